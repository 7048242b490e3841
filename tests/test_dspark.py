"""DSpark: the drafter of today's DeepSeek-V4 releases (issue 47, DSPARK.md).

The fidelity tests load a tiny random drafter written in the 0731 layout (FP8 + E8M0 block scales, MXFP4
experts, BF16 Markov / confidence heads: ``tests/dspark_release.py``) through the package's loader and drive
its two calls, ``commit`` and ``draft``, against the independent float64 oracle of ``tests/dspark_reference.py``.
The generation tests check ``target.generate(ids, assistant_model=dspark)`` against plain ``generate``.
"""

import numpy as np
import pytest
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dsv4_mtp_hf import DeepseekV4DSparkConfig, DeepseekV4DSparkForCausalLM, DeepseekV4MtpForCausalLM
from dsv4_mtp_hf.generation import Drafts, RollbackDeepseekV4Cache
from dsv4_mtp_hf.generation.dspark_session import DSparkSession
from dsv4_mtp_hf.loading import MtpCheckpointError
from dsv4_mtp_hf.loading.detect import load_drafter

from .dspark_reference import DSparkOracle
from .dspark_release import (decoded_dspark_weights, random_dspark_tensors, random_target_shared,
                             tiny_dspark_config, write_dspark_release)
from .helpers import randomize_

SEED = 20261206


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A tiny 0731-layout release: (directory, config dict, the drafter's float64 oracle)."""
    print(f"seed={SEED}")
    cfg = tiny_dspark_config()
    tensors, shared = random_dspark_tensors(cfg, seed=SEED), random_target_shared(cfg, seed=SEED + 1)
    path = write_dspark_release(tmp_path_factory.mktemp("dspark") / "release", cfg, tensors, shared)
    return path, cfg, decoded_dspark_weights({**tensors, **shared})


def _experts_chosen(model):
    """Hooks recording each draft layer's routed expert ids per call (top-k of the router)."""
    chosen, hooks = [], []
    for i, layer in enumerate(model.layers):
        hooks.append(layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: chosen.append((i, out[1].clone()))))
    return chosen, hooks


def _window_rows(cache, layer: int, start: int, window: int) -> torch.Tensor:
    """Layer ``layer``'s context K/V of positions ``max(0, start - window) .. start - 1`` read from its ring."""
    state = cache.layers[layer].snapshot()
    n = min(window, start)
    return state["kv"][0, -n:] if n else state["kv"][0, :0]


def test_loaded_0731_drafter_matches_the_float64_oracle_over_a_multi_round_session(release):
    """Rounds with no, partial and full acceptance: after every commit the window caches hold the oracle's context
    K/V; every draft's logits are within 1e-4 (relative) of the oracle's, its greedy tokens and chosen experts equal."""
    path, cfg, weights = release
    model = DeepseekV4DSparkForCausalLM.from_pretrained(path, dtype=torch.float32)  # embed/head from the release
    oracle, g = DSparkOracle(cfg, weights), torch.Generator().manual_seed(SEED)
    f, hc, d, window = len(cfg["dspark_target_layer_ids"]), cfg["hc_mult"], cfg["hidden_size"], cfg["sliding_window"]
    cache, start, anchor = model.new_cache(1), 0, 7
    new_rows = 13  # the prompt
    for accepted in (0, 2, 5, 1, 5, 0, 3):  # drafts accepted in the round before each draft
        features = torch.randn(1, new_rows, f, hc, d, generator=g, dtype=torch.float64)
        positions = torch.arange(start, start + new_rows)
        oracle.commit(features[0], positions)
        with torch.no_grad():
            cache.truncate(start)  # the last block's rows go
            model.commit(features.float(), positions[None], cache)
        start += new_rows
        for i in range(model.config.num_draft_layers):
            want = oracle.window_kv(i, start)
            torch.testing.assert_close(_window_rows(cache, i, start, window).double(), want, rtol=1e-4, atol=1e-5)
        chosen, hooks = _experts_chosen(model)
        try:
            with torch.no_grad():
                out = model.draft(torch.tensor([[anchor]]), cache)
        finally:
            for h in hooks:
                h.remove()
        ref = oracle.draft(anchor, start)
        assert out.tokens[0].tolist() == ref["tokens"].tolist()
        rel = (out.logits[0].double() - ref["logits"]).abs().max() / ref["logits"].abs().max()
        assert rel < 1e-4, f"logits differ by {rel:.2e} (relative)"
        torch.testing.assert_close(out.confidences[0].double(), ref["confidences"], rtol=1e-4, atol=1e-6)
        for i, ids in chosen:
            assert torch.equal(ids.reshape(-1, ids.shape[-1]).sort(-1).values, ref["experts"][i].sort(-1).values)
        # the target accepts `accepted` drafts and emits its own token: commit the anchor and the accepted drafts
        new_rows = 1 + min(accepted, cfg["dspark_block_size"])
        anchor = int(torch.randint(3, cfg["vocab_size"], (1,), generator=g))


def test_fp8_kv_roundtrip_knob_matches_the_oracle(tmp_path):
    """DeepSeek's FP8 round trip of the context and block K/V (64 non-RoPE channels here: one group)."""
    cfg = tiny_dspark_config(head_dim=80, partial_rotary_factor=0.2)
    tensors, shared = random_dspark_tensors(cfg, seed=SEED), random_target_shared(cfg, seed=SEED + 1)
    path = write_dspark_release(tmp_path / "release", cfg, tensors, shared)
    weights = decoded_dspark_weights({**tensors, **shared})
    model = DeepseekV4DSparkForCausalLM.from_pretrained(path, dtype=torch.float32, kv_fp8_roundtrip=True)
    oracle = DSparkOracle(cfg, weights, kv_fp8_roundtrip=True)
    features = torch.randn(1, 20, 3, cfg["hc_mult"], cfg["hidden_size"], dtype=torch.float64,
                           generator=torch.Generator().manual_seed(SEED))
    oracle.commit(features[0], torch.arange(20))
    cache = model.new_cache(1)
    with torch.no_grad():
        model.commit(features.float(), torch.arange(20)[None], cache)
        out = model.draft(torch.tensor([[5]]), cache)
    ref = oracle.draft(5, 20)
    rel = (out.logits[0].double() - ref["logits"]).abs().max() / ref["logits"].abs().max()
    assert rel < 1e-3


def test_detection_picks_the_drafter_and_each_class_refuses_the_other(release, tmp_path):
    path, cfg, _ = release
    assert type(load_drafter(path, dtype=torch.float32)) is DeepseekV4DSparkForCausalLM
    with pytest.raises(MtpCheckpointError, match="DeepseekV4DSparkForCausalLM"):
        DeepseekV4MtpForCausalLM.from_pretrained(path)
    v41 = write_dspark_release(tmp_path / "v41", {**cfg, "model_type": "deepseek_v41"}, {}, {})
    with pytest.raises(MtpCheckpointError, match="V4.1"):
        DeepseekV4DSparkForCausalLM.from_pretrained(v41)
    stripped = write_dspark_release(tmp_path / "stripped", cfg, {"mtp.0.attn_norm.weight": torch.ones(4)},
                                    random_target_shared(cfg, 0))
    with pytest.raises(MtpCheckpointError, match="stripped"):
        load_drafter(stripped)


def test_saved_drafter_reloads_bit_for_bit(release, tmp_path):
    path, cfg, _ = release
    model = DeepseekV4DSparkForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.save_pretrained(tmp_path / "saved")
    again = DeepseekV4DSparkForCausalLM.from_pretrained(tmp_path / "saved")
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert type(load_drafter(tmp_path / "saved")) is DeepseekV4DSparkForCausalLM


# -- generate -------------------------------------------------------------------------------------------


def tiny_dspark_pair(seed: int, **overrides):
    """A random V4 target (sliding, CSA, HCA layers) and a random DSpark drafter reading its three layers."""
    cfg = tiny_dspark_config(**{**dict(num_hidden_layers=4, hidden_size=64, moe_intermediate_size=32, head_dim=32,
                                       q_lora_rank=32, o_lora_rank=16, dspark_markov_rank=8), **overrides})
    cfg["dspark_target_layer_ids"] = [1, 2, 3]
    torch.manual_seed(seed)
    config = DeepseekV4Config(**cfg)
    target = DeepseekV4ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    randomize_(target, g, std=0.1)
    drafter = DeepseekV4DSparkForCausalLM(DeepseekV4DSparkConfig.from_target_config(config)).eval()
    randomize_(drafter, g)
    return target, drafter.bind(target)


def _truth_drafts(monkeypatch, truth, wrong_at):
    """Each round's drafts become ``truth``'s tokens (off by one at ``wrong_at``) while the drafter still runs."""
    real = DSparkSession._draft

    def _draft(self, ids, features, choose, limit):
        drafts = real(self, ids, features, choose, limit)
        if drafts is None:
            return None
        tokens = drafts.tokens.clone()
        for i in range(tokens.shape[1]):
            j = ids.shape[1] + i
            tok = int(truth[0, j]) if j < truth.shape[1] else 0
            tokens[0, i] = (tok + 1) % 300 if j in wrong_at else tok
        return Drafts(tokens, drafts.logits, drafts.confidences)

    monkeypatch.setattr(DSparkSession, "_draft", _draft)


@pytest.mark.parametrize("num_assistant_tokens, new_tokens", [("auto", 160), (5, 60), (2, 60)])
def test_greedy_generate_with_dspark_equals_plain_over_150_tokens(num_assistant_tokens, new_tokens, monkeypatch):
    target, dspark = tiny_dspark_pair(seed=1)
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    assert torch.equal(target.generate(ids, assistant_model=dspark, num_assistant_tokens=num_assistant_tokens, **kw),
                       plain)
    _truth_drafts(monkeypatch, plain, {12 + i for i in range(0, new_tokens, 7)})
    got = target.generate(ids, assistant_model=dspark, num_assistant_tokens=num_assistant_tokens, **kw)
    assert torch.equal(got, plain)
    stats = dspark.last_generation_stats
    assert 0 < stats.accepted < stats.drafted and stats.mean_accepted_length > 2
    if num_assistant_tokens == "auto":
        assert stats.draft_lengths and max(stats.draft_lengths) <= 5  # verified lengths chosen per round
        assert stats.mean_verified_length <= 5
    else:  # a fixed length verifies K drafts a round, but for the length-cut last rounds
        assert num_assistant_tokens - 0.5 < stats.mean_verified_length <= num_assistant_tokens


def test_auto_takes_plain_steps_when_every_block_misses_and_drafts_when_they_land(monkeypatch):
    """DSpark's "auto" weighs plain steps before drafting a block (its confidences come after the block is
    paid for): with every draft wrong it runs plain steps, probing rarely; with drafts that land it never
    does; greedy output equals plain either way.  A drafting round is made to cost two plain steps on a fake
    clock (a CPU's timings of a tiny pair say little)."""
    from dsv4_mtp_hf.generation import draft_length

    target, dspark = tiny_dspark_pair(seed=5)
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(6))
    kw = dict(max_new_tokens=90, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    clock = [0.0]

    def tick():
        clock[0] += 1.0
        return clock[0]

    monkeypatch.setattr(draft_length.time, "perf_counter", tick)  # one read per round: a plain round costs 1
    real = DSparkSession._draft
    monkeypatch.setattr(DSparkSession, "_draft", lambda self, *a: (tick(), real(self, *a))[1])  # a block: +1
    for wrong, plain_steps in ((range(12, 12 + 90), lambda n: n >= 50), ((), lambda n: n == 0)):
        _truth_drafts(monkeypatch, plain, set(wrong))
        got = target.generate(ids, assistant_model=dspark, num_assistant_tokens="auto", **kw)
        assert torch.equal(got, plain)
        lengths = dspark.last_generation_stats.draft_lengths
        print("draft lengths:", lengths)
        assert plain_steps(lengths.count(0)), lengths


def test_confidence_threshold_sets_the_verified_lengths(monkeypatch):
    target, dspark = tiny_dspark_pair(seed=3)
    ids = torch.randint(3, 300, (1, 10), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    confidences = []
    real = DSparkSession._draft

    def record(self, *a):
        drafts = real(self, *a)
        confidences.append(drafts.confidences[0].tolist())
        return drafts

    monkeypatch.setattr(DSparkSession, "_draft", record)
    got = target.generate(ids, assistant_model=dspark, assistant_confidence_threshold=0.5, **kw)
    assert torch.equal(got, target.generate(ids, **kw))
    lengths = dspark.last_generation_stats.draft_lengths
    want = [max(1, next((j for j, c in enumerate(cs) if c < 0.5), len(cs))) for cs in confidences]
    assert lengths == want[: len(lengths)] and len(set(lengths)) > 1


def test_multi_turn_with_dspark_resumes_the_drafter(monkeypatch):
    target, dspark = tiny_dspark_pair(seed=5)
    g = torch.Generator().manual_seed(6)
    p1, more = torch.randint(3, 300, (1, 9), generator=g), torch.randint(3, 300, (1, 5), generator=g)
    cache = RollbackDeepseekV4Cache(target.config, max_rollback=5)
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    a1 = target.generate(p1, assistant_model=dspark, cache=cache, **kw)
    x = torch.cat([a1, more], dim=1)
    committed = []
    real = DSparkSession._draft
    monkeypatch.setattr(DSparkSession, "_draft", lambda self, *a: committed.append(self.committed) or real(self, *a))
    a2 = target.generate(x, assistant_model=dspark, cache=cache, **kw)
    assert torch.equal(a2, target.generate(x, **kw))
    assert committed[0] > 0  # the second call's drafter started from the first call's state


def _chi2_pvalue(a, b, vocab):
    ca, cb = torch.bincount(a, minlength=vocab).double(), torch.bincount(b, minlength=vocab).double()
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    tot, na, nb = ca + cb, ca.sum(), cb.sum()
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    stat = (((ca - ea) ** 2) / ea + ((cb - eb) ** 2) / eb).sum()
    return float(1 - torch.distributions.Chi2(torch.tensor(float(int(keep.sum()) - 1))).cdf(stat))


@pytest.mark.parametrize("path", ["sampled block", pytest.param("per-position", marks=pytest.mark.slow)])
def test_speculative_sampling_with_dspark_matches_plain_sampling(path, monkeypatch):
    """400 sampled calls: the first three tokens are distributed as plain sampling's (chi-square)."""
    vocab = 16
    target, dspark = tiny_dspark_pair(seed=7, vocab_size=vocab, dspark_noise_token_id=15)
    ids = torch.randint(3, vocab, (1, 6), generator=torch.Generator().manual_seed(8))
    kw = dict(do_sample=True, temperature=1.3, top_k=10, max_new_tokens=3, eos_token_id=None)
    if path == "per-position":
        from dsv4_mtp_hf.generation import round as rounds

        monkeypatch.setattr(rounds, "regime", lambda do_sample, processors: "processed")
    n = 400
    torch.manual_seed(0)
    plain = target.generate(ids.expand(n, -1), **kw)[:, -3:]
    torch.manual_seed(1)
    assisted, drafted, accepted = [], 0, 0
    for _ in range(n):
        assisted.append(target.generate(ids, assistant_model=dspark, num_assistant_tokens=2, **kw)[0, -3:])
        drafted += dspark.last_generation_stats.drafted
        accepted += dspark.last_generation_stats.accepted
    assisted = torch.stack(assisted)
    assert 0.1 * drafted < accepted < drafted
    for i in range(3):
        assert _chi2_pvalue(plain[:, i], assisted[:, i], vocab) > 1e-3, f"token {i} distribution differs"


def test_dspark_on_the_graphed_target_equals_plain(monkeypatch):
    """On a graphed target (CPU: the fixed-shape step without graphs) the features come from the step itself."""
    from dsv4_mtp_hf import graph_target, ungraph_target

    target, dspark = tiny_dspark_pair(seed=9)
    ids = torch.randint(3, 300, (1, 11), generator=torch.Generator().manual_seed(10))
    kw = dict(max_new_tokens=60, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    graph_target(target, max_length=128)
    try:
        _truth_drafts(monkeypatch, plain, {11 + i for i in range(0, 60, 6)})
        got = target.generate(ids, assistant_model=dspark, **kw)
    finally:
        ungraph_target(target)
    assert torch.equal(got, plain)
    assert dspark.last_generation_stats.accepted > 0


def test_bad_inputs_name_the_problem():
    target, dspark = tiny_dspark_pair(seed=11)
    with pytest.raises(ValueError, match="exceeds"):
        target.generate(torch.tensor([[5, 6, 7]]), assistant_model=dspark, num_assistant_tokens=6, max_new_tokens=3)
    with pytest.raises(ValueError, match="layer outputs"):
        dspark(torch.tensor([[5]]), hidden_states=torch.randn(1, 4, 2, 4, 64))
    other = DeepseekV4ForCausalLM(DeepseekV4Config(**tiny_dspark_config(hidden_size=128)))
    with pytest.raises(ValueError, match="does not match"):
        dspark.bind(other)


def test_drafting_settings_from_a_generation_config_are_honoured_or_refused():
    """``num_assistant_tokens`` in a passed ``generation_config`` (or the target's) and
    ``assistant_confidence_threshold`` on the drafter's ``generation_config`` (where transformers reads an
    assistant's settings) are honoured like the keywords, never silently replaced by the drafter's "auto"."""
    from transformers import GenerationConfig

    target, dspark = tiny_dspark_pair(seed=12)
    ids = torch.randint(3, 300, (1, 8), generator=torch.Generator().manual_seed(13))
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    got = target.generate(ids, assistant_model=dspark, generation_config=GenerationConfig(num_assistant_tokens=2, **kw))
    assert torch.equal(got, plain)
    stats = dspark.last_generation_stats
    assert not stats.draft_lengths and 0 < stats.mean_verified_length <= 2  # a fixed K=2, not "auto"
    assert torch.equal(target.generate(ids, assistant_model=dspark, num_assistant_tokens=np.int64(2), **kw), plain)
    with pytest.raises(ValueError, match="exceeds"):
        target.generate(ids, assistant_model=dspark, generation_config=GenerationConfig(num_assistant_tokens=6, **kw))
    target.generation_config.num_assistant_tokens = 2
    try:
        assert torch.equal(target.generate(ids, assistant_model=dspark, **kw), plain)
        assert not dspark.last_generation_stats.draft_lengths
    finally:
        target.generation_config.num_assistant_tokens = None
    target.generate(ids, assistant_model=dspark, assistant_confidence_threshold=0.5, **kw)
    want = dspark.last_generation_stats.draft_lengths
    dspark.generation_config.assistant_confidence_threshold = 0.5
    try:
        assert torch.equal(target.generate(ids, assistant_model=dspark, **kw), plain)
        assert dspark.last_generation_stats.draft_lengths == want
        dspark.generation_config.assistant_confidence_threshold = 7
        with pytest.raises(ValueError, match="assistant_confidence_threshold"):
            target.generate(ids, assistant_model=dspark, **kw)
    finally:
        dspark.generation_config.assistant_confidence_threshold = None
    with pytest.raises(ValueError, match="assistant_confidence_threshold"):
        target.generate(ids, assistant_model=dspark, assistant_confidence_threshold="0.5", **kw)


# -- CUDA ---------------------------------------------------------------------------------------------------


def _cuda_pair(seed: int):
    """A pair whose sizes the Triton FP4 MoE tiles (multiples of 256): the block round is graph-capturable."""
    target, dspark = tiny_dspark_pair(seed, hidden_size=256, moe_intermediate_size=256)
    return target.cuda(), dspark.cuda()


@pytest.mark.parametrize("sampled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_block_draft_compiles_as_one_graph_and_computes_the_eager_round(sampled):
    """The CUDA path compiles the block with ``fullgraph=True`` before capturing it; the same compile on the CPU
    (inductor) must trace it whole and give the eager round's drafts."""
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

    from dsv4_mtp_hf.generation.dspark_session import GraphedBlockDrafter

    _, drafter = tiny_dspark_pair(seed=5)
    c = drafter.config
    feats = torch.randn(1, 4, len(c.dspark_target_layer_ids), c.hc_mult, c.hidden_size,
                        generator=torch.Generator().manual_seed(6))
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.6), TopKLogitsWarper(20)]) if sampled else None
    rounds = []
    for compiled in (False, True):
        d = GraphedBlockDrafter(drafter, drafter.new_cache(1), sampled=sampled, warpers=warpers, compile=False)
        if compiled:
            d.block = torch.compile(d._block, fullgraph=True, dynamic=False)
        torch.manual_seed(7)  # the sampled draws
        rounds.append(d.round(feats, torch.tensor([[7]])))
    (t0, z0, c0), (t1, z1, c1) = rounds
    # sampled: the compiled draw consumes the generator differently, and each Markov step reads the token drawn
    # before it; so the first position's q and confidence match, and every draw lies in its own q's support
    n = 1 if sampled else z0.shape[1]
    torch.testing.assert_close(z1[:, :n], z0[:, :n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c1[:, :n], c0[:, :n], rtol=1e-4, atol=1e-4)
    if sampled:
        assert torch.isfinite(z1.gather(-1, t1.unsqueeze(-1))).all()
    else:
        assert torch.equal(t1, t0)


@pytest.mark.gpu
@pytest.mark.parametrize("sampled", [False, True])
def test_graphed_dspark_round_replays_its_eager_round(sampled):
    """The compiled, captured round (commit + block) gives the eager round's drafts, logits and confidences for
    every row count, from the same cache states."""
    from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    from dsv4_mtp_hf.generation.dspark_session import GraphedBlockDrafter

    target, dspark = _cuda_pair(seed=12)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(20)]) if sampled else None
    graphed = GraphedBlockDrafter(dspark, dspark.new_cache(1), sampled, warpers)
    eager = GraphedBlockDrafter(dspark, dspark.new_cache(1), sampled, warpers, compile=False)
    eager.use_graph = False
    assert graphed.use_graph and graphed.compiled
    g = torch.Generator(device="cuda").manual_seed(SEED)
    c = dspark.config
    prompt = torch.randn(1, 30, 3, c.hc_mult, c.hidden_size, device="cuda", generator=g)
    with torch.no_grad():
        for d in (graphed, eager):
            dspark.commit(prompt, torch.arange(30, device="cuda")[None], d.cache)
        for n in (1, 3, 6, 2, 6):
            features = torch.randn(1, n, 3, c.hc_mult, c.hidden_size, device="cuda", generator=g)
            anchor = torch.randint(3, 300, (1, 1), device="cuda", generator=g)
            start = int(graphed.cache.seq_lengths[0])
            got = [t.clone() for t in graphed.round(features, anchor)]
            want = eager.round(features, anchor)
            # sampled: the draws differ (the graph's RNG offsets are its own), so only what precedes the first
            # draw is compared -- the first row's processed logits and confidence
            rows = slice(None) if not sampled else slice(0, 1)
            if not sampled:
                assert torch.equal(got[0], want[0])
            finite = torch.isfinite(want[1][:, rows])
            torch.testing.assert_close(got[1][:, rows][finite], want[1][:, rows][finite], rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(got[2][:, rows], want[2][:, rows], rtol=2e-3, atol=2e-3)
            for d in (graphed, eager):
                d.cache.truncate(start + n)  # the block's rows go; the committed ones stay
    assert set(graphed.graphs) == {1, 2, 3, 6}


@pytest.mark.gpu
def test_dspark_generate_on_cuda_equals_plain_on_both_targets(monkeypatch):
    from dsv4_mtp_hf import graph_target, pack_fp4_experts, ungraph_target

    target, dspark = _cuda_pair(seed=13)
    ids = torch.randint(3, 300, (1, 11), generator=torch.Generator().manual_seed(14)).cuda()
    kw = dict(max_new_tokens=60, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)  # float32: a bf16 eager verify of 6 rows rounds unlike 1-row steps
    _truth_drafts(monkeypatch, plain, {11 + i for i in range(0, 60, 6)})
    assert torch.equal(target.generate(ids, assistant_model=dspark, **kw), plain)
    monkeypatch.undo()
    target, dspark = _cuda_pair(seed=13)  # a bf16 pair with packed experts: graph_target needs capturable experts
    pack_fp4_experts(target.bfloat16())  # (fp32 grouped_mm is not) and a release's drafter is bf16 too
    dspark.bfloat16()
    graph_target(target, max_length=128)
    try:
        plain_graphed = target.generate(ids, **kw)
        _truth_drafts(monkeypatch, plain_graphed, {11 + i for i in range(0, 60, 6)})
        got = target.generate(ids, assistant_model=dspark, **kw)
    finally:
        ungraph_target(target)
    assert torch.equal(got, plain_graphed)
    kept = [d for d in dspark.__dict__["_kept_drafters"].values()]
    assert kept and all(d.use_graph and d.graphs for d in kept)
