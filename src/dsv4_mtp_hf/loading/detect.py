"""Which drafter a DeepSeek-V4 release ships, from its tensors first and its config second (design §7b).

* MTP: ``mtp.0.{e_proj,h_proj}`` (the preview V4-Flash/Pro releases and their re-exports);
* DSpark: ``mtp.0.main_proj`` and the Markov / confidence heads on the last block (0731, -DSpark);
* V4.1 (``model_type: deepseek_v41``): a different DSpark (layer inputs, no ``hc_head``), not supported;
* a config with ``dspark_*`` fields but no drafter tensors: a stripped re-export, refused by name.

:func:`load_drafter` returns whichever drafter a release ships; each class refuses the other's release,
naming the class to use.
"""

from __future__ import annotations

from .formats import MtpCheckpointError
from .files import (INDEX_FILE, SINGLE_FILE, hub_kwargs, read_config_dict, read_json_file, read_safetensors_header,
                    resolve_first)

MTP, DSPARK = "mtp", "dspark"
CLASSES = {MTP: "DeepseekV4MtpForCausalLM", DSPARK: "DeepseekV4DSparkForCausalLM"}
SAVED = {"deepseek_v4_mtp": MTP, "deepseek_v4_dspark": DSPARK}


def stored_names(path_or_repo, hub: dict) -> list[str] | None:
    """The tensor names a checkpoint's index (or single safetensors file) lists; None if it has neither file."""
    found = resolve_first(path_or_repo, (INDEX_FILE, SINGLE_FILE), hub)
    if found is None:
        return None
    name, path = found
    if name == INDEX_FILE:
        return list(read_json_file(path, "weight index").get("weight_map") or {})
    return list(read_safetensors_header(path))


def drafter_kind(names, config: dict | None, required: bool = True) -> str | None:
    """``"mtp"`` or ``"dspark"`` for a release's tensor ``names`` and config dict; an error naming what is
    missing or unsupported otherwise (``required=False``: None when no ``mtp.*`` tensor is stored at all, for
    the caller's own report)."""
    config = config or {}
    if config.get("model_type") == "deepseek_v41":
        raise MtpCheckpointError(
            "This is a DeepSeek-V4.1 release (model_type 'deepseek_v41'): its DSpark drafter reads other target "
            "layers and has no hc_head, a different drafter that this package does not support yet.")
    names = set(names or ())
    if not required and not any(n.startswith("mtp.") for n in names):
        return None
    has = lambda suffix: any(n.startswith("mtp.0." + suffix) for n in names)  # noqa: E731
    if has("main_proj.") and has("main_norm."):
        return DSPARK
    if has("e_proj.") or has("h_proj.") or has("enorm.") or has("hnorm."):
        return MTP
    if any(k.startswith("dspark_") for k in config):
        raise MtpCheckpointError(
            "config.json carries DSpark fields (dspark_*) but the weights hold no DSpark drafter (`mtp.0.main_proj`, "
            "`mtp.0.main_norm`, the Markov and confidence heads): a re-export that stripped it. Load the drafter from "
            "the original release (deepseek-ai/DeepSeek-V4-Flash-0731, -Flash-DSpark, -Pro-DSpark).")
    found = sorted({n.split(".")[2] for n in names if n.startswith("mtp.0.") and n.count(".") >= 2})[:8]
    raise MtpCheckpointError(
        f"No drafter in this checkpoint: neither an MTP head (`mtp.0.e_proj`/`h_proj`) nor DSpark (`mtp.0.main_proj`); "
        f"its `mtp.0.*` tensors: {found or 'none'}. Releases with the MTP: deepseek-ai/DeepSeek-V4-Flash, -Pro; with "
        "DSpark: deepseek-ai/DeepSeek-V4-Flash-0731, -Flash-DSpark, -Pro-DSpark.")


def release_drafter(path_or_repo, kwargs: dict) -> tuple[str, str]:
    """-> (``"release"`` or ``"saved"``, ``"mtp"`` / ``"dspark"``) for a checkpoint directory or Hub repo."""
    hub = hub_kwargs(kwargs)
    cfg = read_config_dict(path_or_repo, hub) or {}
    if cfg.get("model_type") in SAVED:
        return "saved", SAVED[cfg["model_type"]]
    names = stored_names(path_or_repo, hub)
    if names is None:
        raise MtpCheckpointError(
            f"{path_or_repo} has no weights: neither {INDEX_FILE} nor {SINGLE_FILE}. A drafter loads from a "
            "DeepSeek-V4 release (its config.json, index and the shards holding `mtp.*`) or from a drafter saved "
            "with save_pretrained; copy or download the missing files.")
    return "release", drafter_kind(names, cfg)


def check_class(cls, kind: str | None) -> None:
    """``cls`` must be the drafter class of ``kind`` (None: nothing to check); otherwise the error names the right
    one."""
    if kind is not None and cls.__name__ != CLASSES[kind] and not any(c.__name__ == CLASSES[kind] for c in cls.__mro__):
        raise MtpCheckpointError(
            f"This checkpoint ships the {'DSpark drafter' if kind == DSPARK else 'MTP head'}, not what {cls.__name__} "
            f"loads: use {CLASSES[kind]}.from_pretrained(...), or dsv4_mtp_hf.load_drafter(...) which picks it.")


def load_drafter(path_or_repo, target_model=None, **kwargs):
    """The drafter a DeepSeek-V4 release (or a saved drafter of ours) ships: a ``DeepseekV4MtpForCausalLM`` or a
    ``DeepseekV4DSparkForCausalLM``, chosen by its tensors, loaded with ``from_pretrained``'s keywords."""
    from .. import DeepseekV4DSparkForCausalLM, DeepseekV4MtpForCausalLM

    _, kind = release_drafter(path_or_repo, kwargs)
    cls = DeepseekV4DSparkForCausalLM if kind == DSPARK else DeepseekV4MtpForCausalLM
    return cls.from_pretrained(path_or_repo, target_model=target_model, **kwargs)
