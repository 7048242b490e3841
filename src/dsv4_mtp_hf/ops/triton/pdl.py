"""Programmatic dependent launch (PDL, sm_90+) for the package's Triton kernels.

A draft step is ~45 dependent kernels of 1-20 µs; without PDL the GPU drains each one before
launching the next.  With PDL a kernel may start while its predecessor's last blocks exit and
waits in ``griddepcontrol.wait`` until the predecessor has completed and its writes are visible.

The contract, kept by :func:`launch_args` and :func:`wait`: every PDL-launched kernel calls
:func:`wait` before any load or store, then triggers its dependent (``launch_dependents``).
Triggering after the wait keeps at most two grids of the chain resident, and waiting is
transitive, so the chain keeps stream order.  CUDA-graph capture records the launches as
programmatic edges.  :func:`inductor_options` turns PDL on for Inductor's generated kernels too.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _on(device: torch.device) -> bool:
    return device.type == "cuda" and _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_args(device: torch.device) -> dict:
    """Keyword arguments for a launch of a kernel that takes ``PDL: tl.constexpr`` and calls
    :func:`wait` under it: PDL on sm_90+ (``PDL=1`` with ``launch_pdl``), off elsewhere."""
    return {"PDL": 1, "launch_pdl": True} if _on(device) else {"PDL": 0}


def inductor_options(device: torch.device) -> dict:
    """Inductor options for a ``torch.compile`` whose kernels run on ``device``: PDL for the
    generated kernels where :func:`launch_args` uses it (and this torch has the option)."""
    import torch._inductor.config as config

    return {"triton.enable_pdl": True} if hasattr(config.triton, "enable_pdl") and _on(device) else {}


@triton.jit
def wait(PDL: tl.constexpr):
    """The first statement of a PDL-launched kernel: wait for the previous kernel in the stream,
    then let the next one's launch begin (a no-op when ``PDL`` is 0)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
