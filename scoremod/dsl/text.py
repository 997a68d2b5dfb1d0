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

import itertools

import numpy as np
from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from scoremod.dsl import ir
from scoremod.dsl.ir import BOOL, F32, I32, Node, const
from scoremod.dsl.ops import OPS, apply
from scoremod.errors import ScoreModSyntaxError, ScoreModTypeError

# ---------------------------------------------------------------- printing

_ATOM = 10


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


def _format_node(node: Node, names: dict) -> tuple[str, int]:
    """(text, precedence) of one node whose children are already named or inlined."""

    def sub(child, need):
        text, prec = names[child]
        return f"({text})" if prec < need else text

    if node.op == "const":
        return _format_const(node)
    if node.op == "var":
        return node.attr, _ATOM
    if node.op == "operand":
        return node.attr[0], _ATOM
    if node.op == "load":
        array = node.args[0].attr[0]
        if len(node.args) == 1:
            return array, _ATOM
        return f"{array}[{', '.join(sub(a, 0) for a in node.args[1:])}]", _ATOM
    op = OPS.get(node.op)
    if op is None:  # lowering-internal nodes (e.g. materialize) print as calls
        return f"{node.op}({', '.join(sub(a, 0) for a in node.args)})", _ATOM
    if node.op == "integer_pow":
        return f"{sub(node.args[0], _ATOM)} ** {node.attr}", op.prec
    if op.infix:
        a, b = node.args
        left_need = op.prec + 1 if node.op in _NON_ASSOC else op.prec
        return f"{sub(a, left_need)} {op.infix} {sub(b, op.prec + 1)}", op.prec
    if op.prefix:
        sep = " " if op.prefix.isalpha() else ""
        return f"{op.prefix}{sep}{sub(node.args[0], op.prec)}", op.prec
    return f"{node.op}({', '.join(sub(a, 0) for a in node.args)})", _ATOM


_NON_ASSOC = ("lt", "le", "gt", "ge", "eq", "ne")


def _uses(order):
    count = {}
    for node in order:
        for a in node.args:
            count[a] = count.get(a, 0) + 1
    return count


def format_mod(root: Node) -> str:
    """Canonical text: operand declarations, lets for shared nodes, expression."""
    order = ir.toposort(root)
    uses = _uses(order)
    taken = {n.attr[0] for n in order if n.op == "operand"}
    let_names = (f"x{i}" for i in itertools.count() if f"x{i}" not in taken)
    names, stmts = {}, []
    for node in order:
        if node.op == "operand":
            name, shape, dtype = node.attr
            stmts.append(f"{name}: {dtype}[{', '.join(map(str, shape))}]")
        text = _format_node(node, names)
        if uses.get(node, 0) > 1 and not ops_is_leaf(node) and node is not root:
            let = next(let_names)
            stmts.append(f"let {let} = {text[0]}")
            text = (let, _ATOM)
        names[node] = text
    return "; ".join(stmts + [names[root][0]])


def format_expr(root: Node) -> str:
    """The expression alone, shared subexpressions written out in full."""
    names = {}
    for node in ir.toposort(root):
        names[node] = _format_node(node, names)
    return names[root][0]


def ops_is_leaf(node):
    return node.op in ("var", "const", "operand") or (node.op == "load" and len(node.args) == 1)


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
_ALIASES = {"maximum": "max", "minimum": "min", "logistic": "sigmoid", "square": None,
            "clip": None, "float32": "f32", "int32": "i32"}
_CMP = {"<": "lt", "<=": "le", ">": "gt", ">=": "ge", "==": "eq", "!=": "ne"}
_BINOP = {"+": "add", "-": "sub", "*": "mul", "/": "div", "//": "floordiv", "%": "mod"}


class _V:
    """A parsed value: a node, and whether it is a weakly typed literal."""

    __slots__ = ("node", "weak")

    def __init__(self, node, weak=False):
        self.node, self.weak = node, weak


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
        if out.node.dtype == BOOL:
            raise self.error(expr.meta, "a score_mod must return a number, not a boolean")
        return apply("f32", out.node)

    def check_free(self, name, meta):
        if name in ir.VAR_NAMES or name in _KEYWORDS or name in self.lets or name in self.decls:
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

    def value(self, t) -> _V:
        if isinstance(t, Token):
            raise AssertionError(t)
        try:
            return getattr(self, "v_" + t.data)(t, *t.children)
        except ScoreModTypeError as e:
            if isinstance(e, ScoreModSyntaxError):
                raise
            raise self.error(t.meta, str(e)) from None

    def v_float(self, t, tok):
        return _V(const(float(tok), F32), weak=True)

    def v_int(self, t, tok):
        return _V(const(int(tok), I32), weak=True)

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
            return _V(apply("load", array))
        if name in self.names:
            return _scalar_value(name, self.names[name], lambda m: self.error(t.meta, m))
        raise self.error(t.meta, f"unknown name {name!r}; pass its value: parse(text, {name}=...)")

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
        args = [self.value(i) for i in idx]
        for a in args:
            if a.node.dtype != I32:
                raise self.error(t.meta, f"index of {name} must be an integer, got {a.node.dtype}")
        return _V(apply("load", array, *[a.node for a in args]))

    def v_neg(self, t, x):
        v = self.value(x)
        return _V(apply("neg", v.node), v.weak)

    def v_not_(self, t, x):
        return _V(apply("not", self.value(x).node))

    def v_and_(self, t, a, b):
        return _V(apply("and", self.value(a).node, self.value(b).node))

    def v_or_(self, t, a, b):
        return _V(apply("or", self.value(a).node, self.value(b).node))

    def v_cmp(self, t, a, op, b):
        a, b = _promote(self.value(a), self.value(b))
        return _V(apply(_CMP[str(op)], a.node, b.node))

    def v_binop(self, t, a, op, b):
        op = _BINOP[str(op)]
        a, b = _promote(self.value(a), self.value(b))
        if op == "div" and a.node.dtype == I32:
            a, b = _V(apply("f32", a.node), a.weak), _V(apply("f32", b.node), b.weak)
        return _V(apply(op, a.node, b.node), a.weak and b.weak)

    def v_power(self, t, base, _pow, exponent):
        x, e = self.value(base), self.value(exponent)
        if e.node.op == "const" and e.node.dtype == I32 and e.weak:
            return _V(apply("integer_pow", x.node, attr=e.node.attr), x.weak)
        x, e = _promote(x, e)
        if x.node.dtype != F32:
            x, e = _V(apply("f32", x.node)), _V(apply("f32", e.node))
        return _V(apply("pow", x.node, e.node))

    def v_call(self, t, fn, *args):
        fn = str(fn)
        vals = [self.value(a) for a in args]
        if fn in ("clip", "square"):
            want = 3 if fn == "clip" else 1
            if len(vals) != want:
                raise self.error(t.meta, f"{fn} takes {want} arguments, got {len(vals)}")
            if fn == "square":
                return _V(apply("integer_pow", vals[0].node, attr=2))
            x, lo, hi = vals
            x, lo = _promote(x, lo)
            low = _V(apply("max", x.node, lo.node))
            low, hi = _promote(low, hi)
            return _V(apply("min", low.node, hi.node))
        name = _ALIASES.get(fn, fn)
        op = OPS.get(name)
        if op is None or name in ("load", "integer_pow"):
            raise self.error(t.meta, f"unknown function {fn!r}; see docs/ops.md for the ops")
        if len(vals) != op.arity:
            raise self.error(t.meta, f"{fn} takes {op.arity} arguments, got {len(vals)}")
        if op.sig in ("float", "float2"):
            vals = [_V(apply("f32", v.node), v.weak) for v in vals]
        elif op.sig == "where":
            c, a, b = vals
            a, b = _promote(a, b)
            vals = [c, a, b]
        elif len(vals) == 2:
            vals = list(_promote(*vals))
        return _V(apply(name, *[v.node for v in vals]))


def _promote(a: _V, b: _V):
    """JAX-style promotion: weak literals take the other side's type, int -> float."""
    ta, tb = a.node.dtype, b.node.dtype
    if ta == tb:
        return a, b
    if BOOL in (ta, tb) and not (a.weak or b.weak):
        raise ScoreModTypeError(f"cannot combine {ta} with {tb}; cast explicitly, e.g. f32(x)")
    if a.weak and not b.weak:
        return _V(apply(tb, a.node), True), b
    if b.weak and not a.weak:
        return a, _V(apply(ta, b.node), True)
    return (_V(apply("f32", a.node), a.weak), _V(apply("f32", b.node), b.weak))


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
    if isinstance(value, (int, np.integer)):
        return _V(const(int(value), I32), weak=isinstance(value, int))
    if isinstance(value, (float, np.floating)):
        return _V(const(float(value), F32), weak=isinstance(value, float))
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return _scalar_value(name, value[()], error)
    raise error(f"{name}={type(value).__name__}: pass a number or an array")


def parse_expr(text: str, names: dict) -> tuple[Node, dict]:
    """Parse ``text``; returns (root node, {operand name: value or None})."""
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
    elif isinstance(e, UnexpectedToken):
        what = f"unexpected {e.token.value!r}" if e.token.value else "unexpected end of text"
    else:
        what = "syntax error"
    src = text.splitlines()[line - 1] if text.splitlines() else ""
    caret = " " * max(col - 1, 0) + "^"
    return _located(ScoreModSyntaxError(f"line {line}, column {col}: {what}\n  {src}\n  {caret}"),
                    line, col)


def _located(err: ScoreModSyntaxError, line, column) -> ScoreModSyntaxError:
    """Set SyntaxError's own fields, for tools that read them (str() keeps our message)."""
    err.lineno, err.offset = line, column
    return err
