"""The FP4 MoE kernel families of ``ops/triton/fp4_moe_triton.py`` (``-m gpu``) against the reference, and
the dispatch table (CPU).  Every random input comes from a fixed seed, printed and named in the assertion."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_mtp_hf.ops import fp4_moe, fp4_moe_reference

from .test_fp4_moe_op import LIMIT, SHAPES, _reference_f64_gpu, make_experts, make_inputs, rel_err

triton = pytest.importorskip("triton")
fmt_triton = pytest.importorskip("dsv4_mtp_hf.ops.triton.fp4_moe_triton")
hmma = pytest.importorskip("dsv4_mtp_hf.ops.triton.fp4_moe_hmma")

TOKENS = (1, 2, 3, 5, 16, 17, 64, 150)  # 150: a prefill, in blocks of 64 + 64 + 22 rows
FAMILY = {  # the regime each T of TOKENS falls in (fp4_moe_triton.ROUTES)
    "nvfp4": ("stream", "stream", "hmma", "hmma", "hmma", "dot", "dot", "dot"),
    "mxfp4": ("stream", "hmma", "hmma", "hmma", "hmma", "hmma", "hmma", "hmma"),
}


# ----------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_dispatch_edges(fmt):
    # a prefill runs in blocks of MAX_KERNEL_TOKENS rows: the family of a full block
    assert fmt_triton.kernel_for(fmt, 1000, LIMIT) == fmt_triton.kernel_for(fmt, fmt_triton.MAX_KERNEL_TOKENS, LIMIT)
    # hmma needs a finite limit (a static fp16 activation prescale): the tl.dot kernels take its T
    assert fmt_triton.kernel_for(fmt, 5, math.inf) == "dot"
    assert fmt_triton.kernel_for(fmt, 1, math.inf) == "stream"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_kernel_supports(fmt):
    assert fmt_triton.kernel_supports(4096, 2048) and fmt_triton.kernel_supports(7168, 3072)
    assert fmt_triton.kernel_supports(1024, 512) and fmt_triton.kernel_supports(256, 256)
    assert not fmt_triton.kernel_supports(128, 64)
    # sizes the stream / hmma kernels do not tile take the tl.dot kernels
    assert fmt_triton.kernel_for(fmt, 1, LIMIT, 256, 256) == "dot"
    assert fmt_triton.kernel_for("mxfp4", 4, LIMIT, 256, 256) == "dot"  # nsub 4: K a multiple of 512


@pytest.mark.parametrize("limit", [10.0, 7.0, 1.0, 1000.0])
def test_act_prescale_bounds_the_fp16_activation(limit):
    """|silu(min(g, L)) * clamp(u, -L, L)| * 2**SA stays below fp16's max, and SA is the largest such."""
    sa = hmma.act_prescale(limit)
    silu = limit / (1 + math.exp(-limit))
    bound = limit * max(silu, 0.2785)
    assert bound * 2.0**sa <= 65504 < bound * 2.0 ** (sa + 1) * 1.001
    assert hmma.act_prescale(math.inf) is None and hmma.act_prescale(0.0) is None


# ----------------------------------------------------------------------------- GPU
def _case(fmt, T, shape="small", k=6, seed=0):
    E, D, I = SHAPES[shape]
    print(f"seed={seed}")
    W = make_experts(E, D, I, fmt, device="cuda", seed=seed)
    x, ids, rw = make_inputs(T, E, k, D, device="cuda", seed=seed + 1)
    return x, ids, rw, W


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("T", TOKENS)
def test_kernel_matches_reference(fmt, T):
    """The registered op at each regime and its boundaries, against ``fp4_moe_reference`` (fp32) and the
    float64 reference; every output element written (NaN-poisoned buffer)."""
    seed = 1000 + 10 * T + (fmt == "mxfp4")
    x, ids, rw, W = _case(fmt, T, seed=seed)
    out = torch.full_like(x, float("nan"))
    out.copy_(fp4_moe(x, ids, rw, *W, fmt, LIMIT))
    want = fp4_moe_reference(x, ids, rw, *W, fmt, LIMIT)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), f"seed={seed}"
    assert out.abs().max() > 0, f"seed={seed}"
    assert rel_err(out, want) < 1e-2, f"{fmt} T={T} ({FAMILY[fmt][TOKENS.index(T)]}) seed={seed}"
    assert rel_err(out, _reference_f64_gpu(x, ids, rw, W, fmt)) < 1e-2, f"seed={seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_flash_shapes_many_tokens_per_expert(fmt):
    """V4-Flash sizes, k=8 of 16 experts at T=16 (hmma passes of 2 tokens, several per expert) and T=32 (NVFP4:
    tl.dot's tall tiles)."""
    for T in (16, 32):
        seed = 2000 + T + (fmt == "mxfp4")
        x, ids, rw, W = _case(fmt, T, shape="flash", k=8, seed=seed)
        out = fp4_moe(x, ids, rw, *W, fmt, LIMIT)
        assert rel_err(out, _reference_f64_gpu(x, ids, rw, W, fmt)) < 1e-2, f"{fmt} T={T} seed={seed}"


@pytest.mark.gpu
def test_no_finite_limit_takes_the_dot_kernels():
    seed = 3000
    x, ids, rw, W = _case("mxfp4", 5, seed=seed)
    out = fp4_moe(x, ids, rw, *W, "mxfp4", math.inf)
    want = fp4_moe_reference(x, ids, rw, *W, "mxfp4", math.inf)
    assert rel_err(out, want) < 1e-2, f"seed={seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_ticket_sums_reset_across_calls(fmt, monkeypatch):
    """The stream and hmma down kernels sum each token's rows themselves (tickets): over repeated calls on new
    inputs the result is bit for bit that of the separate sum kernel, and the tickets end at 0."""
    from dsv4_mtp_hf.ops.triton import moe_pairs

    for T in (1, 2, 5):  # stream, then hmma (MXFP4 from T=2, NVFP4 from T=3)
        for i in range(3):
            seed = 4000 + 10 * T + i
            x, ids, rw, W = _case(fmt, T, seed=seed)
            got = fmt_triton.fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT).clone()
            with monkeypatch.context() as m:  # as in a graph captured before the tickets exist
                m.setattr(fmt_triton, "sum_tickets", lambda *a: None)
                want = fmt_triton.fp4_moe_triton(x, ids, rw, *W, fmt, LIMIT)
            torch.cuda.synchronize()
            assert torch.equal(got, want), f"{fmt} T={T} call {i} seed={seed}"
    tickets = moe_pairs.sum_tickets(x.device, 1, 1)
    assert tickets is not None and int(tickets.abs().sum()) == 0


@pytest.mark.gpu
def test_cuda_graph_replay():
    """One graph per family (NVFP4 T=1 stream, T=4 hmma, T=32 tl.dot): replays on new inputs copied into the
    captured buffers write every element and match the reference."""
    fmt = "nvfp4"
    for T in (1, 4, 32):
        seed = 5000 + T
        x, ids, rw, W = _case(fmt, T, seed=seed)
        out = torch.full_like(x, float("nan"))

        def step():
            out.copy_(fp4_moe(x, ids, rw, *W, fmt, LIMIT))

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        for i in range(2):
            x2, ids2, rw2 = make_inputs(T, SHAPES["small"][0], 6, x.shape[1], device="cuda", seed=seed + 2 + i)
            x.copy_(x2), ids.copy_(ids2), rw.copy_(rw2)
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert not torch.isnan(out).any(), f"T={T} replay {i} seed={seed}"
            want = fp4_moe_reference(x, ids, rw, *W, fmt, LIMIT)
            assert rel_err(out, want) < 1e-2, f"T={T} replay {i} seed={seed}"


@pytest.mark.gpu
def test_graph_captured_before_the_tickets_exist():
    """A graph captured before any eager call allocated the tickets launches the sum kernel; the eager calls
    after it take the tickets; both give the same bits on new inputs."""
    from dsv4_mtp_hf.ops.triton import persistent

    seed = 6000
    x, ids, rw, W = _case("mxfp4", 1, seed=seed)
    key = ("fp4_moe_sum_tickets", str(x.device))
    out = torch.empty_like(x)
    saved = persistent._BUFFERS.pop(key, None)
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # compile the kernels (this allocates the tickets: drop them again)
            out.copy_(fmt_triton.fp4_moe_triton(x, ids, rw, *W, "mxfp4", LIMIT))
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        persistent._BUFFERS.pop(key, None)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out.copy_(fmt_triton.fp4_moe_triton(x, ids, rw, *W, "mxfp4", LIMIT))
        assert key not in persistent._BUFFERS  # nothing allocated under capture
        for i in range(2):
            x2, ids2, rw2 = make_inputs(1, SHAPES["small"][0], 6, x.shape[1], device="cuda", seed=seed + 2 + i)
            x.copy_(x2), ids.copy_(ids2), rw.copy_(rw2)
            out.fill_(float("nan"))
            g.replay()
            eager = fmt_triton.fp4_moe_triton(x, ids, rw, *W, "mxfp4", LIMIT)  # takes the tickets
            torch.cuda.synchronize()
            assert key in persistent._BUFFERS
            assert torch.equal(out, eager), f"replay {i} seed={seed}"
    finally:
        if saved is not None:
            persistent._BUFFERS[key] = saved


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_hmma_fp16_subnormal_weights(fmt):
    """Only +-0.5 codes: the hmma decode gives fp16 subnormals (0.5 x 2**-14) for every weight.  If the tensor
    cores flushed subnormal fp16 inputs to zero the output would be ~0 (error ~1)."""
    seed = 7000 + (fmt == "mxfp4")
    E, D, I = SHAPES["small"]
    print(f"seed={seed}")
    w13, s13, g13, w2, s2, g2 = make_experts(E, D, I, fmt, device="cuda", seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 2)

    def halves(t):  # each nibble 0x1 (+0.5) or 0x9 (-0.5)
        r = torch.randint(0, 4, t.shape, device="cuda", generator=gen, dtype=torch.uint8)
        return (0x11 | ((r & 1) << 3) | ((r & 2) << 6)).to(torch.uint8)

    W = (halves(w13), s13, g13 * 4, halves(w2), s2, g2 * 4)  # x4: gate values of the usual size
    x, ids, rw = make_inputs(4, E, 6, D, device="cuda", seed=seed + 1)
    assert fmt_triton.kernel_for(fmt, 4, LIMIT) == "hmma"
    err = rel_err(fp4_moe(x, ids, rw, *W, fmt, LIMIT), _reference_f64_gpu(x, ids, rw, W, fmt))
    assert err < 1e-2, (f"fp16 subnormal weights came out wrong (rel. err {err:.3g}, seed={seed}): the tensor "
                        "cores seem to flush fp16 subnormal MMA inputs, so fp4_moe_hmma's decode must not be used")
