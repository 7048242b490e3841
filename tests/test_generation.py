"""`target.generate(assistant_model=mtp)` on transformers' own DeepseekV4ForCausalLM."""

import contextlib

import pytest
import torch

from dsv4_mtp_hf import DeepseekV4MtpForCausalLM
from dsv4_mtp_hf.generation import RollbackDeepseekV4Cache, mtp_session
from dsv4_mtp_hf.generation import round as rounds

from .helpers import (edited_drafts, generate_recording_session, per_position_drafts, proposals_recorded,
                      sessions_made, tiny_pair, truth_drafts, unbound_assistant_pattern)

# Layers mix sliding, CSA (rate 4) and HCA (rate 8) attention with an 8-token window:
# 200 new tokens cross dozens of window and compression boundaries.
PROMPT_LEN = 11
PATHS = ["rounds", "per-position"]  # the drafter's whole rounds (GraphedDrafter, eager on CPU), or a Chooser per draft


def prompt(seed=0, length=PROMPT_LEN, vocab=320):
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def drafting(path):
    """The context a call drafts in along ``path`` (:data:`PATHS`)."""
    return per_position_drafts() if path == "per-position" else contextlib.nullcontext()


@pytest.mark.tf_internals
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_assisted_output_is_identical_to_plain_greedy(k):
    target, mtp = tiny_pair(seed=k)
    ids = prompt(k)
    kw = dict(max_new_tokens=200, min_new_tokens=200, do_sample=False)
    plain = target.generate(ids, **kw)
    assisted = target.generate(ids, assistant_model=mtp, num_assistant_tokens=k, **kw)
    assert plain.shape[1] == PROMPT_LEN + 200
    assert torch.equal(assisted, plain)
    stats = mtp.last_generation_stats
    assert stats.num_assistant_tokens == k and stats.new_tokens == 200
    # every round drafts K tokens, except the last few, whose drafts the max_length budget trims
    assert stats.rounds * k - k * k <= stats.drafted <= stats.rounds * k
    assert len(stats.acceptance_by_position) == k


@pytest.mark.tf_internals
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k", [2, 3])
def test_partly_correct_drafts_exercise_acceptance_and_rejection(k, path, monkeypatch):
    """Oracle drafts (the target's greedy continuation, wrong at chosen positions) while the real MTP still runs:
    both acceptance and rejection happen, the output is plain greedy's, and every round's first draft comes from MTP
    rows recomputed from the target's residual after a rollback.  Per position: ``min_new_tokens`` adds a processor
    that reads the sequence, so each draft goes through the round's Chooser; rounds: no processor, the drafter."""
    target, mtp = tiny_pair(seed=10 + k)
    ids = prompt(10 + k)
    if path == "per-position":
        kw = dict(max_new_tokens=80, min_new_tokens=80, do_sample=False)
    else:
        kw = dict(max_new_tokens=80, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    wrong_at = {PROMPT_LEN + i for i in range(0, 80, 7)} | {PROMPT_LEN + i for i in range(3, 80, 11)}
    oracle = truth_drafts(plain, wrong_at)

    # The first draft's logits before any processing: the Chooser's first call of the round (per position), or the
    # round's first draft logits (greedy rounds hand back the raw fp32 logits).
    chooser_calls, firsts = [], []
    real_call = rounds.Chooser.__call__

    def call(self, logits, prefix):
        chooser_calls.append((prefix.shape[1], logits.float().clone()))
        return real_call(self, logits, prefix)

    def edit(ids_, drafts):
        if path == "per-position":
            at, raw = chooser_calls[0]
            assert at == ids_.shape[1]  # the round's first Chooser call is its first draft position
            firsts.append((at, raw[0]))
        else:
            assert not chooser_calls  # the drafter chose the drafts itself
            firsts.append((ids_.shape[1], drafts.logits[0, 0].clone()))
        chooser_calls.clear()
        return oracle(ids_, drafts)

    monkeypatch.setattr(rounds.Chooser, "__call__", call)
    with sessions_made() as made, edited_drafts(edit):
        assisted = target.generate(ids, assistant_model=mtp, num_assistant_tokens=k, **kw)
    assert (made[-1].drafter is None) == (path == "per-position")  # the path under test
    assert torch.equal(assisted, plain)
    s = mtp.last_generation_stats
    assert 0 < s.accepted < s.drafted  # both paths taken
    assert s.mean_accepted_length > 1.5
    assert s.new_tokens == 80 and s.rounds < 80

    # Every round's first draft comes from MTP rows recomputed from the target's residual after
    # a rollback: its logits equal a fresh, uncached MTP pass over the final sequence.
    captured = []
    hook = target.model.hc_head.register_forward_pre_hook(lambda m, a: captured.append(a[0]))
    with torch.no_grad():
        target(plain)
        hook.remove()
        fresh = mtp(plain[:, 1:], captured[0][:, :-1]).logits[0]  # row p predicts t_{p+2}
    assert len(firsts) == s.rounds
    for pos, raw in firsts:
        torch.testing.assert_close(raw, fresh[pos - 2], rtol=1e-3, atol=1e-4)


@pytest.mark.tf_internals
@pytest.mark.parametrize("path", PATHS)
def test_eos_inside_accepted_drafts_ends_generation_like_plain(path):
    """The drafts are the target's greedy continuation: an EOS is drafted and accepted, and the output ends there as
    plain greedy's does.  On the drafter's rounds the drafts go on past the EOS within the round (they reach the
    host only where the verifier does not cut at EOS itself, transformers 5.17): either way the accepted tokens
    end at the first EOS."""
    target, mtp = tiny_pair(seed=3)
    ids = prompt(3)
    plain = target.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=None)
    eos = int(plain[0, PROMPT_LEN + 25])  # with every draft accepted (K=3), a round's first draft lands here
    want = target.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=eos)
    oracle, mid_round = truth_drafts(plain), []

    def edit(ids_, drafts):
        drafts = oracle(ids_, drafts)
        mid_round.append(eos in drafts.tokens[0, :-1].tolist())  # drafts after an EOS in this round
        return drafts

    with drafting(path), edited_drafts(edit), proposals_recorded() as proposed:
        got = target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, max_new_tokens=60, do_sample=False,
                              eos_token_id=eos)
    assert torch.equal(got, want)
    assert int(got[0, -1]) == eos and got.shape[1] < PROMPT_LEN + 60
    assert any(eos in p for p in proposed)  # the case under test: an EOS among a round's drafts
    if path == "rounds":
        assert any(mid_round)


@pytest.mark.tf_internals
def test_max_new_tokens_and_stopping_criteria_are_respected():
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= PROMPT_LEN + 17, dtype=torch.bool)

    target, mtp = tiny_pair(seed=4)
    ids = prompt(4)
    plain = target.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    with edited_drafts(truth_drafts(plain)), proposals_recorded() as proposed:
        for n in (1, 2, 5, 13):
            got = target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            assert torch.equal(got, plain[:, : PROMPT_LEN + n])
        got = target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, max_new_tokens=40, min_new_tokens=40,
                              do_sample=False, stopping_criteria=StoppingCriteriaList([StopAtLength()]))
    assert max(map(len, proposed)) == 3  # whole rounds of right drafts were offered
    # accepted drafts may overshoot a custom criterion within the last round, as transformers' own
    # assisted loop does; the tokens are still the target's greedy tokens
    assert PROMPT_LEN + 17 <= got.shape[1] <= PROMPT_LEN + 17 + 3
    assert torch.equal(got, plain[:, : got.shape[1]])


def _chi2_pvalue(a: torch.Tensor, b: torch.Tensor, vocab: int) -> float:
    """Two-sample chi-square homogeneity test on token counts."""
    ca, cb = torch.bincount(a, minlength=vocab).double(), torch.bincount(b, minlength=vocab).double()
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    na, nb = ca.sum(), cb.sum()
    tot = ca + cb
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    stat = (((ca - ea) ** 2) / ea + ((cb - eb) ** 2) / eb).sum()
    df = int(keep.sum()) - 1
    return float(1 - torch.distributions.Chi2(torch.tensor(float(df))).cdf(stat))


@pytest.mark.tf_internals
@pytest.mark.parametrize("path", [pytest.param("per-token drafts", marks=pytest.mark.slow), "sampled rounds",
                                  "graphed target"])  # per-token drafts' distribution: make test-slow (test_grammar samples through them)
def test_speculative_sampling_matches_plain_sampling_in_distribution(path, monkeypatch):
    """600 sampled assisted calls: the first three tokens are distributed as plain sampling's, whichever way the
    drafts are drawn (one forward per draft, or the sampled round of the graphs) and whichever loop verifies
    (transformers', or ours on a graphed target)."""
    from dsv4_mtp_hf import graph_target
    from dsv4_mtp_hf.generation import assisted_loop

    vocab = 16
    target, mtp = tiny_pair(seed=5, target_overrides=dict(vocab_size=vocab, num_hidden_layers=2,
                                                           layer_types=["sliding_attention", "compressed_sparse_attention"],
                                                           mlp_layer_types=["moe", "moe"]))
    ids = prompt(5, length=6, vocab=vocab)
    # min_new_tokens would add a processor that reads the sequence (not graph-safe): no EOS instead
    kw = dict(do_sample=True, temperature=1.3, top_k=10, max_new_tokens=3, eos_token_id=None)
    n = 600
    torch.manual_seed(0)
    plain = target.generate(ids.expand(n, -1), **kw)[:, -3:]
    loops = []
    if path == "graphed target":
        graph_target(target, max_length=32)
        real = assisted_loop.decode
        monkeypatch.setattr(assisted_loop, "decode", lambda *a, **k: loops.append(1) or real(*a, **k))
    torch.manual_seed(1)
    assisted, drafted, accepted, drafters = [], 0, 0, set()
    with drafting("per-position" if path == "per-token drafts" else "rounds"):
        for _ in range(n):
            with sessions_made() as made:
                assisted.append(target.generate(ids, assistant_model=mtp, num_assistant_tokens=2, **kw)[0, -3:])
            drafters.add(made[0].drafter)
            drafted += mtp.last_generation_stats.drafted
            accepted += mtp.last_generation_stats.accepted
    assisted = torch.stack(assisted)
    assert len(loops) == (n if path == "graphed target" else 0)
    if path == "per-token drafts":
        assert drafters == {None}
    else:  # the sampled rounds of one kept drafter (eager on CPU)
        assert len(drafters) == 1 and next(iter(drafters)).sampled
    assert 0.15 * drafted < accepted < drafted  # both paths of speculative sampling are exercised
    for i in range(3):
        assert _chi2_pvalue(plain[:, i], assisted[:, i], vocab) > 1e-3, f"token {i} distribution differs"


def test_bad_inputs_give_clear_errors():
    target, mtp = tiny_pair(seed=6)
    ids = prompt(6)
    with pytest.raises(ValueError, match="num_assistant_tokens"):
        target.generate(ids, assistant_model=mtp, num_assistant_tokens=0, max_new_tokens=4)
    with pytest.raises(ValueError, match=f"exceeds the {mtp.config.max_draft_tokens + 1} drafts per round"):
        target.generate(ids, assistant_model=mtp, num_assistant_tokens=mtp.config.max_draft_tokens + 5, max_new_tokens=4)
    with pytest.raises(ValueError, match="one sequence per `generate` call.*speculative_generate"):
        target.generate(ids.expand(2, -1), assistant_model=mtp, max_new_tokens=4)
    with pytest.raises(ValueError, match="RollbackDeepseekV4Cache"):
        from transformers import DynamicCache

        target.generate(ids, assistant_model=mtp, max_new_tokens=4, past_key_values=DynamicCache(config=target.config))
    other_target, other_mtp = tiny_pair(seed=7)
    with pytest.raises(ValueError, match="not bound to the target"):
        target.generate(ids, assistant_model=other_mtp, max_new_tokens=4)


def test_plain_generate_is_unchanged_while_bound_and_unbind_restores_the_target():
    target, mtp = tiny_pair(seed=8)
    ids = prompt(8)
    bound = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert "generate" in target.__dict__
    mtp.unbind()
    assert "generate" not in target.__dict__ and "_get_candidate_generator" not in target.__dict__
    assert not mtp.is_bound
    assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False), bound)
    # transformers <= 5.24 refuses assisted generation for V4 itself; 5.25 asks the unbound drafter, which says
    # to bind it.
    with pytest.raises(ValueError, match=unbound_assistant_pattern()):
        target.generate(ids, assistant_model=mtp, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="not bound"):
        mtp(ids, torch.randn(1, ids.shape[1], mtp.config.hc_mult, mtp.config.hidden_size))
    other, _ = tiny_pair(seed=9)
    mtp.bind(other)  # moved to another target: the first one is itself again, and the drafter says where it is
    assert "generate" not in target.__dict__
    with pytest.raises(ValueError, match=unbound_assistant_pattern(bound_elsewhere=True)):
        target.generate(ids, assistant_model=mtp, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="bound to one target"):
        mtp.generate(ids)
    mtp.bind(target)
    target.generate(ids, assistant_model=mtp, max_new_tokens=4)


def test_two_drafts_can_share_one_target():
    target, mtp = tiny_pair(seed=8)
    second = DeepseekV4MtpForCausalLM(mtp.config).eval()
    second.load_state_dict(mtp.state_dict())
    second.bind(target)
    ids = prompt(8)
    plain = target.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=second, max_new_tokens=10, do_sample=False), plain)
    mtp.unbind()
    assert "generate" in target.__dict__  # still bound to `second`
    assert torch.equal(target.generate(ids, assistant_model=second, max_new_tokens=10, do_sample=False), plain)
    second.unbind()
    assert "generate" not in target.__dict__


def test_user_supplied_rollback_cache_is_used():
    target, mtp = tiny_pair(seed=9)
    ids = prompt(9)
    cache = RollbackDeepseekV4Cache(target.config, max_rollback=3)
    plain = target.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    got = target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, max_new_tokens=20, min_new_tokens=20,
                          do_sample=False, past_key_values=cache)
    assert torch.equal(got, plain)
    assert cache.get_seq_length() == plain.shape[1] - 1


@pytest.mark.parametrize("subset", ["first_n", "token_ids"])
def test_reduced_draft_vocabulary_keeps_greedy_output_exact(subset):
    target, mtp = tiny_pair(seed=12, mtp_vocab_size=100 if subset == "first_n" else None)
    if subset == "token_ids":
        mtp.set_draft_vocab(torch.arange(3, 320, 3))
    allowed = mtp.draft_vocab_ids()
    ids = prompt(12)
    hs = torch.randn(1, ids.shape[1], mtp.config.hc_mult, mtp.config.hidden_size)
    with torch.no_grad():
        full = mtp(ids, hs).logits
        small = mtp(ids, hs, draft_vocab=True).logits
    torch.testing.assert_close(small[..., allowed], full[..., allowed])
    outside = torch.ones(mtp.config.vocab_size, dtype=torch.bool)
    outside[allowed] = False
    assert torch.isneginf(small[..., outside]).all()
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    recorded = {}
    for path in PATHS:  # the drafter's rounds draft in the reduced vocabulary, and so does the Chooser

        def record(ids_, drafts, seen=recorded.setdefault(path, [])):
            seen.extend(drafts.tokens[0].tolist())
            return drafts

        with drafting(path), edited_drafts(record):
            assert torch.equal(target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, **kw), plain)
    for path, seen in recorded.items():
        assert seen and set(seen) <= set(allowed.tolist()), path
    with pytest.raises(ValueError, match="draft vocabulary"):
        mtp.set_draft_vocab([mtp.config.vocab_size])


@pytest.mark.gpu
def test_greedy_assisted_generation_on_cuda_is_identical_to_plain():
    target, mtp = tiny_pair(seed=13)
    target, mtp = target.cuda(), mtp.cuda()
    ids = prompt(13).cuda()
    kw = dict(max_new_tokens=60, min_new_tokens=60, do_sample=False)
    plain = target.generate(ids, **kw)
    assert torch.equal(target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, **kw), plain)
    assert mtp.last_generation_stats.rounds > 0


@pytest.mark.tf_internals
@pytest.mark.parametrize("k", [1, 2, 4])
def test_paged_drafter_path_keeps_greedy_output_identical(k):
    """The fast greedy path (whole rounds -- the verified rows' catch-up, the first draft, drafts 2..K --
    through `GraphedDrafter.round` on the paged cache) -- here without the graph, which needs CUDA --
    gives plain greedy output, with the MTP's own drafts and with partly-correct oracle drafts."""
    target, mtp = tiny_pair(seed=20 + k)
    ids = prompt(20 + k)
    kw = dict(max_new_tokens=120, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    wrong_at = {PROMPT_LEN + i for i in range(0, 120, 5)} | {PROMPT_LEN + i for i in range(3, 120, 11)}
    oracle, edits = truth_drafts(plain, wrong_at), []

    def partly_correct(ids_, drafts):  # accept + reject on the fast path too
        edits.append(drafts.tokens.shape[1])
        return oracle(ids_, drafts)

    for edit in (None, partly_correct):
        with sessions_made() as made, (edited_drafts(edit) if edit else drafting("rounds")):
            got = target.generate(ids, assistant_model=mtp, num_assistant_tokens=k, **kw)
        assert torch.equal(got, plain)
        session = made[-1]
        d = session.drafter
        assert d is not None and d.num_drafts == k and d.steps == k - 1  # K = 1: rounds of the catch-up alone
        assert session.cache is d.cache and not d.use_graph
    s = mtp.last_generation_stats
    assert 0 < s.accepted < s.drafted
    assert len(edits) > 10 and set(edits) == {k}  # the oracle drafts went through the rounds, K drafts each

    # The paged path proposes exactly what the per-position loop on the contiguous cache proposes.
    proposals = {}
    for path in PATHS:
        with drafting(path), proposals_recorded() as proposals[path]:
            target.generate(ids, assistant_model=mtp, num_assistant_tokens=k, max_new_tokens=60, do_sample=False,
                            eos_token_id=None)
    assert proposals["rounds"] == proposals["per-position"] and sum(map(len, proposals["rounds"])) > 0


def test_the_paged_drafter_is_kept_across_generate_calls():
    """A second generate call reuses the first one's drafter (its CUDA graphs, on CUDA) from a reset cache:
    it proposes exactly what a fresh per-position loop proposes; a new draft vocabulary gets a new drafter."""
    target, mtp = tiny_pair(seed=31)
    kw = dict(num_assistant_tokens=3, max_new_tokens=40, do_sample=False, eos_token_id=None)
    proposals = []
    try:
        with sessions_made() as made:
            for path, ids in (("rounds", prompt(31)), ("rounds", prompt(32)), ("per-position", prompt(32))):
                with drafting(path), proposals_recorded() as seen:
                    got = target.generate(ids, assistant_model=mtp, **kw)
                proposals.append(seen)
                assert torch.equal(got, target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None))
            assert made[0].drafter is not None and made[0].drafter is made[1].drafter and made[2].drafter is None
            assert proposals[1] == proposals[2] and sum(map(len, proposals[1])) > 0
            mtp.set_draft_vocab(list(range(200)))
            target.generate(prompt(31), assistant_model=mtp, **kw)
            assert made[-1].drafter is not None and made[-1].drafter is not made[0].drafter
    finally:
        mtp.set_draft_vocab(None)


@pytest.mark.gpu
def test_greedy_generate_on_cuda_uses_the_graphed_drafter_and_stays_exact():
    sizes = dict(hidden_size=256, moe_intermediate_size=256)  # tiled by the Triton FP4 MoE: graph-capturable
    target, mtp = tiny_pair(seed=14, target_overrides=sizes)
    target, mtp = target.cuda(), mtp.cuda()
    ids = prompt(14).cuda()
    kw = dict(max_new_tokens=60, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    got, session = generate_recording_session(target, mtp, ids, num_assistant_tokens=3, **kw)
    assert torch.equal(got, plain)
    d = session.drafter
    assert d is not None and d.use_graph and d.round_graphs  # whole rounds replayed as graphs
    assert set(d.round_graphs) <= set(range(1, d.max_round_rows + 1))
    assert d.compiled  # torch.compile'd step inside the graph (fp32: reference attention)


@pytest.mark.parametrize("path", PATHS)
def test_long_prompt_mtp_prefill_in_blocks_is_exact(path, monkeypatch):
    """Greedy output cannot reveal a wrong draft (the verifier corrects it), so compare the
    MTP's own draft logits with and without block-wise prefill of a long prompt."""
    target, mtp = tiny_pair(seed=15)
    ids = prompt(15, length=40)
    kw = dict(max_new_tokens=30, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    runs, blocks = [], []
    hook = mtp.register_forward_pre_hook(lambda m, args: blocks.append(args[0].shape[1]))  # MTP forwards' rows
    try:
        for chunk in (2048, 7):  # 7: the prompt's 40 MTP rows go through the MTP cache in 6 blocks
            monkeypatch.setattr(mtp_session, "PREFILL_CHUNK", chunk)
            seen = []

            def record(ids_, drafts):
                seen.append(drafts.logits.clone())
                return drafts

            blocks.clear()
            with drafting(path), edited_drafts(record):
                assert torch.equal(target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, **kw), plain)
            assert blocks[: 1 if chunk > 40 else 6] == ([40] if chunk > 40 else [7] * 5 + [5])  # the case under test
            runs.append(seen)
    finally:
        hook.remove()
    assert len(runs[0]) == len(runs[1]) > 5
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
