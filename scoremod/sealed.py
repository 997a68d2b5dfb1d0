"""Files scoremod trusts only when whole: a magic line, the SHA-256 of the rest,
the rest. The cuDNN plan store's entries and the sealed entries of JAX's
compilation cache are framed so; each checks what the body holds itself.
"""

from __future__ import annotations

import hashlib
import os


class Invalid(Exception):
    """A file that is not a valid entry for the wanted key."""


def frame(magic: bytes, body: bytes) -> bytes:
    """``body`` behind ``magic`` and its SHA-256."""
    return magic + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def body_of(magic: bytes, data: bytes, unframed: str) -> bytes:
    """The body of the file ``data`` framed by :func:`frame`; :class:`Invalid`
    (saying ``unframed`` when the magic line is missing) when it is not whole."""
    if not data.startswith(magic):
        raise Invalid(unframed)
    digest, sep, body = data[len(magic):].partition(b"\n")
    if not sep or hashlib.sha256(body).hexdigest().encode() != digest:
        raise Invalid("digest mismatch (truncated or corrupt)")
    return body


def remove_if_unchanged(path: str, st) -> None:
    """Remove the bad entry at ``path`` (``os.lstat`` result ``st``) unless another
    process has just replaced it: an entry left in place would never be rewritten.
    A link is removed itself, not what it points at."""
    try:
        now = os.lstat(path)
        if (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size,
                                                          st.st_mtime_ns):
            os.unlink(path)
    except OSError:
        pass
