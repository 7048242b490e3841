"""Triton kernels behind ``dsv4_mtp::skinny_linear`` / ``_cat`` / ``_sum`` on CUDA.

A weight-streaming GEMM for a few rows (M <= 64): the weight is the A operand ("swap AB",
``acc[BLOCK_N, BLOCK_M] += W @ x^T``, rows padded to 16 by masked loads), so the tensor cores
take the few rows for free and the software pipeliner keeps ``num_stages - 1`` weight tiles in
flight.  One program per ``BLOCK_N`` output columns; when N alone cannot fill the GPU, K is
split over ``SPLIT`` programs writing fp32 partials that the last of a tile's programs (by ticket) sums in a
fixed order (``split_tail``; ``_reduce_kernel`` when a graph is captured before the tickets exist).
Two weights sharing the input (``_cat``) are two tile ranges of one launch; grouped ``wo_a``
reads x columns ``[g*K, (g+1)*K)`` for group g; ``_skinny_sum_kernel`` walks ``w0`` then ``w1``
into one accumulator.  Fixed grids, no host sync, fixed summation order: CUDA-graph safe and deterministic.
Launches on one device share the tickets: they must be ordered on one stream.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..skinny_linear import (DTYPES, check_skinny_inputs, check_skinny_sum_inputs, skinny_linear_cat_op,
                             skinny_linear_cat_reference, skinny_linear_op, skinny_linear_reference,
                             skinny_linear_sum_op, skinny_linear_sum_reference)
from . import pdl
from .pdl import wait
from .persistent import persistent_zeros

MAX_KERNEL_ROWS = 64  # beyond this the reference (cuBLAS) runs: a GEMM, not a weight stream
REDUCE_BLOCK = 1024
TICKETS_MIN = 8192  # output tiles a launch may have (a 32768-row weight in 16-row tiles is 2048)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _acc_tile(acc, x_ptr, w_ptr, M, Nw, K, stride_xm, stride_wn, n_tile, x_col0, k_lo, X_DIV: tl.constexpr,
              K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN: tl.constexpr, FP32: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_M] += W[tile rows, k_lo : k_lo + K_SPLIT] @ x[rows // X_DIV, same K]^T``."""
    rn = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < Nw
    mmask = rm < M
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    x_ptrs = x_ptr + (rm // X_DIV)[None, :].to(tl.int64) * stride_xm + (x_col0 + k_lo + rk)[:, None]
    for k in range(0, K_SPLIT, BLOCK_K):
        if EVEN:
            w = tl.load(w_ptrs)
            xt = tl.load(x_ptrs, mask=mmask[None, :], other=0.0)
        else:
            kmask = (k_lo + k + rk) < K
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=mmask[None, :] & kmask[:, None], other=0.0)
        if FP32:  # fp32 data: exact fp32 products, as F.linear
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _store_tile(acc, out_ptr, M, Nw, stride_om, n_tile, col0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rn = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    o_ptrs = out_ptr + rm[None, :].to(tl.int64) * stride_om + (col0 + rn)[:, None]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rm < M)[None, :] & (rn < Nw)[:, None])


@triton.jit
def split_tail(acc, part_ptr, out_ptr, ticket_ptr, tile, M, Nw, stride_om, stride_os, n_tile, col0, SPLIT: tl.constexpr,
               TICKET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile's accumulator out: with one split into ``out``; with several its fp32 partial into ``part_ptr``
    (this split's ``[M, N]`` slice) and, with ``TICKET``, the last split of the tile to arrive (an acq_rel
    ticket, reset after use) sums the tile's partials in split order -- the order of ``_reduce_kernel``, the same
    bits -- into ``out``.  Without tickets a ``_reduce_kernel`` launch sums them."""
    if SPLIT == 1:
        _store_tile(acc, out_ptr, M, Nw, stride_om, n_tile, col0, BLOCK_M, BLOCK_N)
    else:
        _store_tile(acc, part_ptr, M, Nw, stride_om, n_tile, col0, BLOCK_M, BLOCK_N)
        if TICKET:
            tl.debug_barrier()  # every thread's partial stores precede the ticket (released by it)
            if tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                tl.atomic_xchg(ticket_ptr + tile, 0, sem="relaxed", scope="gpu")  # clean for the next launch
                rn = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
                rm = tl.arange(0, BLOCK_M)
                offs = rm[None, :].to(tl.int64) * stride_om + (col0 + rn)[:, None]
                mask = (rm < M)[None, :] & (rn < Nw)[:, None]
                first = part_ptr - tl.program_id(1).to(tl.int64) * stride_os
                total = tl.load(first + offs, mask=mask, other=0.0, cache_modifier=".cg")
                for sp in tl.static_range(1, SPLIT):
                    total += tl.load(first + sp * stride_os + offs, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile(x_ptr, w_ptr, part_ptr, out_ptr, ticket_ptr, tile, M, Nw, K, stride_xm, stride_wn, stride_om, stride_os,
          n_tile, col0, x_col0, k_lo, K_SPLIT: tl.constexpr, SPLIT: tl.constexpr, TICKET: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, FP32: tl.constexpr):
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc = _acc_tile(acc, x_ptr, w_ptr, M, Nw, K, stride_xm, stride_wn, n_tile, x_col0, k_lo, 1, K_SPLIT,
                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN, FP32)
    split_tail(acc, part_ptr, out_ptr, ticket_ptr, tile, M, Nw, stride_om, stride_os, n_tile, col0, SPLIT, TICKET,
               BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _skinny_sum_kernel(x0_ptr, w0_ptr, x1_ptr, w1_ptr, out_ptr, M, N, stride_x0m, stride_w0, stride_x1m,
                       stride_w1, stride_om, K0: tl.constexpr, K1: tl.constexpr, X1_DIV: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                       FP32: tl.constexpr, PDL: tl.constexpr = False):
    """One accumulator over both products: ``x0 w0^T`` along K0, then ``x1[m // X1_DIV] w1^T`` along K1."""
    wait(PDL)
    pid = tl.program_id(0)
    KS0: tl.constexpr = (K0 + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    KS1: tl.constexpr = (K1 + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc = _acc_tile(acc, x0_ptr, w0_ptr, M, N, K0, stride_x0m, stride_w0, pid, 0, 0, 1, KS0,
                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN, FP32)
    acc = _acc_tile(acc, x1_ptr, w1_ptr, M, N, K1, stride_x1m, stride_w1, pid, 0, 0, X1_DIV, KS1,
                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN, FP32)
    _store_tile(acc, out_ptr, M, N, stride_om, pid, 0, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x_ptr, w0_ptr, w1_ptr, part_ptr, out_ptr, ticket_ptr, M, N0, N1, K, stride_xm, stride_w0, stride_w1,
                   stride_om, stride_os, TILES0, N_PER_GROUP, K_SPLIT: tl.constexpr, SPLIT: tl.constexpr,
                   TICKET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN: tl.constexpr, FP32: tl.constexpr, TWO: tl.constexpr, GROUPED: tl.constexpr,
                   PDL: tl.constexpr = False):
    wait(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_lo = pid_k * K_SPLIT
    part_ptr += pid_k.to(tl.int64) * stride_os
    if TWO:
        if pid < TILES0:
            _tile(x_ptr, w0_ptr, part_ptr, out_ptr, ticket_ptr, pid, M, N0, K, stride_xm, stride_w0, stride_om,
                  stride_os, pid, 0, 0, k_lo, K_SPLIT, SPLIT, TICKET, BLOCK_M, BLOCK_N, BLOCK_K, EVEN, FP32)
        else:
            _tile(x_ptr, w1_ptr, part_ptr, out_ptr, ticket_ptr, pid, M, N1, K, stride_xm, stride_w1, stride_om,
                  stride_os, pid - TILES0, N0, 0, k_lo, K_SPLIT, SPLIT, TICKET, BLOCK_M, BLOCK_N, BLOCK_K, EVEN, FP32)
    else:
        x_col0 = 0
        if GROUPED:
            x_col0 = (pid * BLOCK_N // N_PER_GROUP) * K
        _tile(x_ptr, w0_ptr, part_ptr, out_ptr, ticket_ptr, pid, M, N0, K, stride_xm, stride_w0, stride_om, stride_os,
              pid, 0, x_col0, k_lo, K_SPLIT, SPLIT, TICKET, BLOCK_M, BLOCK_N, BLOCK_K, EVEN, FP32)


@triton.jit
def _reduce_kernel(ws_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):  # fixed order: deterministic
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_config(m: int, ns: tuple[int, ...], k: int, groups: int, dtype: torch.dtype, sms: int = 132) -> SkinnyConfig | None:
    """The launch configuration for ``m`` rows, weights of ``ns`` rows and ``k`` columns (None:
    the kernel does not take the shape).  The tallest tile (64 or 32 rows) that still gives about
    one program per SM, each streaming 16-32 KB of weight per pipeline stage; split K only when
    N alone cannot fill the GPU.  Measured back to back in a CUDA graph on the H200
    (``benchmarks/linear_op.py``): one program of 32 rows per SM beats two of 16 on every
    4096-row weight (~13%), and 64-row tiles beat 32 on ``wo_a``."""
    fp32 = dtype == torch.float32
    n_per_group = ns[0] // groups if groups > 1 else 0

    def fits(bn):  # a program's rows stay inside one group
        return groups == 1 or n_per_group % bn == 0

    def tiles(bn):
        return sum(triton.cdiv(n, bn) for n in ns)

    if not fits(16):
        return None
    bn = 32 if fits(32) else 16
    for cand in (64, 32):
        if fits(cand) and tiles(cand) >= 0.9 * sms:
            bn = cand
            break
    # weight tile per stage 8/16/32 KB (bk=256); with the [16, BLOCK_K] x tile, 80/120/160 KB of shared
    # memory for the pipeline.  64-row tiles on short rows (wq_b, K=1024) take 128-wide K blocks.
    bk, stages = {16: (256, 5), 32: (256, 5), 64: (256 if k >= 4096 else 128, 4)}[bn]
    if fp32:
        bk, stages = bk // 2, 3
    bk = max(16, min(bk, triton.next_power_of_2(k)))
    split = 1
    while tiles(bn) * split < 0.9 * sms and k // (2 * split) >= 2 * bk and split < 64:
        split *= 2
    if split > 1:
        k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
        split = triton.cdiv(k, k_split)
    return SkinnyConfig(bn, bk, split, num_warps=4, num_stages=stages)


def skinny_linear_triton(x: torch.Tensor, weights: list[torch.Tensor], groups: int = 1,
                         config: SkinnyConfig | None = None, out: torch.Tensor | None = None,
                         workspace: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, G*K]`` (unit stride along K) times ``weights`` (each ``[N_i, K]``, unit stride along
    K; at most two, and one when ``groups > 1``) -> ``[M, sum N_i]`` in x's dtype.  ``out`` (contiguous
    ``[M, N]``) and the split-K ``workspace`` (fp32, at least ``split*M*N`` elements) may be given
    (tests poison them to check every element is written)."""
    m = x.shape[0]
    k = weights[0].shape[1]
    ns = tuple(w.shape[0] for w in weights)
    n = sum(ns)
    if config is None:
        sms = _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device()) \
            if x.is_cuda else 132
        config = pick_config(m, ns, k, groups, x.dtype, sms)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    bn, bk, split = config.block_n, config.block_k, config.split
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_split)
    even = all(v % bn == 0 for v in ns) and k % k_split == 0 and k_split % bk == 0
    if split == 1:
        target = out
    elif workspace is not None:
        target = workspace.view(-1)[: split * m * n].view(split, m, n)
    else:
        target = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    w0 = weights[0]
    w1 = weights[1] if len(weights) > 1 else w0
    pdl_kw = pdl.launch_args(x.device)
    tiles0 = triton.cdiv(ns[0], bn)
    grid = (sum(triton.cdiv(v, bn) for v in ns), split)
    tickets = split_tickets("skinny_linear_tickets", x.device, grid[0]) if split > 1 else None
    _skinny_kernel[grid](
        x, w0, w1, target, out, tickets if tickets is not None else out, m, ns[0], ns[1] if len(ns) > 1 else 0, k,
        x.stride(0), w0.stride(0), w1.stride(0), n, m * n, tiles0, ns[0] // groups, K_SPLIT=k_split, SPLIT=split,
        TICKET=tickets is not None, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk, EVEN=even,
        FP32=x.dtype == torch.float32, TWO=len(weights) > 1, GROUPED=groups > 1, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl_kw,
    )
    if split > 1 and tickets is None:  # captured before the tickets existed: sum the partials in a second launch
        _reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](target, out, m * n, SPLIT=split, BLOCK=REDUCE_BLOCK,
                                                             num_warps=4, **pdl_kw)
    return out


def split_tickets(name: str, device: torch.device, tiles: int) -> torch.Tensor | None:
    """The split-K tickets of a launch of ``tiles`` output tiles (:func:`split_tail`); None while a graph is
    captured before they exist (the caller then sums in a ``_reduce_kernel`` launch)."""
    return persistent_zeros(name, device, max(tiles, TICKETS_MIN), torch.int32)


def kernel_takes(x: torch.Tensor, weights: list[torch.Tensor], groups: int = 1) -> bool:
    """Shapes, dtypes and layouts the kernel handles (the rest runs the reference)."""
    if x.shape[0] > MAX_KERNEL_ROWS or x.dtype not in DTYPES or len(weights) > 2 or (groups > 1 and len(weights) > 1):
        return False
    if any(w.stride(1) != 1 and w.shape[1] > 1 for w in weights):
        return False
    k = weights[0].shape[1]
    return pick_config(x.shape[0], tuple(w.shape[0] for w in weights), k, groups, x.dtype) is not None


@skinny_linear_op.register_kernel("cuda")
def _skinny_linear_cuda(x, weight, groups=1):
    check_skinny_inputs(x, [weight], groups)
    if not kernel_takes(x, [weight], groups):
        return skinny_linear_reference(x, weight, groups)
    with torch.cuda.device(x.device):  # Triton launches on the current device, not the tensor's
        return skinny_linear_triton(x if x.stride(-1) == 1 else x.contiguous(), [weight], groups)


@skinny_linear_cat_op.register_kernel("cuda")
def _skinny_linear_cat_cuda(x, weights):
    check_skinny_inputs(x, weights)
    if not kernel_takes(x, list(weights)):
        return skinny_linear_cat_reference(x, weights)
    with torch.cuda.device(x.device):
        return skinny_linear_triton(x if x.stride(-1) == 1 else x.contiguous(), list(weights))


def sum_config(m: int, n: int, k0: int, k1: int, dtype: torch.dtype, sms: int = 132) -> SkinnyConfig | None:
    """``pick_config`` for the summed pair over ``K0 + K1``; None (the reference runs) when that
    would split K -- the two products share one accumulator per program."""
    if m > MAX_KERNEL_ROWS or dtype not in DTYPES:
        return None
    cfg = pick_config(m, (n,), k0 + k1, 1, dtype, sms)
    if cfg is None or cfg.split > 1:
        return None
    bk = max(16, min(cfg.block_k, triton.next_power_of_2(min(k0, k1))))
    return SkinnyConfig(cfg.block_n, bk, 1, cfg.num_warps, cfg.num_stages)


def skinny_linear_sum_triton(x0: torch.Tensor, w0: torch.Tensor, x1: torch.Tensor, w1: torch.Tensor,
                             config: SkinnyConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x0 w0^T + x1[m // R] w1^T`` in one launch (inputs validated, unit stride along K)."""
    m, n = x0.shape[0], w0.shape[0]
    k0, k1 = w0.shape[1], w1.shape[1]
    if config is None:
        sms = _sm_count(x0.device.index if x0.device.index is not None else torch.cuda.current_device())
        config = sum_config(m, n, k0, k1, x0.dtype, sms)
        if config is None:
            raise ValueError(f"skinny_linear_sum: no one-launch configuration for M={m}, N={n}, K={k0}+{k1}.")
    if out is None:
        out = torch.empty(m, n, dtype=x0.dtype, device=x0.device)
    if m == 0 or n == 0:
        return out
    bn, bk = config.block_n, config.block_k
    even = n % bn == 0 and k0 % bk == 0 and k1 % bk == 0
    _skinny_sum_kernel[(triton.cdiv(n, bn),)](
        x0, w0, x1, w1, out, m, n, x0.stride(0), w0.stride(0), x1.stride(0), w1.stride(0), n, K0=k0, K1=k1,
        X1_DIV=m // x1.shape[0], BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk, EVEN=even,
        FP32=x0.dtype == torch.float32, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl.launch_args(x0.device),
    )
    return out


@skinny_linear_sum_op.register_kernel("cuda")
def _skinny_linear_sum_cuda(x0, w0, x1, w1):
    check_skinny_sum_inputs(x0, w0, x1, w1)
    layouts_ok = all(t.stride(-1) == 1 or t.shape[-1] <= 1 for t in (w0, w1))
    if not layouts_ok or sum_config(x0.shape[0], w0.shape[0], w0.shape[1], w1.shape[1], x0.dtype) is None:
        return skinny_linear_sum_reference(x0, w0, x1, w1)
    with torch.cuda.device(x0.device):
        return skinny_linear_sum_triton(x0 if x0.stride(-1) == 1 else x0.contiguous(), w0,
                                        x1 if x1.stride(-1) == 1 else x1.contiguous(), w1)
