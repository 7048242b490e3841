"""``dsv4_mtp::indexer_topk`` -- the CSA lightning indexer's choice of compressed entries (design §6).

Each query row ``t`` scores every compressed indexer entry ``s`` with ``sum_h w_{t,h} relu(q_{t,h} . K_s)``
(transformers' ``DeepseekV4IndexerScorer``: ``relu(q.K) * index_head_dim^-0.5``, weights ``weights_proj(x) *
index_n_heads^-0.5``), masks the entries of windows that close after the query (``s >= (p + 1) // rate``)
and keeps the ``k`` best.  Picks that point at a masked entry (a query with fewer than ``k`` closed windows)
come back as ``-1``, as transformers' indexer returns them, after the real picks; the order among the real picks is
not part of the contract (the reference's is by score, the CUDA kernel's by entry).

The entries are a fixed-shape buffer (``target_runtime/batched_state.py``: every entry the capacity allows,
plus a spare), so the shapes depend only on the row count.  The reference below is the source of truth; the
CUDA registration (``ops/triton/indexer_triton.py``) scores in one launch, reading only the closed entries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._kernels import register_triton_kernels

LIB = "dsv4_mtp"


def check_indexer_inputs(q, entries, weights, positions) -> None:
    if q.dim() != 4 or entries.dim() != 3 or q.shape[0] != entries.shape[0] or q.shape[-1] != entries.shape[-1]:
        raise ValueError(f"indexer_topk: q must be [B, n, H, d] and entries [B, E, d], got {tuple(q.shape)} and "
                         f"{tuple(entries.shape)}")
    if tuple(weights.shape) != tuple(q.shape[:3]) or tuple(positions.shape) != tuple(q.shape[:2]):
        raise ValueError(f"indexer_topk: weights must be [B, n, H] = {tuple(q.shape[:3])} and positions [B, n], got "
                         f"{tuple(weights.shape)} and {tuple(positions.shape)}")
    if positions.dtype != torch.long:
        raise TypeError(f"indexer_topk: positions must be int64, got {positions.dtype}")


def indexer_topk_reference(q, entries, weights, positions, rate: int, k: int, softmax_scale: float,
                           weights_scale: float) -> torch.Tensor:
    """``q [B, n, H, d]`` (RoPE'd), ``entries [B, E, d]``, ``weights [B, n, H]`` (``weights_proj(x)``),
    ``positions [B, n]`` -> the picked entries ``[B, n, min(k, E)]`` (``-1``: no entry)."""
    scores = torch.matmul(q.float(), entries.transpose(-1, -2).float().unsqueeze(1))  # [B, n, H, E]
    scores = F.relu(scores) * softmax_scale
    scores = (scores * (weights.float() * weights_scale).unsqueeze(-1)).sum(dim=2)  # [B, n, E]
    threshold = ((positions + 1) // rate).unsqueeze(-1)
    visible = torch.arange(entries.shape[1], device=q.device) < threshold
    picks = scores.masked_fill(~visible, float("-inf")).topk(min(k, entries.shape[1]), dim=-1).indices
    return torch.where(picks < threshold, picks, -1)


@torch.library.custom_op(f"{LIB}::indexer_topk", mutates_args=())
def indexer_topk_op(q: torch.Tensor, entries: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                    rate: int, k: int, softmax_scale: float, weights_scale: float) -> torch.Tensor:
    """The reference math on any device without a faster kernel."""
    check_indexer_inputs(q, entries, weights, positions)
    return indexer_topk_reference(q, entries, weights, positions, rate, k, softmax_scale, weights_scale)


@indexer_topk_op.register_fake
def _(q, entries, weights, positions, rate, k, softmax_scale, weights_scale):
    check_indexer_inputs(q, entries, weights, positions)
    return positions.new_empty(*q.shape[:2], min(k, entries.shape[1]))


def indexer_topk(q, entries, weights, positions, rate: int, k: int, softmax_scale: float,
                 weights_scale: float) -> torch.Tensor:
    """The op (module docstring)."""
    return indexer_topk_op(q, entries, weights, positions, rate, k, softmax_scale, weights_scale)


def register_cuda_kernels() -> bool:
    """Register the Triton kernel behind ``dsv4_mtp::indexer_topk`` (on import when CUDA is present)."""
    return register_triton_kernels("indexer_triton", "dsv4_mtp::indexer_topk")


if torch.cuda.is_available():
    register_cuda_kernels()
