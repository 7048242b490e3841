"""A round's rules, shared by every driver (transformers' loop, ours, batches) and every drafter.

A round: the drafter proposes drafts after the confirmed tokens; the target verifies the last confirmed
token and the drafts in one forward; the drafts it agrees with are kept, plus the target's own token
after them (a correction or a bonus).  This module owns:

* :func:`resolve_num_drafts`: ``num_assistant_tokens`` (an int, or ``"auto"``) checked once, against the
  drafter's one limit;
* :func:`regime`: which drafting path a call's settings take (graph-safe or per-position choices);
* :func:`accept`: greedy or sampled acceptance of a round's drafts, on the device, for B rounds at once;
* :func:`cut`: the kept tokens cut at the first EOS and at the length budget;
* :class:`StopRules`: the call's other stopping criteria (stop strings, user criteria) applied to each prefix of
  the kept tokens, so a round ends exactly where plain decoding would have stopped;
* :class:`Chooser`: the per-position draft choice when logits processors read the sequence.
"""

from __future__ import annotations

import numbers

import torch
from transformers.generation.stopping_criteria import (
    ConfidenceCriteria,
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
)

from . import sampling

AUTO = "auto"


def resolve_num_drafts(value, max_drafts: int, auto_drafts: int, limit_hint: str = "") -> tuple[int, bool]:
    """``num_assistant_tokens`` -> (drafts per round K, whether K is chosen per round).  ``"auto"`` drafts
    ``auto_drafts`` (the drafter's own choice) and hands the verifier a per-round prefix.  K must lie in
    ``[1, max_drafts]``: what the drafter's state can roll back (``limit_hint``: what sets that limit)."""
    if value == AUTO:
        return min(auto_drafts, max_drafts), True
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`num_assistant_tokens` must be an integer >= 1 (drafts per round) or \"auto\", "
                         f"got {value!r}.")
    if value > max_drafts:
        raise ValueError(f"`num_assistant_tokens`={value} exceeds the {max_drafts} drafts per round this drafter "
                         f"can roll back; ask for fewer{f' ({limit_hint})' if limit_hint else ''}.")
    return int(value), False


def regime(do_sample: bool, logits_processor) -> str:
    """``"greedy"`` (no processors), ``"sampled"`` (graph-safe warpers only: :mod:`.sampling`) or
    ``"processed"``: processors that read the sequence, applied per draft position by a :class:`Chooser`."""
    if do_sample:
        return "sampled" if sampling.graph_safe(logits_processor) else "processed"
    return "greedy" if not logits_processor else "processed"


def cut(tokens: list[int], eos: set[int], room: int) -> list[int]:
    """The tokens a round keeps: at most ``room`` (the length budget), up to and including the first EOS."""
    tokens = tokens[: max(room, 0)]
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end]


# Criteria every driver already applies inside a round (`cut`), and the one that is about time, not a prefix: it
# is checked once a round, on the whole sequence, as transformers' assisted loop does.
_CUT_BY_EVERY_DRIVER = (MaxLengthCriteria, EosTokenCriteria)
_PER_ROUND = (MaxTimeCriteria,)


class StopRules:
    """The call's stopping criteria inside a round.  Plain decoding checks them after every token; a round adds
    several tokens at once, so each prefix of its kept tokens is checked and the round ends at the first where
    any criterion fires (stop strings, user ``StoppingCriteria``): the output, and the caches after it, end
    exactly where plain decoding would have stopped.  A criterion must therefore be a function of the sequence,
    as transformers' own are.  ``MaxTimeCriteria`` is checked once a round; EOS and max length are cut by
    :func:`cut`.  ``ConfidenceCriteria`` (an assistant's own rule, reading the step's scores) is refused."""

    def __init__(self, stopping_criteria):
        criteria = list(stopping_criteria or ())
        refused = [c for c in criteria if isinstance(c, ConfidenceCriteria)]
        if refused:
            raise ValueError("`ConfidenceCriteria` stops an assistant model's own drafting from its step scores; it "
                             "has no meaning for the target of speculative decoding. Remove it (DSpark's drafts are "
                             "cut by confidence with `assistant_confidence_threshold=`).")
        self.per_prefix = [c for c in criteria if type(c) not in _CUT_BY_EVERY_DRIVER + _PER_ROUND]
        self.per_round = [c for c in criteria if type(c) in _PER_ROUND]

    def __bool__(self) -> bool:
        return bool(self.per_prefix or self.per_round)

    def first_stop(self, ids: torch.Tensor, tokens: list[int], scores=None) -> int | None:
        """For a round's kept ``tokens`` after ``ids [1, L]``: the length of the shortest prefix of ``tokens`` on
        which a per-prefix criterion fires (plain decoding stops there), else None.  ``scores``: what the
        criteria would be called with after the last token (a per-token tuple is cut to each prefix)."""
        if not self.per_prefix or not tokens:
            return None
        full = torch.cat([ids, torch.as_tensor(tokens, dtype=ids.dtype, device=ids.device).view(1, -1)], dim=1)
        n, length = len(tokens), ids.shape[1]
        fired = []
        for j in range(1, n + 1):
            cut_scores = scores[: len(scores) - (n - j)] if isinstance(scores, tuple) else scores
            prefix = full[:, : length + j]
            fired.append(torch.stack([torch.as_tensor(c(prefix, cut_scores)).reshape(-1)[0].to(ids.device)
                                      for c in self.per_prefix]).any())
        hits = torch.stack(fired).tolist()  # one host read for every prefix
        return next((j + 1 for j, hit in enumerate(hits) if hit), None)

    def round_over(self, ids: torch.Tensor) -> bool:
        """After a round: whether a per-round criterion (max time) ends the call."""
        return any(bool(torch.as_tensor(c(ids, None)).any()) for c in self.per_round)


def accepted_prefix(drafts: list[int], choices: list[int]) -> int:
    """Greedy acceptance read on the host (the batched loop's ragged rounds): the drafts equal to the target's
    choices at their rows, up to the first that is not -- the rule :func:`accept` applies on the device."""
    return next((n for n, (d, c) in enumerate(zip(drafts, choices)) if d != c), len(drafts))


def accept(drafts: torch.Tensor, target_logits: torch.Tensor, q_logits: torch.Tensor | None = None,
           warpers=None, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance of B rounds on the device: ``drafts [B, k]``, the target's logits at the verified rows
    ``[B, k + 1, V]``.  Greedy (``warpers`` None): the drafts equal to the target's argmax, up to the first
    that is not.  Sampled: speculative sampling against ``q_logits [B, k, V]`` (what each draft was drawn
    from) with the target's rows warped by the call's ``warpers``.  Returns ``(accepted [B], selected
    [B, k + 1])``; a round keeps ``selected[:, : accepted + 1]``."""
    if warpers is None:
        selected = target_logits.argmax(-1)
        k = drafts.shape[1]
        accepted = (drafts == selected[:, :k].to(drafts.device)).long().cumprod(-1).sum(-1)
        return accepted.to(selected.device), selected
    p = sampling.warp(warpers, target_logits).softmax(-1)
    q = q_logits.to(p.device).float().softmax(-1) if q_logits is not None else p.new_zeros(*drafts.shape, p.shape[-1])
    return sampling.speculative_accept(drafts.to(p.device), q, p, generator)


class Chooser:
    """Draft choices when the call's logits processors read the sequence (grammars, penalties, ...): each draft
    position is processed with the drafted prefix, exactly as the verifier processes the target's rows, and the
    draft is its argmax or a draw from it (the processed logits are the ``q`` handed to the verifier).  A
    position whose processed logits allow no token ends the round (returns None)."""

    def __init__(self, logits_processor, do_sample: bool, eos: set[int], stats=None):
        self.logits_processor, self.do_sample, self.eos, self.stats = logits_processor, do_sample, eos, stats

    def process(self, logits: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        return self.logits_processor(prefix.to(logits.device), logits) if self.logits_processor else logits

    def select(self, processed: torch.Tensor) -> torch.Tensor:
        if not self.do_sample:
            return processed.argmax(-1, keepdim=True)
        probs = processed.softmax(-1)
        sampling.check_finite(probs, "The draft's processed distribution")
        return sampling.draw(probs).unsqueeze(-1)

    def __call__(self, logits: torch.Tensor, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """``logits [1, V]`` at the next draft position after ``prefix [1, L]`` -> ``(token [1, 1], processed
        logits [1, V], last)`` (``last``: an EOS, draft no further), or None: nothing allowed here."""
        processed = self.process(logits, prefix)
        if self.do_sample and bool(torch.isneginf(processed).all()):  # nothing to sample from: no junk draft
            return self._stopped()
        token = self.select(processed)
        # one host read per draft: the token id and whether the processed distribution allows it at all
        token_id, forbidden = torch.cat([token, torch.isneginf(processed.gather(-1, token)).long()], -1)[0].tolist()
        if forbidden:
            return self._stopped()
        return token, processed, token_id in self.eos

    def _stopped(self) -> None:
        if self.stats is not None:
            self.stats.rounds_stopped_by_processor += 1
        return None
