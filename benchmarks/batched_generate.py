"""Speculative decoding beyond one GPU and beyond batch 1, against plain `generate`.

Builds a V4-Flash-shaped multi-layer target (random bf16 weights, drawn fresh each run)
spread over every visible GPU with accelerate's `dispatch_model` (embedding and the first
layers on cuda:0, the last layers, head and MTP on the last GPU), then in one run:

1. greedy equality: plain `target.generate`, `target.generate(assistant_model=mtp)` and
   `speculative_generate` give the same tokens;
2. per-round cost of assisted generation on the split target vs a plain decode step;
3. tokens/s of `speculative_generate` for B = 1, 4, 16 ragged prompts against plain
   batched (left-padded) `generate`, with the random MTP (acceptance ~0: the cost of a
   rejected round) and with oracle drafts (the MTP runs as usual, but its drafts are
   replaced by the known greedy continuation: acceptance 1, the best case);
4. the same B sweep on the trained demo pair (real acceptance, tiny and launch-bound).

    python benchmarks/batched_generate.py --out $OUT            # 4 layers, ~55 GB of GPU memory
    python benchmarks/batched_generate.py --tiny                 # smoke run (CPU or GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_split_target, left_pad, wall  # noqa: E402

from dsv4_mtp_hf import load_demo_pair  # noqa: E402
from dsv4_mtp_hf.generation import speculative_generate  # noqa: E402
from dsv4_mtp_hf.generation.mtp_batch import MtpBatch  # noqa: E402


class OracleDrafts:
    """Replaces the MTP's drafts by the known greedy continuation (the MTP still runs)."""

    def __init__(self, truth: list[list[int]]):
        self.truth, self.original = truth, MtpBatch.draft

    def __enter__(self):
        truth, original = self.truth, self.original

        def draft(drafter, seqs, budgets):
            real, dists = original(drafter, seqs, budgets)  # greedy here: dists are None
            out = []
            for i, d in zip(seqs, real):
                n = len(drafter.call.new[i])
                out.append(truth[i][n : n + len(d)])
            return out, dists

        MtpBatch.draft = draft

    def __exit__(self, *exc):
        MtpBatch.draft = self.original


def sweep(target, mtp, prompt_lens, batches, new_tokens, k, repeats, gen, label, rows, checks,
          attentions=("batched",)):
    """Per batch size: plain batched ``generate`` once, then ``speculative_generate`` with each
    target attention in ``attentions`` (random-MTP drafts and oracle drafts), all in one run."""
    embed_dev = target.get_input_embeddings().weight.device
    vocab = target.config.vocab_size
    for b in batches:
        print(f"[{label}] B={b}", flush=True)
        prompts = [torch.randint(3, vocab, (prompt_lens[i % len(prompt_lens)],), generator=gen) for i in range(b)]
        ids, mask = left_pad(prompts, 0, embed_dev)
        t_plain = wall(lambda: target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0), repeats)
        plain_b = target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0)[:, ids.shape[1]:].cpu()
        # Against per-sequence plain greedy (the first 4 sequences): bf16 kernels round
        # differently at different batch shapes, so on the GPU a near-tie can flip.
        n_ref = min(b, 4)
        refs = [target.generate(prompts[i][None].to(embed_dev), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False)[0, prompts[i].numel():].tolist() for i in range(n_ref)]
        checks[f"{label} B={b}: padded batch equal to per-sequence plain greedy (of {n_ref})"] = sum(
            refs[i] == plain_b[i].tolist() for i in range(n_ref))
        for attn in attentions:
            kw = dict(max_new_tokens=new_tokens, num_assistant_tokens=k, eos_token_id=[], target_attention=attn)
            out = speculative_generate(target, mtp, prompts, **kw)
            truth = [t.tolist() for t in out.new_tokens]
            t_spec = wall(lambda: speculative_generate(target, mtp, prompts, **kw), repeats)
            acc = sum(s.accepted for s in out.stats) / max(1, sum(s.drafted for s in out.stats))
            print(f"[{label}] B={b}, {attn} attention: oracle drafts", flush=True)
            with OracleDrafts(truth):
                oracle = speculative_generate(target, mtp, prompts, **kw)
                t_oracle = wall(lambda: speculative_generate(target, mtp, prompts, **kw), repeats)
            same = {"spec": sum(refs[i] == truth[i] for i in range(n_ref)),
                    "oracle": sum(refs[i] == oracle.new_tokens[i].tolist() for i in range(n_ref))}
            name = f"{label} B={b}, {attn} attention: sequences equal to per-sequence plain greedy (of {n_ref})"
            checks[name] = same
            real_len = statistics.mean(s.mean_accepted_length for s in out.stats)
            oracle_len = statistics.mean(s.mean_accepted_length for s in oracle.stats)
            tok = b * new_tokens
            rows.append((f"{label}, {attn}", b, tok / t_plain, tok / t_spec, real_len, acc, tok / t_oracle, oracle_len))
            print(rows[-1], same, flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="target weights; float32 makes the greedy-equality checks immune to bf16 near-ties "
                        "(kernels of different batch shapes round differently)")
    p.add_argument("--no-demo", action="store_true", help="skip the demo-pair sweep")
    p.add_argument("--attention", default="batched,per_sequence",
                   help="target attentions of speculative_generate to time side by side (comma list)")
    args = p.parse_args()
    seed = int(time.time())
    gen = torch.Generator().manual_seed(seed)
    batches = [int(b) for b in args.batches.split(",")]
    attentions = tuple(a for a in args.attention.split(",") if a)
    checks, rows, info = {}, [], {"seed": seed}
    with torch.no_grad():
        target, mtp, device_map = build_split_target(args.layers, args.tiny, gen, getattr(torch, args.dtype))
        info["target dtype"] = args.dtype
        info["devices"] = sorted({str(v) for v in device_map.values()})
        info["device_map"] = device_map
        embed_dev = target.get_input_embeddings().weight.device
        vocab = target.config.vocab_size

        # 1. greedy equality on the split target, and 2. per-round cost.
        prompt = torch.randint(3, vocab, (1, 100), generator=gen).to(embed_dev)
        kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None)
        plain = target.generate(prompt, **kw)
        assisted = target.generate(prompt, assistant_model=mtp, num_assistant_tokens=args.k, **kw)
        batched = speculative_generate(target, mtp, [prompt[0].cpu()], max_new_tokens=args.new_tokens,
                                       num_assistant_tokens=args.k, eos_token_id=[])
        checks["split target: assisted == plain greedy"] = bool(torch.equal(assisted, plain))
        checks["split target: speculative_generate == plain greedy"] = bool(
            torch.equal(batched.new_tokens[0], plain[0, 100:].cpu()))
        t_plain = wall(lambda: target.generate(prompt, **kw), args.repeats)
        t_assist = wall(lambda: target.generate(prompt, assistant_model=mtp, num_assistant_tokens=args.k, **kw),
                        args.repeats)
        rounds = mtp.last_generation_stats.rounds
        info["plain ms per token"] = 1e3 * t_plain / args.new_tokens
        info["assisted ms per round"] = 1e3 * t_assist / max(1, rounds)
        info["assisted rounds"] = rounds
        print(json.dumps(info, default=str), {k_: v for k_, v in checks.items()}, flush=True)

        # 3. the B sweep on the V4-shaped split target.
        sweep(target, mtp, (64, 100, 150, 200), batches, args.new_tokens, args.k, args.repeats, gen,
              f"V4-shaped, {args.layers} layers, {args.dtype}", rows, checks, attentions)
        target = mtp = None  # free the V4-shaped pair before loading the demo pair
        torch.cuda.empty_cache() if torch.cuda.is_available() else None

        # 4. the demo pair (real acceptance).
        if not args.no_demo:
            dev = "cuda:0" if torch.cuda.is_available() else "cpu"
            dt, dm, _ = load_demo_pair(device=dev)
            sweep(dt, dm, (40, 64, 90), batches, args.new_tokens, args.k, args.repeats, gen, "demo pair", rows, checks,
                  attentions)

    print("\n" + json.dumps(info, indent=1, default=str))
    for k_, v in checks.items():
        print(f"check: {k_}: {v}")
    print(f"\n{'model':<44} {'B':>3} {'plain tok/s':>11} {'spec tok/s':>10} {'tok/round':>9} {'acc':>5} "
          f"{'oracle tok/s':>12} {'tok/round':>9}")
    for label, b, tp, ts, rl, acc, to, ol in rows:
        print(f"{label:<44} {b:>3} {tp:>11.1f} {ts:>10.1f} {rl:>9.2f} {acc:>5.2f} {to:>12.1f} {ol:>9.2f}")
    if args.out:
        with open(os.path.join(args.out, "batched_generate.json"), "w") as f:
            json.dump({"info": info, "checks": checks, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
