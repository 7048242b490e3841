"""Opt-in small-batch path of ``dsv4_mtp::fp4_moe`` on CUDA: FP4 decoded in registers
straight into ``mma.sync`` operands, no shared memory, no layout conversion.

Idea: at decode sizes (T = 1..16 tokens) the op is a bandwidth-bound GEMV over the
chosen experts.  Here every lane streams its own 16-byte pieces of two weight rows, and
one inline-asm block per 32 weights of each row decodes them (``decode_ptx``), applies
the block scale and feeds ``mma.sync.m16n8k16`` (layout and the K-slot argument:
``mma_ptx``): about 3.3 SASS instructions per weight against 4.4 for the ``tl.dot``
kernels, and the tokens of an expert ride along as MMA columns (8 per pass).

Status (H200, 2026-11-29, ``benchmarks/moe_op.py``): correct for both formats at T = 1..64
(rel. err 2.4e-3, every output written, graph replay), but 1.4-1.7x SLOWER than the
``tl.dot`` kernels at every T, so ``fp4_moe_triton.CONFIG["mma_max_tokens"]`` is 0.  The
SASS shows why at least in part: ptxas issues the next iteration's weight loads in the
last ~12% of the loop body, so with prefetch distance 1 they hide almost no latency.
``MMA_CONFIG["prefetch"] = 2`` (built, checked in the interpreter, not yet timed) gives
them a whole iteration.  The per-lane activation loads (twice the weight loads, from
L1/L2) are the other suspect.

Kernels (fixed grids per T, CUDA-graph safe, no host sync):

1. ``_gate_up_mma_kernel``, grid ``(P, I / (8 NW / KSPLIT))``: the leader program of each
   expert (first pair routed to it; the rest exit) computes ``silu(min(g, L)) * clamp(u)
   * r`` for 8 NW / KSPLIT intermediate rows (gate row and up row per lane group) and all
   its tokens, and writes the bf16 activation of each pair to ``act [P, I]``.
2. ``_down_mma_kernel``, grid ``(P, D / (16 NW / KSPLIT))``: ``w2`` rows times the pair
   activations, fp32 into ``y [P, D]``.
3. ``moe_pairs._sum_kernel``: ``out[t] = sum_j y[t k + j]`` in a fixed order.

Lane (warp w, group g, quarter q) owns two weight rows of its lane group and K slice
(w mod KSPLIT) * 4 + q of them (KSPLIT warps share rows and add their slices at the end);
the K loop walks the slice in 64-byte iterations (4 sub-windows of 16 bytes, one asm call
each), loading the weights and scales ``prefetch`` iterations ahead.  K must be a
multiple of 512 KSPLIT (V4-Flash and V4-Pro sizes are, with KSPLIT 1 or 2).

``USE_ASM=False`` replaces the asm by plain Triton arithmetic with the same per-lane
results, so the indexing runs under the CPU interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ... import fp4
from .mma_ptx import CONSTRAINTS, mma_asm
from .moe_pairs import _expert_rows, _sum_kernel, flat_ids

_C = tl.constexpr(CONSTRAINTS)
_NV0 = tl.constexpr(mma_asm("nvfp4", 0))
_NV1 = tl.constexpr(mma_asm("nvfp4", 1))
_MX0 = tl.constexpr(mma_asm("mxfp4", 0))
_MX1 = tl.constexpr(mma_asm("mxfp4", 1))
_MX2 = tl.constexpr(mma_asm("mxfp4", 2))
_MX3 = tl.constexpr(mma_asm("mxfp4", 3))
_TWO63 = tl.constexpr(9.223372036854775808e18)


@triton.jit
def _rank_pairs(offs, match, rank, c0):
    """Pair index of ranks c0 .. c0+7 of this expert (0 where the rank does not exist)."""
    j = tl.arange(0, 8)
    m = match[None, :] & (rank[None, :] == (c0 + j)[:, None])
    return tl.sum(tl.where(m, offs[None, :], 0), axis=1)


@triton.jit
def _pick(v8, idx):
    """v8[idx] for a length-8 vector and per-lane indices."""
    j = tl.arange(0, 8)
    return tl.sum(tl.where(idx[:, None] == j[None, :], v8[None, :], 0), axis=1)


@triton.jit
def _lanes(NW: tl.constexpr):
    t = tl.arange(0, 32 * NW)
    lane = t % 32
    return t // 32, lane // 4, lane % 4


@triton.jit
def _load_iter(wa, wb, sa, sb, it, IS_NV: tl.constexpr):
    """One 64-byte iteration of both rows: 4 x 16 bytes each, and their scale bytes."""
    i4 = tl.arange(0, 4)
    o = it * 16 + i4[None, :]
    a0 = tl.load(wa[:, None] + o)
    a1 = tl.load(wa[:, None] + (o + 4))
    a2 = tl.load(wa[:, None] + (o + 8))
    a3 = tl.load(wa[:, None] + (o + 12))
    b0 = tl.load(wb[:, None] + o)
    b1 = tl.load(wb[:, None] + (o + 4))
    b2 = tl.load(wb[:, None] + (o + 8))
    b3 = tl.load(wb[:, None] + (o + 12))
    if IS_NV:
        so = it * 8 + i4[None, :]
        sa0 = tl.load(sa[:, None] + so)
        sa1 = tl.load(sa[:, None] + (so + 4))
        sb0 = tl.load(sb[:, None] + so)
        sb1 = tl.load(sb[:, None] + (so + 4))
    else:
        so = it * 4 + i4[None, :]
        sa0 = tl.load(sa[:, None] + so)
        sa1 = sa0
        sb0 = tl.load(sb[:, None] + so)
        sb1 = sb0
    return a0, a1, a2, a3, b0, b1, b2, b3, sa0, sa1, sb0, sb1


@triton.jit
def _emu_values(w, s, SUB: tl.constexpr, IS_NV: tl.constexpr):
    """Interpreter stand-in for the asm decode + scale: int32 [NT, 4] words -> fp32 [NT, 32]
    (value 8 j + k = nibble k of word j), in the asm's units (NVFP4: times 2**-63)."""
    k = tl.arange(0, 8)
    nib = (w[:, :, None] >> (4 * k)[None, None, :]) & 15
    mag = (nib & 7).to(tl.float32)
    v = tl.where(mag <= 4.0, mag * 0.5, tl.where(mag == 7.0, 6.0, mag - 2.0))
    v = tl.where(nib >= 8, -v, v)
    v = tl.reshape(v, (w.shape[0], 32))
    i4 = tl.arange(0, 4)
    vi = tl.arange(0, 32)
    if IS_NV:
        sf = s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * (1.0 / _TWO63)
        byte = 2 * (SUB % 2) + vi // 16
    else:
        sf = tl.exp2(s.to(tl.float32) - 127.0)
        byte = SUB + vi * 0
    sv = tl.sum(tl.where(byte[None, :, None] == i4[None, None, :], sf[:, None, :], 0.0), axis=2)
    return v * sv


@triton.jit
def _sub_step(acc_a, acc_b, wa_s, wb_s, sa, sb, xq, xe_ptr, tok8, xoff, XROW: tl.constexpr, kl, KL: tl.constexpr,
              IS_NV: tl.constexpr, SUB: tl.constexpr, USE_ASM: tl.constexpr):
    """One 16-byte sub-window of both rows (32 weights each) against the activations."""
    if USE_ASM:
        i4 = tl.arange(0, 4)
        xp = xq[:, None] + (xoff + i4[None, :])
        x0 = tl.load(xp)
        x1 = tl.load(xp + 4)
        x2 = tl.load(xp + 8)
        x3 = tl.load(xp + 12)
        if IS_NV:
            if SUB % 2 == 0:
                acc_a, acc_b = tl.inline_asm_elementwise(_NV0, _C, [acc_a, acc_b, wa_s, wb_s, x0, x1, x2, x3, sa, sb],
                                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
            else:
                acc_a, acc_b = tl.inline_asm_elementwise(_NV1, _C, [acc_a, acc_b, wa_s, wb_s, x0, x1, x2, x3, sa, sb],
                                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
        else:
            if SUB == 0:
                acc_a, acc_b = tl.inline_asm_elementwise(_MX0, _C, [acc_a, acc_b, wa_s, wb_s, x0, x1, x2, x3, sa, sb],
                                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
            elif SUB == 1:
                acc_a, acc_b = tl.inline_asm_elementwise(_MX1, _C, [acc_a, acc_b, wa_s, wb_s, x0, x1, x2, x3, sa, sb],
                                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
            elif SUB == 2:
                acc_a, acc_b = tl.inline_asm_elementwise(_MX2, _C, [acc_a, acc_b, wa_s, wb_s, x0, x1, x2, x3, sa, sb],
                                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
            else:
                acc_a, acc_b = tl.inline_asm_elementwise(_MX3, _C, [acc_a, acc_b, wa_s, wb_s, x0, x1, x2, x3, sa, sb],
                                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        # acc_a / acc_b are [NT, 8] per-lane partial sums for the 8 token columns
        va = _emu_values(wa_s, sa, SUB, IS_NV)
        vb = _emu_values(wb_s, sb, SUB, IS_NV)
        vi = tl.arange(0, 32)
        # bf16 activations: token column j, this lane's quarter, this sub-window
        xp = xe_ptr + tok8[None, :, None] * XROW + (kl[:, None, None] * (XROW // KL) + 2 * xoff + vi[None, None, :])
        xv = tl.load(xp).to(tl.float32)  # [NT, 8, 32]
        acc_a += tl.sum(va[:, None, :] * xv, axis=2)
        acc_b += tl.sum(vb[:, None, :] * xv, axis=2)
    return acc_a, acc_b


@triton.jit
def _iter_body(acc_a, acc_b, a0, a1, a2, a3, b0, b1, b2, b3, sa0, sa1, sb0, sb1, xq, xe_ptr, tok8, xo,
               XROW: tl.constexpr, kl, KL: tl.constexpr, IS_NV: tl.constexpr, USE_ASM: tl.constexpr):
    """One 64-byte iteration: four sub-windows; ``xo`` = its first activation word."""
    acc_a, acc_b = _sub_step(acc_a, acc_b, a0, b0, sa0, sb0, xq, xe_ptr, tok8, xo, XROW, kl, KL, IS_NV, 0, USE_ASM)
    acc_a, acc_b = _sub_step(acc_a, acc_b, a1, b1, sa0, sb0, xq, xe_ptr, tok8, xo + 16, XROW, kl, KL, IS_NV, 1, USE_ASM)
    acc_a, acc_b = _sub_step(acc_a, acc_b, a2, b2, sa1, sb1, xq, xe_ptr, tok8, xo + 32, XROW, kl, KL, IS_NV, 2, USE_ASM)
    acc_a, acc_b = _sub_step(acc_a, acc_b, a3, b3, sa1, sb1, xq, xe_ptr, tok8, xo + 48, XROW, kl, KL, IS_NV, 3, USE_ASM)
    return acc_a, acc_b


@triton.jit
def _k_loop(wa, wb, sa, sb, xq, xe_ptr, tok8, q, kl, KL: tl.constexpr, NIT: tl.constexpr, XROW: tl.constexpr,
            IS_NV: tl.constexpr, USE_ASM: tl.constexpr, NW: tl.constexpr, KSPLIT: tl.constexpr, PF: tl.constexpr):
    """Stream this lane's K slice of both rows; returns (c0, c1, c2, c3) per lane of the
    first NW / KSPLIT warps (summed over the KSPLIT warps that share the rows)."""
    NT: tl.constexpr = 32 * NW
    if USE_ASM:
        acc_a = tl.zeros((NT, 4), dtype=tl.float32)
        acc_b = tl.zeros((NT, 4), dtype=tl.float32)
    else:
        acc_a = tl.zeros((NT, 8), dtype=tl.float32)
        acc_b = tl.zeros((NT, 8), dtype=tl.float32)
    a0, a1, a2, a3, b0, b1, b2, b3, sa0, sa1, sb0, sb1 = _load_iter(wa, wb, sa, sb, 0, IS_NV)
    if PF == 1:
        for it in tl.range(NIT, loop_unroll_factor=1):
            # prefetch the next iteration (the last one reloads itself: cached, harmless).
            # ptxas tends to issue these loads late in the body (register pressure), so
            # they may hide less latency than the code suggests; PF=2 leaves them a
            # whole iteration wherever they are placed.
            nxt = tl.minimum(it + 1, NIT - 1)
            n0, n1, n2, n3, m0, m1, m2, m3, ta0, ta1, tb0, tb1 = _load_iter(wa, wb, sa, sb, nxt, IS_NV)
            acc_a, acc_b = _iter_body(acc_a, acc_b, a0, a1, a2, a3, b0, b1, b2, b3, sa0, sa1, sb0, sb1,
                                      xq, xe_ptr, tok8, it * 64, XROW, kl, KL, IS_NV, USE_ASM)
            a0, a1, a2, a3, b0, b1, b2, b3 = n0, n1, n2, n3, m0, m1, m2, m3
            sa0, sa1, sb0, sb1 = ta0, ta1, tb0, tb1
    else:
        n0, n1, n2, n3, m0, m1, m2, m3, ta0, ta1, tb0, tb1 = _load_iter(wa, wb, sa, sb, tl.minimum(1, NIT - 1), IS_NV)
        for it in tl.range(NIT, loop_unroll_factor=1):
            nx2 = tl.minimum(it + 2, NIT - 1)
            p0, p1, p2, p3, r0, r1, r2, r3, ua0, ua1, ub0, ub1 = _load_iter(wa, wb, sa, sb, nx2, IS_NV)
            acc_a, acc_b = _iter_body(acc_a, acc_b, a0, a1, a2, a3, b0, b1, b2, b3, sa0, sa1, sb0, sb1,
                                      xq, xe_ptr, tok8, it * 64, XROW, kl, KL, IS_NV, USE_ASM)
            a0, a1, a2, a3, b0, b1, b2, b3 = n0, n1, n2, n3, m0, m1, m2, m3
            sa0, sa1, sb0, sb1 = ta0, ta1, tb0, tb1
            n0, n1, n2, n3, m0, m1, m2, m3 = p0, p1, p2, p3, r0, r1, r2, r3
            ta0, ta1, tb0, tb1 = ua0, ua1, ub0, ub1
    if USE_ASM:
        c = acc_a + acc_b  # [NT, 4]: (row a, col 2q), (row a, 2q+1), (row b, 2q), (row b, 2q+1)
        e0, e1 = tl.split(tl.reshape(c, (NT, 2, 2)))
        c0, c2 = tl.split(e0)
        c1, c3 = tl.split(e1)
    else:
        # the MMA sums the four K quarters across lanes; do the same with a reshape
        G: tl.constexpr = NT // 4
        sa_ = tl.sum(tl.reshape(acc_a, (G, 4, 8)), axis=1)
        sb_ = tl.sum(tl.reshape(acc_b, (G, 4, 8)), axis=1)
        fa = tl.reshape(tl.broadcast_to(sa_[:, None, :], (G, 4, 8)), (NT, 8))
        fb = tl.reshape(tl.broadcast_to(sb_[:, None, :], (G, 4, 8)), (NT, 8))
        j = tl.arange(0, 8)
        c0 = tl.sum(tl.where(j[None, :] == 2 * q[:, None], fa, 0.0), axis=1)
        c1 = tl.sum(tl.where(j[None, :] == 2 * q[:, None] + 1, fa, 0.0), axis=1)
        c2 = tl.sum(tl.where(j[None, :] == 2 * q[:, None], fb, 0.0), axis=1)
        c3 = tl.sum(tl.where(j[None, :] == 2 * q[:, None] + 1, fb, 0.0), axis=1)
    if KSPLIT > 1:  # warps wr * KSPLIT + h share rows: add their K slices (shared memory, once)
        RG: tl.constexpr = NW // KSPLIT
        c0 = tl.reshape(tl.sum(tl.reshape(c0, (RG, KSPLIT, 32)), axis=1), (RG * 32,))
        c1 = tl.reshape(tl.sum(tl.reshape(c1, (RG, KSPLIT, 32)), axis=1), (RG * 32,))
        c2 = tl.reshape(tl.sum(tl.reshape(c2, (RG, KSPLIT, 32)), axis=1), (RG * 32,))
        c3 = tl.reshape(tl.sum(tl.reshape(c3, (RG, KSPLIT, 32)), axis=1), (RG * 32,))
    return c0, c1, c2, c3


@triton.jit
def _gate_up_mma_kernel(
    xw_ptr, xe_ptr, ids_ptr, rw_ptr, w_ptr, s_ptr, g_ptr, act_ptr, P,
    I: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr, PB: tl.constexpr, G: tl.constexpr,
    IS_NV: tl.constexpr, LIMIT: tl.constexpr, NW: tl.constexpr, KSPLIT: tl.constexpr,
    USE_ASM: tl.constexpr, PF: tl.constexpr,
):
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, pid_p, P, PB)
    if earlier == 0:
        RG: tl.constexpr = NW // KSPLIT  # groups of 8 rows per program
        KL: tl.constexpr = 4 * KSPLIT  # K slices per row
        wid, g, q = _lanes(NW)
        kl = (wid % KSPLIT) * 4 + q  # this lane's K slice
        n = pid_n * (8 * RG) + (wid // KSPLIT) * 8 + g  # intermediate row of this lane group
        WR: tl.constexpr = D // 8  # int32 words per weight row
        SR: tl.constexpr = D // G  # scale bytes per row
        row = e * (2 * I) + n.to(tl.int64)
        wa = w_ptr + row * WR + kl * (WR // KL)
        wb = wa + I * WR
        sa = s_ptr + row * SR + kl * (SR // KL)
        sb = sa + I * SR
        fold = _TWO63 if IS_NV else 1.0
        gg = tl.load(g_ptr + 2 * e) * fold
        gu = tl.load(g_ptr + 2 * e + 1) * fold
        # lanes of the (K-reduced) result
        wo, go, qo = _lanes(RG)
        no = pid_n * (8 * RG) + wo * 8 + go
        c0r = count * 0
        while c0r < count:  # passes of 8 MMA columns (ranks c0r .. c0r + 7)
            pairs8 = _rank_pairs(offs, match, rank, c0r)
            tok8 = (pairs8 // TOPK).to(tl.int64)
            tok_g = _pick(tok8, g)  # B column g = rank c0r + g (rank past count: pair 0, unused)
            xq = xw_ptr + tok_g * (D // 2) + kl * (D // (2 * KL))
            c0, c1, c2, c3 = _k_loop(wa, wb, sa, sb, xq, xe_ptr, tok8, q, kl, KL, D // (512 * KSPLIT), D,
                                     IS_NV, USE_ASM, NW, KSPLIT, PF)
            for h in tl.static_range(2):
                if h == 0:
                    gv = c0 * gg
                    uv = c2 * gu
                else:
                    gv = c1 * gg
                    uv = c3 * gu
                r = c0r + 2 * qo + h
                ok = r < count
                pair = _pick(pairs8, 2 * qo + h)
                rw = tl.load(rw_ptr + pair, mask=ok, other=0.0)
                gv = tl.minimum(gv, LIMIT)
                uv = tl.minimum(tl.maximum(uv, -LIMIT), LIMIT)
                a = gv / (1.0 + tl.exp(-gv)) * uv * rw
                tl.store(act_ptr + pair.to(tl.int64) * I + no, a.to(tl.bfloat16), mask=ok)
            c0r += 8


@triton.jit
def _down_mma_kernel(
    aw_ptr, ae_ptr, ids_ptr, w_ptr, s_ptr, g_ptr, y_ptr, P,
    I: tl.constexpr, D: tl.constexpr, PB: tl.constexpr, G: tl.constexpr,
    IS_NV: tl.constexpr, NW: tl.constexpr, KSPLIT: tl.constexpr, USE_ASM: tl.constexpr, PF: tl.constexpr,
):
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, pid_p, P, PB)
    if earlier == 0:
        RG: tl.constexpr = NW // KSPLIT
        KL: tl.constexpr = 4 * KSPLIT
        wid, g, q = _lanes(NW)
        kl = (wid % KSPLIT) * 4 + q
        r1 = pid_n * (16 * RG) + (wid // KSPLIT) * 8 + g  # output rows of this lane group: r1, r1 + 8 RG
        WR: tl.constexpr = I // 8
        SR: tl.constexpr = I // G
        row = e * D + r1.to(tl.int64)
        wa = w_ptr + row * WR + kl * (WR // KL)
        wb = wa + (8 * RG) * WR
        sa = s_ptr + row * SR + kl * (SR // KL)
        sb = sa + (8 * RG) * SR
        gw = tl.load(g_ptr + e) * (_TWO63 if IS_NV else 1.0)
        wo, go, qo = _lanes(RG)
        ro = pid_n * (16 * RG) + wo * 8 + go
        c0r = count * 0
        while c0r < count:  # passes of 8 MMA columns (ranks c0r .. c0r + 7)
            pairs8 = _rank_pairs(offs, match, rank, c0r).to(tl.int64)
            pair_g = _pick(pairs8, g)
            xq = aw_ptr + pair_g * (I // 2) + kl * (I // (2 * KL))
            c0, c1, c2, c3 = _k_loop(wa, wb, sa, sb, xq, ae_ptr, pairs8, q, kl, KL, I // (512 * KSPLIT), I,
                                     IS_NV, USE_ASM, NW, KSPLIT, PF)
            for h in tl.static_range(2):
                r = c0r + 2 * qo + h
                ok = r < count
                pair = _pick(pairs8, 2 * qo + h)
                if h == 0:
                    ya = c0
                    yb = c2
                else:
                    ya = c1
                    yb = c3
                dst = y_ptr + pair * D + ro
                tl.store(dst, ya * gw, mask=ok)
                tl.store(dst + 8 * RG, yb * gw, mask=ok)
            c0r += 8


# warps per program and K split (warps sharing rows) of each kernel
MMA_CONFIG = {"gate_up_warps": 4, "gate_up_ksplit": 1, "down_warps": 4, "down_ksplit": 1,
              # weight/scale prefetch distance in 64-byte iterations (1 was measured, 2 not yet)
              "prefetch": 1}


def mma_supports(hidden: int, intermediate: int, config: dict | None = None) -> bool:
    """Whether the mma.sync kernels tile these sizes (K a multiple of 512 per K split)."""
    cfg = {**MMA_CONFIG, **(config or {})}
    kg, kd = cfg["gate_up_ksplit"], cfg["down_ksplit"]
    return (hidden % (512 * kg) == 0 and intermediate % (512 * kd) == 0
            and intermediate % (8 * cfg["gate_up_warps"] // kg) == 0 and hidden % (16 * cfg["down_warps"] // kd) == 0
            and cfg["gate_up_warps"] % kg == 0 and cfg["down_warps"] % kd == 0)


def fp4_moe_mma(
    x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit,
    config: dict | None = None,
):
    """The small-batch CUDA path (inputs already validated by the caller)."""

    cfg = {**MMA_CONFIG, **(config or {})}
    f = fp4.get_format(fmt)
    t, d = x.shape
    k = topk_ids.shape[1]
    inter = w2.shape[-1] * 2
    p = t * k
    out = torch.empty_like(x)
    if p == 0:
        return out.zero_()
    if not mma_supports(d, inter, cfg):
        raise ValueError(f"fp4_moe_mma needs hidden/intermediate sizes that are multiples of 512, got {d}/{inter}.")
    x_c = x.contiguous()
    ids = flat_ids(topk_ids)
    rw = topk_weights.to(torch.float32).contiguous().view(-1)
    act = torch.empty(p, inter, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(p, d, dtype=torch.float32, device=x.device)
    pb = max(64, triton.next_power_of_2(p))  # few compiled variants: T*k <= 64 share one
    is_nv = f.name == "nvfp4"
    use_asm = os.environ.get("TRITON_INTERPRET", "0") != "1"
    nwg, nwd = cfg["gate_up_warps"], cfg["down_warps"]
    ksg, ksd = cfg["gate_up_ksplit"], cfg["down_ksplit"]
    only = cfg.get("only")
    if only in (None, "gate_up"):
        _gate_up_mma_kernel[(p, inter // (8 * nwg // ksg))](
            x_c.view(torch.int32), x_c, ids, rw, w13.view(torch.int32), w13_scale.view(torch.uint8),
            w13_global.float().contiguous(), act, p,
            inter, d, TOPK=k, PB=pb, G=f.group_size, IS_NV=is_nv, LIMIT=float(swiglu_limit),
            NW=nwg, KSPLIT=ksg, USE_ASM=use_asm, PF=cfg["prefetch"], num_warps=nwg, num_stages=1,
        )
    if only in (None, "down"):
        _down_mma_kernel[(p, d // (16 * nwd // ksd))](
            act.view(torch.int32), act, ids, w2.view(torch.int32), w2_scale.view(torch.uint8),
            w2_global.float().contiguous(), y, p,
            inter, d, PB=pb, G=f.group_size, IS_NV=is_nv, NW=nwd, KSPLIT=ksd, USE_ASM=use_asm, PF=cfg["prefetch"],
            num_warps=nwd, num_stages=1,
        )
    if only is not None:
        return out
    blk = 1024
    _sum_kernel[(t, triton.cdiv(d, blk))](y, out, d, TOPK=k, BLOCK=blk, num_warps=4)
    return out
