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
    from dsv4_mtp_hf.ops.triton import attention_triton as at, persistent
    g = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))

    def draft(b, h, d, l, window):  # held keys then the new one; sequence 0's first rows before its start
        q = torch.randn(b, 1, h, d, generator=g).bfloat16()
        kv = torch.randn(b, l, d, generator=g).bfloat16()
        qpos = torch.randint(l, 4 * l, (b, 1), generator=g)
        kvpos = qpos - l + 1 + torch.arange(l)
        kvpos[0, : l // 3] = -(1 << 40)
        return q, kv, qpos, kvpos

    def shuffled(b, h, d, l, window):  # positions in any order, some after the query
        q, kv = torch.randn(b, 1, h, d, generator=g).bfloat16(), torch.randn(b, l, d, generator=g).bfloat16()
        qpos = torch.randint(l - 2, l + 3, (b, 1), generator=g)
        kvpos = torch.stack([torch.randperm(l, generator=g) for _ in range(b)])
        kvpos[0, :3] = -(1 << 40)
        return q, kv, qpos, kvpos

    worst = 0.0
    cases = [  # (inputs, b, h, d, l, window, config): key counts not a multiple of the split; windows that
               # leave whole splits masked (l=100, window 20: splits 0-4 of 16 keys see nothing)
        (draft, 2, 32, 64, 100, 20, dict(keys_per_program=16, block_h=16)),
        (draft, 2, 32, 64, 100, 40, dict(keys_per_program=32, block_h=32, combine="kernel")),
        (draft, 1, 64, 32, 70, 64, dict(keys_per_program=32, block_h=64, block_l=16)),
        (draft, 3, 64, 32, 128, 128, dict(keys_per_program=64, block_h=16)),
        (draft, 2, 32, 64, 100, 20, dict(keys_per_program=0)),
        (shuffled, 2, 16, 64, 40, 8, dict(keys_per_program=16, combine="ticket")),
        (shuffled, 1, 32, 32, 33, 64, dict(keys_per_program=32, block_h=16, combine="kernel")),
        (shuffled, 3, 16, 16, 7, 4, {}),
        (shuffled, 2, 16, 64, 40, 8, dict(keys_per_program=0)),
        (draft, 1, 64, 32, 128, 128, {}),
    ]
    for make, b, h, d, l, window, cfg in cases:
        q, kv, qpos, kvpos = make(b, h, d, l, window)
        sinks = torch.randn(h, generator=g)
        assert at.kernel_takes(q, kv)
        out = torch.full_like(q, float("nan"))
        got = at.window_attention_triton(q, kv, qpos, kvpos, sinks, window, d ** -0.5, out=out, config=cfg)
        want = sliding_window_attention_reference(q.float(), kv.float(), qpos, kvpos, sinks, window, d ** -0.5)
        assert torch.isfinite(got).all(), (b, h, d, l, window, cfg)
        err = float((got.float() - want).norm() / want.norm())
        assert err < 1e-2, (b, h, d, l, window, cfg, err)
        worst = max(worst, err)
        assert all(int(t.abs().sum()) == 0 for (name, _), t in persistent._BUFFERS.items()
                   if name == "window_attention_tickets"), "tickets not reset"
        again = at.window_attention_triton(q, kv, qpos, kvpos, sinks, window, d ** -0.5, config=cfg)
        assert torch.equal(again, got), "a second call differs"

    # every key masked (the query far past the window): the sink takes all the weight, output 0, no NaN
    q, kv, qpos, kvpos = draft(2, 32, 64, 100, 20)
    for cfg in (dict(keys_per_program=32), dict(keys_per_program=32, combine="kernel"), dict(keys_per_program=0)):
        got = at.window_attention_triton(q, kv, qpos + 1000, kvpos, torch.randn(32, generator=g), 20, 0.1,
                                         out=torch.full_like(q, float("nan")), config=cfg)
        assert torch.equal(got, torch.zeros_like(got)), cfg

    # the default choice and the settings' checks
    assert at.resolve_config(1, 64, 128, 512).keys_per_program == 64  # split at batch 1
    assert at.resolve_config(16, 64, 128, 512).keys_per_program == 0  # one program per head block
    assert at.resolve_config(1, 64, 128, 512, dict(keys_per_program=None)).keys_per_program == 0
    for bad, msg in [(dict(block_h=48), "block_h"), (dict(block_h=64), "divide"), (dict(keys_per_program=24), "power"),
                     (dict(keys_per_program=32, block_l=64), "block_l"), (dict(combine="x"), "combine"),
                     (dict(nsplit=2), "unknown")]:
        try:
            at.resolve_config(1, 32, 128, 512, bad)
        except ValueError as e:
            assert msg in str(e), (bad, e)
        else:
            raise AssertionError(bad)
    print("OK", worst)
""")


def test_triton_kernel_under_the_cpu_interpreter():
    """Single-kernel and split paths (both combines) against the fp32 reference."""
    run_under_triton_interpreter(INTERPRETER_SCRIPT)


# Every split setting the kernel exposes (attention_triton.CONFIG), plus the default ("auto").
GPU_SETTINGS = [dict(keys_per_program=0), dict(keys_per_program=0, block_l=32, num_warps=4)] + [
    dict(keys_per_program=k, block_h=bh, combine=c) for k in (16, 32, 64) for bh in (16, 32, 64)
    for c in ("ticket", "kernel")] + [{}]


def _setting_id(cfg):
    return "/".join(f"{k}={v}" for k, v in cfg.items()) or "auto"


def _check_against_reference(got, q, kv, qp, kp, sinks):
    want = sliding_window_attention_reference(q.float(), kv.float(), qp, kp, sinks, 128, 512**-0.5)
    assert torch.isfinite(got).all()
    rel = float((got.float() - want).norm() / want.norm())
    assert rel < 1e-2, rel
    assert float((got.float() - want).abs().max() / want.abs().max()) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_SETTINGS, ids=_setting_id)
@pytest.mark.parametrize("b", [1, 4, 16])
def test_kernel_settings_at_v4_flash_size(b, cfg):
    """Each setting: NaN-poisoned output vs the fp32 reference, then CUDA-graph replays on new inputs
    equal to eager (twice: the split tickets must be back at 0 after each replay)."""
    from dsv4_mtp_hf.ops.triton.attention_triton import window_attention_triton

    g = gen()
    q, kv, qp, kp, sinks = draft_inputs(b, 64, 512, 128, g, device="cuda")

    def run(q, kv, out=None):
        return window_attention_triton(q, kv, qp, kp, sinks, 128, 512**-0.5, out=out, config=cfg)

    got = run(q, kv, out=torch.full_like(q, float("nan")))
    _check_against_reference(got, q, kv, qp, kp, sinks)
    assert torch.equal(run(q, kv), got)  # deterministic
    static = [t.clone() for t in (q, kv)]
    res = torch.full_like(q, float("nan"))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(*static, out=res)
    for _ in range(2):
        q2, kv2 = draft_inputs(b, 64, 512, 128, g, device="cuda")[:2]
        static[0].copy_(q2)
        static[1].copy_(kv2)
        res.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(res, run(q2, kv2))


@pytest.mark.gpu
def test_split_captured_before_any_eager_call(monkeypatch):
    """No ticket buffer yet at capture time: the split combine becomes a second launch, still right."""
    from dsv4_mtp_hf.ops.triton import attention_triton as at, persistent

    monkeypatch.setattr(persistent, "_BUFFERS", {})
    monkeypatch.setattr(at, "_warned_capture", False)
    g = gen()
    q, kv, qp, kp, sinks = draft_inputs(1, 64, 512, 128, g, device="cuda")
    cfg = dict(keys_per_program=32, combine="ticket")
    # warm-up (Triton compiles) without tickets: the kernel-combine launches that the capture falls back to
    at.window_attention_triton(q, kv, qp, kp, sinks, 128, 512**-0.5, config=dict(cfg, combine="kernel"))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match="second launch"), torch.cuda.graph(graph):
        res = at.window_attention_triton(q, kv, qp, kp, sinks, 128, 512**-0.5, config=cfg)
    assert not persistent._BUFFERS
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(res, at.window_attention_triton(q, kv, qp, kp, sinks, 128, 512**-0.5, config=cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 4, 16])
def test_kernel_matches_reference_at_v4_flash_size(b):
    """The op through the dispatcher with the default CONFIG, eager and in a CUDA graph."""
    from dsv4_mtp_hf.ops.triton.attention_triton import kernel_takes, window_attention_triton

    g = gen()
    q, kv, qp, kp, sinks = draft_inputs(b, 64, 512, 128, g, device="cuda")
    assert kernel_takes(q, kv)
    out = torch.full_like(q, float("nan"))
    got = window_attention_triton(q, kv, qp, kp, sinks, 128, 512**-0.5, out=out)
    _check_against_reference(got, q, kv, qp, kp, sinks)
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
