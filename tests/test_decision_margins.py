"""The near-tie guard of the randomized exactness tests (``helpers.DecisionMargins``,
``helpers.draw_until_clear``): it must see ties where they are, and let real failures fail."""

import pytest
import torch

from dsv4_mtp_hf.generation.ragged_target import RaggedTargetForward

from .helpers import DecisionMargins, draw_until_clear, tiny_pair


def forward_margin(target, mtp=None, runner=None):
    margins = DecisionMargins()
    margins.watch(*[m for m in (target, mtp) if m is not None], argmax=True)
    ids = torch.randint(3, 320, (1, 12))
    with torch.no_grad():
        if runner is None:
            target(ids)
        else:
            runner([ids[0]], runner.new_caches(1, 1))
    margins.close()
    return margins.min


@pytest.mark.tf_internals
@pytest.mark.parametrize("attention", [None, "per_sequence", "batched"])
def test_margins_are_positive_on_random_weights_and_zero_at_a_forced_tie(attention):
    target, _ = tiny_pair(seed=3, target_overrides=dict(index_n_heads=32))
    runner = None if attention is None else RaggedTargetForward(target, attention=attention)
    assert forward_margin(target, runner=runner) > 0
    router = target.model.layers[1].mlp.gate
    with torch.no_grad():
        router.weight[:] = router.weight[0]  # every expert scores the same: the top-k is a tie
        router.e_score_correction_bias.zero_()  # (the selection bias would break it)
    assert forward_margin(target, runner=runner) == 0


@pytest.mark.tf_internals
def test_indexer_and_argmax_ties_are_seen():
    target, _ = tiny_pair(seed=4, target_overrides=dict(index_n_heads=32, index_topk=2))
    csa = next(l.self_attn for l in target.model.layers if hasattr(l.self_attn, "compressor")
               and hasattr(l.self_attn.compressor, "indexer"))
    with torch.no_grad():
        csa.compressor.indexer.q_b_proj.weight.zero_()  # every entry scores 0 for every query
    assert forward_margin(target) == 0
    target, _ = tiny_pair(seed=4)
    with torch.no_grad():
        target.lm_head.weight[:] = target.lm_head.weight[7]
    assert forward_margin(target) == 0


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
