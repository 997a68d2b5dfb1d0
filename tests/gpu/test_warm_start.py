"""Warm start: a second process loads the cuDNN graphs the first one built.

Each case runs a fused softcap + causal attention (forward, then forward and
backward) in fresh processes that share one plan cache directory:

1. cold: builds every graph and writes it (and fills JAX's compilation cache);
2. warm: must build nothing (``builds == 0``), load every graph from disk and
   give bitwise the same output;
3. warm with JAX's persistent compilation cache on as well.

The times of each process's first calls are printed (run with ``-s``), not
asserted: the goal is a first call under 0.3 s in a warm process; the
breakdown (with and without JAX's cache, the frontend's import) tells what
is left of it.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

_SCRIPT = r"""
import json, sys, time
import numpy as np
t_start = time.perf_counter()
import jax, jax.numpy as jnp
import scoremod
t_import = time.perf_counter() - t_start

out_path = sys.argv[1]
b, s, h, d = 2, 2048, 8, 128
ks = jax.random.split(jax.random.PRNGKey(0), 4)
q, k, v, do = (jax.random.normal(x, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for x in ks)
jax.block_until_ready((q, k, v, do))  # the device is up before anything is timed
mod = scoremod.trace(lambda score, b, h, q_idx, kv_idx:
                     jnp.where(q_idx >= kv_idx, 30.0 * jnp.tanh(score / 30.0), -jnp.inf))
cudnn_imported = "cudnn" in sys.modules

def first_call(fn, *args):
    # Times of the first call of jit(fn): trace and lower (the cuDNN graphs are
    # fetched here), XLA compile, first execution (the FFI deserializes the graphs).
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    t3 = time.perf_counter()
    times = {"trace_lower_s": round(t1 - t0, 4), "compile_s": round(t2 - t1, 4),
             "execute_s": round(t3 - t2, 4), "total_s": round(t3 - t0, 4)}
    return out, times

(o, lse), forward_times = first_call(
    lambda q, k, v: scoremod.attention(q, k, v, mod, implementation="cudnn", return_lse=True),
    q, k, v)
after_forward = scoremod.cache_info()
cudnn_imported_by_call = "cudnn" in sys.modules  # a warm process need not import the frontend

def loss(q, k, v):
    o = scoremod.attention(q, k, v, mod, implementation="cudnn")
    return jnp.vdot(o.astype(jnp.float32), do.astype(jnp.float32))

grads, backward_times = first_call(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)

t0 = time.perf_counter()
jax.block_until_ready(scoremod.attention(q, k, v, mod, implementation="cudnn"))
eager_forward = time.perf_counter() - t0

arrays = {"o": o, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
np.savez(out_path, **{n: np.asarray(a).view(np.uint16) if a.dtype == jnp.bfloat16
                      else np.asarray(a) for n, a in arrays.items()})
print(json.dumps({
    "import_s": round(t_import, 3), "cudnn_imported_before_call": cudnn_imported,
    "cudnn_imported_by_first_call": cudnn_imported_by_call,
    "first_forward": forward_times, "first_fwd_bwd": backward_times,
    "then_eager_forward_s": round(eager_forward, 4),
    "jax_cache_dir": jax.config.jax_compilation_cache_dir,
    "after_forward": after_forward, "final": scoremod.cache_info()}))
"""


def _float32(bf16_bits):
    return (bf16_bits.astype(np.uint32) << 16).view(np.float32)


def _run(tmp_path, name, cache_dir, jax_cache):
    out = tmp_path / f"{name}.npz"
    env = {**os.environ, "SCOREMOD_CACHE_DIR": str(cache_dir),
           "SCOREMOD_JAX_CACHE": "1" if jax_cache else "0"}
    run = subprocess.run([sys.executable, "-c", _SCRIPT, str(out)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, f"{name} process failed:\n{run.stderr[-6000:]}"
    report = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"\n{name}: {json.dumps(report, indent=1)}")
    return report, dict(np.load(out)), run.stderr


def test_a_second_process_builds_nothing_and_computes_the_same(tmp_path):
    cache = tmp_path / "cache"
    cold, cold_out, _ = _run(tmp_path, "cold", cache, jax_cache=True)
    assert cold["final"]["builds"] > 0 and cold["final"]["disk_writes"] == cold["final"]["builds"]
    plans = os.listdir(cache / "cudnn-plans")
    assert len([p for p in plans if p.endswith(".plan")]) == cold["final"]["builds"], plans

    for name, jax_cache in (("warm", False), ("warm+jax-cache", True)):
        warm, warm_out, stderr = _run(tmp_path, name, cache, jax_cache)
        info = warm["final"]
        assert warm["after_forward"]["builds"] == 0 and warm["after_forward"]["disk_hits"] > 0, warm
        assert info["builds"] == 0 and info["disk_hits"] == cold["final"]["builds"], warm
        assert info["disk_writes"] == 0 and info["disk_rejected"] == 0, warm
        for n in ("o", "lse"):  # the same graphs on the same inputs: the same bits
            assert np.array_equal(warm_out[n], cold_out[n]), f"{name}: {n} differs from the cold run"
        for n in ("dq", "dk", "dv"):  # bitwise unless the backward accumulates in a racy order
            got, want = _float32(warm_out[n]), _float32(cold_out[n])
            np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max(),
                                       err_msg=f"{name}: {n}")
            print(f"{name}: {n} bitwise equal to cold: {np.array_equal(warm_out[n], cold_out[n])}")
        assert "Traceback" not in stderr, stderr

    imp = subprocess.run([sys.executable, "-c", "import time; t = time.perf_counter(); "
                          "import cudnn; print(round(time.perf_counter() - t, 3))"],
                         capture_output=True, text=True, timeout=300)
    print(f"\n`import cudnn` alone in a fresh process: {imp.stdout.strip()} s")


def test_a_corrupt_cache_is_rebuilt_not_trusted(tmp_path):
    cache = tmp_path / "cache"
    cold, cold_out, _ = _run(tmp_path, "cold", cache, jax_cache=False)
    plans = sorted((cache / "cudnn-plans").glob("*.plan"))
    for p in plans:  # flip one byte in the middle of each serialized graph
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))
    again, again_out, _ = _run(tmp_path, "after corruption", cache, jax_cache=False)
    info = again["final"]
    assert info["disk_rejected"] == len(plans) and info["builds"] == cold["final"]["builds"], info
    assert np.array_equal(again_out["o"], cold_out["o"])
