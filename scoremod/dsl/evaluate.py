"""The IR evaluated with jax.numpy: what a mod computes, on broadcastable arrays.

The definition every lowering is tested against; jit-able and differentiable
(gradients reach the operands).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from scoremod.dsl import ir
from scoremod.dsl.ir import (BOOL, CONST, F32, I32, LOAD, MATERIALIZE, OPERAND, OPS, TANGENT,
                             VAR, WITH_GRAD)

_JNP_DTYPE = {F32: jnp.float32, I32: jnp.int32, BOOL: jnp.bool_}


def evaluate(expr: ir.Node, inputs: dict, operands: dict):
    """Value of ``expr`` given arrays for the variables and the operands."""
    order = ir.toposort(expr)
    linear = _linear_nodes(order) - _read_directly(order, expr)
    vals = {}
    for node in order:
        if node in linear:  # a with_grad derivative's: evaluated at the real tangent
            continue
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
        elif node.op == WITH_GRAD:
            vals[node] = _with_grad(node, vals, linear)
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


def _read_directly(order, expr) -> set:
    """Nodes whose value is read other than as a with_grad derivative (the root
    itself may be one, e.g. a derivative evaluated alone): those take tangent() = 1."""
    direct = {expr}
    for node in reversed(order):  # from the root down: what a directly read node reads
        if node in direct:
            direct.update(node.args[:1] + node.args[1::2] if node.op == WITH_GRAD else node.args)
    return direct


def _linear_nodes(order) -> set:
    """The nodes computed from tangent(): with_grad's derivatives, linear in it
    (a with_grad is not, through its derivatives)."""
    linear = set()
    for node in order:
        args = node.args[:1] + node.args[1::2] if node.op == WITH_GRAD else node.args
        if node.op == TANGENT or any(a in linear for a in args):
            linear.add(node)
    return linear


def _with_grad(node, vals, linear):
    """with_grad(y, x1, d1, ...): y, whose JVP is the sum of each d_i evaluated
    at tangent() = the tangent of x_i, as JAX runs a custom_jvp rule. (Not d_i
    at 1 times that tangent: where the rule selects, a zero partial must not
    meet an infinite cotangent as 0 * inf = nan; where it multiplies, it must.)"""
    xs, lins = node.args[1::2], node.args[2::2]
    # A derivative with no tangent in it contributes nothing (JAX transposes
    # only what is linear in the tangent).
    lins = [lin if lin in linear else None for lin in lins]
    read = sorted({a for lin in lins if lin is not None
                   for n in ir.toposort(lin, stop=lambda n: n not in linear) if n in linear
                   for a in n.args if a not in linear}, key=_order_key(lins))
    value, x_vals, read_vals = vals[node.args[0]], [vals[x] for x in xs], [vals[a] for a in read]
    shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in (value, *x_vals, *read_vals)))

    @jax.custom_jvp
    def with_grad(value, x_vals, read_vals):
        return jnp.broadcast_to(value, shape)

    @with_grad.defjvp
    def with_grad_jvp(primals, tangents):
        value, _, read_vals = primals
        _, dxs, _ = tangents
        known = dict(zip(read, read_vals))
        out = jnp.zeros(shape, jnp.float32)
        for lin, dx in zip(lins, dxs):
            if lin is not None:
                out = out + _at_tangent(lin, known, dx)
        return jnp.broadcast_to(value, shape), out

    return with_grad(value, x_vals, read_vals)


def _order_key(lins):
    """Sort key putting nodes in a deterministic order (first seen in ``lins``)."""
    rank = {n: i for i, n in enumerate(ir.toposort(*[lin for lin in lins if lin is not None]))}
    return rank.__getitem__


def _at_tangent(lin, known, t):
    """``lin`` with tangent() = ``t``; ``known`` holds the values it reads."""
    env = dict(known)
    for node in ir.toposort(lin, stop=lambda n: n in known):
        if node in env:
            continue
        env[node] = t if node.op == TANGENT else OPS[node.op].evaluate(
            [env[a] for a in node.args], node.attr)
    return env[lin]
