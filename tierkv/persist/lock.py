"""Advisory file locks (``fcntl.flock``) between processes — and threads — sharing a persistent directory.

Each acquisition opens the lock file anew: ``flock`` locks belong to an open file description, so two
threads (or two stores in one process) holding separate descriptors exclude each other exactly as two
processes do, and the kernel drops a dead process's locks with its descriptors — a SIGKILL never leaves
a lock behind.

Lock files are named relative to their directory's descriptor and opened with
:func:`tierkv.safefs.open_regular` (no link followed, a FIFO neither waited for nor used). Every descriptor
is a Python file object, made while SIGINT is held (:func:`~tierkv.atomic.deferred_interrupts`): a Ctrl-C
never finds a descriptor nobody owns, and dropping the object closes it (so a lock is never held by a
descriptor nobody has).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from typing import BinaryIO

from tierkv import safefs
from tierkv.atomic import deferred_interrupts


def _open(directory: int, name: str, flags: int) -> BinaryIO:
    """``name`` in ``directory`` as a file object (read-only: ``flock`` needs no more)."""
    mode = safefs.file_mode()

    def opener(path: str, _: int) -> int:
        fd = safefs.open_regular(directory, path, f"lock file {name}", os.O_RDONLY | flags, mode=mode)
        if flags & os.O_CREAT:
            with contextlib.suppress(OSError):  # exact whatever the umask (only its owner may change it)
                os.fchmod(fd, mode)
        return fd

    with deferred_interrupts():
        return open(name, "rb", buffering=0, opener=opener)  # noqa: SIM115 - closed by the caller


@contextlib.contextmanager
def locked(directory: int, name: str, exclusive: bool) -> Iterator[None]:
    """Hold ``name`` in ``directory`` (created if missing) shared or exclusive for the block."""
    with _open(directory, name, os.O_CREAT) as f:  # closing releases the lock
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield


class OwnerLock:
    """An exclusive lock held for an owner's lifetime: it marks ``name``'s companion files as in use.

    :func:`is_abandoned` tells another process whether the owner is gone (its lock can be taken). An
    ``OwnerLock`` dropped without :meth:`release` releases it too (its file object closes)."""

    def __init__(self, directory: int, name: str) -> None:
        self.name = name
        file = _open(directory, name, os.O_CREAT | os.O_EXCL)  # a new file: its flock never waits
        fcntl.flock(file, fcntl.LOCK_EX)
        self._file = file

    def release(self) -> None:
        self._file.close()


def is_abandoned(directory: int, name: str) -> bool:
    """True if nobody holds ``name``'s owner lock (or it does not exist); never blocks. Anything there that is
    not a regular file (a link, a FIFO) is not abandoned: it is left alone."""
    try:
        with _open(directory, name, 0) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except FileNotFoundError:
        return True
    except OSError:  # BlockingIOError: its owner lives; IntegrityError: not a lock file tierkv made
        return False
    return True
