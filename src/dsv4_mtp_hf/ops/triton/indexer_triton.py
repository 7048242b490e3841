"""Triton kernel behind ``dsv4_mtp::indexer_topk`` (``ops/indexer.py``): the scores in one launch, then top-k.

``_scores_kernel``, grid ``(B * n, E / BLOCK_E)``: a program scores ``BLOCK_E`` entries for one query row,
``sum_h w_h relu(q_h . K_e)`` over the row's heads in fp32 (the reference's precision: the picks are a discrete
choice, so the scores are not rounded through bf16), with the entries of windows the row has not closed at
``-inf``.  The entries past the row's closed count are not read.  ``torch.topk`` then picks (one more launch),
and picks of masked entries become ``-1`` (one more).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait
from ..indexer import check_indexer_inputs, indexer_topk_op

BLOCK_E = 32


@triton.jit
def _scores_kernel(q_ptr, ent_ptr, w_ptr, pos_ptr, out_ptr, n, H, d, E, rate, softmax_scale, weights_scale,
                   sq_r, sq_h, se_b, se_e, sw_r, so_r,
                   HP: tl.constexpr, D: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
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
        q = tl.load(q_ptr + r * sq_r + h[:, None] * sq_h + j[None, :], mask=hm[:, None] & jm[None, :],
                    other=0.0).to(tl.float32)
        keys = tl.load(ent_ptr + b * se_b + e[:, None].to(tl.int64) * se_e + j[None, :],
                       mask=visible[:, None] & jm[None, :], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [HP, BLOCK_E]
        w = tl.load(w_ptr + r * sw_r + h, mask=hm, other=0.0).to(tl.float32) * weights_scale
        s = tl.sum(tl.maximum(s, 0.0) * softmax_scale * w[:, None], axis=0)
        scores = tl.where(visible, s, float("-inf"))
    tl.store(out_ptr + r * so_r + e, scores, mask=e < E)


@indexer_topk_op.register_kernel("cuda")
def _indexer_topk_cuda(q, entries, weights, positions, rate, k, softmax_scale, weights_scale):
    check_indexer_inputs(q, entries, weights, positions)
    b, n, h, d = q.shape
    E = entries.shape[1]
    q, weights, positions = q.contiguous(), weights.contiguous(), positions.contiguous()
    entries = entries if entries.stride(-1) == 1 else entries.contiguous()
    scores = torch.empty(b, n, E, dtype=torch.float32, device=q.device)
    if b * n and E:
        with torch.cuda.device(q.device):
            _scores_kernel[(b * n, triton.cdiv(E, BLOCK_E))](
                q, entries, weights, positions, scores, n, h, d, E, int(rate), float(softmax_scale),
                float(weights_scale), q.stride(1), q.stride(2), entries.stride(0), entries.stride(1), weights.stride(1),
                E, HP=max(16, triton.next_power_of_2(h)), D=max(16, triton.next_power_of_2(d)), BLOCK_E=BLOCK_E,
                num_warps=4, **pdl.launch_args(q.device))
    picks = scores.topk(min(k, E), dim=-1).indices
    return torch.where(picks < ((positions + 1) // rate).unsqueeze(-1), picks, -1)
