"""The scoremod command line.

    scoremod demo                          # softcap + causal attention, as picked and reference
    scoremod doctor                        # versions, GPU, extension: can the fused path run here?
    scoremod doctor --verify               # check the loaded cuDNN on this GPU, keep the verdict
    scoremod show "30.0 * tanh(score / 30.0)"
    scoremod show "cap * tanh(score / cap)" --set cap=30.0
    scoremod show mypackage.mods:softcap   # import a function (or ScoreMod) and trace it
    python benchmarks/run.py --help        # the benchmark harness (in a checkout, not installed)
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
    choice = scoremod.which_implementation(q, k, v, mod)
    picked, refused = choice.implementation, choice.verdicts["cudnn"]
    device = jax.devices()[0]
    print(f"backend:   {jax.default_backend()} ({device.device_kind})")
    print(f"q, k, v:   {shape} {q.dtype}")
    why = "" if refused is None else f" (fused cuDNN path not taken: {refused.splitlines()[0]})"
    print(f"implementation=None runs: {picked}{why}")

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
    show_lowering(mod)
    if not mod.operand_nodes:
        print("operands:           none")
    for node, value in zip(mod.operand_nodes, mod.operands):
        name, shape, dtype = node.attr
        state = "unbound: give it with mod.bind" if value is None else "bound"
        print(f"operand:            {name}: {dtype}{list(shape)} ({state})")
    return 0


def show_lowering(mod) -> None:
    """What the fused path makes of ``mod``: support, cuDNN nodes, both callbacks."""
    from collections import Counter

    from scoremod.dsl.text import format_mod
    from scoremod.errors import ScoreModError
    from scoremod.lowering.cudnn import graph as cudnn_graph
    from scoremod.lowering.cudnn import rules as cudnn_rules
    from scoremod.dsl import ir
    from scoremod.lowering.cudnn.table import INPUT_TENSORS, TABLE

    try:
        cudnn_rules.check_supported(mod.expr, mod.sources)
        fwd, bwd = cudnn_rules.forward_and_backward(mod.expr)
    except ScoreModError as e:
        print(f"fused cuDNN path:   not supported: {e}")
        return
    here = _runnable_here()
    print("fused cuDNN path:   supported by the lowering; "
          + ("runnable here" if here is None else f"not runnable here: {here}"))
    from scoremod.lowering.cudnn import masks

    band = masks.native_band(cudnn_rules.canonical(mod.expr), 4096, 4096)
    if band is not None:
        print(f"{'':20s}a pure mask: runs as plain attention under cuDNN's native mask "
              f"(at Sq = Skv = 4096: {band}); the score_mod below is the form used otherwise")
    in_fwd = set(cudnn_graph.emission_order(fwd))
    for label, expr in (("score_mod", fwd), ("score_mod_bprop", bwd)):
        # bprop reuses what score_mod emitted; count only what it adds
        nodes = [n for n in cudnn_graph.emission_order(expr) if expr is fwd or n not in in_fwd]
        counts = Counter(
            "gen_index" if n.op == ir.VAR and n.attr not in (ir.SCORE, ir.COTANGENT)
            else "scalar" if n.op == ir.CONST
            else "tensor input" if n.op in INPUT_TENSORS
            else TABLE[n.op].emit.node
            for n in nodes if not (n.op == ir.VAR and n.attr in (ir.SCORE, ir.COTANGENT)))
        print(f"{label + ':':20s}{format_mod(expr)}")
        print(f"{'':20s}cuDNN nodes: {', '.join(f'{k} x{v}' for k, v in sorted(counts.items()))}")


def _runnable_here() -> str | None:
    """Why this machine cannot run the fused path (first line), or None when it can."""
    import jax.numpy as jnp

    import scoremod

    q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    choice = scoremod.which_implementation(q, q, q)
    return None if choice.implementation == "cudnn" else (
        choice.verdicts["cudnn"] or choice.reason).splitlines()[0]


def doctor(args) -> int:
    from scoremod import doctor as doctor_module

    return doctor_module.main(verify=args.verify)


def check(args) -> int:
    """Each fused backend that takes the mod here (or the one named) against the
    reference path on this machine: max errors of O, dQ, dK, dV (and d(sinks),
    with --sinks), times, and whether a second run gives the same bits (with
    --deterministic, under LoweringOptions(deterministic=True))."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import scoremod

    from scoremod.attention import check_implementation

    check_implementation(args.implementation)  # a wrong name fails before anything runs
    mod = load_mod(args.expr, dict(args.set))
    dtype = jnp.dtype(args.dtype)
    b, h, s, d = args.batch, args.heads, args.seq, args.head_dim
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (b, s, h, d), jnp.float32).astype(dtype) for key in ks)
    sinks = None if args.sinks is None else jnp.full((h,), args.sinks, jnp.float32)
    options = scoremod.LoweringOptions(deterministic=True) if args.deterministic else None
    print(f"mod:   {mod}")
    print(f"shape: batch {b}, heads {h}, seq {s}, head_dim {d}, {dtype.name}"
          + ("" if sinks is None else f", a sink of {args.sinks} per head"))

    def run(impl):
        def step(q, k, v, sinks):
            o, vjp = jax.vjp(lambda q, k, v, sinks: scoremod.attention(
                q, k, v, mod, implementation=impl, sinks=sinks, options=options), q, k, v, sinks)
            return (o, *vjp(do))

        step = jax.jit(step)
        out, seconds = _timed(step, q, k, v, sinks)
        return out, seconds, step(q, k, v, sinks)  # another run, for the bits

    choice = scoremod.which_implementation(q, k, v, mod, sinks=sinks, options=options)
    if args.implementation:  # by name: it runs or says why not (interpret mode off a GPU)
        fused = [args.implementation]
    else:
        fused = [name for name, why in choice.verdicts.items() if why is None and name != "xla"]
    if not fused:  # said before the reference is timed: nothing to compare it with
        print(f"fused path not run: {choice.verdicts['cudnn']}")
        return 0
    ref, t_ref, _ = run("xla")
    print(f"reference (xla):    {t_ref * 1e3:8.3f} ms per forward+backward")
    labels = ("O", "dQ", "dK", "dV", "dsinks")
    for name in fused:
        # the chosen backend runs as implementation=None: under --deterministic its
        # backward may run elsewhere, which the backend by name refuses
        out, seconds, again = run(None if name == choice[0] and not args.implementation
                                  else name)
        print(f"fused ({name}):{'':{max(1, 11 - len(name))}s}{seconds * 1e3:8.3f} ms per "
              "forward+backward" + (" (chosen by implementation=None)" if name == choice[0]
                                    else ""))
        if name == choice[0] and choice.backward:
            print(f"  backward: {choice.backward}")
        differ = [label for label, a, b in zip(labels, out, again)
                  if a is not None and not np.array_equal(np.asarray(a), np.asarray(b))]
        print("  a second run: " + ("the same bits" if not differ else
                                    f"{', '.join(differ)} differ in their bits"))
        for label, a, r in zip(labels, out, ref):
            if a is None:  # no sinks: their gradient is None
                continue
            a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
            err = float(np.max(np.abs(a - r)))
            print(f"max |{label:2s} {name} - reference| = {err:.3e}  "
                  f"(relative {err / (np.max(np.abs(r)) + 1e-12):.2e})")
    return 0


BENCH_MOVED = (
    "scoremod bench: the benchmark harness is not part of the installed package; it lives in "
    "the repository's benchmarks/ folder. From a checkout, run\n"
    "    python benchmarks/run.py ARGS   (python benchmarks/run.py --help for the options)\n"
    "It needs an NVIDIA GPU; --dry-run runs a tiny CPU smoke test.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scoremod", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run softcap + causal attention as implementation=None "
                   "picks and on the reference path").set_defaults(run=demo)
    for name in ("doctor", "info"):
        p = sub.add_parser(name, help="versions, GPU, cuDNN and the extension: can the fused "
                           "path run here, and if not, why" if name == "doctor"
                           else "same as doctor")
        p.add_argument("--verify", action="store_true", help=(
            "check the loaded cuDNN on this GPU now: a conformance set of mods covering the "
            "graph shapes scoremod emits, forward and dQ/dK/dV in bfloat16 and float16, "
            "against the reference path (a minute or two). The verdict is kept in the cache "
            "folder (<cache root>/cudnn-verdicts), keyed by cuDNN, frontend, GPU architecture "
            "and scoremod version; implementation=None uses a cuDNN outside the validated "
            "line only once its verdict passed. Exit status 0: passed, 1: failed or known to "
            "be bad, 2: cannot check here"))
        p.set_defaults(run=doctor)
    p = sub.add_parser("show", help="print a mod's canonical text, key and gradient")
    p.add_argument("expr", help='text form ("30.0 * tanh(score / 30.0)") or module:function')
    p.add_argument("--set", "-s", action="append", default=[], metavar="NAME=NUMBER",
                   type=_name_value, help="a constant the text names")
    p.set_defaults(run=show)
    p = sub.add_parser("check", help="run the fused backends against the reference on this "
                       "machine")
    p.add_argument("expr", help='text form or module:function')
    p.add_argument("--set", "-s", action="append", default=[], metavar="NAME=NUMBER",
                   type=_name_value, help="a constant the text names")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--sinks", type=float, metavar="LOGIT",
                   help="attention sinks: this logit for every head (docs/guide.md)")
    p.add_argument("--implementation", metavar="NAME",
                   help="check this backend only (default: every fused one that takes the mod "
                        "here); 'pallas' runs in interpret mode off a GPU")
    p.add_argument("--deterministic", action="store_true",
                   help="under LoweringOptions(deterministic=True): gradients that repeat "
                        "bitwise (cuDNN's forward, the Pallas kernels' backward)")
    p.set_defaults(run=check)
    sub.add_parser("bench", add_help=False, help="moved: python benchmarks/run.py (in a checkout)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        print(BENCH_MOVED, file=sys.stderr)
        return 2
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    from scoremod.errors import ScoreModError

    try:
        rc = args.run(args)
        sys.stdout.flush()  # a closed pipe (`| head`) shows here, not at exit
        return rc
    except BrokenPipeError:
        # The reader went away: say nothing more, and keep Python's exit-time
        # flush from reporting the same broken pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
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
