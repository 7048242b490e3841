import torch

from dsv4_mtp_hf.layers.hyper_connection import HyperConnection, HyperHead, hc_post, sinkhorn


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
