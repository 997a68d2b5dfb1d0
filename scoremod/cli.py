"""The scoremod command line.

    scoremod demo                          # softcap + causal attention, both paths
    scoremod show "30.0 * tanh(score / 30.0)"
    scoremod show "cap * tanh(score / cap)" --set cap=30.0
    scoremod show mypackage.mods:softcap   # import a function (or ScoreMod) and trace it
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import time

_IMPORT_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def _timed(fn, *args, repeat=5, **kwargs):
    """(result, seconds per call) of a jitted ``fn``, compile excluded."""
    import jax

    out = jax.block_until_ready(fn(*args, **kwargs))  # compile and warm up
    start = time.perf_counter()
    for _ in range(repeat):
        out = jax.block_until_ready(fn(*args, **kwargs))
    return out, (time.perf_counter() - start) / repeat


def demo(args) -> int:
    import jax
    import jax.numpy as jnp

    import scoremod
    from scoremod.lowering import cudnn_path

    cap = 30.0

    def softcap_causal(score, b, h, q_idx, kv_idx):
        return jnp.where(q_idx >= kv_idx, cap * jnp.tanh(score / cap), -jnp.inf)

    mod = scoremod.trace(softcap_causal)
    print(f"mod:       {mod}")
    print(f"key:       {mod.key}")
    print(f"grad:      {mod.grad}")

    shape = (2, 256, 4, 64)  # batch, seq, heads, head_dim
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in (kq, kk, kv))
    picked = "cudnn" if cudnn_path.usable(q, k, v, mod) else "xla"
    device = jax.devices()[0]
    print(f"backend:   {jax.default_backend()} ({device.device_kind})")
    print(f"q, k, v:   {shape} {q.dtype}")
    print(f"implementation=None runs: {picked} (cudnn_path.usable: {picked == 'cudnn'})")

    def forward(q, k, v, impl):
        return scoremod.attention(q, k, v, mod, implementation=impl)

    def loss(q, k, v, impl):
        return jnp.sum(forward(q, k, v, impl).astype(jnp.float32) ** 2)

    fwd = jax.jit(forward, static_argnames="impl")
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnames="impl")
    results = {}
    for label, impl in (("None", None), ("xla", "xla")):
        out, t_fwd = _timed(fwd, q, k, v, impl=impl)
        grads, t_bwd = _timed(bwd, q, k, v, impl=impl)
        results[label] = out, grads
        norms = ", ".join(f"d{n} {float(jnp.linalg.norm(g.astype(jnp.float32))):.4g}"
                          for n, g in zip("qkv", grads))
        print(f"[{label:>4}] out {out.shape} {out.dtype}; forward {t_fwd * 1e3:.2f} ms/call, "
              f"grad {t_bwd * 1e3:.2f} ms/call; grad norms {norms}")

    (out_a, grads_a), (out_b, grads_b) = results["None"], results["xla"]

    def maxdiff(a, b):
        return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))

    print(f"max |out(None) - out(xla)| = {maxdiff(out_a, out_b):.3g}")
    print("max |grad(None) - grad(xla)| = "
          + ", ".join(f"d{n} {maxdiff(a, b):.3g}" for n, a, b in zip("qkv", grads_a, grads_b)))
    return 0


def _value(text):
    """A --set value: an int or float literal."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(f"{text!r} is not a number")


def load_mod(expr: str, names: dict):
    """A ScoreMod from text, or from ``module:function`` (imported and traced)."""
    import scoremod

    if _IMPORT_SPEC.fullmatch(expr):
        module_name, attr = expr.split(":")
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise ImportError(f"{module_name} has no attribute {attr!r}")
            obj = getattr(obj, part)
        return scoremod.trace(obj)
    return scoremod.parse(expr, **names)


def show(args) -> int:
    mod = load_mod(args.expr, dict(args.set))
    print(f"text:               {mod}")
    print(f"key:                {mod.key}")
    print(f"grad:               {mod.grad}")
    print(f"has_computed_index: {mod.has_computed_index}")
    if not mod.operand_nodes:
        print("operands:           none")
    for node, value in zip(mod.operand_nodes, mod.operands):
        name, shape, dtype = node.attr
        state = "unbound: give it with mod.bind" if value is None else "bound"
        print(f"operand:            {name}: {dtype}{list(shape)} ({state})")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scoremod", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run softcap + causal attention on both paths").set_defaults(
        run=demo)
    p = sub.add_parser("show", help="print a mod's canonical text, key and gradient")
    p.add_argument("expr", help='text form ("30.0 * tanh(score / 30.0)") or module:function')
    p.add_argument("--set", "-s", action="append", default=[], metavar="NAME=NUMBER",
                   type=_name_value, help="a constant the text names")
    p.set_defaults(run=show)
    args = parser.parse_args(argv)

    from scoremod.errors import ScoreModError

    try:
        return args.run(args)
    except (ScoreModError, ImportError) as e:
        msg = str(e)
        if "unknown name" in msg:
            name = re.search(r"unknown name '(\w+)'", msg)
            name = name.group(1) if name else "NAME"
            msg += f"\nOn the command line, write the number in its place or pass --set {name}=<number>"
        print(f"scoremod {args.command}: {type(e).__name__}: {msg}", file=sys.stderr)
        return 2


def _name_value(text):
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=NUMBER, got {text!r}")
    return name, _value(value)


if __name__ == "__main__":
    sys.exit(main())
