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

CONFIG_MODULE = "configuration_deepseek_v4_mtp"
MODEL_MODULE = "modeling_deepseek_v4_mtp"
AUTO_MAP = {
    "AutoConfig": f"{CONFIG_MODULE}.DeepseekV4MtpConfig",
    "AutoModelForCausalLM": f"{MODEL_MODULE}.DeepseekV4MtpForCausalLM",
}

REMOTE_CODE_FILES = {
    f"{CONFIG_MODULE}.py": '''\
"""Hub remote code for DeepSeek-V4 MTP drafts: the configuration.

Thin by design: the implementation lives in the `dsv4_mtp_hf` package
(`pip install dsv4-mtp-hf`); this file only lets
`AutoConfig.from_pretrained(repo, trust_remote_code=True)` find it.
"""

from dsv4_mtp_hf.configuration import DeepseekV4MtpConfig

__all__ = ["DeepseekV4MtpConfig"]
''',
    f"{MODEL_MODULE}.py": '''\
"""Hub remote code for DeepSeek-V4 MTP drafts: the model.

Thin by design: the implementation lives in the `dsv4_mtp_hf` package
(`pip install dsv4-mtp-hf`); this file only lets
`AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)` find it.
Bind the loaded draft to its target with `mtp.bind(target)`.
"""

from dsv4_mtp_hf.modeling import DeepseekV4MtpForCausalLM

__all__ = ["DeepseekV4MtpForCausalLM"]
''',
}


def write_remote_code(save_directory: str | os.PathLike) -> list[Path]:
    """Write the thin remote-code files into ``save_directory``."""
    out = []
    for name, text in REMOTE_CODE_FILES.items():
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
    define the classes (``dsv4_mtp_hf/modeling.py`` and its relative imports), which does
    not work for a package; loading through remote code also registers the classes for
    auto-class saving, so that copy is switched off here while we save.

    A directory holding another model's config or weights (e.g. the release the draft was loaded
    from) is refused before anything is written: transformers' save would overwrite its
    ``config.json`` and delete its shards (:mod:`.save_guard`).
    """
    check_save_directory(save_directory, model.config.model_type, draft_owns(model), "DeepSeek-V4 MTP draft")
    push = pop_push_arguments(kwargs)
    classes = (type(model), type(model.config))
    saved = [c.__dict__.get("_auto_class", None) for c in classes]
    model.config.auto_map = dict(AUTO_MAP)
    try:
        for c in classes:
            c._auto_class = None
        result = save_fn(save_directory, *args, **kwargs)
    finally:
        for c, value in zip(classes, saved):
            c._auto_class = value
    if kwargs.get("is_main_process", True):
        write_remote_code(save_directory)
    push_saved_folder(save_directory, push, "Upload DeepSeek-V4 MTP draft")
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
