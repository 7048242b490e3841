"""Batched speculative decoding: B sequences of different lengths, one draft model (the MTP or DSpark).

transformers' assisted loop serves one sequence at a time.  :func:`speculative_generate`
runs B sequences together, each with its own acceptance and its own rollback:

* the target runs through :class:`~dsv4_mtp_hf.target_runtime.ragged.RaggedTargetForward` (per-sequence
  rollback state and positions, the attention batched over sequences with per-sequence
  state by default, token-wise work batched over all sequences), so each sequence computes
  what it computes alone -- no padding enters the target's arithmetic; it returns the outputs of
  the target layers the drafter reads, at every row;
* the drafter's part is a :class:`~.drafter.BatchDrafter` (:mod:`.mtp_batch`, :mod:`.dspark_batch`): its caches
  hold every sequence with its own length, it commits each sequence's verified rows and drafts for all live
  sequences in batched forwards, and each sequence verifies its own number of drafts;
* the round's rules are :mod:`.round`'s: acceptance (greedy, or speculative sampling per sequence), the cut at
  EOS and ``max_new_tokens``, stopping criteria on each prefix; finished sequences leave the batch.

Round bookkeeping per sequence (as in :mod:`.candidate`): with ``L`` confirmed tokens the target
has processed ``t_0..t_{L-2}``.  The target verifies ``[t_{L-1}, d_1..d_k]`` in one ragged forward with
every sequence's own ``k``, accepts ``a`` drafts and adds its own next token; its cache is cropped to
``L + a`` rows, the drafter's provisional rows are dropped and rows ``L-1..L+a-1`` committed from the
target's features.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..target_runtime.ragged import RaggedTargetForward
from . import round as rounds
from . import sampling
from . import dspark_batch, mtp_batch  # noqa: F401  (register the drafters' batch parts)
from .drafter import batch_drafter_class, session_class
from .stats import BatchGenerationStats, GenerationStats


@dataclass
class SpeculativeOutput:
    sequences: torch.LongTensor  # [B, prompt + new], prompt rows as given, new tokens right-padded
    new_tokens: list[torch.LongTensor]  # per sequence, the generated tokens only
    stats: list[GenerationStats] = field(default_factory=list)  # per sequence


def _prompts(input_ids, attention_mask) -> list[torch.Tensor]:
    if isinstance(input_ids, (list, tuple)):
        if not len(input_ids):
            raise ValueError("`input_ids` is an empty list: pass at least one prompt (a list of 1-D token id "
                             "sequences, or a [batch, seq] tensor).")
        if attention_mask is not None:
            raise ValueError("`attention_mask` goes with a padded `input_ids` tensor, not with a list of prompts.")
        out = [_token_ids(p, i) for i, p in enumerate(input_ids)]
    else:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"`input_ids` must be [batch, seq] (or a list of 1-D prompts), got "
                             f"{tuple(getattr(input_ids, 'shape', ()))}.")
        _token_ids(input_ids, None)
        if attention_mask is None:
            return [row for row in input_ids]
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"`attention_mask` {tuple(attention_mask.shape)} must match `input_ids` {tuple(input_ids.shape)}.")
        out = []
        for i, (row, mask) in enumerate(zip(input_ids, attention_mask.bool())):
            idx = mask.nonzero().flatten()
            if idx.numel() and int(idx[-1] - idx[0]) + 1 != idx.numel():
                raise ValueError(f"row {i}: the attention mask has holes; only left or right padding is supported.")
            out.append(row[idx])
    for i, p in enumerate(out):
        if p.numel() == 0:
            raise ValueError(f"prompt {i} is empty.")
    return out


def _token_ids(prompt, i) -> torch.Tensor:
    """One prompt as a 1-D long tensor; floats (which would be truncated silently) are refused."""
    t = torch.as_tensor(prompt)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{'`input_ids`' if i is None else f'prompt {i}'} must hold integer token ids, got {t.dtype}.")
    return t.to(torch.long).reshape(-1) if i is not None else t


_UNSET = object()


def _eos_ids(target, eos_token_id) -> set[int]:
    """``eos_token_id`` as ``generate`` reads it: unset -> the target's generation config; None -> no EOS."""
    eos = target.generation_config.eos_token_id if eos_token_id is _UNSET else eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple, set)) else [eos])}


class _Batch:
    """Per-sequence state of one :func:`speculative_generate` call; the drafter's part in ``batch_drafter`` (a
    :class:`~.drafter.BatchDrafter`, which reads ``tokens``, ``k``, ``auto``, ``threshold``, ``warpers``,
    ``generator``, ``prefill_chunk`` and ``stats`` from here)."""

    def __init__(self, target, drafter, prompts, k, auto, threshold, max_new_tokens, eos, prefill_chunk, warpers=None,
                 generator=None, target_attention="batched", rules=None):
        self.target, self.k, self.auto, self.threshold = target, k, auto, threshold
        self.warpers, self.generator = warpers, generator
        self.rules = rules or rounds.StopRules(None)  # stopping criteria checked on each prefix of a round
        layers = session_class(drafter).feature_layers(drafter, target.config)
        self.runner = RaggedTargetForward(target, attention=target_attention, feature_layers=layers)
        self.prompts = prompts
        self.tokens = [p.tolist() for p in prompts]
        self.new = [[] for _ in prompts]
        self.max_new, self.eos, self.prefill_chunk = max_new_tokens, eos, prefill_chunk
        self.caches = self.runner.new_caches(len(prompts), max_rollback=k)
        self.done = [False] * len(prompts)
        self.stats = BatchGenerationStats(GenerationStats(k, auto=auto) for _ in prompts)
        self.batch_drafter = batch_drafter_class(drafter)(drafter, self)

    # -- the target's tokens --------------------------------------------------------------------
    def _accept(self, i: int, tokens: list[int]) -> None:
        tokens = rounds.cut(tokens, self.eos, self.max_new - len(self.new[i]))
        stop = self.rules.first_stop(torch.tensor([self.tokens[i]]), tokens) if self.rules else None
        tokens = tokens[:stop]
        self.tokens[i] += tokens
        self.new[i] += tokens
        if tokens and (stop or tokens[-1] in self.eos or len(self.new[i]) >= self.max_new or self._timed_out(i)):
            self._finish(i)

    def _timed_out(self, i: int) -> bool:
        return bool(self.rules.per_round) and self.rules.round_over(torch.tensor([self.tokens[i]]))

    def _finish(self, i: int) -> None:
        self.done[i] = True
        if hasattr(self.caches[i], "free"):  # a slot of the batched target state
            self.caches[i].free()
        self.caches[i] = None  # the target cache of a finished sequence is released now
        self.batch_drafter.free(i)

    def verify(self, drafts: list[list[int]], dists, logits: torch.Tensor, offsets):
        """Each sequence's acceptance (:func:`.round.accept`, greedy or speculative sampling) of its drafts against
        the target's logits at its verified rows: ``[(accepted, tokens kept)]``, in one host read."""
        if self.warpers is None:  # greedy: one argmax over every verified row of the batch
            choices = logits.argmax(-1).tolist()
            out = []
            for j, d in enumerate(drafts):
                selected = choices[offsets[j] : offsets[j + 1]]
                a = rounds.accepted_prefix(d, selected)
                out.append((a, selected[: a + 1]))
            return out
        results = []
        for j, d in enumerate(drafts):
            rows = logits[offsets[j] : offsets[j + 1]][None]
            drafted = torch.tensor([d], dtype=torch.long, device=rows.device)
            q = dists[j][None] if d else None
            accepted, selected = rounds.accept(drafted, rows, q, self.warpers, self.generator)
            results.append(torch.cat([accepted.view(1), selected[0]]))
        read = torch.cat(results).tolist()
        out, at = [], 0
        for d in drafts:
            a, selected = read[at], read[at + 1 : at + 2 + len(d)]
            out.append((a, selected[: a + 1]))
            at += 2 + len(d)
        return out


@torch.no_grad()
def speculative_generate(
    target,
    drafter,
    input_ids,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 128,
    num_assistant_tokens: int | str | None = None,
    assistant_confidence_threshold: float | None = None,
    eos_token_id=_UNSET,
    pad_token_id: int | None = None,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    generator: torch.Generator | None = None,
    prefill_tokens: int = 8192,
    prefill_chunk: int = 2048,
    target_attention: str = "batched",
    stopping_criteria=None,
) -> SpeculativeOutput:
    """Speculative decoding of a batch with ``drafter`` (the MTP head or DSpark, bound to ``target``).

    ``input_ids``: a ``[B, S]`` tensor (with ``attention_mask`` for left or right padding)
    or a list of 1-D prompts.  Greedy: every sequence gets the tokens
    ``target.generate(prompt, max_new_tokens=...)`` gives it alone (up to float summation order, which
    can flip a near-tie).  ``do_sample=True``: speculative sampling per sequence (drafts drawn from the drafter's
    processed distribution, accepted with probability ``min(1, p/q)``, a rejection resampled from ``max(p - q, 0)``),
    so each sequence is distributed as ``generate(prompt, do_sample=True, temperature=, top_k=, top_p=,
    min_p=)`` -- unset values come from ``target.generation_config`` as in ``generate``; ``generator`` (on
    the drafter's device) makes a run reproducible.  ``eos_token_id``: unset, the target's; None, no EOS (as
    ``generate``).  ``num_assistant_tokens`` (default the drafter's ``generation_config``): drafts verified per
    round, an int; DSpark also takes ``"auto"`` (its default: each sequence verifies the prefix its confidences
    choose) and ``assistant_confidence_threshold`` (each sequence verifies the longest prefix whose confidences
    reach it).  ``prefill_tokens`` caps the prompt tokens one target forward takes (bounded memory).
    ``target_attention``: ``"batched"`` runs the target's attention once per layer for all sequences
    (:mod:`~dsv4_mtp_hf.target_runtime.batched_state`); ``"per_sequence"`` once per sequence through transformers'
    own attention and cache (the reference it is tested against).  ``stopping_criteria``: transformers
    ``StoppingCriteria`` (e.g. ``StopStringCriteria(tokenizer, stop_strings)``), checked per sequence on each
    prefix of a round's tokens, so each sequence ends where ``generate`` would stop it.
    ``drafter.last_generation_stats`` holds the per-sequence statistics afterwards.
    """
    warpers = None
    if do_sample:
        gc = target.generation_config
        warpers = sampling.build_warpers(*(v if v is not None else getattr(gc, n) for n, v in (
            ("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p))))
    return _decode_batch(target, drafter, input_ids, attention_mask, max_new_tokens,
                         (num_assistant_tokens, assistant_confidence_threshold), _eos_ids(target, eos_token_id),
                         pad_token_id, warpers, generator, prefill_tokens, prefill_chunk, target_attention,
                         rounds.StopRules(stopping_criteria))


def _decode_batch(target, drafter, input_ids, attention_mask, max_new_tokens, drafting, eos, pad_token_id,
                  warpers, generator, prefill_tokens, prefill_chunk, target_attention, rules) -> SpeculativeOutput:
    """:func:`speculative_generate` with its settings resolved (``warpers``: None for greedy; ``drafting``: the
    call's ``(num_assistant_tokens, assistant_confidence_threshold)``, None for the drafter's own)."""
    check_batch_drafter(drafter)
    if getattr(drafter, "target_model", None) is not target:
        raise ValueError(drafter.binding_error())
    k, auto, threshold = _drafting_settings(drafter, *drafting)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be an integer >= 1, got {max_new_tokens!r}.")
    prompts = _prompts(input_ids, attention_mask)
    vocab = target.config.vocab_size
    for i, p in enumerate(prompts):
        if int(p.min()) < 0 or int(p.max()) >= vocab:
            raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={vocab}).")
    st = _Batch(target, drafter, prompts, k, auto, threshold, max_new_tokens, eos, prefill_chunk, warpers, generator,
                target_attention, rules)
    drafter.last_generation_stats = st.stats
    for group in _prefill_groups(prompts, prefill_tokens):
        _prefill(st, group)
    while not all(st.done):
        _round(st)
    drafter.generation_finished(st.stats)
    return _output(st, input_ids, prompts, pad_token_id, target)


def _drafting_settings(drafter, num_assistant_tokens, threshold) -> tuple[int, bool, float | None]:
    """``(K, auto, threshold)`` of the call: its values, else the drafter's ``generation_config``; checked."""
    cls, gc = session_class(drafter), drafter.generation_config
    value = gc.num_assistant_tokens if num_assistant_tokens is None else num_assistant_tokens
    threshold = getattr(gc, "assistant_confidence_threshold", None) if threshold is None else threshold
    if threshold is not None and not cls.confidence_head:
        raise ValueError(f"`assistant_confidence_threshold` needs a drafter with a confidence head (DSpark); "
                         f"{type(drafter).__name__} has none. Pass `num_assistant_tokens` instead.")
    k, auto = rounds.resolve_num_drafts(value, cls.max_drafts(drafter), cls.auto_num_drafts(drafter), cls.limit_hint)
    batch_drafter_class(drafter).check_settings(drafter, auto, threshold)
    return k, auto, threshold


def check_batch_drafter(drafter) -> None:
    """Batches draft with a drafter of ours that has a batch part (:class:`~.drafter.BatchDrafter`): anything else
    is refused by name, with what serves it."""
    if drafter is None:
        raise ValueError("pass the drafter: `speculative_generate(target, drafter, prompts)` or "
                         "`generate(..., custom_generate=speculative_decoding, drafter=drafter)`.")
    if batch_drafter_class(drafter) is not None:
        return
    name = type(drafter).__name__
    if session_class(drafter) is not None:
        raise ValueError(
            f"Batched speculative decoding (speculative_generate, speculative_decoding) has no batch part for {name}; "
            "it drafts one sequence per call. Generate each prompt with "
            "`target.generate(prompt[None], assistant_model=drafter)` (batch 1).")
    raise TypeError(f"the drafter must be a DeepseekV4MtpForCausalLM or DeepseekV4DSparkForCausalLM bound to the "
                    f"target, got {name}.")


def _prefill_groups(prompts, prefill_tokens: int) -> list[list[int]]:
    """Prompts in groups of at most ``prefill_tokens`` tokens per target forward (one prompt may exceed it)."""
    groups, cur, size = [], [], 0
    for i, p in enumerate(prompts):
        if cur and size + p.numel() > prefill_tokens:
            groups.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += p.numel()
    groups.append(cur)
    return groups


def _prefill(st: _Batch, group: list[int]) -> None:
    chunks = [st.prompts[i] for i in group]
    last_rows = torch.tensor([c.numel() for c in chunks]).cumsum(0) - 1
    logits, features, offsets = st.runner(chunks, [st.caches[i] for i in group], logit_rows=last_rows)
    first = sampling.choose(st.warpers, logits, st.generator, "The target's distribution after the prompt")[0]
    for i, token in zip(group, first.tolist()):
        st._accept(i, [token])
        st.stats[i].record_round(0, 0, 1)  # the prefill's token: no drafts yet
    live = [j for j, i in enumerate(group) if not st.done[i]]
    if live:
        st.batch_drafter.advance([group[j] for j in live], [features[offsets[j] : offsets[j + 1]] for j in live])


def _round(st: _Batch) -> None:
    """One round for every unfinished sequence: drafts, one ragged verify, per-sequence acceptance and rollback."""
    seqs = [i for i, d in enumerate(st.done) if not d]
    # up to k drafts per sequence, fewer near max_new_tokens (the round also adds the target's token)
    budgets = [min(st.k, st.max_new - len(st.new[i]) - 1) for i in seqs]
    drafts, dists = st.batch_drafter.draft(seqs, budgets)
    for j, d in enumerate(drafts):  # nothing after an EOS is worth verifying
        drafts[j] = rounds.cut(d, st.eos, len(d))
        dists[j] = dists[j][: len(drafts[j])] if dists[j] is not None else None
    chunks = [torch.tensor([st.tokens[i][-1]] + d) for i, d in zip(seqs, drafts)]
    logits, features, offsets = st.runner(chunks, [st.caches[i] for i in seqs])
    st.batch_drafter.rollback(seqs)  # drop the drafts' rows; the verified ones are committed below
    caught, kept = [], []
    for j, (i, (a, tokens)) in enumerate(zip(seqs, st.verify(drafts, dists, logits, offsets))):
        before = len(st.new[i])
        st._accept(i, tokens)
        st.stats[i].record_round(len(drafts[j]), a, len(st.new[i]) - before)
        st.batch_drafter.observe(i, len(drafts[j]), a)
        if st.done[i]:
            continue
        st.caches[i].crop(len(st.tokens[i]) - 1)  # the target has processed all but the last token
        caught.append(i)
        kept.append(features[offsets[j] : offsets[j] + a + 1])
    if caught:
        st.batch_drafter.advance(caught, kept)


def _output(st: _Batch, input_ids, prompts, pad_token_id, target) -> SpeculativeOutput:
    pad = pad_token_id
    if pad is None:
        pad = target.generation_config.pad_token_id
    if pad is None:
        pad = min(st.eos) if st.eos else 0
    new = [torch.tensor(n, dtype=torch.long) for n in st.new]
    heads = list(input_ids.cpu()) if isinstance(input_ids, torch.Tensor) else [p.cpu() for p in prompts]
    rows = [torch.cat([h, n]) for h, n in zip(heads, new)]
    width = max(r.numel() for r in rows)
    sequences = torch.full((len(rows), width), int(pad), dtype=torch.long)
    for i, r in enumerate(rows):
        sequences[i, : r.numel()] = r
    return SpeculativeOutput(sequences=sequences, new_tokens=new, stats=st.stats)


def speculative_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                         streamer=None, drafter=None, mtp=None, target_attention: str = "batched",
                         num_assistant_tokens=None, assistant_confidence_threshold=None, **model_kwargs):
    """:func:`speculative_generate` as transformers' decoding loop, for
    ``target.generate(ids, attention_mask=mask, custom_generate=speculative_decoding, drafter=drafter, ...)``
    (``mtp=`` and :data:`mtp_decoding` are the names from before DSpark batched).

    ``generate`` prepares the inputs and the generation config (``max_new_tokens``, EOS, padding, ``do_sample``
    and its warpers) and hands them here; the result has ``generate``'s layout: the (padded) prompt rows, then
    each sequence's new tokens, padded with ``pad_token_id``.  ``num_assistant_tokens`` and
    ``assistant_confidence_threshold`` are read as given to ``generate`` (keywords, a passed or the target's
    generation config; unset: the drafter's own).  Stopping criteria (``stop_strings`` with ``tokenizer=``, user
    criteria) end each sequence where ``generate`` would; processors other than temperature/top-k/top-p/min-p,
    streamers and dict outputs raise.  ``drafter.last_generation_stats``: per sequence."""
    if drafter is not None and mtp is not None and drafter is not mtp:
        raise ValueError("two drafters passed: `drafter=` and `mtp=` (its former name); pass one, as `drafter=`.")
    drafter = mtp if drafter is None else drafter
    check_batch_drafter(drafter)
    if not sampling.graph_safe(logits_processor) or (logits_processor and not generation_config.do_sample):
        extra = [type(p).__name__ for p in logits_processor if type(p) not in sampling.GRAPH_SAFE_WARPERS or
                 not generation_config.do_sample]
        raise ValueError(f"batched speculative decoding applies the sampling warpers temperature/top-k/top-p/min-p "
                         f"only; remove {extra} (or use `generate(assistant_model=drafter)` one sequence at a time).")
    if streamer is not None or synced_gpus or generation_config.return_dict_in_generate:
        raise ValueError("batched speculative decoding supports no streamer, synced_gpus or return_dict_in_generate "
                         "(use `generate(assistant_model=drafter)` one sequence at a time for those).")
    new_tokens = generation_config.max_length - input_ids.shape[1]
    out = _decode_batch(
        model, drafter, input_ids, model_kwargs.get("attention_mask"), new_tokens,
        (num_assistant_tokens, assistant_confidence_threshold), _eos_ids(model, generation_config.eos_token_id),
        generation_config.pad_token_id, logits_processor if generation_config.do_sample else None, None, 8192, 2048,
        target_attention, rounds.StopRules(stopping_criteria))
    return out.sequences.to(input_ids.device)


mtp_decoding = speculative_decoding  # the name from when batches drafted with the MTP only
