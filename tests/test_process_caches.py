"""JAX's compilation cache under SCOREMOD_JAX_CACHE=1: sealed entries, a private folder.

On the CPU: JAX's persistent cache writes CPU executables too, and scoremod sets
its thresholds to 0, so every jitted program of a process is an entry.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import threading

import pytest

from scoremod import process_caches

# One jitted attention call: softcap ``cap`` at sequence length ``n``; prints its
# output and how many programs the process loaded from the cache.
_PROGRAM = """
import json, sys
import numpy as np, jax, scoremod
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
cap, n = float(sys.argv[1]), int(sys.argv[2])
q = np.linspace(-3, 3, n * 8, dtype=np.float32).reshape(1, n, 1, 8)
f = jax.jit(lambda q, k, v: scoremod.attention(
    q, k, v, lambda s, b, h, qi, ki: cap * jax.numpy.tanh(s / cap), implementation="xla"))
out = np.asarray(f(q, 2 * q, q))
print(json.dumps({"out": out.ravel().tolist(),
                  "hits": events.count("/jax/compilation_cache/cache_hits"),
                  "dir": jax.config.jax_compilation_cache_dir}))
"""


def _run(root, cap, n, **env_changes):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SCOREMOD_CACHE_DIR": str(root),
           "SCOREMOD_JAX_CACHE": "1", **env_changes}
    run = subprocess.run([sys.executable, "-c", _PROGRAM, str(cap), str(n)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1]), run.stderr


def _entries(folder):
    return {n for n in os.listdir(folder) if n.endswith("-cache")}


def _cold(root, programs):
    """Each program's output in a process that compiled it, and its entry's file name."""
    folder = root / "jax"
    outs, names = [], []
    for cap, n in programs:
        before = _entries(folder) if folder.is_dir() else set()
        result, _ = _run(root, cap, n)
        assert result["hits"] == 0 and result["dir"] == str(folder)
        (new,) = _entries(folder) - before  # one jitted program, one entry
        outs.append(result["out"])
        names.append(new)
    return outs, names


@pytest.mark.parametrize("how", ["replace", "rotate"])
def test_an_entry_moved_over_another_is_compiled_again_not_run(tmp_path, how):
    # The adversarial trial: another program's valid file at an entry's name ran as
    # that program (cap 50 for 0.5, no error); rotated files crashed in JAX's
    # ValueError on a layout annotation (different shapes).
    programs = [(0.5, 16), (50.0, 16)] if how == "replace" else [(0.5, 16), (50.0, 16), (0.5, 32)]
    outs, names = _cold(tmp_path, programs)
    assert outs[0] != outs[1]  # the two caps tell apart which program ran
    folder = tmp_path / "jax"
    if how == "replace":
        shutil.copyfile(folder / names[1], folder / names[0])
        targets = [0]
    else:
        data = [(folder / name).read_bytes() for name in names]
        for i, name in enumerate(names):
            (folder / name).write_bytes(data[i - 1])
        targets = range(len(programs))
    for i in targets:
        result, stderr = _run(tmp_path, *programs[i])
        assert result["out"] == outs[i], f"program {i} ran another program's file"
        assert result["hits"] == 0
        assert "ignoring the JAX compilation cache entry" in stderr
        assert "holds the program of another key" in stderr
    # Each rejected entry was rewritten: the next process loads it, and it is right.
    for i in targets:
        result, stderr = _run(tmp_path, *programs[i])
        assert (result["out"], result["hits"]) == (outs[i], 1), stderr[-2000:]
        assert "ignoring" not in stderr


def test_plain_jax_entries_are_not_trusted(tmp_path):
    # A file JAX wrote without scoremod has no key to check: it is compiled again.
    plain = {"SCOREMOD_JAX_CACHE": "0", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    want, _ = _run(tmp_path, 0.5, 16, **plain)
    # Plain JAX at these thresholds caches every program of the process (jax 0.10
    # writes 3 here, later versions 1): at least the attention call's.
    assert want["hits"] == 0 and len(_entries(tmp_path / "jax")) >= 1
    result, stderr = _run(tmp_path, 0.5, 16)
    assert (result["out"], result["hits"]) == (want["out"], 0)
    assert "not sealed by scoremod" in stderr
    result, _ = _run(tmp_path, 0.5, 16)  # now sealed
    assert (result["out"], result["hits"]) == (want["out"], 1)


_SETUP = """
import jax
from scoremod import process_caches
process_caches.setup()
print(jax.config.jax_compilation_cache_dir)
"""


def _setup_in_a_process(root):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SCOREMOD_CACHE_DIR": str(root),
           "SCOREMOD_JAX_CACHE": "1"}
    run = subprocess.run([sys.executable, "-c", _SETUP], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()[-1], run.stderr


@pytest.mark.parametrize("where, mode, why", [
    ("jax", 0o777, "the folder is writable by its group and others (mode 777)"),
    ("jax", 0o720, "the folder is writable by its group (mode 720)"),
    ("root", 0o757, "its parent {root} is writable by others (mode 757)"),
])
def test_a_folder_others_may_write_is_not_used(tmp_path, where, mode, why):
    root = tmp_path / "root"
    (root / "jax").mkdir(parents=True)
    os.chmod(root / where if where == "jax" else root, mode)
    directory, stderr = _setup_in_a_process(root)
    assert directory == "None"
    assert f"not using JAX's compilation cache in {root / 'jax'}: {why.format(root=root)}" in stderr
    assert f"chmod 700 {root / 'jax'}" in stderr


def test_a_private_folder_is_used_and_a_sticky_parent_is_fine(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o1777)  # like /tmp: others cannot rename our folder away
    directory, stderr = _setup_in_a_process(root)
    assert directory == str(root / "jax") and "compilation cache" not in stderr
    assert stat.S_IMODE(os.stat(root / "jax").st_mode) == 0o700


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a folder to another user needs root")
def test_a_folder_of_another_user_is_not_used(tmp_path):
    root = tmp_path / "root"
    (root / "jax").mkdir(parents=True, mode=0o700)
    os.chown(root / "jax", 4321, -1)
    directory, stderr = _setup_in_a_process(root)
    assert directory == "None"
    assert "the folder is owned by uid 4321, not by you (uid 0)" in stderr


# --- the sealed file cache itself, in this process --------------------------------


@pytest.fixture
def sealed(tmp_path):
    from jax._src.lru_cache import LRUCache

    return process_caches.SealedEntries(LRUCache(str(tmp_path), max_size=-1), str(tmp_path))


def test_sealed_entries_round_trip(sealed, tmp_path):
    sealed.put("jit_f-abc", b"\x00compiled\nbytes")
    assert sealed.get("jit_f-abc") == b"\x00compiled\nbytes"
    assert sealed.get("jit_g-def") is None
    raw = (tmp_path / "jit_f-abc-cache").read_bytes()
    assert raw == process_caches.seal("jit_f-abc", b"\x00compiled\nbytes")
    assert raw.startswith(b"scoremod-jax-entry\n")


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "empty"])
def test_a_damaged_entry_is_a_miss_and_removed(sealed, tmp_path, damage, caplog):
    sealed.put("jit_f-abc", b"compiled bytes" * 100)
    path = tmp_path / "jit_f-abc-cache"
    data = path.read_bytes()
    data = {"truncate": data[:len(data) // 2], "empty": b"",
            "flip a byte": data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]}[damage]
    path.write_bytes(data)
    assert sealed.get("jit_f-abc") is None
    assert not path.exists()
    assert "ignoring the JAX compilation cache entry" in caplog.text


def test_a_pipe_at_an_entry_does_not_block(sealed, tmp_path):
    path = tmp_path / "jit_f-abc-cache"
    os.mkfifo(path)
    got = []
    reader = threading.Thread(target=lambda: got.append(sealed.get("jit_f-abc")), daemon=True)
    reader.start()
    reader.join(timeout=20)
    if reader.is_alive():  # unblock the reader (it waits for a writer), then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a pipe at an entry's path blocked")
    assert got == [None] and not path.exists()


def test_an_entry_others_may_write_is_not_run_and_ours_are_written_private(sealed, tmp_path):
    old = os.umask(0o002)  # a umask that gives new files to the group
    try:
        sealed.put("jit_f-abc", b"compiled")
    finally:
        os.umask(old)
    path = tmp_path / "jit_f-abc-cache"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert sealed.get("jit_f-abc") == b"compiled"
    os.chmod(path, 0o666)
    assert sealed.get("jit_f-abc") is None and not path.exists()
