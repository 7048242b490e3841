"""One forward of a transformers DeepSeek-V4 target over a ragged batch of sequences.

transformers' V4 cache keeps one compressor state per layer for the whole batch, and its
compression windows count cache positions, so a left-padded batch compresses different
windows than the same sequence alone: batched V4 decoding there is not what per-sequence
decoding computes.  Here every sequence keeps its own state and its own positions; the
tokens of all sequences are flattened into one row so the token-wise work
(hyper-connections, norms, the MoE, the head) runs once for the whole batch.  The
attention (with its compressor and indexer state) runs either

* ``"batched"`` (default): once per layer for all sequences, their state held as padded
  tensors with per-sequence lengths (:mod:`.batched_attention`), with the target's
  ``self_attn`` weights; or
* ``"per_sequence"``: once per sequence through the target's own ``self_attn`` with one
  :class:`RollbackDeepseekV4Cache` each -- transformers' code, the oracle the batched path
  is tested against.

The layer arithmetic is transformers' ``DeepseekV4DecoderLayer.forward`` spelled out, so
each sequence computes what it would compute alone.

Works with targets spread over several GPUs by accelerate's ``device_map``: activations
move to each layer's device, caches (and batched state) live where their layer lives.
"""

from __future__ import annotations

import torch

from ..compat import takes_cache_kwarg
from ..layers.rope import rotary_tables
from ..ops.hyper_connection import hc_pre
from .batched_state import BatchedSequence, BatchedTargetState
from .dtypes import norms_to_compute_dtype
from .features import check_layers
from .rollback_cache import RollbackDeepseekV4Cache


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


_ATTENTION = ("batched", "per_sequence")


class RaggedTargetForward:
    """Runs ``target`` (a ``DeepseekV4ForCausalLM``) on ``chunks[i]`` appended to sequence
    ``i``'s cache.  Returns the logits of the requested rows and the pre-``hc_head``
    residual of every row (what the MTP reads), or with ``feature_layers`` the outputs of those
    decoder layers at every row (what a drafter reads: :mod:`.features`).

    ``attention="batched"``: one attention pass per layer for all sequences, with their
    state in one :class:`~.batched_attention.BatchedTargetState` (the caches are its
    :class:`~.batched_attention.BatchedSequence` handles); a forward whose chunks are longer
    than ``max_chunk`` tokens runs in pieces of ``max_chunk`` (bounded attention memory).
    ``attention="per_sequence"``: the attention runs once per sequence through the target's
    own ``self_attn`` with a :class:`RollbackDeepseekV4Cache` each (the exactness oracle)."""

    def __init__(self, target, attention: str = "batched", max_chunk: int = 256,
                 feature_layers: list[int] | None = None):
        from transformers.masking_utils import create_sliding_window_causal_mask

        if attention not in _ATTENTION:
            raise ValueError(f"target attention must be one of {_ATTENTION}, got {attention!r}.")
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1, got {max_chunk}.")
        norms_to_compute_dtype(target)  # transformers 5.17 reloads bf16 targets with fp32 norms (a no-op on 5.18+)
        self.target, self.model = target, target.model
        self.config = target.config
        self.attention, self.max_chunk = attention, int(max_chunk)
        last = len(self.model.layers) - 1
        self.feature_layers = None if feature_layers is None else check_layers(target, feature_layers)
        # the layers whose outputs a forward keeps: the drafter's, then the last (the head reads it) if not among them
        self._kept = (self.feature_layers or []) + ([last] if last not in (self.feature_layers or []) else [])
        self._mask_fn = create_sliding_window_causal_mask
        self._attn_cache_kw = takes_cache_kwarg(type(self.model.layers[0].self_attn).forward)
        self._mask_cache_kw = takes_cache_kwarg(create_sliding_window_causal_mask)

    def new_cache(self, max_rollback: int) -> RollbackDeepseekV4Cache:
        return RollbackDeepseekV4Cache(self.config, max_rollback=max_rollback)

    def new_caches(self, batch_size: int, max_rollback: int, capacity: int | None = None) -> list:
        """One cache per sequence, of the kind this runner's ``attention`` takes.  Call a
        cache's ``free()`` (batched) or drop it (per-sequence) when its sequence finishes.
        ``capacity`` (batched): fixed shapes for sequences of at most that many tokens."""
        if self.attention == "per_sequence":
            return [self.new_cache(max_rollback) for _ in range(batch_size)]
        return BatchedTargetState(self.config, batch_size, max_rollback, capacity).sequences()

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
        is token ``j`` of chunk ``i``; with ``feature_layers``, ``features [N, F, hc_mult, D]`` (those layers'
        outputs, in their order) in place of the residual."""
        if len(chunks) != len(caches) or not chunks:
            raise ValueError(f"one cache per chunk: got {len(chunks)} chunks and {len(caches)} caches.")
        lengths = [int(c.numel()) for c in chunks]
        if min(lengths) < 1:
            raise ValueError("every chunk needs at least one token.")
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        batched = [isinstance(c, BatchedSequence) for c in caches]
        if any(batched):
            if not all(batched) or len({id(c.state) for c in caches}) != 1:
                raise ValueError("batched attention: every cache must be a sequence of the same BatchedTargetState.")
            kept = self._batched(chunks, caches, lengths)
        else:
            kept = self._per_sequence(chunks, caches, lengths, offsets)
        residual = kept[:, self._kept.index(len(self.model.layers) - 1)]
        model = self.model
        head_dev = _device_of(model.hc_head)
        rows = residual if logit_rows is None else residual[logit_rows.to(residual.device)]
        h = model.norm(model.hc_head(rows.to(head_dev).unsqueeze(0)))
        lm = self.target.lm_head
        logits = lm(h.to(_device_of(lm)))[0]
        if self.feature_layers is not None:
            return logits, kept[:, : len(self.feature_layers)], offsets
        return logits, residual, offsets

    def _per_sequence(self, chunks, caches, lengths, offsets) -> torch.Tensor:
        model = self.model
        embed_dev = _device_of(model.embed_tokens)
        ids = torch.cat([c.reshape(-1).to(embed_dev) for c in chunks]).unsqueeze(0)  # [1, N]
        positions = torch.cat([
            torch.arange(cache.get_seq_length(), cache.get_seq_length() + n, device=embed_dev)
            for cache, n in zip(caches, lengths)
        ]).unsqueeze(0)
        embeds = model.embed_tokens(ids)
        per_seq = []
        for i, cache in enumerate(caches):  # masks are built before any layer updates the cache
            a, b = offsets[i], offsets[i + 1]
            per_seq.append((a, b, positions[:, a:b], self._mask(embeds[:, a:b], cache, positions[:, a:b])))

        def attend(layer_idx, attn, x, pe, on):
            outs = []
            for i, (a, b, pos, mask) in enumerate(per_seq):
                pe_i = {k: (cos[:, a:b], sin[:, a:b]) for k, (cos, sin) in pe.items()}
                out, _ = attn(x[:, a:b], position_embeddings=pe_i, position_ids=on(pos), attention_mask=on(mask),
                              **{self._attn_cache_kw: caches[i]})
                outs.append(out)
            return torch.cat(outs, dim=1)

        return self._layers(ids, positions, embeds, attend)

    def _batched(self, chunks, caches, lengths) -> torch.Tensor:
        model, state = self.model, caches[0].state
        embed_dev = _device_of(model.embed_tokens)
        flat = [c.reshape(-1).to(embed_dev) for c in chunks]
        pieces = []  # long chunks run in pieces of max_chunk tokens, each piece a forward of its own
        for start in range(0, max(lengths), self.max_chunk):
            part = [i for i, n in enumerate(lengths) if n > start]
            pieces.append((part, [flat[i][start : start + self.max_chunk] for i in part]))
        outs = []
        for part, piece in pieces:
            slots = [caches[i].slot for i in part]
            plan = state.plan(slots, [int(p.numel()) for p in piece])
            ids = torch.cat(piece).unsqueeze(0)
            positions = plan.on(embed_dev)["flat_pos"]

            def attend(layer_idx, attn, x, pe, on, plan=plan):
                return state.attend(layer_idx, attn, x, pe, plan)

            outs.append(self._layers(ids, positions, model.embed_tokens(ids), attend))
            state.commit(plan)
        if len(outs) == 1:
            return outs[0]
        # back to chunk order: piece p holds tokens [p * max_chunk, ...) of the chunks still that long
        per_chunk = [[] for _ in chunks]
        for (part, piece), res in zip(pieces, outs):
            a = 0
            for i, p in zip(part, piece):
                per_chunk[i].append(res[a : a + p.numel()])
                a += p.numel()
        return torch.cat([r for rs in per_chunk for r in rs])

    def _mhc(self, hc, streams: torch.Tensor):
        """transformers' ``DeepseekV4HyperConnection(streams)`` -- the same math (design §2: an RMS-scaled
        mix GEMV, sigmoids, Sinkhorn, the collapse) -- through ``dsv4_mtp::hc_pre``: two kernels on CUDA
        where transformers' module launches ~120 (its Sinkhorn alone is 20 x 6).  -> (collapsed, post, comb)."""
        return hc_pre(streams, hc.fn, hc.base, hc.scale, hc.hc_sinkhorn_iters, hc.hc_eps, self.config.rms_norm_eps)

    def _layers(self, ids, positions, embeds, attend) -> torch.Tensor:
        """transformers' ``DeepseekV4DecoderLayer.forward`` over the flat rows, with the attention
        delegated to ``attend(layer_idx, self_attn, x, position_embeddings, on)``.  Returns the
        outputs of the kept layers ``[N, len(_kept), hc_mult, D]`` (the last layer's: the residual)."""
        model = self.model
        pe, hidden = self.streams_in(embeds, positions)
        moved: dict = {}
        outputs: dict[int, torch.Tensor] = {}

        for idx, layer in enumerate(model.layers):
            dev = _device_of(layer)

            def on(t, dev=dev):  # per-device copies of the shared per-forward tensors (device_map targets)
                if t is None or not isinstance(t, torch.Tensor) or t.device == dev:
                    return t
                key = (id(t), dev)
                if key not in moved:
                    moved[key] = t.to(dev)
                return moved[key]

            pe_dev = {k: (on(cos), on(sin)) for k, (cos, sin) in pe.items()}

            def attend_here(attn, x, pe, idx=idx, on=on):
                return attend(idx, attn, x, pe, on)

            hidden = self.block(layer, hidden.to(dev), on(ids), pe_dev, attend_here)
            if idx in self._kept:
                outputs[idx] = hidden[0]
        if len(self._kept) == 1:
            return hidden[0].unsqueeze(1)  # [N, 1, hc, D]: the residual, no copy
        return torch.stack([outputs[i].to(hidden.device) for i in self._kept], dim=1)

    def streams_in(self, embeds, positions):
        """RoPE tables of the rows (``{"main", "compress"}``) and the embeddings as ``hc_mult`` streams."""
        pe = {k: rotary_tables(self.model.rotary_emb, embeds, positions, k) for k in ("main", "compress")}
        return pe, embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()

    def block(self, layer, hidden, ids, pe, attend) -> torch.Tensor:
        """One ``DeepseekV4DecoderLayer`` on the streams ``hidden [1, N, hc, D]``, with the attention
        delegated to ``attend(self_attn, x, position_embeddings)``."""
        dtype = hidden.dtype
        collapsed, post, comb = self._mhc(layer.attn_hc, hidden)
        attn = attend(layer.self_attn, layer.input_layernorm(collapsed), pe)
        hidden = post.to(dtype).unsqueeze(-1) * attn.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), hidden)
        collapsed, post, comb = self._mhc(layer.ffn_hc, hidden)
        mlp = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids=ids)
        return post.to(dtype).unsqueeze(-1) * mlp.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), hidden)
