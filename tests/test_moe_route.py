"""``dsv4_mtp::moe_route``: the fused router agrees with the reference routing math."""

import random

import pytest
import torch
import torch.nn.functional as F

from dsv4_mtp_hf.ops.moe_route import moe_route, moe_route_op, moe_route_reference

from .helpers import run_under_triton_interpreter


def inputs(t, d, e, device="cpu", dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
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


INTERPRETER_SCRIPT = r"""
import random
import torch
from dsv4_mtp_hf.ops.triton.moe_route_triton import moe_route_triton
from dsv4_mtp_hf.ops.moe_route import moe_route_reference
torch.manual_seed(random.SystemRandom().randrange(2**31))
for t, d, e, k, norm in ((1, 256, 32, 6, True), (3, 128, 16, 2, False)):
    h = torch.randn(t, d).to(torch.bfloat16); w = (torch.randn(e, d) * 3 * d**-0.5).to(torch.bfloat16)
    b = torch.randn(e) * 0.1
    a = moe_route_triton(h, w, b, k, 1.5, norm, ticket=True)
    c = moe_route_triton(h, w, b, k, 1.5, norm, ticket=False)
    r = moe_route_reference(h, w, b, k, 1.5, norm)
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]), (a, c)
    assert torch.equal(a[1].sort(-1).values, r[1].sort(-1).values), (a[1], r[1])
    torch.testing.assert_close(a[0].sort(-1).values, r[0].sort(-1).values, rtol=1e-5, atol=1e-6)
print("OK")
"""


def test_route_kernels_under_the_cpu_interpreter():
    """Both top-k forms (the scores kernel's ticket, the separate kernel) give the same bits and the
    reference's experts and weights (Triton's CPU interpreter; skipped where Triton is missing)."""
    run_under_triton_interpreter(INTERPRETER_SCRIPT, timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("t,d,e,k,normalize", [
    (1, 4096, 256, 6, True), (4, 4096, 256, 6, True), (16, 4096, 256, 6, True), (64, 4096, 256, 6, True),
    (100, 4096, 256, 6, True), (3, 256, 16, 2, False), (2, 100, 10, 3, True),
])
def test_cuda_kernels_match_the_reference(t, d, e, k, normalize):
    h, w, bias = inputs(t, d, e, device="cuda")
    weights, ids = moe_route_op(h, w, bias, k, 1.5, normalize)
    want_w, want_ids = moe_route_reference(h, w, bias, k, 1.5, normalize)
    assert ids.dtype == torch.long and weights.dtype == torch.float32
    # Tokens whose k-th and (k+1)-th biased scores are within rounding may pick either expert.
    sel = (F.softplus(h.float() @ w.float().t()).sqrt() + bias).sort(dim=-1, descending=True).values
    clear = (sel[:, k - 1] - sel[:, k] > 1e-4) if k < e else torch.ones(t, dtype=torch.bool, device="cuda")
    assert clear.float().mean() > 0.8
    # the same experts with the same weights (the order among near-equal winners may differ)
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(-1, order)[clear], want_ids.gather(-1, want_order)[clear])
    torch.testing.assert_close(weights.gather(-1, order)[clear], want_w.gather(-1, want_order)[clear],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("t,normalize", [(1, True), (16, True), (64, False)])
def test_ticket_topk_equals_the_topk_kernel(t, normalize):
    """The top-k by the scores kernel's last program per token (the default) gives the same ids and
    weights, bit for bit, as the separate top-k kernel, and leaves its tickets at 0 (three calls)."""
    from dsv4_mtp_hf.ops.triton import persistent
    from dsv4_mtp_hf.ops.triton.moe_route_triton import moe_route_triton

    for _ in range(3):
        h, w, bias = inputs(t, 4096, 256, device="cuda")
        got = moe_route_triton(h, w, bias, 6, 2.5, normalize, ticket=True)
        want = moe_route_triton(h, w, bias, 6, 2.5, normalize, ticket=False)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    torch.cuda.synchronize()
    assert int(persistent._BUFFERS[("moe_route_tickets", str(h.device))].abs().sum()) == 0


@pytest.mark.gpu
def test_ticket_topk_graph_captured_first():
    """Captured before any eager call allocated the tickets: the graph holds the two-kernel form, and
    its replays still match the eager (ticket) routing on new inputs."""
    from dsv4_mtp_hf.ops.triton import persistent
    from dsv4_mtp_hf.ops.triton.moe_route_triton import moe_route_triton

    h, w, bias = inputs(4, 4096, 256, device="cuda")
    key = ("moe_route_tickets", str(h.device))
    moe_route_triton(h, w, bias, 6, 2.5, True, ticket=False)  # compiles, takes no tickets
    torch.cuda.synchronize()
    saved = persistent._BUFFERS.pop(key, None)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = moe_route_triton(h, w, bias, 6, 2.5, True)
        assert key not in persistent._BUFFERS
        for _ in range(2):
            h2, _w, _b = inputs(4, 4096, 256, device="cuda")
            h.copy_(h2)
            g.replay()
            want = moe_route_triton(h, w, bias, 6, 2.5, True)  # eager: allocates and takes the tickets
            torch.cuda.synchronize()
            assert key in persistent._BUFFERS
            assert torch.equal(out[1], want[1]) and torch.equal(out[0], want[0])
    finally:
        if saved is not None and key not in persistent._BUFFERS:
            persistent._BUFFERS[key] = saved
