"""The ordered registry of backends: ``implementation=None`` asks them in order.

    >>> from scoremod.lowering import registry
    >>> registry.names()
    ('cudnn-varlen', 'cudnn', 'pallas', 'xla')
    >>> [b.name for b in registry.backends()]
    ['cudnn-varlen', 'cudnn', 'pallas', 'xla']
    >>> registry.get("reference").name
    'xla'

Adding a backend is its package plus one line in ``_BACKENDS`` (in the order
``implementation=None`` should try it), or :func:`register` at run time. A
backend whose GPU tests have not passed yet goes in ``_BY_NAME_ONLY``: it runs
only when asked for by name, with a warning, never automatically.
"""

from __future__ import annotations

import warnings

from scoremod.errors import ScoreModError
from scoremod.lowering.backend import Backend
from scoremod.lowering.cudnn.backend import CUDNN
from scoremod.lowering.cudnn_varlen.backend import CUDNN_VARLEN
from scoremod.lowering.pallas.backend import PALLAS
from scoremod.lowering.reference import REFERENCE



class UnknownImplementationError(ScoreModError, ValueError):
    """``implementation=`` names no registered backend."""


# Tried in this order; the reference path runs anywhere. cudnn-varlen declines
# every mod that is not a segment mask, so it goes before the dense cuDNN path;
# Pallas (slower than cuDNN where both run, but O(S) memory and it computes
# operand gradients) takes what cuDNN refuses, before the reference path.
_BACKENDS: list = [CUDNN_VARLEN, CUDNN, PALLAS, REFERENCE]
# Backends not yet validated on a GPU: by name only, with a warning.
_BY_NAME_ONLY: list = []
_ALIASES = {"reference": "xla"}
_WARNED: set = set()


def backends() -> tuple:
    """The registered backends, in the order ``implementation=None`` tries them."""
    return tuple(_BACKENDS)


def names() -> tuple:
    """Every registered name: the automatic ones in order, then those run by name only."""
    return tuple(b.name for b in _BACKENDS + _BY_NAME_ONLY)


def get(name: str) -> Backend:
    """The backend registered as ``name``; a ScoreModError listing the names otherwise."""
    name = _ALIASES.get(name, name)
    for backend in _BACKENDS:
        if backend.name == name:
            return backend
    for backend in _BY_NAME_ONLY:
        if backend.name == name:
            if name not in _WARNED:
                _WARNED.add(name)
                warnings.warn(f"scoremod: implementation={name!r} is not validated on a GPU yet "
                              "(implementation=None never picks it); check its results against "
                              "implementation=\"xla\"", stacklevel=3)
            return backend
    known = ", ".join(repr(n) for n in names() + tuple(_ALIASES))
    raise UnknownImplementationError(
        f"unknown implementation {name!r}; the registered ones are {known} "
        "(or None to choose automatically)")


def register(backend: Backend, *, before: str | None = None) -> None:
    """Adds ``backend`` (before the one named ``before``, else just before the
    reference path, which stays last since it runs anywhere)."""
    if not isinstance(backend, Backend) or not backend.name:
        raise ScoreModError(f"{backend!r} is not a named scoremod Backend")
    if backend in _BY_NAME_ONLY:  # promoted: tried automatically from now on
        _BY_NAME_ONLY.remove(backend)
    if backend.name in names() or backend.name in _ALIASES:
        raise ScoreModError(f"a backend named {backend.name!r} is already registered")
    at = names().index(before if before is not None else REFERENCE.name)
    _BACKENDS.insert(at, backend)


def unregister(name: str) -> None:
    """Removes the backend ``name`` (the reference path stays)."""
    backend = get(name)
    if backend is REFERENCE:
        raise ScoreModError("the reference path cannot be unregistered")
    (_BACKENDS if backend in _BACKENDS else _BY_NAME_ONLY).remove(backend)
