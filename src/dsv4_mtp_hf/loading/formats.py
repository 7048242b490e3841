"""Decoding the tensor formats of DeepSeek-V4 releases (design §1).

* FP8 e4m3 weights with one scale per 128x128 block (``<module>.scale``, E8M0 in the
  native release; float scales are accepted too): decoded by :mod:`dsv4_mtp_hf.fp8`.
* Routed experts, packed FP4 (e2m1), in three layouts that we keep packed:
  native MXFP4 (``weight`` I8 + ``scale`` E8M0 per 32), ModelOpt NVFP4 (``weight`` U8 +
  ``weight_scale`` E4M3 per 16 + ``weight_scale_2`` fp32 global) and compressed-tensors
  NVFP4 (``weight_packed`` + ``weight_scale`` + ``weight_global_scale`` = 1 / ModelOpt's
  global).  A fourth layout, ``dense``, is a BF16/F32 expert (community conversions);
  it is quantised to the model's FP4 format one matrix at a time.

FP4 and FP8 packing/decoding live in :mod:`dsv4_mtp_hf.fp4` and :mod:`dsv4_mtp_hf.fp8`; this module only
knows checkpoint layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import fp4

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
