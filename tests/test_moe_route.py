"""``dsv4_mtp::moe_route``: the fused router agrees with the reference routing math."""

import pytest
import torch
import torch.nn.functional as F

from dsv4_mtp_hf.ops.moe_route import moe_route, moe_route_op, moe_route_reference

SEED = 2024


def inputs(t, d, e, device="cpu", dtype=torch.bfloat16, seed=SEED):
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(t, d, generator=gen).to(device, dtype)
    w = (torch.randn(e, d, generator=gen) * 3 * d**-0.5).to(device, dtype)
    bias = (torch.randn(e, generator=gen) * 0.1).to(device)
    return h, w, bias


def test_reference_is_the_spec_routing_and_the_cpu_op_is_the_reference():
    h, w, bias = inputs(5, 64, 16, dtype=torch.float32)
    weights, ids = moe_route_reference(h, w, bias, 4, 1.5, True)
    s = torch.sqrt(F.softplus(h @ w.t()))
    for t in range(5):  # top-4 of s + bias; weights from the unbiased s, normalised, x 1.5
        chosen = sorted(range(16), key=lambda i: -float(s[t, i] + bias[i]))[:4]
        assert ids[t].tolist() == chosen
        torch.testing.assert_close(weights[t], 1.5 * s[t, chosen] / s[t, chosen].sum())
    got = moe_route_op(h, w, bias, 4, 1.5, False)
    want = moe_route_reference(h, w, bias, 4, 1.5, False)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    assert torch.equal(moe_route(h, w, bias, 4, 1.5, False)[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("t,d,e,k,normalize", [
    (1, 4096, 256, 6, True), (16, 4096, 256, 6, True), (100, 4096, 256, 6, True), (2, 100, 10, 3, False),
])
def test_cuda_kernels_match_the_reference(t, d, e, k, normalize):
    h, w, bias = inputs(t, d, e, device="cuda")
    weights, ids = moe_route_op(h, w, bias, k, 1.5, normalize)
    want_w, want_ids = moe_route_reference(h, w, bias, k, 1.5, normalize)
    assert ids.dtype == torch.long and weights.dtype == torch.float32
    # Tokens whose k-th and (k+1)-th biased scores are within rounding may pick either expert.
    sel = (F.softplus(h.float() @ w.float().t()).sqrt() + bias).sort(dim=-1, descending=True).values
    clear = (sel[:, k - 1] - sel[:, k] > 1e-4) if k < e else torch.ones(t, dtype=torch.bool, device="cuda")
    assert clear.float().mean() > 0.8, f"seed={SEED}"
    # the same experts with the same weights (the order among near-equal winners may differ)
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(-1, order)[clear], want_ids.gather(-1, want_order)[clear]), f"seed={SEED}"
    torch.testing.assert_close(weights.gather(-1, order)[clear], want_w.gather(-1, want_order)[clear],
                               rtol=1e-5, atol=1e-6, msg=f"seed={SEED}")
    if t <= 64:  # the kernel's top-k tickets are back at 0
        from dsv4_mtp_hf.ops.triton import persistent

        torch.cuda.synchronize()
        assert int(persistent._BUFFERS[("moe_route_tickets", str(h.device))].abs().sum()) == 0


@pytest.mark.gpu
def test_graph_captured_before_any_eager_call(monkeypatch):
    """Captured before any eager call allocated the tickets: the graph holds the separate top-k launch,
    and its replays give the bits of the eager (one-launch) routing on new inputs."""
    from dsv4_mtp_hf.ops.triton import moe_route_triton as mr, persistent

    h, w, bias = inputs(4, 4096, 256, device="cuda")
    with monkeypatch.context() as m:  # warm-up without tickets: Triton compiles the two launches
        m.setattr(mr, "persistent_zeros", lambda *args: None)
        mr.moe_route_triton(h, w, bias, 6, 2.5, True)
    monkeypatch.setattr(persistent, "_BUFFERS", {})
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = mr.moe_route_triton(h, w, bias, 6, 2.5, True)
    assert not persistent._BUFFERS
    for i in range(2):
        h.copy_(inputs(4, 4096, 256, device="cuda", seed=SEED + 1 + i)[0])
        g.replay()
        want = mr.moe_route_triton(h, w, bias, 6, 2.5, True)  # eager: allocates and takes the tickets
        torch.cuda.synchronize()
        assert torch.equal(out[1], want[1]) and torch.equal(out[0], want[0]), f"seed={SEED + 1 + i}"
