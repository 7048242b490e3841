"""Streamed FMA GEMV kernels of ``dsv4_mtp::fp4_moe`` (the T=1..2 NVFP4 / T=1 MXFP4 regime).

At one or two tokens the MoE is a GEMV bound by memory latency, not by issue or bandwidth: a thread
keeps only a few 16-byte loads in flight before it needs their registers.  Here the K loop is a
``tl.range(..., num_stages=STAGES)`` loop of plain loads, which Triton's software pipeliner turns
into asynchronous copies (``cp.async``) into a ring of STAGES shared-memory buffers, so STAGES - 1
weight tiles per program are in flight while the current one is decoded.

Per program: BLOCK_N rows of one expert (gate/up: the gate rows and the same up rows), all of K in
steps of BLOCK_K weights, one token per pass (an expert with several tokens re-reads its rows from
L2, so this path is for decode sizes).  The leader program per expert (``moe_pairs._expert_rows``).

Numerics: exact e2m1 decode to fp32 (``decode_ptx.DECODE8_F32*``; NVFP4 folds the 2**-126 into the
block scale and global, 2**63 each, MXFP4 multiplies by 2**126), fp32 products, per scale group an
fp32 sum times the block scale into an fp32 accumulator (fixed order: deterministic), the per-row
sum across threads at the end.  The activations are read as int32 words of bf16 pairs: ``<< 16``
and ``& 0xFFFF0000`` give the even / odd fp32 values without a shuffle.  The gate/up kernel writes
``act = silu(min(g, L)) * clamp(u, -L, L) * r`` as bf16 (as the tl.dot kernels); the down kernel
writes ``y [P, D]`` fp32 and, with tickets, the token sums (``moe_pairs._ticket_sum``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_ptx import DECODE8_F32, DECODE8_F32_RAW
from .moe_pairs import TWO63, _block_scale, _expert_rows, _pair_of_rank, _ticket_sum
from .pdl import launch_args, wait

_DECODE8 = tl.constexpr(DECODE8_F32)
_DECODE8_RAW = tl.constexpr(DECODE8_F32_RAW)

# BLOCK_N rows per program, BLOCK_K weights per K step, STAGES ring buffers, warps, register cap
# (down: 80 instead of ptxas's 95 fits 6 programs per SM, the T=1 grid in one wave).
STREAM_CONFIG = {
    "gate_up": dict(BLOCK_N=32, BLOCK_K=512, STAGES=3, num_warps=4, maxnreg=None),
    "down": dict(BLOCK_N=32, BLOCK_K=512, STAGES=3, num_warps=4, maxnreg=80),
}


@triton.jit
def _x_pair(xw):
    """int32 words of bf16 pairs -> (even, odd) fp32 values."""
    return (xw << 16).to(tl.float32, bitcast=True), (xw & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _decode8(w, IS_NV: tl.constexpr):
    """int32 word of 4 packed bytes -> 8 fp32 (low nibbles of bytes 0-3, then high nibbles), times
    2**-126 for NVFP4 (folded into its scales)."""
    if IS_NV:
        return tl.inline_asm_elementwise(_DECODE8_RAW, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
                                         dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_DECODE8, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
                                         dtype=(tl.float32,) * 8, is_pure=True, pack=1)


@triton.jit
def _x_step(x_row, kk, HW: tl.constexpr):
    """The activations of K step ``kk`` (4 HW bf16-pair words, one contiguous load) as 8 fp32 [1, HW]
    operands: pair words 4j .. 4j+3 meet packed word j."""
    xw = tl.load(x_row + kk * (4 * HW) + tl.arange(0, 4 * HW))
    ev, od = tl.split(tl.reshape(xw, (HW, 2, 2)))  # words 4j + 2h, 4j + 2h + 1
    w0, w2 = tl.split(ev)
    w1, w3 = tl.split(od)
    x0e, x0o = _x_pair(w0)
    x1e, x1o = _x_pair(w1)
    x2e, x2o = _x_pair(w2)
    x3e, x3o = _x_pair(w3)
    return x0e[None, :], x0o[None, :], x1e[None, :], x1o[None, :], x2e[None, :], x2o[None, :], x3e[None, :], x3o[None, :]


@triton.jit
def _w_tile(w_ptr, row0, kk, HW: tl.constexpr, WROW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Packed int32 words [BLOCK_N, HW] of rows row0.. at K step kk (WROW words per row)."""
    r = row0.to(tl.int64) + tl.arange(0, BLOCK_N)
    return tl.load(w_ptr + r[:, None] * WROW + (kk * HW + tl.arange(0, HW))[None, :])


@triton.jit
def _s_tile(s_ptr, row0, kk, NG: tl.constexpr, NSC: tl.constexpr, BLOCK_N: tl.constexpr):
    """Raw scale bytes [BLOCK_N, NG] of rows row0.. at K step kk (NSC per row)."""
    r = row0.to(tl.int64) + tl.arange(0, BLOCK_N)
    return tl.load(s_ptr + r[:, None] * NSC + (kk * NG + tl.arange(0, NG))[None, :])


@triton.jit
def _tile_dot(pw, rsw, x8, BLOCK_N: tl.constexpr, HW: tl.constexpr, WPG: tl.constexpr, IS_NV: tl.constexpr):
    """One K step: per-scale-group fp32 sums times their block scales, [BLOCK_N, HW // WPG]."""
    l0, l1, l2, l3, h0, h1, h2, h3 = _decode8(pw, IS_NV)
    x0e, x0o, x1e, x1o, x2e, x2o, x3e, x3o = x8
    s = l0 * x0e
    s = s + h0 * x0o
    s = s + l1 * x1e
    s = s + h1 * x1o
    s = s + l2 * x2e
    s = s + h2 * x2o
    s = s + l3 * x3e
    s = s + h3 * x3o
    return tl.sum(tl.reshape(s, (BLOCK_N, HW // WPG, WPG)), axis=2) * _block_scale(rsw, IS_NV)


@triton.jit
def _gate_up_stream_kernel(
    xw_ptr, ids_ptr, rw_ptr, w_ptr, s_ptr, g_ptr, act_ptr,
    P, I: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr, PB: tl.constexpr, G: tl.constexpr,
    IS_NV: tl.constexpr, LIMIT: tl.constexpr, NPASS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, PDL: tl.constexpr = False,
):
    wait(PDL)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, tl.program_id(0), P, PB)
    if earlier == 0:
        HW: tl.constexpr = BLOCK_K // 8  # packed int32 words per row per K step
        WPG: tl.constexpr = G // 8  # words per scale group
        NG: tl.constexpr = HW // WPG
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_g = (e * (2 * I) + pid_n * BLOCK_N).to(tl.int32)  # < 2**31: E * 2I rows
        row_u = row_g + I
        fold = TWO63 if IS_NV else 1.0
        gg = tl.load(g_ptr + 2 * e) * fold
        gu = tl.load(g_ptr + 2 * e + 1) * fold
        for ci in range(NPASS):  # NPASS = P: an expert serves at most P pairs
            if ci < count:
                p0 = _pair_of_rank(offs, match, rank, ci)
                x0 = xw_ptr + (p0 // TOPK).to(tl.int64) * (D // 2)
                acc_g = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
                acc_u = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
                for kk in tl.range(D // BLOCK_K, num_stages=STAGES):
                    pg = _w_tile(w_ptr, row_g, kk, HW, D // 8, BLOCK_N)
                    pu = _w_tile(w_ptr, row_u, kk, HW, D // 8, BLOCK_N)
                    rsg = _s_tile(s_ptr, row_g, kk, NG, D // G, BLOCK_N)
                    rsu = _s_tile(s_ptr, row_u, kk, NG, D // G, BLOCK_N)
                    x8 = _x_step(x0, kk, HW)
                    acc_g += _tile_dot(pg, rsg, x8, BLOCK_N, HW, WPG, IS_NV)
                    acc_u += _tile_dot(pu, rsu, x8, BLOCK_N, HW, WPG, IS_NV)
                g = tl.minimum(tl.sum(acc_g, axis=1) * gg, LIMIT)
                u = tl.minimum(tl.maximum(tl.sum(acc_u, axis=1) * gu, -LIMIT), LIMIT)
                a = g / (1.0 + tl.exp(-g)) * u * tl.load(rw_ptr + p0)
                tl.store(act_ptr + p0.to(tl.int64) * I + n, a.to(tl.bfloat16))


@triton.jit
def _down_stream_kernel(
    aw_ptr, ids_ptr, w_ptr, s_ptr, g_ptr, y_ptr, out_ptr, tk_ptr,
    P, I: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr, PB: tl.constexpr, G: tl.constexpr,
    IS_NV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    TICKET: tl.constexpr, PDL: tl.constexpr = False,
):
    wait(PDL)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, tl.program_id(0), P, PB)
    if earlier == 0:
        HW: tl.constexpr = BLOCK_K // 8
        WPG: tl.constexpr = G // 8
        NG: tl.constexpr = HW // WPG
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row0 = (e * D + pid_n * BLOCK_N).to(tl.int32)  # < 2**31: E * D rows
        gw = tl.load(g_ptr + e) * (TWO63 if IS_NV else 1.0)
        ci = count * 0
        while ci < count:  # a dynamic loop: unrolled over the pair count it spilled at the register cap
            p0 = _pair_of_rank(offs, match, rank, ci)
            a0 = aw_ptr + p0.to(tl.int64) * (I // 2)
            acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
            for kk in tl.range(I // BLOCK_K, num_stages=STAGES):
                pw = _w_tile(w_ptr, row0, kk, HW, I // 8, BLOCK_N)
                rsw = _s_tile(s_ptr, row0, kk, NG, I // G, BLOCK_N)
                acc += _tile_dot(pw, rsw, _x_step(a0, kk, HW), BLOCK_N, HW, WPG, IS_NV)
            tl.store(y_ptr + p0.to(tl.int64) * D + n, tl.sum(acc, axis=1) * gw)
            if TICKET:  # the token's last pair sums its k rows of this tile into out
                _ticket_sum(y_ptr, out_ptr, tk_ptr, p0, pid_n, D // BLOCK_N, D, TOPK, BLOCK_N)
            ci += 1


def stream_supports(hidden: int, intermediate: int) -> bool:
    """Whether STREAM_CONFIG's blocks tile these sizes (multiples of 512 do: V4-Flash, V4-Pro)."""
    gu, dn = STREAM_CONFIG["gate_up"], STREAM_CONFIG["down"]
    return (hidden % gu["BLOCK_K"] == 0 and intermediate % gu["BLOCK_N"] == 0
            and intermediate % dn["BLOCK_K"] == 0 and hidden % dn["BLOCK_N"] == 0)


def _regs(c: dict) -> dict:
    return {"maxnreg": c["maxnreg"]} if c["maxnreg"] else {}


def launch_stream(x, ids, rw, w13, w13_scale, w13_global, w2, w2_scale, w2_global, act, y, out, tickets, *, k,
                  group_size, is_nv, limit):
    """Gate/up into ``act`` [P, I] bf16, down into ``y`` [P, D] fp32; with ``tickets`` the down kernel
    also writes the token sums into ``out`` (else that is the caller's ``_sum_kernel``)."""
    p = ids.numel()
    d = x.shape[1]
    inter = act.shape[1]
    if not stream_supports(d, inter):
        raise ValueError(f"fp4_moe (stream kernels): D={d} / I={inter} are not multiples of the blocks "
                         f"{STREAM_CONFIG}; use sizes that are multiples of 512 (or the reference).")
    if x.data_ptr() % 16:  # the activations are read as 16-byte vectors
        x = x.clone()
    gu, dn = STREAM_CONFIG["gate_up"], STREAM_CONFIG["down"]
    common = dict(PB=max(16, triton.next_power_of_2(p)), G=group_size, IS_NV=is_nv, **launch_args(x.device))
    _gate_up_stream_kernel[(p, inter // gu["BLOCK_N"])](
        x.view(torch.int32), ids, rw, w13.view(torch.int32), w13_scale.view(torch.uint8),
        w13_global.float().contiguous(), act, p, inter, d, TOPK=k, LIMIT=float(limit), NPASS=p,
        BLOCK_N=gu["BLOCK_N"], BLOCK_K=gu["BLOCK_K"], STAGES=gu["STAGES"], num_warps=gu["num_warps"],
        **_regs(gu), **common,
    )
    ticket = tickets is not None
    _down_stream_kernel[(p, d // dn["BLOCK_N"])](
        act.view(torch.int32), ids, w2.view(torch.int32), w2_scale.view(torch.uint8), w2_global.float().contiguous(),
        y, out, tickets if ticket else ids, p, inter, d, TOPK=k, BLOCK_N=dn["BLOCK_N"], BLOCK_K=dn["BLOCK_K"],
        STAGES=dn["STAGES"], TICKET=ticket, num_warps=dn["num_warps"], **_regs(dn), **common,
    )
