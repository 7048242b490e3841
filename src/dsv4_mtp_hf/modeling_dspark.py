"""`DeepseekV4DSparkForCausalLM`: DeepSeek-V4's DSpark drafter as a transformers model (design §7b).

Two calls make a round, with the target's features of committed positions and the anchor token::

    commit:  main_x[p] = main_norm(main_proj . concat_l mean_j X_l[p, j])        (l in dspark_target_layer_ids)
             c_i[p]    = RoPE_p(kv_norm_i(wkv_i . main_x[p]))  into draft layer i's window cache
    draft:   block [anchor, noise x (γ-1)] at positions P..P+γ-1, embedded and copied to hc_mult streams;
             num_draft_layers V4 draft layers, every block row attending to the context window
             (positions P-window..P-1) and to the whole block (no causal mask);
             h_k = hc_head(streams_k);  U_k = lm_head(norm(h_k))
             Markov:     e_k = W1[x_{k-1}] (x_0 = anchor);  z_k = U_k + W2 e_k;  x_k chosen from z_k
             confidence: c_k = sigmoid(w . [h_k ; e_k])  (drafts 1..k-1 accepted -> draft k accepted)

The backbone runs once for the block; only the rank-r Markov step is sequential.  The embedding and lm head
belong to the target and are shared by reference (never part of this model's ``state_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from .cache import DSparkKVCache
from .configuration import DeepseekV4DSparkConfig
from .draft_model import DeepseekV4DraftModel
from .layers.block import DeepseekV4DraftBlock
from .layers.hyper_connection import HyperHead
from .layers.linear import project
from .layers.norms import RMSNorm
from .layers.rope import rope_cos_sin
from .ops.argmax import argmax_last


@dataclass
class DeepseekV4DSparkOutput(ModelOutput):
    """A drafted block: ``tokens [B, γ]``, ``logits [B, γ, V]`` (fp32 ``z_k``, or the processed logits each draft
    was chosen from), ``confidences [B, γ]``, ``hidden [B, γ, D]`` (the pre-norm head states ``h_k``)."""

    tokens: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    confidences: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    cache: DSparkKVCache | None = None


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The default draft choice: the argmax of fp32 logits ``[B, V]`` and the logits themselves."""
    return argmax_last(logits), logits


class DeepseekV4DSparkForCausalLM(DeepseekV4DraftModel):
    """DeepSeek-V4's DSpark drafter: bind it to its V4 target, then ``target.generate(ids, assistant_model=dspark)``.
    :meth:`commit` and :meth:`draft` are the round's two calls (the drafter protocol drives them)."""

    config_class = DeepseekV4DSparkConfig
    config: DeepseekV4DSparkConfig
    base_model_prefix = "dspark"

    def __init__(self, config: DeepseekV4DSparkConfig, target_model=None):
        super().__init__(config)
        d, r, v = config.hidden_size, config.dspark_markov_rank, config.vocab_size
        self.main_proj = nn.Linear(len(config.dspark_target_layer_ids) * d, d, bias=False)
        self.main_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DeepseekV4DraftBlock(config) for _ in range(config.num_draft_layers))
        self.hc_head = HyperHead(config.hc_mult, d, config.hc_eps, config.rms_norm_eps)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.markov_embed = nn.Embedding(v, r)  # W1: the previous token's rank-r code
        self.markov_proj = nn.Linear(r, v, bias=False)  # W2: its bias on the next token's logits
        self.confidence = nn.Linear(d + r, 1, bias=False)
        self.post_init()
        if self.generation_config is not None:
            self.generation_config.num_assistant_tokens = "auto"  # verify the prefix the confidences choose
            self.generation_config.num_assistant_tokens_schedule = "constant"
        self._init_binding(target_model)

    def _init_weights(self, module):
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        else:
            super()._init_weights(module)

    @property
    def block_size(self) -> int:
        return self.config.dspark_block_size

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, target_model=None, **kwargs):
        """Load the DSpark drafter of a DeepSeek-V4 release (0731, -DSpark; ``model_type: deepseek_v4``, only the
        shards holding ``mtp.*`` fetched, plus ``embed.weight`` / ``head.weight`` when no target is given) or a
        saved drafter of ours (``model_type: deepseek_v4_dspark``).  ``target_model=``: bind to it."""
        from .loading.dspark import load_dspark_checkpoint

        return load_dspark_checkpoint(cls, super().from_pretrained, pretrained_model_name_or_path, *args,
                                       target_model=target_model, **kwargs)

    def new_cache(self, batch_size: int = 1, **kwargs) -> DSparkKVCache:
        """The drafter's window caches for ``batch_size`` sequences (on the model's device and dtype)."""
        w = self.main_proj.weight
        kwargs.setdefault("device", w.device)
        kwargs.setdefault("dtype", w.dtype)
        return DSparkKVCache(self.config, batch_size, **kwargs)

    # -- the round's two calls -----------------------------------------------------------------------
    def commit(self, features: torch.Tensor, positions: torch.Tensor, cache: DSparkKVCache) -> None:
        """Write the context K/V of committed rows into every layer's window cache.  ``features
        [B, n, F, hc, D]``: the target layers' outputs at those rows (F = ``len(dspark_target_layer_ids)``, in that
        order); ``positions [B, n]``: their positions, continuing each sequence's cache length."""
        w = self.main_proj.weight
        hidden = features.to(w.device).float().mean(dim=-2).flatten(-2).to(w.dtype)  # streams' plain mean, layer-major
        main_x = self.main_norm(project(hidden, self.main_proj))
        cos, sin = rope_cos_sin(positions.to(w.device), self.config.qk_rope_head_dim, self.config.rope_theta)
        for layer, layer_cache in zip(self.layers, cache.layers):
            layer_cache.update(layer.self_attn.key_value(main_x, cos, sin))

    def backbone(self, anchor: torch.Tensor, cache: DSparkKVCache) -> torch.Tensor:
        """The block's parallel part: ``anchor [B, 1]`` at each sequence's cache length P (the block's rows go to
        positions P..P+γ-1 and into the caches, to be rolled back) -> the pre-norm head states ``h [B, γ, D]``."""
        c, w = self.config, self.main_proj.weight
        shared = self._require_bound()
        b, g = anchor.shape[0], c.dspark_block_size
        ids = torch.cat([anchor, anchor.new_full((b, g - 1), c.dspark_noise_token_id)], dim=1)
        embed = shared.embed_tokens(ids.to(shared.embed_tokens.weight.device)).to(device=w.device, dtype=w.dtype)
        streams = embed.unsqueeze(2).expand(-1, -1, c.hc_mult, -1).contiguous()  # copies, no mixing
        start = cache.seq_lengths.to(w.device).unsqueeze(1)
        positions = start + torch.arange(g, device=w.device)
        cos, sin = rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta)
        # every row sees the context window and the whole block: the causal window of the block's last row
        visible = ((start + g - 1).expand(b, g), c.sliding_window + g)
        for layer, layer_cache in zip(self.layers, cache.layers):
            streams = layer(streams, cos, sin, positions, layer_cache, "reference", None, visible)
        return self.hc_head(streams)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``U = lm_head(norm(h))`` of head states ``[B, γ, D]`` -> ``[B, γ, V]``."""
        head = self._require_bound().lm_head
        return project(self.norm(hidden).to(device=head.weight.device, dtype=head.weight.dtype), head)

    def markov(self, base_logits: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor):
        """One sequential step at block row k: ``base_logits U_k [B, V]``, ``hidden h_k [B, D]``, the previous
        token ``[B]`` -> ``(z_k [B, V] fp32, c_k [B] fp32)``."""
        e = self.markov_embed(previous.to(self.markov_embed.weight.device))
        z = base_logits.float() + project(e, self.markov_proj).float().to(base_logits.device)
        features = torch.cat([hidden.float(), e.float().to(hidden.device)], dim=-1)
        confidence = torch.sigmoid(nn.functional.linear(features, self.confidence.weight.float()))
        return z, confidence.squeeze(-1)

    def draft(self, anchor: torch.Tensor, cache: DSparkKVCache, select=greedy) -> DeepseekV4DSparkOutput:
        """Draft a block after ``anchor [B, 1]`` (at each sequence's cache length): the backbone once, then the
        γ Markov steps, each draft chosen by ``select(z_k [B, V]) -> (token [B], processed logits [B, V])``
        (default: greedy).  No host reads (CUDA-graph safe)."""
        hidden = self.backbone(anchor, cache)
        base = self.head_logits(hidden)
        previous, tokens, logits, confidences = anchor[:, 0], [], [], []
        for k in range(self.config.dspark_block_size):
            z, c = self.markov(base[:, k], hidden[:, k], previous)
            previous, processed = select(z)
            tokens.append(previous)
            logits.append(processed)
            confidences.append(c)
        return DeepseekV4DSparkOutput(tokens=torch.stack(tokens, 1), logits=torch.stack(logits, 1),
                                      confidences=torch.stack(confidences, 1), hidden=hidden, cache=cache)

    # -- transformers' entry point ----------------------------------------------------------------------
    def forward(self, input_ids: torch.LongTensor, hidden_states: torch.Tensor | None = None,
                cache: DSparkKVCache | None = None, past_key_values: DSparkKVCache | None = None,
                **kwargs) -> DeepseekV4DSparkOutput:
        """Commit the target features ``hidden_states [B, n, F, hc, D]`` of the positions after the cache's
        (optional), then draft a greedy block after the anchor tokens ``input_ids [B, 1]``.  The block's rows stay
        in the cache until rolled back (``cache.truncate``)."""
        cache = cache if cache is not None else past_key_values
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] != 1:
            raise ValueError(f"`input_ids` must be the anchor tokens [batch, 1], got "
                             f"{None if input_ids is None else tuple(input_ids.shape)}.")
        if cache is None:
            cache = self.new_cache(input_ids.shape[0])
        if hidden_states is not None:
            self._check_features(hidden_states, input_ids.shape[0])
            n = hidden_states.shape[1]
            positions = cache.seq_lengths.unsqueeze(1) + torch.arange(n, device=cache.seq_lengths.device)
            self.commit(hidden_states, positions, cache)
        return self.draft(input_ids, cache)

    def _check_features(self, features: torch.Tensor, batch: int) -> None:
        c = self.config
        expected = (batch, len(c.dspark_target_layer_ids), c.hc_mult, c.hidden_size)
        got = tuple(features.shape)
        if features.dim() != 5 or (got[0], *got[2:]) != expected:
            raise ValueError(
                f"`hidden_states` must be the target's layer outputs [batch, rows, {expected[1]} layers, hc_mult, "
                f"hidden] = [{batch}, n, {', '.join(map(str, expected[1:]))}], got {got}: the outputs of target "
                f"layers {c.dspark_target_layer_ids} (multi-stream, before any collapse).")
