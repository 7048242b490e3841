"""Batched speculative decoding: B sequences of different lengths, one MTP draft model.

transformers' assisted loop serves one sequence at a time.  :func:`speculative_generate`
runs B sequences together, each with its own acceptance and its own rollback:

* the target runs through :class:`~dsv4_mtp_hf.target_runtime.ragged.RaggedTargetForward` (per-sequence
  rollback state and positions, the attention batched over sequences with per-sequence
  state by default, token-wise work batched over all sequences), so each sequence computes
  what it computes alone -- no padding enters the target's arithmetic;
* the MTP runs on one :class:`~dsv4_mtp_hf.cache.PagedMtpKVCache` (per-sequence lengths and
  O(1) rollback); sequences that accepted different numbers of drafts catch up in one
  padded forward (``PagedMtpKVCache.ragged``), finished sequences leave the batch.

Round bookkeeping per sequence (as in :mod:`.candidate`): with ``L`` confirmed tokens the
target has processed ``t_0..t_{L-2}`` and the MTP holds rows ``0..L-2``.  The target
verifies ``[t_{L-1}, d_1..d_k]``, accepts ``a`` drafts and adds its own next token; its
cache is cropped to ``L + a`` rows, the MTP's draft rows are dropped and rows
``L-1..L+a-1`` are recomputed from the target's residual.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..target_runtime.ragged import RaggedTargetForward
from . import round as rounds
from . import sampling
from .drafter import session_class
from .mtp_session import MtpSession
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


def _head_logits(mtp, residual: torch.Tensor) -> torch.Tensor:
    """The MTP's draft logits for residual rows ``[B, 1, hc, D]`` -> ``[B, V]``."""
    return mtp.draft_logits(residual)[:, -1]


class _Batch:
    """Per-sequence state of one :func:`speculative_generate` call."""

    def __init__(self, target, mtp, prompts, k, max_new_tokens, eos, prefill_chunk, warpers=None, generator=None,
                 target_attention="batched", rules=None):
        self.target, self.mtp, self.k, self.warpers, self.generator = target, mtp, k, warpers, generator
        self.rules = rules or rounds.StopRules(None)  # stopping criteria checked on each prefix of a round
        self.runner = RaggedTargetForward(target, attention=target_attention)
        self.device = mtp.e_proj.weight.device
        self.prompts = prompts
        self.tokens = [p.tolist() for p in prompts]
        self.new = [[] for _ in prompts]
        self.max_new, self.eos, self.prefill_chunk = max_new_tokens, eos, prefill_chunk
        self.caches = self.runner.new_caches(len(prompts), max_rollback=k)
        self.mcache = mtp.new_cache(paged=True, batch_size=len(prompts))
        # Under "auto" the MTP keeps the reference attention here, as GraphedDrafter does: FlashInfer
        # plans on the host per call, and this ragged path has not been measured or checked with it on
        # a GPU.  An explicit "flashinfer" is honoured.
        self.attention_backend = "reference" if mtp.config.attention_backend == "auto" else None
        self.mtp_rows = [0] * len(prompts)  # rows in the MTP cache (host copy of seq_lengths)
        self.done = [False] * len(prompts)
        self.stats = BatchGenerationStats(GenerationStats(k) for _ in prompts)
        self.first_draft: dict[int, int] = {}  # the next round's first draft per sequence
        self.first_q: dict[int, torch.Tensor] = {}  # (sampling) the processed logits it was drawn from
        self.draft_residual: dict[int, torch.Tensor] = {}  # the MTP residual it came from

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts from logits ``[N, V]``: ``(tokens [N], processed fp32 logits)`` -- greedy, or drawn from the
        call's warped distribution (the ``q`` of speculative sampling)."""
        logits = logits.float()
        if self.warpers is None:
            return logits.argmax(-1), logits
        processed = sampling.warp(self.warpers, logits)
        probs = processed.softmax(-1)
        sampling.check_finite(probs, "The draft's distribution")
        return sampling.draw(probs, self.generator), processed

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
        self.mcache.free(i)
        self.first_draft.pop(i, None)
        self.first_q.pop(i, None)
        self.draft_residual.pop(i, None)
    # -- the MTP's rows -------------------------------------------------------------------------
    def catch_up(self, seqs: list[int], residuals: list[torch.Tensor]) -> None:
        """MTP rows ``mtp_rows[i] ..`` from the target's residual rows ``residuals[i]`` and the
        confirmed tokens after them; yields each sequence's first draft of the next round."""
        counts = [int(r.shape[0]) for r in residuals]
        width = max(counts)
        last = [None] * len(seqs)
        for a in range(0, width, self.prefill_chunk):
            b = min(a + self.prefill_chunk, width)
            ids = torch.zeros(len(seqs), b - a, dtype=torch.long)
            res = residuals[0].new_zeros(len(seqs), b - a, *residuals[0].shape[1:], device=self.device)
            num_new = []
            for j, (i, r) in enumerate(zip(seqs, residuals)):
                n = max(0, min(counts[j], b) - a)
                num_new.append(n)
                p0 = self.mtp_rows[i] + a
                ids[j, :n] = torch.tensor(self.tokens[i][p0 + 1 : p0 + 1 + n])
                res[j, :n] = r[a : a + n].to(self.device)
            start = torch.tensor([self.mtp_rows[i] + a for i in seqs], device=self.device)
            pos = start.unsqueeze(1) + torch.arange(b - a, device=self.device)
            rows = torch.tensor(seqs)
            with self.mcache.ragged(rows=rows, num_new=torch.tensor(num_new)):
                out = self.mtp(ids.to(self.device), res, position_ids=pos, past_key_values=self.mcache,
                               logits_to_keep=1, draft_vocab=True, attention_backend=self.attention_backend)
            for j, n in enumerate(num_new):
                if a < counts[j] <= b:  # this chunk holds the sequence's last row
                    last[j] = out.residual[j, counts[j] - 1 - a]
        for j, i in enumerate(seqs):
            self.mtp_rows[i] += counts[j]
        residual = torch.stack(last).unsqueeze(1)  # [S, 1, hc, D]
        drafts, q = self.choose(_head_logits(self.mtp, residual))
        drafts = drafts.tolist()
        for j, i in enumerate(seqs):
            self.first_draft[i] = drafts[j]
            self.draft_residual[i] = residual[j]
            self.first_q[i] = q[j]

    def draft(self, seqs: list[int], budgets: list[int]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Up to ``budgets[j]`` drafts per sequence: the first from the catch-up, the rest from
        batched MTP steps on the MTP's own residual (rows rolled back next round).  Greedy, or
        sampled from the processed MTP distribution, which is returned alongside (sampling)."""
        drafts = [[self.first_draft[i]] if budgets[j] else [] for j, i in enumerate(seqs)]
        dists = [[self.first_q[i]] if budgets[j] else [] for j, i in enumerate(seqs)]
        steps = max(budgets) - 1
        step_q = []
        if steps > 0:
            live = [i for j, i in enumerate(seqs) if budgets[j] > 1]
            tok = torch.tensor([[self.first_draft[i]] for i in live], device=self.device)
            res = torch.stack([self.draft_residual[i] for i in live])
            rows = torch.tensor(live)
            steps_out = []
            for s in range(steps):
                pos = torch.tensor([[self.mtp_rows[i] + s] for i in live], device=self.device)
                with self.mcache.ragged(rows=rows):
                    out = self.mtp(tok, res, position_ids=pos, past_key_values=self.mcache, draft_vocab=True,
                                   attention_backend=self.attention_backend)
                tok, q = self.choose(out.logits[:, -1])
                tok = tok.unsqueeze(-1)
                step_q.append(q)
                res = out.residual[:, -1:]
                steps_out.append(tok)
            more = torch.cat(steps_out, dim=1).tolist()  # one host read per round
            row_of = {i: r for r, i in enumerate(live)}
            for j, i in enumerate(seqs):
                if budgets[j] > 1:
                    r = row_of[i]
                    drafts[j] += more[r][: budgets[j] - 1]
                    dists[j] += [q[r] for q in step_q[: budgets[j] - 1]]
        for d, q in zip(drafts, dists):  # nothing after an EOS is worth verifying
            keep = len(rounds.cut(d, self.eos, len(d)))
            del d[keep:]
            del q[keep:]
        return drafts, dists

    def rollback_mtp(self, seqs: list[int]) -> None:
        lengths = self.mcache.seq_lengths.clone()
        for i in seqs:
            lengths[i] = self.mtp_rows[i]
        self.mcache.truncate(lengths)

    def verify(self, seqs: list[int], drafts: list[list[int]], dists, logits: torch.Tensor, offsets):
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
            q = torch.stack(dists[j])[None] if d and self.warpers is not None else None
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
    mtp,
    input_ids,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 128,
    num_assistant_tokens: int | None = None,
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
    """Speculative decoding of a batch with the MTP as the draft.

    ``input_ids``: a ``[B, S]`` tensor (with ``attention_mask`` for left or right padding)
    or a list of 1-D prompts.  Greedy: every sequence gets the tokens
    ``target.generate(prompt, max_new_tokens=...)`` gives it alone (up to float summation order, which
    can flip a near-tie).  ``do_sample=True``: speculative sampling (drafts drawn from the MTP's processed
    distribution, accepted with probability ``min(1, p/q)``, a rejection resampled from ``max(p - q, 0)``),
    so each sequence is distributed as ``generate(prompt, do_sample=True, temperature=, top_k=, top_p=,
    min_p=)`` -- unset values come from ``target.generation_config`` as in ``generate``; ``generator`` (on
    the MTP's device) makes a run reproducible.  ``eos_token_id``: unset, the target's; None, no EOS (as
    ``generate``).  ``num_assistant_tokens`` (default ``mtp.generation_config.num_assistant_tokens``)
    drafts per round; ``prefill_tokens`` caps the prompt tokens one target forward takes (bounded memory).
    ``target_attention``: ``"batched"`` runs the target's attention once per layer for all sequences
    (:mod:`~dsv4_mtp_hf.target_runtime.batched_state`); ``"per_sequence"`` once per sequence through transformers'
    own attention and cache (the reference it is tested against).  ``stopping_criteria``: transformers
    ``StoppingCriteria`` (e.g. ``StopStringCriteria(tokenizer, stop_strings)``), checked per sequence on each
    prefix of a round's tokens, so each sequence ends where ``generate`` would stop it.
    ``mtp.last_generation_stats`` holds the per-sequence statistics afterwards.
    """
    warpers = None
    if do_sample:
        gc = target.generation_config
        warpers = sampling.build_warpers(*(v if v is not None else getattr(gc, n) for n, v in (
            ("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p))))
    return _decode_batch(target, mtp, input_ids, attention_mask, max_new_tokens, num_assistant_tokens,
                         _eos_ids(target, eos_token_id), pad_token_id, warpers, generator, prefill_tokens,
                         prefill_chunk, target_attention, rounds.StopRules(stopping_criteria))


def _decode_batch(target, mtp, input_ids, attention_mask, max_new_tokens, num_assistant_tokens, eos, pad_token_id,
                  warpers, generator, prefill_tokens, prefill_chunk, target_attention, rules) -> SpeculativeOutput:
    """:func:`speculative_generate` with its settings resolved (``warpers``: None for greedy)."""
    check_batch_drafter(mtp)
    if getattr(mtp, "target_model", None) is not target:
        raise ValueError(mtp.binding_error())
    value = mtp.generation_config.num_assistant_tokens if num_assistant_tokens is None else num_assistant_tokens
    if value == rounds.AUTO:
        raise ValueError("batches draft a fixed number of tokens per round: pass `num_assistant_tokens` as an int.")
    k, _ = rounds.resolve_num_drafts(value, MtpSession.max_drafts(mtp), MtpSession.auto_num_drafts(mtp),
                                  MtpSession.limit_hint)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be an integer >= 1, got {max_new_tokens!r}.")
    prompts = _prompts(input_ids, attention_mask)
    vocab = target.config.vocab_size
    for i, p in enumerate(prompts):
        if int(p.min()) < 0 or int(p.max()) >= vocab:
            raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={vocab}).")
    st = _Batch(target, mtp, prompts, k, max_new_tokens, eos, prefill_chunk, warpers, generator, target_attention,
                rules)
    mtp.last_generation_stats = st.stats
    for group in _prefill_groups(prompts, prefill_tokens):
        _prefill(st, group)
    while not all(st.done):
        _round(st)
    mtp.generation_finished(st.stats)
    return _output(st, input_ids, prompts, pad_token_id, target)


def check_batch_drafter(mtp) -> None:
    """Batches draft with the MTP head only (design §7b): any other drafter is refused by name, with what serves it."""
    if mtp is None:
        raise ValueError("pass the draft: `speculative_generate(target, mtp, prompts)` or "
                         "`generate(..., custom_generate=mtp_decoding, mtp=mtp)`.")
    if session_class(mtp) is MtpSession:
        return
    name = type(mtp).__name__
    if session_class(mtp) is not None:
        raise ValueError(
            "Batched speculative decoding (speculative_generate, mtp_decoding) drafts with the MTP head "
            f"(DeepseekV4MtpForCausalLM) only; {name} drafts one sequence per call. Generate each prompt with "
            "`target.generate(prompt[None], assistant_model=drafter)` (batch 1), or load the MTP head of a "
            "preview release (deepseek-ai/DeepSeek-V4-Flash, -Pro) for batches.")
    raise TypeError(f"the draft must be a DeepseekV4MtpForCausalLM bound to the target, got {name}.")


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
    logits, residual, offsets = st.runner(chunks, [st.caches[i] for i in group], logit_rows=last_rows)
    first = st.choose(logits)[0].tolist()
    for j, i in enumerate(group):
        st._accept(i, [first[j]])
        st.stats[i].record_round(0, 0, 1)  # the prefill's token: no drafts yet
    live = [j for j, i in enumerate(group) if not st.done[i]]
    if live:
        st.catch_up([group[j] for j in live], [residual[offsets[j] : offsets[j + 1]] for j in live])


def _round(st: _Batch) -> None:
    """One round for every unfinished sequence: drafts, one ragged verify, per-sequence acceptance and rollback."""
    seqs = [i for i, d in enumerate(st.done) if not d]
    # k drafts per sequence, fewer near max_new_tokens (the round also adds the target's token).
    budgets = [min(st.k, st.max_new - len(st.new[i]) - 1) for i in seqs]
    drafts, dists = st.draft(seqs, budgets)
    chunks = [torch.tensor([st.tokens[i][-1]] + d) for i, d in zip(seqs, drafts)]
    logits, residual, offsets = st.runner(chunks, [st.caches[i] for i in seqs])
    st.rollback_mtp(seqs)  # drop the draft rows; the verified ones are recomputed below
    caught, caught_res = [], []
    for j, (i, (a, tokens)) in enumerate(zip(seqs, st.verify(seqs, drafts, dists, logits, offsets))):
        before = len(st.new[i])
        st._accept(i, tokens)
        st.stats[i].record_round(len(drafts[j]), a, len(st.new[i]) - before)
        if st.done[i]:
            continue
        st.caches[i].crop(len(st.tokens[i]) - 1)  # the target has processed all but the last token
        caught.append(i)
        caught_res.append(residual[offsets[j] : offsets[j] + a + 1])
    if caught:
        st.catch_up(caught, caught_res)


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


def mtp_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                 streamer=None, mtp=None, target_attention: str = "batched", **model_kwargs):
    """:func:`speculative_generate` as transformers' decoding loop, for
    ``target.generate(ids, attention_mask=mask, custom_generate=mtp_decoding, mtp=mtp, ...)``.

    ``generate`` prepares the inputs and the generation config (``max_new_tokens``, EOS, padding,
    ``num_assistant_tokens``, ``do_sample`` and its warpers) and hands them here; the result has
    ``generate``'s layout: the (padded) prompt rows, then each sequence's new tokens, padded with
    ``pad_token_id``.  Stopping criteria (``stop_strings`` with ``tokenizer=``, user criteria) end each
    sequence where ``generate`` would; processors other than temperature/top-k/top-p/min-p, streamers and dict
    outputs raise.  ``mtp.last_generation_stats``: per sequence."""
    check_batch_drafter(mtp)
    if not sampling.graph_safe(logits_processor) or (logits_processor and not generation_config.do_sample):
        extra = [type(p).__name__ for p in logits_processor if type(p) not in sampling.GRAPH_SAFE_WARPERS or
                 not generation_config.do_sample]
        raise ValueError(f"MTP batched decoding applies the sampling warpers temperature/top-k/top-p/min-p only; "
                         f"remove {extra} (or use `generate(assistant_model=mtp)` one sequence at a time).")
    if streamer is not None or synced_gpus or generation_config.return_dict_in_generate:
        raise ValueError("MTP batched decoding supports no streamer, synced_gpus or return_dict_in_generate.")
    out = _decode_batch(
        model, mtp, input_ids, model_kwargs.get("attention_mask"), generation_config.max_length - input_ids.shape[1],
        _passed_num_assistant_tokens(model, generation_config), _eos_ids(model, generation_config.eos_token_id),
        generation_config.pad_token_id, logits_processor if generation_config.do_sample else None, None, 8192, 2048,
        target_attention, rounds.StopRules(stopping_criteria))
    return out.sequences.to(input_ids.device)


def _passed_num_assistant_tokens(model, generation_config):
    """``num_assistant_tokens`` as given to ``generate`` (or set on the target's generation config), else None: the
    drafter's own.  ``generate`` fills an unset value with transformers' global default (20), which is no choice
    of the drafter's and may exceed what it rolls back."""
    value = generation_config.num_assistant_tokens
    if model.generation_config.num_assistant_tokens is None and \
            value == model.generation_config._get_default_generation_params().get("num_assistant_tokens"):
        return None
    return value
