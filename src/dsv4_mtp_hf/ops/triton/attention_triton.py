"""Triton kernel behind ``dsv4_mtp::window_attention`` for one query row per sequence (a draft step).

Grid ``(B, H / BLOCK_H, NSPLIT)``: a program holds ``BLOCK_H`` query heads of one sequence and walks
a range of keys in steps of ``block_l``: bf16 MMA scores (fp32 accumulation), the window mask from
the positions, an fp32 online softmax (finite -1e30 start: a fully masked range leaves a zero
partial, never NaN), and ``p @ kv`` with p rounded to bf16 (~2**-9, the only rounding the reference
lacks).  The keys serve as values (shared KV).  With one split the program adds the sink and writes
the output; with several (small batches, flash-decoding) each writes its partial to a workspace
and the last program of each (sequence, head block), by an acq_rel ticket reset after use,
combines them in a fixed order -- one launch, deterministic.  A graph captured before the tickets
exist combines in a second launch instead.  Calls on one device share the tickets: one stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait
from .persistent import persistent_zeros
from ..attention import check_window_attention_inputs, sliding_window_attention_reference, window_attention

BLOCK_H = 16  # query heads per program (the MMA's M)
_TICKETS_MIN = 4096  # tickets (one per sequence x head block) allocated at least


def pick_config(b: int, h: int, length: int, d: int) -> tuple[int, int, int]:
    """``(keys_per_program, block_l, num_warps)``; ``keys_per_program`` 0: all keys in one program.
    H200, V4-Flash H=64 d=512 L=128 (``benchmarks/attention_op.py``): while the unsplit grid is
    small (B=1..4: 4-16 programs) two ranges of 64 keys with the ticket combine beat one range
    (7.4 vs 8.1 µs at B=1); from 64 unsplit programs on (B=16) the split no longer pays."""
    kpp = 0 if b * (h // BLOCK_H) >= 64 or length <= 64 else 64
    block_l = 64 if d <= 512 else 32  # [64, 1024] bf16 keys would crowd shared memory
    num_warps = 8 if BLOCK_H * d >= 8192 else 4  # [16, 512] on 4 warps spills
    return kpp, block_l, num_warps


@triton.jit
def _combine(acc_ptr, m_ptr, den_ptr, sink_ptr, out_ptr, b, h, d, H, so_b, so_h,
             D: tl.constexpr, BLOCK_H: tl.constexpr, NSPLIT: tl.constexpr):
    """out[b, h] from the NSPLIT partials, split 0 first (a fixed order: deterministic).
    ``.cg``: the partials come from other programs of this launch, so read them from the L2."""
    row = b * NSPLIT * H + h  # [BLOCK_H] row of split 0 in the [B, NSPLIT, H] statistics
    sink = tl.load(sink_ptr + h).to(tl.float32)
    m = sink
    for i in tl.static_range(NSPLIT):
        m = tl.maximum(m, tl.load(m_ptr + row + i * H, cache_modifier=".cg"))
    den = tl.exp(sink - m)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for i in tl.static_range(NSPLIT):
        w = tl.exp(tl.load(m_ptr + row + i * H, cache_modifier=".cg") - m)  # 0 for a fully masked split
        den += tl.load(den_ptr + row + i * H, cache_modifier=".cg") * w
        part = tl.load(acc_ptr + (row + i * H)[:, None].to(tl.int64) * D + d[None, :], cache_modifier=".cg")
        acc += part * w[:, None]
    out = acc / den[:, None]
    tl.store(out_ptr + b * so_b + h[:, None].to(tl.int64) * so_h + d[None, :], out.to(out_ptr.dtype.element_ty))


@triton.jit
def _step(q, kv_ptr, kvpos_ptr, qp, b, l0, l1, window, scale, skv_b, skv_l, skp_b, skp_l, m, den, acc, d,
          BLOCK_L: tl.constexpr):
    """Keys ``[l0, l0 + BLOCK_L) & [.., l1)`` into the online softmax state ``(m, den, acc)``."""
    j = l0 + tl.arange(0, BLOCK_L)
    ok = j < l1
    kv = tl.load(kv_ptr + b * skv_b + j[:, None].to(tl.int64) * skv_l + d[None, :], mask=ok[:, None], other=0.0)
    kp = tl.load(kvpos_ptr + b * skp_b + j.to(tl.int64) * skp_l, mask=ok, other=0)
    s = tl.dot(q, tl.trans(kv))
    delta = qp - kp
    visible = ok & (delta >= 0) & (delta < window)
    s = tl.where(visible[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    den = den * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
    return m_new, den, acc


@triton.jit
def _window_attention_kernel(q_ptr, kv_ptr, qpos_ptr, kvpos_ptr, sink_ptr, out_ptr, acc_ptr, m_ptr, den_ptr,
                             ticket_ptr, L, keys_per_program, window, scale, H,
                             sq_b, sq_h, skv_b, skv_l, sqp_b, skp_b, skp_l, so_b, so_h,
                             D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, STEPS: tl.constexpr,
                             NSPLIT: tl.constexpr, TICKET: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + h[:, None].to(tl.int64) * sq_h + d[None, :])
    qp = tl.load(qpos_ptr + b * sqp_b)
    m = tl.full([BLOCK_H], -1e30, dtype=tl.float32)  # finite: a fully masked block leaves alpha = 1, p = 0
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    l0 = split * keys_per_program
    l1 = tl.minimum(l0 + keys_per_program, L)
    if STEPS > 0:  # a split's few steps unrolled: q and the keys die after their last use (fewer registers)
        for i in tl.static_range(STEPS):
            m, den, acc = _step(q, kv_ptr, kvpos_ptr, qp, b, l0 + i * BLOCK_L, l1, window, scale, skv_b, skv_l,
                                skp_b, skp_l, m, den, acc, d, BLOCK_L)
    else:
        for l in range(l0, l1, BLOCK_L):
            m, den, acc = _step(q, kv_ptr, kvpos_ptr, qp, b, l, l1, window, scale, skv_b, skv_l, skp_b, skp_l,
                                m, den, acc, d, BLOCK_L)
    if NSPLIT == 1:
        sink = tl.load(sink_ptr + h).to(tl.float32)
        m_fin = tl.maximum(m, sink)
        alpha = tl.exp(m - m_fin)
        den = den * alpha + tl.exp(sink - m_fin)
        out = acc * (alpha / den)[:, None]
        tl.store(out_ptr + b * so_b + h[:, None].to(tl.int64) * so_h + d[None, :], out.to(out_ptr.dtype.element_ty))
    else:
        row = (b * NSPLIT + split) * H + h  # workspace: statistics [B, NSPLIT, H], accumulators [B, NSPLIT, H, D]
        tl.store(m_ptr + row, m)
        tl.store(den_ptr + row, den)
        tl.store(acc_ptr + row[:, None].to(tl.int64) * D + d[None, :], acc)
        if TICKET:
            tl.debug_barrier()  # every thread's partial stores precede the ticket (released by it)
            ticket = ticket_ptr + b * tl.num_programs(1) + hb
            if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == NSPLIT - 1:  # the last of the splits
                tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # clean for the next call / replay
                _combine(acc_ptr, m_ptr, den_ptr, sink_ptr, out_ptr, b, h, d, H, so_b, so_h, D, BLOCK_H, NSPLIT)


@triton.jit
def _combine_kernel(acc_ptr, m_ptr, den_ptr, sink_ptr, out_ptr, H, so_b, so_h,
                    D: tl.constexpr, BLOCK_H: tl.constexpr, NSPLIT: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _combine(acc_ptr, m_ptr, den_ptr, sink_ptr, out_ptr, b, h, tl.arange(0, D), H, so_b, so_h, D, BLOCK_H, NSPLIT)


def kernel_takes(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """One query row per sequence, 16-bit activations, heads a multiple of BLOCK_H, a power-of-two head dim."""
    d = q.shape[-1]
    return (q.shape[1] == 1 and q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype
            and q.shape[2] % BLOCK_H == 0 and d >= 16 and d & (d - 1) == 0 and d <= 1024
            and q.stride(-1) == 1 and kv.stride(-1) == 1)


def window_attention_triton(q, kv, q_positions, kv_positions, sinks, window: int, scale: float,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel on ``kernel_takes`` inputs (``out``: tests poison it to check every element is written)."""
    b, _, h, d = q.shape
    length = kv.shape[1]
    kpp, block_l, num_warps = pick_config(b, h, length, d)
    nsplit = triton.cdiv(length, kpp) if kpp else 1
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    n_hb = h // BLOCK_H
    ticket = None
    acc = m = den = out  # unused without a split
    if nsplit > 1:
        ws = torch.empty(b * nsplit * h * (d + 2), dtype=torch.float32, device=q.device)  # one allocation
        acc = ws[: b * nsplit * h * d]
        m, den = ws[b * nsplit * h * d:].view(2, -1)
        ticket = persistent_zeros("window_attention_tickets", q.device, max(b * n_hb, _TICKETS_MIN), torch.int32)
    _window_attention_kernel[(b, n_hb, nsplit)](
        q, kv, q_positions, kv_positions, sinks, out, acc, m, den, ticket if ticket is not None else out,
        length, kpp or length, int(window), float(scale), h,
        q.stride(0), q.stride(2), kv.stride(0), kv.stride(1), q_positions.stride(0),
        kv_positions.stride(0), kv_positions.stride(1), out.stride(0), out.stride(2),
        D=d, BLOCK_H=BLOCK_H, BLOCK_L=block_l, STEPS=kpp // block_l, NSPLIT=nsplit, TICKET=ticket is not None,
        num_warps=num_warps, num_stages=2, **pdl.launch_args(q.device),
    )
    if nsplit > 1 and ticket is None:  # captured before the tickets existed: combine in a second launch
        _combine_kernel[(b, n_hb)](acc, m, den, sinks, out, h, out.stride(0), out.stride(2),
                                   D=d, BLOCK_H=BLOCK_H, NSPLIT=nsplit, num_warps=num_warps,
                                   **pdl.launch_args(q.device))
    return out


@window_attention.register_kernel("cuda")
def _window_attention_cuda(q, kv, q_positions, kv_positions, sinks, window, scale):
    check_window_attention_inputs(q, kv, q_positions, kv_positions, sinks)
    if not kernel_takes(q, kv):
        return sliding_window_attention_reference(q, kv, q_positions, kv_positions, sinks, window, scale)
    with torch.cuda.device(q.device):  # Triton launches on the current device
        return window_attention_triton(q, kv, q_positions, kv_positions, sinks, window, scale)
