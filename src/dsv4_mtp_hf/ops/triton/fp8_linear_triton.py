"""Triton kernel behind ``dsv4_mtp::fp8_linear`` on CUDA: a W8A16 weight stream for a few rows.

The layout of ``skinny_linear_triton`` ("swap AB": ``acc[BLOCK_N, BLOCK_M] += W @ x^T``, rows padded to 16
by masked loads, one program per ``BLOCK_N`` output columns, K split over programs when N alone cannot fill
the GPU, the last of a tile's programs summing the partials in a fixed order: ``split_tail``).  The weight tile is FP8: it is widened to x's dtype in
registers (exact: e4m3 values fit bf16), multiplied in a fresh accumulator per 128-column K block and added
times that block's scale.  ``BLOCK_N`` divides 128 and tiles start at multiples of it, so a tile lies in
one scale row and every K step reads one scale.  Fixed grids, no host sync: CUDA-graph safe, deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..fp8_linear import (BLOCK, check_fp8_linear_cat_inputs, check_fp8_linear_inputs, fp8_linear_cat_op,
                          fp8_linear_cat_reference, fp8_linear_op, fp8_linear_reference)
from . import pdl
from .pdl import wait
from .skinny_linear_triton import REDUCE_BLOCK, _reduce_kernel, _sm_count, split_tail, split_tickets

MAX_KERNEL_ROWS = 64  # beyond this the reference runs: a GEMM on the dequantised weight
KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # fp32 activations run the reference


@dataclass(frozen=True)
class Fp8Config:
    block_n: int
    split: int = 1
    block_k: int = BLOCK
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _fp8_tile(x_ptr, w_ptr, s_ptr, part_ptr, out_ptr, ticket_ptr, tile, M, Nw, K, stride_xm, stride_wn, stride_sn,
              stride_om, stride_os, n_tile, col0, x_col0, k_lo, K_SPLIT: tl.constexpr, SPLIT: tl.constexpr,
              TICKET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SCALE_BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """Output columns ``col0 + [n_tile * BLOCK_N, +BLOCK_N)`` of one weight ``[Nw, K]``, over K columns
    ``[k_lo, k_lo + K_SPLIT)``; a tile lies in one scale row (BLOCK_N divides SCALE_BLOCK)."""
    rn = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < Nw
    mmask = rm < M
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    x_ptrs = x_ptr + rm[None, :].to(tl.int64) * stride_xm + (x_col0 + k_lo + rk)[:, None]
    s_row = s_ptr + (n_tile * BLOCK_N // SCALE_BLOCK).to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K_SPLIT, BLOCK_K):
        if EVEN:
            w = tl.load(w_ptrs)
            xt = tl.load(x_ptrs, mask=mmask[None, :], other=0.0)
            s = tl.load(s_row + (k_lo + k) // SCALE_BLOCK)
        else:
            kmask = (k_lo + k + rk) < K
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=mmask[None, :] & kmask[:, None], other=0.0)
            s = tl.load(s_row + (k_lo + k) // SCALE_BLOCK, mask=(k_lo + k) < K, other=0.0)
        acc += tl.dot(w.to(xt.dtype), xt) * s
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    split_tail(acc, part_ptr, out_ptr, ticket_ptr, tile, M, Nw, stride_om, stride_os, n_tile, col0, SPLIT, TICKET,
               BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _fp8_linear_kernel(x_ptr, w0_ptr, s0_ptr, w1_ptr, s1_ptr, part_ptr, out_ptr, ticket_ptr, M, N0, N1, K, stride_xm,
                       stride_w0, stride_s0, stride_w1, stride_s1, stride_om, stride_os, TILES0, N_PER_GROUP,
                       K_SPLIT: tl.constexpr, SPLIT: tl.constexpr, TICKET: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr, EVEN: tl.constexpr,
                       TWO: tl.constexpr, GROUPED: tl.constexpr, PDL: tl.constexpr = False):
    """Programs ``[0, TILES0)`` write weight 0's columns; with ``TWO`` the rest write weight 1's after them."""
    wait(PDL)
    pid = tl.program_id(0)
    k_lo = tl.program_id(1) * K_SPLIT
    part_ptr += tl.program_id(1).to(tl.int64) * stride_os
    if TWO:
        if pid < TILES0:
            _fp8_tile(x_ptr, w0_ptr, s0_ptr, part_ptr, out_ptr, ticket_ptr, pid, M, N0, K, stride_xm, stride_w0,
                      stride_s0, stride_om, stride_os, pid, 0, 0, k_lo, K_SPLIT, SPLIT, TICKET, BLOCK_M, BLOCK_N,
                      BLOCK_K, SCALE_BLOCK, EVEN)
        else:
            _fp8_tile(x_ptr, w1_ptr, s1_ptr, part_ptr, out_ptr, ticket_ptr, pid, M, N1, K, stride_xm, stride_w1,
                      stride_s1, stride_om, stride_os, pid - TILES0, N0, 0, k_lo, K_SPLIT, SPLIT, TICKET, BLOCK_M,
                      BLOCK_N, BLOCK_K, SCALE_BLOCK, EVEN)
    else:
        x_col0 = 0
        if GROUPED:
            x_col0 = (pid * BLOCK_N // N_PER_GROUP) * K
        _fp8_tile(x_ptr, w0_ptr, s0_ptr, part_ptr, out_ptr, ticket_ptr, pid, M, N0, K, stride_xm, stride_w0,
                  stride_s0, stride_om, stride_os, pid, 0, x_col0, k_lo, K_SPLIT, SPLIT, TICKET, BLOCK_M, BLOCK_N,
                  BLOCK_K, SCALE_BLOCK, EVEN)


def pick_config(m: int, ns: tuple[int, ...], k: int, groups: int, sms: int = 132) -> Fp8Config | None:
    """For weights of ``ns`` rows read together: the tallest tile (64, 32 or 16 rows, each dividing 128 and the
    group) that still gives about one program per SM; K is then split (in whole 128-column blocks) until there
    are about two programs per SM: the FP8 stream needs more loads in flight than one program a SM keeps
    (BENCHMARKS.md, FP8 projections; K steps of 256-512 columns and deeper pipelines were slower).  None: the
    kernel does not take the shape."""
    per_group = ns[0] // groups

    def fits(bn):
        return groups == 1 or per_group % bn == 0

    def tiles(bn):
        return sum(triton.cdiv(n, bn) for n in ns)

    candidates = [bn for bn in (64, 32, 16) if fits(bn)]
    if not candidates or m > MAX_KERNEL_ROWS or len(ns) > 2 or (groups > 1 and len(ns) > 1):
        return None
    bn = next((c for c in candidates if tiles(c) >= 0.9 * sms), candidates[-1])
    bk = BLOCK if k >= BLOCK else max(16, triton.next_power_of_2(k))
    blocks = triton.cdiv(k, BLOCK)
    split = 1
    while tiles(bn) * split < 1.9 * sms and blocks // (2 * split) >= 2 and split < 64:
        split *= 2
    return Fp8Config(bn, split, bk, num_warps=4, num_stages=6 if bn <= 32 else 4)


def fp8_linear_triton(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor], groups: int = 1,
                      config: Fp8Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, G*K]`` (unit stride along K) times the FP8 ``weights`` (one, or two read together, each
    ``[N_i, K]``) with their block ``scales`` -> ``[M, sum N_i]``."""
    m, k = x.shape[0], weights[0].shape[1]
    ns = tuple(w.shape[0] for w in weights)
    n = sum(ns)
    if config is None:
        config = pick_config(m, ns, k, groups, _sm_count(x.device.index if x.device.index is not None
                                                         else torch.cuda.current_device()))
        if config is None:
            raise ValueError(f"fp8_linear: no kernel configuration for M={m}, N={ns}, K={k}, groups={groups}.")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    bn, bk = config.block_n, config.block_k
    if bk > BLOCK:
        raise ValueError(f"fp8_linear: a K step reads one scale, so it spans at most {BLOCK} columns; got {bk}.")
    blocks = triton.cdiv(k, BLOCK)
    k_split = triton.cdiv(blocks, config.split) * BLOCK  # whole scale blocks per split
    split = triton.cdiv(k, k_split)
    even = all(v % bn == 0 for v in ns) and k % k_split == 0 and k_split % bk == 0
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    (w0, s0), (w1, s1) = (weights[0], scales[0]), (weights[-1], scales[-1])
    tiles0 = triton.cdiv(ns[0], bn)
    grid = (sum(triton.cdiv(v, bn) for v in ns), split)
    tickets = split_tickets("fp8_linear_tickets", x.device, grid[0]) if split > 1 else None
    pdl_kw = pdl.launch_args(x.device)
    _fp8_linear_kernel[grid](
        x, w0, s0, w1, s1, target, out, tickets if tickets is not None else out, m, ns[0], ns[-1], k, x.stride(0),
        w0.stride(0), s0.stride(0), w1.stride(0), s1.stride(0), n, m * n, tiles0, ns[0] // groups, K_SPLIT=k_split,
        SPLIT=split, TICKET=tickets is not None, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk,
        SCALE_BLOCK=BLOCK, EVEN=even, TWO=len(weights) > 1, GROUPED=groups > 1, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl_kw,
    )
    if split > 1 and tickets is None:  # captured before the tickets existed: sum the partials in a second launch
        _reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](target, out, m * n, SPLIT=split, BLOCK=REDUCE_BLOCK,
                                                             num_warps=4, **pdl_kw)
    return out


def kernel_takes(x: torch.Tensor, weights: list[torch.Tensor], groups: int = 1) -> bool:
    """Rows, dtypes and layouts the kernel handles; the rest runs the reference (a prompt's GEMM)."""
    if x.dtype not in KERNEL_DTYPES or any(w.stride(1) != 1 for w in weights) or weights[0].shape[1] < 16:
        return False
    return pick_config(x.shape[0], tuple(w.shape[0] for w in weights), weights[0].shape[1], groups) is not None


@fp8_linear_op.register_kernel("cuda")
def _fp8_linear_cuda(x, weight, scale, groups=1):
    check_fp8_linear_inputs(x, weight, scale, groups)
    if not kernel_takes(x, [weight], groups):
        return fp8_linear_reference(x, weight, scale, groups)
    with torch.cuda.device(x.device):  # Triton launches on the current device, not the tensor's
        return fp8_linear_triton(x if x.stride(-1) == 1 else x.contiguous(), [weight], [scale.contiguous()], groups)


@fp8_linear_cat_op.register_kernel("cuda")
def _fp8_linear_cat_cuda(x, weights, scales):
    check_fp8_linear_cat_inputs(x, weights, scales)
    if len(weights) > 2 or not kernel_takes(x, list(weights)):
        return fp8_linear_cat_reference(x, weights, scales)
    with torch.cuda.device(x.device):
        return fp8_linear_triton(x if x.stride(-1) == 1 else x.contiguous(), list(weights),
                                 [s.contiguous() for s in scales])
