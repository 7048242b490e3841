"""What an assisted ``generate`` call accepts and refuses (generation/binding.py), and the batched API's inputs: a
second turn on the same cache, left-padded prompts, settings this path cannot honour, ``speculative_generate``'s
EOS / prompt / statistics handling, NaN logits when sampling, and ``crop``'s one meaning on every cache."""

import pytest
import torch

from dsv4_mtp_hf import DeepseekV4MtpForCausalLM, graph_target
from dsv4_mtp_hf.compat import cache_kwarg
from dsv4_mtp_hf.generation import (BatchGenerationStats, RollbackDeepseekV4Cache, mtp_decoding,
                                    speculative_generate)
from dsv4_mtp_hf.generation.mtp_session import MtpSession
from dsv4_mtp_hf.target_runtime.graph import graphed

from .helpers import edited_drafts, proposals_recorded, sessions_made, tiny_pair

GREEDY = dict(do_sample=False, eos_token_id=None)


def prompt(seed, length=11, vocab=320):
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


# -- multi-turn --------------------------------------------------------------------------------------------------
def _first_draft_logits(record):
    """An ``edited_drafts`` edit appending each round's first draft logits to ``record`` (drafts unchanged)."""

    def edit(ids, drafts):
        record.append(drafts.logits[0, 0].clone())
        return drafts

    return edit


def _second_turn(target, mtp, cache, seed, monkeypatch):
    """Two assisted turns on ``cache``: the first over a prompt, the second over its output and 5 more tokens.
    Returns the second turn's input and output, its proposals and first-draft logits per round, the rows the
    drafter held after the first turn and ``(committed, rows committed)`` at the second turn's first round."""
    name = cache_kwarg(target)
    with sessions_made() as first:
        a1 = target.generate(prompt(seed), assistant_model=mtp, max_new_tokens=10, **{name: cache}, **GREEDY)
    assert cache.get_seq_length() == a1.shape[1] - 1 and cache.draft_state is not None
    held = first[-1].committed
    x2 = torch.cat([a1, prompt(seed + 1, length=5)], dim=1)
    starts, logits, real = [], [], MtpSession._draft

    def _draft(self, ids, features, choose, limit):
        starts.append((self.committed, features.shape[1]))
        return real(self, ids, features, choose, limit)

    monkeypatch.setattr(MtpSession, "_draft", _draft)
    with proposals_recorded() as proposed, edited_drafts(_first_draft_logits(logits)):
        a2 = target.generate(x2, assistant_model=mtp, max_new_tokens=10, **{name: cache}, **GREEDY)
    monkeypatch.setattr(MtpSession, "_draft", real)
    return x2, a2, (proposed, logits), held, starts[0]


def _check_resumed(target, mtp, x2, a2, drafted, held, start):
    # the output: plain generate over the whole conversation
    assert torch.equal(a2, target.generate(x2, max_new_tokens=10, **GREEDY))
    # the drafter resumed: its first round commits only the rows after those it held, with the target's features
    # of the first turn's last rows (kept on the cache) and of the second turn's prompt
    assert held > 0 and start == (held, x2.shape[1] - held)
    # and drafts what a single fresh call over the whole conversation drafts (the same drafting points): the same
    # proposals, from the same first-draft logits but for float summation order
    proposed, logits, fresh_logits = *drafted, []
    with proposals_recorded() as fresh, edited_drafts(_first_draft_logits(fresh_logits)):
        target.generate(x2, assistant_model=mtp, max_new_tokens=10, **GREEDY)
    assert proposed == fresh and sum(map(len, fresh)) > 0
    assert len(logits) == len(fresh_logits)
    for i, (a, b) in enumerate(zip(logits, fresh_logits)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"round {i}: {m}")


@pytest.mark.tf_internals
def test_a_second_turn_on_the_same_cache_resumes_the_drafter_and_equals_plain_generate(monkeypatch):
    target, mtp = tiny_pair(seed=60)
    cache = RollbackDeepseekV4Cache(target.config, max_rollback=3)
    x2, a2, drafted, held, start = _second_turn(target, mtp, cache, 60, monkeypatch)
    assert cache.get_seq_length() == a2.shape[1] - 1
    _check_resumed(target, mtp, x2, a2, drafted, held, start)


@pytest.mark.tf_internals
def test_a_second_turn_on_a_graphed_targets_cache_resumes_the_drafter(monkeypatch):
    """The same on the graphed target (CPU: the graphs' fixed-shape step run eagerly), decoded by our loop."""
    target, mtp = tiny_pair(seed=61)
    graph_target(target, max_length=64)
    cache = graphed(target).new_cache(3)
    x2, a2, drafted, held, start = _second_turn(target, mtp, cache, 61, monkeypatch)
    assert cache.get_seq_length() == a2.shape[1] - 1
    _check_resumed(target, mtp, x2, a2, drafted, held, start)


@pytest.mark.tf_internals
def test_a_cache_the_drafter_did_not_fill_is_refused_before_any_work():
    """A cache filled by a plain generate (or by another drafter, or a plain generate after an assisted turn)
    gives the drafter no context for its tokens; a cache holding another conversation is no prefix of the input.
    Each is refused with the fix, and the cache is left as it was."""
    target, mtp = tiny_pair(seed=62)
    name = cache_kwarg(target)
    p1, more = prompt(62), prompt(63, length=4)

    def refused(cache, ids, match, drafter=mtp):
        length = cache.get_seq_length()
        with pytest.raises(ValueError, match=match):
            target.generate(ids, assistant_model=drafter, max_new_tokens=6, **{name: cache}, **GREEDY)
        assert cache.get_seq_length() == length

    unseen = "did not see the target process.*Pass a fresh cache \\(or none\\)"
    plain_filled = RollbackDeepseekV4Cache(target.config, max_rollback=3)
    a1 = target.generate(p1, max_new_tokens=6, **{name: plain_filled}, **GREEDY)
    assert plain_filled.get_seq_length() > 0
    refused(plain_filled, torch.cat([a1, more], 1), unseen)

    cache = RollbackDeepseekV4Cache(target.config, max_rollback=3)
    a1 = target.generate(p1, assistant_model=mtp, max_new_tokens=6, **{name: cache}, **GREEDY)
    other = prompt(64, length=a1.shape[1] + 3)  # another conversation, longer than what the cache holds
    refused(cache, other, "not a prefix of `input_ids`.*pass a fresh cache \\(or none\\), or the whole conversation")
    refused(cache, a1[:, :5], "not a prefix of `input_ids`")  # a shorter input than the cache holds
    second = DeepseekV4MtpForCausalLM(mtp.config).eval()
    second.load_state_dict(mtp.state_dict())
    second.bind(target)
    refused(cache, torch.cat([a1, more], 1), unseen, drafter=second)  # another drafter left this cache
    a2 = target.generate(torch.cat([a1, more], 1), max_new_tokens=6, **{name: cache}, **GREEDY)  # a plain turn
    refused(cache, torch.cat([a2, more], 1), unseen)


# -- left padding ------------------------------------------------------------------------------------------------
@pytest.mark.tf_internals
def test_a_left_padded_prompt_gives_its_pads_then_plain_generate_of_the_prompt():
    target, mtp = tiny_pair(seed=65)
    ids = prompt(65)
    pads = torch.full((1, 4), 2)
    padded = torch.cat([pads, ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones_like(ids)], dim=1)
    kw = dict(max_new_tokens=20, do_sample=False)
    want = torch.cat([pads, target.generate(ids, **kw)], dim=1)
    assert torch.equal(target.generate(padded, attention_mask=mask, assistant_model=mtp, **kw), want)
    assert mtp.last_generation_stats.rounds > 0
    out = target.generate(padded, attention_mask=mask, assistant_model=mtp, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, want)
    for bad in ([1, 1, 0, 1] + [1] * 11,  # a hole
                [1] * 13 + [0, 0],  # right padding
                [0] * 15):  # nothing left
        with pytest.raises(ValueError, match="holes or right padding.*speculative_generate"):
            target.generate(padded, attention_mask=torch.tensor([bad]), assistant_model=mtp, **kw)


# -- refused settings --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting, match", [
    (dict(num_beams=2), "set num_beams=1 \\(or generate without `assistant_model` for beam search\\)"),
    (dict(num_return_sequences=2), "set num_return_sequences=1"),
    (dict(prompt_lookup_num_tokens=3), "prompt lookup and a drafter are two candidate generators"),
    (dict(num_assistant_tokens_schedule="heuristic"), 'choose K per round with `num_assistant_tokens="auto"`'),
    (dict(assistant_confidence_threshold=0.4), 'needs a drafter with a confidence head.*num_assistant_tokens="auto"'),
    (dict(prefill_chunk_size=4), "the assisted prefill runs whole"),
])
def test_settings_this_path_cannot_honour_are_refused_naming_the_alternative(setting, match):
    target, mtp = tiny_pair(seed=66)
    with pytest.raises(ValueError, match=match):
        target.generate(prompt(66), assistant_model=mtp, max_new_tokens=4, **setting)


@pytest.mark.tf_internals
def test_a_batch_names_the_batched_api_and_use_mtp_drafts_with_the_bound_drafter():
    target, mtp = tiny_pair(seed=67)
    ids = prompt(67)
    with pytest.raises(ValueError, match="got a batch of 2.*speculative_generate"):
        target.generate(torch.cat([ids, prompt(68)]), assistant_model=mtp, max_new_tokens=4)
    kw = dict(max_new_tokens=16, **GREEDY)
    with sessions_made() as made:
        got = target.generate(ids, use_mtp=True, **kw)
    stats = mtp.last_generation_stats
    assert made and made[0].model is mtp and stats.rounds > 0  # it drafted with the bound MTP
    assert torch.equal(got, target.generate(ids, assistant_model=mtp, **kw))
    assert torch.equal(got, target.generate(ids, **kw))
    second = DeepseekV4MtpForCausalLM(mtp.config).eval()
    second.bind(target)
    with pytest.raises(ValueError, match=r"2 are bound: DeepseekV4MtpForCausalLM .*Pass `assistant_model=drafter`"):
        target.generate(ids, use_mtp=True, **kw)


# -- speculative_generate ----------------------------------------------------------------------------------------
def _plain(target, p, n, **kw):
    return target.generate(p[None], max_new_tokens=n, do_sample=False, **kw)[0, p.numel():]


def test_speculative_generate_reads_eos_token_id_as_generate_does():
    """Unset: the target's EOS ends a sequence; None: no EOS at all, as ``generate(eos_token_id=None)``."""
    target, mtp = tiny_pair(seed=69)
    ps = [prompt(69, length=6)[0], prompt(70, length=9)[0]]
    eos = int(_plain(target, ps[0], 30, eos_token_id=None)[5])  # a token the first sequence emits early
    target.generation_config.eos_token_id = eos
    unset = speculative_generate(target, mtp, ps, max_new_tokens=30)
    none = speculative_generate(target, mtp, ps, max_new_tokens=30, eos_token_id=None)
    for i, p in enumerate(ps):
        assert torch.equal(none.new_tokens[i], _plain(target, p, 30, eos_token_id=None)), i
        want = _plain(target, p, 30)  # the target's EOS
        assert torch.equal(unset.new_tokens[i], want), i
    assert unset.new_tokens[0].numel() < 30 and int(unset.new_tokens[0][-1]) == eos  # the EOS ended it
    assert none.new_tokens[0].numel() == 30 and eos in none.new_tokens[0].tolist()  # and was ignored here


def test_speculative_generate_refuses_float_and_empty_prompts_and_keeps_its_statistics():
    target, mtp = tiny_pair(seed=71)
    for bad in ([torch.tensor([5.0, 6.0, 7.0])], [[5.0, 6.0]], torch.tensor([[5.0, 6.0, 7.0]])):
        with pytest.raises(TypeError, match="integer token ids"):
            speculative_generate(target, mtp, bad, max_new_tokens=4)
    with pytest.raises(TypeError, match="integer token ids"):
        target.generate(prompt(71).float(), assistant_model=mtp, max_new_tokens=4)
    with pytest.raises(ValueError, match="empty list: pass at least one prompt"):
        speculative_generate(target, mtp, [], max_new_tokens=4)
    ps = [prompt(72, length=5)[0], prompt(73, length=8)[0]]
    out = speculative_generate(target, mtp, ps, max_new_tokens=12, eos_token_id=None)
    stats = mtp.last_generation_stats
    assert isinstance(stats, BatchGenerationStats) and stats is out.stats and len(stats) == 2
    assert stats.rounds == sum(s.rounds for s in stats) > 0 and [s.new_tokens for s in stats] == [12, 12]


@pytest.mark.tf_internals
def test_mtp_decoding_honours_num_assistant_tokens_given_to_generate():
    target, mtp = tiny_pair(seed=74)
    ids = torch.cat([torch.full((1, 3), 2), prompt(74, length=6)], 1).repeat(2, 1)
    ids[1] = torch.cat([torch.tensor([2]), prompt(75, length=8)[0]])
    mask = (ids != 2).long()
    default = mtp.generation_config.num_assistant_tokens
    for passed, want in ((None, default), (2, 2), (5, 5)):
        extra = {} if passed is None else {"num_assistant_tokens": passed}
        out = target.generate(ids, attention_mask=mask, custom_generate=mtp_decoding, mtp=mtp, max_new_tokens=12,
                              do_sample=False, **extra)
        stats = mtp.last_generation_stats
        assert [s.num_assistant_tokens for s in stats] == [want, want], passed
        assert max(len(s.drafted_by_position) for s in stats) == want  # rounds of `want` drafts
        ref = speculative_generate(target, mtp, ids, attention_mask=mask, max_new_tokens=12, num_assistant_tokens=want,
                                   pad_token_id=target.generation_config.pad_token_id)
        assert torch.equal(out, ref.sequences)


# -- NaN ---------------------------------------------------------------------------------------------------------
@pytest.mark.tf_internals
def test_nan_draft_logits_when_sampling_raise_an_error_naming_nan():
    """A broken MTP (NaN weights) under ``do_sample=True``: an error that says NaN and what to check, not
    ``torch.multinomial``'s, on every drafting path (the drafter's sampled rounds, the per-position Chooser of a
    processor that reads the sequence, our loop on a graphed target, the batched API)."""
    target, mtp = tiny_pair(seed=76)
    with torch.no_grad():
        mtp.e_proj.weight.fill_(float("nan"))
    ids = prompt(76)
    for extra in ({}, {"repetition_penalty": 1.2}):
        with pytest.raises(FloatingPointError, match="NaN.*weights"):
            target.generate(ids, assistant_model=mtp, do_sample=True, max_new_tokens=8, **extra)
    with pytest.raises(FloatingPointError, match="NaN"):
        speculative_generate(target, mtp, [ids[0]], do_sample=True, max_new_tokens=8)
    graph_target(target, max_length=64)
    with pytest.raises(FloatingPointError, match="NaN"):
        target.generate(ids, assistant_model=mtp, do_sample=True, max_new_tokens=8)


# -- crop --------------------------------------------------------------------------------------------------------
@pytest.mark.tf_internals
def test_crop_has_transformers_meaning_on_the_mtp_caches_and_the_targets():
    """``crop(n)``: n < 0 removes -n tokens, 0 removes nothing, n > 0 keeps the first n -- on the MTP's caches
    as on the target's (``truncate(length)`` is the absolute form)."""
    target, mtp = tiny_pair(seed=77)
    ids = prompt(77)
    hs = torch.randn(1, 11, mtp.config.hc_mult, mtp.config.hidden_size)
    caches = [mtp.new_cache(), mtp.new_cache(paged=True), RollbackDeepseekV4Cache(target.config, max_rollback=3)]
    with torch.no_grad():
        for cache in caches[:2]:
            mtp(ids, hs, past_key_values=cache)
        target(ids, use_cache=True, **{cache_kwarg(target): caches[2]})
    for cache in caches:
        name = type(cache).__name__
        assert cache.get_seq_length() == 11, name
        cache.crop(0)
        assert cache.get_seq_length() == 11, name
        cache.crop(-2)
        assert cache.get_seq_length() == 9, name
        cache.crop(50)  # keeps the first 50: all of them
        assert cache.get_seq_length() == 9, name
        cache.crop(8)
        assert cache.get_seq_length() == 8, name
    for cache in caches[:2]:
        cache.truncate(6)
        assert cache.get_seq_length() == 6
