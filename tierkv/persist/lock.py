"""Advisory file locks (``fcntl.flock``) between processes — and threads — sharing a persistent directory.

Each acquisition opens the lock file anew: ``flock`` locks belong to an open file description, so two
threads (or two stores in one process) holding separate descriptors exclude each other exactly as two
processes do, and the kernel drops a dead process's locks with its descriptors — a SIGKILL never leaves
a lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(path: Path, exclusive: bool) -> Iterator[None]:
    """Hold ``path`` (created if missing) shared or exclusive for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing releases the lock


class OwnerLock:
    """An exclusive lock held for an owner's lifetime: it marks ``path``'s companion files as in use.

    :func:`is_abandoned` tells another process whether the owner is gone (its lock can be taken)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def is_abandoned(path: Path) -> bool:
    """True if nobody holds ``path``'s owner lock (or it does not exist); never blocks."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True
