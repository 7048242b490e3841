"""Routing-pair bookkeeping shared by the FP4 MoE kernels.

A pair is one (token, chosen expert) entry of the flattened ``topk_ids``.  Each expert's "leader"
program (the first pair routed to it; the others exit) finds every pair of its expert by an
in-register match over all ``P`` ids (no sort kernel), so each expert's weights stream once per row
tile.  The per-pair outputs ``y [P, D]`` are summed per token in a fixed order (j = 0 .. k-1, fp32),
so the result is deterministic: by ``_sum_kernel`` (one more launch) or inside the down kernels by
``_ticket_sum`` (the token's last pair program per row tile; same order, same bits).
"""

import torch
import triton
import triton.language as tl

from .persistent import persistent_zeros
from .pdl import wait

# NVFP4 folds the decode's 2**-126 into its e4m3 block scale and fp32 global, 2**63 each (exact for
# every e4m3 scale; for E8M0 it would be exact only for exponents 65..191, so MXFP4 does not fold).
TWO63 = tl.constexpr(9.223372036854775808e18)

# Tickets of ``_ticket_sum``: one per (token, down row tile); at least this many are allocated.
SUM_TICKETS_MIN = 32768


def flat_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """``topk_ids [T, k]`` as the kernels' flat ``[P]`` ids (int32 / int64 as they are)."""
    if topk_ids.dtype not in (torch.int32, torch.int64):
        topk_ids = topk_ids.to(torch.int32)
    return topk_ids.contiguous().view(-1)


@triton.jit
def _expert_rows(ids_ptr, pid_p, P, PB: tl.constexpr):
    """Pair ``pid_p``'s expert e, and over all pairs: which match e, their rank among e's pairs, how
    many there are, and how many precede ``pid_p`` (0: this program is e's leader)."""
    offs = tl.arange(0, PB)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
    e = tl.load(ids_ptr + pid_p)
    match = ids == e
    earlier = tl.sum((match & (offs < pid_p)).to(tl.int32), axis=0)
    rank = tl.cumsum(match.to(tl.int32), axis=0) - 1
    count = tl.sum(match.to(tl.int32), axis=0)
    return e.to(tl.int64), offs, match, rank, count, earlier


@triton.jit
def _block_scale(raw, IS_NV: tl.constexpr):
    """Raw scale bytes -> fp32: NVFP4 e4m3 x 2**63 (the fold), MXFP4 E8M0 e -> 2**(e-127) (the fp32
    exponent field is the same byte)."""
    if IS_NV:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * TWO63
    else:
        return (raw.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _pair_of_rank(offs, match, rank, r):
    """Pair index of the expert's rank-r pair (0 where it does not exist)."""
    return tl.sum(tl.where(match & (rank == r), offs, 0), axis=0)


@triton.jit
def _rank_pairs(offs, match, rank, c0):
    """Pair indices of ranks c0 .. c0+7 of this expert (0 where the rank does not exist)."""
    j = tl.arange(0, 8)
    m = match[None, :] & (rank[None, :] == (c0 + j)[:, None])
    return tl.sum(tl.where(m, offs[None, :], 0), axis=1)


@triton.jit
def _pick(v8, idx):
    """v8[idx] for a length-8 vector and per-lane indices."""
    j = tl.arange(0, 8)
    return tl.sum(tl.where(idx[:, None] == j[None, :], v8[None, :], 0), axis=1)


@triton.jit
def _lanes(NW: tl.constexpr):
    """(warp, lane group g, lane q) of every thread: lane = 4 g + q (the mma.sync fragment layout)."""
    t = tl.arange(0, 32 * NW)
    lane = t % 32
    return t // 32, lane // 4, lane % 4


@triton.jit
def _sum_kernel(y_ptr, out_ptr, D: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(y_ptr + (t * TOPK + j).to(tl.int64) * D + n, mask=ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * D + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


SUM_BLOCK = 1024


def launch_sum(y: torch.Tensor, out: torch.Tensor, k: int, pdl_kw: dict) -> None:
    """``out[t] = sum_j y[t k + j]`` as one launch (``_sum_kernel``)."""
    t, d = out.shape
    _sum_kernel[(t, triton.cdiv(d, SUM_BLOCK))](y, out, d, TOPK=k, BLOCK=SUM_BLOCK, num_warps=4, **pdl_kw)


def sum_tickets(device: torch.device, tokens: int, tiles: int) -> torch.Tensor | None:
    """The zeroed int32 tickets of ``_ticket_sum`` for ``tokens`` x ``tiles`` row tiles; None while a
    CUDA graph is captured before any eager call allocated them (the caller then launches
    ``_sum_kernel``).  One buffer per device: the fp4_moe calls that use it must be ordered on one
    stream."""
    return persistent_zeros("fp4_moe_sum_tickets", device, max(tokens * tiles, SUM_TICKETS_MIN), torch.int32)


@triton.jit
def _ticket_sum(y_ptr, out_ptr, tk_ptr, pair, tile, NTILE: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr,
                ROWS: tl.constexpr):
    """After this program stored ``y[pair, tile rows]``: take the (token, tile) ticket; the token's last
    pair to arrive writes ``out[token, tile rows] = sum_j y[token k + j]`` (the order and bits of
    ``_sum_kernel``, whoever arrives last) and resets the ticket to 0 for the next call or replay."""
    tl.debug_barrier()  # every thread's y stores precede the ticket, which releases them at gpu scope
    tok = pair // TOPK
    ticket = tk_ptr + tok * NTILE + tile
    if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == TOPK - 1:
        tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")
        n = tile * ROWS + tl.arange(0, ROWS)
        acc = tl.zeros((ROWS,), dtype=tl.float32)
        for j in tl.static_range(TOPK):  # .cg: the other pairs' rows come from other programs (L2)
            acc += tl.load(y_ptr + (tok * TOPK + j).to(tl.int64) * D + n, cache_modifier=".cg")
        tl.store(out_ptr + tok.to(tl.int64) * D + n, acc.to(out_ptr.dtype.element_ty))
