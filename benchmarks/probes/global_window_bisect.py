"""Which part of Longformer's global window goes wrong on the Pallas kernels on the H200?

`(|q - kv| <= W) | g[q] | g[kv]` came out wrong on the H200 on both Pallas engines
(bool flags), and with int flags compared with 0 on the Mosaic engine (O off by 0.74),
while interpret mode on the CPU matched and the block map was right
(bool_window_map.py); document masks and `or`s of two-index conditions ran right.
The kernels refuse such masks (codegen.ONE_AXIS_READ_UNDER_OR). This probe lifts that
refusal and runs variants that each drop one ingredient, on each engine, on the plan's
block map and on a dense one, printing the largest error of O against the reference
path (bf16 tolerance about 3e-2):

- `full`: the failing mask, int flags; `bool`: bool flags;
- `kv_only` / `q_only`: one side's flags;
- `no_abs`: the band as two one-sided comparisons;
- `sum`: int arithmetic `band + g[q] + g[kv] > 0`, no bool `or`;
- `nested`: `where(g[q] != 0, s, where(g[kv] != 0, s, where(band, s, -inf)))`;
- `float`: float flags compared with 0.5.

Each on four plans: the plan's own (`map`: its block map and the mod it runs on full
tiles), a dense map with no full-tile mod (`dense`), and one ingredient of the first
at a time (`map_nofull`: the map without the full-tile mod; `dense_full`: a dense
map with it, no tile full, so only its `lax.cond` differs); and whether the map
computed on this device visits and marks full the tiles an exact map does
(`PROBE_MAPS=1`). 2026-12-07 on the H200: `map` wrong for full, bool, kv_only and
q_only, right for no_abs and sum; `dense` right everywhere; Triton right.

    python benchmarks/probes/global_window_bisect.py          (an H200)
    JAX_PLATFORMS=cpu python benchmarks/probes/global_window_bisect.py   (interpret mode: all right)
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

import scoremod
from scoremod.lowering.pallas import backend as pallas_backend
from scoremod.lowering.pallas import codegen
from scoremod.lowering.problem import Problem
from scoremod.lowering.reference import REFERENCE

S, W = (int(x) for x in os.environ.get("PROBE_S_W", "512,16").split(","))
B, H, D = 2, 4, 128


def variants(gi, gb, gf):
    band = lambda q, k: jnp.abs(q - k) <= W  # noqa: E731
    return {
        "full": lambda s, b, h, q, k: jnp.where(band(q, k) | (gi[q] != 0) | (gi[k] != 0), s,
                                                -jnp.inf),
        "bool": lambda s, b, h, q, k: jnp.where(band(q, k) | gb[q] | gb[k], s, -jnp.inf),
        "kv_only": lambda s, b, h, q, k: jnp.where(band(q, k) | (gi[k] != 0), s, -jnp.inf),
        "q_only": lambda s, b, h, q, k: jnp.where(band(q, k) | (gi[q] != 0), s, -jnp.inf),
        "no_abs": lambda s, b, h, q, k: jnp.where(((q - k <= W) & (k - q <= W)) | (gi[q] != 0)
                                                  | (gi[k] != 0), s, -jnp.inf),
        "sum": lambda s, b, h, q, k: jnp.where(band(q, k).astype(jnp.int32) + gi[q] + gi[k] > 0,
                                               s, -jnp.inf),
        "nested": lambda s, b, h, q, k: jnp.where(
            gi[q] != 0, s, jnp.where(gi[k] != 0, s, jnp.where(band(q, k), s, -jnp.inf))),
        "float": lambda s, b, h, q, k: jnp.where(band(q, k) | (gf[q] > 0.5) | (gf[k] > 0.5), s,
                                                 -jnp.inf),
    }


def main():
    # Lift the refusals: this probe is about what the kernels compute.
    codegen._or_over_one_axis_read = lambda node: False
    codegen._one_axis_bool_read = lambda node: False
    flags = np.arange(S) % 37 == 5
    gi, gb = jnp.asarray(flags, jnp.int32), jnp.asarray(flags)
    gf = gi.astype(jnp.float32)
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(x, (B, S, H, D), jnp.float32).astype(jnp.bfloat16) for x in ks)
    problem = Problem.of(q, k, v)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; b{B} s{S} h{H} d{D} W{W}",
          flush=True)
    for name, fn in variants(gi, gb, gf).items():
        mod = scoremod.trace(fn)
        ops = tuple(jnp.asarray(x) for x in mod.operands)
        ref = REFERENCE.plan(problem, mod, 0.125, scoremod.LoweringOptions(), True)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        want = REFERENCE.forward(ref, f32(q), f32(k), f32(v), ops)[0]
        for engine in ("mosaic", "triton"):
            options = scoremod.LoweringOptions(pallas_engine=engine)
            for label in ("map", "dense", "map_nofull", "dense_full"):
                if engine == "triton" and label in ("map_nofull", "dense_full"):
                    continue
                try:
                    plan = pallas_backend.PALLAS.plan(problem, mod, 0.125, options, True)
                    if label.startswith("dense"):
                        plan = dataclasses.replace(plan, block_map=pallas_backend.dense_map)
                    if label in ("dense", "map_nofull"):
                        plan = dataclasses.replace(plan, full_expr=None)
                    run = functools.partial(pallas_backend.PALLAS.forward, plan)
                    if jax.devices()[0].platform == "gpu":  # (interpret mode hangs under jit)
                        run = jax.jit(run)
                    o = run(q, k, v, ops)[0]
                    err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - want)))
                    print(f"{name:8s} {engine:6s} {label:5s} |O - ref| {err:.3e}"
                          f"{'  WRONG' if err > 3e-2 else ''}", flush=True)
                except Exception as e:  # an engine that refuses: say so, go on
                    print(f"{name:8s} {engine:6s} {label:5s} failed: {type(e).__name__}: "
                          f"{str(e)[:200]}", flush=True)
        if os.environ.get("PROBE_MAPS"):
            check_map(name, mod, ops, problem)


def check_map(name, mod, ops, problem):
    """The plan's block map at the Mosaic forward's tiles, computed on this device,
    against the exact one (every entry evaluated by the reference path)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's tests
    from tests import pallas_cases as pc

    options = scoremod.LoweringOptions(pallas_engine="mosaic")
    plan = pallas_backend.PALLAS.plan(problem, mod, 0.125, options, True)
    named = dict(zip(mod.operand_names, ops))
    bq, bk = plan.forward_blocks
    nk = -(-problem.skv // bk)

    def tiles(bmap):  # (visited, full) [B, H, query tiles, key tiles], broadcast
        counts, ids, full = (np.asarray(x) for x in (bmap.q_counts, bmap.q_blocks, bmap.q_full))
        visited = np.zeros(counts.shape + (nk,), bool)
        marked = np.zeros_like(visited)
        for at in np.ndindex(*counts.shape):
            visited[at + (ids[at][:counts[at]],)] = True
            marked[at + (ids[at][:counts[at]],)] = full[at][:counts[at]]
        shape = (problem.b, problem.hq) + visited.shape[2:]
        return np.broadcast_to(visited, shape), np.broadcast_to(marked, shape)

    got = tiles(plan.block_map(problem, bq, bk, named))
    want = tiles(pc.mask_block_map(mod, ops, problem, bq, bk))
    same = all(np.array_equal(a, b) for a, b in zip(got, want))
    print(f"{name:8s} map on {jax.devices()[0].platform}: "
          f"{'the exact one' if same else 'DIFFERS from the exact one'}", flush=True)


if __name__ == "__main__":
    main()
