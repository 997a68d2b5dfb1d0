"""The IR's one bottom-up rebuild (``ir.rebuild``) and ``substitute`` on it."""

import scoremod  # noqa: F401  (installs the op table into the IR)
from scoremod.dsl import ir

S, Q, K = ir.var("score"), ir.var("q_idx"), ir.var("kv_idx")


def test_every_node_once_children_first_with_rewritten_arguments():
    shared = ir.build("tanh", S)
    root = shared * shared + shared
    seen = []

    def fn(node, args):
        seen.append(node)
        assert all(a in seen or a.op == ir.CONST for a in node.args)  # children first
        if node is S:
            return S * 2.0
        if node is shared:
            assert args == (S * 2.0,)  # the argument as rewritten
        return None

    out = ir.rebuild(root, fn)
    assert len(seen) == len(set(seen)) == len(ir.toposort(root))
    t = ir.build("tanh", S * 2.0)
    assert out is t * t + t


def test_unchanged_nodes_are_kept_and_changed_ones_go_through_the_simplifier():
    root = ir.build("tanh", S) + 1.0
    assert ir.rebuild(root, lambda node, args: None) is root
    # x * y with y replaced by 1.0: rebuilt through the op table, which drops * 1.0
    x, y = ir.build("tanh", S), ir.build("exp", S)
    out = ir.rebuild(x * y, lambda node, args: ir.const(1.0, ir.F32) if node is y else None)
    assert out is x


def test_stop_keeps_a_node_whole_and_hands_it_its_own_arguments():
    index = Q - K
    read = ir.build(ir.LOAD, ir.operand("t", (8,), "float32"), index)
    root = read + S
    visited, given = [], {}

    def fn(node, args):
        visited.append(node)
        given[node] = args
        return ir.var("b") if node is Q else None

    out = ir.rebuild(root, fn, stop=lambda n: n.op == ir.LOAD)
    assert index not in visited and Q not in visited
    assert given[read] == read.args and out is root
    # Without the stop the index is rewritten.
    assert ir.rebuild(root, fn) is ir.build(ir.LOAD, read.args[0], ir.var("b") - K) + S


def test_substitute_does_not_substitute_inside_what_it_put_in():
    x = ir.build("tanh", S)
    assert ir.substitute(x + 1.0, {x: x * 2.0}) is x * 2.0 + 1.0
    assert ir.substitute(x, {x: S}) is S


def test_deep_chains_rebuild_without_recursion():
    node = S
    for i in range(20000):
        node = ir.build("tanh", node) if i % 2 else node * 3.0
    out = ir.rebuild(node, lambda n, args: S * 0.5 if n is S else None)
    assert out is not node and ir.substitute(out, {S * 0.5: S}) is node
