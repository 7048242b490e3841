"""FP4 (e2m1) weight formats: packing, decoding and quantisation.

Two block-scaled formats carry DeepSeek-V4's routed experts (design §1):

* ``mxfp4`` -- the native release: one E8M0 scale ``2**(e - 127)`` per 32 values
  along K.
* ``nvfp4`` -- ModelOpt / compressed-tensors re-quantisations: one E4M3 scale per
  16 values along K times one fp32 global scale per matrix.

Codes are packed two per byte, element ``2i`` in the LOW nibble; bit 3 is the
sign, bits 0-2 index the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}.  Scales are
kept as raw ``uint8`` bytes (E8M0 exponent or E4M3 bit pattern) so that every
tensor survives save/load and device moves bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0
E4M3_MAX = 448.0


@dataclass(frozen=True)
class FP4Format:
    name: str
    group_size: int  # values along K sharing one block scale
    has_global_scale: bool


NVFP4 = FP4Format("nvfp4", 16, True)
MXFP4 = FP4Format("mxfp4", 32, False)
FORMATS = {f.name: f for f in (NVFP4, MXFP4)}


def get_format(name: str) -> FP4Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"Unknown FP4 expert format {name!r}; supported formats are {sorted(FORMATS)}.") from None


def e2m1_table(device=None, dtype=torch.float32) -> torch.Tensor:
    """The 16 code values, indexed by the 4-bit code (bit 3 = sign)."""
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.cat([pos, -pos]).to(device=device, dtype=dtype)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., K]`` (values 0..15) -> packed bytes ``[..., K/2]``."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {tuple(codes.shape)}.")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes ``[..., K/2]`` (uint8 or int8) -> uint8 codes ``[..., K]``."""
    packed = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 data must be uint8 or int8, got {packed.dtype}.")
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    return e2m1_table(codes.device)[codes.long()]


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scale) to the nearest e2m1 code.
    Ties go to the even mantissa, as hardware conversions do; |x| > 6 saturates."""
    mag = x.abs().float()
    # Decision boundaries between consecutive magnitudes; ties resolved toward the
    # code with an even mantissa bit (0, 1, 2, 4 for the ties at .25, 1.25, 2.5, 5;
    # 1.0, 2.0 and 4.0 for .75, 1.75 and 3.5 -- i.e. the even code index).
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=x.device)
    idx = torch.bucketize(mag, mids, right=False)  # x == mid -> lower index
    tie = (idx < 7) & (mag == mids[idx.clamp(max=6)])
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)  # move odd-index ties up to the even code
    sign = (x < 0) & (idx > 0)
    return (idx | (sign.to(idx.dtype) << 3)).to(torch.uint8)


def decode_scales(scale: torch.Tensor, fmt: FP4Format | str) -> torch.Tensor:
    """Raw per-block scale bytes -> float32 multipliers."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    raw = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    if fmt is NVFP4:
        return raw.view(torch.float8_e4m3fn).float()
    # E8M0: 2**(e-127); 255 is NaN by definition.
    e = raw.to(torch.int32)
    out = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127)
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


def scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Any stored scale dtype (float8_e4m3fn, float8_e8m0fnu, uint8, int8) as raw uint8 bytes."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.element_size() != 1:
        raise TypeError(f"FP4 block scales must be 1-byte values, got {scale.dtype}.")
    return scale.view(torch.uint8)


def dequantize_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    fmt: FP4Format | str,
    global_scale: torch.Tensor | float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode ``packed [..., N, K/2]`` with ``scale [..., N, K/group]`` to ``[..., N, K]``.

    ``global_scale`` (NVFP4 only) multiplies each matrix; pass one value per leading
    index (e.g. ``[E]`` for a stack of experts) or a scalar.
    """
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    values = decode_e2m1(unpack_fp4(packed))
    k = values.shape[-1]
    if scale.shape[-1] * fmt.group_size != k or scale.shape[:-1] != values.shape[:-1]:
        raise ValueError(
            f"{fmt.name} scale shape {tuple(scale.shape)} does not match packed weight shape "
            f"{tuple(packed.shape)} (expected {(*values.shape[:-1], k // fmt.group_size)})."
        )
    s = decode_scales(scale, fmt).repeat_interleave(fmt.group_size, dim=-1)
    out = values * s
    if global_scale is not None:
        g = torch.as_tensor(global_scale, dtype=torch.float32, device=out.device)
        out = out * g.reshape(*g.shape, *([1] * (out.dim() - g.dim())))
    return out.to(dtype)


def quantize_fp4(w: torch.Tensor, fmt: FP4Format | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise ``w [..., N, K]`` -> (packed uint8 ``[..., N, K/2]``, scale bytes uint8
    ``[..., N, K/group]``, fp32 global scale ``[...]``; ones for MXFP4).

    NVFP4 follows ModelOpt's recipe (global = amax / (448·6), block scale =
    block_amax / (6·global) rounded to E4M3); MXFP4 picks the smallest power of two
    that keeps the block maximum representable.
    """
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    w = w.float()
    *lead, n, k = w.shape
    if k % fmt.group_size:
        raise ValueError(f"K={k} is not a multiple of the {fmt.name} group size {fmt.group_size}.")
    blocks = w.reshape(*lead, n, k // fmt.group_size, fmt.group_size)
    bmax = blocks.abs().amax(-1)
    if fmt is NVFP4:
        amax = w.abs().reshape(*lead, -1).amax(-1) if lead else w.abs().amax()
        glob = (amax / (E4M3_MAX * FP4_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
        g = glob.reshape(*glob.shape, 1, 1)
        s = (bmax / (FP4_MAX * g)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        sf = s.float() * g
        raw = s.view(torch.uint8)
    else:
        glob = torch.ones(lead, dtype=torch.float32)
        e = torch.ceil(torch.log2((bmax / FP4_MAX).clamp(min=2.0**-127))).clamp(-127, 127)
        raw = (e + 127).to(torch.uint8)
        sf = torch.ldexp(torch.ones_like(e), e.to(torch.int32))
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    codes = encode_e2m1(blocks / safe.unsqueeze(-1)).reshape(*lead, n, k)
    return pack_fp4(codes), raw.contiguous(), glob.float()
