#!/usr/bin/env python3
"""``dsv4_mtp::hc_pre`` / ``dsv4_mtp::hc_head`` (Triton) at V4 draft-step shapes, launched with and
without programmatic dependent launch (``ops/triton/pdl.py``), side by side.

One command on the GPU::

    PYTHONPATH=src python3 benchmarks/hc_op.py --out $OUT

n=4 streams, D=4096, ITERS=20, bf16 x, T in {1, 4, 16} tokens, fresh random inputs.  For each
setting, first a check of the CUDA implementation against the float64 reference (tolerances of
tests/test_hyper_connection.py: y rtol 8e-3, post/comb rtol 1e-5 atol 1e-6); then the time: a
CUDA graph of ``--calls`` op calls back to back, CUDA events around each replay, median of
``--iters`` replays, per call (``attention_op.graphed_us``).  Both launches are in the time
(``_mix_partial_kernel`` + ``_finish_kernel``).  ``finish`` is the finishing kernel's autotuned
config for ``hc_pre``.  Prints a table and writes ``hc_op.json`` and ``hc_op.txt`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import triton  # noqa: E402

from common import graphed_us  # noqa: E402  (CUDA graph of calls back to back, median per call)
from dsv4_mtp_hf.ops.hyper_connection import hc_head_op, hc_head_reference, hc_pre_op, hc_pre_reference  # noqa: E402
from dsv4_mtp_hf.ops.triton import hyper_connection_triton as hct  # noqa: E402
from dsv4_mtp_hf.ops.triton import pdl  # noqa: E402

N, D, ITERS, HC_EPS, RMS_EPS = 4, 4096, 20, 1e-6, 1e-6
SETTINGS = [("pdl", True)]  # PDL is always on where the GPU supports it


def inputs(t, gen):
    dev = "cuda"
    x = torch.randn(t, N, D, device=dev, generator=gen).bfloat16()
    fn = torch.randn((2 + N) * N, N * D, device=dev, generator=gen) * (2 / (N * D) ** 0.5)
    base = torch.randn((2 + N) * N, device=dev, generator=gen)
    scale = torch.rand(3, device=dev, generator=gen) + 0.5
    hfn = torch.randn(N, N * D, device=dev, generator=gen) * (2 / (N * D) ** 0.5)
    hbase, hscale = torch.randn(N, device=dev, generator=gen), torch.rand(1, device=dev, generator=gen) + 0.5
    return x, (fn, base, scale), (hfn, hbase, hscale)


def check(x, pre_w, head_w):
    """Max abs errors (y, post, comb, head y) of the CUDA implementation vs float64; whether they are
    within the test tolerances and the op (what is timed) returns the same bits; the finish config."""
    y, post, comb = hct._hc_pre_cuda(x, *pre_w, ITERS, HC_EPS, RMS_EPS)
    finish = str(hct._finish_kernel.best_config)
    yh = hct._hc_head_cuda(x, *head_w, HC_EPS, RMS_EPS)
    same = all(torch.equal(a, b) for a, b in zip(hc_pre_op(x, *pre_w, ITERS, HC_EPS, RMS_EPS), (y, post, comb)))
    same = same and torch.equal(hc_head_op(x, *head_w, HC_EPS, RMS_EPS), yh)
    want = [w.double() for w in hc_pre_reference(x.double(), *(w.double() for w in pre_w), ITERS, HC_EPS, RMS_EPS)]
    want_h = hc_head_reference(x.double(), *(w.double() for w in head_w), HC_EPS, RMS_EPS)
    got, ref = (y, post, comb, yh), (*want, want_h)
    tol = ((8e-3, 1e-5), (1e-5, 1e-6), (1e-5, 1e-6), (8e-3, 1e-5))  # (rtol, atol)
    errs = [float((g.double() - r).abs().max()) for g, r in zip(got, ref)]
    ok = same and all(bool(torch.isfinite(g).all()) and torch.allclose(g.double(), r, rtol=rt, atol=at)
                      for g, r, (rt, at) in zip(got, ref, tol))
    return errs, ok, finish


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,4,16")
    p.add_argument("--iters", type=int, default=50, help="timed replays (median)")
    p.add_argument("--calls", type=int, default=20, help="calls back to back in one graph")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(int(time.time()))
    head = (f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
            f"n={N} D={D} ITERS={ITERS} bf16")
    print(head, flush=True)
    rows = []
    for t in [int(v) for v in args.tokens.split(",")]:
        x, pre_w, head_w = inputs(t, gen)
        for label, on in SETTINGS:
            errs, ok, finish = check(x, pre_w, head_w)
            pre_us = head_us = float("nan")
            if ok:
                pre_us = graphed_us(lambda: hc_pre_op(x, *pre_w, ITERS, HC_EPS, RMS_EPS), args.calls, args.iters)
                head_us = graphed_us(lambda: hc_head_op(x, *head_w, HC_EPS, RMS_EPS), args.calls, args.iters)
            rows.append(dict(T=t, setting=label, hc_pre_us=pre_us, hc_head_us=head_us, ok=ok, finish=finish,
                             max_err=dict(zip(("y", "post", "comb", "head_y"), errs))))
            print(f"T={t:<3} {label:<6} hc_pre {pre_us:6.2f} us  hc_head {head_us:6.2f} us  ok {ok}  "
                  f"errs y {errs[0]:.1e} post {errs[1]:.1e} comb {errs[2]:.1e} head {errs[3]:.1e}  finish {finish}",
                  flush=True)
    by = {(r["T"], r["setting"]): r for r in rows}
    lines = [head, f"µs per call, CUDA graph of {args.calls} calls back to back, median of {args.iters} replays",
             f"{'T':>3} {'hc_pre PDL':>11} {'no PDL':>8} {'saved':>6} {'head PDL':>9} {'no PDL':>8}  checks"]
    for t in sorted({r["T"] for r in rows}):
        s, g = by[(t, "PDL")], by[(t, "no PDL")]
        checks = "ok" if s["ok"] and g["ok"] else "FAILED CHECK"
        saved = g["hc_pre_us"] - s["hc_pre_us"]
        lines.append(f"{t:>3} {s['hc_pre_us']:>11.2f} {g['hc_pre_us']:>8.2f} {saved:>6.2f} "
                     f"{s['hc_head_us']:>9.2f} {g['hc_head_us']:>8.2f}  {checks}")
    table = "\n".join(lines)
    print("\n" + table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hc_op.txt"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "hc_op.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__, n=N,
                       D=D, iters_sinkhorn=ITERS, calls=args.calls, iters=args.iters, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
