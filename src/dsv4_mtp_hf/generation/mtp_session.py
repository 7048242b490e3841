"""The MTP's drafting session (design §2): the drafter protocol (:mod:`.drafter`) for ``DeepseekV4MtpForCausalLM``.

With ``L`` confirmed tokens the target has processed all but the last, so its residuals ``X_0..X_{L-2}``
are known.  MTP row p pairs ``X_p`` with the confirmed ``t_{p+1}``.  A round:

* drops the provisional rows of the last round's drafts from the MTP cache;
* commits the rows verified since (their residual from the target, the confirmed tokens after them) in
  one forward; the last of them predicts draft 1;
* drafts 2..K feed the MTP's own residual back with the drafted token (rows rolled back next round).

Greedy rounds and sampled rounds with graph-safe warpers run whole through a :class:`~.mtp_graph.GraphedDrafter`
on a paged cache: one CUDA-graph replay per round on a GPU where the FP4 kernels tile the model, the same
steps eagerly elsewhere.  When the call's processors read the sequence, each draft is chosen by the driver's
:class:`~.round.Chooser` after its own forward on a contiguous cache.
"""

from __future__ import annotations

import torch

from . import sampling
from .draft_length import AUTO_MAX_DRAFTS
from .drafter import Drafts, DraftSession, register
from .graphs import kept_drafter, weight_pointers
from .mtp_graph import GraphedDrafter

PREFILL_CHUNK = 2048  # MTP rows per forward when committing a long prompt (bounded activation memory; exact)


@register
class MtpSession(DraftSession):
    model_type = "deepseek_v4_mtp"
    limit_hint = "or raise `mtp.config.max_draft_tokens`, the rows its cache rolls back"

    @staticmethod
    def feature_layers(model, target_config) -> list[int]:
        return [target_config.num_hidden_layers - 1]  # its output is the residual the target's hc_head collapses

    @staticmethod
    def max_drafts(model) -> int:
        return model.config.max_draft_tokens + 1  # drafts 2..K leave K - 1 provisional rows to roll back

    @staticmethod
    def auto_num_drafts(model) -> int:
        return AUTO_MAX_DRAFTS  # K drafted per round under "auto" (the verifier gets the prefix the call chooses)

    def __init__(self, mtp, num_drafts: int, regime: str, warpers=None):
        super().__init__(mtp, num_drafts)
        self.drafter = None if regime == "processed" else _kept_drafter(mtp, num_drafts, regime == "sampled", warpers)
        self.cache = self.drafter.cache if self.drafter is not None else mtp.new_cache()
        self.device = mtp.e_proj.weight.device

    def _draft(self, ids, features, choose, limit: int):
        residual = features[:, :, -1].to(self.device)
        rows, length = residual.shape[1], ids.shape[1]
        new_ids = ids[:, self.committed + 1 : length].to(self.device)
        d = self.drafter
        if d is not None:  # the drop is the last round's K - 1 draft rows, within the ring by construction
            self.cache.truncate(self.committed, check=False)
            if rows <= d.max_round_rows and d.attention_plans is None:
                tokens, logits = d.round(new_ids, residual)  # catch-up, first draft, the rest: one replay
                self.committed = length - 1
                return Drafts(tokens, logits)
        else:
            self.cache.truncate(self.committed)
        out = self._commit(new_ids, residual)
        self.committed = length - 1
        if d is not None:
            return self._draft_rest(out)
        return self._draft_per_position(ids, out, choose, limit)

    def _commit(self, new_ids: torch.Tensor, residual: torch.Tensor):
        """MTP rows ``committed ..`` from the target's residual, in chunks of :data:`PREFILL_CHUNK` rows."""
        rows = residual.shape[1]
        for a in range(0, rows, PREFILL_CHUNK):
            b = min(a + PREFILL_CHUNK, rows)
            p0 = self.committed + a
            out = self.model(new_ids[:, a:b], residual[:, a:b], past_key_values=self.cache, logits_to_keep=1,
                             position_ids=torch.arange(p0, p0 + b - a, device=self.device).unsqueeze(0),
                             draft_vocab=True)
        return out

    def _draft_rest(self, out) -> Drafts:
        """Through the drafter: the first draft from the committed rows, drafts 2..K in one go."""
        d = self.drafter
        first, first_logits = d.select(out.logits[:, -1])  # argmax, or a draw from the processed q
        if d.steps == 0:
            return Drafts(first, first_logits.unsqueeze(1))
        if d.use_graph and d.graph is None:
            d.capture()  # a failure raises (GraphedDrafter names the fix); no silent eager fallback
        if d.use_graph:
            rest, rest_logits = (t.clone() for t in d(first, out.residual[:, -1:]))
        else:
            d.tokens.copy_(first)
            d.residual.copy_(out.residual[:, -1:])
            rest, rest_logits = d.run_eager()
        return Drafts(torch.cat([first, rest], 1), torch.cat([first_logits.unsqueeze(1), rest_logits.float()], 1))

    def _draft_per_position(self, ids, out, choose, limit: int) -> Drafts | None:
        """Each draft chosen by ``choose`` with the drafted prefix, one MTP forward per draft."""
        prefix, tokens, logits = ids, [], []
        for k in range(limit):
            choice = choose(out.logits[:, -1], prefix)
            if choice is None:
                break
            token, processed, last = choice
            tokens.append(token)
            logits.append(processed)
            prefix = torch.cat([prefix, token.to(prefix.device)], dim=1)
            if last or k == limit - 1:
                break
            position = torch.tensor([[ids.shape[1] - 1 + k]], device=self.device)
            out = self.model(token.to(self.device), out.residual[:, -1:], position_ids=position,
                             past_key_values=self.cache, draft_vocab=True)
        if not tokens:
            return None
        return Drafts(torch.cat(tokens, dim=1), torch.stack(logits, dim=1))

    def _snapshot(self) -> dict:
        self.cache.truncate(self.committed, **({"check": False} if self.drafter is not None else {}))
        return self.cache.snapshot()

    def _restore(self, state: dict) -> None:
        self.cache.restore(state)


def _kept_drafter(mtp, num_drafts: int, sampled: bool, warpers) -> GraphedDrafter:
    """The MTP's graphed drafter for these settings (:func:`.graphs.kept_drafter`; the draft vocabulary is read
    by address too)."""
    key = ("mtp", num_drafts, mtp.config.attention_backend, id(getattr(mtp, "_draft_ids", None)),
           sampled and sampling.signature(warpers), weight_pointers(mtp))

    def make() -> GraphedDrafter:
        drafter = GraphedDrafter(mtp, mtp.new_cache(paged=True, batch_size=1), num_drafts=num_drafts,
                                 draft_vocab=True, sampled=sampled, warpers=warpers if sampled else None)
        drafter.use_graph = drafter.capturable()
        # Not with FlashInfer plans: torch.compile specialises on their per-drafter handle.
        if drafter.use_graph and drafter.attention_plans is None:
            drafter.compile_step()
        return drafter

    return kept_drafter(mtp, key, make)
