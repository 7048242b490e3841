"""Reduced draft vocabularies (issue #48, item 7): the config's ``draft_vocab_ids`` survives save/load (our loader
and Hub remote code), ``draft_vocab_from_corpus`` picks a corpus's most frequent ids, and a generate call whose
acceptance collapsed under a reduced vocabulary warns, naming the cause and the fix."""

import json
import logging

import pytest
import torch
from transformers.utils.logging import warning_once

from dsv4_mtp_hf import DeepseekV4MtpConfig, DeepseekV4MtpForCausalLM, draft_vocab_from_corpus
from dsv4_mtp_hf.draft_vocab import (
    COLLAPSE_MEAN_ACCEPTED_LENGTH,
    COLLAPSE_MIN_ROUNDS,
    draft_vocab_collapsed,
    warn_if_draft_vocab_collapsed,
)
from dsv4_mtp_hf.generation.speculative import speculative_generate
from dsv4_mtp_hf.generation.stats import BatchGenerationStats, GenerationStats

from .helpers import edited_drafts, run_fresh_python, tiny_pair, truth_drafts

LOGGER = "dsv4_mtp_hf.draft_vocab"


def prompt(seed, length=11, vocab=320):
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def collapse_warnings(caplog):
    """The collapse warnings logged inside the test (``warning_once``'s memory cleared before and after)."""
    warning_once.cache_clear()
    caplog.set_level(logging.WARNING, logger=LOGGER)
    yield lambda: [r.getMessage() for r in caplog.records if r.name == LOGGER]
    warning_once.cache_clear()


# -- the config field and set_draft_vocab --------------------------------------------------------------------


def test_config_keeps_draft_vocab_ids_sorted_unique_and_checked():
    c = DeepseekV4MtpConfig(vocab_size=50, hidden_size=64, moe_intermediate_size=32, draft_vocab_ids=[7, 3, 7, 0])
    assert c.draft_vocab_ids == [0, 3, 7]
    assert DeepseekV4MtpConfig(vocab_size=50, hidden_size=64, moe_intermediate_size=32,
                               draft_vocab_ids=torch.tensor([[4, 2]])).draft_vocab_ids == [2, 4]
    for bad in ([], [50], [-1], [1.5], ["3"], [True], "12"):
        with pytest.raises(ValueError, match="draft vocabulary"):
            DeepseekV4MtpConfig(vocab_size=50, hidden_size=64, moe_intermediate_size=32, draft_vocab_ids=bad)
    assert DeepseekV4MtpConfig().draft_vocab_ids is None


def test_set_draft_vocab_writes_the_config_and_none_restores_mtp_vocab_size():
    target, mtp = tiny_pair(seed=40, mtp_vocab_size=100)
    assert mtp.config.draft_vocab_ids is None and torch.equal(mtp.draft_vocab_ids(), torch.arange(100))
    mtp.set_draft_vocab(torch.tensor([9, 5, 5, 300]))
    assert mtp.config.draft_vocab_ids == [5, 9, 300]  # the subset wins over mtp_vocab_size
    assert mtp.draft_vocab_ids().tolist() == [5, 9, 300]
    mtp.set_draft_vocab(None)
    assert mtp.config.draft_vocab_ids is None and torch.equal(mtp.draft_vocab_ids(), torch.arange(100))
    with pytest.raises(ValueError, match="draft vocabulary"):
        mtp.set_draft_vocab([320])
    assert mtp.config.draft_vocab_ids is None  # a refused subset changes nothing


def test_draft_vocab_ids_survive_save_and_load(tmp_path):
    target, mtp = tiny_pair(seed=41)
    subset = list(range(3, 320, 4))
    mtp.set_draft_vocab(subset)
    mtp.save_pretrained(tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["draft_vocab_ids"] == subset
    back = DeepseekV4MtpForCausalLM.from_pretrained(tmp_path / "d", target_model=target)
    assert back.config.draft_vocab_ids == subset and back.draft_vocab_ids().tolist() == subset
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 320, (1, 6), generator=g)
    hs = torch.randn(1, 6, mtp.config.hc_mult, mtp.config.hidden_size, generator=g)
    with torch.no_grad():
        small = back(ids, hs, draft_vocab=True).logits
    outside = torch.ones(320, dtype=torch.bool)
    outside[subset] = False
    assert torch.isneginf(small[..., outside]).all() and torch.isfinite(small[..., subset]).all()
    # cleared, saved again: the reload drafts over the full vocabulary
    back.set_draft_vocab(None)
    back.save_pretrained(tmp_path / "d")
    again = DeepseekV4MtpForCausalLM.from_pretrained(tmp_path / "d", target_model=target)
    assert again.config.draft_vocab_ids is None and again.draft_vocab_ids() is None


@pytest.mark.tf_internals
def test_draft_vocab_ids_survive_the_remote_code_path(tmp_path):
    _, mtp = tiny_pair(seed=42)
    mtp.set_draft_vocab([5, 17, 200])
    mtp.save_pretrained(tmp_path / "d")
    script = (
        "import sys\n"
        "from transformers import AutoModelForCausalLM\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "print(type(m).__name__, m.config.draft_vocab_ids, m.draft_vocab_ids().tolist())\n"
    )
    stdout = run_fresh_python(script, tmp_path / "d", tmp_path=tmp_path)
    assert "DeepseekV4MtpForCausalLM [5, 17, 200] [5, 17, 200]" in stdout


def test_a_new_subset_on_a_rebound_target_gathers_the_new_head():
    target, mtp = tiny_pair(seed=43)
    other, _ = tiny_pair(seed=44)
    mtp.set_draft_vocab(list(range(0, 320, 2)))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 320, (1, 4), generator=g)
    hs = torch.randn(1, 4, mtp.config.hc_mult, mtp.config.hidden_size, generator=g)
    with torch.no_grad():
        mtp(ids, hs, draft_vocab=True)  # gathers target's head rows
        mtp.bind(other)
        small, full = mtp(ids, hs, draft_vocab=True).logits, mtp(ids, hs).logits
    torch.testing.assert_close(small[..., ::2], full[..., ::2])


# -- draft_vocab_from_corpus ----------------------------------------------------------------------------------


def test_draft_vocab_from_corpus_takes_the_most_frequent_ids_and_always():
    corpus = [[5, 5, 5, 9, 9, 2], [9, 7, 7, 7, 7, 2], torch.tensor([11, 7])]
    # counts: 7:5, 5:3, 9:3, 2:2, 11:1 -> the top 3 with the tie 5/9 broken by the smaller id
    assert draft_vocab_from_corpus(corpus, 3).tolist() == [5, 7, 9]
    assert draft_vocab_from_corpus(corpus, 3, always=[1, 0]).tolist() == [0, 1, 7]
    assert draft_vocab_from_corpus(corpus, 4, always=(7,)).tolist() == [2, 5, 7, 9]
    got = draft_vocab_from_corpus(torch.tensor([[5, 5, 5, 9, 9, 2], [9, 7, 7, 7, 7, 2]]), 2)
    assert got.dtype == torch.long and got.tolist() == [5, 7]
    assert draft_vocab_from_corpus([3, 3, 4], 1).tolist() == [3]  # one flat sequence
    # fewer distinct ids than asked: all of them
    assert draft_vocab_from_corpus(corpus, 50, always=[1]).tolist() == [1, 2, 5, 7, 9, 11]


def test_draft_vocab_from_corpus_reads_a_tokenizer_output_without_its_padding():
    batch = {"input_ids": torch.tensor([[4, 4, 8, 0, 0, 0], [8, 8, 8, 4, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]])}
    assert draft_vocab_from_corpus(batch, 2).tolist() == [4, 8]  # pad id 0 (5 times) is not counted
    assert draft_vocab_from_corpus({"input_ids": [[4, 4], [8]]}, 1).tolist() == [4]


def test_draft_vocab_from_corpus_refuses_bad_input():
    with pytest.raises(ValueError, match="size"):
        draft_vocab_from_corpus([[1, 2]], 0)
    with pytest.raises(ValueError, match="always"):
        draft_vocab_from_corpus([[1, 2]], 1, always=[3, 4])
    with pytest.raises(ValueError, match="vocab_size"):
        draft_vocab_from_corpus([[1, 400]], 2, vocab_size=320)
    with pytest.raises(ValueError, match="vocab_size"):
        draft_vocab_from_corpus([[1]], 400, vocab_size=320)
    with pytest.raises(ValueError, match="tokenise"):
        draft_vocab_from_corpus(["some text"], 2)
    with pytest.raises(ValueError, match="integer"):
        draft_vocab_from_corpus(torch.tensor([0.5, 1.0]), 2)
    with pytest.raises(ValueError, match="non-negative"):
        draft_vocab_from_corpus([[-1, 2]], 2)
    with pytest.raises(ValueError, match="no token ids"):
        draft_vocab_from_corpus([], 2)


def test_a_corpus_subset_drafts_and_keeps_greedy_output_exact():
    target, mtp = tiny_pair(seed=45)
    ids = prompt(45)
    kw = dict(max_new_tokens=30, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    mtp.set_draft_vocab(draft_vocab_from_corpus(plain, 64, always=[0, 1, 2], vocab_size=320))
    assert torch.equal(target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, **kw), plain)


# -- the collapse warning ---------------------------------------------------------------------------------------


def stats(rounds, accepted):
    s = GenerationStats(3)
    for i in range(rounds):
        s.record_round(3, accepted // rounds + (i < accepted % rounds), 1)
    return s


def test_collapse_is_a_low_mean_accepted_length_over_enough_rounds():
    assert COLLAPSE_MIN_ROUNDS == 8 and COLLAPSE_MEAN_ACCEPTED_LENGTH == 1.3
    assert draft_vocab_collapsed(stats(8, 2))  # 1.25 tokens per round
    assert not draft_vocab_collapsed(stats(8, 3))  # 1.375
    assert not draft_vocab_collapsed(stats(7, 0))  # too few rounds to judge
    assert not draft_vocab_collapsed(GenerationStats(3))
    batch = BatchGenerationStats([stats(5, 0), stats(5, 1)])
    assert draft_vocab_collapsed(batch)  # 10 rounds, 1.1 per round


def test_the_warning_needs_a_reduced_vocabulary(collapse_warnings):
    _, mtp = tiny_pair(seed=46)
    assert not warn_if_draft_vocab_collapsed(mtp, stats(20, 0))  # full vocabulary: not this warning's business
    mtp.set_draft_vocab(list(range(100)))
    assert not warn_if_draft_vocab_collapsed(mtp, stats(20, 30))
    assert not warn_if_draft_vocab_collapsed(mtp, None)
    assert collapse_warnings() == []
    assert warn_if_draft_vocab_collapsed(mtp, stats(20, 0))
    (msg,) = collapse_warnings()
    assert "reduced vocabulary of 100 of 320 ids" in msg and "draft_vocab_from_corpus" in msg
    assert "set_draft_vocab(None)" in msg and "exact" in msg


def test_a_generate_call_that_collapses_under_a_reduced_vocabulary_warns(collapse_warnings):
    target, mtp = tiny_pair(seed=47)
    ids = prompt(47)
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    used = set(plain[0, ids.shape[1]:].tolist())
    mtp.set_draft_vocab([t for t in range(320) if t not in used])  # the text's tokens can never be drafted
    assert torch.equal(target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, **kw), plain)
    s = mtp.last_generation_stats
    assert s.accepted == 0 and s.rounds >= COLLAPSE_MIN_ROUNDS
    (msg,) = collapse_warnings()
    assert f"of {320 - len(used)} of 320 ids" in msg and "outside that subset" in msg
    # the batched driver checks its calls too
    warning_once.cache_clear()
    out = speculative_generate(target, mtp, ids, max_new_tokens=40, num_assistant_tokens=3, eos_token_id=None)
    assert torch.equal(out.sequences, plain)
    assert len(collapse_warnings()) == 2


def test_no_warning_when_the_reduced_vocabulary_fits_or_the_call_is_short(collapse_warnings):
    target, mtp = tiny_pair(seed=48)
    ids = prompt(48)
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    mtp.set_draft_vocab(sorted(set(plain[0].tolist())))
    with edited_drafts(truth_drafts(plain)):  # drafts within the subset, all accepted
        assert torch.equal(target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, **kw), plain)
    assert mtp.last_generation_stats.mean_accepted_length > 3
    mtp.set_draft_vocab([300])  # collapses, but over too few rounds to tell
    short = dict(kw, max_new_tokens=5)
    assert torch.equal(target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, **short), plain[:, :16])
    assert mtp.last_generation_stats.rounds < COLLAPSE_MIN_ROUNDS
    assert collapse_warnings() == []
