"""Grammar-constrained generation and drafting with xgrammar.

`XGrammarLogitsProcessor(compiled_grammar)` is a transformers `LogitsProcessor`: pass it as
`logits_processor=[...]` to plain `target.generate(...)` (the constrained baseline) or to
`target.generate(..., assistant_model=mtp)`.  In the assisted loop the SAME processor object masks

* every draft position with the grammar state that follows the tokens drafted before it (the MTP
  candidate generator calls the processors with the drafted prefix), and
* every verifier row (transformers calls the processors on ``prefix``, ``prefix + d1``, ...),

so drafts never leave the grammar and the verifier sees exactly the masks plain constrained
generation would use.

Calls arrive out of order (draft prefixes ``L, L+1, ..., L+k-1``, then the verifier's
``L, ..., L+k``, then the next round's ``L' <= L+k+1`` that may diverge from the drafts).  One
`xgrammar.GrammarMatcher` per batch row follows the longest prefix it was asked about:

* the tokens it accepted are kept on the host and compared with ``input_ids`` (only the last
  ``max_rollback_tokens + 1`` of them: older tokens are verified and never change);
* a prefix that diverges from them rolls the matcher back to the common prefix
  (`matcher.rollback(n)`, bounded by ``max_rollback_tokens``; a deeper divergence, e.g. a reused
  processor, resets and replays) and accepts the new tokens forward;
* the bitmask of every prefix on the current path is cached, so the verifier re-reading the
  draft prefixes costs no matcher work at all.

A prefix that contains a token the grammar rejects (a draft that was NOT masked, or the bonus
token after an all-masked row) cannot be continued; its row is returned unmasked (that row is
never used: the rejected token is rejected by the verifier too) and counted in ``stats``.

Bitmasks use xgrammar's 32-bit layout (`xgr.allocate_token_bitmask`) and are filled on the host
(xgrammar requires it); they are applied on the logits' device with
`xgr.apply_token_bitmask_inplace` (xgrammar's own kernel; its `torch_native` backend if the
default one is unavailable, e.g. CUDA without triton).  Logit columns beyond the tokenizer's
vocabulary (padded LM heads) are masked too.

A processor follows one `generate` call: its first call fixes the prompt.  A later call whose
prompt differs (or is shorter) starts over; call `reset()` (or build a new processor) before
reusing it for a prompt that EXTENDS the previous sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import LogitsProcessor

try:  # optional dependency: `pip install "dsv4-mtp-hf[grammar]"`
    import xgrammar as xgr
except ImportError:  # pragma: no cover - exercised only without xgrammar
    xgr = None


def _require_xgrammar():
    if xgr is None:
        raise ImportError(
            "Grammar-constrained generation needs xgrammar: `pip install 'dsv4-mtp-hf[grammar]'` "
            "(or `pip install xgrammar`)."
        )
    return xgr


@dataclass
class GrammarStats:
    """What the processor did (all rows together)."""

    calls: int = 0  # processor calls (rows x calls)
    masks_filled: int = 0  # `fill_next_token_bitmask` runs
    mask_cache_hits: int = 0  # prefixes answered from the per-prefix bitmask cache
    tokens_accepted: int = 0  # `accept_token` successes (forward moves)
    rollbacks: int = 0  # `rollback` calls
    tokens_rolled_back: int = 0
    max_rollback: int = 0  # deepest single rollback
    replays: int = 0  # divergences deeper than `max_rollback_tokens`: reset + replay
    rejected_prefix_calls: int = 0  # prefixes containing a grammar-rejected token (returned unmasked)
    terminated_calls: int = 0  # prefixes ending after the stop token (returned unmasked)

    def as_dict(self) -> dict:
        return asdict(self)


class _Row:
    __slots__ = ("matcher", "tokens", "masks", "rejected")

    def __init__(self, matcher):
        self.matcher = matcher
        self.tokens: list[int] = []  # generated tokens the matcher has accepted, in order
        self.masks: dict[int, tuple[torch.Tensor, bool]] = {}  # prefix length -> (bitmask row, need_apply)
        self.rejected: tuple[int, int] | None = None  # (position, token) the grammar refused there


class XGrammarLogitsProcessor(LogitsProcessor):
    """Masks logits with an xgrammar grammar; correct for any order of prefixes (see module doc).

    Args:
        compiled_grammar: an `xgrammar.CompiledGrammar` (e.g. from
            `xgr.GrammarCompiler(tokenizer_info).compile_json_schema(schema)`).
        max_rollback_tokens: how far a matcher can roll back; must be at least the number of
            draft tokens per round (`num_assistant_tokens`).  Deeper divergences replay.
        override_stop_tokens: stop tokens for the matcher (default: the tokenizer info's).
    """

    def __init__(self, compiled_grammar, *, max_rollback_tokens: int = 16, override_stop_tokens=None):
        _require_xgrammar()
        if max_rollback_tokens < 1:
            raise ValueError(f"max_rollback_tokens must be >= 1, got {max_rollback_tokens}")
        self.compiled_grammar = compiled_grammar
        self.max_rollback_tokens = int(max_rollback_tokens)
        self.override_stop_tokens = override_stop_tokens
        self.vocab_size = compiled_grammar.tokenizer_info.vocab_size
        self._scratch = xgr.allocate_token_bitmask(1, self.vocab_size)
        info = compiled_grammar.tokenizer_info
        stop = set(info.stop_token_ids if override_stop_tokens is None else
                   ([override_stop_tokens] if isinstance(override_stop_tokens, int) else override_stop_tokens))
        # ids the matcher always refuses (it logs a warning for each): decided here, silently
        self._never = set(info.special_token_ids) - stop
        self._backend = "auto"
        self.reset()

    # -- state ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the prompt and the matchers: the next call starts a new generation."""
        self._prompt: torch.Tensor | None = None
        self._rows: list[_Row] = []
        self.stats = GrammarStats()

    def _new_matcher(self):
        # xgrammar >= 0.2 keeps the whole history (its `max_rollback_tokens` is deprecated);
        # our own bound decides between `rollback` and reset + replay.
        return xgr.GrammarMatcher(self.compiled_grammar, override_stop_tokens=self.override_stop_tokens)

    def _start(self, input_ids: torch.LongTensor) -> None:
        self._prompt = input_ids.detach().clone()
        self._rows = [_Row(self._new_matcher()) for _ in range(input_ids.shape[0])]

    @property
    def prompt_length(self) -> int | None:
        return None if self._prompt is None else self._prompt.shape[1]

    def accepted_tokens(self, row: int = 0) -> list[int]:
        """Generated tokens the row's matcher currently stands after (for tests/inspection)."""
        return list(self._rows[row].tokens)

    def matcher(self, row: int = 0):
        return self._rows[row].matcher

    # -- syncing one row to a prefix -------------------------------------------------------------
    def _rollback_to(self, row: _Row, keep: int, generated: torch.Tensor) -> None:
        n = len(row.tokens) - keep
        if n <= 0:
            return
        if n <= self.max_rollback_tokens:
            row.matcher.rollback(n)
            self.stats.rollbacks += 1
            self.stats.tokens_rolled_back += n
            self.stats.max_rollback = max(self.stats.max_rollback, n)
            del row.tokens[keep:]
        else:  # deeper than the matcher's history: start over and replay the kept tokens
            self.stats.replays += 1
            replay = generated[:keep].tolist()
            row.matcher = self._new_matcher()
            row.tokens, row.rejected = [], None
            for tok in replay:
                if tok in self._never or not 0 <= tok < self.vocab_size or not row.matcher.accept_token(tok):
                    row.rejected = (len(row.tokens), tok)
                    break
                row.tokens.append(tok)
        for pos in [p for p in row.masks if p > len(row.tokens)]:
            del row.masks[pos]
        if row.rejected is not None and row.rejected[0] > len(row.tokens):
            row.rejected = None

    def _sync(self, row: _Row, generated: torch.Tensor, exact: bool = False) -> bool:
        """Bring the row's matcher to the prefix ``generated`` (1-D, host or device).  Returns
        False if the prefix contains a token the grammar rejects (the matcher then stands at the
        longest valid prefix).  A shorter prefix whose mask is cached does not move the matcher
        unless ``exact``."""
        target_len = generated.shape[0]
        have = len(row.tokens)
        # Tokens older than the rollback window are verified: compare only the recent ones.
        base = max(0, min(have, target_len) - self.max_rollback_tokens - 1)
        tail = generated[base:].tolist()  # the one host read of input_ids per row and call
        common = base
        for a, b in zip(row.tokens[base:], tail):
            if a != b:
                break
            common += 1
        if common < have and target_len > common:  # diverges from the matcher's path: roll back
            self._rollback_to(row, common, generated)
        elif common < have and target_len == common and (exact or target_len not in row.masks):
            self._rollback_to(row, common, generated)  # a shorter prefix we have no mask for
        if target_len <= len(row.tokens):
            return True
        if row.rejected is not None and row.rejected[0] == len(row.tokens) and row.rejected[1] == tail[len(row.tokens) - base]:
            return False
        for tok in tail[len(row.tokens) - base :]:
            if tok in self._never or not 0 <= tok < self.vocab_size or not row.matcher.accept_token(tok):
                row.rejected = (len(row.tokens), tok)
                return False
            row.tokens.append(tok)
            self.stats.tokens_accepted += 1
        row.rejected = None
        return True

    def _mask(self, row: _Row, length: int) -> tuple[torch.Tensor | None, bool]:
        cached = row.masks.get(length)
        if cached is not None:
            self.stats.mask_cache_hits += 1
            return cached
        assert length == len(row.tokens)
        if row.matcher.is_terminated():  # after the stop token: generation ends, nothing to mask
            self.stats.terminated_calls += 1
            return None, False
        need_apply = bool(row.matcher.fill_next_token_bitmask(self._scratch, 0))
        entry = (self._scratch[0].clone(), need_apply)
        self.stats.masks_filled += 1
        row.masks[length] = entry
        # Keep only what a verifier / next round can still ask for.
        oldest = length - self.max_rollback_tokens - 2
        for pos in [p for p in row.masks if p < oldest]:
            del row.masks[pos]
        return entry

    # -- LogitsProcessor -------------------------------------------------------------------------
    def _check_prompt(self, input_ids: torch.LongTensor) -> int:
        prompt = self._prompt
        if (
            prompt is None
            or prompt.shape[0] != input_ids.shape[0]
            or input_ids.shape[1] < prompt.shape[1]
            or not torch.equal(input_ids[:, : prompt.shape[1]].to(prompt.device), prompt)
        ):
            self._start(input_ids)
        return self._prompt.shape[1]

    def sync_to_verified(self, input_ids: torch.LongTensor) -> None:
        """Roll the matchers back (or forward) to ``input_ids`` now, without computing a mask.
        The MTP candidate generator calls this after every verify round with the verified
        sequence, so that between rounds each matcher stands exactly after the verified prefix."""
        if self._prompt is None:
            return
        start = self._check_prompt(input_ids)
        for b, row in enumerate(self._rows):
            self._sync(row, input_ids[b, start:], exact=True)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        batch = input_ids.shape[0]
        start = self._check_prompt(input_ids)
        masks, rows_to_apply = [], []
        for b, row in enumerate(self._rows):
            self.stats.calls += 1
            generated = input_ids[b, start:]
            if not self._sync(row, generated):
                self.stats.rejected_prefix_calls += 1
                masks.append(None)
                continue
            mask, need_apply = self._mask(row, generated.shape[0])
            masks.append(mask)
            if mask is not None and need_apply:
                rows_to_apply.append(b)
        out = scores.clone()
        if rows_to_apply:
            bitmask = torch.stack([m if m is not None else torch.zeros_like(self._scratch[0]) for m in masks])
            bitmask = bitmask.to(out.device, non_blocking=True)
            self._apply(out, bitmask, None if len(rows_to_apply) == batch else rows_to_apply)
        if out.shape[-1] > self.vocab_size:  # padded LM head: ids beyond the tokenizer are never allowed
            valid = [b for b, m in enumerate(masks) if m is not None]
            if valid:
                out[valid, self.vocab_size :] = float("-inf")
        return out

    def _apply(self, logits: torch.Tensor, bitmask: torch.Tensor, indices) -> None:
        kw = dict(vocab_size=min(self.vocab_size, logits.shape[-1]), indices=indices)
        if self._backend == "auto":
            try:
                xgr.apply_token_bitmask_inplace(logits, bitmask, **kw)
                return
            except Exception:  # e.g. CUDA logits without triton / a compiled kernel
                self._backend = "torch_native"
        xgr.apply_token_bitmask_inplace(logits, bitmask, backend=self._backend, **kw)


def compile_json_schema(tokenizer_info, schema, **kwargs):
    """Convenience: `xgr.GrammarCompiler(tokenizer_info).compile_json_schema(schema, **kwargs)`."""
    return _require_xgrammar().GrammarCompiler(tokenizer_info).compile_json_schema(schema, **kwargs)
