"""How often two roundings of the same MTP math pick the same greedy draft on a trained model.

The trained demo pair (``dsv4_mtp_hf.load_demo_pair``) drafts K tokens from windows of its held-out
stdlib modules: the target runs once in bf16, and its residuals feed the MTP in bf16 and in fp32
(the same weights; fp4 experts packed either way).  A draft position counts while every earlier
draft of its window agrees (the same prefix).  Prints the agreement and the fp32 path's top-2 logit
gaps: the near ties where any bf16 path (ours or the reference) may pick either token.

    python benchmarks/demo_rounding_agreement.py [--rounds 24 --batch 16 --context 96 --drafts 3 --device cpu]
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch

from dsv4_mtp_hf import load_demo_pair
from dsv4_mtp_hf.demo_pair import demo_pair_path


def held_out_streams(tokenizer, min_tokens: int) -> list[torch.Tensor]:
    """Token ids of the demo pair's held-out stdlib modules present in this Python (>= min_tokens each)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    streams = []
    for name in (demo_pair_path() / "heldout_files.txt").read_text().split():
        path = root / name
        if path.exists():
            ids = tokenizer(path.read_text(encoding="utf-8", errors="replace"), return_tensors="pt").input_ids[0]
            if ids.numel() >= min_tokens:
                streams.append(ids)
    if len(streams) < 4:
        raise SystemExit(f"only {len(streams)} held-out modules found under {root}: this Python's stdlib differs "
                         "from the one the demo pair was trained on.")
    return streams


def windows(streams, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    out = []
    for _ in range(batch):
        s = streams[int(torch.randint(len(streams), (1,), generator=gen))]
        o = int(torch.randint(s.numel() - length + 1, (1,), generator=gen))
        out.append(s[o:o + length])
    return torch.stack(out)


def target_residual(target, ids: torch.Tensor) -> torch.Tensor:
    """The target's pre-``hc_head`` residual ``[B, T, hc_mult, D]`` (what generation hands the MTP)."""
    got = []
    hook = target.model.hc_head.register_forward_pre_hook(lambda m, a: got.append(a[0]))
    try:
        with torch.no_grad():
            target(ids)
    finally:
        hook.remove()
    return got[0]


def drafts(mtp, ids: torch.Tensor, residual: torch.Tensor, context: int, k: int):
    """K greedy drafts ``[B, K]`` and their fp32 logits ``[B, K, V]`` after priming a paged cache with
    ``context`` rows (row p: residual p, token p + 1)."""
    residual = residual.to(mtp.dtype)
    cache = mtp.new_cache(paged=True, batch_size=ids.shape[0])
    with torch.no_grad():
        mtp(ids[:, 1:context + 1], residual[:, :context], past_key_values=cache)
        tok, res, toks, logits = ids[:, context + 1:context + 2], residual[:, context:context + 1], [], []
        for _ in range(k):
            tok, lg, res = mtp.draft_step(tok, res, cache, False)
            toks.append(tok)
            logits.append(lg.float())
    return torch.cat(toks, 1), torch.stack(logits, 1)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=96)
    ap.add_argument("--drafts", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    return ap.parse_args(argv)


def agreement(args: argparse.Namespace) -> dict:
    """bf16 against fp32 MTP drafts on held-out windows: ``same`` of ``counted`` draft positions (a position
    counts while the drafts before it agreed), the fp32 top-2 logit ``gaps``, the fp32 ``logits_rms`` and the
    number of held-out ``modules``."""
    target, mtp16, tokenizer = load_demo_pair(args.device, torch.bfloat16)
    _, mtp32, _ = load_demo_pair(args.device, torch.float32)
    streams = held_out_streams(tokenizer, args.context + 2)
    gen = torch.Generator().manual_seed(args.seed)
    same = counted = 0
    gaps = []
    for _ in range(args.rounds):
        ids = windows(streams, args.batch, args.context + 2, gen).to(args.device)
        res = target_residual(target, ids[:, :args.context + 1])
        d16, _ = drafts(mtp16, ids, res, args.context, args.drafts)
        d32, l32 = drafts(mtp32, ids, res, args.context, args.drafts)
        eq = (d16 == d32).cpu()
        valid = torch.cat([torch.ones(args.batch, 1, dtype=torch.bool), eq[:, :-1].long().cumprod(1).bool()], 1)
        same += int(eq[valid].sum())
        counted += int(valid.sum())
        top2 = l32.topk(2, dim=-1).values
        gaps.append((top2[..., 0] - top2[..., 1]).flatten().cpu())
    return dict(same=same, counted=counted, gaps=torch.cat(gaps), logits_rms=float(l32.pow(2).mean().sqrt()),
                modules=len(streams))


def main(argv: list[str] | None = None):
    args = parse(argv)
    r = agreement(args)
    same, counted = r["same"], r["counted"]
    q = r["gaps"].quantile(torch.tensor([0.01, 0.05, 0.5])).tolist()
    print(f"demo pair, {r['modules']} held-out modules, {args.rounds} x {args.batch} windows of {args.context} tokens, "
          f"K={args.drafts}, device {args.device}")
    print(f"bf16 MTP vs fp32 MTP, same bf16 target residuals: same greedy draft at {same}/{counted} positions "
          f"({100 * same / counted:.1f}%)")
    print(f"fp32 top-2 logit gap: 1% {q[0]:.4f}, 5% {q[1]:.4f}, median {q[2]:.3f}; logits rms "
          f"{r['logits_rms']:.2f}")


if __name__ == "__main__":
    main()
