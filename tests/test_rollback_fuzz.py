"""Seeded fuzz of the target's rollback state against caches that never saw a rejected row (issue 45).

Each round forwards 1..K+1 random rows (a verify chunk: the last token and up to K drafts), accepts a random
prefix of them (0..all) and crops the rest, by either of ``crop``'s forms.  The truth is transformers' own
cache (``DynamicCache``) fed only the accepted rows: the logits of every accepted row (computed in the next
forward after the previous crop) must match, and at the end of each sequence the next step must match a fresh
``DynamicCache`` fed the whole accepted sequence at once.  The target has sliding, CSA and HCA layers with 8
indexer heads x 32 dims, so indexer ties are rare (SPEC §7); a failure that a router or indexer choice within
``DecisionMargins.EPS`` of a tie explains is redrawn (``draw_until_clear``).  Seeds are printed.

The CI-sized runs (a few hundred rounds each) run in ``make test``; the larger ones are marked ``slow`` and run
only when selected (``pytest -m slow tests/test_rollback_fuzz.py``)."""

from __future__ import annotations

import random
import sys

import pytest
import torch
from transformers import DeepseekV4ForCausalLM, DynamicCache

from dsv4_mtp_hf.compat import cache_kwarg
from dsv4_mtp_hf.target_runtime.ragged import RaggedTargetForward
from dsv4_mtp_hf.target_runtime.rollback_cache import RollbackDeepseekV4Cache

from .helpers import DRAW_SEED, DecisionMargins, draw_until_clear, randomize_, tiny_target_config

pytestmark = pytest.mark.tf_internals

K = 4  # drafts per round: a verify chunk holds 1..K+1 rows, a crop removes up to K+1
TOL = 3e-5  # float32 (seen: <= 7e-6); accepted rows are computed inside longer chunks than the reference computes them in


def only_when_selected(request) -> None:
    if "slow" not in (request.config.getoption("markexpr", "") or ""):
        pytest.skip("slow fuzz: run it with `pytest -m slow tests/test_rollback_fuzz.py`")


def make_target(seed: int) -> DeepseekV4ForCausalLM:
    """The helpers' tiny target (sliding, CSA rate 4, HCA rate 8; window 8; 8 x 32 indexer, top-4), random."""
    torch.manual_seed(seed)
    target = DeepseekV4ForCausalLM(tiny_target_config()).eval()
    randomize_(target, torch.Generator().manual_seed(seed + 1), std=0.1)
    return target


class Forward:
    def __init__(self, target):
        self.target, self.kw = target, cache_kwarg(target)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, cache) -> torch.Tensor:
        return self.target(input_ids=ids.reshape(1, -1), use_cache=True, **{self.kw: cache}).logits[0]


def new_round(margins) -> None:
    """Margins count from here: a failure is excused (redrawn) only by a near-tie in the round that failed,
    not by one anywhere in a long run (a flipped choice shows in the round it happens: the rows compared are
    the rows whose choices flipped)."""
    margins.min, margins.by_kind = float("inf"), {}


def assert_close(got, want, what: str) -> float:
    diff = (got - want).abs().max().item() if got.numel() else 0.0
    assert diff < TOL, f"{what}: max |rolled back - never saw the rejected rows| = {diff:.3g}"
    return diff


def fuzz_rollback_cache(seed: int, margins, sequences: int, rounds: int) -> None:
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    target = make_target(seed)
    margins.watch(target)
    fwd, vocab, window = Forward(target), target.config.vocab_size, target.config.sliding_window
    worst, crops = 0.0, 0
    print(f"fuzz_rollback_cache: seed={seed}")
    for s in range(sequences):
        ours = RollbackDeepseekV4Cache(target.config, max_rollback=K + 1)
        ref = DynamicCache(config=target.config)  # only ever sees the accepted rows
        accepted = torch.randint(3, vocab, (rng.randint(1, 3 * window),), generator=g)  # the prompt
        worst = max(worst, assert_close(fwd(accepted, ours), fwd(accepted, ref), f"seed={seed} seq={s} prompt"))
        for r in range(rounds):
            new_round(margins)
            n = rng.randint(1, K + 1)
            a = rng.randint(0, n)  # accepted rows; the other n - a are rejected
            chunk = torch.randint(3, vocab, (n,), generator=g)
            got = fwd(chunk, ours)
            if rng.random() < 0.5:
                ours.crop(-(n - a))  # what transformers' assisted loop calls
            else:
                ours.crop(accepted.numel() + a)  # the absolute form
            crops += n > a
            what = f"seed={seed} seq={s} round={r} length={accepted.numel()} rows={n} accepted={a}"
            if a:
                worst = max(worst, assert_close(got[:a], fwd(chunk[:a], ref), what))
            accepted = torch.cat([accepted, chunk[:a]])
            assert ours.get_seq_length() == ref.get_seq_length() == accepted.numel(), what
        new_round(margins)
        nxt = torch.randint(3, vocab, (rng.randint(1, K + 1),), generator=g)
        fresh = DynamicCache(config=target.config)
        fwd(accepted, fresh)  # the whole accepted sequence in one prefill
        got, want = fwd(nxt, ours), fwd(nxt, fresh)
        worst = max(worst, assert_close(got, want, f"seed={seed} seq={s} next step vs a fresh cache"))
        worst = max(worst, assert_close(got, fwd(nxt, ref), f"seed={seed} seq={s} next step"))
    print(f"seed={seed}: {sequences} x {rounds} rounds, {crops} crops, worst |diff| {worst:.3g}")


def fuzz_batched_state(seed: int, margins, batch: int, rounds: int) -> None:
    """The same rounds on :class:`BatchedTargetState` (via :class:`RaggedTargetForward`): every sequence of a
    ragged batch against its own ``DynamicCache`` fed its accepted rows."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    target = make_target(seed)
    margins.watch(target)
    fwd, vocab = Forward(target), target.config.vocab_size
    runner = RaggedTargetForward(target, attention="batched", max_chunk=rng.choice([5, 256]))
    seqs = runner.new_caches(batch, K + 1)
    refs = [DynamicCache(config=target.config) for _ in range(batch)]
    chunks = [torch.randint(3, vocab, (rng.randint(1, 24),), generator=g) for _ in range(batch)]  # ragged prompts
    worst = 0.0
    print(f"fuzz_batched_state: seed={seed}")
    for r in range(rounds + 1):
        new_round(margins)
        logits, _, offsets = runner(chunks, seqs)
        keep = [len(c) if r == 0 else rng.randint(0, len(c)) for c in chunks]  # the prompt is all accepted
        for i, (c, a) in enumerate(zip(chunks, keep)):
            seqs[i].crop(seqs[i].get_seq_length() - (len(c) - a))
            what = f"seed={seed} round={r} seq={i} rows={len(c)} accepted={a}"
            if a:
                worst = max(worst, assert_close(logits[offsets[i]: offsets[i] + a], fwd(c[:a], refs[i]), what))
            assert seqs[i].get_seq_length() == refs[i].get_seq_length(), what
        chunks = [torch.randint(3, vocab, (rng.randint(1, K + 1),), generator=g) for _ in range(batch)]
    print(f"seed={seed}: batch {batch} x {rounds} rounds, worst |diff| {worst:.3g}")


def test_rollback_cache_fuzz():
    draw_until_clear(lambda seed, margins: fuzz_rollback_cache(seed, margins, sequences=4, rounds=60))


def test_batched_state_fuzz():
    draw_until_clear(lambda seed, margins: fuzz_batched_state(seed, margins, batch=4, rounds=50))


def test_the_fuzz_catches_a_cache_whose_crop_leaves_a_stale_overlap(monkeypatch):
    """The fuzz has teeth: a cache that rolls everything back but the CSA overlap slice fails it on values."""

    class StaleOverlap(RollbackDeepseekV4Cache):
        def crop(self, max_length):
            kept = [(layer.overlap_kv.copy(), layer.overlap_gate.copy()) if hasattr(layer, "overlap_kv") else None
                    for layer in self.layers]
            super().crop(max_length)
            for layer, state in zip(self.layers, kept):
                if state is not None:
                    layer.overlap_kv, layer.overlap_gate = state

    monkeypatch.setattr(sys.modules[__name__], "RollbackDeepseekV4Cache", StaleOverlap)
    margins = DecisionMargins()
    try:
        with pytest.raises(AssertionError, match="never saw the rejected rows"):
            fuzz_rollback_cache(DRAW_SEED, margins, sequences=1, rounds=30)
    finally:
        margins.close()


# The large runs: four weight draws each, seeds DRAW_SEED + 100 * i (+ the redraws draw_until_clear makes).  Many
# short sequences rather than a few long ones: the 8-head indexer's exact ties (every head's ReLU at 0) grow with
# the number of compressed entries a query sees.
@pytest.mark.slow
@pytest.mark.parametrize("offset", [100, 200, 300, 400])
def test_rollback_cache_fuzz_large(request, offset):
    only_when_selected(request)
    draw_until_clear(lambda seed, margins: fuzz_rollback_cache(seed + offset, margins, sequences=20, rounds=120))


@pytest.mark.slow
@pytest.mark.parametrize("offset", [100, 200, 300, 400])
def test_batched_state_fuzz_large(request, offset):
    only_when_selected(request)
    draw_until_clear(lambda seed, margins: fuzz_batched_state(seed + offset, margins, batch=8, rounds=120))
