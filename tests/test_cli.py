"""The command line: show and check (demo is run by tests/test_docs.py's README check)."""

import pytest

import scoremod

from scoremod.cli import main


def test_show_prints_text_key_grad_and_lowering(capsys):
    assert main(["show", "where(q_idx >= kv_idx, cap * tanh(score / cap), -inf)", "--set", "cap=30"]) == 0
    out = capsys.readouterr().out
    assert "text:               where(q_idx >= kv_idx, tanh(score / 30.0) * 30.0, -inf)" in out
    assert "fused cuDNN path:   supported" in out
    assert "cmp_ge x1" in out and "tanh x1" in out and "binary_select" in out
    bprop = out.split("score_mod_bprop:")[1]
    assert "tanh" not in bprop.split("cuDNN nodes:")[1]  # reused from score_mod, not recomputed


def test_show_explains_refusal(capsys):
    assert main(["show", "where(score > 0.5, score, 0.0)"]) == 0
    out = capsys.readouterr().out
    assert "not supported" in out and "compares float values" in out


def test_show_unknown_name_suggests_set(capsys):
    assert main(["show", "cap * tanh(score / cap)"]) == 2
    assert "--set cap=" in capsys.readouterr().err


def test_check_runs_reference_and_says_why_not_fused(capsys):
    import jax.numpy as jnp

    q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
    if scoremod.which_implementation(q, q, q).verdicts["cudnn"] is None:
        pytest.skip("a GPU is present: the fused comparison runs instead")
    assert main(["check", "30.0 * tanh(score / 30.0)", "--seq", "64", "--heads", "2", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "reference (xla)" in out and "fused path not run: no NVIDIA GPU" in out


@pytest.mark.gpu
def test_check_compares_fused_with_reference_on_a_gpu(capsys):
    assert main(["check", "30.0 * tanh(score / 30.0)", "--seq", "256", "--heads", "4",
                 "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "fused (cudnn)" in out
    for name in ("O ", "dQ", "dK", "dV"):
        line = next(l for l in out.splitlines() if l.startswith(f"max |{name}"))
        assert float(line.split("relative ")[1].rstrip(")")) < 3e-2, line
