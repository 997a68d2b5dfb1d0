"""The benchmark harness's GPU rows compute what they claim, at a small shape.

FlexAttention's document_softcap (block mask and softcap score_mod) and its
operand-gradient row (ALiBi's slopes with requires_grad) against
the harness's own xla row on the same values; and the scoremod row, run with
implementation=None, records the backend that ran: cuDNN for fwd+bwd, the
Pallas kernels it falls back to for the gradients of the captured arrays.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from benchmarks import harness as bench
from tests.gpu.test_fused import _rel_err

pytestmark = pytest.mark.gpu

TOL = 1e-2  # float16 inputs, float32 reference on the same (rounded) values


def _shape(gain=1.0):
    """A float16 shape whose xla row reads the torch inputs' values (q and k times
    ``gain``: scores of tens, where the softcap bends them)."""
    pytest.importorskip("torch")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    shape = bench.Shape(2, 4, 256, 64, "float16", window=32)
    q, k, v, do = shape.torch_inputs()
    scaled = [gain * q, gain * k, v, do]
    same = [jnp.asarray(t.float().cpu().numpy()) for t in scaled]
    shape.torch_inputs, shape.jax_inputs = (lambda: scaled), (lambda: same)
    return shape


def _bhsd(t):
    """A FlexAttention [B, H, S, D] result as numpy [B, S, H, D]."""
    return t.transpose(1, 2).float().cpu().numpy()


def test_flex_document_softcap_is_the_xla_rows_attention():
    shape = _shape(gain=4.0)
    flex, _, variant = bench.make_call("flex", "document_softcap", shape, "fwd")
    xla, _, _ = bench.make_call("xla", "document_softcap", shape, "fwd")
    assert variant == "block mask"
    want = np.asarray(xla())
    assert _rel_err(_bhsd(flex()), want) < TOL
    mask_only, _, _ = bench.make_call("flex", "document", shape, "fwd")  # without the softcap
    assert _rel_err(_bhsd(mask_only()), want) > 10 * TOL


# relbias: FlexAttention finds no Triton configuration for its table's gradient that
# fits shared memory (torch 2.11, even at this shape); its benchmark row records that.
@pytest.mark.parametrize("name", ["alibi"])
def test_flex_operand_gradients_are_the_xla_rows(name):
    shape = _shape()
    flex, _, _ = bench.make_call("flex", name, shape, bench.OPS)
    xla, _, _ = bench.make_call("xla", name, shape, bench.OPS)
    got, want = flex(), xla()
    assert len(got) == 4 and len(want) == 5  # flex: the gradients; xla: O first
    for g, w in zip(got[:3], want[1:4]):  # dQ, dK, dV
        assert _rel_err(_bhsd(g), w) < TOL
    learned = got[3].float().cpu().numpy()
    assert learned.shape == want[4].shape and np.abs(want[4]).max() > 0
    assert _rel_err(learned, want[4]) < 5 * TOL  # summed over S * S scores


def test_scoremod_row_records_cudnn_then_pallas_for_operand_gradients(tmp_path):
    out = tmp_path / "b.json"
    assert bench.main(["--impls", "scoremod,pallas", "--mods", "alibi,document_softcap", "--seqs",
                       "512", "--head-dims", "64", "--long", "0", "--batch", "1", "--heads", "2",
                       "--reps", "2", "--iters", "2", "--directions", "fwd,fwdbwd,fwdbwd_ops",
                       "--json", str(out)]) == 0
    got = {(r["mod"], r["impl"], r["direction"]): r for r in json.loads(out.read_text())["results"]}
    assert all(r["status"] == "ok" for r in got.values()), got
    assert set(got) == {("alibi", i, d) for i in ("scoremod", "pallas")
                        for d in ("fwd", "fwdbwd", bench.OPS)} | {
        ("document_softcap", i, d) for i in ("scoremod", "pallas") for d in ("fwd", "fwdbwd")}
    assert got["alibi", "scoremod", "fwdbwd"]["backend"] == "cudnn"
    ops = got["alibi", "scoremod", bench.OPS]
    assert ops["backend"] == "pallas (fallback from cudnn)", ops
    assert any("gradients for score_mod operands" in w for w in ops["warnings"])
    shape = bench.Shape(1, 2, 512, 64, "bfloat16", 256)
    q, k, v, _ = shape.jax_inputs()
    planned = scoremod.which_implementation(q, k, v, shape.mod("document_softcap")).implementation
    assert got["document_softcap", "scoremod", "fwd"]["backend"] == planned
