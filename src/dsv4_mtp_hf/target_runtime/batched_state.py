"""DeepSeek-V4 target attention for a ragged batch in one pass per layer, with per-sequence state.

transformers' V4 cache holds one state per layer for the whole batch with one shared length,
so :class:`~.ragged_target.RaggedTargetForward` used to run the attention once per sequence
(each with its own :class:`~.target_cache.RollbackDeepseekV4Cache`).  Here the state of all
sequences lives in padded tensors indexed by a sequence *slot*, and every layer's attention
(sliding K=V window, HCA/CSA compressor, CSA indexer) runs once for all sequences, with the
target's own ``self_attn`` weights.

State per layer (on that layer's device), for ``B`` slots:

* ``ring [B, W - 1 + max_rollback, d]``: the sliding K=V rows, slot ``pos % R``;
* per compressor stream (``"compressor"``, plus ``"indexer"`` on CSA):
  ``ring_kv`` / ``ring_gate [B, R, c]`` with the raw projected rows (slot ``pos % R``) and
  ``entries [B, capacity, d]`` with the compressed entries (entry ``e`` at index ``e``).

Everything else is a function of each sequence's length ``L`` (host ints): a stream holds
``L // rate`` entries and its buffer is the raw rows ``[(L // rate) * rate, L)``; the CSA
overlap (the ``Ca`` half of the last closed window) is re-read from the raw rows of the
previous window instead of being kept.  So a rollback only moves ``L``: entries of windows
that are still closed keep their exact values, those of reopened windows are recomputed
(and overwritten) when the window closes again, and the rings keep enough rows
(``max_rollback`` more than a forward needs) for any crop of at most ``max_rollback`` tokens
below the furthest length a sequence reached.

A forward is planned on the host from the lengths alone (:meth:`BatchedTargetState.plan`:
gather/scatter indices, no device reads), the index tensors are copied once per device,
and the layers then run without host synchronisation.

With a ``capacity`` (the most tokens a sequence may reach), every shape of a forward depends
only on its chunk lengths, not on the sequences' lengths: the entries are preallocated for the
capacity and attended masked, and each stream compresses as many windows as could close (those
that do not are written to a spare entry that is never read).  That is what lets a forward of
a given shape replay as a CUDA graph (:mod:`.target_graph`).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from ..layers.attention import sink_attention
from .rollback_cache import CacheRollbackError

__all__ = ["BatchedTargetState", "BatchedSequence"]

_SLIDING = "sliding_attention"
_HCA = "heavily_compressed_attention"
_CSA = "compressed_sparse_attention"


def _excl_cumsum(t: np.ndarray) -> np.ndarray:
    return np.cumsum(t) - t


def _ragged_arange(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sequence of each item, index of the item within its sequence) for ``counts[i]`` items of sequence ``i``."""
    seq = np.repeat(np.arange(counts.size), counts)
    return seq, np.arange(seq.size) - _excl_cumsum(counts)[seq]


class _Plan:
    """Host-side index arrays of one forward (int64, computed with NumPy: a few dozen tiny array ops, which
    cost ~1 µs each there and several µs as CPU torch ops -- this runs before every graphed step), copied
    once per device."""

    def __init__(self, slots, lengths, chunk_lengths, window, max_rollback, streams, capacity=None):
        b = len(slots)
        self.slots = list(slots)
        self.L = L = np.asarray(lengths, dtype=np.int64)
        self.n = n = np.asarray(chunk_lengths, dtype=np.int64)
        self.end = end = L + n
        self.b, self.S, self.N = b, int(n.max()), int(n.sum())
        self.window = window
        off = _excl_cumsum(n)
        t = {"rows": np.asarray(slots, dtype=np.int64)}
        j = np.arange(self.S)
        t["pos"] = L[:, None] + j  # [b, S] (rows past a chunk's end are padding)
        t["pad_idx"] = off[:, None] + np.minimum(j, n[:, None] - 1)  # flat token of (i, j), clamped
        seq, k = _ragged_arange(n)
        t["unpad_idx"] = seq * self.S + k  # padded row of each flat token
        t["flat_pos"] = (L[seq] + k)[None]  # [1, N]
        t["end"] = end

        def src(P: np.ndarray, R: int) -> np.ndarray:
            # Index of absolute position P of each sequence in cat(ring[rows].flatten(0, 1), new_rows):
            # positions before L come from the ring, the others from this forward's rows.
            shape = (b,) + (1,) * (P.ndim - 1)
            Lb, ob = L.reshape(shape), off.reshape(shape)
            ring = np.arange(b).reshape(shape) * R + P % R
            new = b * R + ob + (P - Lb)
            return np.clip(np.where(P < Lb, ring, new), 0, b * R + self.N - 1)

        def ring_writes(prefix: str, R: int) -> None:
            # The last min(n, R) rows of each chunk go to slot pos % R (no duplicate slots).
            c = np.minimum(n, R)
            s, k = _ragged_arange(c)
            P = end[s] - c[s] + k
            t[prefix + "w_row"], t[prefix + "w_slot"], t[prefix + "w_src"] = t["rows"][s], P % R, off[s] + P - L[s]

        # sliding window: the W - 1 positions before each chunk, then the chunk
        self.ring = max(1, window - 1 + max_rollback)
        t["kpos"] = L[:, None] - (window - 1) + np.arange(window - 1 + self.S)
        t["ksrc"] = src(t["kpos"], self.ring)
        ring_writes("s_", self.ring)

        # compressor streams, one plan per (rate, ring size, overlap)
        self.streams = {}
        for key in streams:
            rate, R, overlap = key
            p = f"{rate}_{R}_{int(overlap)}_"
            w0 = L // rate
            nw = (L % rate + n) // rate  # windows that close in this forward
            # fixed shapes: as many windows as a chunk of S tokens can close, the rest to the spare entry
            NW = int(nw.max()) if capacity is None else (rate - 1 + self.S) // rate
            if NW:
                first = w0[:, None] + np.arange(NW)  # [b, NW] entry index of each closing window
                P = (first * rate)[:, :, None] + np.arange(rate)  # [b, NW, rate] its source positions
                t[p + "win"] = src(P, R)
                if overlap:  # the previous window's rows (its Ca half joins this entry)
                    t[p + "prev"] = src(P - rate, R)
                    t[p + "has_prev"] = (first >= 1).astype(np.int64)
                t[p + "epos"] = first * rate  # RoPE position of each entry
                if capacity is None:
                    s, k = _ragged_arange(nw)
                    e_idx = w0[s] + k
                else:
                    s, k = np.repeat(np.arange(b), NW), np.tile(np.arange(NW), b)
                    e_idx = np.where(k < nw[s], w0[s] + k, capacity // rate)  # spare entry
                t[p + "e_row"], t[p + "e_idx"], t[p + "e_src"] = t["rows"][s], e_idx, s * NW + k
            ring_writes(p, R)
            T = int((end // rate).max()) if capacity is None else capacity // rate
            self.streams[key] = (p, NW, T)
        self._host = t
        self._dev: dict = {}

    def host_flat(self) -> torch.Tensor:
        """Every index array in one flat int64 CPU tensor (the layout :meth:`use` reads)."""
        return torch.from_numpy(np.concatenate([v.reshape(-1) for v in self._host.values()]).astype(np.int64))

    def on(self, dev: torch.device) -> dict:
        """The index tensors (and the masks derived from them) on ``dev``: one copy per device."""
        dev = torch.device(dev)
        if dev in self._dev:
            return self._dev[dev]
        flat = self.host_flat()
        if dev.type == "cuda":
            flat = flat.pin_memory().to(dev, non_blocking=True)
        else:
            flat = flat.to(dev)
        return self.use(flat)

    def use(self, flat: torch.Tensor) -> dict:
        """The index tensors as views of ``flat`` (laid out as :meth:`host_flat`, on any device; a
        CUDA graph's static buffer), plus the masks derived from them, for the forwards on its device."""
        if flat.numel() != sum(v.size for v in self._host.values()):
            raise ValueError(f"plan buffer holds {flat.numel()} indices, this plan needs "
                             f"{sum(v.size for v in self._host.values())}.")
        t, i = {}, 0
        for k, v in self._host.items():
            t[k] = flat[i : i + v.size].view(v.shape)
            i += v.size
        self._dev[flat.device] = _derive_masks(t, self.window, self.streams)
        return t


def _derive_masks(t: dict, window: int, streams: dict) -> dict:
    """The masks a forward derives from its index tensors ``t`` (in place; on their device)."""
    pos, kpos = t["pos"][:, :, None], t["kpos"][:, None, :]
    # sliding: a query at p sees the keys p - W + 1 .. p that exist (transformers' sliding mask)
    t["k_ok"] = (kpos >= 0) & (kpos < t["end"][:, None, None]) & (kpos <= pos) & (pos - kpos < window)
    for key, (p, NW, _) in streams.items():
        # a query at p may use the entries of windows that closed at or before p
        t[p + "thresh"] = (t["pos"] + 1) // key[0]
        if p + "has_prev" in t:
            t[p + "has_prev"] = t[p + "has_prev"].bool()
    return t


class _FixedPlan:
    """The plan of a fixed-shape forward of ``n`` rows of sequence slot 0 (the graphed target's step,
    batch 1, with a capacity): :class:`_Plan`'s index tensors specialised to one sequence, computed by
    torch from its length ``L`` where ``L`` lies (:meth:`indices`).  Its shapes do not depend on ``L``, so
    one plan serves every step of ``n`` rows and a CUDA graph computes the indices itself from a length
    buffer: the host plans nothing per step.  ``tests/test_batched_attention.py`` checks it equals
    :class:`_Plan` index for index."""

    def __init__(self, n: int, window: int, max_rollback: int, streams: list, capacity: int):
        self.slots, self.b, self.S, self.N, self.window, self.capacity = [0], 1, n, n, window, capacity
        self.ring = max(1, window - 1 + max_rollback)  # as _Plan
        self.streams = {key: (f"{key[0]}_{key[1]}_{int(key[2])}_", (key[0] - 1 + n) // key[0], capacity // key[0])
                        for key in streams}

    def indices(self, L: torch.Tensor) -> dict:
        """``L``: the sequence's length, int64 ``[1]`` on the forward's device -> :meth:`_Plan.use`'s dict."""
        n, W, dev = self.N, self.window, L.device

        def arange(k):
            return torch.arange(k, device=dev)

        def zeros(k):
            return torch.zeros(k, dtype=torch.long, device=dev)

        def src(P, R):  # _Plan's src for one sequence: the ring below L, this forward's rows from L on
            Lb = L.reshape((1,) * P.ndim)
            return torch.where(P < Lb, P % R, R + P - Lb).clamp(0, R + n - 1)

        def ring_writes(prefix, R):
            c = min(n, R)  # the last c rows of the forward go to slot pos % R
            k = n - c + arange(c)
            t[prefix + "w_row"], t[prefix + "w_slot"], t[prefix + "w_src"] = zeros(c), (L + k) % R, k

        j = arange(n)
        t = {"rows": zeros(1), "pos": L[:, None] + j, "pad_idx": j[None], "unpad_idx": j, "flat_pos": (L + j)[None],
             "end": L + n}
        t["kpos"] = L[:, None] - (W - 1) + arange(W - 1 + n)
        t["ksrc"] = src(t["kpos"], self.ring)
        ring_writes("s_", self.ring)
        for (rate, R, overlap), (p, NW, _) in self.streams.items():
            w0, nw = L // rate, (L % rate + n) // rate
            if NW:
                first = w0[:, None] + arange(NW)  # [1, NW]
                P = (first * rate)[:, :, None] + arange(rate)
                t[p + "win"] = src(P, R)
                if overlap:
                    t[p + "prev"] = src(P - rate, R)
                    t[p + "has_prev"] = (first >= 1).long()
                t[p + "epos"] = first * rate
                k = arange(NW)
                t[p + "e_row"], t[p + "e_src"] = zeros(NW), k
                t[p + "e_idx"] = torch.where(k < nw, w0 + k, self.capacity // rate)  # else the spare entry
            ring_writes(p, R)
        return _derive_masks(t, W, self.streams)


class _Stream:
    """One compressor stream of one layer: raw-row rings and compressed entries."""

    def __init__(self, rate: int, ring: int, overlap: bool, capacity: int | None):
        self.rate, self.R, self.overlap = rate, ring, overlap
        # with a capacity: every entry the capacity allows, plus the spare one unused windows write to
        self.fixed_entries = None if capacity is None else capacity // rate + 1
        self.ring_kv = self.ring_gate = self.entries = None

    @property
    def key(self):
        return (self.rate, self.R, self.overlap)

    def step(self, module, x: torch.Tensor, plan: _Plan, t: dict, batch_size: int) -> int:
        """Append this forward's rows (``x``: ``[1, N, D]``) and compress the windows that closed.
        Returns ``T``, the most entries any of the forward's sequences now has (``self.entries[:, :T]``)."""
        p, NW, T = plan.streams[self.key]
        kv, gate = module.kv_proj(x)[0], module.gate_proj(x)[0]  # [N, c]
        if self.ring_kv is None:
            self.ring_kv = kv.new_zeros(batch_size, self.R, kv.shape[-1])
            self.ring_gate = gate.new_zeros(batch_size, self.R, gate.shape[-1])
        rows = t["rows"]
        if NW:
            src_kv = torch.cat([self.ring_kv[rows].flatten(0, 1), kv])
            src_gate = torch.cat([self.ring_gate[rows].flatten(0, 1), gate])
            win_kv, win_gate = src_kv[t[p + "win"]], src_gate[t[p + "win"]] + module.position_bias
            if self.overlap:
                # CSA: entry w softmax-pools the Ca half of window w - 1 with the Cb half of window w
                # (zero kv / -inf gate, i.e. weight 0, before the first window)
                d = module.head_dim
                has = t[p + "has_prev"][:, :, None, None]
                prev_kv = src_kv[t[p + "prev"]][..., :d]
                prev_gate = (src_gate[t[p + "prev"]] + module.position_bias)[..., :d]
                win_kv = torch.cat([torch.where(has, prev_kv, 0.0), win_kv[..., d:]], dim=2)
                win_gate = torch.cat([torch.where(has, prev_gate, float("-inf")), win_gate[..., d:]], dim=2)
            # transformers' compressor arithmetic, window by window
            weights = win_gate.softmax(dim=2, dtype=torch.float32).to(win_kv.dtype)
            compressed = module.kv_norm((win_kv * weights).sum(dim=2))  # [b, NW, d]
            cos, sin = module.rotary_emb(compressed, position_ids=t[p + "epos"], layer_type="compress")
            compressed = apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)
            self._reserve(T if self.fixed_entries is None else self.fixed_entries, compressed)
            self.entries.index_put_((t[p + "e_row"], t[p + "e_idx"]), compressed.flatten(0, 1)[t[p + "e_src"]])
        self.ring_kv.index_put_((t[p + "w_row"], t[p + "w_slot"]), kv[t[p + "w_src"]])
        self.ring_gate.index_put_((t[p + "w_row"], t[p + "w_slot"]), gate[t[p + "w_src"]])
        return T

    def _reserve(self, count: int, like: torch.Tensor) -> None:
        # Zero-initialised (stale or unused entries are masked, but must not be NaN: 0 * NaN = NaN).
        have = 0 if self.entries is None else self.entries.shape[1]
        if count <= have:
            return
        size = count if self.fixed_entries is not None else max(count, 2 * have, 16)
        grown = like.new_zeros(self.ring_kv.shape[0], size, like.shape[-1])
        if self.entries is not None:
            grown[:, :have] = self.entries
        self.entries = grown


class _LayerState:
    def __init__(self, layer_type: str, config, max_rollback: int, capacity: int | None):
        self.layer_type = layer_type
        self.ring = None
        self.streams: dict[str, _Stream] = {}
        if layer_type == _HCA:
            m = config.compress_rates[_HCA]
            self.streams["compressor"] = _Stream(m, max(1, m - 1 + max_rollback), False, capacity)
        elif layer_type == _CSA:
            m = config.compress_rates[_CSA]
            for name in ("compressor", "indexer"):  # the overlap needs the previous window: 2m - 1 rows
                self.streams[name] = _Stream(m, 2 * m - 1 + max_rollback, True, capacity)


class BatchedTargetState:
    """Attention state of every layer of a V4 target for ``batch_size`` sequence slots.

    ``max_rollback``: the most tokens a :meth:`crop` may remove below the furthest length a
    sequence has reached (the number of draft tokens verified per round).  ``capacity``: the
    most tokens a sequence may reach; with it, a forward's shapes depend only on its chunk
    lengths (what a CUDA graph needs), without it the compressed entries grow as needed.
    """

    def __init__(self, config, batch_size: int, max_rollback: int, capacity: int | None = None):
        config = config.get_text_config(decoder=True)
        types = list(getattr(config, "layer_types", None) or [])
        unknown = sorted(set(types) - {_SLIDING, _HCA, _CSA})
        if not types or unknown:
            raise ValueError(f"batched V4 attention: unsupported layer types {unknown or '(none given)'}.")
        impl = getattr(config, "_attn_implementation", None) or "eager"
        if impl != "eager":
            raise ValueError(f"batched V4 attention computes transformers' eager attention; the target uses "
                             f"{impl!r}. Use target_attention='per_sequence'.")
        if max_rollback < 0 or batch_size < 1:
            raise ValueError(f"need batch_size >= 1 and max_rollback >= 0, got {batch_size}, {max_rollback}.")
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be None or >= 1 tokens, got {capacity}.")
        self.config, self.batch_size, self.max_rollback = config, int(batch_size), int(max_rollback)
        self.capacity = None if capacity is None else int(capacity)
        self.window = int(config.sliding_window)
        self.layers = [_LayerState(t, config, self.max_rollback, self.capacity) for t in types]
        self.lengths = [0] * batch_size
        self.high = [0] * batch_size  # furthest length reached: rings hold rows back to high - ring size
        self.alive = [True] * batch_size
        self._fixed_plans: dict[int, _FixedPlan] = {}

    def allocate(self, dtype: torch.dtype, devices: list) -> None:
        """Every buffer of a state with a capacity, zeroed, in ``dtype`` (the target's activations') on each layer's
        device (``devices[i]``): what a compiled or captured step reads by address must exist before its first
        run (without this, a forward makes them when it first needs them)."""
        if self.capacity is None:
            raise ValueError("allocate is for a state with a capacity (its entries have a fixed size).")
        c, b = self.config, self.batch_size
        for layer, device in zip(self.layers, devices, strict=True):
            kw = dict(dtype=dtype, device=device)
            layer.ring = torch.zeros(b, max(1, self.window - 1 + self.max_rollback), c.head_dim, **kw)
            for name, st in layer.streams.items():
                d = c.head_dim if name == "compressor" else c.index_head_dim
                width = 2 * d if st.overlap else d  # CSA rows carry the Ca and Cb halves
                st.ring_kv, st.ring_gate = (torch.zeros(b, st.R, width, **kw) for _ in range(2))
                st.entries = torch.zeros(b, st.fixed_entries, d, **kw)

    def sequences(self) -> list["BatchedSequence"]:
        return [BatchedSequence(self, i) for i in range(self.batch_size)]

    # -- bookkeeping (host only) -----------------------------------------------------------------
    def truncate(self, slot: int, length: int) -> None:
        """Roll sequence ``slot`` back to ``length`` tokens: nothing but its length changes."""
        self._check(slot)
        if not 0 <= length <= self.lengths[slot]:
            raise CacheRollbackError(f"cannot truncate sequence {slot} of {self.lengths[slot]} tokens to {length}.")
        lowest = self.high[slot] - self.max_rollback
        if length < lowest:
            raise CacheRollbackError(
                f"cannot roll sequence {slot} back to {length} tokens: it reached {self.high[slot]} and the "
                f"state keeps max_rollback={self.max_rollback} rows of history (lowest length {lowest}).")
        self.lengths[slot] = length

    def free(self, slot: int) -> None:
        """The sequence left the batch: its slot is no longer valid (its rows are never read again)."""
        self._check(slot)
        self.alive[slot] = False
        self.lengths[slot] = self.high[slot] = 0

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.batch_size:
            raise IndexError(f"sequence slot {slot} out of range [0, {self.batch_size}).")
        if not self.alive[slot]:
            raise ValueError(f"sequence slot {slot} was freed.")

    def plan(self, slots: list[int], chunk_lengths: list[int]) -> _Plan:
        if len(set(slots)) != len(slots):
            raise ValueError(f"each sequence at most once per forward, got slots {slots}.")
        for s in slots:
            self._check(s)
        if self.capacity is not None:
            for s, n in zip(slots, chunk_lengths):
                if self.lengths[s] + n > self.capacity:
                    raise ValueError(
                        f"sequence {s} would reach {self.lengths[s] + n} tokens; this state holds at most "
                        f"capacity={self.capacity} (for a graphed target: graph_target(target, max_length=...)).")
        keys = {st.key for layer in self.layers for st in layer.streams.values()}
        return _Plan(slots, [self.lengths[s] for s in slots], chunk_lengths, self.window, self.max_rollback,
                     sorted(keys), self.capacity)

    def fixed_plan(self, n: int) -> _FixedPlan:
        """The :class:`_FixedPlan` of a forward of ``n`` rows of slot 0 at its current length (a state with a
        capacity and one slot: the graphed target's); :meth:`advance` afterwards."""
        if self.capacity is None or self.batch_size != 1:
            raise ValueError("fixed plans are for a state of one sequence slot with a capacity (graph_target's).")
        self._check(0)
        if self.lengths[0] + n > self.capacity:
            raise ValueError(f"sequence 0 would reach {self.lengths[0] + n} tokens; this state holds at most "
                             f"capacity={self.capacity} (for a graphed target: graph_target(target, max_length=...)).")
        if n not in self._fixed_plans:
            keys = {st.key for layer in self.layers for st in layer.streams.values()}
            self._fixed_plans[n] = _FixedPlan(n, self.window, self.max_rollback, sorted(keys), self.capacity)
        return self._fixed_plans[n]

    def advance(self, slot: int, n: int) -> None:
        """After every layer ran a forward of ``n`` rows of ``slot``: the sequence is longer by them."""
        self.lengths[slot] += n
        self.high[slot] = max(self.high[slot], self.lengths[slot])

    def commit(self, plan: _Plan) -> None:
        """After every layer ran ``plan``: the sequences are longer by their chunks."""
        for s, e in zip(plan.slots, plan.end.tolist()):
            self.lengths[s] = e
            self.high[s] = max(self.high[s], e)

    # -- one layer -----------------------------------------------------------------------------
    def attend(self, layer_idx: int, attn, x: torch.Tensor, position_embeddings: dict, plan: _Plan) -> torch.Tensor:
        """``attn``: the layer's ``DeepseekV4Attention``; ``x``: its input ``[1, N, D]`` (the chunks of
        ``plan`` flattened); ``position_embeddings``: ``{"main", "compress"}`` cos/sin of the flat
        positions.  Returns what ``attn`` returns for each sequence alone, flattened: ``[1, N, D]``."""
        return self.attend_layer(self.layers[layer_idx], attn, x, position_embeddings, plan, plan.on(x.device))

    def attend_layer(self, layer: "_LayerState", attn, x, position_embeddings: dict, plan: _Plan, t: dict):
        """:meth:`attend` on one layer's state, with the plan's index tensors ``t`` on ``x``'s device."""
        b, S, N = plan.b, plan.S, plan.N
        cos, sin = position_embeddings[attn.rope_layer_type]

        # token-wise projections, on the flat rows (transformers' DeepseekV4Attention.forward)
        q_residual = attn.q_a_norm(attn.q_a_proj(x))
        q = attn.q_b_norm(attn.q_b_proj(q_residual).view(1, N, -1, attn.head_dim).transpose(1, 2))
        q = apply_rotary_pos_emb(q, cos, sin)  # [1, H, N, d]
        kv = apply_rotary_pos_emb(attn.kv_norm(attn.kv_proj(x)).view(1, N, 1, attn.head_dim).transpose(1, 2), cos, sin)
        kv = kv[0, 0]  # [N, d]: one K=V head
        q = q[0][:, t["pad_idx"]].transpose(0, 1)  # [b, H, S, d]

        # sliding K=V window: the previous W - 1 rows from the ring, then the chunk's rows
        if layer.ring is None:
            layer.ring = kv.new_zeros(self.batch_size, plan.ring, kv.shape[-1])
        keys = torch.cat([layer.ring[t["rows"]].flatten(0, 1), kv])[t["ksrc"]]  # [b, W - 1 + S, d]
        ok = t["k_ok"]  # [b, S, W - 1 + S]
        layer.ring.index_put_((t["s_w_row"], t["s_w_slot"]), kv[t["s_w_src"]])

        sel_keys = sel_ok = None
        if layer.layer_type == _HCA:
            st = layer.streams["compressor"]
            T = st.step(attn.compressor, x, plan, t, self.batch_size)
            if T:  # every closed window, causally: entry e once p + 1 >= (e + 1) * rate
                thresh = t[plan.streams[st.key][0] + "thresh"]
                e_ok = torch.arange(T, device=x.device) < thresh[:, :, None]
                keys = torch.cat([keys, st.entries[t["rows"], :T]], dim=1)
                ok = torch.cat([ok, e_ok], dim=2)
        elif layer.layer_type == _CSA:
            comp, st, ist = attn.compressor, layer.streams["compressor"], layer.streams["indexer"]
            T = st.step(comp, x, plan, t, self.batch_size)
            ist.step(comp.indexer, x, plan, t, self.batch_size)
            if T:
                thresh = t[plan.streams[st.key][0] + "thresh"]
                top = self._indexer_topk(comp.indexer, x, q_residual, ist.entries[t["rows"], :T], thresh, t)
                sel_ok = top < thresh[:, :, None]  # [b, S, k]
                # gather only the picked entries (the -inf rest contributes exactly 0 in transformers)
                sel_keys = st.entries[t["rows"][:, None, None], torch.where(sel_ok, top, 0)]  # [b, S, k, d]

        out = self._attention(attn, q, keys, ok, sel_keys, sel_ok)  # [b, S, H, d]
        out = out.reshape(b * S, *out.shape[2:])[t["unpad_idx"]].unsqueeze(0)  # [1, N, H, d]
        # K=V carried RoPE into the output: undo it at the query position (as transformers does)
        out = apply_rotary_pos_emb(out.transpose(1, 2), cos, -sin).transpose(1, 2)
        grouped = attn.o_a_proj(out.reshape(1, N, attn.config.o_groups, -1)).flatten(2)
        return attn.o_b_proj(grouped)

    @staticmethod
    def _indexer_topk(indexer, x, q_residual, entries, thresh, t) -> torch.Tensor:
        """CSA lightning indexer: top-k entries per query among those it may see (``-inf`` for
        the others, as transformers masks them); picks past the threshold are dropped by the caller."""
        N = x.shape[1]
        cos, sin = indexer.rotary_emb(x, position_ids=t["flat_pos"], layer_type="compress")
        q = indexer.q_b_proj(q_residual).view(1, N, -1, indexer.head_dim).transpose(1, 2)
        q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)[0]  # [N, H, d]
        pad = t["pad_idx"]
        scores = indexer.scorer(q[pad], entries, x[0][pad])  # [b, S, T]
        T = entries.shape[1]
        future = torch.arange(T, device=x.device) >= thresh[:, :, None]
        scores = scores.masked_fill(future, float("-inf"))
        return scores.topk(min(indexer.index_topk, T), dim=-1).indices

    @staticmethod
    def _attention(attn, q, keys, ok, sel_keys, sel_ok) -> torch.Tensor:
        """transformers' eager V4 attention (shared K=V head, per-head sink; ``layers.attention.sink_attention``)
        for padded queries ``q [b, H, S, d]`` over per-sequence keys ``[b, K, d]`` and, on CSA, per-query
        selected keys ``[b, S, k, d]``.  -> ``[b, S, H, d]``."""
        groups = [(keys, ok)] + ([] if sel_keys is None else [(sel_keys, sel_ok)])
        return sink_attention(q, attn.sinks, attn.scaling, *groups)


class BatchedSequence:
    """One sequence of a :class:`BatchedTargetState`: what :class:`~.ragged_target.RaggedTargetForward`
    takes in place of a per-sequence cache (``get_seq_length``, ``crop``, ``free``)."""

    def __init__(self, state: BatchedTargetState, slot: int):
        self.state, self.slot = state, slot

    def get_seq_length(self) -> int:
        return self.state.lengths[self.slot]

    def crop(self, max_length: int) -> None:
        """``RollbackDeepseekV4Cache.crop`` conventions: ``> 0`` keep that many tokens, ``<= 0`` remove ``-n``."""
        cur = self.get_seq_length()
        n = int(max_length)
        self.state.truncate(self.slot, cur + n if n <= 0 else min(n, cur))

    def free(self) -> None:
        self.state.free(self.slot)
