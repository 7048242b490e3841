#!/usr/bin/env python3
"""``dsv4_mtp::window_attention`` (Triton) at V4-Flash draft-step shapes: split-key settings vs the
unsplit kernel vs the reference path.

One command on the GPU::

    PYTHONPATH=src python benchmarks/attention_op.py --out $OUT

H=64 heads, d=512, window 128, L=128 keys (127 held + the new one), one query row per sequence,
B in {1, 4, 16}, bf16, fresh random inputs with masked cache rows (the first third of sequence
0's rows before its start).  For each setting of ``attention_triton.CONFIG`` (``--settings``):

* first a check: NaN-poisoned output against the fp32 reference (rel. Frobenius error < 1e-2,
  every element written), and the same call inside a CUDA graph equal to eager (bit for bit);
* then the time: a CUDA graph of ``--calls`` calls back to back, replayed after warm-up, CUDA
  events around each replay, median of ``--iters`` replays, reported per call.  The inputs
  (0.2 MB at B=1, 3 MB at B=16) stay in the L2, as the new key and the query do in a draft step.

Settings: ``unsplit/lS/wW`` is the single-kernel path (``keys_per_program=0``) with S keys per
step on W warps (``unsplit/l32/w4``: the kernel as it was before the split, the x column's base);
``kK/hH/ticket|kernel`` splits the keys in ranges of K over programs of H heads, combined by the
last program (ticket) or a second launch; ``auto`` is the default ``CONFIG`` (``pick_config``);
``reference`` the op's reference math (fp32 einsums).
Prints a table last and writes ``attention_op.json`` to ``--out``.
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
from common import graphed_us  # noqa: E402  (CUDA graph of calls back to back, median per call)

from dsv4_mtp_hf.ops.attention import sliding_window_attention_reference  # noqa: E402
from dsv4_mtp_hf.ops.triton import attention_triton as at  # noqa: E402

H, D, WINDOW = 64, 512, 128
L = WINDOW  # (W-1) held keys + the new one


def inputs(b, gen):
    q = torch.randn(b, 1, H, D, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(b, L, D, device="cuda", generator=gen).bfloat16()
    start = torch.randint(WINDOW, 4 * WINDOW, (b, 1), device="cuda", generator=gen)
    kv_pos = start - L + 1 + torch.arange(L, device="cuda")
    kv_pos[0, : L // 3] = -(1 << 40)
    sinks = torch.randn(H, device="cuda", generator=gen)
    return q, kv, start, kv_pos, sinks


def settings(names: str | None):
    """(label, config) pairs; config None = the reference path.  The kernel has one configuration per
    shape (``attention_triton.pick_config``)."""
    s = [("auto", {}), ("reference", None)]
    if names:
        keep = names.split(",")
        s = [x for x in s if x[0] in keep]
    return s


def check(fn, want):
    """rel. error vs the fp32 reference (output poisoned with NaN first) and graph replay == eager."""
    out = torch.full((want.shape), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = fn(out)
    torch.cuda.synchronize()
    finite = bool(torch.isfinite(got).all())
    rel = float((got.float() - want).norm() / want.norm())
    gout = torch.full_like(out, float("nan"))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(gout)
    g.replay()
    g.replay()  # twice: the tickets must be back at 0 after each
    torch.cuda.synchronize()
    return rel, finite, bool(torch.equal(gout, got))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--iters", type=int, default=50, help="timed replays (median)")
    p.add_argument("--calls", type=int, default=20, help="calls back to back in one graph")
    p.add_argument("--settings", default=None, help="comma-separated labels (default: all)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(int(time.time()))
    scale = D**-0.5
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, H={H} d={D} window={WINDOW} L={L}",
          flush=True)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        q, kv, qp, kp, sinks = inputs(b, gen)
        want = sliding_window_attention_reference(q.float(), kv.float(), qp, kp, sinks, WINDOW, scale)
        for label, cfg in settings(args.settings):
            if cfg is None:
                def run(out=None):
                    r = sliding_window_attention_reference(q, kv, qp, kp, sinks, WINDOW, scale)
                    return r if out is None else out.copy_(r)
                launch = "torch"
            else:
                def run(out=None):
                    return at.window_attention_triton(q, kv, qp, kp, sinks, WINDOW, scale, out=out)
                kpp, bl, nw = at.pick_config(b, H, L, D)
                splits = -(-L // kpp) if kpp else 1
                launch = f"grid ({b},{H // at.BLOCK_H},{splits}) k{kpp or L} l{bl} w{nw}" + (" ticket" if splits > 1 else "")
            try:
                rel, finite, graph_eq = check(run, want)
                ok = finite and rel < 1e-2 and graph_eq
                us = graphed_us(run, args.calls, args.iters) if ok else float("nan")
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report, go on
                print(f"B={b} {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            row = dict(B=b, setting=label, config=cfg, launch=launch, us=us, rel_err=rel, finite=finite,
                       graph_equals_eager=graph_eq)
            rows.append(row)
            print(f"B={b:<3} {label:<18} {us:7.2f} us  rel err {rel:.1e}  finite {finite}  graph==eager {graph_eq}  "
                  f"{launch}", flush=True)
    base = {r["B"]: r["us"] for r in rows if r["setting"] == "unsplit/l32/w4"}
    with open(os.path.join(args.out, "attention_op.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, H=H, d=D, window=WINDOW, L=L,
                       calls=args.calls, iters=args.iters, rows=rows), f, indent=2)
    print(f"\nµs per call, CUDA graph of {args.calls} calls back to back, median of {args.iters} replays; "
          "x = unsplit/l32/w4 (the previous kernel) / this")
    print(f"{'B':>3} {'setting':<18} {'us':>7} {'x':>5} {'rel err':>8}  launch")
    for r in rows:
        x = base.get(r["B"], float("nan")) / r["us"]
        bad = "" if r["finite"] and r["rel_err"] < 1e-2 and r["graph_equals_eager"] else "  FAILED CHECK"
        print(f"{r['B']:>3} {r['setting']:<18} {r['us']:>7.2f} {x:>5.2f} {r['rel_err']:>8.1e}  {r['launch']}{bad}")


if __name__ == "__main__":
    main()
