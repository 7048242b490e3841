"""Triton (CUDA) implementation of ``dsv4_mtp::fp4_moe`` on the canonical packed layout.

Three launches, fixed grids that depend only on T (CUDA-graph safe, no host sync):

1. ``_gate_up_kernel``  grid ``(P = T*k, cdiv(I, BLOCK_N))``.  Program ``(p, nb)`` owns the
   expert ``e = topk_ids.flat[p]`` only if ``p`` is the first pair routed to ``e``
   ("leader"); other programs exit at once.  The leader gathers every pair routed to
   ``e`` (in-register histogram/rank over the ``P`` ids, no sort kernel), so each
   expert's weights are streamed exactly once per N block whatever T is.  It decodes
   FP4 in registers to exact bf16 values (e2m1 x block scale; the fp32 global scale is
   applied to the fp32 accumulator), runs gate and up as two bf16 MMAs with fp32
   accumulation, applies ``silu(min(g, L)) * clamp(u, -L, L) * r`` and writes the bf16
   activation row of each pair to a ``[P, I]`` workspace.
2. ``_down_kernel``  grid ``(P, cdiv(D, BLOCK_N))``: same leader scheme, ``w2`` decoded in
   registers, fp32 result per pair into a ``[P, D]`` fp32 workspace.
3. ``_sum_kernel``: ``out[t] = sum_j y[t*k + j]`` in a fixed order (deterministic).  The stream and
   hmma paths (the defaults at T=1..16) do this step inside their down kernel instead
   (``moe_pairs._ticket_sum``, ``CONFIG["ticket_sum"]``): one launch fewer, the same bits.

``config=dict(mma_max_tokens=64)`` routes T <= 64 to the opt-in mma.sync kernels of
``fp4_moe_mma`` instead (same three-step structure, decode straight into ``mma.sync``).
``CONFIG["stream_min_tokens"] .. ["stream_max_tokens"]`` (default: T=1..2 NVFP4, T=1 MXFP4, where it
measured faster, BENCHMARKS.md) routes steps 1-2 to the streamed FMA GEMV kernels of ``fp4_moe_stream``,
``CONFIG["hmma_min_tokens"] .. ["hmma_max_tokens"]`` (default: T=3..16 NVFP4, T=2..16 MXFP4) to the staged
fp16 mma.sync loop of ``fp4_moe_hmma``; the other ``*_min_tokens`` /
``*_max_tokens`` ranges (off by default) to the opt-in variants ``fp4_moe_gemv`` and ``fp4_moe_hgemv``.
Each range key (and the variant's config key) is one value or a dict by format name.

The even and odd K elements of a packed byte row (low / high nibbles) feed two MMAs
against the even / odd columns of the activations, so no nibble interleave is needed.

Decode (``decode_ptx``): and / mul / and per two weights gives the bf16 bits of the e2m1
value times 2**-126.  For NVFP4 ("fold", default) the block scale is taken as e4m3 x 2**63
and the fp32 global as g x 2**63, so one bf16x2 multiply per two weights applies the scale
and undoes the 2**-126, exactly; MXFP4 multiplies by 2**126 first (fold would be exact only
for E8M0 exponents 65..191; ``CONFIG["fold_mxfp4"]`` opts in).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ... import fp4
from ..fp4_moe import check_fp4_moe_inputs, fp4_moe, fp4_moe_reference
from .decode_ptx import DECODE_ASM, DECODE_ASM_RAW
from .fp4_moe_mma import fp4_moe_mma, mma_supports
from .moe_pairs import _expert_rows, _sum_kernel, flat_ids, sum_tickets
from . import pdl
from .pdl import wait

# The PTX decode (e2m1 nibbles -> bf16 bits) lives in ``decode_ptx`` (no Triton import, so
# CPU CI checks its constants bit for bit: tests/test_fp4_moe_op.py).
_DECODE_ASM = tl.constexpr(DECODE_ASM)
_DECODE_ASM_RAW = tl.constexpr(DECODE_ASM_RAW)


@triton.jit
def _decode_nibbles(packed, USE_ASM: tl.constexpr, FOLD: tl.constexpr = False):
    """uint8 [R, C] -> (low-nibble values, high-nibble values), bf16 [R, C], exact e2m1
    (times 2**-126 when FOLD)."""
    if FOLD:
        lo, hi = tl.inline_asm_elementwise(
            _DECODE_ASM_RAW, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )
    elif USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            _DECODE_ASM, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )
    else:
        # fp16 trick: (c&8)<<12 | (c&7)<<9 is the e2m1 value times 2**-14 (subnormals exact).
        b = packed.to(tl.int16)
        cl = b & 15
        ch = (b >> 4) & 15
        fl = (((cl & 8) << 12) | ((cl & 7) << 9)).to(tl.float16, bitcast=True)
        fh = (((ch & 8) << 12) | ((ch & 7) << 9)).to(tl.float16, bitcast=True)
        lo = (fl.to(tl.float32) * 16384.0).to(tl.bfloat16)
        hi = (fh.to(tl.float32) * 16384.0).to(tl.bfloat16)
    return lo, hi


@triton.jit
def _decode_scale(raw, IS_NV: tl.constexpr, FOLD: tl.constexpr = False):
    """Raw scale bytes -> fp32 multipliers (e4m3 x e2m1 and 2**k x e2m1 stay exact in bf16)."""
    if FOLD:
        # 2**63 moved from the accumulator into the scale: value*2**-126 * s*2**63 stays a
        # normal bf16 (exact for e4m3 scales, and E8M0 exponents 65..191).
        if IS_NV:
            return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 9.223372036854775808e18
        else:
            return ((raw.to(tl.int32) + 63) << 23).to(tl.float32, bitcast=True)
    elif IS_NV:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        # E8M0 byte e -> 2**(e-127): the fp32 exponent field is the same byte (0 -> 0, 255 -> inf).
        return (raw.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scaled(vals, s, BLOCK_N: tl.constexpr, HALF_K: tl.constexpr, HALF_G: tl.constexpr, CDT: tl.constexpr):
    """vals bf16 [BLOCK_N, HALF_K] (one nibble lane), s fp32 [BLOCK_N, HALF_K // HALF_G] -> exact bf16."""
    v = tl.reshape(vals, (BLOCK_N, HALF_K // HALF_G, HALF_G))
    if CDT == tl.bfloat16:
        # e2m1 x (e4m3 or 2**k) has at most 6 significant bits: the bf16 product is exact
        w = v * s.to(tl.bfloat16)[:, :, None]
    else:
        w = (v.to(tl.float32) * s[:, :, None]).to(CDT)
    return tl.reshape(w, (BLOCK_N, HALF_K))


@triton.jit
def _rows_of_chunk(offs, match, rank, count, c0, BLOCK_M: tl.constexpr):
    r = c0 + tl.arange(0, BLOCK_M)
    sel = match[None, :] & (rank[None, :] == r[:, None])
    pair = tl.sum(tl.where(sel, offs[None, :], 0), axis=1)
    return pair, r < count


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, rw_ptr, w_ptr, s_ptr, g_ptr, act_ptr,
    P, I: tl.constexpr, D: tl.constexpr,
    TOPK: tl.constexpr, PB: tl.constexpr, G: tl.constexpr, IS_NV: tl.constexpr,
    LIMIT: tl.constexpr, NCHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_ASM: tl.constexpr, CDT: tl.constexpr, FOLD: tl.constexpr, PDL: tl.constexpr = False,
):
    wait(PDL)
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, pid_p, P, PB)
    if earlier == 0:
        HK: tl.constexpr = BLOCK_K // 2
        HG: tl.constexpr = G // 2
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < I
        kb = tl.arange(0, HK)  # byte index within the K block
        kx = tl.arange(0, BLOCK_K)
        ks = tl.arange(0, HK // HG)  # scale index within the K block
        half_d: tl.constexpr = D // 2
        nsc: tl.constexpr = D // G
        wg_rows = w_ptr + e * (2 * I) * half_d + n.to(tl.int64) * half_d
        wu_rows = wg_rows + I * half_d
        sg_rows = s_ptr + e * (2 * I) * nsc + n.to(tl.int64) * nsc
        su_rows = sg_rows + I * nsc
        gg = tl.load(g_ptr + 2 * e) * (9.223372036854775808e18 if FOLD else 1.0)
        gu = tl.load(g_ptr + 2 * e + 1) * (9.223372036854775808e18 if FOLD else 1.0)
        for ci in range(NCHUNK):
          c0 = ci * BLOCK_M
          if c0 < count:
            pair, r_ok = _rows_of_chunk(offs, match, rank, count, c0, BLOCK_M)
            tok = pair // TOPK
            x_rows = x_ptr + tok.to(tl.int64) * D
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(0, D // BLOCK_K):
                # index arithmetic by multiplication only, so the byte loads stay 16-byte vectors
                bcol = kk * HK + kb
                pg = tl.load(wg_rows[:, None] + bcol[None, :])
                pu = tl.load(wu_rows[:, None] + bcol[None, :])
                gl, gh = _decode_nibbles(pg, USE_ASM, FOLD)
                ul, uh = _decode_nibbles(pu, USE_ASM, FOLD)
                xv = tl.load(x_rows[:, None] + (kk * BLOCK_K + kx)[None, :], mask=r_ok[:, None], other=0.0)
                xe, xo = tl.split(tl.reshape(xv, (BLOCK_M, HK, 2)))
                scol = kk * (HK // HG) + ks
                sg = _decode_scale(tl.load(sg_rows[:, None] + scol[None, :]), IS_NV, FOLD)
                su = _decode_scale(tl.load(su_rows[:, None] + scol[None, :]), IS_NV, FOLD)
                gl = _scaled(gl, sg, BLOCK_N, HK, HG, CDT)
                gh = _scaled(gh, sg, BLOCK_N, HK, HG, CDT)
                ul = _scaled(ul, su, BLOCK_N, HK, HG, CDT)
                uh = _scaled(uh, su, BLOCK_N, HK, HG, CDT)
                xe = xe.to(CDT)
                xo = xo.to(CDT)
                acc_g = tl.dot(xe, tl.trans(gl), acc_g)
                acc_g = tl.dot(xo, tl.trans(gh), acc_g)
                acc_u = tl.dot(xe, tl.trans(ul), acc_u)
                acc_u = tl.dot(xo, tl.trans(uh), acc_u)
            g = tl.minimum(acc_g * gg, LIMIT)
            u = tl.minimum(tl.maximum(acc_u * gu, -LIMIT), LIMIT)
            rw = tl.load(rw_ptr + pair, mask=r_ok, other=0.0).to(tl.float32)
            a = g / (1.0 + tl.exp(-g)) * u * rw[:, None]
            dst = act_ptr + pair.to(tl.int64)[:, None] * I + n[None, :]
            tl.store(dst, a.to(tl.bfloat16), mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    a_ptr, ids_ptr, w_ptr, s_ptr, g_ptr, y_ptr,
    P, I: tl.constexpr, D: tl.constexpr,
    PB: tl.constexpr, G: tl.constexpr, IS_NV: tl.constexpr, NCHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr, CDT: tl.constexpr,
    FOLD: tl.constexpr, PDL: tl.constexpr = False,
):
    wait(PDL)
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, pid_p, P, PB)
    if earlier == 0:
        HK: tl.constexpr = BLOCK_K // 2
        HG: tl.constexpr = G // 2
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < D
        kb = tl.arange(0, HK)
        kx = tl.arange(0, BLOCK_K)
        ks = tl.arange(0, HK // HG)
        half_i: tl.constexpr = I // 2
        nsc: tl.constexpr = I // G
        w_rows = w_ptr + e * D * half_i + n.to(tl.int64) * half_i
        s_rows = s_ptr + e * D * nsc + n.to(tl.int64) * nsc
        gw = tl.load(g_ptr + e) * (9.223372036854775808e18 if FOLD else 1.0)
        for ci in range(NCHUNK):
          c0 = ci * BLOCK_M
          if c0 < count:
            pair, r_ok = _rows_of_chunk(offs, match, rank, count, c0, BLOCK_M)
            a_rows = a_ptr + pair.to(tl.int64) * I
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(0, I // BLOCK_K):
                pw = tl.load(w_rows[:, None] + (kk * HK + kb)[None, :])
                wl, wh = _decode_nibbles(pw, USE_ASM, FOLD)
                av = tl.load(a_rows[:, None] + (kk * BLOCK_K + kx)[None, :], mask=r_ok[:, None], other=0.0)
                ae, ao = tl.split(tl.reshape(av, (BLOCK_M, HK, 2)))
                sw = _decode_scale(tl.load(s_rows[:, None] + (kk * (HK // HG) + ks)[None, :]), IS_NV, FOLD)
                wl = _scaled(wl, sw, BLOCK_N, HK, HG, CDT)
                wh = _scaled(wh, sw, BLOCK_N, HK, HG, CDT)
                ae = ae.to(CDT)
                ao = ao.to(CDT)
                acc = tl.dot(ae, tl.trans(wl), acc)
                acc = tl.dot(ao, tl.trans(wh), acc)
            dst = y_ptr + pair.to(tl.int64)[:, None] * D + n[None, :]
            tl.store(dst, acc * gw, mask=r_ok[:, None] & n_ok[None, :])


# Launch configuration (BLOCK_N, BLOCK_K, num_warps, num_stages) per kernel, by regime:
# "small" serves up to ``small_max_pairs`` (token, expert) pairs (T=1 decode: narrower
# gate/up programs), "large" the rest with 128-row tiles (they amortise the activation
# operand over more weight rows), and "tall" replaces "large" once the MMA row block
# reaches ``tall_min_block_m`` (many tokens per expert, prefill: a 64 x 128 tile does not
# fit in shared memory and 32 x 128 spills registers).  A ``config`` argument with "gate_up"/"down" keys overrides them all.
# Measured on the H200 (BENCHMARKS.md, 2026-11-29): at T=1 gate/up BLOCK_N=32 with down
# BLOCK_N=64 is best; from T=2 BLOCK_N=128 (equal at T=2, 4-9% faster at T=4..8, 10-24%
# at T=16..64 than 64).
CONFIG = {
    "small": dict(gate_up=dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3),
                  down=dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3)),
    "large": dict(gate_up=dict(BLOCK_N=128, BLOCK_K=256, num_warps=4, num_stages=3),
                  down=dict(BLOCK_N=128, BLOCK_K=256, num_warps=4, num_stages=3)),
    "tall": dict(gate_up=dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),
                 down=dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3)),
    "small_max_pairs": 8,
    "tall_min_block_m": 32,
    # PTX decode (4 bytes -> 8 bf16 per call); DSV4_FP4_MOE_NO_ASM=1 forces the portable path.
    "use_asm": os.environ.get("DSV4_FP4_MOE_NO_ASM", "0") != "1",
    # fold the 2**126 decode factor into scale (2**63) and global (2**63): one bf16x2
    # multiply fewer per two weights.  Exact for every NVFP4 (e4m3) scale, so on for NVFP4;
    # for MXFP4 exact only for E8M0 exponents 65..191, so MXFP4 needs "fold_mxfp4" too.
    "fold_scale": True,
    "fold_mxfp4": False,
    # Up to this many tokens the op would take the mma.sync path (``fp4_moe_mma``: decode
    # straight into MMA registers, no shared memory); 0 = never.  Off by default: it is
    # correct (GPU-checked, both formats, graph replay) but measured 1.4-1.7x slower than
    # these tl.dot kernels at every T (BENCHMARKS.md, 2026-11-29).  "mma" holds its launch
    # configuration (``fp4_moe_mma.MMA_CONFIG``).
    "mma_max_tokens": 0,
    "mma": dict(gate_up_warps=4, down_warps=4),
    # From "gemv_min_tokens" to "gemv_max_tokens" tokens the gate/up and down kernels are
    # the FMA GEMV kernels of ``fp4_moe_gemv`` (CUDA cores, no shared memory); "gemv" overrides
    # their launch configuration (``fp4_moe_gemv.GEMV_CONFIG`` keys).  Measured on the H200
    # (BENCHMARKS.md, 2026-11-30, two runs): 9-10% faster than these tl.dot kernels at T=2
    # (90.6 / 90.3 vs 99.6 / 99.9 us); at T=4 +3% / -2% (a wash); at T=1 equal with BLOCK_N=32
    # and 17-22% slower with 16 or 8; 19-38% slower from T=8.  So it was the default at T=2 only,
    # until the streamed GEMV below beat it there (2026-12-01: 72.7 vs 84.4 us, NVFP4): now off.
    "gemv_min_tokens": 2,
    "gemv_max_tokens": 0,
    "gemv": None,
    # From "hgemv_min_tokens" to "hgemv_max_tokens" tokens (checked before "gemv_*") the gate/up
    # and down kernels are the fp16x2 (HFMA2) GEMV kernels of ``fp4_moe_hgemv``; "hgemv"
    # overrides their configuration (``fp4_moe_hgemv.HGEMV_CONFIG`` keys).  Off by default:
    # 9-28% faster at T=1..16 on the H200 (BENCHMARKS.md, 2026-11-30), but its fp16 group sums
    # pass 1e-2 relative error once activations are ~300x unit scale (its module docstring).
    "hgemv_min_tokens": 1,
    "hgemv_max_tokens": 0,
    "hgemv": None,
    # From "hmma_min_tokens" to "hmma_max_tokens" tokens (checked before "hgemv_*" and "gemv_*")
    # the gate/up and down kernels are the fp16 mma.sync kernels of ``fp4_moe_hmma`` (exact
    # products, fp32 block scales and sums); "hmma" overrides ``fp4_moe_hmma.HMMA_CONFIG``.  By
    # default its staged loop (prefetch 0) where it measured faster than the rest (BENCHMARKS.md,
    # 2026-12-01, eighth session, H200, rotated routings, same run): MXFP4 nsub 4 at T=4..16
    # (117.5 / 242.3 / 459.9 us at T=4 / 8 / 16 against 139.6 / 303.5 / 497.1; 46.0 vs 42.5 at T=1,
    # 73.1 vs 72.5 at T=2, 1388 vs 1283 at T=64), NVFP4 nsub 2 at T=8..16 (253.7 / 445.4 against
    # 271.6 / 466.9; 134.3 vs 133.2 at T=4).  Ninth session: with 168 registers (HMMA_CONFIG) the staged
    # kernels fit 3 programs per SM (ncu, T=16); NVFP4 nsub 2 capped at 96 (5 programs) measured 122.4 /
    # 233.2 / 453.8 us at T=4 / 8 / 16 against 131.3 / 250.8 / 458.0 at 168 and the stream's 134.9 at T=4
    # (one run, same run), so NVFP4 now takes it from T=4 (T=5..7 unmeasured, between two wins; they took
    # the tl.dot kernels before).  MXFP4 at 128 / 96: 117.4 / 120.3 vs 117.4 at T=4 (T=8..16 not yet
    # measured), so it kept 168.  Tenth session (2026-12-02, same runs): MXFP4 at 128 registers (4 programs
    # per SM, the limit of its 57 KB ring) 214.8 / 406.9 us at T=8 / 16 against 243.0 / 460.5 at 168, and the
    # staged loop at T=3 94.2-94.4 against the stream's 109.6-110.3 (two runs; 94.7 vs 105.8 in the ninth), so
    # MXFP4 takes it from T=3 with maxnreg 128 (T=4: 117.4 vs 117.1, equal).  Then 2 stages (one 28 KB buffer)
    # at 72 registers, 7 programs per SM: 380.5 / 386.5 us at T=16 and 207.5 / 210.6 at T=8 against 408.5 /
    # 408.0 and 215.4 / 215.7 (two runs), 118.6 vs 118.3 at T=4, 98.1 vs 95.1 at T=3 (the stream: ~110): the
    # MXFP4 default now.  NVFP4 with 2 stages at 80 registers: 435.5 vs 443.6 at T=16 but 140.4 vs 125.1 at
    # T=4, so it keeps 3 stages.  Twelfth session (2026-12-02, after the eleventh's cheaper loop; three runs,
    # rotated routings): NVFP4 at T=3 95.2-96.3 us against the stream's 101.7-104.7, MXFP4 at T=2 70.2-70.5
    # against 72.7-75.9, so each format takes the staged loop one token earlier; NVFP4 at T=2 still loses
    # (78.7-80.1 against 71.5), and both formats at T=1 (47.1 NVFP4, 47.3 MXFP4 against 42.2 / 42.6).
    # Needs a finite swiglu_limit (else these T take the other paths).
    # Each of these routing keys may be one value or a dict by format name.
    "hmma_min_tokens": {"nvfp4": 3, "mxfp4": 2},
    "hmma_max_tokens": 16,
    "hmma": {"nvfp4": dict(prefetch=0, maxnreg=96, gate_up=dict(nsub=2), down=dict(nsub=2)),
             "mxfp4": dict(prefetch=0, stages=2, maxnreg=72, gate_up=dict(nsub=4), down=dict(nsub=4))},
    # From "stream_min_tokens" to "stream_max_tokens" tokens (checked first) the gate/up and down
    # kernels are the FMA GEMV kernels fed by a shared-memory ring of asynchronous copies
    # (``fp4_moe_stream``; exact like ``fp4_moe_gemv``); "stream" overrides its STREAM_CONFIG.
    # Measured on the H200 (BENCHMARKS.md, 2026-12-01, NVFP4, routings rotated): 42.3 / 73.9 / 136.9 us
    # at T = 1 / 2 / 4 against 48.0 / 84.7 / 156.7 for the previous defaults, slower at T=16.
    # NVFP4 hands T=3 to the staged hmma loop (above), MXFP4 T=2.
    # The stream and hmma paths sum each token's expert rows inside their down kernel (``moe_pairs._ticket_sum``:
    # the token's last pair program per row tile, the same order and bits as ``_sum_kernel``, one launch fewer);
    # False: the separate sum kernel (also the fallback while a graph is captured before any eager call).
    "ticket_sum": True,
    "stream_min_tokens": 1,
    "stream_max_tokens": {"nvfp4": 2, "mxfp4": 1},
    "stream": None,
}

def route_value(cfg: dict, key: str, fmt: str, default=None):
    """``cfg[key]``, or its entry for ``fmt`` where it is a dict by format name (a missing
    format: ``default``)."""
    v = cfg.get(key, default)
    if isinstance(v, dict) and v and set(v) <= set(fp4.FORMATS):
        return v.get(fmt, default)
    return v


def _block_m(pairs: int, experts: int) -> int:
    """Rows per MMA tile: sized to the expected tokens per expert (not to T), so decode
    batches with few tokens per expert do not pay for empty rows; more rows loop."""
    return min(64, max(16, triton.next_power_of_2(triton.cdiv(pairs, experts))))


def fp4_moe_triton(*args, config: dict | None = None):
    """``fp4_moe`` on CUDA (see the module docstring)."""
    return _fp4_moe_triton(*args, config=config)


def _fp4_moe_triton(
    x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit,
    config: dict | None = None,
):
    """Launch the three kernels; shapes validated by ``check_fp4_moe_inputs``."""
    check_fp4_moe_inputs(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt)
    for name, ten in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if not ten.is_contiguous():
            raise ValueError(f"fp4_moe (CUDA) needs contiguous expert tensors; {name} is not (call .contiguous() once at load).")
    cfg = CONFIG if config is None else {**CONFIG, **config}
    t, d = x.shape
    if "gate_up" not in cfg and t <= cfg["mma_max_tokens"] and mma_supports(d, w2.shape[-1] * 2, cfg["mma"]):
        mcfg = {**cfg["mma"], **({"only": cfg["only"]} if "only" in cfg else {})}
        return fp4_moe_mma(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt,
                           swiglu_limit, config=mcfg)
    f = fp4.get_format(fmt)
    k = topk_ids.shape[1]
    inter = w2.shape[-1] * 2
    p = t * k
    out = torch.empty_like(x)
    if p == 0:
        return out.zero_()
    x_c = x.contiguous()
    ids = flat_ids(topk_ids)
    rw = topk_weights.to(torch.float32).contiguous().view(-1)
    act = torch.empty(p, inter, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(p, d, dtype=torch.float32, device=x.device)
    is_nv = f.name == "nvfp4"
    fold = bool(cfg["fold_scale"]) and bool(cfg["use_asm"]) and (is_nv or bool(cfg.get("fold_mxfp4", False)))
    only = cfg.get("only")  # timing breakdown (benchmarks/moe_op.py): one kernel, garbage result
    pdl_kw = pdl.launch_args(x.device)
    # the GEMV variants, where the config routes this T to one: those the caller's ``config`` names
    # first (so a request for one is not taken over by a default range), then in this order
    keys = ("stream", "hmma", "hgemv", "gemv")
    keys = sorted(keys, key=lambda kk: f"{kk}_max_tokens" not in (config or {}))
    for key in keys:
        if "gate_up" in cfg or not route_value(cfg, f"{key}_min_tokens", f.name, 1) <= t <= route_value(
                cfg, f"{key}_max_tokens", f.name, 0):
            continue
        if key == "stream":
            from . import fp4_moe_stream as mod

            base, supports, launch, extra = mod.STREAM_CONFIG, mod.stream_supports, mod.launch_stream, {"fold": fold}
        elif key == "hmma":
            from . import fp4_moe_hmma as mod

            base, launch, extra = mod.HMMA_CONFIG, mod.launch_hmma, {}
            supports = functools.partial(mod.hmma_supports, limit=swiglu_limit, is_nv=is_nv)
        elif key == "hgemv":
            from . import fp4_moe_hgemv as mod

            base, supports, launch, extra = mod.HGEMV_CONFIG, mod.hgemv_supports, mod.launch_hgemv, {}
        else:
            from . import fp4_moe_gemv as mod

            base, supports, launch, extra = mod.GEMV_CONFIG, mod.gemv_supports, mod.launch_gemv, {"fold": fold}
        vcfg = {**base, **(route_value(cfg, key, f.name) or {})}
        if supports(d, inter, vcfg):
            tickets = None
            if key in ("stream", "hmma") and cfg["ticket_sum"] and only is None:
                tickets = sum_tickets(x.device, t, d)  # at most one tile per row, whatever the config's tiles
                extra = {**extra, "out": out, "tickets": tickets}
            launch(x_c, ids, rw, w13, w13_scale, w13_global, w2, w2_scale, w2_global, act, y, k=k,
                   group_size=f.group_size, is_nv=is_nv, limit=swiglu_limit, use_asm=bool(cfg["use_asm"]), cfg=vcfg,
                   only=only, **extra)
            if only is None and tickets is None:
                _sum_kernel[(t, triton.cdiv(d, 1024))](y, out, d, TOPK=k, BLOCK=1024, num_warps=4, **pdl_kw)
            return out
    pb = max(16, triton.next_power_of_2(p))
    bm = _block_m(p, w13.shape[0])
    nchunk = triton.cdiv(p, bm)  # an expert serves at most P pairs (T unless ids repeat in a row)
    if "gate_up" in cfg:
        gu, dn = cfg["gate_up"], cfg["down"]
    else:
        regime = (cfg["small"] if p <= cfg["small_max_pairs"]
                  else cfg["tall"] if bm >= cfg["tall_min_block_m"] else cfg["large"])
        gu, dn = regime["gate_up"], regime["down"]
    # The CPU interpreter (TRITON_INTERPRET=1, used for CPU debugging) mishandles bf16
    # MMAs, so it multiplies in fp32; on the GPU the MMA operands are bf16.
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    cdt = tl.float32 if interp else tl.bfloat16
    for c in (gu, dn):
        if c["BLOCK_K"] % f.group_size or c["BLOCK_K"] // 2 < 4:
            raise ValueError(f"BLOCK_K={c['BLOCK_K']} must be a multiple of the group size {f.group_size}.")
    if d % gu["BLOCK_K"] or inter % dn["BLOCK_K"] or inter % gu["BLOCK_N"] or d % dn["BLOCK_N"]:
        raise ValueError(f"D={d} / I={inter} must be multiples of the kernel blocks {gu} / {dn}.")
    if only in (None, "gate_up"):
        _gate_up_kernel[(p, triton.cdiv(inter, gu["BLOCK_N"]))](
            x_c, ids, rw, w13, w13_scale.view(torch.uint8), w13_global.float().contiguous(), act,
            p, inter, d,
            TOPK=k, PB=pb, G=f.group_size, IS_NV=is_nv, LIMIT=float(swiglu_limit),
            NCHUNK=nchunk, BLOCK_M=bm, BLOCK_N=gu["BLOCK_N"], BLOCK_K=gu["BLOCK_K"], USE_ASM=cfg["use_asm"], CDT=cdt,
            FOLD=fold, num_warps=gu["num_warps"], num_stages=gu["num_stages"], **pdl_kw,
        )
    if only in (None, "down"):
        _down_kernel[(p, triton.cdiv(d, dn["BLOCK_N"]))](
            act, ids, w2, w2_scale.view(torch.uint8), w2_global.float().contiguous(), y,
            p, inter, d,
            PB=pb, G=f.group_size, IS_NV=is_nv,
            NCHUNK=nchunk, BLOCK_M=bm, BLOCK_N=dn["BLOCK_N"], BLOCK_K=dn["BLOCK_K"], USE_ASM=cfg["use_asm"], CDT=cdt,
            FOLD=fold, num_warps=dn["num_warps"], num_stages=dn["num_stages"], **pdl_kw,
        )
    if only is not None:
        return out
    blk = 1024
    _sum_kernel[(t, triton.cdiv(d, blk))](y, out, d, TOPK=k, BLOCK=blk, num_warps=4, **pdl_kw)
    return out


MAX_KERNEL_TOKENS = 64


def kernel_supports(hidden: int, intermediate: int) -> bool:
    """Whether the default kernel blocks tile these sizes (V4-Flash and V4-Pro do)."""
    blocks = (CONFIG["small"], CONFIG["large"], CONFIG["tall"])
    return all(
        hidden % c["gate_up"]["BLOCK_K"] == 0 and intermediate % c["down"]["BLOCK_K"] == 0
        and intermediate % c["gate_up"]["BLOCK_N"] == 0 and hidden % c["down"]["BLOCK_N"] == 0
        for c in blocks
    )


@fp4_moe.register_kernel("cuda")
def _fp4_moe_cuda(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit):
    # Small (test/demo) models, and prefills past the decode shapes the kernel is built for
    # (it ranks all T*k routing pairs in one block): the reference math, which decodes each
    # used expert once for all its tokens.
    if x.shape[0] > MAX_KERNEL_TOKENS or not kernel_supports(x.shape[-1], w2.shape[-1] * 2):
        return fp4_moe_reference(
            x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit
        )
    # Triton launches on the current device, not the tensors': an MTP on cuda:1 (beside a
    # device_map target's lm head) would otherwise run its kernels on cuda:0.
    with torch.cuda.device(x.device):
        return fp4_moe_triton(
            x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit
        )
