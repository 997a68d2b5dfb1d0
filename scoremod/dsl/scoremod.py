"""ScoreMod: a traced or parsed score modification, the unit users pass around.

    >>> import jax.numpy as jnp, scoremod
    >>> softcap = scoremod.trace(lambda s, b, h, q, k: 30 * jnp.tanh(s / 30))
    >>> str(softcap)
    'tanh(score / 30.0) * 30.0'
    >>> str(softcap.grad)
    'let x0 = tanh(score / 30.0); (x0 + 1.0) * (1.0 - x0) * 30.0 / 30.0'
    >>> scoremod.parse(str(softcap)) == softcap
    True
"""

from __future__ import annotations

import copy
import hashlib
import weakref

import jax
import numpy as np

from scoremod.dsl import ir
from scoremod.dsl.evaluate import evaluate
from scoremod.dsl.grad import vjp
from scoremod.dsl.ir import CONST, F32, LOAD, VAR, Node, const
from scoremod.dsl.text import format_mod, parse_expr
from scoremod.dsl.trace import trace_function
from scoremod.errors import ScoreModTypeError, ScoreModValueError

KEY_VERSION = "scoremod-ir-1"

# Where each node was written, for error messages. Not part of equality.
# Keyed by the root; the value names nodes by their position in
# ir.toposort(root), never by the nodes themselves: a value holding its own
# key would keep every traced expression interned forever.
_SOURCES: "weakref.WeakKeyDictionary[Node, dict[int, str]]" = weakref.WeakKeyDictionary()


class ScoreMod:
    """An immutable, hashable score modification.

    ``str`` is the canonical text, ``key`` a stable digest of it (the IR:
    constants, operand shapes and dtypes, never operand values);
    ``same_ir`` compares that structure. ``==`` is stricter: equal mods have
    the same IR *and* the same operand values, so a mod is safe as a
    ``jax.jit`` static argument or a dict key. ``hash`` is structural (equal
    mods hash alike). ``grad`` is the derived d(mod)/d(score); calling a mod
    evaluates it with jax.numpy. A ScoreMod is a pytree whose leaves are its
    operand values, so it can cross ``jax.jit`` and ``jax.grad`` boundaries
    (gradients flow to the operands on the reference path).

        >>> import jax.numpy as jnp, scoremod
        >>> slopes = jnp.asarray([0.5, 0.25])
        >>> alibi = scoremod.trace(lambda s, b, h, q, k: s + slopes[h] * (k - q))
        >>> alibi.operand_names, str(alibi)
        (('c0',), 'c0: float32[2]; score + c0[h] * f32(kv_idx - q_idx)')
        >>> steeper = alibi.bind(c0=slopes * 2)   # same IR and key, new values
        >>> steeper.same_ir(alibi), steeper.key == alibi.key, steeper == alibi
        (True, True, False)
        >>> float(alibi(0.0, 0, 1, 3, 1))         # score 0, head 1, q 3, kv 1
        -0.5
    """

    __slots__ = ("expr", "_values", "_cache")

    def __init__(self, expr: Node, values: tuple | None = None):
        if not isinstance(expr, Node) or expr.dtype != F32:
            raise TypeError("ScoreMod needs a float32 IR node")
        object.__setattr__(self, "expr", expr)
        nodes = ir.operands_of(expr)
        if values is None:
            values = (None,) * len(nodes)
        values = tuple(values)
        if len(values) != len(nodes):
            raise ScoreModValueError(f"{len(nodes)} operands, {len(values)} values")
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_cache", {})

    def __setattr__(self, name, value):
        raise AttributeError("ScoreMod is immutable")

    # --- identity ---------------------------------------------------------
    def same_ir(self, other) -> bool:
        """The same expression, constants, operand shapes and dtypes (and so the
        same ``key``), whatever the operand values."""
        return isinstance(other, ScoreMod) and other.expr is self.expr

    def __eq__(self, other):
        # Values count: jax.jit compares static arguments with ==, and a
        # structural == would replay a function compiled for other values.
        if not self.same_ir(other):
            return False
        return all(_same_value(a, b) for a, b in zip(self._values, other._values))

    def __ne__(self, other):
        return not self == other

    def __hash__(self):  # structural: mods equal by value are equal by IR
        return hash((ScoreMod, self.expr))

    # --- pickle and copy: the IR as a flat table through checked constructors
    def __reduce__(self):
        return (_unpickle, (ir.to_table(self.expr), self._values, self._source_positions()))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return ScoreMod(self.expr, copy.deepcopy(self._values, memo))

    def _source_positions(self) -> dict:
        return dict(_SOURCES.get(self.expr, {}))

    def __str__(self):
        if "text" not in self._cache:
            self._cache["text"] = format_mod(self.expr)
        return self._cache["text"]

    def __repr__(self):
        return f"scoremod.parse({str(self)!r})"

    @property
    def key(self) -> str:
        """Hex SHA-256 of the canonical text: equal for equal mods, in any process."""
        return hashlib.sha256(f"{KEY_VERSION}\n{self}".encode()).hexdigest()

    # --- operands ---------------------------------------------------------
    @property
    def operand_nodes(self) -> tuple:
        if "nodes" not in self._cache:
            self._cache["nodes"] = tuple(ir.operands_of(self.expr))
        return self._cache["nodes"]

    @property
    def operand_names(self) -> tuple:
        return tuple(n.attr[0] for n in self.operand_nodes)

    @property
    def operands(self) -> tuple:
        """Captured array values, in the fixed order of ``operand_names``."""
        return self._values

    def bind(self, **values) -> "ScoreMod":
        """A copy with some operand values replaced, by name: ``mod.bind(slopes=x)``."""
        names = self.operand_names
        unknown = set(values) - set(names)
        if unknown:
            raise ScoreModValueError(
                f"unknown operands {sorted(unknown)}; this mod has {list(names)}"
                + ("" if names else " (none)")
            )
        new = []
        for node, old in zip(self.operand_nodes, self._values):
            name, shape, dtype = node.attr
            v = values.get(name, old)
            if name in values:
                _check_operand(name, v, shape, dtype)
                v = snapshot(v)
            new.append(v)
        return ScoreMod(self.expr, tuple(new))

    def require_bound(self):
        """Every operand has a value of its declared shape and dtype.

        Checked here, at use, rather than when a mod is rebuilt from its
        leaves: jax rebuilds pytrees with placeholders (``object()``, None,
        float0 cotangents), and a ``tree_map`` may stack values for ``vmap``.
        """
        missing = [n for n, v in zip(self.operand_names, self._values) if v is None]
        if missing:
            raise ScoreModTypeError(
                f"operands {missing} of this score_mod have no values; "
                f"give them with mod.bind({missing[0]}=array) or parse(text, {missing[0]}=array)"
            )
        for node, value in zip(self.operand_nodes, self._values):
            name, shape, dtype = node.attr
            _check_operand(name, value, shape, dtype,
                           hint=" (a jax.tree_util.tree_map over a mod must keep each "
                                "operand's shape and dtype)")

    # --- derived mods -----------------------------------------------------
    @property
    def grad(self) -> "ScoreMod":
        """d(mod)/d(score) as a ScoreMod in the same text form."""
        if "grad" not in self._cache:
            self._cache["grad"] = self.derived(vjp(self.expr, const(1.0, F32)))
        return self._cache["grad"]

    def derived(self, expr: Node) -> "ScoreMod":
        """A mod of ``expr``, an expression built from this one's operands,
        carrying their values (by name: ``expr`` may use some, in any order)."""
        by_name = dict(zip(self.operand_names, self._values))
        return ScoreMod(expr, tuple(by_name[n.attr[0]] for n in ir.operands_of(expr)))

    @property
    def has_computed_index(self) -> bool:
        """True when an array is indexed by a computed index (``t[q_idx - kv_idx]``).

        The reference path handles these; the fused path must refuse or
        materialize them.
        """
        return any(n.op == LOAD and not _direct_load(n) for n in ir.toposort(self.expr))

    @property
    def sources(self) -> dict:
        """Where each node was written (``file:line``), when traced."""
        positions = _SOURCES.get(self.expr)
        if not positions:
            return {}
        order = ir.toposort(self.expr)
        return {order[i]: where for i, where in positions.items()}

    # --- evaluation -------------------------------------------------------
    def __call__(self, score, b, h, q_idx, kv_idx):
        """Evaluate on broadcastable arrays with jax.numpy (float32 result)."""
        self.require_bound()
        inputs = dict(zip(ir.VAR_NAMES, (score, b, h, q_idx, kv_idx)))
        return evaluate(self.expr, inputs, dict(zip(self.operand_names, self._values)))


def fresh_operand_name(name: str, taken) -> str:
    """``name``, or ``name1``, ``name2``, ... : the first not in ``taken`` (an
    operand added to a mod whose own operands may already use the name)."""
    out, i = name, 1
    while out in taken:
        out, i = f"{name}{i}", i + 1
    return out


def snapshot(value):
    """``value`` as a mod keeps it: a NumPy array (also JAX's wrapper of one
    that ``jnp.asarray(bias)`` in a traced body gives) as a read-only copy,
    since the caller may write into theirs; jax arrays are immutable as they are."""
    if isinstance(value, np.ndarray):
        value = np.array(value)
        value.flags.writeable = False
    return value


def _direct_load(node: Node) -> bool:
    idx = node.args[1:]
    vars_ = [i for i in idx if i.op == VAR]
    return all(i.op in (VAR, CONST) for i in idx) and len(set(vars_)) == len(vars_)


def _check_operand(name, value, shape, dtype, hint=""):
    try:
        got_shape = tuple(np.shape(value))
        got_dtype = np.dtype(value.dtype).name if hasattr(value, "dtype") else None
    except Exception:  # not array-like at all
        got_shape, got_dtype = "?", type(value).__name__
    if got_shape != shape or got_dtype != dtype:
        shown = f"{got_dtype}{list(got_shape)}" if got_shape != "?" else got_dtype
        raise ScoreModTypeError(f"operand {name} must be {dtype}{list(shape)}, got {shown}{hint}")


def _same_value(a, b) -> bool:
    """Operand values equal bit for bit, without ever reading a tracer."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        return False  # unknown until run: never equal (and never concretized)
    try:
        x, y = np.asarray(a), np.asarray(b)
    except Exception:
        return False
    if x.dtype == object or y.dtype == object:
        return False
    return (x.shape == y.shape and x.dtype == y.dtype
            and np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes())


def _unpickle(table, values, source_positions):
    expr = ir.from_table(table)
    if source_positions:
        _SOURCES.setdefault(expr, dict(source_positions))
    return ScoreMod(expr, values)


def _flatten(mod):
    return mod._values, mod.expr


def _unflatten(expr, values):
    return ScoreMod(expr, tuple(values))


jax.tree_util.register_pytree_node(ScoreMod, _flatten, _unflatten)


def trace(fn) -> ScoreMod:
    """Trace ``fn(score, b, h, q_idx, kv_idx)`` written in jax.numpy into a ScoreMod.

        >>> import jax.numpy as jnp, scoremod
        >>> causal = scoremod.trace(
        ...     lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf))
        >>> str(causal)
        'where(q_idx >= kv_idx, score, -inf)'

    Python and NumPy scalars it closes over become constants (part of the
    key); jax arrays become operands (shape and dtype in the key, values
    not), so ``slopes[h]`` or ``bias[h, q_idx, kv_idx]`` work. A NumPy
    array it reads (``jnp.asarray(bias)[h]``) is copied: the mod is a
    snapshot, whatever is written into ``bias`` later.
    """
    if isinstance(fn, ScoreMod):
        return fn
    root, values, sources = trace_function(fn)
    values = tuple(snapshot(v) for v in values)
    if root not in _SOURCES:
        order = {node: i for i, node in enumerate(ir.toposort(root))}
        _SOURCES[root] = {order[n]: where for n, where in sources.items() if n in order}
    return ScoreMod(root, values)


def score_mod(fn) -> ScoreMod:
    """Decorator form of :func:`trace`.

        >>> import jax.numpy as jnp, scoremod
        >>> @scoremod.score_mod
        ... def softcap(score, b, h, q_idx, kv_idx):
        ...     return 50.0 * jnp.tanh(score / 50.0)
        >>> softcap.key == scoremod.parse("50.0 * tanh(score / 50.0)").key
        True
    """
    return trace(fn)


# Names the text form gives a meaning of its own: a value passed under one
# would be ignored.


def parse(text: str, **names) -> ScoreMod:
    """Parse the text form; keyword arguments give constants and arrays.

        >>> import scoremod
        >>> str(scoremod.parse("cap * tanh(score / cap)", cap=30.0))
        'tanh(score / 30.0) * 30.0'

    Numbers become constants; arrays (jax or NumPy with ndim >= 1, or 0-d jax
    arrays) become operands. Declarations (``slopes: float32[16]; ...``) in
    the text stand for arrays not given; such a mod needs ``bind`` before use.
    """
    if not isinstance(text, str):
        raise ScoreModTypeError(f"parse takes a string, got {type(text).__name__}")
    root, values = parse_expr(text, names)
    nodes = ir.operands_of(root)
    for node in nodes:
        name, shape, dtype = node.attr
        if values.get(name) is not None:
            _check_operand(name, values[name], shape, dtype)
    return ScoreMod(root, tuple(snapshot(values.get(n.attr[0])) for n in nodes))


def as_score_mod(mod) -> ScoreMod | None:
    """Accept a ScoreMod, a callable (traced) or a text form (parsed)."""
    if mod is None or isinstance(mod, ScoreMod):
        return mod
    if isinstance(mod, str):
        return parse(mod)
    if callable(mod):
        return trace(mod)
    raise ScoreModTypeError(
        f"score_mod must be a ScoreMod, a function (score, b, h, q_idx, kv_idx) -> score, "
        f"or a text form; got {type(mod).__name__}"
    )
