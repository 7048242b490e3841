"""Triton kernels behind ``dsv4_mtp::moe_route`` and ``dsv4_mtp::hash_route`` on CUDA (decode-sized batches).

``_scores_kernel`` grid ``(T, cdiv(E, BLOCK_E))``: ``BLOCK_E`` bf16 gate rows per program, fp32
dots, ``sqrt(softplus(.))`` into an fp32 ``[T, E]`` workspace; the token's last-arriving program
(an acq_rel ticket) then takes the top-k of ``score + bias`` (``_topk_row``: k rounds of max /
lowest index / mask; weights from the unbiased scores, renormalised, scaled), or with ``HASH`` the
experts of the token id's ``tid2eid`` row and their scores, renormalised and scaled (``_hash_row``).  A graph
captured before any eager call allocated the tickets runs ``_finish_kernel`` as a second launch (same bits).
Fixed grids, no host sync, deterministic; more than ``MAX_TOKENS`` rows run the reference's GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..moe_route import check_hash_route_inputs, hash_route_op, hash_route_reference, moe_route_op, moe_route_reference
from . import pdl
from .pdl import wait
from .persistent import persistent_zeros

MAX_TOKENS = 64
BLOCK_E = 2  # gate rows per program: 128 programs per token for 256 experts


@triton.jit
def _topk_row(s_ptr, bias_ptr, w_ptr, id_ptr, t, E, SCALING: tl.constexpr, NORMALIZE: tl.constexpr,
              TOP_K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, CG: tl.constexpr):
    """Token t's top-k of ``score + bias`` from the fp32 scores row (``.cg`` when other programs of this
    launch wrote it): k rounds of max / lowest index among the maxima / mask, weights from the unbiased
    scores, renormalised and scaled."""
    e = tl.arange(0, E_PAD)
    emask = e < E
    if CG:
        s = tl.load(s_ptr + t * E + e, mask=emask, other=0.0, cache_modifier=".cg")
    else:
        s = tl.load(s_ptr + t * E + e, mask=emask, other=0.0)
    sel = tl.where(emask, s + tl.load(bias_ptr + e, mask=emask, other=0.0).to(tl.float32), float("-inf"))
    slot = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    ws = tl.zeros([K_PAD], dtype=tl.float32)
    tot = 0.0
    for i in tl.static_range(TOP_K):
        m = tl.max(sel, axis=0)
        idx = tl.minimum(tl.min(tl.where(sel == m, e, E_PAD), axis=0), E - 1)  # a NaN row stays in range
        ids = tl.where(slot == i, idx, ids)
        v = tl.sum(tl.where(e == idx, s, 0.0), axis=0)  # one nonzero term: exact in any layout
        ws = tl.where(slot == i, v, ws)
        tot += v  # in pick order, a scalar: the same bits in the 1-warp and the 4-warp program
        sel = tl.where(e == idx, float("-inf"), sel)
    if NORMALIZE:
        ws = ws / tot
    kmask = slot < TOP_K
    tl.store(w_ptr + t * TOP_K + slot, ws * SCALING, mask=kmask)
    tl.store(id_ptr + t * TOP_K + slot, ids.to(tl.int64), mask=kmask)


@triton.jit
def _hash_row(s_ptr, tid_ptr, tok_ptr, w_ptr, id_ptr, t, E, stride_tid, SCALING: tl.constexpr, TOP_K: tl.constexpr,
              K_PAD: tl.constexpr, CG: tl.constexpr):
    """Token t's experts: its id's ``tid2eid`` row; weights its scores there over their sum (+1e-20), scaled."""
    slot = tl.arange(0, K_PAD)
    kmask = slot < TOP_K
    tok = tl.load(tok_ptr + t).to(tl.int64)
    ids = tl.load(tid_ptr + tok * stride_tid + slot, mask=kmask, other=0).to(tl.int64)
    if CG:
        v = tl.load(s_ptr + t * E + ids, mask=kmask, other=0.0, cache_modifier=".cg")
    else:
        v = tl.load(s_ptr + t * E + ids, mask=kmask, other=0.0)
    ws = v / (tl.sum(v, axis=0) + 1e-20) * SCALING
    tl.store(w_ptr + t * TOP_K + slot, ws, mask=kmask)
    tl.store(id_ptr + t * TOP_K + slot, ids, mask=kmask)


@triton.jit
def _scores_kernel(h_ptr, w_ptr, s_ptr, bias_ptr, rw_ptr, id_ptr, tk_ptr, tid_ptr, tok_ptr, E, stride_tid,
                   D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SCALING: tl.constexpr,
                   NORMALIZE: tl.constexpr, TOP_K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                   TICKET: tl.constexpr, HASH: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    t = tl.program_id(0)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < E
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < D
        hk = tl.load(h_ptr + t * D + k, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None] * D + k[None, :], mask=emask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * hk[None, :], axis=1)
    # softplus as torch computes it (identity above 20), log1p without cancellation
    u = tl.exp(-tl.abs(acc))
    log1p_u = tl.where(u < 1e-3, u * (1.0 - u * (0.5 - u / 3.0)), tl.log(1.0 + u))
    sp = tl.where(acc > 20.0, acc, tl.maximum(acc, 0.0) + log1p_u)
    tl.store(s_ptr + t * E + e, tl.sqrt(sp), mask=emask)
    if TICKET:  # the token's last program to finish picks its experts (one launch fewer) and resets the ticket
        tl.debug_barrier()  # every thread's score stores precede the ticket, which releases them at gpu scope
        if tl.atomic_add(tk_ptr + t, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
            tl.atomic_xchg(tk_ptr + t, 0, sem="relaxed", scope="gpu")
            if HASH:
                _hash_row(s_ptr, tid_ptr, tok_ptr, rw_ptr, id_ptr, t, E, stride_tid, SCALING, TOP_K, K_PAD, True)
            else:
                _topk_row(s_ptr, bias_ptr, rw_ptr, id_ptr, t, E, SCALING, NORMALIZE, TOP_K, E_PAD, K_PAD, True)


@triton.jit
def _finish_kernel(s_ptr, bias_ptr, w_ptr, id_ptr, tid_ptr, tok_ptr, E, stride_tid, SCALING: tl.constexpr,
                   NORMALIZE: tl.constexpr, TOP_K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                   HASH: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    if HASH:
        _hash_row(s_ptr, tid_ptr, tok_ptr, w_ptr, id_ptr, tl.program_id(0), E, stride_tid, SCALING, TOP_K, K_PAD,
                  False)
    else:
        _topk_row(s_ptr, bias_ptr, w_ptr, id_ptr, tl.program_id(0), E, SCALING, NORMALIZE, TOP_K, E_PAD, K_PAD, False)


def moe_route_triton(h, weight, bias, top_k: int, scaling: float, normalize: bool, tid2eid=None, input_ids=None):
    """Scores and the experts in one launch: picked by the token's last scores program (tickets from
    ``persistent_zeros``; a separate launch while a graph is captured before any eager call allocated them).
    ``tid2eid`` and ``input_ids``: hash routing (``bias`` and ``normalize`` unused)."""
    t, d = h.shape
    e = weight.shape[0]
    hashed = tid2eid is not None
    scores = torch.empty(t, e, dtype=torch.float32, device=h.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=h.device)
    ids = torch.empty(t, top_k, dtype=torch.long, device=h.device)
    if t:
        pdl_kw = pdl.launch_args(h.device)
        pick_kw = dict(SCALING=float(scaling), NORMALIZE=bool(normalize), TOP_K=top_k, E_PAD=triton.next_power_of_2(e),
                       K_PAD=triton.next_power_of_2(top_k), HASH=hashed)
        table = (tid2eid, input_ids, tid2eid.stride(0)) if hashed else (ids, ids, 0)
        bias = bias if bias is not None else scores
        tickets = persistent_zeros("moe_route_tickets", h.device, max(t, MAX_TOKENS), torch.int32)
        _scores_kernel[(t, triton.cdiv(e, BLOCK_E))](h, weight, scores, bias, weights, ids,
                                                      tickets if tickets is not None else ids, *table[:2], e, table[2],
                                                      D=d, BLOCK_E=BLOCK_E, BLOCK_K=min(triton.next_power_of_2(d), 4096),
                                                      TICKET=tickets is not None, num_warps=4, **pick_kw, **pdl_kw)
        if tickets is None:
            _finish_kernel[(t,)](scores, bias, weights, ids, *table[:2], e, table[2], num_warps=1, **pick_kw, **pdl_kw)
    return weights, ids


def _kernel_takes(h, weight, top_k) -> bool:
    t, d = h.shape
    e = weight.shape[0]
    return (t <= MAX_TOKENS and 1 <= top_k <= e and e <= 4096 and weight.shape[1] == d
            and h.dtype in (torch.float32, torch.bfloat16, torch.float16))


@moe_route_op.register_kernel("cuda")
def _moe_route_cuda(h, weight, bias, top_k, scaling, normalize):
    if not _kernel_takes(h, weight, top_k):
        return moe_route_reference(h, weight, bias, top_k, scaling, normalize)
    with torch.cuda.device(h.device):  # Triton launches on the current device, not the tensor's
        return moe_route_triton(h.contiguous(), weight.contiguous(), bias.contiguous(), top_k, scaling,  # bias: any float
                                normalize)


@hash_route_op.register_kernel("cuda")
def _hash_route_cuda(h, weight, tid2eid, input_ids, scaling):
    check_hash_route_inputs(h, weight, tid2eid, input_ids)
    if not _kernel_takes(h, weight, tid2eid.shape[1]) or tid2eid.stride(1) != 1:
        return hash_route_reference(h, weight, tid2eid, input_ids, scaling)
    with torch.cuda.device(h.device):
        return moe_route_triton(h.contiguous(), weight.contiguous(), None, tid2eid.shape[1], scaling, False,
                                tid2eid, input_ids.contiguous())
