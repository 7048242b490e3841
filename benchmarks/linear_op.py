#!/usr/bin/env python3
"""``dsv4_mtp::skinny_linear(_cat)`` (Triton) against torch (cuBLAS) on the MTP's dense shapes.

One command on the GPU (see BENCHMARKS.md, "Skinny dense projections")::

    PYTHONPATH=src python benchmarks/linear_op.py --out $OUT [--sweep | --draft-step]

For each V4-Flash dense projection of the MTP (``mtp_dense_shapes``: e_proj/h_proj, wq_a+wkv
read in one launch, wq_b, the grouped wo_a, wo_b, the shared expert's w1+w3 in one launch and
w2, the fp32 router gate and mHC fn) and M in {1, 4, 16} rows, with fresh random inputs:

* ours  -- the op as registered for CUDA (``pick_config``),
* torch -- what the model ran before: ``F.linear`` per weight (two calls for the fused pairs),
  the einsum of ``GroupedOutputProjection`` for wo_a,

each captured in a CUDA graph and replayed after a 256 MiB write that flushes the L2 (weights
come from HBM, as in a draft step), timed with CUDA events around the replay alone, median
of ``--iters``.  Floor = bytes read and written (weights + x + out) over the device-to-device
copy bandwidth of the same run; ``%copy`` = floor / time.  Other modes: ``--sweep`` times a few
other launch configurations of our kernel per shape (M = 1 and 16); ``--lm-head`` the lm head's
GEMV called four ways (F.linear, mv, matmul, ours); ``--fp8`` the target's FP8 projections
(``dsv4_mtp::fp8_linear``) against their bf16 copies; ``--draft-step`` times the
compiled + graphed V4-Flash draft step with the op off (cuBLAS) and on, same run.
Correctness (NaN-poisoned outputs, every shape, M = 1..16) lives in tests/test_skinny_linear.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dsv4_mtp_hf.configuration import DeepseekV4MtpConfig  # noqa: E402
from dsv4_mtp_hf.ops.skinny_linear import mtp_dense_shapes, skinny_linear_op, skinny_linear_cat_op  # noqa: E402
import common  # noqa: E402  (the random V4-Flash pair, timing and copy-bandwidth helpers)


def graph_replay_us(fn, iters: int, before=None) -> tuple[float, torch.cuda.CUDAGraph]:
    """``fn`` (warmed up once) captured in a CUDA graph; median µs of ``iters`` replays timed with
    CUDA events, ``before()`` (e.g. an L2 flush) run untimed ahead of each; and the graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        if before is not None:
            before()
        a.record(); g.replay(); b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev) * 1e3, g


class Timer:
    """``flush="write"`` (the 2026-11-30 numbers): a 256 MiB memset before each replay; it leaves
    the L2 full of dirty lines whose write-back the timed kernels then share (a fixed cost of
    several µs per replay, paid by ours and torch alike).  ``"read"`` reads 256 MiB instead
    (clean lines; closer to a draft step, whose other kernels mostly read weights) -- untimed yet."""

    def __init__(self, iters: int, flush: str = "write"):
        self.iters = iters
        self.flush_mode = flush
        self.flush = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")  # 256 MiB

    def _flush(self):
        if self.flush_mode == "read":
            self.flush.sum()
        else:
            self.flush.zero_()

    def graphed_us(self, fn) -> float:
        """Median µs of ``fn`` captured in a CUDA graph, each replay after an L2 flush."""
        return graph_replay_us(fn, self.iters, before=self._flush)[0]


def ours_fn(x, ws, groups, config=None):
    if config is not None:
        from dsv4_mtp_hf.ops.triton.skinny_linear_triton import skinny_linear_triton

        return lambda: skinny_linear_triton(x, ws, groups, config)
    if len(ws) == 1:
        return lambda: skinny_linear_op(x, ws[0], groups)
    return lambda: skinny_linear_cat_op(x, ws)


def torch_fn(x, ws, groups):
    if groups > 1:
        w = ws[0]
        wv = w.view(groups, -1, w.shape[1])
        xv = x.view(x.shape[0], groups, -1)
        return lambda: torch.einsum("...gi,goi->...go", xv, wv).flatten(-2)
    return lambda: [F.linear(x, w) for w in ws]


def sweep_configs(base):
    from dsv4_mtp_hf.ops.triton.skinny_linear_triton import SkinnyConfig

    cands = [SkinnyConfig(16, 128, base.split, 4, 6), SkinnyConfig(16, 512, base.split, 4, 3),
             SkinnyConfig(32, 128, base.split, 4, 5), SkinnyConfig(64, 64, base.split, 4, 6),
             SkinnyConfig(base.block_n, base.block_k, base.split * 2, 4, base.num_stages),
             SkinnyConfig(base.block_n, base.block_k, base.split, 8, base.num_stages)]
    return [c for c in cands if c != base]


def sweep(args):
    """Other launch configurations of our kernel per shape, M = 1 and 16 (checked against ours)."""
    from dsv4_mtp_hf.ops.triton.skinny_linear_triton import pick_config, skinny_linear_triton

    cfg = DeepseekV4MtpConfig.from_json_file(args.config)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = common.copy_bandwidth()
    timer = Timer(args.iters, args.flush)
    out, t0 = [], time.time()
    for name, ns, k, groups, dtype in mtp_dense_shapes(cfg):
        ws = [(torch.randn(n, k, device="cuda") * k**-0.5).to(dtype) for n in ns]
        esz = ws[0].element_size()
        for m in (1, 16):
            if time.time() - t0 > args.sweep_budget_s:
                break
            x = torch.randn(m, k * groups, device="cuda").to(dtype)
            floor_us = (sum(w.numel() for w in ws) + x.numel() + m * sum(ns)) * esz / bw * 1e6
            base = pick_config(m, ns, k, groups, dtype, sms)
            ref = skinny_linear_triton(x, ws, groups, base).float()
            res = [(timer.graphed_us(ours_fn(x, ws, groups, base)), base)]
            for c in sweep_configs(base):
                try:
                    got = skinny_linear_triton(x, ws, groups, c).float()
                    err = float((got - ref).norm() / ref.norm())
                    res.append((timer.graphed_us(ours_fn(x, ws, groups, c)), c))
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: skip the variant
                    print(f"  {name} M={m} {c}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                if err > 1e-2:
                    print(f"  {name} M={m} {c}: WRONG (rel err {err:.1e} vs the default config)")
            for t, c in res:
                out.append(dict(shape=name, M=m, us=t, copy=floor_us / t, default=c == base,
                                config=[c.block_n, c.block_k, c.split, c.num_warps, c.num_stages]))
            best = min(res, key=lambda r: r[0])
            print(f"{name:<22} M={m:<3} default {res[0][0]:7.2f} us ({100 * floor_us / res[0][0]:5.1f}%)  best "
                  f"{best[0]:7.2f} us ({100 * floor_us / best[0]:5.1f}%) [{best[1].block_n}, {best[1].block_k}, "
                  f"{best[1].split}, {best[1].num_warps}, {best[1].num_stages}]  all: "
                  + " ".join(f"{t:.1f}" for t, _ in res), flush=True)
        ws = None  # free the weight copies (the timing closure above reads ws: no del)
    if args.out:
        with open(os.path.join(args.out, "linear_op_sweep.json"), "w") as f:
            json.dump(dict(copy_bw=bw, sweeps=out), f, indent=2)


def stream_configs(base, k):
    """The default and alternatives for ``--stream``: tiles half / twice as tall, K split in two more parts."""
    from dsv4_mtp_hf.ops.triton.skinny_linear_triton import SkinnyConfig

    c = [("default", base)]
    if base.block_n < 64:
        c.append(("bn x2", SkinnyConfig(base.block_n * 2, base.block_k, base.split, base.num_warps, base.num_stages)))
    if base.block_n > 16:
        c.append(("bn / 2", SkinnyConfig(base.block_n // 2, base.block_k, base.split, base.num_warps, base.num_stages)))
    c.append(("split x2", SkinnyConfig(base.block_n, base.block_k, base.split * 2, base.num_warps, base.num_stages)))
    return c


def stream(args):
    """Each dense shape's kernel as it runs inside a draft step: back to back, straight after another
    weight stream, never from the L2.  One CUDA graph of ``calls`` calls cycling through enough copies
    of the weights (>= 256 MB) that none is still cached; CUDA events around a replay; µs per call,
    median of ``--iters`` replays.  Also ``skinny_linear_sum`` at the e/h shape (h_proj over 4 streams
    + e_proj)."""
    from dsv4_mtp_hf.ops.triton.skinny_linear_triton import (
        pick_config, skinny_linear_sum_triton, skinny_linear_triton, sum_config)

    cfg = DeepseekV4MtpConfig.from_json_file(args.config)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = common.copy_bandwidth()
    d = cfg.hidden_size
    shapes = [(name, ns, k, groups) for name, ns, k, groups, dtype in mtp_dense_shapes(cfg) if dtype == torch.bfloat16]
    shapes.append(("e/h sum (h_proj x4 + e_proj)", (d,), 2 * d, 0))
    out = []
    print(f"stream mode: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for name, ns, k, groups in shapes:
        mb = sum(ns) * k * 2 / 1e6
        copies = max(2, int(256 // mb) + 1)
        ws = [[(torch.randn(n, k, device="cuda") * k**-0.5).bfloat16() for n in ns] for _ in range(copies)]
        if groups == 0:  # the e/h sum: k = 2d over the two weights
            ws = [[w[0][:, :d].contiguous(), w[0][:, d:].contiguous()] for w in ws]
            x0 = torch.randn(4, d, device="cuda").bfloat16()
            x1 = torch.randn(1, d, device="cuda").bfloat16()
            base = sum_config(4, d, d, d, torch.bfloat16, sms)
        else:
            x = torch.randn(1, k * groups, device="cuda").bfloat16()
            base = pick_config(1, ns, k, groups, torch.bfloat16, sms)
        for label, c in stream_configs(base, k):
            if groups == 0 and c.split > 1:
                continue

            def call(wset, c=c):
                if groups == 0:
                    return skinny_linear_sum_triton(x0, wset[0], x1, wset[1], c)
                return skinny_linear_triton(x, wset, groups, c)
            try:
                ref = call(ws[0], base).float()
                err = float((call(ws[0]).float() - ref).norm() / ref.norm())
                calls = 2 * copies
                us = graph_replay_us(lambda: [call(ws[i % copies]) for i in range(calls)], args.iters)[0] / calls
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report, go on
                print(f"  {name} {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            floor = mb * 1e12 / bw
            out.append(dict(shape=name, config=label, us=us, floor_us=floor, tbps=mb / us, rel_err_vs_default=err,
                            cfg=[c.block_n, c.block_k, c.split, c.num_warps, c.num_stages]))
            print(f"{name:<28} {label:<9} {us:7.2f} us  {mb / us:5.2f} TB/s  ({100 * floor / us:5.1f}% of copy)  "
                  f"err vs default {err:.1e}  cfg {out[-1]['cfg']}", flush=True)
        ws = None  # free the weight copies (the timing closure above reads ws: no del)
        torch.cuda.empty_cache()
    if args.out:
        with open(os.path.join(args.out, "linear_op_stream.json"), "w") as f:
            json.dump(dict(copy_bw=bw, rows=out), f, indent=2)


def lm_head(args):
    """The lm head's GEMV (V4-Flash: 129280 x 4096 bf16, 1.06 GB, so every call streams from HBM)
    the ways a step could call it: ``F.linear`` (what the compiled step's ``mm`` is, and the
    memset + cuBLAS kernel in its timeline), ``torch.mv``, ``W @ h.T`` and our skinny op.  One
    CUDA graph of 4 back-to-back calls per variant, CUDA events around a replay, µs per call,
    median of ``--iters``; the kernels of one replay from the profiler."""
    cfg = DeepseekV4MtpConfig.from_json_file(args.config)
    v, d = cfg.vocab_size, cfg.hidden_size
    bw = common.copy_bandwidth()
    w = (torch.randn(v, d, device="cuda") * d**-0.5).bfloat16()
    floor = v * d * 2 / bw * 1e6
    out = []
    print(f"lm head {v} x {d}: copy bandwidth {bw / 1e12:.2f} TB/s, floor {floor:.1f} us", flush=True)
    for m in [int(r) for r in args.rows.split(",")]:
        h = torch.randn(m, d, device="cuda").bfloat16()
        variants = {"F.linear": lambda: F.linear(h, w), "torch.matmul(W, h.T)": lambda: torch.matmul(w, h.t()),
                    "skinny_linear": lambda: skinny_linear_op(h, w, 1)}
        if m == 1:
            variants["torch.mv"] = lambda: torch.mv(w, h[0])
        want = F.linear(h.float(), w.float())
        for name, fn in variants.items():
            got = fn()
            err = float((got.float().reshape(want.shape) - want).norm() / want.norm())
            us, g = graph_replay_us(lambda: [fn() for _ in range(4)], args.iters)
            us /= 4
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                g.replay()
                torch.cuda.synchronize()
            kernels = sorted({e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
            out.append(dict(rows=m, variant=name, us=us, floor_us=floor, rel_err=err, kernels=kernels))
            print(f"M={m:<3} {name:<22} {us:8.1f} us  {100 * floor / us:5.1f}% of copy  err {err:.1e}  {kernels}",
                  flush=True)
            del g
    if args.out:
        with open(os.path.join(args.out, "linear_op_lm_head.json"), "w") as f:
            json.dump(dict(copy_bw=bw, rows=out), f, indent=2)


def draft_step_effect(args):
    """Compiled + CUDA-graphed V4-Flash draft steps (K=1, reference attention, as
    ``benchmarks/draft_step.py`` builds them: random weights, 127 cached positions) with
    the skinny kernels off (``use_skinny`` patched: cuBLAS, the previous path) and on, same run,
    same cache contents; the timings alternate off/on three times (median of medians)."""
    import importlib

    from dsv4_mtp_hf.generation.mtp_graph import GraphedDrafter

    sl = importlib.import_module("dsv4_mtp_hf.ops.skinny_linear")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(int(time.time()))
    target, mtp = common.random_pair(False, dev, gen)
    lin = importlib.import_module("dsv4_mtp_hf.layers.linear")
    saved = sl.use_skinny, lin.use_skinny
    result = {}
    try:
        for bsz in [int(b) for b in args.batches.split(",")]:
            paged, pids, phs, lengths = common.prefilled_paged_cache(mtp, bsz, 127, gen)
            paged2 = mtp.new_cache(paged=True, batch_size=bsz)
            with torch.no_grad():
                mtp(pids[:, :-1], phs[:, :-1], past_key_values=paged2)  # the same 127 rows as `paged`
            assert torch.equal(paged2.seq_lengths, lengths)
            drafters, replays, outs = {}, {}, {}
            for on, cache in ((False, paged), (True, paged2)):
                sl.use_skinny = lin.use_skinny = saved[0] if on else (lambda *a: False)  # off: F.linear (cuBLAS)
                t0 = time.perf_counter()
                d = GraphedDrafter(mtp, cache, num_drafts=2, compile=True)
                d.tokens.copy_(pids[:, -1:]); d.residual.copy_(phs[:, -1:])
                d.capture()
                if not d.compiled:
                    raise RuntimeError("torch.compile fell back to the uncompiled step")
                print(f"batch {bsz}, skinny_linear {'on' if on else 'off'}: compile + capture {time.perf_counter() - t0:.0f} s",
                      flush=True)
                drafters[on] = d
                replays[on] = (lambda d=d, c=cache: (c.seq_lengths.copy_(lengths), d(pids[:, -1:], phs[:, -1:]))[1])
                outs[on] = replays[on]()
            torch.cuda.synchronize()
            (d0, l0), (d1, l1) = outs[False], outs[True]
            rel = float((l1.float() - l0.float()).norm() / l0.float().norm())
            med = {False: [], True: []}
            for _ in range(3):
                for on in (False, True):
                    med[on].append(common.time_ms(replays[on], args.iters))
            off_ms, on_ms = statistics.median(med[False]), statistics.median(med[True])
            result[bsz] = dict(off_ms=off_ms, on_ms=on_ms, rounds_off=med[False], rounds_on=med[True], logits_rel_err=rel,
                               same_drafts=bool(torch.equal(d0, d1)))
            print(f"draft step batch {bsz} K=1 compiled + graphed: cuBLAS {off_ms:.3f} ms, skinny_linear {on_ms:.3f} ms "
                  f"(rounds {['%.3f' % v for v in med[False]]} / {['%.3f' % v for v in med[True]]}); logits rel err "
                  f"{rel:.1e}, same drafts {torch.equal(d0, d1)}", flush=True)
            del drafters, replays, outs, paged, paged2
    finally:
        sl.use_skinny, lin.use_skinny = saved
    if args.out:
        with open(os.path.join(args.out, "linear_op_draft_step.json"), "w") as f:
            json.dump(result, f, indent=2)


def target_fp8_shapes(cfg) -> list[tuple[str, int, int, int]]:
    """The V4 target layer's projections a release stores in FP8: (name, N, K, groups)."""
    d, h, g = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.o_groups
    return [("q_a_proj", cfg.q_lora_rank, d, 1), ("q_b_proj", h, cfg.q_lora_rank, 1), ("kv_proj", cfg.head_dim, d, 1),
            ("o_a_proj (grouped)", g * cfg.o_lora_rank, h // g, g), ("o_b_proj", d, g * cfg.o_lora_rank, 1),
            ("indexer q_b_proj", 64 * 128, cfg.q_lora_rank, 1), ("shared gate/up (each)", cfg.moe_intermediate_size, d, 1),
            ("shared down", d, cfg.moe_intermediate_size, 1)]


def fp8(args):
    """``dsv4_mtp::fp8_linear`` (W8A16, the release's FP8 bytes) against the bf16 weight through our skinny op and
    through torch (cuBLAS), on the target layer's FP8 projections; floor = the FP8 weight's bytes."""
    from dsv4_mtp_hf.fp8 import quantize_fp8_block
    from dsv4_mtp_hf.ops.fp8_linear import fp8_linear_op, fp8_linear_reference

    cfg = DeepseekV4MtpConfig.from_json_file(args.config)
    bw, timer, rows = common.copy_bandwidth(), Timer(args.iters, args.flush), []
    print(f"device {torch.cuda.get_device_name(0)}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for name, n, k, groups in target_fp8_shapes(cfg):
        q, s = quantize_fp8_block(torch.randn(n, k, device="cuda") * k**-0.5)
        s = s.float()
        w = fp8_linear_reference(torch.eye(k, device="cuda"), q, s).T.contiguous().bfloat16()
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k * groups, device="cuda").bfloat16()
            want = fp8_linear_reference(x.float(), q, s, groups)
            err = float((fp8_linear_op(x, q, s, groups).float() - want).norm() / want.norm())
            floor_us = (q.numel() + s.numel() * 4) / bw * 1e6
            row = dict(shape=name, M=m, N=n, K=k, groups=groups, floor_us=floor_us, rel_err=err,
                       fp8_us=timer.graphed_us(lambda: fp8_linear_op(x, q, s, groups)),
                       bf16_ours_us=timer.graphed_us(ours_fn(x, [w], groups)),
                       bf16_torch_us=timer.graphed_us(torch_fn(x, [w], groups)))
            rows.append(row)
            print(row, flush=True)
    if args.out:
        with open(os.path.join(args.out, "linear_op_fp8.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), copy_bw=bw, rows=rows), f, indent=2)
    print(f"\n{'projection':<22} {'M':>3} {'FP8 MB':>7} {'floor us':>8} {'fp8 us':>7} {'xfloor':>6} {'bf16 ours':>9} "
          f"{'bf16 torch':>10} {'err':>8}")
    for r in rows:
        print(f"{r['shape']:<22} {r['M']:>3} {r['N'] * r['K'] / 1e6:>7.2f} {r['floor_us']:>8.2f} {r['fp8_us']:>7.2f} "
              f"{r['fp8_us'] / r['floor_us']:>6.2f} {r['bf16_ours_us']:>9.2f} {r['bf16_torch_us']:>10.2f} {r['rel_err']:>8.1e}")
    for m in sorted({r["M"] for r in rows}):
        sel = [r for r in rows if r["M"] == m]
        print(f"one layer's FP8 projections, M={m} (shared gate/up counted twice): " + ", ".join(
            f"{key} {sum(r[key] * (2 if 'each' in r['shape'] else 1) for r in sel):.1f} us"
            for key in ("floor_us", "fp8_us", "bf16_ours_us", "bf16_torch_us")))


def fp8_sweep_configs(base):
    """Alternatives to the FP8 kernel's default configuration: K split further or less, a deeper pipeline,
    more warps, other tiles (K steps wider than one scale block were slower on an H100: git history)."""
    from dataclasses import replace

    if base.block_k < 128:  # a small K: one step, nothing to vary
        return []
    cands = [replace(base, num_stages=8), replace(base, split=base.split * 2),
             replace(base, split=max(base.split // 2, 1)),
             replace(base, num_warps=8), replace(base, block_n=min(2 * base.block_n, 128)),
             replace(base, block_n=max(base.block_n // 2, 16))]
    seen = {base}
    return [c for c in cands if not (c in seen or seen.add(c))]


def fp8_sweep(args):
    """``--fp8 --sweep``: the FP8 kernel's other launch configurations per projection, M = 1 and 16 (each checked
    against the reference); the default and the best, and one layer's total with each shape's best."""
    from dsv4_mtp_hf.fp8 import quantize_fp8_block
    from dsv4_mtp_hf.ops.fp8_linear import fp8_linear_reference
    from dsv4_mtp_hf.ops.triton.fp8_linear_triton import fp8_linear_triton, pick_config

    cfg = DeepseekV4MtpConfig.from_json_file(args.config)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    timer, out, totals = Timer(args.iters, args.flush), [], {}
    print(f"device {torch.cuda.get_device_name(0)}", flush=True)
    for name, n, k, groups in target_fp8_shapes(cfg):
        q, s = quantize_fp8_block(torch.randn(n, k, device="cuda") * k**-0.5)
        s = s.float()
        for m in (1, 16):
            x = torch.randn(m, k * groups, device="cuda").bfloat16()
            want = fp8_linear_reference(x.float(), q, s, groups)
            base = pick_config(m, (n,), k, groups, sms)
            res = []
            for c in [base] + fp8_sweep_configs(base):
                try:
                    err = float((fp8_linear_triton(x, [q], [s], groups, c).float() - want).norm() / want.norm())
                    res.append((timer.graphed_us(lambda c=c: fp8_linear_triton(x, [q], [s], groups, c)), c, err))
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: skip the variant
                    print(f"  {name} M={m} {c}: {type(e).__name__}: {str(e)[:120]}")
            bad = [r for r in res if r[2] > 1e-2]
            if bad:
                print(f"  {name} M={m}: WRONG configurations {[(c, e) for _, c, e in bad]}")
            ok = [r for r in res if r[2] <= 1e-2]
            best = min(ok, key=lambda r: r[0])
            count = 2 if "each" in name else 1
            totals.setdefault(m, [0.0, 0.0])
            totals[m][0] += count * res[0][0]
            totals[m][1] += count * best[0]
            out += [dict(shape=name, M=m, us=t, err=e, default=c == base, config=list(c.__dict__.values()))
                    for t, c, e in res]
            print(f"{name:<22} M={m:<3} default {res[0][0]:7.2f} us  best {best[0]:7.2f} us {best[1]}  all: "
                  + " ".join(f"{t:.1f}" for t, _, _ in res), flush=True)
    for m, (d, b) in totals.items():
        print(f"one layer's FP8 projections, M={m}: default configs {d:.1f} us, each shape's best {b:.1f} us")
    if args.out:
        with open(os.path.join(args.out, "linear_op_fp8_sweep.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), rows=out), f, indent=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(ROOT / "configs" / "deepseek-v4-flash-mtp.json"))
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--flush", choices=("write", "read"), default="write",
                   help="L2 flush before each replay: a 256 MiB memset (default) or a 256 MiB read")
    p.add_argument("--sweep", action="store_true", help="only time other launch configurations of ours (M = 1, 16); with --fp8 of the FP8 kernel")
    p.add_argument("--sweep-budget-s", type=float, default=60.0, help="stop sweeping after this long")
    p.add_argument("--stream", action="store_true",
                   help="only the back-to-back in-graph timing of each shape (rotating weight copies), a few configs")
    p.add_argument("--draft-step", action="store_true",
                   help="only the compiled + graphed V4-Flash draft step (batch 1, K=1) with the op off and on")
    p.add_argument("--batches", default="1", help="batch sizes for --draft-step")
    p.add_argument("--lm-head", action="store_true", help="only the lm head's GEMV: F.linear, mv, matmul, ours")
    p.add_argument("--fp8", action="store_true",
                   help="only the target's FP8 projections: dsv4_mtp::fp8_linear against their bf16 copies")
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args()
    from dsv4_mtp_hf.ops.triton.skinny_linear_triton import pick_config

    torch.manual_seed(int(time.time()))
    if args.draft_step:
        return draft_step_effect(args)
    if args.sweep:
        return fp8_sweep(args) if args.fp8 else sweep(args)
    if args.stream:
        return stream(args)
    if args.lm_head:
        return lm_head(args)
    if args.fp8:
        return fp8(args)
    cfg = DeepseekV4MtpConfig.from_json_file(args.config)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = common.copy_bandwidth()
    timer = Timer(args.iters, args.flush)
    rows_list = [int(r) for r in args.rows.split(",")]
    rows = []
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for name, ns, k, groups, dtype in mtp_dense_shapes(cfg):
        ws = [(torch.randn(n, k, device="cuda") * k**-0.5).to(dtype) for n in ns]
        esz = ws[0].element_size()
        for m in rows_list:
            x = torch.randn(m, k * groups, device="cuda").to(dtype)
            nbytes = sum(w.numel() for w in ws) * esz + x.numel() * esz + m * sum(ns) * esz
            floor_us = nbytes / bw * 1e6
            base = pick_config(m, ns, k, groups, dtype, sms)
            got = ours_fn(x, ws, groups)()
            want = torch.cat([t.float() for t in torch_fn(x, ws, groups)()], -1) if groups == 1 else \
                torch_fn(x.float(), [w.float() for w in ws], groups)()
            rel = float((got.float() - want).norm() / want.norm())
            t_ours = timer.graphed_us(ours_fn(x, ws, groups))
            t_torch = timer.graphed_us(torch_fn(x, ws, groups))
            row = dict(shape=name, M=m, N=list(ns), K=k, groups=groups, dtype=str(dtype).replace("torch.", ""),
                       MB=nbytes / 1e6, floor_us=floor_us, ours_us=t_ours, torch_us=t_torch,
                       ours_copy=floor_us / t_ours, torch_copy=floor_us / t_torch, speedup=t_torch / t_ours,
                       rel_err=rel, config=[base.block_n, base.block_k, base.split, base.num_warps, base.num_stages])
            rows.append(row)
            print(f"{name:<22} M={m:<3} ours {t_ours:7.2f} us ({100 * row['ours_copy']:5.1f}%)  torch {t_torch:7.2f} us "
                  f"({100 * row['torch_copy']:5.1f}%)  x{row['speedup']:.2f}  err {rel:.1e}  cfg {row['config']}", flush=True)
        ws = None  # free the weight copies (the timing closure above reads ws: no del)
        torch.cuda.empty_cache()

    wired = ("wq_a+wkv", "wq_b", "wo_a (grouped)", "wo_b", "shared w1+w3", "shared w2")
    sums = {}
    for m in rows_list:
        sel = [r for r in rows if r["M"] == m and r["shape"] in wired]
        sums[m] = dict(ours_us=sum(r["ours_us"] for r in sel), torch_us=sum(r["torch_us"] for r in sel),
                       floor_us=sum(r["floor_us"] for r in sel))
    if args.out:
        with open(os.path.join(args.out, "linear_op.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, copy_bw=bw, iters=args.iters,
                           rows=rows, wired_sums=sums), f, indent=2)
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; CUDA-graph replays after an L2 flush, median of {args.iters}; "
          "config = [BLOCK_N, BLOCK_K, SPLIT, warps, stages]")
    print(f"{'shape':<22} {'M':>3} {'MB':>7} {'floor us':>9} {'ours us':>8} {'%copy':>6} {'torch us':>9} {'%copy':>6} "
          f"{'speedup':>7} {'rel err':>8}  config")
    for r in rows:
        print(f"{r['shape']:<22} {r['M']:>3} {r['MB']:>7.2f} {r['floor_us']:>9.2f} {r['ours_us']:>8.2f} "
              f"{100 * r['ours_copy']:>6.1f} {r['torch_us']:>9.2f} {100 * r['torch_copy']:>6.1f} {r['speedup']:>7.2f} "
              f"{r['rel_err']:>8.1e}  {r['config']}")
    for m, s in sums.items():
        print(f"wired projections (wq_a+wkv .. shared w2), M={m}: ours {s['ours_us']:.1f} us, torch {s['torch_us']:.1f} us, "
              f"floor {s['floor_us']:.1f} us")


if __name__ == "__main__":
    main()
