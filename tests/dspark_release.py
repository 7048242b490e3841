"""A tiny DeepSeek-V4 DSpark release, written the way DeepSeek ships one (test helper).

* :func:`tiny_dspark_config` -- a target ``config.json`` dict (``model_type: deepseek_v4``)
  carrying the DSpark fields of the 0731 release (DSPARK.md §a).
* :func:`random_dspark_tensors` -- the drafter's tensors under ``mtp.{i}.`` with the names,
  dtypes and formats of DSPARK.md §e (FP8 e4m3 + E8M0 128x128 block scales, MXFP4 experts,
  BF16 norms/Markov/confidence, F32 mHC/sink/bias).
* :func:`random_target_shared` -- ``embed.weight`` / ``head.weight`` (shared with the target).
* :func:`write_dspark_release` -- ``config.json``, ``model.safetensors.index.json`` and shards.
* :func:`decoded_dspark_weights` -- the float64 values the stored tensors encode (SPEC §6),
  decoded here without the package's decoders (the tests cross-check both).

Sizes are tiny but keep the formats honest: FP8 matrices have partial 128-blocks (64-wide
edges) and every expert K is a multiple of the MXFP4 group (32).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv4_mtp_hf.fp4 import quantize_fp4
from dsv4_mtp_hf.fp8 import quantize_fp8_block

LAYER_TYPE_CYCLE = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
FP8_BLOCK = 128
MXFP4_GROUP = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def tiny_dspark_config(**overrides) -> dict:
    """A tiny V4 target config dict that ``transformers.DeepseekV4Config(**cfg)`` accepts, with the
    DSpark fields of 0731 (DSPARK.md §a): ``dspark_block_size`` γ, ``dspark_noise_token_id``,
    ``dspark_target_layer_ids`` (the LAST three target layers), ``dspark_markov_rank`` r and the
    legacy ``num_nextn_predict_layers: 1``.  Target layers cycle sliding/CSA/HCA (layer 0 hash-MoE)
    unless ``layer_types``/``mlp_layer_types`` are overridden."""
    n = overrides.get("num_hidden_layers", 3)
    cfg = dict(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", dtype="bfloat16",
        vocab_size=320, hidden_size=256, num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=1,
        head_dim=64, partial_rotary_factor=0.25, q_lora_rank=64, o_groups=2, o_lora_rank=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64,
        scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0,
        sliding_window=8, rope_theta=10000.0, compress_rope_theta=160000.0,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        index_n_heads=8, index_head_dim=32, index_topk=4,  # SPEC §7: enough indexer heads to avoid ties
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
        num_nextn_predict_layers=1,  # legacy field kept by 0731: NOT evidence of an MTP head
        dspark_block_size=5, dspark_noise_token_id=300, dspark_markov_rank=16,
    )
    cfg["layer_types"] = [LAYER_TYPE_CYCLE[i % 3] for i in range(n)]
    cfg["mlp_layer_types"] = ["hash_moe" if i == 0 else "moe" for i in range(n)]
    cfg["dspark_target_layer_ids"] = list(range(max(0, n - 3), n))
    cfg.update(overrides)
    if not 0 <= cfg["dspark_noise_token_id"] < cfg["vocab_size"]:
        raise ValueError("dspark_noise_token_id must be a valid token id")
    return cfg


def rope_dim(config: dict) -> int:
    """RoPE channels (the LAST ones of each head): ``qk_rope_head_dim`` or head_dim × partial factor."""
    if config.get("qk_rope_head_dim") is not None:
        return int(config["qk_rope_head_dim"])
    return int(config["head_dim"] * config.get("partial_rotary_factor", 64 / 512))


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 weight + E8M0 scale grid [ceil(N/128), ceil(K/128)] (SPEC §6)."""
    q, s = quantize_fp8_block(w)
    return q.contiguous(), s.contiguous()


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 as I8 [N, K/2] (low nibble first) + E8M0 scale [N, K/32] (SPEC §6)."""
    packed, raw, _ = quantize_fp4(w, "mxfp4")
    return packed.view(torch.int8).contiguous(), raw.view(torch.float8_e8m0fnu).contiguous()


def _layer_float_params(config: dict, prefix: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Float32 master values of one draft layer's non-expert tensors (DSPARK.md §e), std ~ 1/sqrt(K)."""
    d, h, hd = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
    n, qr, og, orank = config["hc_mult"], config["q_lora_rank"], config["o_groups"], config["o_lora_rank"]
    e, inter = config["n_routed_experts"], config["moe_intermediate_size"]
    mix = (2 + n) * n

    def rnd(*shape, std=1.0, mean=0.0):
        return mean + std * torch.randn(*shape, generator=g)

    p = {}
    for norm in ("attn_norm", "ffn_norm", "attn.q_norm", "attn.kv_norm"):
        size = {"attn.q_norm": qr, "attn.kv_norm": hd}.get(norm, d)
        p[f"{norm}.weight"] = rnd(size, std=0.1, mean=1.0)
    for hc in ("hc_attn", "hc_ffn"):
        p[f"{hc}_fn"] = rnd(mix, n * d, std=1.0 / math.sqrt(n * d))
        p[f"{hc}_base"] = rnd(mix, std=0.5)
        p[f"{hc}_scale"] = rnd(3, std=0.1, mean=1.0)
    p["attn.wq_a.weight"] = rnd(qr, d, std=d ** -0.5)
    p["attn.wq_b.weight"] = rnd(h * hd, qr, std=qr ** -0.5)
    p["attn.wkv.weight"] = rnd(hd, d, std=d ** -0.5)
    p["attn.wo_a.weight"] = rnd(og * orank, h * hd // og, std=(h * hd // og) ** -0.5)
    p["attn.wo_b.weight"] = rnd(d, og * orank, std=(og * orank) ** -0.5)
    p["attn.attn_sink"] = rnd(h, std=1.0)
    p["ffn.gate.weight"] = rnd(e, d, std=d ** -0.5)
    p["ffn.gate.bias"] = rnd(e, std=0.2)
    # gate/up at 4/sqrt(D) so that the SwiGLU clamp (limit 10) is hit now and then; down scaled back
    for part, shape, std in (("w1", (inter, d), 4 * d ** -0.5), ("w3", (inter, d), 4 * d ** -0.5),
                             ("w2", (d, inter), 0.1 * inter ** -0.5)):
        for j in range(e):
            p[f"ffn.experts.{j}.{part}.weight"] = rnd(*shape, std=std)
        p[f"ffn.shared_experts.{part}.weight"] = rnd(*shape, std=std)
    return {prefix + k: v for k, v in p.items()}


def _encode(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One float32 master tensor -> its stored form(s) by name (DSPARK.md §e dtypes)."""
    if ".experts." in name:
        q, s = _mxfp4(w)
    elif name.endswith(".weight") and w.dim() == 2 and (".attn.w" in name or "shared_experts" in name
                                                        or name.endswith("main_proj.weight")):
        q, s = _fp8(w)
    elif name.endswith(".weight"):  # norms, gate, Markov, confidence
        return {name: w.to(torch.bfloat16).contiguous()}
    else:  # hc_*, attn_sink, gate.bias
        return {name: w.float().contiguous()}
    return {name: q, name[: -len("weight")] + "scale": s}


def random_dspark_tensors(config: dict, seed: int, layers: int = 3) -> dict[str, torch.Tensor]:
    """The drafter's stored tensors ``mtp.{i}.*`` (DSPARK.md §e), random, non-degenerate, seeded.
    ``mtp.0`` adds ``main_proj``/``main_norm``; the last block adds ``norm``, ``hc_head_*``,
    ``markov_head.markov_w{1,2}`` [V, r] and ``confidence_head.proj`` [1, D + r]."""
    g = torch.Generator().manual_seed(seed)
    d, n, v, r = config["hidden_size"], config["hc_mult"], config["vocab_size"], config["dspark_markov_rank"]
    k_main = len(config["dspark_target_layer_ids"]) * d
    master = {}
    for i in range(layers):
        if i == 0:
            master["mtp.0.main_proj.weight"] = torch.randn(d, k_main, generator=g) * k_main ** -0.5
            master["mtp.0.main_norm.weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
        master.update(_layer_float_params(config, f"mtp.{i}.", g))
    last = f"mtp.{layers - 1}."
    master[last + "norm.weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
    master[last + "hc_head_fn"] = torch.randn(n, n * d, generator=g) * (n * d) ** -0.5
    master[last + "hc_head_base"] = 0.5 * torch.randn(n, generator=g)
    master[last + "hc_head_scale"] = 1.0 + 0.1 * torch.randn(1, generator=g)
    master[last + "markov_head.markov_w1.weight"] = torch.randn(v, r, generator=g)
    master[last + "markov_head.markov_w2.weight"] = torch.randn(v, r, generator=g) * r ** -0.5
    master[last + "confidence_head.proj.weight"] = torch.cat([  # logit spread ~2 for h_k rms ~5, e_k rms 1
        0.3 * d ** -0.5 * torch.randn(1, d, generator=g), r ** -0.5 * torch.randn(1, r, generator=g)], dim=1)
    out = {}
    for name, w in master.items():
        out.update(_encode(name, w))
    return out


def random_target_shared(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """The target's ``embed.weight`` (std 1) and ``head.weight`` (std 2/sqrt(D)), BF16 [V, D]."""
    g = torch.Generator().manual_seed(seed)
    v, d = config["vocab_size"], config["hidden_size"]
    embed = torch.randn(v, d, generator=g)
    head = torch.randn(v, d, generator=g) * 2.0 * d ** -0.5
    return {"embed.weight": embed.to(torch.bfloat16), "head.weight": head.to(torch.bfloat16)}


def write_dspark_release(path, config: dict, tensors: dict, shared: dict, target_tensors: dict | None = None,
                         shards: int = 2) -> Path:
    """Write ``config.json``, ``model.safetensors.index.json`` (``weight_map``) and
    ``model-0000k-of-0000S.safetensors`` shards: embed/head in the first shard, the target's
    other tensors spread over the shards before the last, every ``mtp.*`` tensor in the LAST
    shard (as in the V4 release, SPEC §6)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    files: list[dict] = [{} for _ in range(shards)]
    files[0].update(shared)
    for j, (name, t) in enumerate(sorted((target_tensors or {}).items())):
        files[j % max(1, shards - 1)][name] = t
    files[-1].update(tensors)
    weight_map, total = {}, 0
    for fname, content in zip(names, files):
        content = {k: t.contiguous() for k, t in content.items()}
        save_file(content, str(path / fname), metadata={"format": "pt"})
        for k, t in content.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float64 ``2**(e - 127)``."""
    e = scale.view(torch.uint8).to(torch.int64)
    if (e == 255).any():
        raise ValueError("E8M0 scale 0xFF is NaN")
    return torch.pow(torch.tensor(2.0, dtype=torch.float64), (e - 127).double())


def _decode_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [N, K] × one scale per 128×128 block (partial edges allowed) -> float64."""
    n, k = w.shape
    s = _e8m0(scale) if scale.element_size() == 1 else scale.double()
    s = s.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return w.double() * s


def _decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 (element 2i in the low nibble, bit 3 = sign) × E8M0 per 32 along K -> float64."""
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    return vals * _e8m0(scale).repeat_interleave(MXFP4_GROUP, dim=-1)


def decoded_dspark_weights(tensors: dict) -> dict[str, torch.Tensor]:
    """Float64 value of every stored tensor, keyed by native name (``.scale`` entries are folded
    into their weight): FP8 × block scale, MXFP4 experts decoded, BF16/F32 widened (SPEC §6)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".scale"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            out[name] = _decode_fp8(t, tensors[name[: -len("weight")] + "scale"])
        elif t.dtype in (torch.int8, torch.uint8):
            out[name] = _decode_mxfp4(t, tensors[name[: -len("weight")] + "scale"])
        else:
            out[name] = t.double()
    return out
