"""``dsv4_mtp::compressed_attention`` -- the V4 target's attention for a decode step's ``n`` rows (design §6).

Row ``i`` of sequence ``b`` sits at position ``p = length[b] + i`` and attends, in one softmax with a per-head sink
logit in the denominator (transformers' eager V4 attention; the one K=V head serves every query head):

* the sliding window: the keys at positions ``(p - window, p]``; positions before ``length`` come from the ring
  (position ``q`` in slot ``q % R``), the others are this step's rows ``kv``;
* the compressed entries: with ``picks`` (CSA) the entries ``picks[b, i, :]`` names, as ``indexer_topk`` returns
  them: the real picks first, then ``-1`` (none), at most ``(p + 1) // rate`` real ones; without
  (HCA) every entry of a window closed by ``p``, ``e < (p + 1) // rate``; neither when ``rate`` is 0.

The step's rows are not written to the ring here: the caller writes them after the call (the last row of a
long step takes the slot the first row's oldest key is read from).  Shapes depend only on ``n`` and the
state's sizes, and no value leaves the device, so a step replays from a CUDA graph.

The reference below (fp32 scores and softmax) is the source of truth on every device; the CUDA registration
(``ops/triton/compressed_attention_triton.py``) walks the same keys in one launch.
"""

from __future__ import annotations

import torch

from ._kernels import register_triton_kernels

LIB = "dsv4_mtp"


def check_compressed_attention_inputs(q, kv, ring, length, entries, picks, sinks, window: int, rate: int) -> None:
    """Raise naming what ``compressed_attention`` does not define."""
    if q.dim() != 4 or kv.dim() != 3 or tuple(kv.shape) != (q.shape[0], q.shape[1], q.shape[3]):
        raise ValueError(f"compressed_attention: q must be [B, n, H, d] and kv [B, n, d], got {tuple(q.shape)} and "
                         f"{tuple(kv.shape)}")
    b, n, h, d = q.shape
    if ring.dim() != 3 or ring.shape[0] != b or ring.shape[2] != d or ring.shape[1] < window - 1:
        raise ValueError(f"compressed_attention: ring must be [B={b}, R >= window - 1 = {window - 1}, d={d}], got "
                         f"{tuple(ring.shape)}")
    if tuple(length.shape) != (b,) or length.dtype != torch.long:
        raise ValueError(f"compressed_attention: length must be int64 [B={b}], got {length.dtype} "
                         f"{tuple(length.shape)}")
    if tuple(sinks.shape) != (h,):
        raise ValueError(f"compressed_attention: sinks must be [H={h}], got {tuple(sinks.shape)}")
    if rate < 0 or (rate > 0) != (entries is not None):
        raise ValueError(f"compressed_attention: entries go with a compression rate > 0 (got rate {rate} and "
                         f"{'no entries' if entries is None else 'entries'})")
    if entries is not None and (entries.dim() != 3 or entries.shape[0] != b or entries.shape[2] != d):
        raise ValueError(f"compressed_attention: entries must be [B={b}, E, d={d}], got {tuple(entries.shape)}")
    if picks is not None and (entries is None or picks.dim() != 3 or tuple(picks.shape[:2]) != (b, n)
                              or picks.dtype != torch.long):
        raise ValueError(f"compressed_attention: picks must be int64 [B={b}, n={n}, k] beside entries, got "
                         f"{picks.dtype} {tuple(picks.shape)}")


def _window_keys(kv, ring, length, window: int):
    """Each sequence's window keys ``[B, W - 1 + n, d]`` (the ``W - 1`` positions before the step, then the step's
    rows) and their positions ``[B, W - 1 + n]``."""
    b, n, _ = kv.shape
    slots = ring.shape[1]
    key_pos = length.view(b, 1) - (window - 1) + torch.arange(window - 1 + n, device=kv.device)
    idx = torch.where(key_pos < length.view(b, 1), key_pos % slots, slots + key_pos - length.view(b, 1))
    seq = torch.arange(b, device=kv.device).view(b, 1)
    return torch.cat([ring, kv], dim=1)[seq, idx.clamp(0, slots + n - 1)], key_pos


def compressed_attention_reference(q, kv, ring, length, entries, picks, sinks, scale: float, window: int,
                                   rate: int) -> torch.Tensor:
    """``q [B, n, H, d]``, ``kv [B, n, d]``, ``ring [B, R, d]``, ``length [B]``, ``entries [B, E, d]`` or None,
    ``picks [B, n, k]`` or None, ``sinks [H]`` -> ``[B, n, H, d]`` in q's dtype (module docstring)."""
    b, n = kv.shape[:2]
    positions = length.view(b, 1) + torch.arange(n, device=q.device)  # [B, n]
    keys, key_pos = _window_keys(kv, ring, length, window)
    delta = positions[:, :, None] - key_pos[:, None, :]
    groups = [(keys[:, None].expand(b, n, -1, -1), (key_pos[:, None, :] >= 0) & (delta >= 0) & (delta < window))]
    if picks is not None:
        seq = torch.arange(b, device=q.device).view(b, 1, 1)
        groups.append((entries[seq, picks.clamp(min=0)], picks >= 0))
    elif entries is not None:
        closed = (positions + 1) // rate
        visible = torch.arange(entries.shape[1], device=q.device) < closed[..., None]
        groups.append((entries[:, None].expand(b, n, -1, -1), visible))
    keys = torch.cat([k for k, _ in groups], dim=2).float()  # [B, n, K, d]
    visible = torch.cat([v for _, v in groups], dim=2)  # [B, n, K]
    logits = torch.einsum("bnhd,bnkd->bnhk", q.float(), keys) * scale
    logits = logits.masked_fill(~visible[:, :, None], float("-inf"))
    sink = sinks.float().view(1, 1, -1, 1).expand(b, n, -1, 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]  # the sink keeps every row finite
    return torch.einsum("bnhk,bnkd->bnhd", probs, keys).to(q.dtype).contiguous()


@torch.library.custom_op(f"{LIB}::compressed_attention", mutates_args=())
def compressed_attention(q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, length: torch.Tensor,
                         entries: torch.Tensor | None, picks: torch.Tensor | None, sinks: torch.Tensor, scale: float,
                         window: int, rate: int) -> torch.Tensor:
    """The reference math on any device without a faster kernel (module docstring)."""
    check_compressed_attention_inputs(q, kv, ring, length, entries, picks, sinks, window, rate)
    return compressed_attention_reference(q, kv, ring, length, entries, picks, sinks, scale, window, rate)


@compressed_attention.register_fake
def _(q, kv, ring, length, entries, picks, sinks, scale, window, rate):
    check_compressed_attention_inputs(q, kv, ring, length, entries, picks, sinks, window, rate)
    return q.new_empty(q.shape)  # contiguous, as every registration returns it


def register_cuda_kernels() -> bool:
    """Register the Triton kernel behind ``dsv4_mtp::compressed_attention`` (on import when CUDA is present)."""
    return register_triton_kernels("compressed_attention_triton", "dsv4_mtp::compressed_attention")


if torch.cuda.is_available():
    register_cuda_kernels()
