"""Batched speculative decoding: B sequences of different lengths, one MTP draft model.

transformers' assisted loop serves one sequence at a time.  :func:`speculative_generate`
runs B sequences together, each with its own acceptance and its own rollback:

* the target runs through :class:`~.ragged_target.RaggedTargetForward` (per-sequence
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

from . import sampling
from ..target.ragged import RaggedTargetForward
from .stats import GenerationStats


@dataclass
class SpeculativeOutput:
    sequences: torch.LongTensor  # [B, prompt + new], prompt rows as given, new tokens right-padded
    new_tokens: list[torch.LongTensor]  # per sequence, the generated tokens only
    stats: list[GenerationStats] = field(default_factory=list)  # per sequence


def _prompts(input_ids, attention_mask) -> list[torch.Tensor]:
    if isinstance(input_ids, (list, tuple)):
        out = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in input_ids]
        if attention_mask is not None:
            raise ValueError("`attention_mask` goes with a padded `input_ids` tensor, not with a list of prompts.")
    else:
        if input_ids.dim() != 2:
            raise ValueError(f"`input_ids` must be [batch, seq] (or a list of 1-D prompts), got {tuple(input_ids.shape)}.")
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


def _eos_ids(target, eos_token_id) -> set[int]:
    eos = target.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple, set)) else [eos])}


def _head_logits(mtp, residual: torch.Tensor) -> torch.Tensor:
    """The MTP's draft logits for residual rows ``[B, 1, hc, D]`` -> ``[B, V]``."""
    h = mtp.norm(mtp.hc_head(residual))
    return mtp._lm_logits(h, mtp._require_bound().lm_head, draft_vocab=True)[:, -1]


class _Sampler:
    """The distribution ``generate(do_sample=True, temperature, top_k, top_p)`` samples from,
    applied alike to draft and target logits (what makes speculative sampling exact)."""

    def __init__(self, temperature, top_k, top_p, generator):
        from transformers.generation.logits_process import (
            LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
        )

        self.warpers = LogitsProcessorList()
        if temperature is not None and temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k is not None and top_k != 0:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))
        self.generator = generator

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[N, V]`` logits -> ``[N, V]`` probabilities."""
        scores = logits.float()
        if self.warpers:
            scores = self.warpers(torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device), scores)
        return scores.softmax(dim=-1)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def uniform(self, n: int, device) -> torch.Tensor:
        return torch.rand(n, generator=self.generator, device=device)


class _Batch:
    """Per-sequence state of one :func:`speculative_generate` call."""

    def __init__(self, target, mtp, prompts, k, max_new_tokens, eos, prefill_chunk, sampler=None,
                 target_attention="batched"):
        self.target, self.mtp, self.k, self.sampler = target, mtp, k, sampler
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
        self.stats = [GenerationStats(k) for _ in prompts]
        self.first_draft: dict[int, int] = {}  # the next round's first draft per sequence
        self.first_q: dict[int, torch.Tensor] = {}  # (sampling) the distribution it was drawn from
        self.draft_residual: dict[int, torch.Tensor] = {}  # the MTP residual it came from

    # -- the target's tokens --------------------------------------------------------------------
    def _accept(self, i: int, tokens: list[int]) -> None:
        for t in tokens:
            if self.done[i]:
                break
            self.tokens[i].append(t)
            self.new[i].append(t)
            if t in self.eos or len(self.new[i]) >= self.max_new:
                self._finish(i)

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
        logits = _head_logits(self.mtp, residual)
        if self.sampler is None:
            drafts = logits.float().argmax(-1).tolist()
        else:
            q = self.sampler.probs(logits)
            drafts = self.sampler.sample(q).tolist()
        for j, i in enumerate(seqs):
            self.first_draft[i] = drafts[j]
            self.draft_residual[i] = residual[j]
            if self.sampler is not None:
                self.first_q[i] = q[j]

    def draft(self, seqs: list[int], budgets: list[int]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Up to ``budgets[j]`` drafts per sequence: the first from the catch-up, the rest from
        batched MTP steps on the MTP's own residual (rows rolled back next round).  Greedy, or
        sampled from the processed MTP distribution, which is returned alongside (sampling)."""
        drafts = [[self.first_draft[i]] if budgets[j] else [] for j, i in enumerate(seqs)]
        dists = [[self.first_q[i]] if budgets[j] and self.sampler is not None else [] for j, i in enumerate(seqs)]
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
                if self.sampler is None:
                    tok = out.logits[:, -1].float().argmax(-1, keepdim=True)
                else:
                    q = self.sampler.probs(out.logits[:, -1])
                    tok = self.sampler.sample(q).unsqueeze(-1)
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
            cut = next((n + 1 for n, t in enumerate(d) if t in self.eos), len(d))
            del d[cut:]
            del q[cut:]
        return drafts, dists

    def rollback_mtp(self, seqs: list[int]) -> None:
        lengths = self.mcache.seq_lengths.clone()
        for i in seqs:
            lengths[i] = self.mtp_rows[i]
        self.mcache.crop(lengths)


def _verify_sampled(sampler: _Sampler, drafts: list[int], q: list[torch.Tensor], p: torch.Tensor) -> tuple[int, int]:
    """Speculative sampling of one sequence's round (:func:`.sampling.speculative_accept`): ``p [k+1, V]`` the
    target's processed distributions at the verified rows, ``q[n]`` the draft's at draft ``n``.  Returns the
    accepted count and the token the target adds (a resample after a rejection, else a sample of the row after
    the last draft), in one host read."""
    k = len(drafts)
    qs = torch.stack(q).to(p.device) if k else p.new_zeros(0, p.shape[-1])
    n, selected = sampling.speculative_accept(torch.tensor([drafts], dtype=torch.long, device=p.device), qs[None],
                                              p[None], sampler.generator)
    n, *selected = torch.cat([n, selected[0]]).tolist()
    return n, selected[n]


@torch.no_grad()
def speculative_generate(
    target,
    mtp,
    input_ids,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 128,
    num_draft_tokens: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    prefill_tokens: int = 8192,
    prefill_chunk: int = 2048,
    target_attention: str = "batched",
) -> SpeculativeOutput:
    """Speculative decoding of a batch with the MTP as the draft.

    ``input_ids``: a ``[B, S]`` tensor (with ``attention_mask`` for left or right padding)
    or a list of 1-D prompts.  Greedy: every sequence gets exactly the tokens
    ``target.generate(prompt, max_new_tokens=...)`` gives it alone.  ``do_sample=True``:
    speculative sampling (drafts drawn from the MTP's processed distribution, accepted with
    probability ``min(1, p/q)``, a rejection resampled from ``max(p - q, 0)``), so each
    sequence is distributed as ``generate(prompt, do_sample=True, temperature=, top_k=,
    top_p=)`` -- unset values come from ``target.generation_config`` as in ``generate``;
    ``generator`` (on the MTP's device) makes a run reproducible.  ``num_draft_tokens``
    (default ``mtp.generation_config.num_assistant_tokens``) drafts per round;
    ``prefill_tokens`` caps the prompt tokens one target forward takes (bounded memory).
    ``target_attention``: ``"batched"`` runs the target's attention once per layer for all
    sequences (:mod:`~.batched_attention`); ``"per_sequence"`` once per sequence through
    transformers' own attention and cache (the reference it is tested against).
    """
    sampler = None
    if do_sample:
        gc = target.generation_config
        temperature = gc.temperature if temperature is None else temperature
        top_k = gc.top_k if top_k is None else top_k
        top_p = gc.top_p if top_p is None else top_p
        if temperature is not None and not temperature > 0:
            raise ValueError(f"`temperature` must be > 0 when sampling, got {temperature!r}.")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"`top_p` must be in (0, 1], got {top_p!r}.")
        sampler = _Sampler(temperature, top_k, top_p, generator)
    if mtp.target_model is not target:
        raise ValueError("the MTP is not bound to this target: call `mtp.bind(target)` first.")
    k = mtp.generation_config.num_assistant_tokens if num_draft_tokens is None else num_draft_tokens
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"`num_draft_tokens` must be an integer >= 1, got {k!r}.")
    if k - 1 > mtp.config.max_draft_tokens:
        raise ValueError(f"`num_draft_tokens`={k} exceeds what the MTP cache rolls back "
                         f"(config.max_draft_tokens={mtp.config.max_draft_tokens}); raise `mtp.config.max_draft_tokens`.")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be an integer >= 1, got {max_new_tokens!r}.")
    prompts = _prompts(input_ids, attention_mask)
    vocab = target.config.vocab_size
    for i, p in enumerate(prompts):
        if int(p.min()) < 0 or int(p.max()) >= vocab:
            raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={vocab}).")
    eos = _eos_ids(target, eos_token_id)
    st = _Batch(target, mtp, prompts, k, max_new_tokens, eos, prefill_chunk, sampler, target_attention)

    # Prefill, in groups of at most `prefill_tokens` prompt tokens (one prompt may exceed it).
    groups, cur, size = [], [], 0
    for i, p in enumerate(prompts):
        if cur and size + p.numel() > prefill_tokens:
            groups.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += p.numel()
    groups.append(cur)
    for group in groups:
        chunks = [prompts[i] for i in group]
        lens = torch.tensor([c.numel() for c in chunks])
        last_rows = lens.cumsum(0) - 1
        logits, residual, offsets = st.runner(chunks, [st.caches[i] for i in group], logit_rows=last_rows)
        first = (logits.float().argmax(-1) if sampler is None else sampler.sample(sampler.probs(logits))).tolist()
        for j, i in enumerate(group):
            st._accept(i, [first[j]])
            st.stats[i].record_round(0, 0, 1)  # the prefill's token: no drafts yet
        live = [j for j, i in enumerate(group) if not st.done[i]]
        if live:
            st.catch_up([group[j] for j in live], [residual[offsets[j] : offsets[j + 1]] for j in live])

    while not all(st.done):
        seqs = [i for i, d in enumerate(st.done) if not d]
        # k drafts per sequence, fewer near max_new_tokens (the round also adds the target's token).
        budgets = [min(k, st.max_new - len(st.new[i]) - 1) for i in seqs]
        drafts, dists = st.draft(seqs, budgets)
        chunks = [torch.tensor([st.tokens[i][-1]] + d) for i, d in zip(seqs, drafts)]
        logits, residual, offsets = st.runner(chunks, [st.caches[i] for i in seqs])
        greedy = logits.float().argmax(-1).tolist() if sampler is None else None
        p_all = sampler.probs(logits) if sampler is not None else None
        st.rollback_mtp(seqs)  # drop the draft rows; the verified ones are recomputed below
        caught, caught_res = [], []
        for j, i in enumerate(seqs):
            d = drafts[j]
            if sampler is None:
                g = greedy[offsets[j] : offsets[j + 1]]
                a = next((n for n, t in enumerate(d) if t != g[n]), len(d))
                tokens = d[:a] + [g[a]]
            else:
                a, last = _verify_sampled(sampler, d, dists[j], p_all[offsets[j] : offsets[j + 1]])
                tokens = d[:a] + [last]
            before = len(st.new[i])
            st._accept(i, tokens)
            st.stats[i].record_round(len(d), a, len(st.new[i]) - before)
            if st.done[i]:
                continue
            st.caches[i].crop(len(st.tokens[i]) - 1)  # the target has processed all but the last token
            caught.append(i)
            caught_res.append(residual[offsets[j] : offsets[j] + a + 1])
        if caught:
            st.catch_up(caught, caught_res)

    pad = pad_token_id
    if pad is None:
        pad = target.generation_config.pad_token_id
    if pad is None:
        pad = min(eos) if eos else 0
    new = [torch.tensor(n, dtype=torch.long) for n in st.new]
    if isinstance(input_ids, torch.Tensor):
        heads = list(input_ids.cpu())
    else:
        heads = [p.cpu() for p in prompts]
    rows = [torch.cat([h, n]) for h, n in zip(heads, new)]
    width = max(r.numel() for r in rows)
    sequences = torch.full((len(rows), width), int(pad), dtype=torch.long)
    for i, r in enumerate(rows):
        sequences[i, : r.numel()] = r
    return SpeculativeOutput(sequences=sequences, new_tokens=new, stats=st.stats)


_WARPERS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper")
_STOPPERS = ("MaxLengthCriteria", "EosTokenCriteria")


def mtp_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                 streamer=None, mtp=None, num_draft_tokens: int | None = None, target_attention: str = "batched",
                 **model_kwargs):
    """:func:`speculative_generate` as transformers' decoding loop, for
    ``target.generate(ids, attention_mask=mask, custom_generate=mtp_decoding, mtp=mtp, ...)``.

    ``generate`` prepares the inputs and the generation config (``max_new_tokens``, EOS,
    padding, ``do_sample``/``temperature``/``top_k``/``top_p``) and hands them here; the
    result has ``generate``'s layout: the (padded) prompt rows, then each sequence's new
    tokens, padded with ``pad_token_id``.  Other logits processors, stopping criteria,
    streamers and dict outputs are not supported and raise."""
    if mtp is None:
        raise ValueError("pass the draft: `generate(..., custom_generate=mtp_decoding, mtp=mtp)`.")
    extra = [type(p).__name__ for p in logits_processor if type(p).__name__ not in _WARPERS]
    if extra:
        raise ValueError(f"MTP batched decoding applies temperature/top-k/top-p only; remove {extra} "
                         "(or use `generate(assistant_model=mtp)` one sequence at a time).")
    extra = [type(c).__name__ for c in stopping_criteria if type(c).__name__ not in _STOPPERS]
    if extra:
        raise ValueError(f"MTP batched decoding stops at EOS and max length only; remove {extra}.")
    if streamer is not None or synced_gpus or generation_config.return_dict_in_generate:
        raise ValueError("MTP batched decoding supports no streamer, synced_gpus or return_dict_in_generate.")
    eos = generation_config.eos_token_id
    out = speculative_generate(
        model, mtp, input_ids, attention_mask=model_kwargs.get("attention_mask"),
        max_new_tokens=generation_config.max_length - input_ids.shape[1], num_draft_tokens=num_draft_tokens,
        eos_token_id=[] if eos is None else eos, pad_token_id=generation_config.pad_token_id,
        do_sample=bool(generation_config.do_sample), temperature=generation_config.temperature,
        top_k=generation_config.top_k, top_p=generation_config.top_p, target_attention=target_attention,
    )
    return out.sequences.to(input_ids.device)
