"""fp16x2 (HFMA2) GEMV path of ``dsv4_mtp::fp4_moe`` on CUDA: the structure of ``fp4_moe_gemv``
(leader program per expert, no shared memory in the K loop, fp32 scale and running sums) with
about half the instructions per weight.

Status: opt-in (``fp4_moe_triton.CONFIG["hgemv_min_tokens"] .. ["hgemv_max_tokens"]``, default
off), because its fp16 partial sums are less exact than the fp32-accumulating default (below).
Static SASS (sm_90, V4-Flash, T=1, ``benchmarks/sass_count.py``): gate/up K loop 2.37
instructions per weight (NVFP4), 2.19 with ``scale16``, 2.12 (MXFP4), against 4.6-5.2 for
``fp4_moe_gemv``; no spills, <= 128 registers (167 with ``pf``).  H200 (BENCHMARKS.md,
2026-11-30, NVFP4, V4-Flash, same run): 48.0 / 75.6 / 117.6 / 429.5 µs at T = 1 / 2 / 4 / 16
against 52.8 / 90.2 / 163.8 / 469.9 µs for the default path; Nsight Compute at T=1: gate/up
21.9 µs and down 14.8 µs against 29.6 and 17.0 µs (the bytes alone: 16.4 + 9.4 µs).

Accuracy limit, measured on the H200 (T=20, against float64): relative error 2.4e-3 at unit
activations (the default path: 2.3e-3), 3.1e-3 at 30x, 6.9e-3 at 300x, 1.8e-2 at 2000x.  The
fp16 group sums leave the gate and up values with an absolute error of ~2**-11 of their
magnitude; SwiGLU's fixed clamp (L = 10) and silu's bend near zero turn that into output error
once the gate values are hundreds of times L.  An outlier alone does not (6e4 in a unit row:
2.3e-3), as the prescale is per token.

Why: at T=1 the FMA GEMV issues ~4.7 SASS instructions per weight, mostly the e2m1 -> fp32
decode (2-3 per weight) and one FFMA.  Here two weights are decoded at once straight into an
fp16x2 register and multiplied by fp16x2 activations with one ``fma.rn.f16x2``: 10 integer
instructions + 4 HFMA2 per 8 weights (``decode_ptx.HG_WORD`` explains the decode).

Layout: per K step a thread owns one 4-word chunk (32 weights, one 16-byte load) of each of its
rows; 32 threads of a warp cover BLOCK_K = 1024 weights of a row, the warps split the rows.  A
thread's 32 activations are loaded and converted to fp16 once per step and reused for all the
rows it owns (BLOCK_N * BLOCK_K / (1024 * num_warps) per matrix: 8 gate + 8 up rows by
default).  Activations and scales are loaded by inline PTX in the weights' layout: a plain
``tl.load`` would get a layout that spreads a chunk over several threads, and a shared-memory
conversion with barriers in every K step.

Numerics (where fp16 rounding enters, and why it is bounded):

* Weights: the decode gives the e2m1 value times 2**-14, exactly (fp16 normals and subnormals).
* Activations: prescaled by 2**s when converted bf16 -> fp16, s per token (per pair in the
  down kernel) from the row's largest magnitude: ``s = xtop + 126 - e_max`` clamped to
  [0, 100], so that 2**(xtop-1) <= max|x| * 2**s < 2**xtop (xtop = 15).  A static s cannot
  serve both ends: |x| up to 1e4 needs s <= 2 (fp16 max 65504), while keeping the products of
  typical |x| ~ 0.01-1 normal needs s of 7-10 or more.  The conversion is exact (8 significant
  bits into 11) for |x| >= max|x| * 2**-31; smaller values become fp16 subnormals or zero
  (absolute error < max|x| * 2**-39).
* Products e2m1 x x_h x 2**-14 have at most 2 + 8 significant bits: exact while normal, i.e.
  for |x| >= ~max|x| * 2**-13 (x_h >= 2).  Each ``fma.rn.f16x2`` rounds its sum once to 11
  bits: relative 2**-11 of the running lane sum, or, when it is subnormal, an absolute
  < 2**-25 in fp16 units = max|x| * 2**-25 in units of x (before the block scale).
* The fp16 sums run over one scale group only (8 products per lane NVFP4, 16 MXFP4), so
  their rounding errors are those of 8-16 adds, independent across groups.  No overflow:
  |lane| < 16 * 6 * 2**(xtop-14) = 192.
* Then the two lanes are converted to fp32 and added; the block scale multiply, the running
  sum over K, the global scale and the exact 2**(14 - s) undo are fp32.
* ``scale16`` (NVFP4, opt-in): the group's e4m3 scale (exact in fp16) multiplies the lanes in
  fp16 and the chunk's two groups are added in fp16 before the fp32 conversion: two more
  roundings (2**-11 relative each); xtop = 14 keeps it finite: |lane * scale| <=
  8 * 6 * 1 * 448 = 21504, two groups < 43008.
* max|x| >= 2**xtop clamps s to 0 (x_h = x): exact and overflow-free up to the fp16 range
  (65504) for the default; with ``scale16`` overflow-free for max|x| < 2**14 (or any |x| < 65504
  with block scales < 170).  NaN/inf inputs propagate.

Kernels (fixed grids that depend only on T: CUDA-graph safe, no host sync), as in
``fp4_moe_gemv``: ``_gate_up_hgemv_kernel`` grid (P, I / BLOCK_N) writes ``act [P, I]``
(bf16, ``silu(min(g, L)) * clamp(u, -L, L) * r``), ``_down_hgemv_kernel`` grid
(P, D / BLOCK_N) writes ``y [P, D]`` fp32, then ``moe_pairs._sum_kernel`` (the caller's).
``USE_ASM=False`` runs the same per-element math in plain Triton (the CPU interpreter).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .decode_ptx import HG_CHUNK_NV16, HG_GROUP2, HG_GROUP4, HG_XCVT
from .fp4_moe_triton import _decode_scale
from .moe_pairs import _expert_rows

_GROUP2 = tl.constexpr(HG_GROUP2)
_GROUP4 = tl.constexpr(HG_GROUP4)
_CHUNK_NV16 = tl.constexpr(HG_CHUNK_NV16)
_XCVT = tl.constexpr(HG_XCVT)

# Launch configuration per kernel: BLOCK_N rows per program, BLOCK_K weights per row per K step
# (BLOCK_K / 32 threads per row, one 32-weight chunk each; a thread owns BLOCK_N * BLOCK_K /
# (32 * 32 * num_warps) rows and reuses its converted activations across them), warps.
# "pf": load the next K step's weights during this one's math (more registers); "scale16":
# NVFP4 block scales applied in fp16 (fewer instructions, see the module docstring); "xtop":
# max|x| * 2**s < 2**xtop (None: 15, or 14 with scale16).
HGEMV_CONFIG = {
    "gate_up": dict(BLOCK_N=32, BLOCK_K=1024, num_warps=4),
    "down": dict(BLOCK_N=64, BLOCK_K=512, num_warps=4),
    "pf": False,
    "scale16": False,
    "xtop": None,
}


@triton.jit
def _pair_of_rank(offs, match, rank, r):
    """Pair index of the expert's rank-r pair (0 where it does not exist)."""
    return tl.sum(tl.where(match & (rank == r), offs, 0), axis=0)


@triton.jit
def _prescale(row_ptr, NW: tl.constexpr, NW2: tl.constexpr, XTOP: tl.constexpr):
    """Exponent s for a row of NW int32 words (bf16 pairs): max|x| * 2**s < 2**XTOP, s in [0, 100]."""
    o = tl.arange(0, NW2)
    w = tl.load(row_ptr + o, mask=o < NW, other=0)
    m = tl.max(tl.maximum(w & 0x7FFF, (w >> 16) & 0x7FFF), axis=0)  # bf16 bits order like |x|
    return tl.minimum(tl.maximum(XTOP + 126 - (m >> 7), 0), 100)


@triton.jit
def _split4(t, R: tl.constexpr, C: tl.constexpr):
    """[R, C, 4] -> its four [R, C] slices along the last dim."""
    a, b = tl.split(tl.reshape(t, (R, C, 2, 2)))
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _f16_bits(v):
    """fp32 -> fp16 (round to nearest even) bits in the low 16 bits of an int32."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _xpairs(xp, s2, USE_ASM: tl.constexpr):
    """The 8 activations of one weight word, 4 int32 words of bf16 pairs at xp[..] .. xp[..]+3
    (xp: pointers [C]) -> fp16x2 (K0,K4), (K1,K5), (K2,K6), (K3,K7), each x 2**s, as [1, C] int32.

    The asm path loads the 16 bytes itself (one ld.global.nc.v4 per weight word): a plain
    [C, 4] load would get a layout that spreads a chunk over several threads and costs a
    shared-memory round trip per K step to reach the weights' layout (one chunk per thread)."""
    if USE_ASM:
        p04, p15, p26, p37 = tl.inline_asm_elementwise(
            _XCVT, "=r,=r,=r,=r,l,r", [xp.to(tl.int64, bitcast=True), s2], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    else:
        x0 = tl.load(xp) + s2
        x1 = tl.load(xp + 1) + s2
        x2 = tl.load(xp + 2) + s2
        x3 = tl.load(xp + 3) + s2
        lo0 = _f16_bits((x0 << 16).to(tl.float32, bitcast=True))
        hi0 = _f16_bits((x0 & -65536).to(tl.float32, bitcast=True))
        lo1 = _f16_bits((x1 << 16).to(tl.float32, bitcast=True))
        hi1 = _f16_bits((x1 & -65536).to(tl.float32, bitcast=True))
        lo2 = _f16_bits((x2 << 16).to(tl.float32, bitcast=True))
        hi2 = _f16_bits((x2 & -65536).to(tl.float32, bitcast=True))
        lo3 = _f16_bits((x3 << 16).to(tl.float32, bitcast=True))
        hi3 = _f16_bits((x3 & -65536).to(tl.float32, bitcast=True))
        p04 = lo0 | (lo2 << 16)
        p15 = hi0 | (hi2 << 16)
        p26 = lo1 | (lo3 << 16)
        p37 = hi1 | (hi3 << 16)
    return p04[None, :], p15[None, :], p26[None, :], p37[None, :]


@triton.jit
def _load_scales(sp, IS_NV: tl.constexpr, USE_ASM: tl.constexpr):
    """Raw scales of one chunk per element (int32): two e4m3 bytes (NVFP4) or one e8m0 byte.
    asm loads for the same reason as ``_xpairs`` (a plain load would be vectorised along the
    chunks, i.e. spread differently from the weights, and need a layout conversion)."""
    if USE_ASM:
        if IS_NV:
            return tl.inline_asm_elementwise("ld.global.nc.u16 $0, [$1];", "=r,l", [sp.to(tl.int64, bitcast=True)],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [sp.to(tl.int64, bitcast=True)],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.load(sp).to(tl.int32) & (65535 if IS_NV else 255)


@triton.jit
def _nib_f16(c):
    """e2m1 code (int32 0..15) -> fp16 value x 2**-14 (same bits as the PTX decode)."""
    return (((c & 8) << 12) | ((c & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _lane(p, hi: tl.constexpr):
    """One fp16 lane of an fp16x2 int32."""
    if hi:
        return ((p >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return (p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _word_f16(q, p04, p15, p26, p37, a0, a1):
    """Plain-Triton twin of decode_ptx.HG_WORD: the same products (exact while normal, so a
    multiply then an add equals the fma) and fp16 adds, in the same order."""
    a0 = a0 + _nib_f16((q >> 12) & 15) * _lane(p37, False)
    a1 = a1 + _nib_f16((q >> 28) & 15) * _lane(p37, True)
    a0 = a0 + _nib_f16((q >> 4) & 15) * _lane(p15, False)
    a1 = a1 + _nib_f16((q >> 20) & 15) * _lane(p15, True)
    a0 = a0 + _nib_f16((q >> 8) & 15) * _lane(p26, False)
    a1 = a1 + _nib_f16((q >> 24) & 15) * _lane(p26, True)
    a0 = a0 + _nib_f16(q & 15) * _lane(p04, False)
    a1 = a1 + _nib_f16((q >> 16) & 15) * _lane(p04, True)
    return a0, a1


@triton.jit
def _group2(q0, q1, x0a, x0b, x0c, x0d, x1a, x1b, x1c, x1d, USE_ASM: tl.constexpr):
    """Two words (one NVFP4 scale group) . their activation pairs -> fp32 sum."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_GROUP2, "=r" + ",r" * 10, [q0, q1, x0a, x0b, x0c, x0d, x1a, x1b, x1c, x1d],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        z = tl.zeros(q0.shape, dtype=tl.float16)
        a0, a1 = _word_f16(q0, x0a, x0b, x0c, x0d, z, z)
        a0, a1 = _word_f16(q1, x1a, x1b, x1c, x1d, a0, a1)
        return a0.to(tl.float32) + a1.to(tl.float32)


@triton.jit
def _group4(q0, q1, q2, q3, x0a, x0b, x0c, x0d, x1a, x1b, x1c, x1d, x2a, x2b, x2c, x2d, x3a, x3b, x3c, x3d,
            USE_ASM: tl.constexpr):
    """Four words (one MXFP4 scale group) . their activation pairs -> fp32 sum."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            _GROUP4, "=r" + ",r" * 20,
            [q0, q1, q2, q3, x0a, x0b, x0c, x0d, x1a, x1b, x1c, x1d, x2a, x2b, x2c, x2d, x3a, x3b, x3c, x3d],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        z = tl.zeros(q0.shape, dtype=tl.float16)
        a0, a1 = _word_f16(q0, x0a, x0b, x0c, x0d, z, z)
        a0, a1 = _word_f16(q1, x1a, x1b, x1c, x1d, a0, a1)
        a0, a1 = _word_f16(q2, x2a, x2b, x2c, x2d, a0, a1)
        a0, a1 = _word_f16(q3, x3a, x3b, x3c, x3d, a0, a1)
        return a0.to(tl.float32) + a1.to(tl.float32)


@triton.jit
def _chunk_nv16(q0, q1, q2, q3, x0a, x0b, x0c, x0d, x1a, x1b, x1c, x1d, x2a, x2b, x2c, x2d, x3a, x3b, x3c, x3d, rs,
                USE_ASM: tl.constexpr):
    """NVFP4 chunk (two groups) with the block scales applied in fp16 (SCALE16) -> fp32."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            _CHUNK_NV16, "=r" + ",r" * 21,
            [q0, q1, q2, q3, x0a, x0b, x0c, x0d, x1a, x1b, x1c, x1d, x2a, x2b, x2c, x2d, x3a, x3b, x3c, x3d, rs],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        z = tl.zeros(q0.shape, dtype=tl.float16)
        a0, a1 = _word_f16(q0, x0a, x0b, x0c, x0d, z, z)
        a0, a1 = _word_f16(q1, x1a, x1b, x1c, x1d, a0, a1)
        b0, b1 = _word_f16(q2, x2a, x2b, x2c, x2d, z, z)
        b0, b1 = _word_f16(q3, x3a, x3b, x3c, x3d, b0, b1)
        sa = (rs & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        sb = ((rs >> 8) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        a0 = a0 * sa + b0 * sb  # the asm fuses the second product into an fma (one rounding fewer)
        a1 = a1 * sa + b1 * sb
        return a0.to(tl.float32) + a1.to(tl.float32)


@triton.jit
def _chunk_dot(acc, pw, rs, x0a, x0b, x0c, x0d, x1a, x1b, x1c, x1d, x2a, x2b, x2c, x2d, x3a, x3b, x3c, x3d,
               R: tl.constexpr, C: tl.constexpr, IS_NV: tl.constexpr, SCALE16: tl.constexpr, USE_ASM: tl.constexpr):
    """acc [R, C] + weight chunks [R, C, 4] (32 weights each) . activations x block scales.
    rs: the chunk's raw scales (int32): two e4m3 bytes (NVFP4) or one e8m0 byte (MXFP4)."""
    q0, q1, q2, q3 = _split4(pw, R, C)
    if IS_NV:
        if SCALE16:
            return acc + _chunk_nv16(q0, q1, q2, q3, x0a, x0b, x0c, x0d, x1a, x1b, x1c, x1d, x2a, x2b, x2c, x2d,
                                     x3a, x3b, x3c, x3d, rs, USE_ASM)
        sa = _group2(q0, q1, x0a, x0b, x0c, x0d, x1a, x1b, x1c, x1d, USE_ASM)
        sb = _group2(q2, q3, x2a, x2b, x2c, x2d, x3a, x3b, x3c, x3d, USE_ASM)
        acc = tl.fma(sa, _decode_scale((rs & 255).to(tl.uint8), True), acc)
        return tl.fma(sb, _decode_scale(((rs >> 8) & 255).to(tl.uint8), True), acc)
    else:
        s = _group4(q0, q1, q2, q3, x0a, x0b, x0c, x0d, x1a, x1b, x1c, x1d, x2a, x2b, x2c, x2d, x3a, x3b, x3c, x3d,
                    USE_ASM)
        return tl.fma(s, (rs << 23).to(tl.float32, bitcast=True), acc)  # e8m0 byte -> 2**(e-127)


@triton.jit
def _gate_up_hgemv_kernel(
    xw_ptr, ids_ptr, rw_ptr, w_ptr, s_ptr, g_ptr, act_ptr,
    P, I: tl.constexpr, D: tl.constexpr,
    TOPK: tl.constexpr, PB: tl.constexpr, IS_NV: tl.constexpr, LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, XW2: tl.constexpr, XTOP: tl.constexpr,
    SCALE16: tl.constexpr, PF: tl.constexpr, USE_ASM: tl.constexpr, NPASS: tl.constexpr = 0,
):
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, pid_p, P, PB)
    if earlier == 0:
        CH: tl.constexpr = BLOCK_K // 32  # 32-weight chunks per row per K step (one per thread)
        NK: tl.constexpr = D // BLOCK_K
        wrow: tl.constexpr = D // 8  # int32 words per row
        srow: tl.constexpr = D // 32  # scale elements per row (int16 NVFP4 pairs, or uint8 MXFP4)
        r = tl.arange(0, BLOCK_N)
        n = pid_n * BLOCK_N + r
        c = tl.arange(0, CH)
        jw = tl.arange(0, 4 * CH)
        # one scalar base per matrix and int32 tile offsets: a thread's rows then differ by
        # compile-time constants (immediate load offsets, no 64-bit address math per row)
        row0 = e * (2 * I) + pid_n * BLOCK_N
        wg = w_ptr + row0 * wrow
        wu = wg + I * wrow
        sg = s_ptr + row0 * srow
        su = sg + I * srow
        wo0 = (r * wrow)[:, None] + jw[None, :]  # K step 0 (for PF): [BN, 4*CH] words, 16-byte vectors
        so0 = (r * srow)[:, None] + c[None, :]  # and its [BN, CH] chunk scales
        gg = tl.load(g_ptr + 2 * e)
        gu = tl.load(g_ptr + 2 * e + 1)
        # one pass per token routed to this expert; runtime bound P on the GPU (no recompilation
        # per T), NPASS = P as a constexpr in the CPU interpreter (it cannot loop to a runtime int)
        for ci in range(NPASS if NPASS > 0 else P):
            if ci < count:
                p0 = _pair_of_rank(offs, match, rank, ci)
                x_row = xw_ptr + (p0 // TOPK).to(tl.int64) * (D // 2)
                s = _prescale(x_row, D // 2, XW2, XTOP)
                s2 = s * 0x00800080
                undo = ((141 - s) << 23).to(tl.float32, bitcast=True)  # 2**(14 - s)
                acc_g = tl.zeros((BLOCK_N, CH), dtype=tl.float32)
                acc_u = tl.zeros((BLOCK_N, CH), dtype=tl.float32)
                if PF:
                    pg = tl.load(wg + wo0)
                    pu = tl.load(wu + wo0)
                    rsg = _load_scales(sg + so0, IS_NV, USE_ASM)
                    rsu = _load_scales(su + so0, IS_NV, USE_ASM)
                for kk in range(NK):
                    if PF:  # the next K step's weights and scales in flight during this one's math
                        kn = tl.minimum(kk + 1, NK - 1)
                        pg_n = tl.load(wg + ((r * wrow)[:, None] + (kn * 4 * CH + jw)[None, :]))
                        pu_n = tl.load(wu + ((r * wrow)[:, None] + (kn * 4 * CH + jw)[None, :]))
                        rsg_n = _load_scales(sg + ((r * srow)[:, None] + (kn * CH + c)[None, :]), IS_NV, USE_ASM)
                        rsu_n = _load_scales(su + ((r * srow)[:, None] + (kn * CH + c)[None, :]), IS_NV, USE_ASM)
                    else:
                        pg = tl.load(wg + ((r * wrow)[:, None] + (kk * 4 * CH + jw)[None, :]))
                        pu = tl.load(wu + ((r * wrow)[:, None] + (kk * 4 * CH + jw)[None, :]))
                        rsg = _load_scales(sg + ((r * srow)[:, None] + (kk * CH + c)[None, :]), IS_NV, USE_ASM)
                        rsu = _load_scales(su + ((r * srow)[:, None] + (kk * CH + c)[None, :]), IS_NV, USE_ASM)
                    xc = x_row + (kk * CH + c) * 16
                    x0a, x0b, x0c, x0d = _xpairs(xc, s2, USE_ASM)
                    x1a, x1b, x1c, x1d = _xpairs(xc + 4, s2, USE_ASM)
                    x2a, x2b, x2c, x2d = _xpairs(xc + 8, s2, USE_ASM)
                    x3a, x3b, x3c, x3d = _xpairs(xc + 12, s2, USE_ASM)
                    acc_g = _chunk_dot(acc_g, tl.reshape(pg, (BLOCK_N, CH, 4)), rsg, x0a, x0b, x0c, x0d, x1a, x1b, x1c,
                                       x1d, x2a, x2b, x2c, x2d, x3a, x3b, x3c, x3d, BLOCK_N, CH, IS_NV, SCALE16, USE_ASM)
                    acc_u = _chunk_dot(acc_u, tl.reshape(pu, (BLOCK_N, CH, 4)), rsu, x0a, x0b, x0c, x0d, x1a, x1b, x1c,
                                       x1d, x2a, x2b, x2c, x2d, x3a, x3b, x3c, x3d, BLOCK_N, CH, IS_NV, SCALE16, USE_ASM)
                    if PF:
                        pg, pu, rsg, rsu = pg_n, pu_n, rsg_n, rsu_n
                g = tl.minimum(tl.sum(acc_g, axis=1) * (gg * undo), LIMIT)
                u = tl.minimum(tl.maximum(tl.sum(acc_u, axis=1) * (gu * undo), -LIMIT), LIMIT)
                a = g / (1.0 + tl.exp(-g)) * u * tl.load(rw_ptr + p0)
                tl.store(act_ptr + p0.to(tl.int64) * I + n, a.to(tl.bfloat16))


@triton.jit
def _down_hgemv_kernel(
    aw_ptr, ids_ptr, w_ptr, s_ptr, g_ptr, y_ptr,
    P, I: tl.constexpr, D: tl.constexpr,
    PB: tl.constexpr, IS_NV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, XW2: tl.constexpr, XTOP: tl.constexpr,
    SCALE16: tl.constexpr, PF: tl.constexpr, USE_ASM: tl.constexpr, NPASS: tl.constexpr = 0,
):
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, pid_p, P, PB)
    if earlier == 0:
        CH: tl.constexpr = BLOCK_K // 32
        NK: tl.constexpr = I // BLOCK_K
        wrow: tl.constexpr = I // 8
        srow: tl.constexpr = I // 32
        r = tl.arange(0, BLOCK_N)
        n = pid_n * BLOCK_N + r
        c = tl.arange(0, CH)
        jw = tl.arange(0, 4 * CH)
        row0 = e * D + pid_n * BLOCK_N
        wb = w_ptr + row0 * wrow
        sb = s_ptr + row0 * srow
        wo0 = (r * wrow)[:, None] + jw[None, :]
        so0 = (r * srow)[:, None] + c[None, :]
        gw = tl.load(g_ptr + e)
        # one pass per token routed to this expert; runtime bound P on the GPU (no recompilation
        # per T), NPASS = P as a constexpr in the CPU interpreter (it cannot loop to a runtime int)
        for ci in range(NPASS if NPASS > 0 else P):
            if ci < count:
                p0 = _pair_of_rank(offs, match, rank, ci)
                a_row = aw_ptr + p0.to(tl.int64) * (I // 2)
                s = _prescale(a_row, I // 2, XW2, XTOP)
                s2 = s * 0x00800080
                undo = ((141 - s) << 23).to(tl.float32, bitcast=True)
                acc = tl.zeros((BLOCK_N, CH), dtype=tl.float32)
                if PF:
                    pw = tl.load(wb + wo0)
                    rs = _load_scales(sb + so0, IS_NV, USE_ASM)
                for kk in range(NK):
                    if PF:
                        kn = tl.minimum(kk + 1, NK - 1)
                        pw_n = tl.load(wb + ((r * wrow)[:, None] + (kn * 4 * CH + jw)[None, :]))
                        rs_n = _load_scales(sb + ((r * srow)[:, None] + (kn * CH + c)[None, :]), IS_NV, USE_ASM)
                    else:
                        pw = tl.load(wb + ((r * wrow)[:, None] + (kk * 4 * CH + jw)[None, :]))
                        rs = _load_scales(sb + ((r * srow)[:, None] + (kk * CH + c)[None, :]), IS_NV, USE_ASM)
                    xc = a_row + (kk * CH + c) * 16
                    x0a, x0b, x0c, x0d = _xpairs(xc, s2, USE_ASM)
                    x1a, x1b, x1c, x1d = _xpairs(xc + 4, s2, USE_ASM)
                    x2a, x2b, x2c, x2d = _xpairs(xc + 8, s2, USE_ASM)
                    x3a, x3b, x3c, x3d = _xpairs(xc + 12, s2, USE_ASM)
                    acc = _chunk_dot(acc, tl.reshape(pw, (BLOCK_N, CH, 4)), rs, x0a, x0b, x0c, x0d, x1a, x1b, x1c, x1d,
                                     x2a, x2b, x2c, x2d, x3a, x3b, x3c, x3d, BLOCK_N, CH, IS_NV, SCALE16, USE_ASM)
                    if PF:
                        pw, rs = pw_n, rs_n
                tl.store(y_ptr + p0.to(tl.int64) * D + n, tl.sum(acc, axis=1) * (gw * undo))


def hgemv_supports(hidden: int, intermediate: int, cfg: dict | None = None) -> bool:
    cfg = cfg or HGEMV_CONFIG
    gu, dn = cfg["gate_up"], cfg["down"]
    return (hidden % gu["BLOCK_K"] == 0 and intermediate % gu["BLOCK_N"] == 0
            and intermediate % dn["BLOCK_K"] == 0 and hidden % dn["BLOCK_N"] == 0)


def launch_hgemv(x, ids, rw, w13, w13_scale, w13_global, w2, w2_scale, w2_global, act, y, *, k, group_size,
                 is_nv, limit, use_asm, cfg, only=None):
    """Gate/up and down HFMA2 GEMV kernels (the sum kernel is the caller's)."""
    p = ids.numel()
    t, d = x.shape
    inter = act.shape[1]
    pb = max(16, triton.next_power_of_2(p))
    gu, dn = cfg["gate_up"], cfg["down"]
    if group_size != (16 if is_nv else 32):
        raise ValueError(f"hgemv: unexpected group size {group_size} for {'nvfp4' if is_nv else 'mxfp4'}.")
    for c in (gu, dn):
        if c["BLOCK_K"] < 32 or c["BLOCK_K"] & (c["BLOCK_K"] - 1) or c["BLOCK_N"] & (c["BLOCK_N"] - 1):
            raise ValueError(f"hgemv config {c}: BLOCK_K (>= 32) and BLOCK_N must be powers of two.")
    if not hgemv_supports(d, inter, cfg):
        raise ValueError(f"D={d} / I={inter} must be multiples of the hgemv blocks {gu} / {dn}.")
    if x.data_ptr() % 16:  # the activations are read as 16-byte vectors
        x = x.clone()
    # scales per 32-weight chunk: two e4m3 bytes (one int16) for NVFP4, one e8m0 byte for MXFP4
    sview = torch.int16 if is_nv else torch.uint8
    scale16 = bool(cfg.get("scale16", False)) and is_nv
    xtop = cfg.get("xtop") or (14 if scale16 else 15)
    if not 1 <= xtop <= (14 if scale16 else 15):
        raise ValueError(f"hgemv xtop={xtop} would let fp16 group sums overflow (at most {14 if scale16 else 15}).")
    common = dict(IS_NV=is_nv, XTOP=xtop, SCALE16=scale16, PF=bool(cfg.get("pf", False)), USE_ASM=use_asm,
                  NPASS=p if os.environ.get("TRITON_INTERPRET", "0") == "1" else 0, num_stages=1)
    if only in (None, "gate_up"):
        _gate_up_hgemv_kernel[(p, inter // gu["BLOCK_N"])](
            x.view(torch.int32), ids, rw, w13.view(torch.int32), w13_scale.view(torch.uint8).view(sview),
            w13_global.float().contiguous(), act, p, inter, d, TOPK=k, PB=pb, LIMIT=float(limit),
            BLOCK_N=gu["BLOCK_N"], BLOCK_K=gu["BLOCK_K"], XW2=triton.next_power_of_2(d // 2),
            num_warps=gu["num_warps"], **common,
        )
    if only in (None, "down"):
        _down_hgemv_kernel[(p, d // dn["BLOCK_N"])](
            act.view(torch.int32), ids, w2.view(torch.int32), w2_scale.view(torch.uint8).view(sview),
            w2_global.float().contiguous(), y, p, inter, d, PB=pb,
            BLOCK_N=dn["BLOCK_N"], BLOCK_K=dn["BLOCK_K"], XW2=triton.next_power_of_2(inter // 2),
            num_warps=dn["num_warps"], **common,
        )
