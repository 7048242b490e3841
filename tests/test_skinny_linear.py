"""``dsv4_mtp::skinny_linear(_cat)``: the reference is F.linear, the ops check their inputs, the
layers keep the CPU path unchanged, and (``-m gpu``) the Triton kernels match the reference on the
MTP's dense shapes for 1-16 rows."""

import importlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsv4_mtp_hf.configuration import DeepseekV4MtpConfig
from dsv4_mtp_hf.layers.attention import GroupedOutputProjection
from dsv4_mtp_hf.layers.linear import project, project_sum, skinny_ready
from dsv4_mtp_hf.layers.moe import SharedExpert
from dsv4_mtp_hf.ops.skinny_linear import (
    check_skinny_inputs,
    mtp_dense_shapes,
    skinny_linear,
    skinny_linear_cat,
    skinny_linear_cat_op,
    skinny_linear_cat_reference,
    skinny_linear_op,
    skinny_linear_reference,
    skinny_linear_sum,
    skinny_linear_sum_op,
    skinny_linear_sum_reference,
    use_skinny,
)

sl = importlib.import_module("dsv4_mtp_hf.ops.skinny_linear")  # the module (the package re-exports the function)
ROOT = Path(__file__).resolve().parents[1]
FLASH = ROOT / "configs" / "deepseek-v4-flash-mtp.json"


SEED = 4321


def gen(seed=SEED):
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def rand(*shape, g, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- CPU: reference and op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_is_f_linear_and_the_cpu_op_is_the_reference(dtype):
    g = gen()
    x, w = rand(5, 48, g=g, dtype=dtype), rand(40, 48, g=g, dtype=dtype)
    assert torch.equal(skinny_linear_reference(x, w), F.linear(x, w))
    assert torch.equal(skinny_linear_op(x, w), F.linear(x, w))
    assert torch.equal(skinny_linear(x.view(5, 1, 48), w), F.linear(x, w).view(5, 1, 40))
    w2 = rand(24, 48, g=g, dtype=dtype)
    want = F.linear(x, torch.cat([w, w2]))
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(skinny_linear_cat_reference(x, [w, w2]), want, **tol)
    assert torch.equal(skinny_linear_cat_op(x, [w, w2]), skinny_linear_cat_reference(x, [w, w2]))
    assert torch.equal(skinny_linear_cat(x, [w, w2]), skinny_linear_cat_reference(x, [w, w2]))


def test_grouped_reference_is_a_linear_per_group():
    g = gen()
    groups, k, ng = 4, 32, 8
    x, w = rand(3, groups * k, g=g), rand(groups * ng, k, g=g)
    got = skinny_linear_reference(x, w, groups)
    want = torch.cat([F.linear(x[:, i * k:(i + 1) * k], w[i * ng:(i + 1) * ng]) for i in range(groups)], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(skinny_linear_op(x, w, groups), got)


@pytest.mark.parametrize("x_shape,w_shapes,groups,dtypes,err", [
    ((8,), [(4, 8)], 1, (torch.float32, torch.float32), ValueError),           # x not 2-D
    ((2, 3, 8), [(4, 8)], 1, (torch.float32, torch.float32), ValueError),      # x not 2-D
    ((2, 8), [(8,)], 1, (torch.float32, torch.float32), ValueError),           # weight not 2-D
    ((2, 8), [(4, 6)], 1, (torch.float32, torch.float32), ValueError),         # K mismatch
    ((2, 8), [(4, 8), (4, 6)], 1, (torch.float32, torch.float32), ValueError), # cat weights' K differ
    ((2, 16), [(6, 8)], 4, (torch.float32, torch.float32), ValueError),        # groups do not divide N
    ((2, 16), [(8, 8)], 4, (torch.float32, torch.float32), ValueError),        # G*K != x's columns
    ((2, 8), [(4, 8)], 0, (torch.float32, torch.float32), ValueError),         # groups < 1
    ((2, 8), [(4, 8)], 1, (torch.bfloat16, torch.float32), TypeError),         # dtype mismatch
    ((2, 8), [(4, 8)], 1, (torch.int32, torch.int32), TypeError),              # not floating
    ((2, 8), [(4, 8)], 1, (torch.float64, torch.float64), TypeError),          # unsupported dtype
])
def test_bad_inputs_raise(x_shape, w_shapes, groups, dtypes, err):
    x = torch.ones(x_shape, dtype=dtypes[0])
    ws = [torch.ones(s, dtype=dtypes[1]) for s in w_shapes]
    with pytest.raises(err):
        check_skinny_inputs(x, ws, groups)
    with pytest.raises(err):
        if len(ws) == 1:
            skinny_linear_op(x, ws[0], groups)
        else:
            skinny_linear_cat_op(x, ws)
    with pytest.raises(ValueError):
        check_skinny_inputs(torch.ones(2, 8), [])


def test_fake_impl_shapes_under_torch_compile_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w, w2 = torch.empty(3, 64), torch.empty(16, 64), torch.empty(8, 64)
        assert skinny_linear_op(x, w).shape == (3, 16)
        assert skinny_linear_op(x, torch.empty(32, 16), 4).shape == (3, 32)
        assert skinny_linear_cat_op(x, [w, w2]).shape == (3, 24)
        with pytest.raises(ValueError):
            skinny_linear_op(x, torch.empty(16, 32))


def test_ops_trace_through_torch_compile():
    g = gen()
    x, w, w2, wg = rand(3, 32, g=g), rand(16, 32, g=g), rand(8, 32, g=g), rand(16, 8, g=g)

    def f(t):
        a, b = skinny_linear_cat(t.view(3, 1, 32), [w, w2]).split([16, 8], -1)
        return a.relu() + skinny_linear(t, wg, 4).view(3, 1, 16), b

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")  # the fake impls, functionalised
    for got, want in zip(compiled(x), f(x)):
        assert torch.equal(got, want)


def test_opcheck():
    g = gen()
    x, w, w2 = rand(3, 32, g=g), rand(16, 32, g=g), rand(8, 32, g=g)
    torch.library.opcheck(skinny_linear_op, (x, w, 1))
    torch.library.opcheck(skinny_linear_op, (x, rand(16, 8, g=g), 4))
    torch.library.opcheck(skinny_linear_cat_op, (x, [w, w2]))


def test_mtp_dense_shapes_at_v4_flash():
    c = DeepseekV4MtpConfig.from_json_file(str(FLASH))
    shapes = {name: (ns, k, groups) for name, ns, k, groups, _ in mtp_dense_shapes(c)}
    assert shapes["e_proj, h_proj (each)"] == ((4096,), 4096, 1)
    assert shapes["wq_a+wkv"] == ((1024, 512), 4096, 1)
    assert shapes["wq_b"] == ((32768,), 1024, 1)
    assert shapes["wo_a (grouped)"] == ((8192,), 4096, 8)
    assert shapes["wo_b"] == ((4096,), 8192, 1)
    assert shapes["shared w1+w3"] == ((2048, 2048), 4096, 1)
    assert shapes["shared w2"] == ((4096,), 2048, 1)


# ----------------------------------------------------------------------------- CPU: the layers are unchanged
def test_cpu_layers_take_the_reference_path_bit_for_bit():
    g = gen()
    lin, lin2 = nn.Linear(32, 16, bias=False), nn.Linear(32, 8, bias=False)
    x = rand(2, 1, 32, g=g)
    assert not use_skinny(x, lin.weight) and not skinny_ready(x, lin, lin2)
    assert torch.equal(project(x, lin), lin(x))
    a, b = project(x, lin, lin2)
    assert torch.equal(a, lin(x)) and torch.equal(b, lin2(x))
    c = DeepseekV4MtpConfig.from_json_file(str(ROOT / "configs" / "tiny-mtp.json"))
    se = SharedExpert(c)
    for p in se.parameters():
        nn.init.normal_(p, std=0.5)
    h = rand(3, 1, c.hidden_size, g=g)
    gate = se.gate_proj(h).float().clamp(max=se.limit)
    up = se.up_proj(h).float().clamp(-se.limit, se.limit)
    assert torch.equal(se(h), se.down_proj((F.silu(gate) * up).to(h.dtype)))
    gp = GroupedOutputProjection(16, 8, 4)
    nn.init.normal_(gp.weight)
    o = rand(2, 1, 4, 16, g=g)
    want = torch.einsum("...gi,goi->...go", o, gp.weight.view(4, -1, 16)).flatten(-2)
    assert torch.equal(gp(o), want)


def test_sum_reference_is_both_products_in_fp32_rounded_once():
    g = gen()
    x0, w0 = rand(8, 32, g=g), rand(16, 32, g=g)
    x1, w1 = rand(2, 24, g=g), rand(16, 24, g=g)
    want = x0 @ w0.T + (x1 @ w1.T).repeat_interleave(4, 0)
    torch.testing.assert_close(skinny_linear_sum_reference(x0, w0, x1, w1), want, rtol=1e-5, atol=1e-5)
    b = [t.bfloat16() for t in (x0, w0, x1, w1)]
    got = skinny_linear_sum_op(*b)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, skinny_linear_sum_reference(*b))
    # the wrapper: x0 [..., R, K0], x1 [..., K1]
    out = skinny_linear_sum(x0.view(2, 4, 32), w0, x1, w1)
    assert out.shape == (2, 4, 16)
    torch.testing.assert_close(out.reshape(8, 16), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shapes,err", [
    (((8, 32), (16, 32), (3, 24), (16, 24)), "whole multiple"),
    (((8, 32), (16, 32), (2, 24), (12, 24)), "one width"),
    (((8, 32), (16, 30), (2, 24), (16, 24)), "does not match"),
])
def test_sum_bad_inputs_raise(shapes, err):
    x0, w0, x1, w1 = (torch.ones(*s) for s in shapes)
    with pytest.raises(ValueError, match=err):
        skinny_linear_sum_op(x0, w0, x1, w1)


def test_project_sum_on_cpu_is_the_modules_and_an_add():
    g = gen()
    h_proj, e_proj = nn.Linear(32, 16, bias=False), nn.Linear(24, 16, bias=False)
    x0, x1 = rand(3, 4, 32, g=g), rand(3, 24, g=g)
    with torch.no_grad():
        assert torch.equal(project_sum(x0, h_proj, x1, e_proj), h_proj(x0) + e_proj(x1).unsqueeze(-2))


def test_sum_op_traces_through_torch_compile_and_opcheck():
    g = gen()
    args = (rand(8, 32, g=g), rand(16, 32, g=g), rand(2, 24, g=g), rand(16, 24, g=g))
    torch.library.opcheck(skinny_linear_sum_op, args)
    f = torch.compile(lambda *a: skinny_linear_sum_op(*a) + 1, fullgraph=True, backend="eager")
    torch.testing.assert_close(f(*args), skinny_linear_sum_reference(*args) + 1)


# ----------------------------------------------------------------------------- GPU
FLASH_SHAPES = mtp_dense_shapes(DeepseekV4MtpConfig.from_json_file(str(FLASH)))


def _weights(ns, k, dtype, g):
    return [rand(n, k, g=g, dtype=dtype, device="cuda", scale=k**-0.5) for n in ns]


@pytest.mark.gpu
@pytest.mark.parametrize("name,ns,k,groups,dtype", FLASH_SHAPES, ids=[s[0] for s in FLASH_SHAPES])
def test_kernel_matches_reference_on_mtp_shapes(name, ns, k, groups, dtype):
    from dsv4_mtp_hf.ops.triton.skinny_linear_triton import pick_config, skinny_linear_triton

    g = gen()
    ws = _weights(ns, k, dtype, g)
    wcat = torch.cat(ws).float()
    n = sum(ns)
    for m in (1, 3, 16):
        x = rand(m, k * groups, g=g, dtype=dtype, device="cuda")
        cfg = pick_config(m, ns, k, groups, dtype, torch.cuda.get_device_properties(0).multi_processor_count)
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        ws_buf = torch.full((cfg.split * m * n,), float("nan"), device="cuda")
        got = skinny_linear_triton(x, ws, groups, cfg, out=out, workspace=ws_buf)
        want = skinny_linear_reference(x.float(), wcat, groups)
        assert torch.isfinite(got).all(), (name, m, f"seed={SEED}")
        rel = float((got.float() - want).norm() / want.norm())
        assert rel < 1e-2, (name, m, rel, f"seed={SEED}")
        assert float((got.float() - want).abs().max() / want.abs().max()) < 1e-2, (name, m, f"seed={SEED}")
        # through the dispatcher (the registered CUDA kernel), deterministic
        op = skinny_linear_op(x, ws[0], groups) if len(ws) == 1 else skinny_linear_cat_op(x, ws)
        assert torch.equal(op, got), (name, m)
        again = skinny_linear_op(x, ws[0], groups) if len(ws) == 1 else skinny_linear_cat_op(x, ws)
        assert torch.equal(op, again)


@pytest.mark.gpu
def test_cuda_graph_replay_and_torch_compile():
    g = gen()
    ws = _weights((1024, 512), 4096, torch.bfloat16, g)
    x = rand(4, 4096, g=g, dtype=torch.bfloat16, device="cuda")

    def f(t):
        return skinny_linear_cat(t, ws) * 2

    eager = f(x)
    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), eager)
    static = x.clone()
    f(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(static)
    x2 = rand(4, 4096, g=g, dtype=torch.bfloat16, device="cuda")
    static.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, f(x2))


@pytest.mark.gpu
def test_layers_on_cuda_use_the_op_and_agree_with_f_linear():
    g = gen()
    c = DeepseekV4MtpConfig.from_json_file(str(ROOT / "configs" / "tiny-mtp.json"))
    se = SharedExpert(c).to("cuda", torch.bfloat16)
    gp = GroupedOutputProjection(64, 32, 4).to("cuda", torch.bfloat16)
    for p in list(se.parameters()) + list(gp.parameters()):
        nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    with torch.no_grad():
        for rows in (1, 4, 16, 17):
            h = rand(rows, 1, c.hidden_size, g=g, dtype=torch.bfloat16, device="cuda")
            o = rand(rows, 1, 4, 64, g=g, dtype=torch.bfloat16, device="cuda")
            assert skinny_ready(h, se.gate_proj, se.up_proj) == (rows <= sl.MAX_ROWS)
            gate = se.gate_proj(h).float().clamp(max=se.limit)  # nn.Linear.forward: F.linear (cuBLAS)
            up = se.up_proj(h).float().clamp(-se.limit, se.limit)
            ref_se = se.down_proj((F.silu(gate) * up).to(h.dtype))
            ref_gp = torch.einsum("...gi,goi->...go", o, gp.weight.view(4, -1, 64)).flatten(-2)
            for got, want in ((se(h), ref_se), (gp(o), ref_gp)):
                rel = float((got.float() - want.float()).norm() / want.float().norm())
                assert rel < 1e-2, (rows, rel, f"seed={SEED}")


@pytest.mark.gpu
def test_sum_kernel_matches_reference_on_the_e_h_projection():
    """h_proj over the 4 streams plus e_proj of the token, V4-Flash size, batch 1..4."""
    from dsv4_mtp_hf.ops.triton.skinny_linear_triton import sum_config, skinny_linear_sum_triton

    g = gen()
    d = 4096
    wh, we = _weights((d,), d, torch.bfloat16, g)[0], _weights((d,), d, torch.bfloat16, g)[0]
    for b in (1, 2, 4):
        x0 = rand(4 * b, d, g=g, dtype=torch.bfloat16, device="cuda")
        x1 = rand(b, d, g=g, dtype=torch.bfloat16, device="cuda")
        cfg = sum_config(4 * b, d, d, d, torch.bfloat16)
        assert cfg is not None and cfg.split == 1
        out = torch.full((4 * b, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = skinny_linear_sum_triton(x0, wh, x1, we, cfg, out=out)
        want = skinny_linear_sum_reference(x0.float(), wh.float(), x1.float(), we.float())
        assert torch.isfinite(got).all(), b
        assert float((got.float() - want).norm() / want.norm()) < 1e-2, b
        assert float((got.float() - want).abs().max() / want.abs().max()) < 1e-2, b
        assert torch.equal(skinny_linear_sum_op(x0, wh, x1, we), got)  # the registered kernel, deterministic


def test_project_takes_any_number_of_projections_and_calls_the_others():
    """The target's attention projects its normed row through five to seven modules at once, FP8 ones among
    them: each output is its module's (CPU: ``F.linear`` per plain weight, the others called)."""
    g = gen()
    mods = [nn.Linear(32, n, bias=False) for n in (16, 8, 24, 24, 4)]
    hooked = nn.Linear(32, 6, bias=False)
    seen = []
    hooked.register_forward_hook(lambda m, a, out: seen.append(out))
    for m in mods + [hooked]:
        nn.init.normal_(m.weight)
    x = rand(3, 32, g=g)
    with torch.no_grad():
        outs = project(x, mods[0], hooked, *mods[1:])
    assert len(outs) == 6 and len(seen) == 1 and outs[1] is seen[0]  # the hooked module ran as itself
    for m, out in zip([mods[0], hooked, *mods[1:]], outs):
        assert torch.equal(out, F.linear(x, m.weight))


@pytest.mark.gpu
@torch.no_grad()
def test_many_projections_of_one_row_run_two_to_a_launch_on_cuda(monkeypatch):
    """A V4-Flash CSA layer's seven projections of its normed row (q_a, kv, the compressor's and the indexer's
    kv/gate, the indexer's weights): four launches (three pairs, one single), each output F.linear's up to bf16
    summation order."""
    g = gen()
    ws = _weights((1024, 512, 1024, 1024, 256, 256, 64), 4096, torch.bfloat16, g)
    launches = []
    for name in ("skinny_linear_cat", "skinny_linear"):
        real = getattr(sl, name)
        monkeypatch.setattr(sl, name, lambda *a, real=real, name=name: launches.append(name) or real(*a))
    for rows in (1, 4):
        launches.clear()
        x = rand(rows, 4096, g=g, dtype=torch.bfloat16, device="cuda")
        outs = sl.linear_weights(x, *ws)
        assert launches == ["skinny_linear_cat"] * 3 + ["skinny_linear"]
        for w, out in zip(ws, outs):
            want = F.linear(x.float(), w.float())
            assert float((out.float() - want).norm() / want.norm()) < 1e-2, f"seed={SEED}"


@pytest.mark.gpu
def test_split_k_by_ticket_gives_the_bits_of_the_reduce_launch(monkeypatch):
    """Split-K tiles summed by their last program (tickets) equal the separate reduce launch a graph captured
    before the tickets exist uses, for the bf16 and the FP8 kernels; the tickets are left at zero."""
    from dsv4_mtp_hf.fp8 import quantize_fp8_block
    from dsv4_mtp_hf.ops.triton import fp8_linear_triton as ft, persistent, skinny_linear_triton as st

    g = gen()
    ws = _weights((1024, 512), 4096, torch.bfloat16, g)
    x = rand(3, 4096, g=g, dtype=torch.bfloat16, device="cuda")
    q, s = zip(*(quantize_fp8_block(w.float().cpu()) for w in ws))
    q, s = [t.cuda() for t in q], [t.float().cuda() for t in s]
    assert st.pick_config(3, (1024, 512), 4096, 1, torch.bfloat16).split > 1 and ft.pick_config(3, (1024, 512), 4096, 1).split > 1
    ticketed = st.skinny_linear_triton(x, ws), ft.fp8_linear_triton(x, q, s)
    monkeypatch.setattr(st, "split_tickets", lambda *a: None)
    monkeypatch.setattr(ft, "split_tickets", lambda *a: None)
    reduced = st.skinny_linear_triton(x, ws), ft.fp8_linear_triton(x, q, s)
    assert all(torch.equal(a, b) for a, b in zip(ticketed, reduced)), f"seed={SEED}"
    torch.cuda.synchronize()
    assert all(int(b.abs().sum()) == 0 for (name, _), b in persistent._BUFFERS.items() if "linear_tickets" in name)
