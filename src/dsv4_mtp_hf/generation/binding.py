"""Binding a drafter to a transformers ``DeepseekV4ForCausalLM`` target, and its assisted ``generate`` calls.

transformers refuses assisted generation for V4 (``_is_stateful``) and only builds its own candidate
generators.  Binding changes nothing process-wide: :mod:`dsv4_mtp_hf.patching` gives the ONE target object a
``generate`` wrapper, and :func:`_assisted_call` (registered there) serves the calls whose
``assistant_model`` is one of our drafters (or ``use_mtp=True`` with one bound).  Only inside such a call
does the target get ``_is_stateful = False``, our candidate generator, a rollback-able cache and a feature
tap on the layers the drafter reads.  ``unbind()`` removes all of it.

What a call checks before it runs (each refusal names the fix): one sequence (batches: the batched API),
one beam, a left-padded mask (the pads are stripped, as the batched path does, and put back on the output),
transformers settings this path does not honour, and a cache handed in: empty, or holding a prefix of the
input that an earlier call with this drafter left (multi-turn; the drafter resumes from its state then).
On a graphed target the call decodes through our loop (:mod:`.assisted_loop`) where it serves the call, else
through transformers' loop (:mod:`.transformers_loop`); both end a round where any stopping criterion fires.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
from transformers.utils import logging as hf_logging

from .. import patching
from ..compat import cache_kwarg
from ..target_runtime.features import FeatureTap
from ..target_runtime.graph import GraphedTargetCache, final_length, graphed
from ..target_runtime.rollback_cache import RollbackDeepseekV4Cache
from . import assisted_loop, dspark_session, mtp_session, speculative, transformers_loop  # noqa: F401
from . import round as rounds
from .candidate import DraftCandidateGenerator
from .drafter import session_class
from .stats import GenerationStats

logger = hf_logging.get_logger(__name__)

# transformers settings that choose other candidate generators or schedules: refused, with what to use instead.
REFUSED = {
    "num_assistant_tokens_schedule": "our drafters choose K per round with `num_assistant_tokens=\"auto\"`",
    "prompt_lookup_num_tokens": "prompt lookup and a drafter are two candidate generators: pass one of them",
    "assistant_early_exit": "early exit drafts with the target's own layers: pass it without `assistant_model`",
    "assistant_lookbehind": "it aligns two tokenizers; the drafter shares the target's",
    "target_lookbehind": "it aligns two tokenizers; the drafter shares the target's",
    "prefill_chunk_size": "the assisted prefill runs whole (a graphed target already replays it in chunks)",
}


def attach(drafter, target) -> None:
    """Bind ``drafter`` to ``target``.  An earlier copy of the same checkpoint's drafter bound there is unbound (with
    a warning): loading a release again with ``target_model=`` (a notebook cell run twice) must not leave several
    copies bound, which ``use_mtp=True`` could not choose between."""
    rec = patching.record(target)
    earlier = [d for d in (rec.drafts if rec is not None else ()) if d is not drafter and _same_checkpoint(d, drafter)]
    for old in earlier:
        old.unbind()
        old._unbound_note = (f"a later copy of it, loaded from {drafter.name_or_path}, was bound to its target in "
                             "its place")
        logger.warning(f"Unbound an earlier {type(old).__name__} loaded from {drafter.name_or_path} from this target: "
                       "a target keeps one copy of a checkpoint's drafter bound, the latest. `old.bind(target)` "
                       "binds that copy again (and unbinds this one).")
    patching.record(target, create=True).drafts.add(drafter)  # a fresh record if the last unbind dropped it
    patching.refresh_generate(target)


def _same_checkpoint(a, b) -> bool:
    return type(a) is type(b) and bool(a.name_or_path) and a.name_or_path == b.name_or_path


def detach(drafter, target) -> None:
    rec = patching.record(target)
    if rec is None:
        return
    rec.drafts.discard(drafter)
    patching.refresh_generate(target)  # the last drafter leaves: the target is as before binding (unless graphed)


@dataclass
class DraftState:
    """What an assisted call leaves on the target's cache for the next call with it (multi-turn): the drafter,
    the tokens the cache holds, the drafter's session snapshot."""

    drafter: object
    tokens: torch.Tensor  # [1, cache length]
    snapshot: dict


class AssistedCall:
    """One assisted ``generate`` call: the drafter and its session, K, the feature source, the statistics."""

    def __init__(self, drafter, target, num_drafts: int, auto: bool, graphs=None, resume: DraftState | None = None,
                 confidence_threshold: float | None = None):
        self.drafter, self.target, self.num_drafts, self.auto = drafter, target, num_drafts, auto
        self.confidence_threshold = confidence_threshold
        self.session_class = session_class(drafter)
        layers = self.session_class.feature_layers(drafter, target.config)
        self.stats = GenerationStats(num_drafts, auto=auto)
        self.session = self.generator = None
        self.resume = resume
        self._tap = None
        if graphs is not None:  # a graphed target writes the layers' outputs from its graphs
            graphs.tap(layers)
            self._take = graphs.take_features
        else:
            self._tap = FeatureTap(target, layers)
            self._take = self._tap.take

    def start_session(self, regime: str, warpers):
        self.session = self.session_class(self.drafter, self.num_drafts, regime, warpers)
        if self.resume is not None:
            self.session.restore(self.resume.snapshot)
        return self.session

    def take_features(self) -> torch.Tensor | None:
        return self._take()

    def candidates(self, generation_config, logits_processor) -> DraftCandidateGenerator:
        self.generator = DraftCandidateGenerator(self, generation_config, logits_processor)
        return self.generator

    def leave_state(self, cache, sequences: torch.Tensor) -> None:
        """After the call: what the next call on ``cache`` resumes from (the rows the target processed last)."""
        length = cache.get_seq_length()
        if self.session is None or length == 0:
            cache.draft_state = None
            return
        self.session.hold(self.take_features(), processed=length)
        cache.draft_state = DraftState(self.drafter, sequences[:1, :length].clone(), self.session.snapshot())

    def close(self) -> None:
        if self._tap is not None:
            self._tap.close()


def _decoding(call, name, streamer, synced_gpus):
    """The ``custom_generate`` callable of an assisted call: our loop (:mod:`.assisted_loop`, on a graphed target)
    where it serves the call, else transformers' own (:mod:`.transformers_loop`), with generate's prepared
    arguments either way and the call's stopping criteria honoured inside each round.  ``streamer`` and
    ``synced_gpus`` are the call's own (generate hands a callable neither)."""

    def decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, inputs_tensor=None,
                 **model_kwargs):
        on_graphs = isinstance(model_kwargs.get(name), GraphedTargetCache)
        if on_graphs and assisted_loop.serves(logits_processor, stopping_criteria, generation_config, synced_gpus):
            candidates = call.candidates(generation_config, logits_processor)
            warpers = logits_processor if generation_config.do_sample else None
            return assisted_loop.decode(model, candidates, name, input_ids, stopping_criteria, streamer, warpers,
                                        **model_kwargs)
        return transformers_loop.decode(model, call, name, input_ids, logits_processor, stopping_criteria,
                                        generation_config, synced_gpus, streamer, inputs_tensor, **model_kwargs)

    return decoding


def _candidate_generator(target, call):
    cls_get = type(target)._get_candidate_generator

    def get(*args, **kwargs):
        if kwargs.get("assistant_model") is not call.drafter:
            return cls_get(target, *args, **kwargs)
        return call.candidates(kwargs["generation_config"], kwargs.get("logits_processor"))

    return get


def _prefill_uncached(target):
    """transformers' assisted loop forwards the whole input on its first iteration, even onto a cache holding a
    prefix of it (multi-turn): slice the input to what the cache does not hold, as plain ``generate`` does."""
    cls_prepare = type(target).prepare_inputs_for_generation

    def prepare(input_ids, *args, next_sequence_length=None, is_first_iteration=False, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if is_first_iteration and next_sequence_length is None and cache is not None and cache.get_seq_length():
            next_sequence_length = input_ids.shape[1] - cache.get_seq_length()
        return cls_prepare(target, input_ids, *args, next_sequence_length=next_sequence_length,
                           is_first_iteration=is_first_iteration, **kwargs)

    return prepare


def _assisted_call(target, cls_generate, args, kwargs):
    """The generate handler of bound drafters: an assisted call with one of ours as ``assistant_model``."""
    drafter = _drafter_of_call(target, kwargs)
    if drafter is None:
        return NotImplemented
    if drafter.target_model is not target:
        raise ValueError(drafter.binding_error())
    kwargs = _as_keywords(cls_generate, target, args, kwargs)
    ids, pads = _unpadded(kwargs)
    _check_settings(target, drafter, ids, kwargs)
    return _repad(_assisted_generate(drafter, target, cls_generate, kwargs, ids), pads)


def _drafter_of_call(target, kwargs):
    """The call's drafter of ours (``assistant_model``, or the bound one for ``use_mtp=True``), else None."""
    assistant = kwargs.get("assistant_model")
    if kwargs.get("use_mtp") and assistant is None:
        rec = patching.record(target)
        bound = [d for d in (rec.drafts if rec is not None else ()) if session_class(d) is not None]
        if not bound:
            raise ValueError("`use_mtp=True` drafts with the drafter bound to this target, and none is: load one with "
                             "`load_drafter(repo, target_model=target)` or call `drafter.bind(target)` (or pass "
                             "`assistant_model=drafter`).")
        if len(bound) > 1:
            names = ", ".join(sorted(f"{type(d).__name__} ({d.name_or_path or 'built from a config'})" for d in bound))
            raise ValueError(f"`use_mtp=True` drafts with the drafter bound to this target, and {len(bound)} are "
                             f"bound: {names}. Pass `assistant_model=drafter` to choose one, or `unbind()` the "
                             "others.")
        kwargs.pop("use_mtp")
        kwargs["assistant_model"] = assistant = bound[0]
    if session_class(assistant) is None:
        return None
    kwargs.pop("use_mtp", None)
    return assistant


def _unpadded(kwargs: dict):
    """The call's input without left padding: ``(input_ids [1, L], pads [1, P] or None)``.  A batch-1
    attention mask with leading zeros is stripped with its tokens (the output gets them back in front): the
    answer is then plain ``generate``'s for the unpadded prompt, as in the batched path.  Holes or right
    padding are refused."""
    ids = kwargs.get("inputs", kwargs.get("input_ids"))
    mask = kwargs.get("attention_mask")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("assisted generation with our drafters takes `input_ids` as a [1, seq] tensor of token ids.")
    if ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"`input_ids` must be integer token ids, got a {ids.dtype} tensor.")
    if mask is None or ids.shape[0] != 1 or bool(mask.bool().all()):
        return ids, None
    keep = mask[0].bool()
    first = int(keep.nonzero()[0]) if keep.any() else ids.shape[1]
    if first == ids.shape[1] or not bool(keep[first:].all()):
        raise ValueError("the attention mask has holes or right padding; assisted generation takes a left-padded "
                         "(or unpadded) prompt. Strip the padding, or use "
                         "`dsv4_mtp_hf.generation.speculative_generate` for padded batches.")
    stripped = ids[:, first:]
    for name in ("input_ids", "inputs"):
        if isinstance(kwargs.get(name), torch.Tensor):
            kwargs[name] = stripped
    kwargs["attention_mask"] = mask[:, first:]
    return stripped, ids[:, :first]


def _repad(out, pads):
    if pads is None:
        return out
    if isinstance(out, torch.Tensor):
        return torch.cat([pads.to(out.device), out], dim=1)
    out.sequences = torch.cat([pads.to(out.sequences.device), out.sequences], dim=1)
    return out


def _setting(target, kwargs: dict, name: str):
    """A generation setting as this call sees it: its keyword, else the passed or the target's config."""
    if name in kwargs:
        return kwargs[name]
    config = kwargs.get("generation_config") or target.generation_config
    return getattr(config, name, None)


def _draft_setting(target, drafter, kwargs: dict, name: str):
    """A drafting setting (``num_assistant_tokens``, ``assistant_confidence_threshold``): the call's keyword or
    generation config (passed, else the target's), else the drafter's ``generation_config``, where transformers
    reads an assistant's drafting settings."""
    value = _setting(target, kwargs, name)
    return getattr(drafter.generation_config, name, None) if value is None else value


def _check_settings(target, drafter, ids: torch.Tensor, kwargs: dict) -> None:
    """Refuse what this path cannot honour, naming what to use instead."""
    if ids.shape[0] != 1:
        raise ValueError(
            f"assisted generation with a drafter runs one sequence per `generate` call (transformers' assisted loop "
            f"is batch-1), got a batch of {ids.shape[0]}. For batches use "
            "`dsv4_mtp_hf.generation.speculative_generate(target, drafter, prompts)` or "
            "`target.generate(ids, attention_mask=mask, custom_generate=speculative_decoding, drafter=drafter)`.")
    for name in ("num_beams", "num_return_sequences"):
        value = _setting(target, kwargs, name)
        if value is not None and value > 1:
            raise ValueError(f"`{name}={value}`: speculative decoding verifies one greedy or sampled continuation; "
                             f"set {name}=1 (or generate without `assistant_model` for beam search).")
    for name, instead in REFUSED.items():
        if _setting(target, kwargs, name) is not None:
            raise ValueError(f"`{name}` is not honoured with {type(drafter).__name__}: {instead}.")
    threshold = _draft_setting(target, drafter, kwargs, "assistant_confidence_threshold")
    if threshold is not None and not getattr(session_class(drafter), "confidence_head", False):
        raise ValueError(f"`assistant_confidence_threshold` needs a drafter with a confidence head (DSpark); "
                         f"{type(drafter).__name__} has none. Use `num_assistant_tokens=\"auto\"`.")


def _assisted_generate(drafter, target, cls_generate, kwargs, ids):
    cls = session_class(drafter)
    value = _draft_setting(target, drafter, kwargs, "num_assistant_tokens")
    kwargs.pop("num_assistant_tokens", None)
    num_drafts, auto = rounds.resolve_num_drafts(value, cls.max_drafts(drafter), cls.auto_num_drafts(drafter),
                                                cls.limit_hint)
    name = cache_kwarg(target)
    cache = kwargs.pop(name, None)
    other = kwargs.pop("past_key_values" if name == "cache" else "cache", None)
    cache = other if cache is None else cache
    cache, resume = _call_cache(target, cache, num_drafts, drafter, ids, kwargs)
    kwargs[name] = cache
    on_graphs = isinstance(cache, GraphedTargetCache)
    threshold = _draft_setting(target, drafter, kwargs, "assistant_confidence_threshold")
    call = AssistedCall(drafter, target, num_drafts, auto, cache.graphs if on_graphs else None, resume, threshold)
    if kwargs.get("custom_generate") is None:
        _stop_strings_as_criteria(target, kwargs)
        kwargs["custom_generate"] = _decoding(call, name, kwargs.get("streamer"), bool(kwargs.get("synced_gpus")))
    drafter.last_generation_stats = call.stats
    patches = dict(_is_stateful=False, _get_candidate_generator=_candidate_generator(target, call),
                   prepare_inputs_for_generation=_prefill_uncached(target))
    try:
        with patching.during(target, **patches):
            out = cls_generate(target, **kwargs)
        call.leave_state(cache, out if isinstance(out, torch.Tensor) else out.sequences)
        drafter.generation_finished(call.stats)
        return out
    finally:
        call.close()


def _stop_strings_as_criteria(target, kwargs: dict) -> None:
    """``stop_strings`` built into the call's stopping criteria here: ``generate`` hands a ``custom_generate``
    callable no tokenizer, so it could not build them itself (it would refuse the call)."""
    strings = _setting(target, kwargs, "stop_strings")
    if strings is None:
        return
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError("`stop_strings` needs the model's tokenizer: pass `tokenizer=` to `generate` as well.")
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=strings))
    kwargs["stopping_criteria"], kwargs["stop_strings"] = criteria, None


def _call_cache(target, cache, num_drafts: int, drafter, ids, kwargs):
    """The target cache of the call and the drafter state to resume from: a new rollback-able cache (graphed on
    a graphed target), or the caller's, empty or holding a prefix of ``ids`` an earlier call with this drafter
    left (multi-turn)."""
    graphs = graphed(target)
    if cache is None:
        if graphs is not None:
            graphs.check_length(final_length(target, (), {**kwargs, "inputs": ids}))
            return graphs.new_cache(num_drafts), None
        return RollbackDeepseekV4Cache(target.config, max_rollback=num_drafts), None
    if not isinstance(cache, (RollbackDeepseekV4Cache, GraphedTargetCache)) or cache.max_rollback < num_drafts:
        raise ValueError(
            "speculative decoding needs a target cache that rolls back compressed-attention state: pass no "
            f"cache, or a `RollbackDeepseekV4Cache(config, max_rollback>={num_drafts})`.")
    length = cache.get_seq_length()
    if length == 0:
        return cache, None
    state = getattr(cache, "draft_state", None)
    if state is None or state.drafter is not drafter or state.tokens.shape[1] != length:
        raise ValueError(
            f"this cache holds {length} tokens that {type(drafter).__name__} did not see the target process (a plain "
            "`generate`, a forward or another drafter filled it), so the drafter has no context for them. Pass a "
            "fresh cache (or none), or generate every turn with this `assistant_model`.")
    if ids.shape[1] <= length or not torch.equal(state.tokens.to(ids.device), ids[:, :length]):
        raise ValueError(
            f"this cache holds {length} tokens that are not a prefix of `input_ids` (another conversation, or an "
            "edited one): pass a fresh cache (or none), or the whole conversation so far as `input_ids`.")
    return cache, state


def _as_keywords(cls_generate, target, args, kwargs) -> dict:
    """The call's arguments by keyword (positional ones named by ``generate``'s signature)."""
    if not args:
        return dict(kwargs)
    bound = inspect.signature(cls_generate).bind_partial(target, *args, **kwargs).arguments
    bound.pop("self", None)
    extra = bound.pop("kwargs", {})
    return {**bound, **extra}


def _batched_call(target, cls_generate, args, kwargs):
    """``generate(custom_generate=speculative_decoding, ...)`` (or ``mtp_decoding``): its ``stop_strings`` built
    into criteria and its drafting settings read here, since ``generate`` hands a ``custom_generate`` callable no
    tokenizer, and a generation config with transformers' defaults filled in (an unset ``num_assistant_tokens``
    reads 20, ``assistant_confidence_threshold`` 0.4: no choice of the drafter's)."""
    if kwargs.get("custom_generate") not in (speculative.speculative_decoding, speculative.mtp_decoding):
        return NotImplemented
    kwargs = _as_keywords(cls_generate, target, args, kwargs)
    _stop_strings_as_criteria(target, kwargs)
    for name in ("num_assistant_tokens", "assistant_confidence_threshold"):
        kwargs[name] = _setting(target, kwargs, name)  # None: the drafter's own
    return cls_generate(target, **kwargs)


patching.register_generate_handler(_assisted_call, first=True)
patching.register_generate_handler(_batched_call)
