"""A fused backend's calls on sharded and on vmapped arrays.

A fused kernel (a cuDNN graph) has fixed shapes and is opaque to XLA: without
help, XLA gathers every input onto every device and runs the whole attention
there, and ``jax.vmap`` cannot batch it at all. This module gives the fused
forward and backward calls

- a **partitioning rule** (``jax.experimental.custom_partitioning`` with a
  Shardy sharding rule): under ``jax.jit``, whatever sharding XLA chose for
  q, k and v, each device runs the backend's plan for *its* block: batch and
  (query and key/value) heads stay sharded with no communication; queries
  sharded along the sequence (context parallelism) keep their rows, and the
  keys and values are gathered, so each device computes its rows over all
  keys (their gradients are summed across the query shards). The head dims
  and the keys' sequence are never split: XLA reshards them first. The mod
  keeps seeing *global* indices: a shard whose ``b``, ``h`` or ``q_idx``
  starts past 0 runs the mod with that index shifted by the shard's start
  (the IR's ``offset`` op, one static constant per shard: every shard's
  plan is built at compile time, and ``lax.switch`` on the device's position
  picks its own), and a captured array indexed directly by a sharded index
  is sharded with it and read with the local index.
- a **batching rule** (``jax.custom_batching.custom_vmap``): the vmapped
  axes fold into the batch axis, with the mod rewritten so that ``b`` is
  still the index within one example (see :func:`fold_batch`).

Both rules re-plan the call for the new shapes through the backend
(``static.on(problem, mod, why)``), so they hold for any fused backend.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from scoremod.dsl import ir, ops
from scoremod.dsl.ir import I32
from scoremod.dsl.scoremod import ScoreMod
from scoremod.lowering import decode, nonfinite
from scoremod.lowering import sinks as attention_sinks
from scoremod.lowering.problem import AXES, Problem


# --------------------------------------------------------------------------- #
# the mod's operands: which axes follow an index of the call


def direct_axes(expr, problem: Problem) -> dict:
    """``{(operand name, axis): index name}`` for the axes of captured arrays
    that every read indexes by one index variable directly, over its whole
    extent (``slopes[h]`` with one slope per head): those can be sliced like
    that index and read with the local index."""
    uses: dict = {}
    for node in ir.toposort(expr):
        if node.op != ir.LOAD:
            continue
        name, shape, _ = node.args[0].attr
        per = uses.setdefault((name, shape), [set() for _ in shape])
        for axis, idx in enumerate(node.args[1:]):
            per[axis].add(idx)
    out = {}
    for (name, shape), per in uses.items():
        for axis, idxs in enumerate(per):
            (idx,) = idxs if len(idxs) == 1 else (None,)
            if (idx is not None and idx.op == ir.VAR and idx.attr in AXES
                    and shape[axis] == problem.extent(idx.attr) and shape[axis] > 1):
                out[(name, axis)] = idx.attr
    return out


def _values_of(expr, keep) -> set:
    """The index variables ``expr`` uses as values (outside the kept positions)."""
    found, seen = set(), set()
    stack = [expr]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == ir.VAR:
            found.add(node.attr)
        elif node.op == ir.LOAD:
            name = node.args[0].attr[0]
            stack.extend(a for i, a in enumerate(node.args[1:]) if (name, i) not in keep)
        else:
            stack.extend(node.args)
    return found


def shifted(expr, starts: dict, keep) -> ir.Node:
    """``expr`` on a shard whose indices start at ``starts`` (``{"b": 2, ...}``):
    each index in ``starts`` becomes ``offset(index, start)``, the op no rewrite
    removes, so every shard's expression has one structure (a fused backend
    compiles its kernel once); reads at positions in ``keep`` stay local."""
    mapping = {ir.var(n): ops.apply("offset", ir.var(n), ir.const(int(s), I32))
               for n, s in starts.items()}

    def shift(node, args):
        if node in mapping:
            return mapping[node]
        if node.op != ir.LOAD:
            return None
        name = node.args[0].attr[0]
        args = args[:1] + tuple(old if (name, i) in keep else new
                                for i, (old, new) in enumerate(zip(node.args[1:], args[1:])))
        return node if args == node.args else ops.apply(ir.LOAD, *args)

    return ir.rebuild(expr, shift, stop=mapping.__contains__)


# --------------------------------------------------------------------------- #
# partitioning


def _spec(sharding, ndim):
    """The PartitionSpec of ``sharding`` as a tuple of ``ndim`` entries (None
    where unsharded); None when it is not a NamedSharding."""
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return spec[:ndim]


def _axes(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _count(mesh, entry):
    return math.prod(mesh.shape[a] for a in _axes(entry))


# The kinds of call: "forward" (q, k, v), "forward_sinks" (q, k, v and the sinks
# [b, hq], which the backend joins in its softmax: Call.sinks_inside),
# "backward" (q, k, v, O, LSE, dO) and "backward_sinks" (those and the sinks,
# whose gradient the backend sums: Backend.sums_sink_gradient); the mod's
# operands follow.
_ARRAYS = {"forward": 3, "forward_sinks": 4, "backward": 6, "backward_sinks": 7}


def _operand_arrays(kind):
    """How many leading arrays of a ``kind`` call are attention arrays (the
    rest are the mod's operands)."""
    return _ARRAYS[kind]


def _layout(kind, problem: Problem):
    """Per attention array of a ``kind`` call, the index (of AXES) or head-dim
    marker of each axis; results likewise."""
    q = ("b", "q_idx", "h", "d")
    kv = ("b", "kv_idx", "hkv", "d")
    o = ("b", "q_idx", "h", "d")
    lse = ("b", "h", "q_idx")
    if kind == "forward":
        return (q, kv, kv), (o, lse)
    if kind == "forward_sinks":
        return (q, kv, kv, ("b", "h")), (o, lse)
    if kind == "backward_sinks":
        return (q, kv, kv, o, lse, o, ("b", "h")), (q, kv, kv, ("b", "h"))
    return (q, kv, kv, o, lse, o), (q, kv, kv)


def _rule(kind, static, mesh, value_types, result_types):
    """The Shardy rule: einsum-like factors of every argument and result."""
    problem = static.problem
    # Query heads and key/value heads are one factor without grouping; with it,
    # two (a compound (k g) lets Shardy split one mesh axis across k and g, a
    # sharding no PartitionSpec can name): the partition makes them agree.
    groups = problem.hq // problem.hkv
    letters = {"b": "b", "q_idx": "s", "kv_idx": "t", "h": "h" if groups > 1 else "k",
               "hkv": "k"}
    args, results = _layout(kind, problem)
    replicate = set()

    def mapping(axes, dims_key):
        out = []
        for i, a in enumerate(axes):
            if a == "d":
                name = f"{dims_key}d{i}"
                replicate.add(name)
                out.append(name)
            else:
                out.append(letters[a])
        return " ".join(out)

    # The head dims: one factor per array (q.k needs d equal, v's may differ; none is split).
    text = [mapping(a, f"a{j}") for j, a in enumerate(args)]
    direct = direct_axes(static.plan.mod.expr, problem) if static.plan.mod is not None else {}
    for j, node in enumerate(_operand_nodes(static)):
        name, shape, _ = node.attr
        dims = []
        for axis in range(len(shape)):
            index = direct.get((name, axis))
            if index is not None:
                dims.append(letters[index])
            else:
                dims.append(f"x{j}_{axis}")
                replicate.add(dims[-1])
        text.append(" ".join(dims))
    out = [mapping(r, f"r{j}") for j, r in enumerate(results)]
    rule = ", ".join(text) + " -> " + ", ".join(out)
    # The key sequence is gathered, never split: a kernel needs all keys of its rows.
    # (Shardy wants special factors in the order they first appear.)
    replicate.add("t")
    order = list(dict.fromkeys(rule.replace("(", " ").replace(")", " ").replace(",", " ")
                               .replace("->", " ").split()))
    kw = {"need_replication_factors": tuple(f for f in order if f in replicate)}
    del mesh, value_types, result_types  # the static call knows the shapes
    return rule, kw


def _operand_nodes(static):
    return static.plan.mod.operand_nodes if static.plan.mod is not None else ()


def _decide(static, mesh, spec_q):
    """The mesh axes each of batch, heads and query sequence stays sharded on
    (None: gathered), given q's spec."""
    p = static.problem
    if spec_q is None:
        return None, None, None
    b, s, h, _ = spec_q

    def fits(entry, size):
        return entry if entry is not None and size % _count(mesh, entry) == 0 else None

    return fits(b, p.b), fits(h, p.hkv), fits(s, p.sq)


def _partition(kind, static, mesh, arg_shapes, result_shape):
    """custom_partitioning's callback: the shardings the call runs on (XLA
    reshards the arguments to them) and the per-device computation."""
    del result_shape  # the shardings follow from the arguments'
    p = static.problem
    flat = jax.tree.leaves(arg_shapes)
    bax, hax, sax = _decide(static, mesh, _spec(flat[0].sharding, 4))
    entry = {"b": bax, "h": hax, "hkv": hax, "q_idx": sax, "kv_idx": None, "d": None}
    args, results = _layout(kind, p)
    mod = static.plan.mod
    direct = direct_axes(mod.expr, p) if mod is not None else {}

    def named(axes):
        return NamedSharding(mesh, PartitionSpec(*(entry[a] for a in axes)))

    arg_shardings = [named(a) for a in args]
    keep = set()
    for node in _operand_nodes(static):
        name, shape, _ = node.attr
        axes = []
        for axis in range(len(shape)):
            index = direct.get((name, axis))
            axes.append(entry[index] if index is not None else None)
            if index is not None and entry[index] is not None:
                keep.add((name, axis))
        arg_shardings.append(NamedSharding(mesh, PartitionSpec(*axes)))
    result_shardings = tuple(named(r) for r in results)
    lower = functools.partial(_lower, kind, static, keep, {"b": bax, "h": hax, "q_idx": sax},
                              mesh)
    return mesh, lower, result_shardings, tuple(arg_shardings)


def _lower(kind, static, keep, sharded, mesh, *arrays):
    """The per-device computation: the plan of this device's block, with the
    mod's indices shifted to this device's start (one branch per shard)."""
    n = _operand_arrays(kind)
    local = Problem.of(*arrays[:3])
    mod = _declared_at_local_shapes(static.plan.mod, arrays[n:])
    # Indices the mod uses as values on a sharded axis need the shard's start.
    used = _values_of(mod.expr, keep) if mod is not None else set()
    extent = {"b": local.b, "h": local.hq, "q_idx": local.sq}
    moving = [(name, sharded[name]) for name in ("b", "h", "q_idx")
              if sharded[name] is not None and name in used]
    counts = [_count(mesh, entry) for _, entry in moving]

    def branch(position):
        starts = {}
        for (name, _), i in zip(moving, position):
            starts[name] = i * extent[name]
        if mod is None or not moving:
            sub = static.on(local, mod, "on one device's shard")
        else:
            sub = static.on(local, ScoreMod(shifted(mod.expr, starts, keep)),
                                   "on one device's shard, with the mod's indices shifted")
        order = _order(mod, sub.plan.mod)

        def run(*arrays):
            head, operands = arrays[:n], arrays[n:]
            return _call(kind, sub, *head, *(operands[i] for i in order))

        return run

    positions = [()]
    for c in counts:
        positions = [pos + (i,) for pos in positions for i in range(c)]
    if len(positions) == 1:
        out = branch(positions[0])(*arrays)
    else:
        index = jnp.int32(0)
        for (_, entry), c in zip(moving, counts):
            index = index * c + jax.lax.axis_index(_axes(entry))
        out = jax.lax.switch(index, [branch(p) for p in positions], *arrays)
    if not kind.startswith("backward") or sharded["q_idx"] is None:
        return out
    # Each query shard's rows contribute to every key's gradient (and to the sinks'):
    # summed after the switch, which every device leaves (a collective inside a
    # branch that only some devices take waits forever for the others).
    axes = _axes(sharded["q_idx"])
    dq, *summed = out
    return (dq, *(jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype) for x in summed))


def _declared_at_local_shapes(mod, values):
    """``mod`` with each captured array declared at the shape of its value on
    this shard (an array sliced like the index that reads it is smaller there,
    and a mod never reads an array of another shape than it declares)."""
    if mod is None:
        return None
    mapping = {}
    for node, value in zip(mod.operand_nodes, values):
        name, shape, dtype = node.attr
        if tuple(value.shape) != shape:
            mapping[node] = ir.operand(name, value.shape, dtype)
    return ScoreMod(ir.substitute(mod.expr, mapping)) if mapping else mod


def _order(mod, sub_mod):
    """Positions of ``sub_mod``'s operands among ``mod``'s (matched by name)."""
    if mod is None or sub_mod is None:
        return ()
    names = mod.operand_names
    return tuple(names.index(name) for name in sub_mod.operand_names)


def _call(kind, static, *arrays):
    """One kernel call of the backend, on one device's (unbatched) arrays
    (those of a ``kind`` call, then the mod's operands); with the masked-key
    rule for non-finite V (``lowering/nonfinite.py``) applied here, where V is
    this device's own, when the options ask for it."""
    backend, plan = static.backend, static.plan
    check = static.options.check_values
    n = _operand_arrays(kind)
    head, operands = arrays[:n], arrays[n:]
    folded = decode.choose(static)
    if folded is not None:  # short queries: the same kernels on folded shapes
        return _folded_call(kind, static, folded, head, operands)
    if not kind.startswith("backward"):
        q, k, v = head[:3]
        sinks = head[3] if kind == "forward_sinks" else None
        if sinks is not None and not static.sinks_inside:  # joined around it
            out = _call("forward", static, q, k, v, *operands)
            return tuple(attention_sinks.combine(*out, sinks))
        if not check:
            return tuple(backend.forward(plan, q, k, v, operands, *(
                () if sinks is None else (sinks,))))
        return nonfinite.forward(backend, plan, q, k, v, operands)
    q, k, v, o, lse, do = head[:6]
    if kind == "backward_sinks":  # per head (the route's rule), O and V finite (no check)
        return tuple(backend.backward_with_sinks(plan, q, k, v, o, lse, do, operands, head[6]))
    dq, dk, dv, _ = nonfinite.backward(backend, plan, q, k, v, o, lse, do, operands, check)
    return dq, dk, dv


def _folded_call(kind, static, folded, head, operands):
    """``_call`` of a call of short queries, on the folded call's kernels (the sinks
    joined around them, their gradient summed after)."""
    if not kind.startswith("backward"):
        out = decode.forward(static, folded, *head[:3], operands,
                             lambda inner, q, k, v, ops: _call("forward", inner, q, k, v, *ops))
        return out if kind == "forward" else tuple(attention_sinks.combine(*out, head[3]))

    def run(inner, q, k, v, o, lse, do, ops, dlse, wanted):
        return (*_call("backward", inner, q, k, v, o, lse, do, *ops), {})

    grads = decode.backward(static, folded, *head[:6], operands, None, (), run)[:3]
    return grads if kind == "backward" else (*grads, _sink_gradient(head))


def _sink_gradient(head):
    """The sinks' gradient of a "backward_sinks" call's arrays by the one reduction
    (lowering/sinks.py), for the ways that do not run the backend's own sum."""
    o, lse, do, sinks = head[3:7]
    return attention_sinks.gradient(o, lse, do, None, sinks)


def _partitioned(kind):
    fn = custom_partitioning(functools.partial(_call, kind), static_argnums=(0,))
    fn.def_partition(partition=functools.partial(_partition, kind),
                     sharding_rule=functools.partial(_rule, kind))
    return fn


_PARTITIONED = {kind: _partitioned(kind) for kind in _ARRAYS}


# --------------------------------------------------------------------------- #
# vmap: fold the mapped axes into the batch


def fold_batch(mod: ScoreMod | None, operands, batched, n: int, b: int):
    """The mod and operands of a call whose batch is ``n`` examples of ``b``
    folded into one axis of ``n * b``.

    The folded batch index ``b'`` is ``example * b + b``: the mod's ``b``
    becomes ``b' % b``. A captured array read at ``b`` directly is tiled
    (``n`` copies), or, when vmapped (``batched``: one per example), its
    examples are merged into that axis, and keeps the direct read at ``b'``;
    any other vmapped array gains a leading axis read at ``b' // b``.
    Returns ``(mod, operands)`` (operand values in the new mod's order).
    """
    if mod is None:
        return None, ()
    values = dict(zip(mod.operand_names, operands))
    is_batched = dict(zip(mod.operand_names, batched))
    bvar = ir.var("b")
    within = ops.apply("mod", bvar, ir.const(b, I32))
    example = ops.apply("floordiv", bvar, ir.const(b, I32))
    new_values: dict = {}

    def fold(node, args):
        if node is bvar:
            return within
        if node.op != ir.LOAD:
            return None
        name, shape, dtype = node.args[0].attr
        x, mapped = values[name], is_batched[name]
        idx = node.args[1:]
        axis = next((i for i, a in enumerate(idx) if a is bvar and shape[i] == b and b > 1), None)
        if axis is not None:  # read at b directly: keep it direct over the folded batch
            if mapped:
                x = jnp.moveaxis(x, 0, axis)
                x = x.reshape(x.shape[:axis] + (n * b,) + x.shape[axis + 2:])
            else:
                x = jnp.concatenate([x] * n, axis=axis)
            new_idx = [old if i == axis else new for i, (old, new) in enumerate(zip(idx, args[1:]))]
        elif mapped:
            new_idx = [example, *args[1:]]
        else:
            new_idx = list(args[1:])
        tag = f"{name}_{axis}" if axis is not None else (f"{name}_e" if mapped else name)
        new_shape = tuple(x.shape) if (axis is not None or mapped) else shape
        leaf = ir.operand(tag, new_shape, dtype) if tag != name else node.args[0]
        new_values[tag] = x if tag != name else values[name]
        return ops.apply(ir.LOAD, leaf, *new_idx)

    new = ScoreMod(ir.rebuild(mod.expr, fold))
    return new, tuple(new_values[name] for name in new.operand_names)


def folded_from(name: str, names) -> str:
    """The operand of the original mod (among ``names``) that ``fold_batch``'s
    operand ``name`` comes from: itself, or ``<original>_<axis>`` / ``_e``."""
    return name if name in names else name[:name.rindex("_")]


def fold(x, batched, n):
    """``x`` with its mapped leading axis (broadcast first if unmapped) merged
    into the next one."""
    if not batched:
        x = jnp.broadcast_to(x, (n,) + x.shape)
    return x.reshape((n * x.shape[1],) + x.shape[2:])


def unfold(x, n):
    return x.reshape((n, x.shape[0] // n) + x.shape[1:])


def _batched(kind, static):
    """The ``kind`` call of ``static`` with the batching rule attached."""
    m = _operand_arrays(kind)
    if static.backend.partitioned:
        call = functools.partial(_PARTITIONED[kind], static)
    else:  # one call on whole arrays: XLA gathers shards
        call = functools.partial(_call, kind, static)
    call = jax.custom_batching.custom_vmap(call)

    @call.def_vmap
    def rule(axis_size, in_batched, *arrays):
        n = axis_size
        head = [fold(x, bt, n) for x, bt in zip(arrays[:m], in_batched[:m])]
        b = arrays[0].shape[1] if in_batched[0] else arrays[0].shape[0]
        mod, operands = fold_batch(static.plan.mod, arrays[m:], in_batched[m:], n, b)
        q, k, v = head[:3]
        sub = static.on(Problem.of(q, k, v), mod,
                        "under jax.vmap (the mapped axes folded into the batch)")
        if kind == "forward_sinks" and in_batched[3]:  # sinks per example: not one per head
            outs = attention_sinks.combine(*_batched("forward", sub)(*head[:3], *operands),
                                           head[3])
        elif kind == "backward_sinks":
            # Summed after: the kernel's sum over the folded batch would add up the
            # examples' gradients, each example's own being wanted.
            outs = (*_batched("backward", sub)(*head[:6], *operands), _sink_gradient(head))
        else:
            outs = _batched(kind, sub)(*head, *operands)
        outs = jax.tree.map(lambda x: unfold(x, n), outs)
        return outs, jax.tree.map(lambda _: True, outs)

    return call


def forward(static, q, k, v, operands, sinks=None):
    """``(O, LSE)`` of the backend's forward, partitioned and batched as above; with
    ``sinks`` (float32 [b, hq]; ``static.sinks_inside``), joined in its softmax."""
    if sinks is None:
        return _batched("forward", static)(q, k, v, *operands)
    return _batched("forward_sinks", static)(q, k, v, sinks, *operands)


def backward(static, q, k, v, o, lse, do, operands, dlse=None, wanted=(), sinks=None):
    """``(dQ, dK, dV, gradients of the operands named in wanted, d(sinks) or None)``
    of the backend's backward, partitioned and batched as above; with ``sinks``
    (float32 [b, hq]: no ``dlse`` or ``wanted`` then), their gradient summed by
    the backend (``Backend.sums_sink_gradient``). With the LSE's cotangent
    ``dlse`` or operand gradients (the Pallas kernels compute both; they are
    not partitioned) the backend's backward is called on the arrays as they
    are: JAX batches its kernels under ``jax.vmap``."""
    if sinks is not None:
        dq, dk, dv, dsinks = _batched("backward_sinks", static)(q, k, v, o, lse, do, sinks,
                                                                 *operands)
        return dq, dk, dv, (), dsinks
    if dlse is None and not wanted:
        return (*_batched("backward", static)(q, k, v, o, lse, do, *operands), (), None)
    def run(call, q, k, v, o, lse, do, operands, dlse, wanted):
        return nonfinite.backward(call.backend, call.plan, q, k, v, o, lse, do, operands,
                                  call.options.check_values, dlse, wanted)

    folded = decode.choose(static)
    if folded is None:
        dq, dk, dv, grads = run(static, q, k, v, o, lse, do, operands, dlse, wanted)
    else:
        dq, dk, dv, grads = decode.backward(static, folded, q, k, v, o, lse, do, operands, dlse,
                                            wanted, run)
    return dq, dk, dv, tuple(grads[name] for name in wanted), None
