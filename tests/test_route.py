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

    def spy(backend, plan, q, k, v, operands, *, problem, **kw):
        ran.append(backend.name)
        o = jnp.zeros((problem.b, problem.sq, problem.hq, problem.dv), q.dtype)
        return o, jnp.zeros((problem.b, problem.hq, problem.sq), jnp.float32)

    monkeypatch.setattr(api, "run", spy)
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
    assert by_name.backend.name == "xla" and by_name.warning is None and by_name.fallback is None
    with pytest.raises(scoremod.ScoreModError, match="implementation=\"cudnn\" cannot run"):
        route_module.route(Problem.of(q, q, q), mod, 0.125, scoremod.LoweringOptions(), "cudnn")
    assert np.isfinite(chosen.plan.scale)
