"""The scripts in examples/ run, small, and what they report is right.

Each example's ``main(argv)`` takes size flags and returns a dict of what it
checked; these tests run them with tiny sizes and assert on those results.
"""

import importlib.util
import json
import pathlib
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    """Import examples/<name>.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


SMALL = ["--batch", "1", "--seq", "32", "--head-dim", "16"]


def test_every_example_is_listed_in_the_readme():
    readme = (EXAMPLES / "README.md").read_text()
    for path in EXAMPLES.glob("*.py"):
        assert f"`{path.name}`" in readme, f"{path.name} is missing from examples/README.md"
        assert '"""' in path.read_text().split("\n", 1)[0], f"{path.name} has no docstring"


def test_quickstart(capsys):
    r = load("quickstart").main(SMALL + ["--heads", "4", "--kv-heads", "2", "--dtype", "float32"])
    assert r["output_shape"] == (1, 32, 4, 16)
    for name in ("out", "dq", "dk", "dv"):
        assert r["xla"][name] < 1e-5, (name, r)    # float32: agree to rounding
        assert r["plain"][name] < 1e-5, (name, r)
    out = capsys.readouterr().out
    assert "where(q_idx >= kv_idx, tanh(score / 30.0) * 30.0, -inf)" in out
    assert "implementation=None runs the" in out


def test_gemma2_block(capsys):
    r = load("gemma2_block").main(
        ["--layers", "2", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
         "--head-dim", "16", "--mlp-dim", "64", "--vocab", "64", "--batch", "1",
         "--seq", "24", "--window", "8"])
    texts, keys = r["mod_texts"], r["mod_keys"]
    assert texts[0] == ("where(q_idx >= kv_idx and q_idx - kv_idx < 8, "
                        "tanh(score / 50.0) * 50.0, -inf)")
    assert texts[1] == "where(q_idx >= kv_idx, tanh(score / 50.0) * 50.0, -inf)"
    assert keys[0] != keys[1]
    assert r["grads_finite"]
    assert r["loss_diff"] < 1e-2 and r["grad_max_rel_diff"] < 3e-2, r  # bf16 attention
    assert 2.0 < r["loss_scoremod"] < 8.0  # about log(vocab) at initialization
    out = capsys.readouterr().out
    assert "layer 0 sliding" in out and "layer 1 global" in out


def test_gemma2_layers_alternate():
    m = load("gemma2_block")
    cfg = m.parse_args(["--layers", "5", "--window", "7"])
    assert m.layer_windows(cfg) == [7, None, 7, None, 7]


def test_alibi_slopes_are_the_standard_ones():
    slopes = load("alibi").alibi_slopes
    assert slopes(8) == [2.0 ** -i for i in range(1, 9)]
    assert slopes(4) == [2.0 ** (-2 * i) for i in range(1, 5)]
    # Not a power of two: the 4 slopes of 4 heads, then every other slope of 8 heads.
    assert slopes(6) == [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    assert slopes(12)[8:] == pytest.approx([2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5])


def test_alibi(capsys):
    r = load("alibi").main(SMALL + ["--heads", "6", "--kv-heads", "2"])
    assert r["slopes"] == [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    assert r["same_key"] and r["constant_keys_differ"]
    assert r["compilations"] == 1  # other slope values reuse the compiled function
    assert r["diff slopes"] < 3e-2 and r["diff slopes / 2"] < 3e-2, r
    assert "c0: float32[6]" in capsys.readouterr().out


def test_document_masking():
    m = load("document_masking")
    r = m.main(SMALL + ["--batch", "2", "--heads", "2", "--kv-heads", "1", "--docs", "3"])
    assert r["documents"] == 6
    assert r["max_diff"] < 4e-2, r          # packed == each document alone (bf16 ulps)
    assert r["gradient_leak"] == 0.0        # exactly no gradient across documents
    assert r["gradient_inside_norm"] > 0
    assert r["same_key"]


def test_document_masking_check_has_teeth(monkeypatch):
    """With a plain causal mask instead, the isolation checks must fail."""
    m = load("document_masking")
    monkeypatch.setattr(m, "document_mod", lambda ids: m.scoremod.trace(m.causal))
    r = m.main(SMALL + ["--batch", "1", "--heads", "1", "--docs", "3"])
    assert r["max_diff"] > 0.1 and r["gradient_leak"] > 0


def test_t5_relative_bias(capsys):
    m = load("t5_relative_bias")
    r = m.main(SMALL + ["--heads", "2", "--steps", "5", "--num-buckets", "16",
                        "--max-distance", "32"])
    assert r["buckets_match"]
    assert r["forward_diff"] < 3e-2, r
    assert r["grad_norm"] > 0 and r["table_change"] > 0
    assert r["losses"][-1] < r["losses"][0]
    out = capsys.readouterr().out
    assert "has_computed_index: True" in out
    # float -> int inside an index is XLA's to compute (materialized), not cuDNN's
    assert "T5's float log:  supported; the table lookup is materialized" in out


def test_t5_integer_buckets_match_t5_formula():
    import jax
    import numpy as np

    m = load("t5_relative_bias")
    for nb, md in ((32, 128), (32, 64), (64, 256)):
        rel = np.arange(-3 * md, 3 * md + 1)
        got = np.asarray(jax.jit(m.make_bucket_fn(nb, md))(0, rel))
        np.testing.assert_array_equal(got, m.t5_bucket_reference(rel, nb, md))


def test_tiny_lm_nnx():
    pytest.importorskip("flax.nnx", reason="tiny_lm_nnx.py needs flax")
    r = load("tiny_lm_nnx").main(
        ["--steps", "40", "--batch", "8", "--seq", "32", "--d-model", "32", "--layers", "1",
         "--heads", "2", "--head-dim", "16", "--vocab", "16", "--period", "4",
         "--log-every", "10", "--lr", "1e-2"])
    assert r["last_loss"] < r["first_loss"] - 0.5, r["history"]
    assert r["ms_per_step"] > 0


def test_tiny_lm_nnx_exits_clearly_without_flax(monkeypatch):
    monkeypatch.setitem(sys.modules, "flax", None)  # import flax raises ImportError
    with pytest.raises(SystemExit, match="needs Flax"):
        load("tiny_lm_nnx")


def test_config_mods(capsys):
    m = load("config_mods")
    r = m.main(["--batch", "2", "--seq", "16", "--heads", "4", "--head-dim", "16"])
    assert set(r) == {"softcap", "causal", "sliding_window", "alibi", "document_mask",
                      "prefix_lm", "temperature"}
    assert len({x["key"] for x in r.values()}) == len(r)  # all different mods
    for name, x in r.items():
        assert x["roundtrip"] and x["finite"] and "skipped" not in x, (name, x)
    assert r["softcap"]["text"] == "tanh(score / 30.0) * 30.0"
    # The config's softcap is the same mod as the jax.numpy function: same key.
    traced = m.scoremod.trace(lambda score, b, h, q_idx, kv_idx: 30.0 * m.jnp.tanh(score / 30.0))
    assert r["softcap"]["key"] == traced.key
    assert r["sliding_window"]["text"].startswith("where(q_idx >= kv_idx and q_idx - kv_idx < 8")
    assert r["alibi"]["text"].startswith("slopes: float32[4];")


def test_config_mods_yaml_and_too_small_arrays(tmp_path):
    yaml = pytest.importorskip("yaml")
    m = load("config_mods")
    config = json.loads((EXAMPLES / "config_mods.json").read_text())
    config["mods"] = [x for x in config["mods"] if x["name"] in ("softcap", "document_mask")]
    path = tmp_path / "mods.yaml"
    path.write_text(yaml.safe_dump(config))
    r = m.main(["--config", str(path), "--batch", "2", "--seq", "40", "--heads", "2",
                "--head-dim", "16"])
    assert r["softcap"]["finite"]
    assert "indexed by q_idx" in r["document_mask"]["skipped"]  # ids cover 32 positions


@pytest.mark.gpu
def test_quickstart_takes_the_fused_path_on_a_gpu(capsys):
    r = load("quickstart").main(["--batch", "1", "--seq", "256", "--heads", "4",
                                 "--kv-heads", "2", "--head-dim", "64"])  # bf16 by default
    assert r["fused"], capsys.readouterr().out
    for name in ("out", "dq", "dk", "dv"):
        assert r["xla"][name] < 3e-2 and r["plain"][name] < 3e-2, (name, r)
