"""`graph_target`: the target's fixed-shape decode step (CUDA graphs on a GPU, the same code
eagerly on CPU) against transformers' own forward and generate."""

import random
import statistics

import pytest
import torch

from dsv4_mtp_hf import graph_target, pack_fp4_experts, ungraph_target
from dsv4_mtp_hf.generation import (CacheRollbackError, Drafts, GraphedTargetCache, RollbackDeepseekV4Cache,
                                    mtp_decoding)
from dsv4_mtp_hf.target_runtime import graph as target_graph
from dsv4_mtp_hf.target_runtime.fp8_linears import quantize_fp8_linears
from dsv4_mtp_hf.compat import cache_kwarg as _cache_kwarg

from .helpers import assert_equal_but_for_bf16_ties, draw_until_clear, edited_drafts, tiny_pair, truth_drafts

TOL = 3e-5  # float32, as the batched attention's tests (the same arithmetic in another summation order)
SEED = 2026


def ids_of(seed, n, vocab=320, device="cpu"):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)


def forward_both(target, graphs, steps, seed, K=3):
    """Feeds the same chunks to transformers' forward (rollback cache) and to the graphed one, with
    random crops of up to K rows after each chunk; yields both logits per chunk."""
    rng = random.Random(seed)
    ref_cache, cache = RollbackDeepseekV4Cache(target.config, max_rollback=K), graphs.new_cache(K)
    dev, name = target.lm_head.weight.device, _cache_kwarg(target)
    for i, n in enumerate(steps):
        chunk = ids_of(seed * 100 + i, n, target.config.vocab_size, dev)
        want = type(target).forward(target, chunk, use_cache=True, **{name: ref_cache}).logits
        got = target(chunk, use_cache=True, **{name: cache}).logits
        yield i, n, want, got
        if i:  # not the prompt: reject 0 .. n - 1 of the chunk's rows, as a verify would
            drop = rng.randint(0, min(n - 1, K))
            ref_cache.crop(-drop)
            cache.crop(-drop)
        assert cache.get_seq_length() == ref_cache.get_seq_length()


@pytest.mark.tf_internals
def test_graphed_forward_equals_transformers_through_steps_and_crops():
    def attempt(seed, margins):
        target, _ = tiny_pair(seed=seed % 1000, target_overrides=dict(index_n_heads=32))
        margins.watch(target)
        graphs = graph_target(target, max_length=200, max_rollback=3)
        rng = random.Random(seed)
        steps = [rng.randint(2, 20)] + [rng.randint(1, 4) for _ in range(40)] + [9]
        worst = 0.0
        for i, n, want, got in forward_both(target, graphs, steps, seed):
            assert got.shape == want.shape
            diff = (got - want).abs().max().item()
            assert diff < TOL, f"seed={seed} chunk {i} of {n} rows: max |graphed - transformers| = {diff:.3g}"
            worst = max(worst, diff)
        print(f"seed={seed}: worst |diff| {worst:.3g}")

    draw_until_clear(attempt)


@pytest.mark.tf_internals
@pytest.mark.parametrize("k", [1, 3])
def test_plain_and_assisted_generate_on_the_graphed_target_equal_plain_generate(k):
    print(f"seed={SEED + k}")
    target, mtp = tiny_pair(seed=SEED + k)
    ids = ids_of(SEED + k, 11)
    kw = dict(max_new_tokens=80, min_new_tokens=80, do_sample=False)
    plain = target.generate(ids, **kw)
    graph_target(target, max_length=128)
    assert torch.equal(target.generate(ids, **kw), plain)
    assert torch.equal(target.generate(ids, assistant_model=mtp, num_assistant_tokens=k, **kw), plain)
    assert mtp.last_generation_stats.rounds > 0
    # the graphed state is what served the calls
    assert target_graph.graphed(target).sequence.get_seq_length() > 80
    # a cache of the caller's own runs transformers' forward, on which the MTP reads its residual as on any target
    own = RollbackDeepseekV4Cache(target.config, max_rollback=k)
    assisted = target.generate(ids, assistant_model=mtp, num_assistant_tokens=k, past_key_values=own, **kw)
    assert torch.equal(assisted, plain)
    assert own.get_seq_length() > 80


@pytest.mark.tf_internals
def test_a_prompt_computes_the_same_on_the_targets_first_forward_and_later_ones():
    """Every prompt runs the same chunk steps, the first one included (it only allocates the state first):
    so plain and assisted calls, first or not, start from bitwise the same logits and residual."""
    print(f"seed={SEED}")
    target, _ = tiny_pair(seed=SEED)
    graphs = graph_target(target, max_length=64)
    ids, name = ids_of(SEED, 13), _cache_kwarg(target)
    first = target(ids, **{name: graphs.new_cache()}).logits
    first_features = graphs.take_features()
    again = target(ids, **{name: graphs.new_cache()}).logits
    assert first_features.shape[:3] == (1, 13, 1)  # the last layer's output at every row (what the MTP reads)
    assert torch.equal(first, again) and torch.equal(first_features, graphs.take_features())


def truth_with_mistakes(truth: torch.Tensor, wrong_at: set, sampled: bool = False):
    """An ``edited_drafts`` edit: the target's greedy continuation ``truth`` with a mistake at each position of
    ``wrong_at`` (the real MTP still runs and fills, rolls back and recomputes its cache).  ``sampled``: each draft
    comes with the one-hot distribution it was "drawn" from, so a right draft is accepted and a wrong one rejected."""
    oracle = truth_drafts(truth, wrong_at)

    def edit(ids, drafts):
        drafts = oracle(ids, drafts)
        if sampled:
            q = torch.full_like(drafts.logits, float("-inf")).scatter_(
                -1, drafts.tokens.unsqueeze(-1).to(drafts.logits.device), 0.0)
            drafts = Drafts(drafts.tokens, q, drafts.confidences)
        return drafts

    return edit


def _loop_case(seed, new_tokens, monkeypatch, sampled=False, mistakes=0.3):
    """A graphed tiny target whose MTP drafts the plain greedy output with a mistake at ``mistakes`` of the positions
    (:func:`truth_with_mistakes`, for the test's duration), its plain greedy output, and the list that counts the
    calls our loop serves."""
    from dsv4_mtp_hf.generation import assisted_loop
    from dsv4_mtp_hf.generation.mtp_session import MtpSession

    print(f"seed={seed}")
    target, mtp = tiny_pair(seed=seed)
    ids = ids_of(seed, 9)
    plain = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    rng = random.Random(seed)
    wrong_at = {p for p in range(9, 9 + new_tokens) if rng.random() < mistakes}
    graph_target(target, max_length=128)
    loops = []
    real = assisted_loop.decode
    monkeypatch.setattr(assisted_loop, "decode", lambda *a, **kw: loops.append(1) or real(*a, **kw))
    with edited_drafts(truth_with_mistakes(plain, wrong_at, sampled)):
        edited = MtpSession._draft
    monkeypatch.setattr(MtpSession, "_draft", edited)  # the edit, undone with the test's monkeypatch
    return target, mtp, ids, plain, loops


def test_auto_takes_plain_steps_in_our_loop_when_every_draft_misses(monkeypatch):
    """Drafts that never land: "auto" measures plain steps and runs them (the drafter keeps their rows), with a
    rare probe; the output still equals plain greedy.  A drafted round is made to cost two plain steps (a CPU's
    timings of a tiny pair say little)."""
    from dsv4_mtp_hf.generation.draft_length import AutoDraftLength

    target, mtp, ids, plain, loops = _loop_case(SEED + 23, 80, monkeypatch, mistakes=1.0)
    plain_step = lambda self: statistics.median(self.times[0][1:][-32:])  # noqa: E731  (what choose weighs)
    monkeypatch.setattr(AutoDraftLength, "round_time", lambda self, k, r: 2 * plain_step(self))
    got = target.generate(ids, assistant_model=mtp, num_assistant_tokens="auto", max_new_tokens=80, do_sample=False,
                          eos_token_id=None)
    assert torch.equal(got, plain) and loops == [1]
    lengths = mtp.last_generation_stats.draft_lengths
    print("draft lengths:", lengths)
    assert mtp.last_generation_stats.accepted == 0
    assert lengths[-40:].count(0) >= 38, lengths  # plain steps, at most a probe or two


@pytest.mark.tf_internals
@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_our_loop_serves_greedy_calls_on_the_graphed_target_exactly(k, monkeypatch):
    """On a graphed target a greedy call without logits processors runs our loop (assisted_loop), not
    transformers': the drafts half right, the output equals plain greedy generate at every length, cut at an
    EOS as plain cuts it, the streamer sees what the call returns, and the statistics count what happened."""
    from transformers.generation.streamers import BaseStreamer

    target, mtp, ids, plain, loops = _loop_case(SEED + 20, 60, monkeypatch)

    class Collect(BaseStreamer):
        def __init__(self):
            self.seen, self.ended = [], False

        def put(self, value):
            self.seen += value.reshape(-1).tolist()

        def end(self):
            self.ended = True

    for n in (1, 2, 5, 13, 60):
        streamer = Collect()
        got = target.generate(ids, assistant_model=mtp, num_assistant_tokens=k, max_new_tokens=n, do_sample=False,
                              eos_token_id=None, streamer=streamer)
        assert torch.equal(got, plain[:, : 9 + n]), f"max_new_tokens={n}"
        assert streamer.seen == got[0].tolist() and streamer.ended
    stats = mtp.last_generation_stats
    assert 0 < stats.accepted < stats.drafted and stats.new_tokens == 60
    for at in (9 + 4, 9 + 30):  # an EOS the target emits early, then one inside a later round
        eos = int(plain[0, at])
        want = target.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=eos)
        got = target.generate(ids, assistant_model=mtp, num_assistant_tokens=k, max_new_tokens=60, do_sample=False,
                              eos_token_id=eos)
        assert torch.equal(got, want) and int(got[0, -1]) == eos
    assert len(loops) == 7
    kw = dict(max_new_tokens=20, do_sample=False, repetition_penalty=1.3)  # a logits processor
    assert torch.equal(target.generate(ids, assistant_model=mtp, num_assistant_tokens=k, **kw), target.generate(ids, **kw))
    assert len(loops) == 7  # transformers' loop served it


@pytest.mark.tf_internals
@pytest.mark.parametrize("k", [1, 3])
def test_our_loop_serves_sampled_calls_on_the_graphed_target(k, monkeypatch):
    """Sampling with graph-safe warpers runs our loop too.  With top-k = 1 sampling is greedy, so the output must
    equal plain greedy generate at every length, accepting the right drafts and rejecting the wrong ones; a
    processor that reads the sequence (repetition penalty) goes to transformers' loop."""
    seed = SEED + 21
    target, mtp, ids, plain, loops = _loop_case(seed, 40, monkeypatch, sampled=True)
    kw = dict(do_sample=True, top_k=1, temperature=0.7, top_p=0.9, eos_token_id=None)
    for n in (1, 4, 40):
        got = target.generate(ids, assistant_model=mtp, num_assistant_tokens=k, max_new_tokens=n, **kw)
        assert torch.equal(got, plain[:, : 9 + n]), f"max_new_tokens={n}"
    stats = mtp.last_generation_stats
    assert 0 < stats.accepted < stats.drafted and stats.new_tokens == 40
    assert len(loops) == 3
    torch.manual_seed(seed)
    target.generate(ids, assistant_model=mtp, num_assistant_tokens=k, max_new_tokens=5, repetition_penalty=1.3, **kw)
    assert len(loops) == 3  # transformers' loop served it


def in_three_segments(model):
    """The embedding alone, layers 0-1, layer 2: the segments a device_map target with its embedding beside
    the lm head gets (here all on one device, so the hand-offs between segments run on the CPU too)."""
    dev = model.embed_tokens.weight.device
    return [target_graph._Segment(dev, True, []), target_graph._Segment(dev, False, [0, 1]),
            target_graph._Segment(dev, False, [2])]


def head_apart(segments, device):
    """The head in a segment of its own, as on a device_map that puts the lm head on another GPU."""
    return segments + [target_graph._Segment(device, False, [], head=True)]


def test_the_head_joins_the_last_segment_or_follows_it_on_its_own_device():
    cpu, other = torch.device("cpu"), torch.device("meta")
    joined = target_graph._with_head([target_graph._Segment(cpu, True, [0, 1])], cpu)
    assert [(s.device, s.layers, s.head) for s in joined] == [(cpu, [0, 1], True)]
    apart = target_graph._with_head([target_graph._Segment(cpu, True, [0, 1])], other)
    assert [(s.device, s.layers, s.head) for s in apart] == [(cpu, [0, 1], False), (other, [], True)]


@pytest.mark.tf_internals
def test_a_target_in_segments_computes_what_it_computes_whole(monkeypatch):
    """Each segment reads the streams and RoPE tables the previous one wrote into its static inputs (the
    head in a segment of its own): through forwards and crops the segmented step equals transformers'
    forward, and generate stays exact."""
    monkeypatch.setattr(target_graph, "_segments", in_three_segments)
    monkeypatch.setattr(target_graph, "_with_head", head_apart)
    seed = SEED + 7
    print(f"seed={seed}")
    target, mtp = tiny_pair(seed=seed)
    ids = ids_of(seed, 11)
    kw = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False)
    plain = target.generate(ids, **kw)
    graphs = graph_target(target, max_length=200, max_rollback=3)
    assert [(len(sg.layers), sg.head) for sg in graphs.segments] == [(0, False), (2, False), (1, False), (0, True)]
    rng = random.Random(seed)
    steps = [rng.randint(2, 20)] + [rng.randint(1, 4) for _ in range(20)]
    for i, n, want, got in forward_both(target, graphs, steps, seed):
        diff = (got - want).abs().max().item()
        assert diff < TOL, f"seed={seed} chunk {i} of {n} rows: max |segmented - transformers| = {diff:.3g}"
    assert torch.equal(target.generate(ids, **kw), plain)
    assert torch.equal(target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, **kw), plain)


@pytest.mark.tf_internals
def test_beams_and_batches_on_a_graphed_target_run_transformers_forward():
    """The graphed step runs one sequence in transformers' loop; anything else is unchanged."""
    target, mtp = tiny_pair(seed=SEED)
    ids = ids_of(SEED, 7)
    batch = torch.cat([ids, ids_of(SEED + 1, 7)])
    kw = dict(max_new_tokens=6, do_sample=False)
    runs = (lambda: target.generate(ids, num_beams=2, **kw), lambda: target.generate(batch, **kw),
            lambda: target.generate(ids, custom_generate=mtp_decoding, mtp=mtp, **kw))
    want = [run() for run in runs]
    graphs = graph_target(target, max_length=64)
    got = [run() for run in runs]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert graphs._epoch == 0  # no graphed cache was made for them


@pytest.mark.tf_internals
def test_ungraph_and_unbind_restore_the_target_in_either_order():
    target, mtp = tiny_pair(seed=SEED)
    ids = ids_of(SEED, 7)
    kw = dict(max_new_tokens=12, do_sample=False)
    plain = target.generate(ids, **kw)
    graph_target(target, max_length=64)
    mtp.unbind()
    assert "forward" in target.__dict__ and "generate" in target.__dict__  # still graphed
    assert torch.equal(target.generate(ids, **kw), plain)
    mtp.bind(target)
    ungraph_target(target)
    assert "forward" not in target.__dict__ and "generate" in target.__dict__  # still bound
    assert torch.equal(target.generate(ids, assistant_model=mtp, num_assistant_tokens=2, **kw), plain)
    mtp.unbind()
    assert not {"forward", "generate", "_get_candidate_generator"} & set(target.__dict__)


@pytest.mark.tf_internals
def test_capture_all_leaves_generation_exact_and_on_cuda_captures_every_row_count():
    """``capture_all`` runs every decode row count on a scratch generation: afterwards plain and assisted greedy
    generate still equal transformers' plain greedy (on CUDA without capturing anything more)."""
    print(f"seed={SEED}")
    target, mtp = _gpu_target(SEED) if torch.cuda.is_available() else tiny_pair(seed=SEED)
    ids = ids_of(SEED, 9, device=target.device)
    kw = dict(max_new_tokens=24, do_sample=False)
    plain = target.generate(ids, **kw)
    graphs = graph_target(target, max_length=64, max_rollback=3)
    try:
        graphs.capture_all()
        if graphs.use_graphs:
            assert set(graphs._graphs) == {1, 2, 3, 4}
        captured = dict(graphs._graphs)
        assert torch.equal(target.generate(ids, **kw), plain)
        assert torch.equal(target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, **kw), plain)
        assert all(graphs._graphs[n] is g for n, g in captured.items())  # nothing captured again
    finally:
        ungraph_target(target)


@pytest.mark.tf_internals
def test_graphed_target_errors_name_the_problem():
    target, mtp = tiny_pair(seed=SEED)
    graphs = graph_target(target, max_length=24, max_rollback=2)
    with pytest.raises(ValueError, match="already graphed"):
        graph_target(target)
    with pytest.raises(ValueError, match="may reach 30 tokens.*max_length=24"):  # before any work
        target.generate(ids_of(1, 10), max_new_tokens=20, do_sample=False)
    with pytest.raises(ValueError, match="may reach 25 tokens"):
        target.generate(ids_of(1, 5), max_length=25, assistant_model=mtp, num_assistant_tokens=2)
    cache = graphs.new_cache()
    with pytest.raises(ValueError, match="capacity=24"):  # a forward past it, called directly
        target(ids_of(1, 25), past_key_values=cache)
    with pytest.raises(ValueError, match="max_rollback=3"):
        target.generate(ids_of(1, 5), max_new_tokens=4, assistant_model=mtp, num_assistant_tokens=3)
    cache = graphs.new_cache()
    with pytest.raises(ValueError, match="one sequence"):
        target(ids_of(1, 4).repeat(2, 1), past_key_values=cache)
    with pytest.raises(ValueError, match="all ones"):
        target(ids_of(1, 4), past_key_values=cache, attention_mask=torch.tensor([[0, 1, 1, 1]]))
    with pytest.raises(ValueError, match="does not return hidden_states"):
        target(ids_of(1, 4), past_key_values=cache, output_hidden_states=True)
    target(ids_of(1, 4), past_key_values=cache)
    target(ids_of(2, 3), past_key_values=cache)
    with pytest.raises(CacheRollbackError):
        cache.crop(1)  # 7 tokens back to 1: more than max_rollback=2
    newer = graphs.new_cache()
    with pytest.raises(RuntimeError, match="superseded"):
        cache.get_seq_length()
    assert isinstance(newer, GraphedTargetCache) and newer.get_seq_length() == 0
    with torch.no_grad():
        target.lm_head.weight.mul_(1.0)  # in place: the graphs read the same addresses
    target.generate(ids_of(1, 4), max_new_tokens=2, do_sample=False)
    quantize_fp8_linears(target)  # modules replaced under the graphs: their weights' addresses are freed
    with pytest.raises(RuntimeError, match=r"weights changed since graph_target \(model.layers.0.self_attn.q_a_proj"
                                           r".*ungraph_target\(target\) before changing"):
        target.generate(ids_of(1, 4), max_new_tokens=2, do_sample=False)
    with pytest.raises(RuntimeError, match="weights changed"):
        target.generate(ids_of(1, 4), max_new_tokens=2, assistant_model=mtp, num_assistant_tokens=2)
    ungraph_target(target)
    graph_target(target, max_length=24, max_rollback=2)  # graphed again over the new weights
    target.generate(ids_of(1, 4), max_new_tokens=2, do_sample=False)
    ungraph_target(target)
    with pytest.raises(ValueError, match="not graphed"):
        ungraph_target(target)
    with pytest.raises(TypeError, match="DeepseekV4ForCausalLM"):
        graph_target(mtp)
    with pytest.raises(ValueError, match="max_length"):
        graph_target(target, max_length=0)
    target.model.layers[2].to("meta")  # as an offloaded layer would be
    with pytest.raises(ValueError, match="without offloading"):
        graph_target(target)


GPU_SIZES = dict(hidden_size=256, moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=4)


def _gpu_target(seed):
    target, mtp = tiny_pair(seed=seed, target_overrides=GPU_SIZES)
    target, mtp = target.to("cuda", torch.bfloat16), mtp.to("cuda")
    mtp.bind(target)
    pack_fp4_experts(target)  # capturable experts (tiled by the Triton FP4 MoE)
    return target, mtp


def _graphed_logits(target, steps, seed, use_graphs, compile, K=3):
    graphs = graph_target(target, max_length=256, max_rollback=K, compile=compile)
    graphs.use_graphs = use_graphs
    try:
        return [got.float() for _, _, _, got in forward_both(target, graphs, steps, seed, K)], graphs
    finally:
        ungraph_target(target)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "uncompiled"])
def test_graph_replays_equal_the_same_step_run_eagerly_on_cuda(compile):
    """The replays read the indices planned for each forward (nothing baked in at capture): through
    49 forwards of 1-4 rows with random crops, and a long one replayed as power-of-two chunks, they give
    what the same fixed-shape step gives without the graph (compiled or not, as captured).
    (Against transformers' bf16 forward the step differs by bf16 noise, and a router or indexer
    choice near a tie can flip on random weights, so that comparison is the float32 CPU test's.)"""
    print(f"seed={SEED}")
    target, _ = _gpu_target(SEED)
    rng = random.Random(SEED)
    steps = [13] + [rng.randint(1, 4) for _ in range(24)] + [45] + [rng.randint(1, 4) for _ in range(24)]
    replayed, graphs = _graphed_logits(target, steps, SEED, True, compile)
    # every decode shape replayed, and the 45 rows as chunks of 32, 8, 4 and 1 (uncompiled past max_rows)
    assert set(graphs._graphs) == {1, 2, 3, 4, 8, 32} and graphs.compiled == compile
    eager, _ = _graphed_logits(target, steps, SEED, False, compile)
    for i, (a, b) in enumerate(zip(replayed, eager)):
        rel = float((a - b).norm() / b.norm())
        assert rel < 1e-3, f"forward {i} ({steps[i]} rows): replayed vs eager relative difference {rel:.3g}"


@pytest.mark.gpu
def test_segment_graphs_replay_what_one_graph_replays_on_cuda(monkeypatch):
    """One graph per segment and row count, the streams and RoPE tables handed on between replays: the
    same logits as the whole step's graph (three segments on one GPU; two GPUs: tests/test_multi_gpu.py)."""
    print(f"seed={SEED + 2}")
    target, _ = _gpu_target(SEED + 2)
    rng = random.Random(SEED + 2)
    steps = [13] + [rng.randint(1, 4) for _ in range(24)]
    whole, _ = _graphed_logits(target, steps, SEED + 2, True, True)
    monkeypatch.setattr(target_graph, "_segments", in_three_segments)
    parts, graphs = _graphed_logits(target, steps, SEED + 2, True, True)
    # the decode shapes, and the prompt's 13 rows as chunks of 8, 4 and 1
    assert all(len(gs) == 3 for gs in graphs._graphs.values()) and set(graphs._graphs) == {1, 2, 3, 4, 8}
    for i, (a, b) in enumerate(zip(parts, whole)):
        rel = float((a - b).norm() / b.norm())
        assert rel < 1e-3, f"forward {i} ({steps[i]} rows): segments vs whole relative difference {rel:.3g}"


@pytest.mark.gpu
def test_assisted_generate_on_the_graphed_cuda_target_equals_its_plain_generate():
    print(f"seed={SEED + 1}")
    target, mtp = _gpu_target(SEED + 1)
    graphs = graph_target(target, max_length=256)
    ids = ids_of(SEED + 1, 4, device="cuda")  # a prompt no longer than a verify: still the eager prefill
    kw = dict(max_new_tokens=60, do_sample=False, eos_token_id=None)
    plain = target.generate(ids, **kw)
    assisted = target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, **kw)  # our loop
    assert torch.equal(assisted, plain)
    assert {1, 4} <= set(graphs._graphs)  # plain steps and 4-row verifies replayed graphs
    kw = dict(max_new_tokens=60, min_new_tokens=60, do_sample=False)  # a logits processor: transformers' loop
    assert torch.equal(target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, **kw), target.generate(ids, **kw))


@pytest.mark.gpu
def test_sampled_assisted_generate_on_the_graphed_cuda_target_replays_graphs_and_stays_exact():
    """Sampling on the graphed CUDA target: the MTP's sampled round graphs and our loop.  At top-k = 1 sampling is
    greedy, so the output equals plain greedy generate; at temperature 1 the drafts are real draws."""
    print(f"seed={SEED + 3}")
    target, mtp = _gpu_target(SEED + 3)
    graph_target(target, max_length=256)
    ids = ids_of(SEED + 3, 12, device="cuda")
    plain = target.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=None, output_logits=True,
                            return_dict_in_generate=True)
    kw = dict(max_new_tokens=60, do_sample=True, eos_token_id=None)
    got = target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, top_k=1, **kw)
    assert_equal_but_for_bf16_ties(got, plain)  # bf16 target: a K+1-row verify rounds unlike a 1-row step
    drafters = [d for d in mtp.__dict__["_kept_drafters"].values() if d.sampled]
    assert len(drafters) == 1 and drafters[0].round_graphs  # the sampled rounds replayed graphs
    torch.manual_seed(SEED)
    got = target.generate(ids, assistant_model=mtp, num_assistant_tokens=3, temperature=1.0, top_k=0, **kw)
    stats = mtp.last_generation_stats
    assert got.shape == (1, 72) and stats.new_tokens == 60 and stats.drafted > 0
