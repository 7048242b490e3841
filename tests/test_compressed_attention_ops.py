"""The target decode layer's ops (``dsv4_mtp::compressor_step``, ``indexer_topk``, ``hash_route``) against
transformers' own modules on random inputs: a compressor stream fed step by step, with rollbacks, holds the
entries transformers' compressor computes from the whole prefix; the indexer picks what its scorer ranks;
hash routing is ``DeepseekV4HashRouter``.  Schemas and fakes (``torch.library.opcheck``); on a GPU, the CUDA
path equals the CPU reference and replays from a CUDA graph."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from dsv4_mtp_hf.ops.compressor import closing_windows, compressor_step, compressor_step_op
from dsv4_mtp_hf.ops.indexer import indexer_topk, indexer_topk_op
from dsv4_mtp_hf.ops.moe_route import hash_route, hash_route_op

from .helpers import randomize_, tiny_target_config

SEED = 5757
K = 3  # the most rows a crop removes (max_rollback)


def _compressor(kind: str, rate: int, seed: int):
    """transformers' HCA or CSA compressor with random weights (float32)."""
    cfg = tiny_target_config(compress_rates={"compressed_sparse_attention": rate, "heavily_compressed_attention": rate})
    module = (hf.DeepseekV4CSACompressor if kind == "csa" else hf.DeepseekV4HCACompressor)(cfg).float().eval()
    randomize_(module, torch.Generator().manual_seed(seed))
    return cfg, module


def _state(module, overlap: bool, capacity: int):
    """One sequence's stream state as ``BatchedTargetState`` lays it out (rings of the minimum size for K)."""
    rate, d = module.compress_rate, module.head_dim
    ring = (2 * rate if overlap else rate) - 1 + K
    width = 2 * d if overlap else d
    return torch.zeros(1, ring, width), torch.zeros(1, ring, width), torch.zeros(1, capacity // rate + 1, d)


@torch.no_grad()
def _step(module, x, ring_kv, ring_gate, entries, length: int, overlap: bool):
    """Our op on the rows ``x [1, n, D]`` at ``length``: the projections, the closing windows' RoPE, the step."""
    n, rate = x.shape[1], module.compress_rate
    L = torch.tensor([length])
    first, _ = closing_windows(L, n, rate)
    cos, sin = module.rotary_emb(x, position_ids=first * rate, layer_type="compress")
    compressor_step(module.kv_proj(x), module.gate_proj(x), L, ring_kv, ring_gate, entries, module.position_bias,
                    module.kv_norm.weight, cos, sin, rate, overlap, module.kv_norm.variance_epsilon)


@pytest.mark.tf_internals
@pytest.mark.parametrize("kind, rate", [("hca", 4), ("csa", 2), ("csa", 4), ("hca", 128)])
def test_compressor_steps_and_rollbacks_hold_the_entries_transformers_computes_from_the_prefix(kind, rate):
    """Rows appended 1..K+1 at a time, K of them rolled back now and then (the length moves back, nothing else):
    after every step the entries equal what transformers' compressor (stateless, from the whole prefix) emits,
    the CSA overlap across windows and steps included.  The spare entry takes the windows left open."""
    seed = SEED + rate + (kind == "csa")
    print(f"seed={seed}")
    cfg, module = _compressor(kind, rate, seed)
    overlap, steps = kind == "csa", 40 if rate <= 4 else 150
    capacity = 4 * (K + 1) * steps
    x = torch.randn(1, capacity, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    q_res = torch.randn(1, capacity, cfg.q_lora_rank)
    state = _state(module, overlap, capacity)
    rng, length, high, checked = random.Random(seed), 0, 0, 0
    for step in range(steps):
        if step and rng.random() < 0.4:  # a rejected verify: back by up to K rows, never below high - K
            length -= rng.randint(0, min(K, length - (high - K)))
        n = rng.randint(1, K + 1)
        _step(module, x[:, length : length + n], *state, length, overlap)
        length += n
        high = max(high, length)
        with torch.no_grad():  # stateless: every window of the prefix (the CSA one runs its indexer too)
            want = module(x[:, :length], q_res[:, :length], torch.arange(length)[None], None, 0)[0][0, 0]
        got = state[2][0, : length // rate]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"seed={seed} step {step} length {length}")
        checked += want.shape[0]
    assert checked > 0 and length // rate >= 2, "the case must close windows"


@pytest.mark.tf_internals
def test_indexer_picks_the_entries_transformers_scorer_ranks_highest_among_those_closed():
    print(f"seed={SEED}")
    g = torch.Generator().manual_seed(SEED)
    cfg = tiny_target_config(index_n_heads=8, index_topk=4)
    scorer = hf.DeepseekV4IndexerScorer(cfg).float()
    randomize_(scorer, g)
    rate, n, entries_n = 4, 4, 9
    q = torch.randn(1, n, cfg.index_n_heads, cfg.index_head_dim, generator=g)
    entries = torch.randn(1, entries_n, cfg.index_head_dim, generator=g)
    hidden = torch.randn(1, n, cfg.hidden_size, generator=g)
    for start in (0, 3, 13, 30):  # no entry closed yet, some, all but the spare
        positions = torch.arange(start, start + n)[None]
        with torch.no_grad():
            got = indexer_topk(q, entries, scorer.weights_proj(hidden), positions, rate, cfg.index_topk,
                               scorer.softmax_scale, scorer.weights_scaling)
            # transformers' indexer: scores, the causal mask, top-k, picks past the threshold -> -1
            scores = scorer(q, entries, hidden)
        threshold = ((positions + 1) // rate)[..., None]
        scores = scores.masked_fill(torch.arange(entries_n) >= threshold, float("-inf"))
        picks = scores.topk(min(cfg.index_topk, entries_n), dim=-1).indices
        want = torch.where(picks >= threshold, -1, picks)
        assert torch.equal(got.sort(-1).values, want.sort(-1).values), f"start {start}"
        assert torch.equal((got >= 0).sum(-1), threshold[..., 0].clamp(max=cfg.index_topk))  # every closed one, up to k


@pytest.mark.tf_internals
def test_hash_routing_is_transformers_hash_router():
    print(f"seed={SEED}")
    cfg = tiny_target_config()
    router = hf.DeepseekV4HashRouter(cfg).float()
    g = torch.Generator().manual_seed(SEED)
    randomize_(router, g)
    router.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, router.tid2eid.shape, generator=g))
    ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=g)
    h = torch.randn(1, 6, cfg.hidden_size, generator=g)
    with torch.no_grad():
        _, want_w, want_ids = router(h, ids)
        got_w, got_ids = hash_route(h[0], router.weight, router.tid2eid, ids[0], cfg.routed_scaling_factor)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


def _op_cases(device="cpu"):
    g = torch.Generator().manual_seed(SEED)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device)

    b, n, d, rate, ring = 1, 3, 8, 4, 2 * 4 - 1 + K
    nw = (rate - 1 + n) // rate
    compressor = (r(b, n, 2 * d), r(b, n, 2 * d), torch.tensor([6], device=device), r(b, ring, 2 * d),
                  r(b, ring, 2 * d), torch.zeros(b, 7, d, device=device), r(rate, 2 * d), r(d), r(b, nw, 2),
                  r(b, nw, 2), rate, True, 1e-6)
    indexer = (r(1, n, 4, d), r(1, 7, d), r(1, n, 4), torch.tensor([[4, 5, 6]], device=device), 2, 3, 0.3, 0.5)
    hashed = (r(n, d), r(6, d), torch.randint(0, 6, (20, 2), generator=g).to(device),
              torch.tensor([1, 5, 7], device=device), 1.5)
    return [(compressor_step_op, compressor), (indexer_topk_op, indexer), (hash_route_op, hashed)]


@pytest.mark.parametrize("case", range(3), ids=["compressor_step", "indexer_topk", "hash_route"])
def test_op_schemas_and_fakes(case):
    """Schema, fake (what torch.compile traces) and in-place mutation checks of each op."""
    op, args = _op_cases()[case]
    torch.library.opcheck(op, args)


def test_errors_name_the_op_and_the_shapes():
    op, args = _op_cases()[0]
    with pytest.raises(ValueError, match="compressor_step: entries must be"):
        op(*args[:5], torch.zeros(1, 7, 5), *args[6:])
    with pytest.raises(ValueError, match="cannot hold a window"):
        op(args[0], args[1], args[2], args[3][:, :3], args[4][:, :3], *args[5:])
    op, args = _op_cases()[1]
    with pytest.raises(ValueError, match="indexer_topk: weights must be"):
        op(args[0], args[1], args[2][..., :3], *args[3:])


def _outputs(case: int, args: list, result) -> list[torch.Tensor]:
    """What an op gives: the state it writes (compressor_step) or its results."""
    if case == 0:
        return [args[i] for i in (3, 4, 5)]
    return list(result) if isinstance(result, tuple) else [result]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(3), ids=["compressor_step", "indexer_topk", "hash_route"])
def test_ops_on_cuda_equal_the_cpu_reference_and_replay_from_a_cuda_graph(case):
    """The CUDA registration (today the reference) against the CPU, eagerly and replayed from a CUDA graph (no host
    sync inside the op; the state written in place at the captured addresses)."""
    op, cpu = _op_cases()[case]
    want = _outputs(case, cpu, op(*cpu))
    _, gpu = _op_cases("cuda")[case]
    for a, b in zip(_outputs(case, gpu, op(*gpu)), want, strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)
    _, fresh = _op_cases("cuda")[case]
    static = [t.clone() if isinstance(t, torch.Tensor) else t for t in fresh]
    op(*static)  # warm-up outside the capture
    for dst, src in zip(static, fresh):
        if isinstance(src, torch.Tensor):
            dst.copy_(src)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(*static)
    for dst, src in zip(static, fresh):  # the inputs the eager call saw (the capture ran nothing), then replay
        if isinstance(src, torch.Tensor):
            dst.copy_(src)
    graph.replay()
    for a, b in zip(_outputs(case, static, captured), want, strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)
