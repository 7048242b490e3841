"""``dsv4_mtp::paged_kv_update`` -- the paged MTP cache's per-step read and write, as one op.

:meth:`PagedMtpKVCache.update <dsv4_mtp_hf.cache.PagedMtpKVCache.update>` gathers each
sequence's last ``window - 1`` keys from its ring, appends the new keys after them (the
keys to attend over, with their positions) and writes the new keys into the ring at the
sequence's length.  As PyTorch ops inside a compiled draft step that was 5 kernels: the
positions, the gather + cat, and -- because the write is an ``index_put_`` on a graph input
that Inductor functionalises -- a copy of the whole pool, the write into the copy and a copy
back (2 x the pool's bytes every step).  As an op that declares its write it is one kernel
on CUDA (``ops/triton/paged_cache_triton.py``) and the pool is updated in place.  The
lengths are not touched here: the caller advances them after.  The reference below is the
source of truth (CPU, autograd callers).
"""

from __future__ import annotations

import torch

from ._kernels import register_triton_kernels

LIB = "dsv4_mtp"
FAR_PAST = -(1 << 40)  # the position of ring rows before a sequence's start: outside every window


def check_paged_kv_update_inputs(pool, block_table, seq_lengths, kv, hist: int, capacity: int) -> None:
    if pool.dim() != 3 or kv.dim() != 3 or kv.shape[-1] != pool.shape[-1]:
        raise ValueError(f"paged_kv_update expects pool [pages, page_size, d] and kv [B, S, d], got "
                         f"{tuple(pool.shape)} and {tuple(kv.shape)}.")
    b = kv.shape[0]
    if tuple(seq_lengths.shape) != (b,) or block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"seq_lengths must be [B] and block_table [B, pages] for B = {b}, got "
                         f"{tuple(seq_lengths.shape)} and {tuple(block_table.shape)}.")
    if capacity != block_table.shape[1] * pool.shape[1] or not 0 <= hist < capacity:
        raise ValueError(f"capacity {capacity} must equal pages per sequence x page size = "
                         f"{block_table.shape[1]} x {pool.shape[1]}, and the history {hist} must be below it.")
    if seq_lengths.dtype != torch.int64 or block_table.dtype != torch.int64:
        raise ValueError("seq_lengths and block_table must be int64.")


def ring_slots(positions, block_table, page_size: int, capacity: int):
    """Absolute positions ``[B, L]`` -> (page ids, row in page) of each sequence's ring."""
    slot = positions % capacity
    return block_table.gather(1, slot // page_size), slot % page_size


def gather_held(pool, block_table, start, hist: int, capacity: int, dtype):
    """The ``hist`` positions before ``start [B, 1]``: (keys ``[B, hist, d]`` in ``dtype``, their
    positions ``[B, hist]``; rows before a sequence's start read slot 0's and get ``FAR_PAST``)."""
    past = start - hist + torch.arange(hist, device=start.device)
    page, row = ring_slots(past.clamp(min=0), block_table, pool.shape[1], capacity)
    return pool[page, row].to(dtype), torch.where(past >= 0, past, torch.full_like(past, FAR_PAST))


def paged_kv_update_reference(pool, block_table, seq_lengths, kv, hist: int, capacity: int):
    """-> (keys ``[B, hist + S, d]`` in kv's dtype, their positions ``[B, hist + S]``); writes kv's
    rows into the ring at positions ``seq_lengths[b] + i`` (slot ``pos % capacity``, page
    ``block_table[b, slot // page_size]``).  Held rows before a sequence's start get position
    ``FAR_PAST``; a prefill longer than the ring only leaves its last rows there."""
    s = kv.shape[1]
    start = seq_lengths.unsqueeze(1)
    held, past = gather_held(pool, block_table, start, hist, capacity, kv.dtype)
    new_pos = start + torch.arange(s, device=kv.device)  # [B, S]
    keys, positions = torch.cat([held, kv], dim=1), torch.cat([past, new_pos], dim=1)
    keep = min(s, capacity)
    page, row = ring_slots(new_pos[:, s - keep :], block_table, pool.shape[1], capacity)
    pool[page, row] = kv[:, s - keep :].to(pool.dtype)
    return keys, positions


@torch.library.custom_op(f"{LIB}::paged_kv_update", mutates_args=("pool",))
def paged_kv_update_op(pool: torch.Tensor, block_table: torch.Tensor, seq_lengths: torch.Tensor, kv: torch.Tensor,
                       hist: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fallback registration (any device without a faster kernel): the reference."""
    check_paged_kv_update_inputs(pool, block_table, seq_lengths, kv, hist, capacity)
    return paged_kv_update_reference(pool, block_table, seq_lengths, kv, hist, capacity)


@paged_kv_update_op.register_fake
def _(pool, block_table, seq_lengths, kv, hist, capacity):
    check_paged_kv_update_inputs(pool, block_table, seq_lengths, kv, hist, capacity)
    b, s, d = kv.shape
    return kv.new_empty(b, hist + s, d), seq_lengths.new_empty(b, hist + s)


def paged_kv_update(pool, block_table, seq_lengths, kv, hist: int, capacity: int):
    """(keys, positions) and the ring write.  Keys with autograd history take the reference (an
    op without a backward would cut it); everything else takes the op."""
    if torch.is_grad_enabled() and kv.requires_grad:
        check_paged_kv_update_inputs(pool, block_table, seq_lengths, kv, hist, capacity)
        return paged_kv_update_reference(pool, block_table, seq_lengths, kv, hist, capacity)
    return paged_kv_update_op(pool, block_table, seq_lengths, kv.contiguous(), hist, capacity)


def register_cuda_kernels() -> bool:
    """Register the Triton kernel behind ``dsv4_mtp::paged_kv_update`` (on import when CUDA is present)."""
    return register_triton_kernels("paged_cache_triton", "dsv4_mtp::paged_kv_update")

if torch.cuda.is_available():
    register_cuda_kernels()
