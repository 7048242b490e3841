#!/usr/bin/env python3
"""Correctness + timing of ``dsv4_mtp::fp4_moe`` (Triton CUDA kernel) on V4 MoE shapes.

One command on the GPU (see BENCHMARKS.md, "FP4 MoE op (issue 5)")::

    PYTHONPATH=src python benchmarks/moe_op.py --out $OUT

For each format and T it draws fresh random packed weights / activations / routing,
checks the op (NaN-poisoned output, every element written) against a float64
dequantise-and-matmul reference of the same packed weights, then times (CUDA graph
replay, L2 flushed with a 256 MiB memset before every timed replay -- ``--flush cold``: the
memset, then a read of it (experimental, see ``ColdFlush``); ``--flush rotate``: no flush, one
graph of ``--rotations`` calls back to back, each with another random routing, so every call
reads its experts from HBM as in a draft step (the method of the 2026-12-01 tables) -- median of N):

* ours      -- the op as registered for CUDA (Triton, ``fp4_moe_triton.CONFIG``),
* variants  -- a few launch configurations of the same kernels (``--sweep``; ``mma*``
               time the opt-in mma.sync path of ``fp4_moe_mma``, ``hm*`` the fp16 mma.sync
               path of ``fp4_moe_hmma``),
* reference -- ``fp4_moe_reference`` (dequantise + torch matmul per expert, eager:
               it syncs to the host, so it cannot be graph-captured),
* humming   -- humming-kernels 0.1.19 indexed W4A16 MoE (NVFP4 only), driven the
               way vLLM drives it: align on device, w13 GEMM, fused clamped SwiGLU,
               w2 GEMM, weighted sum.
* read probe -- ``--read-probe``: a kernel that only reads the chosen experts' bytes (two
               launches, like the op), under both flushes: what the bytes alone cost.

The floor is the bytes that must be read (unique experts x packed weights + scales +
globals, plus activations in and out) over the device-to-device copy bandwidth
measured in the same run; ``%copy`` = floor / time = achieved fraction of it.  Under
``--flush rotate`` "uniq" is the mean over the rotated routings (what the timed calls read);
until 2026-12-02 (thirteenth session) it was the first routing's alone, which at T=16 moved
``%copy`` by several points from run to run (76-87 unique experts of 96 pairs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from unittest import mock

import torch

from dsv4_mtp_hf import fp4
from dsv4_mtp_hf.ops import fp4_moe, fp4_moe_reference

LIMIT = 10.0


def log(*a, file=None):
    msg = " ".join(str(x) for x in a)
    print(msg, flush=True)
    if file is not None:
        file.write(msg + "\n")
        file.flush()


# ----------------------------------------------------------------------------- data
def random_experts(E, D, I, fmt, dev, gen, same_w13_global=False):
    """Random packed codes and scale bytes (never zeros), sized so the clamp is active
    for a few per cent of gate/up values."""
    f = fp4.get_format(fmt)
    w13 = torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, device=dev, generator=gen)
    w2 = torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, device=dev, generator=gen)
    if fmt == "nvfp4":
        def sc(shape):
            return (torch.rand(shape, device=dev, generator=gen) * 7 + 1).to(torch.float8_e4m3fn).view(torch.uint8)
        s13, s2 = sc((E, 2 * I, D // f.group_size)), sc((E, D, I // f.group_size))
        g13 = (torch.rand(E, 2, device=dev, generator=gen) * 2e-3 + 3e-3)
        if same_w13_global:
            g13[:, 1] = g13[:, 0]
        g2 = torch.rand(E, device=dev, generator=gen) * 1e-3 + 1e-3
    else:
        s13 = torch.randint(120, 123, (E, 2 * I, D // f.group_size), dtype=torch.uint8, device=dev, generator=gen)
        s2 = torch.randint(117, 120, (E, D, I // f.group_size), dtype=torch.uint8, device=dev, generator=gen)
        g13 = torch.ones(E, 2, device=dev)
        g2 = torch.ones(E, device=dev)
    return w13, s13, g13.float(), w2, s2, g2.float()


def random_inputs(T, E, k, D, dev, gen):
    x = torch.randn(T, D, device=dev, generator=gen).to(torch.bfloat16)
    ids = torch.rand(T, E, device=dev, generator=gen).topk(k, dim=1).indices.to(torch.int32)
    w = torch.rand(T, k, device=dev, generator=gen) + 0.05
    w = (w / w.sum(1, keepdim=True) * 1.5).float()
    return x, ids, w


def reference_f64(x, ids, rw, W, fmt):
    """Float64 dequantise + matmul of exactly the packed weights (no rounding besides fp64)."""
    w13, s13, g13, w2, s2, g2 = W
    inter = w2.shape[-1] * 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    xd = x.double()
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        a13 = fp4.dequantize_fp4(w13[e], s13[e], fmt).double()
        a13[:inter] *= g13[e, 0].double()
        a13[inter:] *= g13[e, 1].double()
        gu = xd[tok] @ a13.t()
        g, u = gu[:, :inter].clamp(max=LIMIT), gu[:, inter:].clamp(-LIMIT, LIMIT)
        act = torch.nn.functional.silu(g) * u * rw[tok, slot].double().unsqueeze(-1)
        a2 = fp4.dequantize_fp4(w2[e], s2[e], fmt).double() * g2[e].double()
        out.index_add_(0, tok, act @ a2.t())
    return out


def expert_bytes(W):
    w13, s13, g13, w2, s2, g2 = W
    return w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel() + 4 * 3


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


# ----------------------------------------------------------------------------- timing
def capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fn()
    torch.cuda.synchronize()
    return g


def bench(fn, iters, warmup, flush):
    """Median µs per call over `iters` (CUDA events), L2 flushed before each call (``flush``
    None: no flush, for the rotated graphs of ``--flush rotate``)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    st = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if flush is not None:
            flush.zero_()
        st[i].record()
        fn()
        en[i].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in zip(st, en))


def copy_bandwidth():
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(ts)


# ----------------------------------------------------------------------------- read probe
def read_probe_runner(W, ids, chunk_words: int):
    """A kernel that only reads what the op must read at these ids -- each chosen expert's
    packed w1/w3 and its scales, then (second launch, like the op's down kernel) w2 and its
    scales -- in contiguous chunks of ``chunk_words`` int32 words per program, xor-ing them
    so the loads stay.  Its time is what the bytes cost in two short launches without any
    FP4 math (under the write flush; see ``ColdFlush`` for why the other flush is not used)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read_kernel(ids_ptr, w_ptr, s_ptr, out_ptr, W_WORDS: tl.constexpr, S_WORDS: tl.constexpr,
                     CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        c = tl.program_id(1)
        e = tl.load(ids_ptr + i).to(tl.int64)
        NCW: tl.constexpr = W_WORDS // CHUNK
        if c < NCW:
            base = w_ptr + e * W_WORDS + c * CHUNK
        else:
            base = s_ptr + e * S_WORDS + (c - NCW) * CHUNK
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for k in range(0, CHUNK, BLOCK):
            acc ^= tl.load(base + k + tl.arange(0, BLOCK))
        tl.store(out_ptr + i * tl.num_programs(1) + c, tl.xor_sum(acc, axis=0))

    w13, s13, _, w2, s2, _ = W
    uniq = torch.unique(ids).to(torch.int32)
    mats = [(w13.view(torch.int32), s13.view(torch.int32)), (w2.view(torch.int32), s2.view(torch.int32))]
    block = min(chunk_words, 4096)
    outs = [torch.empty(uniq.numel() * (w[0].numel() + s[0].numel()) // chunk_words, dtype=torch.int32, device=ids.device)
            for w, s in mats]

    def run():
        for (w, s), out in zip(mats, outs):
            ww, sw = w[0].numel(), s[0].numel()
            _read_kernel[(uniq.numel(), (ww + sw) // chunk_words)](uniq, w, s, out, ww, sw, chunk_words, block, num_warps=4)
        return outs

    return run


# ----------------------------------------------------------------------------- humming
class Humming:
    """humming-kernels indexed W4A16 MoE on ModelOpt-NVFP4 weights (one global per matrix)."""

    def __init__(self, W, E, D, I, topk, Ts, dev):
        from humming.ops.utils import init_humming_launcher
        from humming.schema import BaseWeightSchema
        from humming.transform import prepare_fp16_e8m0_scale, prepare_layer_config, transform_humming_tensors
        from humming.tune import get_heuristics_config

        w13, s13, g13, w2, s2, g2 = W
        self.E, self.D, self.I, self.k, self.dev = E, D, I, topk, dev
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        schema = BaseWeightSchema.from_config({"quant_method": "modelopt", "quant_algo": "NVFP4"})
        self.cfg, self.t, self.lists = {}, {}, {}
        mats = {
            "w13": (w13, s13.view(torch.float8_e4m3fn), g13[:, 0].contiguous(), 2 * I, D, [I, I]),
            "w2": (w2, s2.view(torch.float8_e4m3fn), g2.contiguous(), D, I, [D]),
        }
        for name, (p, s, g, n, kk, stacks) in mats.items():
            hs, tens = schema.convert_humming(
                tensors={"weight": p, "weight_scale": s, "weight_scale_2": g}, shape_n_stacks=stacks,
                shape_k_stacks=[kk], param_dtype=torch.bfloat16, num_experts=E, device=dev)
            cfg = prepare_layer_config(
                shape_n=n, shape_k=kk, weight_schema=hs, input_schema=None, num_experts=E,
                pad_n_to_multiple=256, pad_k_to_multiple=128, torch_dtype=torch.bfloat16, device=dev, tensors=tens)
            cfg, tens = prepare_fp16_e8m0_scale(cfg, tens)
            self.cfg[name], self.t[name] = cfg, transform_humming_tensors(cfg, tens)
            del tens
            # vLLM-style interval list of heuristic tunings over valid_shape_m = T*k
            lst, lo = [], 0
            for vm in sorted({t * topk for t in Ts}):
                c = json.loads(json.dumps(get_heuristics_config(cfg, shape_m=vm, gemm_type="indexed", device=idx)))
                if lst and lst[-1][2] == c:
                    lst[-1][1] = vm
                else:
                    lst.append([lo, vm, c])
                lo = vm
            lst[-1][1] = 1 << 30
            self.lists[name] = json.dumps(lst)
        self.bm = {n: json.loads(self.lists[n]) for n in self.cfg}
        self.compute = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"})
        self.locks = {n: torch.zeros(1 << 16, dtype=torch.int32, device=dev) for n in self.cfg}
        init_humming_launcher()

    def block_m(self, name, vm):
        for lo, hi, c in self.bm[name]:
            if lo < vm <= hi or (lo == 0 and vm <= hi):
                return c["block_shape"][0]
        return self.bm[name][-1][2]["block_shape"][0]

    def gemm(self, name, x, out, al, top_k, vm):
        from humming.forward import humming_forward

        t = self.t[name]
        humming_forward(
            self.cfg[name], inputs=x, weight=t["weight"], weight_scale=t["weight_scale"],
            weight_scale_2=t.get("weight_scale_2"), outputs=out, sorted_ids=al["sorted"],
            expert_ids=al["experts"], num_tokens_padded=al["ntp"], locks=self.locks[name],
            top_k=top_k, valid_shape_m=vm, compute_config=self.compute, tuning_config=self.lists[name])


def align_buffers(n, E, bm, dev):
    cap = (n + E * (bm - 1) + bm - 1) // bm * bm + 2 * bm
    return {
        "n": n, "E": E, "bm": bm,
        "sorted": torch.full((cap,), n, dtype=torch.int32, device=dev),
        "experts": torch.zeros(cap // bm, dtype=torch.int32, device=dev),
        "ntp": torch.zeros(1, dtype=torch.int32, device=dev),
        "starts": torch.arange(cap // bm, dtype=torch.int64, device=dev) * bm,
        "ar": torch.arange(n, dtype=torch.int64, device=dev),
        "ones": torch.ones(n, dtype=torch.int64, device=dev),
    }


def align(al, ids):
    """Device-only moe_align: flat pair ids grouped by expert, padded to bm per expert."""
    flat = ids.reshape(-1).long()
    bm = al["bm"]
    counts = torch.zeros(al["E"], dtype=torch.int64, device=flat.device).scatter_add_(0, flat, al["ones"])
    padded = (counts + bm - 1) // bm * bm
    pad_end = padded.cumsum(0)
    dest0 = pad_end - padded
    cstart = counts.cumsum(0) - counts
    order = torch.sort(flat, stable=True).indices
    se = flat[order]
    dest = dest0[se] + (al["ar"] - cstart[se])
    al["sorted"].fill_(al["n"])
    al["sorted"].scatter_(0, dest, order.to(torch.int32))
    al["experts"].copy_(torch.searchsorted(pad_end, al["starts"], right=True).clamp_(max=al["E"] - 1))
    al["ntp"].copy_(pad_end[-1:])


def humming_runner(hm, x, ids, rw):
    from humming import ops

    T, k, D, I = x.shape[0], ids.shape[1], hm.D, hm.I
    vm = T * k
    al1 = align_buffers(vm, hm.E, hm.block_m("w13", vm), x.device)
    bm2 = hm.block_m("w2", vm)
    al2 = al1 if bm2 == al1["bm"] else align_buffers(vm, hm.E, bm2, x.device)
    gate_up = torch.empty(vm, 2 * I, dtype=torch.bfloat16, device=x.device)
    act = torch.empty(vm, I, dtype=torch.bfloat16, device=x.device)
    down = torch.empty(vm, D, dtype=torch.bfloat16, device=x.device)
    out = torch.empty(T, D, dtype=torch.bfloat16, device=x.device)
    wts = rw.to(torch.bfloat16).view(T, 1, k).contiguous()
    impl = ("[](float a, float b) { const float g = fminf(a, 10.f); const float u = fmaxf(fminf(b, 10.f), -10.f); "
            "return g / (1.f + expf(-g)) * u; }(a, b)")

    def run():
        align(al1, ids)
        if al2 is not al1:
            align(al2, ids)
        hm.gemm("w13", x, gate_up, al1, k, vm)
        ops.process_input(gate_up, outputs=act, activation_type="binary_split", activation_impl=impl)
        hm.gemm("w2", act, down, al2, 1, vm)
        torch.bmm(wts, down.view(T, k, D), out=out.view(T, 1, D))
        return out

    return run


# ----------------------------------------------------------------------------- main
def _cfg(bn, bk, warps, stages, bn2=None, bk2=None, warps2=None, stages2=None):
    return dict(gate_up=dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages),
                down=dict(BLOCK_N=bn2 or bn, BLOCK_K=bk2 or bk, num_warps=warps2 or warps, num_stages=stages2 or stages))


def _gv(bn, bn2, bk=512, m=1, warps=4, pf=1):
    return dict(gemv_min_tokens=1, gemv_max_tokens=64, gemv=dict(gate_up=dict(BLOCK_N=bn, BLOCK_K=bk, M=m, PF=pf, num_warps=warps),
                                              down=dict(BLOCK_N=bn2, BLOCK_K=bk, M=m, PF=pf, num_warps=warps)))


SWEEP = {
    # timing breakdown of the default configuration: one kernel alone (result not checked)
    "only_gu": dict(only="gate_up"),
    "only_dn": dict(only="down"),
    # the default routing with the token sums in a separate kernel (before the thirteenth session), against the
    # down kernels' ticket sums (the default now)
    "sumk": dict(ticket_sum=False),
    # our kernels with PDL but without their early trigger (``ops/triton/pdl.py``'s ``trigger``; before the fourteenth
    # session): "_flags" are module attributes patched while the variant runs and is captured
    "notrig": {"_flags": {"dsv4_mtp_hf.ops.triton.pdl.trigger": False}},
    # the routed staged hmma kernels launched without PDL (before the thirteenth session)
    "hm_nopdl": dict(hmma={"nvfp4": dict(prefetch=0, maxnreg=96, gate_up=dict(nsub=2), down=dict(nsub=2), pdl=False),
                           "mxfp4": dict(prefetch=0, stages=2, maxnreg=72, gate_up=dict(nsub=4), down=dict(nsub=4),
                                         pdl=False)}),
    # the tl.dot kernels at every T (the default) and the opt-in mma.sync path, with its
    # breakdown, warps per program (gate_up, down), K split across warps and prefetch depth
    "dot": dict(mma_max_tokens=0, gemv_max_tokens=0, stream_max_tokens=0, hmma_max_tokens=0),  # the tl.dot kernels at every T (default until 2026-11-30)
    "pre8": dict(stream_max_tokens=4, hmma_max_tokens=0),  # the routing before the staged hmma loop (until 2026-12-01, eighth session)
    "pre9": dict(stream_max_tokens={"nvfp4": 4, "mxfp4": 3}, hmma_min_tokens={"nvfp4": 8, "mxfp4": 4},  # eighth session's
                 hmma={"nvfp4": dict(prefetch=0, gate_up=dict(nsub=2), down=dict(nsub=2)),  # (168 registers)
                       "mxfp4": dict(prefetch=0, gate_up=dict(nsub=4), down=dict(nsub=4))}),
    "pre10": dict(stream_max_tokens=3, hmma_min_tokens=4,  # the ninth session's (MXFP4 at 168 registers from T=4)
                  hmma={"nvfp4": dict(prefetch=0, maxnreg=96, gate_up=dict(nsub=2), down=dict(nsub=2)),
                        "mxfp4": dict(prefetch=0, gate_up=dict(nsub=4), down=dict(nsub=4))}),
    # the eleventh session's routing (the stream to T=3 NVFP4 / T=2 MXFP4, its down kernel without a register cap)
    "pre12": dict(stream_max_tokens={"nvfp4": 3, "mxfp4": 2}, hmma_min_tokens={"nvfp4": 4, "mxfp4": 3},
                  stream=dict(down=dict(maxnreg=None))),
    # the tenth session's first routing (MXFP4: 3 stages at 128 registers)
    "pre11": dict(hmma={"nvfp4": dict(prefetch=0, maxnreg=96, gate_up=dict(nsub=2), down=dict(nsub=2)),
                        "mxfp4": dict(prefetch=0, maxnreg=128, gate_up=dict(nsub=4), down=dict(nsub=4))}),
    "mma": dict(mma_max_tokens=64),
    "mma_gu": dict(mma_max_tokens=64, only="gate_up"),
    "mma_dn": dict(mma_max_tokens=64, only="down"),
    "mma_pf2": dict(mma_max_tokens=64, mma=dict(gate_up_warps=4, down_warps=4, prefetch=2)),
    "m2": dict(mma_max_tokens=64, mma=dict(gate_up_warps=2, down_warps=2)),
    "m8": dict(mma_max_tokens=64, mma=dict(gate_up_warps=8, down_warps=8)),
    "m4k2": dict(mma_max_tokens=64, mma=dict(gate_up_warps=4, gate_up_ksplit=2, down_warps=4, down_ksplit=2)),
    "m8k2": dict(mma_max_tokens=64, mma=dict(gate_up_warps=8, gate_up_ksplit=2, down_warps=8, down_ksplit=2)),
    "m8k4": dict(mma_max_tokens=64, mma=dict(gate_up_warps=8, gate_up_ksplit=4, down_warps=8, down_ksplit=4)),
    "nofold": dict(fold_scale=False),
    "gv_t2": dict(stream_max_tokens=0, gemv_min_tokens=2, gemv_max_tokens=2),  # the defaults before the streamed GEMV
    # T=1: more bytes in flight per program (deeper pipeline / wider K steps)
    "g32s4": _cfg(32, 256, 4, 4),
    "g32s5d512": _cfg(32, 256, 4, 5, 32, 512, 4, 3),
    "k512": _cfg(32, 512, 4, 3),
    "d512s4": _cfg(32, 256, 4, 4, 32, 512, 4, 4),
    "d64": _cfg(32, 256, 4, 3, 64, 256, 4, 3),
    "d64s4": _cfg(32, 256, 4, 4, 64, 256, 4, 4),
    "n64w8": _cfg(64, 256, 8, 3),
    "n128w8": _cfg(128, 256, 8, 3),
    "n256w8": _cfg(256, 256, 8, 3),
    "n32w4": _cfg(32, 256, 4, 3),
    "n64w4": _cfg(64, 256, 4, 3),
    "n32w2": _cfg(32, 256, 2, 3),
    "n64w2": _cfg(64, 256, 2, 3),
    "n128w4": _cfg(128, 256, 4, 3),
    "n64s4": _cfg(64, 256, 4, 4),
    "noasm": dict(use_asm=False),
    # FMA GEMV kernels (``fp4_moe_gemv``: CUDA cores, no shared memory) for gate/up and down;
    # gvB = gate/up BLOCK_N B (down: see _gv); m2 = two tokens of an expert per pass; pf2 = two
    # K steps loaded ahead (default one)
    "gv16": _gv(16, 32),
    "gv8": _gv(8, 16),
    "gv32": _gv(32, 32),
    "gv8w2": _gv(8, 16, warps=2),
    "gv16m2": _gv(16, 32, m=2),
    "gv8m2": _gv(8, 16, m=2),
    "gv16pf2": _gv(16, 32, pf=2),
    "gv8pf2": _gv(8, 16, pf=2),
    "gv32pf2": _gv(32, 32, pf=2),
    # untimed (device time ran out): one K step = the whole row (V4-Flash: 2 KB of w1/w3, 1 KB
    # of w2), so each row is read in one burst by the 4 warps (DRAM page locality)
    "gvrow": dict(gemv_min_tokens=1, gemv_max_tokens=64,
                  gemv=dict(gate_up=dict(BLOCK_N=4, BLOCK_K=4096, M=1, PF=1, num_warps=4),
                            down=dict(BLOCK_N=8, BLOCK_K=2048, M=1, PF=1, num_warps=4))),
    "gv16_gu": dict(_gv(16, 32), only="gate_up"),
    "gv16_dn": dict(_gv(16, 32), only="down"),
    "gv8_gu": dict(_gv(8, 16), only="gate_up"),
    "gv8_dn": dict(_gv(8, 16), only="down"),
    # fp16x2 HFMA2 GEMV kernels (``fp4_moe_hgemv``), gate/up (BLOCK_N, BLOCK_K, warps) / down (...):
    # hg32 = its default (32, 1024, 4) / (64, 512, 4); hg16 (16, 1024, 4) / (32, 512, 4); hg8 (8, 1024, 2) /
    # (16, 512, 2); hg64 (64, 512, 4) / (64, 512, 2); s = NVFP4 block scales in fp16; pf = next K step prefetched
    **{name: dict(hgemv_min_tokens=1, hgemv_max_tokens=64, hgemv=dict(
        gate_up=dict(BLOCK_N=g[0], BLOCK_K=g[1], num_warps=g[2]), down=dict(BLOCK_N=d[0], BLOCK_K=d[1], num_warps=d[2]),
        **extra), **({"only": only} if only else {}))
       for name, g, d, extra, only in (
           ("hg32", (32, 1024, 4), (64, 512, 4), {}, None), ("hg16", (16, 1024, 4), (32, 512, 4), {}, None),
           ("hg8", (8, 1024, 2), (16, 512, 2), {}, None), ("hg64", (64, 512, 4), (64, 512, 2), {}, None),
           ("hg32s", (32, 1024, 4), (64, 512, 4), dict(scale16=True), None),
           ("hg32pf", (32, 1024, 4), (64, 512, 4), dict(pf=True), None),
           ("hg32_gu", (32, 1024, 4), (64, 512, 4), {}, "gate_up"), ("hg32_dn", (32, 1024, 4), (64, 512, 4), {}, "down"),
           ("hg16_gu", (16, 1024, 4), (32, 512, 4), {}, "gate_up"), ("hg16_dn", (16, 1024, 4), (32, 512, 4), {}, "down"))},
    # FMA GEMV fed by a shared-memory ring of async copies (``fp4_moe_stream``; its STREAM_CONFIG):
    # st = the default (32 rows, 512-weight steps, 3 stages, 4 warps, cp.async); sN = N stages;
    # nB = B rows per program (both kernels); k256 = 256-weight steps; w8 = 8 warps; tma = bulk
    # tensor copies for the weight tiles; _gu / _dn one kernel
    **{name: dict(stream_min_tokens=1, stream_max_tokens=64, stream=scfg, **({"only": only} if only else {}))
       for name, scfg, only in (
           ("st", {}, None), ("st_gu", {}, "gate_up"), ("st_dn", {}, "down"),
           ("st_s2", dict(gate_up=dict(STAGES=2), down=dict(STAGES=2)), None),
           ("st_s4", dict(gate_up=dict(STAGES=4), down=dict(STAGES=4)), None),
           ("st_s6", dict(gate_up=dict(STAGES=6), down=dict(STAGES=4)), None),
           ("st_n16", dict(gate_up=dict(BLOCK_N=16), down=dict(BLOCK_N=16)), None),
           ("st_n16s4", dict(gate_up=dict(BLOCK_N=16, STAGES=4), down=dict(BLOCK_N=16, STAGES=4)), None),
           ("st_n64", dict(gate_up=dict(BLOCK_N=64, STAGES=2), down=dict(BLOCK_N=64, STAGES=2)), None),
           ("st_k256", dict(gate_up=dict(BLOCK_K=256, STAGES=4), down=dict(BLOCK_K=256, STAGES=4)), None),
           ("st_k1024", dict(gate_up=dict(BLOCK_K=1024, BLOCK_N=16), down=dict(BLOCK_K=1024, BLOCK_N=16, STAGES=2)), None),
           ("st_w8", dict(gate_up=dict(num_warps=8), down=dict(num_warps=8)), None),
           ("st_tma", dict(tma=True), None),
           ("st_tma_s4", dict(tma=True, gate_up=dict(STAGES=4), down=dict(STAGES=4)), None),
           ("st_tma_n16", dict(tma=True, gate_up=dict(BLOCK_N=16, STAGES=4), down=dict(BLOCK_N=16, STAGES=4)), None),
           ("st_tma_k256", dict(tma=True, gate_up=dict(BLOCK_K=256, STAGES=4), down=dict(BLOCK_K=256, STAGES=4)), None),
           ("st_w2", dict(gate_up=dict(BLOCK_N=16, num_warps=2), down=dict(BLOCK_N=16, num_warps=2)), None),
           ("st_w2s4", dict(gate_up=dict(BLOCK_N=16, num_warps=2, STAGES=4), down=dict(BLOCK_N=16, num_warps=2, STAGES=4)), None),
           ("st_dk256", dict(down=dict(BLOCK_K=256, STAGES=4)), None), ("st_gs4", dict(gate_up=dict(STAGES=4)), None),
           ("st_dn16", dict(down=dict(BLOCK_N=16)), None),
           ("st_dn64", dict(down=dict(BLOCK_N=64)), None),  # down in one wave at T=1 (384 programs, not 768)
           # drN = the down kernel capped at N registers (the default 80: one wave at T=1), dr0 = no cap (ptxas takes
           # 95: 5 programs per SM, so the 768 programs at T=1 take 1.16 waves)
           ("st_dr0", dict(down=dict(maxnreg=None)), None), ("st_dr72", dict(down=dict(maxnreg=72)), None),
           ("st_dr0_dn", dict(down=dict(maxnreg=None)), "down"),
           # probes: the same grid, loads and pipeline without the FP4 math (result garbage, unchecked)
           ("st_probe", dict(probe=True), None), ("st_tma_probe", dict(tma=True, probe=True), None),
           ("st_gu_probe", dict(probe=True), "gate_up"), ("st_dn_probe", dict(probe=True), "down"),
           # fu = both kernels as one launch (``_fused_stream_kernel``); rN = its register cap (ptxas alone takes
           # ~158: 3 programs per SM); dn64 / gu16 = down / gate_up tiles of 64 / 16 rows
           ("st_fu", dict(fused=True), None), ("st_fu_r128", dict(fused=True, fused_maxnreg=128), None),
           ("st_fu_r128_dn64", dict(fused=True, fused_maxnreg=128, down=dict(BLOCK_N=64)), None),
           ("st_fu_dn64", dict(fused=True, down=dict(BLOCK_N=64)), None),
           ("st_fu_r128_gu16", dict(fused=True, fused_maxnreg=128, gate_up=dict(BLOCK_N=16)), None),
           ("st_fu_r96", dict(fused=True, fused_maxnreg=96), None),
           ("st_fu_dn64_probe", dict(fused=True, probe=True, down=dict(BLOCK_N=64)), None),
           ("st_fu_probe", dict(fused=True, probe=True), None),
           ("st_fu_r128_probe", dict(fused=True, fused_maxnreg=128, probe=True), None))},
    # fp16 mma.sync kernels with fp32 block scales (``fp4_moe_hmma``; its HMMA_CONFIG): hm = the default
    # (4 warps, 2 chunks per lane and iteration, loop unrolled by two, maxnreg 168); _gu / _dn one kernel
    # (gate/up includes the small activation prologue); pf2 = weights two iterations ahead (3 rotating
    # buffers); n1 / n4 = 1 / 4 chunks per iteration (n4: maxnreg 232); r128 / rfree = register cap 128 /
    # none (ptxas then issues the prefetch loads late); w2 = 2 warps (2x the programs); w8k2 = 8 warps,
    # 2 per row (K split); na = weights loaded with .L1::no_allocate
    **{name: dict(hmma_min_tokens=1, hmma_max_tokens=64, hmma=hcfg, **({"only": only} if only else {}))
       for name, hcfg, only in (
           ("hm", {}, None), ("hm_gu", {}, "gate_up"), ("hm_dn", {}, "down"),
           ("hm_pf2", dict(prefetch=2), None),
           ("hm_n1", dict(gate_up=dict(nsub=1), down=dict(nsub=1)), None),
           ("hm_n4", dict(gate_up=dict(nsub=4), down=dict(nsub=4), maxnreg=232), None),
           ("hm_r128", dict(maxnreg=128), None), ("hm_rfree", dict(maxnreg=None), None),
           ("hm_w2", dict(gate_up=dict(num_warps=2), down=dict(num_warps=2)), None),
           ("hm_w8k2", dict(gate_up=dict(num_warps=8, ksplit=2), down=dict(num_warps=8, ksplit=2)), None),
           ("hm_na", dict(w_hint=".L1::no_allocate"), None),
           # staged K loop (prefetch 0): loads through the pipeliner's shared-memory ring, each lane slot a contiguous
           # quarter of the row; hm_st = nsub 4 (both formats), sN = N stages, n2 = nsub 2 (NVFP4 only)
           ("hm_st", dict(prefetch=0, gate_up=dict(nsub=4), down=dict(nsub=4)), None),
           ("hm_st2", dict(prefetch=0, stages=2, gate_up=dict(nsub=4), down=dict(nsub=4)), None),
           ("hm_st4", dict(prefetch=0, stages=4, gate_up=dict(nsub=4), down=dict(nsub=4)), None),
           ("hm_st_n2", dict(prefetch=0, gate_up=dict(nsub=2), down=dict(nsub=2)), None),
           ("hm_st_n2s4", dict(prefetch=0, stages=4, gate_up=dict(nsub=2), down=dict(nsub=2)), None),
           # sx = the B operands copied once per program, not once per warp ("share")
           ("hm_st_sx", dict(prefetch=0, share=True, gate_up=dict(nsub=4), down=dict(nsub=4)), None),
           ("hm_st4_sx", dict(prefetch=0, stages=4, share=True, gate_up=dict(nsub=4), down=dict(nsub=4)), None),
           ("hm_st_n2_sx", dict(prefetch=0, share=True, gate_up=dict(nsub=2), down=dict(nsub=2)), None),
           # rN = ptxas register cap N (the default 168 leaves 3 programs per SM: ncu, T=16, ninth session)
           *((f"hm_st{tag}_r{r}", dict(prefetch=0, maxnreg=r, gate_up=dict(nsub=ns), down=dict(nsub=ns), **extra), None)
             for r in (128, 96, 80) for tag, ns, extra in (("", 4, {}), ("_sx", 4, {"share": True}), ("_n2", 2, {}))),
           # st2_rN: 2 stages (one 28 KB buffer for MXFP4, 16 KB NVFP4 nsub 2, 22 KB MXFP4 with share: 7 / 13 / 9
           # programs per SM by shared memory) at register cap N (72 / 64 / 56 / 48: 7 / 8 / 9 / 10 programs by registers;
           # the sm_90 build spills nothing at 72 and only outside the K loop below it); _pr = probe (see below)
           *((f"hm_st2{tag}_r{r}{pt}", dict(prefetch=0, stages=2, maxnreg=r, gate_up=dict(nsub=ns), down=dict(nsub=ns),
                                            **extra, **({"probe": True} if pt else {})), None)
             for tag, ns, extra, regs in (("", 4, {}, (128, 96, 80, 72)), ("_n2", 2, {}, (80, 72, 64, 56, 48)),
                                          ("_sx", 4, {"share": True}, (72, 64, 56, 48)))
             for r in regs for pt in ("", "_pr")),
           # tf = "tiles_first" (the grid walks one expert's row tiles first); s4 = 4 stages
           ("hm_st_tf", dict(prefetch=0, tiles_first=True, gate_up=dict(nsub=4), down=dict(nsub=4)), None),
           ("hm_st_r128_tf", dict(prefetch=0, maxnreg=128, tiles_first=True, gate_up=dict(nsub=4), down=dict(nsub=4)), None),
           ("hm_st_n2_r96_tf", dict(prefetch=0, maxnreg=96, tiles_first=True, gate_up=dict(nsub=2), down=dict(nsub=2)), None),
           ("hm_st_n2_r96s4", dict(prefetch=0, maxnreg=96, stages=4, gate_up=dict(nsub=2), down=dict(nsub=2)), None),
           # _pr = probe: the same grid, loads and ring without the FP4 math (garbage result, unchecked): what the
           # staged loop's loads alone cost
           ("hm_st_pr", dict(prefetch=0, probe=True, gate_up=dict(nsub=4), down=dict(nsub=4)), None),
           ("hm_st_tf_pr", dict(prefetch=0, probe=True, tiles_first=True, gate_up=dict(nsub=4), down=dict(nsub=4)), None),
           ("hm_st_r128_pr", dict(prefetch=0, probe=True, maxnreg=128, gate_up=dict(nsub=4), down=dict(nsub=4)), None),
           ("hm_st_n2_r96_pr", dict(prefetch=0, probe=True, maxnreg=96, gate_up=dict(nsub=2), down=dict(nsub=2)), None),
           ("hm_st_n2_r96_tf_pr", dict(prefetch=0, probe=True, maxnreg=96, tiles_first=True, gate_up=dict(nsub=2),
                                       down=dict(nsub=2)), None),
           ("hm_st_w8k2", dict(prefetch=0, gate_up=dict(nsub=4, num_warps=8, ksplit=2), down=dict(nsub=4, num_warps=8, ksplit=2)), None),
           ("hm_st_w2", dict(prefetch=0, gate_up=dict(nsub=4, num_warps=2), down=dict(nsub=4, num_warps=2)), None),
           ("hm_st_gu", dict(prefetch=0, gate_up=dict(nsub=4), down=dict(nsub=4)), "gate_up"),
           ("hm_st_dn", dict(prefetch=0, gate_up=dict(nsub=4), down=dict(nsub=4)), "down"))},
}


def fmtv(v, spec="8.1f"):
    return format(v, spec) if isinstance(v, (int, float)) else f"{'-':>{spec.split('.')[0]}}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ts", default="1,2,4,8,16,64")
    ap.add_argument("--fmts", default="nvfp4,mxfp4")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", default="", help="comma list of SWEEP variants to time too (or 'all'); "
                    "name@1+16 times a variant only at those T")
    ap.add_argument("--sweep-fmts", default="nvfp4")
    ap.add_argument("--sweep-ts", default="", help="T values at which the variants are timed (default: all)")
    ap.add_argument("--no-humming", action="store_true")
    ap.add_argument("--ref-ts", default="1,16", help="T values at which the eager reference path is timed")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--flush", choices=("write", "cold", "rotate"), default="write",
                    help="L2 flush before each timed call: a 256 MiB write (the tables so far) or 'cold' "
                    "(the write, then a read of it; see ColdFlush's caution); 'rotate': no flush, one graph of "
                    "--rotations calls back to back, each with another random routing (so each call finds "
                    "its experts outside L2, as in a draft step), time per call")
    ap.add_argument("--rotations", type=int, default=16, help="calls per graph for --flush rotate")
    ap.add_argument("--read-probe", default="", help="comma list of chunk sizes (int32 words) for a kernel that "
                    "only reads the chosen experts' bytes, timed at each T next to the op (write and cold L2 flush)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    from dsv4_mtp_hf.ops.triton import fp4_moe_triton as tri

    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "moe_op_log.txt"), "a")
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = False
    E, D, I, K = args.experts, args.hidden, args.inter, args.topk
    Ts = [int(t) for t in args.ts.split(",")]
    ref_ts = {int(t) for t in args.ref_ts.split(",") if t}
    sweep_items = list(SWEEP) if args.sweep == "all" else [s for s in args.sweep.split(",") if s]
    sweep = [s.split("@")[0] for s in sweep_items]
    sweep_at = {s.split("@")[0]: {int(t) for t in s.split("@")[1].split("+")} for s in sweep_items if "@" in s}
    sweep_ts = {int(t) for t in args.sweep_ts.split(",") if t}
    log(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} | {torch.cuda.get_device_name()} | torch "
        f"{torch.__version__} | triton {__import__('triton').__version__} | E={E} D={D} I={I} top{K}", file=logf)
    bw = copy_bandwidth()
    log(f"device-to-device copy bandwidth (read+write): {bw / 1e12:.3f} TB/s", file=logf)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

    class ColdFlush:
        """The 256 MiB write, then a read of the same buffer, meant to leave no dirty lines for the
        timed kernel to write back.  Caution (BENCHMARKS.md, 2026-11-30): after it (and after a
        read-only flush) the read probe ran faster than HBM allows, so it does not give a cold,
        DRAM-bound timing either; the write flush stays the default."""
        words = flush.view(torch.int32)

        def zero_(self):
            flush.zero_()
            self.words.sum()

    cold_flush = ColdFlush()
    timing_flush = cold_flush if args.flush == "cold" else flush
    seed = int.from_bytes(os.urandom(4), "little")
    log(f"seed {seed}; default config {json.dumps(tri.CONFIG)}", file=logf)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    results = []
    for fmt in args.fmts.split(","):
        W = random_experts(E, D, I, fmt, dev, gen, same_w13_global=True)
        bpe = expert_bytes(W)
        hm = None
        if fmt == "nvfp4" and not args.no_humming:
            try:
                t0 = time.perf_counter()
                hm = Humming(W, E, D, I, K, Ts, dev)
                log(f"humming prepared in {time.perf_counter() - t0:.1f}s", file=logf)
            except Exception as err:  # noqa: BLE001
                log(f"humming unavailable: {type(err).__name__}: {' '.join(str(err).split())[:400]}", file=logf)
                hm = None
        for T in Ts:
            row = {"fmt": fmt, "T": T}
            x, ids, rw = random_inputs(T, E, K, D, dev, gen)
            ref = reference_f64(x, ids, rw, W, fmt)
            id_sets = [ids] + ([random_inputs(T, E, K, D, dev, gen)[1] for _ in range(max(1, args.rotations) - 1)]
                               if args.flush == "rotate" else [])
            # the floor of what is timed: under rotation the mean over the rotated routings (their unique experts
            # differ: 76-87 of the 96 pairs at T=16), not the first routing's (before 2026-12-02, thirteenth session)
            uniq = statistics.mean(int(torch.unique(i).numel()) for i in id_sets)
            row["uniq"] = uniq
            row["uniq_first"] = int(torch.unique(ids).numel())
            row["floor"] = (uniq * bpe + 2 * x.numel() * 2 + ids.numel() * 8) / bw * 1e6

            def timed(make):
                """Median µs per call of ``make(ids)()`` as a replayed graph: flushed before each
                replay (``--flush write/cold``), or ``--flush rotate``'s calls over ``id_sets``."""
                if args.flush == "rotate":
                    fns = [make(i) for i in id_sets]
                    gr = capture(lambda: [f() for f in fns])
                    return bench(gr.replay, args.iters, 3, None) / len(fns)
                return bench(capture(make(ids)).replay, args.iters, 5, timing_flush)
            # correctness of the registered op, NaN-poisoned static output
            out = torch.full_like(x, float("nan"))

            def make_ours(ids_):
                return lambda: out.copy_(fp4_moe(x, ids_, rw, *W, fmt, LIMIT))

            ours = make_ours(ids)

            try:
                ours()
                torch.cuda.synchronize()
                row["nan"] = int(torch.isnan(out).sum())
                row["err"] = rel_err(out, ref)
                out.fill_(float("nan"))
                g = capture(ours)
                out.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                row["graph_err"] = rel_err(out, ref) if not torch.isnan(out).any() else float("nan")
                del g
                row["ours"] = timed(make_ours)
            except Exception as err:  # noqa: BLE001
                log(f"[{fmt} T={T}] ours FAILED: {type(err).__name__}: {' '.join(str(err).split())[:600]}", file=logf)
                traceback.print_exc(file=logf)
            sweep_here = fmt in args.sweep_fmts.split(",") and (not args.sweep_ts or T in sweep_ts)
            for name in (sweep if sweep_here else []):
                if name in sweep_at and T not in sweep_at[name]:
                    continue
                try:
                    o2 = torch.full_like(x, float("nan"))
                    cfgv = {kk: vv for kk, vv in SWEEP[name].items() if kk != "_flags"}
                    if "hmma" in cfgv:  # an unsupported hmma config would time the op's other path under its name
                        from dsv4_mtp_hf.ops.triton.fp4_moe_hmma import hmma_supports
                        from dsv4_mtp_hf.ops.triton.fp4_moe_triton import route_value

                        if not hmma_supports(D, I, route_value(cfgv, "hmma", fmt), LIMIT, fmt == "nvfp4"):
                            log(f"[{fmt} T={T}] variant {name}: not supported for this format / shape, skipped", file=logf)
                            continue

                    def make_var(ids_, cfgv=cfgv, o2=o2):
                        return lambda: o2.copy_(tri.fp4_moe_triton(x, ids_, rw, *W, fmt, LIMIT, config=cfgv))

                    with contextlib.ExitStack() as flags:
                        for path, value in SWEEP[name].get("_flags", {}).items():
                            flags.enter_context(mock.patch(path, value))
                        make_var(ids)()
                        torch.cuda.synchronize()
                        # one kernel only, or a probe (no math): the result is not the op's, so unchecked
                        unchecked = "only" in cfgv or any(isinstance(v, dict) and v.get("probe") for v in cfgv.values())
                        e2 = None if unchecked else (rel_err(o2, ref) if not torch.isnan(o2).any() else float("nan"))
                        row[f"v:{name}"] = (timed(make_var), e2)
                except Exception as err:  # noqa: BLE001
                    log(f"[{fmt} T={T}] variant {name} FAILED: {type(err).__name__}: "
                        f"{' '.join(str(err).split())[:300]}", file=logf)
            for chunk in [int(c) for c in args.read_probe.split(",") if c] if fmt == args.fmts.split(",")[0] else []:
                try:
                    row[f"read{chunk}"] = timed(lambda ids_, chunk=chunk: read_probe_runner(W, ids_, chunk))
                    if args.flush != "rotate":
                        g = capture(read_probe_runner(W, ids, chunk))
                        row[f"read{chunk}_cold"] = bench(g.replay, args.iters, 5, cold_flush)
                        del g
                except Exception as err:  # noqa: BLE001
                    log(f"[{fmt} T={T}] read probe {chunk} FAILED: {type(err).__name__}: {' '.join(str(err).split())[:300]}",
                        file=logf)
            if args.read_probe and "ours" in row and fmt == args.fmts.split(",")[0] and args.flush != "rotate":
                g = capture(ours)
                row["ours_cold"] = bench(g.replay, args.iters, 5, cold_flush)
                del g
            if T in ref_ts:
                try:
                    fn = lambda: fp4_moe_reference(x, ids, rw, *W, fmt, LIMIT)  # noqa: E731
                    row["ref_err"] = rel_err(fn(), ref)
                    row["ref"] = bench(fn, 5, 1, timing_flush)
                except Exception as err:  # noqa: BLE001
                    log(f"[{fmt} T={T}] reference timing FAILED: {err}", file=logf)
            if hm is not None:
                try:
                    run = humming_runner(hm, x, ids, rw)
                    o3 = run()
                    torch.cuda.synchronize()
                    row["hum_err"] = rel_err(o3, ref)
                    del run
                    row["hum"] = timed(lambda ids_: humming_runner(hm, x, ids_, rw))
                except Exception as err:  # noqa: BLE001
                    log(f"[{fmt} T={T}] humming FAILED: {type(err).__name__}: {' '.join(str(err).split())[:400]}",
                        file=logf)
            log(f"  row {json.dumps(row)}", file=logf)
            results.append(row)
            torch.cuda.empty_cache()
        W = hm = None  # free the experts before the next format (closures above read W: no del)
        torch.cuda.empty_cache()

    log("", file=logf)
    log(f"FP4 MoE op, E={E} D={D} I={I} top-{K}, bf16 activations; CUDA-graph replay, "
        f"{f'{args.rotations} routings rotated back to back (no flush)' if args.flush == 'rotate' else f'L2 flushed ({args.flush})'}, median of "
        f"{args.iters}; copy bw {bw / 1e12:.2f} TB/s; floor = bytes/copy-bw; %copy = floor/time", file=logf)
    hdr = (f"{'fmt':>5} {'T':>3} {'uniq':>5} {'floor_us':>8} {'ours_us':>8} {'xfloor':>6} {'%copy':>6} {'err':>8} "
           f"{'nan':>3} {'hum_us':>8} {'hum%':>5} {'hum_err':>8} {'ref_us':>8}")
    log(hdr, file=logf)
    for r in results:
        o, h = r.get("ours"), r.get("hum")
        log(f"{r['fmt']:>5} {r['T']:>3} {r['uniq']:>5.1f} {fmtv(r['floor'])} {fmtv(o)} "
            f"{fmtv(o / r['floor'] if o else None, '6.2f')} "
            f"{fmtv(100 * r['floor'] / o if o else None, '5.0f')}% {fmtv(r.get('err'), '8.1e')} {fmtv(r.get('nan'), '3d')} "
            f"{fmtv(h)} {fmtv(100 * r['floor'] / h if h else None, '4.0f')}% {fmtv(r.get('hum_err'), '8.1e')} "
            f"{fmtv(r.get('ref'), '8.0f')}", file=logf)
    if args.read_probe:
        log("read probe (us; write flush / cold flush = write then read), the op under both:", file=logf)
        for r in results:
            log(f"{r['fmt']:>5} {r['T']:>3} floor {fmtv(r['floor'], '.1f')} ours {fmtv(r.get('ours'), '.1f')} / "
                f"{fmtv(r.get('ours_cold'), '.1f')} " + " ".join(
                    f"read{c}={fmtv(r.get(f'read{c}'), '.1f')}/{fmtv(r.get(f'read{c}_cold'), '.1f')}"
                    for c in args.read_probe.split(",") if c), file=logf)
    if sweep:
        log("variants (us / err):", file=logf)
        for r in results:
            log(f"{r['fmt']:>5} {r['T']:>3} " + " ".join(
                f"{n}={fmtv(r[f'v:{n}'][0], '.1f')}/{fmtv(r[f'v:{n}'][1], '.0e')}" for n in sweep if f"v:{n}" in r),
                file=logf)
    with open(os.path.join(args.out, "moe_op_results.json"), "w") as fh:
        json.dump({"copy_bw": bw, "rows": results, "config": tri.CONFIG}, fh, indent=1)
    bad = [r for r in results if not (isinstance(r.get("err"), float) and r["err"] < 1e-2 and r.get("nan") == 0)]
    log(f"correctness: {'ALL OK' if not bad else 'FAILED for ' + str([(r['fmt'], r['T']) for r in bad])}", file=logf)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
