"""The near-tie guard of the randomized exactness tests (``helpers.DecisionMargins``,
``helpers.draw_until_clear``): it must see ties where they are, and let real failures fail."""

import pytest
import torch

from dsv4_mtp_hf.target_runtime.ragged import RaggedTargetForward

from .helpers import DecisionMargins, draw_until_clear, tiny_pair


def forward_margins(target, runner=None) -> dict:
    """The smallest margin of each kind of choice in one forward of 12 random tokens."""
    margins = DecisionMargins()
    margins.watch(target, argmax=True)
    ids = torch.randint(3, 320, (1, 12))
    with torch.no_grad():
        if runner is None:
            target(ids)
        else:
            runner([ids[0]], runner.new_caches(1, 1))
    margins.close()
    assert margins.min == min(margins.by_kind.values())
    return margins.by_kind


ATTENTION = [None, "per_sequence", "batched"]  # transformers' forward, our two ragged target paths


def pair_and_runner(seed, attention, **overrides):
    target, _ = tiny_pair(seed=seed, target_overrides=dict(index_n_heads=32, **overrides))
    return target, None if attention is None else RaggedTargetForward(target, attention=attention)


@pytest.mark.tf_internals
@pytest.mark.parametrize("attention", ATTENTION)
def test_each_kind_is_seen_positive_on_random_weights_and_zero_at_a_forced_tie(attention):
    target, runner = pair_and_runner(3, attention)
    got = forward_margins(target, runner)
    assert set(got) == {"router", "indexer", "argmax"} and min(got.values()) > 0, got

    router = target.model.layers[1].mlp.gate
    with torch.no_grad():
        router.weight[:] = router.weight[0]  # every expert scores the same: the top-k is a tie
        router.e_score_correction_bias.zero_()  # (the selection bias would break it)
    got = forward_margins(target, runner)
    assert got["router"] == 0 and got["indexer"] > 0 and got["argmax"] > 0, got

    target, runner = pair_and_runner(4, attention, index_topk=2)
    csa = next(layer.self_attn for layer in target.model.layers
               if getattr(getattr(layer.self_attn, "compressor", None), "indexer", None) is not None)
    with torch.no_grad():
        csa.compressor.indexer.q_b_proj.weight.zero_()  # every entry scores 0 for every query
    got = forward_margins(target, runner)
    assert got["indexer"] == 0 and got["router"] > 0, got

    target, runner = pair_and_runner(4, attention)
    with torch.no_grad():
        target.lm_head.weight[:] = target.lm_head.weight[7]
    got = forward_margins(target, runner)
    assert got["argmax"] == 0 and got["router"] > 0 and got["indexer"] > 0, got


def test_draw_until_clear_redraws_only_failures_a_near_tie_explains():
    calls = []

    def near_then_pass(seed, margins):
        calls.append(seed)
        if len(calls) == 1:
            margins.min = 0.0
            raise AssertionError("flipped at a tie")

    draw_until_clear(near_then_pass)
    assert len(calls) == 2 and calls[0] != calls[1]

    def clear_failure(seed, margins):
        margins.min = 1.0
        raise AssertionError("a real bug")

    with pytest.raises(AssertionError, match="a real bug"):
        draw_until_clear(clear_failure)

    def always_near(seed, margins):
        margins.min = 0.0
        raise AssertionError("tie")

    with pytest.raises(AssertionError, match="3 draws failed"):
        draw_until_clear(always_near, tries=3)
