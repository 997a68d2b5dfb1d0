"""Reverse-mode differentiation of the IR with respect to the score.

One pass over the DAG in reverse topological order, calling each op's rule
(its op-table entry's ``vjp``). The result is an IR expression in the same
nodes as the forward one, so a lowering can reuse what the forward computes.
An op without a rule is an error, never a zero gradient: ops through which no
gradient flows (comparisons, rounding, casts, integer ops) declare ``ZERO``.

    >>> from scoremod.dsl import ir
    >>> from scoremod.dsl.ops import apply
    >>> s = ir.var("score")
    >>> vjp(apply("tanh", s / 30.0) * 30.0, ir.const(1.0, "f32"))
    <f32 (tanh(score / 30.0) + 1.0) * (1.0 - tanh(score / 30.0)) * 30.0 / 30.0>
"""

from __future__ import annotations

from scoremod.dsl import ir
from scoremod.dsl.ir import F32, OPS, Node, const
from scoremod.errors import ScoreModError


def ZERO(node: Node, g: Node) -> tuple:
    """The rule of an op that passes no gradient to any argument."""
    return (None,) * len(node.args)


def rule(op: str):
    """The derivative rule of ``op`` as (node, g, live) -> cotangents, ``live`` the
    arguments the gradient flows to; a ScoreModError names an op without one."""
    entry = OPS.get(op)
    if entry is None or entry.vjp is None:
        raise ScoreModError(
            f"no derivative rule for op {op!r}: its op-table entry (scoremod/dsl/ops.py) "
            "needs vjp=..., or vjp=ZERO if no gradient flows through it")
    if entry.vjp_live:
        return entry.vjp
    return lambda node, g, live: entry.vjp(node, g)


def vjp(root: Node, cotangent: Node, wrt: Node | None = None) -> Node:
    """d(root)/d(wrt) times ``cotangent``, as an IR node (``wrt`` defaults to score)."""
    wrt = ir.var(ir.SCORE) if wrt is None else wrt
    live = ir.depends_on(root, wrt)
    if root not in live:
        return const(0.0, F32)
    cts = {root: cotangent}
    for node in reversed(ir.toposort(root)):
        g = cts.pop(node, None)
        if node is wrt:
            return g if g is not None else const(0.0, F32)
        if g is None or node not in live:
            continue
        flows = tuple(arg in live and arg.dtype == F32 for arg in node.args)
        for arg, ct, flow in zip(node.args, rule(node.op)(node, g, flows), flows):
            if ct is None or not flow:
                continue
            cts[arg] = ct if arg not in cts else cts[arg] + ct
    return const(0.0, F32)
