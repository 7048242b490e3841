"""Triton kernel behind ``dsv4_mtp::argmax`` on CUDA: ``torch.argmax(x, -1)`` in one launch.

Grid ``(rows, G)``: program ``(r, g)`` reduces chunk g of row r to one int64 key packing the whole
``torch.argmax`` order (high 32 bits: the fp32 value as an order-preserving int32, NaN above +inf,
-0.0 equal to +0.0; low 32 bits: ``2**31 - 1 - index``, so ties go to the first index), stores it
and takes a ticket from the row's counter (acq_rel).  The last program combines the G keys by an
integer max (deterministic in any arrival order), writes the index and resets the counter.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from ..argmax import KERNEL_MAX_ROWS, argmax_op, kernel_takes
from .persistent import persistent_zeros
from . import pdl
from .pdl import wait

G_MAX = 512  # partials per row the workspace holds (longer rows get more tiles per program)
_EMPTY = tl.constexpr(-(2**63))  # below every element's key: masked lanes, padding of the partials


@triton.jit
def _packed_key(x, idx):
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0, as in torch.argmax
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ tl.where(bits < 0, 0x7FFFFFFF, 0)  # negative floats: reverse their magnitude order
    key = tl.where(x != x, 0x7FFFFFFF, key)  # every NaN is maximal and equal: the first one wins
    return (key.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, part_ptr, ticket_ptr, V, stride_row, G,
                   BLOCK: tl.constexpr, TILES: tl.constexpr, G_P2: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    row = tl.program_id(0)
    g = tl.program_id(1)
    lane = tl.arange(0, BLOCK)
    x_row = x_ptr + row.to(tl.int64) * stride_row
    best = tl.full([BLOCK], _EMPTY, tl.int64)
    for t in tl.static_range(TILES):  # later tiles only replace strictly larger keys: ties keep the first
        idx = g * (BLOCK * TILES) + t * BLOCK + lane
        ok = idx < V
        x = tl.load(x_row + idx, mask=ok, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.where(ok, _packed_key(x, idx), _EMPTY))
    tl.store(part_ptr + row * G + g, tl.max(best, axis=0))
    tl.debug_barrier()  # every thread's part of the store is issued before the ticket releases it
    ticket = tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel")
    if ticket == G - 1:  # the last program of this row: all G partials are visible (acquire)
        j = tl.arange(0, G_P2)
        parts = tl.load(part_ptr + row * G + j, mask=j < G, other=_EMPTY, cache_modifier=".cg")
        top = tl.max(parts, axis=0)
        tl.store(out_ptr + row, (0x7FFFFFFF - (top & 0xFFFFFFFF)).to(tl.int64))
        tl.store(ticket_ptr + row, 0)  # clean for the next launch (stream order)


def pick_config(rows: int, v: int) -> tuple[int, int, int]:
    """``(BLOCK, TILES, num_warps)``: ~128 programs in all at V=129280 (1024-element chunks at 1-2
    rows, 4096 beyond; H200: 2.6 µs at 1 row, 4.1 at 16, against 27 for torch.argmax)."""
    block = 1024 if rows <= 2 else 4096
    n = triton.cdiv(v, block)
    tiles = max(1, triton.cdiv(n, G_MAX), triton.cdiv(rows * n, 2048))
    return block, tiles, 4


def workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The device's partials ``[KERNEL_MAX_ROWS * G_MAX]`` int64 and row tickets
    ``[KERNEL_MAX_ROWS]`` int32 (``persistent``: zeroed once, never freed); None while a CUDA
    graph captures before any call on this device allocated them."""
    parts = persistent_zeros("argmax_partials", device, KERNEL_MAX_ROWS * G_MAX, torch.int64)
    tickets = persistent_zeros("argmax_tickets", device, KERNEL_MAX_ROWS, torch.int32)
    return None if parts is None or tickets is None else (parts, tickets)


def argmax_triton(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, -1)`` for ``1 <= rows <= KERNEL_MAX_ROWS`` and ``V < 2**31 - 1``.  Calls
    sharing the device's workspace must be stream-ordered (one stream per device)."""
    v = x.shape[-1]
    x2 = x.reshape(-1, v)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    block, tiles, warps = pick_config(rows, v)
    g = triton.cdiv(v, block * tiles)
    parts, tickets = workspace(x.device)
    if rows > tickets.numel() or rows * g > parts.numel():
        raise ValueError(f"argmax_triton: {rows} rows x {g} partials exceed the workspace.")
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _argmax_kernel[(rows, g)](x2, out, parts, tickets, v, x2.stride(0), g,
                              BLOCK=block, TILES=tiles, G_P2=triton.next_power_of_2(g), num_warps=warps,
                              **pdl.launch_args(x.device))
    return out.view(x.shape[:-1])


@argmax_op.register_kernel("cuda")
def _argmax_cuda(x):
    if not kernel_takes(x):
        return torch.argmax(x, dim=-1)
    if workspace(x.device) is None:  # the workspace is allocated outside capture only
        warnings.warn("dsv4_mtp::argmax: first call inside a CUDA graph capture (no workspace yet; warm up "
                      "before capturing); this capture uses torch.argmax.")
        return torch.argmax(x, dim=-1)
    try:
        with torch.cuda.device(x.device):  # Triton launches on the current device, not the tensor's
            return argmax_triton(x)
    except Exception as err:
        raise RuntimeError(
            f"dsv4_mtp::argmax: the Triton kernel failed for x {tuple(x.shape)} {x.dtype} on {x.device}: "
            f"{type(err).__name__}: {err}. Check the Triton install (`python -c 'import triton'`, a CUDA "
            "toolchain it supports)."
        ) from err
