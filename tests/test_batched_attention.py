"""The batched V4 target attention (`generation/batched_attention.py`) against the per-sequence
path (transformers' own attention and cache, one sequence at a time): same logits in float32
through ragged prefill, multi-token verify chunks, rollbacks and sequences leaving the batch;
same greedy tokens in `speculative_generate` as plain per-sequence `generate`.

Every run draws fresh weights, prompts, chunk lengths and crops; the seed is in each message.
A draw whose failure a near-tie explains (a router, indexer or argmax choice within 3e-5 of a
tie, where float32 summation order may pick either side) is redrawn: ``draw_until_clear``."""

import random

import pytest
import torch

from dsv4_mtp_hf.generation import CacheRollbackError, speculative_generate
from dsv4_mtp_hf.target_runtime.batched_state import BatchedTargetState
from dsv4_mtp_hf.target_runtime.ragged import RaggedTargetForward

from .helpers import draw_until_clear, tiny_pair

TOL = 3e-5  # float32; observed max |diff| 4e-6..1.05e-5 over 30 runs (summation order of the batched kernels)

# 32 indexer heads: with random weights an entry whose every head's ReLU is 0 scores exactly 0,
# and torch.topk breaks such ties differently for differently shaped score tensors (SPEC §7:
# transformers' own full, chunked and one-token forwards then disagree too).  With 8 heads
# (1/256 per query and entry) the random runs below hit such a tie about once in 20 runs.
# sliding (window 8), CSA (rate 4) and HCA (rate 8): the helpers' default target
DEFAULT = dict(index_n_heads=32)
# window 5, CSA rate 2 (windows close every other token: several per verify chunk), HCA rate 4,
# a CSA layer first and last, top-3 of many entries
DENSE = dict(index_n_heads=32, num_hidden_layers=4, sliding_window=5, index_topk=3,
             layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention",
                          "compressed_sparse_attention"],
             mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
             compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4})


def runners(target, max_chunk=256):
    return (RaggedTargetForward(target, attention="per_sequence"),
            RaggedTargetForward(target, attention="batched", max_chunk=max_chunk))


def compare(ref, bat, rc, bc, chunks, seqs, what):
    l1, r1, o1 = ref(chunks, [rc[i] for i in seqs])
    l2, r2, o2 = bat(chunks, [bc[i] for i in seqs])
    assert o1 == o2
    diff = max((l1 - l2).abs().max().item(), (r1 - r2).abs().max().item())
    assert diff < TOL, f"{what}: max |batched - per-sequence| = {diff:.3g}"
    for i in seqs:
        assert rc[i].get_seq_length() == bc[i].get_seq_length()
    return diff


@pytest.mark.tf_internals
@pytest.mark.parametrize("capacity", [None, 160], ids=["growing", "fixed-shapes"])
@pytest.mark.parametrize("overrides", [DEFAULT, DENSE], ids=["default", "dense"])
def test_batched_logits_equal_per_sequence_through_rounds_crops_and_departures(overrides, capacity):
    def attempt(seed, margins):
        g = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        target, _ = tiny_pair(seed=seed % 1000, target_overrides=overrides)
        margins.watch(target)
        vocab, K, B = target.config.vocab_size, 3, 4
        ref, bat = runners(target, max_chunk=rng.choice([4, 7, 256]))  # small max_chunk: prefill in pieces
        rc, bc = ref.new_caches(B, K), bat.new_caches(B, K, capacity)  # at most 25 + 24 * 4 + 1 + 13 tokens
        lengths = rng.sample(range(2, 26), B)  # ragged: compression windows close at different steps
        what = f"seed={seed} prompts={lengths}"
        compare(ref, bat, rc, bc, [torch.randint(3, vocab, (n,), generator=g) for n in lengths], list(range(B)),
                what + " prefill")
        live = list(range(B))
        worst = 0.0
        for step in range(24):
            if step in (8, 16):  # a sequence leaves the batch; the others go on in a shuffled order
                gone = live.pop(rng.randrange(len(live)))
                bc[gone].free()
                rng.shuffle(live)
            n = [rng.randint(1, K + 1) for _ in live]  # a verify chunk: last token + up to K drafts
            chunks = [torch.randint(3, vocab, (k,), generator=g) for k in n]
            worst = max(worst, compare(ref, bat, rc, bc, chunks, live, f"{what} step={step} seqs={live} chunks={n}"))
            for i, k in zip(live, n):  # reject 0 .. k - 1 of the chunk's rows
                keep = rc[i].get_seq_length() - rng.randint(0, k - 1)
                rc[i].crop(keep)
                bc[i].crop(keep)
        # one more step per sequence after the last crops, then a prefill-sized chunk (pieces again)
        compare(ref, bat, rc, bc, [torch.randint(3, vocab, (1,), generator=g) for _ in live], live, what + " after crop")
        compare(ref, bat, rc, bc, [torch.randint(3, vocab, (rng.randint(5, 13),), generator=g) for _ in live], live,
                what + " long chunk")
        print(f"{what}: worst |diff| {worst:.3g}")

    draw_until_clear(attempt)


@pytest.mark.tf_internals
def test_a_crop_restores_the_state_a_shorter_history_gives():
    """Rolling back K rows and re-feeding other tokens equals a state that never saw the
    rejected rows (its windows closed, reopened and closed again with other rows)."""

    def attempt(seed, margins):
        g = torch.Generator().manual_seed(seed)
        target, _ = tiny_pair(seed=seed % 1000, target_overrides=DENSE)
        margins.watch(target)
        _, bat = runners(target)
        a, b, c = bat.new_caches(3, 4)
        prompt = torch.randint(3, 320, (9,), generator=g)
        bat([prompt] * 3, [a, b, c])
        rejected, good, more = (torch.randint(3, 320, (k,), generator=g) for k in (4, 3, 2))
        bat([rejected, rejected], [a, c])
        a.crop(9)  # a: rolled back; b: never saw `rejected`; c: kept it
        got, _, _ = bat([good] * 3, [a, b, c])
        assert (got[:3] - got[3:6]).abs().max() < TOL, f"seed={seed}"
        assert (got[:3] - got[6:]).abs().max() > 1e-3, f"seed={seed}"  # the history matters: the check can fail
        got, _, _ = bat([more] * 2, [a, b])
        assert (got[:2] - got[2:]).abs().max() < TOL, f"seed={seed}"

    draw_until_clear(attempt)


@pytest.mark.tf_internals
def test_batched_speculative_greedy_equals_plain_greedy_per_sequence():
    """Fresh prompts and weights; sequences finish at different rounds (EOS), so the batch
    shrinks while the others keep their state."""

    def attempt(seed, margins):
        rng = random.Random(seed)
        target, mtp = tiny_pair(seed=seed % 1000, target_overrides=rng.choice([DEFAULT, DENSE]))
        margins.watch(target, mtp, argmax=True)
        g = torch.Generator().manual_seed(seed)
        ps = [torch.randint(3, 320, (n,), generator=g) for n in rng.sample(range(3, 30), 4)]
        k = rng.randint(1, 4)
        plain = [target.generate(p[None], max_new_tokens=30, do_sample=False, eos_token_id=None)[0, p.numel():]
                 for p in ps]
        eos = int(plain[rng.randrange(4)][rng.randint(3, 12)])
        out = speculative_generate(target, mtp, ps, max_new_tokens=30, num_assistant_tokens=k, eos_token_id=eos,
                                   target_attention="batched")
        ref = speculative_generate(target, mtp, ps, max_new_tokens=30, num_assistant_tokens=k, eos_token_id=eos,
                                   target_attention="per_sequence")
        for i, want in enumerate(plain):
            if (want == eos).any():
                want = want[: int((want == eos).nonzero()[0, 0]) + 1]
            assert torch.equal(out.new_tokens[i], want), f"seed={seed} k={k} seq={i}"
            assert out.stats[i].as_dict() == ref.stats[i].as_dict(), f"seed={seed} k={k} seq={i}"

    draw_until_clear(attempt)


def test_state_errors_name_the_problem():
    target, mtp = tiny_pair(seed=0)
    runner = RaggedTargetForward(target)
    assert runner.attention == "batched"  # the default
    seqs = runner.new_caches(3, max_rollback=2)
    x = torch.tensor([5, 6, 7, 8])
    runner([x, x[:1]], seqs[:2])
    with pytest.raises(CacheRollbackError, match="max_rollback=2"):
        seqs[0].crop(1)
    seqs[0].crop(2)  # 4 - 2: allowed
    seqs[1].crop(5)  # the positive form keeps min(5, length) tokens: a no-op, as RollbackDeepseekV4Cache
    assert seqs[1].get_seq_length() == 1
    with pytest.raises(CacheRollbackError, match="truncate"):
        seqs[1].state.truncate(1, 5)  # the state truncates to a length <= the current one
    seqs[2].free()
    with pytest.raises(ValueError, match="freed"):
        runner([x], [seqs[2]])
    with pytest.raises(ValueError, match="at most once"):
        runner([x, x], [seqs[0], seqs[0]])
    other = runner.new_caches(1, max_rollback=2)
    with pytest.raises(ValueError, match="same BatchedTargetState"):
        runner([x, x], [seqs[0], other[0]])
    with pytest.raises(ValueError, match="same BatchedTargetState"):
        runner([x, x], [seqs[0], RaggedTargetForward(target, attention="per_sequence").new_cache(2)])
    with pytest.raises(ValueError, match="target attention"):
        RaggedTargetForward(target, attention="padded")
    with pytest.raises(ValueError, match="target attention"):
        speculative_generate(target, mtp, [x], max_new_tokens=2, target_attention="padded")
    cfg = target.config.__class__.from_dict(target.config.to_dict())
    cfg._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="per_sequence"):
        BatchedTargetState(cfg, 2, 1)


@pytest.mark.parametrize("overrides", [{}, DENSE], ids=["default", "dense"])
def test_the_fixed_plan_a_graph_computes_equals_the_host_plan(overrides):
    """The graphed step's plan, computed by torch from the length alone, gives every index and mask of the
    host (NumPy) plan of the same forward: at every length from the first token up to the capacity (the
    window filling, compressor windows closing, rollbacks' reach), for every verify width."""
    target, _ = tiny_pair(seed=0, target_overrides=overrides)
    capacity, K = 60, 4
    state = BatchedTargetState(target.config, 1, max_rollback=K, capacity=capacity)
    for n in list(range(1, K + 2)) + [8, 16]:  # verify widths, and prompt chunks (powers of two)
        for length in range(0, capacity - n + 1):
            state.lengths[0] = state.high[0] = length
            host = state.plan([0], [n])
            want = host.use(host.host_flat())
            got = state.fixed_plan(n).indices(torch.tensor([length]))
            assert set(got) == set(want), f"n={n} L={length}: keys {sorted(set(got) ^ set(want))} differ"
            for key in want:
                assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (
                    f"n={n} L={length}: {key} is {got[key].tolist()}, the host plan's {want[key].tolist()}")
            assert state.fixed_plan(n).streams == host.streams and state.fixed_plan(n).ring == host.ring
    with pytest.raises(ValueError, match="capacity=60"):
        state.fixed_plan(17)  # from length 60 - 16
    with pytest.raises(ValueError, match="one sequence slot with a capacity"):
        BatchedTargetState(target.config, 2, max_rollback=K, capacity=capacity).fixed_plan(1)
