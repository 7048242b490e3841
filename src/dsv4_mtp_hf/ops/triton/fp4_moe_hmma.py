"""Opt-in small-batch path of ``dsv4_mtp::fp4_moe`` on CUDA: FP4 decoded straight to fp16
``mma.sync`` operands, block scales applied in fp32 to the MMA results (exact products, fp32
accumulation): 1.81 (NVFP4) / 1.71 (MXFP4) SASS instructions per weight in the K loops.

Status (2026-11-30): exact on the H200 (tests/test_fp4_moe_hmma.py ``-m gpu``: 41 passed, the
tensor cores keep fp16 subnormal weights) but not faster: 55.0 / 53.1 µs at T=1 (``hm`` / ``hm_pf2``)
against 53.0 for the default kernels and 47.3 for the fp16x2 GEMV (BENCHMARKS.md, fifth session) --
at T=1 the MoE is bound by memory latency, not by issue.  Off by default
(``fp4_moe_triton.CONFIG["hmma_min_tokens"] .. ["hmma_max_tokens"]``); ``CONFIG["hmma"]`` overrides
``HMMA_CONFIG``.  Static SASS, V4-Flash, T=1 (``benchmarks/sass_count.py``): gate/up 1.81 / 1.71,
down 1.80 / 1.71 instructions per weight (NVFP4 / MXFP4), against 2.37 / 2.12 for the fp16x2 GEMV
(gate/up) and 3.22 / 3.55 for ``fp4_moe_mma``.

Why: the default kernels issue ~4.7 instructions per weight and are issue-bound at T=1; the fp16x2
GEMV (``fp4_moe_hgemv``) halves that but sums in fp16; ``fp4_moe_mma`` is exact but decodes to bf16,
scales each weight (bf16 FMA) and permutes activations: ~3.3.  Here per 8 weights: the HG decode
(``decode_ptx.HG_DECODE``, 10 integer instructions) and half an MMA per row, and per scale group 4
FFMA, so the K loop is mostly the decode.

Lane layout (one warp = 8 lane groups g of 4 lanes q; lane = 4 g + q; m16n8k16 fragments as in
``mma_ptx``'s docstring: A rows g / g + 8 of a lane group are its "row a" / "row b", lane q holds
K slots {2q, 2q+1, 2q+8, 2q+9} of A and of B):

* Rows: gate/up: row a = gate row n, row b = up row n (one per lane group, 8 RG per program);
  down: output rows r and r + 8 RG.
* K: a row is cut into 16-byte chunks (32 weights); chunk c belongs to lane slot c mod KL
  (KL = 4 KSPLIT: q and the warp's K split).  An iteration takes NSUB chunks per row per lane
  (16-byte loads, 64 contiguous bytes per lane group); the loop is unrolled by two so the next
  iteration's weights load during this one's math without register copies (``HMMA_CONFIG``).
* Per word of a chunk (row a and the same word of row b): MMA 1 takes A = {a(K0,K4), b(K0,K4),
  a(K1,K5), b(K1,K5)}, B = {x(K0,K4), x(K1,K5)}; MMA 2 the (K2,K6), (K3,K7) pairs.
* Scale groups: lanes q = 0..3 hold different chunks, i.e. different block scales, so an MMA over
  all 16 K slots would add four scale groups.  Instead B column j = 2 q' + h is the activation of
  token h (of this pass) in quarter q' only: lane (j, j // 2) loads it, every other lane loads the
  zero row.  So D[row][2q + h] is lane q's own dot product and lane (g, q) ends with c0 / c1 =
  row a x tokens 0 / 1 and c2 / c3 = row b x tokens 0 / 1 of its chunk: scaled in fp32 per group,
  summed over the lane's chunks, then over the 4 (x KSPLIT) lanes of the row at the end.  The
  price: 2 tokens per pass (an expert with more tokens runs several passes; at decode sizes most
  experts have one or two).

Activations (fp16, "pair order": per 8 K values x0 x4 x1 x5 x2 x6 x3 x7, so one 16-byte load is the
B operands of one word's two MMAs):

* gate/up: ``_x_f16_kernel`` (grid T + 1) writes ``xh[t] = x[t] * 2**s_t`` and ``s_t``, with s_t from
  the token's max |x| (max |x| * 2**s < 2**15; bf16 -> fp16 is then exact in the normal range) in
  [-120, 120]; row T of ``xh`` and row P of ``act`` are zeros (the non-feeding lanes' B).
* down: the gate/up epilogue writes ``act = silu(min(g, L)) * clamp(u, -L, L) * 2**SA`` (fp16,
  pair order), SA static: |act| <= L * max(silu(L), 0.2785) (``act_prescale``).  The routing
  weight goes into the down epilogue (y = rw * gw * acc * 2**(14 - SA)) instead of before the
  down projection: the same math, and fp16 act (11 bits) is finer than the default's bf16 act * rw.
  With no finite limit there is no static bound: ``hmma_supports`` says no and the op takes the
  default path.  Small act values (below 2**(-14 - SA) = 2**-23 for L = 10) lose relative
  precision as fp16 subnormals (absolute error < 2**-34); simulated on V4-Flash shapes: 2e-4
  relative at activation scales 1e-3 .. 2e3 (bf16 act * rw: 1.7e-3).

Numerics: weights e2m1 x 2**-14 (codes +-0.5 are fp16 subnormals: the tensor cores must keep
them -- ``test_hmma_fp16_subnormal_weights`` checks), products exact, fp32 accumulation inside the
MMA (the tensor core's own summation), block scale, running sum, global scale, 2**-14 and 2**-s
in fp32.

Kernels (fixed grids per T, CUDA-graph safe, no host sync): ``_x_f16_kernel`` (T + 1; one launch
more than the other paths, a candidate for folding into whatever produces x),
``_gate_up_hmma_kernel`` (P, I / 8 RG) -> ``act [P + 1, I]`` fp16, ``_down_hmma_kernel`` (P, D / 16 RG)
-> ``y [P, D]`` fp32, then ``moe_pairs._sum_kernel`` (the caller's).  Leader program per expert,
passes of 2 tokens (``moe_pairs._expert_rows``, ``fp4_moe_mma._rank_pairs``).

``prefetch=0`` ("staged", opt-in): the K loop is a ``tl.range(num_stages=stages)`` loop whose weights,
activations and per-row scale windows are plain 16-byte loads, so Triton's pipeliner turns them into a
ring of asynchronous copies (as in ``fp4_moe_stream``; an inline-asm load in the loop, or a
loop-carried prefetched value, stops the pipeliner, hence the plain loads and the scale windows).
Correct on the H200 (the GPU tests) but slower than ``prefetch=1`` (2026-12-01, BENCHMARKS.md): first
13x (610 us at T=1; Nsight Compute: 42% of the warps' time stalled on a full MIO queue, DRAM 3% busy),
when every lane copied its B operand, the zero row for 28 of 32 lanes (same-address async copies
serialise); with those copies masked off, 92 us against 45 us for ``prefetch=1``.  The per-row scale
windows are still read by the row's four lanes from one address: the next suspect.  Not routed to.

``USE_ASM=False`` (the CPU interpreter): the same loads, lane roles and pointers in plain Triton,
the MMA emulated across the warp's lanes (zero B columns included), the decode by value.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .fp4_moe_mma import _lanes, _pick, _rank_pairs
from .mma_ptx import HMMA_CONSTRAINTS, hmma_asm, ldg_asm
from .moe_pairs import _expert_rows, merged_config

_HM_NV = tl.constexpr(hmma_asm("nvfp4"))
_HM_MX = tl.constexpr(hmma_asm("mxfp4"))
_HM_C = tl.constexpr(HMMA_CONSTRAINTS)

# Per kernel: warps per program, warps sharing rows (K split), 16-byte chunks per row per lane per
# iteration.  "prefetch": 1 = the K loop unrolled by two with two weight buffers (the next
# iteration's weights load during this one's math, no register copies), 2 = two iterations ahead
# in three rotating buffers (costs ~20 register moves per iteration), 0 = the staged loop ("stages"
# ring buffers, default 3; see the module docstring: correct but measured 2x slower).  "maxnreg": ptxas register
# cap; left free (~96-128) ptxas issues the prefetch loads just before their use (SASS), 168 lets
# it issue them early and still fits 3 programs of 4 warps per SM (384 programs at T=1: one wave).
# "w_hint": cache qualifier of the weight loads (e.g. ".L1::no_allocate").
HMMA_CONFIG = {
    "gate_up": dict(num_warps=4, ksplit=1, nsub=2),
    "down": dict(num_warps=4, ksplit=1, nsub=2),
    "prefetch": 1,
    "maxnreg": 168,
    "w_hint": "",
}

F16_MAX = 65504.0


def act_prescale(limit: float) -> int | None:
    """Static exponent SA with |silu(min(g, L)) * clamp(u, -L, L)| * 2**SA <= 65504 (fp16), or
    None (no finite positive limit, or SA out of range): then the op takes the default path."""
    if not (isinstance(limit, (int, float)) and math.isfinite(limit) and limit > 0):
        return None
    silu = limit / (1.0 + math.exp(-limit))
    bound = limit * max(silu, 0.2785)  # silu >= -0.27846 below zero
    sa = math.floor(math.log2(F16_MAX * (1 - 1e-3) / bound))
    return sa if -60 <= sa <= 60 else None


def hmma_config(cfg: dict | None = None) -> dict:
    """HMMA_CONFIG with ``cfg``'s keys over it ("gate_up" / "down" merged key by key)."""
    return merged_config(HMMA_CONFIG, cfg)


def hmma_supports(hidden: int, intermediate: int, cfg: dict | None = None, limit: float = 10.0) -> bool:
    """Whether the kernels tile these sizes (K a multiple of 2 x 32 KL NSUB per matrix) and the
    limit gives a static activation prescale."""
    cfg = hmma_config(cfg)
    gu, dn = cfg["gate_up"], cfg["down"]
    ok = act_prescale(limit) is not None
    for c, k, rows, n in ((gu, hidden, 8, intermediate), (dn, intermediate, 16, hidden)):
        nw, ks, ns = c["num_warps"], c["ksplit"], c["nsub"]
        # K: whole iterations, an even number of them (the K loop is unrolled by two)
        ok = ok and nw % ks == 0 and k % (2 * 32 * 4 * ks * ns) == 0 and n % (rows * (nw // ks)) == 0
    return ok


def load_asms(kind: str, k: int, n_rows_b: int, is_nv: bool, cfg: dict):
    """The load asm strings of one kernel: (weights, scales, activations).  ``k``: the K of the
    matrix; ``n_rows_b``: rows from row a to row b."""
    c = cfg[kind]
    kl, ns = 4 * c["ksplit"], c["nsub"]
    hb, sr, sb = k // 2, k // (16 if is_nv else 32), 2 if is_nv else 1
    w = ldg_asm([j * 16 * kl for j in range(ns)] + [n_rows_b * hb + j * 16 * kl for j in range(ns)],
                hint=cfg.get("w_hint", ""))
    s = ldg_asm([j * sb * kl for j in range(ns)] + [n_rows_b * sr + j * sb * kl for j in range(ns)],
                width="u16" if is_nv else "u8")
    x = ldg_asm([j * 64 * kl + 16 * i for j in range(ns) for i in range(4)])
    return w, s, x


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def _pair_pos(k):
    """Position of K index k in the pair-order layout (per 8: x0 x4 x1 x5 x2 x6 x3 x7)."""
    return (k // 8) * 8 + (k % 4) * 2 + (k // 4) % 2


@triton.jit
def _x_f16_kernel(x_ptr, xh_ptr, xs_ptr, act_ptr, T, P, D: tl.constexpr, I: tl.constexpr,
                  DP: tl.constexpr, IP: tl.constexpr):
    """xh[t] = fp16(x[t] * 2**s_t) in pair order and s_t (program t < T); zero rows xh[T], act[P]."""
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
def _ld_w(p, ROWB: tl.constexpr, KL: tl.constexpr, NSUB: tl.constexpr, WLD: tl.constexpr, USE_ASM: tl.constexpr):
    """Weights of one iteration: NSUB 16-byte chunks of row a, then of row b.  asm: 4 int32 words
    per chunk; emulation: [NT, 16] bytes per chunk."""
    if USE_ASM:
        return tl.inline_asm_elementwise(WLD, "=r," * (8 * NSUB) + "l", [p.to(tl.int64, bitcast=True)],
                                         dtype=(tl.int32,) * (8 * NSUB), is_pure=True, pack=1)
    else:
        tl.static_assert(NSUB <= 2, "the interpreter twin takes nsub 1 or 2")
        b = tl.arange(0, 16)
        if NSUB == 1:
            return (tl.load(p[:, None] + b[None, :]), tl.load(p[:, None] + (ROWB + b)[None, :]))
        else:
            return (tl.load(p[:, None] + b[None, :]), tl.load(p[:, None] + (16 * KL + b)[None, :]),
                    tl.load(p[:, None] + (ROWB + b)[None, :]), tl.load(p[:, None] + (ROWB + 16 * KL + b)[None, :]))


@triton.jit
def _ld_s(p, SROWB: tl.constexpr, KL: tl.constexpr, NSUB: tl.constexpr, SLD: tl.constexpr, IS_NV: tl.constexpr,
          USE_ASM: tl.constexpr):
    """Raw scales of one iteration (int32 each): per chunk two e4m3 bytes (NVFP4) or one e8m0."""
    if USE_ASM:
        return tl.inline_asm_elementwise(SLD, "=r," * (2 * NSUB) + "l", [p.to(tl.int64, bitcast=True)],
                                         dtype=(tl.int32,) * (2 * NSUB), is_pure=True, pack=1)
    else:
        tl.static_assert(NSUB <= 2, "the interpreter twin takes nsub 1 or 2")
        SB: tl.constexpr = 2 if IS_NV else 1
        if NSUB == 1:
            return (_raw_scale(p, IS_NV), _raw_scale(p + SROWB, IS_NV))
        else:
            return (_raw_scale(p, IS_NV), _raw_scale(p + SB * KL, IS_NV), _raw_scale(p + SROWB, IS_NV),
                    _raw_scale(p + (SROWB + SB * KL), IS_NV))


@triton.jit
def _raw_scale(p, IS_NV: tl.constexpr):
    if IS_NV:
        return tl.load(p).to(tl.int32) | (tl.load(p + 1).to(tl.int32) << 8)
    else:
        return tl.load(p).to(tl.int32)


@triton.jit
def _ld_x(p, KL: tl.constexpr, NSUB: tl.constexpr, XLD: tl.constexpr, USE_ASM: tl.constexpr):
    """Activations of one iteration.  asm: per chunk 16 int32 (4 per word, pair order);
    emulation: per chunk [NT, 32] fp32 in natural K order."""
    if USE_ASM:
        return tl.inline_asm_elementwise(XLD, "=r," * (16 * NSUB) + "l", [p.to(tl.int64, bitcast=True)],
                                         dtype=(tl.int32,) * (16 * NSUB), is_pure=True, pack=1)
    else:
        tl.static_assert(NSUB <= 2, "the interpreter twin takes nsub 1 or 2")
        pos = _pair_pos(tl.arange(0, 32))
        if NSUB == 1:
            return (tl.load(p[:, None] + pos[None, :]).to(tl.float32),)
        else:
            return (tl.load(p[:, None] + pos[None, :]).to(tl.float32),
                    tl.load(p[:, None] + (32 * KL + pos)[None, :]).to(tl.float32))


@triton.jit
def _emu_w(b):
    """[NT, 16] packed bytes -> [NT, 32] fp32 weights e2m1 x 2**-14 (natural K order)."""
    v = tl.join(b & 15, b >> 4).to(tl.int32)  # [NT, 16, 2]: K = 2 byte + nibble
    mag = v & 7
    e = tl.where(mag <= 4, mag.to(tl.float32) * 0.5, tl.where(mag == 7, 6.0, mag.to(tl.float32) - 2.0))
    e = tl.where(v >= 8, -e, e) * (1.0 / 16384.0)
    return tl.reshape(e, (b.shape[0], 32))


@triton.jit
def _emu_mma(wa, wb, xb, NW: tl.constexpr, KW: tl.constexpr):
    """Interpreter stand-in for a lane group's MMAs over KW K values per lane: D[g][j] sums the K
    slots of all four lanes q', B column j from lane (j, q'); lane (g, q) keeps columns 2q, 2q+1."""
    A = tl.reshape(wa, (NW, 8, 1, 4, KW))
    Bm = tl.reshape(xb, (NW, 1, 8, 4, KW))
    Da = tl.sum(tl.sum(A * Bm, axis=4), axis=3)  # [NW, 8 rows g, 8 columns j]
    Db = tl.sum(tl.sum(tl.reshape(wb, (NW, 8, 1, 4, KW)) * Bm, axis=4), axis=3)
    q = tl.arange(0, 4)
    j = tl.arange(0, 8)
    sel0 = j[None, None, None, :] == 2 * q[None, None, :, None]  # [1, 1, 4, 8]
    sel1 = j[None, None, None, :] == 2 * q[None, None, :, None] + 1
    NT: tl.constexpr = 32 * NW
    c0 = tl.reshape(tl.sum(tl.where(sel0, Da[:, :, None, :], 0.0), axis=3), (NT,))
    c1 = tl.reshape(tl.sum(tl.where(sel1, Da[:, :, None, :], 0.0), axis=3), (NT,))
    c2 = tl.reshape(tl.sum(tl.where(sel0, Db[:, :, None, :], 0.0), axis=3), (NT,))
    c3 = tl.reshape(tl.sum(tl.where(sel1, Db[:, :, None, :], 0.0), axis=3), (NT,))
    return c0, c1, c2, c3


@triton.jit
def _emu_scale(raw, grp: tl.constexpr, IS_NV: tl.constexpr):
    if IS_NV:
        return ((raw >> (8 * grp)) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return tl.maximum(raw << 23, 0x00400000).to(tl.float32, bitcast=True)


@triton.jit
def _chunk(acc, w, s, x, j: tl.constexpr, NSUB: tl.constexpr, IS_NV: tl.constexpr, NW: tl.constexpr,
           USE_ASM: tl.constexpr):
    """acc (c0, c1, c2, c3) + chunk j of this iteration (rows a, b) against its activations."""
    if USE_ASM:
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
    else:
        NT: tl.constexpr = 32 * NW
        va = _emu_w(w[j])
        vb = _emu_w(w[NSUB + j])
        xv = x[j]
        c0, c1, c2, c3 = acc[0], acc[1], acc[2], acc[3]
        if IS_NV:  # two groups of 16 weights: each group's MMAs, then its scale
            va0, va1 = tl.split(tl.permute(tl.reshape(va, (NT, 2, 16)), (0, 2, 1)))
            vb0, vb1 = tl.split(tl.permute(tl.reshape(vb, (NT, 2, 16)), (0, 2, 1)))
            x0, x1 = tl.split(tl.permute(tl.reshape(xv, (NT, 2, 16)), (0, 2, 1)))
            d0, d1, d2, d3 = _emu_mma(va0, vb0, x0, NW, 16)
            sa = _emu_scale(s[j], 0, True)
            sb = _emu_scale(s[NSUB + j], 0, True)
            c0, c1, c2, c3 = c0 + d0 * sa, c1 + d1 * sa, c2 + d2 * sb, c3 + d3 * sb
            d0, d1, d2, d3 = _emu_mma(va1, vb1, x1, NW, 16)
            sa = _emu_scale(s[j], 1, True)
            sb = _emu_scale(s[NSUB + j], 1, True)
        else:
            d0, d1, d2, d3 = _emu_mma(va, vb, xv, NW, 32)
            sa = _emu_scale(s[j], 0, False)
            sb = _emu_scale(s[NSUB + j], 0, False)
        return c0 + d0 * sa, c1 + d1 * sa, c2 + d2 * sb, c3 + d3 * sb


@triton.jit
def _words4(p, feed=None):
    """Four int32 words from ``p [NT]`` (16-byte aligned int32 pointers): one 16-byte load per
    lane, as 4 tensors [NT] (a plain load, so Triton's pipeliner can make it asynchronous).
    ``feed [NT]``: lanes that load (the others get zeros without touching memory)."""
    if feed is None:
        t = tl.load(p[:, None] + tl.arange(0, 4)[None, :])
    else:
        t = tl.load(p[:, None] + tl.arange(0, 4)[None, :], mask=feed[:, None], other=0)
    ev, od = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))  # words (0, 2), (1, 3)
    w0, w2 = tl.split(ev)
    w1, w3 = tl.split(od)
    return w0, w1, w2, w3


@triton.jit
def _ld_w_words(p, ROWB: tl.constexpr, KL: tl.constexpr, NSUB: tl.constexpr):
    """``_ld_w`` by plain loads: ``p`` int32 pointers; NSUB chunks of row a, then of row b."""
    a0, a1, a2, a3 = _words4(p)
    b0, b1, b2, b3 = _words4(p + ROWB // 4)
    if NSUB == 1:
        return a0, a1, a2, a3, b0, b1, b2, b3
    else:
        tl.static_assert(NSUB == 2, "the staged loop takes nsub 1 or 2")
        c0, c1, c2, c3 = _words4(p + 4 * KL)
        d0, d1, d2, d3 = _words4(p + ROWB // 4 + 4 * KL)
        return a0, a1, a2, a3, c0, c1, c2, c3, b0, b1, b2, b3, d0, d1, d2, d3


@triton.jit
def _ld_x_words(p, feed, KL: tl.constexpr, NSUB: tl.constexpr):
    """``_ld_x`` by plain loads: per chunk 16 int32 words (four 16-byte loads); lanes that feed no
    B column (``feed`` False) read nothing and hold zeros (as the zero row would give them)."""
    x0, x1, x2, x3 = _words4(p, feed)
    x4, x5, x6, x7 = _words4(p + 4, feed)
    x8, x9, x10, x11 = _words4(p + 8, feed)
    x12, x13, x14, x15 = _words4(p + 12, feed)
    if NSUB == 1:
        return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15
    else:
        tl.static_assert(NSUB == 2, "the staged loop takes nsub 1 or 2")
        y0, y1, y2, y3 = _words4(p + 16 * KL, feed)
        y4, y5, y6, y7 = _words4(p + 16 * KL + 4, feed)
        y8, y9, y10, y11 = _words4(p + 16 * KL + 8, feed)
        y12, y13, y14, y15 = _words4(p + 16 * KL + 12, feed)
        return (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)


@triton.jit
def _scale_of(win, kl, j: tl.constexpr, KL: tl.constexpr, IS_NV: tl.constexpr):
    """Lane ``kl``'s raw scale of chunk j (as ``_ld_s`` gives it: NVFP4 two e4m3 bytes as a u16, MXFP4
    the e8m0 byte) out of ``win [NT, SW]``, the int32 words of its row's scale bytes of this iteration."""
    SB: tl.constexpr = 2 if IS_NV else 1
    b = SB * (kl + KL * j)  # byte within the window
    word = tl.sum(tl.where(tl.arange(0, win.shape[1])[None, :] == (b // 4)[:, None], win, 0), axis=1)
    return (word >> ((b % 4) * 8)) & (0xFFFF if IS_NV else 0xFF)


@triton.jit
def _ld_s_window(swin, kl, SROWB: tl.constexpr, KL: tl.constexpr, NSUB: tl.constexpr, IS_NV: tl.constexpr):
    """``_ld_s`` for the staged loop: each lane loads its rows' whole scale window of the iteration
    (SB * KL * NSUB bytes, as int32 words, the same for the row's KL lanes) by plain loads that the
    pipeliner makes asynchronous (a lane's own 1-2 bytes are too small for an async copy, and an
    inline-asm load in the loop stops the pipeliner), then picks its own bytes."""
    SW: tl.constexpr = (2 if IS_NV else 1) * KL * NSUB // 4
    o = tl.arange(0, SW)[None, :]
    wa_ = tl.load(swin[:, None] + o)
    wb_ = tl.load(swin[:, None] + (SROWB // 4 + o))
    if NSUB == 1:
        return _scale_of(wa_, kl, 0, KL, IS_NV), _scale_of(wb_, kl, 0, KL, IS_NV)
    else:
        tl.static_assert(NSUB == 2, "the staged loop takes nsub 1 or 2")
        return (_scale_of(wa_, kl, 0, KL, IS_NV), _scale_of(wa_, kl, 1, KL, IS_NV),
                _scale_of(wb_, kl, 0, KL, IS_NV), _scale_of(wb_, kl, 1, KL, IS_NV))


@triton.jit
def _k_loop(wa, sa, swin, kl, xq, feed, NIT: tl.constexpr, ROWB: tl.constexpr, SROWB: tl.constexpr, KL: tl.constexpr,
            NSUB: tl.constexpr, PF: tl.constexpr, IS_NV: tl.constexpr, NW: tl.constexpr,
            WLD: tl.constexpr, SLD: tl.constexpr, XLD: tl.constexpr, USE_ASM: tl.constexpr,
            STAGES: tl.constexpr = 3):
    """This lane's chunks of rows a and b against its B operands: (c0, c1, c2, c3) per lane."""
    NT: tl.constexpr = 32 * NW
    WST: tl.constexpr = 16 * KL * NSUB  # bytes per iteration and row
    SST: tl.constexpr = (2 if IS_NV else 1) * KL * NSUB
    XST: tl.constexpr = 32 * KL * NSUB  # fp16 activations per iteration
    z = tl.zeros((NT,), dtype=tl.float32)
    acc = (z, z, z, z)
    if PF == 0:
        # staged: weights and activations by plain 16-byte loads in a tl.range(num_stages) loop, which
        # Triton's pipeliner turns into a ring of STAGES asynchronous copies (as ``fp4_moe_stream``);
        # the scales as whole per-row windows (a lane's own 1-2 bytes are too small for an async copy)
        if USE_ASM:
            wa32 = wa.to(tl.pointer_type(tl.int32), bitcast=True)
            xq32 = xq.to(tl.pointer_type(tl.int32), bitcast=True)
            swin32 = swin.to(tl.pointer_type(tl.int32), bitcast=True)
            for it in tl.range(NIT, num_stages=STAGES):
                s = _ld_s_window(swin32 + it * (SST // 4), kl, SROWB, KL, NSUB, IS_NV)
                w = _ld_w_words(wa32 + it * (WST // 4), ROWB, KL, NSUB)
                x = _ld_x_words(xq32 + it * (XST // 2), feed, KL, NSUB)
                for j in tl.static_range(NSUB):
                    acc = _chunk(acc, w, s, x, j, NSUB, IS_NV, NW, USE_ASM)
        else:  # its interpreter twin: the emulated loads in the same loop
            for it in tl.range(NIT, num_stages=STAGES):
                w = _ld_w(wa + it * WST, ROWB, KL, NSUB, WLD, USE_ASM)
                s = _ld_s(sa + it * SST, SROWB, KL, NSUB, SLD, IS_NV, USE_ASM)
                x = _ld_x(xq + it * XST, KL, NSUB, XLD, USE_ASM)
                for j in tl.static_range(NSUB):
                    acc = _chunk(acc, w, s, x, j, NSUB, IS_NV, NW, USE_ASM)
        return acc
    w = _ld_w(wa, ROWB, KL, NSUB, WLD, USE_ASM)
    s = _ld_s(sa, SROWB, KL, NSUB, SLD, IS_NV, USE_ASM)
    if PF == 1:
        # unrolled by two with two buffers, so no weight register is copied: the odd iteration's
        # weights load during the even one's math and the next even's during the odd one's.  The
        # odd iteration's scales load a whole body ahead (else ptxas issues them just before use)
        s1 = _ld_s(sa + tl.minimum(1, NIT - 1) * SST, SROWB, KL, NSUB, SLD, IS_NV, USE_ASM)
        for it in tl.range(0, NIT, 2, loop_unroll_factor=1):
            w1 = _ld_w(wa + (it + 1) * WST, ROWB, KL, NSUB, WLD, USE_ASM)
            x = _ld_x(xq + it * XST, KL, NSUB, XLD, USE_ASM)
            for j in tl.static_range(NSUB):
                acc = _chunk(acc, w, s, x, j, NSUB, IS_NV, NW, USE_ASM)
            nxt = tl.minimum(it + 2, NIT - 2)  # the last pass reloads its own (cached, harmless)
            w = _ld_w(wa + nxt * WST, ROWB, KL, NSUB, WLD, USE_ASM)
            s = _ld_s(sa + nxt * SST, SROWB, KL, NSUB, SLD, IS_NV, USE_ASM)
            s1n = _ld_s(sa + (nxt + 1) * SST, SROWB, KL, NSUB, SLD, IS_NV, USE_ASM)
            x = _ld_x(xq + (it + 1) * XST, KL, NSUB, XLD, USE_ASM)
            for j in tl.static_range(NSUB):
                acc = _chunk(acc, w1, s1, x, j, NSUB, IS_NV, NW, USE_ASM)
            s1 = s1n
    else:
        # two iterations ahead, rotating three buffers (the rotation costs register moves)
        n1 = tl.minimum(1, NIT - 1)
        w1 = _ld_w(wa + n1 * WST, ROWB, KL, NSUB, WLD, USE_ASM)
        s1 = _ld_s(sa + n1 * SST, SROWB, KL, NSUB, SLD, IS_NV, USE_ASM)
        for it in tl.range(NIT, loop_unroll_factor=1):
            nxt = tl.minimum(it + 2, NIT - 1)
            wn = _ld_w(wa + nxt * WST, ROWB, KL, NSUB, WLD, USE_ASM)
            sn = _ld_s(sa + nxt * SST, SROWB, KL, NSUB, SLD, IS_NV, USE_ASM)
            x = _ld_x(xq + it * XST, KL, NSUB, XLD, USE_ASM)
            for j in tl.static_range(NSUB):
                acc = _chunk(acc, w, s, x, j, NSUB, IS_NV, NW, USE_ASM)
            w = w1
            s = s1
            w1 = wn
            s1 = sn
    return acc


@triton.jit
def _rows_sum(c, RG: tl.constexpr, KSPLIT: tl.constexpr):
    """[NT] per-lane partial sums -> [8 RG] per row (over the 4 lanes and KSPLIT warps of a row)."""
    return tl.reshape(tl.sum(tl.sum(tl.reshape(c, (RG, KSPLIT, 8, 4)), axis=3), axis=1), (8 * RG,))


@triton.jit
def _b_row(pairs8, g, c0r, count, ZROW, q, DIV: tl.constexpr):
    """Row of the activation buffer this lane feeds as B: token (DIV = TOPK) or pair (DIV = 1)
    of rank c0r + g % 2 if the lane is column g's feeder (q == g // 2) and the rank exists, else
    the zero row."""
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
    LIMIT: tl.constexpr, ASCALE: tl.constexpr, NW: tl.constexpr, KSPLIT: tl.constexpr, NSUB: tl.constexpr,
    PF: tl.constexpr, WLD: tl.constexpr, SLD: tl.constexpr, XLD: tl.constexpr, USE_ASM: tl.constexpr,
    STAGES: tl.constexpr = 3,
):
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, pid_p, P, PB)
    if earlier == 0:
        RG: tl.constexpr = NW // KSPLIT  # lane groups (gate row + up row) per K slice
        KL: tl.constexpr = 4 * KSPLIT  # lane slots per row
        HB: tl.constexpr = D // 2  # bytes per weight row
        SR: tl.constexpr = D // (16 if IS_NV else 32)  # scale bytes per row
        wid, g, q = _lanes(NW)
        kl = (wid % KSPLIT) * 4 + q
        n = pid_n * (8 * RG) + (wid // KSPLIT) * 8 + g
        row = e * (2 * I) + n.to(tl.int64)
        wa = w_ptr + row * HB + kl * 16
        sa = s_ptr + row * SR + kl * (2 if IS_NV else 1)
        gg = tl.load(g_ptr + 2 * e) * 16384.0  # undoes the decode's 2**-14
        gu = tl.load(g_ptr + 2 * e + 1) * 16384.0
        no = pid_n * (8 * RG) + tl.arange(0, 8 * RG)  # rows of the reduced result
        T = P // TOPK
        c0r = count * 0
        while c0r < count:  # passes of 2 tokens (ranks c0r, c0r + 1)
            pairs8 = _rank_pairs(offs, match, rank, c0r)
            brow = _b_row(pairs8, g, c0r, count, T, q, TOPK)
            xq = xh_ptr + brow * D + kl * 32
            acc = _k_loop(wa, sa, s_ptr + row * SR, kl, xq, brow != T, D // (32 * KL * NSUB), I * HB, I * SR, KL, NSUB, PF, IS_NV, NW,
                          WLD, SLD, XLD, USE_ASM, STAGES)
            for h in tl.static_range(2):
                pair = _pair_of(pairs8, h)
                ok = c0r + h < count
                tok = pair // TOPK
                s_t = tl.load(xs_ptr + tok)
                undo = ((127 - s_t) << 23).to(tl.float32, bitcast=True)  # 2**-s, s in [-120, 120]
                gv = tl.minimum(_rows_sum(acc[h], RG, KSPLIT) * undo * gg, LIMIT)
                uv = _rows_sum(acc[2 + h], RG, KSPLIT) * undo * gu
                uv = tl.minimum(tl.maximum(uv, -LIMIT), LIMIT)
                a = gv / (1.0 + tl.exp(-gv)) * uv * ASCALE  # 2**SA
                tl.store(act_ptr + pair.to(tl.int64) * I + _pair_pos(no), a.to(tl.float16), mask=ok)
            c0r += 2


@triton.jit
def _down_hmma_kernel(
    act_ptr, ids_ptr, rw_ptr, w_ptr, s_ptr, g_ptr, y_ptr, P,
    I: tl.constexpr, D: tl.constexpr, PB: tl.constexpr, IS_NV: tl.constexpr, YSCALE: tl.constexpr,
    NW: tl.constexpr, KSPLIT: tl.constexpr, NSUB: tl.constexpr, PF: tl.constexpr,
    WLD: tl.constexpr, SLD: tl.constexpr, XLD: tl.constexpr, USE_ASM: tl.constexpr, STAGES: tl.constexpr = 3,
):
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, pid_p, P, PB)
    if earlier == 0:
        RG: tl.constexpr = NW // KSPLIT
        KL: tl.constexpr = 4 * KSPLIT
        HB: tl.constexpr = I // 2
        SR: tl.constexpr = I // (16 if IS_NV else 32)
        wid, g, q = _lanes(NW)
        kl = (wid % KSPLIT) * 4 + q
        r1 = pid_n * (16 * RG) + (wid // KSPLIT) * 8 + g  # output rows r1 (a) and r1 + 8 RG (b)
        row = e * D + r1.to(tl.int64)
        wa = w_ptr + row * HB + kl * 16
        sa = s_ptr + row * SR + kl * (2 if IS_NV else 1)
        gw = tl.load(g_ptr + e) * YSCALE  # 2**(14 - SA): undoes the decode's 2**-14 and act's 2**SA
        ro = pid_n * (16 * RG) + tl.arange(0, 8 * RG)
        c0r = count * 0
        while c0r < count:
            pairs8 = _rank_pairs(offs, match, rank, c0r)
            brow = _b_row(pairs8, g, c0r, count, P, q, 1)
            xq = act_ptr + brow * I + kl * 32
            acc = _k_loop(wa, sa, s_ptr + row * SR, kl, xq, brow != P, I // (32 * KL * NSUB), 8 * RG * HB, 8 * RG * SR, KL, NSUB, PF, IS_NV, NW,
                          WLD, SLD, XLD, USE_ASM, STAGES)
            for h in tl.static_range(2):
                pair = _pair_of(pairs8, h)
                ok = c0r + h < count
                f = tl.load(rw_ptr + pair, mask=ok, other=0.0) * gw  # routing weight after w2 (fp32)
                dst = y_ptr + pair.to(tl.int64) * D + ro
                tl.store(dst, _rows_sum(acc[h], RG, KSPLIT) * f, mask=ok)
                tl.store(dst + 8 * RG, _rows_sum(acc[2 + h], RG, KSPLIT) * f, mask=ok)
            c0r += 2


def launch_hmma(x, ids, rw, w13, w13_scale, w13_global, w2, w2_scale, w2_global, act, y, *, k, group_size, is_nv,
                limit, use_asm, cfg, only=None):
    """Prologue, gate/up and down kernels into ``y`` (the sum kernel is the caller's).  ``act``
    (the caller's bf16 workspace) is not used: these kernels keep their own fp16 copy."""
    del act
    p = ids.numel()
    t, d = x.shape
    inter = w2.shape[-1] * 2
    cfg = hmma_config(cfg)
    sa = act_prescale(limit)
    if group_size != (16 if is_nv else 32):
        raise ValueError(f"hmma: unexpected group size {group_size} for {'nvfp4' if is_nv else 'mxfp4'}.")
    if sa is None or not hmma_supports(d, inter, cfg, limit):
        raise ValueError(f"hmma: D={d} / I={inter} / limit={limit} not supported by {cfg}.")
    for name, ten, al in (("w13", w13, 16), ("w2", w2, 16), ("w13_scale", w13_scale, 2), ("w2_scale", w2_scale, 2)):
        if ten.data_ptr() % al:
            raise ValueError(f"hmma: {name} must be {al}-byte aligned.")
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    use_asm = bool(use_asm) and not interp
    dev = x.device
    xh = torch.empty(t + 1, d, dtype=torch.float16, device=dev)
    xs = torch.empty(t, dtype=torch.int32, device=dev)
    act16 = torch.empty(p + 1, inter, dtype=torch.float16, device=dev)
    pb = max(16, triton.next_power_of_2(p))
    pf = int(cfg["prefetch"])
    if pf not in (0, 1, 2):
        raise ValueError(f"hmma prefetch must be 0 (staged), 1 or 2, got {pf}.")
    gu, dn = cfg["gate_up"], cfg["down"]
    stages = int(cfg.get("stages", 3))
    if pf == 0 and (stages < 1 or gu["nsub"] > 2 or dn["nsub"] > 2):
        raise ValueError(f"hmma staged loop (prefetch 0): stages >= 1 and nsub 1 or 2, got {stages}, {gu['nsub']}, {dn['nsub']}.")
    regs = {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and not interp else {}
    if only in (None, "gate_up"):
        _x_f16_kernel[(t + 1,)](x, xh, xs, act16, t, p, d, inter, DP=triton.next_power_of_2(d),
                                IP=triton.next_power_of_2(inter), num_warps=4)
        nw, ks = gu["num_warps"], gu["ksplit"]
        wld, sld, xld = load_asms("gate_up", d, inter, is_nv, cfg)
        _gate_up_hmma_kernel[(p, inter // (8 * nw // ks))](
            xh, xs, ids, w13.view(torch.uint8), w13_scale.view(torch.uint8), w13_global.float().contiguous(), act16, p,
            inter, d, TOPK=k, PB=pb, IS_NV=is_nv, LIMIT=float(limit), ASCALE=2.0**sa, NW=nw, KSPLIT=ks,
            NSUB=gu["nsub"], PF=pf,
            WLD=wld, SLD=sld, XLD=xld, USE_ASM=use_asm, STAGES=stages, num_warps=nw, num_stages=1, **regs,
        )
    if only in (None, "down"):
        nw, ks = dn["num_warps"], dn["ksplit"]
        wld, sld, xld = load_asms("down", inter, 8 * (nw // ks), is_nv, cfg)
        _down_hmma_kernel[(p, d // (16 * nw // ks))](
            act16, ids, rw, w2.view(torch.uint8), w2_scale.view(torch.uint8), w2_global.float().contiguous(), y, p,
            inter, d, PB=pb, IS_NV=is_nv, YSCALE=2.0 ** (14 - sa), NW=nw, KSPLIT=ks, NSUB=dn["nsub"], PF=pf,
            WLD=wld, SLD=sld, XLD=xld, USE_ASM=use_asm, STAGES=stages, num_warps=nw, num_stages=1, **regs,
        )
