"""The MTP's part of a batched call (:mod:`.speculative`): the drafter protocol's :class:`~.drafter.BatchDrafter`
for ``DeepseekV4MtpForCausalLM``.

The MTP runs on one :class:`~dsv4_mtp_hf.cache.PagedMtpKVCache` (per-sequence lengths and O(1) rollback).  With
``L`` confirmed tokens the target has processed ``t_0..t_{L-2}`` and the MTP holds rows ``0..L-2`` (row p pairs
the target's residual ``X_p`` with ``t_{p+1}``).  After a verify that accepted ``a`` drafts, the drafts' rows are
dropped and rows ``L-1..L+a-1`` recomputed from the target's residual; sequences that accepted different numbers
of drafts catch up in one padded forward (``PagedMtpKVCache.ragged``), which also yields each one's first draft
of the next round.  Drafts 2..K feed the MTP's own residual back, all sequences in one step each.
"""

from __future__ import annotations

import torch

from . import sampling
from .drafter import BatchDrafter, register_batch


@register_batch
class MtpBatch(BatchDrafter):
    model_type = "deepseek_v4_mtp"

    @classmethod
    def check_settings(cls, model, auto: bool, threshold) -> None:
        if auto:
            raise ValueError("MTP batches draft a fixed number of tokens per round: pass `num_assistant_tokens` as "
                             "an int (DSpark batches choose a length per sequence with \"auto\").")

    def __init__(self, model, call):
        super().__init__(model, call)
        n = len(call.tokens)
        self.device = model.e_proj.weight.device
        self.cache = model.new_cache(paged=True, batch_size=n)
        # Under "auto" the MTP keeps the reference attention here, as GraphedDrafter does: FlashInfer plans on the
        # host per call, and this ragged path has not been measured or checked with it on a GPU.  An explicit
        # "flashinfer" is honoured.
        self.attention_backend = "reference" if model.config.attention_backend == "auto" else None
        self.rows = [0] * n  # rows in the MTP cache (host copy of seq_lengths)
        self.first_draft: dict[int, int] = {}  # the next round's first draft per sequence
        self.first_q: dict[int, torch.Tensor] = {}  # (sampling) the processed logits it was drawn from
        self.draft_residual: dict[int, torch.Tensor] = {}  # the MTP residual it came from

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sampling.choose(self.call.warpers, logits, self.call.generator)

    def free(self, i: int) -> None:
        self.cache.free(i)
        self.first_draft.pop(i, None)
        self.first_q.pop(i, None)
        self.draft_residual.pop(i, None)

    def advance(self, seqs: list[int], features: list[torch.Tensor]) -> None:
        """MTP rows ``rows[i] ..`` from the target's residual rows (the last layer's features) and the confirmed
        tokens after them; yields each sequence's first draft of the next round."""
        residuals = [f[:, -1] for f in features]
        counts = [int(r.shape[0]) for r in residuals]
        chunk, tokens = self.call.prefill_chunk, self.call.tokens
        width = max(counts)
        last = [None] * len(seqs)
        for a in range(0, width, chunk):
            b = min(a + chunk, width)
            ids = torch.zeros(len(seqs), b - a, dtype=torch.long)
            res = residuals[0].new_zeros(len(seqs), b - a, *residuals[0].shape[1:], device=self.device)
            num_new = []
            for j, (i, r) in enumerate(zip(seqs, residuals)):
                n = max(0, min(counts[j], b) - a)
                num_new.append(n)
                p0 = self.rows[i] + a
                ids[j, :n] = torch.tensor(tokens[i][p0 + 1 : p0 + 1 + n])
                res[j, :n] = r[a : a + n].to(self.device)
            start = torch.tensor([self.rows[i] + a for i in seqs], device=self.device)
            pos = start.unsqueeze(1) + torch.arange(b - a, device=self.device)
            with self.cache.ragged(rows=torch.tensor(seqs), num_new=torch.tensor(num_new)):
                out = self.model(ids.to(self.device), res, position_ids=pos, past_key_values=self.cache,
                                 logits_to_keep=1, draft_vocab=True, attention_backend=self.attention_backend)
            for j in range(len(seqs)):
                if a < counts[j] <= b:  # this chunk holds the sequence's last row
                    last[j] = out.residual[j, counts[j] - 1 - a]
        for j, i in enumerate(seqs):
            self.rows[i] += counts[j]
        residual = torch.stack(last).unsqueeze(1)  # [S, 1, hc, D]
        drafts, q = self.choose(self.model.draft_logits(residual)[:, -1])
        for j, (i, d) in enumerate(zip(seqs, drafts.tolist())):
            self.first_draft[i] = d
            self.draft_residual[i] = residual[j]
            self.first_q[i] = q[j]

    def draft(self, seqs: list[int], budgets: list[int]):
        """Up to ``budgets[j]`` drafts per sequence: the first from the catch-up, the rest from batched MTP steps
        on the MTP's own residual (rows rolled back next round)."""
        drafts = [[self.first_draft[i]] if budgets[j] else [] for j, i in enumerate(seqs)]
        dists = [[self.first_q[i]] if budgets[j] else [] for j, i in enumerate(seqs)]
        steps = max(budgets) - 1
        if steps > 0:
            live = [i for j, i in enumerate(seqs) if budgets[j] > 1]
            tok = torch.tensor([[self.first_draft[i]] for i in live], device=self.device)
            res = torch.stack([self.draft_residual[i] for i in live])
            rows = torch.tensor(live)
            steps_out, step_q = [], []
            for s in range(steps):
                pos = torch.tensor([[self.rows[i] + s] for i in live], device=self.device)
                with self.cache.ragged(rows=rows):
                    out = self.model(tok, res, position_ids=pos, past_key_values=self.cache, draft_vocab=True,
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
        sampled = self.call.warpers is not None
        return drafts, [torch.stack(q) if sampled and q else None for q in dists]

    def rollback(self, seqs: list[int]) -> None:
        lengths = self.cache.seq_lengths.clone()
        for i in seqs:
            lengths[i] = self.rows[i]
        self.cache.truncate(lengths)
