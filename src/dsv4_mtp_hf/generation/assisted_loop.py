"""Assisted decoding of one sequence on a graphed target, greedy or sampled: our loop in place of transformers'.

On a graphed target (:mod:`dsv4_mtp_hf.target_runtime.graph`) a round's GPU work is two graph replays, the MTP's
round and the target's verify, and the GPU waits on whatever the host does between the read
of one round's accepted count and the next launch.  transformers' ``_assisted_decoding``
spends about 1-2 ms of host time there per round (input and mask bookkeeping, a float copy of
the logits, stopping criteria, cache and kwargs updates), as much as the MTP's whole round.
This loop runs the same round with the host doing only what it must:

* the drafter drafts through the call's candidate generator (:class:`~.candidate.DraftCandidateGenerator`, the
  drafter's session): one round-graph replay;
* the target verifies the last confirmed token and the drafts through its forward (so
  forward hooks on the target fire, as in ``generate``): one step-graph replay;
* the greedy choice at every verified row and the number of accepted drafts are computed on
  the GPU and read in one copy, the round's only synchronisation;
* sampling: the same, with the call's warpers applied to every verified row at once and
  speculative sampling's accept/resample on the device (:func:`.sampling.speculative_accept`);
* the tokens kept are the accepted drafts and the target's next token, cut at the first EOS,
  at ``max_length`` and where a stopping criterion fires, exactly what plain ``generate`` adds one
  token at a time (greedy), or distributed exactly as it (sampling).

``generate`` still prepares everything (generation config, stopping criteria, the streamer's
prompt) and hands over here as a ``custom_generate`` callable (``binding._assisted_generate``).
The loop serves greedy decoding without logits processors and sampling whose processors are all
graph-safe warpers (temperature, top-k, top-p, min-p), with any stopping criteria (stop strings and
user criteria are checked on each prefix of a round's tokens: :class:`.round.StopRules`), returning
the sequences.  Anything else -- other processors (grammars, penalties, ``min_new_tokens`` with an
EOS), ``return_dict_in_generate``, ``synced_gpus`` -- runs transformers' loop with the same prepared
arguments (:mod:`.transformers_loop`).
"""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from . import round as rounds
from . import sampling


def _limits(stopping_criteria) -> tuple[int, set[int]]:
    """``(max_length, EOS ids)`` of the call's criteria (``generate`` always adds a max length)."""
    max_length, eos = None, set()
    for criterion in stopping_criteria:
        if type(criterion) is MaxLengthCriteria:
            max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
        elif type(criterion) is EosTokenCriteria:
            eos |= {int(t) for t in criterion.eos_token_id.reshape(-1).tolist()}
    return max_length, eos


def serves(logits_processor, stopping_criteria, generation_config, synced_gpus) -> bool:
    """Whether this loop serves the call (the module docstring), else transformers' loop does."""
    processors_served = rounds.regime(generation_config.do_sample, logits_processor) != "processed"
    return (processors_served and not synced_gpus and not generation_config.return_dict_in_generate
            and _limits(stopping_criteria)[0] is not None)


def _first_token(logits: torch.Tensor, warpers) -> torch.Tensor:
    """The target's token after the prompt from its last logits row ``[1, V]``: the argmax, or a draw from the
    warped distribution."""
    if warpers is None:
        return logits.argmax(-1)
    probs = sampling.warp(warpers, logits).softmax(-1)
    sampling.check_finite(probs, "The target's distribution after the prompt")
    return sampling.draw(probs)


@torch.no_grad()
def decode(model, candidates, cache_name, input_ids, stopping_criteria, streamer=None, warpers=None,
           **model_kwargs):
    """The loop (module docstring) for ``input_ids [1, L]`` with generate's ``model_kwargs``; ``candidates``
    is the call's candidate generator, ``model_kwargs[cache_name]`` the target's
    :class:`~dsv4_mtp_hf.target_runtime.graph.GraphedTargetCache` (empty, or holding a prefix of ``input_ids`` from an
    earlier call); ``warpers``: the call's (graph-safe) logits processors when it samples, None when greedy.
    Returns ``[1, L + new]``."""
    max_length, eos = _limits(stopping_criteria)
    rules = rounds.StopRules(stopping_criteria)
    cache = model_kwargs[cache_name]
    candidates.verifier_cuts_at_eos = True  # `rounds.cut` below: no host read of the drafts for transformers 5.17
    ids = input_ids
    # The prompt (what the cache does not hold yet): transformers' first iteration, no drafts.
    candidates.get_candidates(ids, is_first_iteration=True)
    logits = model(ids[:, cache.get_seq_length():], **{cache_name: cache}, logits_to_keep=1).logits
    selected = _first_token(logits[0, -1:], warpers).to(ids.device)
    tokens, accepted = rounds.cut(selected.tolist(), eos, max_length - ids.shape[1]), 0
    stop = rules.first_stop(ids, tokens)
    while True:
        # The kept tokens are a prefix of the target's choices: appended from the device, no upload.
        ids = torch.cat([ids, selected[None, : len(tokens)]], dim=1)
        candidates.update_candidate_strategy(ids, None, min(accepted, len(tokens) - 1))
        if streamer is not None:
            streamer.put(torch.tensor([tokens]))
        if stop or tokens[-1] in eos or ids.shape[1] >= max_length or rules.round_over(ids):
            break
        length = ids.shape[1]
        candidate_ids, q = candidates.get_candidates(ids, is_first_iteration=False)
        drafted = candidate_ids.shape[1] - length
        verify = candidate_ids[:, length - 1 :].to(ids.device)  # the last confirmed token, then the drafts
        logits = model(verify, **{cache_name: cache}, logits_to_keep=drafted + 1).logits
        accepted, selected = rounds.accept(verify[:, 1:], logits, q, warpers)
        read = [accepted.view(1), selected[0]]
        if warpers is not None:  # a NaN anywhere would be drawn silently: checked in the same read
            read.append(torch.isfinite(logits).all().view(1).long())
        read = torch.cat(read).tolist()  # the round's one host read
        if warpers is not None and not read.pop():
            sampling.check_finite(logits, "The target's logits at the verified rows")
        accepted, selected = read[0], selected[0].to(ids.device)
        tokens = rounds.cut(read[1:], eos, min(accepted + 1, max_length - length))
        stop = rules.first_stop(ids, tokens)  # a stop string or criterion inside the round ends it there
        tokens = tokens[:stop]
        cache.crop(length + len(tokens) - 1 - cache.get_seq_length())  # the target processed all but the last
    if streamer is not None:
        streamer.end()
    return ids
