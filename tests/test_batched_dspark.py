"""Batches with DSpark (issue 59): `speculative_generate(target, dspark, prompts)` runs B ragged sequences, each
with its own verify length (K, "auto" or a confidence threshold), acceptance, rollback and positions.  Greedy:
every sequence gets what plain greedy `generate` gives it alone; sampled: exact speculative sampling per sequence.
Drafts are forced to the target's own tokens (wrong every few positions) where multi-token rounds and rollbacks
must happen: the random drafter alone lands almost nothing."""

import pytest
import torch

from dsv4_mtp_hf.target_runtime.features import FeatureTap
from dsv4_mtp_hf.target_runtime.ragged import RaggedTargetForward

from .test_dspark import tiny_dspark_pair

SEED = 5900
LENGTHS = (5, 12, 23, 9)


def prompts(seed: int, lengths=LENGTHS, vocab: int = 300) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def test_the_ragged_forward_returns_the_layers_a_drafter_reads():
    """`feature_layers`: the outputs of those decoder layers at every row of a ragged forward, as forward hooks on
    the target's own layers see them for each sequence alone."""
    target, dspark = tiny_dspark_pair(seed=SEED)
    layers = list(dspark.config.dspark_target_layer_ids)
    ps = prompts(SEED, (6, 13))
    plain_runner = RaggedTargetForward(target)
    runner = RaggedTargetForward(target, feature_layers=layers)
    logits, features, offsets = runner(ps, runner.new_caches(2, max_rollback=4))
    want_logits, residual, _ = plain_runner(ps, plain_runner.new_caches(2, max_rollback=4))
    assert features.shape == (19, 3, target.config.hc_mult, target.config.hidden_size)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)
    torch.testing.assert_close(features[:, -1], residual, rtol=0, atol=0)  # the last layer's output: the residual
    tap = FeatureTap(target, layers)
    try:
        for i, p in enumerate(ps):
            target(p[None])
            torch.testing.assert_close(features[offsets[i] : offsets[i + 1]], tap.take()[0], rtol=1e-4, atol=1e-5)
    finally:
        tap.close()
    with pytest.raises(ValueError, match="reads target layers"):
        RaggedTargetForward(target, feature_layers=[9])


def test_dspark_cache_runs_ragged_and_frees_sequences():
    """One commit of 3 rows for sequence 0 and 1 for sequence 2 (sequence 1 left out) stores exactly those rows,
    each sequence's K/V equal to a commit of its rows alone; inside `ragged` the lengths are the selected rows'."""
    _, dspark = tiny_dspark_pair(seed=SEED)
    c = dspark.config
    feats = torch.randn(2, 3, len(c.dspark_target_layer_ids), c.hc_mult, c.hidden_size,
                        generator=torch.Generator().manual_seed(SEED))
    cache = dspark.new_cache(3)
    with torch.no_grad(), cache.ragged(rows=torch.tensor([0, 2]), num_new=torch.tensor([3, 1])):
        assert cache.seq_lengths.tolist() == [0, 0]
        dspark.commit(feats, torch.arange(3).expand(2, 3), cache)
    assert cache.seq_lengths.tolist() == [3, 0, 1]
    with cache.ragged(rows=torch.tensor([2])):
        assert cache.seq_lengths.tolist() == [1]
    for row, n in ((0, 3), (2, 1)):
        alone = dspark.new_cache(1)
        with torch.no_grad():
            dspark.commit(feats[row // 2, :n][None], torch.arange(n)[None], alone)
        for layer, one in zip(cache.layers, alone.layers):
            page, slot = layer._rows(torch.arange(n)[None], layer.block_table[[row]])
            torch.testing.assert_close(layer.pool[page, slot], one.snapshot()["kv"])
    cache.free(0)
    assert all(not layer.active[0] for layer in cache.layers)
    with pytest.raises(ValueError, match="freed"), cache.ragged(rows=torch.tensor([0])):
        pass
