"""DSpark's part of a batched call (:mod:`.speculative`): the drafter protocol's :class:`~.drafter.BatchDrafter`
for ``DeepseekV4DSparkForCausalLM`` (design §7b).

One :class:`~dsv4_mtp_hf.cache.DSparkKVCache` holds every sequence's window caches, each with its own length.
With ``L`` confirmed tokens the target has processed positions ``0..L-2``; a round for the live sequences is

* one commit of the rows each one verified since (ragged: a padded forward of which each sequence stores its
  own count, ``DSparkKVCache.ragged``);
* one block forward for the sequences that draft (anchor: each one's last confirmed token), the γ Markov
  steps included, with no host read inside; then one read of the block's tokens and confidences;
* per sequence, the prefix it verifies: K, or its own :class:`~.draft_length.ConfidenceLength` (``"auto"``'s
  Algorithm 1, or ``assistant_confidence_threshold``) on its own confidences, with modeled round costs
  (``timed=False``: a batch's wall time is no one sequence's, and a seeded call must repeat).  Draft j's
  decision reads ``c_1..c_j`` only, so speculative sampling stays exact.

After the verify the block's rows are rolled back (only committed rows stay in the caches).
"""

from __future__ import annotations

import torch

from . import sampling
from .draft_length import ConfidenceLength
from .drafter import BatchDrafter, register_batch


@register_batch
class DSparkBatch(BatchDrafter):
    model_type = "deepseek_v4_dspark"

    def __init__(self, model, call):
        super().__init__(model, call)
        n = len(call.tokens)
        self.cache = model.new_cache(n)
        self.device = self.cache.seq_lengths.device
        self.committed = [0] * n  # committed rows per sequence (host copy of the cache lengths after a rollback)
        by_confidence = call.auto or call.threshold is not None
        self.lengths = [ConfidenceLength(call.k, call.threshold, timed=False) for _ in range(n)] \
            if by_confidence else None
        self.check_drafts = call.warpers is not None  # the first sampled block's q is checked for NaN (one read)

    def free(self, i: int) -> None:
        self.cache.free(i)

    def advance(self, seqs: list[int], features: list[torch.Tensor]) -> None:
        """One commit of each sequence's new rows (in chunks of ``prefill_chunk`` rows: a long prompt's
        activations stay bounded), each at its own positions."""
        counts = [int(f.shape[0]) for f in features]
        chunk = self.call.prefill_chunk
        for a in range(0, max(counts), chunk):
            part = [j for j, n in enumerate(counts) if n > a]
            rows = [seqs[j] for j in part]
            b = min(a + chunk, max(counts[j] for j in part))
            feats = features[part[0]].new_zeros(len(part), b - a, *features[part[0]].shape[1:])
            num_new = [min(counts[j], b) - a for j in part]
            for r, j in enumerate(part):
                feats[r, : num_new[r]] = features[j][a : a + num_new[r]]
            start = torch.tensor([self.committed[i] + a for i in rows], device=self.device)
            positions = start.unsqueeze(1) + torch.arange(b - a, device=self.device)
            with self.cache.ragged(rows=torch.tensor(rows), num_new=torch.tensor(num_new)):
                self.model.commit(feats, positions, self.cache)
        for j, i in enumerate(seqs):
            self.committed[i] += counts[j]

    def _draw(self, z: torch.Tensor):
        return sampling.draft_draw(self.call.warpers, z, self.call.generator)

    def _block(self, seqs: list[int]):
        """One block after each sequence's last confirmed token (the anchor, at its committed length): greedy (the
        drafter's default choice) or drawn from the call's warped distribution."""
        anchors = torch.tensor([[self.call.tokens[i][-1]] for i in seqs], device=self.device)
        with self.cache.ragged(rows=torch.tensor(seqs)):
            if self.call.warpers is None:
                return self.model.draft(anchors, self.cache)
            return self.model.draft(anchors, self.cache, self._draw)

    def _drafting(self, seqs: list[int], budgets: list[int]) -> list[int]:
        """The positions (in ``seqs``) of the sequences that draft this round: those with room for a draft whose
        ``"auto"`` does not choose a plain step (recorded as a verified length of 0; a threshold always drafts)."""
        out = []
        for j, i in enumerate(seqs):
            if budgets[j] < 1:
                continue
            if self.lengths is not None and not self.lengths[i].draft_now():
                self.call.stats[i].draft_lengths.append(0)
                continue
            out.append(j)
        return out

    def draft(self, seqs: list[int], budgets: list[int]):
        drafts, dists = [[] for _ in seqs], [None] * len(seqs)
        drafting = self._drafting(seqs, budgets)
        if not drafting:
            return drafts, dists
        out = self._block([seqs[j] for j in drafting])
        g = out.tokens.shape[1]
        read = torch.cat([out.tokens.double(), out.confidences.double()], dim=1).tolist()  # the round's one read
        if self.check_drafts:
            self.check_drafts = False
            sampling.check_finite(out.logits.softmax(-1), "The drafter's sampled distribution")
        for r, j in enumerate(drafting):
            i = seqs[j]
            limit = self.call.k
            if self.lengths is not None:
                policy = self.lengths[i]
                if len(policy.choices) == 1:
                    policy.skip_timing()  # as batch 1: the first block's round also commits the whole prompt
                limit = policy.choose(read[r][g:])
                self.call.stats[i].draft_lengths.append(limit)
            keep = min(limit, budgets[j])
            drafts[j] = [int(t) for t in read[r][:keep]]
            dists[j] = out.logits[r, :keep] if self.call.warpers is not None else None
        return drafts, dists

    def rollback(self, seqs: list[int]) -> None:
        """The block's rows go: every sequence back to its committed rows (O(1): only the lengths move)."""
        self.cache.truncate(torch.tensor(self.committed, device=self.device), check=False)

    def observe(self, i: int, drafted: int, accepted: int) -> None:
        if self.lengths is not None and drafted:
            self.lengths[i].observe(drafted, accepted)
