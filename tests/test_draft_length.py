"""``num_assistant_tokens="auto"`` (`generation/draft_length.py`): the choice of K, and exact output with it."""

import pytest
import torch

from dsv4_mtp_hf.generation import draft_length as dl
from dsv4_mtp_hf.generation.draft_length import AutoDraftLength

from .helpers import edited_drafts, generate_recording_session, sessions_made, tiny_pair, truth_drafts
from .test_generation import PATHS, PROMPT_LEN, drafting, prompt


def rounds(policy, n, accepted_of, cost_of):
    """``n`` rounds on a fake clock: round time ``cost_of(K)``, ``accepted_of(K)`` drafts accepted."""
    clock = [0.0]
    policy._clock = lambda: clock[0]
    for _ in range(n):
        k = policy.choose()
        policy.observe(k, accepted_of(k))
        clock[0] += cost_of(k)


def test_high_acceptance_drafts_the_most_and_none_drafts_one():
    sure = AutoDraftLength(4)
    rounds(sure, 40, lambda k: k, lambda k: 1.0 + 0.05 * k)
    assert sure.best() == 4 and sure.choices[-1] in (3, 4)
    hopeless = AutoDraftLength(4)  # drafts that never land: a plain step (1.0) beats a round of K = 1 (1.5)
    rounds(hopeless, 40, lambda k: 0, lambda k: 1.0 + 0.5 * (k > 0) + 0.05 * k)
    assert hopeless.choices[-24:].count(0) >= 23, hopeless.choices  # plain steps, at most one probe


def test_auto_probes_less_often_while_drafts_miss_and_drafts_again_when_they_land():
    p = AutoDraftLength(4)
    turn = [0]

    def accepted(k):
        turn[0] += 1
        return 0 if turn[0] <= 400 else k

    rounds(p, 600, accepted, lambda k: 1.0 + 0.5 * (k > 0) + 0.05 * k)
    missing = p.choices[:400]
    probes = [i for i in range(50, 400) if missing[i] > 0]
    print("probe rounds while drafts miss:", probes)
    assert len(probes) <= 6 and all(b - a >= dl.PROBE_FIRST for a, b in zip(probes, probes[1:]))
    assert all(b - a <= c - b for a, b, c in zip(probes, probes[1:], probes[2:]))  # the waits grow
    back = p.choices.index(next(k for k in p.choices[400:] if k), 400)
    assert back - 400 <= dl.PROBE_MAX and p.choices[back + 10:].count(0) == 0, p.choices[400:]  # drafting again


@pytest.mark.parametrize("tokens, floor", [(128, 0.94), (512, 0.975)])
def test_auto_with_every_draft_rejected_runs_close_to_plain_steps(tokens, floor):
    """A drafting round that lands nothing costs two plain steps here (a shallow target, where drafting is
    dearest): over a short generation "auto" gives up little against plain decoding, both policies."""
    for policy in (AutoDraftLength(4), dl.ConfidenceLength(5)):
        clock, spent = [0.0], 0.0
        policy._clock = lambda: clock[0]
        for _ in range(tokens):  # every round yields one token
            if isinstance(policy, AutoDraftLength):
                k = policy.choose()
            else:
                k = policy.choose([0.3] * 5) if policy.draft_now() else 0
            if k:
                policy.observe(k, 0)
            step = 2.0 if k else 1.0
            clock[0] += step
            spent += step
        print(type(policy).__name__, "plain speed ratio:", tokens / spent)
        assert tokens / spent >= floor, policy.choices


def test_plain_steps_are_measured_only_when_drafting_is_in_doubt_and_kept_off_when_it_pays():
    sure = AutoDraftLength(4)  # three drafts in four land: no plain round at all
    rounds(sure, 60, lambda k: min(k, 3), lambda k: 1.0 + 0.5 * (k > 0) + 0.05 * k)
    assert 0 not in sure.choices
    half = AutoDraftLength(1)  # K = 1 at 60%: 1.6 tokens for 1.1 plain steps; measured, then drafting
    n = [0]

    def sixty(k):
        n[0] += 1
        return int(n[0] % 5 < 3)

    rounds(half, 80, sixty, lambda k: 1.0 + 0.1 * k)
    assert 1 <= half.choices.count(0) <= 3 and half.choices[-40:].count(0) == 0, half.choices


def test_the_cost_slope_is_fitted_from_round_times_and_decides_k():
    for slope, want in ((0.02, 4), (1.0, 1)):
        p = AutoDraftLength(4)
        rounds(p, 40, lambda k: k // 2, lambda k, s=slope: 1.0 + s * k)
        assert len(p.times) >= 2  # the exploration rounds measured a second K
        assert p.slope() == pytest.approx(slope, rel=1e-6)
        # 80% acceptance at every position: E(K) = 1 + .8 + .64 + ...; cheap drafts favour K=4, dear ones K=1
        p.offered, p.taken = [1000] * 4, [800] * 4
        assert p.best() == want, slope


def test_exploration_and_the_untimed_first_round():
    p = AutoDraftLength(3)
    clock = [0.0]
    p._clock = lambda: clock[0]
    p.choose()
    p.skip_timing()  # the first round also runs the MTP over the prompt
    clock[0] += 100.0
    for _ in range(dl.EXPLORE_EVERY):
        p.observe(p.choices[-1], p.choices[-1])
        p.choose()
        clock[0] += 1.0
    assert all(t < 2 for ts in p.times.values() for t in ts)  # the 100 s round was not recorded
    assert p.choices[dl.EXPLORE_EVERY - 1] != p.choices[dl.EXPLORE_EVERY - 2]  # a neighbour was tried
    with pytest.raises(ValueError, match="max_k"):
        AutoDraftLength(0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("wrong_every", [0, 1])  # 0: every draft right; 1: every draft wrong
def test_auto_k_keeps_greedy_output_exact_and_follows_acceptance(path, wrong_every, monkeypatch):
    # The round times of a tiny model on a CPU say little about a GPU; fix the cost slope, test the acceptance side.
    monkeypatch.setattr(AutoDraftLength, "slope", lambda self: dl.PRIOR_SLOPE)

    target, mtp = tiny_pair(seed=40)
    ids = prompt(40)
    kw = dict(max_new_tokens=60, min_new_tokens=60, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    wrong_at = set(range(PROMPT_LEN, PROMPT_LEN + 60)) if wrong_every else set()
    with drafting(path), sessions_made() as made, edited_drafts(truth_drafts(plain, wrong_at)):
        assisted = target.generate(ids, assistant_model=mtp, num_assistant_tokens="auto", **kw)
    # the path under test: the drafter drafts the most "auto" allows and hands the verifier each round's K of them
    if path == "rounds":
        assert made[-1].drafter is not None and made[-1].drafter.num_drafts == dl.AUTO_MAX_DRAFTS
    else:
        assert made[-1].drafter is None
    assert torch.equal(assisted, plain)
    s = mtp.last_generation_stats
    assert s.auto and s.as_dict()["num_assistant_tokens"] == "auto" and s.num_assistant_tokens == dl.AUTO_MAX_DRAFTS
    print("draft lengths:", s.draft_lengths)
    drafted = [k for k in s.draft_lengths if k]  # 0: a plain step, "auto" found drafting did not pay
    assert len(drafted) == s.rounds and set(s.draft_lengths) <= set(range(dl.AUTO_MAX_DRAFTS + 1))
    assert s.accepted == (0 if wrong_every else s.drafted)
    late = s.draft_lengths[len(s.draft_lengths) // 2:]
    median = sorted(late)[len(late) // 2]  # the most drafts when all land (a neighbour explored now and then)
    assert (median == dl.AUTO_MAX_DRAFTS and min(late) >= dl.AUTO_MAX_DRAFTS - 1) if not wrong_every else median <= 1, \
        s.draft_lengths


def test_auto_k_bad_values_are_named():
    target, mtp = tiny_pair(seed=41)
    with pytest.raises(ValueError, match='or "auto"'):
        target.generate(prompt(41), assistant_model=mtp, num_assistant_tokens="fast", max_new_tokens=4)


@pytest.mark.gpu
def test_auto_k_on_cuda_replays_the_round_graphs_and_stays_exact():
    target, mtp = tiny_pair(seed=42, target_overrides=dict(hidden_size=256, moe_intermediate_size=256))
    target, mtp = target.cuda(), mtp.cuda()
    ids = prompt(42).cuda()
    kw = dict(max_new_tokens=60, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    got, session = generate_recording_session(target, mtp, ids, num_assistant_tokens="auto", **kw)
    assert torch.equal(got, plain)
    d = session.drafter
    assert d is not None and d.use_graph and d.round_graphs and d.num_drafts == dl.AUTO_MAX_DRAFTS
    assert len([k for k in mtp.last_generation_stats.draft_lengths if k]) == mtp.last_generation_stats.rounds


def test_untimed_policies_choose_from_acceptance_alone():
    """Sampled calls' policies (``timed=False``) cost rounds by ``modeled_cost``: the clock is never read, hopeless
    drafts still give way to plain steps, drafts that land are kept."""
    for landing, plain_after in ((False, True), (True, False)):
        for policy in (AutoDraftLength(3, timed=False), dl.ConfidenceLength(5, timed=False)):
            policy._clock = lambda: 0.0  # any value: the times recorded are modeled
            for _ in range(60):
                if isinstance(policy, AutoDraftLength):
                    k = policy.choose()
                else:
                    k = policy.choose([0.9] * 5) if policy.draft_now() else 0
                if k:
                    policy.observe(k, k if landing else 0)
            plain = policy.choices[-20:].count(0)
            assert (plain >= 18) if plain_after else plain == 0, policy.choices
            assert all(t == dl.modeled_cost(k) for k, ts in policy.times.items() for t in ts)
