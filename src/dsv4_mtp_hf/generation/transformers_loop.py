"""transformers' assisted loop (``_assisted_decoding``) for the calls our own loop does not serve, with every
stopping criterion honoured inside a round.

transformers cuts a round's tokens at EOS and max length only and checks the other criteria once, on the whole
sequence after the round: a stop string or a user ``StoppingCriteria`` that fires on an accepted draft is
missed, and decoding runs past it.  Here the loop gets the criteria wrapped (:class:`_RoundStops`): after each
round they are checked on each prefix of the round's tokens (:class:`.round.StopRules`); where one fires, the
loop is told to stop and the streamer gets only the kept tokens; after the loop the output (its per-token
scores, logits, attentions and hidden states too), the target's cache and the call's statistics end where plain
decoding would have ended.
"""

from __future__ import annotations

import torch

from . import round as rounds

# Output fields with one entry per generated token (transformers' assisted loop appends them token by token).
_PER_TOKEN = ("scores", "logits", "attentions", "hidden_states")


class _Streamer:
    """The call's streamer, fed each round's tokens only once :class:`_RoundStops` has cut them."""

    def __init__(self, streamer):
        self.streamer, self.held = streamer, []

    def put(self, value) -> None:
        self.held += torch.as_tensor(value).reshape(-1).tolist()

    def release(self, count: int) -> None:
        if self.held[:count]:
            self.streamer.put(torch.tensor([self.held[:count]]))
        self.held = []

    def end(self) -> None:
        self.release(len(self.held))
        self.streamer.end()


class _RoundStops:
    """transformers' stopping criteria as the loop calls them after each round, checked on each prefix of the
    round's tokens; ``end`` is the output's length once one fired inside a round."""

    def __init__(self, call, rules: rounds.StopRules, criteria, length: int, streamer):
        self.call, self.rules, self.criteria, self.length = call, rules, criteria, length
        self.streamer = None if streamer is None else _Streamer(streamer)
        self.end = None

    def __call__(self, input_ids, scores=None, **kwargs):
        if self.call.generator is not None and self.call.generator.verifying:
            return self.criteria(input_ids, scores, **kwargs)  # transformers 5.17's own check of the candidates
        new = input_ids[0, self.length :].tolist()
        stop = self.rules.first_stop(input_ids[:, : self.length], new, scores)
        if self.streamer is not None:
            self.streamer.release(stop or len(new))
        if stop is not None:
            self.end = self.length + stop
            return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        self.length = input_ids.shape[1]
        return self.criteria(input_ids, scores, **kwargs)

    def trim(self, out, cache, stats):
        """The loop's output cut to ``end``, the target's cache cropped to match, the statistics corrected."""
        if self.end is None:
            return out
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        extra = sequences.shape[1] - self.end
        if extra <= 0:
            return out
        cache.crop(self.end - 1)  # the target has processed all but the last kept token
        stats.new_tokens -= extra
        if isinstance(out, torch.Tensor):
            return out[:, : self.end]
        out.sequences = sequences[:, : self.end]
        for name in _PER_TOKEN:
            value = getattr(out, name, None)
            if isinstance(value, tuple) and len(value) >= extra:
                setattr(out, name, value[: len(value) - extra])
        return out


def decode(model, call, cache_name, input_ids, logits_processor, stopping_criteria, generation_config,
           synced_gpus=False, streamer=None, inputs_tensor=None, **model_kwargs):
    """``_assisted_decoding`` with ``call``'s drafter, its criteria checked inside each round."""
    rules = rounds.StopRules(stopping_criteria)
    stops = _RoundStops(call, rules, stopping_criteria, input_ids.shape[1], streamer) if rules.per_prefix else None
    out = type(model)._assisted_decoding(
        model, input_ids, logits_processor, stops or stopping_criteria, generation_config, synced_gpus=synced_gpus,
        streamer=streamer if stops is None else stops.streamer, inputs_tensor=inputs_tensor,
        assistant_model=call.drafter, **model_kwargs,
    )
    return out if stops is None else stops.trim(out, model_kwargs[cache_name], call.stats)
