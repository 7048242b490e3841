"""``dsv4_mtp::fp4_moe_with_shared`` -- the whole MoE after the router: routed FP4 experts and
the shared expert, overlapped on CUDA.

    routed, shared = fp4_moe(x, ids, weights, ...), shared_expert(x)      (both in x's dtype)

The caller adds them (``layers.moe.MtpMoE``): under ``torch.compile`` that add fuses into the
kernel that follows instead of costing a launch inside the opaque op.

The two halves read disjoint weights (6 routed FP4 experts, ~75 MB at V4-Flash size; the bf16
shared expert, ~50 MB) and depend only on ``x``.  At a draft step's few rows neither keeps the
H200's memory system busy alone: the routed kernels are latency-bound at ~1.5 TB/s and each
shared-expert GEMV pays its own ramp and tail (BENCHMARKS.md).  The CUDA registration runs the
shared expert on a side stream while the routed kernels run on the current one, then joins.
Inside ``torch.cuda.graph`` capture the fork and join become two parallel branches of the graph;
the op is opaque to ``torch.compile``, so the compiled draft step keeps the overlap.

The reference (CPU, and the source of truth) is the layer's sequential math; the two paths
compute the same values (the kernels are the same; only the order of launches changes).
"""

from __future__ import annotations

import torch

from .fp4_moe import LIB, clamped_swiglu, fp4_moe
from .skinny_linear import linear_weights


def shared_expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """V4's shared expert on bias-free weights: ``w2 (silu(min(w1 x, L)) * clamp(w3 x, -L, L))``,
    the SwiGLU in fp32 and rounded to x's dtype before ``w2`` (``layers.moe.SharedExpert``)."""
    gate, up = linear_weights(x, w1, w3)
    return linear_weights(clamped_swiglu(gate, up, limit).to(x.dtype), w2)


def _check(x, shared_w1, shared_w3, shared_w2):
    d = x.shape[-1]
    if shared_w1.dim() != 2 or shared_w1.shape != shared_w3.shape or shared_w2.shape != (d, shared_w1.shape[0]):
        raise ValueError(
            f"shared expert weights must be w1 [I, D], w3 [I, D], w2 [D, I] with D = {d} (x's hidden size); got "
            f"{tuple(shared_w1.shape)}, {tuple(shared_w3.shape)}, {tuple(shared_w2.shape)}."
        )
    if shared_w1.shape[1] != d:
        raise ValueError(f"shared expert w1 {tuple(shared_w1.shape)} expects hidden size {shared_w1.shape[1]}, x has {d}.")


@torch.library.custom_op(f"{LIB}::fp4_moe_with_shared", mutates_args=())
def fp4_moe_with_shared(
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
    shared_w1: torch.Tensor,
    shared_w3: torch.Tensor,
    shared_w2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fallback registration (CPU and any device without streams): one half after the other.
    ``swiglu_limit`` clamps both halves (V4 has one ``swiglu_limit``)."""
    return _sequential(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt,
                       swiglu_limit, shared_w1, shared_w3, shared_w2)


def _sequential(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit,
                shared_w1, shared_w3, shared_w2):
    _check(x, shared_w1, shared_w3, shared_w2)
    routed = fp4_moe(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit)
    return routed, shared_expert(x, shared_w1, shared_w3, shared_w2, swiglu_limit)


@fp4_moe_with_shared.register_fake
def _(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit,
      shared_w1, shared_w3, shared_w2):
    _check(x, shared_w1, shared_w3, shared_w2)
    return torch.empty_like(x), torch.empty_like(x)


# False: the CUDA registration runs the halves one after the other on the current stream (to
# measure the overlap side by side, ``benchmarks/draft_step.py --no-moe-overlap``).
use_side_stream = True
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device, created once (a stream per call would defeat graph reuse)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


@fp4_moe_with_shared.register_kernel("cuda")
def _fp4_moe_with_shared_cuda(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt,
                              swiglu_limit, shared_w1, shared_w3, shared_w2):
    if not use_side_stream:
        return _sequential(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt,
                           swiglu_limit, shared_w1, shared_w3, shared_w2)
    _check(x, shared_w1, shared_w3, shared_w2)
    main = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)
    side.wait_stream(main)  # fork: x (and everything before it) is ready
    with torch.cuda.stream(side):
        shared = shared_expert(x, shared_w1, shared_w3, shared_w2, swiglu_limit)
    routed = fp4_moe(x, topk_ids, topk_weights, w13, w13_scale, w13_global, w2, w2_scale, w2_global, fmt, swiglu_limit)
    main.wait_stream(side)  # join: the caller reads both on the current stream
    shared.record_stream(main)  # allocated on the side stream, read (and freed) after the join
    return routed, shared
