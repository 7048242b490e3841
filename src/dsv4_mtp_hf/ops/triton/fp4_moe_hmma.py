"""fp16 ``mma.sync`` kernels of ``dsv4_mtp::fp4_moe`` (the T=3..16 NVFP4 / T=2..64 MXFP4 regime).

FP4 decoded straight to fp16 MMA operands (``decode_ptx.HG_DECODE``, 10 integer instructions per 8
weights), block scales applied in fp32 to the MMA results: ~1.8 SASS instructions per weight in the
K loop, against ~4.7 for the tl.dot kernels, which are issue-bound at these sizes.

Lane layout (one warp = 8 lane groups g of 4 lanes q; lane = 4 g + q; m16n8k16 fragments: A rows g /
g + 8 of a lane group are its "row a" / "row b", lane q holds K slots {2q, 2q+1, 2q+8, 2q+9} of A and
of B):

* Rows: gate/up: row a = gate row n, row b = up row n (8 per warp); down: output rows r and r + 8 NW.
* K: a row is cut into 16-byte chunks (32 weights); an iteration covers 4 NSUB adjacent chunks, lane q
  taking chunks q, q + 4, ...  Per word of a chunk, MMA 1 takes A = {a(K0,K4), b(K0,K4), a(K1,K5),
  b(K1,K5)}, B = {x(K0,K4), x(K1,K5)}; MMA 2 the (K2,K6), (K3,K7) pairs (``mma_ptx.hmma_asm``).
* Scale groups: lanes q = 0..3 hold different chunks, i.e. different block scales, so an MMA over all
  16 K slots would mix four groups.  Instead B column j = 2 q' + h is the activation of token h (of
  this pass) in quarter q' only: lane (j, j // 2) feeds it, every other lane feeds zeros.  So lane
  (g, q) ends with c0 / c1 = row a x tokens 0 / 1 and c2 / c3 = row b x tokens 0 / 1 of its own chunk,
  scaled in fp32 per group, summed over its chunks, then over the row's 4 lanes.  The price: 2 tokens
  per pass (an expert with more tokens runs several passes).

Staged loop: the K loop is a ``tl.range(num_stages=STAGES)`` loop of plain loads, which Triton's
pipeliner turns into a ring of asynchronous copies.  To keep the copies few and 16 bytes wide: the B
operands are copied once per B column (``_feeder_chunk``; same-address copies by every lane would
serialise), their pointers carry a ``tl.multiple_of`` hint, and each lane copies its row's scale window
of the iteration and picks its bytes in registers (``_ld_s_window``).  The zeroing of non-feeding lanes
is an integer multiply (FMA pipe), not a select: the loop is bound by the integer ALU pipe.

Activations (fp16, "pair order": per 8 K values x0 x4 x1 x5 x2 x6 x3 x7, one 16-byte load per word's
two MMAs): ``_x_f16_kernel`` writes ``xh[t] = x[t] * 2**s_t`` with s_t from the token's max |x| (so
bf16 -> fp16 is exact in the normal range) and zero rows ``xh[T]``, ``act[P]`` (the zero B operands).
The gate/up epilogue writes ``act = silu(min(g, L)) * clamp(u, -L, L) * 2**SA`` (fp16), SA static from
the limit (``act_prescale``; no finite limit, no static bound: the op takes the tl.dot kernels).  The
routing weight goes into the down epilogue (y = rw * gw * acc * 2**(14 - SA)).

Numerics: weights e2m1 x 2**-14 (codes +-0.5 are fp16 subnormals, which the tensor cores keep), exact
products, fp32 accumulation, block scale, running sum, global scale, 2**-14 and 2**-s in fp32.  Small
act values (below 2**-23 for L = 10) lose relative precision as fp16 subnormals (absolute error < 2**-34).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .mma_ptx import HMMA_CONSTRAINTS, hmma_asm
from .moe_pairs import _expert_rows, _lanes, _pick, _rank_pairs, _ticket_sum
from .pdl import launch_args, wait

_HM_NV = tl.constexpr(hmma_asm("nvfp4"))
_HM_MX = tl.constexpr(hmma_asm("mxfp4"))
_HM_C = tl.constexpr(HMMA_CONSTRAINTS)

# One launch configuration per format, gate/up and down alike: warps per program, 16-byte chunks per
# lane per iteration, ring buffers, register cap (measured best on the H200: NVFP4 5 programs per SM
# at 96 registers; MXFP4 7 programs with a 2-stage ring at 72 beat a deeper ring).
HMMA_CONFIG = {
    "nvfp4": dict(num_warps=4, nsub=2, stages=3, maxnreg=96),
    "mxfp4": dict(num_warps=4, nsub=4, stages=2, maxnreg=72),
}
F16_MAX = 65504.0


def act_prescale(limit: float) -> int | None:
    """Static exponent SA with |silu(min(g, L)) * clamp(u, -L, L)| * 2**SA <= 65504 (fp16), or None
    (no finite positive limit, or SA out of range)."""
    if not (isinstance(limit, (int, float)) and math.isfinite(limit) and limit > 0):
        return None
    silu = limit / (1.0 + math.exp(-limit))
    bound = limit * max(silu, 0.2785)  # silu >= -0.27846 below zero
    sa = math.floor(math.log2(F16_MAX * (1 - 1e-3) / bound))
    return sa if -60 <= sa <= 60 else None


def hmma_supports(hidden: int, intermediate: int, fmt: str) -> bool:
    """Whether the kernels tile these sizes: K a multiple of 128 NSUB per matrix, gate/up rows of
    8 NW, down rows of 16 NW (multiples of 512 do: V4-Flash, V4-Pro)."""
    c = HMMA_CONFIG[fmt]
    nw, ns = c["num_warps"], c["nsub"]
    return (hidden % (128 * ns) == 0 and intermediate % (8 * nw) == 0
            and intermediate % (128 * ns) == 0 and hidden % (16 * nw) == 0)


@triton.jit
def _pair_pos(k):
    """Position of K index k in the pair-order layout (per 8: x0 x4 x1 x5 x2 x6 x3 x7)."""
    return (k // 8) * 8 + (k % 4) * 2 + (k // 4) % 2


@triton.jit
def _x_f16_kernel(x_ptr, xh_ptr, xs_ptr, act_ptr, T, P, D: tl.constexpr, I: tl.constexpr,
                  DP: tl.constexpr, IP: tl.constexpr, PDL: tl.constexpr = False):
    """xh[t] = fp16(x[t] * 2**s_t) in pair order and s_t (program t < T); zero rows xh[T], act[P]."""
    wait(PDL)
    t = tl.program_id(0)
    k = tl.arange(0, DP)
    ok = k < D
    if t < T:
        xv = tl.load(x_ptr + t.to(tl.int64) * D + k, mask=ok, other=0.0).to(tl.float32)
        m = tl.max(tl.abs(xv), axis=0)
        e = (m.to(tl.int32, bitcast=True) >> 23) & 255
        s = tl.minimum(tl.maximum(141 - e, -120), 120)  # max|x| * 2**s < 2**15
        xh = (xv * ((127 + s) << 23).to(tl.float32, bitcast=True)).to(tl.float16)
        tl.store(xh_ptr + t.to(tl.int64) * D + _pair_pos(k), xh, mask=ok)
        tl.store(xs_ptr + t, s)
    else:
        tl.store(xh_ptr + t.to(tl.int64) * D + k, tl.zeros((DP,), dtype=tl.float16), mask=ok)
        i = tl.arange(0, IP)
        tl.store(act_ptr + P * I + i, tl.zeros((IP,), dtype=tl.float16), mask=i < I)  # P * I < 2**31


@triton.jit
def _chunk(acc, w, s, x, j: tl.constexpr, NSUB: tl.constexpr, IS_NV: tl.constexpr):
    """acc (c0, c1, c2, c3) + chunk j of this iteration (rows a, b) against its activations."""
    a: tl.constexpr = 4 * j  # (annotated: a plain assignment would make them tensors)
    b: tl.constexpr = 4 * (NSUB + j)
    xo: tl.constexpr = 16 * j
    ops = [acc[0], acc[1], acc[2], acc[3], w[a], w[a + 1], w[a + 2], w[a + 3], w[b], w[b + 1], w[b + 2], w[b + 3],
           x[xo], x[xo + 1], x[xo + 2], x[xo + 3], x[xo + 4], x[xo + 5], x[xo + 6], x[xo + 7],
           x[xo + 8], x[xo + 9], x[xo + 10], x[xo + 11], x[xo + 12], x[xo + 13], x[xo + 14], x[xo + 15],
           s[j], s[NSUB + j]]
    if IS_NV:
        return tl.inline_asm_elementwise(_HM_NV, _HM_C, ops, dtype=(tl.float32,) * 4, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_HM_MX, _HM_C, ops, dtype=(tl.float32,) * 4, is_pure=True, pack=1)


@triton.jit
def _split4(t):
    """[NT, 4] -> its four columns as [NT] tensors."""
    ev, od = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))  # words (0, 2), (1, 3)
    w0, w2 = tl.split(ev)
    w1, w3 = tl.split(od)
    return w0, w1, w2, w3


@triton.jit
def _words4(p):
    """Four int32 words from ``p [NT]`` (16-byte aligned): one 16-byte plain load per lane (so the
    pipeliner can make it asynchronous), as 4 tensors [NT]."""
    return _split4(tl.load(p[:, None] + tl.arange(0, 4)[None, :]))


@triton.jit
def _ld_w_words(p, ROWB: tl.constexpr, NSUB: tl.constexpr):
    """An iteration's weights: NSUB chunks 4 chunks apart of row a, then of row b, 4 words per chunk."""
    S: tl.constexpr = 16  # words from one of the lane's chunks to the next (4 chunks of 4 words)
    B: tl.constexpr = ROWB // 4
    if NSUB == 2:
        return _words4(p) + _words4(p + S) + _words4(p + B) + _words4(p + B + S)
    else:
        tl.static_assert(NSUB == 4, "the staged loop takes nsub 2 or 4")
        return (_words4(p) + _words4(p + S) + _words4(p + 2 * S) + _words4(p + 3 * S) + _words4(p + B)
                + _words4(p + B + S) + _words4(p + B + 2 * S) + _words4(p + B + 3 * S))


@triton.jit
def _to_lanes(v):
    """A chunk's B-operand words per column, broadcast to every lane (``v [NW, 8, 4, 16]``) -> the lanes'
    words: lane (g, q) keeps column g's if it feeds it (q == g // 2), else zeros; as 16 [NT] tensors.
    The zeroing is an integer multiply by 0 / 1 (IMAD, FMA pipe), not a select (integer ALU pipe)."""
    NW: tl.constexpr = v.shape[0]
    g = tl.arange(0, 8)[None, :, None, None]
    q = tl.arange(0, 4)[None, None, :, None]
    keep = tl.broadcast_to((q == g // 2).to(tl.int32), v.shape)
    lanes = tl.inline_asm_elementwise("mul.lo.u32 $0, $1, $2;", "=r,r,r", [v, keep], dtype=tl.int32,
                                      is_pure=True, pack=1)
    # [NT, 16] -> four [NT, 4] groups of words (word 4 (2 hi + lo) + i at [:, i, hi, lo])
    lo0, lo1 = tl.split(tl.permute(tl.reshape(lanes, (32 * NW, 2, 2, 4)), (0, 3, 1, 2)))
    g0, g2 = tl.split(lo0)
    g1, g3 = tl.split(lo1)
    return _split4(g0) + _split4(g1) + _split4(g2) + _split4(g3)


@triton.jit
def _feeder_chunk(p8, f8, o: tl.constexpr, NW: tl.constexpr):
    """One chunk's 16 words of B operands at ``p8 [NW, 8] + o`` (column j's feeder's pointer), copied
    once per column (masked by ``f8``), not once per lane, and handed to the lanes."""
    v = tl.load(p8[:, :, None] + (o + tl.arange(0, 16))[None, None, :], mask=f8[:, :, None], other=0)  # [NW, 8, 16]
    return _to_lanes(tl.broadcast_to(v[:, :, None, :], (NW, 8, 4, 16)))


@triton.jit
def _ld_x_feeders(p8, f8, NSUB: tl.constexpr, NW: tl.constexpr):
    """An iteration's B operands: 16 words per chunk (NSUB chunks, 4 chunks apart)."""
    S: tl.constexpr = 64
    if NSUB == 2:
        return _feeder_chunk(p8, f8, 0, NW) + _feeder_chunk(p8, f8, S, NW)
    else:
        tl.static_assert(NSUB == 4, "the staged loop takes nsub 2 or 4")
        return (_feeder_chunk(p8, f8, 0, NW) + _feeder_chunk(p8, f8, S, NW)
                + _feeder_chunk(p8, f8, 2 * S, NW) + _feeder_chunk(p8, f8, 3 * S, NW))


@triton.jit
def _per_column(v, NW: tl.constexpr):
    """[NT] per-lane values -> [NW, 8] the value of B column j's feeder lane (g = j, q = j // 2)."""
    g = tl.arange(0, 8)[None, :, None]
    q = tl.arange(0, 4)[None, None, :]
    return tl.sum(tl.where(q == g // 2, tl.reshape(v, (NW, 8, 4)), 0), axis=2)


@triton.jit
def _pick_word(win, i, W0: tl.constexpr, SW: tl.constexpr):
    """``win [NT, NWW]`` -> [NT] word ``W0 + i`` per lane (``0 <= i < SW``), selected in registers; the
    static range test lets the compiler drop the selects outside W0 .. W0 + SW - 1."""
    c = tl.arange(0, win.shape[1])[None, :]
    hit = (c >= W0) & (c < W0 + SW) & (c - W0 == i[:, None])
    return tl.sum(tl.where(hit, win, 0), axis=1)


@triton.jit
def _ld_s_window(p, kl, SROWB: tl.constexpr, NSUB: tl.constexpr, IS_NV: tl.constexpr):
    """An iteration's scale window of rows a and b (``p``: int32 pointers to row a's; 4 NSUB chunks of
    SB bytes, in 16-byte copies) and of it the lane's NSUB raw scales per row (chunks kl + 4 j)."""
    SB: tl.constexpr = 2 if IS_NV else 1
    NWW: tl.constexpr = 4 * NSUB * SB // 4  # words per row and iteration
    MASK: tl.constexpr = 0xFFFF if IS_NV else 0xFF
    # chunk kl + 4 j's bytes lie in words j SW .. j SW + SW - 1; the window is copied in pieces of at most
    # 4 words (one 16-byte copy per thread: a wider tensor is split across threads, then picked via shuffles)
    SW: tl.constexpr = NWW // NSUB
    PW: tl.constexpr = 4 if NWW > 4 else NWW
    tl.static_assert(SW <= PW, "a chunk column's scale words must lie in one 16-byte piece of the window")
    pa = ()
    pb = ()
    for i in tl.static_range(NWW // PW):
        pa = pa + (tl.load(p[:, None] + (i * PW + tl.arange(0, PW))[None, :]),)
        pb = pb + (tl.load(p[:, None] + (SROWB // 4 + i * PW + tl.arange(0, PW))[None, :]),)
    byte = kl * SB
    sh = (byte % 4) * 8
    ra = ()
    rb = ()
    for j in tl.static_range(NSUB):
        ra = ra + (((_pick_word(pa[j * SW // PW], byte // 4, j * SW % PW, SW) >> sh) & MASK),)
        rb = rb + (((_pick_word(pb[j * SW // PW], byte // 4, j * SW % PW, SW) >> sh) & MASK),)
    return ra + rb


@triton.jit
def _k_loop(wa, s_ptr, soff, kl, xb, xoff, feed, NIT: tl.constexpr, ROWB: tl.constexpr, SROWB: tl.constexpr,
            NSUB: tl.constexpr, IS_NV: tl.constexpr, NW: tl.constexpr, STAGES: tl.constexpr):
    """This lane's chunks of rows a and b (their scale windows at ``s_ptr + soff``) against its B
    operands (``xb + xoff``, fp16): (c0, c1, c2, c3) per lane."""
    SB: tl.constexpr = 2 if IS_NV else 1
    z = tl.zeros((32 * NW,), dtype=tl.float32)
    acc = (z, z, z, z)
    wa32 = wa.to(tl.pointer_type(tl.int32), bitcast=True)
    sa32 = s_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + soff // 4
    x32 = xb.to(tl.pointer_type(tl.int32), bitcast=True)
    # B column pointers rebuilt from offsets (multiples of 32 fp16) with an alignment hint: 16-byte copies
    p8 = x32 + tl.multiple_of(_per_column(xoff, NW) // 2, [16, 16])
    f8 = _per_column(feed.to(tl.int32), NW) != 0
    for it in tl.range(NIT, num_stages=STAGES):
        s = _ld_s_window(sa32 + it * (SB * NSUB), kl, SROWB, NSUB, IS_NV)
        w = _ld_w_words(wa32 + it * (16 * NSUB), ROWB, NSUB)
        x = _ld_x_feeders(p8 + it * (64 * NSUB), f8, NSUB, NW)
        for j in tl.static_range(NSUB):
            acc = _chunk(acc, w, s, x, j, NSUB, IS_NV)
    return acc


@triton.jit
def _rows_sum(c, RG: tl.constexpr):
    """[NT] per-lane partial sums -> [8 RG] per row (over the row's 4 lanes)."""
    return tl.reshape(tl.sum(tl.reshape(c, (RG, 8, 4)), axis=2), (8 * RG,))


@triton.jit
def _b_row(pairs8, g, c0r, count, ZROW, q, DIV: tl.constexpr):
    """Row of the activation buffer this lane feeds as B: token (DIV = TOPK) or pair (DIV = 1) of rank
    c0r + g % 2 if the lane is column g's feeder (q == g // 2) and the rank exists, else the zero row."""
    h = g % 2
    src = _pick(pairs8, h) // DIV
    return tl.where((q == g // 2) & (c0r + h < count), src, ZROW).to(tl.int64)


@triton.jit
def _pair_of(pairs8, h: tl.constexpr):
    return tl.sum(tl.where(tl.arange(0, 8) == h, pairs8, 0), axis=0)


@triton.jit
def _gate_up_hmma_kernel(
    xh_ptr, xs_ptr, ids_ptr, w_ptr, s_ptr, g_ptr, act_ptr, P,
    I: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr, PB: tl.constexpr, IS_NV: tl.constexpr,
    LIMIT: tl.constexpr, ASCALE: tl.constexpr, NW: tl.constexpr, NSUB: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait(PDL)
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, pid_p, P, PB)
    if earlier == 0:
        HB: tl.constexpr = D // 2  # bytes per weight row
        SR: tl.constexpr = D // (16 if IS_NV else 32)  # scale bytes per row
        wid, g, q = _lanes(NW)
        n = pid_n * (8 * NW) + wid * 8 + g
        row = e * (2 * I) + n.to(tl.int64)
        wa = w_ptr + row * HB + q * 16  # lane q's first chunk
        soff = row * SR  # the row's scale window
        gg = tl.load(g_ptr + 2 * e) * 16384.0  # undoes the decode's 2**-14
        gu = tl.load(g_ptr + 2 * e + 1) * 16384.0
        no = pid_n * (8 * NW) + tl.arange(0, 8 * NW)  # rows of the reduced result
        T = P // TOPK
        c0r = count * 0
        while c0r < count:  # passes of 2 tokens (ranks c0r, c0r + 1)
            pairs8 = _rank_pairs(offs, match, rank, c0r)
            brow = _b_row(pairs8, g, c0r, count, T, q, TOPK)
            acc = _k_loop(wa, s_ptr, soff, q, xh_ptr, brow * D + q * 32, brow != T, D // (128 * NSUB), I * HB,
                          I * SR, NSUB, IS_NV, NW, STAGES)
            for h in tl.static_range(2):
                pair = _pair_of(pairs8, h)
                ok = c0r + h < count
                s_t = tl.load(xs_ptr + pair // TOPK)
                undo = ((127 - s_t) << 23).to(tl.float32, bitcast=True)  # 2**-s, s in [-120, 120]
                gv = tl.minimum(_rows_sum(acc[h], NW) * undo * gg, LIMIT)
                uv = _rows_sum(acc[2 + h], NW) * undo * gu
                uv = tl.minimum(tl.maximum(uv, -LIMIT), LIMIT)
                a = gv / (1.0 + tl.exp(-gv)) * uv * ASCALE  # 2**SA
                tl.store(act_ptr + pair.to(tl.int64) * I + _pair_pos(no), a.to(tl.float16), mask=ok)
            c0r += 2


@triton.jit
def _down_hmma_kernel(
    act_ptr, ids_ptr, rw_ptr, w_ptr, s_ptr, g_ptr, y_ptr, out_ptr, tk_ptr, P,
    I: tl.constexpr, D: tl.constexpr, PB: tl.constexpr, IS_NV: tl.constexpr, YSCALE: tl.constexpr,
    NW: tl.constexpr, NSUB: tl.constexpr, STAGES: tl.constexpr, TOPK: tl.constexpr, TICKET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait(PDL)
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, pid_p, P, PB)
    if earlier == 0:
        HB: tl.constexpr = I // 2
        SR: tl.constexpr = I // (16 if IS_NV else 32)
        wid, g, q = _lanes(NW)
        r1 = pid_n * (16 * NW) + wid * 8 + g  # output rows r1 (a) and r1 + 8 NW (b)
        row = e * D + r1.to(tl.int64)
        wa = w_ptr + row * HB + q * 16
        soff = row * SR
        gw = tl.load(g_ptr + e) * YSCALE  # 2**(14 - SA): undoes the decode's 2**-14 and act's 2**SA
        ro = pid_n * (16 * NW) + tl.arange(0, 8 * NW)
        c0r = count * 0
        while c0r < count:
            pairs8 = _rank_pairs(offs, match, rank, c0r)
            brow = _b_row(pairs8, g, c0r, count, P, q, 1)
            acc = _k_loop(wa, s_ptr, soff, q, act_ptr, brow * I + q * 32, brow != P, I // (128 * NSUB),
                          8 * NW * HB, 8 * NW * SR, NSUB, IS_NV, NW, STAGES)
            for h in tl.static_range(2):
                pair = _pair_of(pairs8, h)
                ok = c0r + h < count
                f = tl.load(rw_ptr + pair, mask=ok, other=0.0) * gw  # routing weight after w2 (fp32)
                dst = y_ptr + pair.to(tl.int64) * D + ro
                tl.store(dst, _rows_sum(acc[h], NW) * f, mask=ok)
                tl.store(dst + 8 * NW, _rows_sum(acc[2 + h], NW) * f, mask=ok)
            if TICKET:  # each token's last pair sums its k rows of this 16 NW-row tile into out
                for h in tl.static_range(2):
                    if c0r + h < count:
                        _ticket_sum(y_ptr, out_ptr, tk_ptr, _pair_of(pairs8, h), pid_n, D // (16 * NW), D, TOPK,
                                    16 * NW)
            c0r += 2


def launch_hmma(x, ids, rw, w13, w13_scale, w13_global, w2, w2_scale, w2_global, y, out, tickets, *, k, fmt, limit):
    """Prologue, gate/up and down kernels into ``y`` [P, D] fp32; with ``tickets`` the down kernel also
    writes the token sums into ``out`` (else that is the caller's ``_sum_kernel``)."""
    p = ids.numel()
    t, d = x.shape
    inter = w2.shape[-1] * 2
    sa = act_prescale(limit)
    if sa is None or not hmma_supports(d, inter, fmt):
        raise ValueError(f"fp4_moe (hmma kernels, {fmt}): D={d} / I={inter} / swiglu_limit={limit} not supported "
                         f"(needs a finite limit and sizes that are multiples of 512); use the tl.dot kernels.")
    for name, ten, al in (("w13", w13, 16), ("w2", w2, 16), ("w13_scale", w13_scale, 2), ("w2_scale", w2_scale, 2)):
        if ten.data_ptr() % al:
            raise ValueError(f"fp4_moe (hmma kernels): {name} must be {al}-byte aligned (call .contiguous() on a "
                             "fresh allocation).")
    c = HMMA_CONFIG[fmt]
    nw, nsub = c["num_warps"], c["nsub"]
    is_nv = fmt == "nvfp4"
    dev = x.device
    xh = torch.empty(t + 1, d, dtype=torch.float16, device=dev)
    xs = torch.empty(t, dtype=torch.int32, device=dev)
    act16 = torch.empty(p + 1, inter, dtype=torch.float16, device=dev)
    pb = max(16, triton.next_power_of_2(p))
    pdl_kw = launch_args(dev)
    kw = dict(NW=nw, NSUB=nsub, STAGES=c["stages"], num_warps=nw, num_stages=1, maxnreg=c["maxnreg"], **pdl_kw)
    _x_f16_kernel[(t + 1,)](x, xh, xs, act16, t, p, d, inter, DP=triton.next_power_of_2(d),
                            IP=triton.next_power_of_2(inter), num_warps=4, **pdl_kw)
    _gate_up_hmma_kernel[(p, inter // (8 * nw))](
        xh, xs, ids, w13.view(torch.uint8), w13_scale.view(torch.uint8), w13_global.float().contiguous(), act16, p,
        inter, d, TOPK=k, PB=pb, IS_NV=is_nv, LIMIT=float(limit), ASCALE=2.0**sa, **kw,
    )
    ticket = tickets is not None
    _down_hmma_kernel[(p, d // (16 * nw))](
        act16, ids, rw, w2.view(torch.uint8), w2_scale.view(torch.uint8), w2_global.float().contiguous(), y,
        out, tickets if ticket else ids, p, inter, d, PB=pb, IS_NV=is_nv, YSCALE=2.0 ** (14 - sa),
        TOPK=k, TICKET=ticket, **kw,
    )
