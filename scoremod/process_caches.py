"""The process's compile caches, set up once at the first ``scoremod.attention`` call.

Backend-neutral: whatever backend a call takes, ``SCOREMOD_JAX_CACHE=1`` turns on
JAX's persistent compilation cache in ``<cache root>/jax`` (``options.jax_cache_dir``)
for every compile of the process. The Pallas kernels' first call is mostly their
compile, so a later process that finds them there starts warm. The cuDNN plan cache
(``lowering.cudnn.plan_store``) is set up by the cuDNN backend at its first lookup.
"""

from __future__ import annotations

import threading

from scoremod import options

_lock = threading.Lock()
_done = False


def setup() -> None:
    """Read the environment and turn on what it asks for, once per process."""
    global _done
    if _done:  # every call after the first: no lock
        return
    with _lock:
        if _done:
            return
        directory = options.jax_cache_dir()
        if directory is not None:
            enable_jax_compilation_cache(directory)
        _done = True


def enable_jax_compilation_cache(directory: str) -> bool:
    """Turn on JAX's persistent compilation cache in ``directory`` for this process,
    writing every compile (not only those over a second); False when the user had
    set ``jax_compilation_cache_dir`` already (theirs is kept)."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        return False
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return True
