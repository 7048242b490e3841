#!/usr/bin/env python3
"""End to end, as a user sees it: ``target.generate(ids, assistant_model=mtp)`` against plain
``target.generate(ids)``, and ``speculative_generate`` against plain batched decoding.

The target is V4-Flash-shaped (random bf16 weights, ``--layers`` decoder layers, one GPU).  With
random weights the MTP's drafts would never be accepted, so acceptance is *controlled*:

* the target's greedy choice is made predictable: a hook adds a large margin to the logit of
  ``successor(token)`` at every position (all of the target's compute still runs);
* after the MTP has drafted (all of its compute runs too), its tokens are replaced by
  controlled ones: per round a number of correct drafts ``n`` is drawn so that the i-th draft
  is accepted with the profile's probability (``acceptance_by_position``), and every draft
  after the n-th is made wrong.  Profiles: ``none`` (every draft rejected), ``all``, and
  ``deepseek`` (0.88 / 0.80 / 0.72 for drafts 1 / 2 / 3).

``--sample``: every call samples (``do_sample=True``, temperature 0.6, top-p 0.95, top-k 50: a chat
setting) -- the margin still makes the target's choice certain, and each controlled draft comes with
the one-hot distribution it was "drawn" from, so speculative sampling accepts exactly the right
drafts while the MTP still draws its own from the processed distribution.

Every case checks that the output equals plain greedy ``generate`` token for token.  Printed
per case: tokens/s, speedup over plain, tokens per round, and the split of a round into the
target's verify forward, the MTP's work (both GPU time between CUDA events) and host glue (the
rest of the round's wall time), without the first draft round's one-off MTP pass over the prompt
(``prompt mtp``, printed on its own); for plain, ``prompt`` is a whole ``generate`` of one token.  With two ``--layers`` values the speedup at ``--project``
layers (V4-Flash: 43) is extrapolated linearly in the layer count -- labelled as a projection.

    python benchmarks/e2e_generate.py --out $OUT                 # 2 and 5 layers, one H200
    python benchmarks/e2e_generate.py --fp4-experts --graph-target --layers 5 --batches ""   # the fast target
    python benchmarks/e2e_generate.py --fp4-experts --graph-target --layers 5 --ks 3 --profiles deepseek \
        --batches "" --host-profile                              # + where the round's wall time goes
    python benchmarks/e2e_generate.py --tiny --layers 2          # smoke run (CPU or GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    build_split_target, copy_bandwidth, distinct_experts, left_pad, random_drafter, target_step_bytes,
)

from dsv4_mtp_hf import graph_target  # noqa: E402
from dsv4_mtp_hf.generation import Drafts, speculative_generate  # noqa: E402
from dsv4_mtp_hf.generation.candidate import DraftCandidateGenerator  # noqa: E402
from dsv4_mtp_hf.generation.drafter import session_class  # noqa: E402
from dsv4_mtp_hf.generation.dspark_session import DSparkSession  # noqa: E402
from dsv4_mtp_hf.generation.mtp_batch import MtpBatch  # noqa: E402
from dsv4_mtp_hf.generation.mtp_session import MtpSession  # noqa: E402
from dsv4_mtp_hf.target_runtime.graph import graphed  # noqa: E402
from dsv4_mtp_hf.target_runtime.ragged import RaggedTargetForward  # noqa: E402

SEED = 1234
MARGIN = 1000.0
# Unconditional acceptance by draft position: P(drafts 1..i all accepted).  Published: the MTP at K=3
# (GDzhu01/vllm-ascend-deepseekv4#132), DSpark 0731 on prose (vllm#41834) and a code profile with a mean accepted
# length of 4.42 at block 5 (vllm-project/speculators#952: 1 + 0.93 + 0.80 + 0.68 + 0.55 + 0.46).
PROFILES = {"none": (0.0,) * 5, "all": (1.0,) * 5, "deepseek": (0.88, 0.80, 0.72),
            "mtp-published": (0.98, 0.64, 0.15), "dspark-prose": (0.58, 0.45, 0.32, 0.24, 0.16),
            "dspark-code": (0.93, 0.80, 0.68, 0.55, 0.46)}
SAMPLING = dict(do_sample=True, temperature=0.6, top_p=0.95, top_k=50)  # --sample


def successor(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The target's controlled greedy choice after each token (never 0..2: ids a tokenizer may reserve)."""
    return (tokens * 7919 + 13) % (vocab - 3) + 3


def wrong(token, vocab: int):
    """A token that is not ``token`` (a rejected draft)."""
    return (token + 1 - 3) % (vocab - 3) + 3


def chain(last: int, n: int, vocab: int) -> list[int]:
    out, t = [], last
    for _ in range(n):
        t = int(successor(torch.tensor(t), vocab))
        out.append(t)
    return out


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Controlled:
    """Margins on the target's logits and controlled drafts, for one profile at a time."""

    def __init__(self, target, mtp, vocab: int):
        self.target, self.mtp, self.vocab = target, mtp, vocab
        self.profile = PROFILES["none"]
        self.rng = random.Random(SEED)
        self._ids = None
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.timing = False
        self._hooks = [
            target.register_forward_pre_hook(self._take_ids, with_kwargs=True),  # graph_target skips target.model
            target.register_forward_hook(self._margin),  # on the logits out: graph_target runs lm_head in its graph
            target.register_forward_pre_hook(self._target_start),
            target.register_forward_hook(self._target_end),
        ]

    # -- the target: greedy choice = successor(input token) ------------------------------------
    def _take_ids(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._ids = ids

    def _margin(self, module, args, out):
        ids, self._ids = self._ids, None  # (the ragged path adds its margins itself: RaggedTargetForward below)
        logits = out.logits
        rows = ids[:, -logits.shape[1]:]
        out.logits = logits.scatter_add(-1, successor(rows, self.vocab).unsqueeze(-1).to(logits.device),
                                        torch.full((*rows.shape, 1), MARGIN, dtype=logits.dtype, device=logits.device))
        return out

    def ragged_call(self, original):
        ctl = self

        def call(runner, chunks, caches, logit_rows=None):
            logits, residual, offsets = original(runner, chunks, caches, logit_rows)
            flat = torch.cat([c.reshape(-1) for c in chunks])
            rows = flat if logit_rows is None else flat[logit_rows.cpu()]
            want = successor(rows, ctl.vocab).to(logits.device).unsqueeze(-1)
            return logits.scatter_add(-1, want, torch.full_like(want, MARGIN, dtype=logits.dtype)), residual, offsets
        return call

    # -- timing of the target's forwards ---------------------------------------------------------
    def _target_start(self, module, args):
        if self.timing:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()

    def _target_end(self, module, args, out):
        if self.timing:
            t1 = torch.cuda.Event(enable_timing=True)
            t1.record()
            self.events.append(("target", self._t0, t1))

    # -- the drafts ---------------------------------------------------------------------------------
    def correct_count(self, k: int) -> int:
        """Drafts accepted this round: P(n >= i) = profile[i - 1] (0 beyond the profile)."""
        u, n = self.rng.random(), 0
        while n < min(k, len(self.profile)) and u < self.profile[n]:
            n += 1
        return n

    def confidences(self, k: int, like: torch.Tensor) -> torch.Tensor:
        """A confidence head that knows the profile: c_i = P(draft i accepted | drafts before it were)."""
        p = list(self.profile) + [0.0] * k
        c = [p[0]] + [p[i] / p[i - 1] if p[i - 1] > 0 else 0.0 for i in range(1, k)]
        return torch.tensor([c[:k]], dtype=like.dtype, device=like.device)

    def controlled(self, last: int, k: int) -> list[int]:
        truth = chain(last, k, self.vocab)
        n = self.correct_count(k)
        return [t if i < n else wrong(t, self.vocab) for i, t in enumerate(truth)]

    def controlled_on_device(self, last: torch.Tensor, k: int) -> torch.Tensor:
        """:meth:`controlled` from the last token ``[1, 1]`` where it lies, with no host read or upload: the
        benchmark must not add a synchronisation to the round that a user's call does not have."""
        n, t, out = self.correct_count(k), last, []
        for i in range(k):
            t = successor(t, self.vocab)
            out.append(t if i < n else wrong(t, self.vocab))
        return torch.cat(out, dim=1)

    def close(self):
        for h in self._hooks:
            h.remove()


@contextlib.contextmanager
def controlled_drafts(ctl: Controlled):
    """Inside the block every assisted call's drafts are controlled: the drafter drafts through its round path
    (all of its compute runs), then its tokens are replaced by controlled ones, on the device; (sampling) each with
    the one-hot q it is "drawn" from, so a right one is accepted; (DSpark) its confidences by the profile's
    conditional acceptance, so that "auto" chooses verify lengths as a calibrated head would.  The candidate
    generator's work per round (the drafter's) is timed with CUDA events while ``ctl.timing``."""
    sessions = (MtpSession, DSparkSession)
    real = {cls: cls._draft for cls in sessions}
    real_get = DraftCandidateGenerator.get_candidates

    def controlled(cls):
        def _draft(session, ids, features, choose, limit):
            if session.drafter is None:  # the per-position drafts of processors that read the sequence
                raise RuntimeError("the benchmark controls the drafts of the round path only.")
            drafts = real[cls](session, ids, features, choose, limit)
            if drafts is None:
                return drafts
            k = drafts.tokens.shape[1]
            tokens = ctl.controlled_on_device(ids[:, -1:], k).to(drafts.tokens.device)
            logits = drafts.logits
            if session.drafter.sampled:
                logits = torch.full_like(logits, float("-inf")).scatter_(-1, tokens.to(logits.device).unsqueeze(-1), 0.)
            confidences = None if drafts.confidences is None else ctl.confidences(k, drafts.confidences)
            return Drafts(tokens, logits, confidences)
        return _draft

    def get_candidates(generator, *args, **kwargs):
        if not ctl.timing:
            return real_get(generator, *args, **kwargs)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = real_get(generator, *args, **kwargs)
        b.record()
        ctl.events.append(("mtp", a, b))
        return out

    for cls in sessions:
        cls._draft = controlled(cls)
    DraftCandidateGenerator.get_candidates = get_candidates
    try:
        yield
    finally:
        for cls in sessions:
            cls._draft = real[cls]
        DraftCandidateGenerator.get_candidates = real_get


def timed(fn, repeats: int):
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def build_dspark(target, gen: torch.Generator):
    """A random V4-Flash-shaped DSpark drafter (3 draft layers, bf16 dense weights, random MXFP4 experts) reading the
    target's last three layers, beside its lm head, bound."""
    from dsv4_mtp_hf import DeepseekV4DSparkConfig, DeepseekV4DSparkForCausalLM

    layers = target.config.num_hidden_layers
    config = DeepseekV4DSparkConfig.from_target_config(
        {**target.config.to_dict(), "dspark_block_size": 5,
         "dspark_noise_token_id": min(128799, target.config.vocab_size - 1),
         "dspark_target_layer_ids": list(range(max(0, layers - 3), layers)), "dspark_markov_rank": min(256, target.config.hidden_size)})
    return random_drafter(DeepseekV4DSparkForCausalLM, config, target.lm_head.weight.device, gen).bind(target)


def profiles_for(name: str, profiles: list[str]) -> list[str]:
    """The profiles a drafter runs: the generic ones and its own published ones."""
    own = "dspark" if name == "dspark" else "mtp"
    return [p for p in profiles if not p.startswith(("mtp-", "dspark-")) or p.startswith(own + "-")]


def assisted_cases(target, drafters, ctl, args, rows, checks, label):
    dev = target.get_input_embeddings().weight.device
    gen = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(3, ctl.vocab, (1, args.prompt), generator=gen).to(dev)
    n = args.new_tokens
    kw = dict(max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
              **(SAMPLING if args.sample else dict(do_sample=False)))
    t_plain, plain = timed(lambda: target.generate(prompt, **kw), args.repeats)
    t_one, _ = timed(lambda: target.generate(prompt, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1}),
                     args.repeats)
    step = (t_plain - t_one) / (n - 1)
    checks[f"{label}: plain output is the controlled chain"] = plain[0, args.prompt:].tolist() == chain(
        int(prompt[0, -1]), n, ctl.vocab)
    # prompt_ms: a whole generate of one token (the prompt's forward and generate's own setup)
    bandwidth = None
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            bandwidth = copy_bandwidth()  # read + write bytes per second
    floor = None if bandwidth is None else 1e3 * target_step_bytes(target) / bandwidth
    rows.append(dict(label=label, drafter="-", case="plain", k=0, tok_s=n / t_plain, speedup=1.0, tok_round=1.0,
                     round_ms=1e3 * step, target_ms=None, mtp_ms=None, glue_ms=None, x_plain_step=1.0,
                     prompt_ms=1e3 * t_one, floor_ms=floor, x_floor=None if floor is None else 1e3 * step / floor))
    with controlled_drafts(ctl):
        for name, drafter in drafters.items():
            graphs = graphed(target)
            if graphs is not None:  # the drafter's layer tap set, then every row count's graph, before any timing
                target.generate(prompt, assistant_model=drafter, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
                graphs.capture_all()
            for k in args.ks:
                if k != "auto" and k > session_class(drafter).max_drafts(drafter):
                    continue
                for profile in profiles_for(name, args.profiles):
                    case = dict(label=label, drafter=name, case=profile, k=k)
                    rows.append(assisted_case(target, drafter, ctl, args, prompt, kw, plain, (t_plain, t_one, step),
                                              case, checks))
                    rows[-1]["floor_ms"] = draft_floor_ms(drafter, k, bandwidth)
                    print(rows[-1], flush=True)


def assisted_case(target, drafter, ctl, args, prompt, kw, plain, plain_times, case, checks) -> dict:
    """One drafter, K and profile: tokens/s and the round's split (verify, drafter, glue) from CUDA events."""
    t_plain, t_one, step = plain_times
    ctl.profile = PROFILES[case["case"]]
    ctl.rng = random.Random(SEED)

    def run():
        return target.generate(prompt, assistant_model=drafter, num_assistant_tokens=case["k"], **kw)

    t, out = timed(run, args.repeats)
    checks[f"{case['label']}: {case['drafter']} K={case['k']} {case['case']}: equal to plain greedy"] = \
        bool(torch.equal(out, plain))
    stats = drafter.last_generation_stats
    ctl.events, ctl.timing = [], torch.cuda.is_available()  # one more run with CUDA events (the split needs them)
    sync()
    w0 = time.perf_counter()
    run()
    sync()
    wall = time.perf_counter() - w0
    ctl.timing = False
    tgt = [a.elapsed_time(b) for kind, a, b in ctl.events if kind == "target"]
    mt = [a.elapsed_time(b) for kind, a, b in ctl.events if kind == "mtp"]
    r = max(1, stats.rounds)
    prefill_ms = tgt[0] if tgt else 1e3 * t_one
    # mt[0]: the first call (nothing to draft yet); mt[1]: the first draft round, which also runs the drafter
    # over the whole prompt -- a one-off cost, reported on its own, not in the per-round split.
    catch_up = mt[1] if len(mt) > 2 else None
    round_ms = (1e3 * wall - prefill_ms - (catch_up or 0.0)) / r
    t_ms = statistics.mean(tgt[1:]) if len(tgt) > 1 else None
    m_ms = statistics.mean(mt[2:]) if len(mt) > 2 else None
    n = args.new_tokens
    verified = stats.mean_verified_length
    return dict(case, tok_s=n / t, speedup=t_plain / t, tok_round=stats.mean_accepted_length, round_ms=round_ms,
                target_ms=t_ms, mtp_ms=m_ms, glue_ms=None if t_ms is None else round_ms - t_ms - m_ms,
                x_plain_step=round_ms / (1e3 * step), prompt_mtp_ms=catch_up, verified=verified,
                acceptance=stats.acceptance_by_position)


def _bytes(params) -> int:
    return sum(t.numel() * t.element_size() for t in params)


def draft_floor_ms(drafter, k, bandwidth) -> float | None:
    """The drafter's bytes per round at ``bandwidth``: what its GPU time per round is measured against.  Every
    dense weight once per forward; the routed experts a forward of T tokens touches (the expected distinct ones of
    top-k of E); the lm head once per forward (and, DSpark, the Markov head's W2 once per block row).  The MTP's
    round: the catch-up forward (T = 2) and K - 1 steps (T = 1); DSpark's: the commit and one block (T = gamma).
    An estimate from the model's own tensors, not a measurement."""
    if bandwidth is None:
        return None
    c = drafter.config
    layers = list(drafter.layers) if hasattr(drafter, "layers") else [drafter.block]
    experts = layers[0].mlp.experts
    per_expert = _bytes(experts.buffers()) / experts.num_experts
    dense_layer = _bytes(p for layer in layers for p in layer.parameters())
    head = _bytes(drafter.get_output_embeddings().parameters())

    def distinct(t):
        return c.n_routed_experts * (1 - (1 - c.num_experts_per_tok / c.n_routed_experts) ** t)

    if hasattr(drafter, "markov_proj"):  # DSpark: one block of gamma rows
        g = c.dspark_block_size
        rest = _bytes(p for n, p in drafter.named_parameters() if not n.startswith(("layers.", "markov_")))
        total = (dense_layer + rest + len(layers) * distinct(g) * per_expert + head
                 + g * _bytes(drafter.markov_proj.parameters()))
    else:
        k = session_class(drafter).auto_num_drafts(drafter) if k == "auto" else k
        other = _bytes(p for n, p in drafter.named_parameters() if not n.startswith("block."))
        forward = lambda t: dense_layer + other + distinct(t) * per_expert + head  # noqa: E731
        total = forward(2) + (k - 1) * forward(1)
    return 1e3 * total / bandwidth


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def busy_us(intervals) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def host_profile(target, mtp, ctl, args, label, out_dir) -> list[str]:
    """Where a round's wall time goes: one plain and one assisted call (the first K, the first profile) under
    torch.profiler.  Per call: the GPU's busy share of the wall time (the union of its kernels and copies) and,
    per step or round, the host's blocking CUDA calls (syncs, blocking copies) and the time spent in them.
    The full operator tables go to ``out_dir``."""
    from torch.profiler import ProfilerActivity, profile

    dev = target.get_input_embeddings().weight.device
    prompt = torch.randint(3, ctl.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(SEED)).to(dev)
    n, k = args.new_tokens, args.ks[0]
    kw = dict(max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
              **(SAMPLING if args.sample else dict(do_sample=False)))
    ctl.profile = PROFILES[args.profiles[0]]
    calls = [("plain", lambda: target.generate(prompt, **kw)),
             (f"K={k} {args.profiles[0]}", lambda: target.generate(prompt, assistant_model=mtp, num_assistant_tokens=k, **kw))]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    lines = []
    with controlled_drafts(ctl):
        for name, call in calls:
            ctl.rng = random.Random(SEED)
            call()
            sync()
            with profile(activities=activities) as prof:
                call()
                sync()
            events = prof.events()
            steps = n if name == "plain" else max(1, mtp.last_generation_stats.rounds)
            host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
            wall = max(e.time_range.end for e in host) - min(e.time_range.start for e in host)
            gpu = [(e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA]
            blocking = [e for e in host if e.name.startswith(SYNC_CALLS) and "Async" not in e.name]
            lines.append(f"{label}, {name}: wall {wall / 1e3:.1f} ms over {steps} {'steps' if name == 'plain' else 'rounds'}"
                         f" ({wall / 1e3 / steps:.2f} ms each); GPU busy "
                         + (f"{busy_us(gpu) / wall:.0%}" if gpu else "n/a (no CUDA)")
                         + f"; per {'step' if name == 'plain' else 'round'}: {len(blocking) / steps:.1f} blocking CUDA calls, "
                         f"{sum(e.cpu_time_total for e in blocking) / 1e3 / steps:.2f} ms in them")
            kind = "plain" if name == "plain" else "assisted"  # names that come back from the device ([A-Za-z0-9._-])
            stem = f"host_profile_{label.split(',')[0].replace(' ', '')}_{kind}"
            if out_dir:
                os.makedirs(out_dir, exist_ok=True)
                with open(os.path.join(out_dir, stem + ".txt"), "w") as f:
                    f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
            if torch.cuda.is_available():  # again with Python stacks: what the idle GPU waited for
                ctl.rng = random.Random(SEED)
                with profile(activities=activities, with_stack=True) as prof:
                    call()
                    sync()
                lines.extend(idle_gaps(prof, f"{label}, {name}", out_dir and os.path.join(out_dir, stem)))
    return lines


def idle_gaps(prof, what: str, keep: str | None, top: int = 10) -> list[str]:
    """The GPU's idle time per step or round of a profiled call, by what it waited for.  Steady state only:
    from the end of the target's second forward (after the prompt, the MTP's pass over it and the first
    captures).  Each gap before a kernel or copy is charged to the Python frames (the innermost two outside
    torch) that launched it.  Python stacks slow the host ~2x: read the shares, not the times.  ``keep``:
    also save the trace there (.json.gz)."""
    import gzip
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        if keep:
            with open(path, "rb") as f, gzip.open(keep + ".json.gz", "wb") as g:
                g.write(f.read())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    frames = sorted((e for e in events if e.get("cat") == "python_function"), key=lambda e: (e["ts"], -e["dur"]))
    forwards = [e for e in frames if e["name"].startswith("nn.Module: DeepseekV4") and "ForCausalLM" in e["name"]
                and "Mtp" not in e["name"]]
    if len(forwards) < 3:
        return [f"{what}: fewer than three target forwards in the trace"]
    t0 = forwards[1]["ts"] + forwards[1]["dur"]
    steps = sum(e["ts"] >= t0 for e in forwards)
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["ts"] >= t0),
                 key=lambda e: e["ts"])
    if not gpu:
        return [f"{what}: no GPU activity in the trace"]
    launches = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e),
                      key=lambda e: e["ts"])
    skip = ("torch/", "<built-in", "nn.Module", "e2e_generate.py", "_contextlib.py")
    # the frames open at each launch: one sweep in time order, a stack per thread
    who, open_, i = {}, {}, 0
    for ev in launches:
        while i < len(frames) and frames[i]["ts"] <= ev["ts"]:
            open_.setdefault(frames[i]["tid"], []).append(frames[i])
            i += 1
        stack = open_.get(ev["tid"], [])
        while stack and stack[-1]["ts"] + stack[-1]["dur"] < ev["ts"]:
            stack.pop()
        mine = [e for e in stack if e["ts"] + e["dur"] >= ev["ts"] and not e["name"].startswith(skip)]
        who[ev["args"].get("correlation")] = " < ".join(e["name"].split("/")[-1] for e in mine[::-1][:2]) or "?"
    idle, charged, end = 0.0, {}, t0
    for g in gpu:
        gap = g["ts"] - end
        if gap > 0:
            idle += gap
            key = who.get(g["args"].get("correlation"), "?")
            charged[key] = charged.get(key, 0.0) + gap
        end = max(end, g["ts"] + g["dur"])
    lines = [f"{what} (Python stacks, {steps} steady steps/rounds): GPU idle {idle / (end - t0):.0%} of "
             f"{(end - t0) / 1e3:.1f} ms; idle per step/round by the frames that launched the work after it:"]
    for key, us in sorted(charged.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / 1e3 / max(1, steps):7.3f} ms  {key[:150]}")
    return lines


def ragged_plain(target, prompts, n):
    """Per-sequence-exact plain greedy decoding of a batch: our ragged target forward, no drafts."""
    runner = RaggedTargetForward(target, attention="batched")
    caches = runner.new_caches(len(prompts), max_rollback=1)
    lens = torch.tensor([p.numel() for p in prompts])
    logits, _, _ = runner(prompts, caches, logit_rows=lens.cumsum(0) - 1)
    last = logits.float().argmax(-1).tolist()
    out = [[t] for t in last]
    for _ in range(n - 1):
        logits, _, _ = runner([torch.tensor([t]) for t in last], caches)
        last = logits.float().argmax(-1).tolist()
        for o, t in zip(out, last):
            o.append(t)
    return out


@contextlib.contextmanager
def controlled_batch(ctl):
    original_draft, original_call = MtpBatch.draft, RaggedTargetForward.__call__

    def draft(drafter, seqs, budgets):
        real, dists = original_draft(drafter, seqs, budgets)
        tokens = drafter.call.tokens
        return [ctl.controlled(tokens[i][-1], len(d)) if d else d for i, d in zip(seqs, real)], dists

    MtpBatch.draft = draft
    RaggedTargetForward.__call__ = ctl.ragged_call(original_call)
    try:
        yield
    finally:
        MtpBatch.draft, RaggedTargetForward.__call__ = original_draft, original_call


def batched_cases(target, mtp, ctl, args, rows, checks, label):
    dev = target.get_input_embeddings().weight.device
    gen = torch.Generator().manual_seed(SEED + 1)
    n, k = args.new_tokens, args.batch_k
    for b in args.batches:
        prompts = [torch.randint(3, ctl.vocab, (args.prompt + 17 * (i % 4),), generator=gen) for i in range(b)]
        with controlled_batch(ctl):
            t_ragged, ref = timed(lambda: ragged_plain(target, prompts, n), args.repeats)
            ids, mask = left_pad(prompts, 0, dev)
            t_padded, padded = timed(lambda: target.generate(ids, attention_mask=mask, max_new_tokens=n,
                                                             min_new_tokens=n, do_sample=False, pad_token_id=0,
                                                             eos_token_id=None), args.repeats)
            truth = [chain(int(p[-1]), n, ctl.vocab) for p in prompts]
            checks[f"{label} B={b}: ragged plain is the controlled chain"] = ref == truth
            for name in profiles_for("mtp", args.profiles):  # speculative_generate drafts with the MTP
                ctl.profile = PROFILES[name]
                ctl.rng = random.Random(SEED)
                kw = dict(max_new_tokens=n, num_assistant_tokens=k, eos_token_id=[])
                t_spec, out = timed(lambda: speculative_generate(target, mtp, prompts, **kw), args.repeats)
                checks[f"{label} B={b} K={k} {name}: equal to per-sequence plain greedy"] = [
                    t.tolist() for t in out.new_tokens] == truth
                tok = b * n
                rows.append(dict(label=label, case=f"batched {name}", k=k, b=b, tok_s=tok / t_spec,
                                 vs_ragged=t_ragged / t_spec, vs_padded=t_padded / t_spec,
                                 ragged_tok_s=tok / t_ragged, padded_tok_s=tok / t_padded,
                                 tok_round=statistics.mean(s.mean_accepted_length for s in out.stats)))
                print(rows[-1], flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", default="2,5", help="comma list of target layer counts (two: a projection)")
    p.add_argument("--project", type=int, default=43, help="layer count the speedup is projected to")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--ks", default="1,2,3,auto")
    p.add_argument("--profiles", default="none,all,deepseek")
    p.add_argument("--drafters", default="mtp", help="comma list: mtp, dspark (a random V4-Flash-shaped DSpark "
                                                      "drafter reading the target's last three layers)")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--batch-k", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fp4-experts", action="store_true",
                   help="the target's routed experts random packed MXFP4 (DeepseekV4PackedExpertsForCausalLM) instead of "
                        "transformers' bf16")
    p.add_argument("--experts", type=int, default=None,
                   help="routed experts per layer (V4-Flash: 256); fewer keep a token's bytes (it reads its top-6 "
                        "whatever the total) so that 43 layers fit one GPU: depth-faithful")
    p.add_argument("--fp8-linears", action="store_true",
                   help="the target's projections FP8 + block scales as the release stores them (quantize_fp8_linears)")
    p.add_argument("--graph-target", action="store_true",
                   help="the target's decode steps as CUDA graphs (graph_target; needs capturable experts: "
                        "with --fp4-experts)")
    p.add_argument("--host-profile", action="store_true",
                   help="also profile one plain and one assisted call (first K and profile): the GPU's busy share and "
                        "the host's blocking CUDA calls per round")
    p.add_argument("--sample", action="store_true",
                   help="every call samples (SAMPLING: temperature 0.6, top-p 0.95, top-k 50); batches are greedy")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--report", metavar="JSON", help="print the tables and projection of a saved run, measure nothing")
    args = p.parse_args()
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        report(saved["rows"], saved["checks"], args.project)
        return
    args.ks = [x if x == "auto" else int(x) for x in args.ks.split(",") if x]  # "auto": num_assistant_tokens="auto"
    args.profiles = [x for x in args.profiles.split(",") if x]
    args.drafters = [x for x in args.drafters.split(",") if x]
    if unknown := set(args.drafters) - {"mtp", "dspark"}:
        raise SystemExit(f"--drafters: unknown {sorted(unknown)}; choose from mtp, dspark")
    args.batches = [int(x) for x in args.batches.split(",") if x]
    print(f"seed={SEED}", flush=True)
    rows, checks, profiles = [], {}, []
    for layers in [int(x) for x in args.layers.split(",")]:
        label = f"{layers} layers" + (f", {args.experts} experts" if args.experts else "") + (
            ", FP4 experts" if args.fp4_experts else "") + (
            ", FP8 linears" if args.fp8_linears else "") + (
            ", graphed" if args.graph_target else "") + (", sampled" if args.sample else "")
        with torch.no_grad():
            target, mtp, _ = build_split_target(layers, args.tiny, torch.Generator().manual_seed(SEED),
                                                packed_experts=args.fp4_experts, fp8_linears=args.fp8_linears,
                                                experts=args.experts)
            print(expert_overlap(target.config, 6), flush=True)
            drafters = {}
            for name in args.drafters:  # measured in the order given
                drafters[name] = mtp if name == "mtp" else build_dspark(target, torch.Generator().manual_seed(SEED + 2))
            if args.graph_target:  # rounds verify at most a DSpark block (5) drafts
                graph_target(target, max_length=args.prompt + args.new_tokens + 8, max_rollback=5)
            ctl = Controlled(target, mtp, target.config.vocab_size)
            try:
                assisted_cases(target, drafters, ctl, args, rows, checks, label)
                if args.host_profile:
                    profiles.extend(host_profile(target, mtp, ctl, args, label, args.out))
                if args.batches:
                    batched_cases(target, mtp, ctl, args, rows, checks, label)
            finally:
                ctl.close()
            del target, mtp, ctl, drafters
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "e2e_generate.json"), "w") as f:
            json.dump({"rows": rows, "checks": checks, "seed": SEED}, f, indent=1, default=str)
    if profiles:
        print("\n".join(["", "host profile (torch.profiler, one call each):"] + profiles))
    report(rows, checks, args.project)


def expert_overlap(config, rows: int) -> str:
    """Expected distinct routed experts per layer for 1..``rows`` verified rows: this target against V4-Flash (256).
    Fewer experts overlap more across rows, so a depth-faithful target's verify reads less than V4-Flash's."""
    e, k = config.n_routed_experts, config.num_experts_per_tok
    ours = ", ".join(f"{distinct_experts(e, k, t):.1f}" for t in range(1, rows + 1))
    flash = ", ".join(f"{distinct_experts(256, k, t):.1f}" for t in range(1, rows + 1))
    return f"distinct experts per layer for 1..{rows} verified rows: {e} experts {ours}; V4-Flash (256) {flash}"


def project(rows, layers: int) -> list[str]:
    """Per case, the speedup at ``layers`` target layers from the two measured layer counts: the target's
    verify forward and the plain step linear in the layer count, the MTP's work and the glue as measured
    at the larger count (they do not depend on the target's depth).  A projection, not a measurement."""
    counts = sorted({int(r["label"].split()[0]) for r in rows if "b" not in r})
    if len(counts) < 2:
        return []
    l1, l2 = counts[0], counts[-1]

    def row(n, drafter, case, k):
        return next(r for r in rows if "b" not in r and int(r["label"].split()[0]) == n
                    and (r.get("drafter", "mtp"), r["case"], r["k"]) == (drafter, case, k))

    def at(v1, v2):
        return v1 + (v2 - v1) * (layers - l1) / (l2 - l1)

    step = at(row(l1, "-", "plain", 0)["round_ms"], row(l2, "-", "plain", 0)["round_ms"])
    out = [f"projection to {layers} layers (verify and plain step linear in the layer count from {l1} and {l2}, "
           f"MTP work and glue as at {l2}; not measured): plain step {step:.1f} ms"]
    for drafter, case, k in sorted({(r.get("drafter", "mtp"), r["case"], r["k"]) for r in rows
                                    if "b" not in r and r["case"] != "plain"}, key=str):
        c1, c2 = row(l1, drafter, case, k), row(l2, drafter, case, k)
        if c2["target_ms"] is None:
            continue
        rnd = at(c1["target_ms"], c2["target_ms"]) + c2["mtp_ms"] + c2["glue_ms"]
        out.append(f"  {drafter:<6} {case:<13} K={k}: round {rnd:.1f} ms, {c2['tok_round']:.2f} tokens per round, "
                   f"speedup {c2['tok_round'] * step / rnd:.2f}x")
    return out


def report(rows, checks, layers: int) -> None:
    """The checks, the tables and the projection (also from a saved run: ``--report e2e_generate.json``)."""
    failed = [name for name, ok in checks.items() if not ok]
    for name, ok in checks.items():
        print(f"check: {name}: {ok}")
    print(f"\n{'target':<10} {'drafter':<7} {'case':<13} {'K':>4} {'tok/s':>8} {'speedup':>7} {'tok/rnd':>7} "
          f"{'verified':>8} {'round ms':>8} {'verify':>7} {'draft':>6} {'floor':>6} {'glue':>6} {'x step':>6} "
          f"{'prompt':>7} {'prompt draft':>12}")
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        if "b" in r:
            continue
        print(f"{r['label']:<10} {r.get('drafter', 'mtp'):<7} {r['case']:<13} {r['k']:>4} {r['tok_s']:>8.1f} "
              f"{r['speedup']:>6.2f}x {r['tok_round']:>7.2f} {fmt(r.get('verified')):>8} {r['round_ms']:>8.2f} "
              f"{fmt(r['target_ms']):>7} {fmt(r['mtp_ms']):>6} {fmt(r.get('floor_ms')):>6} {fmt(r['glue_ms']):>6} "
              f"{r['x_plain_step']:>6.2f} {fmt(r.get('prompt_ms')):>7} {fmt(r.get('prompt_mtp_ms')):>12}")
    batched = [r for r in rows if "b" in r]
    if batched:
        print(f"\n{'target':<10} {'case':<17} {'B':>3} {'K':>2} {'tok/s':>8} {'ragged tok/s':>12} {'padded tok/s':>12} "
              f"{'vs ragged':>9} {'vs padded':>9} {'tok/rnd':>7}")
        for r in batched:
            print(f"{r['label']:<10} {r['case']:<17} {r['b']:>3} {r['k']:>2} {r['tok_s']:>8.1f} {r['ragged_tok_s']:>12.1f} "
                  f"{r['padded_tok_s']:>12.1f} {r['vs_ragged']:>8.2f}x {r['vs_padded']:>8.2f}x {r['tok_round']:>7.2f}")
    for r in rows:
        if r.get("case") == "plain" and r.get("floor_ms"):
            print(f"{r['label']}: plain step {r['round_ms']:.2f} ms against its byte floor {r['floor_ms']:.2f} ms "
                  f"({r['x_floor']:.2f}x; {r['tok_s']:.1f} tok/s)")
    lines = project(rows, layers)
    if lines:
        print()
        print("\n".join(lines))
    if failed:
        print(f"FAILED checks: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
