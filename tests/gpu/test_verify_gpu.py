"""The cuDNN conformance check on a GPU: ``scoremod doctor --verify`` for real,
and the check at the first automatic use of a cuDNN taken for an unverified one.

The version check's rules, on a faked GPU, are tests/test_verify.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod import device, support
from scoremod.cli import main
from scoremod.lowering.cudnn import verify

pytestmark = pytest.mark.gpu


@pytest.fixture
def verdicts(monkeypatch, tmp_path):
    monkeypatch.setenv("SCOREMOD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SCOREMOD_CUDNN_VERIFY", raising=False)
    verify.forget()
    yield tmp_path / verify.SUBDIR
    verify.forget()


def test_doctor_verify_passes_on_this_gpu(verdicts, capsys):
    rc = main(["doctor", "--verify"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    assert len(rows) == len(verify.CASES) * len(verify.DTYPES), out
    assert all(row[2] == "ok" for row in rows), out  # none refused, none wrong on this cuDNN
    key = verify.current_key()
    found = verify.read(key)
    assert found.passed and len(found.results) == len(rows)
    assert (verdicts / key.file_name()).is_file()
    assert verify.status_line().startswith("verified on this GPU: PASSED")


def test_an_unverified_cudnn_is_checked_at_its_first_automatic_use(verdicts, monkeypatch):
    """The loaded cuDNN reported as 9.27: the first implementation=None call, made
    while a jitted function is traced, runs the check (a few cases, for time) on
    the real fused path, and then runs fused. (The loaded one need not be
    validated: on another cuDNN, 9.28 say, the verdicts folder is new all the same.)"""
    version, path = device.loaded_cudnn_version()
    assert support.cudnn_supported(version)
    monkeypatch.setattr(device, "loaded_cudnn_version", lambda: (92700, path))
    monkeypatch.setattr(verify, "CASES", tuple(c for c in verify.CASES
                                              if c.name in ("softcap", "document_ragged")))
    softcap = scoremod.trace(lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0))
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (2, 256, 4, 64), jnp.bfloat16) for key in ks)
    with pytest.warns(UserWarning, match="checking it on this GPU now, once"):
        out = jax.jit(lambda q, k, v: scoremod.attention(q, k, v, softcap))(q, k, v)
    found = verify.read(verify.current_key())
    assert found.passed and [r.status for r in found.results] == ["ok"] * 4, found.summary()
    assert scoremod.which_implementation(q, k, v, softcap).implementation == "cudnn"
    want = scoremod.attention(q, k, v, softcap, implementation="xla")
    assert verify.relative_error(out, want) < verify.TOLERANCE["bfloat16"]
    assert np.isfinite(np.asarray(out, np.float32)).all()
