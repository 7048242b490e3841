"""Load the MTP layer straight from an original DeepSeek-V4 release (design §1).

A release is a ``config.json`` (``model_type: deepseek_v4``), a
``model.safetensors.index.json`` and many shards; the MTP layer lives under ``mtp.0.*``
(in the V4-Flash release, all 1575 of its tensors sit in the last shard).  We

1. read the config and the index (for a Hub repo id these two files only);
2. pick the shards that hold ``mtp.*`` tensors and fetch/open ONLY those;
3. read their safetensors headers and check, before any data is read, that every
   tensor the MTP needs is there with the right dtype and shape (clear errors
   otherwise);
4. build the model on the meta device, then fill it tensor by tensor: FP8 weights are
   dequantised one matrix at a time on their destination device, routed experts are
   copied as raw FP4 bytes into preallocated packed buffers (never widened), so peak
   host memory stays near the packed size of the MTP plus one tensor.

The target's embedding and lm head (``embed.weight`` / ``head.weight``) are never read:
the MTP shares them with the target by reference.

:func:`load_native_mtp` is those steps in order: :func:`read_native_source` (config, index,
headers), :func:`plan_native_model` (plan + checks on a meta model), :func:`fill_native_model`
(allocate + fill), :func:`finalize_native_model`.  The per-block tables (``BLOCK_PLAIN``,
``BLOCK_LINEAR``, ``BLOCK_EXPERTS``) and :func:`block_units`, :func:`detect_block_experts`,
:func:`validate_plan`, :func:`fill_units` take the native block prefix (``mtp.0.``) and our
module prefix (``block.``) as arguments, so a drafter of several V4 blocks (``mtp.0.``,
``mtp.1.``, ...) can plan, check and fill each of its blocks with them.  Index entries must
name shards inside the checkpoint directory (:func:`check_shard_names`).
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.utils import logging as hf_logging

from ..fp8 import decode_block_scale, dequantize_fp8_block, fp8_scale_shape
from . import formats as F
from .detect import check_class, drafter_kind, stored_names
from .files import HUB_KWARGS, hub_kwargs, read_config_dict, read_safetensors_header, read_weight_map, resolve_file
from .formats import MtpCheckpointError

logger = hf_logging.get_logger(__name__)

MTP_PREFIX = "mtp.0."

RELEASES_HINT = (
    "The MTP layer ships in the native deepseek-ai releases (e.g. deepseek-ai/DeepSeek-V4-Flash, "
    "deepseek-ai/DeepSeek-V4-Pro and their -Base variants) and in BF16 community conversions that kept the "
    "`mtp.*` tensors; several re-quantised releases (e.g. NVFP4 ones) drop it. Load the MTP from such a "
    "release (the target itself may come from any release with the same architecture)."
)

# from_pretrained keywords that mean nothing for a native load (accepted, ignored).
IGNORED_KWARGS = (
    "trust_remote_code", "low_cpu_mem_usage", "use_safetensors", "_from_auto", "_commit_hash",
    "attn_implementation", "output_loading_info", "weights_only", "key_mapping", "adapter_kwargs",
)

# Per-block tables: a V4 block stored under a native prefix (``mtp.0.``; a drafter of several blocks: ``mtp.1.``,
# ...), filled into a module of ours (the MTP's ``block.``).  Native suffix (after the block prefix) -> our name
# (after the module prefix).  Stored as BF16/F32 tensors:
BLOCK_PLAIN = {
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.attn_sink": "self_attn.sinks",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
}
# native module -> our module; ``.weight`` possibly FP8 with a block ``.scale``, or NVFP4:
BLOCK_LINEAR = {
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv": "self_attn.kv_proj",
    "attn.wo_a": "self_attn.o_a_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "ffn.gate": "mlp.gate",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
}
BLOCK_EXPERTS = ("ffn.experts", "mlp.experts")  # native routed experts ``{e}.w1/w3/w2`` -> our FP4Experts module

# The MTP's own tensors around its block, under the same native prefix (``mtp.0.``), filled into the model root.
MTP_PLAIN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
}
MTP_LINEAR = {"e_proj": "e_proj", "h_proj": "h_proj"}
MTP_BLOCK = "block."  # the MTP's block module

# The whole MTP layer's tables (native suffix after ``mtp.0.`` -> our name), kept for readers of the mapping.
PLAIN_TENSORS = {**MTP_PLAIN, **{k: MTP_BLOCK + v for k, v in BLOCK_PLAIN.items()}}
LINEAR_MODULES = {**MTP_LINEAR, **{k: MTP_BLOCK + v for k, v in BLOCK_LINEAR.items()}}
EXPERTS = MTP_BLOCK + BLOCK_EXPERTS[1]

EXPERT_MATRICES = ("w1", "w3", "w2")
# Duplicates of the target's embedding / head that some conversions store under mtp.*.
SHARED_DUPLICATES = re.compile(r"^mtp\.\d+\.(emb|embed|embed_tokens|head|shared_head)\.")


# -- the plan: which native tensors fill which parameter ----------------------------------------------


@dataclass
class Unit:
    kind: str  # "plain" | "linear" | "expert"
    target: str  # our parameter name (plain/linear) or the expert matrix "w1"/"w3"/"w2"
    sources: dict = field(default_factory=dict)  # role -> native tensor name
    layout: str = ""  # linear: "float" | "fp8_block" | "fp8_tensor" | "nvfp4"; expert: ExpertLayout.name
    expert: int = -1
    module: str = EXPERTS  # expert: our FP4Experts module it fills


def _linear_unit(prefix: str, target: str, header: dict, missing: list) -> Unit | None:
    if f"{prefix}.weight_packed" in header or f"{prefix}.weight_scale_2" in header:
        layout = F.NVFP4_COMPRESSED_TENSORS if f"{prefix}.weight_packed" in header else F.NVFP4_MODELOPT
        srcs = layout.keys(prefix)
        absent = [k for k in srcs.values() if k not in header]
        missing.extend(absent)
        return None if absent else Unit("linear", target, srcs, layout.name)
    w = f"{prefix}.weight"
    if w not in header:
        missing.append(w)
        return None
    dtype = header[w][0]
    if dtype in F.FP8_DTYPES:
        for suffix, layout in (("scale", "fp8_block"), ("weight_scale_inv", "fp8_block"), ("weight_scale", "fp8_tensor")):
            if f"{prefix}.{suffix}" in header:
                return Unit("linear", target, {"weight": w, "scale": f"{prefix}.{suffix}"}, layout)
        missing.append(f"{prefix}.scale")
        return None
    return Unit("linear", target, {"weight": w}, "float")


def table_units(header: dict, src: str, dst: str, plain: dict, linear: dict, missing: list,
                skip=lambda suffix: False) -> list[Unit]:
    """Units for the tensors of one table pair: ``plain`` / ``linear`` native suffixes under the native
    prefix ``src`` into our names under ``dst``.  Absent tensors go to ``missing``."""
    units = []
    for suffix, target in plain.items():
        name = src + suffix
        if name in header:
            units.append(Unit("plain", dst + target, {"value": name}))
        else:
            missing.append(name)
    for suffix, target in linear.items():
        if not skip(suffix):
            unit = _linear_unit(src + suffix, dst + target + ".weight", header, missing)
            if unit is not None:
                units.append(unit)
    return units


def present_experts(keys, src: str) -> list[int]:
    """Indices of the routed experts stored under the block prefix ``src``."""
    pattern = re.compile(rf"^{re.escape(src + BLOCK_EXPERTS[0])}\.(\d+)\.")
    return sorted({int(m.group(1)) for k in keys if (m := pattern.match(k))})


def detect_block_experts(header: dict, keys, src: str, expert_format_override: str | None):
    """-> (expert layout, FP4 format) of the routed experts under the block prefix ``src``, read from the
    names and dtypes of the first expert present."""
    layout = None
    for e in present_experts(keys, src):
        pre = f"{src}{BLOCK_EXPERTS[0]}.{e}"
        layout = F.detect_expert_layout(f"{pre}.w1", header) or F.detect_expert_layout(f"{pre}.w2", header)
        if layout is not None:
            break
    if layout is None:
        layout = F.MXFP4_NATIVE  # nothing there: every expert tensor is reported missing
    if layout.format is None:
        return layout, expert_format_override or "mxfp4"
    if expert_format_override not in (None, layout.format):
        raise MtpCheckpointError(
            f"This release stores the routed experts as {layout.name}; `expert_format="
            f"{expert_format_override!r}` would need a lossy re-quantisation. Leave `expert_format` unset."
        )
    return layout, layout.format


def block_units(header: dict, src: str, dst: str, config, layout: F.ExpertLayout, missing: list) -> list[Unit]:
    """Units for one V4 block stored under the native prefix ``src`` (``mtp.0.``) into our module ``dst``
    (``block.``): norms, mHC, attention, router, shared and routed experts (``config``: their counts)."""
    no_shared = not config.n_shared_experts
    units = table_units(header, src, dst, BLOCK_PLAIN, BLOCK_LINEAR, missing,
                        skip=lambda suffix: no_shared and "shared_experts" in suffix)
    module = dst + BLOCK_EXPERTS[1]
    for e in range(config.n_routed_experts):
        for m in EXPERT_MATRICES:
            srcs = layout.keys(f"{src}{BLOCK_EXPERTS[0]}.{e}.{m}")
            absent = [k for k in srcs.values() if k not in header]
            if absent:
                missing.extend(absent)
            else:
                units.append(Unit("expert", m, srcs, layout.name, e, module))
    return units


def unused_keys(keys, units: list[Unit], blocks: list[tuple[str, F.ExpertLayout]]) -> list[str]:
    """Stored keys no unit reads, except activation scales, a layout's ignored parts and duplicates of the
    target's embedding / head (``blocks``: (native block prefix, its expert layout))."""
    used = {k for u in units for k in u.sources.values()}
    ignored = {f"{src}{BLOCK_EXPERTS[0]}.{e}.{m}.{s}" for src, layout in blocks for e in present_experts(keys, src)
               for m in EXPERT_MATRICES for s in layout.ignored}
    ignored |= {k for k in keys if k.endswith((".input_scale", ".input_global_scale"))}
    return [k for k in keys if k not in used and k not in ignored and not SHARED_DUPLICATES.match(k)]


def raise_missing(missing: list[str], layout: F.ExpertLayout, hint: str = RELEASES_HINT,
                  what: str = "The MTP layer (DeepseekV4MtpForCausalLM)") -> None:
    """``what``: the drafter, by its class name; ``hint``: where a complete one ships."""
    if missing:
        shown = ", ".join(missing[:12]) + (", ..." if len(missing) > 12 else "")
        raise MtpCheckpointError(
            f"{what} in this checkpoint is incomplete: {len(missing)} required tensor(s) are missing "
            f"(expert layout detected: {layout.name}): {shown}. {hint}"
        )


def build_plan(model, header: dict, mtp_keys: list[str], expert_format_override: str | None,
               src: str = MTP_PREFIX, dst: str = ""):
    """The MTP layer stored under ``src`` into ``model`` (names under ``dst``) -> (units, expert layout, FP4
    format, unused keys); raises on missing tensors."""
    layout, fmt = detect_block_experts(header, mtp_keys, src, expert_format_override)
    missing: list[str] = []
    units = table_units(header, src, dst, MTP_PLAIN, MTP_LINEAR, missing)
    units += block_units(header, src, dst + MTP_BLOCK, model.config, layout, missing)
    raise_missing(missing, layout)
    return units, layout, fmt, unused_keys(mtp_keys, units, [(src, layout)])


def _expect(name, header, accepted, shape, what):
    dtype, got = header[name]
    if dtype not in accepted:
        raise MtpCheckpointError(
            f"Tensor {name!r} has dtype {dtype}, expected one of {list(accepted)} ({what})."
        )
    if shape is not None and tuple(got) != tuple(shape):
        raise MtpCheckpointError(
            f"Tensor {name!r} has shape {list(got)}, expected {list(shape)} ({what}); the checkpoint does not "
            "match its config.json or is corrupt."
        )


def validate_plan(units: list[Unit], header: dict, shapes: dict, layout: F.ExpertLayout, fmt: str, config) -> None:
    """Check dtypes and shapes of every source tensor against the model, from headers only."""
    d, i = config.hidden_size, config.moe_intermediate_size
    for u in units:
        if u.kind == "plain":
            shape = shapes[u.target]
            numel = 1
            for s in shape:
                numel *= s
            name = u.sources["value"]
            got = header[name][1]
            # Scalars stored as [] or [1] are the same thing.
            scalar = numel == 1 and tuple(got) in ((), (1,))
            ok_shape = tuple(got) if scalar else tuple(shape)
            _expect(name, header, F.FLOAT_DTYPES, ok_shape, f"float tensor for {u.target}")
        elif u.kind == "linear":
            n, k = shapes[u.target]
            if u.layout == "float":
                _expect(u.sources["weight"], header, F.FLOAT_DTYPES, (n, k), f"weight of {u.target}")
            elif u.layout == "fp8_block":
                _expect(u.sources["weight"], header, F.FP8_DTYPES, (n, k), f"FP8 weight of {u.target}")
                _expect(u.sources["scale"], header, F.BLOCK_SCALE_DTYPES, fp8_scale_shape((n, k)),
                        "one scale per 128x128 block, ceil-divided")
            elif u.layout == "fp8_tensor":
                _expect(u.sources["weight"], header, F.FP8_DTYPES, (n, k), f"FP8 weight of {u.target}")
                _expect(u.sources["scale"], header, ("F32",), None, "per-tensor FP8 scale")
            else:  # NVFP4 dense module
                nv = F.NVFP4_COMPRESSED_TENSORS if "weight_packed" in u.sources["packed"] else F.NVFP4_MODELOPT
                for role, (acc, shape) in F.expert_part_expectations(nv, "nvfp4", n, k).items():
                    _expect(u.sources[role], header, acc, shape if role != "global" else None, f"NVFP4 {role} of {u.target}")
        else:
            validate_expert(u, header, layout, fmt, d, i)


def validate_expert(u: Unit, header: dict, layout: F.ExpertLayout, fmt: str, hidden: int, inter: int) -> None:
    """Dtypes and shapes of one routed-expert matrix's tensors (``u.target`` w1 / w3 / w2), from headers."""
    n, k = (inter, hidden) if u.target in ("w1", "w3") else (hidden, inter)
    for role, (acc, shape) in F.expert_part_expectations(layout, fmt, n, k).items():
        name = u.sources[role]
        if role == "global":
            got = header[name][1]
            if tuple(got) not in ((), (1,)):
                raise MtpCheckpointError(
                    f"Tensor {name!r} has shape {list(got)}, expected [] or [1] (one global scale per matrix)."
                )
            shape = None
        _expect(name, header, acc, shape, f"{layout.name} expert {role}, logical matrix [{n}, {k}]")


# -- filling the meta model -----------------------------------------------------------------------------


def resolve_dtype(dtype, config_dict: dict) -> torch.dtype:
    if dtype is None or dtype == "auto":
        dtype = config_dict.get("dtype") or config_dict.get("torch_dtype") or "bfloat16"
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"`dtype` must be a floating torch dtype (or 'auto'), got {dtype!r}.")
    return dtype


def lm_head_device(target) -> torch.device:
    head = target.get_output_embeddings()
    return head.weight.device


def device_resolver(device_map, target_model):
    """-> function(param name) -> torch.device.  With a target and no ``device_map`` the MTP
    goes where the target's lm head is (a draft elsewhere would move every step's hidden
    states across devices); "auto" and friends mean the same."""
    if device_map is None and target_model is not None:
        device_map = "auto"
    if device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
        if target_model is not None:
            device_map = lm_head_device(target_model)
        else:
            device_map = "cuda:0" if torch.cuda.is_available() else "cpu"
    if device_map is None:
        device_map = "cpu"
    if isinstance(device_map, (str, int, torch.device)):
        dev = torch.device(device_map if not isinstance(device_map, int) else f"cuda:{device_map}")
        return lambda name: dev
    if isinstance(device_map, dict):
        table = {
            k: torch.device(v if not isinstance(v, int) else f"cuda:{v}") for k, v in device_map.items()
        }
        if any(v.type in ("disk", "meta") for v in table.values()):
            raise ValueError("device_map: the MTP cannot be offloaded to 'disk'/'meta'; give real devices.")

        def resolve(name: str) -> torch.device:
            best = None
            for k in table:
                if k == "" or name == k or name.startswith(k + "."):
                    if best is None or len(k) > len(best):
                        best = k
            if best is None:
                raise ValueError(f"device_map {device_map} does not place {name!r}; add an entry for it (or \"\").")
            return table[best]

        return resolve
    raise ValueError(f"Unsupported device_map {device_map!r}: use a device, 'auto' or a dict like {{'': 'cuda:0'}}.")


RELEASE_SCALES = "_release_fp8_scales"


def release_scales(model: nn.Module) -> dict:
    """The FP8 block scales (as stored, on the CPU) of the linears ``model`` was loaded with from a release, by our
    weight name: a few bytes per matrix, not part of the ``state_dict``.  The weights themselves are held
    dequantised; :mod:`.export` writes a weight back with its stored scale when that scale still reproduces it
    exactly, so a release-layout export of a release-loaded drafter repeats the release's bytes."""
    scales = model.__dict__.get(RELEASE_SCALES)
    if scales is None:
        scales = model.__dict__[RELEASE_SCALES] = {}
    return scales


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if leaf in mod._parameters:
        old = mod._parameters[leaf]
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad and value.is_floating_point())
    elif leaf in mod._buffers:
        mod._buffers[leaf] = value
    else:
        raise KeyError(name)


def _check_finite(name: str, t: torch.Tensor) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise MtpCheckpointError(f"Tensor {name!r} contains NaN or infinite values: the checkpoint is corrupt.")


def _decode_linear(u: Unit, read, device, dtype) -> torch.Tensor:
    if u.layout == "float":
        name = u.sources["weight"]
        w = read(name).to(device)
        _check_finite(name, w)
        return w.to(dtype)
    if u.layout in ("fp8_block", "fp8_tensor"):
        w = read(u.sources["weight"]).to(device)
        scale = read(u.sources["scale"])
        s = decode_block_scale(scale)
        _check_finite(u.sources["scale"], s)
        if u.layout == "fp8_tensor":  # ModelOpt FP8: one scale per tensor (or per output row)
            s = s.to(device).reshape(-1, 1) if s.numel() > 1 else s.to(device).reshape(())
            out = (w.float() * s).to(dtype)
        else:
            out = dequantize_fp8_block(w, scale, dtype)
        _check_finite(u.sources["weight"], out)
        return out
    nv = F.NVFP4_COMPRESSED_TENSORS if "weight_packed" in u.sources["packed"] else F.NVFP4_MODELOPT
    from .. import fp4

    g = F.global_scale_value(nv, read(u.sources["global"]))
    raw = fp4.scale_bytes(read(u.sources["scale"]))
    F.check_scale_bytes(u.sources["scale"], raw, "nvfp4")
    return fp4.dequantize_fp4(read(u.sources["packed"]).to(device), raw.to(device), "nvfp4", g.to(device), dtype)


@dataclass
class NativeSource:
    """What a release holds for the tensors under ``prefix``: read from its config, index and headers only."""

    path_or_repo: object
    config_dict: dict
    keys: list[str]  # the stored tensors under ``prefix``
    header: dict  # name -> (dtype string, shape)
    shard_of: dict  # name -> shard file
    shard_paths: dict  # shard file -> local path


@dataclass
class LoadOptions:
    dtype: object
    device_map: object
    config: object  # a passed DeepseekV4Config, or None
    overrides: dict  # DeepseekV4MtpConfig fields
    hub: dict


def load_options(kwargs: dict, cls) -> LoadOptions:
    """``from_pretrained``'s keywords for a native load of the drafter class ``cls``; unknown ones (another
    drafter's config fields included) raise."""
    hub = hub_kwargs(kwargs)
    dtype = kwargs.pop("dtype", None)
    torch_dtype = kwargs.pop("torch_dtype", None)
    device_map = kwargs.pop("device_map", None)
    for k in HUB_KWARGS + IGNORED_KWARGS:
        kwargs.pop(k, None)
    config = kwargs.pop("config", None)
    fields = cls.config_class.field_names()
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
    if kwargs:
        raise TypeError(f"Unexpected keyword argument(s) for loading {cls.__name__} from a DeepSeek-V4 release: "
                        f"{sorted(kwargs)} (its config fields and from_pretrained's loading keywords are accepted).")
    return LoadOptions(dtype if dtype is not None else torch_dtype, device_map, config, overrides, hub)


def read_native_source(path_or_repo, hub: dict, prefix: str = MTP_PREFIX) -> NativeSource:
    """Config, index and the headers of the shards holding ``prefix`` (the only files fetched)."""
    config_dict = read_config_dict(path_or_repo, hub) or {}
    weight_map, single = read_weight_map(path_or_repo, hub)
    keys = sorted(k for k in weight_map if k.startswith("mtp."))
    if not keys:
        nextn = config_dict.get("num_nextn_predict_layers")
        raise MtpCheckpointError(
            f"{path_or_repo} has no MTP layer: its weight index lists {len(weight_map)} tensors but none under "
            f"`mtp.*` (expected `{prefix}*`; config.json num_nextn_predict_layers={nextn!r}). {RELEASES_HINT}"
        )
    others = sorted({k.split(".")[1] for k in keys if not k.startswith(prefix)})
    if others:
        logger.warning(f"Ignoring MTP layer(s) mtp.{others} in {path_or_repo}: only {prefix.rstrip('.')} is used.")
        keys = [k for k in keys if k.startswith(prefix)]
    shard_of = {k: weight_map[k] for k in keys}
    shard_paths = {s: (single if single is not None else resolve_file(
        path_or_repo, s, hub, what=f"the index places the drafter's `{prefix}*` tensors in it"))
        for s in sorted(set(shard_of.values()))}
    header: dict = {}
    for s, p in shard_paths.items():
        h = read_safetensors_header(p)
        for k in keys:
            if shard_of[k] == s:
                if k not in h:
                    raise MtpCheckpointError(
                        f"The index places tensor {k!r} in shard {s}, but that shard does not hold it: the index and "
                        "the shards are from different versions. Download the release's index and shards again.")
                header[k] = h[k]
    return NativeSource(path_or_repo, config_dict, keys, header, shard_of, shard_paths)


def plan_native_model(cls, source: NativeSource, target_config, overrides: dict, dtype: torch.dtype):
    """Plan and check the load before any data is read -> (meta model, units, expert layout, format, shapes)."""
    from ..configuration import DeepseekV4MtpConfig

    probe = DeepseekV4MtpConfig.from_target_config(target_config, **overrides)
    with torch.device("meta"):
        model = cls._from_config(probe, dtype=dtype)
    units, layout, fmt, unused = build_plan(model, source.header, source.keys, overrides.get("expert_format"))
    if fmt != probe.expert_format:  # the format the release stores decides the model's
        config = DeepseekV4MtpConfig.from_target_config(target_config, **{**overrides, "expert_format": fmt})
        with torch.device("meta"):
            model = cls._from_config(config, dtype=dtype)
    shapes = {n: tuple(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    validate_plan(units, source.header, shapes, layout, fmt, model.config)
    if unused:
        logger.warning(
            f"{len(unused)} mtp tensor(s) in {source.path_or_repo} are not used by the MTP model: "
            + ", ".join(unused[:8]) + (", ..." if len(unused) > 8 else "")
        )
    return model, units, layout, fmt, shapes


def final_dtypes(model, dtype: torch.dtype):
    """-> function(name) -> the dtype a tensor is loaded in: ``dtype`` (what the meta model holds), except the
    fp32-kept modules, as transformers' loader does."""
    keep = sorted(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    keep_re = re.compile("|".join(re.escape(k) for k in keep)) if keep and dtype in (torch.float16, torch.bfloat16) else None
    metas = dict(list(model.named_parameters()) + list(model.named_buffers()))

    def final_dtype(name: str) -> torch.dtype:
        t = metas[name]
        if not t.is_floating_point():
            return t.dtype
        return torch.float32 if keep_re is not None and keep_re.search(name) else t.dtype

    return final_dtype


@dataclass
class ExpertBuffers:
    """An FP4Experts module's packed buffers, allocated on their device and filled slot by slot."""

    module: str
    bufs: dict
    g13: torch.Tensor
    g2: torch.Tensor
    inter: int

    @classmethod
    def allocate(cls, model, module: str, fmt: str, device_of) -> ExpertBuffers:
        from .. import fp4

        ex = model.get_submodule(module)
        e_n, i_n, d_n, group = ex.num_experts, ex.intermediate_size, ex.hidden_size, fp4.get_format(fmt).group_size
        packed = {
            "w13_weight": (e_n, 2 * i_n, d_n // 2), "w13_scale": (e_n, 2 * i_n, d_n // group),
            "w2_weight": (e_n, d_n, i_n // 2), "w2_scale": (e_n, d_n, i_n // group),
        }
        bufs = {k: torch.empty(s, dtype=torch.uint8, device=device_of(f"{module}.{k}")) for k, s in packed.items()}
        return cls(module, bufs, torch.ones(e_n, 2, dtype=torch.float32), torch.ones(e_n, dtype=torch.float32), i_n)

    def install(self, model, device_of) -> None:
        for k, b in self.bufs.items():
            _set_tensor(model, f"{self.module}.{k}", b)
        for k, g in (("w13_global_bits", self.g13), ("w2_global_bits", self.g2)):
            _set_tensor(model, f"{self.module}.{k}", g.view(torch.int32).to(device_of(f"{self.module}.{k}")))


def shard_reader(stack: ExitStack, source: NativeSource):
    """-> read(name) -> the stored tensor (on the CPU), opening each shard once inside ``stack``."""
    from safetensors import safe_open

    handles = {}

    def read(name: str) -> torch.Tensor:
        s = source.shard_of[name]
        if s not in handles:
            try:
                handles[s] = stack.enter_context(safe_open(source.shard_paths[s], framework="pt", device="cpu"))
            except Exception as e:  # noqa: BLE001
                raise MtpCheckpointError(f"Cannot open shard {source.shard_paths[s]}: {e}") from e
        try:
            return handles[s].get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise MtpCheckpointError(f"Cannot read tensor {name!r} from shard {s}: {e}") from e

    return read


def fill_units(model, units: list[Unit], read, layout: F.ExpertLayout, fmt: str, shapes: dict, final_dtype,
               device_of, experts: dict[str, ExpertBuffers], desc: str = "Loading DeepSeek-V4 MTP") -> None:
    """Read, decode and place every unit's tensors (shard by shard, one tensor at a time); routed experts go
    into ``experts[u.module]``."""
    bar = hf_logging.tqdm(total=sum(len(u.sources) for u in units), desc=desc, unit="tensor")
    try:
        for u in units:
            if u.kind == "plain":
                name = u.sources["value"]
                t = read(name)
                _check_finite(name, t)
                t = t.to(device=device_of(u.target), dtype=final_dtype(u.target)).reshape(shapes[u.target])
                _set_tensor(model, u.target, t.contiguous())
            elif u.kind == "linear":
                _set_tensor(model, u.target, _decode_linear(u, read, device_of(u.target), final_dtype(u.target)))
                if u.layout == "fp8_block":  # kept so that a release-layout export writes the release's own bytes
                    release_scales(model)[u.target] = read(u.sources["scale"]).clone()
            else:
                b = experts[u.module]
                _fill_expert(u, read, layout, fmt, b.bufs, b.g13, b.g2, b.inter)
            bar.update(len(u.sources))
    finally:
        bar.close()


def fill_native_model(model, source: NativeSource, units: list[Unit], layout: F.ExpertLayout, fmt: str,
                      shapes: dict, dtype: torch.dtype, device_of, desc: str = "Loading DeepSeek-V4 MTP") -> None:
    """Allocate the packed expert buffers, then fill the meta ``model`` from the release."""
    experts = {m: ExpertBuffers.allocate(model, m, fmt, device_of) for m in sorted({u.module for u in units
                                                                                   if u.kind == "expert"})}
    units = sorted(units, key=lambda u: (source.shard_of[next(iter(u.sources.values()))], u.kind))
    with ExitStack() as stack:
        fill_units(model, units, shard_reader(stack, source), layout, fmt, shapes, final_dtypes(model, dtype),
                   device_of, experts, desc)
    for b in experts.values():
        b.install(model, device_of)


def finalize_native_model(model, path_or_repo, dtype: torch.dtype, target_model=None):
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"Internal error: these MTP tensors were not loaded: {left}")
    model.config.dtype = dtype
    model.config._name_or_path = str(path_or_repo)
    model.name_or_path = str(path_or_repo)
    model.eval()
    if target_model is not None:
        model.bind(target_model)
    return model


def load_native_mtp(cls, path_or_repo, *, target_model=None, **kwargs):
    """Build ``cls`` (``DeepseekV4MtpForCausalLM``) from an original DeepSeek-V4 release."""
    from transformers import DeepseekV4Config

    opts = load_options(kwargs, cls)
    check_class(cls, drafter_kind(stored_names(path_or_repo, opts.hub), read_config_dict(path_or_repo, opts.hub),
                                  required=False))
    source = read_native_source(path_or_repo, opts.hub)  # 1. config, index, headers of the MTP shards
    target_config = opts.config if opts.config is not None else DeepseekV4Config.from_pretrained(path_or_repo, **opts.hub)
    dtype = resolve_dtype(opts.dtype, source.config_dict)
    model, units, layout, fmt, shapes = plan_native_model(cls, source, target_config, opts.overrides, dtype)  # 2.
    fill_native_model(model, source, units, layout, fmt, shapes, dtype, device_resolver(opts.device_map, target_model))
    return finalize_native_model(model, path_or_repo, dtype, target_model)


@torch.no_grad()
def _fill_expert(u: Unit, read, layout: F.ExpertLayout, fmt: str, bufs, g13, g2, inter: int) -> None:
    from .. import fp4

    e = u.expert
    if layout is F.DENSE_EXPERTS:
        name = u.sources["packed"]
        w = read(name)
        _check_finite(name, w)
        p, s, g = fp4.quantize_fp4(w.float(), fmt)
        g = g.reshape(())
    else:
        p = read(u.sources["packed"]).view(torch.uint8)
        s = fp4.scale_bytes(read(u.sources["scale"]))
        F.check_scale_bytes(u.sources["scale"], s, fmt)
        if "global" in u.sources:
            name = u.sources["global"]
            g = F.global_scale_value(layout, read(name))
            if not bool(torch.isfinite(g)) or float(g) <= 0:
                raise MtpCheckpointError(f"Tensor {name!r} holds an invalid global scale {float(g)!r}.")
        else:
            g = torch.tensor(1.0)
    if u.target == "w2":
        bufs["w2_weight"][e].copy_(p)
        bufs["w2_scale"][e].copy_(s)
        g2[e] = g
    else:
        rows = slice(0, inter) if u.target == "w1" else slice(inter, 2 * inter)
        bufs["w13_weight"][e, rows].copy_(p)
        bufs["w13_scale"][e, rows].copy_(s)
        g13[e, 0 if u.target == "w1" else 1] = g
