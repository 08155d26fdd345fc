"""Who owns the files in a ``disk_dir``: one lock file per open disk tier, held with ``flock`` while it lives.

A disk tier names its files ``tierkv-<pid>-<token>-*.kv`` and holds an exclusive ``flock`` on
``tierkv-<pid>-<token>.lock`` for as long as it is open. The kernel drops the lock when the process dies,
however it dies (SIGKILL included), so the next tier that opens the directory tells dead owners from live
ones without trusting pids: a lock it can take belongs to no one, and the files with that prefix are
removed. ``flock`` and not ``fcntl``/``lockf`` record locks, which are per *process*: a second cache in the
same process would take a live cache's lock.

The lock file is created under a temporary name (``O_EXCL``, mode 0600), locked, then renamed into place, so
no reclaimer ever sees an unlocked lock file of a live tier. A reclaimer may still take the temporary file in
the instant before it is locked (it cannot tell it from one a dead process left): the tier then sees its lock
refused or its file unlinked, and starts over with a new one — two processes opening caches on one directory
at once never fail.

Everything is named relative to the directory's descriptor: a lock file is opened without following a link or
waiting for a FIFO (:func:`tierkv.safefs.open_regular`), and only regular files of this user with tierkv's
names are removed. Files that are not tierkv's (another program's, persisted blocks) are never touched.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import stat
from pathlib import Path

import psutil

from tierkv import forks, safefs
from tierkv.atomic import deferred_interrupts

log = logging.getLogger("tierkv")

_LOCK = re.compile(r"^tierkv-(\d+)-([0-9a-f]+)\.lock$")
_DATA = re.compile(r"^tierkv-(\d+)-([0-9a-z_]+)-.*\.kv$")
_PENDING = re.compile(r"^\.tierkv-.*\.tmp$")  # a lock file not yet renamed into place
ATTEMPTS = 100  # new lock files tried while reclaimers take them (each try is a few microseconds)


class Lease:
    """This tier's claim on its files in the directory ``directory`` (a descriptor; ``where`` names it): an
    open, ``flock``-ed lock file."""

    def __init__(self, directory: int, where: Path) -> None:
        self.directory, self.where = directory, where
        self.prefix = f"tierkv-{os.getpid()}-{secrets.token_hex(6)}"
        self.path = where / f"{self.prefix}.lock"
        self._fd: int | None = None
        self._private: tuple[int, int] | None = None  # the lock file's identity (forks.private_file)
        for _ in range(ATTEMPTS):
            with deferred_interrupts():  # the descriptor is recorded (closed by release) as it is made
                fd, pending = safefs.create_file(directory, ".tierkv-", ".tmp")
                self._fd = fd
            name = pending  # the lock file's name now
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(fd).st_nlink:  # locked before any reclaimer took it: it is ours
                    with deferred_interrupts():  # renamed and known to be, together
                        os.rename(pending, self.path.name, src_dir_fd=directory, dst_dir_fd=directory)
                        name = self.path.name
                    self._private = forks.private_file(fd)  # a forked child does not hold it
                    return
            except BlockingIOError:
                pass  # a reclaimer holds it and removes it
            except BaseException:
                self._close()
                safefs.remove_regular(directory, name)
                raise
            self._close()
        raise OSError(errno.EBUSY, f"no lock file could be made in {str(where)!r} in {ATTEMPTS} tries: other "
                      "processes keep removing them")

    def _close(self) -> None:
        self._forget()
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _forget(self) -> None:
        private, self._private = self._private, None
        if private is not None:
            forks.forget(private)

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent; an unremovable lock file is only unlocked,
        and the next tier opening the directory removes it)."""
        if self._fd is None:
            return
        self._forget()  # before the file goes: its inode may be another file's next
        try:
            safefs.remove_regular(self.directory, self.path.name)
        except OSError as exc:
            log.warning("tierkv: could not remove the lock file %s (%s); the next cache opening %s removes it",
                        self.path, exc.strerror or exc, self.where)
        finally:
            self._close()


def reclaim_dead(directory: int, where: Path) -> list[Path]:
    """Remove the tierkv files in the directory ``directory`` (a descriptor; ``where`` names it) whose owner
    died; return what was removed.

    A lock file nobody holds, and the ``.kv`` files with its prefix, go; so do ``.kv`` files without a lock
    file whose pid is not running (left by versions before lock files). Only regular files of this user are
    looked at and removed; everything else (another user's names in a shared directory) stays untouched.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed: list[Path] = []
    live: set[str] = set()
    dead: set[str] = set()
    for name in names:
        match = _LOCK.match(name)
        if match is not None:
            if _ours(directory, name):
                prefix = name[: -len(".lock")]
                (dead if _take(directory, name, where, removed) else live).add(prefix)
        elif _PENDING.match(name) and _ours(directory, name):
            _take(directory, name, where, removed)
    for name in names:
        match = _DATA.match(name)
        if match is None or not _ours(directory, name):
            continue
        prefix = f"tierkv-{match.group(1)}-{match.group(2)}"
        if prefix in live or (prefix not in dead and _running(match.group(1))):
            continue
        try:
            if safefs.remove_regular(directory, name):
                removed.append(where / name)
        except OSError as exc:
            log.warning("tierkv: could not remove %s, left by a process that died (%s)", name, exc.strerror)
    if removed:
        log.info("tierkv: removed %d file(s) that processes which died left in %s", len(removed), where)
    return removed


def _ours(directory: int, name: str) -> bool:
    """Whether ``name`` in ``directory`` is a regular file tierkv may remove (:func:`tierkv.safefs.is_ours`),
    told by one ``lstat``: another user's entries in a shared directory (any number of them, with any name)
    cost nothing more, and nothing in them is acted on."""
    try:
        status = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(status.st_mode) and safefs.is_ours(status)


_PID_MAX = 2**31 - 1  # the largest pid_t: a number above it names no process


def _running(pid: str) -> bool:
    """Whether the process of ``pid`` (the digits of a file name) is running; a number no pid can be is not."""
    return int(pid) <= _PID_MAX and psutil.pid_exists(int(pid))


def _take(directory: int, name: str, where: Path, removed: list[Path]) -> bool:
    """If ``name`` is a regular file of this user and nobody holds its lock, remove it (while holding the
    lock) and return True. A link, a FIFO or another user's file is never opened for long nor removed."""
    try:
        fd = safefs.open_regular(directory, name, str(where / name))
    except OSError:
        return False  # gone already (another reclaimer), or not ours to open
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise PermissionError(errno.EPERM, "another user's file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EPERM):
            log.warning("tierkv: cannot tell whether %s is in use (%s); leaving it", name, exc.strerror)
        return False
    try:
        if safefs.remove_regular(directory, name):
            removed.append(where / name)
    except OSError as exc:
        log.warning("tierkv: could not remove %s, left by a process that died (%s)", name, exc.strerror)
    finally:
        os.close(fd)
    return True
