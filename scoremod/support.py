"""What scoremod supports and what it was validated with, in one place.

The install extras (``pyproject.toml``), ``scoremod doctor``, the build's
header packages and the fused path's version checks all read these
constants; tests keep ``pyproject.toml`` and the build in step with them.

Versions are encoded as the libraries' version macros do for cuDNN 9 and
the cuDNN frontend: ``major * 10000 + minor * 100 + patch`` (cuDNN 9.19.0 is
91900, frontend 1.32.0 is 13200).
"""

from __future__ import annotations

import functools

#: scoremod's own version (``scoremod.__version__``; pyproject.toml says the same).
VERSION = "0.1.0"

#: cuDNN versions the fused path runs on: ``low <= version < high``. Inside it,
#: a version is used by ``implementation=None`` once it is validated (below)
#: or its conformance check passed on this machine (``scoremod doctor
#: --verify``, ``lowering/cudnn/verify.py``); the install extras allow it.
CUDNN_SUPPORTED = (91900, 100000)

#: The cuDNN line the GPU suite validated (docs/validation.md).
CUDNN_VALIDATED = (91900, 92000)

#: cuDNN frontend versions (the Python package ``nvidia-cudnn-frontend`` and
#: the C++ headers the extension is compiled against, which must be the same
#: version): ``low <= version < high``. The build refuses headers outside it.
CUDNN_FRONTEND_SUPPORTED = (13200, 20000)

#: The frontend version the GPU suite validated.
CUDNN_FRONTEND = "1.32.0"

#: CUDA major versions with an install extra (``scoremod[cuda12]``, ``[cuda13]``).
CUDA_MAJORS = (12, 13)


def version_text(version: int) -> str:
    """91900 -> '9.19.0'; 13200 -> '1.32.0'."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


cudnn_version_text = version_text


def cudnn_supported(version: int) -> bool:
    """Whether a loaded cuDNN (``cudnnGetVersion()``) is in :data:`CUDNN_SUPPORTED`."""
    low, high = CUDNN_SUPPORTED
    return low <= int(version) < high


def cudnn_validated(version: int) -> bool:
    """Whether a loaded cuDNN is of the line the GPU suite validated."""
    low, high = CUDNN_VALIDATED
    return low <= int(version) < high


def frontend_supported(version: int) -> bool:
    """Whether a cuDNN frontend version (encoded) is in :data:`CUDNN_FRONTEND_SUPPORTED`."""
    low, high = CUDNN_FRONTEND_SUPPORTED
    return low <= int(version) < high


def _range_text(low: int, high: int) -> str:
    if high - low == 100 and low % 100 == 0:
        return f"{low // 10000}.{low // 100 % 100}.x"
    return f">= {version_text(low)}, < {version_text(high)}"


def cudnn_range_text() -> str:
    """The supported cuDNN range as users read it: '>= 9.19.0, < 10.0.0'."""
    return _range_text(*CUDNN_SUPPORTED)


def cudnn_validated_text() -> str:
    """The validated cuDNN line as users read it: '9.19.x'."""
    return _range_text(*CUDNN_VALIDATED)


def frontend_range_text() -> str:
    """The supported frontend range as users read it: '>= 1.32.0, < 2.0.0'."""
    return _range_text(*CUDNN_FRONTEND_SUPPORTED)


def _specifier(low: int, high: int, parts: int) -> str:
    """(91900, 100000), 2 -> '>=9.19,<10': a pip version specifier of the range."""
    def short(v):
        fields = [v // 10000, v // 100 % 100, v % 100][:parts]
        while len(fields) > 1 and fields[-1] == 0:
            fields.pop()
        return ".".join(map(str, fields))

    return f">={short(low)},<{short(high)}"


def cudnn_requirement() -> str:
    """The pip specifier of :data:`CUDNN_SUPPORTED` (the extras' ``nvidia-cudnn-cu*``)."""
    return _specifier(*CUDNN_SUPPORTED, parts=2)


def frontend_requirement() -> str:
    """The pip specifier of :data:`CUDNN_FRONTEND_SUPPORTED` (``nvidia-cudnn-frontend``)."""
    return _specifier(*CUDNN_FRONTEND_SUPPORTED, parts=3)


# --- JAX: what differs between the versions scoremod runs on, one check each ---

#: The jax (major, minor) the Pallas Mosaic GPU kernels are written for (0.11.2's
#: API); on an older jax the Triton engine runs their calls.
JAX_FOR_MOSAIC = (0, 11)


def jax_version() -> tuple:
    """The running jax's (major, minor)."""
    import jax

    return tuple(int(x) for x in jax.__version__.split(".")[:2])


def mosaic_missing() -> str | None:
    """Why this jax cannot run the Mosaic GPU kernels (too old), or None."""
    import jax

    if jax_version() < JAX_FOR_MOSAIC:
        return (f"written for jax {'.'.join(map(str, JAX_FOR_MOSAIC))} or later, found "
                f"{jax.__version__}")
    return None


@functools.cache
def pallas_triton_missing() -> str | None:
    """Why this jax cannot compile Pallas kernels with Triton, or None where it can
    (asked once per process). JAX deprecated Pallas's Triton backend in 0.11
    ("will be removed in a future JAX version"): gone is a module that no longer
    imports, or the deprecation turned into an error. Interpret mode (off a GPU)
    does not need it."""
    import jax

    try:
        import jax.experimental.pallas.triton  # noqa: F401
        from jax._src.pallas.triton import pallas_call_registration  # noqa: F401
    except ImportError as e:
        return f"this jax ({jax.__version__}) has no Pallas Triton backend ({e})"
    try:
        from jax._src import deprecations

        if deprecations.is_accelerated("jax-pallas-triton"):
            return (f"this jax ({jax.__version__}) turned the Pallas Triton backend's "
                    "deprecation into an error")
    except (ImportError, AttributeError, KeyError, ValueError):
        pass  # no such deprecation registered: the backend is plainly there
    return None
