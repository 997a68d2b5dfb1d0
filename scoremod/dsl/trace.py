"""Trace a jax.numpy score_mod into the IR.

JAX traces the user's function on scalar abstract values (``make_jaxpr``);
each equation of the jaxpr is then converted to IR nodes. Calls (``jit``,
``checkpoint``) are inlined; a ``custom_jvp`` function keeps its rule (a
``with_grad`` node); a ``custom_vjp`` function is refused. Captured arrays become operands:
they are tracked as lazy arrays (a shape and a function from indices to an
element) until indexing makes them scalar, so ``slopes[h]``,
``(2 * slopes)[h]`` and ``bias[h, q_idx, kv_idx]`` all end as ``load`` nodes.

    >>> import jax.numpy as jnp
    >>> root, values, _ = trace_function(lambda s, b, h, q, k: 30 * jnp.tanh(s / 30))
    >>> root
    <f32 tanh(score / 30.0) * 30.0>
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import linecache
import os
import re
import tokenize
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from scoremod.dsl import ir
from scoremod.dsl.ir import BOOL, CONST, F32, I32, LOAD, Node, const
from scoremod.dsl.ops import COMPARISONS, OPS, WITH_GRAD, apply, tangent
from scoremod.errors import (ScoreModError, ScoreModTypeError, ScoreModValueError,
                             UnsupportedOpError)

_PRIM_TO_OP = {p: op.name for op in OPS.values() for p in op.prims}

# Narrow types. Loads widen them (an int8 to int32, a float16 to float32),
# exactly; arithmetic must then give what jax.numpy gives in the narrow type.
# Narrow ints wrap around as JAX's do (emulated: the int32 result reduced
# modulo 2**bits); narrow floats round after every op, which float32 IR
# cannot reproduce, so their arithmetic is refused.
_INT_RANGE = {"int8": (-2**7, 2**7 - 1), "uint8": (0, 2**8 - 1),
              "int16": (-2**15, 2**15 - 1), "uint16": (0, 2**16 - 1),
              "int32": (ir.INT32_MIN, ir.INT32_MAX), "bool": (0, 1)}
_NARROW_INTS = ("int8", "uint8", "int16", "uint16")
_NARROW_FLOATS = ("float16", "bfloat16")
_WIDENED = {**{n: I32 for n in _NARROW_INTS}, **{n: F32 for n in _NARROW_FLOATS}}
_COMPARISONS = set(COMPARISONS)  # op names, and the primitives of the same names
_LAYOUT = {"copy", "copy_p", "dynamic_slice", "slice", "squeeze", "broadcast_in_dim",
           "reshape"}
# Results that stay inside the narrow type's range for inputs inside it.
_IN_RANGE = _LAYOUT | _COMPARISONS | {"select_n", "clamp", "max", "min", "sign", "rem",
                                      "and", "or", "xor", "reduce_max", "reduce_min",
                                      "reduce_or", "reduce_and"}
# Exact on narrow floats: no rounding happens.
_EXACT_ON_NARROW_FLOATS = _LAYOUT | _COMPARISONS | {
    "select_n", "clamp", "max", "min", "sign", "neg", "abs", "convert_element_type",
    "reduce_max", "reduce_min"}

# Primitives that call a sub-jaxpr we inline, and the param that holds it.
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_CALLS = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "remat", "checkpoint",
          "named_call"}

_IR_DTYPE = {"float32": F32, "int32": I32, "bool": BOOL}

# jax_enable_x64 makes Python numbers weak float64 and int64 values; the IR
# holds them as float32 and int32. Only ops that commute with rounding to
# float32 (which jax.numpy does when the value meets a float32) are exact on
# them; float64 arithmetic, comparisons and conversions to ints are refused.
_WEAK_X64 = {"float64": F32, "int64": I32}
_EXACT_ON_WEAK_FLOAT64 = _LAYOUT | {"select_n", "clamp", "max", "min", "neg", "abs",
                                    "convert_element_type"}  # _convert checks its own


@dataclasses.dataclass(frozen=True)
class _Lazy:
    """An array value: its shape and the IR element at given indices."""

    shape: tuple
    at: Callable[[tuple], Node]


def _where_of(eqn, fallback):
    try:
        from jax._src import source_info_util

        frame = source_info_util.user_frame(eqn.source_info.traceback)
        if frame is not None:
            return f"{frame.file_name}:{frame.start_line}"
    except Exception:  # private API; the location is a courtesy
        pass
    return fallback


def _fn_location(fn):
    target = getattr(fn, "__wrapped__", fn)
    target = getattr(target, "func", target)  # functools.partial
    code = getattr(target, "__code__", None)
    if code is None:  # a callable object
        code = getattr(getattr(type(target), "__call__", None), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else "<unknown>"


class _Tracer:
    def __init__(self, fn):
        self.fn = fn
        self.fn_where = _fn_location(fn)
        self.operands = {}  # id(value) -> (temporary operand node, value)
        self.sources = {}  # node -> "file:line" that created it
        self.in_jvp_rule = False  # tracing a custom_jvp rule: nested calls inline their primal

    # --- values -----------------------------------------------------------
    def captured(self, value, aval, where):
        """A constant or an operand for a value the function closed over.

        A scalar of a narrow type (a literal of uint8 or float16 arithmetic)
        is widened exactly; the equation using it decides if that is sound.
        So is a Python number that jax_enable_x64 makes a weak float64 or
        int64 (rounded to float32 here as jax.numpy rounds it on meeting
        float32; equations computing with it in float64 are refused).
        """
        try:
            weak = _WEAK_X64.get(np.dtype(aval.dtype).name) if aval.weak_type else None
            if isinstance(value, (np.ndarray, np.generic)) and np.ndim(value) == 0:
                name = np.dtype(value.dtype).name
                dtype = weak or _WIDENED.get(name) or self.ir_dtype(
                    name, "captured value of dtype", where)
                return const(np.asarray(value).item(), dtype)
            if not hasattr(value, "shape"):  # Python scalar
                name = np.dtype(aval.dtype).name
                dtype = weak or _WIDENED.get(name) or self.ir_dtype(
                    name, "captured value of dtype", where)
                return const(value, dtype)
        except ScoreModValueError as e:
            raise ScoreModValueError(f"captured value at {where}: {e}") from None
        if _is_key(value):  # refused by the equation that uses it, at its line
            return _RANDOM_KEY
        key = id(value)
        if key not in self.operands:
            name = f"__operand{len(self.operands)}"
            try:
                node = ir.operand(name, value.shape, value.dtype)
            except ValueError as e:
                raise ScoreModTypeError(f"captured array at {where}: {e}") from None
            self.operands[key] = (node, value)
        node = self.operands[key][0]
        return self.lazy_load(node)

    def lazy_load(self, node):
        shape = node.attr[1]
        if shape == ():
            return apply(LOAD, node)
        return _Lazy(shape, lambda idx, node=node: apply(LOAD, node, *idx))

    def ir_dtype(self, name, what, where):
        if name in ("float16", "bfloat16", "float64"):
            raise UnsupportedOpError(
                f"{what} {name} at {where}: a score_mod computes in float32; "
                "remove the cast (the fused kernel keeps scores in float32 anyway)"
            )
        if name not in _IR_DTYPE:
            raise UnsupportedOpError(
                f"{what} {name} at {where}: score_mods use float32, int32 and bool"
            )
        return _IR_DTYPE[name]

    # --- the jaxpr walk ---------------------------------------------------
    def run(self, jaxpr, consts, args, where):
        env = {}

        def read(v):
            if isinstance(v, jcore.Literal):
                return self.captured(v.val, v.aval, where)
            return env[v]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = self.captured(c, v.aval, where)
        for v, a in zip(jaxpr.invars, args):
            env[v] = a
        for eqn in jaxpr.eqns:
            at = _where_of(eqn, where)
            ins = [read(v) for v in eqn.invars]
            outs = self.equation(eqn, ins, at)
            for v, o in zip(eqn.outvars, outs):
                if isinstance(o, _Lazy) and o.shape == ():
                    o = o.at(())
                if isinstance(o, Node) and o not in self.sources:
                    self.sources[o] = at
                env[v] = o
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn, ins, at):
        prim = eqn.primitive.name
        if prim.startswith("random_") or prim == "threefry2x32" or any(
                _is_key(v.aval) for v in (*eqn.invars, *eqn.outvars)):
            _refuse_random(at)
        if prim == "custom_jvp_call" and not self.in_jvp_rule:
            return _custom_jvp_call(self, eqn, ins, at)
        if prim in _CUSTOM_VJP:
            _refuse_custom_vjp(eqn, at)
        if prim in _CALLS and _is_float_floor_divide(eqn):
            # jnp.floor_divide of floats ends in lax.round, which the IR lacks:
            # it is the IR's floordiv, whose reference is jnp.floor_divide itself.
            # An int or bool argument is promoted inside the call, as here.
            ins = [x if v.aval.dtype == np.float32 else self.elementwise("f32", [x])
                   for v, x in zip(eqn.invars, ins)]
            return [self.elementwise("floordiv", ins)]
        if prim in _CALLS:
            sub = next((eqn.params[p] for p in _CALL_PARAMS if p in eqn.params), None)
            if sub is not None:
                if isinstance(sub, jcore.ClosedJaxpr):
                    return self.run(sub.jaxpr, sub.consts, ins, at)
                return self.run(sub, (), ins, at)
        handler = _SPECIAL.get(prim)
        dtypes = [np.dtype(v.aval.dtype).name for v in (*eqn.invars, *eqn.outvars)]
        narrow_float = next((d for d in dtypes if d in _NARROW_FLOATS), None)
        if narrow_float and prim not in _EXACT_ON_NARROW_FLOATS:
            raise UnsupportedOpError(
                f"{prim} in {narrow_float} at {at}: jax.numpy rounds its result to "
                f"{narrow_float}, a score_mod computes in float32; convert to float32 "
                "first, e.g. x.astype(jnp.float32) or array.astype(jnp.float32)[h]"
            )
        if "float64" in dtypes and prim not in _EXACT_ON_WEAK_FLOAT64:
            _refuse_float64(prim, at)
        try:
            if handler is not None:
                out = handler(self, eqn, ins, at)
            elif prim in _PRIM_TO_OP:
                out = self.elementwise(_PRIM_TO_OP[prim], ins)
            else:
                out = None
            if out is not None:
                out_dtype = dtypes[-1]
                if out_dtype in _NARROW_INTS and prim not in _IN_RANGE | {"convert_element_type"}:
                    out = _wrap(self, out, out_dtype)
                return [out]
        except ScoreModTypeError as e:
            raise ScoreModTypeError(f"{prim} at {at}: {e}") from None
        raise UnsupportedOpError(
            f"{prim} at {at} is not supported in a score_mod. The supported operations "
            "are listed in docs/ops.md (scoremod.OPS); if this can be written "
            "with them, rewrite it, or compute it outside the mod and pass an array."
        )

    def elementwise(self, op, ins, attr=None):
        lazy = [x for x in ins if isinstance(x, _Lazy)]
        if not lazy:
            return apply(op, *ins, attr=attr)
        shape = lazy[0].shape
        if any(x.shape != shape for x in lazy):
            raise ScoreModTypeError(f"{op} of arrays of shapes {[x.shape for x in lazy]}")
        return _Lazy(
            shape,
            lambda idx: apply(op, *[x.at(idx) if isinstance(x, _Lazy) else x for x in ins],
                              attr=attr),
        )


# --- primitives that need more than a table lookup --------------------------


_CUSTOM_VJP = ("custom_vjp_call", "custom_vjp_call_jaxpr")


def _is_key(value) -> bool:
    """Whether ``value`` (an aval or an array) is a jax.random key."""
    dtype = getattr(value, "dtype", None)
    try:
        return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    except TypeError:  # not a dtype JAX knows
        return False


def _is_float_floor_divide(eqn) -> bool:
    """A call of jnp.floor_divide (``//``) that computes in float32: by its
    name and its body (a remainder, rounded at the end), not a function of the
    user's that happens to have the name."""
    if not (eqn.params.get("name") == "floor_divide" and len(eqn.invars) == 2
            and len(eqn.outvars) == 1 and eqn.outvars[0].aval.dtype == np.float32):
        return False
    sub = next((eqn.params[p] for p in _CALL_PARAMS if p in eqn.params), None)
    body = getattr(sub, "jaxpr", sub)
    prims = [e.primitive.name for e in getattr(body, "eqns", ())]
    return "rem" in prims and prims[-1] == "round" and body.outvars == body.eqns[-1].outvars


def _refuse_float64(what, at):
    code = _line_at(at)
    raise UnsupportedOpError(
        f"{what} in float64 at {at}{f' (`{code}`)' if code else ''}: with jax_enable_x64 on, "
        "a Python float makes jax.numpy compute with it in float64, and a score_mod computes "
        "in float32; convert to float32 before the Python float meets an int, e.g. "
        "(q_idx - kv_idx).astype(jnp.float32) * 0.5, or trace the mod with x64 off")


def _line_at(at) -> str:
    """The source line at ``file:line`` (empty if unknown)."""
    filename, _, line = at.rpartition(":")
    code = linecache.getline(filename, int(line)).strip() if line.isdigit() else ""
    return code if len(code) <= 120 else code[:117] + "..."


_RANDOM_KEY = object()  # a captured jax.random key


def _refuse_random(at):
    """jax.random in a mod: the IR has no random numbers, and a mod must give
    the same score each time (the backward pass and every tile recompute it)."""
    raise UnsupportedOpError(
        f"jax.random at {at}: a score_mod is a deterministic function of (score, b, h, "
        "q_idx, kv_idx), recomputed by the backward pass, so it cannot draw random "
        "numbers. Draw them outside the mod and capture the array, e.g. noise = "
        "jax.random.normal(key, (B, H, Sq, Skv)), then score + noise[b, h, q_idx, kv_idx].")


def _refuse_custom_vjp(eqn, at):
    """A jax.custom_vjp function's backward is Python that runs when JAX
    differentiates; the IR cannot hold it, and inlining the forward would give
    the forward's derivative instead, silently different from jax.grad's."""
    name = _function_name(eqn)
    raise UnsupportedOpError(
        f"{'`' + name + '`' if name else 'a function'} at {at} is a jax.custom_vjp function: "
        "a score_mod cannot keep its custom backward (Python run when JAX differentiates), "
        "and its forward's own derivative would differ from jax.grad's. Define it with "
        "jax.custom_jvp, whose rule the tracer records (as for jax.nn.softplus), or write it "
        "without a custom derivative.")


def _function_name(eqn):
    """The name of the function a custom_vjp call runs: that of the user frame
    its body's first equation comes from (None if there is none)."""
    call = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
    try:
        from jax._src import source_info_util

        for inner in getattr(call, "jaxpr", call).eqns:
            frame = source_info_util.user_frame(inner.source_info.traceback)
            if frame is not None:
                return frame.function_name
    except Exception:  # private API; the name is a courtesy
        pass
    return None


def _custom_jvp_call(t, eqn, ins, at):
    """A jax.custom_jvp function (jax.nn.relu, softplus, logaddexp, ...) keeps
    its own derivative rule: the primal is inlined, and the rule is traced once
    per float input, with ``tangent()`` for that input and 0 for the others,
    into the derivatives of a ``with_grad`` node (which the simplifier drops
    where they equal the IR's own derivative of the primal)."""
    call = eqn.params["call_jaxpr"]
    (value,) = outs = t.run(call.jaxpr, call.consts, ins, at)
    n_consts = eqn.params.get("num_consts", 0)
    xs = ins[n_consts:]
    wrt = [i for i, x in enumerate(xs) if isinstance(x, Node) and x.dtype == F32
           and x.op != CONST]
    if len(outs) != 1 or not isinstance(value, Node) or value.dtype != F32 or not wrt:
        return outs
    # A rule that takes symbolic zeros gets them for the constant inputs; any
    # other rule sees an instantiated zero tangent, as under jax.grad.
    symbolic = eqn.params.get("symbolic_zeros", False)
    nonzero = wrt if symbolic else range(len(xs))
    zeros = [j not in nonzero for j in range(len(xs))]
    jvp_jaxpr, jvp_consts, _ = eqn.params["jvp_jaxpr_fun"].call_wrapped(*zeros)
    pairs = []
    t.in_jvp_rule = True
    try:
        for i in wrt:
            tangents = [tangent() if j == i else const(0.0, F32) for j in nonzero]
            _, lin = t.run(jvp_jaxpr, jvp_consts, [*xs, *tangents], at)
            pairs += [xs[i], lin]
    finally:
        t.in_jvp_rule = False
    return [apply(WITH_GRAD, value, *pairs)]


def _div(t, eqn, ins, at):
    dtype = np.dtype(eqn.outvars[0].aval.dtype).name
    return t.elementwise("div" if dtype == "float32" else "trunc_div", ins)


def _integer_pow(t, eqn, ins, at):
    return t.elementwise("integer_pow", ins, attr=int(eqn.params["y"]))


def _square(t, eqn, ins, at):
    return t.elementwise("integer_pow", ins, attr=2)


def _select_n(t, eqn, ins, at):
    pred, *cases = ins
    if len(cases) == 1:
        return cases[0]
    if isinstance(pred, _Lazy):
        raise UnsupportedOpError(f"select_n with an array predicate at {at}")
    if pred.dtype == BOOL:
        return t.elementwise("where", [pred, cases[1], cases[0]])
    out = cases[-1]
    for i in range(len(cases) - 2, -1, -1):  # select_n on an int picks cases[pred]
        out = t.elementwise("where", [apply("eq", pred, const(i, I32)), cases[i], out])
    return out


def _clamp(t, eqn, ins, at):
    lo, x, hi = ins
    if all(isinstance(a, Node) for a in ins):
        return _clamp_scalar(lo, x, hi)
    lazy = [a for a in ins if isinstance(a, _Lazy)]
    if any(a.shape != lazy[0].shape for a in lazy):
        raise ScoreModTypeError(f"clamp of arrays of shapes {[a.shape for a in lazy]}")
    return _Lazy(lazy[0].shape, lambda idx: _clamp_scalar(
        *[a.at(idx) if isinstance(a, _Lazy) else a for a in ins]))


def _clamp_scalar(lo, x, hi):
    """lax.clamp: min(max(x, lo), hi), with JAX's derivative, which differs
    from min and max's at ties (0 there, where they split evenly): d/dx is 1
    for lo < x < hi, d/dlo 1 for x < lo < hi, d/dhi 1 for hi < x. The steps
    are relu_grad of differences (no float comparison), as min and max's."""
    value = apply("min", apply("max", x, lo), hi)
    if value.dtype != F32:
        return value
    step, t = (lambda g, a: apply("relu_grad", g, a)), tangent()
    pairs = []
    for arg, lin in ((x, step(step(t, x - lo), hi - x)), (lo, step(step(t, lo - x), hi - lo)),
                     (hi, step(t, x - hi))):
        if arg.op != CONST:
            pairs += [arg, lin]
    return apply(WITH_GRAD, value, *pairs) if pairs else value


def _convert(t, eqn, ins, at):
    name = np.dtype(eqn.params["new_dtype"]).name
    source = np.dtype(eqn.invars[0].aval.dtype).name
    if name == "float64" and eqn.params.get("weak_type") and source != "float64":
        name = "float32"  # an int meeting a Python float under x64: exact, rounded later
    elif source == "float64" and name != "float32":
        _refuse_float64(f"conversion to {name}", at)
    if name not in _NARROW_INTS:
        return t.elementwise(t.ir_dtype(name, "conversion to", at), ins)
    lo, hi = _INT_RANGE[name]
    (x,) = ins
    if source in _INT_RANGE:
        x = t.elementwise("i32", [x])
        s_lo, s_hi = _INT_RANGE[source]
        return x if lo <= s_lo and s_hi <= hi else _wrap(t, x, name)
    # A float saturates into the range (NaN gives 0), as XLA converts.
    x = t.elementwise("max", [x, const(float(lo), F32)])
    x = t.elementwise("min", [x, const(float(hi), F32)])
    return t.elementwise("i32", [x])


def _wrap(t, x, dtype):
    """``x`` (an int32 computed exactly or modulo 2**32) reduced into ``dtype``."""
    lo, hi = _INT_RANGE[dtype]
    span = const(hi - lo + 1, I32)
    if lo == 0:
        return t.elementwise("mod", [x, span])
    shifted = t.elementwise("add", [x, const(-lo, I32)])
    return t.elementwise("add", [t.elementwise("mod", [shifted, span]), const(lo, I32)])


def _identity(t, eqn, ins, at):
    return ins[0]


def _dynamic_slice(t, eqn, ins, at):
    x, *starts = ins
    sizes = tuple(eqn.params["slice_sizes"])
    if not isinstance(x, _Lazy):
        return x
    if any(isinstance(s, _Lazy) for s in starts):
        raise UnsupportedOpError(f"dynamic_slice with array indices at {at}")

    def at_(idx):
        full = []
        for n, z, s, i in zip(x.shape, sizes, starts, idx):
            if z == n:
                full.append(i)
            elif z == 1:  # the load clamps, as XLA clamps the start
                full.append(s)
            else:  # XLA clamps the start so the slice stays inside
                start = apply("min", apply("max", s, const(0, I32)), const(n - z, I32))
                full.append(start if z == 1 else start + i)
        return x.at(tuple(full))

    return _Lazy(sizes, at_)


def _static_slice(t, eqn, ins, at):
    """``x[2]``, ``x[:, 1:5]``: a static slice of a captured array."""
    (x,) = ins
    if not isinstance(x, _Lazy):
        return x
    starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
    steps = eqn.params.get("strides") or (1,) * len(starts)
    shape = tuple(-(-(hi - lo) // st) for lo, hi, st in zip(starts, limits, steps))

    def at_(idx):
        return x.at(tuple(apply("add", i * st if st != 1 else i, const(lo, I32))
                          if lo or st != 1 else i
                          for i, lo, st in zip(idx, starts, steps)))

    return _Lazy(shape, at_)


def _squeeze(t, eqn, ins, at):
    (x,) = ins
    dims = {d % len(x.shape) for d in eqn.params["dimensions"]}
    keep = tuple(n for d, n in enumerate(x.shape) if d not in dims)

    def at_(idx):
        it = iter(idx)
        return x.at(tuple(const(0, I32) if d in dims else next(it) for d in range(len(x.shape))))

    return _Lazy(keep, at_)


def _broadcast_in_dim(t, eqn, ins, at):
    x = ins[0]
    shape = tuple(eqn.params["shape"])
    bdims = tuple(eqn.params["broadcast_dimensions"])
    if isinstance(x, Node):
        return _Lazy(shape, lambda idx: x)

    def at_(idx):
        return x.at(tuple(idx[b] if x.shape[i] == shape[b] else const(0, I32)
                          for i, b in enumerate(bdims)))

    return _Lazy(shape, at_)


def _reshape(t, eqn, ins, at):
    x = ins[0]
    shape = tuple(eqn.params["new_sizes"])
    old = x.shape if isinstance(x, _Lazy) else ()
    if [n for n in old if n != 1] != [n for n in shape if n != 1]:
        raise UnsupportedOpError(
            f"reshape from {old} to {shape} at {at}: only size-1 dims may be added or removed"
        )
    if isinstance(x, Node):
        return _Lazy(shape, lambda idx: x)
    big_old = [d for d, n in enumerate(old) if n != 1]
    big_new = [d for d, n in enumerate(shape) if n != 1]

    def at_(idx):
        full = [const(0, I32)] * len(old)
        for o, n in zip(big_old, big_new):
            full[o] = idx[n]
        return x.at(tuple(full))

    return _Lazy(shape, at_)


def _bitwise(logic, bitwise):
    """jax's and/or/not/xor primitives: logic on bools, bitwise on ints."""
    def handler(t, eqn, ins, at):
        dtype = np.dtype(eqn.outvars[0].aval.dtype).name
        return t.elementwise(logic if dtype == "bool" else bitwise, ins)

    return handler


def _shift_right_logical(t, eqn, ins, at):
    dtype = np.dtype(eqn.outvars[0].aval.dtype).name
    if dtype in ("int8", "int16"):  # zeros shift in at bit 8 or 16, not at bit 32
        raise UnsupportedOpError(
            f"shift_right_logical on {dtype} at {at}: a score_mod computes in int32; convert "
            "to a wider type first (x.astype(jnp.int32)) and mask the bits you need")
    return t.elementwise("shift_right_logical", ins)


# Reductions over a static axis are unrolled into a chain of the binary op, so
# the IR stays scalar; beyond this many elements the mod is refused (the IR
# and every cuDNN graph would grow with it).
MAX_REDUCTION = 64
_REDUCE = {"reduce_sum": "add", "reduce_max": "max", "reduce_min": "min",
           "reduce_or": "or", "reduce_and": "and"}


def _positions(shape, axes):
    """Every index tuple over ``axes`` of ``shape``, in row-major order."""
    grid = [()]
    for ax in axes:
        grid = [g + (i,) for g in grid for i in range(shape[ax])]
    return grid


def _check_reduction(prim, count, at):
    if count > MAX_REDUCTION:
        raise UnsupportedOpError(
            f"{prim} over {count} elements at {at}: a score_mod reduces at most "
            f"{MAX_REDUCTION} elements (the reduction is unrolled into the expression); "
            "compute the reduction outside the mod and pass the result as an array")


def _reduce(t, eqn, ins, at):
    prim = eqn.primitive.name
    (x,) = ins
    dtype = np.dtype(eqn.outvars[0].aval.dtype).name
    op = _REDUCE[prim]
    if op in ("or", "and") and dtype != "bool":
        op = "bitwise_" + op
    if not isinstance(x, _Lazy):  # a scalar (reduced over no axis)
        return x
    axes = tuple(sorted(int(a) % len(x.shape) for a in eqn.params["axes"]))
    kept = tuple(d for d in range(len(x.shape)) if d not in axes)
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    _check_reduction(prim, count, at)

    def at_(idx):
        out = None
        for pos in _positions(x.shape, axes):
            full, it, red = [], iter(idx), iter(pos)
            for d in range(len(x.shape)):
                full.append(const(next(red), I32) if d in axes else next(it))
            v = x.at(tuple(full))
            out = v if out is None else apply(op, out, v)
        return out

    if not kept:
        return at_(())
    return _Lazy(tuple(x.shape[d] for d in kept), at_)


def _dot_general(t, eqn, ins, at):
    """A dot product (jnp.dot, @, einsum) unrolled: a sum of products."""
    lhs, rhs = ins
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lshape = lhs.shape if isinstance(lhs, _Lazy) else ()
    rshape = rhs.shape if isinstance(rhs, _Lazy) else ()
    count = int(np.prod([lshape[a] for a in lc], dtype=np.int64))
    _check_reduction("dot_general", count, at)
    lfree = [d for d in range(len(lshape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rshape)) if d not in rc and d not in rb]
    out_shape = (tuple(lshape[d] for d in lb) + tuple(lshape[d] for d in lfree)
                 + tuple(rshape[d] for d in rfree))

    def elem(x, idx):
        return x.at(tuple(idx)) if isinstance(x, _Lazy) else x

    def at_(idx):
        idx = list(idx)
        nb, nl = len(lb), len(lfree)
        batch, li, ri = idx[:nb], idx[nb:nb + nl], idx[nb + nl:]
        out = None
        for pos in _positions(lshape, lc):
            lidx, ridx = [None] * len(lshape), [None] * len(rshape)
            for d, i in zip(lb, batch):
                lidx[d] = i
            for d, i in zip(rb, batch):
                ridx[d] = i
            for d, i in zip(lfree, li):
                lidx[d] = i
            for d, i in zip(rfree, ri):
                ridx[d] = i
            for d, dr, p in zip(lc, rc, pos):
                lidx[d] = ridx[dr] = const(p, I32)
            term = apply("mul", elem(lhs, lidx), elem(rhs, ridx))
            out = term if out is None else apply("add", out, term)
        return out

    if not out_shape:
        return at_(())
    return _Lazy(out_shape, at_)


_SPECIAL = {
    "and": _bitwise("and", "bitwise_and"),
    "or": _bitwise("or", "bitwise_or"),
    "xor": _bitwise("ne", "bitwise_xor"),  # on bools, m ^ n is m != n
    "not": _bitwise("not", "invert"),
    "shift_right_logical": _shift_right_logical,
    **{prim: _reduce for prim in _REDUCE},
    "dot_general": _dot_general,
    "div": _div,
    "integer_pow": _integer_pow,
    "square": _square,
    "select_n": _select_n,
    "clamp": _clamp,
    "convert_element_type": _convert,
    "copy": _identity,
    "copy_p": _identity,
    "dynamic_slice": _dynamic_slice,
    "slice": _static_slice,
    "squeeze": _squeeze,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
}


def trace_function(fn):
    """Trace ``fn(score, b, h, q_idx, kv_idx)``: (root, operand values, sources)."""
    if not callable(fn):
        raise ScoreModTypeError(f"score_mod must be callable, got {type(fn).__name__}")
    t = _Tracer(fn)
    _check_arity(fn, t.fn_where)
    avals = [jax.ShapeDtypeStruct((), jnp.float32)] + [jax.ShapeDtypeStruct((), jnp.int32)] * 4
    try:
        # A fresh wrapper each time: make_jaxpr caches by function identity,
        # and the same function may close over state that has changed since.
        closed = jax.make_jaxpr(lambda *args: fn(*args))(*avals)
    except ScoreModError:
        raise
    except Exception as e:
        err = _explain(e, t.fn_where)
        if err is None:
            raise
        raise err from e
    jaxpr = closed.jaxpr
    if len(jaxpr.outvars) != 1 or jaxpr.outvars[0].aval.shape != ():
        got = [tuple(v.aval.shape) for v in jaxpr.outvars]
        raise ScoreModTypeError(
            f"score_mod at {t.fn_where} must return one scalar per score, got shapes {got}; "
            "it is called on scalars, so do not reduce or build arrays"
        )
    args = [ir.var(n) for n in ir.VAR_NAMES]
    (out,) = t.run(jaxpr, closed.consts, args, t.fn_where)
    if out is _RANDOM_KEY:
        _refuse_random(t.fn_where)
    if isinstance(out, _Lazy):  # pragma: no cover - shape checked above
        raise ScoreModTypeError("score_mod returned an array")
    if out.dtype == BOOL:
        raise ScoreModTypeError(
            f"score_mod at {t.fn_where} returns a boolean; return a score, e.g. "
            "jnp.where(mask, score, -jnp.inf)"
        )
    root = apply("f32", out)
    # Name operands c0, c1, ... in canonical order so equal mods print equally.
    temps = {node: value for node, value in t.operands.values()}
    renamed, values = {}, []
    for node in ir.operands_of(root):
        _, shape, dtype = node.attr
        renamed[node] = ir.operand(f"c{len(values)}", shape, dtype)
        values.append(temps[node])
    if renamed:
        new_root = ir.substitute(root, renamed)
        sources = _carry_sources(root, new_root, t.sources)
        root = new_root
    else:
        sources = t.sources
    return root, tuple(values), sources


def _carry_sources(old_root, new_root, sources):
    """Map source locations from the pre-rename tree onto the renamed one."""
    carried = {}
    for old, new in zip(ir.toposort(old_root), ir.toposort(new_root)):
        if old in sources:
            carried.setdefault(new, sources[old])
    return carried


# --- errors raised while JAX traces the user's function ---------------------

_SIGNATURE = "(score, b, h, q_idx, kv_idx)"


def _check_arity(fn, where):
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: JAX will tell
        return
    try:
        sig.bind(*range(5))
    except TypeError as e:
        raise ScoreModTypeError(
            f"score_mod at {where} cannot be called as f{_SIGNATURE}: {e}. A score_mod "
            f"takes exactly {_SIGNATURE}"
        ) from None


def _is_library(filename, _dirs=[]) -> bool:
    if not _dirs:
        import jaxlib

        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # scoremod/
        _dirs.append(tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, jaxlib, np))
                     + (package + os.sep,))
        _dirs.append(os.path.dirname(os.__file__) + os.sep)  # the standard library
    path = os.path.abspath(filename)
    if path.startswith(_dirs[0]) or filename.startswith("<frozen"):
        return True
    installed = "site-packages" in path or "dist-packages" in path
    return path.startswith(_dirs[1]) and not installed


def _user_frame(exc):
    """(innermost frame of ``exc``'s traceback in the user's code, whether the
    exception was raised right there rather than inside a library)."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not _is_library(f.filename)]
    if not user:
        return None, False
    return user[-1], frames[-1] is user[-1]


def _statement(frame) -> str:
    first = frame.lineno or 0
    last = getattr(frame, "end_lineno", None) or first
    lines = [linecache.getline(frame.filename, n) for n in range(first, last + 1)]
    return " ".join(x.strip() for x in lines if x.strip()) or (frame.line or "")


def _keywords(code: str) -> list:
    """Python keywords that convert to bool (``if`` ``and`` ...) in ``code``, in order."""
    found = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.NAME and tok.string in (
                    "if", "elif", "while", "and", "or", "not", "assert"):
                found.append(tok.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # a fragment of a longer statement: what was read is enough
    return list(dict.fromkeys(found))


def _explain(e, fn_where):
    """A ScoreModError for an exception raised while tracing, or None to re-raise."""
    frame, raised_by_user = _user_frame(e)
    where = f"{frame.filename}:{frame.lineno}" if frame else fn_where
    code = _statement(frame) if frame else ""
    if len(code) > 120:
        code = code[:117] + "..."
    at = f"at {where}" + (f" (`{code}`)" if code else "")
    if isinstance(e, jax.errors.TracerBoolConversionError):
        return ScoreModTypeError(f"cannot trace score_mod {at}: {_bool_hint(_keywords(code))}")
    if isinstance(e, jax.errors.ConcretizationTypeError):
        return ScoreModTypeError(f"cannot trace score_mod {at}: {_concrete_hint(e, code)}")
    if isinstance(e, jax.errors.TracerIntegerConversionError):
        return ScoreModTypeError(f"cannot trace score_mod {at}: {_index_hint(code)}")
    if isinstance(e, jax.errors.TracerArrayConversionError):
        return ScoreModTypeError(
            f"cannot trace score_mod {at}: a traced value reached NumPy. Use jax.numpy "
            "functions (jnp.tanh, not np.tanh), and convert captured NumPy arrays with "
            "jnp.asarray(...) before indexing them with the mod's inputs."
        )
    if isinstance(e, TypeError):
        if frame is None:  # the call itself failed: the signature was not inspectable
            return ScoreModTypeError(
                f"cannot trace score_mod at {fn_where}: {e}. A score_mod takes exactly "
                f"{_SIGNATURE}."
            )
        return ScoreModTypeError(f"cannot trace score_mod {at}: TypeError: {e}")
    if raised_by_user:
        return None  # the function's own error, not one of scoremod's
    if isinstance(e, OverflowError):
        return ScoreModValueError(
            f"cannot trace score_mod {at}: an integer does not fit in int32, the type of "
            f"the indices ({e}); use a float (1e10) or a smaller number"
        )
    if isinstance(e, (TypeError, ValueError, IndexError)):
        hint = ""
        if isinstance(e, IndexError):
            hint = " An array the mod indexes needs at least one entry along every axis."
        elif "axis" in str(e) or "dimension" in str(e):
            hint = (" A score_mod is called on one score: its inputs are scalars (shape ()), "
                    "so array functions that take an axis (sort, sum, cumsum, argmax) "
                    "do not apply.")
        return ScoreModTypeError(f"cannot trace score_mod {at}: {type(e).__name__}: {e}.{hint}")
    return None


def _bool_hint(words) -> str:
    branch = [w for w in words if w in ("if", "elif", "while", "assert")]
    logic = [w for w in words if w in ("and", "or", "not")]
    said = " and ".join(
        part for part in (
            "Python " + "/".join(f"`{w}`" for w in branch) if branch else "",
            "Python " + "/".join(f"`{w}`" for w in logic) if logic else "") if part)
    fixes = []
    if branch:
        fixes.append("choose with jnp.where(cond, a, b)")
    if logic:
        fixes.append("combine conditions with `&`, `|`, `~` (each in parentheses: "
                     "`(q_idx >= kv_idx) & (h == 0)`)")
    if not said:
        said = "converting a traced value to a Python bool (bool(), `if`, `and`, `or`, `not`)"
        fixes = ["use jnp.where(cond, a, b) and `&`, `|`, `~` instead"]
    return (f"{said} needs a concrete True or False, but the score and the indices are "
            f"traced (they have no value yet): {'; '.join(fixes)}.")


_MATH_CALL = re.compile(r"\bmath\.(\w+)\s*\(")


def _concrete_hint(e, code) -> str:
    math_fn = _MATH_CALL.search(code)
    if math_fn:
        name = math_fn.group(1)
        return (f"`math.{name}` works on Python numbers, and the score and the indices "
                f"are traced values: use jnp.{name} (jax.numpy) instead.")
    kind = re.search(r"problem arose with the `(\w+)` function", str(e))
    if kind:
        fn = kind.group(1)
        return (f"`{fn}(...)` needs a concrete Python number, and the score and the "
                f"indices are traced values: keep them as jax values (use "
                f"x.astype(jnp.float32) or jnp.int32 arithmetic to change type).")
    return ("a concrete Python value was needed from the score or an index, which are "
            "traced: write the mod with jax.numpy operations (jnp.where for choices).")


def _index_hint(code) -> str:
    if re.search(r"\brange\s*\(", code):
        return ("`range()` needs a concrete int, and the indices are traced: a score_mod "
                "describes one score, so write the loop's result in closed form with "
                "jax.numpy operations.")
    return ("a traced index was used where Python needs a concrete int (indexing a list "
            "or a NumPy array, `int()`): index only jax arrays with the mod's inputs; "
            "convert NumPy arrays and lists with jnp.asarray(...) before capturing them.")
