#!/usr/bin/env python3
"""What a sampled round pays to warp and draw: transformers' warpers, the draft's ``sampling.draft_draw`` and
the verify's warp + ``speculative_accept`` on ``[rows, 129280]`` fp32 logits, eager and as a CUDA graph.

One command on the GPU::

    PYTHONPATH=src python3 benchmarks/sampling_warp.py --out $OUT

Warpers: temperature 0.6, top-k 50, top-p 0.95 (``e2e_generate.py --sample``).  Each case is timed eagerly
(after 10 calls) and as a CUDA graph of one call (``attention_op.graphed_us``): CUDA events, median of ``--iters``.
Prints a table and writes ``sampling_warp.txt`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graphed_us  # noqa: E402  (a CUDA graph of the call, median per replay)
from dsv4_mtp_hf.generation import sampling  # noqa: E402

VOCAB = 129280


def eager_us(fn, iters: int) -> float:
    """Median µs of one eager call (launches included), CUDA events around each."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args()
    torch.manual_seed(0)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.6), TopKLogitsWarper(50), TopPLogitsWarper(0.95)])
    rows = []
    for n in (1, 4):
        x = torch.randn(n, VOCAB, device="cuda") * 3
        cases = {
            "torch.sort": lambda: x.sort(-1, descending=True),
            "torch.topk(50)": lambda: x.topk(50, -1),
            "transformers warp + softmax + draw": lambda: sampling.draw(sampling.warp(warpers, x).softmax(-1)),
            "draft_draw": lambda: sampling.draft_draw(warpers, x),
        }
        if n > 1:  # a verify of n rows after n - 1 drafts
            q = sampling.warp(warpers, x[: n - 1]).softmax(-1)[None]
            drafts = sampling.draw(q[0])[None]
            cases["verify: warp + softmax + speculative_accept"] = lambda: sampling.speculative_accept(
                drafts, q, sampling.warp(warpers, x).softmax(-1)[None])
        for name, fn in cases.items():
            rows.append((n, name, eager_us(fn, args.iters), graphed_us(fn, 1, args.iters)))
    lines = [f"{torch.cuda.get_device_name()}, vocabulary {VOCAB}, median of {args.iters}",
             f"{'rows':>4} | {'case':44} | eager us | graphed us"]
    lines += [f"{n:>4} | {name:44} | {e:8.1f} | {g:10.1f}" for n, name, e, g in rows]
    print("\n".join(lines))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "sampling_warp.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
