"""Zeroed device buffers that outlive every call: the tickets (and workspaces) of the kernels
whose last-arriving program finishes the work (``attention_triton``, ``argmax_triton``).

Each kernel leaves its tickets back at 0, so a buffer zeroed once serves every later launch
and CUDA-graph replay.  A buffer is allocated outside graph capture only (a memset recorded in
a graph would run at replay, not before the eager calls after it) and never freed: graphs
captured earlier keep its address, so a grown buffer keeps the old one alive too.  Launches
sharing a buffer must be ordered on one stream.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, str], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers, still referenced by earlier graphs


def persistent_zeros(name: str, device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The zeroed buffer ``name`` on ``device`` with at least ``numel`` elements; None while the
    current stream captures a CUDA graph and no such buffer exists yet (the caller falls back)."""
    key = (name, str(device))
    buf = _BUFFERS.get(key)
    if buf is not None and buf.numel() >= numel and buf.dtype == dtype:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if buf is not None:
        _RETIRED.append(buf)
    _BUFFERS[key] = buf = torch.zeros(numel, dtype=dtype, device=device)
    return buf
