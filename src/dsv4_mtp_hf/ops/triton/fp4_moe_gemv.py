"""Small-batch path of ``dsv4_mtp::fp4_moe`` on CUDA: FP4 GEMV on the CUDA cores (FMA), no
shared memory, no barriers, no layout conversion.

Why: at decode sizes (T = 1..16) almost every chosen expert serves one token, so the op
is a bandwidth-bound GEMV.  The ``tl.dot`` kernels run it at M = 16 MMA rows (15 of them
empty) and route every decoded weight through a shared-memory layout conversion and a
barrier; with ~3 programs per SM at T=1 that chain runs far below issue rate (35% of
copy bandwidth, BENCHMARKS.md 2026-11-29).  Here each thread streams its own 16-byte
pieces of a few weight rows, decodes them in registers (``decode_ptx``), and does fp32
FMAs against the activations, which stay in registers across the rows the thread owns.
Small programs (16-32 rows), many warps per SM, the next K chunk loaded one iteration
ahead: enough bytes in flight without shared memory.

Status (H200, 2026-11-30, BENCHMARKS.md): correct (both formats, V4-Flash and V4-Pro shapes,
T=1..16), the default at T=2 only (9-10% faster than ``tl.dot`` there) until 2026-12-01, when the
same math fed by a shared-memory ring (``fp4_moe_stream``) beat it at T=1..4; now opt-in; equal at T=1 with
BLOCK_N=32 and slower with 16 or 8, about even at T=4, slower from T=8.  A second K step in
flight (PF=2) and M=2 were slower everywhere.  The loop is 4.6-4.8 SASS instructions per weight
(gate/up), so at T=1 it is not issue-bound either (42.7 us measured against a 14.5 us issue
bound): see BENCHMARKS.md for the access-pattern suspect and the untimed whole-row variant.

Per scale group (16 or 32 weights along K) the products are summed in fp32, then the group
sum is multiplied by the block scale and added to an fp32 accumulator (fixed order, so
deterministic); the per-row sum across the threads of a row is taken once at the end.
Exact FP4 decode: e2m1 bits x 2**-126 ("fold": NVFP4 block scale x 2**63 and global x 2**63;
MXFP4 multiplies the decoded values by 2**126 first), fp32 accumulation.

Kernels (fixed grids that depend only on T: CUDA-graph safe, no host sync):

1. ``_gate_up_gemv_kernel``, grid ``(P, I / BLOCK_N)``: the leader program of each expert
   (first pair routed to it; the others exit) computes ``silu(min(g, L)) * clamp(u, -L, L)
   * r`` for BLOCK_N intermediate rows and every token of the expert, M tokens per pass
   (more passes re-read the rows, mostly from L2), into ``act [P, I]`` (bf16, as the
   ``tl.dot`` kernels).
2. ``_down_gemv_kernel``, grid ``(P, D / BLOCK_N)``: ``w2`` rows times the pair
   activations, fp32 into ``y [P, D]``.
3. ``moe_pairs._sum_kernel``: ``out[t] = sum_j y[t k + j]`` in a fixed order.

The activations are read as int32 words (bf16 pairs): the low half is the even K element
(the low nibble's partner), the high half the odd one, so ``<< 16`` and ``& 0xFFFF0000``
give both fp32 values without a shuffle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_ptx import DECODE8_F32, DECODE8_F32_RAW
from .fp4_moe_triton import _decode_scale
from .moe_pairs import _expert_rows

_DECODE8 = tl.constexpr(DECODE8_F32)
_DECODE8_RAW = tl.constexpr(DECODE8_F32_RAW)

# Launch configuration per kernel: BLOCK_N rows per program, BLOCK_K weights per K step
# (BLOCK_K // 2 bytes per row), M tokens per pass, PF K steps loaded ahead (1 or 2), warps.
GEMV_CONFIG = {
    "gate_up": dict(BLOCK_N=16, BLOCK_K=512, M=1, num_warps=4),
    "down": dict(BLOCK_N=32, BLOCK_K=512, M=1, num_warps=4),
}


@triton.jit
def _x_pair(xw):
    """int32 words of bf16 pairs -> (even, odd) fp32 values."""
    xe = (xw << 16).to(tl.float32, bitcast=True)
    xo = (xw & -65536).to(tl.float32, bitcast=True)
    return xe, xo


@triton.jit
def _pair_of_rank(offs, match, rank, r):
    """Pair index of the expert's rank-r pair (0 where it does not exist)."""
    return tl.sum(tl.where(match & (rank == r), offs, 0), axis=0)


@triton.jit
def _nib_f32(c, FOLD: tl.constexpr):
    """e2m1 code (int32, 0..15) -> fp32 value (x 2**-126 if FOLD); portable path."""
    v = (((c & 8) << 28) | ((c & 7) << 22)).to(tl.float32, bitcast=True)  # value x 2**-126
    if not FOLD:
        v = v * 8.507059173023462e37  # 2**126
    return v


@triton.jit
def _decode8(w, USE_ASM: tl.constexpr, FOLD: tl.constexpr):
    """int32 word of 4 packed bytes -> 8 fp32 (low nibbles of bytes 0-3, high nibbles of 0-3)."""
    if USE_ASM:
        if FOLD:
            return tl.inline_asm_elementwise(_DECODE8_RAW, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
                                             dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_DECODE8, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
                                             dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        return (_nib_f32(w & 15, FOLD), _nib_f32((w >> 8) & 15, FOLD), _nib_f32((w >> 16) & 15, FOLD),
                _nib_f32((w >> 24) & 15, FOLD), _nib_f32((w >> 4) & 15, FOLD), _nib_f32((w >> 12) & 15, FOLD),
                _nib_f32((w >> 20) & 15, FOLD), _nib_f32((w >> 28) & 15, FOLD))


@triton.jit
def _load_x8(x_row, j):
    """The 8 activations (fp32, as 4 even/odd pairs) that meet packed word j: int32 pair
    words 4j .. 4j+3 of the row."""
    x0e, x0o = _x_pair(tl.load(x_row + 4 * j))
    x1e, x1o = _x_pair(tl.load(x_row + 4 * j + 1))
    x2e, x2o = _x_pair(tl.load(x_row + 4 * j + 2))
    x3e, x3o = _x_pair(tl.load(x_row + 4 * j + 3))
    return x0e[None, :], x0o[None, :], x1e[None, :], x1o[None, :], x2e[None, :], x2o[None, :], x3e[None, :], x3o[None, :]


@triton.jit
def _word_dot(d, x0e, x0o, x1e, x1o, x2e, x2o, x3e, x3o, BN: tl.constexpr, HW: tl.constexpr, WPG: tl.constexpr):
    """Decoded words (8 fp32 tensors [BN, HW]) . activations -> per-scale-group sums [BN, HW // WPG]."""
    l0, l1, l2, l3, h0, h1, h2, h3 = d
    s = l0 * x0e
    s = s + h0 * x0o
    s = s + l1 * x1e
    s = s + h1 * x1o
    s = s + l2 * x2e
    s = s + h2 * x2o
    s = s + l3 * x3e
    s = s + h3 * x3o
    return tl.sum(tl.reshape(s, (BN, HW // WPG, WPG)), axis=2)


@triton.jit
def _gate_up_gemv_kernel(
    xw_ptr, ids_ptr, rw_ptr, w_ptr, s_ptr, g_ptr, act_ptr,
    P, I: tl.constexpr, D: tl.constexpr,
    TOPK: tl.constexpr, PB: tl.constexpr, G: tl.constexpr, IS_NV: tl.constexpr, LIMIT: tl.constexpr,
    NPASS: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF: tl.constexpr,
    USE_ASM: tl.constexpr, FOLD: tl.constexpr,
):
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, pid_p, P, PB)
    if earlier == 0:
        HW: tl.constexpr = BLOCK_K // 8  # packed int32 words per row per K step
        WPG: tl.constexpr = G // 8  # words per scale group
        NG: tl.constexpr = HW // WPG
        NK: tl.constexpr = D // BLOCK_K
        wrow: tl.constexpr = D // 8
        nsc: tl.constexpr = D // G
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        jw = tl.arange(0, HW)
        ks = tl.arange(0, NG)
        wg_rows = w_ptr + e * (2 * I) * wrow + n.to(tl.int64) * wrow
        wu_rows = wg_rows + I * wrow
        sg_rows = s_ptr + e * (2 * I) * nsc + n.to(tl.int64) * nsc
        su_rows = sg_rows + I * nsc
        gg = tl.load(g_ptr + 2 * e) * (9.223372036854775808e18 if FOLD else 1.0)
        gu = tl.load(g_ptr + 2 * e + 1) * (9.223372036854775808e18 if FOLD else 1.0)
        for ci in range(NPASS):
            c0 = ci * M
            if c0 < count:
                p0 = _pair_of_rank(offs, match, rank, c0)
                x0 = xw_ptr + (p0 // TOPK).to(tl.int64) * (D // 2)
                acc_g0 = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
                acc_u0 = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
                if M == 2:
                    ok1 = c0 + 1 < count
                    p1 = _pair_of_rank(offs, match, rank, c0 + 1)
                    p1 = tl.where(ok1, p1, p0)  # a missing second token recomputes the first (not stored)
                    x1 = xw_ptr + (p1 // TOPK).to(tl.int64) * (D // 2)
                    acc_g1 = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
                    acc_u1 = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
                # K step 0, then each step loads the next one before computing its own
                pg = tl.load(wg_rows[:, None] + jw[None, :])
                pu = tl.load(wu_rows[:, None] + jw[None, :])
                rsg = tl.load(sg_rows[:, None] + ks[None, :])
                rsu = tl.load(su_rows[:, None] + ks[None, :])
                if PF == 2:  # K step 1 too: two steps in flight
                    k1 = tl.minimum(1, NK - 1)
                    pg2 = tl.load(wg_rows[:, None] + (k1 * HW + jw)[None, :])
                    pu2 = tl.load(wu_rows[:, None] + (k1 * HW + jw)[None, :])
                    rsg2 = tl.load(sg_rows[:, None] + (k1 * NG + ks)[None, :])
                    rsu2 = tl.load(su_rows[:, None] + (k1 * NG + ks)[None, :])
                for kk in range(NK):
                    kn = tl.minimum(kk + PF, NK - 1)  # the last steps reload the last one (cached)
                    pg_n = tl.load(wg_rows[:, None] + (kn * HW + jw)[None, :])
                    pu_n = tl.load(wu_rows[:, None] + (kn * HW + jw)[None, :])
                    rsg_n = tl.load(sg_rows[:, None] + (kn * NG + ks)[None, :])
                    rsu_n = tl.load(su_rows[:, None] + (kn * NG + ks)[None, :])
                    dg = _decode8(pg, USE_ASM, FOLD)
                    du = _decode8(pu, USE_ASM, FOLD)
                    sg = _decode_scale(rsg, IS_NV, FOLD)
                    su = _decode_scale(rsu, IS_NV, FOLD)
                    xa, xb, xc, xd, xe, xf, xg, xh = _load_x8(x0, kk * HW + jw)
                    acc_g0 += _word_dot(dg, xa, xb, xc, xd, xe, xf, xg, xh, BLOCK_N, HW, WPG) * sg
                    acc_u0 += _word_dot(du, xa, xb, xc, xd, xe, xf, xg, xh, BLOCK_N, HW, WPG) * su
                    if M == 2:
                        xa, xb, xc, xd, xe, xf, xg, xh = _load_x8(x1, kk * HW + jw)
                        acc_g1 += _word_dot(dg, xa, xb, xc, xd, xe, xf, xg, xh, BLOCK_N, HW, WPG) * sg
                        acc_u1 += _word_dot(du, xa, xb, xc, xd, xe, xf, xg, xh, BLOCK_N, HW, WPG) * su
                    if PF == 2:
                        pg, pu, rsg, rsu = pg2, pu2, rsg2, rsu2
                        pg2, pu2, rsg2, rsu2 = pg_n, pu_n, rsg_n, rsu_n
                    else:
                        pg, pu, rsg, rsu = pg_n, pu_n, rsg_n, rsu_n
                g = tl.minimum(tl.sum(acc_g0, axis=1) * gg, LIMIT)
                u = tl.minimum(tl.maximum(tl.sum(acc_u0, axis=1) * gu, -LIMIT), LIMIT)
                a = g / (1.0 + tl.exp(-g)) * u * tl.load(rw_ptr + p0)
                tl.store(act_ptr + p0.to(tl.int64) * I + n, a.to(tl.bfloat16))
                if M == 2:
                    g = tl.minimum(tl.sum(acc_g1, axis=1) * gg, LIMIT)
                    u = tl.minimum(tl.maximum(tl.sum(acc_u1, axis=1) * gu, -LIMIT), LIMIT)
                    a = g / (1.0 + tl.exp(-g)) * u * tl.load(rw_ptr + p1)
                    tl.store(act_ptr + p1.to(tl.int64) * I + n, a.to(tl.bfloat16), mask=(n < I) & ok1)


@triton.jit
def _down_gemv_kernel(
    aw_ptr, ids_ptr, w_ptr, s_ptr, g_ptr, y_ptr,
    P, I: tl.constexpr, D: tl.constexpr,
    PB: tl.constexpr, G: tl.constexpr, IS_NV: tl.constexpr,
    NPASS: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF: tl.constexpr,
    USE_ASM: tl.constexpr, FOLD: tl.constexpr,
):
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, pid_p, P, PB)
    if earlier == 0:
        HW: tl.constexpr = BLOCK_K // 8
        WPG: tl.constexpr = G // 8
        NG: tl.constexpr = HW // WPG
        NK: tl.constexpr = I // BLOCK_K
        wrow: tl.constexpr = I // 8
        nsc: tl.constexpr = I // G
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        jw = tl.arange(0, HW)
        ks = tl.arange(0, NG)
        w_rows = w_ptr + e * D * wrow + n.to(tl.int64) * wrow
        s_rows = s_ptr + e * D * nsc + n.to(tl.int64) * nsc
        gw = tl.load(g_ptr + e) * (9.223372036854775808e18 if FOLD else 1.0)
        for ci in range(NPASS):
            c0 = ci * M
            if c0 < count:
                p0 = _pair_of_rank(offs, match, rank, c0)
                a0 = aw_ptr + p0.to(tl.int64) * (I // 2)
                acc0 = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
                if M == 2:
                    ok1 = c0 + 1 < count
                    p1 = _pair_of_rank(offs, match, rank, c0 + 1)
                    p1 = tl.where(ok1, p1, p0)
                    a1 = aw_ptr + p1.to(tl.int64) * (I // 2)
                    acc1 = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
                pw = tl.load(w_rows[:, None] + jw[None, :])
                rs = tl.load(s_rows[:, None] + ks[None, :])
                if PF == 2:
                    k1 = tl.minimum(1, NK - 1)
                    pw2 = tl.load(w_rows[:, None] + (k1 * HW + jw)[None, :])
                    rs2 = tl.load(s_rows[:, None] + (k1 * NG + ks)[None, :])
                for kk in range(NK):
                    kn = tl.minimum(kk + PF, NK - 1)
                    pw_n = tl.load(w_rows[:, None] + (kn * HW + jw)[None, :])
                    rs_n = tl.load(s_rows[:, None] + (kn * NG + ks)[None, :])
                    dw = _decode8(pw, USE_ASM, FOLD)
                    sw = _decode_scale(rs, IS_NV, FOLD)
                    xa, xb, xc, xd, xe, xf, xg, xh = _load_x8(a0, kk * HW + jw)
                    acc0 += _word_dot(dw, xa, xb, xc, xd, xe, xf, xg, xh, BLOCK_N, HW, WPG) * sw
                    if M == 2:
                        xa, xb, xc, xd, xe, xf, xg, xh = _load_x8(a1, kk * HW + jw)
                        acc1 += _word_dot(dw, xa, xb, xc, xd, xe, xf, xg, xh, BLOCK_N, HW, WPG) * sw
                    if PF == 2:
                        pw, rs = pw2, rs2
                        pw2, rs2 = pw_n, rs_n
                    else:
                        pw, rs = pw_n, rs_n
                tl.store(y_ptr + p0.to(tl.int64) * D + n, tl.sum(acc0, axis=1) * gw)
                if M == 2:
                    tl.store(y_ptr + p1.to(tl.int64) * D + n, tl.sum(acc1, axis=1) * gw, mask=(n < D) & ok1)


def gemv_supports(hidden: int, intermediate: int, cfg: dict | None = None) -> bool:
    cfg = cfg or GEMV_CONFIG
    gu, dn = cfg["gate_up"], cfg["down"]
    return (hidden % gu["BLOCK_K"] == 0 and intermediate % gu["BLOCK_N"] == 0
            and intermediate % dn["BLOCK_K"] == 0 and hidden % dn["BLOCK_N"] == 0)


def launch_gemv(x, ids, rw, w13, w13_scale, w13_global, w2, w2_scale, w2_global, act, y, *, k, group_size,
                is_nv, limit, use_asm, fold, cfg, only=None):
    """Gate/up and down GEMV kernels (the sum kernel is the caller's)."""
    p = ids.numel()
    t, d = x.shape
    inter = act.shape[1]
    pb = max(16, triton.next_power_of_2(p))
    gu, dn = cfg["gate_up"], cfg["down"]
    for c in (gu, dn):
        if c["BLOCK_K"] % group_size or c["M"] not in (1, 2) or c.get("PF", 1) not in (1, 2):
            raise ValueError(f"GEMV config {c}: BLOCK_K must be a multiple of {group_size}, M and PF 1 or 2.")
    if not gemv_supports(d, inter, cfg):
        raise ValueError(f"D={d} / I={inter} must be multiples of the GEMV blocks {gu} / {dn}.")
    if only in (None, "gate_up"):
        _gate_up_gemv_kernel[(p, inter // gu["BLOCK_N"])](
            x.view(torch.int32), ids, rw, w13.view(torch.int32), w13_scale.view(torch.uint8), w13_global.float().contiguous(), act,
            p, inter, d, TOPK=k, PB=pb, G=group_size, IS_NV=is_nv, LIMIT=float(limit),
            NPASS=triton.cdiv(p, gu["M"]), M=gu["M"], BLOCK_N=gu["BLOCK_N"], BLOCK_K=gu["BLOCK_K"], PF=gu.get("PF", 1), USE_ASM=use_asm, FOLD=fold,
            num_warps=gu["num_warps"], num_stages=1,
        )
    if only in (None, "down"):
        _down_gemv_kernel[(p, d // dn["BLOCK_N"])](
            act.view(torch.int32), ids, w2.view(torch.int32), w2_scale.view(torch.uint8), w2_global.float().contiguous(), y,
            p, inter, d, PB=pb, G=group_size, IS_NV=is_nv,
            NPASS=triton.cdiv(p, dn["M"]), M=dn["M"], BLOCK_N=dn["BLOCK_N"], BLOCK_K=dn["BLOCK_K"], PF=dn.get("PF", 1), USE_ASM=use_asm, FOLD=fold,
            num_warps=dn["num_warps"], num_stages=1,
        )
