"""Sampling without host reads: what lets a sampled round replay as a CUDA graph.

``generate(do_sample=True)`` processes the logits with warpers (temperature, top-k, top-p,
min-p) and draws with ``torch.multinomial``.  Those four warpers are row-wise and read nothing
but the scores (no token history, no host reads), so a round may apply them to all of its rows
at once, inside a graph, exactly as transformers applies them row by row.  The draws use the
exponential race (``argmax(p / E)``, ``E ~ Exp(1)``, which picks ``i`` with probability ``p_i``),
and speculative sampling's accept/resample is computed for every row at once and selected on the
device, so a round needs no ``.item()`` until its one read of the result.

Processors that read the sequence (repetition penalty, ``min_new_tokens``, grammars, ...) are
not graph-safe; such calls keep the eager per-token drafts and transformers' loop.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

GRAPH_SAFE_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


def build_warpers(temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
            min_p: float | None = None) -> LogitsProcessorList:
    """The warpers ``generate(do_sample=True, ...)`` builds for these settings, in transformers' order (the only
    place this package builds a warper list; unset values add no warper)."""
    out = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        if not temperature > 0:
            raise ValueError(f"`temperature` must be > 0 when sampling, got {temperature!r}.")
        out.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        out.append(TopKLogitsWarper(top_k=top_k))
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"`top_p` must be in (0, 1], got {top_p!r}.")
    if top_p is not None and top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p))
    if min_p is not None:
        out.append(MinPLogitsWarper(min_p=min_p))
    return out


def check_finite(probs: torch.Tensor, what: str) -> None:
    """Raise if a distribution to sample from holds NaN or inf (one host read; eager paths only)."""
    if not bool(torch.isfinite(probs).all()):
        raise FloatingPointError(
            f"{what} holds NaN or infinite values, so nothing can be sampled from it. The model's weights or inputs "
            "are broken (a bad checkpoint, an fp16 overflow): check them, or load the model in bfloat16/float32."
        )


def graph_safe(logits_processor) -> bool:
    """Whether every processor of the call is one of :data:`GRAPH_SAFE_WARPERS` (none at all counts)."""
    return all(type(p) in GRAPH_SAFE_WARPERS for p in (logits_processor or ()))


def signature(logits_processor) -> tuple:
    """What a graph of the processors bakes in: each one's type and parameters (graphs are reused while
    it is unchanged)."""
    return tuple((type(p).__name__, tuple(sorted(vars(p).items()))) for p in (logits_processor or ()))


def warp(logits_processor, logits: torch.Tensor) -> torch.Tensor:
    """The graph-safe processors applied to fp32 logits ``[..., V]`` (every row alike; they ignore the
    sequence, which is therefore not passed)."""
    scores = logits.float()
    if logits_processor:
        shape = scores.shape
        rows = scores.reshape(-1, shape[-1])
        rows = logits_processor(torch.empty(rows.shape[0], 0, dtype=torch.long, device=rows.device), rows)
        scores = rows.reshape(shape)
    return scores


def _candidates(warpers) -> int | None:
    """How many logits can survive the warpers: the top-k of their ``TopKLogitsWarper`` when only temperatures
    come before it (monotone, so the top-k of the raw logits is the top-k it sees) and every filter value is
    -inf (the default; a finite one is changed by later warpers), else None (any may)."""
    if any(getattr(w, "filter_value", float("-inf")) != float("-inf") for w in warpers or ()):
        return None
    for w in warpers or ():
        if type(w) is TopKLogitsWarper:
            return w.top_k
        if type(w) is not TemperatureLogitsWarper:
            return None
    return None


def choose(warpers, logits: torch.Tensor, generator: torch.Generator | None = None,
           what: str = "The draft's distribution") -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens from logits ``[N, V]`` on an eager path: ``(tokens [N], processed fp32 logits)`` -- the argmax
    (``warpers`` None) or a draw from the warped distribution, checked for NaN first (one host read)."""
    logits = logits.float()
    if warpers is None:
        return logits.argmax(-1), logits
    processed = warp(warpers, logits)
    probs = processed.softmax(-1)
    check_finite(probs, what)
    return draw(probs, generator), processed


def draft_draw(warpers, logits: torch.Tensor, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft from fp32 logits ``[B, V]``: ``(token [B], processed logits [B, V])``, the token drawn from
    ``softmax(processed)`` -- any distribution keeps speculative sampling exact as long as it is the one handed
    back as ``q``.  With a top-k among the warpers (``generate``'s default sampling has ``top_k=50``) only its k
    best logits can survive, so the warpers run on those k and the rest is -inf: transformers' ``warp`` but for
    which of several logits tied at the k-th value survive, without its second top-k and its sort of the whole
    vocabulary (graphed on an H100: 127 against 295 us a draft, BENCHMARKS.md)."""
    logits = logits.float()
    k = _candidates(warpers)
    if k is None or k >= logits.shape[-1]:
        processed = warp(warpers, logits)
        return draw(processed.softmax(dim=-1), generator), processed
    values, index = logits.topk(k, dim=-1)
    values = warp(warpers, values)
    processed = torch.full_like(logits, float("-inf")).scatter_(-1, index, values)
    token = index.gather(-1, draw(values.softmax(dim=-1), generator).unsqueeze(-1)).squeeze(-1)
    return token, processed


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One sample per row of ``probs [..., V]`` (non-negative, need not be normalised): the exponential
    race.  A zero-probability entry is never drawn (the clamp keeps ``0 / E`` at 0, never NaN)."""
    race = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return (probs.float() / race.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(dim=-1)


def speculative_accept(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al., algorithm 1) of ``B`` rounds on the device.

    ``drafts [B, g]`` were drawn from ``q [B, g, V]`` (probabilities); ``p [B, g + 1, V]`` are the
    target's processed probabilities at the verified rows.  Draft ``j`` is accepted with probability
    ``min(1, p_j / q_j)`` until the first rejection; at the first rejected row ``n`` a token is drawn
    from ``max(p_n - q_n, 0)`` (``p_n`` where that vanishes), after ``g`` accepted drafts from
    ``p_g``.  Returns ``(n [B], selected [B, g + 1])``: ``selected[:, :n]`` are the accepted drafts and
    ``selected[:, n]`` the target's token, so the round keeps ``selected[:, : n + 1]``."""
    b, g = drafts.shape
    if q.shape[:2] != (b, g) or p.shape[:2] != (b, g + 1) or q.shape[-1] != p.shape[-1]:
        raise ValueError(f"speculative_accept: drafts {tuple(drafts.shape)} need q [B, g, V] and p [B, g + 1, V], "
                         f"got q {tuple(q.shape)} and p {tuple(p.shape)}.")
    q, p = q.float(), p.float()
    index = drafts.unsqueeze(-1)
    q_i, p_i = q.gather(-1, index).squeeze(-1), p[:, :g].gather(-1, index).squeeze(-1)
    uniform = torch.rand(b, g, device=p.device, generator=generator)
    accepted = (uniform * q_i < p_i).long().cumprod(dim=-1).sum(dim=-1)  # r < p/q, r in [0, 1)
    residual = torch.cat([(p[:, :g] - q).clamp_min(0), p[:, g:]], dim=1)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    selected = draw(residual, generator)
    rows = torch.arange(g + 1, device=drafts.device)
    kept = torch.cat([drafts, drafts.new_zeros(b, 1)], dim=1)
    return accepted, torch.where(rows < accepted.unsqueeze(-1), kept, selected)
