"""Find the C/C++ headers the scoremod FFI extension is compiled against.

CMake runs this file at configure time (``CMakeLists.txt``); it is also a
diagnostic tool::

    python scoremod/kernels_ffi/find_headers.py          # human-readable report
    python scoremod/kernels_ffi/find_headers.py --json   # machine-readable

Four header sets are needed, all from pip packages or a CUDA toolkit; none of
their libraries is linked (the extension dlopens cuDNN / the CUDA runtime at
run time):

=================  =======================================  ==============================
set                looked for                               provided by
=================  =======================================  ==============================
XLA FFI            ``xla/ffi/api/ffi.h``                    ``jaxlib`` (``<site>/jaxlib/include``)
cuDNN frontend     ``cudnn_frontend.h``                     ``nvidia-cudnn-frontend`` (``<site>/include``)
cuDNN (>= 9)       ``cudnn.h``, ``cudnn_version.h``         ``nvidia-cudnn-cu12/cu13`` (``nvidia/cudnn/include``),
                                                            ``nvidia-cudnn-jit-cu12`` (``nvidia/cudnn_jit/include``)
CUDA runtime       ``cuda.h``, ``cuda_runtime_api.h``,      a CUDA toolkit (``/usr/local/cuda/include``) or
                   ``crt/host_defines.h``, ``nv/target``,   ``nvidia-cuda-runtime`` + ``-crt`` + ``-cccl`` +
                   ``nvrtc.h``                              ``-nvrtc`` (CUDA 13, ``nvidia/cu13/include``)
=================  =======================================  ==============================

Search order for each set (first complete candidate wins):

1. an environment variable naming the directory: ``SCOREMOD_JAXLIB_INCLUDE_DIR``,
   ``SCOREMOD_CUDNN_FRONTEND_INCLUDE_DIR``, ``SCOREMOD_CUDNN_INCLUDE_DIR``,
   ``SCOREMOD_CUDA_INCLUDE_DIR`` (the last two may list several directories
   separated by ``os.pathsep``). When set, only that is used;
2. every ``sys.path`` entry of the interpreter running this script (the build
   environment; includes ``PYTHONPATH``);
3. the target environment's site-packages: with pip's build isolation the
   build interpreter is the user's own, so ``sysconfig``'s purelib/platlib,
   ``site.getsitepackages()``, the ``sys.base_prefix`` paths, ``$VIRTUAL_ENV``
   and ``$CONDA_PREFIX`` still point at the environment being installed into;
4. system locations: ``$CUDA_HOME``/``$CUDA_PATH``, ``/usr/local/cuda/include``,
   ``/usr/include``.

Standard library only: it runs inside pip's isolated build environment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import site
import sys
import sysconfig
from dataclasses import asdict, dataclass, field

#: The cuDNN frontend versions whose headers the extension compiles against,
#: ``low <= version < high`` (scoremod.support.CUDNN_FRONTEND_SUPPORTED, which
#: a test keeps equal): headers outside it are not used.
FRONTEND_RANGE = ((1, 32, 0), (2, 0, 0))
FRONTEND_PACKAGE = "nvidia-cudnn-frontend"
FRONTEND_REQUIREMENT = FRONTEND_PACKAGE + ">=1.32,<2"

#: The pip packages that provide every header set on a machine without a CUDA
#: toolkit, per CUDA major: the cuDNN frontend (any version of the supported
#: range; the build pins the one the target environment has, see
#: :func:`frontend_requirement`), cuDNN 9.19 and the CUDA runtime headers.
#: Only their headers are compiled against (nothing is linked, no GPU is
#: needed). The isolated build installs the set that ``SCOREMOD_CUDA``
#: selects (``build_backend/scoremod_build.py``).
HEADER_PACKAGES_BY_CUDA = {
    13: (
        FRONTEND_REQUIREMENT,
        "nvidia-cudnn-jit-cu13==9.19.0.56",
        "nvidia-cuda-runtime==13.0.88",
        "nvidia-cuda-crt==13.0.88",
        "nvidia-cuda-cccl==13.0.85",
        "nvidia-cuda-nvrtc==13.0.88",
    ),
    12: (
        FRONTEND_REQUIREMENT,
        "nvidia-cudnn-jit-cu12==9.19.0.56",
        "nvidia-cuda-runtime-cu12==12.9.79",
        "nvidia-cuda-nvcc-cu12==12.9.86",  # crt/host_defines.h
        "nvidia-cuda-cccl-cu12==12.9.27",
        "nvidia-cuda-nvrtc-cu12==12.9.86",
    ),
}
#: The CUDA 13 set (what CI and the H200 use).
HEADER_PACKAGES = HEADER_PACKAGES_BY_CUDA[13]


def _checkout() -> str | None:
    """The source checkout this file belongs to (it has pyproject.toml), if any."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return root if os.path.isfile(os.path.join(root, "pyproject.toml")) else None


def rebuild_command(cuda_major: int = 13, checkout: str | None = None) -> str:
    """The one command that (re)builds scoremod with its extension.

    Build isolation on: pip installs the header packages of ``cuda_major``
    into the build environment (``SCOREMOD_CUDA`` selects them), so this
    works in a fresh virtual environment. ``--no-deps`` leaves the installed
    jax alone.
    """
    where = checkout or _checkout()
    target = f"-e {where}" if where else "--force-reinstall --no-binary scoremod scoremod"
    return f"SCOREMOD_CUDA={cuda_major} python -m pip install --no-deps {target}"


REBUILD = rebuild_command()


@dataclass
class HeaderSet:
    key: str
    title: str
    env_var: str
    include_dirs: list[str] = field(default_factory=list)
    version: str = ""
    origin: str = ""
    tried: list[str] = field(default_factory=list)
    fix: str = ""

    @property
    def found(self) -> bool:
        return bool(self.include_dirs)


# --------------------------------------------------------------------------- #
# where to look


def _dedupe(paths):
    seen, out = set(), []
    for path, origin in paths:
        if not path:
            continue
        try:
            real = os.path.realpath(path)
        except OSError:
            continue
        if real in seen or not os.path.isdir(real):
            continue
        seen.add(real)
        out.append((path, origin))
    return out


def _prefix_site_dirs(prefix: str) -> list[str]:
    out = []
    for scheme_vars in ({"base": prefix, "platbase": prefix},):
        try:
            paths = sysconfig.get_paths(vars=scheme_vars)
        except Exception:  # noqa: BLE001 - unusual sysconfig schemes
            continue
        out += [paths.get("purelib", ""), paths.get("platlib", "")]
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    out += [os.path.join(prefix, "lib", ver, "site-packages"),
            os.path.join(prefix, "lib64", ver, "site-packages")]
    return out


def site_dirs() -> list[tuple[str, str]]:
    """(directory, origin) pairs of every site-packages-like dir, in search order."""
    here = os.path.dirname(os.path.abspath(__file__))
    dirs: list[tuple[str, str]] = [(p, "sys.path") for p in sys.path
                                   if p and os.path.abspath(p) != here]
    target: list[str] = []
    paths = sysconfig.get_paths()
    target += [paths.get("purelib", ""), paths.get("platlib", "")]
    try:
        target += list(site.getsitepackages())
    except Exception:  # noqa: BLE001 - some virtualenvs lack it
        pass
    try:
        target.append(site.getusersitepackages())
    except Exception:  # noqa: BLE001
        pass
    target += _prefix_site_dirs(sys.base_prefix)
    for var in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        if os.environ.get(var):
            target += _prefix_site_dirs(os.environ[var])
    dirs += [(p, "target environment") for p in target]
    return _dedupe(dirs)


def _system_roots() -> list[tuple[str, str]]:
    roots = []
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(var):
            roots.append((os.path.join(os.environ[var], "include"), f"${var}"))
    roots += [("/usr/local/cuda/include", "system"), ("/usr/include", "system"),
              ("/usr/include/x86_64-linux-gnu", "system")]
    return roots


def _env_dirs(var: str) -> list[str] | None:
    value = os.environ.get(var, "").strip()
    if not value:
        return None
    return [d for d in value.split(os.pathsep) if d]


def _has(d: str, rel: str) -> bool:
    return os.path.isfile(os.path.join(d, rel))


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _define(text: str, name: str) -> int | None:
    m = re.search(rf"^\s*#\s*define\s+{name}\s+\(?\s*(\d+)", text, re.MULTILINE)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------- #
# the four header sets


def _first_complete(hs: HeaderSet, candidates, required, check=None) -> HeaderSet:
    """Takes the first (dir, origin) that has every `required` file (and passes `check`)."""
    for d, origin in candidates:
        if not os.path.isdir(d):
            if origin.startswith("SCOREMOD_"):
                hs.tried.append(f"{d} ({origin}): not a directory")
            continue
        missing = [r for r in required if not _has(d, r)]
        if missing:
            hs.tried.append(f"{d} ({origin}): no {', '.join(missing)}")
            continue
        problem = check(d) if check else ""
        if problem:
            hs.tried.append(f"{d} ({origin}): {problem}")
            continue
        hs.include_dirs, hs.origin = [d], origin
        return hs
    return hs


def find_jaxlib(sites) -> HeaderSet:
    hs = HeaderSet("jaxlib", "XLA FFI headers (jaxlib)", "SCOREMOD_JAXLIB_INCLUDE_DIR",
                   fix='python -m pip install "jaxlib>=0.10,<0.13"')
    env = _env_dirs(hs.env_var)
    cands = ([(d, hs.env_var) for d in env] if env is not None else
             [(os.path.join(s, "jaxlib", "include"), o) for s, o in sites])
    _first_complete(hs, cands, ["xla/ffi/api/ffi.h", "xla/ffi/api/c_api.h"])
    if hs.found:
        jaxlib_dir = os.path.dirname(hs.include_dirs[0])
        m = re.search(r'_version\s*(?::\s*str\s*)?=\s*"([^"]+)"',
                      _read(os.path.join(jaxlib_dir, "version.py")))
        hs.version = m.group(1) if m else ""
    return hs


def frontend_in_range(version: tuple) -> bool:
    """Whether a frontend version (major, minor, patch) is in :data:`FRONTEND_RANGE`."""
    low, high = FRONTEND_RANGE
    return low <= tuple(version) < high


def _frontend_header_version(d: str) -> tuple[int, int, int] | None:
    text = _read(os.path.join(d, "cudnn_frontend_version.h"))
    parts = [_define(text, f"CUDNN_FRONTEND_{p}_VERSION") for p in ("MAJOR", "MINOR", "PATCH")]
    return None if None in parts else tuple(parts)  # type: ignore[return-value]


def installed_frontend(sites=None) -> tuple[int, int, int] | None:
    """The version of the ``nvidia-cudnn-frontend`` installed in the environment being
    built for (read from its ``.dist-info`` folder, nothing imported), or None. When
    pip asks for the build requirements, the isolated build environment holds only
    the build system's own, so any one found is the target environment's."""
    sites = site_dirs() if sites is None else sites
    for d, _ in sites:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            m = re.fullmatch(r"nvidia_cudnn_frontend-(\d+)\.(\d+)\.(\d+)\.dist-info", name)
            if m:
                return tuple(int(x) for x in m.groups())  # type: ignore[return-value]
    return None


def frontend_requirement(installed: tuple | None) -> str:
    """The frontend headers the build installs: the target environment's version
    where it is in range (the extension must match it), else the range."""
    if installed is not None and frontend_in_range(installed):
        return f"{FRONTEND_PACKAGE}=={'.'.join(map(str, installed))}"
    return FRONTEND_REQUIREMENT


def find_cudnn_frontend(sites) -> HeaderSet:
    hs = HeaderSet("cudnn_frontend", "cuDNN frontend headers (cudnn_frontend.h)",
                   "SCOREMOD_CUDNN_FRONTEND_INCLUDE_DIR",
                   fix=f'python -m pip install --no-deps "{HEADER_PACKAGES[0]}" '
                       "(the same version as the Python `cudnn` package you build graphs with)")
    env = _env_dirs(hs.env_var)
    cands = ([(d, hs.env_var) for d in env] if env is not None else
             [(os.path.join(s, "include"), o) for s, o in sites])

    def check(d):
        v = _frontend_header_version(d)
        if v is None:
            return "cannot parse CUDNN_FRONTEND_MAJOR_VERSION from cudnn_frontend_version.h"
        if not frontend_in_range(v):
            return (f"cuDNN frontend {'.'.join(map(str, v))} is outside the supported range "
                    f"({FRONTEND_REQUIREMENT})")
        return ""

    _first_complete(hs, cands, ["cudnn_frontend.h", "cudnn_frontend_version.h",
                                "cudnn_frontend/graph_interface.h"], check)
    if hs.found:
        hs.version = ".".join(map(str, _frontend_header_version(hs.include_dirs[0])))
    return hs


def _cudnn_version(d: str) -> tuple[int, int, int] | None:
    text = _read(os.path.join(d, "cudnn_version.h"))
    parts = [_define(text, n) for n in ("CUDNN_MAJOR", "CUDNN_MINOR", "CUDNN_PATCHLEVEL")]
    return None if None in parts else tuple(parts)  # type: ignore[return-value]


def find_cudnn(sites) -> HeaderSet:
    hs = HeaderSet("cudnn", "cuDNN 9 headers (cudnn.h)", "SCOREMOD_CUDNN_INCLUDE_DIR",
                   fix=f"python -m pip install --no-deps {HEADER_PACKAGES[1]} "
                       "(headers only; any cuDNN 9 wheel such as nvidia-cudnn-cu12/cu13 also works)")
    env = _env_dirs(hs.env_var)
    if env is not None:
        cands = [(d, hs.env_var) for d in env]
    else:
        cands = [(os.path.join(s, "nvidia", sub, "include"), o)
                 for s, o in sites for sub in ("cudnn", "cudnn_jit", "cu13", "cu12")]
        cands += _system_roots()

    def check(d):
        v = _cudnn_version(d)
        if v is None:
            return "cannot parse CUDNN_MAJOR from cudnn_version.h"
        if v[0] < 9:
            return f"cuDNN {v[0]}.{v[1]}.{v[2]} is older than 9"
        return ""

    _first_complete(hs, cands, ["cudnn.h", "cudnn_version.h"], check)
    if hs.found:
        hs.version = ".".join(map(str, _cudnn_version(hs.include_dirs[0])))
    return hs


def _cuda_root_set(root: str) -> list[str]:
    """The include dirs one CUDA header root contributes (root and its cccl/)."""
    dirs = [root]
    if os.path.isdir(os.path.join(root, "cccl")):
        dirs.append(os.path.join(root, "cccl"))
    return dirs


def _cuda_core_missing(dirs: list[str]) -> list[str]:
    required = ["cuda.h", "cuda_runtime_api.h", "crt/host_defines.h"]
    fp16 = next((os.path.join(d, "cuda_fp16.h") for d in dirs if _has(d, "cuda_fp16.h")), "")
    if fp16 and "<nv/target>" in _read(fp16):
        required.append("nv/target")  # CCCL, needed by cuda_fp16.h since CUDA 12
    return [r for r in required if not any(_has(d, r) for d in dirs)]


def find_cuda(sites) -> HeaderSet:
    hs = HeaderSet("cuda", "CUDA runtime headers (cuda_runtime_api.h, nvrtc.h)",
                   "SCOREMOD_CUDA_INCLUDE_DIR",
                   fix="python -m pip install --no-deps " + " ".join(HEADER_PACKAGES[2:]) +
                       " (or install a CUDA toolkit at /usr/local/cuda)")
    env = _env_dirs(hs.env_var)
    if env is not None:
        dirs = [x for d in env for x in _cuda_root_set(d)]
        missing = _cuda_core_missing(dirs) + (
            [] if any(_has(d, "nvrtc.h") for d in dirs) else ["nvrtc.h"])
        if missing:
            hs.tried.append(f"{os.pathsep.join(env)} ({hs.env_var}): no {', '.join(missing)}")
        else:
            hs.include_dirs, hs.origin = dirs, hs.env_var
    else:
        roots = [(os.path.join(s, "nvidia", sub, "include"), o)
                 for s, o in sites for sub in ("cu13", "cuda_runtime", "cu12")]
        roots += _system_roots()
        # CUDA 12's pip wheels split the headers a CUDA 13 root holds alone:
        # crt/ comes with nvcc, nv/target with cccl, nvrtc.h with nvrtc.
        siblings = {"crt/host_defines.h": "cuda_nvcc", "nv/target": "cuda_cccl",
                    "nvrtc.h": "cuda_nvrtc"}
        for root, origin in roots:
            if not _has(root, "cuda_runtime_api.h"):
                continue  # not a CUDA header dir at all: not worth listing
            dirs = _cuda_root_set(root)
            missing = _cuda_core_missing(dirs) + (
                [] if any(_has(d, "nvrtc.h") for d in dirs) else ["nvrtc.h"])
            for rel in list(missing):
                extra = next((d for s, _ in sites if rel in siblings
                              for d in [os.path.join(s, "nvidia", siblings[rel], "include")]
                              if _has(d, rel)), None)
                if extra is None and rel == "nvrtc.h":  # any candidate root has it
                    extra = next((r for r, _ in roots if _has(r, rel)), None)
                if extra is not None:
                    missing.remove(rel)
                    if extra not in dirs:
                        dirs.append(extra)
            if missing:
                hs.tried.append(f"{root} ({origin}): no {', '.join(missing)}")
                continue
            hs.include_dirs, hs.origin = dirs, origin
            break
        if not hs.found and not hs.tried:
            hs.tried.append("no directory with cuda_runtime_api.h in site-packages "
                            "(nvidia/cu13, nvidia/cuda_runtime), $CUDA_HOME, "
                            "/usr/local/cuda/include or /usr/include")
    if hs.found:
        for d in hs.include_dirs:
            v = _define(_read(os.path.join(d, "cuda_runtime_api.h")), "CUDART_VERSION")
            if v:
                hs.version = f"{v // 1000}.{(v % 1000) // 10}"
                break
    return hs


# --------------------------------------------------------------------------- #
# report


def find_all() -> list[HeaderSet]:
    sites = site_dirs()
    return [find_jaxlib(sites), find_cudnn_frontend(sites), find_cudnn(sites), find_cuda(sites)]


def missing_message(sets: list[HeaderSet]) -> str:
    """Empty when every set was found; else what is missing and how to fix it."""
    missing = [hs for hs in sets if not hs.found]
    if not missing:
        return ""
    lines = ["the scoremod FFI extension was not built: missing " +
             ", ".join(hs.title for hs in missing) + f". Build it with: {REBUILD}"]
    for hs in missing:
        lines.append(f"- {hs.title}: set {hs.env_var}=<dir>, or: {hs.fix}")
        lines += [f"    tried {t}" for t in hs.tried[:8]]
        if len(hs.tried) > 8:
            lines.append(f"    ... and {len(hs.tried) - 8} more")
        if not hs.tried:
            lines.append("    no candidate directory exists")
    lines.append("Searched site-packages: " +
                 ", ".join(d for d, _ in site_dirs()) + "; system: " +
                 ", ".join(d for d, _ in _system_roots()))
    return "\n".join(lines)


def summary(sets: list[HeaderSet]) -> str:
    lines = []
    for hs in sets:
        if hs.found:
            ver = f" {hs.version}" if hs.version else ""
            lines.append(f"{hs.title}{ver}: {os.pathsep.join(hs.include_dirs)} [{hs.origin}]")
        else:
            lines.append(f"{hs.title}: NOT FOUND")
    return "\n".join(lines)


def _cmake_str(s: str) -> str:
    n = 1
    while f"]{'=' * n}]" in s:
        n += 1
    return f"[{'=' * n}[{s}]{'=' * n}]"


def write_cmake(path: str, sets: list[HeaderSet]) -> None:
    found = all(hs.found for hs in sets)
    dirs = [d for hs in sets for d in hs.include_dirs]
    with open(path, "w", encoding="utf-8") as f:
        f.write("# Generated by scoremod/kernels_ffi/find_headers.py\n")
        f.write(f"set(SCOREMOD_FFI_HEADERS_FOUND {'TRUE' if found else 'FALSE'})\n")
        f.write("set(SCOREMOD_FFI_INCLUDE_DIRS " + " ".join(_cmake_str(d) for d in dirs) + ")\n")
        f.write(f"set(SCOREMOD_FFI_MISSING {_cmake_str(missing_message(sets))})\n")
        f.write(f"set(SCOREMOD_FFI_SUMMARY {_cmake_str(summary(sets))})\n")


def write_build_info(path: str, sets: list[HeaderSet], status: str) -> None:
    """A Python module installed next to the extension; read by the loader."""
    info = {
        "status": status,  # "built", "missing_headers", "no_compiler" or "disabled"
        "missing": missing_message(sets),
        "headers": {hs.key: {"include_dirs": hs.include_dirs, "version": hs.version,
                             "origin": hs.origin} for hs in sets},
        "python": sys.executable,
    }
    with open(path, "w", encoding="utf-8") as f:
        f.write('"""Generated at build time by scoremod/kernels_ffi/find_headers.py."""\n\n')
        f.write(f"BUILD_INFO = {info!r}\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--cmake", metavar="FILE", help="write CMake variables to FILE")
    ap.add_argument("--build-info", metavar="FILE",
                    help="write the _build_info.py module installed with the extension")
    ap.add_argument("--disabled", action="store_true",
                    help="the build was disabled (SCOREMOD_BUILD_FFI=OFF): record that")
    ap.add_argument("--no-compiler", action="store_true",
                    help="CMake found no C++ compiler: record that")
    args = ap.parse_args(argv)

    sets = find_all()
    if args.cmake:
        write_cmake(args.cmake, sets)
    if args.build_info:
        status = ("disabled" if args.disabled else
                  "no_compiler" if args.no_compiler else
                  "built" if all(hs.found for hs in sets) else "missing_headers")
        write_build_info(args.build_info, sets, status)
    if args.json:
        print(json.dumps({"sets": [asdict(hs) for hs in sets],
                          "site_dirs": site_dirs()}, indent=2))
    else:
        print(summary(sets))
        msg = missing_message(sets)
        if msg and not args.cmake:
            print(msg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
