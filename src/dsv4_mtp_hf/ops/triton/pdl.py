"""Programmatic dependent launch (PDL, sm_90+) for the package's Triton kernels.

A draft step is ~45 dependent kernels of 1-20 µs; without PDL the GPU drains each one before
launching the next.  With PDL a kernel may start while its predecessor's last blocks exit and
waits in ``griddepcontrol.wait`` until the predecessor has completed and its writes are visible.

The contract, kept by :func:`launch_args` and :func:`wait`: every PDL-launched kernel calls
:func:`wait` before any load or store, then triggers its dependent (``launch_dependents``).
Triggering after the wait keeps at most two grids of the chain resident, and waiting is
transitive, so the chain keeps stream order.  CUDA-graph capture records the launches as
programmatic edges.  :func:`~dsv4_mtp_hf.ops._kernels.inductor_options` turns PDL on for Inductor's generated kernels too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._kernels import pdl_on


def launch_args(device: torch.device) -> dict:
    """Keyword arguments for a launch of a kernel that takes ``PDL: tl.constexpr`` and calls
    :func:`wait` under it: PDL on sm_90+ (``PDL=1`` with ``launch_pdl``), off elsewhere."""
    return {"PDL": 1, "launch_pdl": True} if pdl_on(device) else {"PDL": 0}


@triton.jit
def wait(PDL: tl.constexpr):
    """The first statement of a PDL-launched kernel: wait for the previous kernel in the stream,
    then let the next one's launch begin (a no-op when ``PDL`` is 0)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
