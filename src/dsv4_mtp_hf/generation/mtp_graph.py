"""Chained MTP draft steps, and whole rounds of K drafts, greedy or sampled, captured in CUDA graphs and replayed.

A draft step at batch 1 is hundreds of small kernels: eagerly it is bound by launch and
Python overhead, not by the bytes it reads.  :class:`GraphedDrafter`
records the K - 1 single-row MTP steps after a round's first draft on a :class:`~dsv4_mtp_hf.cache.PagedMtpKVCache` (static
shapes, lengths updated in place on the device), each step feeding its argmax token and
its own residual to the next, and replays them with one launch.  Inputs go through
static buffers.  With the FlashInfer attention the drafter owns one planned wrapper per step
over fixed metadata buffers (``attention_plans``, passed to each step's attention call); the
host re-plans them (from the cache's lengths) before capturing and before every replay, so each
step sees its own key count while the context is shorter than the window.  :meth:`GraphedDrafter.round`
records a whole round instead -- the verified rows' catch-up from the target's residual, the first
draft, then the K - 1 steps -- one graph per number of verified rows (reference attention only).

``sampled=True`` draws each draft from the call's processed distribution instead of taking the
argmax: the graph-safe warpers (:mod:`.sampling`) and the exponential race run inside the graph,
whose RNG advances at every replay, and the logits handed back are the processed ones (the ``q``
exact speculative sampling needs).

``compile=True`` first compiles the step (:meth:`DeepseekV4MtpForCausalLM.draft_step`) with
``torch.compile(fullgraph=True)``: Inductor fuses the ~200 small kernels of a step (norms,
RoPE, mHC mixes, softmax, routing math) into a few dozen generated Triton kernels, and the
graph then captures those.  The custom ops (FP4 MoE, Sinkhorn) stay opaque.
"""

from __future__ import annotations

import torch

from ..cache import PagedMtpKVCache
from ..ops.argmax import argmax_last
from ..ops.fp4_moe import graph_capturable
from . import sampling
from .graphs import compile_options, record_graph


class GraphedDrafter:
    def __init__(self, mtp, cache: PagedMtpKVCache, num_drafts: int, draft_vocab: bool = False,
                 compile: bool = False, compile_mode: str | None = None, sampled: bool = False, warpers=None):
        if not isinstance(cache, PagedMtpKVCache):
            raise TypeError("GraphedDrafter needs a PagedMtpKVCache (static shapes): `mtp.new_cache(paged=True, ...)`.")
        if not 1 <= num_drafts <= cache.max_draft_tokens + 1:
            raise ValueError(f"num_drafts (drafts per round) must be in [1, max_draft_tokens + 1 = "
                             f"{cache.max_draft_tokens + 1}]: the cache rolls back the K - 1 drafted rows.")
        if warpers and not (sampled and sampling.graph_safe(warpers)):
            raise ValueError("GraphedDrafter's warpers must be graph-safe (generation.sampling.GRAPH_SAFE_WARPERS) "
                             "and need sampled=True; other processors draft eagerly.")
        w = mtp.e_proj.weight
        b, c = cache.batch_size, mtp.config
        self.mtp, self.cache, self.num_drafts, self.draft_vocab = mtp, cache, num_drafts, draft_vocab
        self.steps = num_drafts - 1  # drafts 2..K: one chained step each (the first comes from the catch-up)
        self.sampled, self.warpers = sampled, warpers
        self.tokens = torch.zeros(b, 1, dtype=torch.long, device=w.device)
        self.residual = torch.zeros(b, 1, c.hc_mult, c.hidden_size, dtype=w.dtype, device=w.device)
        self.graph = None
        self.drafts = self.logits = None
        self.use_graph = True  # False: the same steps and rounds eagerly (any device; tests)
        # Whole rounds (``round``): up to ``max_round_rows`` verified rows, one graph per row count.
        self.max_round_rows = num_drafts + 1
        self.round_ids = torch.zeros(b, self.max_round_rows, dtype=torch.long, device=w.device)
        self.round_residual = torch.zeros(b, self.max_round_rows, c.hc_mult, c.hidden_size, dtype=w.dtype,
                                          device=w.device)
        self._row_offsets = torch.arange(self.max_round_rows, device=w.device)
        self.round_graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        # FlashInfer attention only when named: under "auto" the drafted steps keep the reference attention,
        # which torch.compile fuses and captures (inside the graph FlashInfer measured no faster at these shapes,
        # BENCHMARKS.md, and its per-drafter plan handle would make torch.compile specialise per drafter).
        # With FlashInfer: one graph-safe plan per step, owned here and passed to every step.
        self.attention_backend = "reference" if c.attention_backend == "auto" else None  # None: the config's
        self.attention_plans = mtp.block.self_attn.new_flashinfer_plans(cache, self.steps, self.attention_backend)
        self.step, self.compiled = mtp.draft_step, False
        if compile:
            self.compile_step(compile_mode)

    def compile_step(self, mode: str | None = None) -> None:
        """Run the steps through ``torch.compile(fullgraph=True)`` from now on (compiled at the
        first call -- the warm-up of :meth:`capture`; a failure there raises).  ``dynamic=False``:
        one specialisation per batch size."""
        options = compile_options(self.mtp.e_proj.weight.device, mode)
        self.step = torch.compile(self.mtp.draft_step, fullgraph=True, dynamic=False, options=options)
        self.compiled = True

    @torch.no_grad()
    def run_eager(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K - 1 steps without the graph (compiled steps if ``compile``): drafts ``[B, K - 1]``
        and their logits ``[B, K - 1, V]``.  One step returns views of its own outputs (no
        copy kernels in the graph); more steps copy their outputs together (each step's
        lm head writes its own buffer)."""
        if self.attention_plans is not None:
            self.attention_plans.rewind()  # step k attends with FlashInfer plan k
        tok, res, drafts, logits = self.tokens, self.residual, [], []
        for _ in range(self.steps):
            tok, step_logits, res = self.step(tok, res, self.cache, self.draft_vocab, self.attention_backend,
                                              self.attention_plans)
            if self.sampled:  # the step's argmax is replaced by a draw from the processed distribution
                tok, step_logits = self.select(step_logits)
            drafts.append(tok)
            logits.append(step_logits)
        if self.steps == 1:
            return drafts[0].view(-1, 1), logits[0].unsqueeze(1)
        return torch.cat(drafts, dim=1), torch.stack(logits, dim=1)

    @torch.no_grad()
    def run_round_eager(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One round without the graph: the MTP rows of ``round_ids`` / ``round_residual[:, :rows]``
        (the verified rows, from the target's residual) appended to the cache, the first draft from the
        last of them, then the K - 1 steps.  Returns the drafts ``[B, K]`` and their fp32 logits."""
        positions = self.cache.seq_lengths.clone().unsqueeze(1) + self._row_offsets[:rows]
        logits, residual = self.mtp.forward_rows(self.round_ids[:, :rows], self.round_residual[:, :rows], positions,
                                          self.cache, 1, self.draft_vocab, self.attention_backend)
        first, first_logits = self.select(logits[:, -1])
        self.tokens.copy_(first)
        if self.steps == 0:  # rounds of one draft (K = 1): the catch-up's own
            return self.tokens, first_logits.unsqueeze(1)
        self.residual.copy_(residual[:, -1:])
        drafts, step_logits = self.run_eager()
        return (torch.cat([self.tokens, drafts], dim=1),
                torch.cat([first_logits.unsqueeze(1), step_logits.float()], dim=1))

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft from logits ``[B, V]``: ``(token [B, 1], fp32 logits)`` -- the argmax and the logits, or
        (``sampled``) a draw from the processed distribution and the processed logits."""
        logits = logits.float()
        if not self.sampled:
            return argmax_last(logits).unsqueeze(-1), logits
        token, processed = sampling.draft_draw(self.warpers, logits)
        return token.unsqueeze(-1), processed

    def round(self, ids: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole round from ``ids [B, n]`` (the tokens t_{p+1} of the n verified rows) and
        ``residual [B, n, hc_mult, D]`` (the target's residual at those rows), n <= ``max_round_rows``:
        one CUDA-graph replay (captured the first time n occurs), no host synchronisation.  Returns the
        graph's static drafts ``[B, 1 + K]`` and logits ``[B, 1 + K, V]`` (read them before the next round)."""
        rows = ids.shape[1]
        if not 1 <= rows <= self.max_round_rows:
            raise ValueError(f"a round takes 1..{self.max_round_rows} verified rows, got {rows}.")
        self.round_ids[:, :rows].copy_(ids)
        self.round_residual[:, :rows].copy_(residual)
        if not self.use_graph:
            return self.run_round_eager(rows)
        if self.attention_plans is not None:
            raise ValueError("round graphs run the reference window attention: the catch-up's FlashInfer plan is "
                             "made on the host per call. Use config.attention_backend 'auto' or 'reference', or "
                             "set `use_graph = False`.")
        if rows not in self.round_graphs:
            self._check_capturable()
            with torch.cuda.device(self.mtp.e_proj.weight.device):
                self.round_graphs[rows] = self._record_graph(lambda: self.run_round_eager(rows), warmup=2)
        graph, out = self.round_graphs[rows]
        graph.replay()
        return out

    def capture(self, warmup: int = 2) -> None:
        """Record the K - 1 steps (plan-like work -- allocation, Triton compilation -- happens in
        the warm-up, outside the capture).  The cache's lengths are restored afterwards."""
        if self.steps == 0:
            raise ValueError("a drafter of num_drafts=1 only replays whole rounds (`round`): it has no steps to capture.")
        self._check_capturable()
        # Streams and graphs belong to the current device: make it the MTP's (e.g. cuda:1).
        with torch.cuda.device(self.mtp.e_proj.weight.device):
            self._plan_attention()
            self.graph, (self.drafts, self.logits) = self._record_graph(self.run_eager, warmup)

    def capturable(self) -> bool:
        """Whether this drafter's steps and rounds can be captured as CUDA graphs here."""
        return self._not_capturable() is None

    def _not_capturable(self) -> str | None:
        """Why the drafter cannot be captured (None: it can)."""
        c, w = self.mtp.config, self.mtp.e_proj.weight
        shared = (self.mtp.get_input_embeddings().weight, self.mtp.get_output_embeddings().weight)
        if w.device.type != "cuda":
            return f"the MTP is on {w.device}: CUDA graphs need a GPU."
        if any(t.device != w.device for t in shared):
            return ("the target's embedding and lm head must live on the MTP's device for graph capture "
                    f"(MTP on {w.device}, embedding on {shared[0].device}, lm head on {shared[1].device}).")
        if not graph_capturable(c.hidden_size, c.moe_intermediate_size, w.device):
            return (f"hidden {c.hidden_size} / intermediate {c.moe_intermediate_size} fall back to the reference MoE, "
                    "which synchronises with the host and cannot be graph-captured (the Triton kernels tile "
                    "multiples of 256 and need Triton).")
        return None

    def _check_capturable(self) -> None:
        reason = self._not_capturable()
        if reason is not None:
            raise ValueError(reason)

    def _record_graph(self, fn, warmup: int):
        """``fn`` warmed up and captured (:func:`.graphs.record_graph`): ``(graph, its static outputs)``."""
        return record_graph(fn, self.cache.seq_lengths, warmup, "the MTP draft step", self.compiled)

    def _plan_attention(self, seq_lengths: list[int] | None = None) -> None:
        """FlashInfer: plan every step for the cache's current lengths (host-side, outside capture;
        no planning at all once every sequence is a window long).  Without ``seq_lengths`` the
        lengths are read from the device (one synchronisation)."""
        if self.attention_plans is not None:
            lengths = self.cache.seq_lengths.tolist() if seq_lengths is None else [int(n) for n in seq_lengths]
            self.attention_plans.plan_decode_steps(lengths)

    def __call__(self, tokens: torch.Tensor, residual: torch.Tensor,
                 seq_lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One replay from ``tokens [B, 1]`` (the last confirmed token) and ``residual
        [B, 1, hc_mult, D]`` (the target's residual at its position): the K - 1 steps' drafts and logits.
        The returned tensors are the graph's static outputs (copy them to keep them).
        ``seq_lengths``: the cache's lengths as host ints, when the caller tracks them -- spares
        the FlashInfer planning its device read; they must equal ``cache.seq_lengths``."""
        if self.graph is None:
            raise RuntimeError("call capture() first.")
        self.tokens.copy_(tokens)
        self.residual.copy_(residual)
        self._plan_attention(seq_lengths)
        self.graph.replay()
        return self.drafts, self.logits
