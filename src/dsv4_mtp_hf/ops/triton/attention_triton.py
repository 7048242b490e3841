"""Triton kernel behind ``dsv4_mtp::window_attention`` for one query row per sequence (a draft step).

Grid ``(B, H / BLOCK_H)``: a program holds ``BLOCK_H`` query heads ``[BLOCK_H, d]`` of one
sequence and walks its keys in blocks of ``BLOCK_L``: bf16 scores by MMA (fp32 accumulation,
as the reference's fp32 products of bf16 values), the window mask from the positions, an
online softmax in fp32, and ``p @ kv`` with the probabilities rounded to bf16 (fp32
accumulation) -- the only rounding the reference does not have, ~2**-9 per probability.
The sink joins the denominator at the end.  The keys are loaded once per block and serve as
values too (shared KV).  Fixed grid per shape, no host sync: CUDA-graph safe.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..attention import check_window_attention_inputs, sliding_window_attention_reference, window_attention

BLOCK_H = 16  # query heads per program (the MMA's M)
BLOCK_L = 32  # keys per step
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # CPU debugging / tests: fp32 dots


@triton.jit
def _window_attention_kernel(q_ptr, kv_ptr, qpos_ptr, kvpos_ptr, sink_ptr, out_ptr, L, window, scale,
                             sq_b, sq_h, skv_b, skv_l, sqp_b, skp_b, skp_l, so_b, so_h,
                             D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, FP32: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + h[:, None].to(tl.int64) * sq_h + d[None, :])
    qp = tl.load(qpos_ptr + b * sqp_b)
    m = tl.full([BLOCK_H], -1e30, dtype=tl.float32)  # finite: a fully masked block leaves alpha = 1
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    l0 = 0
    while l0 < L:  # (a runtime-bounded ``for`` does not run under the CPU interpreter)
        j = l0 + tl.arange(0, BLOCK_L)
        ok = j < L
        kv = tl.load(kv_ptr + b * skv_b + j[:, None].to(tl.int64) * skv_l + d[None, :], mask=ok[:, None], other=0.0)
        kp = tl.load(kvpos_ptr + b * skp_b + j.to(tl.int64) * skp_l, mask=ok, other=0)
        if FP32:  # the CPU interpreter: its dot misreads bf16 operands
            s = tl.dot(q.to(tl.float32), tl.trans(kv.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kv))
        delta = qp - kp
        visible = ok & (delta >= 0) & (delta < window)
        s = tl.where(visible[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        if FP32:
            acc = acc * alpha[:, None] + tl.dot(p, kv.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
        m = m_new
        l0 += BLOCK_L
    sink = tl.load(sink_ptr + h).to(tl.float32)
    m_fin = tl.maximum(m, sink)
    alpha = tl.exp(m - m_fin)
    den = den * alpha + tl.exp(sink - m_fin)
    out = acc * (alpha / den)[:, None]
    tl.store(out_ptr + b * so_b + h[:, None].to(tl.int64) * so_h + d[None, :], out.to(out_ptr.dtype.element_ty))


def kernel_takes(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """One query row per sequence, 16-bit activations, heads a multiple of BLOCK_H, a power-of-two head dim."""
    d = q.shape[-1]
    return (q.shape[1] == 1 and q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype
            and q.shape[2] % BLOCK_H == 0 and d >= 16 and d & (d - 1) == 0 and d <= 1024
            and q.stride(-1) == 1 and kv.stride(-1) == 1)


def window_attention_triton(q, kv, q_positions, kv_positions, sinks, window: int, scale: float,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    b, _, h, d = q.shape
    if out is None:
        out = torch.empty_like(q)
    _window_attention_kernel[(b, h // BLOCK_H)](
        q, kv, q_positions, kv_positions, sinks, out, kv.shape[1], int(window), float(scale),
        q.stride(0), q.stride(2), kv.stride(0), kv.stride(1), q_positions.stride(0),
        kv_positions.stride(0), kv_positions.stride(1), out.stride(0), out.stride(2),
        D=d, BLOCK_H=BLOCK_H, BLOCK_L=BLOCK_L, FP32=_INTERPRET, num_warps=4, num_stages=2,
    )
    return out


@window_attention.register_kernel("cuda")
def _window_attention_cuda(q, kv, q_positions, kv_positions, sinks, window, scale):
    check_window_attention_inputs(q, kv, q_positions, kv_positions, sinks)
    if not kernel_takes(q, kv):
        return sliding_window_attention_reference(q, kv, q_positions, kv_positions, sinks, window, scale)
    with torch.cuda.device(q.device):  # Triton launches on the current device
        return window_attention_triton(q, kv, q_positions, kv_positions, sinks, window, scale)
