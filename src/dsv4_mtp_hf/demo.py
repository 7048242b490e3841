"""`python -m dsv4_mtp_hf.demo`: plain greedy vs MTP-assisted greedy on a DeepSeek-V4 pair.

By default it runs the small V4 pair embedded in the package (trained on the Python
standard library's source); `--target`/`--mtp` point it at any other checkpoint, e.g. a
real DeepSeek-V4 release (the MTP is read from the same release when `--mtp` is omitted).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from tqdm.auto import tqdm

DEFAULT_PROMPTS = (
    "def read_lines(path):\n    with open(path",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\n\n\ndef list_python_files(root):\n    result = []\n    for dirpath, dirnames, filenames in os.walk(root):\n",
    "    def __repr__(self):\n        return",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m dsv4_mtp_hf.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-assistant-tokens", type=int, default=3, help="drafts per verify round (K)")
    p.add_argument("--target", default=None, help="target checkpoint (default: the embedded demo pair)")
    p.add_argument("--mtp", default=None, help="MTP checkpoint (default: the target's release, or the demo pair)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few code prompts")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per prompt and mode; the fastest counts")
    p.add_argument("--quiet", action="store_true", help="do not print the completions")
    return p.parse_args(argv)


def load(args):
    from . import DeepseekV4MtpForCausalLM

    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.target is None:
        from .demo_pair import load_demo_pair

        if args.mtp is not None:
            raise SystemExit("--mtp needs --target (the draft must match its target).")
        return load_demo_pair(device=args.device, dtype=dtype or torch.float32)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype or torch.bfloat16, device_map=args.device).eval()
    mtp = DeepseekV4MtpForCausalLM.from_pretrained(args.mtp or args.target, target_model=target,
                                                   dtype=dtype or torch.bfloat16, device_map=args.device).eval()
    return target, mtp, AutoTokenizer.from_pretrained(args.target)


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.num_assistant_tokens < 1 or args.max_new_tokens < 1:
        raise SystemExit("--num-assistant-tokens and --max-new-tokens must be >= 1")
    target, mtp, tokenizer = load(args)
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    # Warm-up (first calls allocate and initialise), not timed.
    warm = tokenizer(prompts[0], return_tensors="pt").input_ids.to(args.device)
    target.generate(warm, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    target.generate(warm, assistant_model=mtp, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)

    rows, all_equal = [], True
    tot = {"plain_s": 0.0, "mtp_s": 0.0, "tokens": 0, "drafted": [], "accepted": [], "rounds": 0, "acc": 0}
    for text in tqdm(prompts, desc="prompts", unit="prompt", file=sys.stderr):
        ids = tokenizer(text, return_tensors="pt").input_ids.to(args.device)
        def timed(**extra):
            best, out = float("inf"), None
            for _ in range(max(1, args.repeats)):
                _sync(args.device)
                start = time.perf_counter()
                out = target.generate(ids, **kw, **extra)
                _sync(args.device)
                best = min(best, time.perf_counter() - start)
            return out, best

        plain, plain_s = timed()
        assisted, mtp_s = timed(assistant_model=mtp, num_assistant_tokens=args.num_assistant_tokens)
        stats = mtp.last_generation_stats
        same = torch.equal(plain, assisted)
        all_equal &= same
        n = plain.shape[1] - ids.shape[1]
        tot["plain_s"] += plain_s; tot["mtp_s"] += mtp_s; tot["tokens"] += n
        tot["rounds"] += stats.rounds; tot["acc"] += stats.accepted
        for i, (d, a) in enumerate(zip(stats.drafted_by_position, stats.accepted_by_position)):
            while len(tot["drafted"]) <= i:
                tot["drafted"].append(0); tot["accepted"].append(0)
            tot["drafted"][i] += d; tot["accepted"][i] += a
        rows.append((n / plain_s, n / mtp_s, stats.mean_accepted_length, same))
        if not args.quiet:
            completion = tokenizer.decode(assisted[0, ids.shape[1]:], skip_special_tokens=True)
            print(f"\n--- prompt ---\n{text}\n--- completion (identical to plain greedy: {same}) ---\n{completion}")

    plain_tps, mtp_tps = tot["tokens"] / tot["plain_s"], tot["tokens"] / tot["mtp_s"]
    mean_len = (tot["acc"] + tot["rounds"]) / tot["rounds"] if tot["rounds"] else 0.0
    by_pos = [a / d if d else 0.0 for a, d in zip(tot["accepted"], tot["drafted"])]
    print(f"\n{'prompt':>6} {'plain tok/s':>12} {'MTP tok/s':>10} {'speedup':>8} {'accepted len':>13} {'identical':>9}")
    for i, (p, m, L, same) in enumerate(rows):
        print(f"{i:>6} {p:>12.1f} {m:>10.1f} {m / p:>7.2f}x {L:>13.2f} {str(same):>9}")
    print(f"{'all':>6} {plain_tps:>12.1f} {mtp_tps:>10.1f} {mtp_tps / plain_tps:>7.2f}x {mean_len:>13.2f} {str(all_equal):>9}")
    print(f"device={args.device} K={args.num_assistant_tokens} new tokens={tot['tokens']} "
          f"acceptance by draft position: [{', '.join(f'{p:.2f}' for p in by_pos)}]")
    if not all_equal:
        print("ERROR: assisted greedy output differs from plain greedy output", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
