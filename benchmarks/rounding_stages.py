"""Where two roundings of one MTP draft step part: every stage's output, path against path.

One draft step on random V4-Flash-sized weights (``draft_step.random_pair``), run as
* ``fp32``: the reference path with every bf16 weight upcast and fp32 activations (the "truth"),
* ``bf16``: the reference path as a user runs it (bf16 weights and activations, PyTorch mHC/router),
* ``fast`` (CUDA only): the same eager step with the fused mHC/router kernels, the FP4 MoE op and
  ``--attention`` (``flashinfer`` or ``reference``),
with a forward hook on every module up to three levels deep.  For each stage it prints the median and
max (over the batch) relative error of bf16 vs fp32, fast vs fp32 and fast vs bf16, then how often the
greedy tokens agree.  A bf16 rounding adds ~1.7e-3 relative error; where a stage's column jumps by more,
that stage amplifies what it is given.

    python benchmarks/rounding_stages.py --experts 32            # CPU, ~1 minute, ~12 GB of memory
    python benchmarks/rounding_stages.py --tiny                  # seconds: the script's smoke test
    python benchmarks/rounding_stages.py --device cuda --batch 64   # all three paths, V4-Flash shapes
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the random pair, cache and reference switches)


def stage_outputs(mtp, tok, res, paged, lengths) -> dict[str, torch.Tensor]:
    """fp32 copies of every hooked module's first tensor output, logits and greedy tokens of one step."""
    outs: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in mtp.named_modules():
        if name and name.count(".") <= 2:
            def keep(m, i, o, name=name):
                o = o[0] if isinstance(o, tuple) else o
                if torch.is_tensor(o):
                    outs[name] = o.detach().float().clone()
            hooks.append(mod.register_forward_hook(keep))
    try:
        paged.seq_lengths.copy_(lengths)
        with torch.no_grad():
            t, logits, _ = mtp.draft_step(tok, res, paged, False)
    finally:
        for h in hooks:
            h.remove()
        paged.seq_lengths.copy_(lengths)
    outs["logits"] = logits.float()
    outs["token"] = t.view(-1)
    return outs


def rel_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative error of ``a`` against ``b`` per batch row (the first dim)."""
    a, b = a.flatten(1) if a.dim() > 1 else a[:, None], b.flatten(1) if b.dim() > 1 else b[:, None]
    return (a - b).norm(dim=1) / b.norm(dim=1).clamp(min=1e-30)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tiny", action="store_true", help="the small smoke-test shapes of draft_step.py")
    p.add_argument("--experts", type=int, default=None, help="routed experts (default: the config's, 256 at "
                   "V4-Flash size; fewer fit a CPU's memory)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=32, help="cached positions before the draft row")
    p.add_argument("--attention", default="flashinfer", choices=["flashinfer", "reference"],
                   help="the fast path's attention backend (CUDA)")
    p.add_argument("--seed", type=int, default=None, help="default: fresh")
    return p.parse_args(argv)


def measure(args: argparse.Namespace):
    """``(seed, routed experts, {path: {stage: output}}, the compared pairs)``: one draft step's stages on the fp32 reference,
    the bf16 reference and (CUDA) the fast path, on the same random MTP, cache, token and residual."""
    dev = torch.device(args.device)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    _, mtp = common.random_pair(args.tiny, dev, gen, experts=args.experts)  # the MTP holds its target
    paged, _, _, lengths = common.prefilled_paged_cache(mtp, args.batch, args.context, gen)
    c = mtp.config
    tok = torch.randint(0, c.vocab_size, (args.batch, 1), device=dev, generator=gen)
    res = torch.randn(args.batch, 1, c.hc_mult, c.hidden_size, device=dev, generator=gen, dtype=torch.bfloat16)

    with common.fp32_reference(mtp):
        paths = {"fp32": stage_outputs(mtp, tok, res, paged, lengths)}
    with common.hand_written_kernels(False), common.reference_experts(mtp):
        paths["bf16"] = stage_outputs(mtp, tok, res, paged, lengths)
    if dev.type == "cuda":
        mtp.config.attention_backend = args.attention
        try:
            paths["fast"] = stage_outputs(mtp, tok, res, paged, lengths)
        finally:
            mtp.config.attention_backend = "reference"
    pairs = [("bf16", "fp32")] + ([("fast", "fp32"), ("fast", "bf16")] if "fast" in paths else [])
    return seed, c.n_routed_experts, paths, pairs


def errors(paths, pairs) -> dict[str, list[tuple[float, float] | None]]:
    """Per stage, per pair: the (median, max) relative error over the batch rows (None: a stage a path skips,
    e.g. the experts module under the fused MoE op)."""
    out = {}
    for name in paths["fp32"]:
        if name == "token":
            continue
        out[name] = []
        for a, b in pairs:
            if name in paths[a] and name in paths[b] and paths[a][name].shape == paths[b][name].shape:
                r = rel_rows(paths[a][name], paths[b][name])
                out[name].append((float(r.median()), float(r.max())))
            else:
                out[name].append(None)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    seed, experts, paths, pairs = measure(args)
    print(f"seed {seed}; {args.device}; experts {experts}; batch {args.batch}; context {args.context}"
          + (f"; fast path attention {args.attention}" if "fast" in paths else ""))
    print(f"{'stage':38s} {'shape':>20s} {'rms':>9s}  " + "  ".join(f"{a + ' vs ' + b:>19s}" for a, b in pairs))
    print(f"{'':38s} {'':>20s} {'':>9s}  " + "  ".join(f"{'median':>9s} {'max':>9s}" for _ in pairs))
    for name, errs in errors(paths, pairs).items():
        want = paths["fp32"][name]
        cols = [f"{e[0]:9.2e} {e[1]:9.2e}" if e else f"{'-':>9s} {'-':>9s}" for e in errs]
        print(f"{name:38s} {str(tuple(want.shape)):>20s} {want.pow(2).mean().sqrt():9.3e}  " + "  ".join(cols))
    n = args.batch
    print("same greedy token: " + ", ".join(
        f"{a} vs {b} {int((paths[a]['token'] == paths[b]['token']).sum())}/{n}" for a, b in pairs))
    top2 = paths["fp32"]["logits"].topk(2, dim=-1).values
    gap = (top2[:, 0] - top2[:, 1]).sort().values
    print(f"fp32 top-2 logit gaps: median {gap[n // 2]:.3f}, smallest {', '.join(f'{g:.4f}' for g in gap[:4].tolist())}; "
          f"logits rms {paths['fp32']['logits'].pow(2).mean().sqrt():.3f}")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
