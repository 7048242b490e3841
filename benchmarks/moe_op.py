#!/usr/bin/env python3
"""Correctness + timing of ``dsv4_mtp::fp4_moe`` (the registered CUDA kernels) on V4 MoE shapes.

One command on the GPU::

    PYTHONPATH=src python benchmarks/moe_op.py --out $OUT [--ts 1,2,4,8,16,64] [--fmts nvfp4,mxfp4]

For each format and T it draws random packed weights / activations / routing (seed logged), checks the op
(NaN-poisoned output, eager and graph-replayed) against a float64 dequantise-and-matmul reference, then
times CUDA-graph replays, median of ``--iters``.  ``--flush rotate`` (default, how results are reported):
one graph of ``--rotations`` calls back to back, each with another random routing, so every call reads
its experts from HBM as in a draft step; ``--flush write``: a 256 MiB memset before each replay.

* ours      -- the op as registered for CUDA (``fp4_moe_triton.kernel_for`` picks the kernel family),
* reference -- ``fp4_moe_reference`` (eager: it syncs to the host, so it cannot be graph-captured),
* humming   -- humming-kernels 0.1.19 indexed W4A16 MoE (NVFP4 only), driven the way vLLM drives it:
               align on device, w13 GEMM, fused clamped SwiGLU, w2 GEMM, weighted sum.

The floor is the bytes that must be read (unique experts x packed weights + scales + globals, plus
activations in and out) over the device-to-device copy bandwidth measured in the same run; ``%copy`` =
floor / time.  Under ``--flush rotate`` "uniq" is the mean over the rotated routings.  The table is
printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

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
    ap.add_argument("--no-humming", action="store_true")
    ap.add_argument("--ref-ts", default="1,16", help="T values at which the eager reference path is timed")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--flush", choices=("rotate", "write"), default="rotate",
                    help="'rotate': no flush, one graph of --rotations calls back to back, each with another random "
                    "routing (each call finds its experts outside L2, as in a draft step), time per call; "
                    "'write': a 256 MiB memset before each timed replay")
    ap.add_argument("--rotations", type=int, default=16, help="calls per graph for --flush rotate")
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
    log(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} | {torch.cuda.get_device_name()} | torch "
        f"{torch.__version__} | triton {__import__('triton').__version__} | E={E} D={D} I={I} top{K}", file=logf)
    bw = copy_bandwidth()
    log(f"device-to-device copy bandwidth (read+write): {bw / 1e12:.3f} TB/s", file=logf)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

    seed = int.from_bytes(os.urandom(4), "little")
    log(f"seed {seed}; routes {json.dumps(tri.ROUTES)}", file=logf)
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
            # the floor of what is timed: under rotation the mean over the rotated routings' unique experts
            uniq = statistics.mean(int(torch.unique(i).numel()) for i in id_sets)
            row["uniq"] = uniq
            row["uniq_first"] = int(torch.unique(ids).numel())
            row["floor"] = (uniq * bpe + 2 * x.numel() * 2 + ids.numel() * 8) / bw * 1e6

            def timed(make):
                """Median µs per call of ``make(ids)()`` as a replayed graph: ``--flush rotate``'s calls over
                ``id_sets``, or flushed before each replay (``--flush write``)."""
                if args.flush == "rotate":
                    fns = [make(i) for i in id_sets]
                    gr = capture(lambda: [f() for f in fns])
                    return bench(gr.replay, args.iters, 3, None) / len(fns)
                return bench(capture(make(ids)).replay, args.iters, 5, flush)
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
            if T in ref_ts:
                try:
                    fn = lambda: fp4_moe_reference(x, ids, rw, *W, fmt, LIMIT)  # noqa: E731
                    row["ref_err"] = rel_err(fn(), ref)
                    row["ref"] = bench(fn, 5, 1, flush)
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

    with open(os.path.join(args.out, "moe_op_results.json"), "w") as fh:
        json.dump({"copy_bw": bw, "rows": results, "routes": tri.ROUTES}, fh, indent=1)
    bad = [r for r in results if not (isinstance(r.get("err"), float) and r["err"] < 1e-2 and r.get("nan") == 0)]
    log(f"correctness: {'ALL OK' if not bad else 'FAILED for ' + str([(r['fmt'], r['T']) for r in bad])}", file=logf)
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
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
