"""What one call launches on the GPU, kernel by kernel, and for how long.

    python benchmarks/probes/kernel_times.py --cases MOD:IMPL:DIRECTION[,...]
        [--batch 4 --heads 16 --seq 4096 --head-dim 128 --dtype bfloat16
         --window 256 --reps 20]

Each case is a benchmark harness call (benchmarks/harness.py's ``make_call``: the
mods, implementations and directions of ``benchmarks/run.py``), run ``--reps``
times under JAX's profiler after two warm-up calls. Printed per case: every
kernel the device ran in the profiled calls (the GPU planes' stream lines of
the profile), its mean time per call in microseconds and launches per call,
longest first, then the sum, and the wall time per call for comparison. A
fixed cost that the kernels' sum does not explain is launch gaps; one that a
kernel explains names the work to remove (issue 38's sinks gradient, issue
39's per-step launches around the decode kernel).

``profile(call, reps)`` is the same measurement for any ``call()`` (the decode
probe's steps use it with PROBE_PROFILE=1).
"""

import argparse
import collections
import glob
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]  # scoremod, the harness


def profile(call, reps=20):
    """([(kernel name, us per call, launches per call)], wall us per call) of
    ``reps`` calls of ``call()`` (each blocked on), longest kernels first."""
    import jax
    from jax.profiler import ProfileData

    for _ in range(2):
        jax.block_until_ready(call())
    logdir = tempfile.mkdtemp(prefix="kernel_times_")
    with jax.profiler.trace(logdir):
        t0 = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(call())
        wall = (time.perf_counter() - t0) / reps * 1e6
    (path,) = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
    data = ProfileData.from_file(path)
    total, count = collections.Counter(), collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = [ln for ln in plane.lines if ln.name.startswith("Stream")] or list(plane.lines)
        for line in lines:
            for ev in line.events:
                total[ev.name] += ev.duration_ns / 1e3
                count[ev.name] += 1
    rows = sorted(((name, us / reps, count[name] / reps) for name, us in total.items()),
                  key=lambda r: -r[1])
    return rows, wall


def report(label, rows, wall, out=print):
    out(f"{label}: {wall:.1f} us a call (wall), kernels {sum(r[1] for r in rows):.1f} us, "
        f"{sum(r[2] for r in rows):.1f} launches")
    for name, us, n in rows:
        out(f"    {us:9.1f} us  x{n:<4.1f} {name[:150]}")


def main():
    import harness
    from ffi_overhead import shape_arguments

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", required=True,
                    help="MOD:IMPL:DIRECTION, comma separated (benchmarks/run.py's names)")
    shape_arguments(ap)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    shape = harness.Shape(args.batch, args.heads, args.seq, args.head_dim, args.dtype,
                          args.window)
    for case in args.cases.split(","):
        mod, impl, direction = case.split(":")
        try:
            call, _, _ = harness.make_call(impl, mod, shape, direction)
            rows, wall = profile(call, args.reps)
            report(case, rows, wall)
        except Exception as e:  # a case that fails: say so, go on
            print(f"{case}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
