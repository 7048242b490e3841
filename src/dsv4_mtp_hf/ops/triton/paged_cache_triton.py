"""Triton kernel behind ``dsv4_mtp::paged_kv_update`` on CUDA.

Grid ``(B, cdiv(hist + S, ROWS))``: a program takes ROWS rows of one sequence's keys: held
rows are gathered from the ring (as the reference: the slot of ``max(pos, 0)``, position
``FAR_PAST`` before the start), new rows are copied from ``kv`` and written into the ring.
When the new rows' slots cannot meet the held rows' (``hist + kept rows <= capacity``: every
draft step) one launch does both; a prefill longer than that gathers in a first launch and
writes in a second, so no program reads a slot another one overwrites.  Fixed grid, no host
sync: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..paged_cache import FAR_PAST, check_paged_kv_update_inputs, paged_kv_update_op
from . import pdl
from .pdl import wait

ROWS = 8  # key rows per program: 16 programs at batch 1 (32-row programs took 6.0 us on the H200, latency-bound)


@triton.jit
def _update_kernel(pool_ptr, table_ptr, len_ptr, kv_ptr, keys_ptr, pos_ptr, S, KEEP, HIST, D, CAPACITY, PAGE,
                   s_pool_page, s_pool_row, s_table_b, s_kv_b, s_kv_s, s_keys_b, s_keys_l, s_pos_b,
                   READ: tl.constexpr, WRITE: tl.constexpr, FAR: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS).to(tl.int64)  # key rows
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    start = tl.load(len_ptr + b)
    pos = start - HIST + r
    held = r < HIST
    new = (r >= HIST) & (r < HIST + S)
    slot = tl.maximum(pos, 0) % CAPACITY
    page = tl.load(table_ptr + b * s_table_b + slot // PAGE, mask=held | new, other=0)
    ring = pool_ptr + page[:, None] * s_pool_page + (slot % PAGE)[:, None] * s_pool_row + d[None, :]
    src = kv_ptr + b * s_kv_b + (r - HIST)[:, None] * s_kv_s + d[None, :]
    v = tl.load(src, mask=new[:, None] & dmask[None, :], other=0.0)
    if READ:
        h = tl.load(ring, mask=held[:, None] & dmask[None, :], other=0.0).to(v.dtype)
        tl.store(keys_ptr + b * s_keys_b + r[:, None] * s_keys_l + d[None, :], tl.where(held[:, None], h, v),
                 mask=(held | new)[:, None] & dmask[None, :])
        tl.store(pos_ptr + b * s_pos_b + r, tl.where(held & (pos < 0), FAR, pos), mask=held | new)
    if WRITE:
        keep = new & (r >= HIST + S - KEEP)
        tl.store(ring, v.to(pool_ptr.dtype.element_ty), mask=keep[:, None] & dmask[None, :])


@paged_kv_update_op.register_kernel("cuda")
def _paged_kv_update_cuda(pool, block_table, seq_lengths, kv, hist, capacity):
    check_paged_kv_update_inputs(pool, block_table, seq_lengths, kv, hist, capacity)
    b, s, d = kv.shape
    keys = kv.new_empty(b, hist + s, d)
    positions = seq_lengths.new_empty(b, hist + s)
    if b == 0:
        return keys, positions
    if pool.stride(-1) != 1 or kv.stride(-1) != 1 or block_table.stride(-1) != 1 or seq_lengths.stride(0) != 1:
        raise ValueError("paged_kv_update needs contiguous last dims (pool, kv, block_table) and contiguous seq_lengths.")
    keep = min(s, capacity)
    args = (pool, block_table, seq_lengths, kv, keys, positions, s, keep, hist, d, capacity, pool.shape[1],
            pool.stride(0), pool.stride(1), block_table.stride(0), kv.stride(0), kv.stride(1), keys.stride(0),
            keys.stride(1), positions.stride(0))
    grid = (b, triton.cdiv(hist + s, ROWS))
    meta = dict(FAR=FAR_PAST, ROWS=ROWS, BLOCK_D=triton.next_power_of_2(d), num_warps=4, **pdl.launch_args(kv.device))
    with torch.cuda.device(kv.device):  # Triton launches on the current device
        if hist + keep <= capacity:  # the written slots are not among the read ones
            _update_kernel[grid](*args, READ=True, WRITE=True, **meta)
        else:
            _update_kernel[grid](*args, READ=True, WRITE=False, **meta)
            _update_kernel[grid](*args, READ=False, WRITE=True, **meta)
    return keys, positions
