"""``dsv4_mtp::window_attention``: the op is the reference math on CPU, checks its inputs, and its
Triton kernel (CPU interpreter here, the GPU with ``-m gpu``) matches the fp32 reference on
random draft-step inputs -- one query row per sequence, V4-Flash heads, masked cache rows."""

import random
import textwrap

import pytest
import torch

from dsv4_mtp_hf.ops.attention import sliding_window_attention_reference, window_attention

from .helpers import run_under_triton_interpreter

def gen():
    return torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))


def draft_inputs(b, h, d, window, g, device="cpu", dtype=torch.bfloat16):
    """A paged cache's view: W-1 held keys then the new one, the first rows of sequence 0
    before its start (position far in the past), one query at the last position."""
    length = window  # (W-1) held + 1 new
    q = torch.randn(b, 1, h, d, generator=g).to(device, dtype)
    kv = torch.randn(b, length, d, generator=g).to(device, dtype)
    start = torch.randint(window, 4 * window, (b, 1), generator=g)
    kv_pos = start - length + 1 + torch.arange(length)
    kv_pos[0, : length // 3] = -(1 << 40)
    sinks = torch.randn(h, generator=g)
    return q, kv, start.to(device), kv_pos.to(device), sinks.to(device)


def test_op_on_cpu_is_the_reference():
    g = gen()
    q, kv, qp, kp, sinks = draft_inputs(2, 4, 32, 8, g)
    got = window_attention(q, kv, qp, kp, sinks, 8, 32**-0.5)
    assert torch.equal(got, sliding_window_attention_reference(q, kv, qp, kp, sinks, 8, 32**-0.5))
    torch.library.opcheck(window_attention, (q.float(), kv.float(), qp, kp, sinks, 8, 32**-0.5))


@pytest.mark.parametrize("change,err", [
    (lambda a: {**a, "kv": a["kv"][:, :, :16]}, "expects q"),
    (lambda a: {**a, "q_positions": a["q_positions"][:, :0]}, "positions"),
    (lambda a: {**a, "kv_positions": a["kv_positions"][:1]}, "positions"),
    (lambda a: {**a, "sinks": a["sinks"][:3]}, "sinks"),
])
def test_bad_inputs_raise(change, err):
    q, kv, qp, kp, sinks = draft_inputs(2, 4, 32, 8, gen())
    args = dict(q=q, kv=kv, q_positions=qp, kv_positions=kp, sinks=sinks, window=8, scale=0.1)
    with pytest.raises(ValueError, match=err):
        window_attention(**change(args))


INTERPRETER_SCRIPT = textwrap.dedent("""
    import random, torch
    from dsv4_mtp_hf.ops.attention import sliding_window_attention_reference
    from dsv4_mtp_hf.ops.triton.attention_triton import kernel_takes, window_attention_triton
    g = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    worst = 0.0
    for b, h, d, l, window in [(2, 16, 64, 40, 8), (1, 32, 32, 33, 64), (3, 16, 16, 7, 4)]:
        q = torch.randn(b, 1, h, d, generator=g).bfloat16()
        kv = torch.randn(b, l, d, generator=g).bfloat16()
        qpos = torch.randint(l - 2, l + 3, (b, 1), generator=g)
        kvpos = torch.stack([torch.randperm(l, generator=g) for _ in range(b)])
        kvpos[0, :3] = -(1 << 40)
        sinks = torch.randn(h, generator=g)
        assert kernel_takes(q, kv)
        out = torch.full_like(q, float("nan"))
        got = window_attention_triton(q, kv, qpos, kvpos, sinks, window, d ** -0.5, out=out)
        want = sliding_window_attention_reference(q.float(), kv.float(), qpos, kvpos, sinks, window, d ** -0.5)
        assert torch.isfinite(got).all()
        err = float((got.float() - want).norm() / want.norm())
        assert err < 1e-2, (b, h, d, l, window, err)
        worst = max(worst, err)
    print("OK", worst)
""")


def test_triton_kernel_under_the_cpu_interpreter():
    run_under_triton_interpreter(INTERPRETER_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 4, 16])
def test_kernel_matches_reference_at_v4_flash_size(b):
    from dsv4_mtp_hf.ops.triton.attention_triton import kernel_takes, window_attention_triton

    g = gen()
    q, kv, qp, kp, sinks = draft_inputs(b, 64, 512, 128, g, device="cuda")
    assert kernel_takes(q, kv)
    out = torch.full_like(q, float("nan"))
    got = window_attention_triton(q, kv, qp, kp, sinks, 128, 512**-0.5, out=out)
    want = sliding_window_attention_reference(q.float(), kv.float(), qp, kp, sinks, 128, 512**-0.5)
    assert torch.isfinite(got).all()
    rel = float((got.float() - want).norm() / want.norm())
    assert rel < 1e-2, rel
    assert float((got.float() - want).abs().max() / want.abs().max()) < 2e-2
    again = window_attention(q, kv, qp, kp, sinks, 128, 512**-0.5)  # through the dispatcher
    assert torch.equal(again, got)
    # inside a CUDA graph, replayed on new inputs
    static = [t.clone() for t in (q, kv)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = window_attention(static[0], static[1], qp, kp, sinks, 128, 512**-0.5)
    q2, kv2 = draft_inputs(b, 64, 512, 128, g, device="cuda")[:2]
    static[0].copy_(q2)
    static[1].copy_(kv2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(res, window_attention(q2, kv2, qp, kp, sinks, 128, 512**-0.5))
