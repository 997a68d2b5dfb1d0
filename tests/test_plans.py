"""Every mod of the GPU suite plans its fused call on any machine.

Planning (canonical form, native band, query-block split, scale folding,
key-padding guard, loads) is pure Python; the GPU suite then only has to
find what cuDNN computes. Run here with the lowerings' defaults, so a default
switched on is planned for every mod the GPU suite runs.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import scoremod
from scoremod.lowering import cudnn_path, cudnn_rules, reference, split
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
def test_fused_call_plans_and_canonical_form_is_a_fixed_point(name, monkeypatch):
    fn, (sq, skv, hq) = CASES[name]
    mod = scoremod.trace(fn)
    once = cudnn_rules.canonical(mod.expr)
    assert cudnn_rules.canonical(once) == once
    monkeypatch.setattr(cudnn_path, "_sm_count", lambda: 1)  # small shapes split as on the GPU tests
    shapes = (2, sq, skv, hq, 2, 64, 64)
    blocks = cudnn_path._split_blocks(mod, sq, skv, 2 * hq)
    if blocks is None:
        parts = [cudnn_path.Static(mod, shapes, "bfloat16", 0.125, allow_fallback=False)]
    else:
        parts = cudnn_path.Split(mod, shapes, "bfloat16", 0.125, False, blocks).parts
    for static in parts:
        assert static.problem.scale > 0


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
    return float(reference.evaluate(expr, inputs, operands))


SHOW = "from scoremod.lowering import cudnn_path as c; print(c.NATIVE_MASKS, c.SPLIT_BLOCKS, c.FOLD_SCALE)"


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
