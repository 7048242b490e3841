"""Streamed small-batch path of ``dsv4_mtp::fp4_moe`` on CUDA: the FMA GEMV of ``fp4_moe_gemv``
(exact e2m1 decode, fp32 products and sums) fed by an asynchronous shared-memory ring.

Why: at T=1 the register-prefetch GEMV and MMA kernels are bound by memory latency, not by issue
or bandwidth (notes/draft_step_performance.md: ~2.8 warps per scheduler, 35-45% of DRAM peak,
while the bytes alone read in 25.8 us).  A thread can only keep a few 16-byte loads in flight
before it needs their registers.  Here the K loop is a ``tl.range(..., num_stages=STAGES)``
loop: Triton's software pipeliner turns its loads into asynchronous copies into a ring of
``STAGES`` shared-memory buffers (``cp.async``; TMA bulk copies with ``TMA=True``), so
``STAGES - 1`` weight tiles per program are in flight while the current one is decoded, and
no register holds a load that has not landed.  (Without an explicit ``num_stages`` on the
loop Triton pipelines only loops with a ``tl.dot``.)

Per program: BLOCK_N rows of one expert (gate/up: the gate rows and the same up rows), all of
K in steps of BLOCK_K weights: per step a ``[BLOCK_N, BLOCK_K / 8]`` tile of packed int32 words
per matrix, its scale bytes and the step's activations (one contiguous load of bf16 pairs).
Numerics are those of ``fp4_moe_gemv`` (same decode, same per-group fp32 sums, same bf16
``act * r`` between the two kernels).

Status (H200, 2026-12-01, BENCHMARKS.md, routings rotated so every call reads its experts from
HBM): the default at T=1..2 NVFP4 and T=1 MXFP4 since 2026-12-02 (T=1..4 at first), 42.3 / 72.7 /
133.4 us at T=1/2/4 (NVFP4; MXFP4 42.4 / 74.7 / 140.3)
against 47.5 / 84.4 / 156.4 for the previous defaults in the same run; slower than ``tl.dot`` at
T=16.  Still 2.1x the bandwidth floor at T=1: the same kernels with the FP4 math replaced by an
xor (``probe``) take 30 us, the arithmetic (4.55 SASS instructions per weight, gate/up) the rest.

Kernels (fixed grids per T, CUDA-graph safe, no host sync; PDL like the default kernels):
``_gate_up_stream_kernel`` (P, I / BLOCK_N) -> ``act [P, I]`` bf16, ``_down_stream_kernel``
(P, D / BLOCK_N) -> ``y [P, D]`` fp32 and, with tickets, the token sums (``moe_pairs._ticket_sum``: the last of a
token's pairs per row tile; else ``moe_pairs._sum_kernel``, the caller's).  Leader
program per expert (``moe_pairs._expert_rows``), one token per pass: an expert with several
tokens re-reads its rows (from L2), so this path is for decode sizes.  Opt-in (``fused``):
``_fused_stream_kernel`` runs both as one launch, a down tile waiting on its expert's gate/up count.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fp4_moe_gemv import _decode8, _pair_of_rank, _word_dot, _x_pair
from .fp4_moe_triton import _decode_scale
from .moe_pairs import _expert_rows, _ticket_sum, merged_config
from .persistent import persistent_zeros
from .pdl import launch_args, wait

# BLOCK_N rows per program, BLOCK_K weights per K step, STAGES ring buffers, warps; "tma": the
# weight tiles by bulk tensor copies (host-built descriptors) instead of per-thread cp.async
# (measured ~1% faster at T=1..4, within the spread: off); "probe": the same loads and pipeline
# without the FP4 math (a garbage result; ``benchmarks/moe_op.py`` st_*probe: what the kernels'
# structure costs apart from their arithmetic).  A kernel's "maxnreg" caps its registers per thread (None:
# ptxas's choice).  The down kernel's 80: ptxas alone takes 95, which fits 5 programs per SM, so at T=1 its 768
# programs ran in 1.16 waves (Nsight Compute); at 80 (no spills in the sm_90 build, tests/test_fp4_moe_stream.py)
# 6 fit, one wave: 15.7 vs 16.4-16.5 us for the down kernel, 41.2-41.3 vs 42.2-42.3 for the op (NVFP4, T=1, two
# runs; MXFP4 within the spread).
STREAM_CONFIG = {
    "gate_up": dict(BLOCK_N=32, BLOCK_K=512, STAGES=3, num_warps=4, maxnreg=None),
    "down": dict(BLOCK_N=32, BLOCK_K=512, STAGES=3, num_warps=4, maxnreg=80),
    "tma": False,
    # "fused": both kernels as one launch (``_fused_stream_kernel``, a work counter and per-expert counts), capped
    # at "fused_maxnreg" registers per thread; off by default (BENCHMARKS.md, fifteenth session: equal at T=1, NVFP4
    # T=2 2-3 us faster with 64-row down tiles; its loads-only probe is slower than the two kernels')
    "fused": False,
    "fused_maxnreg": None,
}


def stream_config(cfg: dict | None = None) -> dict:
    """STREAM_CONFIG with ``cfg``'s keys over it ("gate_up" / "down" merged key by key)."""
    return merged_config(STREAM_CONFIG, cfg)


@triton.jit
def _x_step(x_row, kk, HW: tl.constexpr, CG: tl.constexpr = False):
    """The activations of K step ``kk`` (4 HW int32 bf16-pair words, one contiguous load) as the
    8 fp32 [1, HW] operands of ``_word_dot``: pair words 4j .. 4j+3 meet packed word j.  ``CG``: from L2."""
    xw = tl.load(x_row + kk * (4 * HW) + tl.arange(0, 4 * HW), cache_modifier=".cg" if CG else "")
    ev, od = tl.split(tl.reshape(xw, (HW, 2, 2)))  # words 4j + 2h, 4j + 2h + 1
    w0, w2 = tl.split(ev)
    w1, w3 = tl.split(od)
    x0e, x0o = _x_pair(w0)
    x1e, x1o = _x_pair(w1)
    x2e, x2o = _x_pair(w2)
    x3e, x3o = _x_pair(w3)
    return x0e[None, :], x0o[None, :], x1e[None, :], x1o[None, :], x2e[None, :], x2o[None, :], x3e[None, :], x3o[None, :]


@triton.jit
def _w_tile(w_ptr, w_desc, row0, kk, HW: tl.constexpr, WROW: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """Packed int32 words [BLOCK_N, HW] of rows row0.. at K step kk (WROW words per row)."""
    if TMA:
        return w_desc.load([row0, kk * HW])
    else:
        r = row0.to(tl.int64) + tl.arange(0, BLOCK_N)
        return tl.load(w_ptr + r[:, None] * WROW + (kk * HW + tl.arange(0, HW))[None, :])


@triton.jit
def _s_tile(s_ptr, row0, kk, NG: tl.constexpr, NSC: tl.constexpr, BLOCK_N: tl.constexpr):
    r = row0.to(tl.int64) + tl.arange(0, BLOCK_N)
    return tl.load(s_ptr + r[:, None] * NSC + (kk * NG + tl.arange(0, NG))[None, :])


@triton.jit
def _tile_dot(pw, rsw, x8, BLOCK_N: tl.constexpr, HW: tl.constexpr, WPG: tl.constexpr, IS_NV: tl.constexpr,
              USE_ASM: tl.constexpr, FOLD: tl.constexpr):
    """One K step: the rows' packed words ``pw`` and raw scales ``rsw`` against the step's activations
    (``_x_step``) -> fp32 per-scale-group sums times their block scales, [BLOCK_N, HW // WPG]."""
    xa, xb, xc, xd, xe, xf, xg, xh = x8
    return (_word_dot(_decode8(pw, USE_ASM, FOLD), xa, xb, xc, xd, xe, xf, xg, xh, BLOCK_N, HW, WPG)
            * _decode_scale(rsw, IS_NV, FOLD))


@triton.jit
def _gate_up_tile(xw_ptr, rw_ptr, w_ptr, w_desc, s_ptr, g_ptr, act_ptr, e, offs, match, rank, count, pid_n,
                  I: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr, G: tl.constexpr, IS_NV: tl.constexpr,
                  LIMIT: tl.constexpr, NPASS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  STAGES: tl.constexpr, TMA: tl.constexpr, USE_ASM: tl.constexpr, FOLD: tl.constexpr,
                  PROBE: tl.constexpr):
    """Gate/up rows ``pid_n * BLOCK_N ..`` of expert ``e`` for each of its ``count`` pairs -> ``act``."""
    HW: tl.constexpr = BLOCK_K // 8  # packed int32 words per row per K step
    WPG: tl.constexpr = G // 8  # words per scale group
    NG: tl.constexpr = HW // WPG
    NK: tl.constexpr = D // BLOCK_K
    WROW: tl.constexpr = D // 8
    NSC: tl.constexpr = D // G
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_g = (e * (2 * I) + pid_n * BLOCK_N).to(tl.int32)  # < 2**31: E * 2I rows
    row_u = row_g + I
    gg = tl.load(g_ptr + 2 * e) * (9.223372036854775808e18 if FOLD else 1.0)
    gu = tl.load(g_ptr + 2 * e + 1) * (9.223372036854775808e18 if FOLD else 1.0)
    for ci in range(NPASS):
        if ci < count:
            p0 = _pair_of_rank(offs, match, rank, ci)
            x0 = xw_ptr + (p0 // TOPK).to(tl.int64) * (D // 2)
            acc_g = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
            if PROBE:
                bits = tl.zeros((BLOCK_N, HW), dtype=tl.int32)
            for kk in tl.range(NK, num_stages=STAGES):
                pg = _w_tile(w_ptr, w_desc, row_g, kk, HW, WROW, BLOCK_N, TMA)
                pu = _w_tile(w_ptr, w_desc, row_u, kk, HW, WROW, BLOCK_N, TMA)
                rsg = _s_tile(s_ptr, row_g, kk, NG, NSC, BLOCK_N)
                rsu = _s_tile(s_ptr, row_u, kk, NG, NSC, BLOCK_N)
                if PROBE:  # the same loads and pipeline, no FP4 math (benchmarks/moe_op.py)
                    bits = bits ^ pg ^ pu
                    acc_g += rsg.to(tl.float32) + rsu.to(tl.float32)
                else:
                    x8 = _x_step(x0, kk, HW)
                    acc_g += _tile_dot(pg, rsg, x8, BLOCK_N, HW, WPG, IS_NV, USE_ASM, FOLD)
                    acc_u += _tile_dot(pu, rsu, x8, BLOCK_N, HW, WPG, IS_NV, USE_ASM, FOLD)
            if PROBE:
                acc_u += tl.sum(bits, axis=1).to(tl.float32)[:, None]
            g = tl.minimum(tl.sum(acc_g, axis=1) * gg, LIMIT)
            u = tl.minimum(tl.maximum(tl.sum(acc_u, axis=1) * gu, -LIMIT), LIMIT)
            a = g / (1.0 + tl.exp(-g)) * u * tl.load(rw_ptr + p0)
            tl.store(act_ptr + p0.to(tl.int64) * I + n, a.to(tl.bfloat16))


@triton.jit
def _down_tile(aw_ptr, w_ptr, w_desc, s_ptr, g_ptr, y_ptr, out_ptr, tk_ptr, e, offs, match, rank, count, pid_n,
               I: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr, G: tl.constexpr, IS_NV: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr,
               USE_ASM: tl.constexpr, FOLD: tl.constexpr, PROBE: tl.constexpr, TICKET: tl.constexpr,
               ACT_CG: tl.constexpr):
    """Down rows ``pid_n * BLOCK_N ..`` of expert ``e`` for each of its ``count`` pairs -> ``y`` (and with
    ``TICKET`` the token sums into ``out``).  ``ACT_CG``: ``act`` read from L2 (written by this grid)."""
    HW: tl.constexpr = BLOCK_K // 8
    WPG: tl.constexpr = G // 8
    NG: tl.constexpr = HW // WPG
    NK: tl.constexpr = I // BLOCK_K
    WROW: tl.constexpr = I // 8
    NSC: tl.constexpr = I // G
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row0 = (e * D + pid_n * BLOCK_N).to(tl.int32)  # < 2**31: E * D rows
    gw = tl.load(g_ptr + e) * (9.223372036854775808e18 if FOLD else 1.0)
    ci = count * 0
    while ci < count:  # one pass per pair of the expert (a dynamic loop: with the ticket inside, a loop unrolled
        # over the pair count spilled at the 80-register cap)
        p0 = _pair_of_rank(offs, match, rank, ci)
        a0 = aw_ptr + p0.to(tl.int64) * (I // 2)
        acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
        if PROBE:
            bits = tl.zeros((BLOCK_N, HW), dtype=tl.int32)
        for kk in tl.range(NK, num_stages=STAGES):
            pw = _w_tile(w_ptr, w_desc, row0, kk, HW, WROW, BLOCK_N, TMA)
            rsw = _s_tile(s_ptr, row0, kk, NG, NSC, BLOCK_N)
            if PROBE:
                bits = bits ^ pw
                acc += rsw.to(tl.float32)
            else:
                acc += _tile_dot(pw, rsw, _x_step(a0, kk, HW, ACT_CG), BLOCK_N, HW, WPG, IS_NV, USE_ASM, FOLD)
        if PROBE:
            acc += tl.sum(bits, axis=1).to(tl.float32)[:, None]
        tl.store(y_ptr + p0.to(tl.int64) * D + n, tl.sum(acc, axis=1) * gw)
        if TICKET:  # the token's last pair sums its k rows of this tile into out
            _ticket_sum(y_ptr, out_ptr, tk_ptr, p0, pid_n, D // BLOCK_N, D, TOPK, BLOCK_N)
        ci += 1


@triton.jit
def _gate_up_stream_kernel(
    xw_ptr, ids_ptr, rw_ptr, w_ptr, w_desc, s_ptr, g_ptr, act_ptr,
    P, I: tl.constexpr, D: tl.constexpr,
    TOPK: tl.constexpr, PB: tl.constexpr, G: tl.constexpr, IS_NV: tl.constexpr, LIMIT: tl.constexpr,
    NPASS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    TMA: tl.constexpr, USE_ASM: tl.constexpr, FOLD: tl.constexpr, PROBE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    wait(PDL)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, tl.program_id(0), P, PB)
    if earlier == 0:
        _gate_up_tile(xw_ptr, rw_ptr, w_ptr, w_desc, s_ptr, g_ptr, act_ptr, e, offs, match, rank, count, pid_n, I, D,
                      TOPK, G, IS_NV, LIMIT, NPASS, BLOCK_N, BLOCK_K, STAGES, TMA, USE_ASM, FOLD, PROBE)


@triton.jit
def _down_stream_kernel(
    aw_ptr, ids_ptr, w_ptr, w_desc, s_ptr, g_ptr, y_ptr, out_ptr, tk_ptr,
    P, I: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr,
    PB: tl.constexpr, G: tl.constexpr, IS_NV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    TMA: tl.constexpr, USE_ASM: tl.constexpr, FOLD: tl.constexpr, PROBE: tl.constexpr = False,
    TICKET: tl.constexpr = False, PDL: tl.constexpr = False,
):
    wait(PDL)
    pid_n = tl.program_id(1)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, tl.program_id(0), P, PB)
    if earlier == 0:
        _down_tile(aw_ptr, w_ptr, w_desc, s_ptr, g_ptr, y_ptr, out_ptr, tk_ptr, e, offs, match, rank, count, pid_n,
                   I, D, TOPK, G, IS_NV, BLOCK_N, BLOCK_K, STAGES, TMA, USE_ASM, FOLD, PROBE, TICKET, False)


# The poll of ``_wait_count``: 256 ns of sleep, then an acquire load of the count (0, 64 and 1000 ns measured the
# same, BENCHMARKS.md: the waiting programs are not what the fused kernel loses time to).
SPIN_ASM = tl.constexpr("nanosleep.u32 256; ld.acquire.gpu.global.b32 $0, [$1];")


@triton.jit
def _wait_count(ptr, target, USE_ASM: tl.constexpr):
    """Block until ``*ptr >= target`` (a count other programs raise with release atomics).  Every thread polls
    with a plain acquire load, not a read-modify-write on the hot line, and sleeps between polls (``SPIN_ASM``)
    so that the waiting warps leave the SM's issue slots to the programs they wait for."""
    if USE_ASM:
        a = ptr.to(tl.int64, bitcast=True)
        c = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [a], dtype=tl.int32,
                                      is_pure=False, pack=1)
        while c < target:
            c = tl.inline_asm_elementwise(SPIN_ASM, "=r,l", [a], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
    else:
        while tl.atomic_add(ptr, 0, sem="acquire", scope="gpu") < target:
            pass


@triton.jit
def _fused_stream_kernel(
    xw_ptr, ids_ptr, rw_ptr, w13_ptr, w13_desc, s13_ptr, g13_ptr, act_ptr, aw_ptr,
    w2_ptr, w2_desc, s2_ptr, g2_ptr, y_ptr, out_ptr, tk_ptr, q_ptr,
    P, I: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr, PB: tl.constexpr, G: tl.constexpr,
    IS_NV: tl.constexpr, LIMIT: tl.constexpr, NPASS: tl.constexpr,
    GU_N: tl.constexpr, GU_K: tl.constexpr, GU_STAGES: tl.constexpr,
    DN_N: tl.constexpr, DN_K: tl.constexpr, DN_STAGES: tl.constexpr,
    TMA: tl.constexpr, USE_ASM: tl.constexpr, FOLD: tl.constexpr, PROBE: tl.constexpr = False,
    TICKET: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Gate/up and down in one launch, one tile per program: P * I / GU_N gate/up tiles, then P * D / DN_N
    down tiles (pair-major).  A program takes the next tile from a work counter (``q[0]``), not from its
    program id, so every down tile is taken only after every gate/up tile has been taken by a running
    program: a down tile's wait for its expert's gate/up tiles (``q[2 + pair]``, one count per finished
    tile) always ends, whatever order or residency the hardware gives the programs.  The last program to
    finish (``q[1]``) resets the counters for the next call or graph replay.  Why: the down tiles of the
    first experts run while the last experts' gate/up tiles still stream (no drain and ramp between two
    grids)."""
    wait(PDL)
    NGU: tl.constexpr = I // GU_N
    NDN: tl.constexpr = D // DN_N
    ngu = P * NGU
    tile = tl.atomic_add(q_ptr, 1, sem="relaxed", scope="gpu")
    gu_tile = tile < ngu
    t = tl.where(gu_tile, tile, tile - ngu)
    pid_p = tl.where(gu_tile, t // NGU, t // NDN)
    pid_n = tl.where(gu_tile, t % NGU, t % NDN)
    e, offs, match, rank, count, earlier = _expert_rows(ids_ptr, pid_p, P, PB)
    if earlier == 0:
        done = q_ptr + 2 + pid_p
        if gu_tile:
            _gate_up_tile(xw_ptr, rw_ptr, w13_ptr, w13_desc, s13_ptr, g13_ptr, act_ptr, e, offs, match, rank, count,
                          pid_n, I, D, TOPK, G, IS_NV, LIMIT, NPASS, GU_N, GU_K, GU_STAGES, TMA, USE_ASM, FOLD,
                          PROBE)
            tl.debug_barrier()  # every thread's act stores precede the count, which releases them at gpu scope
            tl.atomic_add(done, 1, sem="release", scope="gpu")
        else:
            _wait_count(done, NGU, USE_ASM)
            _down_tile(aw_ptr, w2_ptr, w2_desc, s2_ptr, g2_ptr, y_ptr, out_ptr, tk_ptr, e, offs, match, rank, count,
                       pid_n, I, D, TOPK, G, IS_NV, DN_N, DN_K, DN_STAGES, TMA, USE_ASM, FOLD, PROBE, TICKET, True)
    tl.debug_barrier()
    if tl.atomic_add(q_ptr + 1, 1, sem="acq_rel", scope="gpu") == ngu + P * NDN - 1:  # the last: reset
        pc = tl.arange(0, PB)
        tl.store(q_ptr + 2 + pc, 0, mask=pc < P)
        tl.store(q_ptr + tl.arange(0, 2), 0)


def stream_supports(hidden: int, intermediate: int, cfg: dict | None = None) -> bool:
    """Whether the blocks tile these sizes (V4-Flash and V4-Pro with the default config)."""
    cfg = stream_config(cfg)
    gu, dn = cfg["gate_up"], cfg["down"]
    return (hidden % gu["BLOCK_K"] == 0 and intermediate % gu["BLOCK_N"] == 0
            and intermediate % dn["BLOCK_K"] == 0 and hidden % dn["BLOCK_N"] == 0)


def _descriptor(words: torch.Tensor, block_n: int, hw: int):
    """Host-side TMA descriptor of a ``[rows, words]`` int32 matrix, tiles ``[block_n, hw]``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(words, list(words.shape), [words.shape[1], 1], [block_n, hw])


def launch_stream(x, ids, rw, w13, w13_scale, w13_global, w2, w2_scale, w2_global, act, y, *, k, group_size,
                  is_nv, limit, use_asm, fold, cfg, only=None, out=None, tickets=None):
    """Gate/up and down streamed GEMV kernels into ``act`` and ``y``; with ``out`` and ``tickets``
    (``moe_pairs.sum_tickets``) the down kernel also sums each token's rows into ``out``, else the
    sum kernel is the caller's.  With ``cfg["fused"]`` (and ``only`` None) both run as one launch,
    ``_fused_stream_kernel`` (two launches while a CUDA graph is captured before any eager call allocated its
    counters)."""
    p = ids.numel()
    t, d = x.shape
    inter = act.shape[1]
    cfg = stream_config(cfg)
    gu, dn = cfg["gate_up"], cfg["down"]
    for c in (gu, dn):
        bk, bn = c["BLOCK_K"], c["BLOCK_N"]
        if bk % group_size or bk < 64 or bk & (bk - 1) or bn & (bn - 1) or c["STAGES"] < 1 or \
                (c.get("maxnreg") is not None and not 24 <= c["maxnreg"] <= 255):
            raise ValueError(f"stream config {c}: BLOCK_K a power of two >= 64 and a multiple of {group_size}, "
                             "BLOCK_N a power of two, STAGES >= 1, maxnreg None or 24..255.")
    if cfg["fused_maxnreg"] is not None and not 24 <= cfg["fused_maxnreg"] <= 255:
        raise ValueError(f"stream config: fused_maxnreg None or 24..255, got {cfg['fused_maxnreg']}.")
    if cfg["fused"] and gu["num_warps"] != dn["num_warps"]:
        raise ValueError(f"fused stream kernel: gate_up and down need the same num_warps, got {gu['num_warps']} "
                         f"and {dn['num_warps']}.")
    if not stream_supports(d, inter, cfg):
        raise ValueError(f"D={d} / I={inter} must be multiples of the stream blocks {gu} / {dn}.")
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    tma = bool(cfg["tma"]) and not interp
    if x.data_ptr() % 16:  # the activations are read as 16-byte vectors
        x = x.clone()
    w13w = w13.view(torch.int32).view(-1, d // 8)
    w2w = w2.view(torch.int32).view(-1, inter // 8)
    pb = max(16, triton.next_power_of_2(p))
    common = dict(PB=pb, G=group_size, IS_NV=is_nv, TMA=tma, USE_ASM=bool(use_asm) and not interp,
                  FOLD=fold, PROBE=bool(cfg.get("probe", False)), **launch_args(x.device))

    def regs(c):  # the interpreter takes no register cap
        return {"maxnreg": int(c["maxnreg"])} if c.get("maxnreg") and not interp else {}

    ticket = out is not None and tickets is not None
    queue = None
    if cfg["fused"] and only is None:
        queue = persistent_zeros("fp4_moe_stream_queue", x.device, 2 + pb, torch.int32)  # None: captured first
    if queue is not None:
        d13 = _descriptor(w13w, gu["BLOCK_N"], gu["BLOCK_K"] // 8) if tma else None
        d2 = _descriptor(w2w, dn["BLOCK_N"], dn["BLOCK_K"] // 8) if tma else None
        fr = cfg["fused_maxnreg"]
        _fused_stream_kernel[(p * (inter // gu["BLOCK_N"] + d // dn["BLOCK_N"]),)](
            x.view(torch.int32), ids, rw, w13w, d13, w13_scale.view(torch.uint8), w13_global.float().contiguous(), act,
            act.view(torch.int32), w2w, d2, w2_scale.view(torch.uint8), w2_global.float().contiguous(), y,
            out if ticket else y, tickets if ticket else ids, queue,
            p, inter, d, TOPK=k, LIMIT=float(limit), NPASS=p, GU_N=gu["BLOCK_N"], GU_K=gu["BLOCK_K"],
            GU_STAGES=gu["STAGES"], DN_N=dn["BLOCK_N"], DN_K=dn["BLOCK_K"], DN_STAGES=dn["STAGES"], TICKET=ticket,
            num_warps=gu["num_warps"], **regs({"maxnreg": fr}), **common,
        )
        return
    if only in (None, "gate_up"):
        desc = _descriptor(w13w, gu["BLOCK_N"], gu["BLOCK_K"] // 8) if tma else None
        _gate_up_stream_kernel[(p, inter // gu["BLOCK_N"])](
            x.view(torch.int32), ids, rw, w13w, desc, w13_scale.view(torch.uint8), w13_global.float().contiguous(), act,
            p, inter, d, TOPK=k, LIMIT=float(limit), NPASS=p, BLOCK_N=gu["BLOCK_N"], BLOCK_K=gu["BLOCK_K"],
            STAGES=gu["STAGES"],
            num_warps=gu["num_warps"], **regs(gu), **common,
        )
    if only in (None, "down"):
        desc = _descriptor(w2w, dn["BLOCK_N"], dn["BLOCK_K"] // 8) if tma else None
        _down_stream_kernel[(p, d // dn["BLOCK_N"])](
            act.view(torch.int32), ids, w2w, desc, w2_scale.view(torch.uint8), w2_global.float().contiguous(), y,
            out if ticket else y, tickets if ticket else ids,
            p, inter, d, TOPK=k, BLOCK_N=dn["BLOCK_N"], BLOCK_K=dn["BLOCK_K"], STAGES=dn["STAGES"],
            num_warps=dn["num_warps"], TICKET=ticket, **regs(dn), **common,
        )
