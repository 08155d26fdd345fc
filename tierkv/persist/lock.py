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

``flock`` itself waits without a bound, and a process that holds a lock for ever (a stopped one, or another
member of a group-shared directory) would stop every other one; :func:`locked` waits up to a deadline instead
(polling a non-blocking ``flock``) and then raises :class:`LockTimeoutError`, naming the lock file, its
holder's pid where ``/proc/locks`` shows it, and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from typing import BinaryIO

from tierkv import forks, safefs
from tierkv.atomic import deferred_interrupts
from tierkv.errors import DiskTierError, IntegrityError

POLL_SECONDS = (0.001, 0.05)  # first and longest pause between tries of a lock another process holds


class LockTimeoutError(DiskTierError):
    """A lock another process holds was not released within the deadline (``TIERKV_PERSIST_LOCK_TIMEOUT``)."""


def _open(directory: int, name: str, flags: int) -> BinaryIO:
    """``name`` in ``directory`` as a file object (read-only: ``flock`` needs no more)."""
    mode = safefs.file_mode()

    def opener(path: str, _: int) -> int:
        fd = safefs.open_regular(directory, path, f"lock file {name}", os.O_RDONLY | flags, mode=mode)
        links = os.fstat(fd).st_nlink
        if links != 1:  # a hard link planted to a file elsewhere: never locked, never chmod-ed
            os.close(fd)
            raise IntegrityError(errno.EPERM, f"lock file {name}: {links} names for one file where tierkv keeps its "
                                              "own lock (a hard link to a file elsewhere); refused. Remove it.")
        if flags & os.O_CREAT:
            with contextlib.suppress(OSError):  # exact whatever the umask (only its owner may change it)
                os.fchmod(fd, mode)
        return fd

    with deferred_interrupts():
        return open(name, "rb", buffering=0, opener=opener)  # noqa: SIM115 - closed by the caller


@contextlib.contextmanager
def locked(directory: int, name: str, exclusive: bool, timeout: float | None = None,
           where: str | None = None) -> Iterator[None]:
    """Hold ``name`` in ``directory`` (created if missing) shared or exclusive for the block. ``timeout``: the
    longest wait in seconds (0: one try), then :class:`LockTimeoutError`; None waits as long as it takes.
    ``where``: the lock file's path, for the error."""
    with _open(directory, name, os.O_CREAT) as f:
        if timeout is None:
            fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        else:
            _acquire(f, exclusive, timeout, where or name)
        try:
            yield
        finally:  # unlocked, not only closed: a child forked meanwhile shares the open file, and would hold it
            fcntl.flock(f, fcntl.LOCK_UN)


def _acquire(f: BinaryIO, exclusive: bool, timeout: float, where: str) -> None:
    """``flock`` ``f`` within ``timeout`` seconds, trying without blocking and pausing a little longer each time
    (a blocking ``flock`` cannot be given a deadline, and a signal to end it would reach only the main thread)."""
    deadline = time.monotonic() + timeout
    pause = POLL_SECONDS[0]
    while True:
        try:
            fcntl.flock(f, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(pause, left))
            pause = min(2 * pause, POLL_SECONDS[1])
    holders = lock_holders(os.fstat(f.fileno()))
    held_by = f"process {', '.join(map(str, holders))}" if holders else "another process (its pid is not shown " \
        "in /proc/locks here)"
    raise LockTimeoutError(errno.ETIMEDOUT, f"the lock {where} is held by {held_by}, which did not release it "
                                            f"within {timeout:g} s (TIERKV_PERSIST_LOCK_TIMEOUT). A stopped process "
                                            "(kill -CONT it, or end it) or another user of a shared disk_dir holds it; "
                                            "a lock nobody holds is never waited for (the kernel drops a dead "
                                            "process's locks).")


def lock_holders(status: os.stat_result) -> list[int]:
    """The pids that hold a lock on the file of ``status`` (device and inode), as ``/proc/locks`` lists them (the
    pid that took the lock; empty where it cannot be read, or in another pid namespace)."""
    major, minor = os.major(status.st_dev), os.minor(status.st_dev)
    holders: list[int] = []
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as listing:
            lines = listing.read(1 << 20).splitlines()
    except OSError:
        return holders
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":  # "->": a process waiting for the lock, not holding it
            continue
        device = fields[5].split(":")
        try:
            pid = int(fields[4])
            same = len(device) == 3 and int(device[2]) == status.st_ino and \
                (int(device[0], 16), int(device[1], 16)) == (major, minor)
        except ValueError:
            continue
        if same and pid > 0 and pid not in holders:
            holders.append(pid)
    return holders


class OwnerLock:
    """An exclusive lock held for an owner's lifetime: it marks ``name``'s companion files as in use.

    :func:`is_abandoned` tells another process whether the owner is gone (its lock can be taken). An
    ``OwnerLock`` dropped without :meth:`release` releases it too (its file object closes)."""

    def __init__(self, directory: int, name: str) -> None:
        self.name = name
        file = _open(directory, name, os.O_CREAT | os.O_EXCL)  # a new file: its flock never waits
        fcntl.flock(file, fcntl.LOCK_EX)
        self._file = file
        self._private = forks.private_file(file.fileno())  # a forked child does not hold it after this owner dies

    def release(self) -> None:
        if self._file.closed:
            return
        forks.forget(self._private)
        fcntl.flock(self._file, fcntl.LOCK_UN)  # (a forked child shares the open file: closing alone keeps it held)
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
