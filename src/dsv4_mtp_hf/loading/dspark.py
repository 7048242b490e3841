"""Load the DSpark drafter from a DeepSeek-V4 release (design §7b): 0731, -Flash-DSpark, -Pro-DSpark.

The drafter lives under ``mtp.0..N-1.*`` (the names the MTP used), every block a V4 draft layer with the
MTP block's tensor names; ``mtp.0`` adds the input projection (``main_proj``, FP8, and ``main_norm``), the last
block the head (``norm``, ``hc_head_*``), the Markov head (``markov_head.markov_w1/w2``, BF16) and the
confidence head (``confidence_head.proj``).  The same reader as the MTP's (:mod:`.native`): config, index and
headers first, every tensor checked before any data is read, FP8 dequantised one matrix at a time, routed
experts copied as raw FP4 bytes.  Without a target, the release's ``embed.weight`` / ``head.weight`` are read
too, so the drafter runs standalone until it is bound.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from . import native as N
from .checkpoint import check_loading_info, check_saved_files
from .detect import check_class, release_drafter
from .files import read_weight_map, resolve_file
from .formats import MtpCheckpointError

INPUT_PLAIN = {"main_norm.weight": "main_norm.weight"}  # under mtp.0.
INPUT_LINEAR = {"main_proj": "main_proj"}
HEAD_PLAIN = {  # under the last block's prefix
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
    "markov_head.markov_w1.weight": "markov_embed.weight",
    "markov_head.markov_w2.weight": "markov_proj.weight",
    "confidence_head.proj.weight": "confidence.weight",
}
SHARED = {"embed.weight": "embed", "head.weight": "head"}
NAME = "The DSpark drafter (DeepseekV4DSparkForCausalLM)"
RELEASES_HINT = (
    "DSpark ships in deepseek-ai/DeepSeek-V4-Flash-0731, -Flash-DSpark and -Pro-DSpark: blocks mtp.0..mtp.N-1 (N = 3), "
    "`main_proj`/`main_norm` on mtp.0, the head (norm, hc_head, Markov and confidence heads) on the last, all in the "
    "shard(s) the index names. Download the index and those shards again."
)


def draft_blocks(keys) -> list[int]:
    """The ``mtp.{i}`` block indices a release stores."""
    return sorted({int(m.group(1)) for k in keys if (m := re.match(r"^mtp\.(\d+)\.", k))})


def build_dspark_plan(model, header: dict, keys: list[str], expert_format_override: str | None):
    """Every block's units, the input and head tensors -> (units, expert layout, format, unused keys)."""
    blocks = draft_blocks(keys)
    layout, fmt = N.detect_block_experts(header, keys, "mtp.0.", expert_format_override)
    missing: list[str] = []
    units = N.table_units(header, "mtp.0.", "", INPUT_PLAIN, INPUT_LINEAR, missing)
    for i in blocks:
        units += N.block_units(header, f"mtp.{i}.", f"layers.{i}.", model.config, layout, missing)
    units += N.table_units(header, f"mtp.{blocks[-1]}.", "", HEAD_PLAIN, {}, missing)
    N.raise_missing(missing, layout, RELEASES_HINT, NAME)
    return units, layout, fmt, N.unused_keys(keys, units, [(f"mtp.{i}.", layout) for i in blocks])


def check_blocks(source: N.NativeSource) -> None:
    """The release's blocks must be mtp.0 .. mtp.{N-1}: a gap is a block whose tensors the index lost."""
    blocks = draft_blocks(source.keys)
    gaps = sorted(set(range(blocks[-1] + 1)) - set(blocks))
    if gaps:
        shards = ", ".join(sorted(set(source.shard_of.values())))
        raise MtpCheckpointError(
            f"{NAME} in {source.path_or_repo} is incomplete: it stores blocks "
            f"{', '.join(f'mtp.{i}' for i in blocks)} but no tensor of {', '.join(f'mtp.{i}.*' for i in gaps)} (a "
            f"release stores every block from mtp.0 to its last). The release keeps its mtp.* tensors in {shards}: "
            "download that shard and model.safetensors.index.json again.")


def check_release_fields(source: N.NativeSource, target_config, overrides: dict) -> None:
    """The DSpark fields come from the release: absent ones make its config incomplete, and a keyword may not
    change them (the weights were trained with them; another block size changes every row of the block)."""
    from ..configuration import DSPARK_FIELDS, REQUIRED_DSPARK_FIELDS

    cfg = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    missing = [k for k in REQUIRED_DSPARK_FIELDS if cfg.get(k) is None and overrides.get(k) is None]
    if missing:
        raise MtpCheckpointError(
            f"{source.path_or_repo} holds DSpark drafter tensors (`mtp.0.main_proj`, ...) but its config.json has no "
            f"{', '.join(missing)}: the config is incomplete (edited, or re-exported without them). Restore the "
            "release's config.json, or pass the release's values to DeepseekV4DSparkForCausalLM.from_pretrained "
            "(DeepSeek-V4-Flash-0731: `dspark_block_size=5, dspark_target_layer_ids=[40, 41, 42]`).")
    changed = [k for k in DSPARK_FIELDS if k in overrides and cfg.get(k) is not None and overrides[k] != cfg[k]]
    if changed:
        raise MtpCheckpointError(
            "DeepseekV4DSparkForCausalLM takes " + ", ".join(f"{k}={cfg[k]!r}" for k in changed) + " from the "
            f"release, not {', '.join(f'{k}={overrides[k]!r}' for k in changed)}: the drafter's weights were trained "
            "with the release's values (its block is non-causal: another block size changes every draft). Drop the "
            "keyword; to verify fewer drafts per round, pass `num_assistant_tokens=k` to generate.")


def plan_dspark_model(cls, source: N.NativeSource, target_config, overrides: dict, dtype: torch.dtype):
    """Plan and check the load before any data is read -> (meta model, units, expert layout, format, shapes)."""
    from ..configuration import DeepseekV4DSparkConfig

    check_blocks(source)
    check_release_fields(source, target_config, overrides)
    overrides = {**overrides, "num_draft_layers": len(draft_blocks(source.keys))}
    probe = DeepseekV4DSparkConfig.from_target_config(target_config, **overrides)
    with torch.device("meta"):
        model = cls._from_config(probe, dtype=dtype)
    units, layout, fmt, unused = build_dspark_plan(model, source.header, source.keys, overrides.get("expert_format"))
    if fmt != probe.expert_format:
        config = DeepseekV4DSparkConfig.from_target_config(target_config, **{**overrides, "expert_format": fmt})
        with torch.device("meta"):
            model = cls._from_config(config, dtype=dtype)
    shapes = {n: tuple(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    N.validate_plan(units, source.header, shapes, layout, fmt, model.config)
    if unused:
        N.logger.warning(f"{len(unused)} mtp tensor(s) in {source.path_or_repo} are not used by the DSpark drafter: "
                         + ", ".join(unused[:8]) + (", ..." if len(unused) > 8 else ""))
    return model, units, layout, fmt, shapes


def load_native_dspark(cls, path_or_repo, *, target_model=None, **kwargs):
    """Build ``cls`` (``DeepseekV4DSparkForCausalLM``) from a DeepSeek-V4 DSpark release."""
    from transformers import DeepseekV4Config

    opts = N.load_options(kwargs, cls)
    source = N.read_native_source(path_or_repo, opts.hub, prefix="mtp.")
    target_config = opts.config if opts.config is not None else DeepseekV4Config.from_pretrained(path_or_repo, **opts.hub)
    dtype = N.resolve_dtype(opts.dtype, source.config_dict)
    model, units, layout, fmt, shapes = plan_dspark_model(cls, source, target_config, opts.overrides, dtype)
    device_of = N.device_resolver(opts.device_map, target_model)
    N.fill_native_model(model, source, units, layout, fmt, shapes, dtype, device_of, "Loading DeepSeek-V4 DSpark")
    if target_model is None:
        model.use_shared_modules(*read_shared_modules(path_or_repo, opts.hub, dtype, device_of("main_proj.weight")))
    return N.finalize_native_model(model, path_or_repo, dtype, target_model)


def read_shared_modules(path_or_repo, hub: dict, dtype: torch.dtype, device) -> tuple[nn.Embedding, nn.Linear]:
    """The release's ``embed.weight`` / ``head.weight`` as modules (only their shards are fetched)."""
    from safetensors import safe_open

    weight_map, single = read_weight_map(path_or_repo, hub)
    missing = [k for k in SHARED if k not in weight_map]
    if missing:
        raise MtpCheckpointError(f"{path_or_repo} has no {missing}: without a target model the drafter reads the "
                                 "release's embedding and lm head. Pass `target_model=` instead.")
    tensors = {}
    for name in SHARED:
        held = f"it holds {name}, read when no `target_model=` is given"
        path = single if single is not None else resolve_file(path_or_repo, weight_map[name], hub, what=held)
        with safe_open(path, framework="pt", device="cpu") as f:
            tensors[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    vocab, hidden = tensors["embed.weight"].shape
    embed, head = nn.Embedding(vocab, hidden, device="meta"), nn.Linear(hidden, vocab, bias=False, device="meta")
    embed.weight = nn.Parameter(tensors["embed.weight"], requires_grad=False)
    head.weight = nn.Parameter(tensors["head.weight"], requires_grad=False)
    return embed, head


def load_dspark_checkpoint(cls, from_pretrained, path_or_repo, *args, target_model=None, **kwargs):
    """``DeepseekV4DSparkForCausalLM.from_pretrained``: a release through :func:`load_native_dspark`, a saved drafter
    through transformers' loader with the saved-draft checks."""
    where, kind = release_drafter(path_or_repo, kwargs)
    check_class(cls, kind)
    if where == "release":
        return load_native_dspark(cls, path_or_repo, target_model=target_model, **kwargs)
    check_saved_files(path_or_repo, kwargs)
    want_info = kwargs.pop("output_loading_info", False)
    kwargs.pop("ignore_mismatched_sizes", None)  # a mismatch is reported, never loaded silently
    model, info = from_pretrained(path_or_repo, *args, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
    check_loading_info(path_or_repo, info)
    if target_model is not None:
        model.bind(target_model)
    return (model, info) if want_info else model
