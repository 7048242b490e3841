"""``dsv4_mtp::moe_route`` -- the MTP MoE's score routing (design §2).

``s = sqrt(softplus(W_g h))`` in fp32, top-k of ``s + bias`` (the bias only selects), weights =
``s`` at the chosen experts, renormalised, times the routed scaling factor.  As PyTorch ops
that is a weight cast, an fp32 GEMM, a softplus/sqrt kernel and a two-kernel ``topk`` --
about 20 us and five graph nodes per draft step at batch 1.  The CUDA registration
(``ops/triton/moe_route_triton.py``) reads the bf16 gate once and selects in registers, in
one launch.  The reference below is the source of truth (CPU, autograd).

``dsv4_mtp::hash_route`` is the target's first layers' routing (``mlp_layer_types == "hash_moe"``,
transformers' ``DeepseekV4HashRouter``): the experts are a frozen table's row for the token id, the
weights the same fp32 scores at those experts, renormalised and scaled.  Its CUDA registration is
``moe_route``'s scores kernel with the table's experts in place of the top-k; under ``torch.compile`` its
reference is traced (:func:`hash_route`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._kernels import register_triton_kernels

LIB = "dsv4_mtp"


def moe_route_reference(h, weight, bias, top_k: int, scaling: float, normalize: bool):
    """h ``[T, D]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]`` int64)."""
    scores = F.softplus(F.linear(h.float(), weight.float())).sqrt()
    ids = torch.topk(scores + bias.float(), top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scaling, ids


@torch.library.custom_op(f"{LIB}::moe_route", mutates_args=())
def moe_route_op(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                 normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fallback registration (any device without a faster kernel): the reference math."""
    return moe_route_reference(h, weight, bias, top_k, scaling, normalize)


@moe_route_op.register_fake
def _(h, weight, bias, top_k, scaling, normalize):
    t = h.shape[0]
    return h.new_empty(t, top_k, dtype=torch.float32), h.new_empty(t, top_k, dtype=torch.long)


def moe_route(h, weight, bias, top_k: int, scaling: float, normalize: bool):
    """CUDA tensors outside autograd go through the op (the fused kernels when registered)."""
    if h.is_cuda and h.dim() == 2 and not (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)):
        return moe_route_op(h.contiguous(), weight, bias, top_k, scaling, normalize)
    return moe_route_reference(h, weight, bias, top_k, scaling, normalize)


def hash_route_reference(h, weight, tid2eid, input_ids, scaling: float):
    """h ``[T, D]``, ``tid2eid [V, k]``, ``input_ids [T]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]`` int64)."""
    scores = F.softplus(F.linear(h.float(), weight.float())).sqrt()
    ids = tid2eid[input_ids].long()
    weights = scores.gather(-1, ids)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling, ids


def check_hash_route_inputs(h, weight, tid2eid, input_ids):
    if h.dim() != 2 or weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(f"hash_route: h must be [T, D] and weight [E, D], got {tuple(h.shape)} and "
                         f"{tuple(weight.shape)}")
    if tid2eid.dim() != 2 or tuple(input_ids.shape) != (h.shape[0],):
        raise ValueError(f"hash_route: tid2eid must be [V, k] and input_ids [T={h.shape[0]}], got "
                         f"{tuple(tid2eid.shape)} and {tuple(input_ids.shape)}")


@torch.library.custom_op(f"{LIB}::hash_route", mutates_args=())
def hash_route_op(h: torch.Tensor, weight: torch.Tensor, tid2eid: torch.Tensor, input_ids: torch.Tensor,
                  scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Registration for every device without a faster kernel: the reference math."""
    check_hash_route_inputs(h, weight, tid2eid, input_ids)
    return hash_route_reference(h, weight, tid2eid, input_ids, scaling)


@hash_route_op.register_fake
def _(h, weight, tid2eid, input_ids, scaling):
    check_hash_route_inputs(h, weight, tid2eid, input_ids)
    t, k = h.shape[0], tid2eid.shape[1]
    return h.new_empty(t, k, dtype=torch.float32), h.new_empty(t, k, dtype=torch.long)


def hash_route(h, weight, tid2eid, input_ids, scaling: float):
    """Hash routing (module docstring).  The op outside autograd; under ``torch.compile`` (and under autograd) the
    reference itself."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)):
        return hash_route_reference(h, weight, tid2eid, input_ids, scaling)
    return hash_route_op(h, weight, tid2eid, input_ids, scaling)


def register_cuda_kernels() -> bool:
    """Register the Triton kernels behind ``dsv4_mtp::moe_route`` (on import when CUDA is present)."""
    return register_triton_kernels("moe_route_triton", "dsv4_mtp::moe_route/hash_route")

if torch.cuda.is_available():
    register_cuda_kernels()
