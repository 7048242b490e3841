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

The target's MoE (``layers.moe.SparseMoE``) runs the same op: its first layers route by token id
(``tid2eid`` and ``input_ids`` given: ``dsv4_mtp::hash_route``, no router bias), and a release's shared
expert is FP8 (``shared_scales``: the three weights' 128x128 block scales, ``dsv4_mtp::fp8_linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._kernels import register_triton_kernels
from .fp4_moe import LIB, clamped_swiglu, fp4_moe
from .fp8_linear import fp8_linear, fp8_linear_cat_op
from .moe_route import hash_route, moe_route
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


def shared_expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float,
                  scales: list[torch.Tensor] | None = None) -> torch.Tensor:
    """V4's shared expert on bias-free weights: ``w2 (silu(min(w1 x, L)) * clamp(w3 x, -L, L))``,
    the SwiGLU in fp32 and rounded to x's dtype before ``w2`` (``layers.moe.SharedExpert``).  ``scales``:
    the FP8 weights' block scales (``w1, w3, w2``), run by ``dsv4_mtp::fp8_linear``."""
    if scales is not None:
        gate_up = fp8_linear_cat_op(x.reshape(-1, x.shape[-1]), [w1, w3], list(scales[:2])).view(*x.shape[:-1], -1)
        return fp8_linear(clamped_swiglu_op(gate_up, limit), w2, scales[2])
    if use_skinny(x, w1, w3):  # gate and up in one launch, the SwiGLU in one more
        return linear_weights(clamped_swiglu_op(skinny_linear_cat(x, [w1, w3]), limit), w2)
    return linear_weights(clamped_swiglu(F.linear(x, w1), F.linear(x, w3), limit).to(x.dtype), w2)


def _check(x, router_weight, router_bias, shared_w1, shared_w3, shared_w2, shared_scales=(None,) * 3, tid2eid=None,
           input_ids=None):
    d = x.shape[-1]
    if (tid2eid is None) != (input_ids is None) or (tid2eid is None) == (router_bias is None):
        raise ValueError("mtp_moe routes by score (router_bias, no tid2eid/input_ids) or by token id (tid2eid and "
                         "input_ids, no router_bias).")
    if len({s is None for s in shared_scales}) != 1:
        raise ValueError("mtp_moe: give the FP8 shared expert's three block scales, or none (a bf16 shared expert).")
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
            w2_scale, w2_global, fmt, swiglu_limit, tid2eid=None, input_ids=None):
    if tid2eid is not None:
        weights, ids = hash_route(x, router_weight, tid2eid, input_ids, routed_scaling)
    else:
        weights, ids = moe_route(x, router_weight, router_bias, top_k, routed_scaling, norm_topk_prob)
    return fp4_moe(x, ids, weights.float(), w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit)


def _shared_scales(s1, s3, s2):
    return None if s1 is None else [s1, s3, s2]


@torch.library.custom_op(f"{LIB}::mtp_moe", mutates_args=())
def mtp_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None,
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
    shared_w1_scale: torch.Tensor | None = None,
    shared_w3_scale: torch.Tensor | None = None,
    shared_w2_scale: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fallback registration (CPU and any device without streams): one half after the other.
    Returns ``(routed, shared)``; ``swiglu_limit`` clamps both halves (V4 has one).  ``shared_*_scale``: an FP8
    shared expert's block scales; ``tid2eid`` + ``input_ids [T]``: hash routing (``router_bias`` None)."""
    raw_scales = (shared_w1_scale, shared_w3_scale, shared_w2_scale)
    _check(x, router_weight, router_bias, shared_w1, shared_w3, shared_w2, raw_scales, tid2eid, input_ids)
    scales = _shared_scales(*raw_scales)
    routed = _routed(x, router_weight, router_bias, top_k, routed_scaling, norm_topk_prob, w13, w13_scale, w13_global,
                     w2, w2_scale, w2_global, fmt, swiglu_limit, tid2eid, input_ids)
    return routed, shared_expert(x, shared_w1, shared_w3, shared_w2, swiglu_limit, scales)


@mtp_moe.register_fake
def _(x, router_weight, router_bias, top_k, routed_scaling, norm_topk_prob, w13, w13_scale, w13_global, w2, w2_scale,
      w2_global, fmt, swiglu_limit, shared_w1, shared_w3, shared_w2, shared_w1_scale=None, shared_w3_scale=None,
      shared_w2_scale=None, tid2eid=None, input_ids=None):
    _check(x, router_weight, router_bias, shared_w1, shared_w3, shared_w2,
           (shared_w1_scale, shared_w3_scale, shared_w2_scale), tid2eid, input_ids)
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
                  w2, w2_scale, w2_global, fmt, swiglu_limit, shared_w1, shared_w3, shared_w2, shared_w1_scale=None,
                  shared_w3_scale=None, shared_w2_scale=None, tid2eid=None, input_ids=None):
    raw_scales = (shared_w1_scale, shared_w3_scale, shared_w2_scale)
    _check(x, router_weight, router_bias, shared_w1, shared_w3, shared_w2, raw_scales, tid2eid, input_ids)
    scales = _shared_scales(*raw_scales)
    routed_args = (x, router_weight, router_bias, top_k, routed_scaling, norm_topk_prob, w13, w13_scale, w13_global,
                   w2, w2_scale, w2_global, fmt, swiglu_limit, tid2eid, input_ids)
    main = torch.cuda.current_stream(x.device)
    side = _routed_stream(x.device)
    side.wait_stream(main)  # fork: x (and everything before it) is ready
    with torch.cuda.stream(side):
        routed = _routed(*routed_args)
    shared = shared_expert(x, shared_w1, shared_w3, shared_w2, swiglu_limit, scales)
    main.wait_stream(side)  # join: the caller reads both on the current stream
    routed.record_stream(main)  # allocated on the side stream, read (and freed) after the join
    return routed, shared


def register_cuda_kernels() -> bool:
    """Register the Triton kernel behind ``dsv4_mtp::clamped_swiglu`` (on import when CUDA is present)."""
    return register_triton_kernels("swiglu_triton", "dsv4_mtp::clamped_swiglu")

if torch.cuda.is_available():
    register_cuda_kernels()
