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

import functools
import inspect
import weakref

import torch

from . import assisted_loop
from .candidate import MtpCandidateGenerator
from .draft_length import AUTO_MAX_DRAFTS
from .stats import GenerationStats
from .target_cache import RollbackDeepseekV4Cache
from .target_graph import GraphedTargetCache

_INSTANCE_ATTRS = ("generate", "_get_candidate_generator")


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


def _input_ids(args, kwargs):
    for value in (args[0] if args else None, kwargs.get("input_ids"), kwargs.get("inputs")):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _one_sequence(target, args, kwargs) -> bool:
    """A cached generation of exactly one sequence by transformers' own loop (what a graphed target's step
    runs); batches, beams, several returned sequences and custom decoding loops keep their own caches."""
    if kwargs.get("custom_generate") is not None:
        return False
    ids = _input_ids(args, kwargs)
    config = kwargs.get("generation_config") or target.generation_config
    one = {k: kwargs.get(k, getattr(config, k, None)) for k in ("num_beams", "num_return_sequences", "use_cache")}
    return (ids is not None and ids.dim() == 2 and ids.shape[0] == 1 and (one["num_beams"] or 1) == 1
            and (one["num_return_sequences"] or 1) == 1 and one["use_cache"] is not False)


def _final_length(target, args, kwargs) -> int:
    """The most tokens the call may reach (prompt + ``max_new_tokens``, else ``max_length``)."""
    config = kwargs.get("generation_config") or target.generation_config
    new = kwargs.get("max_new_tokens", None if "max_length" in kwargs else config.max_new_tokens)
    if new is not None:
        return _input_ids(args, kwargs).shape[1] + int(new)
    return int(kwargs.get("max_length", config.max_length))


def _cache_kwarg(target) -> str:
    """transformers >= 5.24 calls the cache `cache`; 5.17 calls it `past_key_values`."""
    return "cache" if "cache" in inspect.signature(type(target).forward).parameters else "past_key_values"


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
    drafts = target.__dict__.get("_dsv4_mtp_drafts")
    if drafts is not None:  # another draft may share this target
        drafts.add(mtp)
        return
    target._dsv4_mtp_drafts = weakref.WeakSet([mtp])
    ensure_wrapped(target)


def ensure_wrapped(target) -> None:
    """The per-instance ``generate`` / ``_get_candidate_generator`` that bound drafts and a graphed
    target (:mod:`.target_graph`) both rely on; installed once, removed by :func:`release_wrapper`."""
    if "_dsv4_wrapped" in target.__dict__:
        return
    cls_generate = type(target).generate
    cls_get_candidate_generator = type(target)._get_candidate_generator

    @functools.wraps(cls_generate)
    def generate(*args, **kwargs):
        assistant = kwargs.get("assistant_model")
        if getattr(getattr(assistant, "config", None), "model_type", None) == "deepseek_v4_mtp":
            if assistant.target_model is not target:
                raise ValueError(
                    "This DeepSeek-V4 MTP is not bound to the target model you generate with (it is bound to "
                    f"{'no target' if assistant.target_model is None else 'a different target'}); call "
                    "`mtp.bind(target)` first."
                )
            return _assisted_generate(assistant, target, cls_generate, args, kwargs)
        graphs = target.__dict__.get("_dsv4_target_graphs")
        if graphs is not None and assistant is None and _one_sequence(target, args, kwargs):
            name = _cache_kwarg(target)
            if kwargs.get(name) is None and kwargs.get("past_key_values") is None:
                graphs.check_length(_final_length(target, args, kwargs))
                kwargs[name] = graphs.new_cache()  # plain generate on the graphed step
        return cls_generate(target, *args, **kwargs)

    def _get_candidate_generator(*args, **kwargs):
        assistant = kwargs.get("assistant_model")
        run = getattr(assistant, "_active_run", None)
        if run is None or run.target is not target:
            return cls_get_candidate_generator(target, *args, **kwargs)
        return _candidates(assistant, run, kwargs["generation_config"], kwargs.get("logits_processor"))

    target.generate = generate
    target._get_candidate_generator = _get_candidate_generator
    target._dsv4_wrapped = True


def release_wrapper(target) -> None:
    """Remove the per-instance wrapper once no draft is bound and the target is not graphed."""
    if target.__dict__.get("_dsv4_mtp_drafts") or "_dsv4_target_graphs" in target.__dict__:
        return
    for name in _INSTANCE_ATTRS + ("_dsv4_mtp_drafts", "_dsv4_wrapped"):
        target.__dict__.pop(name, None)


def detach(mtp, target) -> None:
    drafts = target.__dict__.get("_dsv4_mtp_drafts")
    if drafts is None:
        return
    drafts.discard(mtp)
    release_wrapper(target)  # the last draft leaves: the target is exactly as before binding (unless graphed)


def _assisted_generate(mtp, target, cls_generate, args, kwargs):
    ids = _input_ids(args, kwargs)
    if ids is not None and ids.dim() == 2 and ids.shape[0] != 1:
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
    name = _cache_kwarg(target)
    other = "past_key_values" if name == "cache" else "cache"
    cache = kwargs.pop(name, None)
    cache = kwargs.pop(other, None) if cache is None else cache
    graphs = target.__dict__.get("_dsv4_target_graphs")
    if cache is None and graphs is not None:
        graphs.check_length(_final_length(target, args, kwargs))
        cache = graphs.new_cache(k)
    elif cache is None:
        cache = RollbackDeepseekV4Cache(target.config, max_rollback=k)
    elif not isinstance(cache, (RollbackDeepseekV4Cache, GraphedTargetCache)) or cache.max_rollback < k:
        raise ValueError(
            "MTP speculative decoding needs a target cache that rolls back compressed-attention state: pass no "
            f"cache, or a `RollbackDeepseekV4Cache(config, max_rollback>={k})`."
        )
    kwargs[name] = cache
    graphed = isinstance(cache, GraphedTargetCache)
    run = _AssistedRun(mtp, target, k, auto, cache.graphs if graphed else None)
    if graphed and kwargs.get("custom_generate") is None:
        call = inspect.signature(cls_generate).bind_partial(target, *args, **kwargs).arguments
        kwargs["custom_generate"] = _graphed_decoding(mtp, run, name, call.get("streamer"),
                                                      bool(call.get("synced_gpus")))
    mtp.last_generation_stats = run.stats
    mtp._active_run = run
    target._is_stateful = False  # instance attribute: this call only
    try:
        return cls_generate(target, *args, **kwargs)
    finally:
        run.close()
        mtp._active_run = None
        target.__dict__.pop("_is_stateful", None)
