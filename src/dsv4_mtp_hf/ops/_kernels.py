"""Registering an op's Triton kernels (CUDA) without making Triton a hard dependency."""

from __future__ import annotations

import importlib
import importlib.util
import warnings


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
