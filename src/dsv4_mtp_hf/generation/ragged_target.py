"""One forward of a transformers DeepSeek-V4 target over a ragged batch of sequences.

transformers' V4 cache keeps one compressor state per layer for the whole batch, and its
compression windows count cache positions, so a left-padded batch compresses different
windows than the same sequence alone: batched V4 decoding there is not what per-sequence
decoding computes.  Here every sequence keeps its own :class:`RollbackDeepseekV4Cache`
and its own positions; the tokens of all sequences are flattened into one row so the
token-wise work (hyper-connections, norms, the MoE, the head) runs once for the whole
batch, and only the attention (with its compressor and indexer state) runs per sequence,
through the target's own ``self_attn`` modules.  The layer arithmetic is transformers'
``DeepseekV4DecoderLayer.forward`` spelled out, so each sequence computes what it would
compute alone.

Works with targets spread over several GPUs by accelerate's ``device_map``: activations
move to each layer's device, caches live where their layer lives.
"""

from __future__ import annotations

import inspect

import torch

from .target_cache import RollbackDeepseekV4Cache


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


class RaggedTargetForward:
    """Runs ``target`` (a ``DeepseekV4ForCausalLM``) on ``chunks[i]`` appended to sequence
    ``i``'s cache.  Returns the logits of the requested rows and the pre-``hc_head``
    residual of every row (what the MTP reads)."""

    def __init__(self, target):
        from transformers.masking_utils import create_sliding_window_causal_mask

        self.target, self.model = target, target.model
        self.config = target.config
        self._mask_fn = create_sliding_window_causal_mask
        attn_params = inspect.signature(type(self.model.layers[0].self_attn).forward).parameters
        self._attn_cache_kw = "cache" if "cache" in attn_params else "past_key_values"
        mask_params = inspect.signature(create_sliding_window_causal_mask).parameters
        self._mask_cache_kw = "cache" if "cache" in mask_params else "past_key_values"

    def new_cache(self, max_rollback: int) -> RollbackDeepseekV4Cache:
        return RollbackDeepseekV4Cache(self.config, max_rollback=max_rollback)

    def _mask(self, embeds: torch.Tensor, cache, positions: torch.Tensor):
        # What DeepseekV4Model.forward builds for this sequence alone (generate passes an
        # all-ones attention mask over the cached and new tokens).
        ones = torch.ones(1, cache.get_seq_length() + embeds.shape[1], dtype=torch.long, device=embeds.device)
        return self._mask_fn(config=self.config, inputs_embeds=embeds, attention_mask=ones,
                             position_ids=positions, **{self._mask_cache_kw: cache})

    @torch.no_grad()
    def __call__(self, chunks: list[torch.Tensor], caches: list, logit_rows: torch.Tensor | None = None):
        """``chunks[i]``: 1-D token ids appended to sequence ``i`` (positions continue its
        cache).  ``logit_rows``: flat row indices whose logits are needed (default all).
        Returns ``(logits [R, V], residual [N, hc_mult, D], offsets)`` where row ``offsets[i] + j``
        is token ``j`` of chunk ``i``."""
        if len(chunks) != len(caches) or not chunks:
            raise ValueError(f"one cache per chunk: got {len(chunks)} chunks and {len(caches)} caches.")
        model, cfg = self.model, self.config
        embed_dev = _device_of(model.embed_tokens)
        lengths = [int(c.numel()) for c in chunks]
        if min(lengths) < 1:
            raise ValueError("every chunk needs at least one token.")
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        ids = torch.cat([c.reshape(-1).to(embed_dev) for c in chunks]).unsqueeze(0)  # [1, N]
        positions = torch.cat([
            torch.arange(cache.get_seq_length(), cache.get_seq_length() + n, device=embed_dev)
            for cache, n in zip(caches, lengths)
        ]).unsqueeze(0)
        embeds = model.embed_tokens(ids)
        pe = {k: model.rotary_emb(embeds, position_ids=positions, layer_type=k) for k in ("main", "compress")}
        per_seq = []
        for i, cache in enumerate(caches):  # masks are built before any layer updates the cache
            a, b = offsets[i], offsets[i + 1]
            per_seq.append((a, b, positions[:, a:b], self._mask(embeds[:, a:b], cache, positions[:, a:b])))
        hidden = embeds.unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
        moved: dict = {}

        def on(t, dev):  # per-device copies of the shared per-forward tensors (device_map targets)
            if t is None or not isinstance(t, torch.Tensor) or t.device == dev:
                return t
            key = (id(t), dev)
            if key not in moved:
                moved[key] = t.to(dev)
            return moved[key]

        for layer in model.layers:
            dev = _device_of(layer)
            hidden = hidden.to(dev)
            dtype = hidden.dtype
            post, comb, collapsed = layer.attn_hc(hidden)
            x = layer.input_layernorm(collapsed)
            outs = []
            for i, (a, b, pos, mask) in enumerate(per_seq):
                pe_i = {k: (on(cos, dev)[:, a:b], on(sin, dev)[:, a:b]) for k, (cos, sin) in pe.items()}
                out, _ = layer.self_attn(x[:, a:b], position_embeddings=pe_i, position_ids=on(pos, dev),
                                         attention_mask=on(mask, dev), **{self._attn_cache_kw: caches[i]})
                outs.append(out)
            attn = torch.cat(outs, dim=1)
            hidden = post.to(dtype).unsqueeze(-1) * attn.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), hidden)
            post, comb, collapsed = layer.ffn_hc(hidden)
            mlp = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids=on(ids, dev))
            hidden = post.to(dtype).unsqueeze(-1) * mlp.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), hidden)

        residual = hidden[0]  # [N, hc, D]: the MTP's input
        head_dev = _device_of(model.hc_head)
        rows = residual if logit_rows is None else residual[logit_rows.to(residual.device)]
        h = model.norm(model.hc_head(rows.to(head_dev).unsqueeze(0)))
        lm = self.target.lm_head
        logits = lm(h.to(_device_of(lm)))[0]
        return logits, residual, offsets
