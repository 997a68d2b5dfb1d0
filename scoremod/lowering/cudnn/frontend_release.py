"""Free a cuDNN frontend graph's Python objects as soon as it is built.

Why this is needed (cuDNN frontend 1.32): ``cudnn.pygraph`` lowers itself to
a C++ ``backend_graph`` in ``_lower_to_cpp``, whose nested helper
``lower_tensor`` keeps that C++ graph in a closure cell. A score_mod callback
reaches C++ wrapped in a closure that holds ``lower_tensor``, and the C++
graph keeps the callback (a ``std::function`` owning the Python callable).
That is a reference cycle through C++, which Python's garbage collector
cannot see into: the graph, every C++ tensor of the lowering (they keep the
graph alive through nanobind's ``keep_alive``) and our own callbacks with the
tensors they made stay alive until the interpreter exits, where nanobind
reports each of them ("nanobind: leaked instance ... tensor", then the types
and functions those keep alive) on stderr. A lowering the backend declines
(a refused graph) is dropped by the pygraph, but its cycle stays all the same.

:func:`releasing` watches a build: it notes every C++ graph the pygraph
lowers to, and when the build ends (built, refused or failed) it empties the
callbacks' tensor maps, clears the closure cells that hold those C++ graphs
and drops the pygraph's own references to them. Everything is then freed by
reference counting, at once, and nothing is left for the exit.
"""

from __future__ import annotations

import contextlib
import gc
import types


@contextlib.contextmanager
def releasing(graph, *tensor_maps):
    """Around the build of ``graph`` (a ``cudnn.pygraph`` with its ops added):
    afterwards nothing of the frontend stays alive through it.

    ``tensor_maps``: dicts of cuDNN tensors the caller's callbacks fill
    (``Emitter.env``); they are emptied. Read what you need from ``graph``
    (serialized bytes, workspace size, plan name) inside the block. Never
    raises on its own: a frontend without these internals has no such cycle
    to break, and ``graph`` is then left as it is.
    """
    lowered = []
    state = getattr(graph, "__dict__", None)
    lower = getattr(graph, "_lower_to_cpp", None)
    if state is not None and callable(lower):
        def noting_lower(*args, **kwargs):
            cpp = lower(*args, **kwargs)
            lowered.append(cpp)
            return cpp

        state["_lower_to_cpp"] = noting_lower  # this instance only
    try:
        yield graph
    finally:
        if state is not None:
            state.pop("_lower_to_cpp", None)
            current = state.get("_lowered_graph")
            if current is not None and all(current is not c for c in lowered):
                lowered.append(current)
        _release(graph, lowered, tensor_maps)


def _release(graph, lowered, tensor_maps):
    for m in tensor_maps:
        m.clear()
    if lowered:
        # The closure cells of the lowering's helpers (`graph` in _lower_to_cpp).
        for ref in gc.get_referrers(*lowered):
            if isinstance(ref, types.CellType) and any(ref.cell_contents is c for c in lowered):
                ref.cell_contents = None
        lowered.clear()
    reset = getattr(graph, "_reset_lowered_state", None)
    if callable(reset):
        try:
            reset()  # drops _lowered_graph and empties the shared uid -> C++ tensor map
        except Exception:  # noqa: BLE001 - a frontend whose reset needs more state
            pass
