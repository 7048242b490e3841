"""Finding and reading a checkpoint's files (local folder or Hub repo): config, weight index, safetensors headers.

Every loader (the MTP's and DSpark's release readers, saved drafts, drafter detection, the target's expert
reader) reads files through these, so a missing, truncated or misplaced file is reported one way.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import PurePosixPath, PureWindowsPath

import torch

from . import formats as F
from .formats import MtpCheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")


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


def read_json_file(path: str, what: str) -> dict:
    """A JSON object from ``path``; a truncated or damaged file is named in the error."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MtpCheckpointError(
            f"The {what} {path} is not valid JSON ({e}): the file is truncated or corrupt. Download it again "
            "(e.g. `huggingface-cli download` with `--force-download`) or restore it from the release."
        ) from None
    if not isinstance(data, dict):
        raise MtpCheckpointError(f"The {what} {path} holds a JSON {type(data).__name__}, not an object: it is corrupt.")
    return data


def read_config_dict(path_or_repo, hub: dict) -> dict | None:
    path = resolve_file(path_or_repo, CONFIG_FILE, hub, required=False)
    return None if path is None else read_json_file(path, "config file")


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


def check_shard_names(weight_map: dict, index_path: str) -> None:
    """Every shard an index names must lie inside the checkpoint directory: no absolute path, no ``..``
    component (transformers' own rule, ``utils/hub.py::_check_shard_filenames_stay_in_model_dir``; names
    are checked, not resolved, since the Hub cache holds symlinks).  Windows forms are refused too."""
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise MtpCheckpointError(f"The index {index_path} gives tensor {tensor!r} the shard {shard!r}, not a file name.")
        posix, windows = PurePosixPath(shard), PureWindowsPath(shard)
        if posix.anchor or windows.anchor or ".." in posix.parts or ".." in windows.parts:
            raise MtpCheckpointError(
                f"The index {index_path} places tensor {tensor!r} in {shard!r}, outside the checkpoint directory. "
                "Refusing to read it: a release's index names shard files inside its own directory. Fix the index "
                "(or download the release again)."
            )


def read_weight_map(path_or_repo, hub: dict) -> tuple[dict[str, str], str | None]:
    """(tensor name -> shard file, the path of a single-file checkpoint or None) from the index, or from
    ``model.safetensors`` when there is no index."""
    index_path = resolve_file(path_or_repo, INDEX_FILE, hub, required=False)
    if index_path is not None:
        weight_map = read_json_file(index_path, "weight index").get("weight_map") or {}
        if not isinstance(weight_map, dict):
            raise MtpCheckpointError(f"The weight index {index_path} has a `weight_map` that is not an object: corrupt.")
        check_shard_names(weight_map, index_path)
        return weight_map, None
    single = resolve_file(path_or_repo, SINGLE_FILE, hub, required=False)
    if single is None:
        raise MtpCheckpointError(
            f"{path_or_repo} has neither {INDEX_FILE} nor {SINGLE_FILE} (or they could not be fetched): "
            "not a safetensors DeepSeek-V4 release."
        )
    return dict.fromkeys(read_safetensors_header(single), SINGLE_FILE), single


REDOWNLOAD = "Download it again (or restore it from the release / re-save the model)."


def read_safetensors_header(path: str) -> dict[str, tuple[str, tuple]]:
    """name -> (dtype string, shape), with sanity checks that name the broken file and tensor."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise MtpCheckpointError(f"File {path} is corrupt: truncated or not a safetensors file (size {size} bytes). "
                                     + REDOWNLOAD)
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 512 * 1024 * 1024:
            raise MtpCheckpointError(f"File {path} is corrupt: its header claims {n} bytes but the file has {size}. "
                                     + REDOWNLOAD)
        try:
            meta = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MtpCheckpointError(f"File {path} is corrupt: unreadable safetensors header ({e}). {REDOWNLOAD}") from None
    if not isinstance(meta, dict):
        raise MtpCheckpointError(f"File {path} is corrupt: its safetensors header is not an object. {REDOWNLOAD}")
    data_size = size - 8 - n
    out = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise MtpCheckpointError(f"Tensor {name!r} in file {path} is corrupt: header entry {info!r}. "
                                     + REDOWNLOAD) from None
        torch_dtype = F.SAFETENSORS_DTYPES.get(dtype)
        numel = 1
        for d in shape:
            numel *= d
        item = torch.empty((), dtype=torch_dtype).element_size() if torch_dtype is not None else None
        if end > data_size or start > end or (item is not None and end - start != numel * item):
            raise MtpCheckpointError(
                f"Tensor {name!r} in file {path} is corrupt (truncated?): {dtype} {list(shape)} needs "
                f"{numel * (item or 0)} bytes, the header gives bytes [{start}, {end}) of {data_size}. {REDOWNLOAD}"
            )
        out[name] = (dtype, shape)
    return out
