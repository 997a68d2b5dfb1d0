"""Score_mods from a config file, in scoremod's text form, run with attention.

A config (JSON, or YAML when PyYAML is installed) lists mods by name, each
with its text and, optionally, named constants and arrays:

    {"mods": [
      {"name": "softcap", "text": "cap * tanh(score / cap)", "constants": {"cap": 30.0}},
      {"name": "alibi",
       "text": "slopes: float32[4]; where(q_idx >= kv_idx, score + slopes[h] * f32(kv_idx - q_idx), -inf)",
       "arrays": {"slopes": {"dtype": "float32", "values": [0.25, 0.0625, 0.015625, 0.00390625]}}}
    ]}

`scoremod.parse(text, **names)` reads each one: a number becomes a
constant, written into the canonical text and so into the key; an array
becomes an operand, of which only the shape and dtype are in the key (the
arrays are made jax arrays here, so a 0-d value is an operand too; a 0-d
NumPy value would be a constant). A declaration in the text
(`slopes: float32[4];`) checks the array's shape and dtype.

For each mod the script prints its canonical text, its key and its
derivative, checks that the canonical text parses back to the same mod, and
runs attention with it. Arrays indexed by `b`, `h` or a position must cover
the call's sizes; a mod whose arrays are too small for `--seq` (say) is
reported and skipped.

    python examples/config_mods.py                       # examples/config_mods.json
    python examples/config_mods.py --config my_mods.yaml --seq 32
"""

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp

import scoremod

DEFAULT_CONFIG = pathlib.Path(__file__).with_name("config_mods.json")


def read_config(path):
    path = pathlib.Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise SystemExit(f"{path} is YAML: pip install pyyaml, or write it as JSON") from None
        return yaml.safe_load(text)
    return json.loads(text)


def load_mods(config):
    """{name: ScoreMod} from a config dict."""
    mods = {}
    for entry in config["mods"]:
        names = dict(entry.get("constants", {}))
        for name, spec in entry.get("arrays", {}).items():
            names[name] = jnp.asarray(spec["values"], spec.get("dtype", "float32"))
        mods[entry["name"]] = scoremod.parse(entry["text"], **names)
    return mods


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="a .json, .yaml or .yml file")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--implementation", type=lambda t: None if t == "auto" else t,
                   default=None, choices=[None, "xla", "cudnn"], metavar="{auto,xla,cudnn}",
                   help="auto (the default) is implementation=None")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    mods = load_mods(read_config(args.config))
    dtype = jnp.dtype(args.dtype)
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, shape, dtype) for key in keys)
    print(f"{len(mods)} mods from {args.config}; device {jax.devices()[0].device_kind}; "
          f"q, k, v {shape} {dtype.name}")
    attend = jax.jit(lambda q, k, v, mod: scoremod.attention(
        q, k, v, mod, implementation=args.implementation))
    plain = attend(q, k, v, None)  # no mod: plain softmax attention, for comparison

    results = {}
    for name, mod in mods.items():
        print(f"\n[{name}]")
        print(f"  text: {mod}")
        print(f"  key:  {mod.key}")
        print(f"  grad: {mod.grad}")
        roundtrip = scoremod.parse(str(mod)).same_ir(mod)  # declarations keep operands' shapes
        path = args.implementation or scoremod.which_implementation(q, k, v, mod)[0]
        result = {"text": str(mod), "key": mod.key, "roundtrip": roundtrip, "path": path}
        try:
            out = attend(q, k, v, mod)
        except scoremod.ScoreModTypeError as e:
            print(f"  skipped: {e}")
            result["skipped"] = str(e)
        else:
            change = float(jnp.max(jnp.abs(out.astype(jnp.float32) - plain.astype(jnp.float32))))
            result["finite"] = bool(jnp.all(jnp.isfinite(out)))
            result["change_vs_plain"] = change
            print(f"  parse(text) has the same IR: {roundtrip}; ran on the {path} path; output finite: "
                  f"{result['finite']}; max |out - plain attention| {change:.3g}")
        results[name] = result
    return results


if __name__ == "__main__":
    main()
