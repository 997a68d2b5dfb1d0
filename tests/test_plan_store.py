"""The on-disk cuDNN plan cache: keys, files, atomic writes, verification, settings.

No GPU is needed: records are ``graph.Built`` values made up here, keys
are the lowering's real graph keys (``plan.Part.key``), and the
environment (cuDNN versions, GPU) is a given tuple.
"""

import dataclasses
import math
import multiprocessing
import os
import subprocess
import sys
import warnings

import pytest

import scoremod
from scoremod.errors import ScoreModError
from scoremod.lowering.cudnn import graph as cudnn_graph, plan_store
from scoremod.lowering.cudnn.graph import Built
from scoremod.lowering.cudnn.plan import Part
from scoremod.lowering.problem import Problem
from scoremod.options import LoweringOptions

ENV = (("cudnn_backend", 91900), ("cudnn_frontend", "1.32.0"), ("ffi_frontend", 13200),
       ("ffi_cudnn", 91900), ("ffi_cudart", 13000), ("gpu", "NVIDIA H200"),
       ("compute_capability", "9.0"))
SHAPES = (2, 256, 256, 4, 4, 64, 64)  # b, sq, skv, hq, hkv, d, dv


def record(seed=0, size=90_000):
    blob = bytes((i * 131 + seed) % 256 for i in range(size))
    return Built(blob, 1234567 + seed, (1, 2, 3, 100), (4, 5), (1000, 1001),
                 (1065353216, -7), 4096 + seed, "eng0_k2=3", 0.731)


def store_at(path, env=ENV, **kw):
    return plan_store.Store(str(path), environment=lambda: env, **kw)


def graph_key(text="30.0 * tanh(score / 30.0)", shapes=SHAPES, dtype="bfloat16", scale=0.125,
              direction="forward", versions=(9, 91900, 13200)):
    part = Part(scoremod.parse(text), Problem(*shapes, dtype), scale, LoweringOptions())
    return (direction,) + part.key + versions


@pytest.fixture(autouse=True)
def _fresh_process_store():
    plan_store.reset()
    yield
    plan_store.reset()
    cudnn_graph.cache_clear()


def plan_files(directory):
    return sorted(n for n in os.listdir(directory) if n.endswith(".plan")
                  and not n.startswith(".tmp-")) if os.path.isdir(directory) else []


# --- keys -------------------------------------------------------------------------


def test_encoding_tells_apart_what_python_equality_confuses():
    values = [0.0, -0.0, 0, False, 1, 1.0, True, "1", b"1", None, (1,), [1], {1},
              float("nan"), -float("nan"), math.inf, (1, (2,)), ((1, 2),)]
    encodings = [plan_store.encode(v) for v in values]
    assert len(set(encodings)) == len(values), encodings


def test_encoding_refuses_objects_without_a_stable_text():
    with pytest.raises(TypeError, match="cannot encode"):
        plan_store.encode(("forward", object()))


def test_real_graph_keys_encode_and_differ_in_every_field():
    base = graph_key()
    variants = {
        "mod": graph_key("20.0 * tanh(score / 20.0)"),
        "constant bits": graph_key("30.000002 * tanh(score / 30.0)"),
        "batch": graph_key(shapes=(1,) + SHAPES[1:]),
        "seq": graph_key(shapes=(2, 384, 384, 4, 4, 64, 64)),
        "heads (GQA)": graph_key(shapes=(2, 256, 256, 4, 2, 64, 64)),
        "head dim": graph_key(shapes=SHAPES[:5] + (128, 128)),
        "dtype": graph_key(dtype="float16"),
        "scale": graph_key(scale=math.nextafter(0.125, 1)),
        "direction": graph_key(direction="backward"),
        "cuDNN version": graph_key(versions=(9, 92800, 13200)),
        "frontend": graph_key(versions=(9, 91900, 13300)),
        "GPU family": graph_key(versions=(10, 91900, 13200)),
        "native mask band": graph_key("where(kv_idx <= q_idx, score, -inf)"),
        "band width": graph_key("where(kv_idx <= q_idx and kv_idx > q_idx - 64, score, -inf)"),
        "load": graph_key("bias: float32[4]; score + bias[h]"),
        "load layout": graph_key("bias: float32[256]; score + bias[q_idx]"),
    }
    texts = {name: plan_store.encode(k) for name, k in variants.items()}
    assert plan_store.encode(base) == plan_store.encode(graph_key())
    for name, text in texts.items():
        assert text != plan_store.encode(base), name
    assert len(set(texts.values())) == len(texts)


def test_key_encoding_is_the_same_in_every_process():
    code = ("from tests.test_plan_store import graph_key; from scoremod.lowering.cudnn import plan_store;"
            "print(plan_store.encode(graph_key('bias: float32[4]; score + bias[h] * q_idx')))")
    outs = set()
    for seed in ("1", "2"):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu"},
                             timeout=300)
        assert run.returncode == 0, run.stderr
        outs.add(run.stdout)
    assert len(outs) == 1
    assert outs.pop().strip() == plan_store.encode(graph_key("bias: float32[4]; score + bias[h] * q_idx"))


def test_any_key_or_environment_change_is_a_miss(tmp_path):
    store = store_at(tmp_path)
    key = graph_key()
    assert store.put(key, record())
    assert store.get(key, Built) == record()
    assert store.get(graph_key(scale=0.25), Built) is None
    assert store.get(graph_key(dtype="float16"), Built) is None
    for i, (name, value) in enumerate(ENV):
        env = ENV[:i] + ((name, f"{value}x"),) + ENV[i + 1:]
        assert store_at(tmp_path, env).get(key, Built) is None, name
    assert store.counters["disk_rejected"] == 0  # a different key is a miss, not a bad file


def test_a_new_format_version_ignores_old_entries(tmp_path, monkeypatch):
    store_at(tmp_path).put(graph_key(), record())
    monkeypatch.setattr(plan_store, "FORMAT_VERSION", plan_store.FORMAT_VERSION + 1)
    assert store_at(tmp_path).get(graph_key(), Built) is None


# --- files --------------------------------------------------------------------


def test_round_trip_keeps_every_field_exactly(tmp_path):
    store = store_at(tmp_path)
    rec = dataclasses.replace(record(), seconds=1 / 3, scalar_bits=(-2**31, 2**31 - 1))
    assert store.put(graph_key(), rec)
    got = store_at(tmp_path).get(graph_key(), Built)  # a new store: nothing in memory
    assert got == rec and type(got.blob) is bytes and type(got.in_uids) is tuple
    (name,) = plan_files(tmp_path)
    assert name == os.path.basename(store.path(store.material(graph_key())))
    with open(tmp_path / name, "rb") as f:
        head = f.read(200)
    assert head.startswith(b"scoremod-plan\n")  # JSON header and raw bytes, no pickle
    assert b"pickle" not in head and not head.startswith(b"\x80")


def _corrupt(path, how):
    data = open(path, "rb").read()
    if how == "flip payload byte":
        data = data[:-100] + bytes([data[-100] ^ 1]) + data[-99:]
    elif how == "truncate half":
        data = data[:len(data) // 2]
    elif how == "truncate to magic":
        data = data[:14]
    elif how == "drop last byte":
        data = data[:-1]
    elif how == "empty":
        data = b""
    elif how == "garbage":
        data = b"\x00garbage" * 50
    elif how == "flip digest":
        i = len(b"scoremod-plan\n")
        data = data[:i] + (b"0" if data[i:i + 1] != b"0" else b"1") + data[i + 1:]
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("how", ["flip payload byte", "truncate half", "truncate to magic",
                                 "drop last byte", "empty", "garbage", "flip digest"])
def test_corrupt_entries_are_removed_never_trusted(tmp_path, how):
    store = store_at(tmp_path)
    store.put(graph_key(), record())
    (name,) = plan_files(tmp_path)
    _corrupt(tmp_path / name, how)
    assert store.get(graph_key(), Built) is None
    assert store.counters["disk_rejected"] == 1
    assert plan_files(tmp_path) == []


def _get_within(store, key, seconds=20):
    """``store.get(key)`` in a thread: (finished, result); a read that blocks fails the
    test instead of hanging the suite."""
    import threading

    got = []
    reader = threading.Thread(target=lambda: got.append(store.get(key, Built)), daemon=True)
    reader.start()
    reader.join(timeout=seconds)
    return (not reader.is_alive()), (got[0] if got else None)


def test_a_pipe_at_an_entry_is_never_opened(tmp_path):
    store = store_at(tmp_path)
    path = store.path(store.material(graph_key()))
    os.mkfifo(path)
    try:
        finished, got = _get_within(store, graph_key())
    finally:
        if os.path.exists(path) and not os.path.isfile(path):  # unblock a stuck reader
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader: nothing to unblock
                pass
    assert finished, "Store.get blocked on a pipe at the entry's path"
    assert got is None and store.counters["disk_rejected"] == 1
    assert not os.path.exists(path)  # removed: the next build writes the entry
    assert store.put(graph_key(), record())
    assert store.get(graph_key(), Built) == record()


def test_a_link_at_an_entry_is_not_followed(tmp_path):
    # A link may point outside the private folder, at a file others can write.
    store = store_at(tmp_path / "plans")
    store.put(graph_key(), record())
    path = store.path(store.material(graph_key()))
    outside = tmp_path / "outside.plan"
    os.replace(path, outside)
    os.symlink(outside, path)
    assert store.get(graph_key(), Built) is None and store.counters["disk_rejected"] == 1
    assert not os.path.lexists(path) and outside.exists()  # the link goes, not its target


def _rewrite_header(path, edit):
    """Change the JSON header and recompute the digest: a well-formed file that lies."""
    import hashlib
    import json

    data = open(path, "rb").read()
    body = data.split(b"\n", 2)[2]
    size, rest = body.split(b"\n", 1)
    header = json.loads(rest[:int(size)])
    edit(header)
    new_header = json.dumps(header).encode()
    body = b"%d\n" % len(new_header) + new_header + rest[int(size):]
    with open(path, "wb") as f:
        f.write(b"scoremod-plan\n" + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)


@pytest.mark.parametrize("edit", [
    lambda h: h.update(key=h["key"].replace("bfloat16", "float16")),
    lambda h: h.update(format=0),
    lambda h: h["fields"].pop("workspace"),
    lambda h: h["fields"].update(extra=1),
    lambda h: h.update(record="Other"),
], ids=["other key material", "other format", "missing field", "extra field", "other record"])
def test_well_formed_files_for_something_else_are_rejected(tmp_path, edit):
    store = store_at(tmp_path)
    store.put(graph_key(), record())
    (name,) = plan_files(tmp_path)
    _rewrite_header(tmp_path / name, edit)
    assert store.get(graph_key(), Built) is None
    assert store.counters["disk_rejected"] == 1


def _rewrite_raw(path, edit):
    """Replace the header's bytes (and its length line) with ``edit(size_line, header)``'s,
    and recompute the digest: a file whose digest is valid and whose header is odd."""
    import hashlib

    data = open(path, "rb").read()
    body = data.split(b"\n", 2)[2]
    size, rest = body.split(b"\n", 1)
    new_size, new_header = edit(size, rest[:int(size)])
    body = new_size + b"\n" + new_header + rest[int(size):]
    with open(path, "wb") as f:
        f.write(b"scoremod-plan\n" + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)


def _deep(size, header):
    header = header[:-1] + b', "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return b"%d" % len(header), header


def _padded(size, header):
    header = header[:-1] + b', "pad": "' + b"x" * (2 << 20) + b'"}'
    return b"%d" % len(header), header


def _long_length_line(size, header):
    return b"0" * 5000 + size, header


# A valid digest over odd content: each was trusted (a record with a string for its
# workspace) or crashed the read (RecursionError, int()'s digit limit).
_ODD_HEADERS = {
    "a string for an int": lambda h: h["fields"].update(workspace="4096"),
    "a boolean for an int": lambda h: h["fields"].update(workspace=True),
    "a 400-digit int": lambda h: h["fields"].update(graph_id=10 ** 399),
    "an int past 64 bits": lambda h: h["fields"].update(graph_id=2 ** 63),
    "a string in a tuple": lambda h: h["fields"].update(in_uids=[1, "2", 3]),
    "a string for a tuple": lambda h: h["fields"].update(in_uids="123"),
    "an object for a string": lambda h: h["fields"].update(plan={"a": 1}),
    "NaN seconds": lambda h: h["fields"].update(seconds=float("nan")),
    "format true": lambda h: h.update(format=True),
    "an extra header key": lambda h: h.update(extra=1),
}
_ODD_BYTES = {"a 100,000-deep header": _deep, "a 2 MB header": _padded,
              "a 5000-digit header length": _long_length_line}


@pytest.mark.parametrize("how", [*_ODD_HEADERS, *_ODD_BYTES])
def test_odd_content_under_a_valid_digest_is_rejected_not_trusted(tmp_path, how):
    store = store_at(tmp_path)
    store.put(graph_key(), record())
    (name,) = plan_files(tmp_path)
    if how in _ODD_HEADERS:
        _rewrite_header(tmp_path / name, _ODD_HEADERS[how])
    else:
        _rewrite_raw(tmp_path / name, _ODD_BYTES[how])
    assert store.get(graph_key(), Built) is None
    assert store.counters["disk_rejected"] == 1
    assert plan_files(tmp_path) == []  # removed, as a bad digest is
    assert store.put(graph_key(), record()) and store.get(graph_key(), Built) == record()


def test_a_record_that_would_not_read_back_is_not_written(tmp_path):
    store = store_at(tmp_path)
    with pytest.raises(ValueError, match="Built cannot be stored: field workspace: an int of 20 digits"):
        store.put(graph_key(), dataclasses.replace(record(), workspace=2 ** 64))
    with pytest.raises(ValueError, match="Built cannot be stored: field in_uids: a string where an int"):
        store.put(graph_key(), dataclasses.replace(record(), in_uids=(1, "2")))

    @dataclasses.dataclass(frozen=True)
    class Loose:
        blob: bytes
        uids: tuple  # no item type: nothing to check what is read back against

    with pytest.raises(TypeError, match="cannot check Loose.uids"):
        store.put(graph_key(), Loose(b"graph", (1, 2)))
    assert plan_files(tmp_path) == []


def test_an_untouched_rewrite_still_verifies(tmp_path):
    # The helper above changes only what its edit changes (so the tests above test the edits).
    store = store_at(tmp_path)
    store.put(graph_key(), record())
    (name,) = plan_files(tmp_path)
    _rewrite_header(tmp_path / name, lambda h: None)
    assert store.get(graph_key(), Built) == record()


_CRASH_WRITER = """
import os, sys
from tests.test_plan_store import graph_key, record, store_at
real_fsync = os.fsync
def crash(fd):
    os.write(fd, b"")  # the bytes are written, the process dies before the rename
    os._exit(17)
os.fsync = crash
store_at(sys.argv[1]).put(graph_key(), record())
"""


def test_a_crash_mid_write_leaves_no_visible_entry(tmp_path):
    run = subprocess.run([sys.executable, "-c", _CRASH_WRITER, str(tmp_path)],
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 17, run.stderr
    assert plan_files(tmp_path) == []
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert len(leftovers) == 1 and os.path.getsize(tmp_path / leftovers[0]) > 0
    store = store_at(tmp_path)
    assert store.get(graph_key(), Built) is None and store.counters["disk_rejected"] == 0
    # A stale temporary file is removed by the next write's housekeeping.
    os.utime(tmp_path / leftovers[0], (0, 0))
    assert store.put(graph_key(), record())
    assert [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")] == []
    assert store.get(graph_key(), Built) == record()


def _hammer(directory, seed, rounds):
    """Write the same entry over and over while reading it back (another process)."""
    store = store_at(directory)
    for _ in range(rounds):
        assert store.put(graph_key(), record())
        got = store.get(graph_key(), Built)
        assert got == record(), "a reader saw a partial or foreign entry"
    return store.counters["disk_rejected"]


def test_processes_writing_the_same_entry_at_once_all_succeed(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        rejected = pool.starmap(_hammer, [(str(tmp_path), i, 30) for i in range(3)])
    assert rejected == [0, 0, 0]
    assert len(plan_files(tmp_path)) == 1
    assert [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")] == []
    assert store_at(tmp_path).get(graph_key(), Built) == record()


def test_eviction_keeps_the_most_recently_used_within_the_bound(tmp_path):
    store = store_at(tmp_path, max_bytes=3 * 95_000)
    keys = [graph_key(shapes=(b,) + SHAPES[1:]) for b in range(1, 6)]
    for i, key in enumerate(keys[:3]):
        store.put(key, record(i))
        os.utime(store.path(store.material(key)), (1000 + i, 1000 + i))
    assert store.get(keys[0], Built) == record(0)  # a hit makes the oldest the newest
    store.put(keys[3], record(3))
    assert store.get(keys[1], Built) is None  # now the oldest: evicted
    assert store.get(keys[0], Built) == record(0)
    assert store.get(keys[3], Built) == record(3)
    assert sum(size for _, size, _ in store.entries()) <= store.max_bytes
    store.clear()
    assert plan_files(tmp_path) == []


def test_an_unwritable_directory_warns_once_and_keeps_working(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    store = store_at(blocker / "plans")
    with pytest.warns(RuntimeWarning, match="cannot write the cuDNN plan cache"):
        assert not store.put(graph_key(), record())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not store.put(graph_key(scale=0.5), record())
        assert store.get(graph_key(), Built) is None


def test_the_store_makes_its_folder_and_the_cache_root_private(tmp_path):
    # Under a umask that gives new folders to the group, JAX's cache beside the store
    # would refuse a root that the store created group-writable.
    old = os.umask(0o002)
    try:
        assert store_at(tmp_path / "root" / "cudnn-plans").put(graph_key(), record())
    finally:
        os.umask(old)
    for folder in (tmp_path / "root", tmp_path / "root" / "cudnn-plans"):
        assert os.stat(folder).st_mode & 0o777 == 0o700, folder


# --- the process's store, through the graph cache ------------------------------


def test_the_graph_cache_loads_what_an_earlier_process_built(tmp_path):
    plan_store.configure(store_at(tmp_path))
    builds = []

    def build():
        builds.append(1)
        return record()

    key = graph_key()
    assert cudnn_graph.cached(key, build) == record()
    info = scoremod.cache_info()
    assert (info["builds"], info["disk_misses"], info["disk_writes"]) == (1, 1, 1)
    cudnn_graph.cache_clear()  # a new process: an empty memory cache
    plan_store.configure(store_at(tmp_path))
    assert cudnn_graph.cached(key, build) == record()
    info = scoremod.cache_info()
    assert (info["builds"], info["disk_hits"], len(builds)) == (0, 1, 1)
    assert cudnn_graph.cached(key, build) == record()  # then from memory
    assert scoremod.cache_info()["hits"] == 1


def test_a_corrupt_entry_is_rebuilt_and_rewritten(tmp_path):
    plan_store.configure(store_at(tmp_path))
    cudnn_graph.cached(graph_key(), record)
    (name,) = plan_files(tmp_path)
    _corrupt(tmp_path / name, "flip payload byte")
    cudnn_graph.cache_clear()
    assert cudnn_graph.cached(graph_key(), record) == record()
    info = scoremod.cache_info()
    assert (info["disk_rejected"], info["builds"], info["disk_writes"]) == (1, 1, 1)
    assert store_at(tmp_path).get(graph_key(), Built) == record()


def test_a_failing_store_never_fails_the_call(tmp_path):
    def broken_environment():  # e.g. the extension's versions cannot be read
        raise scoremod.CudnnUnavailableError("no extension here")

    plan_store.configure(plan_store.Store(str(tmp_path), environment=broken_environment))
    assert cudnn_graph.cached(graph_key(), record) == record()
    assert scoremod.cache_info()["builds"] == 1


# --- settings -------------------------------------------------------------------


def test_where_the_cache_lives(monkeypatch, tmp_path):
    for name in ("SCOREMOD_CACHE_DIR", "SCOREMOD_PLAN_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert plan_store.store_root() == str(tmp_path / "home" / ".cache" / "scoremod")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert plan_store.store_root() == str(tmp_path / "xdg" / "scoremod")
    monkeypatch.setenv("SCOREMOD_CACHE_DIR", str(tmp_path / "mine"))
    assert plan_store.store_root() == str(tmp_path / "mine")
    assert plan_store.default_store().directory == str(tmp_path / "mine" / "cudnn-plans")
    monkeypatch.setenv("SCOREMOD_PLAN_CACHE", "0")
    assert plan_store.store_root() is None
    monkeypatch.setenv("SCOREMOD_PLAN_CACHE", "1")
    monkeypatch.setenv("SCOREMOD_CACHE_DIR", "")
    assert plan_store.store_root() is None
    plan_store.reset()
    assert plan_store.default_store() is None
    assert plan_store.fetch(graph_key(), Built) is None


def test_describe_says_where_and_how_full(monkeypatch, tmp_path):
    monkeypatch.setenv("SCOREMOD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SCOREMOD_CACHE_MAX_MB", "64")
    store_at(tmp_path / "cudnn-plans").put(graph_key(), record())
    assert plan_store.describe() == (f"cuDNN plan cache: {tmp_path / 'cudnn-plans'} (1 graphs, "
                                     "0.1 of 64 MB)")
    monkeypatch.setenv("SCOREMOD_CACHE_DIR", "")
    assert "off (SCOREMOD_CACHE_DIR is empty)" in plan_store.describe()
    monkeypatch.setenv("SCOREMOD_PLAN_CACHE", "0")
    assert "off (SCOREMOD_PLAN_CACHE=0)" in plan_store.describe()


def test_bad_settings_say_what_is_expected(monkeypatch):
    monkeypatch.setenv("SCOREMOD_PLAN_CACHE", "yes")
    with pytest.raises(ScoreModError, match="SCOREMOD_PLAN_CACHE='yes': expected 0"):
        plan_store.default_store()
    monkeypatch.setenv("SCOREMOD_PLAN_CACHE", "1")
    monkeypatch.setenv("SCOREMOD_CACHE_DIR", "/tmp/x")
    monkeypatch.setenv("SCOREMOD_CACHE_MAX_MB", "-3")
    with pytest.raises(ScoreModError, match="SCOREMOD_CACHE_MAX_MB='-3'"):
        plan_store.default_store()
    monkeypatch.setenv("SCOREMOD_CACHE_MAX_MB", "0.5")
    assert plan_store.default_store().max_bytes == 1 << 19


_JAX_CACHE = """
import jax
from scoremod import process_caches
process_caches.setup()
print(jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
"""
# The same switch from a call that never reaches cuDNN (the Pallas kernels' first call
# is mostly compiling: the cache keeps their code too).
_JAX_CACHE_ANY_BACKEND = """
import jax, jax.numpy as jnp, scoremod
q = jnp.ones((1, 8, 1, 16))
scoremod.attention(q, q, q, lambda s, b, h, qi, ki: s, implementation="xla")
print(jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
"""


@pytest.mark.parametrize("switch, plan_cache, user_dir, want", [
    ("1", "1", None, "{root}/jax 0.0"),
    ("0", "1", None, "None 1.0"),
    ("1", "1", "/elsewhere", "/elsewhere 1.0"),  # the user's own setting is kept
    ("1", "0", None, "{root}/jax 0.0"),  # the cuDNN plan cache's switch is another one
])
@pytest.mark.parametrize("script", [_JAX_CACHE, _JAX_CACHE_ANY_BACKEND],
                         ids=["setup", "any_backend"])
def test_jax_compilation_cache_opt_in(tmp_path, switch, plan_cache, user_dir, want, script):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SCOREMOD_CACHE_DIR": str(tmp_path),
           "SCOREMOD_JAX_CACHE": switch, "SCOREMOD_PLAN_CACHE": plan_cache}
    if user_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = user_dir
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-2:] == want.format(root=tmp_path).split()
