"""Graph-safe sampling (generation/sampling.py): warpers applied to many rows at once, draws, and speculative
sampling's accept/resample on the device, each checked against the distribution it must reproduce."""

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dsv4_mtp_hf.generation import sampling

SEED = 31


@pytest.fixture(autouse=True)
def _seeded():
    print(f"seed={SEED}")
    torch.manual_seed(SEED)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of ``counts`` to ``probs`` (over the entries of positive probability)."""
    keep = probs > 0
    n = counts.sum().double()
    expected = probs[keep].double() * n
    stat = float(((counts[keep].double() - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    return 1 - float(torch.distributions.Chi2(torch.tensor(float(df))).cdf(torch.tensor(stat)))


def random_probs(g, *shape, zeros: float = 0.3):
    p = torch.rand(*shape, generator=g) ** 2 * (torch.rand(*shape, generator=g) > zeros)
    p[..., 0] += 0.05  # no all-zero row
    return p / p.sum(-1, keepdim=True)


def test_warp_is_the_processors_applied_row_by_row():
    """The graph-safe warpers read only their row: applying them to every row at once, without the sequence,
    equals transformers applying them to each row with its own sequence."""
    g = torch.Generator().manual_seed(SEED)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(12), TopPLogitsWarper(0.8),
                                   MinPLogitsWarper(0.02)])
    logits = torch.randn(5, 64, generator=g) * 3
    ids = torch.randint(0, 64, (5, 9), generator=g)
    want = torch.stack([warpers(ids[i : i + 1, : 4 + i], logits[i : i + 1].clone())[0] for i in range(5)])
    got = sampling.warp(warpers, logits.view(1, 5, 64)).view(5, 64)
    assert torch.equal(got, want)
    assert torch.isinf(got).any() and torch.isfinite(got).sum(-1).min() >= 1
    assert sampling.graph_safe(warpers) and sampling.graph_safe(LogitsProcessorList())
    assert not sampling.graph_safe(LogitsProcessorList([*warpers, RepetitionPenaltyLogitsProcessor(1.2)]))
    assert sampling.signature(warpers) == sampling.signature(LogitsProcessorList(
        [TemperatureLogitsWarper(0.7), TopKLogitsWarper(12), TopPLogitsWarper(0.8), MinPLogitsWarper(0.02)]))
    assert sampling.signature(warpers) != sampling.signature(LogitsProcessorList([TemperatureLogitsWarper(0.7)]))


def test_draw_samples_each_row_from_its_distribution_and_never_a_zero():
    g = torch.Generator().manual_seed(SEED)
    probs = random_probs(g, 3, 9)
    n = 30000
    tokens = sampling.draw(probs.expand(n, 3, 9) * 5.0, g)  # unnormalised: the race does not care
    for row in range(3):
        counts = torch.bincount(tokens[:, row], minlength=9)
        assert counts[probs[row] == 0].sum() == 0, f"row {row} drew a zero-probability token"
        assert chi2_pvalue(counts, probs[row]) > 1e-3, (counts / n, probs[row])


def _top_k_lists():
    return {
        "temperature, top-k, top-p, min-p": LogitsProcessorList([
            TemperatureLogitsWarper(0.7), TopKLogitsWarper(40), TopPLogitsWarper(0.8), MinPLogitsWarper(0.02)]),
        "a finite filter value (the whole row)": LogitsProcessorList([
            TopKLogitsWarper(30, filter_value=-1e4), TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.9)]),
        "top-p only (the whole row)": LogitsProcessorList([TemperatureLogitsWarper(2.0), TopPLogitsWarper(0.9)]),
        "top-p before top-k (the whole row)": LogitsProcessorList([TopPLogitsWarper(0.9), TopKLogitsWarper(20)]),
        "none": LogitsProcessorList(),
    }


@pytest.mark.parametrize("name", list(_top_k_lists()))
def test_draft_draw_hands_back_the_warped_logits_and_draws_from_them(name):
    """The draft's processed logits are transformers' warp of the row (with a top-k: computed on its k best
    logits), and its token is drawn from their softmax -- the q that keeps speculative sampling exact."""
    warpers = _top_k_lists()[name]
    g = torch.Generator().manual_seed(SEED)
    logits = torch.randn(4, 2500, generator=g) * 3
    token, processed = sampling.draft_draw(warpers, logits, g)
    torch.testing.assert_close(processed, sampling.warp(warpers, logits), rtol=0, atol=0)
    assert token.shape == (4,) and bool(torch.isfinite(processed.gather(-1, token[:, None])).all())
    row = logits[2:3].expand(8000, -1)
    tokens, _ = sampling.draft_draw(warpers, row, g)
    probs = processed[2].softmax(-1)
    counts = torch.bincount(tokens, minlength=probs.numel())
    assert counts[probs == 0].sum() == 0, "a draft the processed distribution forbids"
    big = probs * counts.sum() >= 5  # the chi-square over the tokens expected 5+ times, the rest pooled
    pooled = lambda t: torch.cat([t[big], t[~big].sum().view(1)])  # noqa: E731
    assert chi2_pvalue(pooled(counts), pooled(probs)) > 1e-3


@pytest.mark.parametrize("g_drafts", [0, 1, 3])
def test_speculative_accept_emits_the_target_distribution(g_drafts):
    """Drafts drawn from q, verified against p: the first emitted token is distributed as p_0 and, given the
    first j drafts accepted, the next emitted token as p_j -- whatever q is (Leviathan et al., theorem 1)."""
    gen = torch.Generator().manual_seed(SEED + g_drafts)
    b, v = 40000, 7
    p = random_probs(gen, g_drafts + 1, v)
    q = random_probs(gen, g_drafts, v)
    if g_drafts:
        q[0] = p[0]  # q = p at the first draft: every such draft is accepted
    drafts = torch.stack([torch.multinomial(q[j], b, replacement=True, generator=gen) for j in range(g_drafts)], 1) \
        if g_drafts else torch.zeros(b, 0, dtype=torch.long)
    n, selected = sampling.speculative_accept(drafts, q.expand(b, -1, -1), p.expand(b, -1, -1), gen)
    assert n.shape == (b,) and selected.shape == (b, g_drafts + 1) and int(n.max()) <= g_drafts
    if g_drafts:
        assert bool((n >= 1).all())  # q_0 = p_0
        assert torch.equal(selected[:, :-1][torch.arange(g_drafts) < n[:, None]], drafts[torch.arange(g_drafts) < n[:, None]])
    for j in range(g_drafts + 1):
        reached = n >= j  # the first j drafts accepted: row j emits the next token
        emitted = selected[reached, j]
        counts = torch.bincount(emitted, minlength=v)
        assert counts[p[j] == 0].sum() == 0
        assert chi2_pvalue(counts, p[j]) > 1e-3, (j, counts / counts.sum(), p[j])
    with pytest.raises(ValueError, match="speculative_accept"):
        sampling.speculative_accept(drafts, q.expand(b, -1, -1), p.expand(b, -1, -1)[:, :g_drafts])
