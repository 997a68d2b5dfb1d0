"""What the cuDNN lowering does with each op of the op table: one entry per op.

An entry says how the op reaches a cuDNN graph: ``emit`` (the frontend node
it becomes), ``rewrite`` (``rules.canonical`` spells it with other ops first:
with the entry's ``spell`` where that is all it takes, else in
``rules._rewrite``), ``tensor`` (it becomes an input tensor of the graph), and
``refusal`` (why it is refused: whenever ``refused_if`` holds, or always).
Every op of ``scoremod.dsl.ops.OPS`` has an entry (a test checks it), so a new
op is lowered, rewritten or refused with a reason, never silently missing.

    >>> from scoremod.lowering.cudnn.table import TABLE
    >>> TABLE["tanh"].emit.node, TABLE["log1p"].rewrite, TABLE["sign"].refusal
    ('tanh', 'log(x + 1)', 'sign has no cuDNN node')
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from scoremod.dsl.ir import F32, I32, LOAD, MATERIALIZE, Node
from scoremod.dsl.ops import WITH_GRAD, apply
from scoremod.dsl.rewrite import int_range

# Read by the graph as tensors (a LOAD, or a MATERIALIZE computed by XLA over
# the index grid ahead of the kernel): their index expressions are not emitted.
INPUT_TENSORS = (LOAD, MATERIALIZE)


@dataclasses.dataclass(frozen=True)
class Entry:
    emit: Callable | None = None  # (graph, input tensors) -> tensor; .node names the cuDNN node
    rewrite: str | None = None  # how canonical() spells it before emission
    spell: Callable | None = None  # (*canonical args) -> Node: that rewrite, where it is all
    tensor: str | None = None  # how it becomes an input tensor
    refusal: str | None = None  # why it is refused
    refused_if: Callable | None = None  # (node) -> bool: when; None: always


def nonneg_int_pair(node: Node) -> bool:
    """A non-negative dividend over a positive divisor: where lax.div and lax.rem
    equal // and % (a zero divisor has XLA's own results)."""
    a, b = node.args
    return node.dtype == I32 and int_range(a)[0] >= 0 and int_range(b)[0] > 0


def _of_float(node: Node) -> bool:
    return node.args[0].dtype == F32


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


# cuDNN's pointwise modes (cudnn-frontend's PointwiseMode_t) have logical
# and/or/not on booleans and no bitwise or shift operation on integers.
_NO_BITWISE = ("cuDNN's pointwise modes have no bitwise or shift operation on integers "
               "(only logical and/or/not on booleans)")
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
    "tan": _pointwise("tan"),
    "atan": Entry(refusal="atan has no cuDNN node (its pointwise modes have tan, no arctangent)"),
    "erf": _pointwise("erf"),
    # cuDNN has ERF and no ERFC: 1 - erf(x) is within 2**-24 of erfc(x) (absolute; the
    # relative error grows where erfc(x) is tiny, x > 3), as float32 holds 1 - erf.
    "erfc": Entry(rewrite="1 - erf(x), absolute error below 1e-7",
                  spell=lambda x: -apply("erf", x) + 1.0),
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
        # i32(floor(x)) converts an integral value, exactly (the floordiv rewrite emits it)
        _pointwise("identity"),
        refused_if=lambda n: _of_float(n) and n.args[0].op not in ("floor", "ceil"),
        refusal="converting a float to an integer has no exact cuDNN node"),
    "integer_pow": Entry(rewrite="a chain of multiplications (its reciprocal when negative)"),
    "log1p": Entry(rewrite="log(x + 1)", spell=lambda x: apply("log", x + 1.0)),
    "expm1": Entry(rewrite="exp(x) - 1", spell=lambda x: apply("exp", x) - 1.0),
    "log2": Entry(rewrite="log(x) * (1 / ln(2))",
                  spell=lambda x: apply("log", x) * (1.0 / math.log(2.0))),
    "exp2": Entry(rewrite="exp(x * log(2))", spell=lambda x: apply("exp", x * math.log(2.0))),
    "floordiv": Entry(rewrite=("ints: i32(floor((f32(a) + 0.5 sign(b)) / f32(b))), exact for "
                               "|a| < 2**21"),
                      refusal="floordiv of floats has no cuDNN node",
                      refused_if=lambda n: n.dtype == F32),
    "mod": Entry(rewrite="ints: a - (a // b) * b", refusal="mod of floats has no cuDNN node",
                 refused_if=lambda n: n.dtype == F32),
    "trunc_div": Entry(rewrite="non-negative ints: floordiv", refusal=_INTEGER_DIVISION,
                       refused_if=lambda n: not nonneg_int_pair(n)),
    "rem": Entry(rewrite="non-negative ints: mod", refusal="lax.rem has no cuDNN node",
                 refused_if=lambda n: not nonneg_int_pair(n)),
    "sign": Entry(refusal="sign has no cuDNN node"),
    **{op: Entry(refusal=_NO_BITWISE) for op in (
        "bitwise_and", "bitwise_or", "bitwise_xor", "invert", "left_shift", "right_shift",
        "shift_right_logical")},
    "bool": Entry(refusal="converting to bool has no cuDNN node; compare instead (x != 0)",
                  refused_if=_of_float),
    WITH_GRAD: Entry(rewrite="its value in the forward graph; its partials, with tangent() "
                             "replaced by the incoming gradient, in the backward graph"),
    "tangent": Entry(rewrite="only inside with_grad's partials, which the backward expands"),
    LOAD: Entry(tensor="an input tensor: the operand read directly when indexed by b, h, q_idx, "
                       "kv_idx or constants, else computed over the index grid by XLA"),
}


def entry(op: str) -> Entry:
    """The table's entry for ``op`` (KeyError names an op the lowering does not know)."""
    return TABLE[op]
