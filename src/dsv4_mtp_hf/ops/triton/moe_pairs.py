"""Routing-pair bookkeeping shared by the FP4 MoE kernels (``fp4_moe_triton``, ``fp4_moe_mma``).

A pair is one (token, chosen expert) entry of the flattened ``topk_ids``; each expert's
"leader" program finds every pair routed to its expert by an in-register match over all
``P`` ids (no sort kernel), and the per-pair outputs are summed per token in a fixed order:
by ``_sum_kernel`` (one more launch), or inside the down kernels by ``_ticket_sum`` (the last
of a token's ``k`` pair programs to finish a row tile sums it; same order, same bits).
"""

import torch
import triton
import triton.language as tl

from .persistent import persistent_zeros
from .pdl import wait

# Tickets of ``_ticket_sum``: one per (token, down row tile), at least this many (the caller asks for one per
# token and row: 4096 at T=1 for V4-Flash, 458752 at T=64 for V4-Pro).
SUM_TICKETS_MIN = 32768


def merged_config(base: dict, cfg: dict | None) -> dict:
    """A kernel family's launch configuration: ``base`` with ``cfg``'s keys over it, the per-kernel
    "gate_up" / "down" dicts merged key by key."""
    cfg = cfg or {}
    out = {**base, **cfg}
    for kind in ("gate_up", "down"):
        out[kind] = {**base[kind], **(cfg.get(kind) or {})}
    return out


def flat_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """``topk_ids [T, k]`` (integers, checked by ``check_fp4_moe_inputs``) as the kernels' flat
    ``[P]`` ids: int32 and int64 as they are (the router's int64 ids cost no conversion
    kernel), other integer types converted."""
    if topk_ids.dtype not in (torch.int32, torch.int64):
        topk_ids = topk_ids.to(torch.int32)
    return topk_ids.contiguous().view(-1)


@triton.jit
def _expert_rows(ids_ptr, pid_p, P, PB: tl.constexpr):
    offs = tl.arange(0, PB)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
    e = tl.load(ids_ptr + pid_p)
    match = ids == e
    earlier = tl.sum((match & (offs < pid_p)).to(tl.int32), axis=0)
    rank = tl.cumsum(match.to(tl.int32), axis=0) - 1
    count = tl.sum(match.to(tl.int32), axis=0)
    return e.to(tl.int64), offs, match, rank, count, earlier


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


def sum_tickets(device: torch.device, tokens: int, tiles: int) -> torch.Tensor | None:
    """The zeroed int32 tickets of ``_ticket_sum`` for ``tokens`` x ``tiles`` row tiles; None while a
    CUDA graph is captured before any eager call allocated them (the caller then launches
    ``_sum_kernel``).  One buffer per device: fp4_moe calls that use it must be ordered on one
    stream (as the window attention's tickets)."""
    return persistent_zeros("fp4_moe_sum_tickets", device, max(tokens * tiles, SUM_TICKETS_MIN), torch.int32)


@triton.jit
def _ticket_sum(y_ptr, out_ptr, tk_ptr, pair, tile, NTILE: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr,
                ROWS: tl.constexpr):
    """After this program stored ``y[pair, tile * ROWS : (tile + 1) * ROWS]``: take the (token, tile)
    ticket; the token's last pair to arrive writes ``out[token, tile rows] = sum_j y[token k + j]``
    (j = 0 .. k-1, fp32, as ``_sum_kernel``: the same bits whoever arrives last) and resets the ticket
    to 0 for the next call or graph replay.  Every pair of a token takes its ticket exactly once, so
    ``TOPK`` arrivals per (token, tile)."""
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
