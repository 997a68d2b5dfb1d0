"""``scoremod doctor``: what this machine has, and whether the fused path runs here.

Every check is a function of its own that returns a line of text and never
raises: a broken install is what this command is for, so each failure is
reported where it happens, with what fixes it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import sys

from scoremod import support

_CPU_JAX_FIX = 'pip install "scoremod[cuda13]" (or [cuda12]; docs/install.md)'


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version (e.g. '580.159.04'), or None without one."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            m = re.search(r"Kernel Module\s+([\d.]+)", f.read())
        if m:
            return m.group(1)
    except OSError:
        pass
    return _nvml_driver_version()  # some VMs have no /proc/driver/nvidia


def _nvml_driver_version() -> str | None:
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        buf = ctypes.create_string_buffer(96)
        ok = nvml.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(len(buf))) == 0
        nvml.nvmlShutdown()
        return buf.value.decode() if ok and buf.value else None
    except (OSError, AttributeError):
        return None


def cuda_plugins() -> list[str]:
    """The installed JAX CUDA plugins, as 'name version'."""
    out = []
    for major in support.CUDA_MAJORS[::-1]:
        version = _dist_version(f"jax-cuda{major}-plugin")
        if version is not None:
            out.append(f"jax-cuda{major}-plugin {version}")
    return out


def gpus() -> tuple[list, str]:
    """(JAX's GPU devices, why there are none: '' when there are some)."""
    import jax

    try:
        devices = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError as e:
        return [], f"JAX could not start: {e}"
    if devices:
        return devices, ""
    plugins, driver = cuda_plugins(), driver_version()
    if plugins:
        try:
            jax.devices("gpu")
            error = ""
        except RuntimeError as e:
            error = f": {str(e).splitlines()[0]}"
        return [], (f"{', '.join(plugins)} is installed but JAX found no GPU{error} "
                    "(check the NVIDIA driver and CUDA_VISIBLE_DEVICES)")
    if driver:
        return [], (f"an NVIDIA driver ({driver}) is installed but this JAX is a CPU-only "
                    f"build: {_CPU_JAX_FIX}")
    return [], "this machine has no NVIDIA GPU (no NVIDIA driver is installed)"


def loaded_cudnn_version() -> tuple[int | None, str]:
    """(cudnnGetVersion() of the libcudnn this process uses, its path), or (None, why not)."""
    from scoremod import device

    return device.loaded_cudnn_version()


def frontend_line() -> str:
    from scoremod import kernels_ffi

    installed = _dist_version("nvidia-cudnn-frontend")
    if installed is None:
        return (f'not installed: pip install --no-deps "nvidia-cudnn-frontend'
                f'{support.frontend_requirement()}" (or the [cuda13] / [cuda12] extra)')
    text = f"nvidia-cudnn-frontend {installed}"
    encoded = kernels_ffi.encode_version(installed)
    if encoded is None or not support.frontend_supported(encoded):
        text += f" (NOT in the supported range {support.frontend_range_text()})"
    elif installed != support.CUDNN_FRONTEND:
        text += f" (validated: {support.CUDNN_FRONTEND})"
    mismatch = kernels_ffi.frontend_mismatch() if kernels_ffi.available() else ""
    return text + (f"; MISMATCH: {mismatch}" if mismatch else "")


def extension_line() -> str:
    from scoremod import kernels_ffi

    if not kernels_ffi.available():
        if driver_version() is None and kernels_ffi.library_path() is None:
            # Nothing to build it for: what is missing, in one line, without the command.
            return ("not built (needed only with an NVIDIA GPU; on one, this line gives the build "
                    f"command): {kernels_ffi.not_built_reason(fix=False)}")
        return "not built: " + kernels_ffi.unavailable_reason()
    cudart = kernels_ffi.compiled_cudart_version()
    return (f"built, loads: {kernels_ffi.library_path()} (cuDNN "
            f"{support.cudnn_version_text(kernels_ffi.compiled_cudnn_version())} headers, CUDA "
            f"{cudart // 1000}.{cudart % 1000 // 10}, frontend "
            f"{support.cudnn_version_text(kernels_ffi.compiled_frontend_version())})")


def fused_verdict() -> tuple[bool, str]:
    """(whether ``implementation=None`` takes the fused path here, a line saying so and why).

    Asked of plain bfloat16 attention at a small shape, so that only the
    machine and the install are judged, not a mod. A cuDNN not verified here
    yet is reported, not checked (``scoremod doctor --verify`` checks it).
    """
    import jax.numpy as jnp

    import scoremod
    from scoremod.lowering.cudnn import verify

    q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    try:
        with verify.deferred():
            choice = scoremod.which_implementation(q, q, q)
    except Exception as e:  # noqa: BLE001 - report whatever breaks
        return False, f"cannot run here: {type(e).__name__}: {e}"
    if choice.implementation != "cudnn":  # the Pallas kernels or the reference path
        reason = choice.verdicts["cudnn"] or "the fused path was not chosen"
        if "not validated on this GPU family" in reason:
            return False, f'runs only when asked for (implementation="cudnn"): {reason}'
        if "not verified on this GPU yet" in reason:
            return False, f"not yet: {reason}"
        return False, f"cannot run here: {reason}"
    return True, "runs here: implementation=None runs attention as fused cuDNN graphs"


def pallas_verdict() -> str:
    """Whether and how the Pallas kernels run here: plain bfloat16 attention at head
    dim 128, judged by the backend itself (its engine under the default options)."""
    import jax.numpy as jnp

    from scoremod import device
    from scoremod import options as lowering_options
    from scoremod.attention import check_inputs
    from scoremod.lowering import registry

    try:
        q = jnp.zeros((1, 128, 1, 128), jnp.bfloat16)
        problem = check_inputs(q, q, q)
        pallas = registry.get("pallas")
        why = pallas.why_not(problem, None, automatic=False)
        if why:
            return f"cannot run here: {why}"
        engine, note = pallas.engine(problem, None, lowering_options.current())
    except Exception as e:  # noqa: BLE001 - report whatever breaks
        return f"cannot run here: {type(e).__name__}: {e}"
    from scoremod import support

    if device.current().platform != "gpu":
        too_old = support.mosaic_missing()
        missing = (f"; their Mosaic GPU engine (Hopper) is {too_old}: jax 0.11 and newer need "
                   "Python 3.12 or newer (docs/install.md)") if too_old else ""
        return ('interpret mode only (no GPU): implementation="pallas" runs, slowly; '
                f"for tests{missing}")
    if engine == "mosaic":
        gone = support.pallas_triton_missing()
        if gone:
            return ("runs here on the Mosaic GPU engine (Hopper kernels); the Triton engine "
                    f"cannot compile here ({gone}): what the Mosaic engine refuses runs on "
                    "the reference path")
        return ("runs here on the Mosaic GPU engine (Hopper kernels); the Triton engine takes "
                "what it refuses")
    return f"runs here on the Triton engine{f' (the Mosaic GPU engine: {note})' if note else ''}"


def caches_line() -> str:
    """The on-disk caches: the cuDNN plan store and JAX's compilation cache."""
    import jax

    from scoremod import options as lowering_options
    from scoremod.lowering.cudnn import plan_store

    try:
        plans = plan_store.describe()
        theirs = jax.config.jax_compilation_cache_dir
        ours = lowering_options.jax_cache_dir()
    except Exception as e:  # noqa: BLE001 - a bad SCOREMOD_* setting: say which
        return f"cannot be read: {type(e).__name__}: {e}"
    if theirs:
        compiled = f"JAX compilation cache: {theirs} (your jax_compilation_cache_dir)"
    elif ours:
        compiled = f"JAX compilation cache: {ours} (SCOREMOD_JAX_CACHE=1)"
    else:
        compiled = ("JAX compilation cache: off (SCOREMOD_JAX_CACHE=1 keeps compiled kernels "
                    "between processes)")
    return f"{plans}\n{compiled}"


def cudnn_status() -> str:
    """What the fused path's version check makes of the loaded cuDNN: validated,
    verified here (passed or failed), not verified yet, known to be bad or outside
    the supported range."""
    from scoremod.lowering.cudnn import verify

    try:
        return verify.status_line()
    except Exception as e:  # noqa: BLE001 - a bad SCOREMOD_* setting: say which
        return f"cannot be judged: {type(e).__name__}: {e}"


def report() -> list[tuple[str, str]]:
    """The doctor's findings as (label, text) rows, in order."""
    import jax

    import scoremod

    rows = [("python", f"{platform.python_version()} ({sys.executable})"),
            ("scoremod", f"{scoremod.__version__} ({os.path.dirname(scoremod.__file__)})"),
            ("jax", f"{jax.__version__}, jaxlib {_dist_version('jaxlib') or '?'}"),
            ("CUDA plugin", ", ".join(cuda_plugins()) or f"none (a CPU-only jax): {_CPU_JAX_FIX}"),
            ("NVIDIA driver", driver_version() or "none")]
    devices, why = gpus()
    if devices:
        for i, d in enumerate(devices):
            cc = getattr(d, "compute_capability", "?")
            rows.append((f"GPU {i}", f"{d.device_kind} (compute capability {cc})"))
    else:
        rows.append(("GPU", f"none visible to JAX: {why}"))
    version, where = loaded_cudnn_version() if devices else (None, "no GPU")
    if version is None:
        rows.append(("cuDNN", f"not loaded ({where}); scoremod supports {support.cudnn_range_text()}"))
    else:
        rows.append(("cuDNN", f"{support.cudnn_version_text(version)} ({where}): "
                              f"{cudnn_status()}"))
    rows.append(("cuDNN frontend", frontend_line()))
    rows.append(("extension", extension_line()))
    rows.append(("fused path", fused_verdict()[1]))
    rows.append(("pallas kernels", pallas_verdict()))
    rows.append(("caches", caches_line()))
    return rows


def verify_main() -> int:
    """``scoremod doctor --verify``: the conformance check of the loaded cuDNN on this
    GPU, run now and recorded (0: passed, 1: failed or refused, 2: cannot run here)."""
    import jax.numpy as jnp

    from scoremod import device
    from scoremod.attention import check_inputs
    from scoremod.lowering import registry
    from scoremod.lowering.cudnn import verify

    def say(text):
        print(f"scoremod doctor --verify: {text}", flush=True)

    devices, why = gpus()
    if not devices:
        say(f"cannot check here: no GPU ({why})")
        return 2
    key = verify.current_key()
    if key is None:
        say(f"cannot check here: {loaded_cudnn_version()[1]}")
        return 2
    bad = verify.known_bad(key.cudnn, key.frontend, device.current().family)
    if bad is not None:
        say(f"not checked: {bad}")
        return 1
    if not support.cudnn_supported(key.cudnn):
        say(f"not checked: cuDNN {support.version_text(key.cudnn)} is outside the supported "
            f"range {support.cudnn_range_text()}")
        return 2
    q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with verify.checking():  # the machine's checks only: the version is what is checked
        why = registry.get("cudnn").why_not(check_inputs(q, q, q), None, automatic=False)
    if why is not None:
        say(f"cannot check here: {why}")
        return 2
    say(f"checking {key.text()} on {devices[0].device_kind}: {len(verify.CASES)} mods, forward "
        f"and backward in {' and '.join(verify.DTYPES)}, against the reference path")
    found = verify.check_and_record(key, progress=lambda r: print("  " + r.line(), flush=True))
    say(f"{found.state.upper()} in {found.seconds:.0f} s: {found.summary()}")
    where = verify.verdict_path(key)
    say(f"verdict kept in {where}" if where and os.path.exists(where)
        else "verdict kept for this process only (no cache folder: SCOREMOD_CACHE_DIR)")
    if found.passed:
        say("implementation=None runs the fused path with this cuDNN on this GPU")
        return 0
    say('implementation=None takes the next route; implementation="cudnn" runs the fused '
        "path anyway, with a warning")
    return 1


def main(verify: bool = False) -> int:
    if verify:
        return verify_main()
    rows = report()
    width = max(len(label) for label, _ in rows) + 2
    for label, text in rows:
        lines = str(text).splitlines() or [""]
        print(f"{label + ':':{width}s}{lines[0]}")
        for line in lines[1:]:
            print(f"{'':{width}s}{line}")
    return 0
