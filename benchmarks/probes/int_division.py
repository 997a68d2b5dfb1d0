"""Probe: what cuDNN computes for integer division in a score_mod graph.

On the H200 (run of 9dbfdf0) the catalogue's tiled NATTEN came out wrong fused
(O off by 0.896) while NATTEN, whose divisions all divide a position itself,
was right. The fused path now refuses a division of a quotient or remainder in
the graph (``rules._divides_a_quotient``: XLA computes it ahead) and the IR
rewrites such decodings into divisions of the position (``dsl/rewrite.py``;
``(q // a) % b`` is emitted as ``q // a - (q // (a*b)) * b``). This probe runs
index expressions both ways:

- ``graph``: the expression as written, in the cuDNN graph: the nested-division
  rewrites and the refusal are switched off for the probe (``in_graph()``:
  patched in this process only, no library switch);
- ``shipped``: as ``attention()`` runs it today (rewritten; what is still
  nested is computed ahead, shown as ``ahead``).

For each expression ``e`` (int32, of q_idx and kv_idx) and each form it prints
one line:

- ``read``: the value cuDNN computed, read exactly from the LSE of
  ``where(kv == K(q), f32(e), -inf)`` (one key per row, so LSE[q] = e(q, K(q));
  K(q) = 0 for expressions of q alone, S - 1 - q otherwise, so q - kv takes
  both signs); the count of rows that differ from jax.numpy, the first few,
  and which candidate the values match: ``jnp`` (the truth), and the
  lowering's own float formula ``i32(floor(f32(a) / f32(b)))`` in NumPy
  float32 as ``ieee`` (correctly rounded: exact below 2**24), ``rcp`` (a *
  float32(1 / b), which XLA's CPU compiler does for a constant divisor and
  gets (q - k) % 7 wrong at q - k = -217), ``trunc`` (rounding toward zero
  instead of floor);
- ``O``: max |O_fused - O_ref| for the mask ``where(e(q) == e(kv), s, -inf)``
  (``e(q, kv) >= e(q, q)`` for expressions of both), against the reference
  path (``implementation="xla"``); bfloat16, so about 1e-2 is agreement.

Hypotheses it tells apart:

H1  cuDNN's DIV is a * rcp(b) (or approximate): floor(q / b) is one off at
    some multiples of b that are not powers of two (q // 41, q // 55 at
    q = b; (q - 3600) // 7 at -3577: the ``rcp`` candidate), single divisions
    included; powers of two exact (so H1 alone does not explain tiled NATTEN,
    whose divisors are all powers of two).
H2  FLOOR is skipped or the float -> int32 identity truncates/rounds: shows
    on negative dividends ((q - kv) // 3, (q - kv) % 7) as the ``trunc``
    candidate, or at q % 8 >= 4 for rounding.
H3  a value the graph converted float -> INT32 and back is wrong: the
    ``cast`` rows (f32(i32(floor(q / 8.0))), with and without an int add)
    are wrong while ``float-nested`` (floor(floor(q / 8.0) / 2.0), no int
    tensor) is right; nested divisions fail through that round trip.
H4  chained floor/div is wrong as such: ``float-nested`` is wrong too.
H5  size: every small nested piece is right and only the whole catalogue
    expressions (tiled NATTEN's pixel row and column) are wrong.
H6  range (expected, documented): values >= 2**24 round in the float formula
    ((q + 2**24) // 3: the ``ieee`` candidate), and int32 wrap-around
    ((q * 2**25) // 2**25) is XLA's, not the graph's float arithmetic.
If every ``graph`` row is right, the H200 failure was elsewhere (e.g. the
whole mod's graph, H5, or cuDNN's engine choice): rerun the catalogue test.
The ``shipped`` rows must all be right (``ahead`` or ``graph``).

Runs in well under a minute on the H200 (b1 h1 s256 d64, forward only, two
small graphs per expression); ``--budget`` stops starting new expressions
after that many seconds. Off a GPU it runs the reference path only (a check of
the probe itself). ``python benchmarks/probes/int_division.py [--only SUBSTR]``
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import scoremod
from scoremod.dsl import ir, rewrite
from scoremod.dsl.evaluate import evaluate
from scoremod.dsl.ops import OPS
from scoremod.lowering.cudnn import plan as cudnn_plan
from scoremod.lowering.cudnn import rules

S, D = 256, 64
I32 = jnp.int32

# name: (e(q, k) on int32 arrays, whether it reads k)
EXPRESSIONS = {
    # single divisions of a position: the forms NATTEN runs right
    "q // 8": (lambda q, k: q // 8, False),
    "q // 3": (lambda q, k: q // 3, False),
    "q // 7": (lambda q, k: q // 7, False),
    "q // 41": (lambda q, k: q // 41, False),  # q * float32(1/41) < 1 at q = 41
    "q // 55": (lambda q, k: q // 55, False),
    "(q - 3600) // 7": (lambda q, k: (q - 3600) // 7, False),  # rcp wrong at -3577
    "q % 7": (lambda q, k: q % 7, False),
    "(q + 3) // 4": (lambda q, k: (q + 3) // 4, False),
    "q // 8 * 8": (lambda q, k: q // 8 * 8, False),
    # negative dividends
    "(q - k) // 3": (lambda q, k: (q - k) // 3, True),
    "(q - k) % 7": (lambda q, k: (q - k) % 7, True),
    "(q - k) // 8": (lambda q, k: (q - k) // 8, True),
    # nested: in the graph only under in_graph()
    "(q // 8) // 2": (lambda q, k: (q // 8) // 2, False),
    "(q // 3) // 5": (lambda q, k: (q // 3) // 5, False),
    "(q // 8) % 4": (lambda q, k: (q // 8) % 4, False),
    "(q % 16) // 4": (lambda q, k: (q % 16) // 4, False),
    "(q % 64) % 8": (lambda q, k: (q % 64) % 8, False),
    "(q % 7) // 2": (lambda q, k: (q % 7) // 2, False),  # no rewrite: 2 does not divide 7
    "(q // 8 + 1) // 2": (lambda q, k: (q // 8 + 1) // 2, False),  # no rewrite
    "((q - k) // 4) // 2": (lambda q, k: ((q - k) // 4) // 2, True),
    # the float -> int32 -> float round trip, and the same nesting in floats
    "cast f32(i32(floor(q/8.)))": (lambda q, k: jnp.floor(q / 8.0).astype(I32), False),
    "cast i32(floor(q/8.)) + 1": (lambda q, k: jnp.floor(q / 8.0).astype(I32) + 1, False),
    "cast i32(floor(q/8.)) // 2": (lambda q, k: jnp.floor(q / 8.0).astype(I32) // 2, False),
    "float-nested floor(floor(q/8.)/2.)": (
        lambda q, k: jnp.floor(jnp.floor(q / 8.0) / 2.0).astype(I32), False),
    # the catalogue's decodings (GPU shapes)
    "tiled_natten row": (lambda q, k: (q // 64) // 4 * 8 + (q % 64) // 8, False),
    "tiled_natten col": (lambda q, k: (q // 64) % 4 * 8 + (q % 64) % 8, False),
    "block_diffusion (q % 128) // 16": (lambda q, k: (q % 128) // 16, False),
    "sta_2d (q // 64) % 4": (lambda q, k: (q // 64) % 4, False),
    "sta_3d ((q // 32) % 6) // 3": (lambda q, k: ((q // 32) % 6) // 3, False),
    "sta_3d (q // 32) // 6": (lambda q, k: (q // 32) // 6, False),
    # range
    "(q + 2**24) // 3": (lambda q, k: (q + 2**24) // 3, False),
    "(q * 2**25) // 2**25": (lambda q, k: (q * 2**25) // 2**25, False),
}


# Rerun as shipped: those the IR's rewrites change or the fused path computes
# ahead (the others are the same graph in both forms).
SHIPPED = [n for n in EXPRESSIONS if n.startswith(("(q // ", "(q % ", "((q", "tiled", "block",
                                                   "sta_", "cast i32(floor(q/8.)) //"))]


@contextlib.contextmanager
def in_graph():
    """Integer divisions go into the cuDNN graph as written: the IR's
    nested-division rewrites and the lowering's refusal of nested division
    are switched off (in this process, for the probe only)."""
    nested = {op: [f for f in rewrite.PATTERNS.get(op, ())
                   if getattr(f, "__qualname__", "").split(".")[0] not in
                   ("_divide_nested", "_remainder_nested")]
              for op in ("floordiv", "mod", "rem")}
    with mock.patch.dict(rewrite.PATTERNS, nested), \
            mock.patch.object(rules, "_divides_a_quotient", lambda node: False), \
            mock.patch.object(rules, "flat_remainder", lambda node: None):
        _clear()
        try:
            yield
        finally:
            _clear()


def _clear():
    rules.canonical.cache_clear()
    cudnn_plan._cached_plan.cache_clear()


def _readout_key(q, uses_k):
    return jnp.zeros_like(q) if not uses_k else S - 1 - q


def _mods(fn, uses_k):
    """e alone (for the candidates), and the probe's mod: head 0 reads e out
    through the LSE, head 1 masks the score with e (one graph per expression)."""
    def value(s, b, h, q, k):
        return fn(q, k).astype(jnp.float32)

    def probe_mod(s, b, h, q, k):
        key = 0 if not uses_k else S - 1 - q
        read = jnp.where(k == key, fn(q, k).astype(jnp.float32), -jnp.inf)
        keep = fn(q, k) >= fn(q, q) if uses_k else fn(q, k) == fn(k, q)
        return jnp.where(h == 0, read, jnp.where(keep, s, -jnp.inf))

    return scoremod.trace(value), scoremod.trace(probe_mod)


def _candidates(value_mod, q, k):
    """{name: values of e(q, k)} under the lowering's float formula
    ``i32(floor(f32(a) / f32(b)))`` computed three ways in NumPy float32:
    ``ieee`` (correctly rounded division), ``rcp`` (a * float32(1 / b), as a
    compiler's division by a constant may be), ``trunc`` (rounding toward zero
    instead of floor). Integer ops are int32 as in XLA."""
    form = rules.canonical(value_mod.expr)
    inputs = {"score": np.zeros(q.shape, np.float32), "b": np.int32(0), "h": np.int32(0),
              "q_idx": np.asarray(q), "kv_idx": np.asarray(k)}
    return {mode: _eval_np(form, inputs, mode) for mode in ("ieee", "rcp", "trunc")}


def _eval_np(form, inputs, mode):
    vals = {}
    for n in ir.toposort(form, stop=lambda n: n.op == ir.MATERIALIZE):
        if n.op == ir.CONST:
            vals[n] = np.asarray(n.attr, {"f32": np.float32, "i32": np.int32, "bool": np.bool_}[n.dtype])
        elif n.op == ir.VAR:
            vals[n] = inputs[n.attr]
        elif n.op == ir.MATERIALIZE:  # computed ahead by XLA: exact
            vals[n] = np.asarray(evaluate(n.args[0], inputs, {}))
        elif n.op == "div":
            a, b = (vals[x].astype(np.float32) for x in n.args)
            vals[n] = (a * (np.float32(1) / b)).astype(np.float32) if mode == "rcp" else a / b
        elif n.op == "floor":
            x = vals[n.args[0]]
            vals[n] = np.trunc(x) if mode == "trunc" else np.floor(x)
        else:
            vals[n] = np.asarray(OPS[n.op].evaluate([vals[a] for a in n.args], n.attr))
    return vals[form]


def _where(expr) -> str:
    nodes = ir.toposort(rules.canonical(expr))
    return "ahead" if any(n.op == ir.MATERIALIZE for n in nodes) else "graph"


def _inputs():
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    shape = (1, S, 2, D)
    return tuple(jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16) for kk in ks)


def _attend(impl, mod, q, k, v):
    opts = scoremod.LoweringOptions.plain()  # one graph, as written: no native mask, no split
    call = lambda q, k, v: scoremod.attention(  # noqa: E731
        q, k, v, mod, implementation=impl, return_lse=True, options=opts)
    return (jax.jit(call) if impl != "xla" else call)(q, k, v)  # the reference runs eagerly


def probe(name, form, impl, inputs):
    fn, uses_k = EXPRESSIONS[name]
    qi = jnp.arange(S, dtype=I32)
    ki = _readout_key(qi, uses_k)
    want = np.asarray(fn(qi, ki)).astype(np.int64)
    value_mod, mod = _mods(fn, uses_k)
    where = _where(mod.expr)
    try:
        o, lse = _attend(impl, mod, *inputs)
        got = np.asarray(lse[0, 0], np.float64)
        wrong = np.flatnonzero(got != want)
        cands = _candidates(value_mod, qi, ki)
        match = [n for n, c in cands.items() if np.array_equal(c, got)]
        if not len(wrong):
            match.insert(0, "jnp")
        first = ", ".join(f"q={i}: want {want[i]} got {got[i]:g}" for i in wrong[:3])
        read = (f"read {len(wrong):3d}/{S} wrong, matches {'|'.join(match) or 'none'}"
                + (f" ({first})" if first else ""))
        o_ref, _ = _attend("xla", mod, *inputs)
        err = float(jnp.max(jnp.abs(o[:, :, 1].astype(jnp.float32)
                                    - o_ref[:, :, 1].astype(jnp.float32))))
        o_text = f"O max|diff| {err:.3g}"
    except Exception as e:  # a refusal or a build failure is an answer too
        read, o_text = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}", ""
    print(f"{form:7s} {where:5s} {name:36s} {read} | {o_text}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the expressions whose name holds this")
    ap.add_argument("--budget", type=float, default=50.0, help="seconds before stopping")
    args = ap.parse_args()
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    impl = "cudnn" if on_gpu else "xla"
    if not on_gpu:
        print("no GPU: the reference path stands in for cuDNN (checks the probe itself)")
    inputs = _inputs()
    t0, skipped = time.perf_counter(), []
    for form, context, names in (("graph", in_graph, list(EXPRESSIONS)),
                                 ("shipped", contextlib.nullcontext, SHIPPED)):
        with context():
            for name in (n for n in names if args.only in n):
                if time.perf_counter() - t0 > args.budget:
                    skipped.append(f"{form}:{name}")
                    continue
                probe(name, form, impl, inputs)
    if skipped:
        print(f"budget of {args.budget:.0f} s spent; not run: {', '.join(skipped)}")
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
