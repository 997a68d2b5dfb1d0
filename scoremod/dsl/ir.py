"""The score_mod IR: small, immutable, hash-consed expression nodes.

Every node is interned: building the same expression twice returns the same
object, so structural equality is identity and a node is its own cache key.

    >>> from scoremod.dsl import ir
    >>> ir.var("score") is ir.var("score")
    True

Node kinds (``op``), named by the constants below:
  ``VAR``          an input: ``score`` (f32) or an index ``b h q_idx kv_idx`` (i32)
  ``CONST``        a scalar literal, ``attr`` is its value
  ``OPERAND``      a captured array, ``attr`` is ``(name, shape, dtype)``; only
                   ever the first argument of a ``LOAD``
  ``MATERIALIZE``  made by lowerings only: its argument computed ahead of the
                   kernel (by XLA) and read as a tensor; its value is its argument's
  anything else is an operation of the op table ``OPS`` (``LOAD`` among them),
  whose entries ``scoremod.dsl.ops`` defines.

The IR sits below the op table: building an op node (type check, simplify,
intern) is the table's ``ops.apply`` and a node's repr is the text form's
printer. Rather than import the modules written in terms of it, the IR is
handed those two functions when they are imported (``install``): ``build``
(used by the arithmetic sugar, ``rebuild``, unpickling, and the modules
below the table: ``grad``, ``rewrite``) and ``repr``.
"""

from __future__ import annotations

import math
import struct
import threading
import weakref

import numpy as np

from scoremod.errors import ScoreModError, ScoreModValueError

# Node kinds the IR itself gives meaning to.
CONST, VAR, OPERAND, LOAD, MATERIALIZE = "const", "var", "operand", "load", "materialize"
LEAVES = (CONST, VAR, OPERAND)
# A value with its own derivative rule (from a jax.custom_jvp function), and
# the tangent its derivatives are linear in: evaluating and differentiating
# them needs the derivatives' structure, not only their values.
WITH_GRAD, TANGENT = "with_grad", "tangent"

# Scalar types of the IR. Scores and float operands compute in float32.
F32, I32, BOOL = "f32", "i32", "bool"
DTYPES = (F32, I32, BOOL)

# The five inputs of every score_mod, in call order.
SCORE = "score"
INDEX_VARS = ("b", "h", "q_idx", "kv_idx")
VAR_NAMES = (SCORE,) + INDEX_VARS
COTANGENT = "dP"  # the incoming gradient of a backward expression (lowering only)

# Array dtypes a captured operand may have, and the IR type a load yields.
OPERAND_DTYPES = {
    "float32": F32,
    "float16": F32,
    "bfloat16": F32,
    "int32": I32,
    "int16": I32,
    "int8": I32,
    "uint8": I32,
    "uint16": I32,
    "bool": BOOL,
}


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

# The op table: name -> entry (``scoremod.dsl.ops.Op``), filled by ops.py.
# It lives here, below everything written in terms of nodes, so that the
# derivative and the simplifier read the one table without importing the
# module that defines its entries (and builds nodes with them).
OPS: dict = {}

# Installed by ops.py and text.py when imported (see the module docstring).
_apply = None  # apply(op, *args, attr=None) -> Node
_format = None  # format_expr(node) -> str


def install(apply=None, format_expr=None):
    """Hand the IR the op table's node constructor or the printer."""
    global _apply, _format
    _apply = apply if apply is not None else _apply
    _format = format_expr if format_expr is not None else _format


def build(op: str, *args, attr=None) -> "Node":
    """``op(*args)`` through the op table's constructor (``ops.apply``)."""
    if _apply is None:
        raise ScoreModError("internal: scoremod.dsl.ops is not imported; import scoremod")
    return _apply(op, *args, attr=attr)


def _attr_key(attr):
    """A key that tells apart values Python's == confuses (0.0/-0.0, 1/True);
    every NaN is one value (the text form cannot tell payloads apart)."""
    if isinstance(attr, float):
        return ("f", struct.pack("<f", math.nan if math.isnan(attr) else attr))
    if isinstance(attr, bool):
        return ("b", attr)
    if isinstance(attr, int):
        return ("i", attr)
    return attr


def _canonical_const(attr, dtype) -> bool:
    if dtype == F32:
        return type(attr) is float and (math.isnan(attr) or float(np.float32(attr)) == attr)
    if dtype == I32:
        return type(attr) is int and INT32_MIN <= attr <= INT32_MAX
    return dtype == BOOL and type(attr) is bool


class Node:
    """One interned IR node. Compare with ``is`` or ``==`` (the same thing)."""

    __slots__ = ("op", "args", "attr", "dtype", "_hash", "__weakref__")
    _interned: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
    _lock = threading.Lock()

    def __new__(cls, op: str, args: tuple = (), attr=None, dtype: str = F32):
        if op == CONST and not _canonical_const(attr, dtype):
            # Interned by its key, a non-canonical value (0.1 unrounded, 2**40
            # as i32) would stand for const(); refused whether or not the
            # canonical node already exists, so the outcome never depends on
            # what was built before.
            raise ScoreModValueError(
                f"{attr!r} is not a canonical {dtype} constant; build it with ir.const"
            )
        key = (op, args, _attr_key(attr), dtype)
        with cls._lock:
            node = cls._interned.get(key)
            if node is None:
                node = object.__new__(cls)
                node.op, node.args, node.attr, node.dtype = op, args, attr, dtype
                node._hash = hash(key)
                cls._interned[key] = node
        return node

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def __reduce__(self):
        # A flat table rebuilt through the validating constructors (never
        # Node() itself): no recursion on deep expressions, and a crafted
        # pickle cannot intern an ill-typed node or a non-canonical constant.
        return (from_table, (to_table(self),))

    def __setattr__(self, name, value):
        if hasattr(self, "_hash"):
            raise AttributeError("IR nodes are immutable")
        object.__setattr__(self, name, value)

    def __repr__(self):
        text = _format(self) if _format is not None else f"{self.op}{self.args or ''}"
        return f"<{self.dtype} {text}>"

    # Arithmetic sugar, used by derivative rules and rewrites.
    def __add__(self, o):
        return _binary("add", self, o)

    def __radd__(self, o):
        return _binary("add", o, self)

    def __sub__(self, o):
        return _binary("sub", self, o)

    def __rsub__(self, o):
        return _binary("sub", o, self)

    def __mul__(self, o):
        return _binary("mul", self, o)

    def __rmul__(self, o):
        return _binary("mul", o, self)

    def __truediv__(self, o):
        return _binary("div", self, o)

    def __rtruediv__(self, o):
        return _binary("div", o, self)

    def __neg__(self):
        return build("neg", self)


def _binary(op, a, b):
    dtype = a.dtype if isinstance(a, Node) else b.dtype
    return build(op, lift(a, dtype), lift(b, dtype))


def const(value, dtype: str) -> Node:
    """A scalar literal of IR type ``dtype`` (floats rounded to float32, NaN canonical)."""
    if dtype == F32:
        if isinstance(value, int) and not -2**128 < value < 2**128:  # beyond float32: inf
            value = math.copysign(math.inf, value)
        with np.errstate(over="ignore"):
            value = float(np.float32(value))
        if math.isnan(value):
            value = math.nan
    elif dtype == I32:
        if not isinstance(value, (int, np.integer, bool, np.bool_)):
            # A float never becomes an int constant silently (1.5 is not 1).
            if not (math.isfinite(float(value)) and float(value).is_integer()):
                raise ScoreModValueError(f"{value!r} is not an integer; an int32 constant must be")
        value = int(value)
        if not INT32_MIN <= value <= INT32_MAX:
            raise ScoreModValueError(
                f"integer constant {value} does not fit in int32 "
                f"[{INT32_MIN}, {INT32_MAX}], the type of indices in a score_mod; "
                "use a float constant (e.g. 1e10) or a smaller number"
            )
    elif dtype == BOOL:
        value = bool(value)
    else:
        raise ScoreModValueError(f"unknown IR dtype {dtype!r}")
    return Node(CONST, (), value, dtype)


def lift(x, dtype: str) -> Node:
    """A Node as is; a Python number as a constant of ``dtype``."""
    return x if isinstance(x, Node) else const(x, dtype)


def var(name: str) -> Node:
    if name not in VAR_NAMES:
        raise ScoreModValueError(f"unknown variable {name!r}; score_mod inputs are {VAR_NAMES}")
    return Node(VAR, (), name, F32 if name == SCORE else I32)


def cotangent() -> Node:
    """``dP``: the incoming gradient of a backward expression (lowering only)."""
    return Node(VAR, (), COTANGENT, F32)


def operand(name: str, shape, dtype) -> Node:
    """A captured array: its shape and dtype are part of the IR, its values are not."""
    dtype = np.dtype(dtype).name
    if dtype not in OPERAND_DTYPES:
        raise ScoreModValueError(
            f"operand {name!r} has dtype {dtype}; supported: {', '.join(OPERAND_DTYPES)}"
        )
    if not isinstance(name, str) or not name.isidentifier():
        raise ScoreModValueError(f"operand name {name!r} is not an identifier")
    shape = tuple(int(d) for d in shape)
    if any(d <= 0 for d in shape):
        # A load clamps its index into range; an empty axis has no element to read.
        raise ScoreModValueError(
            f"operand {name!r} has shape {shape}: an array with an empty axis cannot "
            "be indexed; give it at least one entry per axis"
        )
    return Node(OPERAND, (), (name, shape, dtype), OPERAND_DTYPES[dtype])


def is_const(node: Node, value=None) -> bool:
    if node.op != CONST:
        return False
    if value is None:
        return True
    return node.attr == value and not (isinstance(node.attr, float) and math.isnan(node.attr))


def toposort(*roots: Node, stop=None) -> list[Node]:
    """Every node reachable from ``roots``, children before parents, deterministic.

    ``stop(node)`` true keeps ``node`` but does not descend into its arguments.
    """
    order, seen = [], set()
    for root in roots:
        if root in seen:
            continue
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if node in seen:
                continue
            seen.add(node)
            stack.append((node, True))
            if stop is not None and stop(node):
                continue
            for child in reversed(node.args):
                if child not in seen:
                    stack.append((child, False))
    return order


def source_of(node: Node, root: Node, sources: dict) -> str | None:
    """The user's source line of ``node`` inside ``root`` (a trace's
    ``sources``), else that of the nearest node using it, else None: an op
    the trace built without a line of its own (a rewrite) is named by its user's."""
    if sources.get(node):
        return sources[node]
    for parent in toposort(root):
        if node in parent.args and parent in sources:
            return sources[parent]
    return None


def rebuild(root: Node, fn, stop=None) -> Node:
    """``root`` rebuilt bottom-up: every node once, after its arguments.

    ``fn(node, args)`` gets a node of ``root`` and its arguments as rewritten,
    and returns the node that stands for it, or None for the node on those
    arguments: itself where none changed, else rebuilt (through the
    simplifier). The nodes ``stop`` holds true for are not descended into:
    ``fn`` gets their own arguments.

        >>> from scoremod.dsl import ir
        >>> s = ir.var("score")
        >>> ir.rebuild(ir.build("tanh", s) + s, lambda node, args: s * 2.0 if node is s else None)
        <f32 tanh(score * 2.0) + score * 2.0>
    """
    done = {}
    for node in toposort(root, stop=stop):
        leaf = stop is not None and stop(node)
        args = node.args if leaf else tuple(done[a] for a in node.args)
        out = fn(node, args)
        if out is None:
            out = node if args == node.args else build(node.op, *args, attr=node.attr)
        done[node] = out
    return done[root]


def substitute(root: Node, mapping: dict) -> Node:
    """Rebuild ``root`` with nodes replaced per ``mapping`` (through the simplifier)."""
    return rebuild(root, lambda node, args: mapping.get(node), stop=mapping.__contains__)


def operands_of(root: Node) -> list[Node]:
    """The operand leaves of ``root`` in canonical (first use) order."""
    return [n for n in toposort(root) if n.op == OPERAND]


def variables(*roots: Node) -> frozenset:
    """The names of the variables (``score``, ``b``, ``q_idx``, ...) ``roots`` read."""
    return frozenset(n.attr for n in toposort(*roots) if n.op == VAR)


def depends_on(root: Node, leaf: Node) -> set:
    """The set of nodes under ``root`` whose value depends on ``leaf``."""
    dep = set()
    for node in toposort(root):
        if node is leaf or any(a in dep for a in node.args):
            dep.add(node)
    return dep


# --- pickling: a flat table of nodes, rebuilt through the checked constructors


def to_table(*roots: Node) -> tuple:
    """``(op, argument positions, attr, dtype)`` per node, children first."""
    order = toposort(*roots)
    pos = {node: i for i, node in enumerate(order)}
    return tuple((n.op, tuple(pos[a] for a in n.args), n.attr, n.dtype) for n in order)


def from_table(table) -> Node:
    """The last node of a ``to_table`` table (all of them: ``nodes_from_table``)."""
    return nodes_from_table(table)[-1]


def nodes_from_table(table) -> list:
    nodes = []
    for entry in table:
        try:
            op, arg_pos, attr, dtype = entry
            if any(not 0 <= int(i) < len(nodes) for i in arg_pos):
                raise ScoreModValueError("argument refers to a later node")
            node = _checked_node(op, tuple(nodes[int(i)] for i in arg_pos), attr, dtype)
        except ScoreModValueError as e:
            raise ScoreModValueError(f"invalid IR node {entry!r} in a pickle: {e}") from None
        except (TypeError, ValueError, KeyError) as e:  # a malformed entry
            raise ScoreModValueError(f"invalid IR node {entry!r} in a pickle: {e}") from None
        nodes.append(node)
    return nodes


def _checked_node(op, args, attr, dtype) -> Node:
    if op == CONST:
        if args or not _canonical_const(attr, dtype):
            raise ScoreModValueError(f"{attr!r} is not a canonical {dtype} constant")
        node = const(attr, dtype)
    elif op == VAR:
        if args:
            raise ScoreModValueError("a variable has no arguments")
        node = cotangent() if attr == COTANGENT else var(attr)
    elif op == OPERAND:
        name, shape, array_dtype = attr
        if args:
            raise ScoreModValueError("an operand has no arguments")
        node = operand(name, shape, array_dtype)
    elif op in OPS:
        try:
            node = build(op, *args, attr=attr)
        except ScoreModError as e:
            raise ScoreModValueError(str(e)) from None
    else:
        raise ScoreModValueError(f"unknown op {op!r}")
    if node.dtype != dtype:
        raise ScoreModValueError(f"{op} yields {node.dtype}, the pickle says {dtype}")
    return node
