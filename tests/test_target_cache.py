"""RollbackDeepseekV4Cache: exact rollback of transformers' DeepSeek-V4 cache (sliding, CSA and HCA layers).

Comparison policy. A cache that rolled back must behave like a cache that only ever saw the accepted tokens. The rows
of the accepted tokens were, however, computed inside a longer verify forward than the reference computes them in,
and CPU GEMMs do not promise bit-identical rows for different row counts. So "rolled back vs. never saw the rejected
tokens" is compared with a tight tolerance (float32, 1e-5), while every comparison where both sides ran the very same
forwards (no crop vs. transformers' own cache, crop-then-replay of the same chunk) must be bit-exact (torch.equal).
Tiny configs use 8 indexer heads x 32 dims so the CSA indexer's top-k has no ReLU ties (SPEC §7).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DynamicCache

from dsv4_mtp_hf.target_runtime.rollback_cache import (
    CacheRollbackError,
    RollbackCSALayer,
    RollbackDeepseekV4Cache,
    RollbackHCALayer,
    RollbackSlidingLayer,
)

pytestmark = pytest.mark.tf_internals

_TF = tuple(int(x) for x in transformers.__version__.split(".")[:2])
# transformers 5.24 renamed the forward kwarg `past_key_values` -> `cache` (the old name still works, with a warning)
CACHE_KW = "cache" if _TF >= (5, 24) else "past_key_values"

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
VOCAB = 96
MAX_ROLLBACK = 6
RTOL = ATOL = 1e-5


def tiny_config() -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        head_dim=32,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        hc_mult=2,
        sliding_window=8,
        compress_rates={CSA: 4, HCA: 8},
        index_n_heads=8,
        index_head_dim=32,
        index_topk=3,
        layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        hc_sinkhorn_iters=4,
        max_position_embeddings=1024,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """Tiny matrices: intra-op threads only add spin/sync overhead (and noise on a loaded CI box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = DeepseekV4ForCausalLM(tiny_config()).to(torch.float32).eval()
    # random init leaves the sinks / position biases at trivial values: make them non-trivial
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("position_bias") or name.endswith("sinks"):
                p.normal_(0.0, 0.5)
    return m


def fwd(model, ids, cache):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **{CACHE_KW: cache}).logits


def rand_ids(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=gen)


def assert_close(actual, expected, what=""):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------------------------------------------------
def test_layers_match_config_and_global_mapping_untouched(model):
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache, DeepseekV4HCACache

    cache = RollbackDeepseekV4Cache(model.config, max_rollback=MAX_ROLLBACK)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [RollbackSlidingLayer, RollbackCSALayer, RollbackHCALayer, RollbackCSALayer]
    assert isinstance(cache, DynamicCache) and cache.is_croppable
    # importing / building our cache must not re-route transformers' own layer dispatch
    assert DYNAMIC_LAYER_TYPE_MAPPING[CSA] is DeepseekV4CSACache
    assert DYNAMIC_LAYER_TYPE_MAPPING[HCA] is DeepseekV4HCACache
    assert all(type(layer).__module__.startswith("transformers") for layer in DynamicCache(config=model.config).layers)


def test_without_crop_bit_identical_to_transformers_cache(model):
    gen = torch.Generator().manual_seed(1)
    ids = rand_ids(gen, 45)
    ours, theirs = RollbackDeepseekV4Cache(model.config, max_rollback=MAX_ROLLBACK), DynamicCache(config=model.config)
    start = 0
    for size in [13, 1, 3, 8, 1, 5, 2, 9, 1, 2]:
        chunk = ids[:, start : start + size]
        start += size
        assert torch.equal(fwd(model, chunk, ours), fwd(model, chunk, theirs))
    assert ours.get_seq_length() == theirs.get_seq_length() == start


def test_verify_accept_crop_property(model):
    """(a) random verify(k+1)/accept(n<=k)/crop rounds across many window and compression boundaries."""
    rng = random.Random(2)
    gen = torch.Generator().manual_seed(2)
    n_rounds = 0
    exact = 0
    for trial in range(5):
        ours = RollbackDeepseekV4Cache(model.config, max_rollback=MAX_ROLLBACK)
        ref = DynamicCache(config=model.config)  # transformers' own cache, only ever sees accepted tokens
        prompt = rand_ids(gen, rng.randint(1, 17))
        assert_close(fwd(model, prompt, ours), fwd(model, prompt, ref), "prefill")
        while ref.get_seq_length() < 56:
            k = rng.randint(0, MAX_ROLLBACK)  # drafts; the verify forward holds k + 1 tokens
            n = rng.randint(0, k)  # accepted drafts
            chunk = rand_ids(gen, k + 1)
            got = fwd(model, chunk, ours)[:, : n + 1]
            if rng.random() < 0.25:  # legacy absolute form
                ours.crop(ours.get_seq_length() - (k - n))
            else:  # what _assisted_decoding calls
                ours.crop(-(k - n))
            want = fwd(model, chunk[:, : n + 1], ref)
            # rows of the accepted prefix depend only on the state before this round, i.e. on the previous crop
            assert_close(got, want, f"trial {trial}, round {n_rounds} (k={k}, n={n})")
            exact += torch.equal(got, want)
            assert ours.get_seq_length() == ref.get_seq_length()
            n_rounds += 1
        # after the last crop: one more decode step must agree too
        nxt = rand_ids(gen, 1)
        assert_close(fwd(model, nxt, ours), fwd(model, nxt, ref), f"trial {trial}, final step")
    assert n_rounds > 40


def _build(model, prefix_chunks, cache):
    for chunk in prefix_chunks:
        fwd(model, chunk, cache)
    return cache


@pytest.mark.parametrize("prompt_len", [1, 5, 8, 11, 16, 23])
def test_crop_to_every_length_within_bound(model, prompt_len):
    """(b) every crop target in [T - max_rollback, T], also across the boundary of earlier chunks."""
    gen = torch.Generator().manual_seed(100 + prompt_len)
    chunks = [rand_ids(gen, prompt_len), rand_ids(gen, 2), rand_ids(gen, 1), rand_ids(gen, 4)]
    tokens = torch.cat(chunks, dim=1)
    total = tokens.shape[1]
    nxt = rand_ids(gen, 3)
    base = _build(model, chunks, RollbackDeepseekV4Cache(model.config, max_rollback=MAX_ROLLBACK))
    assert base.min_restorable_length() <= total - MAX_ROLLBACK
    for target in range(max(total - MAX_ROLLBACK, 0), total + 1):
        ours = copy.deepcopy(base)
        ours.crop(target - total)
        assert ours.get_seq_length() == target
        # reference: transformers' cache fed the same chunks, truncated at `target`
        ref, seen = DynamicCache(config=model.config), 0
        for chunk in chunks:
            part = chunk[:, : max(min(chunk.shape[1], target - seen), 0)]
            if part.shape[1]:
                fwd(model, part, ref)
            seen += chunk.shape[1]
        assert_close(fwd(model, nxt, ours), fwd(model, nxt, ref), f"crop to {target} of {total}")


@pytest.mark.parametrize("prompt_len", [3, 8, 13])
def test_crop_whole_chunk_and_replay_is_bit_exact(model, prompt_len):
    """Removing exactly the last forward and replaying it must reproduce logits and state bit for bit."""
    gen = torch.Generator().manual_seed(200 + prompt_len)
    ours = RollbackDeepseekV4Cache(model.config, max_rollback=MAX_ROLLBACK)
    fwd(model, rand_ids(gen, prompt_len), ours)
    for size in [1, 3, 6, 2, 5, 4, 6, 1]:
        chunk = rand_ids(gen, size)
        first = fwd(model, chunk, ours)
        snapshot = copy.deepcopy(ours)
        ours.crop(-size)
        again = fwd(model, chunk, ours)
        assert torch.equal(first, again)
        for a, b in zip(snapshot.layers, ours.layers):
            assert torch.equal(a.keys, b.keys) and a.cumulative_length == b.cumulative_length
            for name in getattr(a, "compressed_kv", {}):
                assert a.entry_count[name] == b.entry_count[name]
                assert torch.equal(a.compressed_kv[name], b.compressed_kv[name])
                assert torch.equal(a.buffer_kv[name], b.buffer_kv[name])
                assert torch.equal(a.buffer_gate[name], b.buffer_gate[name])
            for name in getattr(a, "overlap_kv", {}):
                assert (a.overlap_kv[name] is None) == (b.overlap_kv[name] is None)
                if a.overlap_kv[name] is not None:
                    assert torch.equal(a.overlap_kv[name], b.overlap_kv[name])
                    assert torch.equal(a.overlap_gate[name], b.overlap_gate[name])


def test_crop_beyond_bound_raises_and_leaves_cache_intact(model):
    """(c)"""
    gen = torch.Generator().manual_seed(3)
    prompt, chunk, nxt = rand_ids(gen, 30), rand_ids(gen, 4), rand_ids(gen, 2)
    ours = RollbackDeepseekV4Cache(model.config, max_rollback=MAX_ROLLBACK)
    ref = DynamicCache(config=model.config)
    for c in (prompt, chunk):
        fwd(model, c, ours)
        fwd(model, c, ref)
    with pytest.raises(CacheRollbackError, match="max_rollback"):
        ours.crop(-(MAX_ROLLBACK + 1))
    with pytest.raises(CacheRollbackError, match="max_rollback"):
        ours.crop(3)  # absolute form, far back
    with pytest.raises(CacheRollbackError, match="negative length"):
        ours.crop(-1000)
    assert ours.get_seq_length() == 34
    assert torch.equal(fwd(model, nxt, ours), fwd(model, nxt, ref))  # nothing was modified

    # history is relative to the state the crops started from: two crops can't add up to more than max_rollback
    ours.crop(-4)
    with pytest.raises(CacheRollbackError):
        ours.crop(-(MAX_ROLLBACK - 1))


def test_short_sequences_roll_back_to_zero(model):
    """Before max_rollback tokens were seen the whole history is kept, down to an empty cache."""
    gen = torch.Generator().manual_seed(4)
    ours = RollbackDeepseekV4Cache(model.config, max_rollback=MAX_ROLLBACK)
    first = rand_ids(gen, 5)
    want = fwd(model, first, ours)
    ours.crop(-5)
    assert ours.get_seq_length() == 0
    assert torch.equal(fwd(model, first, ours), want)


def test_crop_argument_forms(model):
    """(d) negative = tokens to remove; 0 = nothing; positive = absolute length (no-op when not shorter)."""
    gen = torch.Generator().manual_seed(5)
    ours = RollbackDeepseekV4Cache(model.config, max_rollback=MAX_ROLLBACK)
    fwd(model, rand_ids(gen, 21), ours)
    ours.crop(0)
    assert ours.get_seq_length() == 21
    ours.crop(50)
    assert ours.get_seq_length() == 21
    a, b = copy.deepcopy(ours), copy.deepcopy(ours)
    a.crop(-3)
    b.crop(18)
    assert a.get_seq_length() == b.get_seq_length() == 18
    nxt = rand_ids(gen, 2)
    assert torch.equal(fwd(model, nxt, a), fwd(model, nxt, b))
    # layer-level crop follows the same conventions
    layer = copy.deepcopy(ours.layers[1])
    layer.crop(-2)
    assert layer.get_seq_length() == 19


def test_reset_then_reuse(model):
    gen = torch.Generator().manual_seed(6)
    ids = rand_ids(gen, 19)
    ours = RollbackDeepseekV4Cache(model.config, max_rollback=MAX_ROLLBACK)
    want = fwd(model, ids, ours)
    ours.reset()
    assert ours.get_seq_length() == 0
    assert torch.equal(fwd(model, ids, ours), want)


def test_generate_accepts_cache(model):
    gen = torch.Generator().manual_seed(7)
    prompt = rand_ids(gen, 12)
    kwargs = dict(max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        want = model.generate(prompt, **kwargs)
        got = model.generate(
            prompt, past_key_values=RollbackDeepseekV4Cache(model.config, max_rollback=MAX_ROLLBACK), **kwargs
        )
        assert torch.equal(got, want)
        if _TF >= (5, 24):
            got = model.generate(prompt, cache=RollbackDeepseekV4Cache(model.config, max_rollback=MAX_ROLLBACK), **kwargs)
            assert torch.equal(got, want)


def test_assisted_loop_with_prompt_lookup(model):
    """transformers' own `_assisted_decoding` loop (prompt-lookup candidates, real `crop(-(k - n))` calls) on a
    target whose `_is_stateful` is lifted for this one instance (transformers <= 5.24; 5.25 dropped the flag and
    checks `cache.is_croppable` instead): greedy output must equal plain greedy decoding."""
    target = copy.copy(model)  # shallow copy: same weights, own instance __dict__
    if hasattr(type(model), "_is_stateful"):
        target._is_stateful = False  # per-instance; the class keeps `_is_stateful = True`
        assert type(model)._is_stateful and model._is_stateful
    gen = torch.Generator().manual_seed(8)
    base = rand_ids(gen, 6)
    prompt = torch.cat([base, base, base[:, :3]], dim=1)  # repetitive prompt, so prompt lookup proposes drafts
    calls = []
    cache = RollbackDeepseekV4Cache(model.config, max_rollback=8)
    real_crop = cache.crop

    def spy(n):
        calls.append(n)
        return real_crop(n)

    cache.crop = spy
    kwargs = dict(max_new_tokens=24, do_sample=False)
    with torch.no_grad():
        want = model.generate(prompt, **kwargs)
        got = target.generate(prompt, past_key_values=cache, prompt_lookup_num_tokens=4, **kwargs)
    assert torch.equal(got, want)
    assert any(c < 0 for c in calls), f"no rejected drafts were cropped: {calls}"
    with pytest.raises(ValueError, match="stateful|cache that can be cropped"):  # transformers' own cache: refused
        with torch.no_grad():
            model.generate(prompt, prompt_lookup_num_tokens=4, **kwargs)


def test_transformers_own_cache_cannot_roll_back(model):
    """Sanity check that the tests above have teeth: transformers' V4 cache fails the same rollback."""
    gen = torch.Generator().manual_seed(9)
    prompt, chunk, nxt = rand_ids(gen, 22), rand_ids(gen, 5), rand_ids(gen, 2)
    theirs, ref = DynamicCache(config=model.config), DynamicCache(config=model.config)
    fwd(model, prompt, theirs)
    fwd(model, prompt, ref)
    if hasattr(theirs, "activate_past_recording"):
        theirs.activate_past_recording()
    fwd(model, chunk, theirs)
    fwd(model, chunk[:, :1], ref)
    try:
        theirs.crop(-4)
        broken = fwd(model, nxt, theirs)
    except Exception:
        return
    assert not torch.allclose(broken, fwd(model, nxt, ref), rtol=RTOL, atol=ATOL)


def test_retained_history_is_bounded(model):
    """Extra memory must not grow with the context: at most max_rollback (+ one window) rows per stream."""
    gen = torch.Generator().manual_seed(10)
    ours = RollbackDeepseekV4Cache(model.config, max_rollback=MAX_ROLLBACK)
    fwd(model, rand_ids(gen, 40), ours)
    for size in [3, 5, 1, 7, 2]:
        fwd(model, rand_ids(gen, size), ours)
        ours.crop(-1)
    w = model.config.sliding_window
    for layer in ours.layers:
        assert layer._k_tail.shape[-2] <= w - 1 + MAX_ROLLBACK
        assert layer.keys.shape[-2] == w - 1  # what the attention sees, as in transformers
        for name in getattr(layer, "compressed_kv", {}):
            m = layer.compress_rate
            assert layer._raw_kv[name].shape[1] <= m - 1 + MAX_ROLLBACK
            assert len(layer._overlap_hist[name]) <= -(-MAX_ROLLBACK // m) + 1
