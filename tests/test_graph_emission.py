"""The graph builders, run on a CPU against a recording stand-in for the cuDNN frontend.

The GPU suite checks what cuDNN computes; this checks, without a GPU, that
every plan of the suite's mods builds its forward and backward graphs (no
exception on any path of the builders) with the tensors, strides, scale and
scalars the plan describes."""

import dataclasses
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.lowering.cudnn import graph as cg
from scoremod.lowering.cudnn.plan import Plan
from scoremod.lowering.problem import Problem
from tests.test_cudnn_rules import CENSUS_MASKS
from tests.test_plans import CASES


class Recorder:
    def __init__(self):
        self.calls, self.tensors = [], []

    def tensor(self, origin):
        t = FakeTensor(self, origin)
        self.tensors.append(t)
        return t


class FakeTensor:
    def __init__(self, rec, origin, **kw):
        self.rec, self.origin, self.props = rec, origin, dict(kw)

    def __getattr__(self, name):
        def setter(*a, **kw):
            self.props[name.removeprefix("set_")] = a[0] if a else kw
            return self
        return setter


class FakeGraph:
    selected_engine = None

    def __init__(self, rec):
        self.rec = rec

    def tensor(self, **kw):
        return FakeTensor(self.rec, "io", **kw)

    def gen_index(self, input, axis):
        return FakeTensor(self.rec, "gen_index", axis=axis)

    def sdpa(self, **kw):
        return self._sdpa("sdpa", kw, 2)

    def sdpa_backward(self, **kw):
        return self._sdpa("sdpa_backward", kw, 3)

    def _sdpa(self, name, kw, outputs):
        self.rec.calls.append((name, {k: v for k, v in kw.items() if not callable(v)}))
        for cb, anchor in (("score_mod", "score"), ("score_mod_bprop", "dP")):
            if kw.get(cb) is not None:
                out = kw[cb](self, FakeTensor(self.rec, anchor))
                assert isinstance(out, FakeTensor) and out.origin != anchor
        return [self.rec.tensor(f"{name}_out{i}") for i in range(outputs)]

    def serialize(self, as_bytes):
        return repr(self.rec.calls).encode()

    def get_workspace_size(self):
        return 16

    def get_plan_name_at_index(self, i):
        return "fake"

    def __getattr__(self, name):  # pointwise nodes and the planning steps
        def node(*a, **kw):
            self.rec.calls.append((name, sorted(kw)))
            return FakeTensor(self.rec, name)
        return node


class Names:
    def __getattr__(self, name):
        return name


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    fake = types.ModuleType("cudnn")
    fake.pygraph = lambda **kw: FakeGraph(rec)
    fake.data_type = fake.heur_mode = fake.build_plan_policy = fake.diagonal_alignment = Names()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    return rec


OPTIONS = {"default": scoremod.LoweringOptions(sms=1), "plain": scoremod.LoweringOptions.plain(),
           "deterministic": scoremod.LoweringOptions(sms=1, deterministic=True)}


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_plan_of_the_gpu_suite_builds_its_graphs(name, options, recorder):
    fn, (sq, skv, hq) = CASES[name]
    plan = Plan(scoremod.trace(fn), Problem(2, sq, skv, hq, 2, 64, 64, "float16"), 0.125,
                OPTIONS[options])
    back = plan.backward_plan
    for part in plan.parts + (back.parts if back is not plan else ()):
        for direction, spec, consts, loads, build in (
                ("sdpa", part.fwd_spec, part.fwd_consts, part.fwd_loads, cg.build_forward),
                ("sdpa_backward", part.spec, part.consts, part.loads, cg.build_backward)):
            recorder.calls.clear()
            args = (part.fwd, spec, consts, [l.node for l in loads], part.describe)
            built = build(*args) if build is cg.build_forward else build(part.fwd, part.bwd, *args[1:])
            (call,) = [kw for n, kw in recorder.calls if n == direction]
            assert call["attn_scale"] == spec.scale
            assert ("diagonal_band_right_bound" in call) == (spec.band is not None)
            # deterministic=True: cuDNN's deterministic backward, the forward as ever
            assert bool(call.get("use_deterministic_algorithm")) == (
                direction == "sdpa_backward" and OPTIONS[options].deterministic)
            q = call["q"].props
            assert q["uid"] == cg.UID_Q and q["dim"][0] == 2 and q["dim"][2] == spec.shape.sq
            rows = spec.q_rows or spec.shape.sq
            assert q["stride"] == [rows * hq * 64, 64, hq * 64, 1]
            assert built.scalar_uids == tuple(cg.UID_SCALARS + i for i in range(len(consts)))
            assert len(built.scalar_bits) == len(consts)
            assert built.in_uids[len(built.in_uids) - len(loads):] == tuple(l.spec.uid for l in loads)
            assert built.graph_id == scoremod.kernels_ffi.hash_graph(built.blob)
            if direction == "sdpa_backward":
                stats = call["stats"].props
                assert stats["dim"] == [2, hq, spec.shape.sq, 1]  # packed, per block
                assert stats["stride"] == [hq * spec.shape.sq, spec.shape.sq, 1, 1]


def build_both(part, recorder):
    """Emit ``part``'s forward and backward graphs into ``recorder``; the built graphs."""
    fwd = cg.build_forward(part.fwd, part.fwd_spec, part.fwd_consts,
                           [l.node for l in part.fwd_loads], part.describe)
    bwd = cg.build_backward(part.fwd, part.bwd, part.spec, part.consts,
                            [l.node for l in part.loads], part.describe)
    return fwd, bwd


@pytest.mark.parametrize("name", sorted(CENSUS_MASKS))
def test_census_mask_spellings_build_their_graphs(name, recorder):
    mod = scoremod.trace(CENSUS_MASKS[name])
    for options in OPTIONS.values():
        plan = Plan(mod, Problem(2, 128, 128, 4, 2, 64, 64, "bfloat16"), 0.125, options)
        for part in plan.parts:
            recorder.calls.clear()
            build_both(part, recorder)
            assert [n for n, _ in recorder.calls if n.startswith("sdpa")] == ["sdpa", "sdpa_backward"]


def test_float_and_int_scalars_travel_as_their_bits():
    from scoremod.dsl import ir

    assert cg._scalar_bits(ir.const(1.0, ir.F32)) == int(np.float32(1.0).view(np.int32))
    assert cg._scalar_bits(ir.const(-3, ir.I32)) == -3


class EngineGraph(FakeGraph):
    """A graph whose planning may land on a Python SDPA engine (``engine``)."""

    engine = None

    def deselect_engines(self, names):
        self.rec.calls.append(("deselect_engines", list(names)))

    def check_support(self):
        self.rec.calls.append(("check_support", []))
        self.selected_engine = self.engine


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_python_engines_that_drop_the_score_mod_are_excluded_and_refused(recorder, direction):
    """Frontend 1.31 and later may serve an SDPA graph with a Python engine
    (sdpa_fwd_prefill_sm100 on Blackwell) that drops the score_mod without an
    error. The builders exclude those engines before planning, and refuse a
    graph on which one was chosen all the same."""
    part = Plan(scoremod.parse("30.0 * tanh(score / 30.0)"), Problem(
        2, 128, 128, 4, 2, 64, 64, "bfloat16"), 0.125, scoremod.LoweringOptions()).parts[0]

    def build():
        if direction == "forward":
            return cg.build_forward(part.fwd, part.fwd_spec, part.fwd_consts,
                                    [l.node for l in part.fwd_loads], part.describe)
        return cg.build_backward(part.fwd, part.bwd, part.spec, part.consts,
                                 [l.node for l in part.loads], part.describe)

    sys.modules["cudnn"].pygraph = lambda **kw: EngineGraph(recorder)
    build()
    steps = [(n, kw) for n, kw in recorder.calls if n in ("deselect_engines", "check_support")]
    assert [n for n, _ in steps] == ["deselect_engines", "check_support"]
    assert {"sdpa_fwd", "sdpa_bwd", "sdpa_prefill"} <= set(steps[0][1])
    EngineGraph.engine = types.SimpleNamespace(name="sdpa_fwd_prefill_sm100")
    try:
        with pytest.raises(scoremod.ScoreModError, match="python engine 'sdpa_fwd_prefill_sm100'"):
            build()
    finally:
        EngineGraph.engine = None


@pytest.mark.parametrize("name", ["native_causal", "split_softcap_prefix_lm", "fold_softcap"])
def test_graphs_with_a_sink_take_it_last(name, recorder):
    """Part.forward_graph(sink=True): the forward graph gets cuDNN's sink input, one
    float32 logit per query head ([1, hq, 1, 1]), as its last input (after the
    loads: a block's byte offsets put 0 there); backward_graph(sink=True) takes it
    likewise and writes the sink's gradient (dSink_token) as its last output; the
    plain graphs have neither."""
    import dataclasses

    fn, (sq, skv, hq) = CASES[name]
    plan = Plan(scoremod.trace(fn), Problem(2, sq, skv, hq, 2, 64, 64, "bfloat16"), 0.125,
                OPTIONS["default"])
    for part in plan.parts:
        recorder.calls.clear()
        spec = dataclasses.replace(part.fwd_spec, sink=True)
        built = cg.build_forward(part.fwd, spec, part.fwd_consts,
                                 [l.node for l in part.fwd_loads], part.describe)
        (call,) = [kw for n, kw in recorder.calls if n == "sdpa"]
        sink = call["sink_token"].props
        assert sink["uid"] == cg.UID_SINK and sink["dim"] == [1, hq, 1, 1]
        assert sink["stride"] == [hq, 1, 1, 1] and sink["data_type"] == "FLOAT"
        assert built.in_uids[-1] == cg.UID_SINK and built.in_uids[:3] == (cg.UID_Q, cg.UID_K, cg.UID_V)
        recorder.calls.clear()
        build_both(part, recorder)
        assert all("sink_token" not in kw for _, kw in recorder.calls)
        # the backward with the sink: its input last, its gradient the last output
        recorder.calls.clear()
        bwd = cg.build_backward(part.fwd, part.bwd, dataclasses.replace(part.spec, sink=True),
                                part.consts, [l.node for l in part.loads], part.describe)
        (call,) = [kw for n, kw in recorder.calls if n == "sdpa_backward"]
        for key, uid in (("sink_token", cg.UID_SINK), ("dSink_token", cg.UID_DSINK)):
            t = call[key].props
            assert t["uid"] == uid and t["dim"] == [1, hq, 1, 1] and t["data_type"] == "FLOAT"
        assert bwd.in_uids[-1] == cg.UID_SINK
        assert bwd.out_uids == (cg.UID_DQ, cg.UID_DK, cg.UID_DV, cg.UID_DSINK)


SINK_PLANS = {  # a plan of each shape (mod, options): one graph, query blocks, key blocks
    "one graph": (lambda s, b, h, q, k: jnp.where(q >= k, 30 * jnp.tanh(s / 30), -jnp.inf),
                  scoremod.LoweringOptions(sms=1, split_blocks=1)),
    "query blocks": (lambda s, b, h, q, k: jnp.where(q >= k, 30 * jnp.tanh(s / 30), -jnp.inf),
                     scoremod.LoweringOptions(sms=1, split_blocks=4)),
    "key blocks": (lambda s, b, h, q, k: jnp.where((k < 128) | (q >= k), s, -jnp.inf),
                   scoremod.LoweringOptions(sms=132)),
}


@pytest.mark.parametrize("name", sorted(SINK_PLANS))
def test_the_backward_sums_the_sinks_gradient_in_its_graphs(name, recorder, monkeypatch):
    """Cudnn.backward_with_sinks on a faked H200, its graphs built into the
    recorder and its FFI calls checked and answered: every graph that takes the
    sink (each query block's; of key blocks, the first: it sums over every row)
    gets it after its loads and a zeroed buffer for dSink carried into its last
    output, the byte offsets line up, and the gradient is the blocks' sum in the
    first batch row."""
    import jax
    import jax.numpy as jnp  # noqa: F811

    from scoremod import device, kernels_ffi
    from scoremod.lowering.cudnn import backend as cudnn_backend

    monkeypatch.setattr(device, "current", lambda: device.Device("gpu", "NVIDIA H200", 9, 132))
    monkeypatch.setattr(cg, "cached", lambda key, build: build())
    monkeypatch.setattr(cg, "backend_version", lambda: 91900)
    monkeypatch.setattr(cg, "frontend_version", lambda: 13200)
    calls = []

    def call(blob, gid, inputs, out_shapes, in_uids, out_uids, *rest, offsets=(), carry=None):
        assert len(inputs) == len(in_uids) and len(out_shapes) == len(out_uids)
        assert len(offsets) in (0, len(in_uids) + len(out_uids)), (offsets, in_uids, out_uids)
        for i, o in (carry or {}).items():
            assert in_uids[i] == -1 and inputs[i].shape == out_shapes[o].shape
            assert inputs[i].dtype == out_shapes[o].dtype
        sink = cg.UID_SINK in in_uids
        assert (cg.UID_DSINK in out_uids) == sink
        if sink:
            at = out_uids.index(cg.UID_DSINK)
            assert in_uids.index(cg.UID_SINK) == len(in_uids) - len(carry) - 1
            assert {o: i for i, o in carry.items()}.get(at) is not None  # starts from zeros
            assert not offsets or (offsets[in_uids.index(cg.UID_SINK)] == 0
                                   and offsets[len(in_uids) + at] == 0)
        calls.append(sink)
        # dSink: 1 + the call's number, so that the sum over blocks shows
        return [jnp.full(s.shape, len(calls) if u == cg.UID_DSINK else 0, s.dtype)
                for s, u in zip(out_shapes, out_uids)]

    monkeypatch.setattr(kernels_ffi, "call", call)
    monkeypatch.setattr(cudnn_backend, "SINK_GRADIENT_IN_GRAPH", True)
    fn, options = SINK_PLANS[name]
    b, s, hq, hkv, d = 2, 1024, 4, 2, 64
    plan = Plan(scoremod.trace(fn), Problem(b, s, s, hq, hkv, d, d, "bfloat16"), 0.125, options)
    back = plan.backward_plan
    assert {"one graph": not back.split, "query blocks": back.split and not back.key_split,
            "key blocks": back.key_split}[name], back.describe()
    cudnn = cudnn_backend.CUDNN
    assert cudnn.sums_sink_gradient(plan, options)
    assert not cudnn.sums_sink_gradient(plan, options.replace(deterministic=True))
    q = jnp.zeros((b, s, hq, d), jnp.bfloat16)
    kv = jnp.zeros((b, s, hkv, d), jnp.bfloat16)
    lse = jnp.zeros((b, hq, s), jnp.float32)
    sinks = jnp.zeros((b, hq), jnp.float32)
    dq, dk, dv, dsinks = jax.jit(lambda *a: cudnn.backward_with_sinks(plan, *a, (), sinks))(
        q, kv, kv, q, lse, q)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, kv.shape, kv.shape)
    takes = [i + 1 for i, sink in enumerate(calls) if sink]
    want = {"one graph": [1], "query blocks": list(range(1, len(back.blocks) + 1)),
            "key blocks": [1]}[name]
    assert takes == want and len(calls) == len(back.blocks), calls
    np.testing.assert_array_equal(dsinks[0], np.full(hq, sum(want), np.float32))
    np.testing.assert_array_equal(dsinks[1:], 0)
