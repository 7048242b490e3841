#!/usr/bin/env python3
"""Host time of one forward's plan (``BatchedTargetState.plan`` + ``host_flat``): the index
arithmetic that runs on the CPU before every step of the graphed target (batch 1) and every
forward of ``speculative_generate`` (batch B).  It is on the critical path of a graphed decode step,
whose GPU part at V4-Flash shape is ~0.3 ms per layer.  V4-Flash's default config (window 128, CSA rate
4, HCA rate 128); sequences at 1000 tokens; median of ``--iters`` after a warm-up.

    python benchmarks/host_plan.py
"""

from __future__ import annotations

import argparse
import statistics
import time

from transformers import DeepseekV4Config

from dsv4_mtp_hf.target_runtime.batched_state import BatchedTargetState


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=300)
    args = p.parse_args()
    cfg = DeepseekV4Config(num_hidden_layers=2, layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                           mlp_layer_types=["hash_moe", "moe"])
    print("| batch | rows per sequence | fixed shapes (graphed) | plan µs |")
    print("|---|---|---|---|")
    for b, n, capacity in ((1, 1, 4096), (1, 4, 4096), (16, 4, None)):
        state = BatchedTargetState(cfg, b, max_rollback=8, capacity=capacity)
        state.lengths = [1000] * b
        state.high = [1000] * b
        slots = list(range(b))
        times = []
        for i in range(args.iters + 20):
            t = time.perf_counter()
            state.plan(slots, [n] * b).host_flat()
            if i >= 20:
                times.append(time.perf_counter() - t)
        print(f"| {b} | {n} | {'yes' if capacity else 'no'} | {1e6 * statistics.median(times):.0f} |")


if __name__ == "__main__":
    main()
