"""The drafter protocol: what a round driver asks of a draft model.

A drafter is a model (``DeepseekV4MtpForCausalLM``, ...) plus a :class:`DraftSession`: one generation's
drafting state for one sequence.  The drivers (transformers' loop through :mod:`.candidate`, our loop
:mod:`.assisted_loop`) know nothing else of a drafter:

* ``feature_layers``: which target layers' outputs (the multi-stream residual ``[hc, D]`` after the layer)
  the drafter reads; the target's side captures them (:mod:`dsv4_mtp_hf.target_runtime.features`);
* :meth:`DraftSession.draft`: commit the target's rows that were confirmed since the last round (their
  features), drop the drafter's provisional rows, and propose the next drafts after the confirmed tokens;
* :meth:`DraftSession.hold`: the target ran without a draft after it (the round that ends a generation):
  keep its features for the next draft;
* :meth:`DraftSession.snapshot` / :meth:`DraftSession.restore`: the state a later call on the same target
  cache resumes from (multi-turn).

A new drafter adds a session class and registers it in :data:`SESSIONS` under its ``config.model_type``; for
batches (:mod:`.speculative`) a :class:`BatchDrafter` too, registered in :data:`BATCH_DRAFTERS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Drafts:
    """One round's drafts: ``tokens [1, k]``; ``logits [1, k, V]`` fp32, the distribution each draft was chosen
    from (the processed logits: what speculative sampling needs as ``q``); ``confidences [1, k]``: the drafter's
    estimate that draft j is accepted given drafts 1..j-1 were (None without a confidence head)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidences: torch.Tensor | None = None


class DraftSession:
    """One generation's drafting state (batch 1).  Subclasses implement :meth:`_draft`, :meth:`snapshot`,
    :meth:`restore`; ``committed`` counts the target rows (positions 0..committed-1) in the drafter's state."""

    model_type: str = ""
    confidence_head: bool = False  # drafts come with confidences (DSpark): a verify length can follow them

    def __init__(self, model, num_drafts: int):
        self.model, self.num_drafts = model, num_drafts
        self.committed = 0
        self._held: list[torch.Tensor] = []

    @staticmethod
    def feature_layers(model, target_config) -> list[int]:
        """The target layers whose outputs this drafter reads (in the order it reads them)."""
        raise NotImplementedError

    @staticmethod
    def max_drafts(model) -> int:
        """The most drafts per round the drafter's state can roll back."""
        raise NotImplementedError

    limit_hint: str = ""  # what sets max_drafts, for the error that names it

    @staticmethod
    def auto_num_drafts(model) -> int:
        """The drafts a round makes under ``num_assistant_tokens="auto"`` (the verifier gets a chosen prefix)."""
        raise NotImplementedError

    def draft(self, ids: torch.Tensor, features: torch.Tensor | None, choose, limit: int) -> Drafts | None:
        """The next drafts after the confirmed tokens ``ids [1, L]``.  ``features [1, n, F, hc, D]``: the target's
        features of its last forward, whose first rows (after what :meth:`hold` kept) are rows
        ``committed .. L-2``.  ``choose``: the call's :class:`~.round.Chooser`, used where drafts are chosen one
        position at a time (processors that read the sequence); the session's own greedy or warped draws
        serve the other calls.  ``limit``: the most drafts worth proposing (a session may draft more; the
        driver hands the verifier a prefix).  None: nothing to propose."""
        features = self._take(features)
        rows = ids.shape[1] - 1 - self.committed
        if rows < 1 or features is None or features.shape[1] < rows:
            raise RuntimeError(
                f"drafting lost track of the target: {rows} confirmed rows to commit but the target's features "
                f"cover {None if features is None else features.shape[1]} rows.")
        return self._draft(ids, features[:, :rows], choose, limit)

    def hold(self, features: torch.Tensor | None, processed: int | None = None) -> None:
        """The target processed rows but nothing is drafted after them: keep their features (cloned).
        ``processed``: the target's length now, so that rows the target rolled back are not kept."""
        if features is not None:
            self._held.append(features.clone())
        if processed is not None and self._held:
            kept = self._take(None)[:, : max(processed - self.committed, 0)]
            self._held = [kept] if kept.shape[1] else []

    def _take(self, features: torch.Tensor | None) -> torch.Tensor | None:
        if not self._held:
            return features
        parts = self._held + ([features] if features is not None else [])
        self._held = []
        return torch.cat([p.to(parts[-1].device) for p in parts], dim=1)

    def _draft(self, ids, features, choose, limit: int) -> Drafts | None:
        raise NotImplementedError

    def snapshot(self) -> dict:
        """What a later call resumes from: the drafter's state (copies), its committed count, the held features."""
        held = self._take(None)
        self._held = [held] if held is not None else []
        return {"committed": self.committed, "held": held, "state": self._snapshot()}

    def restore(self, snapshot: dict) -> None:
        self.committed = snapshot["committed"]
        self._held = [snapshot["held"]] if snapshot["held"] is not None else []
        self._restore(snapshot["state"])

    def _snapshot(self):
        raise NotImplementedError

    def _restore(self, state) -> None:
        raise NotImplementedError


SESSIONS: dict[str, type[DraftSession]] = {}


def register(cls: type[DraftSession]) -> type[DraftSession]:
    SESSIONS[cls.model_type] = cls
    return cls


def _registered(registry: dict, model):
    """``registry``'s entry for a draft model of ours (by ``config.model_type``), else None."""
    return registry.get(getattr(getattr(model, "config", None), "model_type", None))


def session_class(model) -> type[DraftSession] | None:
    """The session class of a draft model of ours, else None."""
    return _registered(SESSIONS, model)


class BatchDrafter:
    """A drafter's part of one batched call (:mod:`.speculative`): its state for B sequences of different lengths,
    each with its own rows and rollback.  The batched loop knows nothing else of a drafter:

    * :meth:`advance`: commit the target's rows kept since the last round (after the prefill: the prompt; after a
      verify: the last confirmed token and the accepted drafts), from their features;
    * :meth:`draft`: each sequence's drafts after its confirmed tokens (and, sampling, what each was drawn from);
    * :meth:`rollback`: after the verify, drop the drafts' provisional rows;
    * :meth:`observe`: a round's outcome per sequence (a verify-length policy learns from it);
    * :meth:`free`: a sequence finished.

    ``call`` is the batch (read only): ``tokens`` (each sequence's confirmed tokens), ``k`` (drafts per round, the
    most), ``auto``, ``threshold``, ``warpers`` (None: greedy), ``generator``, ``prefill_chunk``, ``stats``."""

    model_type: str = ""

    def __init__(self, model, call):
        self.model, self.call = model, call

    @classmethod
    def check_settings(cls, model, auto: bool, threshold) -> None:
        """Refuse the call's drafting settings this drafter's batches cannot honour, naming the fix."""

    def advance(self, seqs: list[int], features: list[torch.Tensor]) -> None:
        """``features[j] [n_j, F, hc, D]``: the target's rows of sequence ``seqs[j]`` kept since its last commit."""
        raise NotImplementedError

    def draft(self, seqs: list[int], budgets: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """At most ``budgets[j]`` drafts for sequence ``seqs[j]`` (none is a plain step), and for sampling the
        processed logits ``[k_j, V]`` each draft was drawn from (speculative sampling's ``q``; None when greedy)."""
        raise NotImplementedError

    def rollback(self, seqs: list[int]) -> None:
        raise NotImplementedError

    def observe(self, i: int, drafted: int, accepted: int) -> None:
        """Sequence ``i``'s round verified ``drafted`` drafts and accepted ``accepted``."""

    def free(self, i: int) -> None:
        raise NotImplementedError


BATCH_DRAFTERS: dict[str, type[BatchDrafter]] = {}


def register_batch(cls: type[BatchDrafter]) -> type[BatchDrafter]:
    BATCH_DRAFTERS[cls.model_type] = cls
    return cls


def batch_drafter_class(model) -> type[BatchDrafter] | None:
    """The batch part of a draft model of ours, else None."""
    return _registered(BATCH_DRAFTERS, model)
