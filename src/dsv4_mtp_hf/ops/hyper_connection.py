"""``dsv4_mtp::hc_pre``, ``hc_post_pre`` and ``hc_head`` -- the mHC stream collapses (design §2).

Per token, ``hc_pre`` is: an RMS factor of the flattened streams, 24 mixes (a
``[24, n*D]`` fp32 GEMV), sigmoids for ``pre``/``post``, a 4x4 Sinkhorn for ``comb`` and
the collapse ``y = sum_j pre_j x_j``; ``hc_head`` is the same without Sinkhorn and post.
``hc_post_pre`` is the previous sub-block's ``hc_post`` (the streams mixed by ``comb`` plus ``post`` times
its output) followed by ``hc_pre`` of the mixed streams: inside a layer the attention's ``hc_post`` and the
MoE's ``hc_pre``, one op that writes the new streams as its GEMV reads them.
As PyTorch ops (even compiled) that is a GEMV, a reduction, a Sinkhorn launch and a
collapse per call; the CUDA registration (``ops/triton/hyper_connection_triton.py``) does
it in two kernels.  The reference below is the source of truth (CPU, autograd).
"""

from __future__ import annotations

import torch

from ._kernels import register_triton_kernels
from .sinkhorn import sinkhorn, sinkhorn_reference

LIB = "dsv4_mtp"


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """``(fn @ flatten(x)) * rsqrt(mean(flatten(x)^2) + eps)`` -> ``[..., fn.shape[0]]`` fp32."""
    xf = x.flatten(-2).float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + rms_eps)
    return (xf @ fn.float().t()) * r


def hc_weights(x, fn, base, scale, iters: int, hc_eps: float, rms_eps: float, comb_fn=sinkhorn):
    """-> ``pre [..., n]``, ``post [..., n]``, ``comb [..., n, n]`` (fp32)."""
    n = x.shape[-2]
    m = hc_mixes(x, fn, rms_eps)
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(m[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = (m[..., 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n))
    return pre, post, comb_fn(comb_logits, iters, hc_eps)


def collapse(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``sum_j w_j x_j`` in fp32, returned in ``x``'s dtype."""
    return (weights.unsqueeze(-1) * x.float()).sum(dim=-2).to(x.dtype)


def hc_post(branch_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``x'_k = post_k * o + sum_j comb[j, k] * x_j`` (sum over the FIRST index) in fp32, in the streams' dtype."""
    xs, out = streams.float(), post.unsqueeze(-1) * branch_out.float().unsqueeze(-2)
    if torch.compiler.is_compiling():  # n multiply-adds: Inductor fuses them into one kernel (a bmm it would not)
        for j in range(streams.shape[-2]):
            out = out + comb[..., j, :].unsqueeze(-1) * xs[..., j : j + 1, :]
        return out.to(streams.dtype)
    return (out + torch.einsum("...jk,...jd->...kd", comb, xs)).to(streams.dtype)


def hc_pre_reference(x, fn, base, scale, iters: int, hc_eps: float, rms_eps: float):
    """``x [..., n, D]`` -> (block input ``[..., D]`` in x's dtype, post, comb)."""
    pre, post, comb = hc_weights(x, fn, base, scale, iters, hc_eps, rms_eps, comb_fn=sinkhorn_reference)
    return collapse(pre, x), post, comb


def hc_post_pre_reference(branch_out, streams, post, comb, fn, base, scale, iters: int, hc_eps: float,
                          rms_eps: float):
    """-> (``hc_post``'s streams, then ``hc_pre`` of them: block input, post, comb)."""
    mixed = hc_post(branch_out, streams, post, comb)
    return (mixed, *hc_pre_reference(mixed, fn, base, scale, iters, hc_eps, rms_eps))


def hc_head_reference(x, fn, base, scale, hc_eps: float, rms_eps: float):
    """``w_j = sigmoid(m_j * scale + base_j) + eps``; ``sum_j w_j x_j``.  No Sinkhorn, no post."""
    m = hc_mixes(x, fn, rms_eps)
    w = torch.sigmoid(m * scale.float() + base.float()) + hc_eps
    return collapse(w, x)


@torch.library.custom_op(f"{LIB}::hc_pre", mutates_args=())
def hc_pre_op(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
              hc_eps: float, rms_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fallback registration (any device without a faster kernel): the reference math."""
    y, post, comb = hc_pre_reference(x, fn, base, scale, iters, hc_eps, rms_eps)
    return y, post.float(), comb.float()


@hc_pre_op.register_fake
def _(x, fn, base, scale, iters, hc_eps, rms_eps):
    n = x.shape[-2]
    lead = x.shape[:-2]
    return (x.new_empty(*lead, x.shape[-1]), x.new_empty(*lead, n, dtype=torch.float32),
            x.new_empty(*lead, n, n, dtype=torch.float32))


def _check_post_pre(branch_out, streams, post, comb):
    n, d = streams.shape[-2:]
    lead = streams.shape[:-2]
    if branch_out.shape != (*lead, d) or post.shape != (*lead, n) or comb.shape != (*lead, n, n):
        raise ValueError(f"hc_post_pre: branch_out [..., D], streams [..., n, D], post [..., n] and comb [..., n, n] "
                         f"must share their leading dims, got {tuple(branch_out.shape)}, {tuple(streams.shape)}, "
                         f"{tuple(post.shape)}, {tuple(comb.shape)}")


@torch.library.custom_op(f"{LIB}::hc_post_pre", mutates_args=())
def hc_post_pre_op(branch_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                   fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
                   rms_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fallback registration: the reference math."""
    _check_post_pre(branch_out, streams, post, comb)
    mixed, y, post2, comb2 = hc_post_pre_reference(branch_out, streams, post, comb, fn, base, scale, iters, hc_eps,
                                                   rms_eps)
    return mixed, y, post2.float(), comb2.float()


@hc_post_pre_op.register_fake
def _(branch_out, streams, post, comb, fn, base, scale, iters, hc_eps, rms_eps):
    _check_post_pre(branch_out, streams, post, comb)
    n = streams.shape[-2]
    lead = streams.shape[:-2]
    return (torch.empty_like(streams), branch_out.new_empty(*lead, streams.shape[-1], dtype=streams.dtype),
            streams.new_empty(*lead, n, dtype=torch.float32), streams.new_empty(*lead, n, n, dtype=torch.float32))


@torch.library.custom_op(f"{LIB}::hc_head", mutates_args=())
def hc_head_op(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
               rms_eps: float) -> torch.Tensor:
    """Fallback registration: the reference math."""
    return hc_head_reference(x, fn, base, scale, hc_eps, rms_eps)


@hc_head_op.register_fake
def _(x, fn, base, scale, hc_eps, rms_eps):
    return x.new_empty(*x.shape[:-2], x.shape[-1])


def _use_op(x: torch.Tensor, *params: torch.Tensor) -> bool:
    # The op has no autograd formula: training (and CPU, where the reference is as good) runs
    # the reference directly.
    return x.is_cuda and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params)))


def hc_pre(x, fn, base, scale, iters: int, hc_eps: float, rms_eps: float):
    """(collapsed block input ``[..., D]``, post ``[..., n]``, comb ``[..., n, n]``)."""
    if _use_op(x, fn, base, scale):
        return hc_pre_op(x.contiguous(), fn, base, scale, iters, hc_eps, rms_eps)
    pre, post, comb = hc_weights(x, fn, base, scale, iters, hc_eps, rms_eps)
    return collapse(pre, x), post, comb


def hc_post_pre(branch_out, streams, post, comb, fn, base, scale, iters: int, hc_eps: float, rms_eps: float):
    """``hc_post(branch_out, streams, post, comb)`` then ``hc_pre`` of the result -> (the mixed streams, block
    input, post, comb); one op on CUDA."""
    if _use_op(streams, branch_out, fn, base, scale):
        return hc_post_pre_op(branch_out.contiguous(), streams.contiguous(), post.contiguous(), comb.contiguous(), fn,
                              base, scale, iters, hc_eps, rms_eps)
    mixed = hc_post(branch_out, streams, post, comb)
    return (mixed, *hc_pre(mixed, fn, base, scale, iters, hc_eps, rms_eps))


def hc_head(x, fn, base, scale, hc_eps: float, rms_eps: float) -> torch.Tensor:
    if _use_op(x, fn, base, scale):
        return hc_head_op(x.contiguous(), fn, base, scale, hc_eps, rms_eps)
    return hc_head_reference(x, fn, base, scale, hc_eps, rms_eps)


def register_cuda_kernels() -> bool:
    """Register the Triton kernels behind ``dsv4_mtp::hc_pre/hc_post_pre/hc_head`` (on import when CUDA is present)."""
    return register_triton_kernels("hyper_connection_triton", "dsv4_mtp::hc_pre/hc_post_pre/hc_head")

if torch.cuda.is_available():
    register_cuda_kernels()
