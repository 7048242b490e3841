"""``dsv4_mtp::compressor_step`` -- one step of a V4 compressor stream on its fixed-shape state (design §6).

A compressed layer (CSA, HCA) pools every ``rate`` tokens' projected rows into one compressed KV entry;
the CSA indexer runs a second, smaller stream over the same windows.  Per stream and sequence the state is
(``target_runtime/batched_state.py``):

* ``ring_kv`` / ``ring_gate [B, R, c]``: the raw projected rows, position ``p`` in slot ``p % R``;
* ``entries [B, E + 1, d]``: entry ``e`` at index ``e``; the last one is a spare that windows which do not
  close in this step write to (never read);

and everything else is a function of the sequence's length ``L``, so a rollback only moves ``L``.  A step
appends ``n`` rows (positions ``L .. L + n - 1``) and recomputes every window that closes in it, exactly as
transformers' compressors do::

    window w (rows w*rate .. (w+1)*rate - 1):  g = gate + position_bias,  kv pooled by softmax_rows(g)
    CSA (overlap): the first half of an entry's 2*rate slots is the previous window's Ca half
                   (kv[..., :d], zero kv / -inf gate before window 0), the second half this window's Cb half
    entry w = RoPE_{w*rate}(RMSNorm(pooled))

Shapes are fixed for a given ``n``: ``(rate - 1 + n) // rate`` windows are computed, those that do not close
go to the spare entry.  The reference below is the source of truth (CPU, and every device); the CUDA
registration (``ops/triton/compressor_triton.py``) computes the windows in one launch and writes the rings in a
second.
"""

from __future__ import annotations

import torch

from ._kernels import register_triton_kernels

LIB = "dsv4_mtp"


def interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' V4 RoPE (``apply_rotary_pos_emb``) on the trailing ``2 * cos.shape[-1]`` channels of ``x``:
    pair ``(a, b)`` -> ``(a cos - b sin, b cos + a sin)`` in fp32, rounded to x's dtype.  ``cos``/``sin``
    broadcast against ``x[..., rope_dim // 2]``."""
    r = 2 * cos.shape[-1]
    pairs = x[..., -r:].float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos.float(), sin.float()
    rotated = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], rotated.to(x.dtype)], dim=-1)


def closing_windows(length: torch.Tensor, n: int, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows a step of ``n`` rows after ``length [B]`` tokens may close: (entry index ``[B, NW]``, whether
    it closes ``[B, NW]``), ``NW = (rate - 1 + n) // rate`` (fixed for ``n``).  Entry ``w``'s RoPE position is
    ``w * rate``."""
    nw = (rate - 1 + n) // rate
    first = length.view(-1, 1) // rate + torch.arange(nw, device=length.device)
    return first, first < (length.view(-1, 1) + n) // rate


def check_compressor_inputs(kv, gate, length, ring_kv, ring_gate, entries, position_bias, norm_weight, cos, sin,
                            rate: int, overlap: bool) -> None:
    """Raise naming what ``compressor_step`` does not define."""
    if kv.dim() != 3 or gate.shape != kv.shape:
        raise ValueError(f"compressor_step: kv and gate must be [B, n, c] of one shape, got {tuple(kv.shape)} and "
                         f"{tuple(gate.shape)}")
    b, n, c = kv.shape
    d = c // 2 if overlap else c
    if ring_kv.shape != ring_gate.shape or ring_kv.dim() != 3 or ring_kv.shape[0] != b or ring_kv.shape[2] != c:
        raise ValueError(f"compressor_step: rings must be [B={b}, R, c={c}], got {tuple(ring_kv.shape)} and "
                         f"{tuple(ring_gate.shape)}")
    if entries.dim() != 3 or entries.shape[0] != b or entries.shape[2] != d:
        raise ValueError(f"compressor_step: entries must be [B={b}, E + 1, d={d}], got {tuple(entries.shape)}")
    if tuple(length.shape) != (b,) or length.dtype != torch.long:
        raise ValueError(f"compressor_step: length must be int64 [B={b}], got {length.dtype} {tuple(length.shape)}")
    if tuple(position_bias.shape) != (rate, c) or tuple(norm_weight.shape) != (d,):
        raise ValueError(f"compressor_step: position_bias must be [rate={rate}, c={c}] and norm_weight [d={d}], got "
                         f"{tuple(position_bias.shape)} and {tuple(norm_weight.shape)}")
    nw = (rate - 1 + n) // rate
    if cos.shape != sin.shape or cos.dim() != 3 or tuple(cos.shape[:2]) != (b, nw) or 2 * cos.shape[2] > d:
        raise ValueError(f"compressor_step: cos/sin must be [B={b}, NW={nw}, rope/2] (the closing windows' RoPE), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if ring_kv.shape[1] < rate * (2 if overlap else 1) - 1:
        raise ValueError(f"compressor_step: a ring of {ring_kv.shape[1]} rows cannot hold a window of rate {rate}"
                         + (" and the previous one" if overlap else ""))


def compressor_step_reference(kv, gate, length, ring_kv, ring_gate, entries, position_bias, norm_weight, cos, sin,
                              rate: int, overlap: bool, eps: float) -> None:
    """``kv``/``gate [B, n, c]``: this step's projected rows; ``cos``/``sin [B, NW, rope/2]``: RoPE of the
    closing windows (:func:`closing_windows`).  Writes the closed windows' entries and the rows into the rings."""
    b, n, c = kv.shape
    ring = ring_kv.shape[1]
    d = entries.shape[-1]
    seq = torch.arange(b, device=kv.device).view(b, 1, 1)
    L = length.view(b, 1, 1)
    src_kv, src_gate = torch.cat([ring_kv, kv], dim=1), torch.cat([ring_gate, gate], dim=1)

    def rows(src, positions):  # positions before L from the ring, the others from this step's rows
        idx = torch.where(positions < L, positions % ring, ring + positions - L).clamp(0, ring + n - 1)
        return src[seq, idx]  # windows that stay open read clamped rows: their entry is the spare

    first, closes = closing_windows(length, n, rate)
    positions = (first * rate).unsqueeze(-1) + torch.arange(rate, device=kv.device)  # [B, NW, rate]
    win_kv, win_gate = rows(src_kv, positions), rows(src_gate, positions) + position_bias
    if overlap:  # entry w pools window w - 1's Ca half with window w's Cb half (nothing before window 0)
        has_prev = (first >= 1)[..., None, None]
        prev_kv = rows(src_kv, positions - rate)[..., :d]
        prev_gate = (rows(src_gate, positions - rate) + position_bias)[..., :d]
        win_kv = torch.cat([torch.where(has_prev, prev_kv, 0.0), win_kv[..., d:]], dim=2)
        win_gate = torch.cat([torch.where(has_prev, prev_gate, float("-inf")), win_gate[..., d:]], dim=2)
    pooled = (win_kv * win_gate.softmax(dim=2, dtype=torch.float32).to(win_kv.dtype)).sum(dim=2)  # [B, NW, d]
    pf = pooled.float()
    normed = (norm_weight.float() * (pf * torch.rsqrt(pf.square().mean(-1, keepdim=True) + eps))).to(pooled.dtype)
    spare = entries.shape[1] - 1
    entries[seq[..., 0], torch.where(closes, first, spare)] = interleaved_rope(normed, cos, sin)
    kept = min(n, ring)  # the last rows of the step, each to its slot
    slots = (length.view(b, 1) + n - kept + torch.arange(kept, device=kv.device)) % ring
    ring_kv[seq[..., 0], slots] = kv[:, n - kept:]
    ring_gate[seq[..., 0], slots] = gate[:, n - kept:]


@torch.library.custom_op(f"{LIB}::compressor_step", mutates_args=("ring_kv", "ring_gate", "entries"))
def compressor_step_op(kv: torch.Tensor, gate: torch.Tensor, length: torch.Tensor, ring_kv: torch.Tensor,
                       ring_gate: torch.Tensor, entries: torch.Tensor, position_bias: torch.Tensor,
                       norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rate: int, overlap: bool,
                       eps: float) -> None:
    """The reference math on any device without a faster kernel."""
    check_compressor_inputs(kv, gate, length, ring_kv, ring_gate, entries, position_bias, norm_weight, cos, sin, rate,
                            overlap)
    compressor_step_reference(kv, gate, length, ring_kv, ring_gate, entries, position_bias, norm_weight, cos, sin,
                              rate, overlap, eps)


@compressor_step_op.register_fake
def _(kv, gate, length, ring_kv, ring_gate, entries, position_bias, norm_weight, cos, sin, rate, overlap, eps):
    check_compressor_inputs(kv, gate, length, ring_kv, ring_gate, entries, position_bias, norm_weight, cos, sin, rate,
                            overlap)


def compressor_step(kv, gate, length, ring_kv, ring_gate, entries, position_bias, norm_weight, cos, sin,
                    rate: int, overlap: bool, eps: float) -> None:
    """One stream's step (module docstring), in place: ``dsv4_mtp::compressor_step``."""
    compressor_step_op(kv, gate, length, ring_kv, ring_gate, entries, position_bias, norm_weight, cos, sin, rate,
                       overlap, eps)


def register_cuda_kernels() -> bool:
    """Register the Triton kernels behind ``dsv4_mtp::compressor_step`` (on import when CUDA is present)."""
    return register_triton_kernels("compressor_triton", "dsv4_mtp::compressor_step")


if torch.cuda.is_available():
    register_cuda_kernels()
