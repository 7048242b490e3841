"""Load the MTP layer straight from an original DeepSeek-V4 release (SPEC §6).

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
"""

from __future__ import annotations

import json
import os
import re
import struct
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.utils import logging as hf_logging

from . import formats as F
from .formats import MtpCheckpointError

logger = hf_logging.get_logger(__name__)

MTP_PREFIX = "mtp.0."
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

RELEASES_HINT = (
    "The MTP layer ships in the native deepseek-ai releases (e.g. deepseek-ai/DeepSeek-V4-Flash, "
    "deepseek-ai/DeepSeek-V4-Pro and their -Base variants) and in BF16 community conversions that kept the "
    "`mtp.*` tensors; several re-quantised releases (e.g. NVFP4 ones) drop it. Load the MTP from such a "
    "release (the target itself may come from any release with the same architecture)."
)

HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")
# from_pretrained keywords that mean nothing for a native load (accepted, ignored).
IGNORED_KWARGS = (
    "trust_remote_code", "low_cpu_mem_usage", "use_safetensors", "_from_auto", "_commit_hash",
    "attn_implementation", "output_loading_info", "weights_only", "key_mapping", "adapter_kwargs",
)

# native suffix (after `mtp.0.`) -> our parameter name; stored as BF16/F32 tensors.
PLAIN_TENSORS = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
    "hc_attn_fn": "block.attn_hc.fn",
    "hc_attn_base": "block.attn_hc.base",
    "hc_attn_scale": "block.attn_hc.scale",
    "hc_ffn_fn": "block.ffn_hc.fn",
    "hc_ffn_base": "block.ffn_hc.base",
    "hc_ffn_scale": "block.ffn_hc.scale",
    "attn_norm.weight": "block.input_layernorm.weight",
    "ffn_norm.weight": "block.post_attention_layernorm.weight",
    "attn.q_norm.weight": "block.self_attn.q_a_norm.weight",
    "attn.kv_norm.weight": "block.self_attn.kv_norm.weight",
    "attn.attn_sink": "block.self_attn.sinks",
    "ffn.gate.bias": "block.mlp.gate.e_score_correction_bias",
}

# native module (after `mtp.0.`) -> our module; `.weight` possibly FP8 with a block `.scale`.
LINEAR_MODULES = {
    "e_proj": "e_proj",
    "h_proj": "h_proj",
    "attn.wq_a": "block.self_attn.q_a_proj",
    "attn.wq_b": "block.self_attn.q_b_proj",
    "attn.wkv": "block.self_attn.kv_proj",
    "attn.wo_a": "block.self_attn.o_a_proj",
    "attn.wo_b": "block.self_attn.o_b_proj",
    "ffn.gate": "block.mlp.gate",
    "ffn.shared_experts.w1": "block.mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3": "block.mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "block.mlp.shared_experts.down_proj",
}

EXPERTS = "block.mlp.experts"
EXPERT_MATRICES = ("w1", "w3", "w2")
# Duplicates of the target's embedding / head that some conversions store under mtp.*.
SHARED_DUPLICATES = re.compile(r"^mtp\.\d+\.(emb|embed|embed_tokens|head|shared_head)\.")


# -- locating files ---------------------------------------------------------------------------------


def hub_kwargs(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in HUB_KWARGS if kwargs.get(k) is not None}


def resolve_file(path_or_repo, filename: str, hub: dict, required: bool = True) -> str | None:
    """Local folder or Hub repo (downloaded into / read from the HF cache, offline-aware)."""
    from transformers.utils.hub import cached_file

    return cached_file(
        path_or_repo, filename, _raise_exceptions_for_missing_entries=required,
        _raise_exceptions_for_connection_errors=required, **hub,
    )


def read_config_dict(path_or_repo, hub: dict) -> dict | None:
    path = resolve_file(path_or_repo, CONFIG_FILE, hub, required=False)
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def is_native_checkpoint(path_or_repo, kwargs: dict) -> bool:
    """True if ``path_or_repo`` is an original DeepSeek-V4 release (``model_type: deepseek_v4``)."""
    config = kwargs.get("config")
    if config is not None and not isinstance(config, (str, os.PathLike)):
        return getattr(config, "model_type", None) == "deepseek_v4"
    try:
        cfg = read_config_dict(path_or_repo, hub_kwargs(kwargs))
    except Exception:  # let transformers' own loader report unreadable paths
        return False
    return isinstance(cfg, dict) and cfg.get("model_type") == "deepseek_v4"


def read_weight_map(path_or_repo, hub: dict) -> tuple[dict[str, str], str | None]:
    """(tensor name -> shard file, the path of a single-file checkpoint or None) from the index, or from
    ``model.safetensors`` when there is no index."""
    index_path = resolve_file(path_or_repo, INDEX_FILE, hub, required=False)
    if index_path is not None:
        with open(index_path, encoding="utf-8") as f:
            return json.load(f).get("weight_map") or {}, None
    single = resolve_file(path_or_repo, SINGLE_FILE, hub, required=False)
    if single is None:
        raise MtpCheckpointError(
            f"{path_or_repo} has neither {INDEX_FILE} nor {SINGLE_FILE} (or they could not be fetched): "
            "not a safetensors DeepSeek-V4 release."
        )
    return dict.fromkeys(read_safetensors_header(single), SINGLE_FILE), single


def read_safetensors_header(path: str) -> dict[str, tuple[str, tuple]]:
    """name -> (dtype string, shape), with sanity checks that name the broken tensor."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise MtpCheckpointError(f"Shard {path} is truncated or not a safetensors file (size {size} bytes).")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 512 * 1024 * 1024:
            raise MtpCheckpointError(f"Shard {path} is corrupt: its header claims {n} bytes but the file has {size}.")
        try:
            meta = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MtpCheckpointError(f"Shard {path} is corrupt: unreadable safetensors header ({e}).") from None
    data_size = size - 8 - n
    out = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        torch_dtype = F.SAFETENSORS_DTYPES.get(dtype)
        numel = 1
        for d in shape:
            numel *= d
        item = torch.empty((), dtype=torch_dtype).element_size() if torch_dtype is not None else None
        if end > data_size or start > end or (item is not None and end - start != numel * item):
            raise MtpCheckpointError(
                f"Tensor {name!r} in shard {path} is corrupt: {dtype} {list(shape)} needs "
                f"{numel * (item or 0)} bytes, the header gives bytes [{start}, {end}) of {data_size}."
            )
        out[name] = (dtype, shape)
    return out


# -- the plan: which native tensors fill which parameter ----------------------------------------------


@dataclass
class Unit:
    kind: str  # "plain" | "linear" | "expert"
    target: str  # our parameter name (plain/linear) or the expert matrix "w1"/"w3"/"w2"
    sources: dict = field(default_factory=dict)  # role -> native tensor name
    layout: str = ""  # linear: "float" | "fp8_block" | "fp8_tensor" | "nvfp4"; expert: ExpertLayout.name
    expert: int = -1


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


def build_plan(model, header: dict, mtp_keys: list[str], expert_format_override: str | None):
    """-> (units, expert layout, FP4 format, unused keys); raises on missing tensors."""
    config = model.config
    missing: list[str] = []
    units: list[Unit] = []
    for suffix, target in PLAIN_TENSORS.items():
        name = MTP_PREFIX + suffix
        if name in header:
            units.append(Unit("plain", target, {"value": name}))
        else:
            missing.append(name)
    for suffix, target in LINEAR_MODULES.items():
        if "shared_experts" in suffix and not config.n_shared_experts:
            continue
        unit = _linear_unit(MTP_PREFIX + suffix, target + ".weight", header, missing)
        if unit is not None:
            units.append(unit)

    # Routed experts: the layout is read from names and dtypes of the first expert present.
    present = sorted(
        {int(m.group(1)) for k in mtp_keys if (m := re.match(rf"^{re.escape(MTP_PREFIX)}ffn\.experts\.(\d+)\.", k))}
    )
    layout = None
    for e in present:
        layout = F.detect_expert_layout(f"{MTP_PREFIX}ffn.experts.{e}.w1", header) or F.detect_expert_layout(
            f"{MTP_PREFIX}ffn.experts.{e}.w2", header
        )
        if layout is not None:
            break
    if layout is None:
        layout = F.MXFP4_NATIVE  # nothing there: everything below is reported missing
    if layout.format is not None:
        if expert_format_override not in (None, layout.format):
            raise MtpCheckpointError(
                f"This release stores the routed experts as {layout.name}; `expert_format="
                f"{expert_format_override!r}` would need a lossy re-quantisation. Leave `expert_format` unset."
            )
        fmt = layout.format
    else:
        fmt = expert_format_override or "mxfp4"
    for e in range(config.n_routed_experts):
        for m in EXPERT_MATRICES:
            srcs = layout.keys(f"{MTP_PREFIX}ffn.experts.{e}.{m}")
            absent = [k for k in srcs.values() if k not in header]
            if absent:
                missing.extend(absent)
            else:
                units.append(Unit("expert", m, srcs, layout.name, e))

    if missing:
        shown = ", ".join(missing[:12]) + (", ..." if len(missing) > 12 else "")
        raise MtpCheckpointError(
            f"The MTP layer in this checkpoint is incomplete: {len(missing)} required tensor(s) are missing "
            f"(expert layout detected: {layout.name}): {shown}. {RELEASES_HINT}"
        )
    used = {k for u in units for k in u.sources.values()}
    ignored = {MTP_PREFIX + f"ffn.experts.{e}.{m}.{s}" for e in present for m in EXPERT_MATRICES for s in layout.ignored}
    ignored |= {k for k in mtp_keys if k.endswith((".input_scale", ".input_global_scale"))}
    unused = [k for k in mtp_keys if k not in used and k not in ignored and not SHARED_DUPLICATES.match(k)]
    return units, layout, fmt, unused


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
                _expect(u.sources["scale"], header, F.BLOCK_SCALE_DTYPES, F.fp8_scale_shape((n, k)),
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
        s = F.decode_block_scale(scale)
        _check_finite(u.sources["scale"], s)
        if u.layout == "fp8_tensor":  # ModelOpt FP8: one scale per tensor (or per output row)
            s = s.to(device).reshape(-1, 1) if s.numel() > 1 else s.to(device).reshape(())
            out = (w.float() * s).to(dtype)
        else:
            out = F.dequantize_fp8_block(w, scale, dtype)
        _check_finite(u.sources["weight"], out)
        return out
    nv = F.NVFP4_COMPRESSED_TENSORS if "weight_packed" in u.sources["packed"] else F.NVFP4_MODELOPT
    from .. import fp4

    g = F.global_scale_value(nv, read(u.sources["global"]))
    raw = fp4.scale_bytes(read(u.sources["scale"]))
    F.check_scale_bytes(u.sources["scale"], raw, "nvfp4")
    return fp4.dequantize_fp4(read(u.sources["packed"]).to(device), raw.to(device), "nvfp4", g.to(device), dtype)


def load_native_mtp(cls, path_or_repo, *, target_model=None, **kwargs):
    """Build ``cls`` (``DeepseekV4MtpForCausalLM``) from an original DeepSeek-V4 release."""
    from safetensors import safe_open
    from transformers import DeepseekV4Config

    from .. import fp4
    from ..configuration import DeepseekV4MtpConfig

    hub = hub_kwargs(kwargs)
    dtype = kwargs.pop("dtype", None)
    torch_dtype = kwargs.pop("torch_dtype", None)
    dtype = dtype if dtype is not None else torch_dtype
    device_map = kwargs.pop("device_map", None)
    for k in HUB_KWARGS + IGNORED_KWARGS:
        kwargs.pop(k, None)
    passed_config = kwargs.pop("config", None)
    fields = set(DeepseekV4MtpConfig.__annotations__)
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
    if kwargs:
        raise TypeError(f"Unexpected keyword argument(s) for loading a native DeepSeek-V4 MTP: {sorted(kwargs)}.")

    # 1. config + index (the only files besides the MTP shards that are fetched).
    config_dict = read_config_dict(path_or_repo, hub) or {}
    weight_map, single = read_weight_map(path_or_repo, hub)
    mtp_keys = sorted(k for k in weight_map if k.startswith("mtp."))
    if not mtp_keys:
        nextn = config_dict.get("num_nextn_predict_layers")
        raise MtpCheckpointError(
            f"{path_or_repo} has no MTP layer: its weight index lists {len(weight_map)} tensors but none under "
            f"`mtp.*` (expected `mtp.0.*`; config.json num_nextn_predict_layers={nextn!r}). {RELEASES_HINT}"
        )
    extra_layers = sorted({k.split(".")[1] for k in mtp_keys} - {"0"})
    if extra_layers:
        logger.warning(f"Ignoring MTP layer(s) mtp.{extra_layers} in {path_or_repo}: only mtp.0 is used.")
        mtp_keys = [k for k in mtp_keys if k.startswith(MTP_PREFIX)]

    target_config = passed_config if passed_config is not None else DeepseekV4Config.from_pretrained(path_or_repo, **hub)
    dtype = resolve_dtype(dtype, config_dict)

    # 2. only the shards holding mtp.* tensors.
    shard_names = sorted({weight_map[k] for k in mtp_keys})
    shard_paths = {s: (single if single is not None else resolve_file(path_or_repo, s, hub)) for s in shard_names}
    header: dict = {}
    for s, p in shard_paths.items():
        h = read_safetensors_header(p)
        for k in mtp_keys:
            if weight_map[k] == s:
                if k not in h:
                    raise MtpCheckpointError(f"The index places tensor {k!r} in shard {s}, but that shard does not hold it.")
                header[k] = h[k]
    shard_of = {k: weight_map[k] for k in mtp_keys}

    # 3. config (expert format from tensor names/dtypes) + meta model + plan checks.
    probe = DeepseekV4MtpConfig.from_target_config(target_config, **overrides)
    with torch.device("meta"):
        probe_model = cls._from_config(probe, dtype=dtype)
    units, layout, fmt, unused = build_plan(probe_model, header, mtp_keys, overrides.get("expert_format"))
    config = DeepseekV4MtpConfig.from_target_config(target_config, **{**overrides, "expert_format": fmt})
    if fmt != probe.expert_format:
        with torch.device("meta"):
            model = cls._from_config(config, dtype=dtype)
    else:
        model, config = probe_model, probe
    shapes = {n: tuple(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    validate_plan(units, header, shapes, layout, fmt, config)
    if unused:
        logger.warning(
            f"{len(unused)} mtp tensor(s) in {path_or_repo} are not used by the MTP model: "
            + ", ".join(unused[:8]) + (", ..." if len(unused) > 8 else "")
        )

    # Final dtypes: `dtype`, except the fp32-kept modules (as transformers' loader does).
    keep = sorted(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    keep_re = re.compile("|".join(re.escape(k) for k in keep)) if keep and dtype in (torch.float16, torch.bfloat16) else None
    metas = dict(list(model.named_parameters()) + list(model.named_buffers()))

    def final_dtype(name: str) -> torch.dtype:
        t = metas[name]
        if not t.is_floating_point():
            return t.dtype
        return torch.float32 if keep_re is not None and keep_re.search(name) else t.dtype

    device_of = device_resolver(device_map, target_model)

    # Packed expert buffers, allocated once on their device and filled slot by slot.
    ex = model.get_submodule(EXPERTS)
    e_n, i_n, d_n, group = ex.num_experts, ex.intermediate_size, ex.hidden_size, fp4.get_format(fmt).group_size
    packed = {
        "w13_weight": (e_n, 2 * i_n, d_n // 2), "w13_scale": (e_n, 2 * i_n, d_n // group),
        "w2_weight": (e_n, d_n, i_n // 2), "w2_scale": (e_n, d_n, i_n // group),
    }
    bufs = {k: torch.empty(s, dtype=torch.uint8, device=device_of(f"{EXPERTS}.{k}")) for k, s in packed.items()}
    g13 = torch.ones(e_n, 2, dtype=torch.float32)
    g2 = torch.ones(e_n, dtype=torch.float32)

    # 4. read, decode, place; shard by shard.
    units.sort(key=lambda u: (shard_of[next(iter(u.sources.values()))], u.kind))
    total = sum(len(u.sources) for u in units)
    with ExitStack() as stack:
        handles = {}

        def read(name: str) -> torch.Tensor:
            s = shard_of[name]
            if s not in handles:
                try:
                    handles[s] = stack.enter_context(safe_open(shard_paths[s], framework="pt", device="cpu"))
                except Exception as e:  # noqa: BLE001
                    raise MtpCheckpointError(f"Cannot open shard {shard_paths[s]}: {e}") from e
            try:
                return handles[s].get_tensor(name)
            except Exception as e:  # noqa: BLE001
                raise MtpCheckpointError(f"Cannot read tensor {name!r} from shard {s}: {e}") from e

        bar = hf_logging.tqdm(total=total, desc="Loading DeepSeek-V4 MTP", unit="tensor")
        try:
            for u in units:
                if u.kind == "plain":
                    name = u.sources["value"]
                    t = read(name)
                    _check_finite(name, t)
                    t = t.to(device=device_of(u.target), dtype=final_dtype(u.target)).reshape(shapes[u.target])
                    _set_tensor(model, u.target, t.contiguous())
                elif u.kind == "linear":
                    t = _decode_linear(u, read, device_of(u.target), final_dtype(u.target))
                    _set_tensor(model, u.target, t)
                else:
                    _fill_expert(u, read, layout, fmt, bufs, g13, g2, i_n)
                bar.update(len(u.sources))
        finally:
            bar.close()

    for k, b in bufs.items():
        _set_tensor(model, f"{EXPERTS}.{k}", b)
    _set_tensor(model, f"{EXPERTS}.w13_global_bits", g13.view(torch.int32).to(device_of(f"{EXPERTS}.w13_global_bits")))
    _set_tensor(model, f"{EXPERTS}.w2_global_bits", g2.view(torch.int32).to(device_of(f"{EXPERTS}.w2_global_bits")))

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
