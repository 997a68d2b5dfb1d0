"""Whether the loaded cuDNN computes scoremod's graphs right on this GPU.

The fused path's rules (which graphs cuDNN accepts, and where it is silently
wrong) were measured on one cuDNN line (``support.CUDNN_VALIDATED``) with one
frontend (``support.CUDNN_FRONTEND``). Another version in the supported range
is trusted once it passes a conformance check on the machine: the mods of
:data:`CASES`, one per graph shape scoremod emits, run forward and backward in
bfloat16 and float16 on the fused path and on the reference path, and every
output (O, LSE, dQ, dK, dV) must agree within the GPU suite's tolerances.

:func:`refusal` is the cuDNN backends' version check. In order:

1. a row of :data:`KNOWN_BAD` that matches: refused, by name too, with the reason;
2. a cuDNN outside ``support.CUDNN_SUPPORTED``: ``implementation=None`` passes
   it over; asked for by name, it runs with a warning;
3. a verdict of this machine (cuDNN, frontend, GPU architecture and scoremod
   version): passed, it runs; failed, as in 2, the warning naming
   ``scoremod doctor --verify``;
4. the validated versions: it runs;
5. otherwise, at the first automatic use, the check runs once, now (with a
   warning saying so; ``SCOREMOD_CUDNN_VERIFY=0`` turns that off, and then
   ``implementation=None`` passes it over until ``scoremod doctor --verify``
   has run), and its verdict decides as in 3.

Verdicts live in ``<cache root>/cudnn-verdicts/``, one sealed file per key
(``scoremod.sealed``: a magic line, the SHA-256 of the rest, JSON), trusted
only when the folder and the file are yours alone, like the other caches.
Before a check runs its file says "started" with the process id: a process
that dies in the check (a crash in cuDNN) leaves that behind, which the next
process on the host reads as a failed verdict instead of crashing again.

The check runs calls through ``scoremod.attention``, which the front door
hands to :func:`use_attention` when it is imported (the lowering does not
import the front door); :func:`verify` takes any runner, so that tests can
stand in for the GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import re
import socket
import stat
import tempfile
import threading
import time
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from scoremod import device, kernels_ffi, options, process_caches, sealed, support
from scoremod.dsl.scoremod import trace
from scoremod.errors import ScoreModError
from scoremod.options import LoweringOptions

log = logging.getLogger("scoremod")

COMMAND = "scoremod doctor --verify"
SUBDIR = "cudnn-verdicts"
_MAGIC = b"scoremod-cudnn-verdict\n"
_FORMAT = 1
_MAX_FILE_BYTES = 1 << 20

#: The GPU suite's tolerances (tests/gpu/test_fused.py): max |fused - reference|
#: over max |reference|, per output.
TOLERANCE = {"bfloat16": 3e-2, "float16": 1e-2}
DTYPES = ("bfloat16", "float16")
OUTPUTS = ("O", "LSE", "dQ", "dK", "dV")


# --- versions and cases known to be wrong ------------------------------------------


@dataclasses.dataclass(frozen=True)
class KnownBad:
    """cuDNN versions ``low <= v < high`` (and frontends, where given) that the fused
    path refuses on the GPU families listed (all where empty), with why and on whose word."""

    cudnn: tuple[int, int]
    families: tuple[int, ...]
    reason: str
    source: str
    frontend: tuple[int, int] | None = None

    def matches(self, cudnn: int, frontend: int | None, family: int | None) -> bool:
        low, high = self.cudnn
        if not low <= cudnn < high or (self.families and family not in self.families):
            return False
        return self.frontend is None or (frontend is not None
                                         and self.frontend[0] <= frontend < self.frontend[1])


KNOWN_BAD = (
    KnownBad(cudnn=(92600, 92700), families=(9,),
             reason="its backward was reported to return NaN at one query row on an H200",
             source="a user report, not reproduced by scoremod's own GPU runs"),
)


def known_bad(cudnn: int, frontend: int | None, family: int | None) -> str | None:
    """Why :data:`KNOWN_BAD` refuses this cuDNN here, or None."""
    for row in KNOWN_BAD:
        if row.matches(cudnn, frontend, family):
            where = "" if not row.families else " on " + ", ".join(f"sm_{f}x" for f in row.families)
            return (f"cuDNN {support.version_text(cudnn)} is known to be wrong for scoremod's "
                    f"graphs{where}: {row.reason} ({row.source}); install another cuDNN in "
                    f"{support.cudnn_range_text()}, or use implementation=\"xla\"")
    return None


# --- the key of a verdict -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Key:
    """What a verdict holds for: the loaded cuDNN, the frontend, the GPU architecture
    and scoremod's version."""

    cudnn: int
    frontend: int
    arch: str  # "sm_90"
    scoremod: str

    def text(self) -> str:
        return (f"cuDNN {support.version_text(self.cudnn)}, frontend "
                f"{support.version_text(self.frontend)}, {self.arch}, scoremod {self.scoremod}")

    def file_name(self) -> str:
        name = (f"cudnn-{support.version_text(self.cudnn)}_frontend-"
                f"{support.version_text(self.frontend)}_{self.arch}_scoremod-{self.scoremod}")
        return re.sub(r"[^\w.+-]", "_", name) + ".verdict"

    def validated(self) -> bool:
        return (support.cudnn_validated(self.cudnn)
                and self.frontend == kernels_ffi.encode_version(support.CUDNN_FRONTEND))


def architecture(dev) -> str:
    """'sm_90' for compute capability 9.0 (the family alone where the minor is unknown)."""
    if dev.capability:
        return "sm_" + dev.capability.replace(".", "")
    return f"sm_{dev.family}x"


def current_key() -> Key | None:
    """The key of this process's cuDNN, frontend and GPU; None without a loaded cuDNN."""
    version, _ = device.loaded_cudnn_version()
    if version is None:
        return None
    return Key(int(version), int(kernels_ffi.installed_frontend_version() or 0),
               architecture(device.current()), support.VERSION)


# --- the conformance set -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One mod at one small shape, and the graph shape it stands for."""

    name: str
    covers: str
    make: Callable | None  # Case -> fn(score, b, h, q_idx, kv_idx); None: plain attention
    b: int = 2
    sq: int = 128
    skv: int = 192  # Sq != Skv, and a last key tile the padding mask cuts
    hq: int = 4
    hkv: int = 2  # grouped-query attention
    d: int = 64
    implementation: str = "cudnn"
    options: LoweringOptions = LoweringOptions()

    def mod(self):
        return None if self.make is None else trace(self.make(self))

    def inputs(self, dtype: str):
        rng = np.random.default_rng(0)
        shapes = ((self.b, self.sq, self.hq, self.d), (self.b, self.skv, self.hkv, self.d),
                  (self.b, self.skv, self.hkv, self.d), (self.b, self.sq, self.hq, self.d))
        return tuple(jnp.asarray(rng.standard_normal(s, np.float32), dtype) for s in shapes)


def _slopes(c):
    return jnp.asarray([2.0 ** (-8 * (i + 1) / c.hq) for i in range(c.hq)], jnp.float32)


def _documents(c):
    rng = np.random.default_rng(1)
    return jnp.asarray(np.sort(rng.integers(0, 3, (c.b, max(c.sq, c.skv))), axis=1), jnp.int32)


def _alibi(c):
    slopes = _slopes(c)
    return lambda s, b, h, q, k: s + slopes[h] * (k - q)


def _kv_bias(c):
    bias = jnp.asarray(np.random.default_rng(2).standard_normal(c.skv), jnp.float32)
    return lambda s, b, h, q, k: s + bias[k]


def _document(c):
    docs = _documents(c)
    return lambda s, b, h, q, k: jnp.where(docs[b, q] == docs[b, k], s, -jnp.inf)


def _relative_bias(c):
    off = max(c.sq, c.skv)
    table = jnp.asarray(np.random.default_rng(3).standard_normal(2 * off + 1), jnp.float32)
    return lambda s, b, h, q, k: s + table[q - k + off]


def _softcap_causal(c):
    return lambda s, b, h, q, k: jnp.where(q >= k, 30.0 * jnp.tanh(s / 30.0), -jnp.inf)


CASES = (
    Case("plain", "plain SDPA, no score_mod, head dim 128", None, d=128),
    Case("softcap", "tanh, with 1/cap folded into attn_scale",
         lambda c: lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0)),
    Case("causal", "cuDNN's native causal band, no score_mod",
         lambda c: lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf)),
    Case("sliding_window", "the native band with a left bound",
         lambda c: lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 32), s, -jnp.inf)),
    Case("softcap_causal", "a gen_index mask inside the score_mod", _softcap_causal),
    Case("softcap_causal_split", "the mod split into query blocks (offsets, rows in place)",
         _softcap_causal, sq=512, skv=512, options=LoweringOptions(split_blocks=4, sms=1)),
    Case("alibi", "a captured per-head array [1,H,1,1] times an index difference", _alibi),
    Case("kv_bias", "a kv-only array, materialized as [1,1,Sq,Skv]", _kv_bias),
    Case("relative_bias", "a table read at q_idx - kv_idx, materialized", _relative_bias),
    Case("document", "a data mask, materialized as [B,1,Sq,Skv]", _document),
    Case("document_ragged", "packed documents as ragged sequences (variable-length SDPA)",
         _document, sq=192, skv=192, implementation="cudnn-varlen"),
    Case("integer_division", "index math with // and %",
         lambda c: lambda s, b, h, q, k: jnp.where((q // 32 == k // 32) | (k % 8 == 0), s,
                                                   -jnp.inf)),
    Case("fully_masked_rows", "rows whose scores are all -inf (O 0, LSE -inf, zero gradients)",
         lambda c: lambda s, b, h, q, k: jnp.where((q >= 16) & (q >= k), s, -jnp.inf),
         sq=192, skv=192),
    Case("sigmoid", "a derivative with factors (where a dangling branch gave dV 50x off)",
         lambda c: lambda s, b, h, q, k: 4.0 * jax.nn.sigmoid(s)),
)


# --- running the set ----------------------------------------------------------------


_API: dict = {}


def use_attention(attention) -> None:
    """The front door's ``scoremod.attention``, with which :func:`run_case` runs."""
    _API["attention"] = attention


def run_case(case: Case, dtype: str, implementation: str) -> tuple:
    """(O, LSE, dQ, dK, dV) of ``case`` as float32 NumPy arrays, through
    ``scoremod.attention`` with ``implementation``; computed now, also when
    called while a program is being traced."""
    attention = _API["attention"]
    # The inputs and the mod's arrays as values, also inside a trace; the step is
    # compiled and run as its own program (under ensure_compile_time_eval its
    # kernels' own arrays would become constants, which custom_partitioning refuses).
    with jax.ensure_compile_time_eval():
        q, k, v, do = (np.asarray(x) for x in case.inputs(dtype))
        mod = case.mod()

    def step(q, k, v, do):
        def f(q, k, v):
            o, lse = attention(q, k, v, mod, implementation=implementation,
                               return_lse=True, options=case.options)
            return o, jax.lax.stop_gradient(lse)  # the fused path does not differentiate it

        (o, lse), vjp = jax.vjp(f, q, k, v)
        return (o, lse, *vjp((do, jnp.zeros_like(lse))))

    compiled = jax.jit(step).lower(q, k, v, do).compile()
    return tuple(np.asarray(x, np.float32) for x in compiled(q, k, v, do))


def relative_error(got, want) -> float:
    """max |got - want| / max |want|, with -inf where both have it counted equal; NaN
    where ``got`` has a NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    both = np.isneginf(got) & np.isneginf(want)
    got, want = np.where(both, 0, got), np.where(both, 0, want)
    if np.isnan(got).any():
        return float("nan")
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))


@dataclasses.dataclass(frozen=True)
class Result:
    """One case in one dtype: ``ok``, ``wrong`` (an output off), ``refused`` (the fused
    path turned it down: the next route runs it) or ``error`` (the fused call failed)."""

    case: str
    dtype: str
    status: str
    errors: dict  # output name -> relative error
    detail: str = ""

    def line(self) -> str:
        errs = ", ".join(f"{n} {e:.2e}" for n, e in self.errors.items())
        return (f"{self.case:22s} {self.dtype:9s} {self.status:8s} "
                f"{errs or self.detail}{'; ' + self.detail if errs and self.detail else ''}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def check_case(run, case: Case, dtype: str) -> Result:
    try:
        want = run(case, dtype, "xla")
    except Exception as e:  # noqa: BLE001 - without a reference there is nothing to trust
        return Result(case.name, dtype, "error", {}, f"the reference path failed: {_first_line(e)}")
    try:
        got = run(case, dtype, case.implementation)
    except ScoreModError as e:
        return Result(case.name, dtype, "refused", {}, _first_line(e))
    except Exception as e:  # noqa: BLE001 - a failed call is the finding
        return Result(case.name, dtype, "error", {}, _first_line(e))
    errors = {n: relative_error(g, w) for n, g, w in zip(OUTPUTS, got, want)}
    off = [n for n, e in errors.items() if not e <= TOLERANCE[dtype]]  # NaN is off
    detail = f"{', '.join(off)} above {TOLERANCE[dtype]:g}" if off else ""
    return Result(case.name, dtype, "wrong" if off else "ok", errors, detail)


def verify(run=None, cases=None, dtypes=DTYPES, progress=None) -> tuple:
    """The :class:`Result` of every case (default :data:`CASES`) in every dtype,
    ``run(case, dtype, implementation)`` (default :func:`run_case`) giving
    (O, LSE, dQ, dK, dV); ``progress`` sees each result."""
    run = run_case if run is None else run
    results = []
    with checking():
        for case in CASES if cases is None else cases:
            for dtype in dtypes:
                result = check_case(run, case, dtype)
                results.append(result)
                if progress is not None:
                    progress(result)
    return tuple(results)


# --- verdicts -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Verdict:
    key: Key
    state: str  # "passed", "failed" or "started" (a check in progress, or one that died)
    results: tuple = ()
    seconds: float = 0.0
    when: str = ""
    pid: int = 0
    host: str = ""
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.state == "passed"

    def summary(self) -> str:
        if self.note:
            return self.note
        counts = {s: sum(r.status == s for r in self.results)
                  for s in ("ok", "wrong", "error", "refused")}
        text = f"{counts['ok']} of {len(self.results)} agree with the reference path"
        bad = [r for r in self.results if r.status in ("wrong", "error")]
        if bad:
            text += "; " + "; ".join(f"{r.case} {r.dtype}: {r.status} ({r.detail})"
                                     for r in bad[:3])
            if len(bad) > 3:
                text += f"; and {len(bad) - 3} more"
        if counts["refused"]:
            text += (f"; {counts['refused']} refused by cuDNN (those calls run on the next "
                     "route)")
        return text


def judge(key: Key, results, seconds: float) -> Verdict:
    """Passed when no case is wrong or failed and at least one ran fused."""
    passed = (not any(r.status in ("wrong", "error") for r in results)
              and any(r.status == "ok" for r in results))
    note = "" if passed or any(r.status != "refused" for r in results) else (
        "cuDNN refused every conformance graph")
    return Verdict(key, "passed" if passed else "failed", tuple(results), round(seconds, 1),
                   _now(), note=note)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def verdict_dir() -> str | None:
    """``<cache root>/cudnn-verdicts``, or None when the on-disk caches are off."""
    root = options.cache_root()
    return None if root is None else os.path.join(root, SUBDIR)


def verdict_path(key: Key) -> str | None:
    folder = verdict_dir()
    return None if folder is None else os.path.join(folder, key.file_name())


def _encode(v: Verdict) -> bytes:
    body = {"format": _FORMAT, "key": dataclasses.asdict(v.key), "state": v.state,
            "results": [dataclasses.asdict(r) for r in v.results], "seconds": v.seconds,
            "when": v.when, "pid": v.pid, "host": v.host, "note": v.note}
    return sealed.frame(_MAGIC, json.dumps(body, sort_keys=True).encode())


def _decode(data: bytes, key: Key) -> Verdict:
    body = sealed.body_of(_MAGIC, data, "not a scoremod verdict file")
    try:
        d = json.loads(body)
        if d["format"] != _FORMAT:
            raise sealed.Invalid(f"format {d['format']!r}, not {_FORMAT}")
        if Key(**d["key"]) != key:
            raise sealed.Invalid(f"it holds the verdict of another key, {d['key']!r}")
        if d["state"] not in ("passed", "failed", "started"):
            raise sealed.Invalid(f"unknown state {d['state']!r}")
        results = tuple(Result(r["case"], r["dtype"], r["status"],
                               {str(n): float(e) for n, e in r["errors"].items()}, r["detail"])
                        for r in d["results"])
        return Verdict(key, d["state"], results, float(d["seconds"]), str(d["when"]),
                       int(d["pid"]), str(d["host"]), str(d["note"]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise sealed.Invalid(f"unreadable ({type(e).__name__}: {e})") from None


def read(key: Key) -> Verdict | None:
    """The verdict on disk for ``key``; None when absent, not trusted or invalid
    (an invalid one is logged and removed)."""
    path = verdict_path(key)
    if path is None:
        return None
    problem = process_caches.folder_problem(os.path.dirname(path))
    if problem is not None:
        if os.path.lexists(path):
            log.warning("scoremod: not reading the cuDNN verdict %s: %s (the folder must be "
                        "writable by you alone)", path, problem)
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(st.st_mode):
            raise sealed.Invalid("not a regular file")
        problem = process_caches.not_yours_alone(st, "the file")
        if problem is not None:
            raise sealed.Invalid(problem)
        with open(path, "rb") as f:
            data = f.read(_MAX_FILE_BYTES + 1)
        if len(data) > _MAX_FILE_BYTES:
            raise sealed.Invalid("too large")
        return _decode(data, key)
    except (sealed.Invalid, OSError) as e:
        log.warning("scoremod: ignoring the cuDNN verdict %s (%s)", path, e)
        sealed.remove_if_unchanged(path, st)
        return None


def write(verdict: Verdict) -> str | None:
    """Keep ``verdict`` on disk (atomically); its path, or None where there is no
    cache folder or it cannot be written (logged: the verdict then lasts this process)."""
    path = verdict_path(verdict.key)
    if path is None:
        return None
    folder = os.path.dirname(path)
    tmp = None
    try:
        os.makedirs(os.path.dirname(folder), mode=0o700, exist_ok=True)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".verdict", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(_encode(verdict))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        return path
    except OSError as e:
        log.warning("scoremod: cannot write the cuDNN verdict %s (%s); it holds for this "
                    "process only", path, e)
        return None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _remove_started(key: Key) -> None:
    """Remove this process's "started" file of ``key`` (another's is left alone)."""
    path = verdict_path(key)
    current = read(key) if path is not None else None
    if current is not None and current.state == "started" and current.pid == os.getpid():
        with contextlib.suppress(OSError):
            os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


def _settled(found: Verdict | None) -> Verdict | None:
    """A passed or failed verdict; a "started" one whose process on this host is gone
    becomes failed (it died in the check); one still running, or of another host, None."""
    if found is None or found.state != "started":
        return found
    if found.host == socket.gethostname() and found.pid != os.getpid() and not _alive(found.pid):
        return dataclasses.replace(found, state="failed", note=(
            f"the check started {found.when} by process {found.pid} did not finish (that "
            "process ended during it: a crash in cuDNN?)"))
    return None


class _Process:
    """This process's verdicts by key, and who is checking now."""

    def __init__(self):
        self.verdicts: dict = {}
        self.lock = threading.Lock()
        self.local = threading.local()


_PROCESS = _Process()


def forget() -> None:
    """Forget the verdicts read or made in this process (the files stay)."""
    with _PROCESS.lock:
        _PROCESS.verdicts.clear()


_UNREAD = object()


def verdict(key: Key) -> Verdict | None:
    """The passed or failed verdict for ``key`` here: this process's, else the file's,
    read once per process (a check another process makes later is not seen)."""
    found = _PROCESS.verdicts.get(key, _UNREAD)
    if found is _UNREAD:
        found = _PROCESS.verdicts[key] = _settled(read(key))
    return found


@contextlib.contextmanager
def _flag(name):
    """This thread's flag ``name`` set within the block (restored after: blocks nest)."""
    before = getattr(_PROCESS.local, name, False)
    setattr(_PROCESS.local, name, True)
    try:
        yield
    finally:
        setattr(_PROCESS.local, name, before)


def checking():
    """Calls made by the check itself: the version check lets named ones run quietly
    and keeps ``implementation=None`` away from the version being checked."""
    return _flag("verifying")


def deferred():
    """Within it, an unverified cuDNN is passed over instead of checked (the
    doctor's report asks what runs without starting a check)."""
    return _flag("deferred")


def check_and_record(key: Key, run=None, cases=None, progress=None) -> Verdict:
    """Run the conformance set now and keep its verdict for ``key`` (on disk where the
    cache folder is, and for this process)."""
    write(Verdict(key, "started", when=_now(), pid=os.getpid(), host=socket.gethostname()))
    start = time.perf_counter()
    try:
        results = verify(run, cases, progress=progress)
    except BaseException:
        _remove_started(key)  # interrupted, not failed: the next use checks again
        raise
    found = judge(key, results, time.perf_counter() - start)
    write(found)
    _PROCESS.verdicts[key] = found
    return found


def refusal(automatic: bool) -> str | None:
    """Why the cuDNN backends do not run on the loaded cuDNN (None: they do); see the
    module docstring for the order. Cheap once this process knows the verdict."""
    key = current_key()
    if key is None:
        return None  # no library loaded yet: the FFI loads one at the first call
    bad = known_bad(key.cudnn, key.frontend, device.current().family)
    if bad is not None:
        return bad
    if not support.cudnn_supported(key.cudnn):
        return _by_name_only(
            f"cuDNN {support.version_text(key.cudnn)} is loaded, but scoremod's fused path "
            f"supports cuDNN {support.cudnn_range_text()} (docs/install.md)", automatic)
    if getattr(_PROCESS.local, "verifying", False):
        return "this cuDNN is being verified" if automatic else None
    found = verdict(key)
    if found is None and not key.validated():
        if not automatic:
            return _by_name_only(_unverified(key), automatic)
        if not options.cudnn_verify_on_first_use():
            return _by_name_only(_unverified(key) + " (SCOREMOD_CUDNN_VERIFY=0 turned the "
                                 "check at first use off)", automatic)
        if getattr(_PROCESS.local, "deferred", False):
            return _by_name_only(_unverified(key) + " (implementation=None checks it at its "
                                 "first use)", automatic)
        with _PROCESS.lock:  # one check per process; other threads wait for its verdict
            found = verdict(key)
            if found is None:
                _note_check(key)
                found = check_and_record(key)
                log.info("scoremod: the conformance check of %s %s in %.0f s: %s", key.text(),
                         found.state, found.seconds, found.summary())
    if found is None or found.passed:
        return None
    return _by_name_only(f"{key.text()} failed scoremod's conformance check on this GPU "
                         f"({found.when}: {found.summary()}); `{COMMAND}` checks again and "
                         "lists every case", automatic)


def _unverified(key: Key) -> str:
    return (f"{key.text()} is not validated with scoremod (validated: cuDNN "
            f"{support.cudnn_validated_text()}, frontend {support.CUDNN_FRONTEND}) and not "
            f"verified on this GPU yet; `{COMMAND}` checks it")


def _note_check(key: Key) -> None:
    where = verdict_path(key) or "memory, for this process (SCOREMOD_CACHE_DIR is empty)"
    warnings.warn(
        f"scoremod: {key.text()} is not validated with scoremod: checking it on this GPU now, "
        f"once ({len(CASES)} mods, forward and backward in {' and '.join(DTYPES)}, against the "
        f"reference path; a minute or two). The verdict is kept in {where}. `{COMMAND}` runs "
        "the same check by hand; SCOREMOD_CUDNN_VERIFY=0 turns this check at first use off.",
        stacklevel=2)


_WARNED: set = set()


def _by_name_only(why: str, automatic: bool) -> str | None:
    """``why`` for ``implementation=None``; asked for by name, a warning (once) and None."""
    if automatic:
        return why + "; ask for it by name to run it anyway: implementation=\"cudnn\""
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"scoremod: {why}; running it because implementation=\"cudnn\" asked "
                      "for it", stacklevel=2)
    return None


def status_line() -> str:
    """What the version check makes of the loaded cuDNN, for ``scoremod doctor``."""
    key = current_key()
    if key is None:
        return "no cuDNN loaded"
    bad = known_bad(key.cudnn, key.frontend, device.current().family)
    if bad is not None:
        return f"REFUSED: {bad}"
    if not support.cudnn_supported(key.cudnn):
        return f"NOT in the supported range {support.cudnn_range_text()}"
    found = verdict(key)
    if found is not None:
        return (f"verified on this GPU: {found.state.upper()} ({found.when}: "
                f"{found.summary()})")
    if key.validated():
        return "validated"
    return (f"supported, not validated (cuDNN {support.cudnn_validated_text()}, frontend "
            f"{support.CUDNN_FRONTEND} are) and not verified here yet: implementation=None "
            f"checks it at its first use, or run `{COMMAND}`")
