"""An on-disk store of built cuDNN graphs, so that a new process starts warm.

Building a cuDNN graph (``build_plans``) takes 0.4-2.3 s per mod and shape.
The result is a small record: the serialized graph (80-100 KB) and what the
FFI call needs beside it (UIDs, scalar bits, workspace size, plan name). This
module keeps those records in files, one per graph, so that the first fused
call of a later process for a mod and shape it has seen loads the record
instead of building it.

Where, and how to switch it off (read at the first cuDNN graph lookup; JAX's own
compilation cache, ``SCOREMOD_JAX_CACHE``, is set up in ``scoremod.process_caches``):

=========================  ====================================================
``SCOREMOD_CACHE_DIR``     the cache root; unset: ``$XDG_CACHE_HOME/scoremod``,
                           else ``~/.cache/scoremod``. Set to the empty string
                           to turn the on-disk store off.
``SCOREMOD_PLAN_CACHE``    ``1`` (default) or ``0``: ``0`` turns it off too.
``SCOREMOD_CACHE_MAX_MB``  size bound of the graph files, default 256 (about
                           2500 graphs): after each write the oldest files
                           (by modification time, refreshed on every hit) are
                           removed until the rest fit.
=========================  ====================================================

Graphs live in ``<root>/cudnn-plans/<sha256>.plan``. An entry is named by the
SHA-256 of its *key material*: a canonical text encoding (:func:`encode`) of
the lowering's graph key (IR, shapes, dtypes, scale, load layouts, mask band,
options), of the environment the graph is only valid in (cuDNN backend and
frontend versions, the versions the FFI extension was compiled with, the GPU's
name and compute capability) and of :data:`FORMAT_VERSION`. The file holds a
magic line, the SHA-256 of everything after it, a JSON header (the full key
material and the record's fields) and the raw serialized graph. Nothing is
unpickled. A file is used only when it is a regular file (a pipe or link at an
entry's name is never opened, so a read cannot block), it parses, its digest
matches, its header is within bounds (1 MB, nested 8 deep, both checked
before parsing) and of the record's schema (exactly its fields, each of the
type the record class annotates, ints in signed 64 bits) and its key
material equals the wanted one exactly; anything else (truncated, corrupt,
another format, odd content under a valid digest) is removed and the graph is
built again. A record that would not pass these checks is never written.

Files are written to a temporary name in the same directory, flushed to disk
and renamed over the entry (``os.replace``), so a reader sees a whole entry or
none, a crash leaves at most a stray temporary file (removed later), and
several processes may write the same entry at once: entries are named by
their content's key, and the last rename wins with an equal record.

A directory that cannot be created or written gives one warning and the
process goes on with its in-memory cache; the store never makes a call fail.
The directory and the cache root above it are created private (mode 0700).
Like JAX's compilation cache it must be trusted: the digest catches
corruption, not a malicious writer, and a cuDNN graph runs GPU code.

    >>> from scoremod.lowering.cudnn import plan_store
    >>> plan_store.encode(("forward", 1.5, -0.0, None, (64, "bfloat16")))
    '("forward",f3ff8000000000000,f8000000000000000,N,(i64,"bfloat16"))'
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import logging
import math
import os
import re
import stat
import struct
import sys
import tempfile
import threading
import time
import typing
import warnings

from scoremod import sealed
from scoremod.errors import ScoreModError
from scoremod import options

log = logging.getLogger("scoremod")

#: Bumped whenever the file layout or the meaning of a record changes.
FORMAT_VERSION = 1
DEFAULT_MAX_MB = options.DEFAULT_PLAN_CACHE_MB
SUBDIR = "cudnn-plans"
SUFFIX = ".plan"
_MAGIC = b"scoremod-plan\n"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 3600  # a temporary file this old belongs to a writer that died
_MAX_FILE_BYTES = 64 << 20  # no cuDNN graph comes near this: a bigger file is not ours
_MAX_HEADER_BYTES = 1 << 20  # key material is 1-2 KB for common mods, tens of KB for huge ones
# A header nests 3 deep ({"fields": {"in_uids": [...]}}); checked before parsing, as a
# deeply nested file would overflow the JSON parser's recursion.
_MAX_HEADER_DEPTH = 8
_INT_BOUND = 1 << 63  # every int of a record is a signed 64-bit value (UIDs, ids, bits, sizes)


# --- canonical key encoding --------------------------------------------------


def encode(key) -> str:
    """A canonical, deterministic text for ``key``, equal in every process.

    ``key`` is built from None, bools, ints, floats (encoded by their exact
    64-bit pattern, so -0.0, 0.0 and NaNs stay apart), strings, bytes, tuples,
    lists, dicts, sets, enums, dataclass instances (by class name and fields)
    and IR nodes (by structure: each distinct node once, then referenced).
    Anything else raises TypeError: an object without a stable encoding must
    not name a file.
    """
    return _Encoder().encode(key)


class _Encoder:
    def __init__(self):
        self.node_ids: dict = {}
        self.defs: list[str] = []

    def encode(self, key) -> str:
        body = self._enc(key)
        return ";".join(self.defs + [body]) if self.defs else body

    def _enc(self, x) -> str:
        from scoremod.dsl.ir import Node

        if x is None:
            return "N"
        if isinstance(x, bool):
            return "T" if x else "F"
        if isinstance(x, enum.Enum):
            return "E" + json.dumps(f"{type(x).__qualname__}.{x.name}")
        if isinstance(x, int):
            return f"i{int(x)}"
        if isinstance(x, float):
            return "f" + struct.pack(">d", x).hex()
        if isinstance(x, str):
            return json.dumps(x)
        if isinstance(x, (bytes, bytearray)):
            return "b" + bytes(x).hex()
        if isinstance(x, Node):
            return self._node(x)
        if isinstance(x, tuple):
            return "(" + ",".join(self._enc(v) for v in x) + ")"
        if isinstance(x, list):
            return "[" + ",".join(self._enc(v) for v in x) + "]"
        if isinstance(x, dict):
            items = sorted(f"{self._enc(k)}:{self._enc(v)}" for k, v in x.items())
            return "{" + ",".join(items) + "}"
        if isinstance(x, (set, frozenset)):
            return "s{" + ",".join(sorted(self._enc(v) for v in x)) + "}"
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            fields = ",".join(f"{f.name}={self._enc(getattr(x, f.name))}"
                              for f in dataclasses.fields(x))
            return "D" + json.dumps(type(x).__qualname__) + "(" + fields + ")"
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(x, numpy.generic):
            return self._enc(x.item())
        raise TypeError(f"the plan cache cannot encode {type(x).__name__} {x!r} in a key")

    def _node(self, root) -> str:
        from scoremod.dsl import ir

        if root not in self.node_ids:
            for n in ir.toposort(root):  # children first, in a deterministic order
                if n in self.node_ids:
                    continue
                args = ",".join(f"@{self.node_ids[a]}" for a in n.args)
                self.node_ids[n] = len(self.defs)
                self.defs.append(f"{json.dumps(n.op)}:{json.dumps(n.dtype)}:{self._enc(n.attr)}"
                                 f"({args})")
        return f"@{self.node_ids[root]}"


# --- the environment a graph is valid in ----------------------------------------


def environment() -> tuple:
    """(name, value) pairs of what a serialized graph depends on besides its key.

    Cheap, and without importing the cuDNN frontend (a warm process need not
    import it): the cuDNN version comes from the library already loaded.
    """
    import jax

    from scoremod import kernels_ffi

    dev = jax.devices()[0]
    return (
        ("cudnn", loaded_cudnn_version()),
        ("cudnn_frontend", kernels_ffi.installed_frontend_version()),
        ("ffi_frontend", kernels_ffi.compiled_frontend_version()),
        ("ffi_cudnn", kernels_ffi.compiled_cudnn_version()),
        ("ffi_cudart", kernels_ffi.compiled_cudart_version()),
        ("gpu", str(getattr(dev, "device_kind", dev.platform))),
        ("compute_capability", str(getattr(dev, "compute_capability", ""))),
    )


def loaded_cudnn_version() -> int:
    """cudnnGetVersion() of the libcudnn in this process (JAX's, which the FFI
    extension also uses); the frontend's answer when none is loaded. Read
    without importing the frontend where a library is loaded (a warm start)."""
    from scoremod import device

    version, _ = device.loaded_cudnn_version()
    if version is None:
        import cudnn

        version = int(cudnn.backend_version())
    return version


# --- records <-> files --------------------------------------------------------------


def _to_json(value):
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a plan record field holds {type(value).__name__}")


def _payload_field(record_type) -> str:
    names = [f.name for f in dataclasses.fields(record_type) if f.name == "blob"]
    if not names:
        raise TypeError(f"{record_type.__name__} has no `blob` field to store as the payload")
    return names[0]


def _serialize(material: str, record) -> bytes:
    payload_name = _payload_field(type(record))
    fields = {f.name: _to_json(getattr(record, f.name)) for f in dataclasses.fields(record)
              if f.name != payload_name}
    header = json.dumps({"format": FORMAT_VERSION, "key": material,
                         "record": type(record).__qualname__, "fields": fields},
                        sort_keys=True, allow_nan=True).encode()
    # Never write what a read would reject: the fields as they will be read back.
    if len(header) > _MAX_HEADER_BYTES:
        raise ValueError(f"a plan record's header of {len(header)} bytes is over "
                         f"{_MAX_HEADER_BYTES}: the mod's key is too large to store")
    try:
        _checked_fields(type(record), json.loads(header)["fields"])
    except _Invalid as e:
        raise ValueError(f"{type(record).__name__} cannot be stored: {e}") from None
    payload = bytes(getattr(record, payload_name))
    return sealed.frame(_MAGIC, b"%d\n" % len(header) + header + payload)


_Invalid = sealed.Invalid


# --- what a header may hold ----------------------------------------------------------


def _int(value):
    if type(value) is not int:  # bool is an int to isinstance; JSON true is not an int here
        raise _Invalid(f"{_kind(value)} where an int belongs")
    if not -_INT_BOUND <= value < _INT_BOUND:
        raise _Invalid(f"an int of {len(str(abs(value)))} digits, outside signed 64 bits")
    return value


def _float(value):
    if type(value) not in (int, float) or not math.isfinite(value):
        raise _Invalid(f"{_kind(value)} where a finite number belongs")
    return float(value)


def _str(value):
    if type(value) is not str:
        raise _Invalid(f"{_kind(value)} where a string belongs")
    return value


def _bool(value):
    if type(value) is not bool:
        raise _Invalid(f"{_kind(value)} where true or false belongs")
    return value


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), f"the number {str(value)[:20]}")


_SCALARS = {int: _int, float: _float, str: _str, bool: _bool}


def _checker(hint):
    """A function from a field's JSON value to the record's value (raising _Invalid),
    for the type hint ``hint``; None for a type the store cannot check."""
    if hint in _SCALARS:
        return _SCALARS[hint]
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _checker(args[0])
        if item is None:
            return None

        def check(value):
            if type(value) is not list:
                raise _Invalid(f"{_kind(value)} where a list belongs")
            return tuple(item(v) for v in value)

        return check
    return None


@functools.lru_cache(maxsize=None)
def _schema(record_type) -> dict:
    """Field name -> checker, for every field of ``record_type`` but the payload.

    A record type with a field the store cannot check (a bare ``tuple``, an object) is
    refused: what the store reads back is only as trustworthy as this check.
    """
    payload_name = _payload_field(record_type)
    hints = typing.get_type_hints(record_type)
    schema = {}
    for f in dataclasses.fields(record_type):
        if f.name == payload_name:
            continue
        check = _checker(hints[f.name])
        if check is None:
            raise TypeError(f"the plan store cannot check {record_type.__name__}.{f.name} of "
                            f"type {hints[f.name]!r}: use int, float, str, bool or tuple[X, ...]")
        schema[f.name] = check
    return schema


def _checked_fields(record_type, fields: dict) -> dict:
    """The record's field values from their JSON ``fields``, each checked (_Invalid)."""
    values = {}
    for name, check in _schema(record_type).items():
        try:
            values[name] = check(fields[name])
        except _Invalid as e:
            raise _Invalid(f"field {name}: {e}") from None
    return values


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


def _json_too_deep(text: bytes, limit: int) -> bool:
    """Whether the JSON ``text`` nests more than ``limit`` deep (strings left out)."""
    depth = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub(b'""', text)):
        depth += 1 if m.group() in b"[{" else -1
        if depth > limit:
            return True
    return False


def _deserialize(data: bytes, material: str, record_type):
    body = sealed.body_of(_MAGIC, data, "no magic line")
    # A valid digest says the file is whole, not that what it holds is sane: the header
    # is bounded and checked field by field before anything of it is used.
    size, sep, rest = body.partition(b"\n")
    if not sep or not size.isdigit() or len(size) > len(str(_MAX_HEADER_BYTES)):
        raise _Invalid("bad header length")
    size = int(size)
    if size > _MAX_HEADER_BYTES:
        raise _Invalid(f"header of {size} bytes, over {_MAX_HEADER_BYTES}")
    if size > len(rest):
        raise _Invalid("bad header length")
    text = rest[:size]
    if _json_too_deep(text, _MAX_HEADER_DEPTH):
        raise _Invalid(f"header nested over {_MAX_HEADER_DEPTH} deep")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise _Invalid(f"header is not JSON: {e}") from None
    if not isinstance(header, dict) or set(header) != {"format", "key", "record", "fields"}:
        raise _Invalid("header keys differ")
    if type(header["format"]) is not int or header["format"] != FORMAT_VERSION:
        raise _Invalid("another format version")
    if header["key"] != material:
        raise _Invalid("key material differs")
    payload_name = _payload_field(record_type)
    schema = _schema(record_type)
    fields = header["fields"]
    if (header["record"] != record_type.__qualname__ or not isinstance(fields, dict)
            or set(fields) != set(schema)):
        raise _Invalid("record fields differ")
    values = _checked_fields(record_type, fields)
    payload = rest[size:]
    if not payload:
        raise _Invalid("empty payload")
    try:
        return record_type(**{payload_name: payload}, **values)
    except (TypeError, ValueError) as e:
        raise _Invalid(f"record does not build: {e}") from None


# --- the store ------------------------------------------------------------------


_COUNTERS = ("disk_hits", "disk_misses", "disk_writes", "disk_rejected")


class Store:
    """Graph records in one directory (see the module docstring).

    ``environment``: a callable returning the (name, value) pairs mixed into
    every key (default: :func:`environment`). ``max_bytes``: the size bound.
    """

    def __init__(self, directory: str, max_bytes: int = DEFAULT_MAX_MB << 20,
                 environment=environment):
        self.directory = os.path.abspath(directory)
        self.max_bytes = int(max_bytes)
        self._environment = environment
        self._env_value = None
        self._lock = threading.Lock()
        self._write_failed = False
        self.counters = dict.fromkeys(_COUNTERS, 0)

    # --- naming
    def material(self, key) -> str:
        """The full key material of ``key``: format, environment and key, encoded."""
        if self._env_value is None:
            self._env_value = tuple(self._environment())
        return encode(("scoremod-plan", FORMAT_VERSION, self._env_value, key))

    def path(self, material: str) -> str:
        name = hashlib.sha256(material.encode()).hexdigest()
        return os.path.join(self.directory, name + SUFFIX)

    def _count(self, name):
        with self._lock:
            self.counters[name] += 1

    # --- reading
    def get(self, key, record_type):
        """The stored record for ``key``, or None (absent, or invalid and removed)."""
        material = self.material(key)
        path = self.path(material)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                data = None  # a pipe would block open() forever: never opened
            else:
                # Non-blocking: the entry may become a pipe between the check and the open.
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
                with os.fdopen(fd, "rb") as f:
                    st = os.fstat(f.fileno())
                    data = f.read(_MAX_FILE_BYTES + 1) if stat.S_ISREG(st.st_mode) else None
        except FileNotFoundError:
            self._count("disk_misses")
            return None
        except OSError as e:
            log.debug("plan cache: cannot read %s: %s", path, e)
            self._count("disk_misses")
            return None
        try:
            if data is None:
                raise _Invalid("not a regular file")
            if len(data) > _MAX_FILE_BYTES:
                raise _Invalid("too large")
            record = _deserialize(data, material, record_type)
        except _Invalid as e:
            log.warning("scoremod: ignoring the invalid plan cache entry %s (%s); rebuilding it",
                        path, e)
            self._count("disk_rejected")
            sealed.remove_if_unchanged(path, st)
            return None
        try:
            os.utime(path)  # eviction keeps the most recently used
        except OSError:
            pass
        self._count("disk_hits")
        return record

    # --- writing
    def put(self, key, record) -> bool:
        """Store ``record`` under ``key`` atomically; False (and one warning) when the
        directory cannot be written. A record a read would reject raises ValueError."""
        if self._write_failed:
            return False
        material = self.material(key)
        data = _serialize(material, record)
        path = self.path(material)
        tmp = None
        try:
            # The cache root first, private too: JAX's cache beside it refuses a root
            # that others may write (scoremod.process_caches).
            os.makedirs(os.path.dirname(self.directory), mode=0o700, exist_ok=True)
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=SUFFIX, dir=self.directory)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            self._write_failed = True
            warnings.warn(
                f"scoremod: cannot write the cuDNN plan cache in {self.directory} ({e}); built "
                "graphs stay in memory for this process. Point SCOREMOD_CACHE_DIR at a writable "
                "directory, or set SCOREMOD_PLAN_CACHE=0 to turn the on-disk cache off.",
                RuntimeWarning, stacklevel=2)
            return False
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self._count("disk_writes")
        self.evict()
        return True

    # --- housekeeping
    def entries(self) -> list:
        """(path, size, mtime) of every entry, oldest first."""
        out = []
        try:
            names = os.listdir(self.directory)
        except OSError:
            return out
        for name in names:
            if not name.endswith(SUFFIX) or name.startswith(_TMP_PREFIX):
                continue
            path = os.path.join(self.directory, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            out.append((path, st.st_size, st.st_mtime))
        out.sort(key=lambda e: (e[2], e[0]))
        return out

    def evict(self) -> None:
        """Remove the oldest entries until the rest fit in ``max_bytes``, and stale
        temporary files of writers that died."""
        cutoff = time.time() - _STALE_TMP_SECONDS
        try:
            for name in os.listdir(self.directory):
                if name.startswith(_TMP_PREFIX):
                    path = os.path.join(self.directory, name)
                    try:
                        if os.stat(path).st_mtime < cutoff:
                            os.unlink(path)
                    except OSError:
                        pass
        except OSError:
            return
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        for path, size, _ in entries:
            if total <= self.max_bytes:
                break
            try:
                os.unlink(path)
            except OSError:
                pass
            total -= size

    def clear(self) -> None:
        """Remove every entry."""
        for path, _, _ in self.entries():
            try:
                os.unlink(path)
            except OSError:
                pass


# --- the process's store, configured from the environment ---------------------------


def store_root() -> str | None:
    """The cache root the plan store uses (``options.cache_root``), or None when the
    store is off (``SCOREMOD_PLAN_CACHE=0`` too, unlike ``options.cache_root``)."""
    return options.plan_cache_settings().root


_state_lock = threading.Lock()
class _Process:
    """The process's store: None until configured (from the environment at first use)."""

    configured = False
    store: Store | None = None


_PROCESS = _Process()


def default_store() -> Store | None:
    """The store this process uses (None: off), configured at first use."""
    with _state_lock:
        if not _PROCESS.configured:
            settings = options.plan_cache_settings()
            root = settings.root
            _PROCESS.store = (None if root is None
                              else Store(os.path.join(root, SUBDIR), settings.max_bytes))
            _PROCESS.configured = True
        return _PROCESS.store


def configure(store: Store | None) -> None:
    """Use ``store`` (None: no on-disk store) instead of the environment's."""
    with _state_lock:
        _PROCESS.store, _PROCESS.configured = store, True


def reset() -> None:
    """Forget the configuration: the next use reads the environment again."""
    with _state_lock:
        _PROCESS.store, _PROCESS.configured = None, False


def fetch(key, record_type):
    """The record for ``key`` from the process's store, or None.

    Raises only for a bad ``SCOREMOD_*`` setting (the user's to fix); any
    other failure is logged and reads as a miss: the store never fails a call.
    """
    s = default_store()
    if s is None:
        return None
    try:
        return s.get(key, record_type)
    except Exception as e:  # noqa: BLE001
        log.warning("scoremod: plan cache lookup failed (%s: %s); building the graph",
                    type(e).__name__, e)
        return None


def store(key, record) -> None:
    """Keep ``record`` under ``key`` in the process's store, if any (never fails a call)."""
    s = default_store()
    if s is None:
        return
    try:
        s.put(key, record)
    except Exception as e:  # noqa: BLE001
        log.warning("scoremod: plan cache write failed (%s: %s)", type(e).__name__, e)


def counters() -> dict:
    """disk_hits, disk_misses, disk_writes, disk_rejected of the process's store."""
    s = _PROCESS.store
    return dict(s.counters) if s is not None else dict.fromkeys(_COUNTERS, 0)


def reset_counters() -> None:
    s = _PROCESS.store
    if s is not None:
        with s._lock:
            s.counters = dict.fromkeys(_COUNTERS, 0)


def describe() -> str:
    """One line on the on-disk plan cache, for diagnostics (``scoremod doctor``)."""
    settings = options.plan_cache_settings()
    if not settings.enabled:
        return "cuDNN plan cache: off (SCOREMOD_PLAN_CACHE=0)"
    root = settings.root
    if root is None:
        return "cuDNN plan cache: off (SCOREMOD_CACHE_DIR is empty)"
    entries = Store(os.path.join(root, SUBDIR)).entries()
    size = sum(e[1] for e in entries)
    return (f"cuDNN plan cache: {os.path.join(root, SUBDIR)} ({len(entries)} graphs, "
            f"{size / (1 << 20):.1f} of {settings.max_bytes / (1 << 20):.0f} MB)")
