"""What scoremod supports and what it was validated with, in one place.

The install extras (``pyproject.toml``), ``scoremod doctor``, the build's
header packages and the fused path's version checks all read these
constants; tests keep ``pyproject.toml`` in step with them.

cuDNN versions are encoded as ``cudnnGetVersion()`` returns them for cuDNN 9:
``major * 10000 + minor * 100 + patch`` (9.19.0 is 91900).
"""

from __future__ import annotations

#: cuDNN versions the fused path runs on: ``low <= version < high``. Only the
#: 9.19 line has been validated on a GPU (docs/validation.md); the install
#: extras pin it. Another version loaded at run time is outside this range.
CUDNN_SUPPORTED = (91900, 92000)

#: The cuDNN frontend (Python package ``nvidia-cudnn-frontend`` and the C++
#: headers the extension is compiled against): both must be this version.
CUDNN_FRONTEND = "1.32.0"

#: CUDA major versions with an install extra (``scoremod[cuda12]``, ``[cuda13]``).
CUDA_MAJORS = (12, 13)


def cudnn_version_text(version: int) -> str:
    """91900 -> '9.19.0'."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def cudnn_supported(version: int) -> bool:
    """Whether a loaded cuDNN (``cudnnGetVersion()``) is in :data:`CUDNN_SUPPORTED`."""
    low, high = CUDNN_SUPPORTED
    return low <= int(version) < high


def cudnn_range_text() -> str:
    """The supported range as users read it, e.g. '9.19.x' or '>= 9.19.0, < 9.21.0'."""
    low, high = CUDNN_SUPPORTED
    if high - low == 100 and low % 100 == 0:
        return f"{low // 10000}.{low // 100 % 100}.x"
    return f">= {cudnn_version_text(low)}, < {cudnn_version_text(high)}"
