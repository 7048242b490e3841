"""Recording a drafter's work as a CUDA graph: what the MTP's and DSpark's graphed drafters share."""

from __future__ import annotations

import torch

from ..compat import progress
from ..ops import inductor_options


def record_graph(fn, lengths, warmup: int, what: str, compiled: bool):
    """Warm ``fn`` up on a side stream (compilation, allocations, Triton autotuning: work a capture must not
    meet), capture it, and restore ``lengths`` (the drafter cache's lengths, which ``fn`` advances: a tensor, or
    a list of them, one per layer cache, every one restored) after every run.  Returns ``(graph, fn's static
    outputs)``.  A failing compiled warm-up raises an error naming ``what`` and the way out (``compile=False``)."""
    lengths = [lengths] if isinstance(lengths, torch.Tensor) else list(lengths)
    saved = [t.clone() for t in lengths]
    rng = torch.cuda.get_rng_state()  # warm-ups draw too: a seeded call must not depend on whether it captured
    bar = progress(desc=f"{'compiling and ' if compiled else ''}capturing {what}", total=warmup + 1, unit="run")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        try:
            for _ in range(warmup):
                fn()
                _restore(lengths, saved)
                bar.update()
        except Exception as err:
            _restore(lengths, saved)
            if not compiled:
                raise
            raise RuntimeError(
                f"torch.compile of {what} failed ({type(err).__name__}: {str(err)[:500]}). Pass `compile=False` to "
                "capture the uncompiled step."
            ) from err
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    _restore(lengths, saved)
    torch.cuda.set_rng_state(rng)
    bar.update()
    bar.close()
    return graph, out


def _restore(lengths: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    for t, s in zip(lengths, saved, strict=True):
        t.copy_(s)


def compile_options(device: torch.device, mode: str | None = None) -> dict | None:
    """Inductor options for a drafter's compiled step (on sm_90+ its kernels launch with PDL like ours)."""
    import torch._inductor
    import torch._inductor.config

    options = dict(torch._inductor.list_mode_options(mode or "default"))
    if device.type == "cuda":
        options.update(inductor_options(device))
    return options or None


KEPT_DRAFTERS = 4  # graphed drafters a model keeps for later calls (one per K / mode / warpers)


def kept_drafter(model, key: tuple, make):
    """The model's graphed drafter for ``key``, made by ``make()`` the first time: later ``generate`` calls reuse it
    (its CUDA graphs, captured once per shape, then cost nothing).  ``key`` holds what the graphs read by address
    and what shapes them; the oldest of :data:`KEPT_DRAFTERS` is dropped.  The drafter's cache is reset."""
    kept = model.__dict__.setdefault("_kept_drafters", {})
    if key in kept:
        kept[key].cache.reset()
        return kept[key]
    drafter = make()
    while len(kept) >= KEPT_DRAFTERS:
        kept.pop(next(iter(kept)))
    kept[key] = drafter
    return drafter


def weight_pointers(model) -> tuple:
    """Addresses and dtypes of the tensors a captured graph reads (every weight and buffer of the drafter, the
    target's embedding and head): a drafter whose weights moved (a dtype or device change, a replaced module)
    gets new graphs rather than replaying over freed memory."""
    tensors = (*model.parameters(), *model.buffers(), model.get_input_embeddings().weight,
               model.get_output_embeddings().weight)
    return tuple((t.data_ptr(), t.dtype) for t in tensors)
