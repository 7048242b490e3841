"""``dsv4_mtp::sinkhorn`` -- the mHC comb matrix: row softmax, then Sinkhorn-Knopp (design §2).

Per token it is a 4x4 problem iterated 20 times: as PyTorch ops that is ~80 tiny kernels
per sub-block, which dominate a CUDA-graph draft step's launch count.  The CUDA
registration (Triton, ``ops/triton/sinkhorn_triton.py``) does it in one kernel with the
matrices in registers; the reference below is the source of truth (CPU, autograd).
"""

from __future__ import annotations

import torch

from ._kernels import register_triton_kernels

LIB = "dsv4_mtp"


def sinkhorn_reference(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, normalise columns, then (iters - 1) x (rows, columns): doubly stochastic."""
    c = logits.softmax(dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


@torch.library.custom_op(f"{LIB}::sinkhorn", mutates_args=())
def sinkhorn_op(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Fallback registration (any device without a faster kernel): the reference math."""
    return sinkhorn_reference(logits.float(), iters, eps)


@sinkhorn_op.register_fake
def _(logits, iters, eps):
    return torch.empty_like(logits, dtype=torch.float32)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """fp32 comb matrices ``[..., n, n]``.  CUDA tensors outside autograd go through the op
    (the fused kernel when registered); everything else runs the reference directly."""
    if logits.is_cuda and not (torch.is_grad_enabled() and logits.requires_grad):
        return sinkhorn_op(logits.float().contiguous(), iters, eps)
    return sinkhorn_reference(logits.float(), iters, eps)


def register_cuda_kernels() -> bool:
    """Register the Triton kernels behind ``dsv4_mtp::sinkhorn`` (on import when CUDA is present)."""
    return register_triton_kernels("sinkhorn_triton", "dsv4_mtp::sinkhorn")

if torch.cuda.is_available():
    register_cuda_kernels()
