"""The MTP's own KV cache: one sliding-window layer, bounded memory, exact rollback.

The MTP layer attends to the current token and the ``window - 1`` before it, so the
cache keeps the last ``window - 1 + max_draft_tokens`` entries: enough to roll back any
in-flight drafts with :meth:`crop` and still hold a full window.  Memory never grows
with the context.
"""

from __future__ import annotations

import torch


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
        """Keep the first ``max_length`` positions (negative: drop that many from the end)."""
        new_len = self.seq_length + max_length if max_length < 0 else max_length
        if new_len < 0 or new_len > self.seq_length:
            raise ValueError(f"cannot crop an MTP cache of length {self.seq_length} to {max_length}.")
        drop = self.seq_length - new_len
        if drop == 0:
            return
        needed_from = max(0, new_len - (self.sliding_window - 1))
        if needed_from < self.first_position:
            raise ValueError(
                f"cannot roll the MTP cache back {drop} positions (to length {new_len}): it holds positions "
                f"{self.first_position}..{self.seq_length - 1} only, bounded by the window plus "
                f"max_draft_tokens={self.max_draft_tokens}. Raise `config.max_draft_tokens`."
            )
        self.kv = self.kv[:, : self.kv.shape[1] - drop]
        self.seq_length = new_len

    def reset(self) -> None:
        self.kv, self.seq_length = None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.kv is not None:
            self.kv = self.kv.index_select(0, beam_idx.to(self.kv.device))
