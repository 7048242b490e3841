"""Dense projections of the MTP: ``nn.Linear`` modules, run through ``dsv4_mtp::skinny_linear``
on CUDA for a draft step's few rows (design §8; ``ops/skinny_linear.py``).

:func:`project` takes one or two bias-free ``nn.Linear`` that read the same input.  Modules
that are not plain ``nn.Linear`` (hooks, adapters, quantised layers) are called as they are.
Plain ones on CPU, for dtypes other than bf16, under autograd or for more than ``MAX_ROWS`` rows
run ``F.linear`` on their weight -- the reference path, unchanged.  Otherwise the projections run
in one kernel launch and the result is split per module (each output element is the same dot
product either way).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.skinny_linear import linear_weights, skinny_linear_sum, use_skinny


def unhooked(m: nn.Module) -> bool:
    """No forward hooks and no per-instance ``forward`` (accelerate's offload hooks replace it):
    calling the module's math directly skips nothing."""
    return not m._forward_hooks and not m._forward_pre_hooks and "forward" not in vars(m)


def plain_linear(m: nn.Module) -> bool:
    """An unhooked bias-free ``nn.Linear`` (not an adapter or quantised layer): its weight is all it computes."""
    return type(m) is nn.Linear and m.bias is None and unhooked(m)


def skinny_ready(x: torch.Tensor, *linears: nn.Module) -> bool:
    """Whether :func:`project` takes the fused CUDA path for ``x`` and ``linears``."""
    return len(linears) <= 2 and all(plain_linear(m) for m in linears) and use_skinny(x, *(m.weight for m in linears))


def project(x: torch.Tensor, *linears: nn.Module) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``linear(x)`` for each module (a tuple when several, the tensor when one)."""
    if len(linears) <= 2 and all(plain_linear(m) for m in linears):
        return linear_weights(x, *(m.weight for m in linears))
    out = tuple(m(x) for m in linears)
    return out[0] if len(out) == 1 else out


def project_sum(x0: torch.Tensor, m0: nn.Module, x1: torch.Tensor, m1: nn.Module) -> torch.Tensor:
    """``m0(x0) + m1(x1)`` broadcast over ``x0``'s second-to-last axis (``x0 [..., R, K0]``,
    ``x1 [..., K1]``): one launch on CUDA (``dsv4_mtp::skinny_linear_sum``, one fp32 accumulator,
    rounded once), the two modules and an add otherwise."""
    if skinny_ready(x0, m0) and skinny_ready(x1, m1) and m0.out_features == m1.out_features:
        return skinny_linear_sum(x0, m0.weight, x1, m1.weight)
    return m0(x0) + m1(x1).unsqueeze(-2)
