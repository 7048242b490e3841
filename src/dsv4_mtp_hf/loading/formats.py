"""Decoding the tensor formats of DeepSeek-V4 releases (design §1).

* FP8 e4m3 weights with one scale per 128x128 block (``<module>.scale``, E8M0 in the
  native release; float scales are accepted too).  Partial edge blocks are allowed:
  the scale grid is ``[ceil(N/128), ceil(K/128)]``, as DeepSeek's own code computes it.
* Routed experts, packed FP4 (e2m1), in three layouts that we keep packed:
  native MXFP4 (``weight`` I8 + ``scale`` E8M0 per 32), ModelOpt NVFP4 (``weight`` U8 +
  ``weight_scale`` E4M3 per 16 + ``weight_scale_2`` fp32 global) and compressed-tensors
  NVFP4 (``weight_packed`` + ``weight_scale`` + ``weight_global_scale`` = 1 / ModelOpt's
  global).  A fourth layout, ``dense``, is a BF16/F32 expert (community conversions);
  it is quantised to the model's FP4 format one matrix at a time.

FP4 packing/decoding itself lives in :mod:`dsv4_mtp_hf.fp4`; this module only knows
checkpoint layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import fp4

FP8_BLOCK = 128


class MtpCheckpointError(ValueError):
    """The checkpoint cannot provide the MTP layer (missing, incomplete or malformed tensors)."""


# safetensors header dtype strings -> torch dtypes (only those a V4 release uses).
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

FLOAT_DTYPES = ("BF16", "F16", "F32")
FP8_DTYPES = ("F8_E4M3",)
E8M0_DTYPES = ("F8_E8M0", "U8")  # raw exponent bytes are accepted as U8
PACKED_FP4_DTYPES = ("I8", "U8")
E4M3_SCALE_DTYPES = ("F8_E4M3", "U8")
BLOCK_SCALE_DTYPES = E8M0_DTYPES + ("F32", "BF16")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fp8_scale_shape(shape: tuple[int, int], block: int = FP8_BLOCK) -> tuple[int, int]:
    n, k = shape
    return ceil_div(n, block), ceil_div(k, block)


def decode_block_scale(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (``float8_e8m0fnu`` or ``uint8``) or float scales -> float32."""
    if scale.dtype == torch.uint8 or scale.dtype == SAFETENSORS_DTYPES["F8_E8M0"]:
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
    e8m0 = SAFETENSORS_DTYPES["F8_E8M0"]
    return q, (raw.view(e8m0) if e8m0 is not None else raw)


# -- routed-expert layouts ------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertLayout:
    """How one expert matrix (``...experts.{e}.w1``) is stored.

    ``parts`` maps a role to the tensor suffix: ``packed`` (FP4 bytes or the dense
    weight), ``scale`` (block scales), ``global`` (fp32 per-matrix global scale).
    ``ignored`` suffixes are read by nobody (activation scales)."""

    name: str
    format: str | None  # FP4 format of the packed data; None for dense experts
    parts: dict
    ignored: tuple = ()
    global_is_reciprocal: bool = False

    def keys(self, prefix: str) -> dict[str, str]:
        return {role: f"{prefix}.{suffix}" for role, suffix in self.parts.items()}


MXFP4_NATIVE = ExpertLayout("mxfp4 (native DeepSeek)", "mxfp4", {"packed": "weight", "scale": "scale"})
NVFP4_MODELOPT = ExpertLayout(
    "nvfp4 (ModelOpt)", "nvfp4",
    {"packed": "weight", "scale": "weight_scale", "global": "weight_scale_2"}, ignored=("input_scale",),
)
NVFP4_COMPRESSED_TENSORS = ExpertLayout(
    "nvfp4 (compressed-tensors)", "nvfp4",
    {"packed": "weight_packed", "scale": "weight_scale", "global": "weight_global_scale"},
    ignored=("input_global_scale", "input_scale"), global_is_reciprocal=True,
)
DENSE_EXPERTS = ExpertLayout("dense (BF16/F32)", None, {"packed": "weight"})
EXPERT_LAYOUTS = (MXFP4_NATIVE, NVFP4_MODELOPT, NVFP4_COMPRESSED_TENSORS, DENSE_EXPERTS)


def detect_expert_layout(prefix: str, header: dict[str, tuple[str, tuple]]) -> ExpertLayout | None:
    """Pick the layout of the expert matrix ``prefix`` (e.g. ``mtp.0.ffn.experts.0.w1``) from
    the tensor names and dtypes present (``header``: name -> (dtype string, shape))."""
    if f"{prefix}.weight_packed" in header:
        return NVFP4_COMPRESSED_TENSORS
    if f"{prefix}.weight_scale_2" in header:
        return NVFP4_MODELOPT
    weight = header.get(f"{prefix}.weight")
    if weight is None:
        return None
    if weight[0] in FLOAT_DTYPES and f"{prefix}.scale" not in header and f"{prefix}.weight_scale" not in header:
        return DENSE_EXPERTS
    if f"{prefix}.scale" in header:
        return MXFP4_NATIVE
    if f"{prefix}.weight_scale" in header and weight[0] in PACKED_FP4_DTYPES:
        return NVFP4_MODELOPT  # global scale missing: reported as incomplete later
    return MXFP4_NATIVE


def expert_part_expectations(layout: ExpertLayout, fmt: str, n: int, k: int) -> dict[str, tuple[tuple, tuple]]:
    """role -> (accepted dtype strings, expected shape) for a logical ``[n, k]`` expert matrix."""
    if layout is DENSE_EXPERTS:
        return {"packed": (FLOAT_DTYPES, (n, k))}
    group = fp4.get_format(fmt).group_size
    out = {"packed": (PACKED_FP4_DTYPES, (n, k // 2))}
    if fmt == "mxfp4":
        out["scale"] = (E8M0_DTYPES, (n, k // group))
    else:
        out["scale"] = (E4M3_SCALE_DTYPES, (n, k // group))
        out["global"] = (("F32",), ())
    return out


def global_scale_value(layout: ExpertLayout, t: torch.Tensor) -> torch.Tensor:
    """The fp32 global multiplier (shape ``[]``) from a stored global-scale tensor."""
    g = t.float().reshape(())
    return (1.0 / g) if layout.global_is_reciprocal else g


def check_scale_bytes(name: str, raw: torch.Tensor, fmt: str) -> None:
    """NaN encodings in block scales (E8M0 0xFF; E4M3 0x7F/0xFF) mean a corrupt tensor."""
    bad = (raw == 255) if fmt == "mxfp4" else ((raw & 0x7F) == 0x7F)
    if bool(bad.any()):
        raise MtpCheckpointError(
            f"Tensor {name!r} holds {int(bad.sum())} NaN block scale(s): the checkpoint is corrupt."
        )
