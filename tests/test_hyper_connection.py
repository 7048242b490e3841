import pytest
import torch

from dsv4_mtp_hf.layers.hyper_connection import HyperConnection, HyperHead, hc_post, sinkhorn

SEED = 99


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws from torch's global generator, seeded here (replay a failure with this seed)."""
    print(f"seed={SEED}")
    torch.manual_seed(SEED)


def make_hc(n=4, d=16, iters=20):
    hc = HyperConnection(n, d, iters, 1e-6, 1e-6)
    with torch.no_grad():
        hc.fn.normal_(0, 0.5)
        hc.base.normal_()
        hc.scale.uniform_(0.5, 2.0)
    return hc


def test_comb_is_doubly_stochastic_and_non_negative():
    c = sinkhorn(torch.randn(7, 4, 4), iters=20, eps=1e-6)
    assert (c >= 0).all()
    assert torch.allclose(c.sum(-2), torch.ones(7, 4), atol=1e-5)  # the last step normalises columns
    assert torch.allclose(c.sum(-1), torch.ones(7, 4), atol=2e-3)  # rows converge within 20 iterations
    assert not torch.allclose(c, c.transpose(-1, -2), atol=1e-3)  # generally not symmetric


def test_hc_pre_post_match_the_spec_by_hand():
    n, d = 4, 16
    hc = make_hc(n, d)
    x = torch.randn(3, n, d)
    collapsed, post, comb = hc(x)
    for t in range(3):
        xf = x[t].flatten()
        m = (hc.fn @ xf) / torch.sqrt((xf**2).mean() + 1e-6)
        pre = torch.sigmoid(m[:n] * hc.scale[0] + hc.base[:n]) + 1e-6
        post_ref = 2 * torch.sigmoid(m[n : 2 * n] * hc.scale[1] + hc.base[n : 2 * n])
        c = (m[2 * n :] * hc.scale[2] + hc.base[2 * n :]).view(n, n)
        c = torch.softmax(c, dim=-1) + 1e-6
        c = c / (c.sum(0, keepdim=True) + 1e-6)
        for _ in range(19):
            c = c / (c.sum(1, keepdim=True) + 1e-6)
            c = c / (c.sum(0, keepdim=True) + 1e-6)
        torch.testing.assert_close(collapsed[t], (pre[:, None] * x[t]).sum(0), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(post[t], post_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(comb[t], c, rtol=1e-5, atol=1e-6)
        o = torch.randn(d)
        out = hc_post(o.expand(1, d), x[t : t + 1], post[t : t + 1], comb[t : t + 1])[0]
        for k in range(n):  # x'_k = post_k * o + sum_j C[j, k] x_j  (sum over the FIRST index)
            torch.testing.assert_close(out[k], post_ref[k] * o + sum(c[j, k] * x[t, j] for j in range(n)), rtol=1e-5, atol=1e-5)


def test_hc_post_uses_the_transpose_of_a_non_symmetric_comb():
    x = torch.randn(1, 2, 3)
    comb = torch.tensor([[[0.9, 0.1], [0.1, 0.9]]]) + torch.tensor([[[0.0, 0.05], [-0.05, 0.0]]])
    out = hc_post(torch.zeros(1, 3), x, torch.zeros(1, 2), comb)
    assert torch.allclose(out[0, 0], comb[0, 0, 0] * x[0, 0] + comb[0, 1, 0] * x[0, 1])


def test_hc_head_collapses_with_sigmoid_weights():
    n, d = 4, 16
    head = HyperHead(n, d, 1e-6, 1e-6)
    with torch.no_grad():
        head.hc_fn.normal_(0, 0.5)
        head.hc_base.normal_()
        head.hc_scale.fill_(0.7)
    x = torch.randn(2, 5, n, d)
    y = head(x)
    xf = x.flatten(-2)
    m = (xf @ head.hc_fn.t()) / torch.sqrt((xf**2).mean(-1, keepdim=True) + 1e-6)
    w = torch.sigmoid(m * 0.7 + head.hc_base) + 1e-6
    torch.testing.assert_close(y, (w.unsqueeze(-1) * x).sum(-2), rtol=1e-5, atol=1e-5)


def test_hc_ops_cpu_registrations_are_the_layer_math_and_compiled_hc_post_is_the_same():
    from dsv4_mtp_hf.ops.hyper_connection import hc_head_op, hc_pre_op

    hc = make_hc(4, 16)
    x = torch.randn(2, 3, 4, 16)
    pre, post, comb = hc.weights(x)
    y, post_op, comb_op = hc_pre_op(x, hc.fn, hc.base, hc.scale, 20, 1e-6, 1e-6)
    torch.testing.assert_close(y, (pre.unsqueeze(-1) * x).sum(-2), rtol=1e-6, atol=1e-6)
    assert torch.equal(post_op, post) and torch.equal(comb_op, comb)
    head = HyperHead(4, 16, 1e-6, 1e-6)
    with torch.no_grad():
        head.hc_fn.normal_(0, 0.5)
        head.hc_base.normal_()
        head.hc_scale.fill_(0.7)
    assert torch.equal(hc_head_op(x, head.hc_fn, head.hc_base, head.hc_scale, 1e-6, 1e-6), head(x))
    o = torch.randn(2, 3, 16)
    compiled = torch.compile(hc_post, backend="eager", fullgraph=True)  # the multiply-add form
    torch.testing.assert_close(compiled(o, x, post, comb), hc_post(o, x, post, comb), rtol=1e-6, atol=1e-6)


def test_hc_post_pre_is_hc_post_then_the_next_hc_pre_and_checks_its_shapes():
    """``HyperConnection.after`` (the op's CPU registration too) is the previous sub-block's ``hc_post`` and then
    this one's ``hc_pre``; mismatched leading dims name the inputs."""
    from dsv4_mtp_hf.ops.hyper_connection import hc_post_pre_op

    first, second = make_hc(4, 16), make_hc(4, 16)
    x, o = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 16)
    _, post, comb = first(x)
    mixed = hc_post(o, x, post, comb)
    want = (mixed, *second(mixed))
    args = (second.fn, second.base, second.scale, 20, 1e-6, 1e-6)
    with torch.no_grad():
        for got in (second.after(o, x, post, comb), hc_post_pre_op(o, x, post, comb, *args)):
            for a, b in zip(got, want):
                assert torch.equal(a, b)
        torch.library.opcheck(hc_post_pre_op, (o, x, post.contiguous(), comb.contiguous(), *args))
        with pytest.raises(ValueError, match="must share their leading dims"):
            hc_post_pre_op(o[:, :2], x, post, comb, *args)


@pytest.mark.gpu
@pytest.mark.parametrize("lead,n,d,dtype,iters", [
    ((1,), 4, 4096, torch.bfloat16, 20), ((16,), 4, 4096, torch.bfloat16, 1), ((2, 3), 4, 256, torch.float32, 20),
    ((3,), 2, 1500, torch.float32, 20), ((200,), 4, 256, torch.bfloat16, 20),  # > 64 tokens: the PyTorch math
])
def test_fused_hc_kernels_write_every_output_and_match_the_reference_on_cuda(lead, n, d, dtype, iters, monkeypatch):
    """The CUDA implementations, outputs NaN-poisoned (only block 0 forms post and comb, every block
    collapses its slice), against the fp64 reference; the dispatcher gives the same bits."""
    from dsv4_mtp_hf.ops.hyper_connection import hc_head_op, hc_head_reference, hc_post_pre_op, hc_pre_op, hc_pre_reference
    from dsv4_mtp_hf.ops.triton import hyper_connection_triton as hct

    x = torch.randn(*lead, n, d, device="cuda").to(dtype)
    fn, base = torch.randn((2 + n) * n, n * d, device="cuda") * (2 / (n * d) ** 0.5), torch.randn((2 + n) * n, device="cuda")
    scale = torch.rand(3, device="cuda") + 0.5
    hfn, hbase, hscale = torch.randn(n, n * d, device="cuda") * (2 / (n * d) ** 0.5), torch.randn(n, device="cuda"), torch.rand(1, device="cuda") + 0.5
    empty = torch.empty

    def poisoned_empty(*a, **k):  # every output element must be written
        t = empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t  # not the autotuner's int L2-flush buffer

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", poisoned_empty)
        y, post, comb = hct._hc_pre_cuda(x, fn, base, scale, iters, 1e-6, 1e-6)
        yh = hct._hc_head_cuda(x, hfn, hbase, hscale, 1e-6, 1e-6)
    want = hc_pre_reference(x.double(), fn.double(), base.double(), scale.double(), iters, 1e-6, 1e-6)
    ytol = dict(rtol=8e-3 if dtype == torch.bfloat16 else 1e-5, atol=1e-5, msg=lambda m: f"seed={SEED}: {m}")
    assert y.dtype == dtype and post.dtype == comb.dtype == torch.float32
    torch.testing.assert_close(y.double(), want[0], **ytol)
    torch.testing.assert_close(post.double(), want[1].double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.double(), want[2].double(), rtol=1e-5, atol=1e-6)
    want_h = hc_head_reference(x.double(), hfn.double(), hbase.double(), hscale.double(), 1e-6, 1e-6)
    torch.testing.assert_close(yh.double(), want_h, **ytol)
    assert torch.equal(hc_pre_op(x, fn, base, scale, iters, 1e-6, 1e-6)[0], y)
    assert torch.equal(hc_head_op(x, hfn, hbase, hscale, 1e-6, 1e-6), yh)
    # hc_post_pre: the previous sub-block's hc_post fused in front (the reference in fp32, its own math)
    o, post0 = torch.randn(*lead, d, device="cuda").to(dtype), torch.rand(*lead, n, device="cuda") * 2
    comb0 = torch.rand(*lead, n, n, device="cuda")
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", poisoned_empty)
        got = hct._hc_post_pre_cuda(o, x, post0, comb0, fn, base, scale, iters, 1e-6, 1e-6)
    # the mixed streams against hc_post (summation order may move a bf16 rounding); the rest against the fp64
    # hc_pre of the kernel's own mixed streams
    torch.testing.assert_close(got[0].float(), hc_post(o, x, post0, comb0).float(),
                               rtol=8e-3 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    want = hc_pre_reference(got[0].double(), fn.double(), base.double(), scale.double(), iters, 1e-6, 1e-6)
    torch.testing.assert_close(got[1].double(), want[0], **ytol)
    torch.testing.assert_close(got[2].double(), want[1].double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[3].double(), want[2].double(), rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(hc_post_pre_op(o, x, post0, comb0, fn, base, scale, iters, 1e-6,
                                                                1e-6), got))
