"""``dsv4_mtp::fp4_moe`` -- the routed-expert half of the V4 MoE on packed FP4 weights.

For T tokens, each with top-k expert ids and routing weights::

    out[t] = sum_j  w2[e_j] @ ( r_j * silu(min(w1[e_j] x_t, L)) * clamp(w3[e_j] x_t, -L, L) )

with ``w1``/``w3`` stacked as ``w13 [E, 2I, D/2]`` (gate rows first, then up rows) and
``w2 [E, D, I/2]``, codes packed two per byte, scales as raw bytes (``fp4.py``).
NVFP4 carries an fp32 global scale per matrix: ``w13_global [E, 2]`` (w1, w3) and
``w2_global [E]``; MXFP4 passes ones.

This file holds the reference implementation (the source of truth, registered for
CPU and used as the fallback on any device).  Fast kernels register behind the same
op for CUDA.
"""

from __future__ import annotations

import torch

from .. import fp4
from ._kernels import register_triton_kernels

LIB = "dsv4_mtp"


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """V4's SwiGLU with the asymmetric clamp, in fp32: ``silu(min(gate, L)) * clamp(up, -L, L)``
    (the gate is clipped above only).  Routed and shared experts alike."""
    return torch.nn.functional.silu(gate.float().clamp(max=limit)) * up.float().clamp(-limit, limit)


def fp4_moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_global: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global: torch.Tensor,
    fmt: str,
    swiglu_limit: float,
) -> torch.Tensor:
    """Dequantise only the experts the tokens use, then fp32 matmuls."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    inter = w2.shape[-1] * 2
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        g13 = fp4.dequantize_fp4(w13[e], w13_scale[e], fmt)
        g13[:inter] *= w13_global[e, 0]
        g13[inter:] *= w13_global[e, 1]
        gate_up = xf[tok] @ g13.t()
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        act = clamped_swiglu(gate, up, swiglu_limit)
        act = act * topk_weights[tok, slot].float().unsqueeze(-1)  # routing weight before w2
        down = fp4.dequantize_fp4(w2[e], w2_scale[e], fmt, w2_global[e])
        out.index_add_(0, tok, act @ down.t())
    return out.to(x.dtype)


def check_fp4_moe_inputs(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt):
    f = fp4.get_format(fmt)
    if x.dim() != 2:
        raise ValueError(f"fp4_moe expects x of shape [T, D], got {tuple(x.shape)}.")
    t, d = x.shape
    if w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise TypeError(f"packed expert weights must be uint8, got w13 {w13.dtype}, w2 {w2.dtype}.")
    e, two_i, half_d = w13.shape
    if half_d * 2 != d:
        raise ValueError(f"w13 {tuple(w13.shape)} expects hidden size {half_d * 2}, x has {d}.")
    if w2.shape != (e, d, two_i // 4):
        raise ValueError(f"w2 shape {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}: expected {(e, d, two_i // 4)}.")
    if w13_scale.shape != (e, two_i, d // f.group_size) or w2_scale.shape != (e, d, two_i // 2 // f.group_size):
        raise ValueError(f"{fmt} scale shapes {tuple(w13_scale.shape)}, {tuple(w2_scale.shape)} do not match the weights.")
    if w13_global.shape != (e, 2) or w2_global.shape != (e,):
        raise ValueError(f"global scales must be [E, 2] and [E], got {tuple(w13_global.shape)}, {tuple(w2_global.shape)}.")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must hold integer expert ids (int32 or int64), got {topk_ids.dtype}.")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} must both be [T={t}, k].")


@torch.library.custom_op(f"{LIB}::fp4_moe", mutates_args=())
def fp4_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_global: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global: torch.Tensor,
    fmt: str,
    swiglu_limit: float,
) -> torch.Tensor:
    """Fallback registration (any device without a faster kernel): the reference math."""
    return fp4_moe_reference(
        x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit
    )


@fp4_moe.register_fake
def _(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit):
    return torch.empty_like(x)


def register_cuda_kernels() -> bool:
    """Register the Triton kernels behind ``dsv4_mtp::fp4_moe`` (on import when CUDA is present)."""
    return register_triton_kernels("fp4_moe_triton", "dsv4_mtp::fp4_moe")


# Which (hidden, intermediate) sizes the CUDA kernels tile, told by their registration (the others run the reference).
_kernel_sizes = None


def register_kernel_sizes(supports) -> None:
    """Called by the CUDA registration with its ``supports(hidden, intermediate) -> bool``."""
    global _kernel_sizes
    _kernel_sizes = supports


def graph_capturable(hidden: int, intermediate: int, device: torch.device) -> bool:
    """Whether ``dsv4_mtp::fp4_moe`` runs a host-sync-free kernel for these sizes on ``device`` (what a CUDA graph
    can capture); the reference math synchronises with the host.  Asked by callers that choose to capture."""
    if device.type != "cuda" or not register_cuda_kernels():
        return False
    return _kernel_sizes is not None and _kernel_sizes(hidden, intermediate)


if torch.cuda.is_available():
    register_cuda_kernels()
