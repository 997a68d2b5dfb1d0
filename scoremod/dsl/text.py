"""The text form of score_mods: a canonical printer and a lark parser.

    >>> from scoremod.dsl.text import parse_expr, format_mod
    >>> root, _ = parse_expr("cap * tanh(score / cap)", {"cap": 30.0})
    >>> format_mod(root)
    'tanh(score / 30.0) * 30.0'

Syntax (Python-like; ``docs/guide.md`` has the full description):
  statements  ``name: float32[16];`` declares a captured array,
              ``let x0 = expr;`` names a shared subexpression,
              the last item is the expression itself
  operators   ``or``, ``and``, ``not``, ``< <= > >= == !=``, ``+ -``,
              ``* / // %``, unary ``-``, ``x ** n`` (n an integer literal)
  atoms       numbers (``30`` int, ``30.0`` float), ``inf``, ``nan``,
              ``true``, ``false``, ``score b h q_idx kv_idx``,
              ``fn(args)`` for ops of the table, ``name[i, ...]`` loads
"""

from __future__ import annotations

import difflib
import itertools
import re

import numpy as np
from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from scoremod.dsl import ir
from scoremod.dsl.ir import BOOL, CONST, F32, I32, LEAVES, LOAD, OPERAND, VAR, Node, const
from scoremod.dsl.ops import COMPARISONS, OPS, apply
from scoremod.errors import ScoreModSyntaxError, ScoreModTypeError

# ---------------------------------------------------------------- printing
# Text is built as pieces (strings and references to already formatted
# children) and joined once at the end, so printing is linear in the output
# size however deep the expression is.

_ATOM = 10
# The parser's nesting limit (brackets), and the depth at which the printer
# names a subexpression with a let so its own output always re-parses.
MAX_TEXT_CHARS = 1_000_000
MAX_NESTING = 500
_PRINT_NESTING = 64


def _format_const(node: Node):
    v = node.attr
    if node.dtype == BOOL:
        return ("true" if v else "false"), _ATOM
    if node.dtype == I32:
        return str(v), (_ATOM if v >= 0 else OPS["neg"].prec)
    if v != v:
        return "nan", _ATOM
    if v in (float("inf"), float("-inf")):
        return ("inf", _ATOM) if v > 0 else ("-inf", OPS["neg"].prec)
    text = str(np.float32(v))
    negative = text.startswith("-")
    return text, (OPS["neg"].prec if negative else _ATOM)


class _Text:
    """A formatted node: its pieces, precedence and bracket nesting depth."""

    __slots__ = ("pieces", "prec", "depth")

    def __init__(self, pieces, prec, depth=0):
        self.pieces, self.prec, self.depth = pieces, prec, depth


def _format_node(node: Node, names: dict) -> _Text:
    """One node whose children are already in ``names`` (named or inlined)."""
    depth = 0

    def sub(child, need, bracket=0):
        nonlocal depth
        t = names[child]
        if t.prec < need:
            depth = max(depth, t.depth + 1)
            return ("(", t, ")")
        depth = max(depth, t.depth + bracket)
        return (t,)

    def call(name, args):
        parts = [f"{name}("]
        for i, a in enumerate(args):
            if i:
                parts.append(", ")
            parts.extend(sub(a, 0, 1))
        parts.append(")")
        return parts

    if node.op == CONST:
        text, prec = _format_const(node)
        return _Text((text,), prec)
    if node.op == VAR:
        return _Text((node.attr,), _ATOM)
    if node.op == OPERAND:
        return _Text((node.attr[0],), _ATOM)
    if node.op == LOAD:
        array = node.args[0].attr[0]
        if len(node.args) == 1:
            return _Text((array,), _ATOM)
        parts = call(array, node.args[1:])
        parts[0], parts[-1] = f"{array}[", "]"
        return _Text(parts, _ATOM, depth)
    op = OPS.get(node.op)
    if op is None or not (op.infix or op.prefix) or node.op == "integer_pow":
        if node.op == "integer_pow":
            parts = (*sub(node.args[0], _ATOM), f" ** {node.attr}")
            return _Text(parts, op.prec, depth)
        # lowering-internal nodes (e.g. materialize) print as calls too
        return _Text(call(node.op, node.args), _ATOM, depth)
    if op.infix:
        a, b = node.args
        left_need = op.prec + 1 if node.op in _NON_ASSOC else op.prec
        parts = (*sub(a, left_need), f" {op.infix} ", *sub(b, op.prec + 1))
        return _Text(parts, op.prec, depth)
    sep = " " if op.prefix.isalpha() else ""
    return _Text((f"{op.prefix}{sep}", *sub(node.args[0], op.prec)), op.prec, depth)


_NON_ASSOC = COMPARISONS


def _join(text: _Text, limit=None) -> str:
    """The string of ``text``, expanding inlined children without recursion."""
    out, size, stack = [], 0, [iter(text.pieces)]
    while stack:
        piece = next(stack[-1], None)
        if piece is None:
            stack.pop()
        elif isinstance(piece, str):
            out.append(piece)
            size += len(piece)
            if limit is not None and size > limit:
                return "".join(out)[:limit] + " ..."
        else:
            stack.append(iter(piece.pieces))
    return "".join(out)


def _uses(order):
    count = {}
    for node in order:
        for a in node.args:
            count[a] = count.get(a, 0) + 1
    return count


def format_mod(root: Node) -> str:
    """Canonical text: operand declarations, lets for shared nodes, expression.

    A node used more than once, or nested deeper than the parser's bracket
    limit allows, is named with a let; the text always re-parses.
    """
    order = ir.toposort(root)
    uses = _uses(order)
    taken = {n.attr[0] for n in order if n.op == OPERAND}
    let_names = (f"x{i}" for i in itertools.count() if f"x{i}" not in taken)
    names, stmts = {}, []
    for node in order:
        if node.op == OPERAND:
            name, shape, dtype = node.attr
            stmts.append(f"{name}: {dtype}[{', '.join(map(str, shape))}]")
        text = _format_node(node, names)
        shared = uses.get(node, 0) > 1 and not ops_is_leaf(node)
        if (shared or text.depth >= _PRINT_NESTING) and node is not root:
            let = next(let_names)
            stmts.append(f"let {let} = {_join(text)}")
            text = _Text((let,), _ATOM)
        names[node] = text
    return "; ".join(stmts + [_join(names[root])])


def format_expr(root: Node, limit: int | None = 4000) -> str:
    """The expression alone, shared subexpressions written out in full.

    For messages and reprs: the text is cut after ``limit`` characters (a
    shared subexpression written out in full can grow exponentially).
    """
    names = {}
    for node in ir.toposort(root):
        names[node] = _format_node(node, names)
    return _join(names[root], limit)


def ops_is_leaf(node):
    return node.op in LEAVES or (node.op == LOAD and len(node.args) == 1)


ir.install(format_expr=format_expr)


# ---------------------------------------------------------------- parsing

_GRAMMAR = r"""
start: (stmt ";")* expr ";"?
?stmt: NAME ":" NAME "[" [INT ("," INT)*] "]"   -> decl
     | "let" NAME "=" expr                      -> let
?expr: or_
?or_: and_ | or_ "or" and_                      -> or_
?and_: not_ | and_ "and" not_                   -> and_
?not_: cmp | "not" not_                         -> not_
?cmp: sum | sum CMP sum                         -> cmp
?sum: term | sum ADD term                       -> binop
?term: unary | term MUL unary                   -> binop
?unary: power | "-" unary                       -> neg
?power: atom | atom POW exponent                 -> power
?exponent: atom | "-" exponent                  -> neg
?atom: FLOAT                                    -> float
     | INT                                      -> int
     | NAME                                     -> name
     | NAME "(" expr ("," expr)* ")"            -> call
     | NAME "(" ")"                             -> call
     | NAME "[" expr ("," expr)* "]"            -> index
     | "(" expr ")"
CMP: "<=" | ">=" | "==" | "!=" | "<" | ">"
ADD: "+" | "-"
POW.2: "**"
MUL: "//" | "*" | "/" | "%"
FLOAT: /(\d+\.\d*|\.\d+)([eE][+-]?\d+)?|\d+[eE][+-]?\d+/
INT: /\d+/
NAME: /[A-Za-z_][A-Za-z_0-9]*/
%ignore /\s+/
"""

_PARSER = Lark(_GRAMMAR, parser="lalr", propagate_positions=True, maybe_placeholders=True)

_KEYWORDS = {"inf": (float("inf"), F32), "nan": (float("nan"), F32), "true": (True, BOOL),
             "false": (False, BOOL)}
_GRAMMAR_WORDS = ("let", "not", "and", "or")
# Names a user cannot give a value to or declare: they already mean something.
RESERVED = frozenset(ir.VAR_NAMES) | frozenset(_KEYWORDS) | frozenset(_GRAMMAR_WORDS)
# Other names of ops (jax.numpy's), from the op table; square and clip are
# functions of the text form written with ops (integer_pow, max and min).
_ALIASES = {alias: op.name for op in OPS.values() for alias in op.aliases}
_COMPOSED = ("square", "clip")
# Ops written with their own syntax only (x ** n, name[i, ...]).
_NOT_CALLABLE = (LOAD, "integer_pow")
_CMP = {"<": "lt", "<=": "le", ">": "gt", ">=": "ge", "==": "eq", "!=": "ne"}
_BINOP = {"+": "add", "-": "sub", "*": "mul", "/": "div", "//": "floordiv", "%": "mod"}
_INT32 = (-(2**31), 2**31 - 1)


class _V:
    """A parsed value: a node, and whether it is weakly typed (a literal, as in JAX).

    An integer literal keeps its Python value (``lit``) so that ``-2147483648``
    is the int32 minimum; a literal outside int32 is an error once used, as
    JAX raises OverflowError for it (even in ``3000000000 * score``).
    ``node`` is None for such a literal.
    """

    __slots__ = ("node", "weak", "lit")

    def __init__(self, node, weak=False, lit=None):
        self.node, self.weak, self.lit = node, weak, lit

    @property
    def dtype(self):
        return I32 if self.node is None else self.node.dtype


def _int_literal(value: int) -> _V:
    fits = _INT32[0] <= value <= _INT32[1]
    return _V(const(value, I32) if fits else None, weak=True, lit=value)


def _need(v: _V) -> Node:
    """The node of ``v`` as it is (an int literal must fit int32)."""
    if v.node is None:
        raise ScoreModTypeError(
            f"the integer {v.lit} does not fit int32 (the range is {_INT32[0]} to {_INT32[1]}); "
            f"as in JAX; write it as a float ({v.lit}.0) if a float is meant"
        )
    return v.node


def _to(v: _V, dtype: str) -> _V:
    """``v`` converted to ``dtype`` (weakness kept)."""
    if v.dtype == dtype:
        return _V(_need(v), v.weak)
    return _V(apply(dtype, _need(v)), v.weak)


def _where(meta):
    return f"line {meta.line}, column {meta.column}"


class _Builder:
    def __init__(self, text, names):
        self.text, self.names, self.lets, self.decls = text, names, {}, {}

    # --- statements
    def run(self, tree: Tree) -> Node:
        *stmts, expr = [c for c in tree.children if c is not None]
        for st in stmts:
            if st.data == "decl":
                self.declare(st)
            else:
                name = str(st.children[0])
                self.check_free(name, st.meta)
                self.lets[name] = self.value(st.children[1])
        out = self.value(expr)
        if out.dtype == BOOL:
            raise self.error(expr.meta, "a score_mod must return a number, not a boolean")
        try:
            return apply("f32", _to(out, F32).node)
        except ScoreModTypeError as e:
            raise self.error(expr.meta, str(e)) from None

    def check_free(self, name, meta):
        if name in RESERVED or name in self.lets or name in self.decls:
            raise self.error(meta, f"name {name!r} is already defined")

    def declare(self, st):
        name, dtype, *dims = st.children
        name = str(name)
        self.check_free(name, st.meta)
        dims = tuple(int(d) for d in dims if d is not None)
        try:
            node = ir.operand(name, dims, str(dtype))
        except (TypeError, ValueError) as e:
            raise self.error(st.meta, str(e)) from None
        given = self.names.get(name)
        if given is not None:
            if not _is_array(given) and not isinstance(given, np.ndarray):
                raise self.error(
                    st.meta,
                    f"{name} is declared {node.attr[2]}{list(dims)} but a "
                    f"{type(given).__name__} was passed; pass an array of that shape",
                )
            shape, gdtype = tuple(np.shape(given)), _dtype_name(given)
            if shape != dims or gdtype != node.attr[2]:
                raise self.error(
                    st.meta,
                    f"{name} is declared {node.attr[2]}{list(dims)} but the array passed "
                    f"has {gdtype}{list(shape)}",
                )
        self.decls[name] = node

    # --- expressions
    def error(self, meta, msg):
        line = self.text.splitlines()[meta.line - 1] if self.text else ""
        caret = " " * (meta.column - 1) + "^"
        return _located(ScoreModSyntaxError(f"{_where(meta)}: {msg}\n  {line}\n  {caret}"),
                        meta.line, meta.column)

    def value(self, root: Tree) -> _V:
        """The value of an expression tree, children first, without recursion
        (a long chain of operators is a deep tree)."""
        done = {}
        stack = [(root, False)]
        while stack:
            t, expanded = stack.pop()
            if not expanded:
                stack.append((t, True))
                stack.extend((c, False) for c in reversed(t.children) if isinstance(c, Tree))
                continue
            args = [done.pop(id(c)) if isinstance(c, Tree) else c for c in t.children]
            try:
                done[id(t)] = getattr(self, "v_" + t.data)(t, *args)
            except ScoreModTypeError as e:
                if isinstance(e, ScoreModSyntaxError):
                    raise
                raise self.error(t.meta, str(e)) from None
        return done[id(root)]

    def v_float(self, t, tok):
        return _V(const(float(tok), F32), weak=True)

    def v_int(self, t, tok):
        return _int_literal(int(tok))

    def v_name(self, t, tok):
        name = str(tok)
        if name in self.lets:
            return self.lets[name]
        if name in ir.VAR_NAMES:
            return _V(ir.var(name))
        if name in _KEYWORDS:
            v, dtype = _KEYWORDS[name]
            return _V(const(v, dtype), weak=dtype != BOOL)
        array = self.array(name, t.meta)
        if array is not None:
            if array.attr[1] != ():
                raise self.error(
                    t.meta, f"{name} has shape {array.attr[1]}; index it, e.g. {name}[h]"
                )
            return _V(apply(LOAD, array))
        if name in self.names:
            return _scalar_value(name, self.names[name], lambda m: self.error(t.meta, m))
        close = self.closest(name, [*ir.VAR_NAMES, *_KEYWORDS, *self.lets, *self.decls,
                                    *self.names])
        if close:
            raise self.error(t.meta, f"unknown name {name!r}; did you mean {close!r}?")
        raise self.error(t.meta, f"unknown name {name!r}; pass its value: parse(text, {name}=...)")

    @staticmethod
    def closest(name, known):
        # Two letters swapped (tahn) is the likeliest typo; then the closest spelling.
        swapped = [k for k in known if sorted(k) == sorted(name) and k != name]
        match = swapped or difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        return match[0] if match else None

    def array(self, name, meta):
        if name in self.decls:
            return self.decls[name]
        value = self.names.get(name)
        if value is None or not _is_array(value):
            return None
        try:
            node = ir.operand(name, np.shape(value), _dtype_name(value))
        except ValueError as e:
            raise self.error(meta, str(e)) from None
        self.decls[name] = node
        return node

    def v_index(self, t, name, *idx):
        array = self.array(str(name), t.meta)
        if array is None:
            raise self.error(t.meta, f"{name} is not an array: pass it, parse(text, {name}=array)")
        for a in idx:
            if a.dtype != I32:
                raise self.error(
                    t.meta, f"index of {name} must be an integer, got {a.dtype}; as in "
                    "jax.numpy an index computed with a float is a float: write i32(...) "
                    "to convert it (rounding toward zero)")
        return _V(apply(LOAD, array, *[_need(a) for a in idx]))

    def v_neg(self, t, x):
        if x.lit is not None:  # -2147483648 is a literal that fits int32
            return _int_literal(-x.lit)
        return _V(apply("neg", x.node), x.weak)

    def v_not_(self, t, x):
        return _V(apply("not", _need(x)))

    def v_and_(self, t, a, b):
        return _V(apply("and", _need(a), _need(b)))

    def v_or_(self, t, a, b):
        return _V(apply("or", _need(a), _need(b)))

    def v_cmp(self, t, a, op, b):
        a, b = _promote(a, b)
        return _V(apply(_CMP[str(op)], a.node, b.node))

    def v_binop(self, t, a, op, b):
        op = _BINOP[str(op)]
        a, b = _promote(a, b)
        if op == "div" and a.dtype != F32:  # true division of ints gives a float, as in JAX
            a, b = _to(a, F32), _to(b, F32)
        return _V(apply(op, a.node, b.node), a.weak and b.weak)

    def v_power(self, t, x, _pow, e):
        if e.node is not None and e.node.op == CONST and e.dtype == I32 and e.weak:
            n = e.node.attr
            if n < 0 and x.dtype != F32:
                raise ScoreModTypeError(
                    f"an integer raised to a negative power ({n}) is an error in JAX "
                    "(integer_pow); write the base as a float, e.g. 2.0 ** -3 or f32(x) ** -3")
            return _V(apply("integer_pow", _need(x), attr=n), x.weak)
        if e.lit is not None:
            raise ScoreModTypeError(f"the exponent {e.lit} does not fit int32")
        if x.dtype != F32 and e.dtype != F32:
            raise ScoreModTypeError(
                "an integer power with an exponent that is not an integer literal is not "
                "supported; convert to float: f32(a) ** f32(n)")
        x, e = _promote(x, e)
        return _V(apply("pow", x.node, e.node))

    def v_call(self, t, fn, *vals):
        fn = str(fn)
        if fn in _COMPOSED:
            want = 3 if fn == "clip" else 1
            if len(vals) != want:
                raise self.error(t.meta, f"{fn} takes {want} arguments, got {len(vals)}")
            if fn == "square":
                return _V(apply("integer_pow", _need(vals[0]), attr=2), vals[0].weak)
            x, lo, hi = vals  # as jnp.clip: minimum(maximum(x, lo), hi)
            x, lo = _promote(x, lo)
            low = _V(apply("max", x.node, lo.node), x.weak and lo.weak)
            low, hi = _promote(low, hi)
            return _V(apply("min", low.node, hi.node), low.weak and hi.weak)
        name = _ALIASES.get(fn, fn)
        op = OPS.get(name)
        if op is None or name in _NOT_CALLABLE:
            close = self.closest(fn, [n for n in [*OPS, *_ALIASES, *_COMPOSED]
                                      if n not in _NOT_CALLABLE])
            hint = f"did you mean {close!r}? " if close else ""
            raise self.error(t.meta, f"unknown function {fn!r}; {hint}see docs/ops.md for the ops")
        if op.arity >= 0 and len(vals) != op.arity:
            raise self.error(t.meta, f"{fn} takes {op.arity} arguments, got {len(vals)}")
        if op.on_int is not None and vals[0].dtype == I32:  # as jnp.floor, jax.nn.relu on ints
            return _V(op.on_int(_need(vals[0])))
        if name == "pow":  # as jnp.power: an int literal exponent is integer_pow
            return self.v_power(t, vals[0], None, vals[1])
        if op.sig in ("float", "float2"):
            vals = [_to(v, F32) for v in vals]
        elif op.sig == "where":
            c, a, b = vals
            a, b = _promote(a, b)
            vals = [_V(_need(c)), a, b]
        elif op.sig.startswith("cast:") and vals and vals[0].node is None:
            vals = [_to(vals[0], op.sig[5:])]
        elif len(vals) == 2:
            vals = list(_promote(*vals))
        return _V(apply(name, *[_need(v) for v in vals]))


def _promote(a: _V, b: _V):
    """JAX's promotion on two values (``jnp.promote_types`` with weak types):
    ints meeting floats become floats, whatever side is weak; bools take the
    other side's type; a weak literal takes the other side's type."""
    ta, tb = a.dtype, b.dtype
    if ta == tb:
        return _V(_need(a), a.weak), _V(_need(b), b.weak)
    if F32 in (ta, tb):
        return _to(a, F32), _to(b, F32)
    # one side is bool, the other an int
    return _to(a, I32), _to(b, I32)


def _is_array(value):
    if isinstance(value, (bool, int, float, np.generic)):
        return False
    if isinstance(value, np.ndarray):
        return value.ndim > 0
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _dtype_name(value):
    return np.dtype(value.dtype).name


def _scalar_value(name, value, error):
    if isinstance(value, (bool, np.bool_)):
        return _V(const(bool(value), BOOL))
    if isinstance(value, int):
        return _int_literal(value)
    if isinstance(value, np.integer):
        if not _INT32[0] <= int(value) <= _INT32[1]:
            raise error(f"{name}={value} does not fit int32")
        return _V(const(int(value), I32))
    if isinstance(value, (float, np.floating)):
        return _V(const(float(value), F32), weak=isinstance(value, float))
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return _scalar_value(name, value[()], error)
    raise error(f"{name}={type(value).__name__}: pass a number or an array")


def _check_limits(text: str):
    """The documented size limits, checked before parsing."""
    if len(text) > MAX_TEXT_CHARS:
        raise ScoreModSyntaxError(
            f"the text has {len(text)} characters; the limit is {MAX_TEXT_CHARS}. Name "
            "repeated parts with let, or build large mods by tracing a function")
    depth = 0
    for line_no, line in enumerate(text.split("\n"), 1):
        for col, ch in enumerate(line, 1):
            if ch in "([":
                depth += 1
                if depth > MAX_NESTING:
                    return _located(ScoreModSyntaxError(
                        f"line {line_no}, column {col}: brackets nest deeper than "
                        f"{MAX_NESTING}; name inner parts with let"), line_no, col)
            elif ch in ")]":
                depth -= 1
    return None


def parse_expr(text: str, names: dict) -> tuple[Node, dict]:
    """Parse ``text``; returns (root node, {operand name: value or None})."""
    for name in names:
        if name in RESERVED:
            what = "an input of every score_mod" if name in ir.VAR_NAMES else "a keyword"
            raise ScoreModSyntaxError(
                f"cannot pass a value for {name!r}: it is {what} of the text form; "
                "rename it in the text and pass that name")
    too_big = _check_limits(text)
    if too_big is not None:
        raise too_big
    try:
        tree = _PARSER.parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(text, e) from None
    builder = _Builder(text, names)
    root = builder.run(tree)
    used = {n.attr[0] for n in ir.operands_of(root)}
    return root, {name: names.get(name) for name in builder.decls if name in used}


def _syntax_error(text, e: UnexpectedInput) -> ScoreModSyntaxError:
    line, col = getattr(e, "line", -1), getattr(e, "column", -1)
    at_end = isinstance(e, UnexpectedToken) and e.token.type == "$END"
    if isinstance(e, UnexpectedEOF) or at_end or line is None or line < 0:
        lines = text.splitlines() or [""]
        line, col = len(lines), len(lines[-1]) + 1
        what = "unexpected end of text"
    elif isinstance(e, UnexpectedCharacters):
        what = f"unexpected character {text[e.pos_in_stream]!r}"
        if text[e.pos_in_stream] == ".":
            what += _dot_hint(text, e.pos_in_stream)
    elif isinstance(e, UnexpectedToken):
        what = f"unexpected {e.token.value!r}" if e.token.value else "unexpected end of text"
    else:
        what = "syntax error"
    src = text.splitlines()[line - 1] if text.splitlines() else ""
    caret = " " * max(col - 1, 0) + "^"
    return _located(ScoreModSyntaxError(f"line {line}, column {col}: {what}\n  {src}\n  {caret}"),
                    line, col)


_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def _dot_hint(text, pos) -> str:
    """What a '.' at ``pos`` was likely meant as: a module prefix (``jnp.tanh``),
    or a method (``x.astype``), neither of which the text form has."""
    start = pos
    while start > 0 and (text[start - 1].isalnum() or text[start - 1] in "_."):
        start -= 1
    dotted = _DOTTED.match(text, start)
    if dotted is None or dotted.start() != start or text[start].isdigit():
        return ""
    name = dotted.group(0)
    fn = name.rsplit(".", 1)[1]
    callable_ = {n for n in [*OPS, *_ALIASES, *_COMPOSED] if n not in _NOT_CALLABLE}
    if fn in callable_:
        return (f": the text form names ops without a module: write `{fn}(...)`, not "
                f"`{name}(...)` (docs/ops.md lists the ops)")
    if fn in _KEYWORDS:
        return f": the text form names constants without a module: write `{fn}`, not `{name}`"
    if fn == "astype":
        return (": the text form has no methods: convert with f32(x), i32(x) or bool(x) "
                "instead of x.astype(...)")
    return (f": the text form has no modules or attributes: `{name}` is not an op "
            "(call ops by name, as tanh(score); docs/ops.md lists them)")


def _located(err: ScoreModSyntaxError, line, column) -> ScoreModSyntaxError:
    """Set SyntaxError's own fields, for tools that read them (str() keeps our message)."""
    err.lineno, err.offset = line, column
    return err
