"""Simplifications applied whenever a node is built: a pattern table.

Each pattern is a function ``(args, attr) -> Node | None`` registered for one
op; ``simplify`` is called by the op table's constructor (``ops.apply``) and
patterns build nodes through it (``ir.build``). They keep traced mods small (JAX's negative-index wrapping of ``x[h]``
folds away because indices are never negative) and keep derivatives readable
(``g * 1`` is ``g``). Every rewrite is exact in float32 arithmetic (``x + 0.0``
stays: it turns -0.0 into 0.0), and holds for every int32
value under XLA's semantics (wrap-around, ``x // 0``): facts about integers
come from ``int_range``, which assumes nothing but that indices are >= 0.
"""

from __future__ import annotations

import math
import weakref

import jax
import numpy as np

from scoremod.dsl import ir
from scoremod.dsl.grad import vjp
from scoremod.dsl.ir import (BOOL, CONST, F32, I32, LOAD, TANGENT, VAR, WITH_GRAD, Node, build, const,
                             is_const)

PATTERNS: dict[str, list] = {}


def pattern(*ops):
    def register(fn):
        for op in ops:
            PATTERNS.setdefault(op, []).append(fn)
        return fn

    return register


COMMUTATIVE = ("add", "mul", "max", "min", "eq", "ne", "and", "or")


def simplify(op, args, attr, dtype):
    """A simpler node for ``op`` (an op-table entry) applied to ``args``, or None."""
    name = op.name
    if name != LOAD and args and all(a.op == CONST for a in args):
        return _fold(op, args, attr, dtype)
    if name in COMMUTATIVE and args[0].op == CONST and args[1].op != CONST:
        # One spelling per value (30 * x is x * 30), and cuDNN wants scalars second.
        return build(name, args[1], args[0], attr=attr)
    for fn in PATTERNS.get(name, ()):
        out = fn(args, attr)
        if out is not None:
            return out
    return None


def _fold(op, args, attr, dtype):
    np_types = {F32: np.float32, I32: np.int32, BOOL: np.bool_}
    with jax.ensure_compile_time_eval(), np.errstate(all="ignore"):
        vals = [np.asarray(a.attr, np_types[a.dtype]) for a in args]
        out = np.asarray(op.evaluate(vals, attr))
    return const(out.item(), dtype)


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_FULL = (INT32_MIN, INT32_MAX)
_LOAD_RANGE = {"int8": (-128, 127), "uint8": (0, 255), "int16": (-(2**15), 2**15 - 1),
               "uint16": (0, 2**16 - 1)}
_RANGES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _fit(lo, hi):
    """(lo, hi) when no int32 value in between wraps, else every int32."""
    return (lo, hi) if INT32_MIN <= lo and hi <= INT32_MAX else _FULL


def _range_of(node: Node, r) -> tuple:
    op, args = node.op, node.args
    if op == VAR:  # sizes fit int32, so indices are in [0, INT32_MAX]
        return (0, INT32_MAX)
    if op == CONST:
        return (int(node.attr), int(node.attr))
    if op == LOAD:
        return _LOAD_RANGE.get(args[0].attr[2], _FULL)
    if op in ("i32",) and args[0].dtype == BOOL:
        return (0, 1)
    if op in ("i32",) or not args or any(a.dtype != I32 for a in args if op != "where"):
        return _FULL
    if op == "where":
        (alo, ahi), (blo, bhi) = r(args[1]), r(args[2])
        return (min(alo, blo), max(ahi, bhi))
    rs = [r(a) for a in args]
    if op in ("add", "offset"):
        return _fit(rs[0][0] + rs[1][0], rs[0][1] + rs[1][1])
    if op == "sub":
        return _fit(rs[0][0] - rs[1][1], rs[0][1] - rs[1][0])
    if op == "mul":
        corners = [x * y for x in rs[0] for y in rs[1]]
        return _fit(min(corners), max(corners))
    if op == "neg":
        return _fit(-rs[0][1], -rs[0][0])
    if op == "abs":
        lo, hi = rs[0]
        if lo == INT32_MIN:  # abs(INT32_MIN) wraps to INT32_MIN
            return _FULL
        return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
    if op in ("max", "min"):
        f = max if op == "max" else min
        return (f(rs[0][0], rs[1][0]), f(rs[0][1], rs[1][1]))
    if op == "sign":
        return (-1 if rs[0][0] < 0 else (0 if rs[0][0] == 0 else 1),
                1 if rs[0][1] > 0 else (0 if rs[0][1] == 0 else -1))
    if op in ("bitwise_and",) and (rs[0][0] >= 0 or rs[1][0] >= 0):
        # and with a non-negative value clears the sign bit: within [0, that value]
        return (0, min(hi for lo, hi in rs if lo >= 0))
    if op in ("bitwise_or", "bitwise_xor") and rs[0][0] >= 0 and rs[1][0] >= 0:
        top = max(rs[0][1], rs[1][1])
        return (0, (1 << top.bit_length()) - 1)  # no bit above the larger one's top bit
    if op == "invert":
        return (-rs[0][1] - 1, -rs[0][0] - 1)
    if op in ("right_shift", "shift_right_logical") and rs[0][0] >= 0:
        return (0, rs[0][1])  # a non-negative value shifted right stays in [0, itself]
    # Division and remainder: XLA defines x / 0 (as -1) and x % 0 (as x), and
    # INT32_MIN / -1; only a non-negative dividend over a positive divisor is
    # bounded here.
    (alo, ahi), (blo, bhi) = rs if len(rs) == 2 else (rs[0], (0, 0))
    if op in ("floordiv", "trunc_div") and alo >= 0 and blo > 0:
        return (alo // bhi, ahi // blo)
    if op in ("mod", "rem") and alo >= 0 and blo > 0:
        return (0, min(ahi, bhi - 1))
    if op == "mod" and blo > 0:
        return (0, bhi - 1)
    if op == "integer_pow" and node.attr >= 0 and alo >= 0:
        return _fit(alo**node.attr, ahi**node.attr)
    return _FULL


def int_range(node: Node) -> tuple:
    """(lo, hi) bounding an int32 node's value for every value of its inputs,
    computed with int32 wrap-around and XLA's division by zero: index variables
    are in [0, 2**31 - 1], nothing else about them is assumed."""
    if node.dtype != I32:
        return _FULL
    cached = _RANGES.get(node)
    if cached is not None:
        return cached
    for n in ir.toposort(node, stop=lambda m: m in _RANGES):
        if n not in _RANGES and n.dtype == I32:
            _RANGES[n] = _range_of(n, lambda a: _RANGES.get(a, _FULL))
    return _RANGES[node]


def nonneg(node: Node) -> bool:
    """True when an int node is >= 0 for every value of its inputs."""
    return node.dtype == I32 and int_range(node)[0] >= 0


def _additive_identity(c):
    # x + -0.0 is x for every float x; x + 0.0 turns -0.0 into 0.0.
    if c.op != CONST:
        return False
    if c.dtype == F32:
        return c.attr == 0.0 and math.copysign(1.0, c.attr) < 0
    return c.attr == 0


@pattern("add")
def _add_zero(args, attr):
    a, b = args
    if _additive_identity(b):
        return a
    if _additive_identity(a):
        return b
    return None


@pattern("sub")
def _sub_const(args, attr):
    a, b = args
    if is_const(b, 0) and (b.dtype != F32 or math.copysign(1.0, b.attr) > 0):
        return a  # x - 0.0 is x, also for x = -0.0
    if b.op == CONST and b.dtype == F32 and math.copysign(1.0, b.attr) < 0:  # x - -c is x + c
        return build("add", a, const(-b.attr, F32))
    return None


@pattern("mul")
def _mul_one(args, attr):
    a, b = args
    if is_const(b, 1) or is_const(b, 1.0):
        return a
    if is_const(a, 1) or is_const(a, 1.0):
        return b
    return None


@pattern("div")
def _div_one(args, attr):
    return args[0] if is_const(args[1], 1.0) else None


def _double_negation(op):
    def rule(args, attr):
        (a,) = args
        return a.args[0] if a.op == op else None

    return rule


PATTERNS["neg"] = [_double_negation("neg")]
PATTERNS["not"] = [_double_negation("not")]


def _decided_by_range(op):
    # JAX wraps negative indices: where(i < 0, i + n, i). An index is never
    # negative, so such tests fold, whenever the value range decides them.
    decide = {  # (always true, always false) for values in [lo, hi]
        "lt": lambda lo, hi, c: (hi < c, lo >= c),
        "ge": lambda lo, hi, c: (lo >= c, hi < c),
        "le": lambda lo, hi, c: (hi <= c, lo > c),
        "gt": lambda lo, hi, c: (lo > c, hi <= c),
    }[op]

    def rule(args, attr):
        a, b = args
        if a.dtype != I32 or b.op != CONST:
            return None
        true, false = decide(*int_range(a), b.attr)
        return const(True, BOOL) if true else (const(False, BOOL) if false else None)

    return rule


for _cmp in ("lt", "ge", "le", "gt"):
    PATTERNS[_cmp] = [_decided_by_range(_cmp)]


@pattern("where")
def _where_known(args, attr):
    c, a, b = args
    if c.op == CONST:
        return a if c.attr else b
    if a is b:
        return a
    return None


@pattern("where")
def _where_of_bools(args, attr):
    # A choice between booleans is logic: where(c, False, True) is not c. One
    # spelling per value, and no bool constant is left for a lowering to read
    # as a tensor (cuDNN selects between tensors, and has no bool constant).
    c, a, b = args
    if a.dtype != BOOL or (a.op != CONST and b.op != CONST):
        return None
    if a.op == CONST and b.op == CONST:  # where(c, True, False) and its negation
        return c if a.attr else build("not", c)
    if a.op == CONST:  # where(c, True, x) = c or x; where(c, False, x) = not c and x
        return build("or", c, b) if a.attr else build("and", build("not", c), b)
    # where(c, x, True) = not c or x; where(c, x, False) = c and x
    return build("or", build("not", c), a) if b.attr else build("and", c, a)


@pattern("where")
def _floor_divide(args, attr):
    # jnp.floor_divide on ints traces to this correction of lax.div; name it.
    c, t, f = args
    if f.op != "trunc_div" or t.op != "sub" or f.dtype != I32:
        return None
    a, b = f.args
    want = build("and", build("ne", build("sign", a), build("sign", b)),
                 build("ne", build("rem", a, b), const(0, I32)))
    if c is want and t is build("sub", f, const(1, I32)):
        return build("floordiv", a, b)
    return None


@pattern("where")
def _remainder(args, attr):
    # jnp.remainder on ints traces to this correction of lax.rem; name it.
    c, t, f = args
    if f.op != "rem" or t.op != "add" or f.dtype != I32:
        return None
    a, b = f.args
    zero = const(0, I32)
    want = build("and", build("ne", build("lt", f, zero), build("lt", b, zero)),
                 build("ne", f, zero))
    if c is want and t is build("add", f, b):
        return build("mod", a, b)
    return None


def _nested_remainder(op):
    # x % a % b is x % b when b divides a (a, b > 0): both are congruent to x
    # modulo b and lie in the same range: [0, b) for the floor remainder (mod;
    # also what rem gives of mod's nonnegative result), of x's sign when both
    # are truncated (rem). Folded vmaps write the batch index this way
    # (b % 6 % 2), and cuDNN then needs no nested division.
    def rule(args, attr):
        x, b = args
        if x.op not in ("mod", "rem") or b.op != CONST or x.args[1].op != CONST:
            return None
        a = x.args[1]
        if a.dtype != I32 or b.dtype != I32 or a.attr <= 0 or b.attr <= 0 or a.attr % b.attr:
            return None
        return build("rem" if op == x.op == "rem" else "mod", x.args[0], b)

    return rule


pattern("mod")(_nested_remainder("mod"))
pattern("rem")(_nested_remainder("rem"))


def _bool_const_compare(negate_on_true):
    def rule(args, attr):
        a, b = args
        if a.dtype != BOOL or b.op != CONST:
            return None
        return a if b.attr != negate_on_true else build("not", a)

    return rule


PATTERNS["ne"] = [_bool_const_compare(True)]  # x != False is x; x != True is not x
PATTERNS["eq"] = [_bool_const_compare(False)]  # x == True is x; x == False is not x


@pattern(WITH_GRAD)
def _with_grad_known(args, attr):
    """with_grad with the derivative the IR computes anyway is its value, and
    jax.nn.relu's rule (derivative 0 at 0) is the relu op."""
    value, pairs = args[0], list(zip(args[1::2], args[2::2]))
    zero, t = const(0.0, F32), build(TANGENT)
    if len(pairs) == 1:
        (x, lin), = pairs
        if value is build("max", x, zero) and lin is build("where", build("gt", x, zero), t, zero):
            return build("relu", x)
    if all(vjp(value, t, wrt=x) is vjp(lin, t, wrt=t) for x, lin in pairs):
        return value
    return None


@pattern("and")
def _and_const(args, attr):
    a, b = args
    for x, y in ((a, b), (b, a)):
        if x.op == CONST:
            return y if x.attr else x
    return a if a is b else None


@pattern("or")
def _or_const(args, attr):
    a, b = args
    for x, y in ((a, b), (b, a)):
        if x.op == CONST:
            return x if x.attr else y
    return a if a is b else None


def _cast_to(dtype):
    def rule(args, attr):
        (a,) = args
        return a if a.dtype == dtype else None

    return rule


def _cast_of_bool_cast(args, attr):
    # f32(i32(m)) of a bool m is f32(m): both are 0 or 1 (m.astype(int) * 1.0).
    (a,) = args
    if a.op == "i32" and a.args[0].dtype == BOOL:
        return build("f32", a.args[0])
    return None


PATTERNS["f32"] = [_cast_to(F32), _cast_of_bool_cast]
PATTERNS["i32"] = [_cast_to(I32)]
PATTERNS["bool"] = [_cast_to(BOOL)]


@pattern(LOAD)
def _drop_redundant_clamp(args, attr):
    # A load clamps its indices, so clamping them first is a no-op. (The
    # reference evaluator clamps explicitly; tracing a call of one mod inside
    # another must give the same IR back.)
    array, idx = args[0], args[1:]
    new = list(idx)
    for i, (x, n) in enumerate(zip(idx, array.attr[1])):
        inner = _clamp_arg(x, n)
        if inner is not None:
            new[i] = inner
    return build(LOAD, array, *new) if new != list(idx) else None


def _clamp_arg(x, n):
    """y when x is min(max(y, 0), n - 1) or max(min(y, n - 1), 0), else None."""
    lo, hi = const(0, I32), const(n - 1, I32)
    if x.op == "min" and x.args[1] is hi and x.args[0].op == "max" and x.args[0].args[1] is lo:
        return x.args[0].args[0]
    if x.op == "max" and x.args[1] is lo and x.args[0].op == "min" and x.args[0].args[1] is hi:
        return x.args[0].args[0]
    return None



# --- nested integer division ----------------------------------------------------
# A division of a quotient or of a remainder by positive constants is one
# division of the original value (pixel decoding: a tile's row is
# (q // 64) // 4, a row inside the tile (q % 64) // 8). For every integer x
# and positive a, b, n, m: (x // a) // b == x // (a * b); when a divides m,
# (x % m) // a == (x // a) % (m // a) (and (x % m) % n == x % n when n
# divides m: _nested_remainder).
# Each holds for every int32 x under XLA's semantics (nothing wraps: a * b is
# checked to fit). lax.rem is the floor remainder where the dividend is never
# negative. What stays nested is a remainder of a quotient, (x // a) % b,
# which a backend can compute from divisions of x alone:
# x // a - (x // (a * b)) * b.


def _positive_const(node):
    return node.op == CONST and node.dtype == I32 and node.attr > 0


def floor_division(node: Node):
    """``(x, a)`` when ``node`` is ``x // a`` in floor semantics by a positive
    constant (floordiv, or lax.div of a non-negative x), else None."""
    return _floor_like(node.op, node.args) if node.dtype == I32 and node.op in (
        "floordiv", "trunc_div") else None


def floor_remainder(node: Node):
    """``(x, m)`` when ``node`` is ``x % m`` in floor semantics by a positive
    constant (mod, or lax.rem of a non-negative x), else None."""
    return _floor_like(node.op, node.args) if node.dtype == I32 and node.op in (
        "mod", "rem") else None


def _floor_like(op, args):
    x, c = args
    if x.dtype != I32 or not _positive_const(c):
        return None
    if op in ("trunc_div", "rem") and not nonneg(x):
        return None
    return x, c


def _divide_nested(outer_op):
    def rule(args, attr):
        outer = _floor_like(outer_op, args)
        if outer is None:
            return None
        y, b = outer
        inner = floor_division(y)
        if inner is not None:  # (x // a) // b == x // (a * b)
            (x, a) = inner
            if a.attr * b.attr > INT32_MAX:
                return None
            return build(y.op, x, const(a.attr * b.attr, I32))
        inner = floor_remainder(y)
        if inner is not None and inner[1].attr % b.attr == 0:  # (x % m) // a
            (x, m) = inner
            if m.attr == b.attr:
                return const(0, I32)
            return build(y.op, build("floordiv", x, b), const(m.attr // b.attr, I32))
        return None

    return rule


# lax.div is left alone: jnp.floor_divide traces to it and a correction that
# ``_floor_divide`` names floordiv (whose rule then applies) only while the
# lax.div node is the one it built.
PATTERNS.setdefault("floordiv", []).append(_divide_nested("floordiv"))
# (x % m) % n == x % n: _nested_remainder above (either remainder, any sign).
