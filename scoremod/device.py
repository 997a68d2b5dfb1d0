"""What the device a call runs on can do: platform, GPU family, SMs, memory.

Backends ask here instead of reading ``jax.devices()`` themselves, so one
place knows how JAX spells a device's capabilities (and a test can stand in
a different device by replacing :func:`current`).

    >>> from scoremod import device
    >>> d = device.current()
    >>> d.platform in ("cpu", "gpu", "tpu") and (d.family is None) == (d.platform != "gpu")
    True
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os

__all__ = ["Device", "current", "available_memory", "loaded_cudnn_version"]


@dataclasses.dataclass(frozen=True)
class Device:
    """The default JAX device, as the backends see it."""

    platform: str  # "cpu", "gpu", "tpu", or "none" when JAX has no device
    kind: str  # jax's device_kind, e.g. "NVIDIA H200"
    family: int | None  # compute capability major of an NVIDIA GPU (9: Hopper), else None
    sm_count: int | None  # streaming multiprocessors of an NVIDIA GPU, else None
    capability: str = ""  # compute capability of an NVIDIA GPU, e.g. "9.0"; else ""


def current() -> Device:
    """The default device of this process (``jax.devices()[0]``)."""
    import jax

    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return Device("none", "", None, None)
    family = sm_count = None
    capability = ""
    if dev.platform == "gpu":
        capability = str(getattr(dev, "compute_capability", ""))
        try:
            family = int(capability.split(".")[0])
        except ValueError:
            family = None
        count = getattr(dev, "core_count", None)
        sm_count = count if isinstance(count, int) and count > 0 else None
    return Device(dev.platform, str(getattr(dev, "device_kind", "")), family, sm_count, capability)


def available_memory() -> int | None:
    """Bytes a computation on the default device may use: the accelerator's
    memory limit, or the host's available RAM on a CPU; None when unknown."""
    import jax

    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return None
    if dev.platform != "cpu":
        try:
            stats = dev.memory_stats() or {}
        except Exception:  # not every backend reports memory
            stats = {}
        limit = stats.get("bytes_limit")
        return int(limit) - int(stats.get("bytes_in_use", 0)) if limit else None
    return _host_available()


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _mapped_cudnn() -> list[str]:
    """Paths of the libcudnn.so files mapped into this process."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {line.split()[-1] for line in f if "libcudnn.so" in line}
    except OSError:
        return []
    return sorted(p for p in paths
                  if p.startswith("/") and os.path.basename(p).startswith("libcudnn.so"))


@functools.lru_cache(maxsize=1)
def _version_of_loaded() -> tuple[int, str] | None:
    for path in _mapped_cudnn():
        try:
            lib = ctypes.CDLL(path)
            lib.cudnnGetVersion.restype = ctypes.c_size_t
            return int(lib.cudnnGetVersion()), path
        except (OSError, AttributeError):
            continue
    return None


def loaded_cudnn_version() -> tuple[int | None, str]:
    """(``cudnnGetVersion()`` of the libcudnn this process uses, its path), or
    (None, why not). JAX's CUDA plugin loads cuDNN with its GPU backend; if it
    has not, the FFI extension loads the one the fused path would use. Cheap
    after the first call (a process loads one cuDNN), and it never imports the
    cuDNN frontend."""
    found = _version_of_loaded()
    if found is None:
        from scoremod import kernels_ffi

        if kernels_ffi.available():
            try:
                kernels_ffi.load_cuda_libraries()
            except Exception as e:  # noqa: BLE001 - a diagnostic never fails the caller
                return None, f"the FFI extension could not load cuDNN: {e}"
            _version_of_loaded.cache_clear()
            found = _version_of_loaded()
    if found is None:
        _version_of_loaded.cache_clear()  # maybe later, once a library is loaded
        return None, "no libcudnn is loaded in this process"
    return found
