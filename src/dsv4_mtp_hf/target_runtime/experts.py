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

import functools
from types import SimpleNamespace

import torch
from transformers import DeepseekV4ForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from .. import fp4, patching
from ..compat import progress
from ..layers.moe import FP4Experts
from ..fp8 import FP8_BLOCK
from .dtypes import norms_to_compute_dtype
from .fp8_linears import FP8BlockLinear, keep_fp8_linears

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
try:  # transformers' FP8Experts (a native release loaded on a GPU) dispatch through their own registry
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
except ImportError:
    pass
else:
    ALL_FP8_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, fp4_experts_forward)

# What an experts module holds besides the packed copy: transformers' bf16 tensors, or its FP8Experts' packed
# e2m1 tensors with their scales.  Freed once the packed copy is in place.
DENSE_TENSORS = ("gate_up_proj", "down_proj", "up_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv",
                 "up_proj_scale_inv", "gate_up_proj_activation_scale", "down_proj_activation_scale",
                 "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


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
    once its packed copy is in place.  Norm weights a bf16 model's loader kept in fp32 are cast where the
    installed transformers needs it (:func:`~.dtypes.norms_to_compute_dtype`).  Returns ``model``.
    """
    layers = _experts_modules(model)
    c = model.config
    if any(hasattr(ex, "fp4") for _, ex in layers):
        raise ValueError("this model's experts are already packed (pack_fp4_experts was called on it).")
    if expert_format is not None:
        fp4.get_format(expert_format)
    reader = None
    if release is not None:
        from .expert_reader import ReleaseExperts

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
    if reader is None and any(not ex.gate_up_proj.is_floating_point() for _, ex in layers):
        raise ValueError("this model's experts are held quantised by transformers (FP8Experts: a native release loaded "
                         "on a GPU); pass the release, pack_fp4_experts(model, release), to read them as stored.")
    for i, experts in progress(layers, desc=f"packing routed experts ({fmt})", unit="layer"):
        packed = _packed_module(c, fmt, experts.gate_up_proj.device)
        if reader is not None:
            reader.fill(i, packed)
        else:
            _quantize_into(packed, experts)
        experts.fp4 = packed
        for name in DENSE_TENSORS:  # the wider copies (3/4 of a layer's bytes) go now
            if getattr(experts, name, None) is not None:
                delattr(experts, name)
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    keep_fp8_linears(model)  # transformers' FP8 projections (a native release on a GPU) run our W8A16 op
    patching.install(model, "save_pretrained", functools.partial(save_packed, model))  # transformers' save drops them
    norms_to_compute_dtype(model)  # a bf16 model loaded by transformers 5.17 keeps fp32 norms its forward can't run
    return model


def _expert_tensors(layer: int, packed: FP4Experts) -> dict[str, torch.Tensor]:
    """One layer's packed experts under the names and layout of a release: native MXFP4 (``.weight`` int8,
    ``.scale`` E8M0), or ModelOpt NVFP4 (``.weight``, ``.weight_scale`` E4M3, ``.weight_scale_2`` fp32)."""
    from ..loading.formats import SAFETENSORS_DTYPES

    e8m0 = SAFETENSORS_DTYPES["F8_E8M0"] or torch.uint8  # raw exponent bytes read back as U8 too
    i, out = packed.intermediate_size, {}
    w13, s13, g13 = packed.w13_weight.cpu(), packed.w13_scale.cpu(), packed.w13_global.cpu()
    w2, s2, g2 = packed.w2_weight.cpu(), packed.w2_scale.cpu(), packed.w2_global.cpu()
    for e in range(packed.num_experts):
        for m, p, sc, g in (("w1", w13[e, :i], s13[e, :i], g13[e, 0]), ("w3", w13[e, i:], s13[e, i:], g13[e, 1]),
                            ("w2", w2[e], s2[e], g2[e])):
            name = f"model.layers.{layer}.ffn.experts.{e}.{m}"
            if packed.format.name == "mxfp4":
                out[name + ".weight"], out[name + ".scale"] = p.view(torch.int8).clone(), sc.view(e8m0).clone()
            else:
                out[name + ".weight"], out[name + ".weight_scale"] = p.clone(), sc.view(torch.float8_e4m3fn).clone()
                out[name + ".weight_scale_2"] = g.clone().reshape(())
    return out


INDEX_FILE = "model.safetensors.index.json"
# In the index metadata of every save_packed: marks a folder as ours (its listed files may be replaced).
SAVE_MARK = ("dsv4_mtp_hf", "packed_experts")


def _earlier_save(save_directory) -> set[str]:
    """The files an earlier :func:`save_packed` into ``save_directory`` listed (empty: none there)."""
    import json
    import os

    try:
        with open(os.path.join(save_directory, INDEX_FILE), encoding="utf-8") as f:
            index = json.load(f)
        if index.get("metadata", {}).get(SAVE_MARK[0]) == SAVE_MARK[1]:
            return set(index["weight_map"].values())
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass
    return set()


def fp8_quantization_config(model) -> dict:
    """``{"quantization_config": ...}`` for a model whose projections are :class:`FP8BlockLinear`, else ``{}``:
    transformers' FineGrainedFP8 config under which its loader reads the saved ``weight`` + ``weight_scale_inv``
    back (dequantised on a CPU, FP8 on a GPU, where :func:`keep_fp8_linears` takes them), every other linear and
    the routed experts named as not converted.  Without it a reload would read the FP8 bytes without their
    scales."""
    if not any(isinstance(m, FP8BlockLinear) for m in model.modules()):
        return {}
    dense = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "scale_fmt": "float",
                                    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                                    "modules_to_not_convert": [*dense, "mlp.experts"]}}


def _quantization(config) -> dict:
    """``config.quantization_config`` as a dict (transformers keeps a dict or a config object); {} when none."""
    q = getattr(config, "quantization_config", None)
    return {} if q is None else dict(q) if isinstance(q, dict) else q.to_dict()


def _foreign_quantization(model) -> str | None:
    """What of a quantization_config this save cannot write: anything but transformers' FP8 projections once
    they are all :class:`FP8BlockLinear` (a native release loaded on a GPU, then packed)."""
    q = _quantization(model.config)
    if not q and getattr(model, "hf_quantizer", None) is None:
        return None
    if q.get("quant_method") != "fp8":
        return f"quant_method {q.get('quant_method')!r}"
    left = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FP8")
                   and not isinstance(m, FP8BlockLinear) and getattr(m, "weight", None) is not None})
    return f"transformers' {', '.join(left)} modules" if left else None


def save_packed(model, save_directory, **kwargs) -> None:
    """``save_pretrained`` of a model with packed experts: transformers writes everything else (its names,
    its shards), then each layer's experts go into a shard of their own as a release stores them, listed in
    the index.  :class:`DeepseekV4PackedExpertsForCausalLM` loads the result back, packed, bit for bit.

    Only into a new or empty directory or over an earlier save of a packed target: a directory holding a
    release, a draft or any other model's files is refused before anything is written (transformers' save
    would overwrite its ``config.json`` and delete its shards).  ``push_to_hub`` uploads the folder once the
    experts are written too."""
    import json
    import os

    from safetensors.torch import save_file
    from transformers import PreTrainedModel

    from ..loading.remote_code import pop_push_arguments, push_saved_folder
    from ..loading.save_guard import check_save_directory

    foreign = _foreign_quantization(model)
    if foreign:
        raise NotImplementedError(
            f"save_pretrained of a packed target under a quantization_config ({foreign}) is not supported: keep the "
            "release itself, and load it with DeepseekV4PackedExpertsForCausalLM.from_pretrained.")
    if kwargs.get("safe_serialization") is False:
        raise ValueError("packed experts are saved as safetensors only (safe_serialization=True).")
    layers = _experts_modules(model)
    earlier = _earlier_save(save_directory)
    check_save_directory(save_directory, model.config.model_type, lambda name: True, "packed DeepSeek-V4 target",
                         owns_file=lambda f: f in earlier or (f == INDEX_FILE and bool(earlier)))
    push = pop_push_arguments(kwargs)
    state = {k: v for k, v in model.state_dict().items() if ".experts.fp4." not in k}
    quantizer = model.__dict__.pop("hf_quantizer", None)  # ours writes the FP8 projections (fp8_quantization_config)
    try:
        with patching.during(model.config, **{"quantization_config": None, **fp8_quantization_config(model)}):
            PreTrainedModel.save_pretrained(model, save_directory, state_dict=state, **kwargs)
    finally:
        if quantizer is not None:
            model.hf_quantizer = quantizer
    if not kwargs.get("is_main_process", True):
        return
    index_path = os.path.join(save_directory, INDEX_FILE)
    single_path = os.path.join(save_directory, "model.safetensors")
    if os.path.exists(single_path):  # one file, just written: renamed as a shard (loaders read a lone one, no index)
        from safetensors import safe_open

        single = "model-00001-of-00001.safetensors"
        os.replace(single_path, os.path.join(save_directory, single))
        with safe_open(os.path.join(save_directory, single), framework="pt") as f:
            index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), single)}
    else:  # sharded: the index transformers just wrote
        with open(index_path) as f:
            index = json.load(f)
    total = index.setdefault("metadata", {}).get("total_size", 0)
    for i, experts in layers:
        name = f"experts-{i + 1:05d}-of-{len(layers):05d}.safetensors"
        tensors = _expert_tensors(i, experts.fp4)
        save_file(tensors, os.path.join(save_directory, name), metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index["metadata"]["total_size"] = total
    index["metadata"][SAVE_MARK[0]] = SAVE_MARK[1]
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    for stale in earlier - set(index["weight_map"].values()):  # our own earlier files this save did not rewrite
        path = os.path.join(save_directory, stale)
        if os.path.dirname(stale) == "" and os.path.isfile(path):
            os.remove(path)
    push_saved_folder(save_directory, push, "Upload DeepSeek-V4 target with packed FP4 experts")


def _experts_out_of_fp8_quantizer(config) -> None:
    """A native release's ``quantization_config`` (FP8) makes transformers' quantizer replace every experts module
    with its ``FP8Experts`` on a GPU, the packed one included: keep the routed experts out of it (they are read
    packed), and the lm head, which it skips when the release names no modules."""
    q = _quantization(config)
    if q.get("quant_method") != "fp8":
        return
    skip = list(q.get("modules_to_not_convert") or ["lm_head"])
    config.quantization_config = {**q, "modules_to_not_convert": [*skip, "mlp.experts"]}


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
                                          r"\.experts\.(gate_up_proj|down_proj)(_scale_inv)?$",
                                          r"\.experts\.\d+\.w[123]\."]
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

        from .expert_reader import ReleaseExperts

        hub = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in kwargs}
        config = kwargs.pop("config", None) or AutoConfig.from_pretrained(release, **hub)
        if getattr(config, "model_type", None) != "deepseek_v4":
            raise TypeError(f"{release} is not a DeepSeek-V4 release (model_type {config.model_type!r}).")
        reader = ReleaseExperts(release, config.num_hidden_layers, config.n_routed_experts, config.hidden_size,
                                config.moe_intermediate_size, expert_format, hub)
        config._dsv4_expert_format = reader.format
        _experts_out_of_fp8_quantizer(config)
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
        keep_fp8_linears(model)  # transformers' FP8 projections (a native release on a GPU) run our W8A16 op
        norms_to_compute_dtype(model)  # transformers 5.17: its loader's fp32 norms would break a bf16 forward
        return model

    def save_pretrained(self, save_directory, **kwargs):
        """:func:`save_packed`: the experts as a release stores them, the rest as transformers saves it."""
        save_packed(self, save_directory, **kwargs)


def expert_bytes(model) -> int:
    """Bytes held by the routed experts of ``model`` (packed or bf16)."""
    total = 0
    for _, experts in _experts_modules(model):
        tensors = experts.fp4.buffers() if hasattr(experts, "fp4") else (experts.gate_up_proj, experts.down_proj)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total
