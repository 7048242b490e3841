"""Refuse to save over another model's files.

transformers' ``save_pretrained`` overwrites ``config.json`` and deletes every ``model-XXXXX-of-YYYYY``
shard in the directory that the new save does not write (its clean-up of a previous save).  Saving a draft
(or a packed target) into the folder of the DeepSeek-V4 release it was loaded from would therefore delete
the release's shards.  :func:`check_save_directory` runs before anything is written: a directory may hold
nothing, files that are no model's (a README, a tokenizer), or an earlier save of the same kind of model;
anything else (another ``model_type``, weights with tensors this model does not write, weight formats we
never write) raises :class:`SaveDirectoryError` naming what is there.
"""

from __future__ import annotations

import fnmatch
import json
import os
import struct
from collections.abc import Callable

CONFIG_FILE = "config.json"
# Model weights in formats we never write (transformers' PyTorch/TF/Flax names, GGUF, Meta's consolidated files);
# every safetensors file and weight index is read and checked.  A Trainer's training_args.bin / optimizer.pt are
# not weights and stay allowed.
OTHER_WEIGHTS = ("pytorch_model*.bin", "tf_model*.h5", "flax_model*.msgpack", "*.gguf", "consolidated*.pth",
                 "consolidated*.pt")
INDEX_SUFFIX = ".index.json"
_HEADER_LIMIT = 512 * 1024 * 1024


class SaveDirectoryError(ValueError):
    """``save_pretrained`` was pointed at a directory holding another model's config or weights."""


def safetensors_names(path: str) -> list[str] | None:
    """The tensor names in a safetensors file's header (None: not a readable safetensors file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None
            (n,) = struct.unpack("<Q", head)
            if n > min(os.path.getsize(path) - 8, _HEADER_LIMIT):
                return None
            meta = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return [k for k in meta if k != "__metadata__"] if isinstance(meta, dict) else None


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _shown(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def foreign_contents(save_directory, model_type: str, owns: Callable[[str], bool],
                     owns_file: Callable[[str], bool] | None = None) -> list[str]:
    """What in ``save_directory`` (top level only) is not an earlier save of a ``model_type`` model:
    a ``config.json`` of another (or no / an unreadable) ``model_type``; a weight file or index naming a
    tensor ``owns(name)`` rejects; a weight format we never write.  ``owns_file(filename)``, when given,
    must accept every weight file too.  Each entry says what it found."""
    if not os.path.isdir(save_directory):
        return []
    found = []
    entries = sorted(os.listdir(save_directory))
    if CONFIG_FILE in entries:
        cfg = _read_json(os.path.join(save_directory, CONFIG_FILE))
        other = cfg.get("model_type") if isinstance(cfg, dict) else None
        if not isinstance(cfg, dict):
            found.append("a config.json that is not valid JSON (another model's, or damaged)")
        elif other != model_type:
            found.append(f"the config.json of a {other!r} model" if other else "a config.json without a model_type")
    for name in entries:
        path = os.path.join(save_directory, name)
        if not os.path.isfile(path):
            continue
        if name.endswith(INDEX_SUFFIX):
            index = _read_json(path)
            keys = list(index.get("weight_map") or {}) if isinstance(index, dict) else None
            if keys is None:
                found.append(f"the weight index {name}, which is not valid JSON")
            elif bad := [k for k in keys if not owns(k)]:
                found.append(f"the weight index {name}, listing tensors this model does not write ({_shown(bad)})")
            elif owns_file is not None and not owns_file(name):
                found.append(f"the weight index {name}, not written by an earlier save of this model")
        elif any(fnmatch.fnmatch(name, p) for p in OTHER_WEIGHTS):
            found.append(f"the weight file {name} (a format this model never writes)")
        elif name.endswith(".safetensors"):
            keys = safetensors_names(path)
            if keys is None:
                found.append(f"the weight file {name}, which is not a readable safetensors file")
            elif bad := [k for k in keys if not owns(k)]:
                found.append(f"the weight file {name}, holding tensors this model does not write ({_shown(bad)})")
            elif owns_file is not None and not owns_file(name):
                found.append(f"the weight file {name}, not listed by an earlier save of this model")
    return found


def check_save_directory(save_directory, model_type: str, owns: Callable[[str], bool], what: str,
                         owns_file: Callable[[str], bool] | None = None) -> None:
    """Raise :class:`SaveDirectoryError` unless ``save_directory`` is new, empty, holds no model files, or
    holds an earlier save of this kind of model (see :func:`foreign_contents`).  ``what`` names the model
    being saved in the message."""
    found = foreign_contents(save_directory, model_type, owns, owns_file)
    if found:
        raise SaveDirectoryError(
            f"Refusing to save the {what} into {os.fspath(save_directory)!r}: it holds another model's files ("
            + "; ".join(found) + "). Saving there would overwrite its config.json and delete its weight shards. "
            "Pass an empty or new directory to save_pretrained (e.g. a sibling folder of the release)."
        )
