"""Every mod of the GPU suite plans its fused call on any machine.

Planning (canonical form, native band, query-block split, scale folding,
key-padding guard, loads) is pure Python; the GPU suite then only has to
find what cuDNN computes. Run here with the lowerings' defaults, so a default
switched on is planned for every mod the GPU suite runs.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.dsl.evaluate import evaluate
from scoremod.lowering.cudnn import rules as cudnn_rules
from scoremod.lowering.cudnn.plan import Plan, plan_for
from scoremod.lowering.problem import Problem
from tests.gpu import test_fused as gpu

CASES = {  # name: (mod function, GPU-test sizes (sq, skv, hq))
    **{f"op_{n}": (f, (128, 192, 4)) for n, f in gpu.OP_MODS.items()},
    **{f"native_{n}": (f, (192, 256, 4)) for n, f in gpu.NATIVE.items()},
    **{f"growing_{n}": (f, (192, 192, 4)) for n, f in gpu.GROWING.items()},
    **{f"split_{n}": (f, (512, 512, 4)) for n, f in gpu.SPLIT.items()},
    **{f"fold_{n}": (f, (128, 192, 4)) for n, f in gpu.FOLD.items()},
    **{f"realistic_{n}-{c['sq']}x{c['skv']}": (f, (c["sq"], c["skv"], c["hq"]))
       for c in gpu.CONFIGS for n, f in gpu.realistic_mods(2, c["sq"], c["skv"], c["hq"]).items()},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_call_plans_and_canonical_form_is_a_fixed_point(name):
    fn, (sq, skv, hq) = CASES[name]
    mod = scoremod.trace(fn)
    once = cudnn_rules.canonical(mod.expr)
    assert cudnn_rules.canonical(once) == once
    options = scoremod.LoweringOptions(sms=1)  # small shapes split as on the GPU tests
    plan = Plan(mod, Problem(2, sq, skv, hq, 2, 64, 64, "bfloat16"), 0.125, options)
    assert len(plan.parts) == len(plan.blocks) and plan.split == (len(plan.blocks) > 1)
    for part in plan.parts:
        assert part.spec.scale > 0


@pytest.mark.parametrize("name", sorted(gpu.OP_MODS))
def test_scale_folding_keeps_the_value_of_every_op_mod(name):
    """fold_scale(e) = (e', c) means e(score) == e'(score * c), checked numerically."""
    mod = scoremod.trace(gpu.OP_MODS[name])
    operands = dict(zip(mod.operand_names, mod.operands))
    expr = cudnn_rules.canonical(mod.expr)
    folded, c = cudnn_rules.fold_scale(expr)
    scores = np.linspace(-3.0, 3.0, 13, dtype=np.float32)
    want = [_eval(expr, s, operands) for s in scores]
    got = [_eval(folded, s * c, operands) for s in scores]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _eval(expr, score, operands):
    inputs = {"score": score, "b": 0, "h": 1, "q_idx": 5, "kv_idx": 3}
    return float(evaluate(expr, inputs, operands))


SHOW = ("import scoremod; o = scoremod.options.defaults(); "
        "print(o.native_masks, o.split_blocks, o.fold_scale)")


@pytest.mark.parametrize("env, out", [
    ({}, "True 8 True"),
    ({"SCOREMOD_NATIVE_MASKS": "0", "SCOREMOD_SPLIT_BLOCKS": "0", "SCOREMOD_FOLD_SCALE": "0"}, "False 0 False"),
    ({"SCOREMOD_SPLIT_BLOCKS": "4"}, "True 4 True"),
    ({"SCOREMOD_NATIVE_MASKS": "yes"}, "SCOREMOD_NATIVE_MASKS='yes': expected 0 (off) or 1 (on)"),
    ({"SCOREMOD_SPLIT_BLOCKS": "-1"}, "SCOREMOD_SPLIT_BLOCKS='-1': expected a number of query blocks"),
])
def test_lowering_switches_from_the_environment(env, out):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SCOREMOD_")}
    run = subprocess.run([sys.executable, "-c", SHOW], env={**clean, **env, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=120)
    assert out in run.stdout + run.stderr


def test_options_are_part_of_the_plan_and_the_plan_is_cached():
    mod = scoremod.trace(gpu.SPLIT["softcap_causal"])
    shape = Problem(2, 512, 512, 4, 2, 64, 64, "bfloat16")
    default = scoremod.LoweringOptions(sms=1)
    a, b = plan_for(mod, shape, 0.125, default), plan_for(mod, shape, 0.125, default)
    assert a is b  # one plan per (mod, shape, scale, options)
    plain = plan_for(mod, shape, 0.125, scoremod.LoweringOptions.plain().replace(sms=1))
    assert plain != a and not plain.split and a.split
    assert plain.parts[0].key != a.parts[0].key
    # Equal graphs under different options still have different graph keys.
    only_fold = scoremod.LoweringOptions(split_blocks=0, sms=1)
    plain_fold = scoremod.LoweringOptions(native_masks=False, split_blocks=0, sms=1)
    x, y = (plan_for(mod, shape, 0.125, o).parts[0] for o in (only_fold, plain_fold))
    assert x.fwd is y.fwd and x.spec == y.spec and x.key != y.key


def test_options_from_argument_context_and_defaults(monkeypatch):
    seen = []
    real = plan_for

    def spy(mod, shape, scale, options):
        seen.append(options)
        return real(mod, shape, scale, options)

    from scoremod.lowering.cudnn import backend

    monkeypatch.setattr(backend, "plan_for", spy)
    q = np.ones((1, 128, 2, 64), np.float16)
    mod = scoremod.trace(gpu.SPLIT["softcap_causal"])
    plain = scoremod.LoweringOptions.plain()
    backend.CUDNN.plan(Problem.of(q, q, q), mod, 0.1, plain, False)
    assert seen == [plain]
    with scoremod.lowering_options(split_blocks=3) as inside:
        assert scoremod.options.current() == inside == scoremod.options.defaults().replace(split_blocks=3)
        with scoremod.lowering_options(plain):
            assert scoremod.options.current() == plain
        assert scoremod.options.current() == inside
    assert scoremod.options.current() == scoremod.options.defaults()
    with pytest.raises(scoremod.ScoreModError, match="split_blocks"):
        scoremod.LoweringOptions(split_blocks=-1)
    with pytest.raises(scoremod.ScoreModError, match="LoweringOptions"):
        scoremod.attention(q, q, q, implementation="xla", options={"fold_scale": False})
    with pytest.raises(scoremod.ScoreModError, match="deterministic must be True or False"):
        scoremod.LoweringOptions(deterministic=1)
    scoremod.options.defaults.cache_clear()
    monkeypatch.setenv("SCOREMOD_DETERMINISTIC", "1")
    try:
        assert scoremod.options.defaults() == scoremod.LoweringOptions(deterministic=True)
        scoremod.options.defaults.cache_clear()
        monkeypatch.setenv("SCOREMOD_DETERMINISTIC", "yes")
        with pytest.raises(scoremod.ScoreModError, match="SCOREMOD_DETERMINISTIC"):
            scoremod.options.defaults()
    finally:
        monkeypatch.delenv("SCOREMOD_DETERMINISTIC")
        scoremod.options.defaults.cache_clear()


@pytest.mark.parametrize("fn, at_zero", [
    (lambda s, b, h, q, k: jax.nn.softplus(s), 0.5),
    (lambda s, b, h, q, k: jnp.logaddexp(s, 0.0), 0.5),
    (lambda s, b, h, q, k: jax.nn.softplus(s / 4.0), 0.125),  # foldable scale, custom rule
    (lambda s, b, h, q, k: jnp.maximum(s, 0.0), 0.5),
    (lambda s, b, h, q, k: jnp.abs(s), 1.0),
])
def test_planned_backward_keeps_derivatives_at_ties(fn, at_zero):
    """The plan's backward expression (after scale folding and canonical rewrites)
    is the derivative JAX gives at an exact tie: zero-padded query rows score 0."""
    from scoremod.lowering.cudnn.plan import Part
    from scoremod.options import LoweringOptions

    mod = scoremod.trace(fn)
    for options in (LoweringOptions(), LoweringOptions.plain()):
        part = Part(mod, Problem(1, 128, 128, 2, 2, 64, 64, "bfloat16"), 0.125, options)
        scale = part.spec.scale / 0.125  # what folding moved into attn_scale
        inputs = {"score": jnp.float32(0.0), "dP": jnp.float32(1.0), "b": 0, "h": 0,
                  "q_idx": 0, "kv_idx": 0}
        got = float(evaluate(part.bwd, inputs, {})) * scale
        assert got == pytest.approx(at_zero), (options, str(part.bwd))
        assert float(jax.grad(lambda s: fn(s, 0, 0, 0, 0))(0.0)) == pytest.approx(at_zero)


@pytest.mark.parametrize("sq,skv", [(1, 12), (100, 128), (128, 100), (256, 384)])
def test_backward_gives_the_padding_no_gradient(sq, skv):
    """cuDNN's backward evaluates the score's gradient on the padding of its last
    tiles too (score 0, indices past the ends): the planned backward expression
    is 0 there, where the derivative of s * log|s| is -inf (NaN in dK and dV on
    the H200 otherwise), and the derivative itself on every real entry; the
    forward expression is -inf there; at whole tiles both are the mod's alone."""
    from scoremod.lowering.cudnn.plan import Part
    from scoremod.dsl import ir

    mod = scoremod.trace(lambda s, b, h, q, k: s * jnp.log(jnp.abs(s)))
    part = Part(mod, Problem(b=1, sq=sq, skv=skv, hq=1, hkv=1, d=64, dv=64, dtype="bfloat16"),
                0.125, scoremod.LoweringOptions())
    qi = np.arange(256 + 128)[:, None]
    ki = np.arange(384 + 128)[None, :]
    for score in (0.0, 0.75):
        inputs = {"score": np.full(qi.shape[:1] + ki.shape[1:], score, np.float32), "b": 0,
                  "h": 0, "q_idx": qi, "kv_idx": ki, ir.cotangent().attr: 1.0}
        got = np.asarray(evaluate(part.bwd, inputs, {}))
        real = (qi < sq) & (ki < skv)
        padded = ~real & (qi < -(-sq // 128) * 128) & (ki < -(-skv // 128) * 128)
        if sq % 128 or skv % 128:
            assert np.all(got[padded] == 0.0), score
        if score:  # d/ds s log|s|, on the real entries
            assert np.allclose(got[real], 1.0 + np.log(score)), score
        # The value is -inf on the padding (P = 0 there: NaN would reach dV).
        value = np.broadcast_to(np.asarray(evaluate(part.fwd, inputs, {})), got.shape)
        assert np.all(np.isneginf(value[padded])) and not np.isneginf(value[real]).any()
    assert bool(sq % 128 or skv % 128) == (part.bwd.op == "where")
