"""A small, really trained DeepSeek-V4 target + MTP draft pair shipped with the package.

The target is transformers' ``DeepseekV4ForCausalLM`` (4 layers mixing sliding, CSA and
HCA attention; hash-routed and score-routed MoE; hc_mult 4) trained from scratch on the
Python standard library's source; the draft is our :class:`DeepseekV4MtpForCausalLM`
trained with the MTP objective against the frozen target, its routed experts packed FP4.
``scripts/train_demo_pair.py`` rebuilds it; ``demo_pair/training_report.json`` holds the
measured quality (held-out loss, MTP accuracy, simulated accepted length) and
``demo_pair/heldout_files.txt`` the stdlib modules it never trained on.

    >>> from dsv4_mtp_hf import load_demo_pair
    >>> target, mtp, tokenizer = load_demo_pair()
    >>> ids = tokenizer("def fibonacci(n):\\n", return_tensors="pt").input_ids
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

__all__ = ["demo_pair_path", "demo_pair_report", "load_demo_pair"]


def demo_pair_path() -> Path:
    """Directory holding ``target_model/``, ``mtp/`` and ``tokenizer/``."""
    path = Path(str(resources.files(__package__) / "demo_pair"))
    if not (path / "target_model" / "config.json").is_file() or not (path / "mtp" / "config.json").is_file():
        raise FileNotFoundError(
            f"The demo pair is missing from {path}; rebuild it with `python scripts/train_demo_pair.py`."
        )
    return path


def demo_pair_report() -> dict:
    """The training report (sizes, held-out metrics, simulated acceptance)."""
    return json.loads((demo_pair_path() / "training_report.json").read_text())


def load_demo_pair(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load ``(target, mtp, tokenizer)``: the target in eval mode, the MTP bound to it.

    The target's large matrices are stored in bf16 and upcast to ``dtype``; the MTP's
    routed experts stay packed FP4 whatever ``dtype`` is.
    """
    from transformers import AutoTokenizer, DeepseekV4ForCausalLM

    from .modeling_mtp import DeepseekV4MtpForCausalLM

    path = demo_pair_path()
    tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
    target = DeepseekV4ForCausalLM.from_pretrained(path / "target_model", dtype=dtype).to(device).eval()
    mtp = DeepseekV4MtpForCausalLM.from_pretrained(path / "mtp", dtype=dtype).to(device).eval()
    mtp.bind(target)
    return target, mtp, tokenizer
