"""The fused cuDNN path (IR -> cuDNN SDPA graphs, run through an XLA FFI call).

Not built yet: asking for it raises, and ``implementation=None`` never
chooses it, so nothing falls back silently.
"""

from __future__ import annotations

from scoremod.errors import CudnnUnavailableError


def usable(query, key, value, mod) -> bool:
    """Whether ``implementation=None`` should take the fused path for this call."""
    return False


def attention(query, key, value, mod, scale, return_lse):
    raise CudnnUnavailableError(
        'implementation="cudnn" is not available in this version of scoremod: the fused '
        'cuDNN path is not built yet. Use implementation="xla" (the reference path) or '
        "implementation=None."
    )
