"""Who owns the files in a ``disk_dir``: one lock file per open disk tier, held with ``flock`` while it lives.

A disk tier names its files ``tierkv-<pid>-<token>-*.kv`` and holds an exclusive ``flock`` on
``tierkv-<pid>-<token>.lock`` for as long as it is open. The kernel drops the lock when the process dies,
however it dies (SIGKILL included), so the next tier that opens the directory tells dead owners from live
ones without trusting pids: a lock it can take belongs to no one, and the files with that prefix are
removed. ``flock`` and not ``fcntl``/``lockf`` record locks, which are per *process*: a second cache in the
same process would take a live cache's lock.

The lock file is created under a temporary name, locked, then renamed into place, so no reclaimer ever
sees an unlocked lock file of a live tier. Files that are not tierkv's (another program's, persisted
blocks) are never touched.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import tempfile
from pathlib import Path

import psutil

log = logging.getLogger("tierkv")

_LOCK = re.compile(r"^tierkv-(\d+)-([0-9a-f]+)\.lock$")
_DATA = re.compile(r"^tierkv-(\d+)-([0-9a-z_]+)-.*\.kv$")
_PENDING = re.compile(r"^\.tierkv-.*\.tmp$")  # a lock file not yet renamed into place


class Lease:
    """This tier's claim on its files in ``directory`` (an open, ``flock``-ed lock file)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.prefix = f"tierkv-{os.getpid()}-{secrets.token_hex(6)}"
        fd, pending = tempfile.mkstemp(dir=directory, prefix=".tierkv-", suffix=".tmp")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.path = directory / f"{self.prefix}.lock"
            os.rename(pending, self.path)
        except BaseException:
            os.close(fd)
            Path(pending).unlink(missing_ok=True)
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent; an unremovable lock file is only unlocked,
        and the next tier opening the directory removes it)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("tierkv: could not remove the lock file %s (%s); the next cache opening %s removes it",
                        self.path, exc.strerror or exc, self.directory)
        finally:
            os.close(fd)


def reclaim_dead(directory: Path) -> list[Path]:
    """Remove the tierkv files in ``directory`` whose owner died; return what was removed.

    A lock file nobody holds, and the ``.kv`` files with its prefix, go; so do ``.kv`` files without a lock
    file whose pid is not running (left by versions before lock files). Everything else stays.
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
            prefix = name[: -len(".lock")]
            (dead if _take(directory / name, removed) else live).add(prefix)
        elif _PENDING.match(name):
            _take(directory / name, removed)
    for name in names:
        match = _DATA.match(name)
        if match is None:
            continue
        prefix = f"tierkv-{match.group(1)}-{match.group(2)}"
        if prefix in live or (prefix not in dead and psutil.pid_exists(int(match.group(1)))):
            continue
        try:
            (directory / name).unlink()
            removed.append(directory / name)
        except FileNotFoundError:
            pass  # another reclaimer was first
        except OSError as exc:
            log.warning("tierkv: could not remove %s, left by a process that died (%s)", name, exc.strerror)
    if removed:
        log.info("tierkv: removed %d file(s) that processes which died left in %s", len(removed), directory)
    return removed


def _take(path: Path, removed: list[Path]) -> bool:
    """If nobody holds ``path``'s lock, remove it (while holding the lock) and return True."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # gone already (another reclaimer), or not ours to open
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            log.warning("tierkv: cannot tell whether %s is in use (%s); leaving it", path, exc.strerror)
        return False
    try:
        path.unlink(missing_ok=True)
        removed.append(path)
    except OSError as exc:
        log.warning("tierkv: could not remove %s, left by a process that died (%s)", path, exc.strerror)
    finally:
        os.close(fd)
    return True
