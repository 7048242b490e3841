"""DSpark's drafting session (design §7b): the drafter protocol (:mod:`.drafter`) for
``DeepseekV4DSparkForCausalLM``.

With ``L`` confirmed tokens the target has processed positions ``0..L-2``.  A round:

* rolls the window caches back to the committed rows (the last block's rows are never kept);
* commits the rows verified since: their context K/V from the target's features at those rows;
* drafts a block of γ tokens after the anchor (the last confirmed token, at position L-1): the backbone
  once, then the γ Markov steps, each with its confidence.

Greedy calls and sampled calls with graph-safe warpers run the commit and the block as one CUDA-graph replay
per number of committed rows (:class:`GraphedBlockDrafter`; the same function eagerly where no graph can be
captured).  When the call's processors read the sequence, each Markov step's draft is chosen by the driver's
:class:`~.round.Chooser` with the drafted prefix.  The verify length is the driver's choice
(:mod:`.draft_length`): the confidences come back with the drafts.
"""

from __future__ import annotations

import torch

from ..ops.fp4_moe import graph_capturable
from . import sampling
from .drafter import Drafts, DraftSession, register
from .graphs import compile_options, kept_drafter, record_graph, weight_pointers

COMMIT_CHUNK = 2048  # rows per commit when a long prompt is committed (bounded activation memory; exact)


@register
class DSparkSession(DraftSession):
    model_type = "deepseek_v4_dspark"
    confidence_head = True
    limit_hint = "a DSpark round drafts one block of `config.dspark_block_size` tokens and verifies a prefix of it"

    @staticmethod
    def feature_layers(model, target_config) -> list[int]:
        return list(model.config.dspark_target_layer_ids)

    @staticmethod
    def max_drafts(model) -> int:
        return model.config.dspark_block_size

    @staticmethod
    def auto_num_drafts(model) -> int:
        return model.config.dspark_block_size

    def __init__(self, model, num_drafts: int, regime: str, warpers=None):
        super().__init__(model, num_drafts)
        self.regime = regime
        self.drafter = None
        if regime != "processed":
            sampled = regime == "sampled"
            key = ("dspark", sampled and sampling.signature(warpers), weight_pointers(model))
            self.drafter = kept_drafter(model, key, lambda: GraphedBlockDrafter(model, model.new_cache(1), sampled,
                                                                                 warpers if sampled else None))
        self.cache = self.drafter.cache if self.drafter is not None else model.new_cache(1)

    def _draft(self, ids, features, choose, limit: int) -> Drafts | None:
        rows, length = features.shape[1], ids.shape[1]
        self.cache.truncate(self.committed, check=self.drafter is None)
        anchor = ids[:, -1:].to(self.model.main_proj.weight.device)
        d = self.drafter
        head = rows - d.max_rows if d is not None else rows
        for a in range(0, max(head, 0), COMMIT_CHUNK):  # a long prompt: all but its last rows eagerly
            b = min(a + COMMIT_CHUNK, head)
            self._commit(features[:, a:b], self.committed + a)
        if d is not None:
            start = max(head, 0)
            tokens, logits, confidences = d.round(features[:, start:], anchor)
            self.committed = length - 1
            return Drafts(tokens, logits, confidences)
        self.committed = length - 1
        return self._draft_per_position(ids, anchor, choose, limit)

    def _commit(self, features, first: int) -> None:
        positions = torch.arange(first, first + features.shape[1], device=self.cache.seq_lengths.device)[None]
        self.model.commit(features, positions, self.cache)

    def _draft_per_position(self, ids, anchor, choose, limit: int) -> Drafts | None:
        """The backbone once, then each Markov step's draft chosen by ``choose`` with the drafted prefix."""
        m = self.model
        hidden = m.backbone(anchor, self.cache)
        base = m.head_logits(hidden)
        previous, prefix, tokens, logits, confidences = anchor[:, 0], ids, [], [], []
        for k in range(min(limit, m.block_size)):
            z, c = m.markov(base[:, k], hidden[:, k], previous)
            choice = choose(z, prefix)
            if choice is None:
                break
            token, processed, last = choice
            tokens.append(token)
            logits.append(processed)
            confidences.append(c)
            prefix = torch.cat([prefix, token.to(prefix.device)], dim=1)
            previous = token[:, 0].to(anchor.device)
            if last:
                break
        if not tokens:
            return None
        return Drafts(torch.cat(tokens, 1), torch.stack(logits, 1), torch.stack(confidences, 1))

    def _snapshot(self) -> dict:
        self.cache.truncate(self.committed, check=False)
        return self.cache.snapshot()

    def _restore(self, state: dict) -> None:
        self.cache.restore(state)


class GraphedBlockDrafter:
    """A DSpark round -- the commit of up to ``block_size + 1`` verified rows and the block draft -- as one
    CUDA-graph replay per number of rows (captured the first time it occurs), or the same function eagerly where
    a graph cannot be captured.  The block (its shapes do not depend on the row count) is compiled once; the
    commit, a few projections, stays uncompiled.  ``sampled``: drafts drawn from the call's warped distribution
    (:func:`~.sampling.draft_draw`), whose logits are handed back as ``q``."""

    def __init__(self, model, cache, sampled: bool = False, warpers=None, compile: bool = True):
        c, w = model.config, model.main_proj.weight
        self.model, self.cache, self.sampled, self.warpers = model, cache, sampled, warpers
        self.max_rows = c.dspark_block_size + 1
        self.features = torch.zeros(1, self.max_rows, len(c.dspark_target_layer_ids), c.hc_mult, c.hidden_size,
                                    dtype=w.dtype, device=w.device)
        self.anchor = torch.zeros(1, 1, dtype=torch.long, device=w.device)
        self.use_graph = self._capturable()
        self.compiled = compile and self.use_graph
        block = self._block
        self.block = torch.compile(block, fullgraph=True, dynamic=False, options=compile_options(w.device)) \
            if self.compiled else block
        self.graphs: dict[int, tuple] = {}

    def _capturable(self) -> bool:
        m, w = self.model, self.model.main_proj.weight
        shared = (m.get_input_embeddings().weight, m.get_output_embeddings().weight)
        return (w.device.type == "cuda" and all(t.device == w.device for t in shared)
                and graph_capturable(m.config.hidden_size, m.config.moe_intermediate_size, w.device))

    def _select(self, z: torch.Tensor):
        if not self.sampled:
            return z.argmax(-1), z
        return sampling.draft_draw(self.warpers, z)

    def _block(self, anchor: torch.Tensor):
        out = self.model.draft(anchor, self.cache, self._select)
        return out.tokens, out.logits, out.confidences

    def _step(self, features: torch.Tensor, anchor: torch.Tensor):
        n = features.shape[1]
        positions = self.cache.seq_lengths.unsqueeze(1) + torch.arange(n, device=features.device)
        self.model.commit(features, positions, self.cache)
        return self.block(anchor)

    @torch.no_grad()
    def round(self, features: torch.Tensor, anchor: torch.Tensor):
        """Commit ``features [1, n, F, hc, D]`` (n <= ``max_rows``) and draft after ``anchor [1, 1]``: ``(tokens
        [1, γ], logits [1, γ, V], confidences [1, γ])`` (a graph's static outputs: read them before the next round)."""
        n = features.shape[1]
        if not 1 <= n <= self.max_rows:
            raise ValueError(f"a DSpark round commits 1..{self.max_rows} rows, got {n}.")
        self.features[:, :n].copy_(features)
        self.anchor.copy_(anchor)
        if not self.use_graph:
            return self._step(self.features[:, :n], self.anchor)
        if n not in self.graphs:
            with torch.cuda.device(self.anchor.device):
                self.graphs[n] = record_graph(lambda: self._step(self.features[:, :n], self.anchor),
                                              [layer.seq_lengths for layer in self.cache.layers], 2,
                                              "the DSpark round", self.compiled)
        graph, out = self.graphs[n]
        graph.replay()
        return out
