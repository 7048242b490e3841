"""Small-batch path of ``dsv4_mtp::fp4_moe`` on CUDA (its staged loop, ``prefetch=0``, the default
at T=4..16 since 2026-12-01 -- MXFP4 and NVFP4 T=8..16 since the eighth session, NVFP4 T=4..7 and its
96-register cap since the ninth, MXFP4 T=3 with 2 stages and 72 registers since the tenth, NVFP4 T=3 and
MXFP4 T=2 since the twelfth; see
"prefetch=0" below): FP4 decoded straight to fp16 ``mma.sync`` operands, block scales applied in fp32 to the MMA
results (exact products, fp32 accumulation): 1.81 (NVFP4) / 1.71 (MXFP4) SASS instructions per weight in
the K loops.

Status (2026-11-30): exact on the H200 (tests/test_fp4_moe_hmma.py ``-m gpu``: 41 passed, the
tensor cores keep fp16 subnormal weights) but not faster: 55.0 / 53.1 µs at T=1 (``hm`` / ``hm_pf2``)
against 53.0 for the default kernels and 47.3 for the fp16x2 GEMV (BENCHMARKS.md, fifth session) --
at T=1 the MoE is bound by memory latency, not by issue.  The unstaged loops are opt-in
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

Kernels (fixed grids per T, CUDA-graph safe, no host sync; programmatic dependent launch like our other kernels
since the thirteenth session, ``HMMA_CONFIG["pdl"]``: NVFP4 T=16 413 vs 422 us, MXFP4 331 vs 334, equal at T=2..4 in
one run): ``_x_f16_kernel`` (T + 1; one launch
more than the other paths, a candidate for folding into whatever produces x),
``_gate_up_hmma_kernel`` (P, I / 8 RG) -> ``act [P + 1, I]`` fp16, ``_down_hmma_kernel`` (P, D / 16 RG)
-> ``y [P, D]`` fp32 and the token sums (``moe_pairs._ticket_sum`` in the down kernel, or
``moe_pairs._sum_kernel``, the caller's, where no tickets are given).  Leader program per expert,
passes of 2 tokens (``moe_pairs._expert_rows``, ``fp4_moe_mma._rank_pairs``).

``prefetch=0`` ("staged", opt-in): the K loop is a ``tl.range(num_stages=stages)`` loop of plain loads,
which Triton's pipeliner turns into a ring of asynchronous copies (as in ``fp4_moe_stream``; an
inline-asm load in the loop, or a loop-carried prefetched value, stops the pipeliner).  Three things
keep the ring's copies few and 16-byte wide (each was a measured 2x or more, BENCHMARKS.md):
* the B operands are copied once per B column (``_feeder_chunk``: [NW, 8] feeder pointers, the lanes
  pick their column's words and zero it where they do not feed) -- one copy per lane made 28 of 32
  lanes copy the zero row, and same-address async copies serialise (610 us at T=1);
* the feeder pointers are rebuilt from offsets with a ``tl.multiple_of`` hint: from a reduction the
  compiler cannot see the alignment and copies 4 bytes at a time;
* each lane copies its row's scale window of the iteration (KL NSUB chunks, 16-byte copies) and
  picks its own bytes in registers (``_ld_s_window``): one 4- or 8-byte copy of just its bytes
  measured 35-40% slower (BENCHMARKS.md, eighth session).
``"share": True`` (staged, ksplit 1; opt-in, ninth session) copies the B operands once per program instead of
once per warp (the warps take the same K): an [8, NSUB, 16] load, 16-byte copies at NSUB 4, that every warp
reads from the ring -- MXFP4 nsub 4: 11 instead of 14 copies per thread and iteration, 44 instead of 56 KB of
shared memory (offline SASS); at NSUB 2 (8-byte copies) the split costs a shared-memory round trip.
Measured (H200, ninth session, one run, us, MXFP4 nsub 4 without / with): 45.8 / 42.4 at T=1, 117.6 /
123.9 at T=4, 243.1 / 226.6 at T=8, 462.2 / 490.9 at T=16; NVFP4 nsub 2: 250.4 / 271.0 at T=8, 457.4 /
573.5 at T=16.  Mixed, so it stays off.
Status (H200, 2026-12-01, rotated routings): MXFP4 with nsub 4 46.1 / 72.9 / 118.1 / 460.9 us at
T=1/2/4/16 (defaults 42.8 / 74.7 / 144.2 / 493.9, seventh session); NVFP4 nsub 2 48.0 at T=1, 460.5
at T=16 (default 478.5); eighth session, same runs: MXFP4 nsub 4 117.5 / 242.3 / 459.9 at T=4 / 8 / 16
(defaults 139.6 / 303.5 / 497.1), NVFP4 nsub 2 253.7 / 445.4 at T=8 / 16 (271.6 / 466.9): routed to
there (``fp4_moe_triton.CONFIG``).  Ninth session: ncu at T=16 (MXFP4) shows the staged kernels at 168
registers per thread (``maxnreg``; the offline build allocates 109-117), so 3 programs (12 warps) per
SM, 18% occupancy, 2.2-2.5 TB/s from DRAM; NVFP4 nsub 2 with ``maxnreg=96`` (5 programs by registers,
no spills in the sm_90 SASS): 122.4 / 233.2 / 453.8 us at T=4 / 8 / 16 against 131.3 / 250.8 / 458.0 with
168 (one run) -- the NVFP4 default now; MXFP4 (57 KB of ring, 4 programs by shared memory) showed no gain
at T=4; tenth session: at 128 registers MXFP4 214.8 / 406.9 us at T=8 / 16 against 243.0 / 460.5 (4 programs
per SM, the limit of its 57 KB ring), and with 2 stages (one 28 KB buffer) at 72 registers (7 programs)
207.5-210.6 / 380.5-386.5 -- the MXFP4 default now: for MXFP4 more programs beat a deeper ring.
``"tiles_first": True`` (opt-in) swaps the grid's axes so the programs running together take consecutive
row tiles of a few experts instead of one row tile of every expert (up to ~100 at T=16, 8 MiB apart): no gain (tenth session: 449.2 vs 454.6 us
NVFP4, 411.4 vs 406.9 MXFP4 at T=16).  Several row tiles per program (one after the other, or in
one loop flattened by Triton, the ring running on across the tiles): no gain either (tenth session, T=16:
437.1 / 409.7 us with 2 flattened tiles against 449.1 / 406.0, slower at T=4..8; code not kept), so the
programs' start and the ring's fill are not the cost.
``"probe": True``: the same grid, loads and ring with the words xor-ed instead of the math (a garbage
result, timing only): at T=16 the loads alone take 1.2-1.4x a contiguous read of the same bytes (NVFP4 360-366,
MXFP4 312-341 us, against 256) and the math adds ~90-130 us on top (BENCHMARKS.md, tenth session).
Eleventh session: that math is bound by the integer ALU pipe (ncu at T=16, routed forms: 62-74% busy, half the
scheduler's issue rate, while the FMA pipe idles at 4-6%; the top stall is that pipe's throttle), and more
programs per SM gain nothing.  So the B operands' zeroing (``_to_lanes``) is an IMAD by the lane's 0 / 1 instead of
a SEL per word, and two of the decode's shifts are IMAD.SHL (``decode_ptx.HG_DECODE``): 424 -> 295 ALU instructions
per MXFP4 iteration, -7 to -10% at T=4..16 (MXFP4), -2 to -5% (NVFP4), same results bit for bit.

``USE_ASM=False`` (the CPU interpreter): the same loads, lane roles and pointers in plain Triton,
the MMA emulated across the warp's lanes (zero B columns included), the decode by value; in the
staged loop the very loads of the GPU path, recast to the emulation's operands.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .fp4_moe_mma import _lanes, _pick, _rank_pairs
from .mma_ptx import HMMA_CONSTRAINTS, hmma_asm, ldg_asm
from .moe_pairs import _expert_rows, _ticket_sum, merged_config
from .pdl import launch_args, wait

_HM_NV = tl.constexpr(hmma_asm("nvfp4"))
_HM_MX = tl.constexpr(hmma_asm("mxfp4"))
_HM_C = tl.constexpr(HMMA_CONSTRAINTS)

# Per kernel: warps per program, warps sharing rows (K split), 16-byte chunks per row per lane per
# iteration.  "prefetch": 1 = the K loop unrolled by two with two weight buffers (the next
# iteration's weights load during this one's math, no register copies), 2 = two iterations ahead
# in three rotating buffers (costs ~20 register moves per iteration), 0 = the staged loop ("stages"
# ring buffers, default 3; nsub 2 or 4 for NVFP4, 4 for MXFP4; see the module docstring).  "maxnreg": ptxas register
# cap; left free (~96-128) ptxas issues the prefetch loads just before their use (SASS), 168 lets
# it issue them early and still fits 3 programs of 4 warps per SM (384 programs at T=1: one wave).
# "w_hint": cache qualifier of the weight loads (e.g. ".L1::no_allocate").
HMMA_CONFIG = {
    "gate_up": dict(num_warps=4, ksplit=1, nsub=2),
    "down": dict(num_warps=4, ksplit=1, nsub=2),
    "prefetch": 1,
    "maxnreg": 168,
    "w_hint": "",
    # programmatic dependent launch (``ops/triton/pdl.py``) for the prologue, gate/up and down kernels, as every
    # other kernel of ours (since the thirteenth session; False: the classic launch)
    "pdl": True,
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


def hmma_supports(hidden: int, intermediate: int, cfg: dict | None = None, limit: float = 10.0,
                  is_nv: bool = True) -> bool:
    """Whether the kernels tile these sizes (K a multiple of 32 KL NSUB per matrix, twice that where
    the K loop is unrolled by two), the limit gives a static activation prescale and, for the staged
    loop (prefetch 0), a row's scale window per iteration (KL nsub chunks, 2 bytes each NVFP4, 1 MXFP4)
    is whole 16-byte copies: with ksplit 1, nsub 2 or 4 (NVFP4), 4 (MXFP4); ``share`` needs the staged loop
    and ksplit 1."""
    cfg = hmma_config(cfg)
    gu, dn = cfg["gate_up"], cfg["down"]
    ok = act_prescale(limit) is not None
    for c, k, rows, n in ((gu, hidden, 8, intermediate), (dn, intermediate, 16, hidden)):
        nw, ks, ns = c["num_warps"], c["ksplit"], c["nsub"]
        # K: whole iterations, an even number of them where the K loop is unrolled by two (prefetch 1, 2)
        unroll = 1 if cfg["prefetch"] == 0 else 2
        ok = ok and nw % ks == 0 and k % (unroll * 32 * 4 * ks * ns) == 0 and n % (rows * (nw // ks)) == 0
        if cfg["prefetch"] == 0:  # the scale window (KL NSUB SB bytes) in whole 16-byte copies
            ok = ok and (4 * ks * ns * (2 if is_nv else 1)) % 16 == 0
        if cfg.get("share"):  # one activation copy per program: staged, and every warp on the same K
            ok = ok and cfg["prefetch"] == 0 and ks == 1
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
def _emu_bytes(w0, w1, w2, w3):
    """Four int32 words [NT] (one chunk of a row) -> the [NT, 16] bytes ``_ld_w``'s twin loads."""
    t = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (w0.shape[0], 4, 1))  # [NT, word, 1]
    b = (t >> (8 * tl.arange(0, 4))[None, None, :]) & 255  # little-endian bytes
    return tl.reshape(b, (w0.shape[0], 16))


@triton.jit
def _emu_acts(x, o: tl.constexpr):
    """A chunk's 16 int32 words of pair-order fp16 activations (``x[o] .. x[o + 15]``, [NT] each: per 8 K
    values words (x0, x4), (x1, x5), (x2, x6), (x3, x7)) -> [NT, 32] fp32 in natural K order (as
    ``_ld_x``'s twin loads them)."""
    NT: tl.constexpr = x[o].shape[0]
    g0 = tl.join(tl.join(x[o], x[o + 2]), tl.join(x[o + 1], x[o + 3]))  # [NT, 2, 2]: word w at [w // 2, w % 2]
    g1 = tl.join(tl.join(x[o + 4], x[o + 6]), tl.join(x[o + 5], x[o + 7]))
    g2 = tl.join(tl.join(x[o + 8], x[o + 10]), tl.join(x[o + 9], x[o + 11]))
    g3 = tl.join(tl.join(x[o + 12], x[o + 14]), tl.join(x[o + 13], x[o + 15]))
    words = tl.reshape(tl.join(tl.join(g0, g2), tl.join(g1, g3)), (NT, 4, 4))  # [NT, word, group]
    halves = tl.join(words & 0xFFFF, (words >> 16) & 0xFFFF)  # [NT, word, group, lo / hi]
    v = halves.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.reshape(tl.permute(v, (0, 2, 3, 1)), (NT, 32))  # K = 8 group + 4 hi + word


@triton.jit
def _emu_chunk_operands(w, x, NSUB: tl.constexpr):
    """The staged loop's loaded words in the emulation's operand form: (2 NSUB chunks of [NT, 16] bytes,
    NSUB chunks of [NT, 32] fp32 activations)."""
    if NSUB == 2:
        we = (_emu_bytes(w[0], w[1], w[2], w[3]), _emu_bytes(w[4], w[5], w[6], w[7]),
              _emu_bytes(w[8], w[9], w[10], w[11]), _emu_bytes(w[12], w[13], w[14], w[15]))
        xe = (_emu_acts(x, 0), _emu_acts(x, 16))
    else:
        tl.static_assert(NSUB == 4, "the staged loop takes nsub 2 or 4")
        we = (_emu_bytes(w[0], w[1], w[2], w[3]), _emu_bytes(w[4], w[5], w[6], w[7]),
              _emu_bytes(w[8], w[9], w[10], w[11]), _emu_bytes(w[12], w[13], w[14], w[15]),
              _emu_bytes(w[16], w[17], w[18], w[19]), _emu_bytes(w[20], w[21], w[22], w[23]),
              _emu_bytes(w[24], w[25], w[26], w[27]), _emu_bytes(w[28], w[29], w[30], w[31]))
        xe = (_emu_acts(x, 0), _emu_acts(x, 16), _emu_acts(x, 32), _emu_acts(x, 48))
    return we, xe


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
def _words4(p):
    """Four int32 words from ``p [NT]`` (16-byte aligned int32 pointers): one 16-byte load per
    lane, as 4 tensors [NT] (a plain load, so Triton's pipeliner can make it asynchronous)."""
    return _split4(tl.load(p[:, None] + tl.arange(0, 4)[None, :]))


@triton.jit
def _ld_w_words(p, ROWB: tl.constexpr, NSUB: tl.constexpr, CS: tl.constexpr):
    """The staged loop's weights: ``p`` int32 pointers; NSUB (2 or 4) chunks CS chunks apart of row a,
    then of row b, as 4 words per chunk (``_chunk``'s order)."""
    S: tl.constexpr = 4 * CS  # words from one of the lane's chunks to the next
    B: tl.constexpr = ROWB // 4
    if NSUB == 2:
        return _words4(p) + _words4(p + S) + _words4(p + B) + _words4(p + B + S)
    else:
        tl.static_assert(NSUB == 4, "the staged loop takes nsub 2 or 4")
        return (_words4(p) + _words4(p + S) + _words4(p + 2 * S) + _words4(p + 3 * S) + _words4(p + B)
                + _words4(p + B + S) + _words4(p + B + 2 * S) + _words4(p + B + 3 * S))


@triton.jit
def _split4(t):
    """[NT, 4] -> its four columns as [NT] tensors."""
    ev, od = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))  # words (0, 2), (1, 3)
    w0, w2 = tl.split(ev)
    w1, w3 = tl.split(od)
    return w0, w1, w2, w3


@triton.jit
def _to_lanes(v, USE_ASM: tl.constexpr):
    """A chunk's B-operand words per column, broadcast to every lane (``v [NW, 8, 4, 16]``) -> the lanes'
    words: lane (g, q) keeps column g's if it is that column's feeder (q == g // 2), else zeros (as the zero
    row); as 16 [NT] tensors in ``_chunk``'s order.  On the GPU the zeroing is an integer multiply by the
    lane's 0 / 1 (IMAD, on the FMA pipe), not a select: the K loop is bound by the integer ALU pipe (ncu,
    T=16: 73% busy, the decode's and the selects' LOP3 / SHF / SEL), which the multiply leaves alone."""
    NW: tl.constexpr = v.shape[0]
    g = tl.arange(0, 8)[None, :, None, None]
    q = tl.arange(0, 4)[None, None, :, None]
    if USE_ASM:
        keep = tl.broadcast_to((q == g // 2).to(tl.int32), v.shape)
        lanes = tl.inline_asm_elementwise("mul.lo.u32 $0, $1, $2;", "=r,r,r", [v, keep], dtype=tl.int32,
                                          is_pure=True, pack=1)
    else:
        lanes = tl.where(q == g // 2, v, 0)
    # [NT, 16] -> four [NT, 4] groups of words (word 4 (2 hi + lo) + i at [:, i, hi, lo])
    lo0, lo1 = tl.split(tl.permute(tl.reshape(lanes, (32 * NW, 2, 2, 4)), (0, 3, 1, 2)))
    g0, g2 = tl.split(lo0)
    g1, g3 = tl.split(lo1)
    return _split4(g0) + _split4(g1) + _split4(g2) + _split4(g3)


@triton.jit
def _feeder_chunk(p8, f8, o: tl.constexpr, NW: tl.constexpr, USE_ASM: tl.constexpr):
    """One chunk's 16 int32 words of B operands at ``p8 [NW, 8] + o`` (B column j's feeder's pointer),
    copied once per column (masked by ``f8``), not once per lane, and handed to the lanes (``_to_lanes``)."""
    v = tl.load(p8[:, :, None] + (o + tl.arange(0, 16))[None, None, :], mask=f8[:, :, None], other=0)  # [NW, 8, 16]
    return _to_lanes(tl.broadcast_to(v[:, :, None, :], (NW, 8, 4, 16)), USE_ASM)


@triton.jit
def _shared_chunk(v, NW: tl.constexpr, USE_ASM: tl.constexpr):
    """One chunk's [8, 16] words of a per-program copy (SHARE), read by every warp."""
    return _to_lanes(tl.broadcast_to(v[None, :, None, :], (NW, 8, 4, 16)), USE_ASM)


@triton.jit
def _ld_x_feeders(p8, f8, NSUB: tl.constexpr, NW: tl.constexpr, CS: tl.constexpr, SHARE: tl.constexpr,
                  USE_ASM: tl.constexpr):
    """The staged loop's B operands: per chunk (NSUB of them, CS chunks apart) 16 words, one copy per B column
    and warp (``p8`` / ``f8`` [NW, 8]), or with SHARE one per column and program (``p8`` / ``f8`` [8]: K split 1,
    every warp takes the same K)."""
    S: tl.constexpr = 16 * CS
    if SHARE:  # one [8, NSUB, 16] copy (4 words per thread at NSUB 4: 16-byte copies), split per chunk
        c = tl.arange(0, NSUB)[None, :, None] * S + tl.arange(0, 16)[None, None, :]
        v = tl.permute(tl.load(p8[:, None, None] + c, mask=f8[:, None, None], other=0), (0, 2, 1))  # [8, 16, NSUB]
        if NSUB == 2:
            v0, v1 = tl.split(v)
            return _shared_chunk(v0, NW, USE_ASM) + _shared_chunk(v1, NW, USE_ASM)
        else:
            tl.static_assert(NSUB == 4, "the staged loop takes nsub 2 or 4")
            ev, od = tl.split(tl.reshape(v, (8, 16, 2, 2)))  # chunks (0, 2), (1, 3)
            v0, v2 = tl.split(ev)
            v1, v3 = tl.split(od)
            return (_shared_chunk(v0, NW, USE_ASM) + _shared_chunk(v1, NW, USE_ASM) + _shared_chunk(v2, NW, USE_ASM)
                    + _shared_chunk(v3, NW, USE_ASM))
    elif NSUB == 2:
        return _feeder_chunk(p8, f8, 0, NW, USE_ASM) + _feeder_chunk(p8, f8, S, NW, USE_ASM)
    else:
        tl.static_assert(NSUB == 4, "the staged loop takes nsub 2 or 4")
        return (_feeder_chunk(p8, f8, 0, NW, USE_ASM) + _feeder_chunk(p8, f8, S, NW, USE_ASM)
                + _feeder_chunk(p8, f8, 2 * S, NW, USE_ASM) + _feeder_chunk(p8, f8, 3 * S, NW, USE_ASM))


@triton.jit
def _per_column(v, NW: tl.constexpr):
    """[NT] per-lane values -> [NW, 8] the value of B column j's feeder lane (g = j, q = j // 2)."""
    g = tl.arange(0, 8)[None, :, None]
    q = tl.arange(0, 4)[None, None, :]
    return tl.sum(tl.where(q == g // 2, tl.reshape(v, (NW, 8, 4)), 0), axis=2)


@triton.jit
def _per_column_shared(v, NW: tl.constexpr):
    """[NT] per-lane values -> [8] warp 0's ``_per_column`` (the same in every warp when K is not split)."""
    w = tl.arange(0, NW)[:, None, None]
    g = tl.arange(0, 8)[None, :, None]
    q = tl.arange(0, 4)[None, None, :]
    return tl.sum(tl.sum(tl.where((w == 0) & (q == g // 2), tl.reshape(v, (NW, 8, 4)), 0), axis=2), axis=0)


@triton.jit
def _pick_word(win, i, W0: tl.constexpr, SW: tl.constexpr):
    """``win [NT, NWW]`` (each lane's own words) -> [NT] word ``W0 + i`` (per lane, ``0 <= i < SW``), selected in
    registers.  The static range test lets the compiler drop the selects of the words outside W0 .. W0 + SW - 1
    (a thread holds its whole row of ``win``, so each position is a compile-time constant)."""
    c = tl.arange(0, win.shape[1])[None, :]
    hit = (c >= W0) & (c < W0 + SW) & (c - W0 == i[:, None])
    return tl.sum(tl.where(hit, win, 0), axis=1)


@triton.jit
def _ld_s_window(p, kl, SROWB: tl.constexpr, NSUB: tl.constexpr, KL: tl.constexpr, IS_NV: tl.constexpr):
    """``_ld_s`` for the staged loop: the iteration's scale window of rows a and b (``p`` int32 pointers
    to the window of row a: the KL NSUB chunks' SB bytes each, 16-byte copies, asynchronous in the
    pipeliner's ring), and of it the lane's NSUB raw scales per row (chunks kl + KL j).  (One copy per
    row, [NW, 8, NWW] broadcast to the row's 4 lanes, is one word per thread: the compiler then picks
    the bytes across lanes -- 64 shuffles, 32 shared stores and 15 more barriers per iteration, SASS.)"""
    SB: tl.constexpr = 2 if IS_NV else 1
    NWW: tl.constexpr = KL * NSUB * SB // 4  # words per row and iteration
    MASK: tl.constexpr = 0xFFFF if IS_NV else 0xFF
    # chunk kl + KL j's bytes lie in words j SW .. j SW + SW - 1 (kl < KL); the window is copied in pieces of at most
    # 4 words (one 16-byte copy per thread: a wider [NT, NWW] tensor is split across threads, and the pick then
    # shuffles across lanes through shared memory -- SASS)
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
            KL: tl.constexpr, NSUB: tl.constexpr, PF: tl.constexpr, IS_NV: tl.constexpr, NW: tl.constexpr,
            WLD: tl.constexpr, SLD: tl.constexpr, XLD: tl.constexpr, USE_ASM: tl.constexpr,
            STAGES: tl.constexpr = 3, SHARE: tl.constexpr = False, PROBE: tl.constexpr = False):
    """This lane's chunks of rows a and b (scales at ``s_ptr + soff``) against its B operands (``xb + xoff``,
    fp16): (c0, c1, c2, c3) per lane.  PROBE (staged loop): the same loads and ring, their words xor-ed
    instead of the FP4 math (a garbage result: what the loads alone cost, ``benchmarks/moe_op.py``)."""
    NT: tl.constexpr = 32 * NW
    SB: tl.constexpr = 2 if IS_NV else 1
    z = tl.zeros((NT,), dtype=tl.float32)
    acc = (z, z, z, z)
    if PF == 0:
        # staged: a tl.range(num_stages) loop of plain loads, which Triton's pipeliner turns into a ring of
        # STAGES asynchronous copies (as ``fp4_moe_stream``).  An iteration covers KL NSUB adjacent chunks of
        # the row, lane slot kl's being kl, kl + KL, ... (the kernels' pointers), and each lane copies the
        # row's scale window of the iteration (16-byte copies) and picks its bytes.  (Measured slower:
        # a lane's scales as one 4- or 8-byte copy, with its NSUB chunks adjacent: 62-66 us at T=1,
        # 579-659 at T=16, whether the lane slots own contiguous quarters of the row or adjacent spans.)
        # The interpreter runs these same loads (pointers, feeder columns, masks, scale words); only the
        # MMA is emulated, on the loaded words recast to its operand form (``_emu_chunk_operands``).
        wa32 = wa.to(tl.pointer_type(tl.int32), bitcast=True)
        s32 = s_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        x32 = xb.to(tl.pointer_type(tl.int32), bitcast=True)
        # the B operands: one copy per column from its feeder's offset (a multiple of 32 fp16: the
        # compiler then knows the 16-byte alignment and copies 16 bytes at a time), not one per lane;
        # SHARE: one copy per program, which every warp reads (they take the same K): 1/NW of the copies
        if SHARE:
            p8 = x32 + tl.multiple_of(_per_column_shared(xoff, NW) // 2, [16])
            f8 = _per_column_shared(feed.to(tl.int32), NW) != 0
        else:
            p8 = x32 + tl.multiple_of(_per_column(xoff, NW) // 2, [16, 16])
            f8 = _per_column(feed.to(tl.int32), NW) != 0
        sa32 = s32 + soff // 4
        for it in tl.range(NIT, num_stages=STAGES):
            s = _ld_s_window(sa32 + it * (SB * KL * NSUB // 4), kl, SROWB, NSUB, KL, IS_NV)
            w = _ld_w_words(wa32 + it * (4 * KL * NSUB), ROWB, NSUB, KL)
            x = _ld_x_feeders(p8 + it * (16 * KL * NSUB), f8, NSUB, NW, KL, SHARE, USE_ASM)
            if PROBE:
                v = s[0]
                for i in tl.static_range(1, len(s)):
                    v = v ^ s[i]
                for i in tl.static_range(len(w)):
                    v = v ^ w[i]
                for i in tl.static_range(len(x)):
                    v = v ^ x[i]
                acc = (acc[0] + v.to(tl.float32), acc[1], acc[2], acc[3])
            elif USE_ASM:
                for j in tl.static_range(NSUB):
                    acc = _chunk(acc, w, s, x, j, NSUB, IS_NV, NW, USE_ASM)
            else:
                we, xe = _emu_chunk_operands(w, x, NSUB)
                for j in tl.static_range(NSUB):
                    acc = _chunk(acc, we, s, xe, j, NSUB, IS_NV, NW, USE_ASM)
        return acc
    sa = s_ptr + soff
    xq = xb + xoff
    WST: tl.constexpr = 16 * KL * NSUB  # bytes per iteration and row
    SST: tl.constexpr = SB * KL * NSUB
    XST: tl.constexpr = 32 * KL * NSUB  # fp16 activations per iteration
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
    STAGES: tl.constexpr = 3, SHARE: tl.constexpr = False, TILES_FIRST: tl.constexpr = False,
    PROBE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    wait(PDL)
    pid_p = tl.program_id(1 if TILES_FIRST else 0)
    pid_n = tl.program_id(0 if TILES_FIRST else 1)
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
        # lane slot kl's K: chunks kl, kl + KL, ... (16 bytes each); its scales at kl (SB bytes each), or in the
        # staged loop the row's window (every lane slot's, from the row's start)
        SOFF: tl.constexpr = 0 if PF == 0 else (2 if IS_NV else 1)
        wa = w_ptr + row * HB + kl * 16
        soff = row * SR + kl * SOFF
        gg = tl.load(g_ptr + 2 * e) * 16384.0  # undoes the decode's 2**-14
        gu = tl.load(g_ptr + 2 * e + 1) * 16384.0
        no = pid_n * (8 * RG) + tl.arange(0, 8 * RG)  # rows of the reduced result
        T = P // TOPK
        c0r = count * 0
        while c0r < count:  # passes of 2 tokens (ranks c0r, c0r + 1)
            pairs8 = _rank_pairs(offs, match, rank, c0r)
            brow = _b_row(pairs8, g, c0r, count, T, q, TOPK)
            acc = _k_loop(wa, s_ptr, soff, kl, xh_ptr, brow * D + kl * 32, brow != T, D // (32 * KL * NSUB), I * HB,
                          I * SR, KL, NSUB, PF, IS_NV, NW, WLD, SLD, XLD, USE_ASM, STAGES, SHARE, PROBE)
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
    act_ptr, ids_ptr, rw_ptr, w_ptr, s_ptr, g_ptr, y_ptr, out_ptr, tk_ptr, P,
    I: tl.constexpr, D: tl.constexpr, PB: tl.constexpr, IS_NV: tl.constexpr, YSCALE: tl.constexpr,
    NW: tl.constexpr, KSPLIT: tl.constexpr, NSUB: tl.constexpr, PF: tl.constexpr,
    WLD: tl.constexpr, SLD: tl.constexpr, XLD: tl.constexpr, USE_ASM: tl.constexpr, STAGES: tl.constexpr = 3,
    SHARE: tl.constexpr = False, TILES_FIRST: tl.constexpr = False, PROBE: tl.constexpr = False,
    TOPK: tl.constexpr = 1, TICKET: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    wait(PDL)
    pid_p = tl.program_id(1 if TILES_FIRST else 0)
    pid_n = tl.program_id(0 if TILES_FIRST else 1)
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
        SOFF: tl.constexpr = 0 if PF == 0 else (2 if IS_NV else 1)  # as in the gate/up kernel
        wa = w_ptr + row * HB + kl * 16
        soff = row * SR + kl * SOFF
        gw = tl.load(g_ptr + e) * YSCALE  # 2**(14 - SA): undoes the decode's 2**-14 and act's 2**SA
        ro = pid_n * (16 * RG) + tl.arange(0, 8 * RG)
        c0r = count * 0
        while c0r < count:
            pairs8 = _rank_pairs(offs, match, rank, c0r)
            brow = _b_row(pairs8, g, c0r, count, P, q, 1)
            acc = _k_loop(wa, s_ptr, soff, kl, act_ptr, brow * I + kl * 32, brow != P, I // (32 * KL * NSUB),
                          8 * RG * HB, 8 * RG * SR, KL, NSUB, PF, IS_NV, NW, WLD, SLD, XLD, USE_ASM, STAGES, SHARE,
                          PROBE)
            for h in tl.static_range(2):
                pair = _pair_of(pairs8, h)
                ok = c0r + h < count
                f = tl.load(rw_ptr + pair, mask=ok, other=0.0) * gw  # routing weight after w2 (fp32)
                dst = y_ptr + pair.to(tl.int64) * D + ro
                tl.store(dst, _rows_sum(acc[h], RG, KSPLIT) * f, mask=ok)
                tl.store(dst + 8 * RG, _rows_sum(acc[2 + h], RG, KSPLIT) * f, mask=ok)
            if TICKET:  # each token's last pair sums its k rows of this 16 RG-row tile into out
                for h in tl.static_range(2):
                    if c0r + h < count:
                        _ticket_sum(y_ptr, out_ptr, tk_ptr, _pair_of(pairs8, h), pid_n, D // (16 * RG), D, TOPK,
                                    16 * RG)
            c0r += 2


def launch_hmma(x, ids, rw, w13, w13_scale, w13_global, w2, w2_scale, w2_global, act, y, *, k, group_size, is_nv,
                limit, use_asm, cfg, only=None, out=None, tickets=None):
    """Prologue, gate/up and down kernels into ``y``; with ``out`` and ``tickets``
    (``moe_pairs.sum_tickets``) the down kernel also sums each token's rows into ``out``, else the
    sum kernel is the caller's.  ``act`` (the caller's bf16 workspace) is not used: these kernels
    keep their own fp16 copy."""
    del act
    p = ids.numel()
    t, d = x.shape
    inter = w2.shape[-1] * 2
    cfg = hmma_config(cfg)
    sa = act_prescale(limit)
    if group_size != (16 if is_nv else 32):
        raise ValueError(f"hmma: unexpected group size {group_size} for {'nvfp4' if is_nv else 'mxfp4'}.")
    if sa is None or not hmma_supports(d, inter, cfg, limit, is_nv):
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
    share = bool(cfg.get("share", False))  # hmma_supports (above) checked it: staged, ksplit 1
    # "tiles_first": the grid's fastest axis walks one expert's row tiles (programs running together stream
    # a few experts' weights), not the pairs (they then read the same row tile of up to ~100 experts at once,
    # addresses a power-of-two expert stride apart)
    tf = bool(cfg.get("tiles_first", False))
    probe = bool(cfg.get("probe", False))  # the loads without the math (a garbage result, timing only)
    if probe and pf != 0:
        raise ValueError("hmma probe: the staged loop only (prefetch 0).")

    def grid(pairs, tiles):
        return (tiles, pairs) if tf else (pairs, tiles)

    if pf == 0 and stages < 1:
        raise ValueError(f"hmma staged loop (prefetch 0): stages >= 1, got {stages}.")
    regs = {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and not interp else {}
    regs.update(launch_args(x.device) if cfg.get("pdl", True) else {"PDL": False})
    if only in (None, "gate_up"):
        _x_f16_kernel[(t + 1,)](x, xh, xs, act16, t, p, d, inter, DP=triton.next_power_of_2(d),
                                IP=triton.next_power_of_2(inter), num_warps=4,
                                **{kk: v for kk, v in regs.items() if kk != "maxnreg"})
        nw, ks = gu["num_warps"], gu["ksplit"]
        wld, sld, xld = load_asms("gate_up", d, inter, is_nv, cfg)
        _gate_up_hmma_kernel[grid(p, inter // (8 * nw // ks))](
            xh, xs, ids, w13.view(torch.uint8), w13_scale.view(torch.uint8), w13_global.float().contiguous(), act16, p,
            inter, d, TOPK=k, PB=pb, IS_NV=is_nv, LIMIT=float(limit), ASCALE=2.0**sa, NW=nw, KSPLIT=ks,
            NSUB=gu["nsub"], PF=pf,
            WLD=wld, SLD=sld, XLD=xld, USE_ASM=use_asm, STAGES=stages, SHARE=share, TILES_FIRST=tf, PROBE=probe,
            num_warps=nw, num_stages=1, **regs,
        )
    if only in (None, "down"):
        nw, ks = dn["num_warps"], dn["ksplit"]
        wld, sld, xld = load_asms("down", inter, 8 * (nw // ks), is_nv, cfg)
        ticket = out is not None and tickets is not None
        _down_hmma_kernel[grid(p, d // (16 * nw // ks))](
            act16, ids, rw, w2.view(torch.uint8), w2_scale.view(torch.uint8), w2_global.float().contiguous(), y,
            out if ticket else y, tickets if ticket else ids, p,
            inter, d, PB=pb, IS_NV=is_nv, YSCALE=2.0 ** (14 - sa), NW=nw, KSPLIT=ks, NSUB=dn["nsub"], PF=pf,
            WLD=wld, SLD=sld, XLD=xld, USE_ASM=use_asm, STAGES=stages, SHARE=share, TILES_FIRST=tf, PROBE=probe,
            TOPK=k, TICKET=ticket, num_warps=nw, num_stages=1, **regs,
        )
