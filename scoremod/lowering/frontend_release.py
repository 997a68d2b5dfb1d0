"""Free a built cuDNN frontend graph's Python objects as soon as it is serialized.

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
and functions those keep alive) on stderr.

:func:`release` breaks the cycle from the Python side once scoremod has
taken what it needs from the graph (the serialized bytes, the workspace size,
the plan name): it empties the callbacks' tensor maps, clears the closure
cells that hold the lowered C++ graph and drops the pygraph's own references
to it. Everything is then freed by reference counting, at once.
"""

from __future__ import annotations

import gc
import types


def release(graph, *tensor_maps) -> None:
    """Let ``graph`` (a built ``cudnn.pygraph``) and its C++ objects be freed.

    ``tensor_maps``: dicts of cuDNN tensors the caller's callbacks filled
    (``Emitter.env``); they are emptied. Call it when nothing more is read
    from ``graph``, on success and on failure alike. Never raises: a
    frontend without these internals simply has nothing to release here.
    """
    for m in tensor_maps:
        m.clear()
    state = getattr(graph, "__dict__", {})
    lowered = state.get("_lowered_graph")
    if lowered is not None:
        # The closure cells of the lowering's helpers (`graph` in _lower_to_cpp).
        for ref in gc.get_referrers(lowered):
            if isinstance(ref, types.CellType):
                ref.cell_contents = None
    reset = getattr(graph, "_reset_lowered_state", None)
    if callable(reset):
        try:
            reset()  # drops _lowered_graph and empties the shared uid -> C++ tensor map
        except Exception:  # noqa: BLE001 - a frontend whose reset needs more state
            pass
    if "_lowered_graph" in state:
        state["_lowered_graph"] = None
    tensors = state.get("_cpp_tensors")
    if isinstance(tensors, dict):
        tensors.clear()
