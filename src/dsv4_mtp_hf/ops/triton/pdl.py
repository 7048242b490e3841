"""Programmatic dependent launch (PDL, sm_90+) for the package's Triton kernels.

A draft step is ~45 dependent kernels of 1-20 µs; between two of them the GPU drains the first,
flushes its writes, and only then launches the second (~0.3-0.7 µs of idle SMs per edge in a
CUDA graph, plus each kernel's ramp).  Launched with PDL, a kernel may start while its
predecessor's last blocks are still exiting; it then waits in ``griddepcontrol.wait`` until
the predecessor has completed and its writes are visible.

The contract, kept by :func:`launch_args` and :func:`wait`:
* every kernel launched with PDL calls :func:`wait` first, before any load or store (so it
  can neither read unfinished results nor overwrite memory a predecessor still reads);
* right after its wait a kernel triggers its dependent (``griddepcontrol.launch_dependents``,
  ``trigger``): the next kernel's blocks may then be launched onto free SM resources while this
  one still runs, and sit in their own :func:`wait` until it has completed.  Without the trigger
  the next grid's launch starts only when this one's last block exits.  Triggering after the
  wait, not before, keeps at most two grids of the chain resident (the running one and the
  next, waiting), and a dependent is launched only once every block of this grid has started,
  so it cannot take the place of one that has not.
Waiting is transitive: a kernel that waited on its predecessor completes only after it, so
the chain keeps stream order.  Kernels launched without PDL are serialised as before, and
CUDA-graph capture records PDL launches as programmatic edges.  Inductor's kernels trigger too
(after their last load).

Inductor can launch the kernels it generates with PDL too (``torch._inductor.config.triton.
enable_pdl``); its code waits before touching anything the previous kernel wrote and, after an
opaque op's kernels (ours), always.  :func:`inductor_options` turns it on for the compiled draft
step (``generation/cuda_graph.py``).

``DSV4_MTP_PDL=0`` (or ``enabled = False``) launches everything the classic way;
``DSV4_MTP_PDL_INDUCTOR=0`` (``inductor = False``) keeps only Inductor's kernels classic;
``DSV4_MTP_PDL_TRIGGER=0`` (``trigger = False``) keeps PDL but no early triggers in our kernels
(before the fourteenth session).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
enabled = os.environ.get("DSV4_MTP_PDL", "1") != "0"
inductor = os.environ.get("DSV4_MTP_PDL_INDUCTOR", "1") != "0"
trigger = os.environ.get("DSV4_MTP_PDL_TRIGGER", "1") != "0"


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_args(device: torch.device) -> dict:
    """Keyword arguments for a launch of a kernel that takes ``PDL: tl.constexpr`` and calls
    :func:`wait` under it: ``PDL`` (0 off, 1 wait, 2 wait and trigger) and Triton's ``launch_pdl``
    always agree."""
    on = (enabled and not _INTERPRET and device.type == "cuda"
          and _capable(device.index if device.index is not None else torch.cuda.current_device()))
    return {"PDL": 2 if trigger else 1, "launch_pdl": True} if on else {"PDL": 0}


def inductor_options(device: torch.device) -> dict:
    """Inductor options for a ``torch.compile`` whose kernels run on ``device``: PDL for the
    generated kernels where :func:`launch_args` would use it (and this torch has the option)."""
    import torch._inductor.config as config

    if inductor and hasattr(config.triton, "enable_pdl") and launch_args(device)["PDL"]:
        return {"triton.enable_pdl": True}
    return {}


@triton.jit
def wait(PDL: tl.constexpr):
    """The first statement of a PDL-launched kernel: block until the previous kernel in the
    stream has completed and its memory is visible, then (``PDL == 2``) let the next kernel's
    launch begin (a no-op when ``PDL`` is 0 / False)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if PDL == 2:
            tl.extra.cuda.gdc_launch_dependents()
