"""Norm weights in the compute dtype on every supported transformers version (issue 45).

transformers' loader keeps DeepSeek-V4's ``*norm*`` weights in fp32 (``_keep_in_fp32_modules_strict``) when it
loads a bf16/fp16 model.  From 5.18 on, ``DeepseekV4RMSNorm`` returns its input's dtype
(``(weight * x).to(input_dtype)``); 5.17's returns ``weight * x.to(input_dtype)``, fp32 under an fp32 weight,
and the next bf16 projection fails ("expected m1 and m2 to have the same dtype").  :func:`norms_to_compute_dtype`
finds the norms whose output would not come back in the model's compute dtype and casts their weights to it,
so that every norm returns the compute dtype, as 5.18+ computes.  Where the installed RMSNorm already does that
it changes nothing (the fp32 weights stay, bit for bit what transformers runs).
"""

from __future__ import annotations

import torch

# Whether an RMSNorm forward returns its input's dtype, per (class, forward, weight dtype, input dtype): probed once.
_RETURNS_INPUT_DTYPE: dict[tuple, bool] = {}


def compute_dtype(model) -> torch.dtype:
    """The dtype the model's activations run in: its input embedding's."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    if weight is None or not weight.is_floating_point():
        raise TypeError(f"{type(model).__name__} has no floating input embedding to read its compute dtype from.")
    return weight.dtype


def _is_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "_parameters", {}).get("weight")
    return type(module).__name__.endswith("RMSNorm") and weight is not None and weight.dim() == 1


@torch.no_grad()
def _returns_input_dtype(module: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``module`` (an RMSNorm) returns ``dtype`` for an input in ``dtype`` with its weight's dtype."""
    key = (type(module), type(module).forward, module.weight.dtype, dtype)
    if key not in _RETURNS_INPUT_DTYPE:
        x = torch.ones(1, module.weight.shape[0], dtype=dtype, device="meta")
        saved = module._parameters["weight"]
        try:  # probed on the meta device: no memory, no kernel, any device the weight lives on
            module._parameters["weight"] = torch.nn.Parameter(torch.empty_like(saved, device="meta"),
                                                              requires_grad=False)
            _RETURNS_INPUT_DTYPE[key] = module(x).dtype == dtype
        finally:
            module._parameters["weight"] = saved
    return _RETURNS_INPUT_DTYPE[key]


@torch.no_grad()
def norms_to_compute_dtype(model, dtype: torch.dtype | None = None) -> list[str]:
    """Cast the weight of every RMSNorm of ``model`` whose weight dtype differs from the compute dtype
    (``dtype``, default: the input embedding's) and whose output would then not come back in that dtype
    (transformers 5.17's ``DeepseekV4RMSNorm`` under the fp32 weights its loader keeps).  Returns the names of
    the weights cast (empty where the installed transformers needs nothing).  Idempotent.

    Call it on a ``DeepseekV4ForCausalLM`` loaded in bf16/fp16 by ``from_pretrained`` before its first forward
    (``DeepseekV4PackedExpertsForCausalLM.from_pretrained`` and ``pack_fp4_experts`` call it themselves)."""
    dtype = dtype or compute_dtype(model)
    cast = []
    for name, module in model.named_modules():
        if not _is_norm(module) or module.weight.dtype == dtype or not module.weight.is_floating_point():
            continue
        if _returns_input_dtype(module, dtype):
            continue
        old = module.weight
        module.weight = torch.nn.Parameter(old.to(dtype), requires_grad=old.requires_grad)
        cast.append(f"{name}.weight" if name else "weight")
    return cast
