"""The sharding layer on 8 CPU devices, with a stand-in for the fused kernel.

cuDNN graphs need a GPU, so the fused backend is replaced by ``StandIn``: the
reference attention registered as a backend that JAX does not differentiate
(``differentiable = False``), so its calls take the fused path's route:
the custom_vjp, the partitioning rule and the batching rule of
``lowering/sharding.py``.

The device count is fixed when JAX starts, so ``test_on_eight_fake_devices``
runs this module again in a subprocess with
``--xla_force_host_platform_device_count=8``; there, every other test runs
(in the parent they skip: one device).
"""

import os
import re
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import scoremod
from scoremod.lowering import registry
from scoremod.lowering import sinks as attention_sinks
from scoremod.lowering.problem import Problem
from scoremod.lowering.reference import Reference

DEVICES = 8
_CHILD = "SCOREMOD_SHARDING_CHILD"
ROOT = Path(__file__).resolve().parents[1]

eight = pytest.mark.skipif(len(jax.devices()) < DEVICES,
                           reason="runs in test_on_eight_fake_devices' subprocess")


def test_on_eight_fake_devices():
    if os.environ.get(_CHILD):
        pytest.skip("this is the subprocess")
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **{_CHILD: "1"})
    # --full: the subprocess runs every test of the module, the spawner included
    # (where it skips); the fast tier would deselect the spawner and sample the rest.
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-x", "--full", __file__], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" in done.stdout  # the spawner skips there
    assert "failed" not in done.stdout


class StandIn(Reference):
    """The reference attention behind the fused path's interface; records the
    shapes its forward and backward are traced at."""

    name = "standin"
    title = "the stand-in kernel"
    differentiable = False
    operand_gradients = False
    materializes_scores = False
    seen: list = []

    def why_not(self, problem, mod, automatic, options=None):
        return None if not automatic else "asked for by name only"

    def plan(self, problem, mod, scale, options, return_lse):
        return super().plan(problem, mod, scale, options, True)  # the fused protocol: O and LSE

    def forward(self, plan, q, k, v, operands):
        self.seen.append(("forward", Problem.of(q, k, v)))
        return super().forward(plan, q, k, v, operands)

    def backward(self, plan, q, k, v, o, lse, do, operands, dlse=None, wanted=()):
        self.seen.append(("backward", Problem.of(q, k, v)))
        return super().backward(plan, q, k, v, o, lse, do, operands, dlse, wanted)


class JoinsSinks(StandIn):
    """The stand-in that joins per-head sinks in its own forward, as cuDNN's does
    (from the first batch row: the route gives it only sinks that are one per head)."""

    name = "standin-sinks"

    def joins_sinks(self, plan, options):
        return True

    def forward(self, plan, q, k, v, operands, sinks=None):
        out = super().forward(plan, q, k, v, operands)
        if sinks is None:
            return out
        self.seen.append(("sinks", tuple(sinks.shape)))
        return attention_sinks.combine(*out, jnp.broadcast_to(sinks[:1], sinks.shape))

    def sums_sink_gradient(self, plan, options):
        return True

    def backward_with_sinks(self, plan, q, k, v, o, lse, do, operands, sinks):
        """As cuDNN's: the sum over the shard's batch rows in its first row."""
        self.seen.append(("sink gradient", tuple(sinks.shape)))
        dq, dk, dv, _ = self.backward(plan, q, k, v, o, lse, do, operands)
        total = attention_sinks.gradient(o, lse, do, None,
                                         jnp.broadcast_to(sinks[:1], sinks.shape)).sum(0)
        return dq, dk, dv, jnp.zeros(sinks.shape, jnp.float32).at[0].set(total)


STANDIN, JOINS_SINKS = StandIn(), JoinsSinks()


@pytest.fixture(autouse=True, scope="module")
def _registered():
    registry.register(STANDIN)
    registry.register(JOINS_SINKS)
    yield
    registry.unregister(STANDIN.name)
    registry.unregister(JOINS_SINKS.name)


def _inputs(b=4, s=64, hq=4, hkv=2, d=16, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, s, hq, d))
    k = jax.random.normal(ks[1], (b, s, hkv, d))
    v = jax.random.normal(ks[2], (b, s, hkv, d))
    w = jax.random.normal(ks[3], (b, s, hq, d))
    return q, k, v, w


def _step(impl, mod):
    """A training step's attention part: loss and gradients of q, k, v."""
    def loss(q, k, v, w):
        return jnp.sum(scoremod.attention(q, k, v, mod, implementation=impl) * w)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _close(got, want, tol=5e-5):
    # float32, relative to the largest entry: the sharded program's per-device dots
    # and sums run in another order than the whole one's (jax 0.12's CPU XLA differs by
    # up to 1.9e-5 here, 0.10's by less than 1e-5); a shard reading the wrong rows,
    # heads or index offsets is off by O(1).
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert np.max(np.abs(g - w)) <= tol * (1 + np.max(np.abs(w))), np.max(np.abs(g - w))


def _mesh():
    return Mesh(np.array(jax.devices()[:DEVICES]).reshape(2, 2, 2), ("x", "y", "z"))


def _put(mesh, spec, *arrays):
    return [jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays]


_COLLECTIVE = re.compile(r"=\s*(\S+)\s+(all-gather|all-to-all|collective-permute|all-reduce|"
                         r"reduce-scatter)(-start)?\(")


def _collectives(hlo):
    """(op, result shape) of every collective in compiled HLO text."""
    return [(m.group(2), m.group(1)) for m in _COLLECTIVE.finditer(hlo)]


def _largest_f32(hlo):
    """Element count of the largest float32 array in compiled HLO text."""
    sizes = [int(np.prod([int(x) for x in dims.split(",") if x])) if dims else 1
             for dims in re.findall(r"f32\[([\d,]*)\]", hlo)]
    return max(sizes)


# A mod reading a per-head array directly (sliced with the heads) and using the
# batch index as a value (needs the shard's global start).
SLOPES = jnp.linspace(0.1, 0.8, 4)
ALIBI_B = scoremod.trace(
    lambda s, b, h, q, k: jnp.where(q >= k, s + SLOPES[h] * (k - q) + 0.25 * b, -jnp.inf))

# batch, heads, batch x heads; with the devices each spreads over
SPECS = {"batch": (P(("x", "y")), 4), "heads": (P(None, None, "x"), 2),
         "batch_x_heads": (P(("x", "y"), None, "z"), 8)}


@eight
@pytest.mark.parametrize("name", sorted(SPECS))
def test_training_step_runs_per_shard_without_communication(name):
    spec, parts = SPECS[name]
    mesh = _mesh()
    q, k, v, w = _inputs()
    want = _step("xla", ALIBI_B)(q, k, v, w)
    args = _put(mesh, spec, q, k, v, w)
    step = jax.jit(_step("standin", ALIBI_B))
    StandIn.seen.clear()
    compiled = step.lower(*args).compile()
    hlo = compiled.as_text()
    # No collective moves q, k, v or their gradients: the one reduction left is
    # the loss's sum, a scalar.
    for op, shape in _collectives(hlo):
        assert op == "all-reduce" and re.fullmatch(r"f32\[\]", shape), (op, shape)
    # The kernel was traced at the shard's shapes, and nothing in the compiled
    # program is as large as the whole call's [b, h, q, kv] scores.
    b_parts = 4 if name.startswith("batch") else 1
    h_parts = parts // b_parts
    local = {(p.b, p.hq, p.hkv) for kind, p in StandIn.seen}
    assert (4 // b_parts, 4 // h_parts, 2 // h_parts) in local, local
    assert _largest_f32(hlo) <= 4 * 4 * 64 * 64 // parts
    got = compiled(*args)
    _close(got, want)
    dq = got[1][0]  # the gradients stay sharded like the inputs
    assert dq.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4), dq.sharding


@eight
@pytest.mark.parametrize("impl", ["standin", "standin-sinks"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_sinks_on_shards(name, impl):
    """Attention sinks ([batch, heads] after broadcasting) on sharded inputs: they
    join each shard's O and LSE outside the kernel, or (standin-sinks) inside its
    forward with the shard's own slice of them, and its backward sums their
    gradient over the shard's rows; their gradient is summed to the user's
    [heads]; no collective but the scalar loss's and the sinks' own
    gradient."""
    spec, _ = SPECS[name]
    mesh = _mesh()
    q, k, v, w = _inputs()
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0])

    def step(impl):
        def loss(q, k, v, w, s):
            return jnp.sum(scoremod.attention(q, k, v, ALIBI_B, implementation=impl,
                                              sinks=s) * w)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 4))

    want = step("xla")(q, k, v, w, sinks)
    StandIn.seen.clear()
    compiled = jax.jit(step(impl)).lower(*_put(mesh, spec, q, k, v, w), sinks).compile()
    joined = [shape for what, shape in StandIn.seen if what == "sinks"]
    assert bool(joined) == (impl == "standin-sinks"), StandIn.seen
    summed = [shape for what, shape in StandIn.seen if what == "sink gradient"]
    assert summed == joined, StandIn.seen  # the backward sums it where the forward joined
    for op, shape in _collectives(compiled.as_text()):
        assert op == "all-reduce" and re.fullmatch(r"f32\[(4)?\]", shape), (op, shape)
    _close(compiled(*_put(mesh, spec, q, k, v, w), sinks), want)


@eight
def test_operand_sliced_with_heads_and_global_indices():
    """A [b, h] table read directly keeps its per-shard slice; the mod's b and h
    are global (a shard's first row is not b = 0)."""
    mesh = _mesh()
    q, k, v, w = _inputs()
    table = jax.random.normal(jax.random.PRNGKey(5), (4, 4))
    mod = scoremod.trace(lambda s, b, h, q, k: s * table[b, h] + 0.1 * h - 0.2 * b)
    want = _step("xla", mod)(q, k, v, w)
    args = _put(mesh, P("x", None, "y"), q, k, v, w)
    got = jax.jit(_step("standin", mod))(*args)
    _close(got, want)


@eight
@pytest.mark.parametrize("spec", [P(None, None, None, "x"), P(None, None, "x", "y"),
                                  P("z", None, None, ("x", "y"))])
def test_unsupported_shardings_are_resharded(spec):
    """The head dim is never split; a split XLA must undo gives the same result."""
    mesh = _mesh()
    q, k, v, w = _inputs()
    want = _step("xla", ALIBI_B)(q, k, v, w)
    got = jax.jit(_step("standin", ALIBI_B))(*_put(mesh, spec, q, k, v, w))
    _close(got, want)


@eight
def test_heads_that_do_not_divide_are_gathered():
    """2 kv heads cannot follow 4 head shards: the heads are gathered, not misread."""
    mesh = Mesh(np.array(jax.devices()[:DEVICES]).reshape(4, 2), ("x", "y"))
    q, k, v, w = _inputs()
    want = _step("xla", ALIBI_B)(q, k, v, w)
    q, w = _put(mesh, P(None, None, "x"), q, w)
    got = jax.jit(_step("standin", ALIBI_B))(q, k, v, w)
    _close(got, want)


# --- context parallelism -------------------------------------------------------

DOCS = jnp.asarray(np.repeat(np.array([[0, 0, 1, 1, 1, 2, 3, 3], [0, 1, 1, 1, 2, 2, 2, 2],
                                       [0, 0, 0, 0, 0, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]]),
                             8, axis=1), jnp.int32)
QPOS = jnp.linspace(-1.0, 1.0, 64)  # read at q_idx directly: sharded with the queries
KPOS = jnp.linspace(0.5, -0.5, 64)  # read at kv_idx directly: gathered with the keys
CONTEXT_MODS = {
    "positions": lambda s, b, h, q, k: jnp.where(q >= k, s + QPOS[q] * KPOS[k], -jnp.inf),
    "causal": lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf),
    "sliding_window": lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 20), s, -jnp.inf),
    "document": lambda s, b, h, q, k: jnp.where((DOCS[b, q] == DOCS[b, k]) & (q >= k), s,
                                                -jnp.inf),
    "alibi": lambda s, b, h, q, k: s + SLOPES[h] * (k - q),
    "softcap_causal": lambda s, b, h, q, k: jnp.where(q >= k, 5 * jnp.tanh(s / 5), -jnp.inf),
}


@eight
@pytest.mark.parametrize("name", sorted(CONTEXT_MODS))
@pytest.mark.parametrize("spec", [P(None, ("x", "y", "z")), P("x", ("y", "z"))],
                         ids=["seq8", "batch2_seq4"])
def test_context_parallel_equals_unsharded(name, spec):
    mod = scoremod.trace(CONTEXT_MODS[name])
    mesh = _mesh()
    q, k, v, w = _inputs()
    want = _step("xla", mod)(q, k, v, w)
    step = jax.jit(_step("standin", mod))
    args = _put(mesh, spec, q, k, v, w)
    StandIn.seen.clear()
    got = step(*args)
    _close(got, want)
    seq_parts = 8 if spec == P(None, ("x", "y", "z")) else 4
    # Each shard computes its rows against all keys (its few rows folded: a group's
    # query heads packed into rows, lowering/decode.py, so rows x heads is the shard's).
    assert any(p.sq * p.hq == 64 // seq_parts * 4 and p.skv == 64
               for _, p in StandIn.seen), StandIn.seen
    dq = got[1][0]  # dQ keeps the query shards
    assert dq.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4), dq.sharding


@eight
def test_context_parallel_lse():
    mod = scoremod.trace(CONTEXT_MODS["document"])
    mesh = _mesh()
    q, k, v, _ = _inputs()
    f = lambda impl: jax.jit(lambda q, k, v: scoremod.attention(  # noqa: E731
        q, k, v, mod, implementation=impl, return_lse=True))
    want = f("xla")(q, k, v)
    got = f("standin")(*_put(mesh, P(None, ("x", "y", "z")), q, k, v))
    _close(got, want)


@eight
@pytest.mark.parametrize("spec", [P(("x", "y")), P(None, ("x", "y", "z"))], ids=["batch", "seq8"])
def test_nonfinite_values_at_masked_keys_per_shard(spec):
    """The masked-key rule for non-finite V (lowering/nonfinite.py) holds on
    each shard, with each device deciding on its own V (no collective)."""
    mod = scoremod.trace(CONTEXT_MODS["causal"])
    mesh = _mesh()
    q, k, v, w = _inputs()
    v = v.at[1, 40, 0].set(jnp.nan)  # masked for batch 1's rows 0..39

    checked = scoremod.LoweringOptions(check_values=True)  # the rule is off by default

    def step(impl):
        def loss(q, k, v, w):
            o = scoremod.attention(q, k, v, mod, implementation=impl, options=checked)
            return jnp.sum(jnp.where(jnp.isnan(o), 0.0, o) * w), o

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    want = step("xla")(q, k, v, w)
    args = _put(mesh, spec, q, k, v, w)
    compiled = step("standin").lower(*args).compile()
    if spec == P(("x", "y")):
        for op, shape in _collectives(compiled.as_text()):
            assert op == "all-reduce" and re.fullmatch(r"f32\[\]", shape), (op, shape)
    (got_loss, got_o), got_grads = compiled(*args)
    (want_loss, want_o), want_grads = want
    o = np.asarray(got_o)
    assert np.isfinite(o[1, :40]).all() and np.isnan(o[1, 40:, :2]).all()
    np.testing.assert_array_equal(np.isnan(o), np.isnan(np.asarray(want_o)))
    _close((jnp.nan_to_num(got_o), got_loss, got_grads),
           (jnp.nan_to_num(want_o), want_loss, want_grads))


class _Automatic(StandIn):
    """The stand-in as implementation=None's first choice (as cuDNN on a GPU)."""

    name = "standin-auto"

    def why_not(self, problem, mod, automatic, options=None):
        return None


@eight
def test_derivatives_on_sharded_inputs_and_in_shard_map():
    """Reverse mode (fused) and forward mode (reference tangents, implementation=None)
    with sharded inputs under jax.jit and inside jax.shard_map."""
    registry.register(_Automatic(), before="xla")
    try:
        mesh = _mesh()
        spec = P(("x", "y"), None, "z")
        q, k, v, _ = _inputs()
        args = _put(mesh, spec, q, k, v)
        tangents = (jnp.cos(q), jnp.sin(k), jnp.cos(v))
        f = lambda impl: lambda q, k, v: scoremod.attention(  # noqa: E731
            q, k, v, ALIBI_B, implementation=impl)
        smap = lambda g: jax.jit(jax.shard_map(  # noqa: E731
            g, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
        checks = {
            "grad_in_shard_map": lambda i: smap(lambda q, k, v: jax.grad(
                lambda q: jnp.sum(jnp.sin(f(i)(q, k, v))))(q))(*args),
            "grad_of_shard_map": lambda i: jax.jit(jax.grad(
                lambda q: jnp.sum(jnp.sin(smap(f(i))(q, *args[1:])))))(args[0]),
            "jvp_of_shard_map": lambda i: jax.jvp(smap(f(i)), tuple(args), tangents),
            "linearize_in_shard_map": lambda i: smap(lambda q, k, v: jax.linearize(
                lambda q: f(i)(q, k, v), q)[1](jnp.cos(q)))(*args),
            "jvp_of_jit": lambda i: jax.jvp(jax.jit(f(i)), tuple(args), tangents),
        }
        for name, check in checks.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = check(None)
            fell_back = any("falls back" in str(w.message) for w in caught)
            assert fell_back == ("grad" not in name), (name, [str(w.message) for w in caught])
            _close(got, check("xla"))
    finally:
        registry.unregister("standin-auto")


# --- the Python graph cache under threads --------------------------------------


def test_graph_cache_builds_once_under_concurrent_tracing():
    """Threads tracing the same call at once (one per device) share one build."""
    from scoremod.lowering.cudnn import graph as cg

    builds = []

    def build():
        builds.append(threading.get_ident())
        time.sleep(0.05)
        return types.SimpleNamespace(seconds=0.05, plan="test")

    key = ("forward", "threads-test", time.time())
    got, start = [], threading.Barrier(8)

    def trace():
        start.wait()
        got.append(cg.cached(key, build))

    threads = [threading.Thread(target=trace) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(got) == 8 and all(g is got[0] for g in got)
    assert cg.cache_entries()[key] is got[0]
