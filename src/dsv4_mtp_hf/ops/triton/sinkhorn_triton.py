"""Triton kernel behind ``dsv4_mtp::sinkhorn`` on CUDA: one program per block of tokens,
each token's n x n matrix kept in registers through all the iterations."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sinkhorn import sinkhorn_op, sinkhorn_reference


@triton.jit
def _sinkhorn_kernel(x_ptr, out_ptr, T, ITERS: tl.constexpr, EPS: tl.constexpr, N: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, N)
    offs = t[:, None, None] * (N * N) + j[None, :, None] * N + j[None, None, :]
    mask = (t < T)[:, None, None] & (offs >= 0)
    c = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.max(c, axis=2)
    e = tl.exp(c - m[:, :, None])
    c = e / tl.sum(e, axis=2)[:, :, None] + EPS  # row softmax + eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + EPS)  # columns
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + EPS)  # rows
        c = c / (tl.sum(c, axis=1)[:, None, :] + EPS)  # columns
    tl.store(out_ptr + offs, c, mask=mask)


def sinkhorn_triton(logits: torch.Tensor, iters: int, eps: float, block_t: int = 32) -> torch.Tensor:
    n = logits.shape[-1]
    x = logits.float().contiguous().view(-1, n, n)
    out = torch.empty_like(x)
    t = x.shape[0]
    if t:
        _sinkhorn_kernel[(triton.cdiv(t, block_t),)](x, out, t, ITERS=iters, EPS=eps, N=n, BLOCK_T=block_t)
    return out.view(logits.shape)


@sinkhorn_op.register_kernel("cuda")
def _sinkhorn_cuda(logits, iters, eps):
    n = logits.shape[-1]
    if logits.dim() < 2 or logits.shape[-2] != n or n & (n - 1) or iters < 1:
        return sinkhorn_reference(logits.float(), iters, eps)  # square, power-of-two n only
    try:
        with torch.cuda.device(logits.device):  # Triton launches on the current device, not the tensor's
            return sinkhorn_triton(logits, iters, eps)
    except Exception as err:
        raise RuntimeError(
            f"dsv4_mtp::sinkhorn: the Triton kernel failed for logits {tuple(logits.shape)} {logits.dtype} on "
            f"{logits.device} (iters={iters}): {type(err).__name__}: {err}. Check the Triton install "
            "(`python -c 'import triton'`, a CUDA toolchain it supports), or run without CUDA kernels on CPU."
        ) from err
