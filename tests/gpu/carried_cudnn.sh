# Run this shell, and every process it starts, on a cuDNN carried to the GPU
# machine in parts (cuDNN 9.28 for issue 37) instead of the one in
# site-packages. Source it from the repository root, in place of
# tests/gpu/device_setup.sh (which it sources once the cuDNN is in place, so
# that the FFI extension is built against the carried headers):
#
#   . tests/gpu/carried_cudnn.sh [PATH ...]
#
# PATH: part files (cudnn-9.28.tar.xz.partaa, ...) and SHA256SUMS, or folders
# holding them (searched down; default: .cudnn-carry). The device tool carries
# at most 64 MiB of ignored files per call, so the archive comes one part per
# call (docs/validation.md, "Another cuDNN"): the machine keeps /tmp between
# calls made close together, so each call adds what it brought to
# /tmp/cudnn-carry, and the call that completes the set checks it against
# SHA256SUMS and unpacks it into /tmp/cudnn-9.28. Later calls need no parts.
#
# Then, for this shell and its children:
#   LD_PRELOAD            += the carried libcudnn.so.9: loaded first, so any later
#                            dlopen("libcudnn.so.9") by name gets it, whatever the
#                            caller's RPATH (jax's xla_cuda_plugin.so has an RPATH to
#                            site-packages/nvidia/cudnn/lib, which beats LD_LIBRARY_PATH)
#   PYTHONPATH            += /tmp/cudnn-9.28: jax's plugin loads nvidia.cudnn's
#                            lib/libcudnn.so.9 by full path, and a path naming another
#                            file would map a second cuDNN; nvidia is a namespace package,
#                            so nvidia.cudnn now resolves to the carried copy
#   LD_LIBRARY_PATH       += its lib folder: the cuDNN frontend (`import cudnn`) opens
#                            the first libcudnn.so.9 in LD_LIBRARY_PATH
#   SCOREMOD_CUDNN_LIBRARY = the carried libcudnn.so.9 (scoremod's FFI extension)
#   SCOREMOD_CUDNN_INCLUDE_DIR = its headers (the extension's build)
# The carried libraries' RUNPATH ($ORIGIN/../../cu13/lib, ../../cublas/lib,
# ../../cuda_nvrtc/lib) finds NVRTC and cuBLASLt through links to the
# site-packages folders of those names. Then it sources tests/gpu/device_setup.sh
# (CARRIED_CUDNN_SETUP=0: not; pass --no-setup to benchmarks/gpu_run.sh after
# it), and last prints, from one process that ran JAX, XLA's own cuDNN
# attention, the frontend and the extension, every cuDNN file mapped, and
# `scoremod doctor`'s cuDNN lines (CARRIED_CUDNN_REPORT=0: not).
#
# Status: 0 the carried cuDNN is in use; 3 parts are missing (it says which:
# carry them in the next call); 2 broken (no SHA256SUMS, a part fails its
# checksum, unpacking or the setup failed); 4 a process still mapped another
# cuDNN. Environment: PYTHON (python3), CARRIED_CUDNN_STAGE, CARRIED_CUDNN_ROOT.

_carried_cudnn() {
    local stage=${CARRIED_CUDNN_STAGE:-/tmp/cudnn-carry}
    local root=${CARRIED_CUDNN_ROOT:-/tmp/cudnn-9.28}
    local lib=$root/nvidia/cudnn/lib py=${PYTHON:-python3}
    local f name sum total=0 have=() missing=()

    if [ ! -e "$root/.unpacked" ]; then
        # (a) Stage what this call brought.
        [ $# -gt 0 ] || set -- .cudnn-carry
        mkdir -p "$stage" || return 2
        f=$(find "$@" -type f -name SHA256SUMS 2>/dev/null | head -n 1)
        if [ -n "$f" ] && ! cmp -s "$f" "$stage/SHA256SUMS"; then
            [ -s "$stage/SHA256SUMS" ] &&
                _carried_cudnn_say "a new SHA256SUMS: dropping the parts staged before"
            rm -f "$stage"/* && cp "$f" "$stage/SHA256SUMS" || return 2
        fi
        while IFS= read -r f; do
            name=${f##*/}
            cmp -s "$f" "$stage/$name" || cp -f "$f" "$stage/$name" || return 2
        done < <(find "$@" -type f -name '*.tar.xz.part*' 2>/dev/null)
        [ -s "$stage/SHA256SUMS" ] || {
            _carried_cudnn_say "no SHA256SUMS in $* nor in $stage: carry .cudnn-carry/SHA256SUMS too"; return 2; }

        # (b) Which parts are here, and do they check out?
        while read -r sum name; do
            name=${name#\*}; total=$((total + 1))
            if [ ! -f "$stage/$name" ]; then missing+=("$name")
            elif [ "$(sha256sum < "$stage/$name" | cut -d' ' -f1)" != "$sum" ]; then
                _carried_cudnn_say "$name fails its checksum (removed): carry it again"; rm -f "$stage/$name"
                return 2
            else have+=("$name"); fi
        done < "$stage/SHA256SUMS"
        if [ ${#missing[@]} -gt 0 ]; then
            _carried_cudnn_say "${#have[@]} of $total parts here (${have[*]:-none}); run again carrying the next: ${missing[*]}"
            return 3
        fi
        _carried_cudnn_say "all $total parts here; unpacking into $root"
        rm -rf "$root.partial" && mkdir -p "$root.partial" || return 2
        (cd "$stage" && cat "${have[@]}") | xz -dc -T0 | tar -xf - -C "$root.partial" \
            || { _carried_cudnn_say "unpacking failed"; return 2; }
        rm -rf "$root" && mv "$root.partial" "$root" && touch "$root/.unpacked" || return 2
        rm -f "$stage"/*.tar.xz.part*  # the parts are not needed any more
    fi
    [ -f "$lib/libcudnn.so.9" ] || { _carried_cudnn_say "$lib/libcudnn.so.9 is missing"; return 2; }
    : > "$root/nvidia/cudnn/__init__.py"  # a regular package: wins over site-packages' copy

    # (c) The carried libraries' RUNPATH: links to site-packages' NVRTC and cuBLAS.
    # site: the nvidia/ folder that jax's plugin's RPATH ($ORIGIN/../../nvidia/...) names.
    local site=${CARRIED_CUDNN_SITE_NVIDIA:-}
    [ -n "$site" ] || site=$(env -u LD_PRELOAD "$py" -c 'import importlib.util as u, os
s = u.find_spec("jax_plugins.xla_cuda13") or u.find_spec("jax_plugins.xla_cuda12")
print(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(s.origin))), "nvidia"))' 2>/dev/null)
    for name in cu13 cublas cuda_nvrtc; do
        [ -d "$site/$name" ] && ln -sfn "$site/$name" "$root/nvidia/$name"
    done
    sum=""
    for f in "$root"/nvidia/{cu13,cuda_nvrtc}/lib/libnvrtc.so.*; do [ -e "$f" ] && sum=$f; done
    [ -n "$sum" ] || _carried_cudnn_say "WARNING: no libnvrtc.so in $site/{cu13,cuda_nvrtc}/lib:" \
        "cuDNN's runtime-compiled engines (fused attention) will fail"

    case " ${LD_PRELOAD:-} " in *" $lib/libcudnn.so.9 "*) ;; *)
        export LD_PRELOAD="$lib/libcudnn.so.9${LD_PRELOAD:+ $LD_PRELOAD}" ;; esac
    case ":${PYTHONPATH:-}:" in *":$root:"*) ;; *)
        export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" ;; esac
    case ":${LD_LIBRARY_PATH:-}:" in *":$lib:"*) ;; *)
        export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
    export SCOREMOD_CUDNN_LIBRARY="$lib/libcudnn.so.9"
    export SCOREMOD_CUDNN_INCLUDE_DIR="$root/nvidia/cudnn/include"
    _carried_cudnn_say "using $(grep -o -m 1 "^cuDNN [0-9.]* for CUDA [0-9]*" "$root/nvidia/cudnn/CARRIED.txt" 2>/dev/null || echo "the cuDNN") in $lib"
    if [ "${CARRIED_CUDNN_SETUP:-1}" != 0 ]; then
        . tests/gpu/device_setup.sh || { _carried_cudnn_say "tests/gpu/device_setup.sh failed"; return 2; }
    fi
    [ "${CARRIED_CUDNN_REPORT:-1}" = 0 ] && return 0

    # (d) What one process that uses all three loaded (the GPU is needed here).
    CARRIED_ROOT=$root "$py" - <<'PY'
import os, sys
root = os.path.realpath(os.environ["CARRIED_ROOT"])
import jax, jax.numpy as jnp
print("  jax", jax.__version__, "on", jax.devices()[0].device_kind)
q = jax.random.normal(jax.random.PRNGKey(0), (1, 256, 2, 64), jnp.bfloat16)
try:  # XLA's own cuDNN: its fused attention
    jax.block_until_ready(jax.nn.dot_product_attention(q, q, q, implementation="cudnn"))
    print("  XLA's cuDNN attention: ran")
except Exception as e:  # noqa: BLE001
    print("  XLA's cuDNN attention: FAILED:", str(e).splitlines()[0][:300])
try:
    import cudnn
    print("  frontend", cudnn.__version__, "backend_version", cudnn.backend_version())
except ImportError as e:
    sys.exit(f"  the cuDNN frontend is not installed ({e}): run tests/gpu/device_setup.sh")
from scoremod import kernels_ffi
if kernels_ffi.available():
    print("  extension (compiled with cuDNN", kernels_ffi.compiled_cudnn_version(), "headers):",
          kernels_ffi.load_cuda_libraries()[1])
    if kernels_ffi.compiled_cudnn_version() // 100 != cudnn.backend_version() // 100:
        print("  NOTE: the extension was built before this script ran, against other headers;"
              " rebuild it: . tests/gpu/device_setup.sh")
else:
    print("  extension:", kernels_ffi.unavailable_reason().splitlines()[0])
try:  # one fused call through the extension, forward and backward
    import scoremod
    softcap = scoremod.trace(lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0))
    loss = lambda q: scoremod.attention(q, q, q, softcap, implementation="cudnn").astype(
        jnp.float32).sum()
    g = jax.block_until_ready(jax.jit(jax.grad(loss))(q))
    print("  scoremod fused (cuDNN) forward and backward: ran, grad finite:",
          bool(jnp.isfinite(g.astype(jnp.float32)).all()))
except Exception as e:  # noqa: BLE001
    print("  scoremod fused (cuDNN): FAILED:", str(e).splitlines()[0][:300])
with open("/proc/self/maps") as f:
    maps = sorted({l.split()[-1] for l in f if "libcudnn" in l or "libnvrtc.so" in l})
for p in maps:
    print("  mapped:", p)
other = [p for p in maps if "libcudnn" in p and not os.path.realpath(p).startswith(root + "/")]
print("  OK: every cuDNN file mapped is the carried one" if not other
      else "  NOT OK: another cuDNN is mapped: " + " ".join(other))
sys.exit(4 if other else 0)
PY
    local rc=$?
    "$py" -m scoremod doctor 2>&1 | grep -E "^(cuDNN|cuDNN frontend|extension|fused path):" | sed 's/^/  /'
    return $rc
}
_carried_cudnn_say() { echo "carried_cudnn: $*"; }
_carried_cudnn "$@"
