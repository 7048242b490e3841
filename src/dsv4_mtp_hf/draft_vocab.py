"""Reduced draft vocabularies: choosing one from a corpus, and noticing when one does not fit the text.

The MTP can draft over a subset of the vocabulary (``config.mtp_vocab_size``, ``config.draft_vocab_ids``,
:meth:`DeepseekV4MtpForCausalLM.set_draft_vocab`): its lm head shrinks to those rows, the target still
verifies over the full vocabulary, and the output stays exact.  Speed depends on the subset covering the
tokens of the text: :func:`draft_vocab_from_corpus` picks the most frequent ids of a user's own corpus, and
:func:`warn_if_draft_vocab_collapsed` (run after each generate call) warns when acceptance collapsed under a
reduced vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from transformers.utils import logging as hf_logging

from .configuration import token_id_list

logger = hf_logging.get_logger(__name__)

# A generate call "collapsed" when it gained fewer than this many tokens per verify round (the target's own
# token included: 1.0 means no draft was ever accepted) over at least this many rounds.
COLLAPSE_MEAN_ACCEPTED_LENGTH = 1.3
COLLAPSE_MIN_ROUNDS = 8


def _as_id_tensor(ids) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"token ids must be an integer tensor, got dtype {ids.dtype}.")
        return ids.detach().reshape(-1).to(device="cpu", dtype=torch.long)
    return torch.tensor(token_id_list(ids), dtype=torch.long)  # a numpy array, or an iterable of ints


def draft_vocab_from_corpus(corpus, size: int, always: Iterable[int] = (),
                            vocab_size: int | None = None) -> torch.Tensor:
    """The ``size`` token ids to draft over, chosen from a tokenised corpus like the traffic the draft will see:
    every id of ``always`` (e.g. ``tokenizer.all_special_ids`` and the EOS ids), then the corpus's most frequent
    ids (ties: the smaller id first).  -> a sorted ``LongTensor`` for :meth:`~DeepseekV4MtpForCausalLM.set_draft_vocab`
    (which saves it with the draft).

    ``corpus``: an integer tensor of any shape (``[batch, seq]``), an iterable of sequences of ids (lists,
    tensors: ``tokenizer(texts)["input_ids"]``), one flat iterable of ids, or a tokenizer's output itself
    (its ``input_ids``; with tensors, the rows its ``attention_mask`` marks as padding are left out).  Other
    padding counts like any token: strip it first.
    ``vocab_size``: when given, ids outside ``[0, vocab_size)`` raise and ``size`` may not exceed it.
    A corpus with fewer distinct ids than ``size`` gives all of them (plus ``always``): fewer than asked."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"`size` must be a positive integer, got {size!r}.")
    if vocab_size is not None and size > vocab_size:
        raise ValueError(f"`size`={size} exceeds vocab_size={vocab_size}.")
    if isinstance(corpus, Mapping) and "input_ids" in corpus:  # a tokenizer's BatchEncoding
        mask, corpus = corpus.get("attention_mask"), corpus["input_ids"]
        if isinstance(corpus, torch.Tensor) and isinstance(mask, torch.Tensor) and mask.shape == corpus.shape:
            corpus = corpus[mask.bool()]  # padding dropped
    keep = _as_id_tensor(list(always)).unique()
    if keep.numel() > size:
        raise ValueError(f"`always` holds {keep.numel()} ids, more than `size`={size}.")
    if isinstance(corpus, torch.Tensor) or (hasattr(corpus, "reshape") and hasattr(corpus, "tolist")):
        parts = [_as_id_tensor(corpus)]
    elif isinstance(corpus, (str, bytes)) or not isinstance(corpus, Iterable):
        raise ValueError(f"`corpus` must hold token ids (a tensor, or sequences of ints), got {type(corpus).__name__}.")
    else:
        parts, flat = [], []
        for item in corpus:
            if isinstance(item, (str, bytes)):
                raise ValueError("`corpus` holds text: tokenise it first (token ids, not strings).")
            if isinstance(item, Iterable) or isinstance(item, torch.Tensor):
                parts.append(_as_id_tensor(item))
            else:
                flat.append(item)
        if flat:
            parts.append(_as_id_tensor(flat))
    ids = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
    everything = torch.cat([ids, keep])
    if everything.numel() and int(everything.min()) < 0:
        raise ValueError("token ids must be non-negative.")
    if vocab_size is not None and everything.numel() and int(everything.max()) >= vocab_size:
        raise ValueError(f"token id {int(everything.max())} is outside [0, vocab_size={vocab_size}).")
    if ids.numel() == 0 and keep.numel() == 0:
        raise ValueError("`corpus` holds no token ids (and `always` is empty): nothing to choose from.")
    counts = torch.bincount(ids, minlength=int(everything.max()) + 1) if ids.numel() else torch.zeros(
        int(everything.max()) + 1, dtype=torch.long)
    counts[keep] = -1  # chosen already
    seen = int((counts > 0).sum())
    take = min(size - keep.numel(), seen)
    # stable sort on descending counts: equal counts keep ascending id order
    order = torch.sort(counts, descending=True, stable=True).indices[:take]
    chosen = torch.cat([keep, order]).unique()
    if chosen.numel() < size:
        logger.info(f"draft_vocab_from_corpus: the corpus has {seen} distinct ids; returning {chosen.numel()} "
                    f"ids, fewer than size={size}.")
    return chosen


def draft_vocab_collapsed(stats) -> bool:
    """True if a generate call's statistics (``GenerationStats`` or a batch's) show collapsed acceptance: a mean
    accepted length below :data:`COLLAPSE_MEAN_ACCEPTED_LENGTH` over at least :data:`COLLAPSE_MIN_ROUNDS`
    verify rounds."""
    rounds = getattr(stats, "rounds", 0) or 0
    return rounds >= COLLAPSE_MIN_ROUNDS and stats.mean_accepted_length < COLLAPSE_MEAN_ACCEPTED_LENGTH


def warn_if_draft_vocab_collapsed(mtp, stats) -> bool:
    """After a generate call: warn (once per vocabulary size) when ``mtp`` drafts over a reduced vocabulary and
    the call's acceptance collapsed (:func:`draft_vocab_collapsed`), the likely cause being a subset that misses
    the tokens of the text.  Returns whether it warned (or would have: ``warning_once`` dedups)."""
    ids = mtp.draft_vocab_ids()
    if ids is None or stats is None or not draft_vocab_collapsed(stats):
        return False
    vocab = mtp.config.vocab_size
    logger.warning_once(
        f"DeepSeek-V4 MTP: a generate call accepted under {COLLAPSE_MEAN_ACCEPTED_LENGTH} tokens per verify round "
        f"(over {COLLAPSE_MIN_ROUNDS}+ rounds; see `mtp.last_generation_stats`) while the MTP drafts over a reduced "
        f"vocabulary of {ids.numel()} of {vocab} ids. The likely cause: the text uses tokens outside that subset, "
        "which the MTP can never propose, so its drafts are rejected (the output is still exact, only slower). "
        "Fix: choose the subset from text like yours, e.g. `mtp.set_draft_vocab(dsv4_mtp_hf.draft_vocab_from_corpus("
        "token_ids, size, always=tokenizer.all_special_ids))`, or a larger one; or draft over the full vocabulary "
        "again with `mtp.set_draft_vocab(None)` and `mtp.config.mtp_vocab_size = None`."
    )
    return True
