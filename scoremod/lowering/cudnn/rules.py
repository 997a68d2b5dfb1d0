"""IR-level preparation of a mod for cuDNN: support check and canonical forms.

Everything here is plain IR work, testable without a GPU. The measured cuDNN
rules it enforces (see docs/limitations.md):

1. a pass-by-value scalar is never the first operand of a binary node:
   ``c - x`` becomes ``-x + c``, ``c / x`` becomes ``reciprocal(x) * c``,
   ``c < x`` becomes ``x > c``, ``where(m, c, x)`` becomes ``where(not m, x, c)``;
2. comparisons only on integer values (positions), never on floats: a mod
   that compares the score is refused with its source line; piecewise ops of
   the score (max, min, abs, relu) have derivative rules through relu_grad;
3. the forward score_mod emits exactly the primal expression; every
   derivative factor is computed in the backward callback;
4. every node reads at least one tensor the graph computes (the score, a
   position, or a node of those): a node of input tensors and scalars alone
   is computed ahead by XLA as one more input tensor.
"""

from __future__ import annotations

import functools
import math

from scoremod.dsl import ir
from scoremod.dsl.grad import vjp
from scoremod.dsl.ir import (BOOL, CONST, F32, I32, LOAD, MATERIALIZE, OPERAND, VAR, Node, const,
                             is_const)
from scoremod.dsl.ops import COMPARISONS, WITH_GRAD, apply
from scoremod.dsl.rewrite import INT32_MAX, floor_division, floor_remainder, int_range
from scoremod.dsl.text import format_expr
from scoremod.errors import ScoreModError, UnsupportedOpError
from scoremod.lowering.cudnn.table import INPUT_TENSORS, TABLE, nonneg_int_pair
from scoremod.lowering.patterns import FLIPPED, score_factor

SCORE = ir.var(ir.SCORE)
DP = ir.cotangent()

_COMPARISONS = COMPARISONS


def _may_divide_by_zero(node):
    lo, hi = int_range(node.args[1])
    return node.dtype == I32 and lo <= 0 <= hi


_INT_DIVISIONS = ("floordiv", "mod", "trunc_div", "rem")


def flat_remainder(node: Node):
    """``(x, a, b)`` when ``node`` is ``(x // a) % b`` by positive constants in
    floor semantics and ``a * b`` fits int32: the graph computes it from
    divisions of ``x`` alone, ``x // a - (x // (a * b)) * b`` (the IR's own
    rewrites leave a remainder of a quotient as the one nested form)."""
    outer = floor_remainder(node)
    inner = floor_division(outer[0]) if outer is not None else None
    if inner is None or inner[1].attr * outer[1].attr > INT32_MAX:
        return None
    return inner[0], inner[1], outer[1]


def _divides_a_quotient(node: Node) -> bool:
    """Whether an integer division's dividend, as the graph computes it, holds
    another integer division, or a float converted to int (i32(floor(x / c)),
    the same graph as a quotient)."""
    flat = flat_remainder(node)
    dividend = flat[0] if flat is not None else node.args[0]
    return any((n.op in _INT_DIVISIONS and n.dtype == I32)
               or (n.op == "i32" and n.args[0].dtype == F32)
               for n in ir.toposort(dividend, stop=lambda n: n.op in INPUT_TENSORS))


def refusal(node: Node) -> str | None:
    """Why the fused path cannot run ``node``, or None."""
    entry = TABLE.get(node.op)
    if entry is not None and entry.refusal and (entry.refused_if is None
                                                or entry.refused_if(node)):
        return entry.refusal
    if node.op in _INT_DIVISIONS and node.dtype == I32 and _divides_a_quotient(node):
        return ("it divides the result of another integer division, remainder or float-to-int "
                "conversion in a way no rewrite turns into divisions of one value; such nested "
                "index arithmetic gave wrong masks in cuDNN on the H200 (tiled NATTEN, block "
                "diffusion), so XLA computes the value ahead")
    if node.op in ("floordiv", "mod") and _may_divide_by_zero(node):
        return ("its divisor may be 0, where XLA defines the result and cuDNN's float "
                "division does not; divide by a positive constant or a value max(d, 1)")
    if node.op in _COMPARISONS and node.args[0].dtype == F32:
        a, b = node.args
        if a is b or (_int_cast(a) and _int_cast(b)):
            return None
        return (
            "it compares float values (such as the score); cuDNN compares only integer "
            "positions. Write masks on b, h, q_idx, kv_idx; for piecewise functions of the "
            "score use max, min, abs or relu"
        )
    return None


def _int_cast(node):
    return node.op == "f32" and node.args[0].dtype == I32


def check_supported(expr: Node, sources: dict) -> None:
    """Raise UnsupportedOpError naming the op and its source line if cuDNN can't run it."""
    score = ir.var(ir.SCORE)
    # An array's index expressions never reach cuDNN: XLA computes a computed
    # index ahead (materialize), so only an index that depends on the score,
    # which XLA cannot know in advance, is refused there. The forward runs
    # with_grad's value only (a with_grad's value may hold another: a custom_jvp
    # function calling softplus); its partials are checked in the backward.
    forward = values_only(expr)
    backward = _fold_nan_tests(vjp(expr, DP))
    nodes = ir.toposort(forward, backward, stop=lambda n: n.op == LOAD)
    ahead = computed_ahead(forward) | computed_ahead(backward)
    for node in nodes:
        why = refusal(node) if node not in ahead else None
        if node.op == LOAD and any(score in ir.depends_on(i, score) for i in node.args[1:]):
            why = ("it indexes an array with a value computed from the score; the fused path "
                   "reads arrays at positions known before the kernel runs")
        if why:
            where = ir.source_of(node, expr, sources)
            raise UnsupportedOpError(
                f"the fused cuDNN path cannot run `{node.op}` in `{format_expr(node)}`"
                f"{' at ' + where if where else ''}: {why}. Use implementation=\"xla\" for this "
                "mod, or implementation=None to pick it automatically."
            )
    try:  # what passes the checks must have canonical forms: refuse, never crash later
        forward_and_backward(expr)
    except UnsupportedOpError:
        raise
    except ScoreModError as e:
        raise UnsupportedOpError(
            f"the fused cuDNN path could not put `{format_expr(expr)}` into the form it "
            f"lowers ({e}); this is a scoremod bug, please report it. Use "
            "implementation=\"xla\" for this mod, or implementation=None to pick it "
            "automatically."
        ) from e


def values_only(expr: Node) -> Node:
    """``expr`` with each with_grad replaced by its value: what the forward graph
    computes (a with_grad's value may hold another: a custom_jvp function calling
    softplus)."""
    return ir.rebuild(expr, lambda node, args: args[0] if node.op == WITH_GRAD else None)


# --- canonical forms ---------------------------------------------------------


def _pow_chain(x, n):
    out = None
    base = x
    while n:
        if n & 1:
            out = base if out is None else out * base
        n >>= 1
        if n:
            base = base * base
    return out


def _one_minus_square_of(a: Node, b: Node) -> Node | None:
    """``t`` where ``a * b`` is ``(t + 1) * (-t + 1)`` (in either order), else None."""
    for x, y in ((a, b), (b, a)):
        if (x.op == "add" and is_const(x.args[1], 1.0) and y.op == "add"
                and is_const(y.args[1], 1.0) and y.args[0].op == "neg"
                and y.args[0].args[0] is x.args[0]):
            return x.args[0]
    return None


def _rewrite(node: Node, args: tuple) -> Node:
    """One node, arguments already canonical."""
    op = node.op
    if op == "mul" and node.dtype == F32:
        # tanh's derivative, JAX's (1 + t)(1 - t), as 1 - t*t: one cuDNN node
        # fewer in the backward (softcap + causal fwd+bwd at seq 4096 ran 6%
        # slower on the H200 with the longer form); the two differ by float32
        # rounding only where |t| is near 1.
        t = _one_minus_square_of(*args)
        if t is not None:
            return apply("add", apply("neg", apply("mul", t, t)), const(1.0, F32))
    if op == "sub" and args[0].op == CONST and args[1].op != CONST:
        return apply("add", apply("neg", args[1]), args[0])
    if op == "div" and args[0].op == CONST and args[1].op != CONST:
        r = apply("reciprocal", args[1])
        return r if is_const(args[0], 1.0) else r * args[0]
    if op in _COMPARISONS:
        a, b = args
        if a.dtype == F32 and a is b:  # x != x tests for NaN; scores are never NaN
            return const(op in ("eq", "le", "ge"), BOOL)
        if _int_cast(a) and _int_cast(b):  # exact below 2**24
            a, b = a.args[0], b.args[0]
        if a.op == CONST and b.op != CONST:
            return apply(FLIPPED[op], b, a)
        return apply(op, a, b)
    if op == "where":
        c, a, b = args
        if a.op == CONST and b.op != CONST:
            return apply("where", apply("not", c), b, a)
        if a.op == CONST and b.op == CONST:
            return apply("where", c, const_tensor(a), b)
        return apply("where", c, a, b)
    if op == "integer_pow":
        n = node.attr
        if n == 0:
            return const(1.0, F32) if node.dtype == F32 else const(1, I32)
        chain = _pow_chain(args[0], abs(n))
        return apply("reciprocal", chain) if n < 0 else chain
    spell = TABLE[op].spell if op in TABLE else None
    if spell is not None:
        return spell(*args)
    if op in ("trunc_div", "rem") and nonneg_int_pair(node):
        op = "floordiv" if op == "trunc_div" else "mod"
    if op == "floordiv":  # ints only (refused for floats)
        # cuDNN divides as a * rcp(b): the quotient of an exact multiple can
        # round just below the integer (on the H200, q // 41 gave 0 at q = 41,
        # (q - k) % 7 gave 7 for 0; benchmarks/probes/int_division.py). Shifted
        # by half a step, (a + 0.5 sign(b)) / b lies at least 0.5 / |b| from every
        # integer, which that rounding (relative, a few ulps) cannot cross while
        # |a| < 2**21: the floor is then exact. The divisor never spans 0 here.
        a, b = (apply("f32", x) for x in args)
        half = 0.5 if int_range(node.args[1])[0] > 0 else -0.5
        return apply("i32", apply("floor", (a + half) / b))
    if op == "mod":
        a, b = args
        return a - _rewrite(Node("floordiv", (a, b), None, I32), (a, b)) * b
    if op == "f32" and args[0].dtype == BOOL:
        return apply("where", args[0], const_tensor(const(1.0, F32)), const(0.0, F32))
    if op == LOAD and node.dtype == BOOL:  # bool arrays travel as int32
        as_int = Node(LOAD, args, None, I32)
        return apply("ne", as_int, const(0, I32))
    return apply(op, *args, attr=node.attr) if op != LOAD else Node(op, args, node.attr, node.dtype)


def const_tensor(c: Node) -> Node:
    """A constant as a tensor: score * 0 + c for a float (the score is finite),
    q_idx * 0 + c for an int, and a comparison of q_idx * 0 with 0 for a bool
    (cuDNN selects between tensors; a pass-by-value scalar has no bool type)."""
    if c.dtype == F32:
        return Node("mul", (SCORE, const(0.0, F32)), None, F32) + c
    zero = Node("mul", (ir.var("q_idx"), const(0, I32)), None, I32)
    if c.dtype == I32:
        return zero if c.attr == 0 else Node("add", (zero, c), None, I32)
    return Node("eq" if c.attr else "ne", (zero, const(0, I32)), None, BOOL)


# --- masks that read arrays ----------------------------------------------------
# cuDNN refuses comparisons on values read from input tensors (measured on the
# H200: doc[b, q_idx] == doc[b, kv_idx] finds no engine, directly, through a
# cast, or as float arithmetic). Such a condition is evaluated by XLA instead,
# into one tensor of the dims it depends on (a document mask becomes a
# [B, 1, Sq, Skv] bias); score_mod then reads that tensor.
#   where(m, x, -inf) = x + materialize(where(m, 0, -inf))
#   where(m, x, y)    = x * i + y * j,  i = materialize(where(m, 1, 0)), j for not m
#
# Rule 4: every node of the graph reads at least one tensor the graph computes
# (the score, a position, or a node of those). On the H200 cuDNN found no
# engine for graphs with a node of inputs alone: rel[q - kv + c] * ratio[h]
# (two arrays read), bias + 0.0 and bias * 0.01 (an array read and a scalar),
# while bias + score and slopes[h] * f32(kv - q) run. Such a node is computed
# ahead by XLA: its value is one more input tensor (rel * ratio one
# [1, H, Sq, Skv] bias added to the score).


def materialize(expr: Node) -> Node:
    """``expr`` computed by XLA over the index grid and read as an input tensor."""
    return Node(MATERIALIZE, (expr,), None, expr.dtype)


def computed_ahead(root) -> set:
    """The values of ``root`` that XLA can compute before the kernel and cuDNN
    would have to read as tensors: those that depend on neither the score nor
    dP (nor a derivative's tangent) and read an array, or use an op the
    table refuses (integer bit operations, lax.rem of signed values, float
    comparisons of positions), or use such a value. cuDNN refuses comparisons
    on values read from tensors, so these reach the graph only inside a
    ``materialize``; an op cuDNN lacks then never needs to run in it."""
    live, ahead = set(), set()
    for node in ir.toposort(root, stop=lambda n: n.op in INPUT_TENSORS):
        if (node.op == VAR and node.attr in (ir.SCORE, ir.COTANGENT)) or node.op == "tangent" \
                or any(a in live for a in node.args):
            live.add(node)
        elif node.op in INPUT_TENSORS or any(a in ahead for a in node.args) \
                or refusal(node) is not None:
            ahead.add(node)
    return ahead


# A float value computed from more array reads than this is one materialized
# tensor rather than that many input tensors of the graph (a low-rank bias
# written as a sum of products, when it is not folded into the head dim).
MAX_GRAPH_READS = 8


def _reads(node, memo):
    if node not in memo:
        memo[node] = (frozenset((node,)) if node.op == LOAD
                      else frozenset().union(*(_reads(a, memo) for a in node.args)))
    return memo[node]


def _fold_nan_tests(root: Node) -> Node:
    """x != x (how jax.nn.softplus tests for NaN) is False, and x == inf (how
    its derivative rule tests for inf) is False: the fused path assumes the
    score and the values computed from it are finite."""
    tests = {}
    for n in ir.toposort(root):
        if n.op not in _COMPARISONS or n.args[0].dtype != F32:
            continue
        a, b = n.args
        if a is b:
            tests[n] = const(n.op in ("eq", "le", "ge"), BOOL)
        elif n.op in ("eq", "ne") and a.op != CONST and is_const(b) and math.isinf(b.attr):
            tests[n] = const(n.op == "ne", BOOL)
    return ir.substitute(root, tests) if tests else root


def _lift_data_masks(root: Node) -> Node:
    root = _fold_nan_tests(root)
    data = computed_ahead(root)
    zero, ninf = const(0.0, F32), const(float("-inf"), F32)
    reads = {}

    def lift(node, args):
        if node.op in (VAR, CONST, OPERAND) + INPUT_TENSORS:
            return node
        if node in data and node.dtype == F32 and (
                refusal(node) is not None or len(_reads(node, reads)) > MAX_GRAPH_READS
                or node.op == "where"):  # a choice of the positions alone: computed exactly
            return materialize(node)
        if node.op == "where" and node.dtype == F32 and node.args[0] in data:
            c, (x, y) = node.args[0], args[1:]
            if is_const(y) and y.attr == float("-inf"):
                return x + materialize(apply("where", c, zero, ninf))
            if is_const(x) and x.attr == float("-inf"):
                return y + materialize(apply("where", c, ninf, zero))
            return _select_by_indicators(c, node.args[1:], args[1:])
        if node.op == "f32" and node.args[0] in data:
            return materialize(node)
        out = node if args == node.args else apply(node.op, *args, attr=node.attr)
        if node.dtype == F32 and out.op != WITH_GRAD and out.args and \
                not any(_in_graph(a) for a in out.args):
            out = materialize(node)  # rule 4: XLA computes it, one tensor
        return out

    # Materialized values are already lifted: canonical form is a fixed point.
    # (A load is kept as it is: the nodes under it are not visited.)
    return ir.rebuild(root, lift, stop=lambda n: n.op in INPUT_TENSORS)


def _in_graph(node: Node) -> bool:
    """Whether the graph computes ``node`` (a virtual tensor), rather than
    reading it (an input tensor) or passing it by value (a constant)."""
    return node.op not in (CONST,) + INPUT_TENSORS


def _select_by_indicators(c: Node, branches: tuple, lifted: tuple) -> Node:
    """``where(c, x, y)`` with ``c`` computed ahead: ``x * i + y * j``, ``i`` and
    ``j`` the tensors of ``c`` and ``not c`` as 1.0 / 0.0. A branch the graph
    does not compute (a constant, an array read) goes into its tensor whole,
    ``where(c, x, 0)``, so that no node multiplies two inputs (rule 4)."""
    zero, one = const(0.0, F32), const(1.0, F32)
    terms = []
    for taken, v, lv in ((True, branches[0], lifted[0]), (False, branches[1], lifted[1])):
        if is_const(lv, 0.0) and math.copysign(1.0, lv.attr) > 0:
            continue
        if _in_graph(lv):
            terms.append(lv * materialize(apply("where", c, one, zero) if taken
                                          else apply("where", c, zero, one)))
        else:
            terms.append(materialize(apply("where", c, v, zero) if taken
                                     else apply("where", c, zero, v)))
    if not terms:
        return const_tensor(zero)
    return terms[0] if len(terms) == 1 else terms[0] + terms[1]


@functools.lru_cache(maxsize=4096)
def canonical(root: Node) -> Node:
    """``root`` rewritten so every node maps onto one cuDNN node under the rules.

    Memoized by node (nodes are hash-consed, so the same expression is the
    same key): the planning steps that each need the canonical form share one.
    """
    # The forward computes with_grad's value alone: what XLA can compute ahead
    # is judged on that (its derivative's tangent() is not a value of the call).
    root = _lift_data_masks(values_only(root))
    out = _canonical_nodes(root)
    # The root must be a tensor that is not the raw input, computed in the graph
    # (rule 4) from the score (a score_mod whose input feeds nothing dangles).
    if out.op == CONST:
        out = const_tensor(out) if out.dtype == F32 else out
    elif out.op in INPUT_TENSORS and out.dtype == F32:
        out = Node("mul", (SCORE, const(0.0, F32)), None, F32) + out
    return out


def _canonical_nodes(root: Node) -> Node:
    # Index expressions of loads and materialized values are computed by XLA
    # exactly as written: they are not rewritten for cuDNN.
    return ir.rebuild(root, _canonical_node, stop=lambda n: n.op in INPUT_TENSORS)


def _canonical_node(node: Node, args: tuple) -> Node:
    if ir.is_const(node) or node.op in (VAR, OPERAND, MATERIALIZE):
        return node
    if node.op == WITH_GRAD:  # the forward computes the value alone
        return args[0]
    if node.op == LOAD:
        return _rewrite(node, node.args)
    flat = flat_remainder(node)
    if flat is not None:  # (x // a) % b from divisions of x alone
        x, a, b = flat
        ab = const(a.attr * b.attr, I32)
        coarse = _rewrite(Node("floordiv", (x, ab), None, I32), (_canonical_nodes(x), ab))
        return apply("sub", args[0], apply("mul", coarse, b))
    return _rewrite(node, args)


def forward_and_backward(expr: Node) -> tuple[Node, Node]:
    """(forward, backward) expressions in canonical form; backward is d/dscore * dP."""
    fwd = canonical(expr)
    bwd = vjp(expr, DP)
    if bwd.op == CONST:  # zero gradient: still an expression of dP
        bwd = Node("mul", (DP, const(0.0, F32)), None, F32)
    return fwd, canonical(bwd)


def has_custom_derivatives(expr: Node) -> bool:
    """Whether ``expr`` holds a value with its own derivative rule (``with_grad``,
    from a ``jax.custom_jvp`` function): it must be differentiated before
    :func:`canonical`, which keeps the value alone."""
    return any(n.op == WITH_GRAD for n in ir.toposort(expr, stop=lambda n: n.op in INPUT_TENSORS))


def fold_scale(expr: Node) -> tuple[Node, float]:
    """``patterns.score_factor`` of ``expr`` (canonical form) where the factor
    is positive, else ``(expr, 1.0)``: the factor then joins cuDNN's
    attn_scale, which scales the score inside the matmul epilogue for free. A
    negative factor stays in the mod (no negative attn_scale has run on the
    GPU).

        >>> import jax.numpy as jnp, scoremod
        >>> softcap = scoremod.trace(lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0))
        >>> folded, c = fold_scale(canonical(softcap.expr))
        >>> print(folded, round(1 / c, 6))
        <f32 tanh(score) * 30.0> 30.0
    """
    folded, c = score_factor(expr)
    return (folded, c) if c > 0 else (expr, 1.0)
