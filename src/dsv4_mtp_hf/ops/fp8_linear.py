"""``dsv4_mtp::fp8_linear`` -- a projection whose weight stays as the release stores it (issue 49).

DeepSeek-V4 releases store the attention, indexer-query and shared-expert projections as FP8 e4m3 with one
power-of-two (E8M0) scale per 128x128 block.  transformers either widens them to bf16 at
load (twice the bytes a decode step reads) or runs them W8A8 through its FineGrainedFP8 kernels, which
quantise the activations per token on every call.  This op is W8A16: the weight is widened in registers,
the activations stay in their dtype.  An e4m3 value times a power of two is exact in bf16, so the op
computes what transformers' dequantised bf16 model computes -- ``F.linear(x, dequantised weight)`` -- up
to summation order, at half its weight bytes.

* ``fp8_linear(x [M, G*K], weight [N, K] float8_e4m3fn, scale [ceil(N/128), ceil(K/128)] float32,
  groups=G) -> [M, N]`` in x's dtype; ``G > 1`` is the grouped projection of ``skinny_linear`` (``wo_a``:
  group g reads x columns ``[g*K, (g+1)*K)`` and writes output columns ``[g*N/G, (g+1)*N/G)``).
* ``fp8_linear_cat(x [M, K], [w_0, w_1], [s_0, s_1]) -> [M, N_0 + N_1]``: the projections that read the same
  input (``q_a`` and ``kv``, ``q_b`` and the indexer's ``q_b``, the shared expert's gate and up) in one weight
  stream -- each output element is the same dot product as ``fp8_linear``'s.

The reference below is the source of truth (CPU and tests).  The CUDA registration
(``ops/triton/fp8_linear_triton.py``) streams the FP8 weight once for up to 64 rows and runs the reference
beyond (a prompt: dequantise, then one GEMM).
"""

from __future__ import annotations

import torch

from ..fp8 import dequantize_fp8_block, fp8_scale_shape
from ._kernels import register_triton_kernels
from .skinny_linear import skinny_linear_reference

LIB = "dsv4_mtp"
BLOCK = 128  # the release's scale block, both ways
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # activation dtypes


def check_fp8_linear_inputs(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int = 1) -> None:
    """Raise ``ValueError`` / ``TypeError`` naming what the op does not define."""
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"fp8_linear: groups must be a positive int, got {groups!r}")
    if x.dim() != 2 or weight.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"fp8_linear: x [M, G*K], weight [N, K] and scale [N/128, K/128] must be 2-D, got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(scale.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"fp8_linear: x must be one of {DTYPES}, got {x.dtype}")
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_linear: weight must be float8_e4m3fn, got {weight.dtype}")
    if scale.dtype != torch.float32:
        raise TypeError(f"fp8_linear: scale must be float32 (convert E8M0 scales with .float()), got {scale.dtype}")
    n, k = weight.shape
    if tuple(scale.shape) != fp8_scale_shape((n, k), BLOCK):
        raise ValueError(f"fp8_linear: weight {tuple(weight.shape)} needs a scale of shape {fp8_scale_shape((n, k))} "
                         f"(one per {BLOCK}x{BLOCK} block), got {tuple(scale.shape)}")
    if len({x.device, weight.device, scale.device}) != 1:
        raise ValueError(f"fp8_linear: x, weight and scale must be on one device, got {x.device}, {weight.device}, "
                         f"{scale.device}")
    if n % groups or x.shape[1] != groups * k:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} does not match weight {tuple(weight.shape)} in "
                         f"{groups} group(s)")


def check_fp8_linear_cat_inputs(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor]) -> None:
    """``fp8_linear_inputs`` for each weight, which must all read x's K columns."""
    if not weights or len(weights) != len(scales):
        raise ValueError(f"fp8_linear_cat: one scale per weight and at least one weight, got {len(weights)} weight(s) "
                         f"and {len(scales)} scale(s)")
    for weight, scale in zip(weights, scales):
        check_fp8_linear_inputs(x, weight, scale)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """``F.linear`` (grouped: ``skinny_linear``'s einsum) of x with the dequantised weight in x's dtype."""
    return skinny_linear_reference(x, dequantize_fp8_block(weight, scale, x.dtype), groups)


def fp8_linear_cat_reference(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor]) -> torch.Tensor:
    """One :func:`fp8_linear_reference` per weight, concatenated along the output columns."""
    return torch.cat([fp8_linear_reference(x, w, s) for w, s in zip(weights, scales)], dim=-1)


@torch.library.custom_op(f"{LIB}::fp8_linear", mutates_args=())
def fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Registration for every device without a faster kernel: the reference math."""
    check_fp8_linear_inputs(x, weight, scale, groups)
    return fp8_linear_reference(x, weight, scale, groups)


@fp8_linear_op.register_fake
def _(x, weight, scale, groups=1):
    check_fp8_linear_inputs(x, weight, scale, groups)
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op(f"{LIB}::fp8_linear_cat", mutates_args=())
def fp8_linear_cat_op(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor]) -> torch.Tensor:
    """Registration for every device without a faster kernel: the reference math."""
    check_fp8_linear_cat_inputs(x, weights, scales)
    return fp8_linear_cat_reference(x, weights, scales)


@fp8_linear_cat_op.register_fake
def _(x, weights, scales):
    check_fp8_linear_cat_inputs(x, weights, scales)
    return x.new_empty(x.shape[0], sum(w.shape[0] for w in weights))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """``x [..., G*K]`` -> ``[..., N]`` through ``dsv4_mtp::fp8_linear`` (any leading dims)."""
    lead = x.shape[:-1]
    out = fp8_linear_op(x.reshape(-1, x.shape[-1]), weight, scale, groups)
    return out.view(*lead, weight.shape[0])


def fp8_linear_cat(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``x [..., K]`` through each FP8 weight with its scales -> one ``[..., N_i]`` per weight, from one
    ``dsv4_mtp::fp8_linear_cat`` (one launch on CUDA for one or two weights)."""
    lead = x.shape[:-1]
    out = fp8_linear_cat_op(x.reshape(-1, x.shape[-1]), list(weights), list(scales))
    return tuple(y.view(*lead, y.shape[-1]) for y in out.split([w.shape[0] for w in weights], dim=-1))


def register_cuda_kernels() -> bool:
    """Register the Triton kernels behind ``dsv4_mtp::fp8_linear(_cat)`` (on import when CUDA is present)."""
    return register_triton_kernels("fp8_linear_triton", "dsv4_mtp::fp8_linear")


if torch.cuda.is_available():
    register_cuda_kernels()
