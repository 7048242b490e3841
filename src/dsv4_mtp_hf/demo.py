"""`python -m dsv4_mtp_hf.demo`: plain greedy vs drafter-assisted greedy on a DeepSeek-V4 pair.

By default it runs the small V4 pair embedded in the package: a 2.75M-parameter target and its MTP,
trained from scratch on the Python standard library's source.  Its completions look like Python but mean
little (a model that small only learns the texture of code); what the demo shows is that the assisted
output is identical to plain greedy decoding and how many drafts the MTP gets accepted.  `--target` points
it at any other DeepSeek-V4 checkpoint, e.g. a release; the drafter it ships (MTP or DSpark) is read from
the same release unless `--drafter` names another.
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
    p.add_argument("--num-assistant-tokens", default="3", help="drafts per verify round (K), or 'auto'")
    p.add_argument("--target", default=None, help="target checkpoint (default: the embedded demo pair)")
    p.add_argument("--drafter", "--mtp", dest="drafter", default=None,
                   help="drafter checkpoint (default: the target's release, or the demo pair)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the demo's tiny models run fastest on one)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few code prompts")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per prompt and mode; the fastest counts")
    p.add_argument("--quiet", action="store_true", help="do not print the completions")
    return p.parse_args(argv)


def load(args):
    from .loading.detect import load_drafter

    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.target is None:
        from .demo_pair import load_demo_pair

        if args.drafter is not None:
            raise SystemExit("--drafter needs --target (the drafter must match its target).")
        return load_demo_pair(device=args.device, dtype=dtype or torch.float32)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype or torch.bfloat16, device_map=args.device).eval()
    drafter = load_drafter(args.drafter or args.target, target_model=target, dtype=dtype or torch.bfloat16,
                           device_map=args.device).eval()
    return target, drafter, AutoTokenizer.from_pretrained(args.target)


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


LEGEND = """\
Columns: plain tok/s and assisted tok/s are new tokens per second of `generate` without and with the
drafter (the fastest of --repeats runs), speedup their ratio, accepted len the tokens each verify round
added (accepted drafts + the target's own token), identical whether the assisted output equals plain
greedy token for token (it must).  On the CPU the tiny pair's forwards cost about the same whatever their
row count, so the speedup follows the accepted length only roughly."""


def _timed(target, ids, kw, repeats, device):
    best, out = float("inf"), None
    for _ in range(max(1, repeats)):
        _sync(device)
        start = time.perf_counter()
        out = target.generate(ids, **kw)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return out, best


def _run_prompt(args, target, drafter, tokenizer, text, kw, k, tot):
    ids = tokenizer(text, return_tensors="pt").input_ids.to(args.device)
    plain, plain_s = _timed(target, ids, kw, args.repeats, args.device)
    assisted, drafter_s = _timed(target, ids, {**kw, "assistant_model": drafter, "num_assistant_tokens": k},
                                 args.repeats, args.device)
    stats = drafter.last_generation_stats
    same = torch.equal(plain, assisted)
    n = plain.shape[1] - ids.shape[1]
    tot["plain_s"] += plain_s; tot["drafter_s"] += drafter_s; tot["tokens"] += n
    tot["rounds"] += stats.rounds; tot["acc"] += stats.accepted
    for i, (d, a) in enumerate(zip(stats.drafted_by_position, stats.accepted_by_position)):
        while len(tot["drafted"]) <= i:
            tot["drafted"].append(0); tot["accepted"].append(0)
        tot["drafted"][i] += d; tot["accepted"][i] += a
    if not args.quiet:
        completion = tokenizer.decode(assisted[0, ids.shape[1]:], skip_special_tokens=True)
        print(f"\n--- prompt ---\n{text}\n--- completion (identical to plain greedy: {same}) ---\n{completion}")
    return n / plain_s, n / drafter_s, stats.mean_accepted_length, same


def _report(rows, tot, args, k) -> bool:
    plain_tps, drafter_tps = tot["tokens"] / tot["plain_s"], tot["tokens"] / tot["drafter_s"]
    mean_len = (tot["acc"] + tot["rounds"]) / tot["rounds"] if tot["rounds"] else 0.0
    by_pos = [a / d if d else 0.0 for a, d in zip(tot["accepted"], tot["drafted"])]
    all_equal = all(r[3] for r in rows)
    print(f"\n{'prompt':>6} {'plain tok/s':>12} {'assisted tok/s':>15} {'speedup':>8} {'accepted len':>13} {'identical':>9}")
    for i, (p, m, length, same) in enumerate(rows):
        print(f"{i:>6} {p:>12.1f} {m:>15.1f} {m / p:>7.2f}x {length:>13.2f} {str(same):>9}")
    print(f"{'all':>6} {plain_tps:>12.1f} {drafter_tps:>15.1f} {drafter_tps / plain_tps:>7.2f}x {mean_len:>13.2f} "
          f"{str(all_equal):>9}")
    print(f"device={args.device} threads={torch.get_num_threads()} K={k} new tokens={tot['tokens']} "
          f"acceptance by draft position: [{', '.join(f'{p:.2f}' for p in by_pos)}]\n\n{LEGEND}")
    return all_equal


def main(argv=None) -> int:
    args = parse_args(argv)
    k = args.num_assistant_tokens if args.num_assistant_tokens == "auto" else int(args.num_assistant_tokens)
    if (k != "auto" and k < 1) or args.max_new_tokens < 1:
        raise SystemExit("--num-assistant-tokens must be >= 1 or 'auto', --max-new-tokens >= 1")
    if args.device == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"Loading {'the embedded demo pair' if args.target is None else args.target} on {args.device}...",
          file=sys.stderr)
    target, drafter, tokenizer = load(args)
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    warm = tokenizer(prompts[0], return_tensors="pt").input_ids.to(args.device)  # first calls allocate: not timed
    target.generate(warm, **{**kw, "max_new_tokens": 2})
    target.generate(warm, assistant_model=drafter, **{**kw, "max_new_tokens": 2})
    tot = {"plain_s": 0.0, "drafter_s": 0.0, "tokens": 0, "drafted": [], "accepted": [], "rounds": 0, "acc": 0}
    rows = [_run_prompt(args, target, drafter, tokenizer, text, kw, k, tot)
            for text in tqdm(prompts, desc="prompts (plain, then assisted)", unit="prompt", file=sys.stderr)]
    if not _report(rows, tot, args, k):
        print("ERROR: assisted greedy output differs from plain greedy output", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
