"""Batched greedy speculative decoding: B sequences of different lengths, one MTP draft model.

transformers' assisted loop serves one sequence at a time.  :func:`speculative_generate`
runs B sequences together, each with its own acceptance and its own rollback:

* the target runs through :class:`~.ragged_target.RaggedTargetForward` (per-sequence
  rollback caches and positions, token-wise work batched over all sequences), so each
  sequence computes what it computes alone -- no padding enters the target;
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

from .ragged_target import RaggedTargetForward
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


class _Batch:
    """Per-sequence state of one :func:`speculative_generate` call."""

    def __init__(self, target, mtp, prompts, k, max_new_tokens, eos, prefill_chunk):
        self.target, self.mtp, self.k = target, mtp, k
        self.runner = RaggedTargetForward(target)
        self.device = mtp.e_proj.weight.device
        self.prompts = prompts
        self.tokens = [p.tolist() for p in prompts]
        self.new = [[] for _ in prompts]
        self.max_new, self.eos, self.prefill_chunk = max_new_tokens, eos, prefill_chunk
        self.caches = [self.runner.new_cache(max_rollback=k) for _ in prompts]
        self.mcache = mtp.new_cache(paged=True, batch_size=len(prompts))
        self.mtp_rows = [0] * len(prompts)  # rows in the MTP cache (host copy of seq_lengths)
        self.done = [False] * len(prompts)
        self.stats = [GenerationStats(k) for _ in prompts]
        self.first_draft: dict[int, int] = {}  # the next round's first draft per sequence
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
        self.caches[i] = None  # the target cache of a finished sequence is released now
        self.mcache.free(i)
        self.first_draft.pop(i, None)
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
                               logits_to_keep=1, draft_vocab=True)
            for j, n in enumerate(num_new):
                if a < counts[j] <= b:  # this chunk holds the sequence's last row
                    last[j] = out.residual[j, counts[j] - 1 - a]
        for j, i in enumerate(seqs):
            self.mtp_rows[i] += counts[j]
        residual = torch.stack(last).unsqueeze(1)  # [S, 1, hc, D]
        drafts = _head_logits(self.mtp, residual).float().argmax(-1).tolist()
        for j, i in enumerate(seqs):
            self.first_draft[i] = drafts[j]
            self.draft_residual[i] = residual[j]

    def draft(self, seqs: list[int], budgets: list[int]) -> list[list[int]]:
        """Up to ``budgets[j]`` greedy drafts per sequence: the first from the catch-up, the
        rest from batched MTP steps on the MTP's own residual (rows rolled back next round)."""
        drafts = [[self.first_draft[i]] if budgets[j] else [] for j, i in enumerate(seqs)]
        steps = max(budgets) - 1
        if steps > 0:
            live = [i for j, i in enumerate(seqs) if budgets[j] > 1]
            tok = torch.tensor([[self.first_draft[i]] for i in live], device=self.device)
            res = torch.stack([self.draft_residual[i] for i in live])
            rows = torch.tensor(live)
            steps_out = []
            for s in range(steps):
                pos = torch.tensor([[self.mtp_rows[i] + s] for i in live], device=self.device)
                with self.mcache.ragged(rows=rows):
                    out = self.mtp(tok, res, position_ids=pos, past_key_values=self.mcache, draft_vocab=True)
                tok = out.logits[:, -1].float().argmax(-1, keepdim=True)
                res = out.residual[:, -1:]
                steps_out.append(tok)
            more = torch.cat(steps_out, dim=1).tolist()  # one host read per round
            for j, i in enumerate(seqs):
                if budgets[j] > 1:
                    drafts[j] += more[live.index(i)][: budgets[j] - 1]
        for d in drafts:  # nothing after an EOS is worth verifying
            cut = next((n + 1 for n, t in enumerate(d) if t in self.eos), len(d))
            del d[cut:]
        return drafts

    def rollback_mtp(self, seqs: list[int]) -> None:
        lengths = self.mcache.seq_lengths.clone()
        for i in seqs:
            lengths[i] = self.mtp_rows[i]
        self.mcache.crop(lengths)


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
    prefill_tokens: int = 8192,
    prefill_chunk: int = 2048,
) -> SpeculativeOutput:
    """Greedy speculative decoding of a batch with the MTP as the draft.

    ``input_ids``: a ``[B, S]`` tensor (with ``attention_mask`` for left or right padding)
    or a list of 1-D prompts.  Every sequence gets exactly the tokens greedy
    ``target.generate(prompt, max_new_tokens=...)`` gives it alone.  ``num_draft_tokens``
    (default ``mtp.generation_config.num_assistant_tokens``) drafts per round;
    ``prefill_tokens`` caps the prompt tokens one target forward takes (bounded memory).
    """
    if do_sample:
        raise NotImplementedError(
            "speculative_generate is greedy only; for sampled speculative decoding use "
            "`target.generate(ids, assistant_model=mtp, do_sample=True)` one sequence at a time."
        )
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
    st = _Batch(target, mtp, prompts, k, max_new_tokens, eos, prefill_chunk)

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
        first = logits.float().argmax(-1).tolist()
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
        drafts = st.draft(seqs, budgets)
        chunks = [torch.tensor([st.tokens[i][-1]] + d) for i, d in zip(seqs, drafts)]
        logits, residual, offsets = st.runner(chunks, [st.caches[i] for i in seqs])
        greedy = logits.float().argmax(-1).tolist()
        st.rollback_mtp(seqs)  # drop the draft rows; the verified ones are recomputed below
        caught, caught_res = [], []
        for j, i in enumerate(seqs):
            d, g = drafts[j], greedy[offsets[j] : offsets[j + 1]]
            a = next((n for n, t in enumerate(d) if t != g[n]), len(d))
            before = len(st.new[i])
            st._accept(i, d[:a] + [g[a]])
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
