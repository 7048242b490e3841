"""CUDA registration of ``dsv4_mtp::fp4_moe``: one kernel family per regime, and the tl.dot kernels.

Kernel families (all exact e2m1 decode in registers, fp32 accumulation, fixed grids that depend only
on T: CUDA-graph safe, no host sync; leader program per expert, ``moe_pairs``):

* ``stream`` (``fp4_moe_stream``): streamed FMA GEMV, a shared-memory ring of async copies;
* ``hmma`` (``fp4_moe_hmma``): fp16 ``mma.sync`` with fp32 block scales, staged loop;
* ``dot`` (here): ``_gate_up_kernel`` / ``_down_kernel``, bf16 ``tl.dot``.  Grid ``(P = T k, tiles)``;
  the leader gathers every pair of its expert (in-register rank over the P ids), decodes FP4 to exact
  bf16 (e2m1 x block scale has at most 6 significant bits), runs gate and up as bf16 MMAs with fp32
  accumulation, and writes ``silu(min(g, L)) * clamp(u, -L, L) * r`` as bf16 to ``act [P, I]``; the
  down kernel writes fp32 ``y [P, D]``; ``_sum_kernel`` sums each token's k rows in a fixed order.
  The even and odd K elements of a packed byte row (low / high nibbles) feed two MMAs against the
  even / odd activation columns, so no nibble interleave is needed.

``kernel_for`` picks the family from ``ROUTES`` (format, T); the stream and hmma down kernels sum the
token rows themselves (``moe_pairs._ticket_sum``; ``_sum_kernel`` only while a CUDA graph is captured
before any eager call allocated the tickets).  Inputs beyond ``MAX_KERNEL_TOKENS`` rows (prefills) run in
blocks of that many rows; for sizes the kernels do not tile (``kernel_supports``: multiples of 256) the op
runs the reference math, by design.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import fp4
from ..fp4_moe import check_fp4_moe_inputs, fp4_moe, fp4_moe_reference, register_kernel_sizes
from .decode_ptx import DECODE_ASM, DECODE_ASM_RAW
from .fp4_moe_hmma import act_prescale, hmma_supports, launch_hmma
from .fp4_moe_stream import launch_stream, stream_supports
from .moe_pairs import TWO63, _block_scale, _expert_rows, flat_ids, launch_sum, sum_tickets
from . import pdl
from .pdl import wait

_DECODE_ASM = tl.constexpr(DECODE_ASM)
_DECODE_ASM_RAW = tl.constexpr(DECODE_ASM_RAW)

MAX_KERNEL_TOKENS = 64

# (first T, last T, family) per format.  Measured on the H200 (same runs, routings rotated so every call
# reads its experts from HBM): stream wins while the MoE is latency-bound (NVFP4 T=2 71.5 vs hmma 79 us),
# hmma from T=3 NVFP4 / T=2 MXFP4; past T=16 NVFP4 tl.dot (T=32 754 vs 793 us, T=64 1223 vs 1388), MXFP4
# hmma (T=32 662 vs 824, T=64 1174 vs 1295).  hmma needs a finite swiglu_limit; without one: dot.
ROUTES = {
    "nvfp4": ((1, 2, "stream"), (3, 16, "hmma"), (17, MAX_KERNEL_TOKENS, "dot")),
    "mxfp4": ((1, 1, "stream"), (2, MAX_KERNEL_TOKENS, "hmma")),
}


def kernel_for(fmt: str, tokens: int, swiglu_limit: float, hidden: int = 4096, intermediate: int = 2048) -> str:
    """The family ``fp4_moe`` runs for ``tokens`` rows (per block of ``MAX_KERNEL_TOKENS``): "stream", "hmma"
    or "dot".  Sizes the stream or hmma kernels do not tile (small test models) take the tl.dot kernels, as
    does hmma without a finite ``swiglu_limit`` (its fp16 activations need the bound)."""
    tokens = min(tokens, MAX_KERNEL_TOKENS)  # longer inputs run in blocks of MAX_KERNEL_TOKENS rows
    family = next((fam for lo, hi, fam in ROUTES[fmt] if lo <= tokens <= hi), "dot")
    if family == "stream" and not stream_supports(hidden, intermediate):
        return "dot"
    if family == "hmma" and (act_prescale(swiglu_limit) is None or not hmma_supports(hidden, intermediate, fmt)):
        return "dot"
    return family


@triton.jit
def _decode_nibbles(packed, IS_NV: tl.constexpr):
    """uint8 [R, C] -> (low-nibble values, high-nibble values), bf16 [R, C]: exact e2m1, times 2**-126
    for NVFP4 (its scales fold the 2**126 back)."""
    if IS_NV:
        return tl.inline_asm_elementwise(
            _DECODE_ASM_RAW, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )
    else:
        return tl.inline_asm_elementwise(
            _DECODE_ASM, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )


@triton.jit
def _scaled(vals, s, BLOCK_N: tl.constexpr, HALF_K: tl.constexpr, HALF_G: tl.constexpr):
    """vals bf16 [BLOCK_N, HALF_K] (one nibble lane) x scales fp32 [BLOCK_N, HALF_K // HALF_G] -> bf16,
    exact (e2m1 x (e4m3 or 2**k) has at most 6 significant bits)."""
    v = tl.reshape(vals, (BLOCK_N, HALF_K // HALF_G, HALF_G))
    return tl.reshape(v * s.to(tl.bfloat16)[:, :, None], (BLOCK_N, HALF_K))


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
    PDL: tl.constexpr = False,
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
        gg = tl.load(g_ptr + 2 * e) * (TWO63 if IS_NV else 1.0)
        gu = tl.load(g_ptr + 2 * e + 1) * (TWO63 if IS_NV else 1.0)
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
                gl, gh = _decode_nibbles(pg, IS_NV)
                ul, uh = _decode_nibbles(pu, IS_NV)
                xv = tl.load(x_rows[:, None] + (kk * BLOCK_K + kx)[None, :], mask=r_ok[:, None], other=0.0)
                xe, xo = tl.split(tl.reshape(xv, (BLOCK_M, HK, 2)))
                xe, xo = xe.to(tl.bfloat16), xo.to(tl.bfloat16)  # x may be fp32 (fp32 models); act is bf16
                scol = kk * (HK // HG) + ks
                sg = _block_scale(tl.load(sg_rows[:, None] + scol[None, :]), IS_NV)
                su = _block_scale(tl.load(su_rows[:, None] + scol[None, :]), IS_NV)
                gl = _scaled(gl, sg, BLOCK_N, HK, HG)
                gh = _scaled(gh, sg, BLOCK_N, HK, HG)
                ul = _scaled(ul, su, BLOCK_N, HK, HG)
                uh = _scaled(uh, su, BLOCK_N, HK, HG)
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
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
        gw = tl.load(g_ptr + e) * (TWO63 if IS_NV else 1.0)
        for ci in range(NCHUNK):
          c0 = ci * BLOCK_M
          if c0 < count:
            pair, r_ok = _rows_of_chunk(offs, match, rank, count, c0, BLOCK_M)
            a_rows = a_ptr + pair.to(tl.int64) * I
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(0, I // BLOCK_K):
                pw = tl.load(w_rows[:, None] + (kk * HK + kb)[None, :])
                wl, wh = _decode_nibbles(pw, IS_NV)
                av = tl.load(a_rows[:, None] + (kk * BLOCK_K + kx)[None, :], mask=r_ok[:, None], other=0.0)
                ae, ao = tl.split(tl.reshape(av, (BLOCK_M, HK, 2)))
                sw = _block_scale(tl.load(s_rows[:, None] + (kk * (HK // HG) + ks)[None, :]), IS_NV)
                wl = _scaled(wl, sw, BLOCK_N, HK, HG)
                wh = _scaled(wh, sw, BLOCK_N, HK, HG)
                acc = tl.dot(ae, tl.trans(wl), acc)
                acc = tl.dot(ao, tl.trans(wh), acc)
            dst = y_ptr + pair.to(tl.int64)[:, None] * D + n[None, :]
            tl.store(dst, acc * gw, mask=r_ok[:, None] & n_ok[None, :])


# tl.dot launch configuration (BLOCK_N, BLOCK_K, num_warps, num_stages) per kernel: "small" up to
# ``small_max_pairs`` pairs (narrower gate/up programs at T=1), "large" 128-row tiles (the activation
# operand amortised over more weight rows), "tall" once the MMA row block reaches ``tall_min_block_m``
# (a 64 x 128 tile does not fit in shared memory, 32 x 128 spills registers).
DOT_CONFIG = {
    "small": dict(gate_up=dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3),
                  down=dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3)),
    "large": dict(gate_up=dict(BLOCK_N=128, BLOCK_K=256, num_warps=4, num_stages=3),
                  down=dict(BLOCK_N=128, BLOCK_K=256, num_warps=4, num_stages=3)),
    "tall": dict(gate_up=dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),
                 down=dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3)),
    "small_max_pairs": 8,
    "tall_min_block_m": 32,
}
_DOT_REGIMES = ("small", "large", "tall")


def _block_m(pairs: int, experts: int) -> int:
    """Rows per MMA tile: sized to the expected tokens per expert (not to T); more rows loop."""
    return min(64, max(16, triton.next_power_of_2(triton.cdiv(pairs, experts))))


def _dot_supports(hidden: int, intermediate: int) -> bool:
    return all(
        hidden % c["gate_up"]["BLOCK_K"] == 0 and intermediate % c["down"]["BLOCK_K"] == 0
        and intermediate % c["gate_up"]["BLOCK_N"] == 0 and hidden % c["down"]["BLOCK_N"] == 0
        for c in (DOT_CONFIG[r] for r in _DOT_REGIMES)
    )


def kernel_supports(hidden: int, intermediate: int) -> bool:
    """Whether the CUDA kernels run these sizes (the tl.dot kernels, the widest fallback, tile multiples of
    256; V4-Flash and V4-Pro take every family)."""
    return _dot_supports(hidden, intermediate)


def _launch_dot(x, ids, rw, w13, w13_scale, w13_global, w2, w2_scale, w2_global, act, y, *, k, group_size, is_nv,
                limit, pdl_kw):
    p = ids.numel()
    d = x.shape[1]
    inter = act.shape[1]
    if not _dot_supports(d, inter):
        raise ValueError(f"fp4_moe (tl.dot kernels): D={d} / I={inter} are not multiples of the blocks "
                         f"{DOT_CONFIG}; use sizes that are multiples of 256 (or the reference).")
    bm = _block_m(p, w13.shape[0])
    regime = ("small" if p <= DOT_CONFIG["small_max_pairs"]
              else "tall" if bm >= DOT_CONFIG["tall_min_block_m"] else "large")
    gu, dn = DOT_CONFIG[regime]["gate_up"], DOT_CONFIG[regime]["down"]
    common = dict(PB=max(16, triton.next_power_of_2(p)), G=group_size, IS_NV=is_nv, BLOCK_M=bm,
                  NCHUNK=triton.cdiv(p, bm), **pdl_kw)  # an expert serves at most P pairs
    _gate_up_kernel[(p, triton.cdiv(inter, gu["BLOCK_N"]))](
        x, ids, rw, w13, w13_scale.view(torch.uint8), w13_global.float().contiguous(), act, p, inter, d,
        TOPK=k, LIMIT=float(limit), BLOCK_N=gu["BLOCK_N"], BLOCK_K=gu["BLOCK_K"],
        num_warps=gu["num_warps"], num_stages=gu["num_stages"], **common,
    )
    _down_kernel[(p, triton.cdiv(d, dn["BLOCK_N"]))](
        act, ids, w2, w2_scale.view(torch.uint8), w2_global.float().contiguous(), y, p, inter, d,
        BLOCK_N=dn["BLOCK_N"], BLOCK_K=dn["BLOCK_K"], num_warps=dn["num_warps"], num_stages=dn["num_stages"],
        **common,
    )


def fp4_moe_triton(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt,
                   swiglu_limit):
    """``fp4_moe`` on CUDA for T <= MAX_KERNEL_TOKENS rows: the family ``kernel_for`` picks."""
    check_fp4_moe_inputs(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt)
    for name, ten in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if not ten.is_contiguous():
            raise ValueError(f"fp4_moe (CUDA) needs contiguous expert tensors; {name} is not (call .contiguous() once at load).")
    f = fp4.get_format(fmt)
    t, d = x.shape
    k = topk_ids.shape[1]
    inter = w2.shape[-1] * 2
    p = t * k
    out = torch.empty_like(x)
    if p == 0:
        return out.zero_()
    if t > MAX_KERNEL_TOKENS:
        raise ValueError(f"fp4_moe (CUDA kernels): T={t} tokens exceeds MAX_KERNEL_TOKENS={MAX_KERNEL_TOKENS}; "
                         "the registered op runs longer inputs in blocks of that many rows.")
    family = kernel_for(f.name, t, swiglu_limit, d, inter)
    x_c = x.contiguous()
    ids = flat_ids(topk_ids)
    rw = topk_weights.to(torch.float32).contiguous().view(-1)
    y = torch.empty(p, d, dtype=torch.float32, device=x.device)
    is_nv = f.name == "nvfp4"
    pdl_kw = pdl.launch_args(x.device)
    tickets = None
    if family == "dot":
        act = torch.empty(p, inter, dtype=torch.bfloat16, device=x.device)
        _launch_dot(x_c, ids, rw, w13, w13_scale, w13_global, w2, w2_scale, w2_global, act, y, k=k,
                    group_size=f.group_size, is_nv=is_nv, limit=swiglu_limit, pdl_kw=pdl_kw)
    else:
        tickets = sum_tickets(x.device, t, d)  # at most one tile per row
        if family == "stream":
            act = torch.empty(p, inter, dtype=torch.bfloat16, device=x.device)
            launch_stream(x_c, ids, rw, w13, w13_scale, w13_global, w2, w2_scale, w2_global, act, y, out, tickets,
                          k=k, group_size=f.group_size, is_nv=is_nv, limit=swiglu_limit)
        else:
            launch_hmma(x_c, ids, rw, w13, w13_scale, w13_global, w2, w2_scale, w2_global, y, out, tickets, k=k,
                        fmt=f.name, limit=swiglu_limit)
    if tickets is None:
        launch_sum(y, out, k, pdl_kw)
    return out


register_kernel_sizes(kernel_supports)


@fp4_moe.register_kernel("cuda")
def _fp4_moe_cuda(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit):
    # Sizes the kernels do not tile (small test/demo models): the reference math.
    if not kernel_supports(x.shape[-1], w2.shape[-1] * 2):
        return fp4_moe_reference(
            x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit
        )
    args = (w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit)
    # Triton launches on the current device, not the tensors' (an MTP on cuda:1 beside a device_map target).
    with torch.cuda.device(x.device):
        t = x.shape[0]
        if t <= MAX_KERNEL_TOKENS:
            return fp4_moe_triton(x, topk_ids, topk_weights, *args)
        # Prefills: blocks of MAX_KERNEL_TOKENS rows (the kernels rank all T k pairs of a call in one block;
        # a token's result never depends on the others').  No host sync, graph-safe, ~1 ms per V4-Flash block.
        return torch.cat([fp4_moe_triton(x[a:a + MAX_KERNEL_TOKENS], topk_ids[a:a + MAX_KERNEL_TOKENS],
                                         topk_weights[a:a + MAX_KERNEL_TOKENS], *args)
                          for a in range(0, t, MAX_KERNEL_TOKENS)])
