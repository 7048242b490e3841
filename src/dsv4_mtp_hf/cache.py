"""The MTP's own KV cache: one sliding-window layer, bounded memory, exact rollback.

The MTP layer attends to the current token and the ``window - 1`` before it, so the
cache keeps the last ``window - 1 + max_draft_tokens`` entries: enough to roll back any
in-flight drafts with :meth:`crop` and still hold a full window.  Memory never grows
with the context.
"""

from __future__ import annotations

import contextlib

import torch

from .ops.paged_cache import gather_held, paged_kv_update, ring_slots


class MtpKVCache:
    def __init__(self, sliding_window: int, max_draft_tokens: int = 16):
        if sliding_window < 1 or max_draft_tokens < 1:
            raise ValueError("sliding_window and max_draft_tokens must be >= 1.")
        self.sliding_window = sliding_window
        self.max_draft_tokens = max_draft_tokens
        self.capacity = sliding_window - 1 + max_draft_tokens
        self.kv: torch.Tensor | None = None  # [B, n, head_dim], the last n positions
        self.seq_length = 0

    @classmethod
    def from_config(cls, config) -> MtpKVCache:
        return cls(config.sliding_window, config.max_draft_tokens)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seq_length

    @property
    def batch_size(self) -> int | None:
        return None if self.kv is None else self.kv.shape[0]

    @property
    def first_position(self) -> int:
        """Absolute position of the oldest entry held."""
        return self.seq_length - (0 if self.kv is None else self.kv.shape[1])

    def update(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``kv [B, S, d]`` (positions ``seq_length ..``); return the keys to attend
        over (held entries + new ones) and their absolute positions ``[L]``."""
        if self.kv is not None and (kv.shape[0] != self.kv.shape[0] or kv.shape[2] != self.kv.shape[2]):
            raise ValueError(
                f"MTP cache holds entries of shape [B={self.kv.shape[0]}, *, {self.kv.shape[2]}] but got "
                f"{tuple(kv.shape)}; use a fresh cache for a new batch."
            )
        start = self.first_position
        full = kv if self.kv is None else torch.cat([self.kv, kv.to(self.kv.dtype)], dim=1)
        self.seq_length += kv.shape[1]
        self.kv = full[:, -self.capacity :]
        positions = torch.arange(start, start + full.shape[1], device=kv.device)
        return full, positions

    def crop(self, max_length: int) -> None:
        """transformers' convention: ``< 0`` removes ``-max_length`` positions, ``0`` nothing, ``> 0`` keeps the
        first ``max_length`` (the legacy absolute form)."""
        n = int(max_length)
        self.truncate(self.seq_length + n if n <= 0 else min(n, self.seq_length))

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions (roll back the rest)."""
        if not 0 <= length <= self.seq_length:
            raise ValueError(f"cannot truncate an MTP cache of length {self.seq_length} to {length}.")
        drop = self.seq_length - length
        if drop == 0:
            return
        needed_from = max(0, length - (self.sliding_window - 1))
        if needed_from < self.first_position:
            raise ValueError(
                f"cannot roll the MTP cache back {drop} positions (to length {length}): it holds positions "
                f"{self.first_position}..{self.seq_length - 1} only, bounded by the window plus "
                f"max_draft_tokens={self.max_draft_tokens}. Raise `config.max_draft_tokens`."
            )
        self.kv = self.kv[:, : self.kv.shape[1] - drop]
        self.seq_length = length

    def snapshot(self) -> dict:
        """The rows held and the length (copies): ``{"kv": [B, n, d] of positions length-n..length-1, "length"}``,
        the same form as :meth:`PagedMtpKVCache.snapshot`, so either cache restores the other's."""
        return {"kv": None if self.kv is None else self.kv.clone(), "length": self.seq_length}

    def restore(self, state: dict) -> None:
        kv = state["kv"]
        self.kv = None if kv is None else kv[:, -self.capacity :].clone()
        self.seq_length = state["length"]

    def reset(self) -> None:
        self.kv, self.seq_length = None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.kv is not None:
            self.kv = self.kv.index_select(0, beam_idx.to(self.kv.device))


class PagedMtpKVCache:
    """The MTP's KV cache as a block pool with per-sequence block tables.

    Each sequence owns ``pages_per_sequence`` pages of ``page_size`` rows used as a ring:
    position ``p`` lives in page ``block_table[b, (p // page_size) % pages_per_sequence]`` at
    row ``p % page_size``.  The ring holds the window plus the drafts in flight, so memory
    is fixed per sequence whatever the context length, and :meth:`crop` only moves a
    sequence's length (O(1), no copy).  Sequences keep their own lengths (ragged batches);
    :meth:`free` returns a finished sequence's pages to the pool, and :meth:`add_sequence`
    fails with a clear error when the pool is exhausted.  All per-step index math runs on
    the cache's device (no host synchronisation), the layout paged attention kernels read.
    """

    def __init__(self, sliding_window: int, head_dim: int, batch_size: int = 1, max_draft_tokens: int = 16,
                 page_size: int = 16, num_pages: int | None = None, device=None, dtype=torch.float32):
        if min(sliding_window, head_dim, batch_size, max_draft_tokens, page_size) < 1:
            raise ValueError("sliding_window, head_dim, batch_size, max_draft_tokens and page_size must be >= 1.")
        self.sliding_window, self.max_draft_tokens, self.page_size = sliding_window, max_draft_tokens, page_size
        self.pages_per_sequence = -(-(sliding_window - 1 + max_draft_tokens) // page_size) + 1
        self.capacity = self.pages_per_sequence * page_size  # ring rows per sequence
        num_pages = batch_size * self.pages_per_sequence if num_pages is None else num_pages
        self.pool = torch.zeros(num_pages, page_size, head_dim, device=device, dtype=dtype)
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self.block_table = torch.full((0, self.pages_per_sequence), -1, dtype=torch.long, device=device)
        self.seq_lengths = torch.zeros(0, dtype=torch.long, device=device)
        self.active: list[bool] = []
        self._ragged = None  # (rows, num_new) while inside `ragged()`
        for _ in range(batch_size):
            self.add_sequence()

    @classmethod
    def from_config(cls, config, batch_size: int = 1, **kwargs) -> PagedMtpKVCache:
        return cls(config.sliding_window, config.head_dim, batch_size, config.max_draft_tokens, **kwargs)

    # -- sequences --------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.active)

    def add_sequence(self) -> int:
        """Start a new sequence (length 0); returns its batch row."""
        if len(self._free_pages) < self.pages_per_sequence:
            raise RuntimeError(
                f"MTP KV pool exhausted: {self.pool.shape[0]} pages of {self.page_size} rows, "
                f"{len(self._free_pages)} free, a sequence needs {self.pages_per_sequence}. Free finished sequences "
                "(`free(b)`) or create the cache with more `num_pages`."
            )
        pages = [self._free_pages.pop() for _ in range(self.pages_per_sequence)]
        row = torch.tensor([pages], dtype=torch.long, device=self.pool.device)
        self.block_table = torch.cat([self.block_table, row])
        self.seq_lengths = torch.cat([self.seq_lengths, self.seq_lengths.new_zeros(1)])
        self.active.append(True)
        return self.batch_size - 1

    def free(self, b: int) -> None:
        """Release sequence ``b``'s pages (its row stays, inactive, so batch rows keep their meaning)."""
        if not self.active[b]:
            raise ValueError(f"sequence {b} is already freed.")
        self._free_pages.extend(self.block_table[b].tolist())
        self.block_table[b] = -1
        self.seq_lengths[b] = 0
        self.active[b] = False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The longest sequence's length (per-sequence lengths: ``seq_lengths``)."""
        return int(self.seq_lengths.max()) if self.batch_size else 0

    # -- the MTP attention's interface ------------------------------------------------------------
    def _rows(self, positions: torch.Tensor, block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Absolute positions ``[B, L]`` -> (page ids, row in page) of each sequence's ring."""
        table = self.block_table if block_table is None else block_table
        return ring_slots(positions, table, self.page_size, self.capacity)

    @contextlib.contextmanager
    def ragged(self, rows: torch.Tensor | None = None, num_new: torch.Tensor | None = None):
        """Inside this block the next forward runs on the sequences ``rows`` only (in that
        order; default all active), and of the S rows it appends for sequence ``i`` only the
        first ``num_new[i]`` are real (default S): the rest are padding that is neither stored
        nor counted.  This is how a ragged batch (sequences that accepted different numbers
        of drafts, finished sequences left out) runs as one padded forward.  Padding rows sit
        after the real ones, so causality hides them from every real query.  Eager only
        (the masked write synchronises with the host)."""
        if rows is None:
            rows = torch.tensor([i for i, a in enumerate(self.active) if a], dtype=torch.long)
        rows = rows.to(device=self.seq_lengths.device, dtype=torch.long)
        if rows.numel() == 0:
            raise ValueError("`rows` selects no sequence.")
        if not all(self.active[i] for i in rows.tolist()):
            raise ValueError(f"`rows` {rows.tolist()} includes freed sequences; active: "
                             f"{[i for i, a in enumerate(self.active) if a]}.")
        if num_new is not None:
            num_new = num_new.to(device=self.seq_lengths.device, dtype=torch.long)
            if num_new.shape != rows.shape or bool((num_new < 0).any()):
                raise ValueError(f"`num_new` must be [{rows.numel()}] non-negative counts, got {num_new.tolist()}.")
        self._ragged = (rows, num_new)
        try:
            yield self
        finally:
            self._ragged = None

    def _update_ragged(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, num_new = self._ragged
        b, s, _ = kv.shape
        if b != rows.numel():
            raise ValueError(f"the forward got a batch of {b} but `ragged(rows=...)` selected {rows.numel()} sequences.")
        num_new = torch.full_like(rows, s) if num_new is None else num_new
        if bool((num_new > s).any()):
            raise ValueError(f"`num_new` {num_new.tolist()} exceeds the {s} rows of the forward.")
        table, start = self.block_table[rows], self.seq_lengths[rows].unsqueeze(1)
        held, past = gather_held(self.pool, table, start, self.sliding_window - 1, self.capacity, kv.dtype)
        i = torch.arange(s, device=kv.device)
        new_pos = start + i
        # Real rows only, and of a long prefill only the last `capacity` (distinct ring slots).
        write = (i < num_new.unsqueeze(1)) & (i >= num_new.unsqueeze(1) - self.capacity)
        page, row = self._rows(new_pos, table)
        self.pool[page[write], row[write]] = kv[write].to(self.pool.dtype)
        self.seq_lengths.index_add_(0, rows, num_new)
        return torch.cat([held, kv], dim=1), torch.cat([past, new_pos], dim=1)

    def update(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``kv [B, S, d]`` at each sequence's own length; return the keys to attend
        over ``[B, W-1+S, d]`` and their absolute positions ``[B, W-1+S]`` (rows before a
        sequence's start carry a position far in the past, so the window masks them)."""
        if self._ragged is not None:
            return self._update_ragged(kv)
        b, s, _ = kv.shape
        if b != self.batch_size or not all(self.active):
            raise ValueError(
                f"the paged MTP cache holds {self.batch_size} sequences ({sum(self.active)} active); the forward "
                f"got a batch of {b}. Run only active sequences, in cache row order."
            )
        # the held keys, the new ones after them, and the ring write: one op (one kernel on CUDA)
        keys, positions = paged_kv_update(self.pool, self.block_table, self.seq_lengths, kv, self.sliding_window - 1,
                                          self.capacity)
        self.seq_lengths.add_(s)  # in place: a captured CUDA graph replays this update
        return keys, positions

    def crop(self, max_length: int) -> None:
        """transformers' convention, for every sequence: ``< 0`` removes ``-max_length`` positions, ``0`` nothing,
        ``> 0`` keeps the first ``max_length``."""
        m = int(max_length)
        self.truncate(self.seq_lengths + m if m <= 0 else self.seq_lengths.clamp(max=m))

    def truncate(self, lengths, check: bool = True) -> None:
        """Roll back to ``lengths``: an int for every sequence, or a tensor ``[B]`` of per-sequence lengths.
        O(1): only the lengths move.  ``check=False`` skips the bounds checks, which read the lengths on the
        host (two synchronisations), for a caller whose own bookkeeping bounds the drop (a round's drafted
        rows)."""
        if isinstance(lengths, torch.Tensor) and lengths.dim() == 1:
            new = lengths.to(self.seq_lengths)
        else:
            new = torch.full_like(self.seq_lengths, int(lengths))
        if not check:
            self.seq_lengths.copy_(new)
            return
        if bool(((new < 0) | (new > self.seq_lengths)).any()):
            raise ValueError(f"cannot truncate MTP sequences of lengths {self.seq_lengths.tolist()} to {new.tolist()}.")
        if bool((self.seq_lengths - new > self.capacity - (self.sliding_window - 1)).any()):
            raise ValueError(
                f"cannot roll the paged MTP cache back from {self.seq_lengths.tolist()} to {new.tolist()}: the ring "
                f"holds the window plus max_draft_tokens={self.max_draft_tokens}. Raise `config.max_draft_tokens`."
            )
        self.seq_lengths.copy_(new)

    def snapshot(self) -> dict:
        """One sequence's rows in its ring and its length: ``{"kv": [1, n, d] of positions length-n..length-1,
        "length"}`` (copies; the form :meth:`MtpKVCache.snapshot` has, so either cache restores the other's)."""
        if self.batch_size != 1 or not self.active[0]:
            raise ValueError("snapshots are of a paged cache holding one active sequence.")
        length = int(self.seq_lengths[0])
        positions = torch.arange(max(0, length - self.capacity), length, device=self.pool.device)[None]
        page, row = self._rows(positions)
        return {"kv": self.pool[page, row].clone() if length else None, "length": length}

    def restore(self, state: dict) -> None:
        """Write a snapshot's rows back into the ring, in place (captured graphs keep reading the same pool)."""
        if self.batch_size != 1 or not self.active[0]:
            raise ValueError("snapshots restore into a paged cache holding one active sequence.")
        length, kv = state["length"], state["kv"]
        if kv is not None:
            kv = kv[:, -self.capacity :].to(self.pool)
            positions = torch.arange(length - kv.shape[1], length, device=self.pool.device)[None]
            page, row = self._rows(positions)
            self.pool[page, row] = kv
        self.seq_lengths.fill_(length)

    def reset(self) -> None:
        self.seq_lengths.zero_()


class DSparkKVCache:
    """The DSpark drafter's context caches (design §7b): one paged ring per draft layer holding the context
    K/V of the last ``window`` committed positions, and room for a drafted block's rows, which are rolled back
    before the next commit (only committed rows stay).  All layers advance together; the lengths are per
    sequence, on the device.  A batch runs ragged (:meth:`ragged`: some sequences, different row counts) and
    frees finished sequences (:meth:`free`), as :class:`PagedMtpKVCache` does."""

    def __init__(self, config, batch_size: int = 1, device=None, dtype=torch.float32, page_size: int = 16):
        self.window, self.block_size = config.sliding_window, config.dspark_block_size
        # `sliding_window + 1`: a paged ring holds `sliding_window - 1` keys before the new rows; the block sees
        # the whole context window (positions P - window .. P - 1).
        self.layers = [PagedMtpKVCache(config.sliding_window + 1, config.head_dim, batch_size, config.dspark_block_size,
                                       page_size=page_size, device=device, dtype=dtype)
                       for _ in range(config.num_draft_layers)]

    @classmethod
    def from_config(cls, config, batch_size: int = 1, **kwargs) -> DSparkKVCache:
        return cls(config, batch_size, **kwargs)

    @property
    def seq_lengths(self) -> torch.Tensor:
        """Each sequence's length; inside :meth:`ragged`, those of the sequences the forward runs on (its rows)."""
        layer = self.layers[0]
        return layer.seq_lengths if layer._ragged is None else layer.seq_lengths[layer._ragged[0]]

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch_size

    @contextlib.contextmanager
    def ragged(self, rows: torch.Tensor | None = None, num_new: torch.Tensor | None = None):
        """The next forward (a commit or a block) runs on the sequences ``rows`` only, of whose rows the first
        ``num_new`` are real: :meth:`PagedMtpKVCache.ragged` for every layer.  Eager only."""
        with contextlib.ExitStack() as stack:
            for layer in self.layers:
                stack.enter_context(layer.ragged(rows, num_new))
            yield self

    def free(self, b: int) -> None:
        """Release sequence ``b``'s pages in every layer (its row stays, inactive)."""
        for layer in self.layers:
            layer.free(b)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()

    def crop(self, max_length: int) -> None:
        """transformers' convention: ``< 0`` removes ``-max_length`` positions, ``0`` nothing, ``> 0`` keeps the
        first ``max_length``."""
        for layer in self.layers:
            layer.crop(max_length)

    def truncate(self, lengths, check: bool = True) -> None:
        """Roll back to ``lengths`` (an int, or per-sequence ``[B]``): only the lengths move."""
        for layer in self.layers:
            layer.truncate(lengths, check)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def snapshot(self) -> dict:
        return {"layers": [layer.snapshot() for layer in self.layers]}

    def restore(self, state: dict) -> None:
        for layer, s in zip(self.layers, state["layers"], strict=True):
            layer.restore(s)
