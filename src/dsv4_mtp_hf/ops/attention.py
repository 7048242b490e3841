"""Sliding-window shared-KV attention with sinks: the reference math (design §2), and the
``dsv4_mtp::window_attention`` op that runs it.

One KV head serves as both key and value for every query head (MQA).  A query at
position p sees the keys at positions (p - window, p].  Each head has a learned sink
logit that joins the softmax denominator only (a key whose value is zero).

The op's CUDA registration (``ops/triton/attention_triton.py``) computes a draft step's
one query row per sequence in one launch (scores, masked online softmax with the sink,
probabilities times the shared KV; at small batch the keys are split over programs and
combined by the last one, flash-decoding); as fp32 cuBLAS GEMMs plus softmax the same math
took ~16 µs of a V4-Flash batch-1 step.  Everything else
-- CPU, more query rows, shapes the kernel does not tile -- runs the reference below.
"""

from __future__ import annotations

import torch

from ._kernels import register_triton_kernels

LIB = "dsv4_mtp"

QUERY_CHUNK = 256  # queries per block in long prefills: memory O(S * (window + chunk)), not O(S^2)


def _attend(q, kv, q_positions, kv_positions, sinks, window, scale):
    scores = torch.einsum("bshd,bld->bhsl", q.float(), kv.float()) * scale
    delta = q_positions.unsqueeze(-1) - kv_positions.unsqueeze(-2)  # [B, S, L]
    visible = (delta >= 0) & (delta < window)
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("bhsl,bld->bshd", probs, kv.float()).to(q.dtype)


def sliding_window_attention_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
    sinks: torch.Tensor,
    window: int,
    scale: float,
    query_chunk: int | None = QUERY_CHUNK,
) -> torch.Tensor:
    """q ``[B, S, H, d]``, kv ``[B, L, d]``, positions ``[B, S]`` / ``[B, L]``, sinks ``[H]``
    -> ``[B, S, H, d]`` in q's dtype.  fp32 scores and softmax.

    The last S keys belong to the S queries (the cache puts held keys first, in order), so
    a block of queries ``[a, b)`` only needs keys ``[L - S + a - (window - 1), L - S + b)``:
    long prefills are processed in blocks of ``query_chunk`` queries with bounded memory."""
    s, l = q.shape[1], kv.shape[1]
    if query_chunk is None or s <= query_chunk:
        return _attend(q, kv, q_positions, kv_positions, sinks, window, scale)
    out = []
    for a in range(0, s, query_chunk):
        b = min(a + query_chunk, s)
        k0, k1 = max(0, l - s + a - (window - 1)), l - s + b
        out.append(_attend(q[:, a:b], kv[:, k0:k1], q_positions[:, a:b], kv_positions[:, k0:k1], sinks, window, scale))
    return torch.cat(out, dim=1)


def check_window_attention_inputs(q, kv, q_positions, kv_positions, sinks) -> None:
    if q.dim() != 4 or kv.dim() != 3 or q.shape[0] != kv.shape[0] or q.shape[-1] != kv.shape[-1]:
        raise ValueError(f"window_attention expects q [B, S, H, d] and kv [B, L, d], got {tuple(q.shape)} and "
                         f"{tuple(kv.shape)}.")
    b, s, h, _ = q.shape
    if tuple(q_positions.shape) != (b, s) or tuple(kv_positions.shape) != (b, kv.shape[1]):
        raise ValueError(f"positions must be [B, S] = {(b, s)} and [B, L] = {(b, kv.shape[1])}, got "
                         f"{tuple(q_positions.shape)} and {tuple(kv_positions.shape)}.")
    if tuple(sinks.shape) != (h,):
        raise ValueError(f"sinks must be [H] = [{h}], got {tuple(sinks.shape)}.")


@torch.library.custom_op(f"{LIB}::window_attention", mutates_args=())
def window_attention(q: torch.Tensor, kv: torch.Tensor, q_positions: torch.Tensor, kv_positions: torch.Tensor,
                     sinks: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """:func:`sliding_window_attention_reference` as an op (the reference math on any device
    without a faster kernel)."""
    check_window_attention_inputs(q, kv, q_positions, kv_positions, sinks)
    return sliding_window_attention_reference(q, kv, q_positions, kv_positions, sinks, window, scale)


@window_attention.register_fake
def _(q, kv, q_positions, kv_positions, sinks, window, scale):
    check_window_attention_inputs(q, kv, q_positions, kv_positions, sinks)
    return torch.empty_like(q)


def sliding_window_attention(q, kv, q_positions, kv_positions, sinks, window: int, scale: float) -> torch.Tensor:
    """The attention for the layers: ``dsv4_mtp::window_attention`` on CUDA outside autograd (its
    kernel where it tiles the shape), the reference math otherwise (CPU; training: the op has no
    backward)."""
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
    attend = window_attention if q.is_cuda and not needs_grad else sliding_window_attention_reference
    return attend(q, kv, q_positions, kv_positions, sinks, window, scale)


def register_cuda_kernels() -> bool:
    """Register the Triton kernel behind ``dsv4_mtp::window_attention`` (on import when CUDA is present)."""
    return register_triton_kernels("attention_triton", "dsv4_mtp::window_attention")

if torch.cuda.is_available():
    register_cuda_kernels()
