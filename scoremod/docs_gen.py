"""Generate ``docs/ops.md``, the op reference, from the op table.

    python -m scoremod.docs_gen           # rewrite docs/ops.md
    python -m scoremod.docs_gen --check   # exit 1 if docs/ops.md is stale

Everything in the table comes from ``scoremod.dsl.ops.OPS`` except three
hand-written pieces kept here: friendlier jax.numpy spellings, the typing
signatures in words, and a short text of each derivative rule. Adding an op
to ``OPS`` without a derivative text here is an error (KeyError), so the
reference cannot silently miss an op.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scoremod.dsl.ops import OPS, Op

OPS_MD = Path(__file__).resolve().parent.parent / "docs" / "ops.md"

# How the derivative of each op is formed. ``g`` is the incoming cotangent,
# ``y`` the op's own result, ``a b c`` its arguments; "to a" names the
# argument a term flows to. "0": the op passes no gradient.
DERIVATIVE_TEXT = {
    "add": "g to a, g to b",
    "sub": "g to a, -g to b",
    "mul": "g * b to a, g * a to b",
    "div": "g / b to a, -((g * b ** -2) * a) to b",
    "trunc_div": "0",
    "floordiv": "0",
    "mod": "floats: g to a, where(a % b was corrected, g, 0) - g * trunc(a / b) to b; ints: 0",
    "rem": "floats: g to a, -(g * trunc(a / b)) to b; ints: 0",
    "offset": "0",
    "neg": "-g",
    "abs": "g - relu_grad(2 * g, -a) (abs'(0) = 1, as in JAX)",
    "sign": "0",
    "exp": "g * y",
    "exp2": "(g * ln(2)) * y",
    "log": "g / a",
    "log1p": "g / (a + 1)",
    "expm1": "g * (y + 1)",
    "tanh": "g * ((y + 1) * (1 - y))",
    "sigmoid": "g * (y * (1 - y))",
    "sqrt": "g * (0.5 / y)",
    "rsqrt": "g * ((y / a) * -0.5)",
    "reciprocal": "g * -(a ** -2)",
    "sin": "g * cos(a)",
    "cos": "-(g * sin(a))",
    "erf": "(g * 2/sqrt(pi)) * exp(-a*a)",
    "floor": "0",
    "ceil": "0",
    "integer_pow": "g * n * a ** (n-1)",
    "pow": "g * (b * pow(a, b - 1)) to a, g * (log(where(a == 0, 1, a)) * y) to b (pow(0, b)' = 0, as in JAX)",
    "max": "relu_grad(g, a - b) / 2 + (g - relu_grad(g, b - a)) / 2 to a, the same with a, b swapped to b (ties split evenly, as in JAX)",
    "min": "relu_grad(g, b - a) / 2 + (g - relu_grad(g, a - b)) / 2 to a, the same with a, b swapped to b (ties split evenly, as in JAX)",
    "relu": "relu_grad(g, a) (0 at 0, as jax.nn.relu)",
    "relu_grad": "relu_grad(g, b) to a, none to b",
    "lt": "0",
    "le": "0",
    "gt": "0",
    "ge": "0",
    "eq": "0",
    "ne": "0",
    "and": "0",
    "or": "0",
    "not": "0",
    "where": "where(a, g, 0) to b, where(a, 0, g) to c, none to a",
    "with_grad": "d_i transposed at g (d_i with tangent() replaced by g, its terms without tangent() dropped) to x_i",
    "tangent": "0",
    "f32": "0",
    "i32": "0",
    "bool": "0",
    "load": "0",
}

# Friendlier spellings: what a user writes in jax.numpy (or lax) to get the op.
SPELLING = {
    "add": "`x + y`, `jnp.add`",
    "sub": "`x - y`, `jnp.subtract`",
    "mul": "`x * y`, `jnp.multiply`",
    "div": "`x / y` on floats, `jnp.divide`",
    "trunc_div": "`lax.div(i, j)` on ints",
    "floordiv": "`//` in the text form; jnp `//` traces to trunc_div, rem and where",
    "mod": "`%` in the text form; jnp `%` traces to rem (and where for signed values)",
    "rem": "`lax.rem`, `jnp.fmod`",
    "offset": "none: written by the query-block split, or as `offset(q_idx, 512)` in the text form",
    "with_grad": "a `jax.custom_jvp` function: `jax.nn.softplus`, `jnp.logaddexp`, `jax.nn.relu6`, ... (`jax.nn.relu` becomes relu)",
    "tangent": "none: inside with_grad's derivatives",
    "neg": "`-x`, `jnp.negative`",
    "abs": "`abs(x)`, `jnp.abs`",
    "sign": "`jnp.sign`",
    "exp": "`jnp.exp`",
    "exp2": "`jnp.exp2`",
    "log": "`jnp.log`",
    "log1p": "`jnp.log1p`",
    "expm1": "`jnp.expm1`",
    "tanh": "`jnp.tanh`",
    "sigmoid": "`jax.nn.sigmoid`, `lax.logistic`",
    "sqrt": "`jnp.sqrt`",
    "rsqrt": "`lax.rsqrt`",
    "sin": "`jnp.sin`",
    "cos": "`jnp.cos`",
    "erf": "`jax.scipy.special.erf`, `lax.erf`",
    "floor": "`jnp.floor`",
    "ceil": "`jnp.ceil`",
    "integer_pow": "`x ** n`, `jnp.square`, `lax.integer_pow`",
    "pow": "`x ** y` with a float y, `jnp.power`",
    "max": "`jnp.maximum`, `jnp.clip`",
    "min": "`jnp.minimum`, `jnp.clip`",
    "relu": "`jax.nn.relu` (`jnp.maximum(x, 0.0)` is max)",
    "relu_grad": "(made by derivatives)",
    "lt": "`x < y`",
    "le": "`x <= y`",
    "gt": "`x > y`",
    "ge": "`x >= y`",
    "eq": "`x == y`",
    "ne": "`x != y`",
    "and": "`m & n`, `jnp.logical_and`",
    "or": "`m | n`, `jnp.logical_or`",
    "not": "`~m`, `jnp.logical_not`",
    "where": "`jnp.where(cond, x, y)`, `lax.select`",
    "f32": "`x.astype(jnp.float32)`",
    "i32": "`x.astype(jnp.int32)`",
    "bool": "`x.astype(bool)`",
    "load": "`arr[i, ...]`, `arr[h]`, `lax.dynamic_slice`",
}

# Op.text writes every infix op as ``a OP b``; two ops read better otherwise.
TEXT_OVERRIDE = {
    "integer_pow": "a ** n",  # n is an integer literal
    "load": "name[i, ...]",  # load is not callable by name in the text form
}

SIG_TEXT = {
    "float": "float32 → float32",
    "float2": "float32, float32 → float32",
    "num": "T → T, T float32 or int32",
    "num2": "T, T → T, T float32 or int32",
    "int2": "int32, int32 → int32",
    "cmp": "T, T → bool, T any type",
    "where": "bool, T, T → T",
    "load": "array, one int32 per dim → the array's element type",
    "with_grad": "float32, then pairs of float32 → float32",
}


def signature_text(op: Op) -> str:
    sig = op.sig
    if sig == "logic":
        return ", ".join(["bool"] * op.arity) + " → bool"
    if op.arity == 0:
        return "→ float32"
    if sig.startswith("cast:"):
        return {"f32": "any → float32", "i32": "any → int32", "bool": "any → bool"}[sig[5:]]
    return SIG_TEXT[sig]


def spelling_text(op: Op) -> str:
    parts = [SPELLING[op.name]] if op.name in SPELLING else []
    if op.prims:
        parts.append("primitive " + ", ".join(f"`{p}`" for p in op.prims))
    return "; ".join(parts) or "—"


def _derivative_cell(name: str) -> str:
    text = DERIVATIVE_TEXT[name]
    return text if text == "0" else f"`{text}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


HEADER = """\
# Op reference

<!-- Generated by scoremod/docs_gen.py from scoremod.dsl.ops.OPS. Do not edit by hand. -->

This file is generated from the op table, `scoremod.dsl.ops.OPS`, the one
place every IR operation is defined. Regenerate it after changing the table
with `python -m scoremod.docs_gen` (`--check` only reports whether it is
stale); `tests/test_docs.py` fails while it is out of date.

Columns: **op**, the IR name; **text**, how the op is written in the text
form (`scoremod.parse`, `str(mod)`); **jax.numpy / lax**, what to write in a
traced function and the JAX primitive(s) that trace straight to the op;
**typing**; **derivative**, the reverse-mode rule used to derive
`mod.grad` and the backward pass, where `g` is the incoming gradient, `y`
the op's result and `a b c` its arguments ("0": no gradient flows);
**meaning**. The derivative is taken with respect to the score; captured
arrays (`load`) get their gradients on the reference path, through `jax.grad`.
"""

CONSTRAINTS = """\
## cuDNN constraints the derivative rules respect

The derivative of a mod is built from the same table and must be lowerable
to a cuDNN backward graph, so the rules are written within cuDNN's pointwise
vocabulary:

- **No comparisons on float values.** A piecewise op of a float (`abs`,
  `max`, `min`, `relu`, and `jnp.clip`, which traces to `max`/`min`) never
  differentiates through `x > 0`: its rule uses
  `relu_grad(g, x)` (`g` where `x > 0`, else 0), which maps to cuDNN's
  ReLU-backward pointwise mode. Comparisons in the user's own mod (usually
  on indices, as in masks) are kept as written; `where` passes them through.
- **Scalars are never a first operand.** cuDNN wants a tensor as the first
  input of a pointwise node. Building the IR puts constants second in
  commutative ops (`30 * x` is `x * 30.0`), and the lowering handles the
  rest (`1.0 - x`, `2.0 / x`); the rules do not have to avoid them.
- **Derivatives are computed only in the backward.** The forward graph
  computes the mod and nothing else. The rules reuse the primal node `y`
  (and its arguments) instead of new expressions, so the backward graph,
  which recomputes the forward mod, shares those nodes.
"""


def ops_table() -> str:
    """The markdown table, one row per op of ``OPS`` in table order."""
    missing = [name for name in OPS if name not in DERIVATIVE_TEXT]
    if missing:
        raise KeyError(f"no derivative text in scoremod/docs_gen.py for ops {missing}")
    rows = [
        "| op | text | jax.numpy / lax | typing | derivative | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for op in OPS.values():
        text = TEXT_OVERRIDE.get(op.name, op.text)
        cells = [
            f"`{op.name}`",
            f"`{text}`",
            spelling_text(op),
            signature_text(op),
            _derivative_cell(op.name),
            op.doc,
        ]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows) + "\n"


def ops_markdown() -> str:
    """The whole of ``docs/ops.md``."""
    return f"{HEADER}\n## Operations\n\n{ops_table()}\n{CONSTRAINTS}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scoremod.docs_gen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    parser.add_argument("--output", type=Path, default=OPS_MD, help="default: docs/ops.md")
    args = parser.parse_args(argv)
    text = ops_markdown()
    if args.check:
        fresh = args.output.exists() and args.output.read_text() == text
        print(f"{args.output}: {'up to date' if fresh else 'stale; run python -m scoremod.docs_gen'}")
        return 0 if fresh else 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
