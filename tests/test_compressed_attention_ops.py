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

from dsv4_mtp_hf.ops.compressed_attention import compressed_attention, compressed_attention_reference
from dsv4_mtp_hf.ops.compressor import closing_windows, compressor_step, compressor_step_op, compressor_step_reference
from dsv4_mtp_hf.ops.indexer import indexer_topk, indexer_topk_op, indexer_topk_reference
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
    attention = (r(2, n, 16, d), r(2, n, d), r(2, 9, d), torch.tensor([3, 30], device=device), r(2, 9, d),
                 torch.tensor([[[0, -1], [0, -1], [0, -1]], [[5, 2], [7, 0], [1, 6]]], device=device), r(16), 0.3, 8, 4)
    return [(compressor_step_op, compressor), (indexer_topk_op, indexer), (hash_route_op, hashed),
            (compressed_attention, attention)]


OPS = ["compressor_step", "indexer_topk", "hash_route", "compressed_attention"]


@pytest.mark.parametrize("case", range(4), ids=OPS)
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
    op, args = _op_cases()[3]
    with pytest.raises(ValueError, match="compressed_attention: picks must be"):
        op(*args[:4], None, *args[5:-1], 0)
    with pytest.raises(ValueError, match=r"compressed_attention: ring must be \[B=2, R >= window - 1 = 7"):
        op(args[0], args[1], args[2][:, :6], *args[3:])
    with pytest.raises(ValueError, match="compressed_attention: entries go with a compression rate"):
        op(*args[:-1], 0)


def _outputs(case: int, args: list, result) -> list[torch.Tensor]:
    """What an op gives: the state it writes (compressor_step) or its results (the indexer's picks as a set: their
    order is not part of the contract)."""
    if case == 0:
        return [args[i] for i in (3, 4, 5)]
    if case == 1:
        return [result.sort(dim=-1).values]
    return list(result) if isinstance(result, tuple) else [result]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(4), ids=OPS)
def test_ops_on_cuda_equal_the_cpu_reference_and_replay_from_a_cuda_graph(case):
    """The CUDA registration against the CPU reference, eagerly and replayed from a CUDA graph (no host sync inside
    the op; the state written in place at the captured addresses)."""
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


def _attention_inputs(mode: str, b: int, n: int, context: int, dtype, device, seed: int):
    """V4-Flash's attention shapes (64 heads of 512, window 128, CSA top-512 at rate 4, HCA rate 128) at
    ``context`` tokens: random rows, a ring and entries, and picks as ``indexer_topk`` returns them."""
    g = torch.Generator().manual_seed(seed)
    h, d, w, k = 64, 512, 128, 512
    rate = {"window": 0, "hca": 128, "csa": 4}[mode]
    length = torch.tensor([context - i * 37 for i in range(b)])
    E = context // rate + 1 if rate else 0
    args = [torch.randn(b, n, h, d, generator=g), torch.randn(b, n, d, generator=g),
            torch.randn(b, w - 1 + 3, d, generator=g), length, torch.randn(b, E, d, generator=g) if rate else None]
    picks = None
    if mode == "csa":
        closed = (length.view(b, 1) + torch.arange(n) + 1) // rate
        scores = torch.rand(b, n, E, generator=g).masked_fill(torch.arange(E) >= closed[..., None], float("-inf"))
        picks = scores.topk(min(k, E), dim=-1).indices
        picks = torch.where(picks < closed[..., None], picks, -1)
    sinks = torch.randn(h, generator=g)
    to = [t if t is None else t.to(device, dtype if t.is_floating_point() else t.dtype) for t in args]
    return [*to, None if picks is None else picks.to(device), sinks.to(device), d ** -0.5, w, rate]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["window", "hca", "csa"])
@pytest.mark.parametrize("n, context", [(1, 100), (4, 130), (6, 20000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compressed_attention_kernel_is_the_reference_at_v4_shapes(mode, n, context, dtype):
    """The Triton kernel (every element written: the output is poisoned first) against the fp32 reference, one and
    two sequences, short and long contexts (its keys split over programs and combined), and replayed from a CUDA
    graph with new inputs."""
    from dsv4_mtp_hf.ops.triton.compressed_attention_triton import compressed_attention_triton

    seed = SEED + n + context
    print(f"seed={seed}")
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for b in (1, 2):
        args = _attention_inputs(mode, b, n, context, dtype, "cuda", seed)
        want = compressed_attention_reference(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                                for a in args])
        out = torch.full_like(args[0], float("nan"))
        torch.testing.assert_close(compressed_attention_triton(*args, out=out).float(), want, **tol)
        torch.testing.assert_close(compressed_attention(*args).float(), want, **tol)
    static = _attention_inputs(mode, 1, n, context, dtype, "cuda", seed + 1)
    compressed_attention(*static)  # warm-up (and the split's tickets) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compressed_attention(*static)
    fresh = _attention_inputs(mode, 1, n, context, dtype, "cuda", seed + 2)
    for dst, src in zip(static, fresh):
        if torch.is_tensor(dst):
            dst.copy_(src)
    graph.replay()
    want = compressed_attention_reference(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                            for a in fresh])
    torch.testing.assert_close(captured.float(), want, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("d, rate, overlap", [(512, 4, True), (128, 4, True), (512, 128, False)],
                         ids=["csa", "indexer", "hca"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compressor_kernel_is_the_reference_at_v4_shapes(d, rate, overlap, dtype):
    """The CUDA kernels against the reference on the same device, V4-Flash's streams, steps of 1..4 rows at lengths
    that close no window, one, or (CSA) two, for two sequences at once: the rings and every real entry equal."""
    seed = SEED + d + rate
    print(f"seed={seed}")
    g = torch.Generator().manual_seed(seed)
    c, ring = (2 * d if overlap else d), (2 * rate if overlap else rate) - 1 + K
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for n in range(1, K + 2):
        for start in (rate - n, rate * 3 - 1, rate * 5 + 1):
            length = torch.tensor([max(start, 0), max(start, 0) + rate], device="cuda")
            nw = (rate - 1 + n) // rate
            r = lambda *s: torch.randn(*s, generator=g).to("cuda", dtype)  # noqa: E731
            args = [r(2, n, c), r(2, n, c), length, r(2, ring, c), r(2, ring, c), r(2, 12, d),
                    torch.randn(rate, c, generator=g).cuda(), torch.randn(d, generator=g).cuda(),
                    r(2, nw, 32).float(), r(2, nw, 32).float(), rate, overlap, 1e-6]
            want = [t.clone() for t in args[3:6]]
            compressor_step_reference(*args[:3], *want, *args[6:])
            compressor_step(*args)
            for got, ref in zip(args[3:6], want):
                torch.testing.assert_close(got[:, :11], ref[:, :11], **tol)  # the spare (index 11) is scratch


@pytest.mark.gpu
@pytest.mark.parametrize("n, context", [(1, 100), (6, 20000)])
def test_indexer_kernel_picks_the_reference_entries_at_v4_shapes(n, context):
    """V4-Flash's indexer (64 heads of 128, top-512 at rate 4) from bf16 queries and entries: the CUDA path picks
    the entries the reference picks (the same set per row, ``-1`` for none)."""
    seed = SEED + n
    print(f"seed={seed}")
    g = torch.Generator().manual_seed(seed)
    E = context // 4 + 1
    q, entries = torch.randn(2, n, 64, 128, generator=g), torch.randn(2, E, 128, generator=g)
    weights = torch.randn(2, n, 64, generator=g)
    positions = torch.tensor([[context - 9], [context // 3]]) + torch.arange(n)
    args = [t.to("cuda", torch.bfloat16) for t in (q, entries, weights)] + [positions.cuda(), 4, 512, 128 ** -0.5, 0.125]
    got = indexer_topk(*args).sort(dim=-1).values
    want = indexer_topk_reference(*args).sort(dim=-1).values
    assert torch.equal(got, want)
