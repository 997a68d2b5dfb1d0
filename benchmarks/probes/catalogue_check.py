"""Which side is wrong when a catalogue mod's fused and reference outputs differ on a GPU.

    python benchmarks/probes/catalogue_check.py tiled_natten [more names]

For each mod, at its catalogue GPU shape (bfloat16, head dim 128):
- the mask/bias the mod gives, evaluated three ways: NumPy (the catalogue's
  reference), ``jax.jit`` of the mod on the GPU, and the tensors the cuDNN plan
  materializes (computed by XLA on the GPU), compared entry by entry;
- O of the fused path (``"cudnn"``) and of the reference path (``"xla"``) on the
  GPU, each against a float64 NumPy attention with the NumPy mask.
"""

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

import scoremod
from scoremod import device
from tests.catalogue.mods import CATALOGUE
from tests.catalogue.verdict import planned
from tests.gpu.test_fused import _inputs, _run


def numpy_attention(q, k, v, scores_mod):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = scores_mod(s)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def check(name):
    e = CATALOGUE[name]
    shape = e.gpu
    env = e.env(shape)
    fn = e.build(env)
    mod = scoremod.trace(fn)
    print(f"== {name} {shape} verdict={e.verdict}")
    print("   mod:", str(mod)[:300])
    sq, skv = shape.sq, shape.skv
    g = types.SimpleNamespace(q=np.arange(sq)[:, None], k=np.arange(skv)[None, :],
                              b=np.arange(shape.b)[:, None, None, None],
                              h=np.arange(shape.h)[None, :, None, None])
    zero = np.zeros((shape.b, shape.h, sq, skv))
    np_scores = e.reference(zero, g, env)
    bi = jnp.arange(shape.b)[:, None, None, None]
    hi = jnp.arange(shape.h)[None, :, None, None]
    qi = jnp.arange(sq)[None, None, :, None]
    ki = jnp.arange(skv)[None, None, None, :]
    jax_scores = np.asarray(jax.jit(lambda s: fn(s, bi, hi, qi, ki))(jnp.zeros(zero.shape, jnp.float32)))
    fin = np.isfinite(np_scores)
    print(f"   numpy vs jit-on-gpu: finite differ {(fin != np.isfinite(jax_scores)).sum()}, "
          f"max |diff| {np.nanmax(np.abs(np.where(fin, np_scores, 0) - np.where(np.isfinite(jax_scores), jax_scores, 0))):.3g}")
    _, backend, plan = planned(mod, shape, 128, device.current().sm_count)
    print("   backend", backend, "split", getattr(plan, "split", None))
    if plan is not None and hasattr(plan, "parts"):
        for i, part in enumerate(plan.parts[:2]):
            arrays = part.load_arrays(mod.operands, forward=True)
            for l, a in zip(part.fwd_loads, arrays):
                a = np.asarray(a, np.float32)
                print(f"   part {i} load {l.spec.dims} {l.spec.dtype}: finite {np.isfinite(a).sum()} "
                      f"of {a.size}; numpy finite (same block) {fin[0, 0].sum() if a.shape[:2] == (1, 1) else fin.sum()}")
                if a.shape[:2] == (1, 1) and a.shape[2:] == (sq, skv):
                    print(f"     materialized vs numpy: finite differ {(np.isfinite(a[0, 0]) != fin[0, 0]).sum()}")
    q, k, v, do = _inputs(shape.b, sq, skv, shape.h, shape.h, 128, jnp.bfloat16)  # the test's
    want = numpy_attention(np.asarray(q, np.float32), np.asarray(k, np.float32),
                           np.asarray(v, np.float32), lambda s: e.reference(s, g, env))
    for impl in ("xla", "cudnn", None):
        for how in ("forward", "under vjp"):
            try:
                if how == "forward":
                    o = jax.jit(lambda q, k, v: scoremod.attention(q, k, v, mod,
                                                                   implementation=impl))(q, k, v)
                else:  # as the GPU tests do: O from jax.vjp, with the pullback run too
                    o = jax.jit(lambda *a: _run(impl, mod, *a))(q, k, v, do)[0]
                o = np.asarray(o, np.float64)
                err = np.abs(o - want).max() / np.abs(want).max()
                rows = np.argwhere(np.abs(o - want).max(-1) > 0.05 * np.abs(want).max())
                print(f"   {impl} {how}: O vs float64 numpy: rel err {err:.3g}; bad (b,q,h) "
                      f"{len(rows)}; first {rows[:5].tolist()}")
            except Exception as ex:  # noqa: BLE001 - report and go on
                print(f"   {impl} {how}: {type(ex).__name__}: {str(ex)[:300]}")


if __name__ == "__main__":
    for n in sys.argv[1:] or ["tiled_natten", "morton_natten"]:
        try:
            check(n)
        except Exception as ex:  # noqa: BLE001
            print(f"== {n}: {type(ex).__name__}: {str(ex)[:400]}")
