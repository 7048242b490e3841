"""Interleaved partial RoPE on the LAST `rope_dim` channels (design §2).

Channel pairs (2i, 2i+1) of the rope slice form one complex number rotated by
`position * theta**(-2i/rope_dim)`.  The MTP layer is sliding-window only, so it
uses plain RoPE (no YaRN).
"""

import torch

from .linear import unhooked

_DYNAMIC_ROPE = ("dynamic", "longrope")  # types whose tables transformers recomputes from the sequence length


def rotary_tables(rotary_emb, like: torch.Tensor, positions: torch.Tensor, layer_type: str):
    """transformers' V4 ``rotary_emb(like, position_ids=positions, layer_type=layer_type)`` -> cos, sin ``[..., rope/2]``
    in ``like``'s dtype.  A static RoPE type is computed here as one fp32 product per entry: transformers <= 5.24
    spells it as a matmul of inner size 1 (the same product, but a cuBLAS launch per table that Inductor cannot
    fuse).  Dynamic types, and a module with hooks, run the module."""
    types = getattr(rotary_emb, "rope_type", None)
    if not isinstance(types, dict) or types.get(layer_type, "dynamic") in _DYNAMIC_ROPE or not unhooked(rotary_emb):
        return rotary_emb(like, position_ids=positions, layer_type=layer_type)
    inv_freq = getattr(rotary_emb, f"{layer_type}_inv_freq")
    scaling = getattr(rotary_emb, f"{layer_type}_attention_scaling")
    freqs = positions[..., None].float() * inv_freq.to(device=like.device, dtype=torch.float)
    return (freqs.cos() * scaling).to(like.dtype), (freqs.sin() * scaling).to(like.dtype)


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions ``[B, S]`` -> fp32 cos, sin ``[B, S, rope_dim // 2]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device) / rope_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x``; ``cos``/``sin`` must
    broadcast against ``x[..., rope_dim // 2]``.  ``inverse`` applies the conjugate
    rotation (V4 un-rotates the attention output at the query's position)."""
    if torch.compiler.is_compiling():
        return _apply_rope_per_channel(x, cos, sin, inverse)
    rope_dim = 2 * cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    pairs = rope.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    s = -sin if inverse else sin
    rotated = torch.stack((a * cos - b * s, a * s + b * cos), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def _apply_rope_per_channel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """:func:`apply_rope` as one expression per output channel, with no ``cat``/``stack``:
    Inductor lowers those to one kernel per piece (a draft step had 4 kernels per RoPE), while
    this form fuses with the norm before it into one kernel.  Same products and sums, so the
    same values: channel 2i gives ``a cos - b sin``, channel 2i+1 ``b cos + a sin``.  Eager
    keeps the slice-based form, which allocates only the rope slice in fp32."""
    d, half = x.shape[-1], cos.shape[-1]
    nope = d - 2 * half

    def per_channel(t):  # [..., half] -> [..., d]: pair i's value on channels nope+2i, nope+2i+1 (0 on nope)
        return torch.nn.functional.pad(t.unsqueeze(-1).expand(*t.shape, 2).flatten(-2), (nope, 0))

    xf = x.float()
    partner = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # channel 2i <-> 2i+1
    ch = torch.arange(d, device=x.device)
    s = per_channel(sin)
    plus = (ch - nope) % 2 == (0 if inverse else 1)  # the sine term: -b sin on channel 2i (+b sin when inverse)
    s = torch.where(plus, s, -s)
    rotated = xf * per_channel(cos) + partner * s
    return torch.where(ch >= nope, rotated, xf).to(x.dtype)
