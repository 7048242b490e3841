"""Version switches for transformers and torch: the only module that asks which version is installed."""

from __future__ import annotations

import inspect

import torch
import transformers

TRANSFORMERS_VERSION = tuple(int(x) for x in transformers.__version__.split(".")[:2])

# transformers >= 5.18 cuts a round's accepted tokens at the first EOS itself (`_assisted_decoding`); 5.17 does not.
VERIFIER_CUTS_AT_EOS = TRANSFORMERS_VERSION >= (5, 18)


def cache_kwarg(model) -> str:
    """The cache's keyword in ``model``'s forward: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def takes_cache_kwarg(fn) -> str:
    """The same question for any callable (transformers' attention modules and mask functions)."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def dynamo_recompile_limit() -> str:
    """The name of Dynamo's per-function recompile limit (``cache_size_limit`` before torch 2.7)."""
    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def progress(iterable=None, *, desc: str, total: int | None = None, unit: str = "it"):
    """transformers' progress bar (``transformers.utils.logging.disable_progress_bar()`` turns it off), for the
    long one-off work a user waits on: packing experts, compiling and capturing graphs."""
    from transformers.utils import logging as hf_logging

    return hf_logging.tqdm(iterable, desc=desc, total=total, unit=unit)
