"""Routing-pair bookkeeping shared by the FP4 MoE kernels (``fp4_moe_triton``, ``fp4_moe_mma``).

A pair is one (token, chosen expert) entry of the flattened ``topk_ids``; each expert's
"leader" program finds every pair routed to its expert by an in-register match over all
``P`` ids (no sort kernel), and the per-pair outputs are summed per token in a fixed order.
"""

import torch
import triton
import triton.language as tl

from .pdl import wait


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
