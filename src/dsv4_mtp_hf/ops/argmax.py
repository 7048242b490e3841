"""Greedy token choice over a large vocabulary, exactly ``torch.argmax(x, -1)``.

One row of 129280 logits reduced by ``torch.argmax`` is a single-block reduction on CUDA
(~37 us at batch 1, a tenth of a whole draft step).  Two faster paths, same indices:

* ``dsv4_mtp::argmax`` (CUDA, ``ops/triton/argmax_triton.py``): one launch, each row split
  over ~128 programs whose partial results the last-arriving program combines.  Under
  ``torch.compile`` + CUDA graphs it replaces the three generated kernels of the path below.
* :func:`argmax_last`'s PyTorch path (CPU, and where the op does not apply): split the row
  into G groups -- group maxima, the first group holding the overall maximum, then the
  first maximum inside that group.  The first maximal element overall lies in the first
  maximal group, so ties (and NaNs, which ``argmax`` treats as maximal) resolve to the same
  index as ``torch.argmax``.

``torch.argmax`` semantics (CPU and CUDA alike): ties go to the first index, any NaN beats
every number (+inf included) and the first NaN wins, -0.0 ties with +0.0.
"""

from __future__ import annotations

import math

import torch

from ._kernels import register_triton_kernels

LIB = "dsv4_mtp"
MIN_SPLIT = 4096  # below this a single reduction is as fast
# Rows the op's kernel takes (more rows fill the GPU with one block per row anyway) and
# dtypes it reads; it compares in fp32.
KERNEL_MAX_ROWS = 256
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_cuda_kernel: list[bool] = []  # [True] once the Triton kernel is registered


def _groups(v: int) -> int:
    """A divisor of ``v`` close to ``sqrt(v)`` (1 when ``v`` has none worth using)."""
    for g in range(math.isqrt(v), 1, -1):
        if v % g == 0:
            return g if g * 8 >= math.isqrt(v) else 1  # e.g. a prime v: one group
    return 1


def argmax_split(x: torch.Tensor, min_split: int = MIN_SPLIT) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` in two stages of plain tensor ops (any device, compiles)."""
    v = x.shape[-1]
    g = _groups(v) if v >= min_split else 1
    if g == 1:
        return x.argmax(dim=-1)
    xg = x.unflatten(-1, (g, v // g))  # [..., G, V/G]
    group = xg.amax(dim=-1).argmax(dim=-1, keepdim=True)  # first group holding the maximum
    rows = xg.gather(-2, group.unsqueeze(-1).expand(*group.shape, v // g)).squeeze(-2)
    return group.squeeze(-1) * (v // g) + rows.argmax(dim=-1)


def kernel_takes(x: torch.Tensor) -> bool:
    """Shapes and dtypes the one-launch kernel handles: rows of a floating tensor with a
    large enough last dim (small rows: one block per row is as fast)."""
    if x.dim() < 1 or x.dtype not in KERNEL_DTYPES or x.shape[-1] < MIN_SPLIT or x.shape[-1] >= 2**31 - 1:
        return False
    rows = x.numel() // x.shape[-1]
    return 1 <= rows <= KERNEL_MAX_ROWS


@torch.library.custom_op(f"{LIB}::argmax", mutates_args=())
def argmax_op(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, -1)`` as an op: int64 ``x.shape[:-1]``.  This registration (any
    device without a faster kernel) is the reference."""
    return torch.argmax(x, dim=-1)


@argmax_op.register_fake
def _(x):
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"dsv4_mtp::argmax reduces a non-empty last dim, got shape {tuple(x.shape)}.")
    return x.new_empty(x.shape[:-1], dtype=torch.long)


def argmax_last(x: torch.Tensor, min_split: int = MIN_SPLIT) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` (same indices, ties to the first): the one-launch op on
    CUDA where its kernel applies, else the two-stage PyTorch path."""
    if x.is_cuda and _cuda_kernel and x.shape[-1] >= min_split and kernel_takes(x):
        return argmax_op(x)
    return argmax_split(x, min_split)


def register_cuda_kernels() -> bool:
    """Register the Triton kernel behind ``dsv4_mtp::argmax`` (on import when CUDA is present)."""
    ok = register_triton_kernels("argmax_triton", "dsv4_mtp::argmax")
    if ok and not _cuda_kernel:
        _cuda_kernel.append(True)
    return ok

if torch.cuda.is_available():
    register_cuda_kernels()
