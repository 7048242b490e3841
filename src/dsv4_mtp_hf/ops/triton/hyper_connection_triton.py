"""Triton kernels behind ``dsv4_mtp::hc_pre`` / ``hc_post_pre`` / ``hc_head`` on CUDA, two launches:

1. ``_mix_partial_kernel`` grid ``(T, SPLIT)``: the ``[M, n*D]`` fp32 GEMV split along K, each
   program writing its M partial dots and partial sum of squares (the RMS factor).  With ``POST``
   (``hc_post_pre``) a program first forms its slice of the mixed streams (``hc_post``: one stream's
   ``BLOCK_K`` columns from every old stream's), rounds and writes it, and reads the GEMV's input from that.
2. ``_finish_kernel`` grid ``(T, cdiv(D, BLOCK_D))``: each program sums the partials in a fixed
   order, forms ``pre`` (a few flops, recomputed per block instead of a third launch) and collapses
   its slice of D; block 0 alone also forms ``post`` and the Sinkhorn ``comb``.
Fixed grids, no host sync: CUDA-graph safe and deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..hyper_connection import collapse, hc_head_op, hc_head_reference, hc_post, hc_post_pre_op, hc_pre_op, hc_weights
from . import pdl
from .pdl import wait

BLOCK_K = 128  # K columns per GEMV program: 128 programs per token at V4 sizes (n*D = 16384)
MAX_TOKENS = 64  # beyond decode-sized batches a GEMM (the PyTorch path) reads the weights better

# Latency-bound kernels: the warp count (and the finishing block) are picked by timing on the
# first call -- a CUDA graph's warm-up, outside capture.  Every config computes the same thing.
_MIX_CONFIGS = [triton.Config({}, num_warps=w) for w in (1, 2, 4)]
_FINISH_CONFIGS = [triton.Config({"BLOCK_D": b}, num_warps=w) for b, w in ((256, 1), (512, 1), (512, 2), (1024, 4))]


@triton.autotune(configs=_MIX_CONFIGS, key=["K", "M", "SPLIT", "POST"])
@triton.jit
def _mix_partial_kernel(x_ptr, fn_ptr, part_ptr, o_ptr, post_ptr, comb_ptr, new_ptr, K, D, M: tl.constexpr,
                        M_PAD: tl.constexpr, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr, N: tl.constexpr,
                        POST: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    t = tl.program_id(0)
    s = tl.program_id(1)
    k = s * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = k < K
    if POST:  # D % BLOCK_K == 0: the slice is columns d of stream j
        j = s * BLOCK_K // D
        d = k - j * D
        mixed = tl.load(post_ptr + t * N + j).to(tl.float32) * tl.load(o_ptr + t * D + d).to(tl.float32)
        for i in tl.static_range(N):  # hc_post's order: post * o, then each old stream's term
            mixed += (tl.load(comb_ptr + t * N * N + i * N + j).to(tl.float32)
                      * tl.load(x_ptr + t * K + i * D + d).to(tl.float32))
        mixed = mixed.to(new_ptr.dtype.element_ty)
        tl.store(new_ptr + t * K + k, mixed)
        xk = mixed.to(tl.float32)
    else:
        xk = tl.load(x_ptr + t * K + k, mask=kmask, other=0.0).to(tl.float32)
    rows = tl.arange(0, M_PAD)
    w = tl.load(fn_ptr + rows[:, None] * K + k[None, :], mask=(rows < M)[:, None] & kmask[None, :], other=0.0)
    acc = tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
    out = part_ptr + (t * SPLIT + s) * (M_PAD + 1)
    tl.store(out + rows, acc)
    tl.store(out + M_PAD, tl.sum(xk * xk, axis=0))


@triton.autotune(configs=_FINISH_CONFIGS, key=["K", "D", "N", "HEAD"])
@triton.jit
def _finish_kernel(x_ptr, part_ptr, base_ptr, scale_ptr, y_ptr, post_ptr, comb_ptr, K, D,
                   N: tl.constexpr, M_PAD: tl.constexpr, SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr,
                   ITERS: tl.constexpr, HC_EPS: tl.constexpr, RMS_EPS: tl.constexpr, HEAD: tl.constexpr,
                   BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    t = tl.program_id(0)
    db = tl.program_id(1)
    sp = tl.arange(0, SPLIT_PAD)
    spmask = sp < SPLIT
    part = part_ptr + t * SPLIT * (M_PAD + 1) + sp * (M_PAD + 1)  # [SPLIT_PAD] row pointers
    ss = tl.sum(tl.load(part + M_PAD, mask=spmask, other=0.0), axis=0)
    r = 1.0 / tl.sqrt(ss / K + RMS_EPS)
    j = tl.arange(0, N)
    m_pre = tl.sum(tl.load(part[:, None] + j[None, :], mask=spmask[:, None], other=0.0), axis=0) * r
    pre = tl.sigmoid(m_pre * tl.load(scale_ptr).to(tl.float32) + tl.load(base_ptr + j).to(tl.float32)) + HC_EPS
    d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    # x is loaded before block 0's Sinkhorn so that the load's latency overlaps it
    xv = tl.load(x_ptr + t * K + j[:, None] * D + d[None, :], mask=dmask[None, :], other=0.0).to(tl.float32)
    if not HEAD:
        if db == 0:  # the other programs only collapse: they skip post and the Sinkhorn
            m_post = tl.sum(tl.load(part[:, None] + N + j[None, :], mask=spmask[:, None], other=0.0), axis=0) * r
            post = 2.0 * tl.sigmoid(m_post * tl.load(scale_ptr + 1).to(tl.float32)
                                   + tl.load(base_ptr + N + j).to(tl.float32))
            tl.store(post_ptr + t * N + j, post)
            idx = 2 * N + j[:, None] * N + j[None, :]  # comb logits, row-major n x n
            m_c = tl.sum(tl.load(part[:, None, None] + idx[None, :, :], mask=spmask[:, None, None], other=0.0), axis=0)
            c = m_c * r * tl.load(scale_ptr + 2).to(tl.float32) + tl.load(base_ptr + idx).to(tl.float32)
            e = tl.exp(c - tl.max(c, axis=1)[:, None])
            c = e / tl.sum(e, axis=1)[:, None] + HC_EPS  # row softmax + eps
            c = c / (tl.sum(c, axis=0)[None, :] + HC_EPS)  # columns
            for _ in range(ITERS - 1):
                c = c / (tl.sum(c, axis=1)[:, None] + HC_EPS)  # rows
                c = c / (tl.sum(c, axis=0)[None, :] + HC_EPS)  # columns
            tl.store(comb_ptr + t * N * N + j[:, None] * N + j[None, :], c)
    y = tl.sum(pre[:, None] * xv, axis=0)
    tl.store(y_ptr + t * D + d, y.to(y_ptr.dtype.element_ty), mask=dmask)


def _supported(x: torch.Tensor, fn: torch.Tensor, mixes: int) -> bool:
    n = x.shape[-2]
    return (x.dim() >= 2 and n >= 1 and n & (n - 1) == 0 and fn.shape == (mixes, n * x.shape[-1])
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x[..., 0, 0].numel() <= MAX_TOKENS)


def _launch(x, fn, base, scale, iters, hc_eps, rms_eps, head: bool, after=None):
    """``after``: ``(branch_out, post, comb)`` of the previous sub-block, whose ``hc_post`` of ``x`` the GEMV
    reads (``hc_post_pre``); the mixed streams are then returned first."""
    n, d = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    xt = x.reshape(-1, n, d)
    t, k = xt.shape[0], n * d
    m = fn.shape[0]
    m_pad = triton.next_power_of_2(m)
    split = triton.cdiv(k, BLOCK_K)
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)
    post = torch.empty(t, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=x.device)
    mixed = torch.empty_like(xt) if after is not None else xt
    if t:
        part = torch.empty(t, split, m_pad + 1, dtype=torch.float32, device=x.device)
        pdl_kw = pdl.launch_args(x.device)
        o, post_in, comb_in = (a.contiguous() for a in after) if after is not None else (xt, post, comb)
        _mix_partial_kernel[(t, split)](xt, fn.contiguous(), part, o, post_in, comb_in, mixed, k, d,
                                        M=m, M_PAD=m_pad, SPLIT=split, BLOCK_K=BLOCK_K, N=n, POST=after is not None,
                                        **pdl_kw)
        _finish_kernel[lambda meta: (t, triton.cdiv(d, meta["BLOCK_D"]))](
            mixed, part, base.contiguous(), scale.contiguous(), y, post, comb, k, d, N=n, M_PAD=m_pad,
            SPLIT=split, SPLIT_PAD=triton.next_power_of_2(split), ITERS=iters, HC_EPS=hc_eps, RMS_EPS=rms_eps,
            HEAD=head, **pdl_kw)
    out = (y.view(*lead, d), post.view(*lead, n), comb.view(*lead, n, n))
    return out if after is None else (mixed.view(*lead, n, d), *out)


@hc_pre_op.register_kernel("cuda")
def _hc_pre_cuda(x, fn, base, scale, iters, hc_eps, rms_eps):
    n = x.shape[-2]
    if iters < 1 or not _supported(x, fn, (2 + n) * n):  # PyTorch math, Sinkhorn through its own op
        pre, post, comb = hc_weights(x, fn, base, scale, iters, hc_eps, rms_eps)
        return collapse(pre, x), post.float(), comb.float()
    with torch.cuda.device(x.device):  # Triton launches on the current device, not the tensor's
        return _launch(x.contiguous(), fn, base, scale, iters, hc_eps, rms_eps, head=False)


@hc_post_pre_op.register_kernel("cuda")
def _hc_post_pre_cuda(branch_out, streams, post, comb, fn, base, scale, iters, hc_eps, rms_eps):
    n, d = streams.shape[-2:]
    if iters < 1 or d % BLOCK_K or branch_out.dtype != streams.dtype or not _supported(streams, fn, (2 + n) * n):
        mixed = hc_post(branch_out, streams, post, comb)  # PyTorch math, hc_pre through its own op
        return (mixed, *hc_pre_op(mixed, fn, base, scale, iters, hc_eps, rms_eps))
    with torch.cuda.device(streams.device):
        return _launch(streams.contiguous(), fn, base, scale, iters, hc_eps, rms_eps, head=False,
                       after=(branch_out, post, comb))


@hc_head_op.register_kernel("cuda")
def _hc_head_cuda(x, fn, base, scale, hc_eps, rms_eps):
    if not _supported(x, fn, x.shape[-2]):
        return hc_head_reference(x, fn, base, scale, hc_eps, rms_eps)
    with torch.cuda.device(x.device):
        return _launch(x.contiguous(), fn, base, scale, 0, hc_eps, rms_eps, head=True)[0]
