"""FP8 e4m3 weights with one power-of-two (E8M0) scale per 128x128 block: DeepSeek-V4's projections.

A native release stores its attention and shared-expert projections this way (``<module>.scale``, E8M0; float
scales are accepted too).  Partial edge blocks are allowed: the scale grid is ``[ceil(N/128), ceil(K/128)]``, as
DeepSeek's own code computes it.  The loaders, the export and the ``fp8_linear`` op's reference all decode here.
"""

from __future__ import annotations

import torch

from . import fp4

FP8_BLOCK = 128
E8M0 = getattr(torch, "float8_e8m0fnu", None)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fp8_scale_shape(shape: tuple[int, int], block: int = FP8_BLOCK) -> tuple[int, int]:
    n, k = shape
    return ceil_div(n, block), ceil_div(k, block)


def decode_block_scale(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (``float8_e8m0fnu`` or ``uint8``) or float scales -> float32."""
    if scale.dtype == torch.uint8 or scale.dtype == E8M0:
        return fp4.decode_scales(scale.view(torch.uint8), fp4.MXFP4)
    return scale.float()


@torch.no_grad()
def dequantize_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = FP8_BLOCK, rows_per_chunk: int = 4096
) -> torch.Tensor:
    """``weight`` e4m3 ``[N, K]`` times its block scale ``[ceil(N/b), ceil(K/b)]`` -> ``dtype``.

    Decoded in row chunks so the fp32 intermediate stays small; runs on ``weight``'s device.
    """
    n, k = weight.shape
    s = decode_block_scale(scale.to(weight.device))
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    rows_per_chunk = max(block, rows_per_chunk - rows_per_chunk % block)
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(n, r0 + rows_per_chunk)
        sb = s[r0 // block : ceil_div(r1, block)]
        sb = sb.repeat_interleave(block, 0)[: r1 - r0].repeat_interleave(block, 1)[:, :k]
        out[r0:r1] = (weight[r0:r1].float() * sb).to(dtype)
    return out


@torch.no_grad()
def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`dequantize_fp8_block` with power-of-two (E8M0) scales, DeepSeek's
    recipe: ``scale = 2**ceil(log2(block_amax / 448))``.  -> (e4m3 weight, e8m0 scale)."""
    w = w.float()
    n, k = w.shape
    rb, cb = fp8_scale_shape((n, k), block)
    padded = torch.zeros(rb * block, cb * block, device=w.device)
    padded[:n, :k] = w
    amax = padded.view(rb, block, cb, block).abs().amax(dim=(1, 3)).clamp(min=1e-30)
    e = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
    s = torch.ldexp(torch.ones_like(e), e.to(torch.int32))
    full = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    q = (w / full).to(torch.float8_e4m3fn)
    raw = (e + 127).to(torch.uint8)
    return q, (raw.view(E8M0) if E8M0 is not None else raw)
