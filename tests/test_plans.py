"""Every mod of the GPU suite plans its fused call on any machine.

Planning (canonical form, native band, query-block split, scale folding,
key-padding guard, loads) is pure Python; the GPU suite then only has to
find what cuDNN computes. Run here with the lowerings' defaults, so a default
switched on is planned for every mod the GPU suite runs.
"""

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
def test_fused_call_plans_and_canonical_form_is_a_fixed_point(name):
    fn, (sq, skv, hq) = CASES[name]
    mod = scoremod.trace(fn)
    once = cudnn_rules.canonical(mod.expr)
    assert cudnn_rules.canonical(once) == once
    blocks = cudnn_path._split_blocks(mod, sq, skv) or (split.Block(0, sq, 0, skv),)
    for blk in blocks:
        part = split.shifted(mod, blk.q0, blk.k0)
        static = cudnn_path.Static(part, (2, blk.q1 - blk.q0, blk.k1 - blk.k0, hq, 2, 64, 64),
                                   "bfloat16", 0.125, allow_fallback=False)
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
