"""Hub remote code: the thin files placed beside saved weights, and the `auto_map` that
points `AutoConfig` / `AutoModelForCausalLM` (``trust_remote_code=True``) at them.

The texts below are the repository's ``modeling/*.py`` files (a test keeps them equal);
they are embedded so that a wheel install of ``dsv4_mtp_hf`` can write them too.
The files import the installed ``dsv4_mtp_hf`` package; they contain no model code.
"""

from __future__ import annotations

import os
from pathlib import Path

from .save_guard import check_save_directory

# The one install instruction: the README, these files and every error that asks for the package say this.
INSTALL = "pip install <path to a clone of the dsv4-mtp-hf repository>"


def _files(kind: str, config_class: str, model_class: str, module: str) -> dict[str, str]:
    """The two thin files of one drafter (``kind`` its words in the docstrings).  The import sits in a ``try``:
    transformers then leaves it to the file, so a missing package is reported with our install instruction
    instead of transformers' guess (``pip install dsv4_mtp_hf``, a name no index holds)."""
    return {name: f'''\
"""Hub remote code for DeepSeek-V4 {kind} drafts: the {what}.

Thin by design: the implementation lives in the `dsv4_mtp_hf` package; this file only lets
`{auto}.from_pretrained(repo, trust_remote_code=True)` find it.{bind}
"""

try:
    from dsv4_mtp_hf import {cls}
except ModuleNotFoundError as err:
    if err.name != "dsv4_mtp_hf":
        raise
    raise ImportError("This DeepSeek-V4 {kind} drafter's code is the dsv4_mtp_hf package (not on PyPI): "
                      "{INSTALL}") from err

__all__ = ["{cls}"]
''' for name, what, auto, cls, bind in (
        (f"configuration_deepseek_v4_{module}.py", "configuration", "AutoConfig", config_class, ""),
        (f"modeling_deepseek_v4_{module}.py", "model", "AutoModelForCausalLM", model_class,
         "\nBind the loaded drafter to its target with `drafter.bind(target)`, or load it with `target_model=target`."),
    )}


# per drafter model type: (the remote-code files, the config's auto_map)
REMOTE_CODE = {
    "deepseek_v4_mtp": (_files("MTP", "DeepseekV4MtpConfig", "DeepseekV4MtpForCausalLM", "mtp"), {
        "AutoConfig": "configuration_deepseek_v4_mtp.DeepseekV4MtpConfig",
        "AutoModelForCausalLM": "modeling_deepseek_v4_mtp.DeepseekV4MtpForCausalLM"}),
    "deepseek_v4_dspark": (_files("DSpark", "DeepseekV4DSparkConfig", "DeepseekV4DSparkForCausalLM", "dspark"), {
        "AutoConfig": "configuration_deepseek_v4_dspark.DeepseekV4DSparkConfig",
        "AutoModelForCausalLM": "modeling_deepseek_v4_dspark.DeepseekV4DSparkForCausalLM"}),
}
REMOTE_CODE_FILES = {name: text for files, _ in REMOTE_CODE.values() for name, text in files.items()}
AUTO_MAP = REMOTE_CODE["deepseek_v4_mtp"][1]


def write_remote_code(save_directory: str | os.PathLike, model_type: str = "deepseek_v4_mtp") -> list[Path]:
    """Write the thin remote-code files of the drafter ``model_type`` into ``save_directory``."""
    out = []
    for name, text in REMOTE_CODE[model_type][0].items():
        path = Path(save_directory) / name
        path.write_text(text, encoding="utf-8")
        out.append(path)
    return out


def draft_owns(model):
    """-> ``owns(tensor name)``: a name a draft writes (under one of the draft's top-level modules).  By
    module rather than by exact name, so that a draft of another configuration saved earlier counts as ours."""
    tops = {name.split(".", 1)[0] for name in model.state_dict()}
    return lambda name: name.split(".", 1)[0] in tops


def save_with_remote_code(model, save_fn, save_directory, *args, **kwargs):
    """Run transformers' ``save_pretrained`` (``save_fn``) with our ``auto_map`` in the config,
    then place the remote-code files beside the weights.

    transformers' own ``register_for_auto_class`` mechanism would copy the modules that
    define the classes (``dsv4_mtp_hf/modeling_mtp.py`` and its relative imports), which does
    not work for a package; loading through remote code also registers the classes for
    auto-class saving, so that copy is switched off here while we save.

    A directory holding another model's config or weights (e.g. the release the draft was loaded
    from) is refused before anything is written: transformers' save would overwrite its
    ``config.json`` and delete its shards (:mod:`.save_guard`).
    """
    kind = model.config.model_type
    what = "DeepSeek-V4 DSpark drafter" if kind == "deepseek_v4_dspark" else "DeepSeek-V4 MTP draft"
    check_save_directory(save_directory, kind, draft_owns(model), what)
    push = pop_push_arguments(kwargs)
    classes = (type(model), type(model.config))
    saved = [c.__dict__.get("_auto_class", None) for c in classes]
    model.config.auto_map = dict(REMOTE_CODE[kind][1])
    try:
        for c in classes:
            c._auto_class = None
        result = save_fn(save_directory, *args, **kwargs)
    finally:
        for c, value in zip(classes, saved):
            c._auto_class = value
    if kwargs.get("is_main_process", True):
        write_remote_code(save_directory, kind)
    push_saved_folder(save_directory, push, f"Upload {what}")
    return result


def pop_push_arguments(kwargs: dict) -> dict:
    """Take ``push_to_hub`` and its arguments out of ``save_pretrained``'s keywords (the folder is uploaded
    after everything in it is written, by :func:`push_saved_folder`); ``token`` stays for the save."""
    return {"push_to_hub": kwargs.pop("push_to_hub", False), "repo_id": kwargs.pop("repo_id", None),
            "commit_message": kwargs.pop("commit_message", None), "private": kwargs.pop("private", None),
            "token": kwargs.get("token")}


def push_saved_folder(save_directory, push: dict, default_message: str) -> None:
    """Upload ``save_directory`` to the Hub when ``push["push_to_hub"]`` (from :func:`pop_push_arguments`)."""
    if not push["push_to_hub"]:
        return
    from huggingface_hub import create_repo, upload_folder

    repo_id = push["repo_id"] or Path(save_directory).name
    create_repo(repo_id, private=push["private"], token=push["token"], exist_ok=True)
    upload_folder(repo_id=repo_id, folder_path=str(save_directory), token=push["token"],
                  commit_message=push["commit_message"] or default_message)
