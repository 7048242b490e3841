"""Our V4 block on a target layer's own modules (``DeepseekV4Block.of_target_layer``: the graphed target's decode
step) against transformers' ``DeepseekV4DecoderLayer``, step for step, in float32: random decode steps of 1..K+1
rows that cross compression windows and roll back (crops of up to K rows, then on).  Each layer's output, its
compressor and indexer entries and the routed experts it picks are transformers'.  Then the step compiled by
Inductor (CPU) computes what it computes eagerly, writing the state in place."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4_mtp_hf import pack_fp4_experts
from dsv4_mtp_hf.layers.block import DeepseekV4Block
from dsv4_mtp_hf.target_runtime.batched_state import BatchedTargetState
from dsv4_mtp_hf.target_runtime.fp8_linears import quantize_fp8_linears
from dsv4_mtp_hf.target_runtime.ragged import RaggedTargetForward
from dsv4_mtp_hf.target_runtime.rollback_cache import RollbackDeepseekV4Cache

from .helpers import draw_until_clear, tiny_pair

K = 3  # max_rollback: verifies of up to K + 1 rows
# hash-routed CSA first, HCA, sliding, CSA; window 5, CSA rate 2 (windows close every other token), HCA rate 4
SMALL_RATES = dict(index_n_heads=32, num_hidden_layers=4, sliding_window=5, index_topk=3,
                   layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention",
                            "compressed_sparse_attention"],
                   mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
                   compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4})
# the release's rates: CSA 4 (overlapping windows), HCA 128
REAL_RATES = dict(index_n_heads=32, num_hidden_layers=2, sliding_window=8, index_topk=4,
                  layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                  mlp_layer_types=["hash_moe", "moe"],
                  compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})


def decode_step(block, state, streams, ids, pe, length):
    """One layer's decode step as the graphed target runs it."""
    return block(streams, pe, state, length, mlp_kwargs={"input_ids": ids})


class Pair:
    """A tiny float32 target, transformers' rollback cache over it and our blocks with one sequence's state."""

    def __init__(self, seed: int, overrides: dict, capacity: int, packed: bool = False, device: str = "cpu"):
        self.target, _ = tiny_pair(seed=seed % 1000, target_overrides=overrides)
        self.target.to(device)
        if packed:  # the release's formats: FP8 projections, packed FP4 experts (ours: one mtp_moe)
            quantize_fp8_linears(self.target)
            pack_fp4_experts(self.target)
        self.config, model = self.target.config, self.target.model
        self.layers = model.layers
        g = torch.Generator().manual_seed(seed)
        for layer in self.layers:  # hash routing by a real table (randomize_ leaves the integer buffers zero)
            if layer.mlp.is_hash:
                table = layer.mlp.gate.tid2eid
                order = torch.rand(table.shape[0], self.config.n_routed_experts, generator=g).argsort(-1)
                table.copy_(order[:, : table.shape[1]])
        self.blocks = [DeepseekV4Block.of_target_layer(layer, self.config) for layer in self.layers]
        self.cache = RollbackDeepseekV4Cache(self.config, max_rollback=K)
        self.state = BatchedTargetState(self.config, 1, K, capacity=capacity)
        self.state.allocate(torch.float32, [torch.device(device)] * len(self.layers))
        self.runner = RaggedTargetForward(self.target, attention="per_sequence")  # its mask is transformers'
        self.picked: dict[str, list] = {"transformers": [], "ours": []}
        self.side = "transformers"
        for layer in self.layers if not packed else ():  # both paths hand the experts module their choice (a hooked
            # packed module also makes ours call it, instead of one mtp_moe: not hooked then)
            layer.mlp.experts.register_forward_pre_hook(lambda m, args: self.picked[self.side].append(args[1]))

    @property
    def length(self) -> int:
        return self.state.lengths[0]

    @torch.no_grad()
    def step(self, streams: torch.Tensor, ids: torch.Tensor) -> list[float]:
        """Both paths on ``n`` new rows, layer by layer (each fed transformers' previous output); -> each
        layer's relative difference."""
        n, model = ids.shape[1], self.target.model
        positions = torch.arange(self.length, self.length + n, device=ids.device)[None]
        pe = {k: model.rotary_emb(streams, position_ids=positions, layer_type=k) for k in ("main", "compress")}
        mask = self.runner._mask(streams[:, :, 0], self.cache, positions)
        kw = {self.runner._attn_cache_kw: self.cache}
        rel = []
        for i, (layer, block) in enumerate(zip(self.layers, self.blocks)):
            self.side = "transformers"
            want = layer(streams, input_ids=ids, position_embeddings=pe, position_ids=positions, attention_mask=mask,
                         **kw)
            self.side = "ours"
            length = torch.tensor([self.length], device=ids.device)
            got = decode_step(block, self.state.layers[i], streams, ids, pe, length)
            rel.append(float((got - want).norm() / want.norm()))
            streams = want
        self.state.advance(0, n)
        return rel

    def crop(self, drop: int) -> None:
        self.cache.crop(-drop)
        self.state.truncate(0, self.length - drop)

    def entries_match(self) -> int:
        """Compare every compressed layer's entries (compressor, indexer) with the cache's; -> how many."""
        count = 0
        for i, (ours, theirs) in enumerate(zip(self.state.layers, self.cache.layers)):
            for name, stream in ours.streams.items():
                want = theirs.compressed_kv[name]
                t = self.length // stream.rate
                if want is None:
                    assert t == 0
                    continue
                assert want.shape[1] == t, (i, name, want.shape, t)
                torch.testing.assert_close(stream.entries[:, :t], want, rtol=1e-5, atol=1e-6,
                                           msg=f"layer {i} {name} entries at length {self.length}")
                count += t
        return count


def _run(seed, margins, overrides, steps, packed=False, device="cpu", tol=1e-5):
    rng = random.Random(seed)
    pair = Pair(seed, overrides, capacity=(K + 1) * steps + 1, packed=packed, device=device)
    margins.watch(pair.target)
    g = torch.Generator().manual_seed(seed)
    worst, entries = 0.0, 0
    for step in range(steps):
        n = rng.randint(1, K + 1)
        streams = torch.randn(1, n, pair.config.hc_mult, pair.config.hidden_size, generator=g).to(device)
        ids = torch.randint(3, pair.config.vocab_size, (1, n), generator=g).to(device)
        rel = pair.step(streams, ids)
        assert max(rel) <= tol, f"seed={seed} step {step} ({n} rows at {pair.length - n}): relative differences {rel}"
        worst = max(worst, *rel)
        entries += pair.entries_match()
        want, got = pair.picked["transformers"], pair.picked["ours"]
        assert len(want) == len(got) == len(pair.layers) * (step + 1) or packed
        for a, b in zip(want, got):
            assert torch.equal(a.sort(-1).values, b.sort(-1).values), f"seed={seed} step {step}: experts differ"
        if rng.random() < 0.5:  # a verify that kept only some of its rows
            pair.crop(rng.randint(0, min(n - 1, K)))
    print(f"seed={seed}: worst relative difference {worst:.3g}, {entries} entries compared")
    return pair


@pytest.mark.tf_internals
@pytest.mark.parametrize("case", ["small-rates", "small-rates-fp8-packed", "real-rates"])
def test_our_block_is_transformers_decoder_layer_through_steps_windows_and_rollbacks(case):
    overrides, steps = (REAL_RATES, 130) if case == "real-rates" else (SMALL_RATES, 40)

    def attempt(seed, margins):
        pair = _run(seed, margins, overrides, steps, packed="packed" in case)
        rates = pair.config.compress_rates
        assert pair.length // rates["heavily_compressed_attention"] >= 2, "the case must close HCA windows"

    draw_until_clear(attempt)


@pytest.mark.gpu
def test_our_block_on_cuda_is_transformers_decoder_layer():
    """The same on CUDA in float32 (our ops' CUDA registrations, transformers' layer on the same GPU)."""
    draw_until_clear(lambda seed, margins: _run(seed, margins, SMALL_RATES, 30, device="cuda", tol=1e-4))


@pytest.mark.tf_internals
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_step_computes_the_eager_step_and_writes_the_state_in_place(backend):
    """The decode step compiled as one graph per layer kind and row count (no graph break: what CUDA graphs
    capture): it gives the eager step's output and state, and every state buffer keeps its address.  ``aot_eager``
    traces what Inductor receives (Dynamo, functionalised state writes, the ops' fakes); ``inductor`` also runs
    its CPU kernels (~2 minutes of compiling)."""
    torch._dynamo.reset()
    seed = 808
    print(f"seed={seed}")
    pair = Pair(seed, SMALL_RATES, capacity=64)
    g = torch.Generator().manual_seed(seed)
    compiled = torch.compile(decode_step, dynamic=False, fullgraph=True, backend=backend)
    # a prompt eagerly, so that windows are closed and entries exist
    for n in (4, 4, 3):
        pair.step(torch.randn(1, n, pair.config.hc_mult, pair.config.hidden_size, generator=g),
                  torch.randint(3, 320, (1, n), generator=g))
    buffers = [t for layer in pair.state.layers for t in
               [layer.ring] + [b for s in layer.streams.values() for b in (s.ring_kv, s.ring_gate, s.entries)]]
    addresses = [t.data_ptr() for t in buffers]
    length = torch.tensor([pair.length])
    with torch.no_grad():
        for n, kinds in ((3, (0,)), (1, (1,)), (2, (2,))):  # CSA (hash-routed) with 3 rows, HCA with 1, sliding with 2
            x = torch.randn(1, n, pair.config.hc_mult, pair.config.hidden_size, generator=g)
            ids = torch.randint(3, 320, (1, n), generator=g)
            positions = torch.arange(pair.length, pair.length + n)[None]
            pe = {k: pair.target.model.rotary_emb(x, position_ids=positions, layer_type=k)
                  for k in ("main", "compress")}
            for i in kinds:
                before = [t.clone() for t in buffers]
                eager = decode_step(pair.blocks[i], pair.state.layers[i], x, ids, pe, length)
                after = [t.clone() for t in buffers]
                for t, b in zip(buffers, before):
                    t.copy_(b)
                got = compiled(pair.blocks[i], pair.state.layers[i], x, ids, pe, length)
                torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
                for t, a in zip(buffers, after):
                    torch.testing.assert_close(t, a, rtol=1e-5, atol=1e-6)
                assert [t.data_ptr() for t in buffers] == addresses
                for t, b in zip(buffers, before):  # the next kind starts from the same state
                    t.copy_(b)


def _stacked(states: list) -> list:
    """One state whose slot b is ``states[b]``'s one sequence (each layer's ring, rings and entries stacked)."""
    from types import SimpleNamespace

    def cat(*ts):
        return torch.cat([t.clone() for t in ts])

    layers = []
    for parts in zip(*(s.layers for s in states)):
        streams = {name: SimpleNamespace(ring_kv=cat(*(p.streams[name].ring_kv for p in parts)),
                                         ring_gate=cat(*(p.streams[name].ring_gate for p in parts)),
                                         entries=cat(*(p.streams[name].entries for p in parts)))
                   for name in parts[0].streams}
        layers.append(SimpleNamespace(ring=cat(*(p.ring for p in parts)), streams=streams))
    return layers


@pytest.mark.parametrize("overrides", [SMALL_RATES, REAL_RATES], ids=["small-rates", "real-rates"])
def test_a_step_of_several_sequences_is_each_sequence_alone(overrides):
    """The block on ``B = 2`` sequences at different lengths (one state slot each) gives each sequence what a step
    of it alone gives: output, ring, compressor and indexer state, through steps of 1..K+1 rows."""
    seed = 2468
    print(f"seed={seed}")
    pair = Pair(seed, overrides, capacity=64)
    cfg, model = pair.config, pair.target.model
    g = torch.Generator().manual_seed(seed)
    alone = [BatchedTargetState(cfg, 1, K, capacity=64) for _ in range(2)]
    for s in alone:
        s.allocate(torch.float32, [torch.device("cpu")] * len(pair.layers))
    lengths = [0, 0]

    def run(states_layers, streams, ids, length):
        positions = length.view(-1, 1) + torch.arange(streams.shape[1])
        pe = {k: model.rotary_emb(streams, position_ids=positions, layer_type=k) for k in ("main", "compress")}
        outs = []
        for i, block in enumerate(pair.blocks):
            outs.append(decode_step(block, states_layers[i], streams, ids, pe, length))
        return outs

    with torch.no_grad():
        for b, prompt in enumerate((7, 13)):  # each sequence's prefix alone, a few rows at a time
            for n in [K + 1] * (prompt // (K + 1)) + [prompt % (K + 1)] * bool(prompt % (K + 1)):
                x = torch.randn(1, n, cfg.hc_mult, cfg.hidden_size, generator=g)
                run(alone[b].layers, x, torch.randint(3, 320, (1, n), generator=g), torch.tensor([lengths[b]]))
                lengths[b] += n
        for n in (1, K + 1, 2, 1, K + 1):
            together = _stacked(alone)
            x = torch.randn(2, n, cfg.hc_mult, cfg.hidden_size, generator=g)
            ids = torch.randint(3, 320, (2, n), generator=g)
            got = run(together, x, ids, torch.tensor(lengths))
            for b in range(2):
                want = run(alone[b].layers, x[b:b + 1], ids[b:b + 1], torch.tensor([lengths[b]]))
                for layer, (o, w) in enumerate(zip(got, want)):
                    torch.testing.assert_close(o[b:b + 1], w, rtol=1e-5, atol=1e-5, msg=lambda m: f"layer {layer}, {n} rows: {m}")
                for ours, theirs in zip(together, alone[b].layers):
                    torch.testing.assert_close(ours.ring[b:b + 1], theirs.ring)
                    for name, st in ours.streams.items():
                        ref = theirs.streams[name]
                        torch.testing.assert_close(st.ring_kv[b:b + 1], ref.ring_kv)
                        torch.testing.assert_close(st.entries[b:b + 1, :-1], ref.entries[:, :-1])
                lengths[b] += n


def test_rotary_tables_are_transformers_rotary_embedding_bit_for_bit():
    """The decode step's RoPE tables (one product per entry) equal transformers' module's, whichever way the
    installed transformers spells them; a module with a hook runs (the hook fires)."""
    print("seed=57")
    from dsv4_mtp_hf.layers.rope import rotary_tables

    target, _ = tiny_pair(seed=57, target_overrides=REAL_RATES)
    rotary = target.model.rotary_emb
    positions = torch.randint(0, 70000, (2, 5), generator=torch.Generator().manual_seed(57))
    like = torch.zeros(2, 5, 8, dtype=torch.bfloat16)
    for layer_type in ("main", "compress"):
        for got, want in zip(rotary_tables(rotary, like, positions, layer_type),
                             rotary(like, position_ids=positions, layer_type=layer_type)):
            assert got.dtype == want.dtype and torch.equal(got, want)
    calls = []
    handle = rotary.register_forward_hook(lambda *a: calls.append(1))
    rotary_tables(rotary, like, positions, "main")
    handle.remove()
    assert calls == [1]
