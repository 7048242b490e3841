#!/usr/bin/env python3
"""The V4 target's decode step with packed FP4 experts (``pack_fp4_experts``), then also graphed
(``graph_target``), against transformers' own bf16 experts, on a V4-Flash-shaped target (random
weights, one GPU).  The graphed step is checked against transformers' forward on the same weights.

The bf16 target's experts are first rounded to MXFP4 values (what transformers holds after dequantising the
native release), so the packed target computes the same function: the run checks the greedy tokens agree and
reports the logits' difference.  Per layer count: the decode step of plain greedy ``generate`` (``(t(N) - t(1)) /
(N - 1)``, median of ``--repeats``), the MoE block alone at T = 1, 2, 4, 8, 16 tokens (CUDA events around one call,
median), the routed experts' memory, all parameters' and buffers' memory, and the peak allocated while measuring.
From two layer counts the per-layer cost is the slope and the step at ``--project`` layers (V4-Flash: 43) is
extrapolated -- labelled as a projection.

``--peer transformers-fp8`` adds transformers' own V4 path as a user with a GPU gets it from the native FP8 release
(benchmarks/peer_fp8.py: FineGrainedFP8 quantizer, FP8Linear + int8-packed FP4 FP8Experts, the Triton kernels of
the staged ``.peers/finegrained_fp8``; random weights, one GPU), measured the same way.  ``--no-bf16`` skips the
bf16-experts target (ours is then built packed from the start: random MXFP4, less memory and time).

    python benchmarks/target_step.py --out $OUT          # 2 and 4 layers, one H200 (~60 GB)
    python benchmarks/target_step.py --peer transformers-fp8 --no-bf16 --out $OUT   # ours against transformers FP8
    python benchmarks/target_step.py --tiny --layers 2   # smoke run (CPU or GPU; the peer's matmuls in torch on CPU)
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_split_target, copy_bandwidth, sync, target_step_bytes, wall  # noqa: E402
import peer_fp8  # noqa: E402

from dsv4_mtp_hf import fp4, graph_target, pack_fp4_experts, ungraph_target  # noqa: E402
from dsv4_mtp_hf.target_runtime import fp8_linear_bytes, quantize_fp8_linears  # noqa: E402
from dsv4_mtp_hf.target_runtime.graph import graphed  # noqa: E402
from dsv4_mtp_hf.target_runtime.experts import expert_bytes  # noqa: E402

SEED = 4321
MOE_ROWS = (1, 2, 4, 8, 16)


def gpu_ms(fn, iters: int) -> float:
    """Median ms of one call (CUDA events; host-side launch time included, as a user pays it)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        sync()
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


@torch.no_grad()
def round_experts_to_mxfp4(target) -> None:
    for layer in target.model.layers:
        ex = layer.mlp.experts
        for w in (ex.gate_up_proj, ex.down_proj):
            for a in range(0, w.shape[0], 16):
                p, s, g = fp4.quantize_fp4(w[a:a + 16], "mxfp4")
                w[a:a + 16] = fp4.dequantize_fp4(p, s, "mxfp4", g, dtype=w.dtype)


def reset_peak() -> None:
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)


def peak_gb() -> float | None:
    """Peak allocated GB since reset_peak, all GPUs (None on CPU)."""
    if not torch.cuda.is_available():
        return None
    return sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())) / 1e9


def free() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def routed_expert_bytes(target) -> int:
    """Ours (packed or bf16: expert_bytes), or the peer's FP8Experts with their scales."""
    experts = [layer.mlp.experts for layer in target.model.layers]
    if hasattr(experts[-1], "gate_up_proj_scale_inv"):
        return sum(peer_fp8.tensor_bytes(e) for e in experts)
    return expert_bytes(target)


def moe_probe(target, device) -> torch.Tensor:
    """The same 16 hidden rows for every target (the MoE block's input)."""
    h = torch.randn(1, 16, target.config.hidden_size, generator=torch.Generator().manual_seed(SEED))
    return h.to(device=device, dtype=torch.bfloat16)


def moe_out(layer, h) -> torch.Tensor:
    return torch.cat([layer.mlp(h[:, :1]), layer.mlp(h[:, :4]), layer.mlp(h)], dim=1).float()  # T = 1, 4, 16


def make_prompt(vocab: int, device, args) -> torch.Tensor:
    return torch.randint(3, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(SEED)).to(device)


@torch.no_grad()
def measure(target, prompt, args, label: str, kind: str) -> dict:
    reset_peak()
    n = args.new_tokens
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    t_n = wall(lambda: target.generate(prompt, **kw), args.repeats)
    t_1 = wall(lambda: target.generate(prompt, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1}), args.repeats)
    tokens = target.generate(prompt, **kw)[0, prompt.shape[1]:].tolist()
    layer = target.model.layers[-1]
    h = moe_probe(target, prompt.device)
    moe_t = {t: gpu_ms(lambda t=t: layer.mlp(h[:, :t]), args.iters) for t in MOE_ROWS}
    out = moe_out(layer, h)
    logits = target(prompt).logits[0, -8:].float()
    graphs = graphed(target)  # the graphed step's GPU time alone: its 1-row graph replayed back to back
    replay_ms = kernels = trace = None
    if graphs and 1 in graphs._graphs:  # one graph per device segment (one on one GPU)
        replay = lambda: [g.graph.replay() for g in graphs._graphs[1]]  # noqa: E731
        replay_ms, trace = gpu_ms(replay, args.iters), kernel_trace(replay)
        kernels = len(trace) or None
    floor_ms = None if kind == "peer" or not torch.cuda.is_available() else 1e3 * target_step_bytes(target) / bandwidth()
    return dict(label=label, kind=kind, step_ms=1e3 * (t_n - t_1) / (n - 1), moe_ms=moe_t[1], moe_t=moe_t,
                floor_ms=floor_ms,
                expert_gb=routed_expert_bytes(target) / 1e9, param_gb=peer_fp8.tensor_bytes(target) / 1e9,
                fp8_linear_gb=fp8_linear_bytes(target) / 1e9, peak_gb=peak_gb(), replay_ms=replay_ms,
                kernels=kernels, trace=trace, tokens=tokens, logits=logits, moe_out=out)


_BANDWIDTH = []


def bandwidth() -> float:
    """The GPU's copy bandwidth (bytes/s read + written), measured once per run."""
    if not _BANDWIDTH:
        _BANDWIDTH.append(copy_bandwidth())
    return _BANDWIDTH[0]


def kernel_trace(fn) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of each kernel one call of ``fn`` launches (torch.profiler's CUDA activity; graph
    nodes included)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.lower().startswith(("memcpy", "memset"))]


def exclusive_us(trace: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """(name, its own µs, its span µs) per kernel.  With PDL a kernel starts before its predecessor ends and its span
    includes that wait; its own time is the part of its span no earlier-ending kernel covers (by end time), so the
    own times partition the GPU's busy time: what the step would lose if that kernel took no time."""
    out, covered = [], float("-inf")
    for name, start, end in sorted(trace, key=lambda t: t[2]):
        out.append((name, max(0.0, end - max(start, covered)), end - start))
        covered = max(covered, end)
    return out


def kernel_table(r: dict, top: int = 18) -> str:
    """One graphed step's kernels grouped by name, the most own GPU time first (:func:`exclusive_us`)."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for name, own, span in exclusive_us(r["trace"]):
        groups.setdefault(name, []).append((own, span))
    own_ms = sum(o for v in groups.values() for o, _ in v) / 1e3
    lines = [f"{r['layers']} layers, {r['label']}: {len(r['trace'])} kernels, own time {own_ms:.3f} ms of a "
             f"{r['replay_ms']:.3f} ms replay ({own_ms / r['replay_ms']:.0%}; the rest: gaps)",
             f"{'count':>5} {'own us':>8} {'span us':>8}  kernel"]
    for name, v in sorted(groups.items(), key=lambda kv: -sum(o for o, _ in kv[1]))[:top]:
        lines.append(f"{len(v):>5} {sum(o for o, _ in v):>8.1f} {sum(s for _, s in v):>8.1f}  {name[:110]}")
    return "\n".join(lines)


def row(layers: int, r: dict) -> dict:
    return dict(layers=layers, **{k: v for k, v in r.items() if k not in ("tokens", "logits", "moe_out", "trace")})


def check_graphed_step(target, graphs, prompt, layers: int, checks: dict) -> None:
    # A decode row replayed from its CUDA graph (the first 1-row forward captures it; roll it back and
    # run it again) against the same fixed-shape step run eagerly: checked.  Against transformers'
    # forward on the same packed weights: reported (bf16 noise, and router near-ties on random weights).
    cache = graphs.new_cache(1)
    target(prompt, past_key_values=cache)
    nxt = prompt[:, -1:] * 0 + 5
    target(nxt, past_key_values=cache)
    cache.crop(-1)
    got = target(nxt, past_key_values=cache).logits[0, -1].float()
    cache.crop(-1)
    graphs.use_graphs = False
    eager = target(nxt, past_key_values=cache).logits[0, -1].float()
    graphs.use_graphs = True
    want = target(torch.cat([prompt, nxt], 1)).logits[0, -1].float()  # no graphed cache: transformers'
    g_rel = float((got - eager).norm() / eager.norm())
    checks[f"{layers} layers: replayed decode step vs the same step eagerly, rel. difference {g_rel:.2e} < 1e-3"] = (
        g_rel < 1e-3 and (1 in graphs._graphs or graphs.device.type != "cuda"))  # CPU: no graphs
    print(f"{layers} layers: graphed decode step logits vs transformers' forward: rel. difference "
          f"{float((got - want).norm() / want.norm()):.2e}")


@torch.no_grad()
def context_replay_ms(target, prompt, context: int, args) -> float:
    """The graphed 1-row decode step at a context of ``context`` tokens (FP8 projections, as the last row): the
    fixed-shape step attends every entry its capacity holds (masked), so its cost is the capacity's, whatever the
    length reached; the step is captured at ``max_length=context`` and replayed back to back."""
    if graphed(target) is not None:
        ungraph_target(target)
    graphs = graph_target(target, max_length=context)
    target.generate(prompt, max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    ms = gpu_ms(lambda: [g.graph.replay() for g in graphs._graphs[1]], args.iters) if 1 in graphs._graphs else None
    ungraph_target(target)
    return ms  # None without CUDA graphs (CPU)


def run_ours(layers: int, args, rows: list, checks: dict, contexts: list, traces: list) -> None:
    """transformers' bf16-experts target (unless --no-bf16), the same packed, then also graphed."""
    target, _, _ = build_split_target(layers, args.tiny, torch.Generator().manual_seed(SEED),
                                      packed_experts=args.no_bf16, experts=args.experts)
    dev = target.get_input_embeddings().weight.device
    prompt = make_prompt(target.config.vocab_size, dev, args)
    bf16 = None
    if not args.no_bf16:
        round_experts_to_mxfp4(target)
        bf16 = measure(target, prompt, args, f"transformers bf16 experts ({target.config._experts_implementation})",
                       "bf16")
        pack_fp4_experts(target)
    ours = measure(target, prompt, args, "packed FP4 experts (dsv4_fp4)", "packed")
    graphs = graph_target(target, max_length=args.prompt + args.new_tokens + 8)
    fast = measure(target, prompt, args, "packed FP4 experts + graph_target", "graphed")
    check_graphed_step(target, graphs, prompt, layers, checks)
    same = sum(a == b for a, b in zip(ours["tokens"], fast["tokens"]))
    print(f"{layers} layers: graphed vs eager packed greedy tokens equal {same}/{len(ours['tokens'])}")
    ungraph_target(target)  # the release's FP8 projections kept (quantised from the random bf16 ones)
    quantize_fp8_linears(target)
    graph_target(target, max_length=args.prompt + args.new_tokens + 8)
    fp8 = measure(target, prompt, args, "packed FP4 experts + FP8 linears + graph_target", "graphed_fp8")
    rel = float((fp8["logits"] - fast["logits"]).norm() / fast["logits"].norm())
    print(f"{layers} layers: FP8 linears vs bf16 linears (graphed) logits rel. difference {rel:.2e} (the FP8 rounding)")
    if bf16 is not None:
        # Same input, same router: the MoE block's output isolates the experts (bf16 noise only).  Through a
        # whole random-weight model a router choice near a tie can flip and move the logits further; those
        # are reported, not checked.
        moe_rel = float((ours["moe_out"] - bf16["moe_out"]).norm() / bf16["moe_out"].norm())
        checks[f"{layers} layers: MoE block (T=1, 4, 16) rel. error {moe_rel:.2e} < 1e-2"] = moe_rel < 1e-2
        rel = float((ours["logits"] - bf16["logits"]).norm() / bf16["logits"].norm())
        same = sum(a == b for a, b in zip(ours["tokens"], bf16["tokens"]))
        print(f"{layers} layers: logits rel. difference {rel:.2e}, greedy tokens equal {same}/{len(bf16['tokens'])}")
    for context in args.contexts:
        contexts.append(dict(layers=layers, context=context, replay_ms=context_replay_ms(target, prompt, context, args),
                             short_context=args.prompt + args.new_tokens + 8, short_ms=fp8["replay_ms"]))
        print(contexts[-1], flush=True)
    for r in (bf16, ours, fast, fp8):
        if r is not None:
            rows.append(row(layers, r))
            print(rows[-1], flush=True)
            if r.get("trace"):
                print(kernel_table({**r, "layers": layers}, args.top_kernels), flush=True)
                traces.append(dict(layers=layers, label=r["label"], trace=r["trace"]))
    del target, graphs
    free()


def prepare_peer(args):
    """The staged Triton kernels in transformers' kernel global.  Without CUDA: torch reference matmuls (the
    staged package is still imported when it can be, to check it loads)."""
    print(f"peer: finegrained_fp8 from {args.peer_path}"
          f"{'' if args.peer_autotune_trials is None else f', autotune {args.peer_autotune_trials} trials'}")
    if torch.cuda.is_available():
        kernel = peer_fp8.load_kernel(args.peer_path, args.peer_autotune_trials)
    else:
        try:
            peer_fp8.load_kernel(args.peer_path, args.peer_autotune_trials)
            print("peer: the staged finegrained_fp8 imports (not run: no CUDA); torch reference matmuls instead")
        except Exception as e:  # e.g. no triton on a CPU machine
            print(f"peer: the staged finegrained_fp8 does not import here ({type(e).__name__}: {e}); "
                  "torch reference matmuls instead")
        kernel = peer_fp8.reference_kernel()
    peer_fp8.install(kernel)
    return kernel


def peer_label(peer, args) -> str:
    impl = peer.config._experts_implementation
    if not torch.cuda.is_available():
        return f"transformers FP8 release path ({impl} experts; CPU: torch reference matmuls)"
    trials = "" if args.peer_autotune_trials is None else f", autotune {args.peer_autotune_trials} trials"
    return f"transformers FP8 release path ({impl} FP4 experts, Triton finegrained-fp8, no DeepGEMM{trials})"


@torch.no_grad()
def run_peer(layers: int, args, kernel, rows: list, checks: dict) -> None:
    """transformers' FP8 V4 (peer_fp8) measured as ours; its MoE block checked against the same weights
    dequantised into torch matmuls (the Triton kernels quantise activations to FP8: a few % apart)."""
    dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    peer = peer_fp8.build_peer(layers, args.tiny, torch.Generator().manual_seed(SEED), dev)
    print(f"{layers} layers: peer modules {peer_fp8.fp8_modules(peer)}", flush=True)
    prompt = make_prompt(peer.config.vocab_size, dev, args)
    t0 = time.perf_counter()  # first calls of each shape: Triton autotune and compile (once per process)
    peer.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    moe_out(peer.model.layers[-1], moe_probe(peer, dev))
    sync()
    print(f"{layers} layers: peer warm-up {time.perf_counter() - t0:.1f} s", flush=True)
    r = measure(peer, prompt, args, peer_label(peer, args), "peer")
    peer_fp8.install(peer_fp8.reference_kernel())
    try:
        want = moe_out(peer.model.layers[-1], moe_probe(peer, dev))
    finally:
        peer_fp8.install(kernel)
    rel = float((r["moe_out"] - want).norm() / want.norm())
    checks[f"{layers} layers: peer MoE block (T=1, 4, 16) vs its weights dequantised in torch, rel. difference "
           f"{rel:.2e} < 0.15"] = rel < 0.15
    checks[f"{layers} layers: peer logits finite"] = bool(torch.isfinite(r["logits"]).all())
    rows.append(row(layers, r))
    print(rows[-1], flush=True)
    del peer
    free()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", default="2,4")
    p.add_argument("--project", type=int, default=43)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--peer", choices=["none", "transformers-fp8"], default="none",
                   help="also measure transformers' own V4 path from the native FP8 release (benchmarks/peer_fp8.py)")
    p.add_argument("--peer-path", default=peer_fp8.DEFAULT_PATH, help="the staged finegrained_fp8 package")
    p.add_argument("--peer-autotune-trials", type=int, default=None,
                   help="cap the peer's Bayesian autotune (faster warm-up, maybe slower kernels); default: as a user")
    p.add_argument("--no-bf16", action="store_true", help="skip transformers' bf16-experts target")
    p.add_argument("--contexts", default="", help="comma list of context lengths (e.g. 16384,65536) at which the "
                   "graphed 1-row step is also timed (its capacity: graph_target's max_length)")
    p.add_argument("--top-kernels", type=int, default=18, help="kernel groups printed per graphed step")
    p.add_argument("--experts", type=int, default=None,
                   help="routed experts per layer (V4-Flash: 256); fewer keep a token's bytes and fit more layers")
    args = p.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    print(f"seed={SEED}, {gpu}, torch {torch.__version__}, transformers {peer_fp8.transformers_version}", flush=True)
    kernel = prepare_peer(args) if args.peer != "none" else None
    rows, checks, contexts, traces, t0 = [], {}, [], [], time.perf_counter()
    for layers in [int(x) for x in args.layers.split(",")]:
        print(f"[{time.perf_counter() - t0:.0f} s] {layers} layers: ours", flush=True)
        run_ours(layers, args, rows, checks, contexts, traces)
        if kernel is not None:
            print(f"[{time.perf_counter() - t0:.0f} s] {layers} layers: peer", flush=True)
            try:  # a failing peer must not lose our rows
                run_peer(layers, args, kernel, rows, checks)
            except Exception as e:
                traceback.print_exc()
                checks[f"{layers} layers: peer ran ({type(e).__name__}: {e})"] = False
                kernel = None
            free()
    print(f"[{time.perf_counter() - t0:.0f} s] done", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "target_step.json"), "w") as f:
            json.dump({"rows": rows, "checks": checks, "contexts": contexts, "seed": SEED}, f, indent=1)
        with open(os.path.join(args.out, "target_step_traces.json"), "w") as f:
            json.dump(traces, f)  # each graphed step's kernels in launch order: (name, start µs, end µs)
    report(rows, checks, args.project, contexts)


def fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def report(rows, checks, project: int, contexts=()) -> None:
    print("\n| layers | target | decode step ms | x byte floor | graph replay ms | kernels/layer | MoE block ms (T="
          + "/".join(map(str, MOE_ROWS)) + ") | routed experts GB | FP8 linears GB | all weights GB | peak GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        moe = " / ".join(f"{r['moe_t'][t]:.3f}" for t in MOE_ROWS)
        per_layer_k = None if not r.get("kernels") else r["kernels"] / r["layers"]
        x_floor = None if not r.get("floor_ms") else r["step_ms"] / r["floor_ms"]
        print(f"| {r['layers']} | {r['label']} | {r['step_ms']:.2f} | {fmt(x_floor)} | {fmt(r.get('replay_ms'), '.3f')} | "
              f"{fmt(per_layer_k, '.0f')} | {moe} | {r['expert_gb']:.2f} | {fmt(r.get('fp8_linear_gb'))} | "
              f"{r['param_gb']:.2f} | {fmt(r.get('peak_gb'))} |")
    slopes = per_layer(rows, project)
    for c in contexts:
        print(f"{c['layers']} layers, FP8 graphed 1-row step at a {c['context']}-token context: {fmt(c['replay_ms'], '.3f')} ms "
              f"(at {c['short_context']} tokens: {fmt(c['short_ms'], '.3f')} ms)")
    for k, v in checks.items():
        print(f"{'PASS' if v else 'FAIL'}: {k}")
    summary(rows, slopes, project)
    if not all(checks.values()):
        sys.exit(1)


def per_layer(rows, project: int) -> dict:
    """label -> (ms per layer, projected step ms).  A layer's cost is the slope between two layer counts: of
    the decode step for the eager targets, of the graph replay for the graphed one (its decode step in generate
    is mostly host work that does not grow with depth, so its slope is lost in that noise).  The step at
    `project` layers: the measured step at the smaller count plus the missing layers at that slope -- a
    PROJECTION."""
    counts = sorted({r["layers"] for r in rows})
    if len(counts) < 2:
        return {}
    a, b = counts[0], counts[-1]
    print(f"\nper layer (slope {a}->{b} layers) and PROJECTION to {project} layers:")
    slopes, kinds = {}, {}
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = {r["layers"]: r for r in rows if r["label"] == label}
        if a not in mine or b not in mine:
            continue
        key = "replay_ms" if mine[a].get("replay_ms") is not None else "step_ms"
        slope = (mine[b][key] - mine[a][key]) / (b - a)
        slopes[label] = (slope, mine[a]["step_ms"] + (project - a) * slope)
        kinds[label] = mine[a]["kind"]
        print(f"  {label}: {slope:.3f} ms/layer ({key}), {slopes[label][1]:.1f} ms/step projected")
    for base in [k for k in slopes if kinds[k] in ("bf16", "peer")]:
        for label in [k for k in slopes if kinds[k] in ("packed", "graphed", "graphed_fp8")]:
            print(f"  per-layer speedup of {label} over {base}: {slopes[base][0] / slopes[label][0]:.2f}x")
    return slopes


def summary(rows, slopes: dict, project: int) -> None:
    """The short table, last: per target at the largest layer count measured."""
    top = max(r["layers"] for r in rows)
    print(f"\n| target | ms/layer | step at {project} layers (PROJECTION) ms | MoE ms T=1 | MoE ms T=16 | "
          f"routed experts GB/layer | all weights GB ({top} layers) | peak GB ({top} layers) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in [r for r in rows if r["layers"] == top]:
        slope, step = slopes.get(r["label"], (None, None))
        print(f"| {r['label']} | {fmt(slope, '.3f')} | {fmt(step, '.1f')} | {r['moe_t'][1]:.3f} | "
              f"{r['moe_t'][16]:.3f} | {r['expert_gb'] / top:.3f} | {r['param_gb']:.2f} | {fmt(r.get('peak_gb'))} |")


if __name__ == "__main__":
    main()
