"""A drafter under transformers' assisted loop: the candidate generator of one assisted ``generate`` call.

transformers' ``_assisted_decoding`` asks a candidate generator for each round's candidates and tells it how
many were accepted.  :class:`DraftCandidateGenerator` answers for any of our drafters (:mod:`.drafter`):
it takes the target's features of the last forward (the call's feature source), has the drafter's session
commit them and draft, hands the verifier the round's candidates (the drafts, their distributions for
speculative sampling) and keeps the call's statistics and draft-length choices.  Our own loop on a graphed
target (:mod:`.assisted_loop`) drives the same object.

The first round proposes nothing (transformers' first iteration), so the target's prefill produces the
features the drafter needs.  Drafts stop at the first EOS (kept as the last draft) and never pass
``max_length``; transformers 5.17 does not cut accepted tokens at an EOS itself, so there the drafts after
an EOS are dropped here (a host read of the round's drafts).
"""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..compat import VERIFIER_CUTS_AT_EOS
from . import round as rounds
from . import sampling
from .draft_length import AutoDraftLength, ConfidenceLength


class DraftCandidateGenerator(CandidateGenerator):
    requires_model_outputs = True
    model_kwargs_overrides: dict = {}  # the features arrive through the call's feature source, not the outputs

    def __init__(self, call, generation_config, logits_processor=None):
        self.call = call  # binding.AssistedCall: the drafter, its feature source, K, the statistics
        self.num_assistant_tokens = call.num_drafts
        self.logits_processor = logits_processor
        self.max_length = generation_config.max_length
        eos = getattr(generation_config, "_eos_token_tensor", None)
        self.eos = set() if eos is None else set(eos.reshape(-1).tolist())
        do_sample = bool(generation_config.do_sample)
        regime = rounds.regime(do_sample, logits_processor)
        self.chooser = rounds.Chooser(logits_processor, do_sample, self.eos, call.stats)
        self.session = call.start_session(regime, logits_processor if regime == "sampled" else None)
        self.draft_length = _length_policy(call, timed=not do_sample)
        self.last_drafted, self.last_input_length = 0, None
        self.verifying = False  # between handing out candidates and hearing how many were accepted
        self.round_limit = call.num_drafts  # drafts handed to the verifier this round
        self.verifier_cuts_at_eos = VERIFIER_CUTS_AT_EOS  # our own loop (assisted_loop) cuts at EOS too
        # Sampled drafts (the drafter's warped draws): their distributions are checked for NaN once, on the call's first
        # drafting round (broken weights show there; one host read per call, none per round).  The per-position
        # Chooser checks every draw itself.
        self.check_drafts = regime == "sampled"

    @property
    def num_drafting_tokens(self) -> int:
        """Drafts per round (transformers >= 5.25 sizes the target cache's past recording with it)."""
        return self.num_assistant_tokens

    @torch.no_grad()
    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        length = input_ids.shape[1]
        self.last_input_length, self.last_drafted, self.verifying = length, 0, True
        if is_first_iteration:
            return input_ids, None
        features = self.call.take_features()
        budget = min(self.num_assistant_tokens, self.max_length - length - 1)
        if budget < 1:  # the verify's own token ends the generation: no drafting (a later call resumes)
            self.session.hold(features, processed=length - 1)  # not the rows of the drafts the verify rejected
            return input_ids, None
        self.round_limit = self.num_assistant_tokens
        by_confidence = isinstance(self.draft_length, ConfidenceLength)
        if self.draft_length is not None:
            if by_confidence:  # DSpark: whether to draft at all; the verify length comes with the confidences
                drafting = self.draft_length.draft_now()
            else:
                self.round_limit = self.draft_length.choose()
                drafting = self.round_limit > 0
            if not drafting:  # "auto" found plain steps faster: the drafter keeps the rows for later
                self.session.hold(features, processed=length - 1)
                self.call.stats.draft_lengths.append(0)
                return input_ids, None
        first_round = self.session.committed == 0
        drafts = self.session.draft(input_ids, features, self.chooser, min(budget, self.round_limit))
        if drafts is None:
            return input_ids, None
        if by_confidence:  # one host read of the round's confidences
            self.round_limit = self.draft_length.choose(drafts.confidences[0].tolist())
        if first_round and self.draft_length is not None:
            self.draft_length.skip_timing()  # this round also runs the drafter over the whole prompt
        keep = min(self.round_limit, budget, drafts.tokens.shape[1])
        if self.check_drafts:
            self.check_drafts = False
            sampling.check_finite(drafts.logits[:, :keep].softmax(-1), "The drafter's sampled distribution")
        if self.eos and not self.verifier_cuts_at_eos:
            keep = len(rounds.cut(drafts.tokens[0, :keep].tolist(), self.eos, keep))  # one host read per round
        self.last_drafted = keep
        candidates = torch.cat([input_ids, drafts.tokens[:, :keep].to(input_ids.device)], dim=1)
        return candidates, drafts.logits[:, :keep]

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        self.verifying = False
        # Stateful processors (grammar matchers) roll back to the verified sequence now.
        for processor in self.logits_processor or ():
            sync = getattr(processor, "sync_to_verified", None)
            if sync is not None:
                sync(input_ids)
        new_tokens = input_ids.shape[1] - (self.last_input_length or input_ids.shape[1])
        accepted = min(int(num_matches), self.last_drafted)
        self.call.stats.record_round(self.last_drafted, accepted, new_tokens)
        if self.draft_length is not None and self.last_drafted:
            self.draft_length.observe(self.last_drafted, accepted)
            self.call.stats.draft_lengths.append(self.round_limit)


def _length_policy(call, timed: bool):
    """How many drafts the verifier gets each round: all K (None); ``"auto"`` for a drafter without
    confidences: K from this call's acceptance and round times; with confidences (``"auto"`` or
    ``assistant_confidence_threshold``): a prefix of the block chosen from them.  ``timed=False`` (sampled
    calls): modeled round costs in place of times, so that a seeded call repeats (draft_length.py)."""
    if call.session_class.confidence_head and (call.auto or call.confidence_threshold is not None):
        return ConfidenceLength(call.num_drafts, call.confidence_threshold, timed)
    return AutoDraftLength(call.num_drafts, timed) if call.auto else None
