"""A DeepSeek-V4 target cache that can be rolled back after rejected drafts.

transformers' ``DeepseekV4ForCausalLM`` keeps, per compressed-attention layer,
state that a plain ``crop`` cannot undo: the compressor buffers
(``buffer_kv`` / ``buffer_gate``), the compressed entries and their count, the
indexer's own compressor state (CSA) and the CSA overlap slice (the ``Ca`` half
of the last closed window). Its sliding-window K=V branch on HCA/CSA layers also
trims to ``sliding_window - 1`` tokens on every update, so even that part cannot
be cropped once the window is full.

:class:`RollbackDeepseekV4Cache` replaces each layer by a subclass of the layer
transformers would have built (``DynamicSlidingWindowLayer``,
``DeepseekV4HCACache``, ``DeepseekV4CSACache``) that additionally keeps a
bounded amount of raw history:

* sliding K=V: the last ``sliding_window - 1 + max_rollback`` rows instead of
  ``sliding_window - 1`` (the attention still only sees the last
  ``sliding_window - 1`` cached rows, exactly as transformers does);
* per compressor stream (``"compressor"``, and ``"indexer"`` on CSA layers):
  the projected ``kv`` / ``gate`` rows from the start of the window that holds
  position ``T - max_rollback`` up to ``T`` (at most
  ``compress_rate - 1 + max_rollback`` rows);
* CSA only: the overlap slice that was current after each of the last
  ``ceil(max_rollback / compress_rate) + 1`` emitted entries.

``crop`` to a length ``L`` then rebuilds the exact state a cache that never saw
the tokens after ``L`` would hold: compressed entries are truncated to
``L // compress_rate`` (entries of windows that are still complete are kept
bit-for-bit), the buffers are re-sliced from the raw history, the overlap slice
is restored from its snapshot, and the sliding tail is shortened. Nothing is
recomputed, so a rollback costs a few tensor slices.

Memory on top of transformers' own cache is bounded by ``max_rollback`` (plus
one compression window), independent of the context length. Cropping further
back than what is retained raises :class:`CacheRollbackError` before any layer
is modified.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicSlidingWindowLayer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache, DeepseekV4HCACache

__all__ = [
    "CacheRollbackError",
    "RollbackDeepseekV4Cache",
    "RollbackSlidingLayer",
    "RollbackHCALayer",
    "RollbackCSALayer",
]

_SLIDING = "sliding_attention"
_HCA = "heavily_compressed_attention"
_CSA = "compressed_sparse_attention"


class CacheRollbackError(RuntimeError):
    """Raised when a crop asks for more rollback than the cache has retained."""


def _keep_last(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Last ``n`` rows of ``t`` along ``dim``; cloned when shortened so the big source storage can be freed."""
    length = t.shape[dim]
    if length <= n:
        return t
    return t.narrow(dim, length - n, n).clone()


def _resolve_target_length(tokens_or_length: int, current: int) -> int:
    """``crop`` argument -> absolute target length (DynamicCache conventions).

    ``n < 0``: remove ``-n`` tokens. ``n == 0``: remove nothing (transformers calls ``crop(0)`` after a fully
    accepted draft). ``n > 0``: legacy absolute form, keep the first ``n`` tokens (no-op if ``n >= current``).
    """
    n = int(tokens_or_length)
    if n <= 0:
        return current + n
    return min(n, current)


class _SlidingHistoryMixin:
    """Sliding-window K=V branch that keeps ``max_rollback`` extra rows so it can be cropped exactly.

    Must come before a ``DynamicSlidingWindowLayer`` subclass in the MRO. ``self.keys`` / ``self.values`` are kept as
    views of the last ``sliding_window - 1`` rows, like transformers' own layers.
    """

    # Never let our subclasses register themselves in transformers' global layer-type mappings.
    _layer_type = None
    is_croppable = True

    def _init_history(self, max_rollback: int) -> None:
        if max_rollback < 0:
            raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
        self.max_rollback = int(max_rollback)
        self._k_tail: torch.Tensor | None = None
        self._v_tail: torch.Tensor | None = None  # None when K is V (always the case in V4)

    # --- transformers' layer API -------------------------------------------------------------------------------------
    def activate_past_recording(self, **kwargs) -> None:
        # History is always kept (bounded by max_rollback); keep the flag for transformers' bookkeeping only.
        # transformers >= 5.25 passes ``recurrent_states_to_keep`` (meant for linear-attention layers).
        self.record_past = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._k_tail = key_states[..., :0, :]
            self._v_tail = None if value_states is key_states else value_states[..., :0, :]
        shared = self._v_tail is None
        if shared and value_states is not key_states:
            raise ValueError("This V4 cache layer was initialised with shared K=V states; got distinct values.")
        visible = self.sliding_window - 1
        old_len = self._k_tail.shape[-2]
        start = max(old_len - visible, 0)
        keep = visible + self.max_rollback

        full_k = torch.cat([self._k_tail, key_states], dim=-2)
        out_k = full_k[..., start:, :]
        self._k_tail = _keep_last(full_k, keep, dim=-2)
        if shared:
            out_v = out_k
            self._v_tail = None
        else:
            full_v = torch.cat([self._v_tail, value_states], dim=-2)
            out_v = full_v[..., start:, :]
            self._v_tail = _keep_last(full_v, keep, dim=-2)
        self.cumulative_length += key_states.shape[-2]
        self._refresh_visible()
        return out_k, out_v

    def _refresh_visible(self) -> None:
        visible = self.sliding_window - 1
        k = self._k_tail
        self.keys = k[..., max(k.shape[-2] - visible, 0) :, :]
        v = k if self._v_tail is None else self._v_tail
        self.values = v[..., max(v.shape[-2] - visible, 0) :, :]

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def crop(self, tokens_to_remove: int) -> None:
        """Layer-level crop (same argument conventions as :meth:`RollbackDeepseekV4Cache.crop`)."""
        target = _resolve_target_length(tokens_to_remove, self.get_seq_length())
        self._check_rollback(target)
        self._rollback(target)

    def reset(self) -> None:
        # Not delegated: transformers 5.17 zeroes `keys` in place and keeps `is_initialized`, which would leave our tails
        # half-initialised. Dropping everything mirrors 5.24's behaviour.
        self.keys = self.values = None
        self.is_initialized = False
        self._k_tail = self._v_tail = None
        self.cumulative_length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self._k_tail is not None:
            self._k_tail = self._k_tail.index_select(0, beam_idx.to(self._k_tail.device))
        if self._v_tail is not None:
            self._v_tail = self._v_tail.index_select(0, beam_idx.to(self._v_tail.device))
        if self._k_tail is not None:
            self._refresh_visible()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("RollbackDeepseekV4Cache supports batch_size 1 assisted decoding only.")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("RollbackDeepseekV4Cache supports batch_size 1 assisted decoding only.")

    # --- rollback ----------------------------------------------------------------------------------------------------
    def min_restorable_length(self) -> int:
        """Smallest length this layer can be cropped to with the history it holds."""
        total = self.cumulative_length
        if self._k_tail is None:
            return total
        tail = self._k_tail.shape[-2]
        if tail >= total:  # full history retained
            return 0
        return total - tail + (self.sliding_window - 1)

    def _check_rollback(self, target: int) -> None:
        total = self.get_seq_length()
        if target < 0:
            raise CacheRollbackError(f"Cannot crop to a negative length ({target}); the cache holds {total} tokens.")
        lowest = self.min_restorable_length()
        if target < lowest:
            raise CacheRollbackError(
                f"Cannot roll the DeepSeek-V4 cache back to {target} tokens: it holds {total} tokens and retains "
                f"history down to {lowest} (max_rollback={self.max_rollback}). Build the cache with a larger "
                f"`max_rollback` (at least the number of draft tokens verified per step)."
            )

    def _rollback(self, target: int) -> None:
        remove = self.cumulative_length - target
        if remove <= 0 or self._k_tail is None:
            return
        self._k_tail = self._k_tail[..., : self._k_tail.shape[-2] - remove, :]
        if self._v_tail is not None:
            self._v_tail = self._v_tail[..., : self._v_tail.shape[-2] - remove, :]
        self.cumulative_length = target
        self._refresh_visible()


class RollbackSlidingLayer(_SlidingHistoryMixin, DynamicSlidingWindowLayer):
    """Rollback-able replacement for the ``DynamicSlidingWindowLayer`` of V4's pure sliding layers."""

    def __init__(self, sliding_window: int, max_rollback: int, **kwargs):
        super().__init__(sliding_window=sliding_window)
        self._init_history(max_rollback)


class _CompressorHistoryMixin(_SlidingHistoryMixin):
    """Adds bounded raw compressor history (and CSA overlap snapshots) to a V4 HCA/CSA cache layer."""

    def _init_compressor_history(self) -> None:
        names = list(self.compressed_kv)
        self._raw_kv: dict[str, torch.Tensor | None] = dict.fromkeys(names)
        self._raw_gate: dict[str, torch.Tensor | None] = dict.fromkeys(names)
        self._raw_start: dict[str, int] = dict.fromkeys(names, 0)
        # entry count -> overlap (kv, gate) that was current right after that many entries were emitted (CSA only)
        self._overlap_hist: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {n: {} for n in names}
        self._min_entry: dict[str, int] = dict.fromkeys(names, 0)

    def _stream_length(self, name: str) -> int:
        buf = self.buffer_kv[name]
        return self.entry_count[name] * self.compress_rate + (0 if buf is None else buf.shape[1])

    # --- hooks called by transformers' compressors --------------------------------------------------------------------
    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        before = self._stream_length(name)
        out = super().store_compression_weights(name, kv, gate)
        total = before + kv.shape[1]
        raw_kv, raw_gate = self._raw_kv[name], self._raw_gate[name]
        if raw_kv is None:
            raw_kv, raw_gate = kv, gate
        else:
            raw_kv, raw_gate = torch.cat([raw_kv, kv], dim=1), torch.cat([raw_gate, gate], dim=1)
        keep_from = (max(total - self.max_rollback, 0) // self.compress_rate) * self.compress_rate
        keep_from = max(keep_from, self._raw_start[name])
        self._raw_kv[name] = _keep_last(raw_kv, total - keep_from, dim=1)
        self._raw_gate[name] = _keep_last(raw_gate, total - keep_from, dim=1)
        self._raw_start[name] = keep_from
        self._min_entry[name] = keep_from // self.compress_rate
        hist = self._overlap_hist[name]
        for e in [e for e in hist if e < self._min_entry[name]]:
            del hist[e]
        return out

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int):
        emitted_before = self.entry_count[name]  # not bumped yet: update_compressor_states runs after this
        prior = super().update_overlap_state(name, chunk_kv, chunk_gate, head_dim)
        n_windows = chunk_kv.shape[1]
        hist = self._overlap_hist[name]
        # only windows whose entry count can still be a rollback target (a long prefill emits thousands)
        first = max(0, self._min_entry[name] - emitted_before - 1)
        for j in range(first, n_windows):
            entries_after = emitted_before + j + 1
            if j == n_windows - 1:  # the live overlap state: share its storage
                hist[entries_after] = (self.overlap_kv[name], self.overlap_gate[name])
            else:
                hist[entries_after] = (
                    chunk_kv[:, j, :, :head_dim].clone(),
                    chunk_gate[:, j, :, :head_dim].clone(),
                )
        return prior

    # --- rollback ----------------------------------------------------------------------------------------------------
    def min_restorable_length(self) -> int:
        lowest = super().min_restorable_length()
        for name in self.compressed_kv:
            if self._raw_kv[name] is None:
                continue
            # rolling back to L needs raw rows from (L // m) * m: any L >= raw_start works
            lowest = max(lowest, self._raw_start[name])
        return lowest

    def _check_rollback(self, target: int) -> None:
        super()._check_rollback(target)
        for name in self.compressed_kv:
            if self._raw_kv[name] is None:
                continue
            stream_total = self._stream_length(name)
            if stream_total != self.cumulative_length:
                raise CacheRollbackError(
                    f"Compressor stream {name!r} saw {stream_total} tokens but the sliding branch saw "
                    f"{self.cumulative_length}; cannot roll back consistently."
                )
            entries = target // self.compress_rate
            if isinstance(self, DeepseekV4CSACache) and entries > 0 and entries not in self._overlap_hist[name]:
                raise CacheRollbackError(
                    f"No overlap snapshot for {entries} compressed entries of stream {name!r}; "
                    f"max_rollback={self.max_rollback} is too small for this crop."
                )

    def _rollback(self, target: int) -> None:
        if target >= self.cumulative_length:
            return
        m = self.compress_rate
        for name in self.compressed_kv:
            raw_kv = self._raw_kv[name]
            if raw_kv is None:
                continue
            start = self._raw_start[name]
            entries = target // m
            if entries < self.entry_count[name]:
                self.compressed_kv[name] = self.compressed_kv[name][:, :entries]
                self.entry_count[name] = entries
            self._raw_kv[name] = raw_kv[:, : target - start]
            self._raw_gate[name] = self._raw_gate[name][:, : target - start]
            self.buffer_kv[name] = self._raw_kv[name][:, entries * m - start :]
            self.buffer_gate[name] = self._raw_gate[name][:, entries * m - start :]
            if isinstance(self, DeepseekV4CSACache):
                hist = self._overlap_hist[name]
                for e in [e for e in hist if e > entries]:
                    del hist[e]
                if entries == 0:
                    self.overlap_kv[name] = self.overlap_gate[name] = None
                else:
                    self.overlap_kv[name], self.overlap_gate[name] = hist[entries]
        super()._rollback(target)

    def reset(self) -> None:
        _SlidingHistoryMixin.reset(self)
        for name in self.compressed_kv:
            self._raw_kv[name] = self._raw_gate[name] = None
            self._raw_start[name] = 0
            self._min_entry[name] = 0
            self._overlap_hist[name].clear()
        if isinstance(self, DeepseekV4CSACache):  # transformers 5.17's CSA layer has no reset of its own
            for name in self.overlap_kv:
                self.overlap_kv[name] = self.overlap_gate[name] = None
        for name in self.compressed_kv:  # nor of the compressor state
            self.buffer_kv[name] = self.buffer_gate[name] = self.compressed_kv[name] = None
            self.entry_count[name] = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("RollbackDeepseekV4Cache supports batch_size 1 assisted decoding only.")


class RollbackHCALayer(_CompressorHistoryMixin, DeepseekV4HCACache):
    """Rollback-able ``DeepseekV4HCACache``."""

    def __init__(self, config, max_rollback: int, **kwargs):
        super().__init__(config)
        self._init_history(max_rollback)
        self._init_compressor_history()


class RollbackCSALayer(_CompressorHistoryMixin, DeepseekV4CSACache):
    """Rollback-able ``DeepseekV4CSACache`` (compressor + indexer streams, with overlap snapshots)."""

    def __init__(self, config, max_rollback: int, **kwargs):
        super().__init__(config)
        self._init_history(max_rollback)
        self._init_compressor_history()


_LAYER_CLASSES = {_SLIDING: RollbackSlidingLayer, _HCA: RollbackHCALayer, _CSA: RollbackCSALayer}


class RollbackDeepseekV4Cache(DynamicCache):
    """``DynamicCache`` for ``DeepseekV4ForCausalLM`` whose ``crop`` is exact for every V4 layer type.

    Args:
        config: the target's ``DeepseekV4Config`` (or a config whose text config is one).
        max_rollback: how many of the most recent tokens can be removed by ``crop``. For speculative decoding this
            must be at least the largest number of draft tokens verified in one forward (rejected drafts are what
            gets cropped). Memory cost: about ``max_rollback + compress_rate`` rows per compressor stream and
            ``max_rollback`` extra sliding rows per layer.

    Pass it as ``target.generate(..., past_key_values=cache)`` / ``target(..., past_key_values=cache)`` (transformers
    5.24 also accepts, and prefers, ``cache=``). It is a ``DynamicCache`` with pre-built layers; no transformers class
    is modified.
    """

    # The draft side's record of the assisted call that last extended this cache (what a next call resumes from);
    # opaque here.
    draft_state = None

    def __init__(self, config, max_rollback: int = 32):
        text_config = config.get_text_config(decoder=True)
        layer_types = list(getattr(text_config, "layer_types", None) or [])
        if not layer_types:
            raise ValueError("RollbackDeepseekV4Cache needs a DeepSeek-V4 config with `layer_types`.")
        unknown = sorted(set(layer_types) - set(_LAYER_CLASSES))
        if unknown:
            raise ValueError(f"Unsupported DeepSeek-V4 layer types for RollbackDeepseekV4Cache: {unknown}")
        layers = []
        for layer_type in layer_types:
            if layer_type == _SLIDING:
                layers.append(RollbackSlidingLayer(sliding_window=text_config.sliding_window, max_rollback=max_rollback))
            else:
                layers.append(_LAYER_CLASSES[layer_type](text_config, max_rollback=max_rollback))
        self.max_rollback = int(max_rollback)
        # Skip DynamicCache.__init__ (it would build transformers' own, non-rollback-able layers from the config).
        Cache.__init__(self, layers=layers)

    def min_restorable_length(self) -> int:
        """Smallest total length the cache can currently be cropped to."""
        return max((layer.min_restorable_length() for layer in self.layers), default=0)

    def crop(self, max_length: int) -> None:
        """Roll the cache back.

        ``max_length < 0``: remove ``-max_length`` tokens (what ``_assisted_decoding`` calls, since transformers
        5.14: ``crop(-(candidate_length - n_matches))``). ``max_length == 0``: remove nothing. ``max_length > 0``:
        legacy absolute form, keep the first ``max_length`` tokens (no-op when the cache is not longer).

        Raises :class:`CacheRollbackError` (nothing is modified) when the target lies beyond the retained history.
        """
        current = self.get_seq_length()
        target = _resolve_target_length(max_length, current)
        if target == current:
            return
        for layer in self.layers:
            layer._check_rollback(target)
        for layer in self.layers:
            layer._rollback(target)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()
