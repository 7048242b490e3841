"""Stopping criteria inside a round (generation/round.py ``StopRules``): a stop string, a user ``StoppingCriteria``
or an EOS that fires on a drafted token ends the output exactly where plain ``generate`` stops, for both drafters
and every driver (transformers' loop, ours on a graphed target, batches), whether the stop falls on draft 1, a
middle draft, the last draft or the bonus token; the caches end with the output, so a later turn resumes.  And
seeded sampled calls repeat under "auto"."""

import pytest
import torch
from transformers import AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import ConfidenceCriteria, StopStringCriteria

from dsv4_mtp_hf import RollbackDeepseekV4Cache, graph_target, ungraph_target
from dsv4_mtp_hf.compat import cache_kwarg
from dsv4_mtp_hf.demo_pair import demo_pair_path
from dsv4_mtp_hf.generation import mtp_decoding, speculative_generate
from dsv4_mtp_hf.generation.dspark_session import DSparkSession

from .helpers import edited_drafts, tiny_pair, truth_drafts
from .test_dspark import _truth_drafts, tiny_dspark_pair

pytestmark = pytest.mark.tf_internals  # transformers' assisted loop and generate's custom_generate differ by version
VOCAB = 2048  # the demo pair's tokenizer: stop strings need real token strings
GREEDY = dict(do_sample=False, eos_token_id=None)
PROMPT_LEN = 9


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_pair_path() / "tokenizer")


def prompt(seed: int) -> torch.Tensor:
    return torch.randint(3, 300, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


class AfterNew(StoppingCriteria):
    """Stops once ``n`` tokens follow the prompt (a function of the sequence, as transformers' criteria are)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] - PROMPT_LEN >= self.n, dtype=torch.bool,
                          device=input_ids.device)


class OnToken(StoppingCriteria):
    """Stops when the last token is one of ``ids`` (content-based: where it fires depends on what was drawn)."""

    def __init__(self, ids):
        self.ids = torch.tensor(sorted(ids))

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.ids.to(input_ids.device))


def _pair(drafter: str):
    if drafter == "mtp":
        return tiny_pair(seed=3, target_overrides=dict(vocab_size=VOCAB))
    return tiny_dspark_pair(seed=3, vocab_size=VOCAB)


def _forced(drafter, monkeypatch, truth):
    """Every draft right (the target's own greedy tokens), so rounds are full and stop positions predictable."""
    if drafter == "mtp":
        return edited_drafts(truth_drafts(truth, vocab=VOCAB))
    _truth_drafts(monkeypatch, truth, set())
    return torch.no_grad()


# K=3 (MTP) and K=5 (DSpark): new token 1 comes from the prompt's forward, then each full round adds its drafts and
# the bonus token: new tokens 2..K+1 are drafts 1..K, token K+2 the bonus.
STOPS = {"mtp": {"draft 1": 2, "middle draft": 3, "last draft": 4, "bonus": 5},
         "dspark": {"draft 1": 2, "middle draft": 4, "last draft": 6, "bonus": 7}}
K = {"mtp": 3, "dspark": 5}


@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
@pytest.mark.parametrize("where", ["draft 1", "middle draft", "last draft", "bonus"])
def test_a_criterion_firing_inside_a_round_ends_the_output_where_plain_does(drafter, where, monkeypatch):
    target, draft = _pair(drafter)
    ids, n = prompt(1), STOPS[drafter][where]
    full = target.generate(ids, max_new_tokens=12, **GREEDY)
    criteria = StoppingCriteriaList([AfterNew(n)])
    plain = target.generate(ids, max_new_tokens=12, stopping_criteria=criteria, **GREEDY)
    assert plain.shape[1] == PROMPT_LEN + n
    with _forced(drafter, monkeypatch, full):
        got = target.generate(ids, assistant_model=draft, num_assistant_tokens=K[drafter], max_new_tokens=12,
                              stopping_criteria=criteria, **GREEDY)
    assert torch.equal(got, plain), where
    stats = draft.last_generation_stats
    assert stats.new_tokens == n and stats.accepted >= min(n - 2, K[drafter])  # the drafts were accepted, then cut
    # EOS at the same position (the token's first occurrence after the prompt)
    eos = int(full[0, PROMPT_LEN + n - 1])
    first = PROMPT_LEN + full[0, PROMPT_LEN:].tolist().index(eos) + 1
    with _forced(drafter, monkeypatch, full):
        got = target.generate(ids, assistant_model=draft, num_assistant_tokens=K[drafter], max_new_tokens=12,
                              do_sample=False, eos_token_id=eos)
    assert torch.equal(got, target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos))
    assert got.shape[1] == first


@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
def test_stop_strings_end_the_output_where_plain_does(drafter, tokenizer, monkeypatch):
    target, draft = _pair(drafter)
    ids = prompt(2)
    full = target.generate(ids, max_new_tokens=14, **GREEDY)
    new = full[0, PROMPT_LEN:].tolist()
    clean = [i for i in range(2, 12) if tokenizer.decode(new[i : i + 2]).isascii()]  # random weights: some bytes
    assert len(clean) >= 3, [tokenizer.decode([t]) for t in new]
    for start in clean[:: max(1, len(clean) // 3)][:3]:  # stop strings ending in different rounds and positions
        stop = tokenizer.decode(new[start : start + 2])
        kw = dict(max_new_tokens=14, stop_strings=[stop], tokenizer=tokenizer, **GREEDY)
        plain = target.generate(ids, **kw)
        assert plain.shape[1] < full.shape[1], stop
        with _forced(drafter, monkeypatch, full):
            assert torch.equal(target.generate(ids, assistant_model=draft, num_assistant_tokens=K[drafter], **kw),
                               plain), stop
        assert torch.equal(target.generate(ids, assistant_model=draft, **kw), plain), stop  # natural drafts, "auto"


@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
def test_our_loop_on_a_graphed_target_stops_inside_a_round(drafter, tokenizer, monkeypatch):
    target, draft = _pair(drafter)
    ids = prompt(4)
    full = target.generate(ids, max_new_tokens=12, **GREEDY)
    graph_target(target, max_length=64)
    try:
        for n in STOPS[drafter].values():
            criteria = StoppingCriteriaList([AfterNew(n)])
            with _forced(drafter, monkeypatch, full):
                got = target.generate(ids, assistant_model=draft, num_assistant_tokens=K[drafter], max_new_tokens=12,
                                      stopping_criteria=criteria, **GREEDY)
            assert torch.equal(got, full[:, : PROMPT_LEN + n]), n
        stop = tokenizer.decode(full[0, PROMPT_LEN + 4 : PROMPT_LEN + 6])
        kw = dict(max_new_tokens=12, stop_strings=[stop], tokenizer=tokenizer, **GREEDY)
        got = target.generate(ids, assistant_model=draft, **kw)
    finally:
        ungraph_target(target)
    assert torch.equal(got, target.generate(ids, **kw))


@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
def test_a_turn_after_a_stop_resumes_from_caches_that_end_with_the_output(drafter, monkeypatch):
    target, draft = _pair(drafter)
    ids, name = prompt(5), cache_kwarg(target)
    full = target.generate(ids, max_new_tokens=12, **GREEDY)
    cache = RollbackDeepseekV4Cache(target.config, max_rollback=K[drafter])
    with _forced(drafter, monkeypatch, full):
        first = target.generate(ids, assistant_model=draft, num_assistant_tokens=K[drafter], max_new_tokens=12,
                                stopping_criteria=StoppingCriteriaList([AfterNew(3)]), **{name: cache}, **GREEDY)
    assert first.shape[1] == PROMPT_LEN + 3 and cache.get_seq_length() == first.shape[1] - 1
    monkeypatch.setattr(DSparkSession, "_draft", DSparkSession.__dict__["_draft"])  # natural drafts from here
    turn = torch.cat([first, prompt(6)[:, :4]], dim=1)
    got = target.generate(turn, assistant_model=draft, num_assistant_tokens=K[drafter], max_new_tokens=10,
                          **{name: cache}, **GREEDY)
    assert torch.equal(got, target.generate(turn, max_new_tokens=10, **GREEDY))


@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
@pytest.mark.parametrize("k", ["fixed", "auto"])
def test_sampled_calls_stop_where_plain_does(drafter, k, monkeypatch):
    """The sampled path (warpers, speculative accept/resample): with ``top_k=1`` the draws are the target's argmax,
    so forced right drafts are accepted and the stop's position is known, on draft 1 to the bonus token; with real
    draws, the output ends at the first new token on which the criterion fires, and at no earlier one."""
    target, draft = _pair(drafter)
    ids, num = prompt(7), K[drafter] if k == "fixed" else "auto"
    full = target.generate(ids, max_new_tokens=12, **GREEDY)
    sample = dict(do_sample=True, top_k=1, eos_token_id=None, max_new_tokens=12)
    for n in STOPS[drafter].values():
        criteria = StoppingCriteriaList([AfterNew(n)])
        with _forced(drafter, monkeypatch, full):
            got = target.generate(ids, assistant_model=draft, num_assistant_tokens=num, stopping_criteria=criteria,
                                  **sample)
        assert torch.equal(got, full[:, : PROMPT_LEN + n]), n
    monkeypatch.setattr(DSparkSession, "_draft", DSparkSession.__dict__["_draft"])  # natural drafts from here
    stops = set(range(3, VOCAB, 5))  # about a fifth of the vocabulary ends the call
    torch.manual_seed(11)
    for _ in range(4):
        out = target.generate(ids, assistant_model=draft, num_assistant_tokens=num, max_new_tokens=40,
                              do_sample=True, eos_token_id=None, stopping_criteria=StoppingCriteriaList([OnToken(stops)]))
        new = out[0, PROMPT_LEN:].tolist()
        assert new[-1] in stops and not stops & set(new[:-1]), new
        assert draft.last_generation_stats.new_tokens == len(new)


def test_streamers_and_dict_outputs_end_with_the_stop(monkeypatch):
    target, mtp = _pair("mtp")
    ids = prompt(8)
    full = target.generate(ids, max_new_tokens=12, **GREEDY)

    class Collect:
        def __init__(self):
            self.seen = []

        def put(self, value):
            self.seen += value.reshape(-1).tolist()

        def end(self):
            self.seen.append("end")

    streamer = Collect()
    kw = dict(max_new_tokens=12, stopping_criteria=StoppingCriteriaList([AfterNew(3)]), **GREEDY)
    with edited_drafts(truth_drafts(full, vocab=VOCAB)):
        out = target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, streamer=streamer,
                              return_dict_in_generate=True, output_scores=True, output_logits=True, **kw)
    assert torch.equal(out.sequences, full[:, : PROMPT_LEN + 3])
    assert len(out.scores) == len(out.logits) == 3
    assert streamer.seen == ids[0].tolist() + full[0, PROMPT_LEN : PROMPT_LEN + 3].tolist() + ["end"]


def _ascii_token(tokenizer, tokens, start):
    return next(tokenizer.decode([t]) for t in tokens[start:] if tokenizer.decode([t]).strip().isascii()
                and tokenizer.decode([t]).strip())


def test_batches_stop_each_sequence_where_plain_does(tokenizer):
    target, mtp = _pair("mtp")
    prompts = [prompt(9)[0], prompt(10)[0, :6]]
    fulls = [target.generate(p[None], max_new_tokens=16, **GREEDY)[0, p.numel() :].tolist() for p in prompts]
    strings = [_ascii_token(tokenizer, fulls[0], 4), _ascii_token(tokenizer, fulls[1], 7)]
    out = speculative_generate(target, mtp, prompts, max_new_tokens=16, num_assistant_tokens=3, eos_token_id=None,
                               stopping_criteria=[StopStringCriteria(tokenizer, strings)])
    for p, new in zip(prompts, out.new_tokens):
        plain = target.generate(p[None], max_new_tokens=16, stop_strings=strings, tokenizer=tokenizer, **GREEDY)
        assert torch.equal(new, plain[0, p.numel() :]) and new.numel() < 16
    ids = prompt(9)
    seqs = target.generate(ids, custom_generate=mtp_decoding, mtp=mtp, max_new_tokens=16, num_assistant_tokens=3,
                           stopping_criteria=StoppingCriteriaList([AfterNew(4)]), **GREEDY)
    assert torch.equal(seqs, target.generate(ids, max_new_tokens=4, **GREEDY))
    seqs = target.generate(ids, custom_generate=mtp_decoding, mtp=mtp, max_new_tokens=16, num_assistant_tokens=3,
                           stop_strings=strings[:1], tokenizer=tokenizer, **GREEDY)
    plain = target.generate(ids, max_new_tokens=16, stop_strings=strings[:1], tokenizer=tokenizer, **GREEDY)
    assert torch.equal(seqs, plain) and plain.shape[1] < PROMPT_LEN + 16


def test_criteria_that_cannot_be_checked_per_prefix_are_refused():
    target, mtp = _pair("mtp")
    with pytest.raises(ValueError, match="ConfidenceCriteria.*assistant_confidence_threshold"):
        target.generate(prompt(1), assistant_model=mtp, max_new_tokens=4,
                        stopping_criteria=StoppingCriteriaList([ConfidenceCriteria(0.5)]), **GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        target.generate(prompt(1), assistant_model=mtp, max_new_tokens=4, stop_strings=["ab"], **GREEDY)


@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
def test_seeded_sampled_calls_repeat_under_auto_whatever_the_round_times(drafter, monkeypatch):
    """"auto" chooses from timings in greedy calls; a sampled call's choices must not follow timing noise, or
    its draws (and output) change from one run to the next under the same seed.  Round times here are noise."""
    from dsv4_mtp_hf.generation import draft_length

    target, draft = _pair(drafter)
    noise = iter(torch.rand(100_000, generator=torch.Generator().manual_seed(0)).cumsum(0).tolist())
    monkeypatch.setattr(draft_length.time, "perf_counter", lambda: next(noise))
    outs, lengths = [], []
    for _ in range(3):
        torch.manual_seed(123)
        outs.append(target.generate(prompt(12), assistant_model=draft, num_assistant_tokens="auto", max_new_tokens=40,
                                    do_sample=True, temperature=0.8, eos_token_id=None))
        lengths.append(draft.last_generation_stats.draft_lengths)
    assert all(torch.equal(o, outs[0]) for o in outs) and lengths[0] == lengths[1] == lengths[2]


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
def test_seeded_sampled_calls_repeat_on_cuda_when_the_first_captures_the_graphs(drafter):
    """The first call on CUDA warms up and captures the drafter's graphs (draws included); the next only replays.
    The seed must give both the same output, with a fixed K and with "auto", stop strings and criteria too."""
    if drafter == "mtp":
        target, draft = tiny_pair(seed=3, target_overrides=dict(vocab_size=VOCAB))
    else:
        target, draft = tiny_dspark_pair(seed=3, vocab_size=VOCAB, hidden_size=256, moe_intermediate_size=256)
    target, draft = target.cuda(), draft.cuda()
    ids = prompt(13).cuda()
    for num in (K[drafter], "auto"):
        outs = []
        for _ in range(3):
            torch.manual_seed(5)
            outs.append(target.generate(ids, assistant_model=draft, num_assistant_tokens=num, max_new_tokens=48,
                                        do_sample=True, top_k=50, eos_token_id=None,
                                        stopping_criteria=StoppingCriteriaList([AfterNew(40)])))
        assert all(torch.equal(o, outs[0]) for o in outs), num
        assert outs[0].shape[1] == PROMPT_LEN + 40
