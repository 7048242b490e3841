"""Registering an op's Triton kernels (CUDA) without making Triton a hard dependency."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings

import torch


def register_triton_kernels(module: str, ops: str) -> bool:
    """Import ``dsv4_mtp_hf.ops.triton.<module>``, whose import registers the CUDA kernels
    of ``ops``.  CPU-only installs (CI) never import Triton; a broken Triton install warns
    and leaves the reference implementation in charge on CUDA.  Returns whether it worked."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        importlib.import_module(f"{__package__}.triton.{module}")
    except Exception as err:  # noqa: BLE001 - a broken Triton install must not break the package
        warnings.warn(f"{ops}: Triton kernels not registered ({type(err).__name__}: {err}); "
                      "the reference implementation runs on CUDA.")
        return False
    return True


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_on(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch (sm_90+; design §8.3)."""
    if device.type != "cuda":
        return False
    return _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


def inductor_options(device: torch.device) -> dict:
    """Inductor options for a ``torch.compile`` whose kernels run on ``device``: PDL for the generated kernels
    where ours use it (and this torch has the option), so compiled and custom kernels chain alike."""
    import torch._inductor.config as config

    return {"triton.enable_pdl": True} if hasattr(config.triton, "enable_pdl") and pdl_on(device) else {}
