"""The target's decode step replayed as CUDA graphs, under transformers' own ``generate``.

transformers' eager V4 layer is bound by kernel launches (~6 ms per layer at batch 1 on an
H200, of which the routed experts are ~1.2 ms), and its cache changes shape every step, so it
cannot be captured.  :func:`graph_target` gives the target a fixed-shape decode step instead:

* its attention state is a :class:`~.batched_attention.BatchedTargetState` with a
  ``capacity`` (one sequence slot, every buffer preallocated for ``max_length`` tokens), so a
  forward's shapes depend only on its number of new rows ``n``;
* a decode step's layers are our V4 block (:meth:`~dsv4_mtp_hf.layers.block.DeepseekV4Block.of_target_layer`)
  on each target layer's own modules and weights (FP8 projections and packed experts as loaded):
  grouped projections, the compressor and indexer ops, the MTP's MoE op;
* for ``n <= max_rollback + 1`` (a plain step, or a verify of ``K`` drafts) the embedding,
  every layer and the head (``hc_head``, ``norm``, ``lm_head``) replay one CUDA graph per
  ``n``, captured the first time ``n`` occurs (that first forward runs eagerly and is the
  warm-up).  The layers compute their positions, ring slots and windows from the sequence's
  length, a device tensor: the host writes one number and launches, with no plan, no upload
  and no sync (the host work before a launch is what an idle GPU waits on);
* a target spread over GPUs by a ``device_map`` replays one graph per device segment
  (:func:`_segments`), the streams and RoPE tables copied device to device between replays;
* on CUDA each layer is first compiled (``torch.compile``, one layer at a time: layers of one
  kind and one ``n`` share the compiled code, so compiling does not grow with the depth).
  Inductor fuses the norms, RoPE, masks and index arithmetic; our custom ops (mHC, projections,
  MoE) stay opaque;
* the head runs inside the step, so forward hooks on ``hc_head``, ``norm`` and ``lm_head`` do
  not fire there (as on the layers; hooks on the target itself do).  The residual the MTP
  drafts from is handed over by :meth:`TargetGraphs.take_features` (the outputs of the layers a drafter
  reads, written by the graphs themselves: :meth:`TargetGraphs.tap`);
* longer forwards (the prompt) replay power-of-two chunks of at most ``prompt_chunk`` rows,
  longest first; the chunks of up to ``max_rows`` rows are the decode graphs, longer ones graphs of
  :class:`~.ragged.RaggedTargetForward`'s spelling of transformers' layer (its modules, the
  batched attention with the indices :class:`~.batched_state._FixedPlan` computes from the
  length), uncompiled and without the head (no compile per chunk size).  Both write the same
  state.  Before the first forward of all the state's buffers are allocated, so that no compiled
  call or capture meets them unallocated.

The state rolls back by moving its length (:class:`GraphedTargetCache.crop`), so assisted
generation with the MTP works on top of it.  On CPU the same fixed-shape step runs eagerly.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from .. import patching
from ..compat import cache_kwarg, dynamo_recompile_limit, progress
from ..layers.block import DeepseekV4Block
from ..ops import inductor_options
from .batched_state import BatchedTargetState
from .dtypes import norms_to_compute_dtype
from .fp8_linears import keep_fp8_linears
from .ragged import RaggedTargetForward

__all__ = ["GraphedTargetCache", "TargetGraphs", "graph_target", "ungraph_target"]


class GraphedTargetCache(Cache):
    """The cache a graphed target's ``generate`` uses: a handle on the target's one fixed-shape
    state (:class:`TargetGraphs`).  ``crop`` rolls back by up to ``max_rollback`` tokens.  Only
    the newest cache of a target is valid: a new one resets the state."""

    is_compileable = False  # transformers must not torch.compile around it: the graphs are ours
    is_croppable = True
    draft_state = None  # the draft side's record of the assisted call that last extended it (opaque here)

    def __init__(self, graphs: "TargetGraphs", epoch: int):
        super().__init__(layers=[])
        self.graphs, self._epoch = graphs, epoch

    @property
    def max_rollback(self) -> int:
        return self.graphs.state.max_rollback

    def _live(self):
        if self.graphs._epoch != self._epoch:
            raise RuntimeError("this GraphedTargetCache was superseded: a graphed target holds one generation at a "
                               "time, and a newer cache reset its state. Start a new generate call.")
        return self.graphs.sequence

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._live().get_seq_length()

    def crop(self, max_length) -> None:
        """transformers' conventions: ``<= 0`` removes ``-max_length`` tokens, ``> 0`` keeps that many."""
        self._live().crop(int(max_length))

    def __repr__(self) -> str:
        return f"GraphedTargetCache(length={self.get_seq_length()}, max_rollback={self.max_rollback})"


class _Segment:
    """Consecutive pieces of the target on one device: the embedding (first segment only), ``layers``
    and the head (last segment only)."""

    def __init__(self, device: torch.device, embeds: bool, layers: list[int], head: bool = False):
        self.device, self.embeds, self.layers, self.head = device, embeds, layers, head


def _head_device(target) -> torch.device:
    devices = {target.model.hc_head.hc_fn.device, target.model.norm.weight.device, target.lm_head.weight.device}
    if len(devices) != 1:
        raise ValueError(f"graph_target runs model.hc_head, model.norm and lm_head in one graph: put them on one "
                         f"device in the device_map, not on {sorted(map(str, devices))}.")
    return devices.pop()


def _segments(model) -> list[_Segment]:
    """The graphed step's segments: the embedding and the first layers on its device, then each run of
    layers on one device (a ``device_map`` target).  One graph per segment and row count."""
    segments = [_Segment(model.embed_tokens.weight.device, True, [])]
    for idx, layer in enumerate(model.layers):
        dev = next(layer.parameters()).device
        if dev != segments[-1].device:
            segments.append(_Segment(dev, False, []))
        segments[-1].layers.append(idx)
    return segments


def _with_head(segments: list[_Segment], device: torch.device) -> list[_Segment]:
    """The head joins the last segment, or follows it on a device of its own."""
    if segments[-1].device != device:
        segments.append(_Segment(device, False, []))
    segments[-1].head = True
    return segments


class _Graph:
    """One captured step of ``n`` rows on one segment: static inputs (token ids, the sequence's length,
    and after the first segment the streams and RoPE tables the previous one produced) and outputs
    (the streams, and on the head's segment the logits)."""

    def __init__(self, n: int, segment: _Segment, hidden_like=None, pe_like=None):
        device = segment.device
        self.segment = segment
        self.ids = torch.zeros(1, n, dtype=torch.long, device=device)
        self.length = torch.zeros(1, dtype=torch.long, device=device)
        self.hidden = None if hidden_like is None else torch.empty_like(hidden_like, device=device)
        self.pe = None if pe_like is None else {k: tuple(torch.empty_like(t, device=device) for t in v)
                                                for k, v in pe_like.items()}
        self.graph = self.out = self.pe_out = self.logits = None
        self.taps: dict[int, torch.Tensor] = {}  # tapped layer -> its output (a static buffer once captured)

    def load(self, ids: torch.Tensor, length: int, prev: "_Graph | None") -> None:
        """This forward's inputs into the static buffers: the ids, the length (a fill: no host-to-device
        copy) and, after the first segment, the previous segment's outputs (device to device: PyTorch
        orders the two devices' streams around the copy, the host does not wait)."""
        self.ids.copy_(ids)
        self.length.fill_(length)
        if prev is not None:
            self.hidden.copy_(prev.out)
            for k, pair in self.pe.items():
                for dst, src in zip(pair, prev.pe_out[k]):
                    dst.copy_(src)


def _fixed_indices(plan, length):
    return plan.indices(length)


def _graph_inputs(runner, model, ids, length):
    """The first segment's inputs of a decode step: the RoPE tables of the rows and the embeddings as streams."""
    positions = (length + torch.arange(ids.shape[1], device=length.device)).unsqueeze(0)
    return runner.streams_in(model.embed_tokens(ids), positions)


def _graph_head(model, lm_head, residual):
    """transformers' head on the streams ``[1, n, hc, D]`` -> logits ``[1, n, V]`` (the modules' own forwards)."""
    return lm_head.forward(model.norm.forward(model.hc_head.forward(residual)))


def _graph_block(block, lstate, hidden, ids, pe, length):
    """One decoder layer of a decode step: our V4 block on the target layer's modules and this layer's state
    (module level, so ``torch.compile`` reuses it across layers of one kind)."""
    return block(hidden, pe, lstate, length, mlp_kwargs={"input_ids": ids})


def _chunk_block(runner, layer, lstate, hidden, ids, pe, state, plan, t):
    """One decoder layer of a prompt chunk: the ragged forward's layer arithmetic (transformers' modules) with the
    batched attention on this layer's state."""

    def attend(attn, x, pe):
        return state.attend_layer(lstate, attn, x, pe, plan, t)

    return runner.block(layer, hidden, ids, pe, attend)


class TargetGraphs:
    """A DeepSeek-V4 target's fixed-shape decode state and its CUDA graphs (see the module
    docstring).  Made by :func:`graph_target`; ``forward`` serves the target's ``forward`` when
    it is called with a :class:`GraphedTargetCache`."""

    def __init__(self, target, max_length: int, max_rollback: int, compile: bool = True):
        if getattr(getattr(target, "config", None), "model_type", None) != "deepseek_v4" or not hasattr(target, "model"):
            raise TypeError(f"graph_target needs a transformers DeepseekV4ForCausalLM, got {type(target).__name__}.")
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
            raise ValueError(f"max_length must be a positive int (the most tokens a sequence reaches), got {max_length!r}.")
        if not isinstance(max_rollback, int) or isinstance(max_rollback, bool) or max_rollback < 0:
            raise ValueError(f"max_rollback must be an int >= 0 (the most drafts per round), got {max_rollback!r}.")
        devices = {p.device for p in target.parameters()} | {b.device for b in target.buffers()}
        if len({d.type for d in devices}) != 1 or next(iter(devices)).type not in ("cuda", "cpu"):
            raise ValueError(f"graph_target needs the target on GPUs (one, or several by a device_map), or wholly on "
                             f"the CPU; its tensors are on {sorted(map(str, devices))}. Load it without offloading "
                             "to the CPU or disk, or leave it ungraphed.")
        self.segments = _with_head(_segments(target.model), _head_device(target))
        self.target, self.device = target, self.segments[0].device
        rope = {b.device for b in target.model.rotary_emb.buffers()}
        if rope - {self.device}:
            raise ValueError(f"graph_target computes RoPE beside the embedding: put model.rotary_emb on the "
                             f"embedding's device ({self.device}) in the device_map, not on {sorted(map(str, rope))}.")
        self.runner = RaggedTargetForward(target, attention="batched")
        # the decode step's layers: our V4 block on each target layer's own modules
        self.blocks = [DeepseekV4Block.of_target_layer(layer, target.config) for layer in target.model.layers]
        self.state = BatchedTargetState(target.config, 1, max_rollback, capacity=max_length)
        self.sequence = self.state.sequences()[0]
        self.max_length, self.max_rows = max_length, max_rollback + 1
        self.use_graphs = self.device.type == "cuda"
        self.compiled = compile and self.use_graphs
        if self.compiled:
            # Inductor's kernels launch with PDL like ours; without reorder_for_locality the state rings' writes stay
            # after their reads, so Inductor writes them in place instead of copying each ring around its scatter.
            options = {**inductor_options(self.device), "reorder_for_locality": False}
            compiled = functools.partial(torch.compile, dynamic=False, options=options)
        else:
            compiled = lambda f: f  # noqa: E731
        self._block, self._inputs, self._head = compiled(_graph_block), compiled(_graph_inputs), compiled(_graph_head)
        self._graphs: dict[int, list[_Graph]] = {}  # per row count: one graph per segment
        self._epoch = 0
        self._features = None
        self.tapped: list[int] = [len(target.model.layers) - 1]  # the layers whose outputs take_features hands out
        self._allocated = False  # the state's buffers exist (`_allocate`, before the first forward)
        self.prompt_chunk = 256  # the longest chunk a prompt replays as one graph (a power of two)
        self._weights = self._weight_addresses()  # what the graphs read by address

    def _weight_addresses(self) -> list[tuple]:
        return [(name, t.data_ptr(), t.dtype) for name, t in
                (*self.target.named_parameters(), *self.target.named_buffers())]

    def check_weights(self) -> None:
        """Raise if a weight of the target was moved or replaced since :func:`graph_target`: compiled and captured
        steps read each weight at its address, so they would compute with freed memory."""
        now = self._weight_addresses()
        if now != self._weights:
            before = {name: rest for name, *rest in self._weights}
            changed = [name for name, *rest in now if before.get(name) != rest] or ["some weights were removed"]
            raise RuntimeError(
                f"the graphed target's weights changed since graph_target ({', '.join(changed[:3])}"
                f"{', ...' if len(changed) > 3 else ''}): a dtype or device change, modules replaced "
                "(quantize_fp8_linears, pack_fp4_experts) or load_state_dict(assign=True). Its graphs read the old "
                "addresses. Call ungraph_target(target) before changing the target, then graph_target(target) again.")

    def tap(self, layers: list[int]) -> None:
        """Have the graphs write the outputs of decoder ``layers`` for :meth:`take_features` (a change of layers
        drops the captured graphs: the next forward of each row count captures them again)."""
        from .features import check_layers

        layers = check_layers(self.target, layers)
        if layers != self.tapped:
            self.tapped = layers
            self._graphs.clear()

    @torch.no_grad()
    def capture_all(self) -> None:
        """Compile and capture the decode graph of every row count (1 .. ``max_rollback + 1``) now, for the layers
        tapped now, instead of at the first forward of each (seconds each, at unforeseeable points of the first
        generations).  Runs on a scratch generation: the next one starts from a new cache, as always.  A drafter
        that taps other layers (DSpark) makes the graphs be captured again: call this after its first call."""
        cache = self.new_cache(self.state.max_rollback)
        ids = torch.full((1, self.max_rows), 3, dtype=torch.long, device=self.device)  # any tokens
        self.forward(cache, input_ids=ids[:, :1], output_class=dict)  # the first forward allocates the state
        bar = progress(desc="capturing the decode step of every row count", total=self.max_rows, unit="graph")
        for n in range(1, self.max_rows + 1):
            self.forward(cache, input_ids=ids[:, :n], output_class=dict)
            cache.crop(-(n - 1))  # a verify keeps at least its first row
            bar.update()
        bar.close()
        self.new_cache()  # the scratch generation's cache and features are no one's
        self._features = None

    def take_features(self) -> torch.Tensor | None:
        """The tapped layers' outputs ``[1, n, F, hc, D]`` of the last forward (what drafters read), once."""
        features, self._features = self._features, None
        return features

    def check_length(self, tokens: int) -> None:
        """Before a generation: it may reach ``tokens`` tokens (prompt + new ones); the state holds ``max_length``."""
        if tokens > self.max_length:
            raise ValueError(f"this generation may reach {tokens} tokens, the graphed target holds "
                             f"max_length={self.max_length}: call ungraph_target(target) and "
                             f"graph_target(target, max_length={tokens}), or ask for fewer new tokens.")

    def new_cache(self, max_rollback: int = 0) -> GraphedTargetCache:
        """A cache for one generation (rolls back up to ``max_rollback`` tokens); resets the state."""
        if max_rollback > self.state.max_rollback:
            raise ValueError(f"this graphed target rolls back at most {self.state.max_rollback} tokens per round, "
                             f"{max_rollback} asked: call graph_target(target, max_rollback={max_rollback}).")
        self.check_weights()
        self._empty()
        self._epoch += 1
        self._features = None
        return GraphedTargetCache(self, self._epoch)

    # -- the forward -----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, cache: GraphedTargetCache, input_ids=None, attention_mask=None, position_ids=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, output_class=None,
                cache_name: str = "past_key_values", **kwargs):
        if cache.graphs is not self:
            raise ValueError("this GraphedTargetCache belongs to another graphed target.")
        cache._live()
        if inputs_embeds is not None or labels is not None or input_ids is None:
            raise ValueError("a graphed target's forward takes input_ids (no inputs_embeds, no labels); call "
                             "ungraph_target(target) for training or embedding inputs.")
        for name in ("output_attentions", "output_hidden_states", "output_router_logits"):
            if kwargs.get(name):
                raise ValueError(f"a graphed target's forward does not return {name[7:]}; call "
                                 "ungraph_target(target) to get them from transformers' forward.")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
            raise ValueError(f"a graphed target runs one sequence (input_ids [1, n]), got {tuple(input_ids.shape)}; "
                             "batches run through dsv4_mtp_hf.generation.speculative_generate.")
        past, n = cache.get_seq_length(), input_ids.shape[1]
        self._check_inputs(attention_mask, position_ids, past, n)
        ids = input_ids.to(self.device)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        if n <= self.max_rows and past > 0:
            _, logits, self._features = self._fixed_step(ids, n)
            logits = logits[:, keep].clone()  # the next replay overwrites the graph's output
        else:  # a prompt (or a long chunk): graph replays of power-of-two chunks
            if not self._allocated:
                self._allocate()
            residual, self._features = self._chunked(ids, n)
            logits = _graph_head(self.target.model, self.target.lm_head, residual[:, keep])
        return output_class(logits=logits, **{cache_name: cache})

    def _check_inputs(self, attention_mask, position_ids, past: int, n: int) -> None:
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (1, past + n):
                raise ValueError(f"a graphed target takes a 2-D attention mask of shape (1, {past + n}) (all ones), got "
                                 f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}.")
            if past == 0 and not bool(attention_mask.bool().all()):  # checked once per generation (a host read)
                raise ValueError("a graphed target runs unpadded sequences: the attention mask must be all ones.")
        if position_ids is not None:
            if position_ids.shape[-1] != n:
                raise ValueError(f"position_ids cover {position_ids.shape[-1]} tokens, input_ids {n}.")
            if past == 0 and not torch.equal(position_ids.reshape(-1).cpu(), torch.arange(n)):
                raise ValueError("a graphed target takes positions from its cache: position_ids must count on from "
                                 "the cached length (0, 1, ... on the first forward).")

    def _segment_step(self, plan, g: _Graph) -> None:
        """One segment's share of a forward for the rows of ``plan``, reading ``g``'s static inputs:
        the embedding (first segment), the segment's layers and the head (last segment).  Sets
        ``g.out`` / ``g.pe_out`` (and ``g.logits``).  Decode shapes (``n <= max_rows``) run our block, compiled,
        and the head; prompt chunks the ragged forward's layers uncompiled (no compile per chunk size), no head."""
        model, state, runner = self.target.model, self.state, self.runner
        if plan.N <= self.max_rows:
            pe, hidden = self._inputs(runner, model, g.ids, g.length) if g.segment.embeds else (g.pe, g.hidden)
            for idx in g.segment.layers:
                hidden = self._block(self.blocks[idx], state.layers[idx], hidden, g.ids, pe, g.length)
                if idx in self.tapped:
                    g.taps[idx] = hidden
        else:
            t = _fixed_indices(plan, g.length)  # the chunk's indices, computed inside the graph
            if g.segment.embeds:
                pe, hidden = runner.streams_in(model.embed_tokens(g.ids), t["flat_pos"])
            else:
                pe, hidden = g.pe, g.hidden
            for idx in g.segment.layers:
                hidden = _chunk_block(runner, model.layers[idx], state.layers[idx], hidden, g.ids, pe, state, plan, t)
                if idx in self.tapped:
                    g.taps[idx] = hidden
        g.out, g.pe_out = hidden, pe
        if g.segment.head and plan.N <= self.max_rows:
            g.logits = self._head(model, self.target.lm_head, hidden)

    def _allocate(self) -> None:
        """Before the first forward: the state's buffers, in the embedding's dtype on each layer's device, so that
        no compiled call or capture meets them unallocated (a capture would recompile: an error)."""
        devices = [next(layer.parameters()).device for layer in self.target.model.layers]
        self.state.allocate(self.target.model.embed_tokens.weight.dtype, devices)
        self._allocated = True

    def _empty(self) -> None:
        """The sequence holds no token (the state's buffers keep their stale rows: a function of the length)."""
        self.state.lengths[0] = self.state.high[0] = 0

    def _chunked(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """A forward of ``n`` rows as fixed steps of power-of-two rows, longest first (at most
        ``prompt_chunk``): any prompt replays at most ~log2(n) + n / prompt_chunk graphs, and the chunks of
        up to ``max_rows`` rows are the decode steps' own.  -> the streams ``[1, n, hc, D]`` (on the head's
        device) and the tapped layers' outputs ``[1, n, F, hc, D]``."""
        outs, features, a = [], [], 0
        while a < n:
            c = min(self.prompt_chunk, 1 << ((n - a).bit_length() - 1))
            out, _, feats = self._fixed_step(ids[:, a : a + c], c)
            outs.append(out.to(self.segments[-1].device, copy=True))  # a later chunk may replay the same graph
            features.append(feats)
            a += c
        return torch.cat(outs, dim=1), torch.cat(features, dim=1)

    def _fixed_step(self, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward of ``n`` rows (a decode step, or a prompt's chunk): graph replays, or (first time, or on
        CPU) the step itself.
        -> (the streams fed to the head ``[1, n, hc, D]``, the logits ``[1, n, V]``: a graph's buffer, the tapped
        layers' outputs ``[1, n, F, hc, D]``: a copy)."""
        plan, length = self.state.fixed_plan(n), self.sequence.get_seq_length()
        graphs = self._graphs.get(n) if self.use_graphs else None
        if graphs is not None:
            prev = None
            for g in graphs:
                with torch.cuda.device(g.segment.device):
                    g.load(ids, length, prev)
                    g.graph.replay()
                prev = g
            out, logits = prev.out, prev.logits
        else:
            bar = progress(desc=f"graph_target: compiling and capturing the {n}-row step", total=2, unit="stage") \
                if self.use_graphs else None
            graphs = self._run(lambda: self._segments_eagerly(plan, ids, length, n), n, "running")  # and the warm-up
            out, logits = graphs[-1].out, graphs[-1].logits  # the eager run's: a capture computes nothing
            if self.use_graphs:
                bar.update()
                self._capture(plan, graphs, n)
                self._graphs[n] = graphs
                bar.update()
                bar.close()
        self.state.advance(0, n)
        return out, logits, self._tapped_outputs(graphs)

    def _tapped_outputs(self, graphs: list[_Graph]) -> torch.Tensor:
        """The tapped layers' outputs of a step, stacked on the head's device (a copy: the next replay overwrites
        the graphs' buffers, and drafters read them after the verify)."""
        taps = {i: t for g in graphs for i, t in g.taps.items()}
        device = self.segments[-1].device
        return torch.stack([taps[i].to(device) for i in self.tapped], dim=2)

    def _segments_eagerly(self, plan, ids, length: int, n: int) -> list[_Graph]:
        """The forward itself, segment after segment, through the static inputs the graphs will read."""
        graphs, prev = [], None
        for segment in self.segments:
            with torch.cuda.device(segment.device) if segment.device.type == "cuda" else contextlib.nullcontext():
                g = _Graph(n, segment, *((prev.out, prev.pe_out) if prev is not None else ()))
                g.load(ids, length, prev)
                self._segment_step(plan, g)
            graphs.append(g)
            prev = g
        return graphs

    def _run(self, fn, n: int, what: str):
        # layers of one kind and one n share a compiled block: kinds x max_rows entries in Dynamo's cache
        with torch._dynamo.config.patch(**{dynamo_recompile_limit(): max(64, 8 * self.max_rows)}):
            try:
                return fn()
            except Exception as e:
                impl = getattr(self.target.config, "_experts_implementation", None)
                raise RuntimeError(
                    f"graph_target: {what} the target's {'compiled ' if self.compiled else ''}decode step of {n} rows "
                    f"failed ({type(e).__name__}: {str(e)[:400]}). A captured layer must not sync with the host: the "
                    f"experts implementation is {impl!r}, and pack_fp4_experts(target) or "
                    "set_experts_implementation('grouped_mm') with bf16 expert weights are capturable (compiled, "
                    "transformers runs other dtypes' grouped_mm through a loop that reads the offsets on the host). "
                    "graph_target(target, compile=False) "
                    "captures the uncompiled step; ungraph_target(target) runs transformers' forward.") from e

    def _capture(self, plan, graphs: list[_Graph], n: int) -> None:
        for device in {g.segment.device for g in graphs}:  # the eager forward has finished everywhere
            torch.cuda.synchronize(device)
        for g in graphs:
            with torch.cuda.device(g.segment.device):  # streams and graphs belong to the current device
                graph = torch.cuda.CUDAGraph()

                def capture(g=g, graph=graph):
                    with torch.cuda.graph(graph):
                        self._segment_step(plan, g)

                self._run(capture, n, "capturing")
                g.graph = graph


def graph_target(target, max_length: int = 4096, max_rollback: int = 8, compile: bool = True) -> TargetGraphs:
    """Make ``target``'s decode steps replay as CUDA graphs (module docstring).

    ``max_length``: the most tokens (prompt + generated) one generation reaches; the state's
    buffers are sized for it.  ``max_rollback``: the most drafts an assisted round may verify.
    ``compile``: compile each layer before capturing it (CUDA; the first steps of each row count
    then take seconds to compile, once per process).  A target on several GPUs (a ``device_map``,
    with ``model.rotary_emb`` beside the embedding) replays one graph per device segment.
    Afterwards ``target.generate(...)`` (plain, or with ``assistant_model=mtp``) runs the graphed
    step; ``target(ids, past_key_values=graphs.new_cache())`` too.  ``ungraph_target`` undoes it.
    """
    if graphed(target) is not None:
        raise ValueError("this target is already graphed; call ungraph_target(target) first to change max_length.")
    norms_to_compute_dtype(target)  # transformers 5.17 reloads bf16 targets with fp32 norms (a no-op on 5.18+)
    keep_fp8_linears(target)  # transformers' FP8Linear (Hub kernels, W8A8) -> our capturable W8A16 op
    graphs = TargetGraphs(target, max_length, max_rollback, compile)
    bound = type(target).forward.__get__(target)
    name = cache_kwarg(target)

    @functools.wraps(bound)
    def forward(*args, **kwargs):
        cache = kwargs.get(name, kwargs.get("past_key_values"))
        if not isinstance(cache, GraphedTargetCache):
            return bound(*args, **kwargs)
        kwargs.pop(name, None)
        kwargs.pop("past_key_values", None)
        kwargs.pop("return_dict", None)
        kwargs.pop("cache_position", None)  # 5.17 may pass it; positions come from the cache
        if args:
            kwargs["input_ids"] = args[0]
            if len(args) > 1:
                raise TypeError("a graphed target's forward takes input_ids positionally, the rest by keyword.")
        return graphs.forward(cache, output_class=MoeCausalLMOutputWithPast, cache_name=name, **kwargs)

    patching.install(target, "forward", forward)
    patching.record(target, create=True).graphs = graphs
    patching.refresh_generate(target)
    return graphs


def ungraph_target(target) -> None:
    """Undo :func:`graph_target`: transformers' own forward and cache again."""
    rec = patching.record(target)
    if rec is None or rec.graphs is None:
        raise ValueError("this target is not graphed (graph_target was not called on it).")
    rec.graphs = None
    patching.uninstall(target, "forward")
    patching.refresh_generate(target)


def _plain_generate_on_graphs(target, cls_generate, args, kwargs):
    """A plain batch-1 ``generate`` on a graphed target gets a cache of the graphed step (else it is passed on)."""
    graphs = graphed(target)
    if graphs is None or kwargs.get("assistant_model") is not None or not _one_sequence(target, args, kwargs):
        return NotImplemented
    name = cache_kwarg(target)
    if kwargs.get(name) is None and kwargs.get("past_key_values") is None:
        graphs.check_length(final_length(target, args, kwargs))
        kwargs[name] = graphs.new_cache()
    return cls_generate(target, *args, **kwargs)


def _input_ids(args, kwargs):
    for value in (args[0] if args else None, kwargs.get("input_ids"), kwargs.get("inputs")):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _one_sequence(target, args, kwargs) -> bool:
    """A cached generation of exactly one sequence by transformers' own loop (what a graphed target's step
    runs); batches, beams, several returned sequences and custom decoding loops keep their own caches."""
    if kwargs.get("custom_generate") is not None:
        return False
    ids = _input_ids(args, kwargs)
    config = kwargs.get("generation_config") or target.generation_config
    one = {k: kwargs.get(k, getattr(config, k, None)) for k in ("num_beams", "num_return_sequences", "use_cache")}
    return (ids is not None and ids.dim() == 2 and ids.shape[0] == 1 and (one["num_beams"] or 1) == 1
            and (one["num_return_sequences"] or 1) == 1 and one["use_cache"] is not False)


def final_length(target, args, kwargs) -> int:
    """The most tokens a ``generate`` call may reach (prompt + ``max_new_tokens``, else ``max_length``)."""
    config = kwargs.get("generation_config") or target.generation_config
    new = kwargs.get("max_new_tokens", None if "max_length" in kwargs else config.max_new_tokens)
    if new is not None:
        return _input_ids(args, kwargs).shape[1] + int(new)
    return int(kwargs.get("max_length", config.max_length))


patching.register_generate_handler(_plain_generate_on_graphs)


def graphed(target) -> TargetGraphs | None:
    """The target's :class:`TargetGraphs`, or None when it is not graphed."""
    rec = patching.record(target)
    return None if rec is None else rec.graphs
