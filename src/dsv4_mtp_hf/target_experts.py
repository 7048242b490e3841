"""Packed FP4 routed experts for transformers' DeepSeek-V4 target, through its experts registry (issue 31).

transformers' ``DeepseekV4Experts`` holds every routed expert in bf16 (``gate_up_proj [E, 2I, D]``,
``down_proj [E, D, I]``: four times the FP4 release) and dispatches its forward through the experts
registry (``@use_experts_implementation``: ``ALL_EXPERTS_FUNCTIONS``, picked by
``config._experts_implementation``).  We register ``"dsv4_fp4"`` there.  :func:`pack_fp4_experts` gives
each experts module an :class:`~dsv4_mtp_hf.layers.moe.FP4Experts` (the release's packed bytes, exactly),
frees the bf16 tensors and switches the model to ``"dsv4_fp4"``: the routed experts then run through
``dsv4_mtp::fp4_moe`` (the Triton kernels on CUDA, the reference math elsewhere).  Routers, shared
experts, attention and everything else stay transformers' own modules.

    target = AutoModelForCausalLM.from_pretrained("deepseek-ai/DeepSeek-V4-Flash", ...)
    pack_fp4_experts(target, "deepseek-ai/DeepSeek-V4-Flash")
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import DeepseekV4ForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from . import fp4
from .layers.moe import FP4Experts

EXPERTS_IMPLEMENTATION = "dsv4_fp4"
QUANTIZE_CHUNK = 16  # experts quantised at a time from in-memory weights (bounds the fp32 temporaries)


def fp4_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """``DeepseekV4Experts.forward`` on packed FP4 weights (``self.fp4``): same inputs, same math."""
    packed = getattr(self, "fp4", None)
    if packed is None:
        raise RuntimeError(
            f"experts_implementation={EXPERTS_IMPLEMENTATION!r} runs packed FP4 experts, but this experts module holds "
            "none: call `dsv4_mtp_hf.pack_fp4_experts(model, release)` instead of setting the implementation by hand."
        )
    return packed(hidden_states, top_k_weights, top_k_index)


ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, fp4_experts_forward)


def _experts_modules(model) -> list[tuple[int, torch.nn.Module]]:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    config = getattr(model, "config", None)
    if layers is None or getattr(config, "model_type", None) != "deepseek_v4":
        raise TypeError(
            f"pack_fp4_experts expects transformers' DeepSeek-V4 model (DeepseekV4ForCausalLM / DeepseekV4Model), "
            f"got {type(model).__name__}."
        )
    out = []
    for i, layer in enumerate(layers):
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is None or not hasattr(experts, "gate_up_proj") and not hasattr(experts, "fp4"):
            raise TypeError(f"layer {i} of {type(model).__name__} has no routed experts module (`mlp.experts`).")
        out.append((i, experts))
    return out


def _packed_module(config, fmt: str, device) -> FP4Experts:
    spec = SimpleNamespace(expert_format=fmt, swiglu_limit=config.swiglu_limit, n_routed_experts=config.n_routed_experts,
                           hidden_size=config.hidden_size, moe_intermediate_size=config.moe_intermediate_size)
    with torch.device("meta"):
        packed = FP4Experts(spec)
    return packed.to_empty(device=device)


@torch.no_grad()
def _quantize_into(packed: FP4Experts, experts) -> None:
    """From the module's own (dense) weights: exact when they hold FP4 values of ``packed.format``
    (a release dequantised by transformers), a re-quantisation otherwise."""
    i = packed.intermediate_size
    for a in range(0, packed.num_experts, QUANTIZE_CHUNK):
        b = min(a + QUANTIZE_CHUNK, packed.num_experts)
        gate_up = experts.gate_up_proj[a:b]
        packed.set_expert(slice(a, b), gate_up[:, :i], gate_up[:, i:], experts.down_proj[a:b])


@torch.no_grad()
def pack_fp4_experts(model, release=None, *, expert_format: str | None = None, **hub_kwargs):
    """Keep ``model``'s routed experts packed in FP4 and run them through ``dsv4_mtp::fp4_moe``.

    ``release``: the DeepSeek-V4 release (local folder or Hub id) the model was loaded from; its packed
    experts are read as they are stored (native MXFP4, or NVFP4), bit for bit.  Without it the model's
    own expert weights are quantised to ``expert_format`` (default ``"mxfp4"``: exact for a model whose
    experts transformers dequantised from the MXFP4 release).  Each layer's bf16 expert tensors are freed
    once its packed copy is in place.  Returns ``model``.
    """
    layers = _experts_modules(model)
    c = model.config
    if any(hasattr(ex, "fp4") for _, ex in layers):
        raise ValueError("this model's experts are already packed (pack_fp4_experts was called on it).")
    if expert_format is not None:
        fp4.get_format(expert_format)
    reader = None
    if release is not None:
        from .loading.target_experts import ReleaseExperts

        reader = ReleaseExperts(release, len(layers), c.n_routed_experts, c.hidden_size, c.moe_intermediate_size,
                                expert_format, hub_kwargs)
        fmt = reader.format
    else:
        if hub_kwargs:
            raise TypeError(f"hub keywords {sorted(hub_kwargs)} need a `release` to read from.")
        fmt = expert_format or "mxfp4"
    offloaded = [i for i, ex in layers if ex.gate_up_proj.device.type == "meta"]
    if offloaded:
        raise ValueError(f"the experts of layers {offloaded} are offloaded (on the meta device): load the model with "
                         "its layers on GPUs or the CPU (a device_map without 'disk' entries) before packing.")
    for i, experts in layers:
        packed = _packed_module(c, fmt, experts.gate_up_proj.device)
        if reader is not None:
            reader.fill(i, packed)
        else:
            _quantize_into(packed, experts)
        experts.fp4 = packed
        del experts.gate_up_proj, experts.down_proj  # the bf16 copies (3/4 of a layer's bytes) go now
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    model.save_pretrained = _refuse_save  # per instance: the packed experts would not load back (not yet)
    return model


def _refuse_save(*args, **kwargs):
    raise NotImplementedError(
        "save_pretrained of a model with packed FP4 experts is not supported yet: transformers' from_pretrained "
        "would not load the packed experts back. Save the model before pack_fp4_experts, or keep the release and "
        "call pack_fp4_experts(target, release) after loading it.")


class DeepseekV4PackedExpertsForCausalLM(DeepseekV4ForCausalLM):
    """transformers' ``DeepseekV4ForCausalLM`` whose routed experts are packed FP4 from the start:
    ``from_pretrained(release, ...)`` never allocates their bf16 copies (~570 GB at V4-Flash size).

    Each experts module holds an :class:`~dsv4_mtp_hf.layers.moe.FP4Experts` (``experts.fp4``) instead of
    ``gate_up_proj`` / ``down_proj``, so transformers' loader skips the release's expert tensors, sizes a
    ``device_map`` with the packed bytes, and allocates those at their packed size on each layer's device;
    then the release's experts are read into them as stored (:class:`ReleaseExperts`, the same reader as
    :func:`pack_fp4_experts`).  Everything else is transformers' own model and loading."""

    # the expert tensors the release holds (read by us) and the packed buffers it does not (filled by us)
    _keys_to_ignore_on_load_unexpected = [*(DeepseekV4ForCausalLM._keys_to_ignore_on_load_unexpected or []),
                                          r"\.experts\.(gate_up_proj|down_proj)$", r"\.experts\.\d+\.w[123]\."]
    _keys_to_ignore_on_load_missing = [r"\.experts\.fp4\."]

    def __init__(self, config):
        super().__init__(config)
        fmt = getattr(config, "_dsv4_expert_format", None) or "mxfp4"
        for _, experts in _experts_modules(self):
            device = experts.gate_up_proj.device
            del experts.gate_up_proj, experts.down_proj
            experts.fp4 = _packed_module(config, fmt, device)
        self.config._experts_implementation = EXPERTS_IMPLEMENTATION

    def _init_weights(self, module):
        if isinstance(module, FP4Experts) or hasattr(module, "fp4"):
            return  # filled from the release after loading
        super()._init_weights(module)

    @classmethod
    def from_pretrained(cls, release, *args, expert_format: str | None = None, **kwargs):
        """``release``: a DeepSeek-V4 release (Hub id or folder) in the layouts :func:`pack_fp4_experts`
        reads; the other arguments are ``from_pretrained``'s (``dtype``, ``device_map``, ...)."""
        from transformers import AutoConfig

        from .loading.target_experts import ReleaseExperts

        hub = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in kwargs}
        config = kwargs.pop("config", None) or AutoConfig.from_pretrained(release, **hub)
        if getattr(config, "model_type", None) != "deepseek_v4":
            raise TypeError(f"{release} is not a DeepSeek-V4 release (model_type {config.model_type!r}).")
        reader = ReleaseExperts(release, config.num_hidden_layers, config.n_routed_experts, config.hidden_size,
                                config.moe_intermediate_size, expert_format, hub)
        config._dsv4_expert_format = reader.format
        impl = kwargs.pop("experts_implementation", EXPERTS_IMPLEMENTATION)
        if impl != EXPERTS_IMPLEMENTATION:
            raise ValueError(f"packed experts run as experts_implementation={EXPERTS_IMPLEMENTATION!r}, not {impl!r}; "
                             "load with transformers' DeepseekV4ForCausalLM for its own implementations.")
        model = super().from_pretrained(release, *args, config=config, **kwargs)
        for i, experts in _experts_modules(model):
            if experts.fp4.w13_weight.device.type == "meta":
                raise ValueError(f"layer {i}'s experts were offloaded (meta device): load with a device_map of GPUs "
                                 "and the CPU only.")
            reader.fill(i, experts.fp4)
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)  # whatever default loading picked
        model.save_pretrained = _refuse_save
        return model


def expert_bytes(model) -> int:
    """Bytes held by the routed experts of ``model`` (packed or bf16)."""
    total = 0
    for _, experts in _experts_modules(model):
        tensors = experts.fp4.buffers() if hasattr(experts, "fp4") else (experts.gate_up_proj, experts.down_proj)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total
