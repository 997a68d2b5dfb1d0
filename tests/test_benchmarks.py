"""The benchmark harness (benchmarks/harness.py): the CPU dry run end to end, targets, output."""

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import scoremod
from benchmarks import harness as bench
from scoremod.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


def _rows(text, header_start):
    """The rows of the markdown table whose header starts with ``header_start``."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.startswith(header_start):
            ncols = line.count("|")
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                assert lines[j].count("|") - lines[j].count("\\|") == ncols, lines[j]
                out.append([c.strip() for c in re.split(r"(?<!\\)\|", lines[j])[1:-1]])
                j += 1
    return out


def test_dry_run_end_to_end(tmp_path, capsys, monkeypatch):
    doc = tmp_path / "performance.md"
    doc.write_text("# Performance\n\nabove\n\n<!-- bench:begin -->\nOLD\n<!-- bench:end -->\n\nbelow\n")
    out = tmp_path / "bench.json"
    real = scoremod.attention

    def attention(q, *a, **kw):  # the long case runs out of memory, as XLA does at 32768
        if q.shape[1] >= 64:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 275.0GiB.")
        return real(q, *a, **kw)

    monkeypatch.setattr(scoremod, "attention", attention)
    argv = ["--dry-run", "--mods", "softcap,document", "--seqs", "32", "--long", "64",
            "--json", str(out), "--doc", str(doc), "--images", str(tmp_path / "images")]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out

    # one progress line per case
    progress = [line for line in printed.splitlines() if re.match(r"\[\s*\d+/\d+", line)]
    assert len(progress) == 2 * 2 * 2, printed
    assert any("s32 d16 softcap" in line and "TF/s" in line for line in progress)
    assert any("s64 d16 document" in line and "OOM" in line for line in progress)

    data = json.loads(out.read_text())
    assert set(data) == {"meta", "results", "targets"}
    meta = data["meta"][0]
    assert meta["argv"] == argv and meta["config"]["impls"] == ["xla"] and "jax" in meta
    results = data["results"]
    assert {(r["seq"], r["mod"], r["direction"]) for r in results} == {
        (s, m, d) for s in (32, 64) for m in ("softcap", "document") for d in ("fwd", "fwdbwd")}
    for r in results:
        assert r["impl"] == "xla" and r["batch"] == 1 and r["heads"] == 2 and r["head_dim"] == 16
        if r["seq"] == 64:
            assert r["long"] and r["status"] == "oom" and "RESOURCE_EXHAUSTED" in r["message"]
            continue
        assert r["status"] == "ok" and not r["long"]
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["reps"] == 3 and r["iters"] >= 1
        flops = 4 * 1 * 2 * 32 * 32 * 16 * (3.5 if r["direction"] == "fwdbwd" else 1)
        assert r["tflops"] == pytest.approx(flops / r["median_ms"] / 1e9)
        assert r["first_call_s"] > 0 and r["graph_builds"] == 0

    text = doc.read_text()
    assert text.startswith("# Performance\n\nabove\n\n<!-- bench:begin -->\n")
    assert text.endswith("<!-- bench:end -->\n\nbelow\n") and "OLD" not in text
    assert text.count("<!-- bench:begin -->") == 1
    assert "### seq 32, head dim 16\n" in text and "### seq 64, head dim 16 (long case)" in text
    rows = _rows(text, "| mod | implementation | fwd ms")
    assert len(rows) == 4 and all(len(r) == 9 for r in rows)
    by = {(r[0], i // 2): r for i, r in enumerate(rows)}
    softcap = by[("softcap", 0)]
    assert softcap[1] == "scoremod XLA reference"
    assert re.fullmatch(r"[\d.]+ \([\d.]+-[\d.]+\)", softcap[2]) and float(softcap[3]) > 0
    assert by[("document", 1)][2] == "OOM" and by[("document", 1)][4] == "OOM"
    png = tmp_path / "images" / "bench.png"
    assert png.exists() == ("plot skipped" not in printed)
    assert ("](images/bench.png)" in text) == png.exists()


def test_cli_bench_says_where_the_harness_went(capsys):
    assert cli_main(["bench", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "python benchmarks/run.py" in err and "--dry-run" in err


def test_run_script_forwards_its_arguments(tmp_path):
    out = tmp_path / "b.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--dry-run", "--mods",
                          "identity", "--seqs", "32", "--long", "0", "--directions", "fwd", "--reps",
                          "2", "--json", str(out)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())["results"]
    assert [(r["mod"], r["impl"], r["direction"], r["status"], r["reps"]) for r in results] == [
        ("identity", "xla", "fwd", "ok", 2)]
    assert "wrote" in run.stdout and not (tmp_path / "docs").exists()


def test_refuses_to_start_without_a_gpu_unless_dry_run(capsys, monkeypatch):
    if bench.no_gpu() is None:
        pytest.skip("a GPU is here")
    monkeypatch.setattr(bench, "run", lambda cfg, save: pytest.fail("started"))
    assert bench.main(["--seqs", "4096"]) == 2
    err = capsys.readouterr().err
    assert "no GPU is visible" in err and "--dry-run" in err


def test_no_page_unless_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run", lambda cfg, save: ([], []))
    monkeypatch.setattr(bench, "write_section", lambda *a: pytest.fail("wrote a page"))
    monkeypatch.setattr(bench, "plot", lambda *a: pytest.fail("drew a plot"))
    monkeypatch.setattr(bench, "no_gpu", lambda: None)  # as on a GPU machine
    monkeypatch.setattr(bench, "warm_up", lambda impls: 0.0)
    assert bench.main(["--dry-run"]) == 0
    assert bench.main(["--seqs", "4096", "--head-dims", "128"]) == 0


def test_results_are_saved_after_every_case(tmp_path, monkeypatch):
    out, calls, real = tmp_path / "b.json", [], bench.measure

    def measure(*a, **kw):  # the command is killed during its second case
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(bench, "measure", measure)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--dry-run", "--mods", "identity", "--seqs", "32", "--long", "0", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert [(r["direction"], r["status"]) for r in saved["results"]] == [("fwd", "ok")]


def test_max_seconds_stops_cleanly(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert bench.main(["--dry-run", "--mods", "identity,causal", "--max-seconds", "1e-9",
                       "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["results"] == [] and len(saved["meta"][0]["not_run"]) == 2 * 2  # 2 mods, 2 shapes
    assert "--max-seconds 1e-09 reached: 4 cases not run" in capsys.readouterr().out


def _rec(seq, mod, impl, direction, ms=None, status="ok", long=False):
    r = {"batch": 4, "heads": 16, "seq": seq, "head_dim": 128, "dtype": "bfloat16", "long": long,
         "mod": mod, "impl": impl, "direction": direction, "variant": "", "status": status,
         "graph_builds": 0}
    if ms is not None:
        r.update(median_ms=ms, min_ms=ms, max_ms=ms, tflops=1.0, first_call_s=0.1)
    return r


def test_targets_ratios_pass_and_miss():
    s = 4096
    times = {
        ("softcap", "scoremod"): (1.0, 4.0), ("softcap", "direct"): (0.99, 3.98),
        ("softcap", "jax-cudnn"): (0.85, 3.0), ("softcap", "xla"): (None, 20.0),
        ("softcap", "flex"): (1.1, 5.0),
        ("softcap_causal", "scoremod"): (0.6, 2.0), ("softcap_causal", "scoremod-plain"): (1.0, 4.0),
        ("causal", "scoremod"): (0.5, 2.0), ("causal", "jax-cudnn"): (0.49, 1.0),
    }
    records = [_rec(s, mod, impl, d, ms) for (mod, impl), pair in times.items()
               for d, ms in zip(("fwd", "fwdbwd"), pair) if ms is not None]
    records += [_rec(32768, "softcap", "scoremod", "fwdbwd", 50.0, long=True),
                _rec(32768, "softcap", "xla", "fwdbwd", status="oom", long=True)]
    got = {(t["seq"], t["mod"], t["impl"], t["target"], t["direction"]): (t["ratio"], t["pass"])
           for t in bench.targets(records)}

    def check(mod, impl, target, direction, ratio, ok, seq=s):
        r, p = got.pop((seq, mod, impl, target, direction))
        assert (r is None and ratio is None) or r == pytest.approx(ratio), (mod, target, direction)
        assert p == ok, (mod, target, direction, r)

    check("softcap", "direct", "FFI / direct", "fwd", 1.0 / 0.99, True)
    check("softcap", "direct", "FFI / direct", "fwdbwd", 4.0 / 3.98, True)
    check("softcap", "jax-cudnn", "vs plain cuDNN", "fwd", 0.85, True)
    check("softcap", "jax-cudnn", "vs plain cuDNN", "bwd", (3.0 - 0.85) / (4.0 - 1.0), False)
    check("softcap", "xla", "vs XLA reference at seq 4096", "fwdbwd", 5.0, True)
    check("softcap", "flex", "vs FlexAttention", "fwd", 1.1, False)
    check("softcap", "flex", "vs FlexAttention", "fwdbwd", 1.25, True)
    check("softcap_causal", "scoremod-plain", "vs unsplit score_mod", "fwd", 1.0 / 0.6, True)
    check("softcap_causal", "scoremod-plain", "vs unsplit score_mod", "fwdbwd", 2.0, True)
    check("causal", "jax-cudnn", "vs native mask", "fwd", 0.98, True)
    check("causal", "jax-cudnn", "vs native mask", "fwdbwd", 0.5, False)
    check("softcap", "xla", "scoremod runs (XLA: oom)", "fwdbwd", None, True, seq=32768)
    assert not got, got  # nothing else: every other ratio lacks one of its two times

    page = bench.markdown(records, [{"date": "today", "argv": ["--seqs", "4096"]}])
    assert "| FFI / direct | <= 1.03 | 2 | 0 | 1.010: s4096 d128 softcap fwd |" in page
    assert "| vs native mask | >= 0.95 | 1 | 1 | 0.500: s4096 d128 causal fwdbwd |" in page
    assert ("vs plain cuDNN (>= 0.8): fwd 0.850 pass; vs plain cuDNN (>= 0.92): bwd 0.717 **miss** |"
            in page)
    assert "| OOM |  | - / - |  | scoremod runs (XLA: oom): fwd+bwd pass |" in page


def test_failures_are_classified():
    class OutOfMemoryError(RuntimeError):  # as torch.cuda names it
        pass

    assert bench.failure(RuntimeError("RESOURCE_EXHAUSTED: Out of memory"))[0] == "oom"
    assert bench.failure(OutOfMemoryError("CUDA out of memory. Tried to allocate"))[0] == "oom"
    assert bench.failure(ImportError("torch is not importable")) == (
        "skipped", "ImportError: torch is not importable")
    assert bench.failure(scoremod.CudnnUnavailableError("no GPU"))[0] == "skipped"
    status, msg = bench.failure(ValueError("bad\nsecond line"))
    assert status == "error" and msg == "ValueError: bad"


def test_section_is_appended_then_replaced(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Performance\n\nhand-written\n")
    bench.write_section(page, "first")
    bench.write_section(page, "second\n")
    assert page.read_text() == ("# Performance\n\nhand-written\n\n<!-- bench:begin -->\nsecond\n"
                                "<!-- bench:end -->\n")


def test_from_merges_runs_later_file_wins(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"meta": [{"date": "d1"}], "results": [
        _rec(4096, "softcap", "scoremod", "fwd", 2.0), _rec(4096, "softcap", "direct", "fwd", 1.0)]}))
    b.write_text(json.dumps({"meta": [{"date": "d2"}], "results": [
        _rec(4096, "softcap", "scoremod", "fwd", 1.0)]}))
    page = tmp_path / "perf.md"
    assert bench.main(["--from", str(a), str(b), "--doc", str(page), "--json", str(tmp_path / "m.json")]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    assert [m["date"] for m in merged["meta"]] == ["d1", "d2"]
    assert sorted((r["impl"], r["median_ms"]) for r in merged["results"]) == [("direct", 1.0), ("scoremod", 1.0)]
    assert [t["ratio"] for t in merged["targets"]] == [1.0]
    text = page.read_text()
    assert "| FFI / direct | <= 1.03 | 1 | 0 | 1.000: s4096 d128 softcap fwd |" in text
    assert "FFI / direct (<= 1.03): fwd 1.000 pass (runs 1+2) |" in text  # direct: d1's
    assert "- run 2: d2, commit" in text
    assert [r["run"] for r in sorted(merged["results"], key=lambda r: r["impl"])] == [0, 1]
    # merged again, the file's own run numbers hold
    assert bench.main(["--from", str(tmp_path / "m.json"), "--doc", str(page)]) == 0
    assert "FFI / direct (<= 1.03): fwd 1.000 pass (runs 1+2) |" in page.read_text()
    assert "target s4096 d128 softcap fwd: FFI / direct: 1.000 (needs <= 1.03) pass" in capsys.readouterr().out


def test_plain_variant_passes_plain_options_and_the_harness_uses_public_names(monkeypatch):
    seen = []
    monkeypatch.setattr(scoremod, "attention", lambda *a, **kw: seen.append(kw["options"]) or a[0])
    shape = bench.Shape(1, 2, 32, 16, "float32", 16)
    for impl in ("scoremod-plain", "scoremod"):
        call, _, _ = bench.make_call(impl, "softcap", shape, "fwd")
        call()
    assert seen == [scoremod.LoweringOptions.plain(), None]
    text = (ROOT / "benchmarks" / "harness.py").read_text()
    assert not re.findall(r"\bscoremod(?:\.\w+)*\._[a-z]", text)  # no private scoremod names


def test_dsink_variant_switches_the_sink_gradient_into_cudnn_while_it_runs(monkeypatch):
    """scoremod-sinks-dsink traces its call with cuDNN's backward summing dSink (the
    switch read when the backward is traced), and leaves the switch as it was."""
    from scoremod.lowering.cudnn import backend as cudnn_backend

    seen = []

    def attention(q, *a, **kw):
        seen.append(cudnn_backend.SINK_GRADIENT_IN_GRAPH)
        return q * kw["sinks"].sum()
    monkeypatch.setattr(scoremod, "attention", attention)
    shape = bench.Shape(1, 2, 32, 16, "float32", 16)
    for impl in ("scoremod-sinks-dsink", "scoremod-sinks"):
        call, _, _ = bench.make_call(impl, "window", shape, "fwdbwd")
        call()
        assert cudnn_backend.SINK_GRADIENT_IN_GRAPH is False
    assert seen == [True, False]
    with pytest.raises(bench.NotApplicable, match="backward"):  # no forward row twice
        bench.make_call("scoremod-sinks-dsink", "window", shape, "fwd")


def test_plan_hook_gives_the_blocks_scoremod_runs():
    shape = bench.Shape(4, 16, 4096, 128, "bfloat16", 256)
    plan = bench.plan_of("softcap_causal", shape, scoremod.LoweringOptions(sms=132))
    assert plan.split and len(plan.blocks) == 8
    assert not bench.plan_of("softcap_causal", shape, scoremod.LoweringOptions.plain()).split
    assert bench.lowered("softcap_causal", {"split_blocks": 8}) == "query blocks"


def test_from_keeps_direct_results_only_beside_the_same_lowering(tmp_path, capsys):
    plain, folded = tmp_path / "plain.json", tmp_path / "folded.json"
    plain.write_text(json.dumps({"meta": [{"date": "d1"}], "results": [
        _rec(4096, "softcap", "scoremod", "fwd", 2.0), _rec(4096, "softcap", "direct", "fwd", 2.0),
        _rec(4096, "identity", "scoremod", "fwd", 1.0), _rec(4096, "identity", "direct", "fwd", 1.0)]}))
    folded.write_text(json.dumps({"meta": [{"date": "d2", "fold_scale": True, "split_blocks": 4}], "results": [
        _rec(4096, "softcap", "scoremod", "fwd", 1.5), _rec(4096, "softcap", "scoremod-plain", "fwd", 2.0),
        _rec(4096, "identity", "scoremod", "fwd", 1.0)]}))
    records, _ = bench.load([str(plain), str(folded)])
    got = {(r["mod"], r["impl"]): r["lowered"] for r in records}
    assert got == {("softcap", "scoremod"): "scale folded", ("softcap", "scoremod-plain"): "as written",
                   ("identity", "scoremod"): "as written", ("identity", "direct"): "as written"}
    assert "dropped: s4096 d128 softcap direct fwd (ran as written; scoremod ran scale folded)" in capsys.readouterr().out
    assert "| softcap | scoremod fused (scale folded) |" in bench.markdown(records, [{"date": "d2"}])


def _nested_divisions(form):
    """Divisions in a canonical form whose dividend holds another's result."""
    from scoremod.dsl import ir

    return [n for n in ir.toposort(form) if n.op == "div"
            and any(m.op == "i32" for m in ir.toposort(n.args[0]))]


def test_int_division_probe_puts_the_nested_division_in_the_graph():
    """benchmarks/probes/int_division.py's in_graph() really emits tiled
    NATTEN's nested division (no rewrite, no refusal), and leaves the
    shipped lowering (flattened, no nesting) as it was afterwards."""
    import jax.numpy as jnp

    from benchmarks.probes import int_division as probe
    from scoremod.dsl import ir
    from scoremod.lowering.cudnn import rules

    fn = probe.EXPRESSIONS["tiled_natten row"][0]
    trace = lambda: scoremod.trace(lambda s, b, h, q, k: s + fn(q, k).astype(jnp.float32))  # noqa: E731
    with probe.in_graph():
        nested = rules.canonical(trace().expr)
    shipped = rules.canonical(trace().expr)
    for form in (nested, shipped):
        assert not any(n.op == ir.MATERIALIZE for n in ir.toposort(form)), form
    assert _nested_divisions(nested), nested
    assert not _nested_divisions(shipped), shipped


def test_int_division_probe_runs_on_the_cpu():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/probes/int_division.py"),
                          "--only", "tiled"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "tiled_natten" in line]
    assert len(rows) == 4 and all("  0/256 wrong, matches jnp" in r for r in rows), out.stdout


def test_mla_rope_baseline_pads_v_and_computes_the_same_attention():
    """jax-cudnn's mla_rope baseline (q, k at head dim D + 64, v zero-padded to
    it, O sliced back) computes what scoremod computes for the mod, at its
    scale; here through jax.nn's XLA implementation, on the CPU."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    shape = bench.Shape(1, 2, 64, 16, "float32", window=8)
    q, k, v, _ = shape.jax_inputs()
    qa, ka = bench.rope_augmented(q, k, shape.aux)
    assert qa.shape == ka.shape == (1, 64, 2, 16 + bench.ROPE_DIM)

    def xla_attention(q, k, v, implementation, **kw):
        assert implementation == "cudnn"
        assert v.shape[-1] == q.shape[-1]  # what jax.nn insists on
        return jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)

    got = bench.rope_padded_v(xla_attention, qa, ka, v, shape.d, is_causal=True)
    want = scoremod.attention(q, k, v, shape.mod("mla_rope"), implementation="xla")
    assert got.shape == v.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_mla_rope_factors_take_the_inputs_dtype_and_fold():
    """At bfloat16 (the benchmark's dtype) the factors are bfloat16, the mod
    traces (its products in float32) and its bias folds into the head dim."""
    from scoremod.lowering import lowrank
    from scoremod.lowering.problem import Problem

    shape = bench.Shape(1, 2, 64, 16, "bfloat16", window=8)
    mod = shape.mod("mla_rope")
    assert {str(x.dtype) for x in mod.operands} == {"bfloat16"}
    found = lowrank.find(mod, Problem(1, 64, 64, 2, 2, 16, 16, "bfloat16"), 0.25)
    assert isinstance(found, lowrank.LowRank) and found.rank == bench.ROPE_DIM


# --- document_softcap and the operand-gradient direction (fwdbwd_ops) -------------


def _grid(b, h, s):
    import numpy as np

    return np.ix_(np.arange(b), np.arange(h), np.arange(s), np.arange(s))


def _np_attention(q, k, v, mod):
    """Attention in float64 numpy, ``mod(scores [B, H, S, S], b, h, q, k)`` on the scaled
    scores; a row with no kept score gives zeros."""
    import numpy as np

    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, s, h, d = q.shape
    scores = mod(np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d), *_grid(b, h, s))
    top = np.max(scores, -1, keepdims=True)
    p = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def _document_softcap(sc, b, h, q, k, seq=64):
    """What the issue asks for, written apart from the harness: 4 equal documents per
    row, causal inside, 30 tanh(s / 30) on the kept scores."""
    import numpy as np

    doc = q * 4 // seq, k * 4 // seq
    return np.where((doc[0] == doc[1]) & (q >= k), 30.0 * np.tanh(sc / 30.0), -np.inf)


def test_document_softcap_mod_is_the_issues():
    """The jax mod on a grid of scores large enough for the softcap to bend them, and the
    xla row's attention, against a numpy reference written from the issue's words."""
    import jax.numpy as jnp
    import numpy as np

    shape = bench.Shape(2, 2, 64, 16, "float32", window=8)
    mod = shape.mod("document_softcap")
    grid = _grid(2, 2, 64)
    sc = 60.0 * np.random.default_rng(1).standard_normal((2, 2, 64, 64)).astype(np.float32)
    got = mod(jnp.asarray(sc), *(jnp.asarray(x) for x in grid))
    np.testing.assert_allclose(np.asarray(got), _document_softcap(sc, *grid), rtol=1e-6, atol=1e-5)
    assert np.isinf(np.asarray(got)).mean() == pytest.approx(1 - 4 * (16 * 17 / 2) / 64 ** 2)

    q, k, v, do = shape.jax_inputs()
    shape.jax_inputs = lambda: [8.0 * q, 8.0 * k, v, do]  # scores of tens: the cap matters
    call, _, _ = bench.make_call("xla", "document_softcap", shape, "fwd")
    want = _np_attention(8.0 * q, 8.0 * k, v, _document_softcap)
    uncapped = _np_attention(8.0 * q, 8.0 * k, v, lambda sc, b, h, qi, ki: np.where(
        (qi * 4 // 64 == ki * 4 // 64) & (qi >= ki), sc, -np.inf))
    assert np.abs(want - uncapped).max() > 1e-2  # the test tells the cap apart
    np.testing.assert_allclose(np.asarray(call()), want, rtol=1e-4, atol=1e-4)


def test_flex_and_jax_mods_share_their_definitions():
    """FlexAttention's score_mod and mask_mod come from the same mod_parts as the JAX
    mods: evaluated with numpy arrays they give the JAX mod's scores, for every mod
    FlexAttention runs; FLEX_LEARNED names the arrays the JAX mod's float operands hold."""
    import jax.numpy as jnp
    import numpy as np

    b, h, s = 2, 2, 64
    aux = bench.aux_arrays(b, h, s, 8)
    grid = _grid(b, h, s)
    sc = (10.0 * np.random.default_rng(2).standard_normal((b, h, s, s))).astype(np.float32)
    for name in bench.MODS:
        if name in bench.ROPE_MODS:
            continue
        score, mask = bench.mod_parts(name, aux, np)
        flex = score(sc, *grid) if score else sc
        flex = np.where(mask(*grid), flex, -np.inf) if mask else flex
        mod = bench.jax_mod(name, aux)
        want = mod(jnp.asarray(sc), *(jnp.asarray(x) for x in grid))
        np.testing.assert_allclose(np.broadcast_to(flex, want.shape), np.asarray(want), rtol=1e-6,
                                   atol=1e-5, err_msg=name)
        floats = [np.asarray(x) for x in mod.operands if np.issubdtype(x.dtype, np.floating)]
        learned = [aux[n] if n in aux else bench.ON_DEMAND[n](aux)
                   for n in bench.FLEX_LEARNED.get(name, ())]
        assert len(floats) == len(learned) and all(
            np.array_equal(x, y) for x, y in zip(floats, learned)), name
    assert set(bench.FLEX_LEARNED) == {"alibi", "alibi_causal", "relbias", "t5", "learned_cap",
                                       "kind_pair", "pair_bias", "rel2d"}
    # rel2d's index: one entry per 2-D offset on the 8 x 8 canvas, shared by every pair
    # of positions that far apart
    rel = bench.rel2d_index(aux)
    r, c = np.arange(s) // 8, np.arange(s) % 8
    offsets = (r[:, None] - r[None, :]) * 100 + (c[:, None] - c[None, :])
    assert len(np.unique(rel)) == len(np.unique(offsets)) == 15 * 15
    assert rel.min() == 0 and rel.max() == aux["rel_table"].shape[1] - 1
    for off in np.unique(offsets):
        assert len(np.unique(rel[offsets == off])) == 1


@pytest.mark.parametrize("name", ["alibi", "relbias"])
def test_operand_gradients_reach_the_captured_array(name):
    """fwdbwd_ops on the xla row returns dQ, dK, dV (those of fwdbwd) and the gradient
    of the captured array, equal to the one of a dense attention written in the test
    with the bias built from the same array, and nonzero."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    shape = bench.Shape(2, 2, 32, 16, "float32", window=8)
    plain, _, _ = bench.make_call("xla", name, shape, "fwdbwd")
    ops, _, _ = bench.make_call("xla", name, shape, bench.OPS)
    got, base = ops(), plain()
    assert len(got) == 5 and len(base) == 4
    for x, y in zip(got[:4], base):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    q, k, v, do = shape.jax_inputs()
    s = shape.s
    qi, ki = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    array = jnp.asarray(shape.aux["slopes" if name == "alibi" else "table"])

    def dense(array):
        bias = array[:, None, None] * (ki - qi) if name == "alibi" else array[:, qi - ki + s - 1]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(shape.d) + bias[None]
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        return jnp.sum(o * do)

    want = jax.grad(dense)(array)
    assert got[4].shape == array.shape and float(jnp.abs(want).max()) > 1e-3
    # A slope's gradient sums dS * (kv - q) over the whole square: terms of both signs
    # cancel to 0.12 beside the other head's 56.8 (float32 sums differ by 5e-5 between
    # jax versions), so the tolerance is absolute at the scale of the largest entry.
    atol = 2e-5 * float(jnp.abs(want).max())
    np.testing.assert_allclose(np.asarray(got[4]), np.asarray(want), rtol=1e-4, atol=atol)


def test_operand_gradients_and_document_softcap_not_applicable_where_unfaithful():
    shape = bench.Shape(1, 2, 32, 16, "float32", window=8)
    for impl, name, direction in [("jax-cudnn", "document_softcap", "fwd"),
                                  ("jax-bias", "document_softcap", "fwdbwd"),
                                  ("xla", "softcap", bench.OPS),  # nothing to learn
                                  ("xla", "document_softcap", bench.OPS),
                                  ("jax-cudnn", "alibi", bench.OPS), ("jax-bias", "alibi", bench.OPS),
                                  ("direct", "alibi", bench.OPS), ("scoremod-ids", "alibi", bench.OPS),
                                  ("scoremod-plain", "relbias", bench.OPS)]:
        with pytest.raises(bench.NotApplicable):
            bench.make_call(impl, name, shape, direction)


def test_operand_gradient_direction_is_opt_in_on_a_gpu_and_in_the_dry_run():
    assert bench.parse_args([]).directions == ["fwd", "fwdbwd"]
    assert bench.parse_args(["--dry-run"]).directions == ["fwd", "fwdbwd", bench.OPS]
    assert bench.parse_args(["--directions", "fwdbwd,fwdbwd_ops"]).directions == ["fwdbwd", bench.OPS]
    assert "document_softcap" in bench.parse_args([]).mods
    with pytest.raises(SystemExit):
        bench.parse_args(["--directions", "bwd_ops"])


def test_dry_run_has_document_softcap_and_operand_gradient_rows(tmp_path):
    out, doc = tmp_path / "b.json", tmp_path / "perf.md"
    assert bench.main(["--dry-run", "--mods", "alibi,document_softcap", "--seqs", "32", "--long", "0",
                       "--json", str(out), "--doc", str(doc), "--images", str(tmp_path)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["mod"], r["direction"], r["status"]) for r in results] == [
        ("alibi", "fwd", "ok"), ("alibi", "fwdbwd", "ok"), ("alibi", bench.OPS, "ok"),
        ("document_softcap", "fwd", "ok"), ("document_softcap", "fwdbwd", "ok")]
    ops = results[2]
    assert ops["tflops"] == pytest.approx(4 * 2 * 32 * 32 * 16 * 3.5 / ops["median_ms"] / 1e9)
    rows = _rows(doc.read_text(), "| mod | implementation | fwd ms | fwd TF/s | fwd+bwd ms | fwd+bwd TF/s "
                 "| fwd+bwd, operand grads ms | fwd+bwd, operand grads TF/s | first call s")
    assert [(r[0], bool(r[6]), r[8].count("/")) for r in rows] == [("alibi", True, 2),
                                                                   ("document_softcap", False, 2)]


def test_scoremod_row_records_the_backend_that_ran_and_its_warnings(tmp_path, monkeypatch):
    """implementation=None on a backend without operand gradients (a stand-in, planned
    first here): fwdbwd runs on it, fwdbwd_ops falls back to the reference path with
    scoremod's warning, and the records say so (the warning is kept, not raised)."""
    from scoremod.lowering import registry
    from tests.test_sharding import StandIn

    class Planned(StandIn):
        name, title = "bench-standin", "the benchmark's stand-in kernel"

        def why_not(self, problem, mod, automatic, options=None):
            return None

    registry.register(Planned())
    try:
        out = tmp_path / "b.json"
        assert bench.main(["--dry-run", "--impls", "scoremod", "--mods", "relbias", "--seqs", "32",
                           "--long", "0", "--directions", "fwdbwd,fwdbwd_ops", "--json", str(out),
                           "--doc", str(tmp_path / "p.md"), "--images", str(tmp_path)]) == 0
    finally:
        registry.unregister("bench-standin")
    plain, ops = json.loads(out.read_text())["results"]
    assert plain["status"] == ops["status"] == "ok"
    assert plain["backend"] == "bench-standin" and not any(
        "falls back" in w for w in plain.get("warnings", []))
    assert ops["backend"] == "xla (fallback from bench-standin)" and ops["lowered"] == "as written"
    assert any("gradients for score_mod operands" in w and "the reference path" in w
               for w in ops["warnings"])
    page = (tmp_path / "p.md").read_text()
    assert ("scoremod fused (fwd+bwd: bench-standin; fwd+bwd, operand grads: xla (fallback from "
            "bench-standin))") in page


def test_mosaic_rows_name_the_backward_that_runs():
    """pallas-mosaic rows say which backward their plan runs: ALiBi's slopes'
    gradient (read at h) on the Mosaic backward too."""
    shape = bench.Shape(1, 2, 64, 64, "bfloat16", window=8)
    variants = {d: bench.make_call("pallas-mosaic", "alibi", shape, d)[2]
                for d in ("fwd", "fwdbwd", bench.OPS)}
    assert variants == {"fwd": "", "fwdbwd": "Mosaic backward",
                        bench.OPS: "Mosaic backward, operand gradients included"}


# benchmarks/gpu_run.sh: one GPU run's steps (tests, bench, probe) under one time budget.
GPU_RUN = ROOT / "benchmarks" / "gpu_run.sh"


def _gpu_run(*args, tmp_path, **env):
    return subprocess.run(["bash", str(GPU_RUN), *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path,
                          env={**os.environ, "OUT": str(tmp_path / "out"), **env})


def test_gpu_run_script_is_valid_bash_and_prints_its_commands(tmp_path):
    assert subprocess.run(["bash", "-n", str(GPU_RUN)]).returncode == 0
    run = _gpu_run("--print", "--budget", "300", "--commit", "abc1234",
                   "tests", "tests/gpu/test_pallas_gpu.py", "-k", "mosaic or cli", "--",
                   "bench=120", "relbias4096", "--seqs", "4096", "--long", "0", "--",
                   "bench", "long", "--seqs", "", "--long", "32768", "--",
                   "probe", "first_call", "--variants", "", "--",
                   "probe", "first_call", "--dtype", "float16", "--", "tests", tmp_path=tmp_path)
    assert run.returncode == 0, run.stderr
    out = str(tmp_path / "out")
    commands = [line for line in run.stdout.splitlines() if line.startswith("+ ")]
    assert commands == [
        "+ . tests/gpu/device_setup.sh",
        f"+ env TESTS= LIMIT=280 OUT={out}/suite PYTHON=python3 bash tests/gpu/run.sh "
        "tests/gpu/test_pallas_gpu.py -k 'mosaic or cli'",
        "+ timeout -k 10 120 python3 benchmarks/run.py --max-seconds 110 --commit abc1234 "
        f"--seqs 4096 --long 0 --json {out}/relbias4096.json",
        "+ timeout -k 10 300 python3 benchmarks/run.py --max-seconds 290 --commit abc1234 "
        f"--seqs '' --long 32768 --json {out}/long.json",
        "+ timeout -k 10 300 python3 benchmarks/probes/first_call.py --variants ''",
        "+ timeout -k 10 300 python3 benchmarks/probes/first_call.py --dtype float16",
        f"+ env TESTS=tests LIMIT=280 OUT={out}/suite-2 PYTHON=python3 bash tests/gpu/run.sh",
    ], run.stdout
    assert f"(log: {out}/first_call-2.log)" in run.stdout
    assert not (tmp_path / "out").exists()  # --print runs nothing, writes nothing


def test_gpu_run_script_skips_a_step_it_has_no_time_for(tmp_path):
    run = _gpu_run("--print", "--no-setup", "bench=10", "short", "--mods", "softcap", "--",
                   "tests", "-k", "cli", tmp_path=tmp_path)
    assert run.returncode == 1
    assert "== bench short at 0 s (10 s)\n== skipped: 10 s left" in run.stdout
    assert "device_setup" not in run.stdout and "bash tests/gpu/run.sh -k cli" in run.stdout


@pytest.mark.parametrize("args, error", [
    ((), "no steps given"),
    (("bench",), "bench needs a NAME"),
    (("bench", "a/b"), "bench NAME 'a/b'"),
    (("bench", "x", "--", "bench", "x"), "bench NAME 'x' given twice"),
    (("probe", "no_such_probe"), "no probe 'no_such_probe'"),
    (("bench=soon", "x"), "bench= takes whole seconds"),
    (("tests", "--", "--", "tests"), "an empty step"),
    (("--budget", "ten", "tests"), "--budget takes whole seconds"),
    (("--verbose", "tests"), "unknown option '--verbose'"),
    (("pytest",), "unknown step 'pytest'"),
])
def test_gpu_run_script_refuses_bad_arguments_before_running_anything(tmp_path, args, error):
    run = _gpu_run(*args, tmp_path=tmp_path)
    assert run.returncode == 2 and error in run.stderr, run.stderr
    assert run.stdout == "" and not (tmp_path / "out").exists()


def test_gpu_run_script_runs_tests_bench_and_probe_steps_on_the_cpu(tmp_path):
    """The whole script without a GPU: the gpu tests are skipped, the harness
    runs its dry run and the int_division probe checks itself on the CPU."""
    run = _gpu_run("--no-setup", "--commit", "abc1234",
                   "tests", "tests/gpu/test_fused.py", "-k", "each_op_in_text", "--",
                   "bench", "tiny", "--dry-run", "--mods", "identity", "--seqs", "32", "--long", "0",
                   "--directions", "fwd", "--reps", "2", "--",
                   "probe=200", "int_division", "--only", "tiled",
                   tmp_path=tmp_path, PYTHON=sys.executable, N="0", JAX_PLATFORMS="cpu",
                   JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
    assert run.returncode == 0, run.stdout + run.stderr
    out = tmp_path / "out"
    assert (out / "run.log").read_text() == run.stdout
    suites = ET.parse(out / "suite" / "gpu-suite.xml").getroot()
    assert sum(int(s.get("tests")) for s in suites.iter("testsuite")) == 2  # only the selection
    assert "gpu suite: " in run.stdout and (out / "suite" / "doctor.txt").exists()
    bench_json = json.loads((out / "tiny.json").read_text())
    assert [(r["mod"], r["impl"], r["status"]) for r in bench_json["results"]] == [
        ("identity", "xla", "ok")]
    assert bench_json["meta"][-1]["commit"] == "abc1234"
    assert "wrote " in (out / "tiny.log").read_text() and "[  1/1" in run.stdout
    rows = [r for r in (out / "int_division.log").read_text().splitlines() if "tiled_natten" in r]
    assert len(rows) == 4 and all("0/256 wrong" in r for r in rows), rows
    assert run.stdout.rstrip().splitlines()[-1].startswith("== done at ")


def test_results_are_data_with_one_readme_per_date_naming_each_run():
    """benchmarks/results/ keeps what the runs wrote; each date's README.md names
    every run folder and file there, and the commands live in it, not in scripts
    (benchmarks/gpu_run.sh runs them)."""
    results = ROOT / "benchmarks" / "results"
    kinds = {".json", ".log", ".xml", ".txt", ".gz", ".md"}
    dates = sorted(p for p in results.iterdir() if p.is_dir())
    assert dates
    for date in dates:
        readme = (date / "README.md").read_text()
        for path in date.rglob("*"):
            assert not path.is_file() or path.suffix in kinds, f"{path} is not run output"
        for entry in date.iterdir():
            stem = entry.name.split(".")[0]
            assert entry.name == "README.md" or stem in readme, f"{date.name}/README.md does not name {entry.name}"


def test_gym_masks_are_the_catalogues_code_at_every_seq(tmp_path):
    """The gym_* mods run the catalogue entry's own code with constants for the seq:
    opt-in (not in the default --mods), traced by scoremod as the catalogue's mod is,
    a dry run gives their rows, and a mask with no form at a seq is no row."""
    import jax.numpy as jnp
    import numpy as np

    from tests.catalogue.mods import CATALOGUE

    assert not set(bench.GYM_MODS) & set(bench.parse_args([]).mods)
    assert set(bench.GYM) <= set(CATALOGUE)
    for s in (64, 4096, 32768):
        for name in bench.GYM_MODS:
            consts = bench.GYM[name[4:]](s)
            if consts is None:
                assert name == "gym_morton_natten" and s == 32768
                continue
            want = CATALOGUE[name[4:]].build(consts)
            if s == 64:  # the same scores as the catalogue's own port
                got = bench.jax_mod(name, bench.aux_arrays(1, 2, s, 8))
                grid = [jnp.asarray(x) for x in _grid(1, 2, s)]
                sc = jnp.zeros((1, 2, s, s))
                np.testing.assert_array_equal(np.asarray(got(sc, *grid)),
                                              np.asarray(want(sc, *grid)), err_msg=name)
    out = tmp_path / "g.json"
    assert bench.main(["--dry-run", "--mods", "gym_natten,gym_morton_natten", "--seqs", "64",
                       "--long", "0", "--directions", "fwd", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["mod"], r["status"]) for r in rows] == [("gym_natten", "ok"),
                                                       ("gym_morton_natten", "ok")]
