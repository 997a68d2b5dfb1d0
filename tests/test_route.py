"""One route per call (``scoremod.route``): what ``which_implementation`` says
is what ``attention`` runs, and the reason names it; warnings only where the
user should act or know.

On a faked H200 (the cuDNN backends' machine checks pass, nothing runs on
them: a spy stands in for the execution), every catalogue mod at its GPU
shape, in float16 and bfloat16, under the default options and under options
that change the choice.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod import device, kernels_ffi
from scoremod import route as route_module
from scoremod.lowering.cudnn import backend as cudnn_backend
from tests.catalogue.mods import CATALOGUE

H200 = device.Device("gpu", "NVIDIA H200", 9, 132)
OPTIONS = {
    "default": scoremod.LoweringOptions(),
    "no-native-masks": scoremod.LoweringOptions(native_masks=False, split_blocks=1),
    "triton-engine": scoremod.LoweringOptions(pallas_engine="triton"),
    "no-folding": scoremod.LoweringOptions(fold_scale=False, low_rank_bias=False),
}


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(device, "current", lambda: H200)
    monkeypatch.setattr(kernels_ffi, "available", lambda: True)
    monkeypatch.setattr(cudnn_backend, "_frontend_installed", lambda: True)
    monkeypatch.setattr(kernels_ffi, "frontend_mismatch", lambda: "")
    monkeypatch.setattr(cudnn_backend.verify, "refusal", lambda automatic: None)
    monkeypatch.setattr(route_module, "_WARNED", set())
    ran = []
    api = __import__("importlib").import_module("scoremod.attention")

    def spy(call, q, k, v, operands, sinks=None):
        ran.append(call.backend.name)
        problem = call.problem
        o = jnp.zeros((problem.b, problem.sq, problem.hq, problem.dv), q.dtype)
        return o, jnp.zeros((problem.b, problem.hq, problem.sq), jnp.float32)

    monkeypatch.setattr(api, "execute", spy)
    return ran


def _call(name, dtype):
    entry = CATALOGUE[name]
    shape = entry.gpu
    mod = entry.build(entry.env(shape))
    hkv = getattr(shape, "hkv", shape.h)
    q = jax.ShapeDtypeStruct((shape.b, shape.sq, shape.h, 128), dtype)
    k = jax.ShapeDtypeStruct((shape.b, shape.skv, hkv, 128), dtype)
    return mod, q, k


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("options", sorted(OPTIONS))
def test_which_implementation_names_what_attention_runs(h200, options, dtype):
    options = OPTIONS[options]
    seen = set()
    for name, entry in sorted(CATALOGUE.items()):
        if entry.needs:
            continue
        mod, q, k = _call(name, dtype)
        args = [jnp.zeros(q.shape, dtype), jnp.zeros(k.shape, dtype), jnp.zeros(k.shape, dtype)]
        choice = scoremod.which_implementation(*args, mod, options=options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            jax.eval_shape(lambda q, k, v: scoremod.attention(q, k, v, mod, options=options),
                           *args)
        assert h200[-1] == choice.implementation, (name, choice)
        assert choice.reason.startswith(choice.implementation + ":"), (name, choice)
        seen.add(choice.implementation)
    assert {"cudnn", "pallas"} <= seen, seen  # the faked machine takes fused routes


def test_the_normal_choice_is_silent(h200):
    """Softcap, causal and ALiBi on their first-choice backend: no warning (the
    variable-length route refusing a mod that is no segment mask is normal);
    a mod cuDNN refuses warns once, naming both backends and the op."""
    q = jnp.zeros((2, 256, 4, 128), jnp.bfloat16)
    slopes = jnp.linspace(0.1, 0.5, 4)
    for mod in (lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0),
                lambda s, b, h, qi, ki: jnp.where(qi >= ki, s, -jnp.inf),
                lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scoremod.attention(q, q, q, mod)
        assert h200[-1] == "cudnn"
    refused = lambda s, b, h, qi, ki: jnp.where(s > 0.0, s, 0.0)  # noqa: E731 float compare
    with pytest.warns(UserWarning, match="uses the Pallas block-sparse kernels here: cudnn "
                                         "refuses this call: .*`gt`"):
        scoremod.attention(q, q, q, refused)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scoremod.attention(q, q, q, refused)  # once per mod and reason
    assert h200[-2:] == ["pallas", "pallas"]


def test_route_is_frozen_and_describes_itself(h200):
    from scoremod.lowering.problem import Problem

    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    mod = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(s > 0.0, s, 0.0))
    chosen = route_module.route(Problem.of(q, q, q), mod, 0.125, scoremod.LoweringOptions())
    with pytest.raises(Exception):
        chosen.backend = None
    choice = chosen.describe()
    assert choice.implementation == chosen.backend.name == "pallas"
    assert choice.reason == chosen.reason and chosen.warning in chosen.reason
    assert choice.verdicts["cudnn"] and choice.verdicts["pallas"] is None
    # Asked for by name: that backend or its refusal, never a warning.
    by_name = route_module.route(Problem.of(q, q, q), mod, 0.125, scoremod.LoweringOptions(),
                                 "xla")
    assert by_name.backend.name == "xla" and by_name.warning is None and by_name.call.fallback is None
    with pytest.raises(scoremod.ScoreModError, match="implementation=\"cudnn\" cannot run"):
        route_module.route(Problem.of(q, q, q), mod, 0.125, scoremod.LoweringOptions(), "cudnn")
    assert np.isfinite(chosen.plan.scale)


def test_a_cudnn_call_passes_few_frames_and_plans_once(monkeypatch):
    """From ``scoremod.attention`` to the cuDNN backend's forward and backward a
    call passes at most 5 scoremod functions, and none of them plans again: the
    route's plan is the one the kernels get (faked H200: the cuDNN forward and
    backward are spies that record the stack and return zeros)."""
    import inspect

    from scoremod.lowering.cudnn.backend import CUDNN

    monkeypatch.setattr(device, "current", lambda: H200)
    monkeypatch.setattr(kernels_ffi, "available", lambda: True)
    monkeypatch.setattr(cudnn_backend, "_frontend_installed", lambda: True)
    monkeypatch.setattr(kernels_ffi, "frontend_mismatch", lambda: "")
    monkeypatch.setattr(cudnn_backend.verify, "refusal", lambda automatic: None)
    seen, plans = {}, []
    real_plan = type(CUDNN).plan

    def plan(self, *args):
        plans.append(args[0])
        return real_plan(self, *args)

    def frames():
        names = []
        for info in inspect.stack()[2:]:
            if "/scoremod/" not in info.filename.replace("\\", "/"):
                continue
            if info.function == "attention" and info.filename.endswith("attention.py"):
                return names
            names.append(f"{info.filename.rsplit('/', 1)[-1]}:{info.function}")
        raise AssertionError("scoremod.attention is not on the stack")

    def forward(self, plan_, q, k, v, operands):
        seen["forward"] = frames()
        p = plan_.shape
        return (jnp.zeros((p.b, p.sq, p.hq, p.dv), q.dtype),
                jnp.zeros((p.b, p.hq, p.sq), jnp.float32))

    def backward(self, plan_, q, k, v, o, lse, do, operands, dlse=None, wanted=()):
        seen["backward"] = inspect.stack()[1].function
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), {}

    monkeypatch.setattr(type(CUDNN), "plan", plan)
    monkeypatch.setattr(type(CUDNN), "forward", forward)
    monkeypatch.setattr(type(CUDNN), "backward", backward)
    q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    softcap = lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0)  # noqa: E731
    assert scoremod.which_implementation(q, q, q, softcap)[0] == "cudnn"
    plans.clear()
    loss = lambda q: scoremod.attention(q, q, q, softcap).astype(jnp.float32).sum()  # noqa: E731
    jax.grad(loss)(q)
    assert len(plans) == 1, plans  # the route's, and no other
    assert 0 < len(seen["forward"]) <= 5, seen["forward"]
    assert "backward" in seen
    plans.clear()
    jax.jit(jax.grad(loss))(q)
    assert len(plans) == 1 and len(seen["forward"]) <= 5, (plans, seen["forward"])


def test_cudnn_joins_per_head_sinks_inside_its_forward(h200):
    """On cuDNN, sinks one per head join its forward graph's softmax (its sink
    input: no pass over O after it), on the query blocks of a split too; sinks per
    batch row, one query row (cuDNN refuses a sink there), check_values and the
    other backends join them around the kernel's forward."""
    q = jnp.zeros((2, 512, 8, 128), jnp.bfloat16)
    k = jnp.zeros((2, 512, 2, 128), jnp.bfloat16)
    per_head, per_batch = jnp.zeros(8), jnp.zeros((2, 8))
    causal = lambda s, b, h, qi, ki: jnp.where(qi >= ki, s, -jnp.inf)  # noqa: E731
    softcap_causal = lambda s, b, h, qi, ki: jnp.where(  # noqa: E731
        qi >= ki, 30 * jnp.tanh(s / 30), -jnp.inf)

    def chosen(mod, sinks, q=q, **kw):
        options = scoremod.LoweringOptions(**kw)
        call = route_module.route(route_module.Problem.of(q, k, k), scoremod.trace(mod), 0.1,
                                  options, None, False,
                                  scoremod.lowering.sinks.layout(sinks)).call
        return call.backend.name, call.sinks_inside

    assert chosen(causal, per_head) == ("cudnn", True)
    assert chosen(softcap_causal, per_head, split_blocks=4, sms=1) == ("cudnn", True)
    assert chosen(causal, per_head[None]) == ("cudnn", True)
    assert chosen(causal, per_batch) == ("cudnn", False)
    assert chosen(causal, per_head, check_values=True) == ("cudnn", False)
    assert chosen(causal, per_head, q=q[:, :1], decode_splits=0) == ("cudnn", False)
    docs = jnp.zeros((2, 512), jnp.int32)
    assert chosen(lambda s, b, h, qi, ki: jnp.where(docs[b, qi] == docs[b, ki], s, -jnp.inf),
                  per_head) == ("cudnn-varlen", False)


def test_mosaic_forward_takes_the_forward_of_score_mod_graphs(h200, monkeypatch):
    """LoweringOptions(mosaic_forward=True): a call the planner puts on cuDNN's
    score_mod graphs (softcap + causal, split into query blocks) runs its forward
    on the Pallas kernels' Mosaic GPU engine, its backward on cuDNN; a pure mask
    under cuDNN's native mask (causal) stays whole on cuDNN, and so does every
    call without the option."""
    from scoremod import support

    monkeypatch.setattr(support, "mosaic_missing", lambda: None)  # as jax 0.11 or later
    on = scoremod.LoweringOptions(mosaic_forward=True)
    q = jnp.zeros((4, 4096, 16, 128), jnp.bfloat16)  # cuDNN splits softcap + causal here
    softcap_causal = lambda s, b, h, qi, ki: jnp.where(  # noqa: E731
        qi >= ki, 30 * jnp.tanh(s / 30), -jnp.inf)
    causal = lambda s, b, h, qi, ki: jnp.where(qi >= ki, s, -jnp.inf)  # noqa: E731
    choice = scoremod.which_implementation(q, q, q, softcap_causal, options=on)
    assert choice.implementation == "pallas", choice
    assert choice.reason.startswith("pallas: it claims the forward from cudnn"), choice.reason
    assert "cuDNN" in choice.backward and "O and LSE" in choice.backward, choice.backward
    assert "Mosaic GPU" in choice.variant
    for mod, options in ((causal, on), (softcap_causal, scoremod.LoweringOptions())):
        choice = scoremod.which_implementation(q, q, q, mod, options=options)
        assert choice.implementation == "cudnn" and choice.backward is None, choice
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.eval_shape(lambda q: scoremod.attention(q, q, q, softcap_causal, options=on), q)
    assert h200[-1] == "pallas"


def test_cudnn_refuses_one_query_row_with_a_captured_array(h200):
    """cuDNN 9.19 computed ALiBi wrongly at one query row on the H200 (b8, 32 query
    heads on 8): a call that would run one row with a captured array is refused,
    by name naming why, and implementation=None runs it elsewhere; the fold that
    packs a group's query heads into rows (the default) keeps it on cuDNN, and a
    mod that reads no array is taken at one row."""
    slopes = jnp.linspace(0.1, 0.5, 32)
    alibi = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)  # noqa: E731
    softcap = lambda s, b, h, qi, ki: 30 * jnp.tanh(s / 30)  # noqa: E731
    q = jnp.zeros((8, 1, 32, 128), jnp.bfloat16)
    kv = jnp.zeros((8, 4096, 8, 128), jnp.bfloat16)
    unfolded = scoremod.LoweringOptions(decode_splits=0)
    with pytest.raises(scoremod.ScoreModError, match="wrongly at one query row"):
        scoremod.which_implementation(q, kv, kv, alibi, implementation="cudnn", options=unfolded)
    assert scoremod.which_implementation(q, kv, kv, alibi, options=unfolded)[0] != "cudnn"
    assert scoremod.which_implementation(q, kv, kv, alibi, implementation="cudnn")[0] == "cudnn"
    assert scoremod.which_implementation(q, kv, kv, softcap, implementation="cudnn",
                                         options=unfolded)[0] == "cudnn"
    mha = jnp.zeros((8, 4096, 32, 128), jnp.bfloat16)  # no group to pack: one row stays
    with pytest.raises(scoremod.ScoreModError, match="wrongly at one query row"):
        scoremod.which_implementation(q, mha, mha, alibi, implementation="cudnn")


def test_a_learned_bias_per_score_trains_on_the_mosaic_backward(h200, monkeypatch):
    """A float bias per head and score (Flax's ``bias``) stays on cuDNN's forward, and
    its gradient's fallback is the Pallas kernels' Mosaic GPU backward, which learns it
    (no Triton kernel, not the reference path's O(S^2) scores)."""
    from scoremod import support
    from scoremod.lowering.problem import Problem

    monkeypatch.setattr(support, "mosaic_missing", lambda: None)  # as jax 0.11 or later
    q = jnp.zeros((2, 1024, 8, 128), jnp.bfloat16)
    bias = jnp.zeros((8, 1024, 1024), jnp.float32)
    mod = scoremod.trace(lambda s, b, h, qi, ki: s + bias[h, qi, ki])
    chosen = route_module.route(Problem.of(q, q, q), mod, 128 ** -0.5, scoremod.LoweringOptions())
    assert chosen.backend.name == "cudnn", chosen.describe()
    fallback, plan = chosen.call.fallback
    assert fallback.name == "pallas" and plan.engine == "mosaic", plan.describe()
    assert plan.backward_engine == "mosaic" and plan.triton_operands == (), plan.describe()
    # Beside Flax's mask per score the same (the mask is not claimed from cuDNN).
    keep = jnp.ones((2, 1, 1024, 1024), bool)
    masked = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(keep[b, 0, qi, ki],
                                                              s + bias[h, qi, ki], -jnp.inf))
    chosen = route_module.route(Problem.of(q, q, q), masked, 128 ** -0.5,
                                scoremod.LoweringOptions())
    assert chosen.backend.name == "cudnn", chosen.describe()
    fallback, plan = chosen.call.fallback
    assert fallback.name == "pallas" and plan.backward_engine == "mosaic", plan.describe()
