"""What the cuDNN lowering does with each op of the op table: one entry per op.

An entry says how the op reaches a cuDNN graph: ``emit`` (the frontend node
it becomes), ``rewrite`` (``rules.canonical`` spells it with other ops first),
``tensor`` (it becomes an input tensor of the graph), and ``refusal`` (why it
is refused, always or in the cases ``rules.refusal`` names). Every op of
``scoremod.dsl.ops.OPS`` has an entry (a test checks it), so a new op is
lowered, rewritten or refused with a reason, never silently missing.

    >>> from scoremod.lowering.cudnn.table import TABLE
    >>> TABLE["tanh"].emit.node, TABLE["log1p"].rewrite, TABLE["sign"].refusal
    ('tanh', 'log(x + 1)', 'sign has no cuDNN node')
"""

from __future__ import annotations

import dataclasses
from typing import Callable

# Op kinds the lowering treats apart from the table's pointwise ops: leaves,
# and the two that become input tensors of the graph.
CONST, VAR, OPERAND = "const", "var", "operand"
LOAD = "load"  # an operand read at index expressions
MATERIALIZE = "materialize"  # a value XLA computes over the index grid ahead of the kernel
INPUT_TENSORS = (LOAD, MATERIALIZE)  # read by the graph as tensors: their indices are not emitted
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")
WITH_GRAD = "with_grad"  # a value with its own derivative rule: the forward emits the value only


@dataclasses.dataclass(frozen=True)
class Entry:
    emit: Callable | None = None  # (graph, input tensors) -> tensor; .node names the cuDNN node
    rewrite: str | None = None  # how canonical() spells it before emission
    tensor: str | None = None  # how it becomes an input tensor
    refusal: str | None = None  # why it is refused (see rules.refusal for when)


def _cudnn():
    import cudnn

    return cudnn


def _node(name, emit):
    emit.node = name  # the cuDNN frontend node this op becomes (for `scoremod show`)
    return Entry(emit=emit)


def _pointwise(name):
    return _node(name, lambda g, a: getattr(g, name)(input=a[0]))


def _binary(name):
    return _node(name, lambda g, a: getattr(g, name)(a=a[0], b=a[1]))


def _cmp(name):
    def emit(g, a):
        return getattr(g, name)(input=a[0], comparison=a[1],
                                compute_data_type=_cudnn().data_type.BOOLEAN)

    return _node(name, emit)


_INTEGER_DIVISION = "integer division rounding toward zero has no cuDNN node"

TABLE = {
    "add": _binary("add"),
    "offset": _binary("add"),
    "sub": _binary("sub"),
    "mul": _binary("mul"),
    "div": _binary("div"),
    "neg": _pointwise("neg"),
    "abs": _pointwise("abs"),
    "exp": _pointwise("exp"),
    "log": _pointwise("log"),
    "tanh": _pointwise("tanh"),
    "sigmoid": _pointwise("sigmoid"),
    "sqrt": _pointwise("sqrt"),
    "rsqrt": _pointwise("rsqrt"),
    "reciprocal": _pointwise("reciprocal"),
    "sin": _pointwise("sin"),
    "cos": _pointwise("cos"),
    "erf": _pointwise("erf"),
    "floor": _pointwise("floor"),
    "ceil": _pointwise("ceil"),
    "relu": _pointwise("relu"),
    "pow": _node("pow", lambda g, a: g.pow(input0=a[0], input1=a[1])),
    "max": _node("max", lambda g, a: g.max(input0=a[0], input1=a[1])),
    "min": _node("min", lambda g, a: g.min(input0=a[0], input1=a[1])),
    "relu_grad": _node("relu_backward", lambda g, a: g.relu_backward(loss=a[0], input=a[1])),
    "lt": _cmp("cmp_lt"),
    "le": _cmp("cmp_le"),
    "gt": _cmp("cmp_gt"),
    "ge": _cmp("cmp_ge"),
    "eq": _cmp("cmp_eq"),
    "ne": _cmp("cmp_neq"),
    "and": _binary("logical_and"),
    "or": _binary("logical_or"),
    "not": _pointwise("logical_not"),
    "where": _node("binary_select",
                   lambda g, a: g.binary_select(input0=a[1], input1=a[2], mask=a[0])),
    "f32": _pointwise("identity"),
    "i32": dataclasses.replace(
        _pointwise("identity"),
        refusal="converting a float to an integer has no exact cuDNN node"),
    "integer_pow": Entry(rewrite="a chain of multiplications (its reciprocal when negative)"),
    "log1p": Entry(rewrite="log(x + 1)"),
    "expm1": Entry(rewrite="exp(x) - 1"),
    "exp2": Entry(rewrite="exp(x * log(2))"),
    "floordiv": Entry(rewrite="ints: i32(floor(f32(a) / f32(b))), exact below 2**24",
                      refusal="floordiv of floats has no cuDNN node"),
    "mod": Entry(rewrite="ints: a - (a // b) * b", refusal="mod of floats has no cuDNN node"),
    "trunc_div": Entry(rewrite="non-negative ints: floordiv", refusal=_INTEGER_DIVISION),
    "rem": Entry(rewrite="non-negative ints: mod", refusal="lax.rem has no cuDNN node"),
    "sign": Entry(refusal="sign has no cuDNN node"),
    "bool": Entry(refusal="converting to bool has no cuDNN node; compare instead (x != 0)"),
    WITH_GRAD: Entry(rewrite="its value in the forward graph; its partials, with tangent() "
                             "replaced by the incoming gradient, in the backward graph"),
    "tangent": Entry(rewrite="only inside with_grad's partials, which the backward expands"),
    LOAD: Entry(tensor="an input tensor: the operand read directly when indexed by b, h, q_idx, "
                       "kv_idx or constants, else computed over the index grid by XLA"),
}


def entry(op: str) -> Entry:
    """The table's entry for ``op`` (KeyError names an op the lowering does not know)."""
    return TABLE[op]
