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


ABSENT, UNREACHABLE = "absent", "unreachable"


def lookup(path_or_repo, filename: str, hub: dict) -> tuple[str | None, str | None]:
    """-> (local path, None), or (None, ``ABSENT``: the checkpoint has no such file), or (None, ``UNREACHABLE``:
    a Hub repo's file that is not in the local cache and could not be fetched -- offline, or no network).  The two
    must not be confused: an unreachable index read as absent would report "no drafter in this checkpoint"."""
    from transformers.utils.hub import cached_file

    if os.path.isdir(path_or_repo):
        path = os.path.join(path_or_repo, hub.get("subfolder") or "", filename)
        return (path, None) if os.path.isfile(path) else (None, ABSENT)
    if _looks_like_a_path(path_or_repo):
        raise MtpCheckpointError(f"{path_or_repo}: no such local directory (and it is not a Hub repo id, "
                                 "`org/name`). Check the path.")
    try:  # both flags on: a missing entry and a connection error then raise differently
        path = cached_file(path_or_repo, filename, _raise_exceptions_for_missing_entries=True,
                           _raise_exceptions_for_connection_errors=True, **hub)
    except OSError as e:
        from huggingface_hub.errors import LocalEntryNotFoundError

        if isinstance(e.__cause__, LocalEntryNotFoundError):  # offline or no network, and not cached
            return None, (ABSENT if _known_absent(path_or_repo, filename, hub) else UNREACHABLE)
        if e.__cause__ is None and e.__context__ is None and e.errno is None:  # "does not appear to have a file"
            return None, ABSENT
        raise  # unknown repo, gated repo, bad revision, HTTP error: transformers' message names it
    return (path, None) if path is not None else (None, ABSENT)  # a missing config.json comes back as None


def _looks_like_a_path(path_or_repo) -> bool:
    s = os.fspath(path_or_repo)
    return os.path.isabs(s) or s.startswith((".", "~")) or s.count("/") > 1 or "\\" in s


def _known_absent(repo: str, filename: str, hub: dict) -> bool:
    """The Hub cache remembers files a repo lacks (``.no_exist``): offline, those are absent, not unreachable."""
    from huggingface_hub import _CACHED_NO_EXIST, try_to_load_from_cache

    name = f"{hub['subfolder']}/{filename}" if hub.get("subfolder") else filename
    found = try_to_load_from_cache(repo, name, cache_dir=hub.get("cache_dir"), revision=hub.get("revision"))
    return found is _CACHED_NO_EXIST


def unreachable_error(path_or_repo, filenames, hub: dict) -> MtpCheckpointError:
    """Offline or no network, and the files are not in the local cache: say so, and how to get them."""
    from huggingface_hub import constants

    offline = hub.get("local_files_only") or constants.HF_HUB_OFFLINE
    why = ("offline mode is on (HF_HUB_OFFLINE=1 or local_files_only=True)" if offline else
           "the Hugging Face Hub cannot be reached (no network?)")
    cache = hub.get("cache_dir") or constants.HF_HUB_CACHE
    return MtpCheckpointError(
        f"Cannot read {' / '.join(filenames)} of {path_or_repo}: {why}, and it is not in the local cache ({cache}). "
        f"Download it once with network access (`hf download {path_or_repo}`, or load it online: only the config, "
        "the index and the shards holding `mtp.*` are fetched), point `cache_dir=` / HF_HOME at the cache that holds "
        f"it, or pass the release's local directory (if {path_or_repo} is meant as one: there is no directory there).")


def resolve_file(path_or_repo, filename: str, hub: dict, required: bool = True, what: str = "") -> str | None:
    """A checkpoint file's local path (a Hub repo's downloaded into / read from the HF cache).  Absent: None, or
    (``required``) an error naming the file (``what``: what it holds).  Unreachable: always an error."""
    path, state = lookup(path_or_repo, filename, hub)
    if state == UNREACHABLE:
        raise unreachable_error(path_or_repo, [filename], hub)
    if path is None and required:
        raise missing_file_error(path_or_repo, filename, what)
    return path


def resolve_first(path_or_repo, filenames, hub: dict) -> tuple[str, str] | None:
    """(name, path) of the first of ``filenames`` the checkpoint has (index, then single file), None if it has none.
    A file that could not be fetched counts only when no later one is there (a single-file repo has no index)."""
    unreachable = []
    for name in filenames:
        path, state = lookup(path_or_repo, name, hub)
        if path is not None:
            return name, path
        if state == UNREACHABLE:
            unreachable.append(name)
    if unreachable:
        raise unreachable_error(path_or_repo, unreachable, hub)
    return None


def missing_file_error(path_or_repo, filename: str, what: str = "") -> MtpCheckpointError:
    held = f" ({what})" if what else ""
    if os.path.isdir(path_or_repo):
        return MtpCheckpointError(
            f"{filename}{held} is missing from the local directory {path_or_repo}: the copy is incomplete. Copy that "
            "file from the release again (e.g. `hf download <repo> " + filename + " --local-dir <dir>`).")
    return MtpCheckpointError(f"The Hub repo {path_or_repo} has no {filename}{held}: check the repo id and "
                              "`revision=`.")


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
    """config.json as a dict, None if the checkpoint has none (an unreachable one raises)."""
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
    found = resolve_first(path_or_repo, (INDEX_FILE, SINGLE_FILE), hub)
    if found is None:
        raise MtpCheckpointError(
            f"{path_or_repo} has neither {INDEX_FILE} nor {SINGLE_FILE}: not a safetensors DeepSeek-V4 release."
        )
    name, path = found
    if name == SINGLE_FILE:
        return dict.fromkeys(read_safetensors_header(path), SINGLE_FILE), path
    weight_map = read_json_file(path, "weight index").get("weight_map") or {}
    if not isinstance(weight_map, dict):
        raise MtpCheckpointError(f"The weight index {path} has a `weight_map` that is not an object: corrupt.")
    check_shard_names(weight_map, path)
    return weight_map, None


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
