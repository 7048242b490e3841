#!/usr/bin/env python3
"""The FP4 MoE kernels at one T, one launch each between cudaProfilerStart/Stop, for Nsight
Compute: where a kernel's time goes (stall reasons, DRAM bytes and throughput, occupancy).

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        python3 benchmarks/moe_ncu.py --t 1

Profiled, after a warm-up (Triton compilation) outside the profiled range: the op as
registered (``dsv4_mtp::fp4_moe``), the FMA-GEMV variant ``gv32`` of ``moe_op.py``'s SWEEP,
and ``moe_op.py``'s read probe (the chosen experts' bytes read in two launches, no math).
ncu flushes the caches before each profiled launch by default, so each reads from DRAM.

Any SWEEP entry profiles with ``--variants``, e.g. the fp16 mma.sync path (``fp4_moe_hmma``)
against the fp16x2 GEMV: ``--variants hm,hm_pf2,hg32``; its kernels are ``_x_f16_kernel`` (the
activation prologue, ~1 us), ``_gate_up_hmma_kernel`` and ``_down_hmma_kernel`` (add
``--kernel-name regex:hmma`` to ncu to profile only those).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_op  # noqa: E402  (the benchmark's data builders, variants and read probe)

from dsv4_mtp_hf.ops import fp4_moe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--t", type=int, default=1)
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--variants", default="gv32", help="comma list of moe_op.SWEEP names to profile too")
    ap.add_argument("--probe-chunk", type=int, default=4096)
    args = ap.parse_args()
    from dsv4_mtp_hf.ops.triton import fp4_moe_triton as tri

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(int.from_bytes(os.urandom(4), "little"))
    W = moe_op.random_experts(256, 4096, 2048, args.fmt, dev, gen, same_w13_global=True)
    x, ids, rw = moe_op.random_inputs(args.t, 256, 6, 4096, dev, gen)
    calls = {"op": lambda: fp4_moe(x, ids, rw, *W, args.fmt, moe_op.LIMIT)}
    for name in [v for v in args.variants.split(",") if v]:
        calls[name] = lambda cfg=moe_op.SWEEP[name]: tri.fp4_moe_triton(x, ids, rw, *W, args.fmt, moe_op.LIMIT, config=cfg)
    calls["read probe"] = moe_op.read_probe_runner(W, ids, args.probe_chunk)
    for fn in calls.values():  # compile and warm up outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in calls.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(calls), f"at T={args.t}, {args.fmt}")


if __name__ == "__main__":
    main()
