"""Binding an MTP draft to a transformers `DeepseekV4ForCausalLM` target.

transformers refuses assisted generation for V4 (`_is_stateful`) and only builds its own
candidate generators.  Binding changes nothing process-wide: it sets per-instance
attributes on the ONE target object (`generate` and `_get_candidate_generator`), which
defer to the class's own methods unless this MTP is the `assistant_model`.  Only inside
such a call does the target get a rollback-able cache, a hook that hands its pre-`hc_head`
residual to the draft, and `_is_stateful = False`.  `unbind()` removes all of it.
On a graphed target the call decodes through our loop (:mod:`.assisted_loop`), handed to
``generate`` as its ``custom_generate``.
"""

from __future__ import annotations

import inspect

import torch

from .. import patching
from ..compat import cache_kwarg
from ..target.graph import GraphedTargetCache, final_length, graphed
from ..target.rollback_cache import RollbackDeepseekV4Cache
from . import assisted_loop
from .candidate import MtpCandidateGenerator
from .draft_length import AUTO_MAX_DRAFTS
from .stats import GenerationStats

class _AssistedRun:
    """State of one assisted `generate` call."""

    def __init__(self, mtp, target, num_assistant_tokens: int, auto: bool = False, graphs=None):
        self.mtp, self.target = mtp, target
        self.num_assistant_tokens = num_assistant_tokens  # with ``auto``: the most drafts a round may have
        self.auto = auto
        self.stats = GenerationStats(num_assistant_tokens, auto=auto)
        self._residual = None
        # On its graphed cache a graphed target runs its head inside its step and hands the residual over itself.
        self._graphs = graphs
        self._hook = None if graphs is not None else target.model.hc_head.register_forward_pre_hook(self._capture)

    def _capture(self, module, args):
        self._residual = args[0]

    def take_residual(self) -> torch.Tensor | None:
        """The target's pre-``hc_head`` streams ``[1, n, hc, D]`` of its last forward, once."""
        if self._graphs is not None:
            return self._graphs.take_residual()
        residual, self._residual = self._residual, None
        return residual

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._residual = None


def _candidates(mtp, run, generation_config, logits_processor):
    """The call's candidate generator: ``mtp.candidate_generator_class`` (a benchmark's or a test's), else ours."""
    return (mtp.candidate_generator_class or MtpCandidateGenerator)(
        mtp, run, generation_config, logits_processor=logits_processor
    )


def _graphed_decoding(mtp, run, name, streamer, synced_gpus):
    """The ``custom_generate`` callable of an assisted call on a graphed target: our loop
    (:mod:`.assisted_loop`) where it serves the call, else transformers' own, with generate's
    prepared arguments either way.  ``streamer`` and ``synced_gpus`` are the call's own (generate
    hands a callable neither)."""

    def decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, inputs_tensor=None,
                 **model_kwargs):
        if assisted_loop.serves(logits_processor, stopping_criteria, generation_config, synced_gpus):
            candidates = _candidates(mtp, run, generation_config, logits_processor)
            warpers = logits_processor if generation_config.do_sample else None
            return assisted_loop.decode(model, candidates, name, input_ids, stopping_criteria, streamer, warpers,
                                        **model_kwargs)
        return type(model)._assisted_decoding(
            model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus,
            streamer=streamer, inputs_tensor=inputs_tensor, assistant_model=mtp, **model_kwargs,
        )

    return decoding


def attach(mtp, target) -> None:
    patching.record(target, create=True).drafts.add(mtp)
    patching.refresh_generate(target)


def detach(mtp, target) -> None:
    rec = patching.record(target)
    if rec is None:
        return
    rec.drafts.discard(mtp)
    patching.refresh_generate(target)  # the last draft leaves: the target is exactly as before binding (unless graphed)


def _assisted_call(target, cls_generate, args, kwargs):
    """The generate handler of bound drafters: an assisted call with one of ours as ``assistant_model``."""
    assistant = kwargs.get("assistant_model")
    if getattr(getattr(assistant, "config", None), "model_type", None) != "deepseek_v4_mtp":
        return NotImplemented
    if assistant.target_model is not target:
        raise ValueError(
            "This DeepSeek-V4 MTP is not bound to the target model you generate with (it is bound to "
            f"{'no target' if assistant.target_model is None else 'a different target'}); call "
            "`mtp.bind(target)` first."
        )
    return _assisted_generate(assistant, target, cls_generate, args, kwargs)


def _get_candidate_generator(target, run):
    cls_get = type(target)._get_candidate_generator

    def get(*args, **kwargs):
        if kwargs.get("assistant_model") is not run.mtp:
            return cls_get(target, *args, **kwargs)
        return _candidates(run.mtp, run, kwargs["generation_config"], kwargs.get("logits_processor"))

    return get


def _assisted_generate(mtp, target, cls_generate, args, kwargs):
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] != 1:
        raise ValueError(
            f"MTP speculative decoding through `generate(assistant_model=...)` runs one sequence at a time "
            f"(transformers' assisted loop is batch-1), got a batch of {ids.shape[0]}. Generate each sequence "
            "separately."
        )
    k = kwargs.pop("num_assistant_tokens", None)
    k = mtp.generation_config.num_assistant_tokens if k is None else k
    auto = k == "auto"
    if auto:  # chosen per round, at most AUTO_MAX_DRAFTS (generation/draft_length.py)
        k = min(AUTO_MAX_DRAFTS, mtp.config.max_draft_tokens + 1)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"`num_assistant_tokens` must be an integer >= 1 (drafts per round) or \"auto\", got {k!r}.")
    if k - 1 > mtp.config.max_draft_tokens:
        raise ValueError(
            f"`num_assistant_tokens`={k} exceeds what the MTP cache can roll back "
            f"(config.max_draft_tokens={mtp.config.max_draft_tokens}); raise `mtp.config.max_draft_tokens`."
        )
    name = cache_kwarg(target)
    other = "past_key_values" if name == "cache" else "cache"
    cache = kwargs.pop(name, None)
    cache = kwargs.pop(other, None) if cache is None else cache
    graphs = graphed(target)
    if cache is None and graphs is not None:
        graphs.check_length(final_length(target, args, kwargs))
        cache = graphs.new_cache(k)
    elif cache is None:
        cache = RollbackDeepseekV4Cache(target.config, max_rollback=k)
    elif not isinstance(cache, (RollbackDeepseekV4Cache, GraphedTargetCache)) or cache.max_rollback < k:
        raise ValueError(
            "MTP speculative decoding needs a target cache that rolls back compressed-attention state: pass no "
            f"cache, or a `RollbackDeepseekV4Cache(config, max_rollback>={k})`."
        )
    kwargs[name] = cache
    on_graphs = isinstance(cache, GraphedTargetCache)
    run = _AssistedRun(mtp, target, k, auto, cache.graphs if on_graphs else None)
    if on_graphs and kwargs.get("custom_generate") is None:
        call = inspect.signature(cls_generate).bind_partial(target, *args, **kwargs).arguments
        kwargs["custom_generate"] = _graphed_decoding(mtp, run, name, call.get("streamer"),
                                                      bool(call.get("synced_gpus")))
    mtp.last_generation_stats = run.stats
    try:
        with patching.during(target, _is_stateful=False, _get_candidate_generator=_get_candidate_generator(target, run)):
            return cls_generate(target, *args, **kwargs)
    finally:
        run.close()


patching.register_generate_handler(_assisted_call, first=True)
