#!/usr/bin/env python
"""Train the small DeepSeek-V4 demo pair shipped in ``src/dsv4_mtp_hf/demo_pair``.

A real (tiny) V4 target -- transformers' ``DeepseekV4ForCausalLM`` mixing sliding, CSA
and HCA attention layers, hash-routed and score-routed MoE -- trained from scratch on the
Python standard library's own source, and our ``DeepseekV4MtpForCausalLM`` draft trained
with the MTP objective against the FROZEN target (SPEC §2), its routed experts finally
packed as FP4.

Stages (wall time of each is logged):

1. corpus   -- stdlib ``*.py`` (test dirs and generated codec tables excluded), split by a
               hash of the relative path: 1 file in 20 is held out for evaluation.
2. tokenizer-- byte-level BPE (``tokenizers``), saved as a transformers fast tokenizer.
3. target   -- AdamW on random 256-token windows; large matrices are then rounded to bf16
               (the precision they are saved in) so the MTP trains against the exact
               target that ships.
4. mtp      -- dense, differentiable stand-in for the FP4 experts; loss = distillation
               on the target's next-next-token distribution + data cross-entropy, plus a
               second recursive step that feeds the MTP's own residual back (K > 1).
5. quantise -- dense experts -> packed FP4 (``FP4Experts.set_expert``), then a short
               fine-tune of everything else with the (frozen) dequantised experts.
6. eval     -- target held-out loss; MTP held-out top-1 accuracy; offline greedy
               speculative decoding with the real packed MTP and its KV cache, giving
               the mean tokens per round at K = 1, 2, 3.
7. save     -- ``save_pretrained`` (safetensors) into ``--out/{target,mtp,tokenizer}``.

Deterministic for a given ``--seed`` on one device and thread count.  The shipped pair
was built with (≈ 20 min on a busy 2-core CPU: target ≈ 11.5 min, MTP ≈ 6 min)::

    python scripts/train_demo_pair.py --seed 0 --threads 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

from dsv4_mtp_hf import DeepseekV4MtpConfig, DeepseekV4MtpForCausalLM  # noqa: E402
from dsv4_mtp_hf.layers.moe import FP4Experts  # noqa: E402

EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings"}
HOLDOUT_BUCKETS = 20  # 1 bucket in 20 (5 %) is held out
T0 = time.time()


def log(*args):
    print(f"[{time.time() - T0:7.1f}s]", *args, flush=True)


# ----------------------------------------------------------------------------------------
# 1. corpus
# ----------------------------------------------------------------------------------------
def is_heldout(rel: str) -> bool:
    return hashlib.sha256(rel.encode()).digest()[0] % HOLDOUT_BUCKETS == 0


def stdlib_files() -> tuple[list[Path], list[Path], Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    train = [p for p in files if not is_heldout(p.relative_to(root).as_posix())]
    held = [p for p in files if is_heldout(p.relative_to(root).as_posix())]
    return train, held, root


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


# ----------------------------------------------------------------------------------------
# 2. tokenizer
# ----------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<bos>", "<eos>", "<pad>"],  # ids 0, 1, 2 = the V4 config defaults
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        model_max_length=4096, clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out_dir)
    return fast


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Concatenate documents as ``text <eos>`` (no bos inside the stream)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def batches(stream: torch.Tensor, n: int, batch: int, seq: int, gen: torch.Generator):
    for _ in range(n):
        starts = torch.randint(0, stream.numel() - seq, (batch,), generator=gen)
        yield torch.stack([stream[s : s + seq] for s in starts.tolist()])


def eval_windows(stream: torch.Tensor, count: int, seq: int) -> torch.Tensor:
    stride = max(seq, (stream.numel() - seq) // count)
    starts = list(range(0, stream.numel() - seq, stride))[:count]
    return torch.stack([stream[s : s + seq] for s in starts])


# ----------------------------------------------------------------------------------------
# 3. target
# ----------------------------------------------------------------------------------------
def target_config(args, vocab_size: int) -> DeepseekV4Config:
    h = args.hidden
    return DeepseekV4Config(
        vocab_size=vocab_size, hidden_size=h, moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=4, num_attention_heads=4, head_dim=64, q_lora_rank=64, o_groups=2, o_lora_rank=64,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        sliding_window=64, index_n_heads=8, index_head_dim=32, index_topk=16,
        partial_rotary_factor=0.25,  # rope dim 16 of head_dim 64
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "sliding_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        tie_word_embeddings=False,
    )


def build_target(cfg: DeepseekV4Config, seed: int) -> DeepseekV4ForCausalLM:
    torch.manual_seed(seed)
    target = DeepseekV4ForCausalLM(cfg)
    # Hash routing: a real random token -> expert assignment (top-k distinct experts).
    g = torch.Generator().manual_seed(seed + 17)
    for layer, kind in zip(target.model.layers, cfg.mlp_layer_types):
        if kind == "hash_moe":
            table = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                                 for _ in range(cfg.vocab_size)])
            layer.mlp.gate.tid2eid.copy_(table)
    return target


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(params, lr: float):
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def train_target(target, stream, args, device):
    target.train()
    opt = make_optimizer(target.parameters(), args.target_lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    t = time.time()
    ema = None
    for step, x in enumerate(batches(stream, args.target_steps, args.batch, args.seq, gen)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.target_steps, args.target_lr, args.warmup)
        x = x.to(device)
        loss = target(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0 or step == args.target_steps - 1:
            log(f"target step {step:4d} loss {loss.item():.3f} (ema {ema:.3f}) {(time.time() - t) / (step + 1):.2f}s/step")
    target.eval()


KEEP_FP32 = ("attn_hc", "ffn_hc", "hc_head", "norm", "layernorm", "sinks", "position_bias", "e_score_correction_bias")


def bf16_names(model) -> list[str]:
    """Large float matrices saved in bf16 (mHC, norms, sinks, biases stay fp32)."""
    return [n for n, p in model.named_parameters() if p.dim() >= 2 and not any(k in n for k in KEEP_FP32)]


@torch.no_grad()
def round_to_bf16_(model) -> None:
    params = dict(model.named_parameters())
    for n in bf16_names(model):
        params[n].copy_(params[n].bfloat16().float())


def bound_children(target):
    """Direct children of the target that are draft models (attached by ``mtp.bind``)."""
    return [(n, m) for n, m in target.named_children() if isinstance(m, DeepseekV4MtpForCausalLM)]


# ----------------------------------------------------------------------------------------
# residual capture (SPEC §7: pre-hc_head residual via a forward pre-hook)
# ----------------------------------------------------------------------------------------
class ResidualTap:
    def __init__(self, target):
        self.value = None
        self.handle = target.model.hc_head.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.value = args[0].detach()

    def remove(self):
        self.handle.remove()


@torch.no_grad()
def target_forward(target, tap: ResidualTap, x: torch.Tensor):
    """logits [B, S, V] (row p predicts x[p+1]) and pre-hc_head residual [B, S, n, D]."""
    logits = target(input_ids=x).logits.float()
    res = tap.value
    assert res is not None and res.shape[:2] == x.shape and res.dim() == 4, "residual tap failed"
    tap.value = None
    return logits, res


def mtp_rows(x: torch.Tensor, logits: torch.Tensor, res: torch.Tensor):
    """Align MTP rows with SPEC §2: row p = (residual X_p, token t_{p+1}) at position p,
    predicting t_{p+2}; the target's distribution for t_{p+2} is its logits at p+1."""
    b, s = x.shape
    ids, hid, labels, teacher = x[:, 1:-1], res[:, :-2], x[:, 2:], logits[:, 1:-1]
    pos = torch.arange(s - 2, device=x.device).unsqueeze(0)
    # explicit alignment checks (row p <-> tokens p+1 / p+2, residual p, teacher p+1)
    p = s // 2
    assert torch.equal(ids[:, p], x[:, p + 1]) and torch.equal(labels[:, p], x[:, p + 2])
    assert torch.equal(hid[:, p], res[:, p]) and torch.equal(teacher[:, p], logits[:, p + 1])
    assert int(pos[0, p]) == p and ids.shape == labels.shape == hid.shape[:2] == teacher.shape[:2]
    return ids, hid, pos, labels, teacher


# ----------------------------------------------------------------------------------------
# 4-5. MTP: dense stand-in for the FP4 experts
# ----------------------------------------------------------------------------------------
class DenseExperts(nn.Module):
    """Differentiable experts with exactly FP4Experts' math (SPEC §5): gate clamped above
    at the limit, up clamped to ±limit, routing weight applied before the down projection."""

    def __init__(self, fp4: FP4Experts, trainable: bool = True):
        super().__init__()
        w13, w2 = zip(*(fp4.dequantized(e) for e in range(fp4.num_experts)))
        w13, w2 = torch.stack(w13), torch.stack(w2)
        i = fp4.intermediate_size
        self.w1 = nn.Parameter(w13[:, :i].clone(), requires_grad=trainable)
        self.w3 = nn.Parameter(w13[:, i:].clone(), requires_grad=trainable)
        self.w2 = nn.Parameter(w2.clone(), requires_grad=trainable)
        self.limit = fp4.swiglu_limit

    def forward(self, x, weights, ids):
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        xf = x.float()
        for e in range(self.w1.shape[0]):
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = xf[tok]
            g = (xe @ self.w1[e].t()).clamp(max=self.limit)
            u = (xe @ self.w3[e].t()).clamp(-self.limit, self.limit)
            a = F.silu(g) * u * weights[tok, slot].float().unsqueeze(-1)
            out = out.index_add(0, tok, a @ self.w2[e].t())
        return out.to(x.dtype)


def mtp_loss(mtp, ids, hid, pos, labels, teacher, args):
    """Step 1 on the target's residual, then (optionally) step 2 on the MTP's own residual:
    row p of step 2 = (MTP residual of step-1 row p, token t_{p+2}) at position p+1 -> t_{p+3}."""
    out = mtp(input_ids=ids, hidden_states=hid, position_ids=pos)
    losses = [_distill(out.logits, labels, teacher, args)]
    if args.recursive_weight > 0:
        out2 = mtp(input_ids=ids[:, 1:], hidden_states=out.residual[:, :-1], position_ids=pos[:, 1:])
        losses.append(args.recursive_weight * _distill(out2.logits, labels[:, 1:], teacher[:, 1:], args))
    return sum(losses), out.logits


def _distill(logits, labels, teacher, args):
    logp = F.log_softmax(logits.float(), -1)
    soft = -(F.softmax(teacher, -1) * logp).sum(-1).mean()
    hard = F.nll_loss(logp.reshape(-1, logp.shape[-1]), labels.reshape(-1))
    return soft + args.hard_weight * hard


def train_mtp(mtp, target, stream, args, device, steps, lr, seed_offset, tag):
    tap = ResidualTap(target)
    mtp.train()
    opt = make_optimizer(mtp.parameters(), lr)
    gen = torch.Generator().manual_seed(args.seed + seed_offset)
    t = time.time()
    ema = None
    for step, x in enumerate(batches(stream, steps, args.batch, args.seq, gen)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, min(args.warmup, steps // 5 + 1))
        x = x.to(device)
        logits, res = target_forward(target, tap, x)
        ids, hid, pos, labels, teacher = mtp_rows(x, logits, res)
        loss, mlogits = mtp_loss(mtp, ids, hid, pos, labels, teacher, args)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in mtp.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0 or step == steps - 1:
            with torch.no_grad():
                acc = (mlogits.argmax(-1) == teacher.argmax(-1)).float().mean().item()
            log(f"{tag} step {step:4d} loss {loss.item():.3f} (ema {ema:.3f}) agree {acc:.3f} "
                f"{(time.time() - t) / (step + 1):.2f}s/step")
    tap.remove()
    mtp.eval()


@torch.no_grad()
def quantise_experts(mtp, dense: DenseExperts, fp4: FP4Experts):
    for e in range(fp4.num_experts):
        fp4.set_expert(e, dense.w1[e].detach().cpu(), dense.w3[e].detach().cpu(), dense.w2[e].detach().cpu())
    # the frozen dequantised stand-in must reproduce the packed experts exactly
    frozen = DenseExperts(fp4, trainable=False).to(dense.w1.device)
    x = torch.randn(64, fp4.hidden_size, device=dense.w1.device)
    ids = torch.stack([torch.randperm(fp4.num_experts)[:2] for _ in range(64)]).to(x.device)
    w = torch.rand(64, 2, device=x.device)
    ref = fp4(x.cpu(), w.cpu(), ids.cpu()).to(x.device)  # the packed experts live on the CPU here
    err = (frozen(x, w, ids) - ref).abs().max().item()
    assert err <= 1e-4 * (1 + ref.abs().max().item()), f"dequantised stand-in differs from FP4Experts by {err}"
    rel = ((DenseExperts(fp4, False).w1 - dense.w1.cpu()).norm() / dense.w1.cpu().norm()).item()
    log(f"quantised {fp4.num_experts} experts to {fp4.format.name}; relative w1 error {rel:.3f}")
    return frozen


# ----------------------------------------------------------------------------------------
# 6. evaluation
# ----------------------------------------------------------------------------------------
@torch.no_grad()
def eval_target(target, windows, device, bs=16):
    total, count = 0.0, 0
    for i in range(0, len(windows), bs):
        x = windows[i : i + bs].to(device)
        logits = target(input_ids=x).logits.float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total, count = total + loss.item(), count + x[:, 1:].numel()
    return total / count


@torch.no_grad()
def eval_mtp(mtp, target, windows, device, bs=16):
    tap = ResidualTap(target)
    hits_data = hits_target = n = 0
    for i in range(0, len(windows), bs):
        x = windows[i : i + bs].to(device)
        logits, res = target_forward(target, tap, x)
        ids, hid, pos, labels, teacher = mtp_rows(x, logits, res)
        pred = mtp(input_ids=ids, hidden_states=hid, position_ids=pos).logits.argmax(-1)
        hits_data += (pred == labels).sum().item()
        hits_target += (pred == teacher.argmax(-1)).sum().item()
        n += labels.numel()
    tap.remove()
    return hits_data / n, hits_target / n


@torch.no_grad()
def greedy_sequence(target, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation by full forwards (self-consistent with full-forward argmax)."""
    seq = prompt.clone()
    for _ in range(new_tokens):
        nxt = target(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


@torch.no_grad()
def simulate_acceptance(target, mtp, seq: torch.Tensor, prompt_len: int, k: int) -> list[int]:
    """Offline greedy speculative decoding of ``seq`` (prompt + the target's greedy
    continuation) with the packed MTP and its KV cache.  Returns tokens gained per round
    (accepted drafts + 1 bonus).

    Round at confirmed tokens t_0..t_n (t_n = the last target output, X_0..X_{n-1} known):
    MTP rows 0..n-2 are cached from target residuals; row n-1 = (X_{n-1}, t_n) drafts d_1,
    then (own residual, d_i) drafts d_{i+1}.  Accept the prefix matching the target's
    greedy tokens, then crop the MTP cache back to n rows (all from target residuals)."""
    tap = ResidualTap(target)
    target(input_ids=seq)
    X = tap.value
    tap.remove()
    cache = mtp.new_cache()
    n = prompt_len  # t_n = first generated token (the target's output for the prompt)
    total = seq.shape[1]
    fed = 0  # MTP rows in cache
    gains = []
    while n + k < total:
        # confirmed rows fed..n-1 (the last one is the first draft row)
        out = mtp(input_ids=seq[:, fed + 1 : n + 1], hidden_states=X[:, fed:n], cache=cache, use_cache=True)
        assert cache.get_seq_length() == n
        drafts = [out.logits[:, -1].argmax(-1)]
        r = out.residual[:, -1:]
        for _ in range(k - 1):
            o = mtp(input_ids=drafts[-1].view(1, 1), hidden_states=r, cache=cache, use_cache=True)
            drafts.append(o.logits[:, -1].argmax(-1))
            r = o.residual
        a = 0
        while a < k and int(drafts[a]) == int(seq[0, n + 1 + a]):
            a += 1
        gains.append(a + 1)
        cache.crop(n)
        fed = n
        n += a + 1
    return gains


@torch.no_grad()
def simulate_on_text(target, mtp, window: torch.Tensor, starts: list[int], k: int) -> list[int]:
    """Rounds starting inside real held-out text (no degenerate greedy loops): for each
    start n, the confirmed prefix is the text t_0..t_n; the MTP (its cache filled from the
    target's residuals of rows 0..n-2) drafts k tokens recursively, and draft i is accepted
    iff all earlier drafts were and it equals the target's greedy token after
    ``text[:n+1] + drafts[:i]`` (an extra target forward when the drafts left the text).
    Returns tokens gained per round (accepted + 1)."""
    x = window.view(1, -1)
    tap = ResidualTap(target)
    greedy = target(input_ids=x).logits[0].argmax(-1)  # greedy[q] = target's choice after x[:q+1]
    X = tap.value
    tap.remove()
    gains = []
    for n in starts:
        cache = mtp.new_cache()
        out = mtp(input_ids=x[:, 1 : n + 1], hidden_states=X[:, :n], cache=cache, use_cache=True)
        drafts = [int(out.logits[0, -1].argmax())]
        r = out.residual[:, -1:]
        for _ in range(k - 1):
            o = mtp(input_ids=torch.tensor([[drafts[-1]]], device=x.device), hidden_states=r, cache=cache,
                    use_cache=True)
            drafts.append(int(o.logits[0, -1].argmax()))
            r = o.residual
        a = 0
        while a < k:
            if drafts[:a] == x[0, n + 1 : n + 1 + a].tolist():
                want = int(greedy[n + a])
            else:
                ctx = torch.cat([x[:, : n + 1], torch.tensor([drafts[:a]], device=x.device)], dim=1)
                want = int(target(input_ids=ctx).logits[0, -1].argmax())
            if drafts[a] != want:
                break
            a += 1
        gains.append(a + 1)
    return gains


# ----------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "src" / "dsv4_mtp_hf" / "demo_pair")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dsv4_demo_work"),
                    help="intermediate results (tokenizer, token streams, trained target)")
    ap.add_argument("--reuse-target", action="store_true", help="load the trained target from --work")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--moe-intermediate", type=int, default=128)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--target-steps", type=int, default=640)
    ap.add_argument("--target-lr", type=float, default=2.5e-3)
    ap.add_argument("--mtp-steps", type=int, default=400)
    ap.add_argument("--mtp-lr", type=float, default=3e-3)
    ap.add_argument("--ft-steps", type=int, default=60, help="fine-tune after quantising the experts")
    ap.add_argument("--ft-lr", type=float, default=5e-4)
    ap.add_argument("--recursive-weight", type=float, default=0.5, help="weight of the second (recursive) step")
    ap.add_argument("--hard-weight", type=float, default=0.25, help="weight of data cross-entropy vs distillation")
    ap.add_argument("--expert-format", default="mxfp4", choices=["mxfp4", "nvfp4"])
    ap.add_argument("--eval-windows", type=int, default=48)
    ap.add_argument("--sim-prompts", type=int, default=12)
    ap.add_argument("--sim-prompt-len", type=int, default=96)
    ap.add_argument("--sim-new-tokens", type=int, default=64)
    ap.add_argument("--text-windows", type=int, default=8, help="held-out windows for in-text round simulation")
    ap.add_argument("--text-stride", type=int, default=12)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (1 is fastest on a busy 2-core box)")
    args = ap.parse_args()

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "device": str(device), "stage_seconds": {}}

    def stage(name, t):
        report["stage_seconds"][name] = round(time.time() - t, 1)
        log(f"== stage {name}: {report['stage_seconds'][name]}s")

    # 1-2. corpus + tokenizer ------------------------------------------------------------
    t = time.time()
    train_files, held_files, root = stdlib_files()
    train_texts, held_texts = [read(p) for p in train_files], [read(p) for p in held_files]
    log(f"corpus: {len(train_files)} train files ({sum(map(len, train_texts)) / 1e6:.1f} MB), "
        f"{len(held_files)} held-out files ({sum(map(len, held_texts)) / 1e6:.2f} MB) from {root}")
    tokenizer = train_tokenizer(train_texts, args.vocab_size, work / "tokenizer")
    train_stream, held_stream = encode_stream(tokenizer, train_texts), encode_stream(tokenizer, held_texts)
    log(f"tokens: train {train_stream.numel()}, held-out {held_stream.numel()}")
    report["corpus"] = {"train_files": len(train_files), "heldout_files": len(held_files),
                        "train_tokens": train_stream.numel(), "heldout_tokens": held_stream.numel(),
                        "heldout_names": [p.relative_to(root).as_posix() for p in held_files]}
    stage("corpus+tokenizer", t)

    # 3. target ---------------------------------------------------------------------------
    t = time.time()
    cfg = target_config(args, len(tokenizer))
    if args.reuse_target and (work / "target").exists():
        target = DeepseekV4ForCausalLM.from_pretrained(work / "target", dtype=torch.float32).to(device)
        log("reusing trained target from", work / "target")
    else:
        target = build_target(cfg, args.seed).to(device)
        log(f"target: {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M params")
        train_target(target, train_stream, args, device)
        round_to_bf16_(target)
        target.save_pretrained(work / "target")
    target.eval().requires_grad_(False)
    windows = eval_windows(held_stream, args.eval_windows, args.seq)
    target_loss = eval_target(target, windows, device)
    log(f"target held-out loss {target_loss:.3f} (ppl {math.exp(target_loss):.1f})")
    report["target"] = {"params": sum(p.numel() for p in target.parameters()), "heldout_loss": target_loss,
                        "heldout_ppl": math.exp(target_loss)}
    stage("target", t)

    # 4. MTP ------------------------------------------------------------------------------
    t = time.time()
    torch.manual_seed(args.seed + 2)
    mcfg = DeepseekV4MtpConfig.from_target_config(target.config, expert_format=args.expert_format,
                                                  attention_backend="reference")
    mtp = DeepseekV4MtpForCausalLM(mcfg).to(device)
    mtp.bind(target)
    fp4 = mtp.block.mlp.experts
    dense = DenseExperts(fp4).to(device)
    mtp.block.mlp.experts = dense
    log(f"mtp: {sum(p.numel() for p in mtp.parameters()) / 1e6:.2f}M params (dense experts while training)")
    train_mtp(mtp, target, train_stream, args, device, args.mtp_steps, args.mtp_lr, 3, "mtp")
    stage("mtp", t)

    # 5. quantise + fine-tune ---------------------------------------------------------------
    t = time.time()
    fp4 = fp4.cpu()
    frozen = quantise_experts(mtp, dense, fp4)
    mtp.block.mlp.experts = frozen
    acc_before = eval_mtp(mtp, target, windows, device)
    log(f"after quantisation: held-out acc (data, target-greedy) {acc_before[0]:.3f} {acc_before[1]:.3f}")
    if args.ft_steps:
        train_mtp(mtp, target, train_stream, args, device, args.ft_steps, args.ft_lr, 4, "ft")
    mtp.block.mlp.experts = fp4.to(device)  # the real packed experts from here on
    stage("quantise+finetune", t)

    # 6. evaluation ---------------------------------------------------------------------------
    t = time.time()
    acc_data, acc_target = eval_mtp(mtp, target, windows, device)
    log(f"MTP held-out top-1: vs data t_(p+2) {acc_data:.3f}; vs target greedy {acc_target:.3f}")
    report["mtp"] = {"params": sum(p.numel() for p in mtp.parameters()),
                     "heldout_top1_vs_data": acc_data, "heldout_top1_vs_target_greedy": acc_target,
                     "heldout_top1_vs_target_greedy_before_finetune": acc_before[1]}
    gen = torch.Generator().manual_seed(args.seed + 5)
    starts = torch.randint(0, held_stream.numel() - args.sim_prompt_len, (args.sim_prompts,), generator=gen)
    seqs = [greedy_sequence(target, held_stream[s : s + args.sim_prompt_len].view(1, -1).to(device),
                            args.sim_new_tokens) for s in starts.tolist()]
    distinct = sum(len(set(s[0, args.sim_prompt_len:].tolist())) for s in seqs) / (len(seqs) * args.sim_new_tokens)
    sim = {}
    for k in (1, 2, 3):
        gains = [g for s in seqs for g in simulate_acceptance(target, mtp, s, args.sim_prompt_len, k)]
        sim[k] = sum(gains) / len(gains)
        log(f"K={k}: mean tokens per round {sim[k]:.3f} over {len(gains)} rounds")
    report["simulated_tokens_per_round"] = sim
    # rounds starting inside real held-out text (the greedy continuations of a small model loop)
    text_starts = list(range(args.seq // 4, args.seq - 4, args.text_stride))
    sim_text = {}
    for k in (1, 2, 3):
        gains = [g for w in windows[:: max(1, len(windows) // args.text_windows)][: args.text_windows] for g in simulate_on_text(target, mtp, w.to(device), text_starts, k)]
        sim_text[k] = sum(gains) / len(gains)
        log(f"K={k}: mean tokens per round starting in held-out text {sim_text[k]:.3f} over {len(gains)} rounds")
    report["simulated_tokens_per_round_in_heldout_text"] = sim_text
    report["greedy_continuation_distinct_token_fraction"] = distinct
    report["example_prompt"] = tokenizer.decode(seqs[0][0, : args.sim_prompt_len].tolist())
    report["example_continuation"] = tokenizer.decode(seqs[0][0, args.sim_prompt_len :].tolist())
    log("example continuation:\n" + report["example_prompt"] + "<<<|>>>" + report["example_continuation"])
    stage("eval", t)

    # 7. save -----------------------------------------------------------------------------------
    t = time.time()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    # Only the target's own tensors: binding may hang the draft off the target as a
    # submodule, whose weights must not leak into the target checkpoint.
    own = {k for k in target.state_dict() if not any(k.startswith(f"{n}.") for n, _ in bound_children(target))}
    sd = {k: v.detach().cpu() for k, v in target.state_dict().items() if k in own}
    for n in bf16_names(target):
        sd[n] = sd[n].bfloat16()
    target.cpu().save_pretrained(out / "target_model", state_dict=sd)
    mtp.cpu().save_pretrained(out / "mtp")
    tokenizer.save_pretrained(out / "tokenizer")
    (out / "heldout_files.txt").write_text("\n".join(report["corpus"].pop("heldout_names")) + "\n")
    stage("save", t)
    report["total_seconds"] = round(time.time() - T0, 1)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    report["artifact_bytes"] = size
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"saved to {out} ({size / 1e6:.2f} MB); report in training_report.json")


if __name__ == "__main__":
    main()
