"""The target's dense projections kept in FP8 as the release stores them (issue 49).

A native DeepSeek-V4 release stores the target's attention projections (``q_a/q_b/kv/o_a/o_b``), the indexer's
query projection and the shared expert as FP8 e4m3 with one E8M0 scale per 128x128 block.
On a CUDA GPU transformers loads them as its ``FP8Linear`` / ``FP8GroupedLinear`` (W8A8: the activations are
quantised per token on every call, by kernels fetched from the Hub); on a CPU, or with
``FineGrainedFP8Config(dequantize=True)``, it widens them to bf16 (twice the bytes a decode step reads).

:class:`~dsv4_mtp_hf.layers.linear.FP8BlockLinear` (a layer: ``layers/linear.py``) keeps the FP8 weight and its
scales and runs ``dsv4_mtp::fp8_linear`` (W8A16: the dequantised bf16 model's math at half its weight bytes).  :func:`keep_fp8_linears` swaps transformers' FP8
modules for it (same tensors, no copy); :func:`quantize_fp8_linears` makes it from a bf16 model's linears
with DeepSeek's recipe (for a BF16 conversion, or random benchmark weights).  ``pack_fp4_experts`` and
``DeepseekV4PackedExpertsForCausalLM`` call :func:`keep_fp8_linears` themselves.
"""

from __future__ import annotations

import torch
from torch import nn

from ..fp8 import FP8_BLOCK, quantize_fp8_block
from ..layers.linear import FP8BlockLinear

# The projections a V4 release stores in FP8 (module names end so); the rest stay as loaded: the compressors'
# and the indexer's other projections (BF16 in the release, as transformers' `_keep_in_fp32_modules` notes),
# the router, norms, embedding and lm head.
FP8_PROJECTIONS = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_a_proj",
                   "self_attn.o_b_proj", "indexer.q_b_proj", "shared_experts.gate_proj", "shared_experts.up_proj",
                   "shared_experts.down_proj")


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _transformers_fp8_class():
    try:
        from transformers.integrations.finegrained_fp8 import FP8Linear
    except ImportError:  # a transformers without the FineGrainedFP8 integration has none to swap
        return None
    return FP8Linear


@torch.no_grad()
def keep_fp8_linears(model: nn.Module) -> list[str]:
    """Swap every transformers ``FP8Linear`` / ``FP8GroupedLinear`` of ``model`` that holds FP8 weights for an
    :class:`FP8BlockLinear` on the same tensors; returns the swapped names.  Idempotent.  Raises for a module
    the op does not define (a bias, a per-tensor scale, a block other than 128x128) rather than run it
    differently from what was loaded."""
    fp8_class = _transformers_fp8_class()
    if fp8_class is None:
        return []
    swapped = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, fp8_class) or module.weight.element_size() > 1:
            continue  # not transformers' FP8 module, or one whose weight was left unquantised
        block = tuple(module.block_size or ())
        if block != (FP8_BLOCK, FP8_BLOCK) or getattr(module, "bias", None) is not None:
            raise ValueError(f"{name}: an FP8 projection with block {block or 'per tensor'} and "
                             f"bias={getattr(module, 'bias', None) is not None}; the packed target runs DeepSeek's "
                             f"{FP8_BLOCK}x{FP8_BLOCK} bias-free blocks only. Load with "
                             "FineGrainedFP8Config(dequantize=True) to run it in bf16.")
        _set(model, name, FP8BlockLinear(module.weight.data, module.weight_scale_inv.data,
                                         getattr(module, "n_groups", 1)))
        swapped.append(name)
    return swapped


@torch.no_grad()
def quantize_fp8_linears(model: nn.Module, projections: tuple[str, ...] = FP8_PROJECTIONS) -> list[str]:
    """Store the projections a release keeps in FP8 (``projections``, matched at the end of module names) as
    :class:`FP8BlockLinear`, quantised with DeepSeek's recipe (E8M0 128x128 blocks), freeing the wider weights;
    returns the names.  For a model loaded from a BF16 conversion; a native release's FP8 bytes are better kept
    as stored (:func:`keep_fp8_linears`)."""
    done = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not name.endswith(projections):
            continue
        if module.bias is not None:
            raise ValueError(f"{name} has a bias; DeepSeek-V4's projections have none.")
        weight, scale = quantize_fp8_block(module.weight.data.float())
        _set(model, name, FP8BlockLinear(weight, scale, getattr(module, "n_groups", 1)))
        done.append(name)
    return done


def fp8_linear_bytes(model: nn.Module) -> int:
    """The FP8 projections' weight and scale bytes."""
    return sum(m.weight.nbytes + m.weight_scale_inv.nbytes for m in model.modules() if isinstance(m, FP8BlockLinear))
