"""Triton kernel behind ``dsv4_mtp::clamped_swiglu`` on CUDA: one launch for V4's clamped SwiGLU
of a few rows (the shared expert's, between its gate/up and down projections), where PyTorch
takes seven elementwise kernels (float casts, two clamps, silu, multiply, cast back)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..mtp_moe import clamped_swiglu_op
from . import pdl
from .pdl import wait

BLOCK = 1024


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, I, stride_row, LIMIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    gate = tl.load(gu_ptr + row * stride_row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_row + I + cols, mask=ok, other=0.0).to(tl.float32)
    # as torch.clamp: a NaN stays NaN
    gate = tl.minimum(gate, LIMIT, propagate_nan=tl.PropagateNan.ALL)
    up = tl.minimum(tl.maximum(up, -LIMIT, propagate_nan=tl.PropagateNan.ALL), LIMIT, propagate_nan=tl.PropagateNan.ALL)
    act = gate * tl.sigmoid(gate) * up  # silu(min(gate, L)) * clamp(up, -L, L), fp32
    tl.store(out_ptr + row * I + cols, act.to(out_ptr.dtype.element_ty), mask=ok)


@clamped_swiglu_op.register_kernel("cuda")
def _clamped_swiglu_cuda(gate_up, limit):
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"clamped_swiglu needs gate and up halves of one width, got {two_i} columns.")
    i = two_i // 2
    rows = gate_up.reshape(-1, two_i)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], i, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and i:
        with torch.cuda.device(gate_up.device):
            _swiglu_kernel[(rows.shape[0], triton.cdiv(i, BLOCK))](rows, out, i, rows.stride(0), LIMIT=float(limit),
                                                                   BLOCK=BLOCK, num_warps=4,
                                                                   **pdl.launch_args(gate_up.device))
    return out.view(*gate_up.shape[:-1], i)
