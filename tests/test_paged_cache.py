"""The paged MTP KV cache: ragged per-sequence lengths and rollback, bounded pool, freeing."""

import pytest
import torch

from dsv4_mtp_hf import PagedMtpKVCache

from .helpers import tiny_pair


SEED = 6


@pytest.fixture(autouse=True)
def _seeded():
    """Draws from torch's global generator are seeded here (replay a failure with this seed)."""
    print(f"seed={SEED}")
    torch.manual_seed(SEED)


def step_inputs(mtp, b, s, gen):
    ids = torch.randint(0, mtp.config.vocab_size, (b, s), generator=gen)
    hs = torch.randn(b, s, mtp.config.hc_mult, mtp.config.hidden_size, generator=gen)
    return ids, hs


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_ragged_rollback_matches_one_contiguous_cache_per_sequence(page_size):
    _, mtp = tiny_pair(max_draft_tokens=4)
    b = 3
    gen = torch.Generator().manual_seed(page_size)
    paged = mtp.new_cache(paged=True, batch_size=b, page_size=page_size)
    singles = [mtp.new_cache() for _ in range(b)]
    with torch.no_grad():
        for step in range(14):
            s = 11 if step == 0 else 1 + step % 4  # a prefill, then draft-sized steps
            ids, hs = step_inputs(mtp, b, s, gen)
            got = mtp(ids, hs, past_key_values=paged).logits
            for i in range(b):
                want = mtp(ids[i : i + 1], hs[i : i + 1], past_key_values=singles[i]).logits
                torch.testing.assert_close(got[i : i + 1], want, rtol=1e-5, atol=1e-5)
            if step:  # per-sequence acceptance: each sequence keeps a different number of rows
                keep = torch.tensor([torch.randint(0, s + 1, (1,), generator=gen).item() for _ in range(b)])
                new_len = paged.seq_lengths - s + keep
                paged.truncate(new_len)
                for i in range(b):
                    singles[i].truncate(int(new_len[i]))
    assert len(set(paged.seq_lengths.tolist())) > 1  # the batch really is ragged
    assert paged.pool.shape[0] == b * paged.pages_per_sequence  # memory never grew


def test_pool_exhaustion_is_a_clear_error_and_freeing_returns_pages():
    cache = PagedMtpKVCache(sliding_window=8, head_dim=16, batch_size=2, max_draft_tokens=2, page_size=4,
                            num_pages=2 * 4)
    assert cache.pages_per_sequence == 4
    with pytest.raises(RuntimeError, match="pool exhausted"):
        cache.add_sequence()
    cache.update(torch.randn(2, 3, 16))
    cache.free(0)
    with pytest.raises(ValueError, match="active"):
        cache.update(torch.randn(2, 1, 16))
    with pytest.raises(ValueError, match="already freed"):
        cache.free(0)
    assert cache.add_sequence() == 2 and cache.seq_lengths.tolist() == [0, 3, 0]


def test_crop_is_bounded_by_the_ring_and_validated():
    cache = PagedMtpKVCache(sliding_window=8, head_dim=4, batch_size=2, max_draft_tokens=3, page_size=2)
    for _ in range(30):
        cache.update(torch.randn(2, 1, 4))
    cache.truncate(torch.tensor([27, 30]))
    assert cache.seq_lengths.tolist() == [27, 30]
    cache.crop(-2)
    assert cache.seq_lengths.tolist() == [25, 28]
    cache.crop(0)  # transformers' convention: removes nothing
    assert cache.seq_lengths.tolist() == [25, 28]
    with pytest.raises(ValueError, match="max_draft_tokens"):
        cache.truncate(torch.tensor([25, 10]))
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(torch.tensor([26, 28]))


def test_graphed_drafter_eager_steps_match_the_contiguous_cache():
    from dsv4_mtp_hf.generation.mtp_graph import GraphedDrafter

    _, mtp = tiny_pair(max_draft_tokens=4)
    gen = torch.Generator().manual_seed(0)
    ids, hs = step_inputs(mtp, 2, 9, gen)
    paged = mtp.new_cache(paged=True, batch_size=2)
    drafter = GraphedDrafter(mtp, paged, num_drafts=4)
    with torch.no_grad():
        mtp(ids[:, :-1], hs[:, :-1], past_key_values=paged)
        drafter.tokens.copy_(ids[:, -1:])
        drafter.residual.copy_(hs[:, -1:])
        drafts, logits = drafter.run_eager()
        for i in range(2):  # the same recursion, by hand, on a contiguous cache
            cache = mtp.new_cache()
            mtp(ids[i : i + 1, :-1], hs[i : i + 1, :-1], past_key_values=cache)
            tok, res = ids[i : i + 1, -1:], hs[i : i + 1, -1:]
            for k in range(3):
                out = mtp(tok, res, past_key_values=cache)
                torch.testing.assert_close(logits[i, k], out.logits[0, -1], rtol=1e-5, atol=1e-5)
                tok, res = out.logits[:, -1].argmax(-1, keepdim=True), out.residual
                assert int(drafts[i, k]) == int(tok)
    assert paged.seq_lengths.tolist() == [11, 11]
    with pytest.raises(RuntimeError, match="capture"):
        drafter(ids[:, -1:], hs[:, -1:])
    with pytest.raises(TypeError, match="PagedMtpKVCache"):
        GraphedDrafter(mtp, mtp.new_cache(), 2)
    with pytest.raises(ValueError, match="num_drafts"):
        GraphedDrafter(mtp, paged, 6)


@pytest.mark.gpu
def test_graphed_drafter_replay_equals_eager_on_cuda():
    from dsv4_mtp_hf.generation.mtp_graph import GraphedDrafter

    # sizes the Triton FP4 MoE tiles (the reference MoE synchronises and cannot be captured)
    target, mtp = tiny_pair(max_draft_tokens=4, target_overrides=dict(hidden_size=256, moe_intermediate_size=256))
    target, mtp = target.cuda(), mtp.cuda()
    gen = torch.Generator().manual_seed(1)
    ids, hs = step_inputs(mtp, 2, 12, gen)
    ids, hs = ids.cuda(), hs.cuda()
    paged = mtp.new_cache(paged=True, batch_size=2)
    with torch.no_grad():
        mtp(ids[:, :-2], hs[:, :-2], past_key_values=paged)
    drafter = GraphedDrafter(mtp, paged, num_drafts=4)
    drafter.tokens.copy_(ids[:, -2:-1])
    drafter.residual.copy_(hs[:, -2:-1])
    drafter.capture()
    lengths = paged.seq_lengths.clone()
    for step in (-2, -1):  # two replays from different inputs
        paged.seq_lengths.copy_(lengths)
        drafter.tokens.copy_(ids[:, step:][:, :1])
        drafter.residual.copy_(hs[:, step:][:, :1])
        want_d, want_l = drafter.run_eager()
        paged.seq_lengths.copy_(lengths)
        got_d, got_l = drafter(ids[:, step:][:, :1], hs[:, step:][:, :1])
        torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-5)
        assert torch.equal(got_d, want_d)


def _round_case(device, sizes=None):
    """A paged cache holding 9 rows, and a round's inputs: 3 verified rows (ids, residual)."""
    target, mtp = tiny_pair(max_draft_tokens=4, target_overrides=sizes)
    target, mtp = target.to(device), mtp.to(device)
    gen = torch.Generator().manual_seed(SEED + 1)
    print(f"seed={SEED + 1}")
    ids, hs = step_inputs(mtp, 1, 12, gen)
    ids, hs = ids.to(device), hs.to(device)
    paged = mtp.new_cache(paged=True, batch_size=1)
    with torch.no_grad():
        mtp(ids[:, :9], hs[:, :9], past_key_values=paged)
    return mtp, paged, ids[:, 9:], hs[:, 9:]


@pytest.mark.parametrize("steps", [2, 0], ids=["K=3", "K=1"])
def test_round_is_the_catch_up_forward_then_the_draft_steps(steps):
    """`GraphedDrafter.round` (eager here) = the plain forward over the verified rows, its greedy draft, then
    the chained draft steps (none for K = 1), on the same cache."""
    from dsv4_mtp_hf.generation.mtp_graph import GraphedDrafter

    mtp, paged, ids, hs = _round_case("cpu")
    ids, hs = ids[:, : steps + 2], hs[:, : steps + 2]  # the most verified rows a round of K = steps + 1 has
    lengths = paged.seq_lengths.clone()
    drafter = GraphedDrafter(mtp, paged, num_drafts=steps + 1)
    drafter.use_graph = False
    with torch.no_grad():
        got_d, got_l = drafter.round(ids, hs)
        got_len = paged.seq_lengths.clone()
        paged.seq_lengths.copy_(lengths)
        out = mtp(ids, hs, past_key_values=paged, logits_to_keep=1)
        tok, res, want_d, want_l = out.logits[:, -1].argmax(-1, keepdim=True), out.residual[:, -1:], [], []
        want_d.append(tok)
        want_l.append(out.logits[:, -1].float())
        for _ in range(steps):
            tok, logits, res = mtp.draft_step(tok, res, paged)
            want_d.append(tok)
            want_l.append(logits.float())
    assert torch.equal(got_d, torch.cat(want_d, dim=1))
    torch.testing.assert_close(got_l, torch.stack(want_l, dim=1))
    assert torch.equal(got_len, paged.seq_lengths) and int(got_len) == 9 + ids.shape[1] + steps
    with pytest.raises(ValueError, match="verified rows"):
        drafter.round(ids[:, :0], hs[:, :0])
    if not steps:
        with pytest.raises(ValueError, match="only replays whole rounds"):
            drafter.capture()


@pytest.mark.gpu
@pytest.mark.parametrize("compile,steps", [(False, 2), (True, 2), (True, 0)],
                         ids=["uncompiled", "compiled", "compiled K=1"])
def test_round_graphs_replay_their_eager_rounds_on_cuda(compile, steps):
    from dsv4_mtp_hf.generation.mtp_graph import GraphedDrafter

    mtp, paged, ids, hs = _round_case("cuda", dict(hidden_size=256, moe_intermediate_size=256))
    lengths = paged.seq_lengths.clone()
    drafter = GraphedDrafter(mtp, paged, num_drafts=steps + 1, compile=compile)
    big = min(3, steps + 2)
    for rows in (big, 1, big):  # a graph per row count, the first one replayed again
        paged.seq_lengths.copy_(lengths)
        drafter.round_ids[:, :rows].copy_(ids[:, :rows])
        drafter.round_residual[:, :rows].copy_(hs[:, :rows])
        want_d, want_l = drafter.run_round_eager(rows)
        want_d, want_l, want_len = want_d.clone(), want_l.clone(), paged.seq_lengths.clone()
        paged.seq_lengths.copy_(lengths)
        got_d, got_l = drafter.round(ids[:, :rows], hs[:, :rows])
        torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-5)
        assert torch.equal(got_d, want_d) and torch.equal(paged.seq_lengths, want_len)
    assert sorted(drafter.round_graphs) == [1, big]


def _sampled_round_reference(mtp, paged, lengths, ids, hs, drafts, warpers):
    """The processed logits a sampled round must hand back for its ``drafts``: the plain forward over the
    verified rows, then a draft step per draft fed that draft, each warped."""
    from dsv4_mtp_hf.generation.sampling import warp

    paged.seq_lengths.copy_(lengths)
    out = mtp(ids, hs, past_key_values=paged, logits_to_keep=1)
    want, res = [warp(warpers, out.logits[:, -1])], out.residual[:, -1:]
    for j in range(drafts.shape[1] - 1):
        _, logits, res = mtp.draft_step(drafts[:, j : j + 1], res, paged)
        want.append(warp(warpers, logits))
    return torch.stack(want, dim=1)


def _first_draft_fits(firsts, q0):
    """The first drafts of many rounds from one cache state follow ``softmax(q0)`` (chi-square)."""
    probs = q0.softmax(-1).double().cpu()
    counts = torch.bincount(torch.tensor(firsts), minlength=probs.numel()).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a draft the processed distribution forbids"
    expected = probs[keep] * len(firsts)
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    pvalue = 1 - float(torch.distributions.Chi2(torch.tensor(float(int(keep.sum()) - 1))).cdf(torch.tensor(stat)))
    assert pvalue > 1e-3, (counts, probs[keep])


def _sampled_rounds(mtp, drafter, paged, ids, hs, warpers, checked, **tolerance):
    """300 rounds from one cache state: each round's shapes, the q of the rounds in ``checked`` against the
    eager recomputation for the drafts they drew, then the first drafts' fit to q."""
    lengths, firsts, steps = paged.seq_lengths.clone(), [], drafter.steps
    with torch.no_grad():
        for trial in range(300):
            paged.seq_lengths.copy_(lengths)
            drafts, q = drafter.round(ids, hs)
            firsts.append(int(drafts[0, 0]))
            assert drafts.shape == (1, steps + 1) and q.shape == (1, steps + 1, mtp.config.vocab_size)
            if trial in checked:
                drafts, q = drafts.clone(), q.clone()
                want = _sampled_round_reference(mtp, paged, lengths, ids, hs, drafts, warpers)
                torch.testing.assert_close(q, want, **tolerance)
    _first_draft_fits(firsts, q[0, 0])


def _warpers():
    from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    return LogitsProcessorList([TemperatureLogitsWarper(0.3), TopKLogitsWarper(4)])


@pytest.mark.parametrize("steps", [2, 0], ids=["K=3", "K=1"])
def test_a_sampled_round_draws_from_the_processed_distribution_it_hands_back(steps):
    """`sampled=True` (eager here): every draft is drawn from the warped MTP distribution at its prefix, and that
    processed distribution is what the round returns -- the q that makes speculative sampling exact."""
    from dsv4_mtp_hf.generation.mtp_graph import GraphedDrafter

    mtp, paged, ids, hs = _round_case("cpu")
    ids, hs, warpers = ids[:, : steps + 2], hs[:, : steps + 2], _warpers()
    drafter = GraphedDrafter(mtp, paged, num_drafts=steps + 1, sampled=True, warpers=warpers)
    drafter.use_graph = False
    _sampled_rounds(mtp, drafter, paged, ids, hs, warpers, checked=(0, 1, 2))
    with pytest.raises(ValueError, match="graph-safe"):
        from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

        GraphedDrafter(mtp, paged, num_drafts=steps + 1, sampled=True, warpers=[RepetitionPenaltyLogitsProcessor(1.1)])


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [2, 0], ids=["K=3", "K=1"])
def test_sampled_round_graphs_draw_afresh_at_every_replay_on_cuda(steps):
    """The sampled round graph's RNG advances at each replay: its first drafts from one cache state follow the
    processed distribution, and each replay's q is the eager recomputation's for the drafts it drew."""
    from dsv4_mtp_hf.generation.mtp_graph import GraphedDrafter

    mtp, paged, ids, hs = _round_case("cuda", dict(hidden_size=256, moe_intermediate_size=256))
    ids, hs, warpers = ids[:, : steps + 2], hs[:, : steps + 2], _warpers()
    drafter = GraphedDrafter(mtp, paged, num_drafts=steps + 1, compile=True, sampled=True, warpers=warpers)
    _sampled_rounds(mtp, drafter, paged, ids, hs, warpers, checked=(1, 101, 201), rtol=1e-4, atol=1e-4)
    assert len(drafter.round_graphs) == 1


# -- dsv4_mtp::paged_kv_update: the ring read + write as one op --------------------------------------


def update_inputs(b, s, d, page_size, pages_per_seq, gen, device="cpu", dtype=torch.bfloat16, pool_dtype=None):
    num_pages = b * pages_per_seq + 3
    pool = torch.randn(num_pages, page_size, d, generator=gen).to(device=device, dtype=pool_dtype or dtype)
    table = torch.randperm(num_pages, generator=gen)[: b * pages_per_seq].view(b, pages_per_seq).to(device)
    lengths = torch.randint(0, 40, (b,), generator=gen).to(device)  # some sequences shorter than the history
    kv = torch.randn(b, s, d, generator=gen).to(device=device, dtype=dtype)
    return pool, table, lengths, kv


def naive_update(pool, table, lengths, kv, hist, capacity):
    """Row by row, as the ring is defined: read the held rows, then write the new ones."""
    pool = pool.clone()
    page_size = pool.shape[1]
    b, s, d = kv.shape
    keys, positions = kv.new_empty(b, hist + s, d), lengths.new_empty(b, hist + s)

    def at(bi, p):
        slot = p % capacity
        return int(table[bi, slot // page_size]), slot % page_size

    for bi in range(b):
        n = int(lengths[bi])
        for j in range(hist):
            p = n - hist + j
            keys[bi, j] = pool[at(bi, max(p, 0))].to(kv.dtype)
            positions[bi, j] = p if p >= 0 else -(1 << 40)
        for i in range(s):
            keys[bi, hist + i], positions[bi, hist + i] = kv[bi, i], n + i
        for i in range(max(0, s - capacity), s):
            pool[at(bi, n + i)] = kv[bi, i].to(pool.dtype)
    return pool, keys, positions


CASES = [(1, 1, 16, 10, 127), (3, 5, 4, 6, 7), (2, 40, 4, 6, 7), (2, 3, 4, 6, 20)]  # b, s, page_size, pages, hist


@pytest.mark.parametrize("b,s,page_size,pages,hist", CASES)
def test_update_op_reads_and_writes_the_ring(b, s, page_size, pages, hist):
    from dsv4_mtp_hf.ops.paged_cache import paged_kv_update_op

    gen = torch.Generator().manual_seed(b * 100 + s)
    pool, table, lengths, kv = update_inputs(b, s, 64, page_size, pages, gen, pool_dtype=torch.float32)
    want_pool, want_keys, want_pos = naive_update(pool, table, lengths, kv, hist, pages * page_size)
    keys, pos = paged_kv_update_op(pool, table, lengths, kv, hist, pages * page_size)
    assert torch.equal(keys, want_keys) and torch.equal(pos, want_pos) and torch.equal(pool, want_pool)


def test_update_op_rejects_bad_inputs():
    from dsv4_mtp_hf.ops.paged_cache import paged_kv_update_op

    pool, table, lengths, kv = update_inputs(2, 3, 64, 4, 6, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="capacity"):
        paged_kv_update_op(pool, table, lengths, kv, 7, 23)
    with pytest.raises(ValueError, match="history"):
        paged_kv_update_op(pool, table, lengths, kv, 24, 24)
    with pytest.raises(ValueError, match="kv"):
        paged_kv_update_op(pool, table, lengths, kv[..., :32], 7, 24)
    with pytest.raises(ValueError, match="seq_lengths"):
        paged_kv_update_op(pool, table, lengths[:1], kv, 7, 24)


def test_compiled_update_keeps_the_pool_write_in_place():
    """Under torch.compile the op's declared write stays in place (no functionalised copy of
    the pool): the cache's own pool and lengths move as in the eager update."""
    gen = torch.Generator().manual_seed(1)
    caches = [PagedMtpKVCache(8, 64, batch_size=2, max_draft_tokens=4, page_size=4, dtype=torch.bfloat16)
              for _ in range(2)]
    pool = torch.randn(caches[0].pool.shape, generator=gen)
    for c in caches:
        c.pool.copy_(pool)
        c.seq_lengths.copy_(torch.tensor([5, 13]))
    kv = torch.randn(2, 3, 64, generator=gen).bfloat16()

    def step(cache, kv):
        keys, pos = cache.update(kv)
        return keys.float().sum(-1), pos

    want = step(caches[0], kv)
    got = torch.compile(step, fullgraph=True)(caches[1], kv)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert torch.equal(caches[0].pool, caches[1].pool) and torch.equal(caches[0].seq_lengths, caches[1].seq_lengths)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device with `pytest -m gpu`)")
@pytest.mark.parametrize("b,s", [(1, 1), (16, 4), (4, 300)])
def test_update_kernel_on_cuda_and_in_a_graph(b, s):
    from dsv4_mtp_hf.ops.paged_cache import paged_kv_update_op

    gen = torch.Generator().manual_seed(b + s)
    pool, table, lengths, kv = update_inputs(b, s, 512, 16, 10, gen, device="cuda")
    want_pool, want_keys, want_pos = naive_update(pool, table, lengths, kv, 127, 160)
    keys, pos = paged_kv_update_op(pool, table, lengths, kv, 127, 160)
    assert torch.equal(keys, want_keys) and torch.equal(pos, want_pos) and torch.equal(pool, want_pool)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_kv_update_op(pool, table, lengths, kv, 127, 160)
    lengths.add_(7)  # the graph reads the lengths at replay
    want_pool, want_keys, want_pos = naive_update(pool, table, lengths, kv, 127, 160)
    out[0].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], want_keys) and torch.equal(out[1], want_pos) and torch.equal(pool, want_pool)
