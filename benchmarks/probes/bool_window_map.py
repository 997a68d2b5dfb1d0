"""Is the block map of a bool-flag mask the same on the GPU as on the CPU, and right?

The global-window mask `(|q - kv| <= W) | g[q] | g[kv]` with bool flags g came out
wrong on the H200 on both Pallas engines while interpret mode on the CPU matched
the reference. Both engines share the block map (lowering/block_maps.py, computed by
XLA on the device): this compares it, per tile size the kernels use, between the
GPU and the CPU, and against the tiles of the mask computed with NumPy (a listed
tile must cover every live one; a tile marked full must have no masked score).

    python benchmarks/probes/bool_window_map.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import scoremod
from scoremod.lowering import block_maps
from scoremod.lowering.problem import Problem


def tiles(mask, bq, bk):
    sq, skv = mask.shape
    nq, nk = -(-sq // bq), -(-skv // bk)
    padded = np.zeros((nq * bq, nk * bk), bool)
    padded[:sq, :skv] = mask
    t = padded.reshape(nq, bq, nk, bk)
    return t.any(axis=(1, 3)), t.all(axis=(1, 3))


def main():
    for s, w, dtype in ((512, 16, "bfloat16"), (1000, 16, "float16"), (1024, 64, "bfloat16")):
        flags = np.arange(s) % 37 == 5
        g = jnp.asarray(flags)
        mod = scoremod.trace(lambda sc, b, h, q, k: jnp.where((jnp.abs(q - k) <= w) | g[q] | g[k],
                                                              sc, -jnp.inf))
        problem = Problem(2, s, s, 4, 2, 128, 128, dtype)
        i = np.arange(s)
        mask = (np.abs(i[:, None] - i[None, :]) <= w) | flags[:, None] | flags[None, :]
        for bq, bk in ((128, 128), (128, 64), (64, 64)):
            maps = {}
            for dev in ("gpu", "cpu"):
                with jax.default_device(jax.devices(dev)[0]):
                    m = block_maps.block_map(mod.expr, (g,), problem, bq, bk)
                    maps[dev] = {f: np.asarray(getattr(m, f)) for f in m._fields}
            same = {f: np.array_equal(maps["gpu"][f], maps["cpu"][f]) for f in maps["gpu"]}
            live, full = tiles(mask, bq, bk)
            m = maps["gpu"]
            missing = wrong_full = 0
            for qb in range(live.shape[0]):
                n = int(m["q_counts"][0, 0, qb])
                listed = m["q_blocks"][0, 0, qb, :n]
                flagged = m["q_full"][0, 0, qb, :n]
                missing += int(sum(1 for kb in np.flatnonzero(live[qb]) if kb not in listed))
                wrong_full += int(sum(1 for kb, f in zip(listed, flagged) if f and not full[qb, kb]))
            print(f"s{s} W{w} tiles {bq}x{bk}: gpu == cpu {all(same.values())} "
                  f"{[f for f, ok in same.items() if not ok]}; live tiles missing {missing}, "
                  f"tiles marked full with a masked score {wrong_full}")


if __name__ == "__main__":
    main()
