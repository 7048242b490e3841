"""Batched speculative decoding (`speculative_generate`): B ragged sequences, per-sequence
acceptance and rollback, identical to per-sequence greedy generation."""

import pytest
import torch

from dsv4_mtp_hf import load_demo_pair
from dsv4_mtp_hf.cache import PagedMtpKVCache
from dsv4_mtp_hf.generation import mtp_decoding, speculative_generate
from dsv4_mtp_hf.target_runtime.ragged import RaggedTargetForward

from .helpers import tiny_pair
from .test_generation import _chi2_pvalue
from .test_demo_pair import SNIPPET


def prompts(seed, lengths, vocab=320):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def plain(target, p, n, **kw):
    kw.setdefault("eos_token_id", None)
    return target.generate(p[None], max_new_tokens=n, do_sample=False, **kw)[0, p.numel():]


@pytest.mark.tf_internals
@pytest.mark.parametrize("k", [1, 3])
def test_batched_greedy_equals_per_sequence_greedy(k):
    """Sliding, CSA (rate 4) and HCA (rate 8) layers with an 8-token window; prompts of 5,
    11 and 23 tokens: every sequence crosses compression boundaries at its own steps."""
    target, mtp = tiny_pair(seed=20 + k)
    ps = prompts(k, (5, 11, 23))
    out = speculative_generate(target, mtp, ps, max_new_tokens=50, num_assistant_tokens=k, eos_token_id=[])
    for i, p in enumerate(ps):
        assert torch.equal(out.new_tokens[i], plain(target, p, 50)), i
        assert out.stats[i].new_tokens == 50 and out.stats[i].num_assistant_tokens == k
    assert out.sequences.shape == (3, 23 + 50)


@pytest.mark.tf_internals
def test_batch_keeps_per_sequence_acceptance_of_the_single_sequence_path():
    """The trained demo pair accepts ~3 tokens per round.  Per sequence, the batch drafts and
    accepts exactly what `target.generate(assistant_model=mtp)` does for that sequence alone
    -- the MTP's rows are recomputed at the right positions with the right residuals -- and
    the outputs equal plain greedy."""
    target, mtp, tok = load_demo_pair()
    x = tok(SNIPPET, return_tensors="pt", add_special_tokens=False).input_ids[0]
    ps = [x[:n] for n in (20, 45, 70, 33)]
    out = speculative_generate(target, mtp, ps, max_new_tokens=32, num_assistant_tokens=3, eos_token_id=[])
    total_rounds = total_accepted = 0
    for i, p in enumerate(ps):
        assert torch.equal(out.new_tokens[i], plain(target, p, 32)), i
        target.generate(p[None], assistant_model=mtp, num_assistant_tokens=3, max_new_tokens=32, do_sample=False,
                        eos_token_id=None)
        alone = mtp.last_generation_stats
        got = out.stats[i]
        assert (got.rounds, got.drafted, got.accepted) == (alone.rounds, alone.drafted, alone.accepted), i
        total_rounds += got.rounds
        total_accepted += got.accepted
    assert (total_accepted + total_rounds) / total_rounds > 1.8


@pytest.mark.tf_internals
def test_eos_finishes_sequences_at_different_rounds():
    target, mtp = tiny_pair(seed=31)
    ps = prompts(31, (7, 12, 9))
    free_run = [plain(target, p, 40) for p in ps]
    eos = int(free_run[1][6])  # a token the second sequence emits early
    out = speculative_generate(target, mtp, ps, max_new_tokens=40, num_assistant_tokens=3, eos_token_id=eos, pad_token_id=2)
    lengths = set()
    for i, p in enumerate(ps):
        want = plain(target, p, 40, eos_token_id=eos, pad_token_id=2)
        want = want[: (want == eos).nonzero()[0, 0] + 1] if (want == eos).any() else want
        assert torch.equal(out.new_tokens[i], want), i
        lengths.add(out.new_tokens[i].numel())
        row = out.sequences[i, p.numel():]
        assert torch.equal(row[: want.numel()], want) and bool((row[want.numel():] == 2).all())
    assert len(lengths) > 1  # the sequences did finish at different times


@pytest.mark.tf_internals
def test_padded_tensor_input_small_prefill_groups_and_chunks():
    """Left- and right-padded rows give what the unpadded prompts give; prefill split over
    several target forwards and MTP chunks changes nothing."""
    target, mtp = tiny_pair(seed=41)
    ps = prompts(41, (9, 4, 14))
    ref = speculative_generate(target, mtp, ps, max_new_tokens=30, num_assistant_tokens=2, eos_token_id=[])
    for side in ("left", "right"):
        ids = torch.full((3, 14), 2, dtype=torch.long)
        mask = torch.zeros(3, 14, dtype=torch.long)
        for i, p in enumerate(ps):
            sl = slice(14 - p.numel(), 14) if side == "left" else slice(0, p.numel())
            ids[i, sl], mask[i, sl] = p, 1
        out = speculative_generate(target, mtp, ids, attention_mask=mask, max_new_tokens=30, num_assistant_tokens=2,
                                   eos_token_id=[], prefill_tokens=10, prefill_chunk=4)
        for i in range(3):
            assert torch.equal(out.new_tokens[i], ref.new_tokens[i]), (side, i)
            assert out.stats[i].as_dict() == ref.stats[i].as_dict(), (side, i)
            assert torch.equal(out.sequences[i, :14], ids[i])  # prompt rows come back as given


@pytest.mark.tf_internals
def test_ragged_target_forward_equals_the_model_forward_per_sequence():
    target, _ = tiny_pair(seed=5)
    runner = RaggedTargetForward(target)
    ps = prompts(5, (6, 13))
    caches = [runner.new_cache(max_rollback=4) for _ in ps]
    logits, residual, offsets = runner(ps, caches)
    for i, p in enumerate(ps):
        want = target(p[None]).logits[0]
        got = logits[offsets[i] : offsets[i + 1]]
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()
        assert caches[i].get_seq_length() == p.numel()
    assert residual.shape == (19, target.config.hc_mult, target.config.hidden_size)
    with pytest.raises(ValueError, match="one cache per chunk"):
        runner(ps, caches[:1])


def test_ragged_paged_append_stores_only_real_rows_of_the_selected_sequences():
    d = 4
    cache = PagedMtpKVCache(sliding_window=4, head_dim=d, batch_size=3, max_draft_tokens=2, page_size=2)
    base = torch.randn(3, 5, d)
    cache.update(base)  # every sequence at length 5
    kv = torch.randn(2, 3, d)
    with cache.ragged(rows=torch.tensor([2, 0]), num_new=torch.tensor([1, 3])):
        keys, pos = cache.update(kv)
    assert cache.seq_lengths.tolist() == [8, 5, 6]
    assert keys.shape == (2, 3 + 3, d) and pos[0, 3:].tolist() == [5, 6, 7]
    # the real rows were written, the padding row of sequence 2 was not
    page, row = cache._rows(torch.tensor([[5, 6, 7], [5, 6, 7]]), cache.block_table[[0, 2]])
    stored = cache.pool[page, row]
    assert torch.equal(stored[0], kv[1])
    assert torch.equal(stored[1, 0], kv[0, 0])
    assert not stored[1, 1:].any()  # never-written ring slots stay zero
    with pytest.raises(ValueError, match="exceeds"):
        with cache.ragged(rows=torch.tensor([1]), num_new=torch.tensor([4])):
            cache.update(torch.randn(1, 3, d))
    cache.free(1)
    with pytest.raises(ValueError, match="freed"):
        with cache.ragged(rows=torch.tensor([1])):
            pass


def test_bad_input_names_the_problem():
    target, mtp = tiny_pair(seed=1)
    p = prompts(1, (5,))
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(target, mtp, p, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        speculative_generate(target, mtp, p, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="num_assistant_tokens"):
        speculative_generate(target, mtp, p, num_assistant_tokens=0)
    with pytest.raises(ValueError, match="drafts per round"):
        speculative_generate(target, mtp, p, num_assistant_tokens=mtp.config.max_draft_tokens + 2)
    with pytest.raises(ValueError, match="holes"):
        speculative_generate(target, mtp, torch.ones(1, 4, dtype=torch.long) * 5,
                             attention_mask=torch.tensor([[1, 0, 1, 1]]))
    with pytest.raises(ValueError, match="empty"):
        speculative_generate(target, mtp, [torch.tensor([], dtype=torch.long)])
    with pytest.raises(ValueError, match="vocab_size"):
        speculative_generate(target, mtp, [torch.tensor([5, 9999])])
    other, _ = tiny_pair(seed=2)
    with pytest.raises(ValueError, match="bind"):
        speculative_generate(other, mtp, p)


@pytest.mark.tf_internals
def test_batched_speculative_sampling_matches_plain_sampling_in_distribution():
    """600 copies of one prompt in one batch: the first three tokens are distributed as
    plain sampling's (temperature and top-k applied alike to drafts and verifier)."""
    vocab = 16
    target, mtp = tiny_pair(seed=5, target_overrides=dict(vocab_size=vocab, num_hidden_layers=2,
                                                           layer_types=["sliding_attention", "compressed_sparse_attention"],
                                                           mlp_layer_types=["moe", "moe"]))
    ids = torch.randint(3, vocab, (1, 6), generator=torch.Generator().manual_seed(5))
    n, kw = 600, dict(temperature=1.3, top_k=10)
    target.generation_config.eos_token_id = None  # no EOS masking or stopping on either side
    torch.manual_seed(0)
    plain = target.generate(ids.expand(n, -1), do_sample=True, max_new_tokens=3, **kw)[:, -3:]
    out = speculative_generate(target, mtp, [ids[0]] * n, do_sample=True, max_new_tokens=3, num_assistant_tokens=2,
                               eos_token_id=[], generator=torch.Generator().manual_seed(3), **kw)
    spec = torch.stack(out.new_tokens)
    drafted, accepted = sum(s.drafted for s in out.stats), sum(s.accepted for s in out.stats)
    assert accepted > 0.15 * drafted  # the accept path is exercised, and the reject path too:
    assert accepted < drafted
    for i in range(3):
        assert _chi2_pvalue(plain[:, i], spec[:, i], vocab) > 1e-3, f"token {i} distribution differs"


def test_speculative_sampling_step_reproduces_the_target_distribution():
    """One draft drawn from q, verified against p (:func:`round.accept`, the rule every driver applies, here for
    n rounds at once): the emitted token is distributed as p (accept with min(1, p/q), else resample from
    max(p - q, 0)), whatever q is."""
    from transformers import LogitsProcessorList

    from dsv4_mtp_hf.generation import round as rounds

    g = torch.Generator().manual_seed(0)
    v, n = 8, 20000
    p = torch.rand(2, v, generator=g) ** 3
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(v, generator=g) ** 3
    q = q / q.sum()
    drafts = torch.multinomial(q, n, replacement=True, generator=g)[:, None]
    accepted, selected = rounds.accept(drafts, p.log().expand(n, -1, -1), q.log().expand(n, 1, -1),
                                       LogitsProcessorList(), torch.Generator().manual_seed(1))
    first = torch.where(accepted == 1, drafts[:, 0], selected[:, 0])
    assert torch.equal(selected[accepted == 1, 0], drafts[accepted == 1, 0])
    assert 0 < int(accepted.sum()) < n  # both accepted and resampled drafts
    counts = torch.bincount(first, minlength=v).double()
    expected = p[0].double() * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    pvalue = 1 - float(torch.distributions.Chi2(torch.tensor(float(v - 1))).cdf(torch.tensor(stat)))
    assert pvalue > 1e-3, (counts / n, p[0])


@pytest.mark.tf_internals
def test_generate_custom_generate_hook_runs_the_batched_loop():
    """`target.generate(custom_generate=mtp_decoding, mtp=mtp)`: generate's own input and
    config handling, our loop; generate's output layout; clear errors for what it cannot honour."""
    target, mtp = tiny_pair(seed=3)
    ps = prompts(3, (5, 9))
    ids, mask = torch.full((2, 9), 2), torch.zeros(2, 9, dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, 9 - p.numel():], mask[i, 9 - p.numel():] = p, 1
    out = target.generate(ids, attention_mask=mask, custom_generate=mtp_decoding, mtp=mtp, num_assistant_tokens=2,
                          max_new_tokens=12, do_sample=False)
    ref = speculative_generate(target, mtp, ids, attention_mask=mask, max_new_tokens=12, num_assistant_tokens=2,
                               eos_token_id=target.generation_config.eos_token_id, pad_token_id=2)
    assert torch.equal(out, ref.sequences)
    for i, p in enumerate(ps):
        alone = target.generate(p[None], max_new_tokens=12, do_sample=False)[0, p.numel():]
        assert torch.equal(out[i, 9 : 9 + alone.numel()], alone)
    with pytest.raises(ValueError, match="RepetitionPenalty"):
        target.generate(ids, attention_mask=mask, custom_generate=mtp_decoding, mtp=mtp, max_new_tokens=4,
                        repetition_penalty=1.3)
    with pytest.raises(ValueError, match="pass the draft"):
        target.generate(ids, attention_mask=mask, custom_generate=mtp_decoding, max_new_tokens=4)
