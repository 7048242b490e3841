"""Triton kernels behind ``dsv4_mtp::compressor_step`` (``ops/compressor.py``): two launches a stream and step.

``_pool_kernel``, grid ``(B, NW)``: a program computes one window that the step may close -- its ``rate`` (CSA:
``2 * rate``, the previous window's Ca half first) raw rows from the ring or the step's rows, the gate plus the
position bias, a softmax over the rows per channel, the pooled row, RMSNorm, and RoPE on the trailing channels --
and writes the entry.  A window the step leaves open is skipped (the reference writes it to the spare entry,
which nothing reads): an HCA layer computes its 128-row window once every 128 tokens.  Two passes over the rows, as the reference rounds:
the softmax's max and sum, then the probabilities rounded to the rows' dtype times the rows, rounded, summed in
fp32.  RoPE pairs neighbouring channels: the normed row is stored, then its RoPE channels are read back in pairs
(a barrier between: the same program's threads).

``_ring_kernel``, grid ``(B,)``: the step's rows into the rings, after every window read them (a step of
``max_rollback + 1`` rows may overwrite the slot of the oldest row a window reads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait
from ..compressor import check_compressor_inputs, compressor_step_op, compressor_step_reference

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rows(b, first, L, n, R, rate, d, skv_b, skv_n, sr_b, sr_l, sl, OVERLAP: tl.constexpr):
    """Slots ``sl``' raw-row offsets into the ring and into the step's rows, which to take, the column offset
    (CSA: the Cb half for this window's rows), the position-bias row and whether the slot exists."""
    if OVERLAP:  # slots [0, rate): window first - 1's rows, Ca half; [rate, 2 rate): this window's, Cb half
        half = (sl >= rate).to(tl.int64)
        pos = (first - 1 + half) * rate + sl - half * rate
        col = half * d
        bias_row = sl - half * rate
        valid = (sl < 2 * rate) & ((first >= 1) | (half == 1))
    else:
        pos = first * rate + sl
        col = sl * 0
        bias_row = sl
        valid = sl < rate
    from_ring = pos < L
    ring_off = b * sr_b + tl.where(pos >= 0, pos % R, 0) * sr_l
    new_off = b * skv_b + tl.maximum(pos - L, 0) * skv_n  # a closing window's rows end within the step
    return ring_off, new_off, from_ring, col, bias_row, valid


@triton.jit
def _load(ptr, ring_ptr, ring_off, new_off, from_ring, col, valid, j, jm):
    ring_v = tl.load(ring_ptr + ring_off[:, None] + col[:, None] + j[None, :],
                     mask=(valid & from_ring)[:, None] & jm[None, :], other=0.0)
    new_v = tl.load(ptr + new_off[:, None] + col[:, None] + j[None, :],
                    mask=(valid & ~from_ring)[:, None] & jm[None, :], other=0.0)
    return tl.where(from_ring[:, None], ring_v, new_v)


@triton.jit
def _gate(gate_ptr, rgate_ptr, bias_ptr, ring_off, new_off, from_ring, col, bias_row, valid, j, jm, c,
          ROUND_GATE: tl.constexpr):
    """The slots' gates plus the position bias in fp32 (rounded to the gates' dtype when the bias has it too, as
    torch adds them); ``-inf`` where a slot does not exist."""
    g = _load(gate_ptr, rgate_ptr, ring_off, new_off, from_ring, col, valid, j, jm)
    bias = tl.load(bias_ptr + bias_row[:, None] * c + col[:, None] + j[None, :], mask=valid[:, None] & jm[None, :],
                   other=0.0)
    s = g.to(tl.float32) + bias.to(tl.float32)
    if ROUND_GATE:
        s = s.to(g.dtype).to(tl.float32)
    return tl.where(valid[:, None], s, float("-inf"))


@triton.jit
def _pool_kernel(kv_ptr, gate_ptr, len_ptr, rkv_ptr, rgate_ptr, ent_ptr, bias_ptr, w_ptr, cos_ptr, sin_ptr,
                 n, R, rate, d, c, eps, half_rope,
                 skv_b, skv_n, sr_b, sr_l, se_b, se_l, scs_b, scs_w,
                 OVERLAP: tl.constexpr, SLOTS: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                 HALF_ROPE: tl.constexpr, ROUND_GATE: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1)
    L = tl.load(len_ptr + b)
    first = L // rate + w
    if first < (L + n) // rate:  # a window left open is not computed (the reference's spare entry is scratch)
        _pool_window(kv_ptr, gate_ptr, rkv_ptr, rgate_ptr, ent_ptr, bias_ptr, w_ptr, cos_ptr, sin_ptr, b, w, first, L,
                     n, R, rate, d, c, eps, half_rope, skv_b, skv_n, sr_b, sr_l, se_b, se_l, scs_b, scs_w,
                     OVERLAP, SLOTS, BS, D, HALF_ROPE, ROUND_GATE)


@triton.jit
def _pool_window(kv_ptr, gate_ptr, rkv_ptr, rgate_ptr, ent_ptr, bias_ptr, w_ptr, cos_ptr, sin_ptr, b, w, first, L,
                 n, R, rate, d, c, eps, half_rope, skv_b, skv_n, sr_b, sr_l, se_b, se_l, scs_b, scs_w,
                 OVERLAP: tl.constexpr, SLOTS: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                 HALF_ROPE: tl.constexpr, ROUND_GATE: tl.constexpr):
    """Window ``first``'s entry: the two passes, RMSNorm, RoPE."""
    j = tl.arange(0, D)
    jm = j < d
    m = tl.full([D], -1e30, dtype=tl.float32)
    den = tl.zeros([D], dtype=tl.float32)
    for s0 in tl.static_range(0, SLOTS, BS):  # pass 1: the softmax's max and sum per channel
        sl = s0 + tl.arange(0, BS)
        ring_off, new_off, from_ring, col, bias_row, valid = _rows(b, first, L, n, R, rate, d, skv_b, skv_n, sr_b,
                                                                   sr_l, sl, OVERLAP)
        g = _gate(gate_ptr, rgate_ptr, bias_ptr, ring_off, new_off, from_ring, col, bias_row, valid, j, jm, c,
                  ROUND_GATE)
        m_new = tl.maximum(m, tl.max(g, axis=0))
        den = den * tl.exp(m - m_new) + tl.sum(tl.exp(g - m_new[None, :]), axis=0)
        m = m_new
    pooled = tl.zeros([D], dtype=tl.float32)
    for s0 in tl.static_range(0, SLOTS, BS):  # pass 2: probabilities (rounded) times the rows (rounded), summed
        sl = s0 + tl.arange(0, BS)
        ring_off, new_off, from_ring, col, bias_row, valid = _rows(b, first, L, n, R, rate, d, skv_b, skv_n, sr_b,
                                                                   sr_l, sl, OVERLAP)
        g = _gate(gate_ptr, rgate_ptr, bias_ptr, ring_off, new_off, from_ring, col, bias_row, valid, j, jm, c,
                  ROUND_GATE)
        x = _load(kv_ptr, rkv_ptr, ring_off, new_off, from_ring, col, valid, j, jm)
        p = (tl.exp(g - m[None, :]) / den[None, :]).to(x.dtype).to(tl.float32)
        pooled += tl.sum((x.to(tl.float32) * p).to(x.dtype).to(tl.float32), axis=0)  # torch's rounded product
    row = ent_ptr + b * se_b + first.to(tl.int64) * se_l
    pf = pooled.to(ent_ptr.dtype.element_ty).to(tl.float32)
    var = tl.sum(tl.where(jm, pf * pf, 0.0), axis=0) / d
    wt = tl.load(w_ptr + j, mask=jm, other=0.0).to(tl.float32)
    normed = (wt * (pf * tl.rsqrt(var + eps))).to(ent_ptr.dtype.element_ty)
    tl.store(row + j, normed, mask=jm)
    tl.debug_barrier()  # the normed row is in memory: RoPE reads its channels back in pairs
    t = tl.arange(0, HALF_ROPE)
    tm = t < half_rope
    at = row + d - 2 * half_rope + 2 * t
    a = tl.load(at, mask=tm, other=0.0).to(tl.float32)
    bb = tl.load(at + 1, mask=tm, other=0.0).to(tl.float32)
    cs = tl.load(cos_ptr + b * scs_b + w * scs_w + t, mask=tm, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + b * scs_b + w * scs_w + t, mask=tm, other=0.0).to(tl.float32)
    tl.debug_barrier()  # every thread read its pair before any writes
    tl.store(at, (a * cs - bb * sn).to(ent_ptr.dtype.element_ty), mask=tm)
    tl.store(at + 1, (bb * cs + a * sn).to(ent_ptr.dtype.element_ty), mask=tm)


@triton.jit
def _ring_kernel(kv_ptr, gate_ptr, len_ptr, rkv_ptr, rgate_ptr, n, R, c, kept, skv_b, skv_n, sr_b, sr_l,
                 C: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    L = tl.load(len_ptr + b)
    j = tl.arange(0, C)
    jm = j < c
    for t in range(0, kept):
        src = b * skv_b + (n - kept + t) * skv_n + j
        dst = b * sr_b + ((L + n - kept + t) % R) * sr_l + j
        tl.store(rkv_ptr + dst, tl.load(kv_ptr + src, mask=jm), mask=jm)
        tl.store(rgate_ptr + dst, tl.load(gate_ptr + src, mask=jm), mask=jm)


def compressor_step_triton(kv, gate, length, ring_kv, ring_gate, entries, position_bias, norm_weight, cos, sin,
                           rate: int, overlap: bool, eps: float) -> None:
    """The two launches on contiguous inputs (the caller checked them)."""
    b, n, c = kv.shape
    d, R = entries.shape[-1], ring_kv.shape[1]
    nw = (rate - 1 + n) // rate
    D = triton.next_power_of_2(max(d, 16))
    slots = triton.next_power_of_2(2 * rate if overlap else rate)
    bs = max(1, min(slots, 4096 // D))
    half = cos.shape[-1]
    kw = pdl.launch_args(kv.device)
    _pool_kernel[(b, nw)](
        kv, gate, length, ring_kv, ring_gate, entries, position_bias, norm_weight, cos, sin,
        n, R, rate, d, c, float(eps), half,
        kv.stride(0), kv.stride(1), ring_kv.stride(0), ring_kv.stride(1), entries.stride(0), entries.stride(1),
        cos.stride(0), cos.stride(1),
        OVERLAP=bool(overlap), SLOTS=slots, BS=bs, D=D, HALF_ROPE=triton.next_power_of_2(max(half, 1)),
        ROUND_GATE=position_bias.dtype == gate.dtype and gate.dtype != torch.float32, num_warps=4, **kw)
    _ring_kernel[(b,)](kv, gate, length, ring_kv, ring_gate, n, R, c, min(n, R), kv.stride(0), kv.stride(1),
                       ring_kv.stride(0), ring_kv.stride(1), C=triton.next_power_of_2(max(c, 16)), num_warps=4, **kw)


@compressor_step_op.register_kernel("cuda")
def _compressor_step_cuda(kv, gate, length, ring_kv, ring_gate, entries, position_bias, norm_weight, cos, sin,
                          rate, overlap, eps):
    check_compressor_inputs(kv, gate, length, ring_kv, ring_gate, entries, position_bias, norm_weight, cos, sin, rate,
                            overlap)
    state = (ring_kv, ring_gate, entries)
    if kv.dtype not in _DTYPES or any(t.dtype != kv.dtype or not t.is_contiguous() for t in state):
        compressor_step_reference(kv, gate, length, ring_kv, ring_gate, entries, position_bias, norm_weight, cos, sin,
                                  rate, overlap, eps)
        return
    with torch.cuda.device(kv.device):
        compressor_step_triton(kv.contiguous(), gate.contiguous(), length, ring_kv, ring_gate, entries,
                               position_bias.contiguous(), norm_weight, cos.contiguous(), sin.contiguous(), rate,
                               overlap, eps)
