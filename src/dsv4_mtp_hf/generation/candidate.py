"""The MTP as a transformers candidate generator (SPEC §2, §7).

Bookkeeping per round, with ``L`` confirmed tokens ``t_0..t_{L-1}`` of which the target
has processed all but the last (its residuals ``X_0..X_{L-2}`` are known):

* MTP rows ``0..L-2`` pair ``X_p`` with the confirmed ``t_{p+1}``.  The rows not yet in the
  MTP cache (those verified in the last round) are computed in one forward from the
  target's residual; the last of them predicts the first draft.
* Each further draft row feeds the MTP's own residual back with the drafted token.
* Draft rows are provisional: the next round crops the MTP cache back to the confirmed
  rows and recomputes them from the target's residual.

The very first round (before the target has run) proposes nothing, so the target's
prefill produces the residuals the MTP needs.

Logits processors (grammar masks, temperature, top-k, ...) are applied to every draft position
with the drafted prefix, exactly as the verifier applies them to the target's rows.  A draft
position whose processed logits allow no token (all -inf, e.g. a grammar state the draft
vocabulary cannot continue) ends the round early; a token the processed distribution gives zero
probability is never drafted.
"""

from __future__ import annotations

import torch
import transformers
from transformers.generation.candidate_generator import CandidateGenerator

from . import sampling
from .draft_length import AutoDraftLength

# transformers >= 5.18 cuts a round's accepted tokens at the first EOS itself (`_assisted_decoding`). 5.17 does
# not, so there the drafts after an EOS are dropped here, which needs the drafts on the host.
VERIFIER_CUTS_AT_EOS = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 18)
KEPT_DRAFTERS = 4  # drafters (and their graphs) an MTP keeps for later calls, one per K / mode / warpers


class MtpCandidateGenerator(CandidateGenerator):
    requires_model_outputs = True
    model_kwargs_overrides: dict = {}  # the residual arrives through a hook, not hidden states
    # False: drafts ignore the logits processors (only the verifier applies them) -- a baseline
    # for measuring what per-position masking of drafts buys; the output is unchanged either way.
    process_drafts: bool = True
    # Greedy rounds without logits processors, and sampled rounds whose processors are all
    # graph-safe warpers (temperature, top-k, top-p, min-p: generation/sampling.py), replay as one
    # CUDA graph per round on a paged MTP cache (`GraphedDrafter`).  "auto": on CUDA, when the
    # Triton FP4 MoE tiles the model's sizes; "eager": the same paged path without the graph
    # (any device; tests); False: always the per-token loop below.
    fast_drafts: str | bool = "auto"
    # With the graph ("auto" on CUDA): compile the draft step with torch.compile before capturing
    # it (fused kernels; the first round pays the compilation, the uncompiled graph if it fails).
    compile_drafts: bool = True
    prefill_chunk: int = 2048  # MTP rows per forward when catching up on a long prompt

    def __init__(self, mtp, run, generation_config, logits_processor=None):
        self.mtp = mtp
        self.run = run  # the binding's per-call state: residual capture, K, stats
        self.num_assistant_tokens = run.num_assistant_tokens
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.max_length = generation_config.max_length
        eos = getattr(generation_config, "_eos_token_tensor", None)
        self.eos_token_ids = set() if eos is None else set(eos.reshape(-1).tolist())
        # "auto": K per round from this call's acceptance and round times; the drafts beyond it are dropped.
        self.draft_length = AutoDraftLength(run.num_assistant_tokens) if run.auto else None
        self.drafter = self._make_drafter()
        self.cache = self.drafter.cache if self.drafter is not None else mtp.new_cache()
        self.confirmed_rows = 0  # MTP rows computed from the target's residual with confirmed tokens
        self.last_drafted = 0
        self.last_input_length = None
        self.round_limit = self.num_assistant_tokens  # drafts handed to the verifier this round
        self.verifier_cuts_at_eos = VERIFIER_CUTS_AT_EOS  # our own loop (assisted_loop) cuts at EOS too

    @property
    def num_drafting_tokens(self) -> int:
        """Drafts per round (transformers >= 5.25 sizes the target cache's past recording with it)."""
        return self.num_assistant_tokens

    # -- drafting -----------------------------------------------------------------------------
    def _make_drafter(self):
        mode, k = self.fast_drafts, self.num_assistant_tokens
        # Greedy without processors, or sampling with graph-safe warpers only (generation/sampling.py).
        sampled = self.do_sample and sampling.graph_safe(self.logits_processor)
        greedy = not self.do_sample and not self.logits_processor
        if mode not in ("auto", "eager") or k < 1 or not (greedy or sampled):
            return None
        if sampled and self.mtp.config.attention_backend not in ("auto", "reference"):
            return None  # a sampled first draft after a long catch-up would need FlashInfer's host plan per call
        if mode == "auto":
            device = self.mtp.e_proj.weight.device
            if device.type != "cuda":
                return None
            # A graph replays on one device: a target split by device_map whose embedding lives
            # elsewhere (the MTP sits by the lm head) drafts eagerly instead.
            shared = (self.mtp.get_input_embeddings().weight, self.mtp.get_output_embeddings().weight)
            if any(t.device != device for t in shared):
                return None
            try:
                from ..ops.triton.fp4_moe_triton import kernel_supports
            except Exception:  # noqa: BLE001 - no Triton: no graph
                return None
            if not kernel_supports(self.mtp.config.hidden_size, self.mtp.config.moe_intermediate_size):
                return None
        from .cuda_graph import GraphedDrafter

        # One drafter per MTP, reused by later generate calls while nothing it captured changed: its graphs
        # (captured once per round size) then cost nothing after the first call.  The key holds what the
        # graphs read by address (weights, draft vocabulary) and what shapes them.
        c, m = self.mtp.config, self.mtp
        key = (k, mode, self.compile_drafts, c.attention_backend, id(getattr(m, "_draft_ids", None)),
               sampled and (self.process_drafts, sampling.signature(self.logits_processor)),
               *(t.data_ptr() for t in (m.e_proj.weight, m.get_input_embeddings().weight,
                                        m.get_output_embeddings().weight)))
        kept = m.__dict__.setdefault("_kept_drafters", {})  # a few, so greedy and sampled calls can alternate
        if key in kept:
            kept[key].cache.reset()
            return kept[key]
        cache = m.new_cache(paged=True, batch_size=1)
        drafter = GraphedDrafter(m, cache, num_drafts=k - 1, draft_vocab=True, sampled=sampled,
                                 warpers=self.logits_processor if sampled and self.process_drafts else None)
        drafter.use_graph = mode == "auto"
        # Not with FlashInfer plans: torch.compile specialises on their per-drafter handle.
        if drafter.use_graph and self.compile_drafts and getattr(drafter, "attention_plans", None) is None:
            drafter.compile_step()
        while len(kept) >= KEPT_DRAFTERS:
            kept.pop(next(iter(kept)))  # the oldest
        kept[key] = drafter
        return drafter

    def _recursive_drafts(self, token: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts 2..K from the first draft and its residual, through the (graphed) drafter."""
        d = self.drafter
        if d.use_graph and d.graph is None:
            d.capture()  # a failure raises (GraphedDrafter names the fix); no silent eager fallback
        if d.use_graph:
            drafts, logits = d(token, residual)
            return drafts.clone(), logits.clone()
        d.tokens.copy_(token)
        d.residual.copy_(residual)
        return d.run_eager()

    def select(self, processed_logits: torch.Tensor, sequence: torch.LongTensor) -> torch.LongTensor:
        """Draft token from the processed MTP logits ``[1, V]``: argmax, or a sample of the
        distribution handed to the verifier (exact speculative sampling)."""
        if self.do_sample:
            return torch.multinomial(processed_logits.softmax(dim=-1), num_samples=1)
        return processed_logits.argmax(dim=-1, keepdim=True)

    def _process(self, logits: torch.Tensor, sequence: torch.LongTensor) -> torch.Tensor:
        logits = logits.float()
        if self.logits_processor and self.process_drafts:
            logits = self.logits_processor(sequence, logits)
        return logits

    @torch.no_grad()
    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        length = input_ids.shape[1]
        self.last_input_length = length
        if is_first_iteration:
            self.last_drafted = 0
            return input_ids, None
        residual = self.run.take_residual()
        new_rows = length - 1 - self.confirmed_rows
        if residual is None or residual.shape[1] < new_rows or new_rows < 1:
            raise RuntimeError(
                f"MTP drafting lost track of the target: {new_rows} verified rows to recompute but the target's "
                f"last forward produced {None if residual is None else residual.shape[1]} residual rows."
            )
        mtp, device = self.mtp, self.mtp.e_proj.weight.device
        # Roll the draft rows back and recompute the verified ones from the target's residual.  The paged
        # cache's drop is the last round's K - 1 draft rows, within its ring by construction: no host check.
        if self.drafter is not None:
            self.cache.crop(self.confirmed_rows, check=False)
        else:
            self.cache.crop(self.confirmed_rows)
        budget = min(self.num_assistant_tokens, self.max_length - length - 1)
        if budget < 1:  # the verify's own token ends the generation: no MTP work (a later call catches up)
            self.last_drafted = 0
            return input_ids, None
        self.round_limit = self.num_assistant_tokens
        if self.draft_length is not None:
            self.round_limit = self.draft_length.choose()
            if self.confirmed_rows == 0:
                self.draft_length.skip_timing()  # this round also runs the MTP over the whole prompt
        d = self.drafter
        if d is not None:  # near max_length the graphs still draft K, and the verifier gets `budget` of them
            self.round_limit = min(self.round_limit, budget)
        if d is not None and new_rows <= d.max_round_rows and d.attention_plans is None:
            # The whole round -- the verified rows' catch-up, the first draft, the recursive ones -- as one
            # graph replay per row count, then one host read.
            tokens, logits = d.round(input_ids[:, self.confirmed_rows + 1 : length].to(device),
                                     residual[:, :new_rows])
            self.confirmed_rows = length - 1
            return self._round_result(input_ids, tokens, logits)
        # Long prompts go through the cache in blocks (bounded activation memory; exact).
        for a in range(0, new_rows, self.prefill_chunk):
            b = min(a + self.prefill_chunk, new_rows)
            p0 = self.confirmed_rows + a
            out = mtp(
                input_ids[:, p0 + 1 : p0 + 1 + (b - a)].to(device),
                residual[:, a:b],
                position_ids=torch.arange(p0, p0 + (b - a), device=device).unsqueeze(0),
                past_key_values=self.cache,
                logits_to_keep=1,
                draft_vocab=True,
            )
        self.confirmed_rows = length - 1

        if self.drafter is not None:
            return self._draft_all(input_ids, out)
        sequence = input_ids
        drafts, draft_logits = [], []
        for k in range(min(budget, self.round_limit)):
            processed = self._process(out.logits[:, -1], sequence.to(out.logits.device))
            # Nothing allowed here (all -inf, e.g. a grammar state): end the round, no junk draft.
            # Greedy needs no separate check: the argmax of an all -inf row is itself -inf below.
            if self.do_sample and bool(torch.isneginf(processed).all()):
                self._stopped_by_processor()
                break
            token = self.select(processed, sequence).reshape(1, 1)
            # One host read per draft: the token id and whether the processed distribution allows it.
            token_id, forbidden = torch.cat(
                [token.to(processed.device), torch.isneginf(processed.gather(-1, token.to(processed.device))).long()],
                dim=-1,
            )[0].tolist()
            if forbidden:  # zero probability after processing: never draft it
                self._stopped_by_processor()
                break
            token = token.to(input_ids.device)
            drafts.append(token)
            draft_logits.append(processed)
            sequence = torch.cat([sequence, token], dim=-1)
            if token_id in self.eos_token_ids or k == min(budget, self.round_limit) - 1:
                break
            position = length - 1 + k
            out = mtp(
                token.to(device),
                out.residual[:, -1:],
                position_ids=torch.tensor([[position]], device=device),
                past_key_values=self.cache,
                draft_vocab=True,
            )
        self.last_drafted = len(drafts)
        if not drafts:
            return input_ids, None
        return sequence, torch.stack(draft_logits, dim=1)

    def _draft_all(self, input_ids, out):
        """Through the drafter: the first draft from the confirmed rows, the rest in one go;
        drafts after an EOS are dropped (their cache rows are rolled back next round)."""
        first, first_logits = self.drafter.select(out.logits[:, -1])  # argmax, or a draw from the processed q
        if self.drafter.num_drafts == 0:  # K = 1
            return self._round_result(input_ids, first, first_logits.unsqueeze(1))
        rest, rest_logits = self._recursive_drafts(first, out.residual[:, -1:])
        tokens = torch.cat([first, rest.to(first.device)], dim=1)
        logits = torch.cat([first_logits.unsqueeze(1), rest_logits.float().to(first_logits.device)], dim=1)
        return self._round_result(input_ids, tokens, logits)

    def _round_result(self, input_ids, tokens, logits):
        """The round's candidates from its drafts ``[1, K]`` (and the logits handed to the verifier): the first ``round_limit`` of them, up to
        an EOS (the rows of the dropped drafts are rolled back next round).  No host read where the verifier
        cuts at EOS itself: the host goes on to the verify while the GPU still drafts."""
        keep = min(self.round_limit, tokens.shape[1])
        if self.eos_token_ids and not self.verifier_cuts_at_eos:
            ids = tokens[0, :keep].tolist()  # one host read for the whole round
            keep = next((i + 1 for i, t in enumerate(ids) if t in self.eos_token_ids), len(ids))
        self.last_drafted = keep
        return torch.cat([input_ids, tokens[:, :keep].to(input_ids.device)], dim=1), logits[:, :keep]

    def _stopped_by_processor(self) -> None:
        self.run.stats.rounds_stopped_by_processor += 1

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        # Stateful processors (grammar matchers) roll back to the verified sequence now.
        for processor in self.logits_processor or ():
            sync = getattr(processor, "sync_to_verified", None)
            if sync is not None:
                sync(input_ids)
        new_tokens = input_ids.shape[1] - (self.last_input_length or input_ids.shape[1])
        accepted = min(int(num_matches), self.last_drafted)
        self.run.stats.record_round(self.last_drafted, accepted, new_tokens)
        if self.draft_length is not None and self.last_drafted:
            self.draft_length.observe(self.last_drafted, accepted)
            self.run.stats.draft_lengths.append(self.round_limit)
