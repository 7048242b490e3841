"""Manifold-constrained hyper-connections (mHC), SPEC §3.  All mixing math in fp32.

The residual is ``hc_mult`` parallel streams ``[..., n, D]``.  Before a sub-block the
streams are collapsed with ``pre`` weights; after it the branch output is expanded
with ``post`` weights and added to the streams mixed by a doubly-stochastic ``comb``
matrix (Sinkhorn-Knopp).  ``hc_head`` collapses the streams once at the end.
"""

import torch
from torch import nn

from ..ops.sinkhorn import sinkhorn  # noqa: F401  (the mHC comb matrix; re-exported)


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """``(fn @ flatten(x)) * rsqrt(mean(flatten(x)^2) + eps)`` -> ``[..., fn.shape[0]]`` fp32."""
    xf = x.flatten(-2).float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + rms_eps)
    return (xf @ fn.float().t()) * r


def hc_post(branch_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``x'_k = post_k * o + sum_j comb[j, k] * x_j`` (sum over the FIRST index)."""
    mixed = torch.einsum("...jk,...jd->...kd", comb, streams.float())
    return (post.unsqueeze(-1) * branch_out.float().unsqueeze(-2) + mixed).to(streams.dtype)


class HyperConnection(nn.Module):
    """One sub-block's mHC: params ``fn [(2+n)n, nD]``, ``base [(2+n)n]``, ``scale [3]``."""

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, rms_eps: float):
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.rms_eps = hc_mult, sinkhorn_iters, hc_eps, rms_eps
        mixes = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(mixes, hc_mult * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(mixes, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> ``pre [..., n]``, ``post [..., n]``, ``comb [..., n, n]`` (fp32)."""
        n = self.hc_mult
        m = hc_mixes(streams, self.fn, self.rms_eps)
        base, scale = self.base.float(), self.scale.float()
        pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + self.hc_eps
        post = 2 * torch.sigmoid(m[..., n : 2 * n] * scale[1] + base[n : 2 * n])
        comb_logits = (m[..., 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n))
        return pre, post, sinkhorn(comb_logits, self.sinkhorn_iters, self.hc_eps)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (collapsed block input ``[..., D]`` in the streams' dtype, post, comb)."""
        pre, post, comb = self.weights(streams)
        collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)
        return collapsed, post, comb


class HyperHead(nn.Module):
    """Final collapse of the streams: ``w_j = sigmoid(m_j * scale + base_j) + eps``; no Sinkhorn."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, rms_eps: float):
        super().__init__()
        self.hc_eps, self.rms_eps = hc_eps, rms_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        m = hc_mixes(streams, self.hc_fn, self.rms_eps)
        w = torch.sigmoid(m * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (w.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)
