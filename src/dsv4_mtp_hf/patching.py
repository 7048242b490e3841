"""The one module that sets attributes on transformers objects.

Everything it installs is per instance (never on a class, never process-wide) and removable:

* ``generate`` on a target that has a bound drafter or is graphed.  The wrapper offers each call to
  the registered generate handlers in order (:func:`register_generate_handler`: the drafters' assisted
  calls from ``generation/``, a graphed target's plain calls from ``target_runtime/``); the first that takes it
  answers, else the class's own ``generate`` runs;
* other methods a caller hands over (:func:`install` / :func:`uninstall`): a graphed target's
  ``forward``, a packed target's ``save_pretrained``;
* attributes that hold for one call only (:func:`during`): ``_is_stateful``,
  ``_get_candidate_generator``, ``prepare_inputs_for_generation`` inside an assisted call.

Our bookkeeping on a target lives in one record (:class:`TargetRecord`, ``target._dsv4``).  This module
imports nothing from the package, so ``target_runtime/`` and ``generation/`` both build on it.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable

_RECORD = "_dsv4"
_MISSING = object()

# handler(target, cls_generate, args, kwargs) -> the call's result, or NotImplemented to pass it on.
GenerateHandler = Callable[..., object]
_GENERATE_HANDLERS: list[GenerateHandler] = []


class TargetRecord:
    """What this package keeps on one target: its bound drafters, its graphs, the methods installed."""

    def __init__(self):
        self.drafts: weakref.WeakSet = weakref.WeakSet()
        self.graphs = None  # target.graph.TargetGraphs while graphed
        self.installed: set[str] = set()


def register_generate_handler(handler: GenerateHandler, first: bool = False) -> None:
    """Offer every wrapped ``generate`` call to ``handler`` (once per handler; ``first``: before the others)."""
    if handler in _GENERATE_HANDLERS:
        return
    _GENERATE_HANDLERS.insert(0, handler) if first else _GENERATE_HANDLERS.append(handler)


def record(target, create: bool = False) -> TargetRecord | None:
    """The target's record (made when ``create``), else None."""
    rec = target.__dict__.get(_RECORD)
    if rec is None and create:
        rec = target.__dict__[_RECORD] = TargetRecord()
    return rec


def install(obj, name: str, fn) -> None:
    """Set ``obj.name = fn`` on the instance (the class's attribute stays as it is)."""
    obj.__dict__[name] = fn
    rec = record(obj, create=True)
    rec.installed.add(name)


def uninstall(obj, name: str) -> None:
    """Remove what :func:`install` set: the class's attribute shows through again."""
    obj.__dict__.pop(name, None)
    rec = record(obj)
    if rec is not None:
        rec.installed.discard(name)
        _drop_if_empty(obj, rec)


@contextlib.contextmanager
def during(obj, **attrs):
    """Per-instance attributes for the duration of a block, then exactly what was there before."""
    before = {name: obj.__dict__.get(name, _MISSING) for name in attrs}
    obj.__dict__.update(attrs)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = value


def refresh_generate(target) -> None:
    """Install the ``generate`` wrapper while the target has a bound drafter or graphs; remove it after."""
    rec = record(target)
    needed = rec is not None and (len(rec.drafts) > 0 or rec.graphs is not None)
    if needed and "generate" not in rec.installed:
        install(target, "generate", _wrapped_generate(target))
    elif not needed and rec is not None and "generate" in rec.installed:
        uninstall(target, "generate")


def _wrapped_generate(target):
    cls_generate = type(target).generate

    @functools.wraps(cls_generate)
    def generate(*args, **kwargs):
        for handler in _GENERATE_HANDLERS:
            out = handler(target, cls_generate, args, kwargs)
            if out is not NotImplemented:
                return out
        return cls_generate(target, *args, **kwargs)

    return generate


def _drop_if_empty(target, rec: TargetRecord) -> None:
    if not rec.installed and not len(rec.drafts) and rec.graphs is None:
        target.__dict__.pop(_RECORD, None)
