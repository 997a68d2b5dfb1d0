"""The process's compile caches, set up once at the first ``scoremod.attention`` call.

Backend-neutral: whatever backend a call takes, ``SCOREMOD_JAX_CACHE=1`` turns on
JAX's persistent compilation cache in ``<cache root>/jax`` (``options.jax_cache_dir``)
for every compile of the process. The Pallas kernels' first call is mostly their
compile, so a later process that finds them there starts warm. The cuDNN plan cache
(``lowering.cudnn.plan_store``) is set up by the cuDNN backend at its first lookup.

JAX names a compiled program's file by its cache key but keeps nothing of the key
inside: a file renamed, copied or restored over another entry runs as the other
program (a softcap of 50 where 0.5 was asked, or a crash on a layout annotation).
So in scoremod's folder each entry is *sealed*: the file holds a magic line, the
SHA-256 of what follows, JAX's key and then JAX's bytes. An entry is used only when
it is a regular file of yours that no one else may write, its digest matches and
its key is the wanted one; anything else (an entry of another key, a plain JAX
entry, truncated or corrupt, a pipe) is logged, removed and compiled again, like a
bad cuDNN plan cache entry. Sealing wraps JAX's own file cache
(``jax._src.compilation_cache.get_file_cache``, the same in jax 0.10 to 0.12);
where a jax has no such function the cache still runs, unsealed, with a warning.

Like the plan store, the folder must be trusted: the digest catches files moved
or damaged, not a malicious writer, who can seal a file too, and a compiled
program runs as your code. Setup checks that the folder and the cache root above
it are yours and writable by you alone, and leaves the cache off with a warning
saying what to do when they are not.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import warnings

from scoremod import options, sealed

log = logging.getLogger("scoremod")

_lock = threading.Lock()
_done = False

_MAGIC = b"scoremod-jax-entry\n"
_ENTRY_SUFFIX = "-cache"  # JAX's file cache names an entry <key>-cache
_sealed_directories: set = set()  # real paths whose entries are sealed


def setup() -> None:
    """Read the environment and turn on what it asks for, once per process."""
    global _done
    if _done:  # every call after the first: no lock
        return
    with _lock:
        if _done:
            return
        directory = options.jax_cache_dir()
        if directory is not None:
            enable_jax_compilation_cache(directory)
        _done = True


def enable_jax_compilation_cache(directory: str) -> bool:
    """Turn on JAX's persistent compilation cache in ``directory`` for this process,
    writing every compile (not only those over a second), each entry sealed (see the
    module docstring); False when the user had set ``jax_compilation_cache_dir``
    already (theirs is kept, unsealed) or when ``directory`` cannot be made private
    or is not private (one warning says why; the process goes on without it)."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        return False
    directory = os.path.abspath(directory)
    try:
        # The cache root first, so that neither folder gets the umask's group bits.
        os.makedirs(os.path.dirname(directory), mode=0o700, exist_ok=True)
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as e:
        _warn(f"scoremod: cannot create JAX's compilation cache folder {directory} ({e}); "
              "compiling without it. Point SCOREMOD_CACHE_DIR at a writable folder, or set "
              "SCOREMOD_JAX_CACHE=0.")
        return False
    problem = folder_problem(directory)
    if problem is not None:
        _warn(f"scoremod: not using JAX's compilation cache in {directory}: {problem}. A "
              "program there runs as your code, so the folder must be writable by you alone: "
              f"make it yours and private (chmod 700 {directory}), or point SCOREMOD_CACHE_DIR "
              "at a folder of yours; SCOREMOD_JAX_CACHE=0 turns the cache off.")
        return False
    if not _seal_entries_in(directory):
        _warn(f"scoremod: cannot check the entries of JAX's compilation cache with jax "
              f"{jax.__version__} (no jax._src.compilation_cache.get_file_cache); they are "
              f"used as JAX stores them, so keep {directory} writable by you alone and clear it "
              "if a compiled program fails on a layout annotation.")
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return True


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


# --- who may write the folder -------------------------------------------------------


def not_yours_alone(st, what: str) -> str | None:
    """Why a file or folder with ``os.stat`` result ``st`` is not yours alone, or None."""
    euid = os.geteuid() if hasattr(os, "geteuid") else None  # no owners to check elsewhere
    if euid is not None and st.st_uid != euid:
        return f"{what} is owned by uid {st.st_uid}, not by you (uid {euid})"
    who = [name for bit, name in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others"))
           if st.st_mode & bit]
    if who:
        return f"{what} is writable by {' and '.join(who)} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def folder_problem(directory: str) -> str | None:
    """Why others could change what JAX loads from ``directory``, or None: the folder
    and its parent (which could rename it away) must be yours and writable by you
    alone; a parent with the sticky bit (``/tmp``) keeps others from renaming it."""
    directory = os.path.abspath(directory)
    try:
        st = os.stat(directory)
        problem = not_yours_alone(st, "the folder")
        if problem is not None:
            return problem
        parent = os.path.dirname(directory)
        pst = os.stat(parent)
    except OSError as e:
        return f"it cannot be read ({e})"
    if not pst.st_mode & stat.S_ISVTX:
        problem = not_yours_alone(pst, f"its parent {parent}")
        if problem is not None:
            return problem
    return None


# --- sealed entries -----------------------------------------------------------------


_Invalid = sealed.Invalid


def seal(key: str, value: bytes) -> bytes:
    """An entry's file: magic, SHA-256 of the rest, JAX's key, JAX's bytes."""
    return sealed.frame(_MAGIC, key.encode() + b"\n" + bytes(value))


def unseal(key: str, data: bytes) -> bytes:
    """JAX's bytes of the sealed entry ``data`` for ``key``; _Invalid when it is not one."""
    body = sealed.body_of(_MAGIC, data, "not sealed by scoremod (written by plain JAX, or damaged)")
    stored, sep, value = body.partition(b"\n")
    if not sep or stored != key.encode():
        raise _Invalid(f"it holds the program of another key, "
                       f"{stored[:120].decode(errors='replace')!r} (moved or copied there)")
    return value


class SealedEntries:
    """JAX's file cache in one folder, each entry sealed by its key.

    Keeps the interface JAX's compilation cache calls (``get``, ``put``, ``_path``) and
    leaves locking, eviction and access times to the file cache it wraps.
    """

    def __init__(self, base, directory: str):
        self._base = base
        self.directory = directory

    @property
    def _path(self):
        return self._base._path

    @_path.setter
    def _path(self, value):
        self._base._path = value

    def _file(self, key: str) -> str:
        return os.path.join(self.directory, key + _ENTRY_SUFFIX)

    def get(self, key: str):
        path = self._file(key)
        try:
            # Checked before JAX opens it: a pipe would block the read forever, and a
            # file another user may write is not to be run. The folder is yours alone
            # (checked at setup), so nobody else can swap it after this check.
            st = os.lstat(path)
        except OSError:
            return None  # absent: a miss
        try:
            if not stat.S_ISREG(st.st_mode):
                raise _Invalid("not a regular file")
            problem = not_yours_alone(st, "the file")
            if problem is not None:
                raise _Invalid(problem)
            data = self._base.get(key)
            if data is None:
                return None
            return unseal(key, data)
        except _Invalid as e:
            log.warning("scoremod: ignoring the JAX compilation cache entry %s (%s); "
                        "compiling it again", path, e)
            sealed.remove_if_unchanged(path, st)  # JAX writes only where no entry is
            return None

    def put(self, key: str, value: bytes) -> None:
        self._base.put(key, seal(key, value))
        path = self._file(key)
        try:  # JAX writes with the umask's mode: a group-writable entry would be refused
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
        except OSError:
            pass


def _seal_entries_in(directory: str) -> bool:
    """Make JAX's file cache in ``directory`` seal and check its entries (other
    folders are left as they are); False where this jax has no file cache to wrap."""
    try:
        from jax._src import compilation_cache
        from jax._src.lru_cache import LRUCache
    except ImportError:
        return False
    original = getattr(compilation_cache, "get_file_cache", None)
    if not callable(original):
        return False
    _sealed_directories.add(os.path.realpath(directory))
    if getattr(original, "scoremod_sealed", False):
        return True  # wrapped already (an earlier call, another folder)

    def get_file_cache(path):
        found = original(path)
        if found is None or os.path.realpath(str(path)) not in _sealed_directories:
            return found
        cache, where = found
        if type(cache) is LRUCache:
            return SealedEntries(cache, str(path)), where
        # jax_compilation_cache_check_contents: JAX's check of each entry against a
        # fresh compile wraps the file cache; the seal goes under it, on the files.
        if type(getattr(cache, "_base_cache", None)) is LRUCache:
            cache._base_cache = SealedEntries(cache._base_cache, str(path))
        return found

    get_file_cache.scoremod_sealed = True
    compilation_cache.get_file_cache = get_file_cache
    return True
