"""A forked child and what its parent made: the child never releases, removes or uses it.

``fork()`` copies a process's memory but none of its threads, so a cache made before it is there in the child
only in part: its mover and I/O pools have no threads (a read submitted there never runs: the first step hangs),
and its finalizers would run when the child exits, joining the parent's I/O threads (a hang) and removing the
parent's live disk tier, its locks and the persistent store's scratch files. So tierkv registers its finalizers
through :func:`finalize`, and in a child (:func:`os.register_at_fork`) they are all detached: the parent still
owns what they release. A child also closes its copies of the parent's disk-tier and lock files
(:func:`private_file`) and takes tierkv's module locks anew (:func:`lock_anew_in_child`). A cache refuses use in
another process than its own (:class:`Owner`); a child makes its own caches (or starts with ``multiprocessing``'s
``spawn``).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

_live: list[weakref.finalize] = []
_lock = threading.Lock()
_private: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) of files a child must not keep open -> registrations


def finalize(obj: object, func: Callable[..., Any], *args: Any) -> weakref.finalize:
    """``weakref.finalize(obj, func, *args)``, detached in a forked child."""
    finalizer = weakref.finalize(obj, func, *args)
    with _lock:
        if len(_live) >= 64:
            _live[:] = [f for f in _live if f.alive]
        _live.append(finalizer)
    return finalizer


def private_file(fd: int) -> tuple[int, int]:
    """Register the file open at ``fd`` (a disk-tier file, a lock file) as the parent's alone: a forked child
    closes every descriptor of it that it inherited, so that it neither keeps the space of the parent's removed
    files nor holds the parent's locks after the parent dies (which tell other processes that their owner lives).
    The key returned goes to :func:`forget` before the file is removed."""
    status = os.fstat(fd)
    key = (status.st_dev, status.st_ino)
    with _lock:
        _private[key] = _private.get(key, 0) + 1
    return key


def forget(key: tuple[int, int]) -> None:
    """Undo one :func:`private_file` (the file is about to be removed: its inode may be another file's next)."""
    with _lock:
        left = _private.get(key, 0) - 1
        if left > 0:
            _private[key] = left
        else:
            _private.pop(key, None)


def _close_private() -> None:
    """In a child: close the inherited descriptors of the parent's private files (found through /proc/self/fd;
    where there is none, they stay open until the child exits)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        try:
            status = os.fstat(int(name))
        except (OSError, ValueError):
            continue
        if (status.st_dev, status.st_ino) in _private:
            os.close(int(name))
    _private.clear()


def _detach_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # the parent's may have been held by a thread that is not here
    for finalizer in _live:
        finalizer.detach()
    _live.clear()
    if _private:
        _close_private()


os.register_at_fork(after_in_child=_detach_in_child)


def lock_anew_in_child(namespace: dict[str, Any], name: str) -> None:
    """Give the module lock ``namespace[name]`` a new lock in every forked child: the parent's may be held at the
    fork by one of its threads, which the child does not have (the child's first use would wait for ever)."""
    os.register_at_fork(after_in_child=lambda: namespace.__setitem__(name, threading.Lock()))


class Owner:
    """The process that made an object; :meth:`check` refuses its use in another (a forked child)."""

    __slots__ = ("pid",)

    def __init__(self) -> None:
        self.pid = os.getpid()

    @property
    def inherited(self) -> bool:
        return os.getpid() != self.pid

    def check(self, what: str) -> None:
        if os.getpid() != self.pid:
            from tierkv.errors import InvalidConfigError

            raise InvalidConfigError(
                f"this {what} was made in process {self.pid}, before a fork(); a forked child cannot use it (its "
                "threads are not in the child, and its files are the parent's): create a new one in the child, or "
                "start workers with multiprocessing's 'spawn' method.")
