"""Assisted decoding of one sequence on a graphed target, greedy or sampled: our loop in place of transformers'.

On a graphed target (:mod:`.target_graph`) a round's GPU work is two graph replays, the MTP's
round and the target's verify, and the GPU waits on whatever the host does between the read
of one round's accepted count and the next launch.  transformers' ``_assisted_decoding``
spends about 1-2 ms of host time there per round (input and mask bookkeeping, a float copy of
the logits, stopping criteria, cache and kwargs updates), as much as the MTP's whole round.
This loop runs the same round with the host doing only what it must:

* the MTP drafts through the candidate generator (:class:`~.candidate.MtpCandidateGenerator`,
  or ``mtp.candidate_generator_class``): one round-graph replay;
* the target verifies the last confirmed token and the drafts through its forward (so
  forward hooks on the target fire, as in ``generate``): one step-graph replay;
* the greedy choice at every verified row and the number of accepted drafts are computed on
  the GPU and read in one copy, the round's only synchronisation;
* sampling: the same, with the call's warpers applied to every verified row at once and
  speculative sampling's accept/resample on the device (:func:`.sampling.speculative_accept`);
* the tokens kept are the accepted drafts and the target's next token, cut at the first EOS
  and at ``max_length``, exactly what plain ``generate`` adds one token at a time (greedy), or
  distributed exactly as it (sampling).

``generate`` still prepares everything (generation config, stopping criteria, the streamer's
prompt) and hands over here as a ``custom_generate`` callable (``binding._assisted_generate``).
The loop serves greedy decoding without logits processors and sampling whose processors are all
graph-safe warpers (temperature, top-k, top-p, min-p), stopped by max length and EOS only,
returning the sequences.  Anything else -- other processors (grammars, penalties,
``min_new_tokens`` with an EOS), other stopping criteria, ``return_dict_in_generate``,
``synced_gpus`` -- runs transformers' ``_assisted_decoding`` with the same prepared arguments.
"""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from . import sampling


def _limits(stopping_criteria) -> tuple[int, set[int]] | None:
    """``(max_length, EOS ids)`` when the criteria are only max length and EOS, else None."""
    max_length, eos = None, set()
    for criterion in stopping_criteria:
        if type(criterion) is MaxLengthCriteria:
            max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
        elif type(criterion) is EosTokenCriteria:
            eos |= {int(t) for t in criterion.eos_token_id.reshape(-1).tolist()}
        else:
            return None
    return None if max_length is None else (max_length, eos)


def serves(logits_processor, stopping_criteria, generation_config, synced_gpus) -> bool:
    """Whether this loop serves the call (the module docstring), else transformers' loop does."""
    processors_served = sampling.graph_safe(logits_processor) if generation_config.do_sample else not logits_processor
    return (processors_served and not synced_gpus and not generation_config.return_dict_in_generate
            and _limits(stopping_criteria) is not None)


def _kept(selected: list[int], accepted: int, room: int, eos: set[int]) -> list[int]:
    """The round's new tokens: the accepted drafts and the target's token after them (``selected[:accepted + 1]``,
    the drafts being equal to the target's choices there), up to the first EOS and at most ``room``."""
    tokens = selected[: min(accepted + 1, room)]
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end]


def _choose(logits: torch.Tensor, warpers) -> torch.Tensor:
    """The target's token at each row of ``logits [n, V]``: the argmax (``warpers`` None), or a draw from the
    warped distribution."""
    if warpers is None:
        return logits.argmax(-1)
    return sampling.draw(sampling.warp(warpers, logits).softmax(-1))


@torch.no_grad()
def decode(model, candidates, cache_name, input_ids, stopping_criteria, streamer=None, warpers=None,
           **model_kwargs):
    """The loop (module docstring) for ``input_ids [1, L]`` with generate's ``model_kwargs``; ``candidates``
    is the call's candidate generator, ``model_kwargs[cache_name]`` the target's
    :class:`~.target_graph.GraphedTargetCache`; ``warpers``: the call's (graph-safe) logits processors when it
    samples, None when it is greedy.  Returns ``[1, L + new]``."""
    max_length, eos = _limits(stopping_criteria)
    cache = model_kwargs[cache_name]
    candidates.verifier_cuts_at_eos = True  # `_kept` below: no host read of the drafts for transformers 5.17
    ids = input_ids
    # The prompt: transformers' first iteration (no drafts), then the target's forward over it.
    candidates.get_candidates(ids, is_first_iteration=True)
    prefill = {k: model_kwargs[k] for k in ("attention_mask", "position_ids") if model_kwargs.get(k) is not None}
    logits = model(ids, **{cache_name: cache}, **prefill, logits_to_keep=1).logits
    selected = _choose(logits[0, -1:], warpers).to(ids.device)
    tokens, accepted = _kept(selected.tolist(), 0, max_length - ids.shape[1], eos), 0
    while True:
        # The kept tokens are a prefix of the target's choices: appended from the device, no upload.
        ids = torch.cat([ids, selected[None, : len(tokens)]], dim=1)
        candidates.update_candidate_strategy(ids, None, min(accepted, len(tokens) - 1))
        if streamer is not None:
            streamer.put(torch.tensor([tokens]))
        if tokens[-1] in eos or ids.shape[1] >= max_length:
            break
        length = ids.shape[1]
        candidate_ids, q = candidates.get_candidates(ids, is_first_iteration=False)
        drafted = candidate_ids.shape[1] - length
        verify = candidate_ids[:, length - 1 :].to(ids.device)  # the last confirmed token, then the drafts
        logits = model(verify, **{cache_name: cache}, logits_to_keep=drafted + 1).logits
        if warpers is None:
            selected = logits[0].argmax(-1).to(ids.device)  # the target's greedy token at each verified row
            matches = (verify[0, 1:] == selected[:drafted]).cumprod(0).sum()
        else:  # accepted drafts, then the target's (re)sampled token: selected[:matches + 1]
            p = sampling.warp(warpers, logits[0]).softmax(-1)
            q = p.new_zeros(0, p.shape[-1]) if q is None else q[0].to(p.device).softmax(-1)
            matches, selected = sampling.speculative_accept(verify[:, 1:].to(p.device), q[None], p[None])
            matches, selected = matches[0], selected[0].to(ids.device)
        read = torch.cat([matches.view(1), selected]).tolist()  # the round's one host read
        accepted = read[0]
        tokens = _kept(read[1:], accepted, max_length - length, eos)
        cache.crop(length + len(tokens) - 1)  # the target has processed all but the last kept token
    if streamer is not None:
        streamer.end()
    return ids
