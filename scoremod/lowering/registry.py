"""The ordered registry of backends: ``implementation=None`` asks them in order.

    >>> from scoremod.lowering import registry
    >>> registry.names()
    ('cudnn-varlen', 'cudnn', 'xla')
    >>> registry.get("reference").name
    'xla'

Adding a backend is its package plus one line in ``_BACKENDS`` (in the order
``implementation=None`` should try it), or :func:`register` at run time.
"""

from __future__ import annotations

from scoremod.errors import ScoreModError
from scoremod.lowering.backend import Backend
from scoremod.lowering.cudnn.backend import CUDNN
from scoremod.lowering.cudnn_varlen.backend import CUDNN_VARLEN
from scoremod.lowering.reference import REFERENCE



class UnknownImplementationError(ScoreModError, ValueError):
    """``implementation=`` names no registered backend."""


_BACKENDS: list = [CUDNN_VARLEN, CUDNN, REFERENCE]  # tried in this order; the reference path runs anywhere
_ALIASES = {"reference": "xla"}


def backends() -> tuple:
    """The registered backends, in the order ``implementation=None`` tries them."""
    return tuple(_BACKENDS)


def names() -> tuple:
    return tuple(b.name for b in _BACKENDS)


def operand_gradients() -> Backend:
    """The first backend whose gradients reach the mod's operands (where a
    fused backend that cannot compute them hands over, if the user allowed it)."""
    return next(b for b in _BACKENDS if b.operand_gradients)


def get(name: str) -> Backend:
    """The backend registered as ``name``; a ScoreModError listing the names otherwise."""
    name = _ALIASES.get(name, name)
    for backend in _BACKENDS:
        if backend.name == name:
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
    if backend.name in names() or backend.name in _ALIASES:
        raise ScoreModError(f"a backend named {backend.name!r} is already registered")
    at = names().index(before if before is not None else REFERENCE.name)
    _BACKENDS.insert(at, backend)


def unregister(name: str) -> None:
    """Removes the backend ``name`` (the reference path stays)."""
    backend = get(name)
    if backend is REFERENCE:
        raise ScoreModError("the reference path cannot be unregistered")
    _BACKENDS.remove(backend)
