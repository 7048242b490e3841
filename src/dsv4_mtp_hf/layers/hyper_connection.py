"""Manifold-constrained hyper-connections (mHC), design §2.  All mixing math in fp32.

The residual is ``hc_mult`` parallel streams ``[..., n, D]``.  Before a sub-block the
streams are collapsed with ``pre`` weights; after it the branch output is expanded
with ``post`` weights and added to the streams mixed by a doubly-stochastic ``comb``
matrix (Sinkhorn-Knopp).  ``hc_head`` collapses the streams once at the end.
"""

import torch
from torch import nn

from ..ops.hyper_connection import hc_head, hc_mixes, hc_post, hc_post_pre, hc_pre, hc_weights  # noqa: F401
from ..ops.sinkhorn import sinkhorn  # noqa: F401  (the mHC comb matrix; re-exported)


class HyperConnection(nn.Module):
    """One sub-block's mHC: params ``fn [(2+n)n, nD]``, ``base [(2+n)n]``, ``scale [3]``."""

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, rms_eps: float):
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.rms_eps = hc_mult, sinkhorn_iters, hc_eps, rms_eps
        mixes = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(mixes, hc_mult * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(mixes, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    @classmethod
    def of(cls, hc: nn.Module, rms_eps: float) -> "HyperConnection":
        """Ours on transformers' ``DeepseekV4HyperConnection``'s own ``fn`` / ``base`` / ``scale`` (no copy)."""
        with torch.device("meta"):
            ours = cls(hc.hc_mult, hc.fn.shape[1] // hc.hc_mult, hc.hc_sinkhorn_iters, hc.hc_eps, rms_eps)
        ours.fn, ours.base, ours.scale = hc.fn, hc.base, hc.scale
        return ours

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> ``pre [..., n]``, ``post [..., n]``, ``comb [..., n, n]`` (fp32)."""
        return hc_weights(streams, self.fn, self.base, self.scale, self.sinkhorn_iters, self.hc_eps, self.rms_eps)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (collapsed block input ``[..., D]`` in the streams' dtype, post, comb); one fused
        op on CUDA (``dsv4_mtp::hc_pre``)."""
        return hc_pre(streams, self.fn, self.base, self.scale, self.sinkhorn_iters, self.hc_eps, self.rms_eps)

    def after(self, branch_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        """The previous sub-block's ``hc_post(branch_out, streams, post, comb)``, then this one's :meth:`forward`
        -> (the mixed streams, block input, post, comb); one fused op on CUDA (``dsv4_mtp::hc_post_pre``)."""
        return hc_post_pre(branch_out, streams, post, comb, self.fn, self.base, self.scale, self.sinkhorn_iters,
                           self.hc_eps, self.rms_eps)


class HyperHead(nn.Module):
    """Final collapse of the streams: ``w_j = sigmoid(m_j * scale + base_j) + eps``; no Sinkhorn."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, rms_eps: float):
        super().__init__()
        self.hc_eps, self.rms_eps = hc_eps, rms_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return hc_head(streams, self.hc_fn, self.hc_base, self.hc_scale, self.hc_eps, self.rms_eps)
