"""Triton kernels behind ``dsv4_mtp::indexer_topk`` (``ops/indexer.py``): the scores, top-k, the picks.

``_scores_kernel``, grid ``(B * n, E / BLOCK_E)``: a program scores ``BLOCK_E`` entries for one query row,
``sum_h w_h relu(q_h . K_e)`` over the row's heads with fp32 accumulation (bf16 / fp16 inputs on the tensor cores:
their products are exact in fp32; fp32 inputs as IEEE fp32), never rounded through bf16 (the picks are a discrete
choice), with the entries of windows the row has not closed at ``-inf``.  The entries past the row's closed count
are not read.

``_topk_kernel``, grid ``(B * n,)``, writes the contract's picks: a row with at most ``k`` closed entries picks each
of them in order, then ``-1``; a row with more picks its ``k`` best by a radix select over its closed scores only
(four 8-bit passes of a histogram of the order-preserving bit patterns, then one pass that emits the entries
above the threshold and the first ones equal to it), in index order.  So the work follows the context, not the
capacity the graph was captured for (``torch.topk`` scanned every entry of the capacity).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait
from ..indexer import check_indexer_inputs, indexer_topk_op

BLOCK_E = 32
TOPK_BLOCK = 2048  # scores per step of the radix select's passes


@triton.jit
def _scores_kernel(q_ptr, ent_ptr, w_ptr, pos_ptr, out_ptr, n, H, d, E, rate, softmax_scale, weights_scale,
                   sq_r, sq_h, se_b, se_e, sw_r, so_r,
                   HP: tl.constexpr, D: tl.constexpr, BLOCK_E: tl.constexpr, IEEE: tl.constexpr,
                   PDL: tl.constexpr = False):
    wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    b = r // n
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    closed = (tl.load(pos_ptr + r) + 1) // rate
    visible = (e < E) & (e < closed)
    scores = tl.full([BLOCK_E], float("-inf"), dtype=tl.float32)
    if tl.program_id(1) * BLOCK_E < closed:
        h = tl.arange(0, HP)
        hm = h < H
        j = tl.arange(0, D)
        jm = j < d
        q = tl.load(q_ptr + r * sq_r + h[:, None] * sq_h + j[None, :], mask=hm[:, None] & jm[None, :], other=0.0)
        keys = tl.load(ent_ptr + b * se_b + e[:, None].to(tl.int64) * se_e + j[None, :],
                       mask=visible[:, None] & jm[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [HP, BLOCK_E]
        else:  # exact products, fp32 accumulation
            s = tl.dot(q, tl.trans(keys))
        w = tl.load(w_ptr + r * sw_r + h, mask=hm, other=0.0).to(tl.float32) * weights_scale
        s = tl.sum(tl.maximum(s, 0.0) * softmax_scale * w[:, None], axis=0)
        scores = tl.where(visible, s, float("-inf"))
    tl.store(out_ptr + r * so_r + e, scores, mask=e < E)


@triton.jit
def _ordered(x):
    """fp32 -> uint32 whose unsigned order is the floats' order (-inf lowest)."""
    bits = x.to(tl.uint32, bitcast=True)
    flip = tl.where((bits >> 31) != 0, tl.full([], 0xFFFFFFFF, tl.uint32), tl.full([], 0x80000000, tl.uint32))
    return bits ^ flip


@triton.jit
def _topk_kernel(scores_ptr, pos_ptr, out_ptr, E, rate, so_r, K: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    closed = tl.minimum((tl.load(pos_ptr + r) + 1) // rate, E)
    j = tl.arange(0, BLOCK_K)
    out = out_ptr + r * K
    if closed <= K:  # every closed entry, then none
        tl.store(out + j, tl.where(j < closed, j.to(tl.int64), -1), mask=j < K)
    else:
        row = scores_ptr + r * so_r
        e0 = tl.arange(0, BLOCK)
        bins = tl.arange(0, 256)
        prefix = tl.zeros([], dtype=tl.uint32)
        fixed = tl.zeros([], dtype=tl.uint32)  # the bits of the threshold found so far
        need = tl.full([], K, dtype=tl.int32)  # picks still to find among the keys that match the prefix
        for shift in tl.static_range(24, -8, -8):
            hist = tl.zeros([256], dtype=tl.int32)
            for c in range(0, closed, BLOCK):
                e = c + e0
                key = _ordered(tl.load(row + e, mask=e < closed, other=0.0))
                match = (e < closed) & ((key & fixed) == prefix)
                hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=match)
            at_least = tl.cumsum(hist, axis=0, reverse=True)  # keys of this digit or above
            digit = tl.sum((at_least >= need).to(tl.int32), axis=0) - 1  # the digit the k-th best has
            need -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
            prefix |= digit.to(tl.uint32) << shift
            fixed |= tl.full([], 0xFF, dtype=tl.uint32) << shift
        taken = tl.zeros([], dtype=tl.int32)  # emitted so far; `need` of the keys equal to the threshold are taken
        equal_before = tl.zeros([], dtype=tl.int32)
        for c in range(0, closed, BLOCK):
            e = c + e0
            key = _ordered(tl.load(row + e, mask=e < closed, other=0.0))
            valid = e < closed
            equal = valid & (key == prefix)
            rank = tl.cumsum(equal.to(tl.int32), axis=0) - 1 + equal_before
            take = (valid & (key > prefix)) | (equal & (rank < need))
            slot = tl.cumsum(take.to(tl.int32), axis=0) - 1 + taken
            tl.store(out + slot, e.to(tl.int64), mask=take)
            taken += tl.sum(take.to(tl.int32), axis=0)
            equal_before += tl.sum(equal.to(tl.int32), axis=0)


@indexer_topk_op.register_kernel("cuda")
def _indexer_topk_cuda(q, entries, weights, positions, rate, k, softmax_scale, weights_scale):
    check_indexer_inputs(q, entries, weights, positions)
    b, n, h, d = q.shape
    E = entries.shape[1]
    q, weights, positions = q.contiguous(), weights.contiguous(), positions.contiguous()
    entries = entries if entries.stride(-1) == 1 else entries.contiguous()
    ieee = q.dtype == torch.float32 or entries.dtype == torch.float32
    if q.dtype != entries.dtype:
        q, entries = q.float(), entries.float()
    scores = torch.empty(b, n, E, dtype=torch.float32, device=q.device)
    kk = min(k, E)
    picks = torch.empty(b, n, kk, dtype=torch.long, device=q.device)
    if b * n and E:
        with torch.cuda.device(q.device):
            pdl_kw = pdl.launch_args(q.device)
            _scores_kernel[(b * n, triton.cdiv(E, BLOCK_E))](
                q, entries, weights, positions, scores, n, h, d, E, int(rate), float(softmax_scale),
                float(weights_scale), q.stride(1), q.stride(2), entries.stride(0), entries.stride(1), weights.stride(1),
                E, HP=max(16, triton.next_power_of_2(h)), D=max(16, triton.next_power_of_2(d)), BLOCK_E=BLOCK_E,
                IEEE=ieee, num_warps=4, **pdl_kw)
            _topk_kernel[(b * n,)](scores, positions, picks, E, int(rate), E, K=kk,
                                   BLOCK_K=triton.next_power_of_2(kk), BLOCK=TOPK_BLOCK, num_warps=8, **pdl_kw)
    return picks
