"""Where the first call's time goes on the Mosaic GPU engine (needs a Hopper GPU).

Softcap and a relative-bias table, forward and fwd+bwd (grad of sum(O) wrt q, k, v),
each in a fresh process, a line a phase: jit(f).trace, .lower() (Pallas -> Mosaic GPU
MLIR, in Python), .compile() (XLA; jaxlib compiles the Mosaic kernels inside it, one
after another), the first run, a second; then "again", the program jitted afresh in
that process: its kernels compile anew, since jax 0.11 stamps each lowered module with
a per-process counter (mosaic_gpu.dump_basename) and jaxlib's kernel cache is keyed by
the module's SHA-256. Variants: samebytes (the stamp dropped by the probe: "again" hits
that cache, its compile is XLA's own), cache (softcap fwd+bwd twice on a fresh
jax_compilation_cache_dir), threads (both fwd+bwd programs compiled in one thread, then
in two), vlog (jaxlib's log lines as each kernel is compiled, ptxas's compile times).
The cases jax_mgpu:fwd and jax_mgpu:grad time JAX's own Mosaic GPU attention
(pallas.ops.gpu.attention_mgpu, no mod, its forward and two backward kernels) the same
way: whether a kernel's compile of about a second is ours or Mosaic GPU's.

    python benchmarks/probes/first_call.py [--seq 4096] [--cases ...] [--variants samebytes,cache,threads,vlog]
"""

import argparse
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core  # KNOWN_KERNELS: an entry a lowered kernel

import scoremod

CASES = ("softcap:fwd", "softcap:grad", "relbias:fwd", "relbias:grad")
REFERENCE_CASES = ("jax_mgpu:fwd", "jax_mgpu:grad")
PHASES = ("trace", "lower", "compile", "first run", "second run")


def programs(a):
    b, s, h, d = a.batch, a.seq, a.heads, 128
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(a.dtype)
               for kk in ks[:3])
    table = jax.random.normal(ks[3], (h, 2 * s - 1), jnp.float32)
    mods = {"none": None,
            "softcap": lambda sc, bi, hi, qi, ki: 30.0 * jnp.tanh(sc / 30.0),
            "relbias": lambda sc, bi, hi, qi, ki: sc + table[hi, qi - ki + s - 1]}
    opts = scoremod.LoweringOptions(pallas_engine=a.engine)

    def make(case):  # a new closure each time: no JAX-level cache sees it twice
        mod, mode = case.split(":")
        if mod == "jax_mgpu":
            from jax.experimental.pallas.ops.gpu import attention_mgpu as ref
            config = ref.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
            # its backward takes float16 only (jax 0.11.2): cast outside it
            f = lambda q, k, v: ref.attention(*(x.astype(jnp.float16) for x in (q, k, v)),  # noqa: E731
                                              config)
        else:
            f = lambda q, k, v: scoremod.attention(q, k, v, mods[mod],  # noqa: E731
                                                   implementation="pallas", options=opts)
        return f if mode == "fwd" else jax.grad(
            lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
    return make, (q, k, v)


def phases(fn, args, top=0):
    """The wall clock between the phases; with top, the lowering's costliest calls printed."""
    n0, t = len(core.KNOWN_KERNELS), [time.time()]
    stage = jax.jit(fn).trace(*args)
    for step in ("lower", "compile", "run", "run"):
        t.append(time.time())
        if step == "run":
            jax.block_until_ready(stage(*args))
        elif step == "lower" and top:
            prof = cProfile.Profile()
            stage = prof.runcall(stage.lower)
            pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(top)
        else:
            stage = getattr(stage, step)()
    t.append(time.time())
    return t, len(core.KNOWN_KERNELS) - n0


def run_case(a):
    if a.same_bytes:  # drop the stamp just before the module is serialized and hashed
        serde = core._run_serde_pass

        def unstamped(module, **kw):
            attrs = module.operation.attributes
            if "mosaic_gpu.dump_basename" in attrs:
                del attrs["mosaic_gpu.dump_basename"]
            return serde(module, **kw)
        core._run_serde_pass = unstamped
    t0 = time.perf_counter()  # the Pallas modules, imported at the first call otherwise
    from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    from scoremod.lowering.pallas import mosaic, mosaic_backward  # noqa: F401
    print(f"{a.case} imports {time.perf_counter() - t0:.3f} s", flush=True)
    make, args = programs(a)
    if a.case.startswith("threads:"):
        n, t0 = int(a.case[8:]), time.perf_counter()
        lowered = [jax.jit(make(c)).trace(*args).lower() for c in CASES[1::2]]
        t1 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda low: low.compile(), lowered))
        return print(f"both fwd+bwd programs, {n} thread(s): lower {t1 - t0:.3f} s, "
                     f"compile {time.perf_counter() - t1:.3f} s", flush=True)
    t, new = phases(make(a.case), args, a.profile)
    for n, x, y in zip(PHASES, t, t[1:]):
        print(f"{a.case} {n} {y - x:.3f} s", flush=True)
    print(f"{a.case} Mosaic kernels lowered: {new}", flush=True)
    if os.environ.get("TF_CPP_VMODULE"):  # the wall clock, to read jaxlib's log lines by
        print(f"{a.case} phases start: " + ", ".join(
            f"{n} {datetime.fromtimestamp(x):%H:%M:%S.%f}" for n, x in zip(PHASES, t)))
    t, _ = phases(make(a.case), args)
    print(f"{a.case} again: " + ", ".join(
        f"{n} {y - x:.3f} s" for n, x, y in zip(PHASES, t, t[1:])), flush=True)


def child(a, case, env=None, keep=None, same_bytes=False):
    cmd = [sys.executable, os.path.abspath(__file__), "--case", case, "--seq", str(a.seq),
           "--batch", str(a.batch), "--heads", str(a.heads), "--engine", a.engine,
           "--dtype", a.dtype, "--profile", str(a.profile)]
    r = subprocess.run(cmd + ["--same-bytes"] * same_bytes, capture_output=True, text=True,
                       env=dict(os.environ, **(env or {})))
    if r.returncode:
        return [f"{case}: exit {r.returncode}"] + r.stderr.splitlines()[-8:]
    return [ln for ln in (r.stdout + r.stderr).splitlines()
            if keep is None or any(word in ln for word in keep)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("--batch", 4), ("--heads", 16), ("--seq", 4096)):
        ap.add_argument(name, type=int, default=default)
    ap.add_argument("--engine", default="mosaic", help="LoweringOptions.pallas_engine")
    ap.add_argument("--dtype", default="bfloat16", help="of q, k and v")
    ap.add_argument("--profile", type=int, default=0,
                    help="print the N costliest calls of each case's first lowering")
    ap.add_argument("--cases", default=",".join(CASES + REFERENCE_CASES))
    ap.add_argument("--variants", default="samebytes,cache,threads,vlog")
    ap.add_argument("--vlog-cases", default="softcap:grad", help="the cases the vlog variant runs")
    ap.add_argument("--case", help="one case in this process (the probe's children)")
    ap.add_argument("--same-bytes", action="store_true", help="with --case: no stamp")
    a = ap.parse_args(argv)
    if a.case:
        return run_case(a)
    out = lambda lines, tag="": print("\n".join(tag + ln for ln in lines), flush=True)
    for case in a.cases.split(","):
        out(child(a, case))
    if "samebytes" in a.variants:
        out(child(a, "softcap:grad", same_bytes=True), "[same bytes] ")
    if "cache" in a.variants:
        with tempfile.TemporaryDirectory() as tmp:
            env = {"JAX_COMPILATION_CACHE_DIR": tmp,
                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
            for label in ("cold", "warm"):
                out(child(a, "softcap:grad", env), f"[disk cache, {label}] ")
    for n in (1, 2) if "threads" in a.variants else ():
        out(child(a, f"threads:{n}"))
    if "vlog" in a.variants:
        env = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "custom_call=5",
               "MOSAIC_GPU_DUMP_PTXAS": "1"}
        for case in a.vlog_cases.split(","):
            out(child(a, case, env, keep=("Mosaic GPU kernel", "phases start", "Compile time",
                                          "Used")), f"[vlog {case}] ")


if __name__ == "__main__":
    main()
