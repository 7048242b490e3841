"""Interleaved partial RoPE on the LAST `rope_dim` channels (SPEC §4).

Channel pairs (2i, 2i+1) of the rope slice form one complex number rotated by
`position * theta**(-2i/rope_dim)`.  The MTP layer is sliding-window only, so it
uses plain RoPE (no YaRN).
"""

import torch


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions ``[B, S]`` -> fp32 cos, sin ``[B, S, rope_dim // 2]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device) / rope_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x``; ``cos``/``sin`` must
    broadcast against ``x[..., rope_dim // 2]``.  ``inverse`` applies the conjugate
    rotation (V4 un-rotates the attention output at the query's position)."""
    rope_dim = 2 * cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    pairs = rope.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    s = -sin if inverse else sin
    rotated = torch.stack((a * cos - b * s, a * s + b * cos), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
