"""Which loader a checkpoint goes to, and the checks around transformers' loader for our own saved drafts.

``DeepseekV4MtpForCausalLM.from_pretrained`` never builds a randomly initialised MTP:

* a DeepSeek-V4 release (``model_type: deepseek_v4``), or native ``mtp.0.*`` tensors beside a config that
  reads as a ``DeepseekV4Config`` whatever its ``model_type`` says, goes to the native loader
  (:mod:`.native`);
* a saved draft (``model_type: deepseek_v4_mtp``) goes to transformers' loader, after its index and
  safetensors headers are checked (a truncated file is named), and a missing, unexpected or mis-shaped
  tensor raises (``ignore_mismatched_sizes`` cannot make a mismatch pass);
* anything else raises, naming its ``model_type``.
"""

from __future__ import annotations

import os

from transformers.utils import logging as hf_logging

from .formats import MtpCheckpointError
from .files import (
    INDEX_FILE,
    SINGLE_FILE,
    check_shard_names,
    hub_kwargs,
    read_config_dict,
    read_json_file,
    read_safetensors_header,
    resolve_file,
    resolve_first,
)

logger = hf_logging.get_logger(__name__)

NATIVE, DRAFT = "native", "draft"
# DeepseekV4Config fields that fix the MTP's tensor shapes: a config without them cannot describe the release.
V4_SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "hc_mult", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
    "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
)
NOT_A_DRAFT_HINT = (
    "DeepseekV4MtpForCausalLM loads a DeepSeek-V4 release (config.json model_type 'deepseek_v4', with its "
    "`mtp.0.*` tensors) or a draft saved by DeepseekV4MtpForCausalLM.save_pretrained (model_type "
    "'deepseek_v4_mtp'). Point it at one of those."
)


def has_native_mtp_tensors(path_or_repo, hub: dict) -> bool:
    """True if the checkpoint's index (or its single safetensors file) lists native ``mtp.0.*`` tensors."""
    found = resolve_first(path_or_repo, (INDEX_FILE, SINGLE_FILE), hub)
    if found is None:
        return False
    name, path = found
    if name == INDEX_FILE:
        names = read_json_file(path, "weight index").get("weight_map") or {}
    else:
        names = read_safetensors_header(path)
    return any(isinstance(k, str) and k.startswith("mtp.0.") for k in names)


def _v4_config_from_dict(path_or_repo, cfg: dict | None):
    """A ``DeepseekV4Config`` from a config.json whose ``model_type`` is not ``deepseek_v4``, or a named error."""
    from transformers import DeepseekV4Config

    if cfg is None:
        raise MtpCheckpointError(
            f"{path_or_repo} holds native DeepSeek-V4 MTP tensors (`mtp.0.*`) but no config.json: the MTP's shapes "
            "come from the release's config. Put the release's config.json beside the weights, or pass "
            "`config=DeepseekV4Config(...)`."
        )
    missing = [k for k in V4_SHAPE_FIELDS if k not in cfg]
    if missing:
        raise MtpCheckpointError(
            f"{path_or_repo} holds native DeepSeek-V4 MTP tensors (`mtp.0.*`), but its config.json (model_type "
            f"{cfg.get('model_type')!r}) cannot be read as a DeepSeek-V4 config: it lacks {', '.join(missing)}. "
            "Use the release's own config.json (model_type 'deepseek_v4'), or pass `config=DeepseekV4Config(...)`."
        )
    logger.warning(
        f"{path_or_repo}: config.json says model_type {cfg.get('model_type')!r}, but the checkpoint holds native "
        "DeepSeek-V4 MTP tensors (`mtp.0.*`) and the config has every DeepSeek-V4 field: loading it as a "
        "DeepSeek-V4 release. Set model_type 'deepseek_v4' in config.json to silence this warning."
    )
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")}
    return DeepseekV4Config.from_dict(fields)


def checkpoint_kind(path_or_repo, kwargs: dict) -> tuple[str, object | None]:
    """-> (``"native"``, a ``DeepseekV4Config`` to load with or None) or (``"draft"``, None); raises
    :class:`MtpCheckpointError` for a checkpoint neither loader takes."""
    config = kwargs.get("config")
    if config is not None and not isinstance(config, (str, os.PathLike)):
        model_type = getattr(config, "model_type", None)
        if model_type in ("deepseek_v4", "deepseek_v4_mtp"):
            return (NATIVE if model_type == "deepseek_v4" else DRAFT), None
        raise MtpCheckpointError(
            f"`config=` must be a DeepseekV4Config (a release) or a DeepseekV4MtpConfig (a saved draft), got "
            f"{type(config).__name__} (model_type {model_type!r})."
        )
    hub = hub_kwargs(kwargs)
    cfg = read_config_dict(path_or_repo, hub)
    model_type = cfg.get("model_type") if cfg is not None else None
    if model_type in ("deepseek_v4", "deepseek_v4_mtp"):
        return (NATIVE if model_type == "deepseek_v4" else DRAFT), None
    if has_native_mtp_tensors(path_or_repo, hub):
        return NATIVE, _v4_config_from_dict(path_or_repo, cfg)
    if cfg is None:
        return DRAFT, None  # nothing readable there: transformers' loader names the path problem
    raise MtpCheckpointError(
        f"{path_or_repo} is not a DeepSeek-V4 MTP checkpoint (model_type {model_type!r}) and holds no native "
        f"`mtp.0.*` tensors. {NOT_A_DRAFT_HINT}"
    )


def check_saved_files(path_or_repo, kwargs: dict) -> None:
    """Before transformers reads a saved draft: its index must be valid JSON naming shards inside the
    directory, and every safetensors file must have a sound header covering its data (a cut download is
    named as corrupt).  Variants and non-safetensors saves are left to transformers."""
    if kwargs.get("variant") or kwargs.get("use_safetensors") is False or kwargs.get("gguf_file"):
        return
    hub = hub_kwargs(kwargs)
    found = resolve_first(path_or_repo, (INDEX_FILE, SINGLE_FILE), hub)
    index_path = found[1] if found is not None and found[0] == INDEX_FILE else None
    if index_path is not None:
        weight_map = read_json_file(index_path, "weight index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise MtpCheckpointError(f"The weight index {index_path} has no `weight_map` object: it is corrupt.")
        check_shard_names(weight_map, index_path)
        files = [resolve_file(path_or_repo, s, hub, required=False) for s in sorted(set(weight_map.values()))]
    else:
        files = [found[1] if found is not None else None]
    for path in files:
        if path is not None:
            read_safetensors_header(path)


def _listed(names: list[str], n: int = 12) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def check_loading_info(path_or_repo, info: dict) -> None:
    """Raise if transformers' loader left a tensor uninitialised, skipped one, or re-initialised a
    mis-shaped one (``output_loading_info`` report)."""
    problems = []
    if info.get("missing_keys"):
        problems.append(f"missing tensor(s) (the model needs them): {_listed(sorted(info['missing_keys']))}")
    if info.get("unexpected_keys"):
        problems.append(f"unexpected tensor(s) (the model has no such parameter): "
                        f"{_listed(sorted(info['unexpected_keys']))}")
    if info.get("mismatched_keys"):
        shown = [f"{name} {list(stored)} (the model needs {list(wanted)})"
                 for name, stored, wanted in sorted(info["mismatched_keys"], key=lambda m: m[0])]
        problems.append(f"tensor(s) of the wrong shape: {_listed(shown)}")
    if info.get("error_msgs"):
        problems.append("; ".join(str(m) for m in info["error_msgs"]))
    if problems:
        raise MtpCheckpointError(
            f"The saved draft in {path_or_repo} does not match its config.json: " + "; ".join(problems)
            + ". Loading does not randomly initialise an MTP: re-save the draft with save_pretrained (or load the "
            "DeepSeek-V4 release it came from), and check that config.json belongs to these weights."
        )


def load_saved_draft(from_pretrained, path_or_repo, *args, **kwargs):
    """transformers' ``from_pretrained`` (``from_pretrained``: the bound parent method) of one of our saved
    drafts, with the checks above.  Returns what it returns (``(model, info)`` with ``output_loading_info``)."""
    check_saved_files(path_or_repo, kwargs)
    want_info = kwargs.pop("output_loading_info", False)
    kwargs.pop("ignore_mismatched_sizes", None)  # a mismatch is reported below, never loaded silently
    model, info = from_pretrained(path_or_repo, *args, output_loading_info=True, ignore_mismatched_sizes=True,
                                  **kwargs)
    check_loading_info(path_or_repo, info)
    return (model, info) if want_info else model


__all__ = ["DRAFT", "NATIVE", "check_loading_info", "check_saved_files", "checkpoint_kind", "has_native_mtp_tensors",
           "load_saved_draft"]
