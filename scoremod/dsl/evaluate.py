"""The IR evaluated with jax.numpy: what a mod computes, on broadcastable arrays.

The definition every lowering is tested against; jit-able and differentiable
(gradients reach the operands).
"""

from __future__ import annotations

import jax.numpy as jnp

from scoremod.dsl import ir
from scoremod.dsl.ir import BOOL, CONST, F32, I32, LOAD, MATERIALIZE, OPERAND, OPS, VAR

_JNP_DTYPE = {F32: jnp.float32, I32: jnp.int32, BOOL: jnp.bool_}


def evaluate(expr: ir.Node, inputs: dict, operands: dict):
    """Value of ``expr`` given arrays for the variables and the operands."""
    vals = {}
    for node in ir.toposort(expr):
        if node.op == CONST:
            vals[node] = jnp.asarray(node.attr, _JNP_DTYPE[node.dtype])
        elif node.op == VAR:
            vals[node] = jnp.asarray(inputs[node.attr], _JNP_DTYPE[node.dtype])
        elif node.op == OPERAND:
            continue
        elif node.op == MATERIALIZE:  # lowering-internal: a value computed ahead
            vals[node] = vals[node.args[0]]
        elif node.op == LOAD:
            vals[node] = _load(node, operands[node.args[0].attr[0]], [vals[a] for a in node.args[1:]])
        else:
            vals[node] = OPS[node.op].evaluate([vals[a] for a in node.args], node.attr)
    return vals[expr]


def _load(node, array, idx):
    array = jnp.asarray(array)
    shape = node.args[0].attr[1]
    # Indices clamp into range, as XLA's dynamic_slice does.
    idx = tuple(jnp.clip(i, 0, n - 1) for i, n in zip(idx, shape))
    out = array[idx] if idx else array
    return out.astype(_JNP_DTYPE[node.dtype])
