"""Export a drafter in the layout of DeepSeek's own releases, for serving engines (design §1, SPEC §6).

vLLM (``--speculative-config '{"method": "mtp", "model": DIR, ...}'``, or ``"method": "dspark"``) and SGLang
(``--speculative-draft-model-path DIR``) read a standalone V4 draft the way they read the release it came from:

* tensors under DeepSeek's names, ``mtp.0.*`` (DSpark: ``mtp.0..N-1.*``), in the release's formats: FP8 e4m3
  linears with an E8M0 ``.scale`` per 128x128 block, MXFP4 routed experts (I8 packed e2m1 + E8M0 ``.scale`` per
  32), the router weight and norms BF16, mHC, sinks and the router bias F32; no embedding, no lm head (the
  engine shares the target's);
* a ``config.json`` that is the TARGET's (``model_type: deepseek_v4``, its ``num_hidden_layers``: engines place
  ``mtp.i`` at layer ``num_hidden_layers + i``), with ``num_nextn_predict_layers`` as the release has it, the
  release's quantization config, DeepSeek's field names (``compress_ratios``, ``num_hash_layers``, ...) beside
  transformers' own, and for an MTP no ``dspark_*`` key;
* a directory whose name holds none of the words engines read as another method (``eagle-``, ``eagle3``,
  ``dflash``, and for an MTP ``dspark``).

The tensor names are not a second table: :func:`release_plan` describes the release's tensors with the release
loader's own tables (:mod:`.native`, :mod:`.dspark`) and runs the loader's own planning on that description, so
every unit the loader would read is written by inverting that unit (:func:`encode_units`).  Loading the export
back with ``from_pretrained(dir, target_model=target)`` gives the drafter again: bit for bit for a drafter
loaded from a release (the FP8 scales it was loaded with are kept, :func:`.native.release_scales`), and the
values quantised to the release's formats for any other (a BF16 or trained draft, NVFP4 experts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from .. import fp4
from ..fp8 import FP8_BLOCK, fp8_scale_shape, quantize_fp8_block
from . import formats as F
from . import native as N
from .files import CONFIG_FILE, INDEX_FILE, read_config_dict

logger = hf_logging.get_logger(__name__)

LAYOUTS = ("transformers", "release")
# In the index metadata of every release-layout export: marks the files listed there as ours (a later export into
# the same directory may replace them).
EXPORT_MARK = ("dsv4_mtp_hf", "release_export")
# DeepSeek's quantization config of the V4 releases (FP8 e4m3 linears, E8M0 128x128 block scales); the routed
# experts' format is the top-level ``expert_dtype``.
RELEASE_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                        "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
# Words vLLM reads in a draft's path as a speculative method of its own (before it looks at the config).
METHOD_WORDS = {"eagle-": "eagle", "eagle3": "eagle3", "dflash": "dflash", "dspark": "dspark"}
# Native linears a release stores in BF16 rather than FP8 (the router).
BF16_LINEARS = ("ffn.gate",)
_LAYER_TYPE_RATIO = {"sliding_attention": 0}


# -- what a release stores ---------------------------------------------------------------------------------------


def _is_dspark(model) -> bool:
    return getattr(model.config, "model_type", None) == "deepseek_v4_dspark"


def release_groups(model) -> tuple[list[tuple[str, str, dict, dict]], list[tuple[str, str]]]:
    """The drafter's tensors as the release loader's tables place them: (groups ``(native prefix, our prefix,
    plain table, linear table)``, blocks ``(native prefix, our block module prefix)``)."""
    if _is_dspark(model):
        from . import dspark as D

        n = model.config.num_draft_layers
        groups = [("mtp.0.", "", D.INPUT_PLAIN, D.INPUT_LINEAR), (f"mtp.{n - 1}.", "", D.HEAD_PLAIN, {})]
        return groups, [(f"mtp.{i}.", f"layers.{i}.") for i in range(n)]
    return [(N.MTP_PREFIX, "", N.MTP_PLAIN, N.MTP_LINEAR)], [(N.MTP_PREFIX, N.MTP_BLOCK)]


def _plain_dtype(suffix: str) -> str:
    """The release's dtype of a plain tensor: norm and head weights BF16; mHC, sinks, the router bias F32."""
    return "BF16" if suffix.endswith(".weight") else "F32"


def release_header(model) -> dict[str, tuple[str, tuple]]:
    """name -> (safetensors dtype, shape) of every tensor the release stores for this drafter."""
    shapes = {n: tuple(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    config = model.config
    header: dict[str, tuple[str, tuple]] = {}

    def add(src, dst, plain, linear):
        for suffix, ours in plain.items():
            header[src + suffix] = (_plain_dtype(suffix), shapes[dst + ours])
        for suffix, ours in linear.items():
            if not config.n_shared_experts and "shared_experts" in suffix:
                continue
            shape = shapes[dst + ours + ".weight"]
            if suffix in BF16_LINEARS:
                header[f"{src}{suffix}.weight"] = ("BF16", shape)
            else:
                header[f"{src}{suffix}.weight"] = ("F8_E4M3", shape)
                header[f"{src}{suffix}.scale"] = ("F8_E8M0", fp8_scale_shape(shape))

    groups, blocks = release_groups(model)
    for src, dst, plain, linear in groups:
        add(src, dst, plain, linear)
    d, i = config.hidden_size, config.moe_intermediate_size
    group = fp4.MXFP4.group_size
    for src, dst in blocks:
        add(src, dst, N.BLOCK_PLAIN, N.BLOCK_LINEAR)
        for e in range(config.n_routed_experts):
            for m in N.EXPERT_MATRICES:
                n, k = (i, d) if m in ("w1", "w3") else (d, i)
                pre = f"{src}{N.BLOCK_EXPERTS[0]}.{e}.{m}"
                header[pre + ".weight"] = ("I8", (n, k // 2))
                header[pre + ".scale"] = ("F8_E8M0", (n, k // group))
    return header


def release_plan(model) -> tuple[dict, list[N.Unit]]:
    """(header, units): the release's tensors (:func:`release_header`) and the release loader's own plan for them
    (which of our tensors each native tensor fills), checked as the loader checks a release."""
    header = release_header(model)
    keys = sorted(header)
    if _is_dspark(model):
        from .dspark import build_dspark_plan

        units, layout, fmt, unused = build_dspark_plan(model, header, keys, "mxfp4")
    else:
        units, layout, fmt, unused = N.build_plan(model, header, keys, "mxfp4")
    ours = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    N.validate_plan(units, header, ours, layout, fmt, model.config)
    read = {k for u in units for k in u.sources.values()}
    filled = {u.target for u in units if u.kind != "expert"} | {
        f"{u.module}.{b}" for u in units if u.kind == "expert"
        for b in ("w13_weight", "w13_scale", "w13_global_bits", "w2_weight", "w2_scale", "w2_global_bits")}
    left = sorted(set(ours) - filled)
    if unused or read != set(header) or layout is not F.MXFP4_NATIVE or left:
        raise RuntimeError(f"Internal error: the release layout and the loader's plan disagree (unused {unused[:4]}, "
                           f"unread {sorted(set(header) - read)[:4]}, our tensors not written {left[:4]}).")
    return header, units


# -- encoding each unit -------------------------------------------------------------------------------------------


def _expand(grid: torch.Tensor, shape: tuple[int, int], block: int = FP8_BLOCK) -> torch.Tensor:
    n, k = shape
    return grid.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


def _as_e8m0(scale: torch.Tensor) -> torch.Tensor | None:
    """A stored block scale as E8M0 bytes (None: a float scale that is not a power of two)."""
    if scale.dtype == torch.uint8 or scale.dtype == F.SAFETENSORS_DTYPES["F8_E8M0"]:
        return scale.view(torch.uint8)
    s = scale.float()
    m, e = torch.frexp(s)
    if not bool(((m == 0.5) & (s > 0)).all()):
        return None
    raw = e.to(torch.int32) - 1 + 127
    return raw.to(torch.uint8) if bool(((raw >= 0) & (raw < 255)).all()) else None


@torch.no_grad()
def encode_fp8(w: torch.Tensor, stored_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A weight as FP8 e4m3 + E8M0 block scale -> (weight, scale as ``float8_e8m0fnu``, reused).  ``stored_scale``
    (the scale the weight was loaded with) is reused when it reproduces ``w`` exactly (the release's own bytes);
    otherwise DeepSeek's recipe quantises ``w`` (:func:`dsv4_mtp_hf.fp8.quantize_fp8_block`)."""
    w = w.detach().float().cpu()
    e8m0 = F.SAFETENSORS_DTYPES["F8_E8M0"]
    raw = _as_e8m0(stored_scale) if stored_scale is not None else None
    if raw is not None and tuple(raw.shape) == fp8_scale_shape(tuple(w.shape)) and bool((raw < 255).all()):
        full = _expand(fp4.decode_scales(raw, fp4.MXFP4), tuple(w.shape))
        q = (w / full).to(torch.float8_e4m3fn)
        if torch.equal(q.float() * full, w):
            return q, raw.clone().view(e8m0), True
    q, s = quantize_fp8_block(w)
    return q, s, False


@torch.no_grad()
def encode_expert(module, e: int, matrix: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Routed expert ``e``'s ``w1``/``w3``/``w2`` as MXFP4 -> (I8 packed, E8M0 scale, exact).  Packed MXFP4 experts
    are copied as they are; other formats (NVFP4) are decoded and quantised to MXFP4 (lossy)."""
    inter = module.intermediate_size
    rows = {"w1": slice(0, inter), "w3": slice(inter, 2 * inter), "w2": slice(None)}[matrix]
    if matrix == "w2":
        packed, scale, glob = module.w2_weight[e], module.w2_scale[e], module.w2_global[e]
    else:
        packed, scale = module.w13_weight[e, rows], module.w13_scale[e, rows]
        glob = module.w13_global[e, 0 if matrix == "w1" else 1]
    e8m0 = F.SAFETENSORS_DTYPES["F8_E8M0"]
    if module.format is fp4.MXFP4 and float(glob) == 1.0:
        return packed.cpu().view(torch.int8).clone(), scale.cpu().view(e8m0).clone(), True
    dense = fp4.dequantize_fp4(packed.cpu(), scale.cpu(), module.format, glob.cpu())
    p, s, _ = fp4.quantize_fp4(dense, fp4.MXFP4)
    return p.view(torch.int8), s.view(e8m0), False


def encode_units(model, header: dict, units: list[N.Unit]) -> dict[str, torch.Tensor]:
    """Every release tensor of the drafter, by inverting each unit of the loader's plan."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    scales = model.__dict__.get(N.RELEASE_SCALES) or {}
    out: dict[str, torch.Tensor] = {}
    requantised = []
    for u in units:
        if u.kind == "plain":
            name = u.sources["value"]
            dtype, shape = header[name]
            out[name] = tensors[u.target].detach().cpu().to(F.SAFETENSORS_DTYPES[dtype]).reshape(shape).contiguous()
        elif u.kind == "linear":
            w = tensors[u.target]
            if u.layout == "float":
                out[u.sources["weight"]] = w.detach().cpu().to(torch.bfloat16).contiguous()
            else:
                q, s, _ = encode_fp8(w, scales.get(u.target))
                out[u.sources["weight"]], out[u.sources["scale"]] = q, s
        else:
            p, s, exact = encode_expert(model.get_submodule(u.module), u.expert, u.target)
            out[u.sources["packed"]], out[u.sources["scale"]] = p, s
            if not exact:
                requantised.append(u.sources["packed"])
    if requantised:
        logger.warning(f"The release layout stores the routed experts as MXFP4; this drafter's are "
                       f"{model.config.expert_format}: {len(requantised)} expert matrices were quantised to MXFP4 "
                       "(lossy). Export a drafter loaded from an MXFP4 release to keep its experts bit for bit.")
    return out


# -- config.json -------------------------------------------------------------------------------------------------


def _target_config_dict(model, target_config) -> dict:
    """The target's config as a dict: ``target_config`` (a ``DeepseekV4Config``, its dict, or the path / Hub id of the
    release whose ``config.json`` is copied as it is), else the bound target's config."""
    if target_config is None:
        target = getattr(model, "target_model", None)
        if target is None:
            raise ValueError(
                "The release layout writes the TARGET's config.json (engines build the drafter from it, at layer "
                "num_hidden_layers): bind the drafter to its target first (`drafter.bind(target)`), or pass "
                "`target_config=` (the target's DeepseekV4Config, its dict, or the release's path or Hub id, whose "
                "config.json is then copied as it is).")
        target_config = target.config
    if isinstance(target_config, (str, os.PathLike)):
        cfg = read_config_dict(target_config, {})
        if cfg is None:
            raise ValueError(f"target_config={os.fspath(target_config)!r}: no config.json there.")
        return dict(cfg)
    if isinstance(target_config, dict):
        return json.loads(json.dumps(target_config))
    if hasattr(target_config, "to_dict"):
        return json.loads(json.dumps(target_config.to_dict(), default=str))
    raise TypeError(f"target_config must be a DeepseekV4Config, a dict or a path, got {type(target_config).__name__}.")


def _release_names(cfg: dict, extra_layers: int) -> None:
    """Add DeepSeek's own field names (what engines read) where only transformers' are present: ``compress_ratios``
    (one per target layer, then 0 for each drafter layer: sliding-window only), ``num_hash_layers``,
    ``qk_rope_head_dim``, ``rope_theta`` / ``compress_rope_theta`` and a YaRN ``rope_scaling``."""
    n = cfg.get("num_hidden_layers")
    layer_types = cfg.get("layer_types")
    if "compress_ratios" not in cfg and isinstance(layer_types, list) and n is not None:
        rates = {**(cfg.get("compress_rates") or {}), **_LAYER_TYPE_RATIO}
        cfg["compress_ratios"] = [int(rates[t]) for t in layer_types[:n]] + [0] * extra_layers
    mlp = cfg.get("mlp_layer_types")
    if "num_hash_layers" not in cfg and isinstance(mlp, list):
        hashed = 0
        while hashed < len(mlp) and mlp[hashed] == "hash_moe":
            hashed += 1
        cfg["num_hash_layers"] = hashed
    rope = cfg.get("rope_parameters") or {}
    main, compress = rope.get("main"), rope.get("compress")
    if isinstance(main, dict):
        cfg.setdefault("rope_theta", main.get("rope_theta"))
    if isinstance(compress, dict):
        cfg.setdefault("compress_rope_theta", compress.get("rope_theta"))
        if compress.get("rope_type") == "yarn" and "rope_scaling" not in cfg:
            cfg["rope_scaling"] = {"type": "yarn", **{k: v for k, v in compress.items() if k not in (
                "rope_type", "rope_theta", "partial_rotary_factor", "attention_factor")}}
    if "qk_rope_head_dim" not in cfg and cfg.get("head_dim") and cfg.get("partial_rotary_factor"):
        cfg["qk_rope_head_dim"] = int(round(cfg["head_dim"] * cfg["partial_rotary_factor"]))


def release_config(model, target_config=None) -> dict:
    """The ``config.json`` of a release-layout export: the target's config (:func:`_target_config_dict`) with
    ``model_type: deepseek_v4``, the release's quantization config, DeepSeek's field names, the drafter's own fields
    (DSpark: ``dspark_*``; an MTP: ``num_nextn_predict_layers: 1`` and no ``dspark_*``); checked against the drafter
    (the shapes an engine builds from it must be the drafter's)."""
    cfg = _target_config_dict(model, target_config)
    if cfg.get("model_type") not in (None, "deepseek_v4"):
        raise ValueError(f"target_config is a {cfg.get('model_type')!r} config; the release layout needs the "
                         "DeepSeek-V4 target's (model_type 'deepseek_v4').")
    for k in [k for k in cfg if k.startswith("_") or k in ("auto_map", "transformers_version")]:
        del cfg[k]
    c = model.config
    cfg["model_type"] = "deepseek_v4"
    cfg["architectures"] = ["DeepseekV4ForCausalLM"]
    if cfg.get("dtype") is None and cfg.get("torch_dtype") is None:
        cfg["dtype"] = "bfloat16"
    cfg["quantization_config"] = json.loads(json.dumps(RELEASE_QUANTIZATION))
    cfg["expert_dtype"] = "fp4"
    if _is_dspark(model):
        cfg.update(dspark_block_size=c.dspark_block_size, dspark_noise_token_id=c.dspark_noise_token_id,
                   dspark_target_layer_ids=list(c.dspark_target_layer_ids), dspark_markov_rank=c.dspark_markov_rank)
        cfg.setdefault("num_nextn_predict_layers", 1)  # 0731 keeps the legacy 1 beside its DSpark drafter
        extra = c.num_draft_layers
        if cfg.get("num_hidden_layers") != c.num_target_layers:
            raise ValueError(f"The drafter reads a {c.num_target_layers}-layer target; target_config has "
                             f"num_hidden_layers={cfg.get('num_hidden_layers')}.")
    else:
        for k in [k for k in cfg if k.startswith("dspark_")]:
            del cfg[k]
        cfg["num_nextn_predict_layers"] = 1
        extra = 1
    _release_names(cfg, extra)
    _check_config_matches(model, cfg)
    return cfg


def _check_config_matches(model, cfg: dict) -> None:
    from ..configuration import TARGET_FIELDS, DeepseekV4DraftConfig

    c = model.config
    try:
        expected = DeepseekV4DraftConfig.from_target_config(cfg, expert_format=c.expert_format)
    except (TypeError, ValueError) as e:
        raise ValueError(f"target_config does not describe a DeepSeek-V4 target: {e}") from None
    skip = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "max_position_embeddings")
    bad = [f"{k}: drafter {getattr(c, k)!r} vs target_config {getattr(expected, k)!r}"
           for k in (*TARGET_FIELDS, "qk_rope_head_dim") if k not in skip and getattr(c, k) != getattr(expected, k)]
    if bad:
        raise ValueError("target_config does not match this drafter (an engine would build other shapes from it): "
                         + "; ".join(bad) + ". Pass the config of the target this drafter belongs to.")


# -- the directory -------------------------------------------------------------------------------------------------


def check_directory_name(save_directory, model, repo_id: str | None = None) -> None:
    """Refuse a path (or Hub repo id) holding a word that makes vLLM pick another speculative method from the path
    before it reads the config (``eagle-``, ``eagle3``, ``dflash``; for an MTP also ``dspark``)."""
    words = {w: m for w, m in METHOD_WORDS.items() if not (_is_dspark(model) and m == "dspark")}
    what = "DSpark drafter" if _is_dspark(model) else "MTP draft"
    for path in filter(None, (os.fspath(save_directory), os.path.abspath(save_directory), repo_id)):
        for word, method in words.items():
            if word in path.lower():
                raise ValueError(
                    f"Refusing to export the {what} to {path!r}: the path contains {word!r}, and vLLM infers the "
                    f"speculative method from a draft's path before its config (it would load this as '{method}'). "
                    f"Choose a path without {', '.join(repr(w) for w in words)} (e.g. '.../dsv4-mtp-release').")


def _earlier_export(save_directory) -> set[str]:
    try:
        with open(os.path.join(save_directory, INDEX_FILE), encoding="utf-8") as f:
            index = json.load(f)
        if index.get("metadata", {}).get(EXPORT_MARK[0]) == EXPORT_MARK[1]:
            return {s for s in index["weight_map"].values() if isinstance(s, str) and os.path.dirname(s) == ""}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass
    return set()


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def save_release_layout(model, save_directory, target_config=None, max_shard_size: int | str = "5GB",
                        is_main_process: bool = True, **kwargs) -> list[str]:
    """Write ``model`` (an MTP or DSpark drafter) into ``save_directory`` in the release layout (module docstring):
    ``config.json``, ``model.safetensors.index.json`` and ``model-XXXXX-of-YYYYY.safetensors`` shards.  Returns
    the files written.  ``target_config``: see :func:`release_config`.  ``push_to_hub`` (and ``repo_id``,
    ``commit_message``, ``private``, ``token``) uploads the folder afterwards.

    Refused before anything is written: a directory holding another model's files (e.g. the release itself,
    :mod:`.save_guard`; an earlier export of ours is replaced, and only the files it listed are removed), a path
    whose name engines read as another method (:func:`check_directory_name`)."""
    from transformers.utils.hub import convert_file_size_to_int
    from safetensors.torch import save_file

    from .remote_code import pop_push_arguments, push_saved_folder
    from .save_guard import check_save_directory

    push = pop_push_arguments(kwargs)
    kwargs.pop("safe_serialization", None)
    if kwargs:
        raise TypeError(f"save_pretrained(layout='release') does not take {sorted(kwargs)}.")
    check_directory_name(save_directory, model, push["repo_id"] if push["push_to_hub"] else None)
    if getattr(model.config, "draft_vocab_ids", None) is not None or getattr(model.config, "mtp_vocab_size", None):
        logger.warning("The release layout has no field for a reduced draft vocabulary (draft_vocab_ids / "
                       "mtp_vocab_size): engines loading this export draft over the full vocabulary.")
    what = "DeepSeek-V4 DSpark drafter" if _is_dspark(model) else "DeepSeek-V4 MTP draft"
    earlier = _earlier_export(save_directory)
    check_save_directory(save_directory, "deepseek_v4", lambda name: name.startswith("mtp."),
                         f"{what} (release layout)",
                         owns_file=lambda f: f in earlier or (f == INDEX_FILE and bool(earlier)))
    config = release_config(model, target_config)
    if not is_main_process:
        return []
    header, units = release_plan(model)
    tensors = encode_units(model, header, units)
    os.makedirs(save_directory, exist_ok=True)
    shards = _shards(tensors, convert_file_size_to_int(max_shard_size) if isinstance(max_shard_size, str)
                     else int(max_shard_size))
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(save_directory, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total, EXPORT_MARK[0]: EXPORT_MARK[1]},
             "weight_map": dict(sorted(weight_map.items()))}
    Path(save_directory, INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    Path(save_directory, CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                                   encoding="utf-8")
    for stale in earlier - set(names):  # files our earlier export listed that this one did not rewrite
        path = os.path.join(save_directory, stale)
        if os.path.isfile(path):
            os.remove(path)
    push_saved_folder(save_directory, push, f"Upload {what} (DeepSeek release layout)")
    return [CONFIG_FILE, INDEX_FILE, *names]


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose 'transformers' (our standalone draft, the default: "
                         "from_pretrained and Hub remote code) or 'release' (DeepSeek's release layout, for vLLM / "
                         "SGLang).")
