"""RMS norms as DeepSeek-V4 computes them: statistics in fp32, fp32 weights."""

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS norm over the last dim (V4's per-head q norm and mHC input norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` in fp32, rounded once to x's dtype (transformers' ``DeepseekV4RMSNorm``)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
        self.eps = eps

    @classmethod
    def of(cls, norm: nn.Module, eps: float) -> "RMSNorm":
        """Ours on another norm's ``weight`` (transformers' ``DeepseekV4RMSNorm``): the same Parameter, no copy."""
        with torch.device("meta"):
            ours = cls(norm.weight.shape[0], eps)
        ours.weight = norm.weight
        return ours

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
