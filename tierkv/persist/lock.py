"""Advisory file locks (``fcntl.flock``) between processes — and threads — sharing a persistent directory.

Each acquisition opens the lock file anew: ``flock`` locks belong to an open file description, so two
threads (or two stores in one process) holding separate descriptors exclude each other exactly as two
processes do, and the kernel drops a dead process's locks with its descriptors — a SIGKILL never leaves
a lock behind.

Every descriptor is a Python file object, opened in C and owned by it from the start: a Ctrl-C between the
open and the code that closes it drops the object, and dropping it closes the descriptor (so a lock is never
held by a descriptor nobody has).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(path: Path, exclusive: bool) -> Iterator[None]:
    """Hold ``path`` (created if missing) shared or exclusive for the block."""
    with open(path, "ab") as f:  # closing releases the lock
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield


class OwnerLock:
    """An exclusive lock held for an owner's lifetime: it marks ``path``'s companion files as in use.

    :func:`is_abandoned` tells another process whether the owner is gone (its lock can be taken). An
    ``OwnerLock`` dropped without :meth:`release` releases it too (its file object closes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        file = open(path, "ab")  # noqa: SIM115 - held for the owner's lifetime, closed by release()
        fcntl.flock(file, fcntl.LOCK_EX)
        self._file = file

    def release(self) -> None:
        self._file.close()


def is_abandoned(path: Path) -> bool:
    """True if nobody holds ``path``'s owner lock (or it does not exist); never blocks."""
    try:
        with open(path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except FileNotFoundError:
        return True
    except BlockingIOError:
        return False
    return True
