"""Sliding-window shared-KV attention with sinks: the reference math (SPEC §4).

One KV head serves as both key and value for every query head (MQA).  A query at
position p sees the keys at positions (p - window, p].  Each head has a learned sink
logit that joins the softmax denominator only (a key whose value is zero).
"""

import torch


def sliding_window_attention_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
    sinks: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """q ``[B, S, H, d]``, kv ``[B, L, d]``, positions ``[B, S]`` / ``[B, L]``, sinks ``[H]``
    -> ``[B, S, H, d]`` in q's dtype.  fp32 scores and softmax."""
    scores = torch.einsum("bshd,bld->bhsl", q.float(), kv.float()) * scale
    delta = q_positions.unsqueeze(-1) - kv_positions.unsqueeze(-2)  # [B, S, L]
    visible = (delta >= 0) & (delta < window)
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("bhsl,bld->bshd", probs, kv.float()).to(q.dtype)
