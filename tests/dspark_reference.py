"""An independent float64 reference ("oracle") of DeepSeek-V4's DSpark drafter (test helper).

Written from /work/shared/DSPARK.md (§b, §c) and SPEC.md (§3 mHC, §4 attention, §5 MoE) only,
in plain PyTorch float64, for readability rather than speed.  It works on the decoded weights
dict of :func:`tests.dspark_release.decoded_dspark_weights` (native names ``mtp.{i}.*``) merged
with the target's decoded ``embed.weight`` / ``head.weight``, and on a config dict
(:func:`tests.dspark_release.tiny_dspark_config` or a release ``config.json``).

Conventions: one row = one token; ``[rows, n, D]`` multi-stream residuals; every matrix is
``[out, in]`` (``y = x @ W.T``).
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


# -- small pieces -----------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x · rsqrt(mean(x²) + eps)`` over the last dim, times ``weight`` if given (SPEC §3/§4)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope_dim(config: dict) -> int:
    """RoPE channels per head, the LAST ones: ``qk_rope_head_dim`` or head_dim × partial factor."""
    if config.get("qk_rope_head_dim") is not None:
        return int(config["qk_rope_head_dim"])
    return int(config["head_dim"] * config.get("partial_rotary_factor", 64 / 512))


def rope(x: torch.Tensor, positions: torch.Tensor, rd: int, theta: float, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the last ``rd`` channels (SPEC §4): pairs (2i, 2i+1) of the rope part are
    one complex number rotated by ``pos · theta^(-2i/rd)``; ``inverse`` rotates by the conjugate.
    ``x`` is ``[rows, ..., C]``; ``positions`` ``[rows]``.  Plain RoPE, no YaRN (DSPARK.md §a)."""
    freqs = theta ** (-torch.arange(0, rd, 2, dtype=F64) / rd)
    ang = positions.to(F64)[:, None] * freqs[None, :]  # [rows, rd/2]
    ang = ang.reshape(ang.shape[0], *([1] * (x.dim() - 2)), ang.shape[1])
    cos, sin = torch.cos(ang), torch.sin(ang) * (-1.0 if inverse else 1.0)
    nope, rp = x[..., :-rd], x[..., -rd:]
    a, b = rp[..., 0::2], rp[..., 1::2]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([nope, rot], dim=-1)


def fp8_roundtrip_nope(x: torch.Tensor, rd: int, group: int = 64) -> torch.Tensor:
    """Optional KV fidelity knob (DSPARK.md b3, SPEC §4): the first ``C − rd`` channels go through
    e4m3 with one power-of-two scale per ``group`` values, ``2**ceil(log2(amax/448))``, amax ≥ 1e-4."""
    nope, rp = x[..., :-rd], x[..., -rd:]
    out = []
    for c0 in range(0, nope.shape[-1], group):
        blk = nope[..., c0:c0 + group]
        amax = blk.abs().amax(-1, keepdim=True).clamp(min=1e-4)
        scale = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
        out.append((blk / scale).to(torch.float8_e4m3fn).to(F64) * scale)
    return torch.cat(out + [rp], dim=-1)


def n_draft_layers(weights: dict) -> int:
    """Draft depth = number of ``mtp.{i}`` prefixes (DSPARK.md §a, §g5)."""
    ids = {int(k.split(".")[1]) for k in weights if k.startswith("mtp.")}
    if ids != set(range(len(ids))):
        raise ValueError(f"draft blocks are not mtp.0..mtp.{len(ids) - 1}: {sorted(ids)}")
    return len(ids)


# -- mHC (SPEC §3) ------------------------------------------------------------------------------


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """``m = (fn @ flatten(x)) · rsqrt(mean(flatten(x)²) + rms_eps)`` for ``x [rows, n, D]``."""
    xf = x.flatten(1)
    return (xf @ fn.T) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """SPEC §3 order: ``softmax_rows + eps``; ``/= colsum + eps``; then (iters − 1)× rows, cols."""
    c = torch.softmax(c, dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def hc_pre(x: torch.Tensor, fn, base, scale, config: dict):
    """mHC pre (SPEC §3): -> (block input ``y = Σ_j pre_j x_j`` [rows, D], ``post`` [rows, n],
    ``comb`` C [rows, n, n] (row-major j, k))."""
    n, eps = config["hc_mult"], config["hc_eps"]
    m = hc_mixes(x, fn, config["rms_norm_eps"])
    pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + eps
    post = 2.0 * torch.sigmoid(m[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = (m[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(-1, n, n)
    comb = sinkhorn(comb, config["hc_sinkhorn_iters"], eps)
    return torch.einsum("rj,rjd->rd", pre, x), post, comb


def hc_post(o: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``x'_k = post_k · o + Σ_j C[j, k] · x_j`` (sum over the FIRST index, SPEC §3)."""
    return post[:, :, None] * o[:, None, :] + torch.einsum("rjk,rjd->rkd", comb, x)


def hc_head(x: torch.Tensor, fn, base, scale, config: dict) -> torch.Tensor:
    """mHC collapse (SPEC §3 hc_head): ``w_j = sigmoid(m_j·scale + base_j) + eps``, ``Σ_j w_j x_j``."""
    m = hc_mixes(x, fn, config["rms_norm_eps"])
    w = torch.sigmoid(m * scale[0] + base) + config["hc_eps"]
    return torch.einsum("rj,rjd->rd", w, x)


# -- context K/V (DSPARK.md b1-b3) ---------------------------------------------------------------


def layer_kv(weights: dict, i: int, h: torch.Tensor, positions: torch.Tensor, config: dict,
             kv_fp8_roundtrip: bool = False) -> torch.Tensor:
    """``RoPE_p(kv_norm_i(wkv_i · h))`` [rows, head_dim] (SPEC §4; DSPARK.md b3/b4)."""
    p, rd = f"mtp.{i}.attn.", rope_dim(config)
    kv = rms_norm(h @ weights[p + "wkv.weight"].T, weights[p + "kv_norm.weight"], config["rms_norm_eps"])
    kv = rope(kv, positions, rd, config.get("rope_theta", 10000.0))
    return fp8_roundtrip_nope(kv, rd) if kv_fp8_roundtrip else kv


def features_to_context(weights: dict, features: torch.Tensor, positions, config: dict,
                        kv_fp8_roundtrip: bool = False) -> list[torch.Tensor]:
    """DSPARK.md b1-b3.  ``features [rows, n_target_layers, n, D]``: the multi-stream residual at the
    OUTPUT of each ``dspark_target_layer_ids`` layer, in that order.  Streams reduced by the plain
    mean, concatenated layer-major to [3D]; ``main_x = main_norm(main_proj · main_hidden)``; per draft
    layer ``c_i[p] = RoPE_p(kv_norm_i(wkv_i · main_x[p]))``.  -> per layer ``[rows, head_dim]``."""
    features = features.to(F64)
    rows = features.shape[0]
    positions = torch.as_tensor(positions, dtype=torch.long).reshape(rows)
    main_hidden = features.mean(dim=2).reshape(rows, -1)  # layer-major concat of the stream means
    main_x = rms_norm(main_hidden @ weights["mtp.0.main_proj.weight"].T, weights["mtp.0.main_norm.weight"],
                      config["rms_norm_eps"])
    return [layer_kv(weights, i, main_x, positions, config, kv_fp8_roundtrip)
            for i in range(n_draft_layers(weights))]


# -- one draft layer (DSPARK.md b4-b6, SPEC §4-§5) ---------------------------------------------------


def block_attention(weights: dict, i: int, h: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor,
                    config: dict, kv_fp8_roundtrip: bool = False) -> torch.Tensor:
    """DSPARK.md b4 / SPEC §4 for the γ block rows ``h [γ, D]`` (after attn_norm) at ``positions``.
    Keys (= values) for EVERY row: the context entries ``ctx [Nc, hd]`` (already RoPE'd) plus all γ
    block K/V; no causal mask.  Per-head sink in the denominator; inverse RoPE; grouped wo_a; wo_b."""
    p, eps, rd = f"mtp.{i}.attn.", config["rms_norm_eps"], rope_dim(config)
    nh, hd, groups = config["num_attention_heads"], config["head_dim"], config["o_groups"]
    theta = config.get("rope_theta", 10000.0)
    qr = rms_norm(h @ weights[p + "wq_a.weight"].T, weights[p + "q_norm.weight"], eps)
    q = (qr @ weights[p + "wq_b.weight"].T).reshape(-1, nh, hd)
    q = rope(rms_norm(q, None, eps), positions, rd, theta)  # per-head UNWEIGHTED rms, then RoPE
    keys = torch.cat([ctx.to(F64), layer_kv(weights, i, h, positions, config, kv_fp8_roundtrip)], dim=0)
    scores = torch.einsum("thd,sd->ths", q, keys) / math.sqrt(hd)
    sink = weights[p + "attn_sink"].reshape(1, nh, 1)
    top = torch.maximum(scores.amax(-1, keepdim=True), sink)
    num = torch.exp(scores - top)
    probs = num / (num.sum(-1, keepdim=True) + torch.exp(sink - top))  # sink: denominator only
    o = rope(torch.einsum("ths,sd->thd", probs, keys), positions, rd, theta, inverse=True)
    o = o.reshape(o.shape[0], groups, nh * hd // groups)
    wo_a = weights[p + "wo_a.weight"].reshape(groups, -1, nh * hd // groups)  # [G, o_lora, H·hd/G]
    oa = torch.einsum("tgc,gkc->tgk", o, wo_a).flatten(1)
    return oa @ weights[p + "wo_b.weight"].T


def swiglu_expert(weights: dict, prefix: str, h: torch.Tensor, route_w: torch.Tensor, limit: float):
    """SPEC §5 expert: ``g = min(w1·h, L)``, ``u = clamp(w3·h, ±L)``, ``w2 · (route_w · silu(g)·u)``."""
    g = (h @ weights[prefix + "w1.weight"].T).clamp(max=limit)
    u = (h @ weights[prefix + "w3.weight"].T).clamp(-limit, limit)
    a = torch.nn.functional.silu(g) * u * route_w[:, None]
    return a @ weights[prefix + "w2.weight"].T


def moe(weights: dict, i: int, h: torch.Tensor, config: dict):
    """Score-routed MoE (SPEC §5, DSPARK.md b6): ``s = sqrt(softplus(W_g h))``, top-k on ``s + bias``,
    unbiased weights normalised × routed_scaling_factor, plus one shared expert (weight 1).
    -> (output [rows, D], chosen experts [rows, k])."""
    p, k, limit = f"mtp.{i}.ffn.", config["num_experts_per_tok"], config["swiglu_limit"]
    s = torch.sqrt(torch.nn.functional.softplus(h @ weights[p + "gate.weight"].T))
    chosen = torch.topk(s + weights[p + "gate.bias"], k, dim=-1).indices
    w = s.gather(-1, chosen)
    w = w / w.sum(-1, keepdim=True) * config["routed_scaling_factor"]
    out = swiglu_expert(weights, p + "shared_experts.", h, torch.ones(h.shape[0], dtype=F64), limit)
    for r in range(h.shape[0]):
        for j in range(k):
            e = int(chosen[r, j])
            out[r] += swiglu_expert(weights, f"{p}experts.{e}.", h[r:r + 1], w[r, j:j + 1], limit)[0]
    return out, chosen


def draft_layer(weights: dict, i: int, x: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor,
                config: dict, kv_fp8_roundtrip: bool = False):
    """DSPARK.md b5: ``hc_pre(hc_attn) → attn_norm → attention → hc_post``, then
    ``hc_pre(hc_ffn) → ffn_norm → MoE → hc_post`` on ``x [γ, n, D]``.  -> (x', chosen experts)."""
    p, eps = f"mtp.{i}.", config["rms_norm_eps"]
    y, post, comb = hc_pre(x, weights[p + "hc_attn_fn"], weights[p + "hc_attn_base"], weights[p + "hc_attn_scale"],
                           config)
    o = block_attention(weights, i, rms_norm(y, weights[p + "attn_norm.weight"], eps), positions, ctx, config,
                        kv_fp8_roundtrip)
    x = hc_post(o, x, post, comb)
    y, post, comb = hc_pre(x, weights[p + "hc_ffn_fn"], weights[p + "hc_ffn_base"], weights[p + "hc_ffn_scale"],
                           config)
    o, chosen = moe(weights, i, rms_norm(y, weights[p + "ffn_norm.weight"], eps), config)
    return hc_post(o, x, post, comb), chosen


def block_forward(weights: dict, ids: torch.Tensor, start: int, contexts: list[torch.Tensor], config: dict,
                  kv_fp8_roundtrip: bool = False) -> dict:
    """DSPARK.md b4-b7 backbone (parallel part) for block ``ids [γ]`` at positions start..start+γ−1.
    ``contexts[i]``: layer i's window K/V ``[Nc, hd]``.  -> dict ``hidden`` (per layer [γ, n, D]),
    ``experts`` (per layer [γ, k]), ``head_hidden`` h_k [γ, D] (pre-norm), ``base_logits`` U [γ, V]."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    positions = start + torch.arange(ids.shape[0])
    x = weights["embed.weight"][ids][:, None, :].expand(-1, config["hc_mult"], -1).clone()  # n copies
    hidden, experts = [], []
    for i in range(n_draft_layers(weights)):
        x, chosen = draft_layer(weights, i, x, positions, contexts[i], config, kv_fp8_roundtrip)
        hidden.append(x)
        experts.append(chosen)
    last = f"mtp.{len(hidden) - 1}."
    h = hc_head(x, weights[last + "hc_head_fn"], weights[last + "hc_head_base"], weights[last + "hc_head_scale"],
                config)
    u = rms_norm(h, weights[last + "norm.weight"], config["rms_norm_eps"]) @ weights["head.weight"].T
    return {"hidden": hidden, "experts": experts, "head_hidden": h, "base_logits": u}


# -- state + Markov head (DSPARK.md b8-b9, §c) ---------------------------------------------------------


class DSparkOracle:
    """The drafter's whole state (DSPARK.md §c): per draft layer, context K/V by absolute position.
    ``commit`` writes committed positions (b1-b3); ``draft`` runs one block (b4-b9)."""

    def __init__(self, config: dict, weights: dict, kv_fp8_roundtrip: bool = False):
        self.config, self.weights, self.kv_fp8_roundtrip = config, weights, kv_fp8_roundtrip
        self.layers = n_draft_layers(weights)
        self.context: list[dict[int, torch.Tensor]] = [{} for _ in range(self.layers)]

    def commit(self, features: torch.Tensor, positions) -> None:
        """Write ``c_i[p]`` for each committed row (features of the target's verify/prefill pass)."""
        positions = [int(p) for p in torch.as_tensor(positions).reshape(-1)]
        kvs = features_to_context(self.weights, features, positions, self.config, self.kv_fp8_roundtrip)
        for i, kv in enumerate(kvs):
            for r, pos in enumerate(positions):
                self.context[i][pos] = kv[r]

    def window(self, start: int) -> list[int]:
        """Context positions every block row sees: ``max(0, P − sliding_window) .. P − 1`` (b4)."""
        return list(range(max(0, start - self.config["sliding_window"]), start))

    def window_kv(self, i: int, start: int) -> torch.Tensor:
        """Layer i's context K/V for an anchor at ``start``; every window position must be committed."""
        pos = self.window(start)
        missing = [p for p in pos if p not in self.context[i]]
        if missing:
            raise KeyError(f"layer {i}: context positions {missing} were never committed")
        if not pos:
            return torch.zeros(0, self.config["head_dim"], dtype=F64)
        return torch.stack([self.context[i][p] for p in pos])

    def draft(self, anchor_token: int, start: int, temperature: float | None = None,
              generator: torch.Generator | None = None, noise_token_id: int | None = None) -> dict:
        """One DSpark block: ids ``[anchor, noise × (γ−1)]`` at ``start..start+γ−1`` (b4), the parallel
        backbone, then the sequential Markov step (b8) and confidences (b9).  Greedy when
        ``temperature`` is None, else ``x_k ~ softmax(z_k / T)`` drawn with ``generator``.
        -> dict: ``tokens`` [γ], ``logits`` z [γ, V], ``confidences`` [γ], ``probs`` q [γ, V] (sampled
        only), ``markov_embed`` e [γ, r], plus :func:`block_forward`'s entries."""
        cfg, w = self.config, self.weights
        gamma = cfg["dspark_block_size"]
        noise = cfg["dspark_noise_token_id"] if noise_token_id is None else noise_token_id
        ids = torch.tensor([anchor_token] + [noise] * (gamma - 1))
        ctx = [self.window_kv(i, start) for i in range(self.layers)]
        out = block_forward(w, ids, start, ctx, cfg, self.kv_fp8_roundtrip)
        out.update(markov_and_confidence(w, out["base_logits"], out["head_hidden"], anchor_token, self.layers,
                                         temperature, generator))
        out["ids"], out["window"] = ids, self.window(start)
        return out


def markov_and_confidence(weights: dict, u: torch.Tensor, h: torch.Tensor, anchor: int, layers: int,
                          temperature: float | None, generator: torch.Generator | None) -> dict:
    """DSPARK.md b8-b9: ``e_k = W1[x_{k−1}]``, ``z_k = U_k + W2·e_k``, ``c_k = σ(w·[h_k; e_k])``;
    x_k = argmax z_k (greedy) or a draw from ``softmax(z_k / T)`` (the sampled x_{k−1} feeds B_k)."""
    last = f"mtp.{layers - 1}."
    w1, w2 = weights[last + "markov_head.markov_w1.weight"], weights[last + "markov_head.markov_w2.weight"]
    wc = weights[last + "confidence_head.proj.weight"][0]
    prev, tokens, zs, es, confs, probs = int(anchor), [], [], [], [], []
    for k in range(u.shape[0]):
        e = w1[prev]
        z = u[k] + w2 @ e
        confs.append(torch.sigmoid(wc @ torch.cat([h[k], e])))
        if temperature is None:
            prev = int(torch.argmax(z))
        else:
            q = torch.softmax(z / temperature, dim=-1)
            prev = int(torch.multinomial(q, 1, generator=generator))
            probs.append(q)
        tokens.append(prev)
        zs.append(z)
        es.append(e)
    out = {"tokens": torch.tensor(tokens), "logits": torch.stack(zs), "confidences": torch.stack(confs),
           "markov_embed": torch.stack(es)}
    if probs:
        out["probs"] = torch.stack(probs)
    return out
