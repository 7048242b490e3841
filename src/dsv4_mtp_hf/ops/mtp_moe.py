"""``dsv4_mtp::mtp_moe`` -- the MTP layer's whole MoE after its norm: the router, the routed FP4
experts and the shared expert, with the shared expert overlapped on CUDA.

    weights, ids = moe_route(x, ...)
    routed, shared = fp4_moe(x, ids, weights, ...), shared_expert(x)      (both in x's dtype)

The caller adds the halves (``layers.moe.MtpMoE``): under ``torch.compile`` that add fuses into
the kernel that follows instead of costing a launch inside the opaque op.

The shared expert depends only on ``x``; the routed experts on the router's choice.  At a
draft step's few rows neither half keeps the H200 busy alone: the routed kernels are
latency-bound at ~1.5 TB/s and each shared-expert GEMV pays its own ramp and tail
(BENCHMARKS.md).  The CUDA registration forks the router and the routed kernels onto a
high-priority side stream, runs the shared expert on the current stream meanwhile, and joins.
Inside ``torch.cuda.graph`` capture the fork and join become two parallel branches of the
graph; the op is opaque to ``torch.compile``, so the compiled draft step keeps them.
Measured (H200, batch 1, compiled and graphed): 14-20 µs off a ~0.48 ms draft step.

The reference (CPU, and the source of truth) is the layer's sequential math; the CUDA path
runs the same kernels in another order, so it computes the same values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._kernels import register_triton_kernels
from .fp4_moe import LIB, clamped_swiglu, fp4_moe
from .moe_route import moe_route
from .skinny_linear import linear_weights, skinny_linear_cat, use_skinny


@torch.library.custom_op(f"{LIB}::clamped_swiglu", mutates_args=())
def clamped_swiglu_op(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """``gate_up [..., 2I]`` (gate columns, then up) -> ``clamped_swiglu(gate, up, limit)`` rounded to
    gate_up's dtype ``[..., I]``; one launch on CUDA (``ops/triton/swiglu_triton.py``)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"clamped_swiglu needs gate and up halves of one width, got {gate_up.shape[-1]} columns.")
    gate, up = gate_up.chunk(2, dim=-1)
    return clamped_swiglu(gate, up, limit).to(gate_up.dtype)


@clamped_swiglu_op.register_fake
def _(gate_up, limit):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def shared_expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """V4's shared expert on bias-free weights: ``w2 (silu(min(w1 x, L)) * clamp(w3 x, -L, L))``,
    the SwiGLU in fp32 and rounded to x's dtype before ``w2`` (``layers.moe.SharedExpert``)."""
    if use_skinny(x, w1, w3):  # gate and up in one launch, the SwiGLU in one more
        return linear_weights(clamped_swiglu_op(skinny_linear_cat(x, [w1, w3]), limit), w2)
    return linear_weights(clamped_swiglu(F.linear(x, w1), F.linear(x, w3), limit).to(x.dtype), w2)


def _check(x, router_weight, shared_w1, shared_w3, shared_w2):
    d = x.shape[-1]
    if x.dim() != 2:
        raise ValueError(f"mtp_moe expects x of shape [T, D], got {tuple(x.shape)}.")
    if router_weight.dim() != 2 or router_weight.shape[1] != d:
        raise ValueError(f"router weight {tuple(router_weight.shape)} must be [E, D] with D = {d} (x's hidden size).")
    if shared_w1.dim() != 2 or shared_w1.shape != shared_w3.shape or shared_w2.shape != (d, shared_w1.shape[0]):
        raise ValueError(
            f"shared expert weights must be w1 [I, D], w3 [I, D], w2 [D, I] with D = {d} (x's hidden size); got "
            f"{tuple(shared_w1.shape)}, {tuple(shared_w3.shape)}, {tuple(shared_w2.shape)}."
        )
    if shared_w1.shape[1] != d:
        raise ValueError(f"shared expert w1 {tuple(shared_w1.shape)} expects hidden size {shared_w1.shape[1]}, x has {d}.")


def _routed(x, router_weight, router_bias, top_k, routed_scaling, norm_topk_prob, w13, w13_scale, w13_global, w2,
            w2_scale, w2_global, fmt, swiglu_limit):
    weights, ids = moe_route(x, router_weight, router_bias, top_k, routed_scaling, norm_topk_prob)
    return fp4_moe(x, ids, weights.float(), w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit)


@torch.library.custom_op(f"{LIB}::mtp_moe", mutates_args=())
def mtp_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor,
    top_k: int,
    routed_scaling: float,
    norm_topk_prob: bool,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_global: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global: torch.Tensor,
    fmt: str,
    swiglu_limit: float,
    shared_w1: torch.Tensor,
    shared_w3: torch.Tensor,
    shared_w2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fallback registration (CPU and any device without streams): one half after the other.
    Returns ``(routed, shared)``; ``swiglu_limit`` clamps both halves (V4 has one)."""
    _check(x, router_weight, shared_w1, shared_w3, shared_w2)
    routed = _routed(x, router_weight, router_bias, top_k, routed_scaling, norm_topk_prob, w13, w13_scale, w13_global,
                     w2, w2_scale, w2_global, fmt, swiglu_limit)
    return routed, shared_expert(x, shared_w1, shared_w3, shared_w2, swiglu_limit)


@mtp_moe.register_fake
def _(x, router_weight, router_bias, top_k, routed_scaling, norm_topk_prob, w13, w13_scale, w13_global, w2, w2_scale,
      w2_global, fmt, swiglu_limit, shared_w1, shared_w3, shared_w2):
    _check(x, router_weight, shared_w1, shared_w3, shared_w2)
    return torch.empty_like(x), torch.empty_like(x)


# The routed half (router + FP4 kernels, the critical path) runs on a high-priority side stream, the
# shared expert on the current one: when both have blocks waiting, the SMs take the routed ones first.
# torch instantiates CUDA graphs with ``cudaGraphInstantiateFlagUseNodePriority``, so a captured kernel
# keeps the priority of the stream it was captured on.
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _routed_stream(device: torch.device) -> torch.cuda.Stream:
    """The routed half's stream, created once per device."""
    if device not in _STREAMS:
        # a number below the device's range maps to its highest priority (torch.cuda.Stream)
        _STREAMS[device] = torch.cuda.Stream(device, priority=-100)
    return _STREAMS[device]


@mtp_moe.register_kernel("cuda")
def _mtp_moe_cuda(x, router_weight, router_bias, top_k, routed_scaling, norm_topk_prob, w13, w13_scale, w13_global,
                  w2, w2_scale, w2_global, fmt, swiglu_limit, shared_w1, shared_w3, shared_w2):
    _check(x, router_weight, shared_w1, shared_w3, shared_w2)
    routed_args = (x, router_weight, router_bias, top_k, routed_scaling, norm_topk_prob, w13, w13_scale, w13_global,
                   w2, w2_scale, w2_global, fmt, swiglu_limit)
    main = torch.cuda.current_stream(x.device)
    side = _routed_stream(x.device)
    side.wait_stream(main)  # fork: x (and everything before it) is ready
    with torch.cuda.stream(side):
        routed = _routed(*routed_args)
    shared = shared_expert(x, shared_w1, shared_w3, shared_w2, swiglu_limit)
    main.wait_stream(side)  # join: the caller reads both on the current stream
    routed.record_stream(main)  # allocated on the side stream, read (and freed) after the join
    return routed, shared


def register_cuda_kernels() -> bool:
    """Register the Triton kernel behind ``dsv4_mtp::clamped_swiglu`` (on import when CUDA is present)."""
    return register_triton_kernels("swiglu_triton", "dsv4_mtp::clamped_swiglu")

if torch.cuda.is_available():
    register_cuda_kernels()
