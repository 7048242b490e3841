"""Batches with DSpark (issue 59): `speculative_generate(target, dspark, prompts)` runs B ragged sequences, each
with its own verify length (K, "auto" or a confidence threshold), acceptance, rollback and positions.  Greedy:
every sequence gets what plain greedy `generate` gives it alone; sampled: exact speculative sampling per sequence.
Drafts are forced to the target's own tokens (wrong every few positions) where multi-token rounds and rollbacks
must happen: the random drafter alone lands almost nothing."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from dsv4_mtp_hf.generation import Drafts, speculative_decoding, speculative_generate
from dsv4_mtp_hf.generation.dspark_batch import DSparkBatch
from dsv4_mtp_hf.generation.dspark_session import DSparkSession
from dsv4_mtp_hf.generation.stats import BatchGenerationStats
from dsv4_mtp_hf.modeling_dspark import DeepseekV4DSparkForCausalLM
from dsv4_mtp_hf.target_runtime.features import FeatureTap
from dsv4_mtp_hf.target_runtime.ragged import RaggedTargetForward

from .helpers import tiny_pair
from .test_dspark import _chi2_pvalue, tiny_dspark_pair

SEED = 5900
LENGTHS = (5, 12, 23, 9)


def prompts(seed: int, lengths=LENGTHS, vocab: int = 300) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def plain(target, p, n, **kw):
    kw.setdefault("eos_token_id", None)
    return target.generate(p[None], max_new_tokens=n, do_sample=False, **kw)[0, p.numel():]


def _truth(tokens, truth, at: int, wrong_every: int, vocab: int):
    """Drafts ``tokens [γ]`` (after ``at`` confirmed tokens) replaced by ``truth``'s, one in ``wrong_every``
    positions off by one."""
    tokens = tokens.clone()
    for j in range(tokens.shape[0]):
        tok = truth[at + j] if at + j < len(truth) else 0
        tokens[j] = (tok + 1) % vocab if (at + j) % wrong_every == 0 else tok
    return tokens


def force_truth(monkeypatch, truths, wrong_every: int = 7, vocab: int = 300):
    """Each sequence's drafts become its ``truths[i]`` tokens (prompt + plain output; see :func:`_truth`), while
    the drafter still runs (its caches are filled, rolled back and committed)."""
    real = DSparkBatch._block

    def block(self, seqs):
        out = real(self, seqs)
        out.tokens = torch.stack([_truth(out.tokens[r], truths[i], len(self.call.tokens[i]), wrong_every, vocab)
                                  for r, i in enumerate(seqs)])
        return out

    monkeypatch.setattr(DSparkBatch, "_block", block)


def force_truth_alone(monkeypatch, truth, wrong_every: int = 7, vocab: int = 300):
    """:func:`force_truth` for batch 1 (``target.generate(assistant_model=dspark)``)."""
    real = DSparkSession._draft

    def _draft(self, ids, features, choose, limit):
        d = real(self, ids, features, choose, limit)
        return Drafts(_truth(d.tokens[0], truth, ids.shape[1], wrong_every, vocab)[None], d.logits, d.confidences)

    monkeypatch.setattr(DSparkSession, "_draft", _draft)


def record_blocks(monkeypatch):
    """Every block the drafter makes, per sequence, in round order: ``{sequence: [(tokens, confidences)]}``
    (batch 1 records under sequence 0)."""
    seen, real = {}, DeepseekV4DSparkForCausalLM.draft
    rows: list = [None]  # the sequences of the batch's block in flight

    def draft(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        for r, i in enumerate(rows[0] if rows[0] is not None else [0]):
            seen.setdefault(i, []).append((out.tokens[r].clone(), out.confidences[r].clone()))
        return out

    real_block = DSparkBatch._block

    def block(self, seqs):
        rows[0] = seqs
        try:
            return real_block(self, seqs)
        finally:
            rows[0] = None

    monkeypatch.setattr(DeepseekV4DSparkForCausalLM, "draft", draft)
    monkeypatch.setattr(DSparkBatch, "_block", block)
    return seen


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


@pytest.mark.tf_internals
@pytest.mark.parametrize("setting", [dict(num_assistant_tokens=3), dict(num_assistant_tokens="auto"),
                                     dict(assistant_confidence_threshold=0.5)], ids=["K=3", "auto", "threshold"])
def test_ragged_dspark_batch_equals_per_sequence_greedy(setting, monkeypatch):
    """Four prompts of 5-23 tokens; the second stops early at an EOS it emits, the others run to
    max_new_tokens.  Forced drafts: rounds accept several drafts and roll back at the wrong ones, each sequence at
    its own positions.  Each output equals plain greedy alone; with a fixed verify length each sequence's blocks
    (the drafter's own tokens, its confidences) are those it makes for that sequence with batch 1."""
    print(f"seed={SEED}")
    target, dspark = tiny_dspark_pair(seed=SEED + 1)
    ps, n = prompts(SEED + 1), 30
    eos = int(plain(target, ps[1], n)[8])  # the second sequence emits it early
    wants = []
    for p in ps:
        w = plain(target, p, n, eos_token_id=eos, pad_token_id=2)
        wants.append(w[: (w == eos).nonzero()[0, 0] + 1] if (w == eos).any() else w)
    assert len({w.numel() for w in wants}) > 1  # they do finish at different rounds
    truths = [p.tolist() + w.tolist() for p, w in zip(ps, wants)]
    blocks = record_blocks(monkeypatch)
    force_truth(monkeypatch, truths)
    out = speculative_generate(target, dspark, ps, max_new_tokens=n, eos_token_id=eos, pad_token_id=2, **setting)
    fixed = setting.get("num_assistant_tokens") == 3
    for i, (p, want) in enumerate(zip(ps, wants)):
        assert torch.equal(out.new_tokens[i], want), i
        assert torch.equal(out.sequences[i, : p.numel() + want.numel()], torch.cat([p, want]))
        stats = out.stats[i]
        assert stats.new_tokens == want.numel() and 0 < stats.accepted < stats.drafted, (i, stats)
        assert stats.mean_accepted_length > 2, (i, stats)
        if fixed:
            assert 2.5 < stats.mean_verified_length <= 3 and not stats.draft_lengths
        else:
            lengths = [k for k in stats.draft_lengths if k]
            assert lengths and max(lengths) <= 5 and len(set(lengths)) > 1, stats.draft_lengths
        if "assistant_confidence_threshold" in setting:  # the longest prefix whose confidences reach 0.5
            cut = [max(1, next((j for j, c in enumerate(cs.tolist()) if c < 0.5), 5)) for _, cs in blocks[i]]
            assert stats.draft_lengths == cut
    assert isinstance(dspark.last_generation_stats, BatchGenerationStats) and dspark.last_generation_stats is out.stats
    if not fixed:
        return
    for i, p in enumerate(ps):  # batch 1, forced alike: the same rounds, the same blocks
        monkeypatch.undo()
        alone = record_blocks(monkeypatch)
        force_truth_alone(monkeypatch, truths[i])
        got = target.generate(p[None], assistant_model=dspark, max_new_tokens=n, do_sample=False, eos_token_id=eos,
                              pad_token_id=2, **setting)
        assert torch.equal(got[0, p.numel():], wants[i])
        assert len(alone[0]) == len(blocks[i]) > 2, i
        for (tokens, confidences), (one, one_confidences) in zip(blocks[i], alone[0]):
            assert torch.equal(tokens, one), i
            torch.testing.assert_close(confidences, one_confidences, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("setting", [dict(num_assistant_tokens="auto"), dict(num_assistant_tokens=3)],
                         ids=["auto", "K=3"])
def test_sampled_dspark_batch_matches_plain_sampling_in_distribution(setting):
    """400 copies of one prompt in one batch, 5 new tokens each: every position is distributed as plain sampling's
    (chi-square; temperature and top-k applied alike to drafts and verifier).  Under "auto" the sequences verify
    lengths 1..3 side by side, each chosen from its own confidences."""
    print(f"seed={SEED}")
    vocab, n, new = 16, 400, 5
    target, dspark = tiny_dspark_pair(seed=8, vocab_size=vocab, dspark_noise_token_id=15)  # confidences 1e-14..1
    ids = torch.randint(3, vocab, (1, 6), generator=torch.Generator().manual_seed(SEED))
    kw = dict(do_sample=True, temperature=1.3, top_k=10, max_new_tokens=new, eos_token_id=None)
    torch.manual_seed(SEED + 1)  # not the batch's seed: its first draws would be the reference's
    reference = target.generate(ids.expand(n, -1), **kw)[:, -new:]
    out = speculative_generate(target, dspark, [ids[0]] * n, generator=torch.Generator().manual_seed(SEED), **kw,
                               **setting)
    spec = torch.stack(out.new_tokens)
    stats = out.stats
    assert 0.1 * stats.drafted < stats.accepted < 0.9 * stats.drafted  # accepted and resampled drafts
    if setting["num_assistant_tokens"] == "auto":
        assert len({s.draft_lengths[0] for s in stats}) > 1  # verify lengths differ within a round
        assert len({k for s in stats for k in s.draft_lengths}) >= 3
    for i in range(new):
        assert _chi2_pvalue(reference[:, i], spec[:, i], vocab) > 1e-3, f"token {i} distribution differs"


def test_seeded_sampled_dspark_batches_repeat_whatever_the_clock_says(monkeypatch):
    """"auto" in a batch chooses from modeled round costs, never from timings: a seed gives the same tokens and
    verify lengths every time, while the clock returns noise."""
    from dsv4_mtp_hf.generation import draft_length

    target, dspark = tiny_dspark_pair(seed=8)
    noise = iter(torch.rand(100_000, generator=torch.Generator().manual_seed(0)).cumsum(0).tolist())
    monkeypatch.setattr(draft_length.time, "perf_counter", lambda: next(noise))
    ps, runs = prompts(SEED + 2, (7, 15, 4)), []
    for _ in range(2):
        out = speculative_generate(target, dspark, ps, do_sample=True, temperature=0.8, max_new_tokens=25,
                                   eos_token_id=None, num_assistant_tokens="auto",
                                   generator=torch.Generator().manual_seed(SEED))
        runs.append(([t.tolist() for t in out.new_tokens], [s.draft_lengths for s in out.stats]))
    assert runs[0] == runs[1] and all(len(t) == 25 for t in runs[0][0])
    assert any(k > 1 for lengths in runs[0][1] for k in lengths)


def test_auto_chooses_plain_steps_per_sequence(monkeypatch):
    """"auto" weighs plain steps against drafting for each sequence on its own: a sequence whose drafts all miss
    soon takes plain steps (verified length 0, no block drafted for it) while one whose drafts land keeps drafting
    in the same rounds; both outputs equal plain greedy."""
    target, dspark = tiny_dspark_pair(seed=SEED + 6)
    ps, n = prompts(SEED + 6, (9, 14)), 40
    wants = [plain(target, p, n) for p in ps]
    force_truth(monkeypatch, [p.tolist() + w.tolist() for p, w in zip(ps, wants)], wrong_every=10**6)
    blocks = record_blocks(monkeypatch)
    real = DSparkBatch._block

    def miss_for_the_second(self, seqs):  # every draft of sequence 1 wrong
        out = real(self, seqs)
        out.tokens[[r for r, i in enumerate(seqs) if i == 1]] += 1
        return out

    monkeypatch.setattr(DSparkBatch, "_block", miss_for_the_second)
    out = speculative_generate(target, dspark, ps, max_new_tokens=n, eos_token_id=None, num_assistant_tokens="auto")
    for i, want in enumerate(wants):
        assert torch.equal(out.new_tokens[i], want), i
    hit, miss = (s.draft_lengths for s in out.stats)
    print("draft lengths:", hit, miss)
    assert 0 not in hit and out.stats[0].accepted == out.stats[0].drafted > 0
    assert miss.count(0) > len(miss) / 2 and out.stats[1].accepted == 0
    assert len(blocks[1]) == len(miss) - miss.count(0) < len(blocks[0])  # no block for a plain step


class OnToken(StoppingCriteria):
    """Stops when the last token is one of ``ids`` (where it fires depends on the sequence's own tokens)."""

    def __init__(self, ids):
        self.ids = torch.tensor(sorted(ids))

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.ids)


@pytest.mark.tf_internals
def test_stopping_criteria_stop_each_sequence_where_plain_does(monkeypatch):
    """A criterion firing on a token inside a round of forced drafts ends that sequence there, as plain
    ``generate`` with the criterion does; the other sequences go on.  Through ``speculative_generate`` and through
    ``generate(custom_generate=speculative_decoding, drafter=)``, which also takes the threshold keyword."""
    target, dspark = tiny_dspark_pair(seed=SEED + 3)
    ps, n = prompts(SEED + 3, (8, 8, 8)), 24
    free = [plain(target, p, n) for p in ps]
    stops = {int(free[0][9]), int(free[2][13])}  # sequence 0 stops at new token 10 (or sooner), 2 at 14
    criteria = StoppingCriteriaList([OnToken(stops)])
    wants = [plain(target, p, n, stopping_criteria=criteria) for p in ps]
    assert len({w.numel() for w in wants}) > 1
    force_truth(monkeypatch, [p.tolist() + f.tolist() for p, f in zip(ps, free)])
    out = speculative_generate(target, dspark, ps, max_new_tokens=n, num_assistant_tokens=5, eos_token_id=None,
                               stopping_criteria=criteria)
    for i, want in enumerate(wants):
        assert torch.equal(out.new_tokens[i], want), i
        assert out.stats[i].accepted > 0 and out.stats[i].new_tokens == want.numel()
    ids = torch.stack(ps)
    seqs = target.generate(ids, custom_generate=speculative_decoding, drafter=dspark, max_new_tokens=n,
                           assistant_confidence_threshold=0.9, stopping_criteria=criteria, do_sample=False,
                           eos_token_id=None, pad_token_id=2)
    lengths = [s.draft_lengths for s in dspark.last_generation_stats]
    kw = dict(max_new_tokens=n, eos_token_id=None, pad_token_id=2, stopping_criteria=criteria)
    ref = speculative_generate(target, dspark, ps, assistant_confidence_threshold=0.9, **kw)
    auto = speculative_generate(target, dspark, ps, **kw)  # the drafter's own setting
    assert torch.equal(seqs, ref.sequences) and torch.equal(seqs, auto.sequences)
    assert lengths == [s.draft_lengths for s in ref.stats] != [s.draft_lengths for s in auto.stats]
    for i, want in enumerate(wants):
        assert torch.equal(seqs[i, 8 : 8 + want.numel()], want)


@pytest.mark.tf_internals
def test_bad_batched_calls_name_the_fix():
    target, dspark = tiny_dspark_pair(seed=SEED + 4)
    ps = prompts(SEED + 4, (5, 7))
    with pytest.raises(ValueError, match=r"exceeds the 5 drafts.*ask for fewer.*one block"):
        speculative_generate(target, dspark, ps, num_assistant_tokens=6)
    with pytest.raises(ValueError, match=r"assistant_confidence_threshold.*\[0, 1\]"):
        speculative_generate(target, dspark, ps, assistant_confidence_threshold=1.5)
    other, _ = tiny_dspark_pair(seed=SEED + 5)
    with pytest.raises(ValueError, match=r"DeepseekV4DSparkForCausalLM is not bound to the target.*bound to another"):
        speculative_generate(other, dspark, ps)
    dspark.unbind()
    with pytest.raises(ValueError, match=r"DeepseekV4DSparkForCausalLM is not bound.*bind\(target\)"):
        speculative_generate(target, dspark, ps)
    dspark.bind(target)
    with pytest.raises(ValueError, match="RepetitionPenalty.*assistant_model=drafter"):
        target.generate(torch.stack([ps[0], ps[0]]), custom_generate=speculative_decoding, drafter=dspark,
                        max_new_tokens=4, repetition_penalty=1.3)
    with pytest.raises(ValueError, match="two drafters.*`drafter=`"):
        target.generate(ps[0][None], custom_generate=speculative_decoding, drafter=dspark, mtp=object(),
                        max_new_tokens=4)
    mtp_target, mtp = tiny_pair(seed=1)
    with pytest.raises(ValueError, match="MTP batches draft a fixed number.*`num_assistant_tokens` as an int"):
        speculative_generate(mtp_target, mtp, [ps[0]], num_assistant_tokens="auto")
    with pytest.raises(ValueError, match="assistant_confidence_threshold.*confidence head.*num_assistant_tokens"):
        speculative_generate(mtp_target, mtp, [ps[0]], assistant_confidence_threshold=0.5)
    with pytest.raises(TypeError, match="DeepseekV4MtpForCausalLM or DeepseekV4DSparkForCausalLM.*got Linear"):
        speculative_generate(target, torch.nn.Linear(2, 2), ps)
