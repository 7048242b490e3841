"""The draft step's fast paths against the reference: `draft_step` under torch.compile (one
graph, same numbers, same cache writes), the compiled step inside the CUDA graph, and the
two-stage argmax."""

import pytest
import torch

from dsv4_mtp_hf.generation.mtp_graph import GraphedDrafter
from dsv4_mtp_hf.ops.argmax import argmax_last

from .helpers import draw_until_clear, tiny_pair

SEED = 31337


def seeded() -> int:
    print(f"seed={SEED}")
    return SEED


def primed(mtp, batch, context, gen, device="cpu"):
    """A paged cache holding `context` rows per sequence, and the next step's inputs."""
    c = mtp.config
    ids = torch.randint(0, c.vocab_size, (batch, context + 1), generator=gen).to(device)
    hs = torch.randn(batch, context + 1, c.hc_mult, c.hidden_size, generator=gen).to(device)
    cache = mtp.new_cache(paged=True, batch_size=batch)
    with torch.no_grad():
        mtp(ids[:, :-1], hs[:, :-1].to(mtp.dtype), past_key_values=cache)
    return cache, ids[:, -1:], hs[:, -1:].to(mtp.dtype)


def run_steps(step, cache, tok, res, k, draft_vocab=True):
    toks, logits = [], []
    with torch.no_grad():
        for _ in range(k):
            tok, lg, res = step(tok, res, cache, draft_vocab)
            toks.append(tok)
            logits.append(lg)
    return torch.cat(toks, 1), torch.stack(logits, 1), res


@pytest.mark.parametrize("v", [320, 4099, 32000, 129280])
def test_two_stage_argmax_is_torch_argmax_with_ties_nans_and_infs(v):
    gen = torch.Generator().manual_seed(seeded())
    x = torch.randint(-2, 3, (6, v), generator=gen).float()  # few distinct values: many ties
    x[1, torch.randint(0, v, (3,), generator=gen)] = float("nan")
    x[2] = float("-inf")
    x[3, torch.randint(0, v, (2,), generator=gen)] = float("inf")
    x[4] = torch.randn(v, generator=gen)
    for t in (x, x.bfloat16(), x[:, None, :]):
        assert torch.equal(argmax_last(t, min_split=1), t.argmax(-1))


def test_draft_step_compiles_to_one_graph_and_matches_eager():
    """fullgraph=True: no host sync or data-dependent Python in the step; the cache writes
    (pool rows, lengths) are the same as eager (AOT autograd functionalises them)."""
    seed = seeded()
    _, mtp = tiny_pair(max_draft_tokens=4)
    mtp.set_draft_vocab(torch.arange(0, 320, 3))  # the subset head runs in the graph too
    gen = torch.Generator().manual_seed(seed)
    cache, tok, res = primed(mtp, 2, 9, gen)
    pool, lengths = cache.pool.clone(), cache.seq_lengths.clone()
    want = run_steps(mtp.draft_step, cache, tok, res, 3)
    want_pool = cache.pool.clone()
    cache.pool.copy_(pool)
    cache.seq_lengths.copy_(lengths)
    torch._dynamo.reset()
    compiled = torch.compile(mtp.draft_step, backend="aot_eager", fullgraph=True, dynamic=False)
    got = run_steps(compiled, cache, tok, res, 3)
    assert torch.equal(got[0], want[0]), seed
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    torch.testing.assert_close(cache.pool, want_pool, rtol=1e-5, atol=1e-5)
    assert cache.seq_lengths.tolist() == (lengths + 3).tolist()
    assert set(got[0].flatten().tolist()) <= set(range(0, 320, 3))


def test_inductor_compiled_drafter_matches_the_uncompiled_steps():
    """Same drafts, logits within 1e-4.  Inductor sums in another order, so a draw whose uncompiled
    steps pass a router or argmax choice within 3e-5 of a tie may fail and is then redrawn."""

    def attempt(seed, margins):
        _, mtp = tiny_pair(max_draft_tokens=4)
        gen = torch.Generator().manual_seed(seed)
        cache, tok, res = primed(mtp, 2, 9, gen)
        lengths = cache.seq_lengths.clone()
        plain, fast = GraphedDrafter(mtp, cache, 4), GraphedDrafter(mtp, cache, 4, compile=True)
        for d in (plain, fast):
            d.tokens.copy_(tok)
            d.residual.copy_(res)
        margins.watch(mtp, argmax=True)
        want_d, want_l = plain.run_eager()
        margins.close()  # Inductor does not trace the hooks
        cache.seq_lengths.copy_(lengths)
        got_d, got_l = fast.run_eager()
        assert torch.equal(got_d, want_d), seed
        torch.testing.assert_close(got_l, want_l, rtol=1e-4, atol=1e-4, msg=f"seed {seed}")

    draw_until_clear(attempt, tries=5)  # fixed draws; one near a tie (float32 summation order) is redrawn


def agreement(got_l, want_l, got_d, want_d):
    """(logits relative error, share of draft positions with the same greedy token).  Positions
    are counted while the reference's top two logits are apart by more than rounding (a near
    tie may go either way, and every later draft of that sequence then has another prefix)."""
    rel = float((got_l.float() - want_l.float()).norm() / want_l.float().norm())
    top2 = want_l.float().topk(2, dim=-1).values
    clear = ((top2[..., 0] - top2[..., 1]) > 1e-2 * top2[..., 0].abs().clamp(min=1)).long().cumprod(dim=-1).bool()
    same = (got_d == want_d)[clear].float().mean().item() if bool(clear.any()) else 1.0
    return rel, same


@pytest.mark.gpu
def test_compiled_graphed_drafter_replays_its_own_eager_run_and_matches_the_cpu_reference():
    seed = seeded()
    sizes = dict(hidden_size=256, moe_intermediate_size=256)  # tiled by the Triton FP4 MoE
    _, ref = tiny_pair(seed=3, max_draft_tokens=4, target_overrides=sizes)  # reference math, on the CPU
    target, mtp = tiny_pair(seed=3, max_draft_tokens=4, target_overrides=sizes)
    target, mtp = target.cuda(), mtp.cuda()
    cache, tok, res = primed(mtp, 3, 12, torch.Generator().manual_seed(seed), device="cuda")
    lengths = cache.seq_lengths.clone()
    fast = GraphedDrafter(mtp, cache, 4, draft_vocab=True, compile=True)
    fast.tokens.copy_(tok)
    fast.residual.copy_(res)
    fast.capture()
    own_d, own_l = fast.run_eager()
    cache.seq_lengths.copy_(lengths)
    got_d, got_l = fast(tok, res)
    assert torch.equal(got_d, own_d) and torch.equal(got_l, own_l), seed  # replay == its eager run

    ref_cache, t, r = primed(ref, 3, 12, torch.Generator().manual_seed(seed))
    want_d, want_l = [], []
    with torch.no_grad():
        for _ in range(3):  # the model's own forward, step by step
            out = ref(t, r, past_key_values=ref_cache, draft_vocab=True)
            t, r = out.logits[:, -1].argmax(-1, keepdim=True), out.residual
            want_d.append(t)
            want_l.append(out.logits[:, -1])
    rel, same = agreement(got_l.cpu(), torch.stack(want_l, 1), got_d.cpu(), torch.cat(want_d, 1))
    assert rel < 1e-2 and same >= 0.99, (seed, rel, same)


@pytest.mark.gpu
def test_two_stage_argmax_on_cuda_at_vocab_size():
    gen = torch.Generator(device="cuda").manual_seed(seeded())
    x = torch.randn(16, 129280, device="cuda", generator=gen).bfloat16()
    x[3, 1000:1010] = 100.0  # a tie across positions: the first wins
    x[5, [77, 129279]] = float("nan")
    assert torch.equal(argmax_last(x), x.argmax(-1))
