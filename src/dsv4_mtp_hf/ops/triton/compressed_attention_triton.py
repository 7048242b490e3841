"""Triton kernel behind ``dsv4_mtp::compressed_attention`` (the target's decode attention, ``ops/compressed_attention.py``).

Grid ``(B * n, H / BLOCK_H, NSPLIT)``: a program holds ``BLOCK_H`` query heads of one row and walks its keys in
tiles of ``BLOCK_L``: first the window's ``W - 1 + n`` key slots (ring rows before the sequence's length, the step's
rows from it on, masked to the row's window), then the compressed entries (the row's ``picks``, or the entries of
the windows its position closed).  Tiles past the row's count of entries (a function of the length on the device)
are skipped, so the work follows the context while the grid stays fixed for a CUDA graph.  Scores are MMAs with
fp32 accumulation, an fp32 online softmax starting at a finite -1e30 (a fully masked tile leaves a zero partial),
and ``p @ keys`` with ``p`` rounded to the keys' dtype (the one rounding the reference lacks).  The sink joins the
denominator at the end.  With several splits (flash-decoding: few rows, many keys) each program writes its
partial to a workspace and the last program of each (row, head block), by an acq_rel ticket reset after use,
combines them in a fixed order -- one launch, deterministic; a graph captured before the tickets exist combines
in a second launch.  Calls on one device share the tickets: one stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait
from .persistent import persistent_zeros
from ..compressed_attention import (
    check_compressed_attention_inputs,
    compressed_attention,
    compressed_attention_reference,
)

BLOCK_H = 16  # query heads per program (the MMA's M)
_TICKETS_MIN = 4096
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _row_tiles(len_ptr, r, n, rate, E, K, WIN_TILES: tl.constexpr, BLOCK_L: tl.constexpr, MODE: tl.constexpr):
    """Row ``r``'s sequence ``b``, index ``i``, length ``L``, position ``p``, count of entries and of key tiles."""
    b = (r // n).to(tl.int64)
    i = r % n
    L = tl.load(len_ptr + b)
    p = L + i
    if MODE == 0:
        count = p * 0
    elif MODE == 1:
        count = tl.minimum((p + 1) // rate, E)
    else:
        count = tl.minimum((p + 1) // rate, K)
    return b, i, L, p, count, WIN_TILES + tl.cdiv(count, BLOCK_L)


@triton.jit
def _combine(acc_ptr, m_ptr, den_ptr, sink_ptr, out_ptr, r, h, hm, d, dm, so_r, so_h, active,
             HP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr):
    """Row ``r``'s heads ``h`` from the partials of its ``active`` splits (those with keys), split 0 first (a fixed
    order).  ``.cg``: the partials come from other programs of the launch, read from the L2."""
    base = r * NSPLIT * HP + h  # split 0's statistics row, [rows, NSPLIT, HP]
    sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32)
    m = sink
    for i in range(active):
        m = tl.maximum(m, tl.load(m_ptr + base + i * HP, cache_modifier=".cg"))
    den = tl.exp(sink - m)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for i in range(active):
        w = tl.exp(tl.load(m_ptr + base + i * HP, cache_modifier=".cg") - m)
        den += tl.load(den_ptr + base + i * HP, cache_modifier=".cg") * w
        acc += tl.load(acc_ptr + (base + i * HP)[:, None].to(tl.int64) * D + d[None, :], cache_modifier=".cg") * w[:, None]
    out = acc / den[:, None]
    tl.store(out_ptr + r.to(tl.int64) * so_r + h[:, None] * so_h + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=hm[:, None] & dm[None, :])


@triton.jit
def _attend(q, rows, vis, d, dm, m, den, acc, scale, IEEE: tl.constexpr):
    """One tile of keys (row pointers ``rows [BLOCK_L]``, ``vis``: which the row sees) into the online softmax."""
    keys = tl.load(rows[:, None] + d[None, :], mask=vis[:, None] & dm[None, :], other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(keys), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(keys))
    s = tl.where(vis[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    pr = tl.exp(s - m_new[:, None])
    den = den * alpha + tl.sum(pr, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(pr.to(keys.dtype), keys, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pr.to(keys.dtype), keys)
    return m_new, den, acc


@triton.jit
def _compressed_attention_kernel(
        q_ptr, kv_ptr, ring_ptr, len_ptr, ent_ptr, picks_ptr, sink_ptr, out_ptr, acc_ptr, m_ptr, den_ptr, ticket_ptr,
        n, H, d_real, R, E, K, window, rate, scale, tiles_per_split,
        sq_b, sq_n, sq_h, skv_b, skv_n, sr_b, sr_l, se_b, se_l, sp_b, sp_n, so_r, so_h,
        D: tl.constexpr, HP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, WIN_TILES: tl.constexpr,
        MODE: tl.constexpr, NSPLIT: tl.constexpr, TICKET: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    r = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    b, i, L, p, count, tiles = _row_tiles(len_ptr, r, n, rate, E, K, WIN_TILES, BLOCK_L, MODE)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    d = tl.arange(0, D)
    dm = d < d_real
    q = tl.load(q_ptr + b * sq_b + i * sq_n + h[:, None] * sq_h + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    m = tl.full([BLOCK_H], -1e30, dtype=tl.float32)
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    t0 = split * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tiles)
    # two loops with branch-free bodies (the key rows of a tile are one formula each), so that both pipeline
    for t in range(t0, tl.minimum(t1, WIN_TILES)):  # the window: key position L - (W - 1) + j
        j = t * BLOCK_L + tl.arange(0, BLOCK_L)
        kp = L - (window - 1) + j
        vis = (j < window - 1 + n) & (kp >= 0) & (kp <= p) & (p - kp < window)
        ring_rows = ring_ptr + b * sr_b + tl.where(kp >= 0, kp % R, 0).to(tl.int64) * sr_l
        new_rows = kv_ptr + b * skv_b + tl.where(kp >= L, kp - L, 0).to(tl.int64) * skv_n
        m, den, acc = _attend(q, tl.where(kp < L, ring_rows, new_rows), vis, d, dm, m, den, acc, scale, IEEE)
    for t in range(tl.maximum(t0, WIN_TILES), t1):  # the compressed entries
        e = (t - WIN_TILES) * BLOCK_L + tl.arange(0, BLOCK_L)
        if MODE == 2:  # CSA: the indexer's picks
            idx = tl.load(picks_ptr + b * sp_b + i * sp_n + e, mask=e < count, other=-1)
            vis = idx >= 0
        else:  # HCA: the closed entries in order
            idx = e
            vis = e < count
        rows = ent_ptr + b * se_b + tl.where(vis, idx, 0).to(tl.int64) * se_l
        m, den, acc = _attend(q, rows, vis, d, dm, m, den, acc, scale, IEEE)
    if NSPLIT == 1:
        sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32)
        m_fin = tl.maximum(m, sink)
        alpha = tl.exp(m - m_fin)
        den = den * alpha + tl.exp(sink - m_fin)
        out = acc * (alpha / den)[:, None]
        tl.store(out_ptr + r.to(tl.int64) * so_r + h[:, None] * so_h + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=hm[:, None] & dm[None, :])
    else:
        active = tl.cdiv(tiles, tiles_per_split)  # the splits with keys: only they write and are combined
        if split < active:
            row = (r * NSPLIT + split) * HP + h  # workspace: statistics [rows, NSPLIT, HP], accumulators [.., D]
            tl.store(m_ptr + row, m)
            tl.store(den_ptr + row, den)
            tl.store(acc_ptr + row[:, None].to(tl.int64) * D + d[None, :], acc)
        if TICKET:
            tl.debug_barrier()  # every thread's partial stores precede the ticket (released by it)
            ticket = ticket_ptr + r * tl.num_programs(1) + hb
            if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == NSPLIT - 1:  # the last of the splits
                tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # clean for the next call / replay
                _combine(acc_ptr, m_ptr, den_ptr, sink_ptr, out_ptr, r, h, hm, d, dm, so_r, so_h, active, HP, BLOCK_H,
                         D, NSPLIT)


@triton.jit
def _combine_kernel(acc_ptr, m_ptr, den_ptr, sink_ptr, out_ptr, len_ptr, n, H, d_real, E, K, rate, tiles_per_split,
                    so_r, so_h, D: tl.constexpr, HP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
                    WIN_TILES: tl.constexpr, MODE: tl.constexpr, NSPLIT: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    r = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    tiles = _row_tiles(len_ptr, r, n, rate, E, K, WIN_TILES, BLOCK_L, MODE)[5]
    _combine(acc_ptr, m_ptr, den_ptr, sink_ptr, out_ptr, r, h, h < H, d, d < d_real, so_r, so_h,
             tl.cdiv(tiles, tiles_per_split), HP, BLOCK_H, D, NSPLIT)


def key_block(d_pad: int) -> int:
    """Keys per tile: about 8K elements.  [64, 512] bf16 tiles at V4's head size took 255 registers a thread and
    spilled ~230 (BENCHMARKS.md, 2026-12-08)."""
    return max(16, min(64, 8192 // d_pad))


def pick_config(rows: int, head_blocks: int, max_tiles: int, d: int, device: torch.device) -> tuple[int, int]:
    """``(tiles_per_split, num_warps)``: keys split over programs until the grid fills about one wave of the GPU's
    SMs (a 1-row step has only ``H / BLOCK_H`` programs per split), at least one tile each."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    nsplit = max(1, min(max_tiles, sms // max(1, rows * head_blocks)))
    num_warps = 8 if BLOCK_H * d >= 8192 else 4  # [16, 512] fp32 accumulators on 4 warps spill
    return triton.cdiv(max_tiles, nsplit), num_warps


def compressed_attention_triton(q, kv, ring, length, entries, picks, sinks, scale: float, window: int, rate: int,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel on any shape (``out``: tests poison it to check every element is written)."""
    b, n, h, d = q.shape
    q, kv, ring = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, kv, ring))
    mode = 0 if entries is None else (2 if picks is not None else 1)
    big = max(d, 16)
    D = 1 << (big - 1).bit_length()
    block_l = key_block(D)
    win_tiles = triton.cdiv(window - 1 + n, block_l)
    E = 0 if entries is None else entries.shape[1]
    K = 0 if picks is None else picks.shape[2]
    max_tiles = win_tiles + triton.cdiv({0: 0, 1: E, 2: min(K, E)}[mode], block_l)
    n_hb = triton.cdiv(h, BLOCK_H)
    rows = b * n
    tiles_per_split, num_warps = pick_config(rows, n_hb, max_tiles, D, q.device)
    nsplit = triton.cdiv(max_tiles, tiles_per_split)
    if out is None:
        out = torch.empty(b, n, h, d, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    hp = n_hb * BLOCK_H
    ticket, acc, m, den = None, out, out, out  # the workspace only with splits
    if nsplit > 1:
        ws = torch.empty(rows * nsplit * hp * (D + 2), dtype=torch.float32, device=q.device)
        acc = ws[: rows * nsplit * hp * D]
        m, den = ws[rows * nsplit * hp * D:].view(2, -1)
        ticket = persistent_zeros("compressed_attention_tickets", q.device, max(rows * n_hb, _TICKETS_MIN), torch.int32)
    ent = entries if entries is not None else ring  # an unread pointer when there are none
    pk = picks if picks is not None else length
    _compressed_attention_kernel[(rows, n_hb, nsplit)](
        q, kv, ring, length, ent, pk, sinks, out, acc, m, den, ticket if ticket is not None else out,
        n, h, d, ring.shape[1], E, K, int(window), int(rate), float(scale), tiles_per_split,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), ring.stride(0), ring.stride(1),
        ent.stride(0), ent.stride(1), pk.stride(0) if picks is not None else 0,
        pk.stride(1) if picks is not None else 0, h * d, d,
        D=D, HP=hp, BLOCK_H=BLOCK_H, BLOCK_L=block_l, WIN_TILES=win_tiles, MODE=mode, NSPLIT=nsplit,
        TICKET=ticket is not None, IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=2,
        **pdl.launch_args(q.device),
    )
    if nsplit > 1 and ticket is None:  # captured before the tickets existed: combine in a second launch
        _combine_kernel[(rows, n_hb)](acc, m, den, sinks, out, length, n, h, d, E, K, int(rate), tiles_per_split,
                                      h * d, d, D=D, HP=hp, BLOCK_H=BLOCK_H, BLOCK_L=block_l, WIN_TILES=win_tiles,
                                      MODE=mode, NSPLIT=nsplit, num_warps=num_warps, **pdl.launch_args(q.device))
    return out


@compressed_attention.register_kernel("cuda")
def _compressed_attention_cuda(q, kv, ring, length, entries, picks, sinks, scale, window, rate):
    check_compressed_attention_inputs(q, kv, ring, length, entries, picks, sinks, window, rate)
    if q.dtype not in _DTYPES or len({q.dtype, kv.dtype, ring.dtype}
                                       | ({entries.dtype} if entries is not None else set())) != 1:
        return compressed_attention_reference(q, kv, ring, length, entries, picks, sinks, scale, window, rate)
    if picks is not None and picks.stride(-1) != 1:
        picks = picks.contiguous()
    if entries is not None and entries.stride(-1) != 1:
        entries = entries.contiguous()
    with torch.cuda.device(q.device):  # Triton launches on the current device
        return compressed_attention_triton(q, kv, ring, length, entries, picks, sinks, scale, window, rate)
