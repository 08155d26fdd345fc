"""Commits that a Ctrl-C cannot cut in half.

A ``KeyboardInterrupt`` is asynchronous: CPython raises it from the SIGINT handler at almost any point of
the main thread. The store's operations are ordered so that an interrupt anywhere before their commit leaves
nothing behind (slots taken so far are given back in ``except BaseException``). The commit itself — a few
table, refcount and free-list edits that must happen together, in memory, with no I/O or wait — runs inside
:func:`deferred_interrupts`: a SIGINT that arrives meanwhile is held and delivered, to whatever handler was
installed, the moment the commit is done. Only the main thread receives SIGINT, so elsewhere it is a no-op.

Never put I/O or a wait inside: the user's Ctrl-C would wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Awaitable, Iterator
from types import FrameType
from typing import TypeVar

T = TypeVar("T")

_held: list[tuple[int, FrameType | None]] = []  # a SIGINT received inside the outermost section
_depth = 0  # sections open on the main thread
_forced = False  # an interrupt() inside the outermost section


def interrupt() -> None:
    """Stop the main thread as Ctrl-C does, whatever SIGINT's own handler is (a script's background job ignores
    SIGINT): raise KeyboardInterrupt now, or inside a section the moment it ends. SIGTERM's way out of a command
    (:mod:`tierkv.cli`)."""
    global _forced
    if _depth:
        _forced = True
        return
    raise KeyboardInterrupt


def _hold(signum: int, frame: FrameType | None) -> None:
    _held.append((signum, frame))


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT until the block ends (nested blocks: until the outermost ends), then deliver it."""
    global _depth, _forced
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # no SIGINT arrives here (or its handler is not Python's and cannot be put back)
        return
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    previous = signal.signal(signal.SIGINT, _hold)
    _depth = 1
    try:
        yield
    finally:
        _depth = 0
        signal.signal(signal.SIGINT, previous)
        forced, _forced = _forced, False
        if forced:
            _held.clear()
            raise KeyboardInterrupt
        if _held:
            signum, frame = _held.pop()
            _held.clear()
            if callable(previous):
                previous(signum, frame)  # the default handler raises KeyboardInterrupt here
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signum)  # SIG_IGN: dropped, as it would have been


async def finished(awaitable: Awaitable[T]) -> T:
    """``await awaitable``, except that a cancellation meanwhile (``task.cancel()``, ``asyncio.wait_for``'s
    timeout) is raised only once it is done. For work on a worker thread (``asyncio.to_thread``, aiofiles): it
    goes on after a plain ``await`` is cancelled, and the caller's cleanup would close the descriptor it reads
    or writes under it — a number the process may give to another file at once."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
        except BaseException:  # noqa: BLE001 - the task's own error, raised below by result()
            break
    if cancelled:
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what the caller gets
        raise asyncio.CancelledError
    return task.result()
