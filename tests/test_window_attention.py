"""``dsv4_mtp::window_attention``: the op is the reference math on CPU, checks its inputs, and (``-m gpu``)
its Triton kernel matches the fp32 reference on random draft-step inputs -- one query row per sequence,
V4-Flash heads, masked cache rows."""

import pytest
import torch

from dsv4_mtp_hf.ops.attention import sliding_window_attention_reference, window_attention

SEED = 1234


def gen(seed=SEED):
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


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


def _check_against_reference(got, q, kv, qp, kp, sinks, window, scale):
    want = sliding_window_attention_reference(q.float(), kv.float(), qp, kp, sinks, window, scale)
    assert torch.isfinite(got).all(), f"seed={SEED}"
    rel = float((got.float() - want).norm() / want.norm())
    assert rel < 1e-2, (rel, f"seed={SEED}")
    assert float((got.float() - want).abs().max() / want.abs().max()) < 2e-2, f"seed={SEED}"


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 16])  # split keys with the ticket combine; one program per head block
def test_kernel_matches_reference_at_v4_flash_size_eager_and_graphed(b):
    """NaN-poisoned output vs the fp32 reference, the dispatcher, then CUDA-graph replays on new
    inputs equal to eager (twice: the split tickets must be back at 0 after each replay)."""
    from dsv4_mtp_hf.ops.triton.attention_triton import kernel_takes, window_attention_triton

    g = gen()
    q, kv, qp, kp, sinks = draft_inputs(b, 64, 512, 128, g, device="cuda")
    assert kernel_takes(q, kv)
    got = window_attention_triton(q, kv, qp, kp, sinks, 128, 512**-0.5, out=torch.full_like(q, float("nan")))
    _check_against_reference(got, q, kv, qp, kp, sinks, 128, 512**-0.5)
    assert torch.equal(window_attention(q, kv, qp, kp, sinks, 128, 512**-0.5), got)  # dispatcher, deterministic
    static = [t.clone() for t in (q, kv)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = window_attention(static[0], static[1], qp, kp, sinks, 128, 512**-0.5)
    for _ in range(2):
        q2, kv2 = draft_inputs(b, 64, 512, 128, g, device="cuda")[:2]
        static[0].copy_(q2)
        static[1].copy_(kv2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(res, window_attention(q2, kv2, qp, kp, sinks, 128, 512**-0.5)), f"seed={SEED}"


@pytest.mark.gpu
def test_uneven_splits_masked_splits_and_a_fully_masked_row():
    """100 keys in splits of 64 (the last one partial), window 20 (the first split sees nothing);
    then the query far past every key: the sink takes all the weight, output 0, no NaN."""
    from dsv4_mtp_hf.ops.triton.attention_triton import window_attention_triton

    g = gen()
    q, kv, qp, kp, sinks = draft_inputs(2, 16, 64, 100, g, device="cuda")
    got = window_attention_triton(q, kv, qp, kp, sinks, 20, 0.125, out=torch.full_like(q, float("nan")))
    _check_against_reference(got, q, kv, qp, kp, sinks, 20, 0.125)
    got = window_attention_triton(q, kv, qp + 1000, kp, sinks, 20, 0.125, out=torch.full_like(q, float("nan")))
    assert torch.equal(got, torch.zeros_like(got)), f"seed={SEED}"


@pytest.mark.gpu
def test_split_captured_before_any_eager_call(monkeypatch):
    """No ticket buffer yet at capture time: the split combine becomes a second launch, still right."""
    from dsv4_mtp_hf.ops.triton import attention_triton as at, persistent

    g = gen()
    q, kv, qp, kp, sinks = draft_inputs(1, 64, 512, 128, g, device="cuda")
    with monkeypatch.context() as m:  # warm-up without tickets: Triton compiles the two launches
        m.setattr(at, "persistent_zeros", lambda *args: None)
        at.window_attention_triton(q, kv, qp, kp, sinks, 128, 512**-0.5)
    monkeypatch.setattr(persistent, "_BUFFERS", {})
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = at.window_attention_triton(q, kv, qp, kp, sinks, 128, 512**-0.5)
    assert not persistent._BUFFERS
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(res, at.window_attention_triton(q, kv, qp, kp, sinks, 128, 512**-0.5)), f"seed={SEED}"
