"""A process that used the fused path exits cleanly: nothing on stderr after its own output.

The cuDNN frontend's Python objects used to outlive every build (a reference
cycle through C++), and nanobind listed them at exit: ~45 lines of "leaked
instance ... tensor" / "leaked function ..." after the program's output.
"""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

_FUSED = r"""
import jax, jax.numpy as jnp
import scoremod

ks = jax.random.split(jax.random.PRNGKey(0), 3)
q, k, v = (jax.random.normal(x, (2, 256, 4, 64), jnp.float32).astype(jnp.bfloat16) for x in ks)
slopes = jnp.linspace(0.1, 1.0, 4)
mods = {
    "softcap": scoremod.parse("30.0 * tanh(score / 30.0)"),
    "softcap + causal (split)": scoremod.trace(lambda s, b, h, qi, ki: jnp.where(
        qi >= ki, 30.0 * jnp.tanh(s / 30.0), -jnp.inf)),
    "alibi (a load)": scoremod.trace(lambda s, b, h, qi, ki: s - slopes[h] * jnp.abs(qi - ki)),
    "causal (native mask)": scoremod.trace(lambda s, b, h, qi, ki: jnp.where(qi >= ki, s, -jnp.inf)),
}
for name, mod in mods.items():
    loss = lambda q, k, v: scoremod.attention(q, k, v, mod, implementation="cudnn").astype(
        jnp.float32).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    jax.block_until_ready(grads)
try:  # a refused call on the way (float32 inputs): its error must not leave anything either
    f32 = q.astype(jnp.float32)
    scoremod.attention(f32, f32, f32, mods["softcap"], implementation="cudnn")
except scoremod.ScoreModError:
    pass
print("builds:", scoremod.cache_info()["builds"])
print("DONE")
"""


def _check_clean(run, what):
    report = f"{what}: exit {run.returncode}\n--- stdout\n{run.stdout[-3000:]}\n--- stderr\n{run.stderr[-8000:]}"
    print(report)
    assert run.returncode == 0, report
    assert "nanobind: leaked" not in run.stderr, report
    assert "Traceback" not in run.stderr, report


def _env():
    # No on-disk plan cache: the graphs are really built in this process.
    return {**os.environ, "SCOREMOD_CACHE_DIR": ""}


def test_fused_forward_and_backward_exit_cleanly():
    run = subprocess.run([sys.executable, "-c", _FUSED], capture_output=True, text=True,
                         env=_env(), timeout=600)
    _check_clean(run, "fused fwd+bwd")
    assert run.stdout.rstrip().endswith("DONE")
    assert "builds: 0" not in run.stdout  # the graphs were built here, not loaded


def test_the_demo_ends_with_its_own_output():
    run = subprocess.run([sys.executable, "-m", "scoremod", "demo"], capture_output=True,
                         text=True, env=_env(), timeout=600)
    _check_clean(run, "python -m scoremod demo")
    assert "nanobind" not in run.stderr


def test_a_process_with_graphs_from_the_plan_cache_exits_cleanly(tmp_path):
    env = {**os.environ, "SCOREMOD_CACHE_DIR": str(tmp_path)}
    for what in ("cold plan cache", "warm plan cache"):
        run = subprocess.run([sys.executable, "-c", _FUSED], capture_output=True, text=True,
                             env=env, timeout=600)
        _check_clean(run, what)
    assert "builds: 0" in run.stdout  # the second process loaded every graph from disk
