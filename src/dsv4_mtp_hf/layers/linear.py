"""Dense projections: ``nn.Linear`` modules, run through ``dsv4_mtp::skinny_linear`` on CUDA for a
decode step's few rows (design §8; ``ops/skinny_linear.py``).

:func:`project` takes the bias-free projections that read the same input.  :class:`FP8BlockLinear` modules
(a release's FP8 projections as ``target_runtime/fp8_linears.py`` keeps them) run two to a
``dsv4_mtp::fp8_linear_cat``; other modules that are not plain ``nn.Linear`` (hooks, adapters, other quantised
layers) are called as they are.  The plain ones on CPU, for dtypes other than bf16, under autograd or for more
than ``MAX_ROWS`` rows run ``F.linear`` on their weight -- the reference path, unchanged.  Otherwise
they run two to a kernel launch and the result is split per module (each output element is the same
dot product either way).
"""

from __future__ import annotations

import torch
from torch import nn

from ..fp8 import decode_block_scale
from ..ops.fp8_linear import fp8_linear, fp8_linear_cat
from ..ops.skinny_linear import grouped_linear, linear_weights, skinny_linear_sum, use_skinny


def unhooked(m: nn.Module) -> bool:
    """No forward hooks and no per-instance ``forward`` (accelerate's offload hooks replace it):
    calling the module's math directly skips nothing."""
    return not m._forward_hooks and not m._forward_pre_hooks and "forward" not in vars(m)


def plain_linear(m: nn.Module) -> bool:
    """An unhooked bias-free ``nn.Linear`` (not an adapter or quantised layer): its weight is all it computes."""
    return type(m) is nn.Linear and m.bias is None and unhooked(m)


class FP8BlockLinear(nn.Module):
    """A bias-free projection whose weight stays FP8 e4m3 with one float32 scale per 128x128 block, run by
    ``dsv4_mtp::fp8_linear``.  ``groups > 1``: transformers' ``DeepseekV4GroupedLinear`` (``o_a_proj``),
    ``[..., G, K] -> [..., G, N/G]``."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, groups: int = 1):
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise TypeError(f"FP8BlockLinear needs a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale_inv", decode_block_scale(scale).to(weight.device))
        self.groups = groups
        self.out_features, self.in_features = weight.shape[0], weight.shape[1] * groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.groups == 1:
            return fp8_linear(x, self.weight, self.weight_scale_inv)
        flat = fp8_linear(x.flatten(-2), self.weight, self.weight_scale_inv, self.groups)
        return flat.view(*x.shape[:-2], self.groups, -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, groups={self.groups}, fp8 e4m3"


def fp8_block(m: nn.Module) -> bool:
    """An unhooked, ungrouped :class:`FP8BlockLinear` (its FP8 weight and block scales are all it computes; other
    FP8 modules, e.g. transformers' W8A8 ``FP8Linear``, are called as they are)."""
    return type(m) is FP8BlockLinear and m.groups == 1 and unhooked(m)


def skinny_ready(x: torch.Tensor, *linears: nn.Module) -> bool:
    """Whether :func:`project` takes the fused CUDA path for ``x`` and ``linears``."""
    return len(linears) <= 2 and all(plain_linear(m) for m in linears) and use_skinny(x, *(m.weight for m in linears))


def project(x: torch.Tensor, *linears: nn.Module) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``linear(x)`` for each module (a tuple when several, the tensor when one): the plain ones together
    (:func:`~dsv4_mtp_hf.ops.skinny_linear.linear_weights`), the FP8 block ones two to a launch, the others
    each called."""
    out = [None] * len(linears)
    plain = [i for i, m in enumerate(linears) if plain_linear(m)]
    if plain:
        ys = linear_weights(x, *(linears[i].weight for i in plain))
        for i, y in zip(plain, ys if len(plain) > 1 else (ys,)):
            out[i] = y
    fp8 = [i for i, m in enumerate(linears) if fp8_block(m)]
    for pair in (fp8[j : j + 2] for j in range(0, len(fp8) - 1, 2)):  # a last odd one is called below
        mods = [linears[i] for i in pair]
        ys = fp8_linear_cat(x, [m.weight for m in mods], [m.weight_scale_inv for m in mods])
        for i, y in zip(pair, ys):
            out[i] = y
    out = tuple(m(x) if y is None else y for m, y in zip(linears, out))
    return out[0] if len(out) == 1 else out


def project_grouped(x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """V4's grouped output projection ``o_a`` on ``x [..., G, K]`` -> ``[..., G * N]``: group g's rows of the
    weight read ``x[..., g, :]``.  A plain bias-free ``nn.Linear`` with ``n_groups`` (transformers'
    ``DeepseekV4GroupedLinear``) runs :func:`~dsv4_mtp_hf.ops.skinny_linear.grouped_linear` on its weight;
    other modules (ours, FP8) are called, a ``[..., G, N]`` result flattened."""
    groups = getattr(linear, "n_groups", None)
    if groups and isinstance(linear, nn.Linear) and linear.bias is None and unhooked(linear):
        return grouped_linear(x, linear.weight, groups)
    out = linear(x)
    return out.flatten(-2) if out.dim() == x.dim() else out


def project_sum(x0: torch.Tensor, m0: nn.Module, x1: torch.Tensor, m1: nn.Module) -> torch.Tensor:
    """``m0(x0) + m1(x1)`` broadcast over ``x0``'s second-to-last axis (``x0 [..., R, K0]``,
    ``x1 [..., K1]``): one launch on CUDA (``dsv4_mtp::skinny_linear_sum``, one fp32 accumulator,
    rounded once), the two modules and an add otherwise."""
    if skinny_ready(x0, m0) and skinny_ready(x1, m1) and m0.out_features == m1.out_features:
        return skinny_linear_sum(x0, m0.weight, x1, m1.weight)
    return m0(x0) + m1(x1).unsqueeze(-2)
