"""scoremod's PEP 517 build backend: scikit-build-core plus the extension's headers.

The native extension compiles against the cuDNN frontend, cuDNN and CUDA
runtime headers. With pip's build isolation (the default) the build sees only
its build requirements, and an install extra such as ``[cuda13]`` is not
visible to it, so this backend adds the header packages of one CUDA major to
what scikit-build-core asks for, chosen by the environment variable
``SCOREMOD_CUDA``:

``13`` or ``12``
    that CUDA major's header packages (``HEADER_PACKAGES_BY_CUDA`` in
    ``scoremod/kernels_ffi/find_headers.py``);
``0`` (or ``none``)
    none: the extension is built only if the headers are found elsewhere
    (the target environment, ``$CUDA_HOME``);
unset (or ``auto``)
    13 or 12 when an NVIDIA driver is installed (13 for a driver that runs
    CUDA 13, i.e. 580 or newer), else none: a CPU machine's install stays light.

Without build isolation (``--no-build-isolation``) pip asks for no build
requirements; the headers then come from the environment itself.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys



def _skbuild():
    # Imported when a hook runs (pip has installed it by then), so that the
    # functions below can be tested without it.
    from scikit_build_core import build

    return build


# PEP 517 hooks that need nothing from us.
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _skbuild().build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _skbuild().build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _skbuild().build_sdist(sdist_directory, config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _skbuild().prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _skbuild().prepare_metadata_for_build_editable(metadata_directory, config_settings)


def get_requires_for_build_sdist(config_settings=None):
    return _skbuild().get_requires_for_build_sdist(config_settings)


_HERE = os.path.dirname(os.path.abspath(__file__))
_FIND_HEADERS = os.path.join(_HERE, os.pardir, "scoremod", "kernels_ffi", "find_headers.py")
# The first NVIDIA driver branch that runs CUDA 13.
_CUDA13_DRIVER = 580


def _find_headers():
    # Loaded by path: importing the scoremod package would need jax.
    spec = importlib.util.spec_from_file_location("_scoremod_find_headers", _FIND_HEADERS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def driver_major() -> int | None:
    """The installed NVIDIA driver's major version (e.g. 580), or None without one."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            m = re.search(r"Kernel Module\s+(\d+)\.", f.read())
        if m:
            return int(m.group(1))
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.match(r"\s*(\d+)\.", out)
    return int(m.group(1)) if m else None


def cuda_major(environ=os.environ, driver=driver_major) -> int | None:
    """Which CUDA major's header packages the build installs (None: none)."""
    text = environ.get("SCOREMOD_CUDA", "").strip().lower()
    if text in ("12", "13"):
        return int(text)
    if text in ("0", "none", "off", "cpu"):
        return None
    if text not in ("", "auto"):
        raise ValueError(f"SCOREMOD_CUDA={text!r}: expected 13, 12, 0 (none) or auto")
    major = driver()
    if major is None:
        return None
    return 13 if major >= _CUDA13_DRIVER else 12


def header_requirements(environ=os.environ, driver=driver_major, frontend=None) -> list[str]:
    """The header packages to install into the build environment. The frontend's
    headers are pinned to the version the target environment has (``frontend()``,
    default: found in its site-packages), since the extension works only with a
    Python package of its headers' version; without one, the supported range."""
    major = cuda_major(environ, driver)
    if major is None:
        return []
    headers = _find_headers()
    installed = (headers.installed_frontend if frontend is None else frontend)()
    return [headers.frontend_requirement(installed) if r == headers.FRONTEND_REQUIREMENT else r
            for r in headers.HEADER_PACKAGES_BY_CUDA[major]]


def get_requires_for_build_wheel(config_settings=None):
    return _skbuild().get_requires_for_build_wheel(config_settings) + header_requirements()


def get_requires_for_build_editable(config_settings=None):
    return _skbuild().get_requires_for_build_editable(config_settings) + header_requirements()
