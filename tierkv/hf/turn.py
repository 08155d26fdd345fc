"""A cache's *turn*: the moment between two forwards that a thread other than the decoding one takes to change or
read the cache as a whole — a save reads every record, an executor block's entry or exit switches the executors —
while the decoding thread's next forward waits (:class:`~tierkv.hf.cache.CacheGuard` holds the state).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

from tierkv.errors import InvalidConfigError

if TYPE_CHECKING:
    from tierkv.hf.cache import TieredCache


TURN_WAIT_S = 60.0
"""How long a save (or an executor block's entry or exit) waits for another thread's forward to finish (one that
stopped part-way with an error, its thread still alive, never does)."""
SAVE_FIX = "save it from that thread, or once its generate() has returned"


@contextlib.contextmanager
def turn(cache: TieredCache, fix: str | None = SAVE_FIX) -> Iterator[None]:
    """The cache's turn (:class:`~tierkv.hf.cache.CacheGuard`): taken between two forwards, waiting for another
    thread's forward in progress to finish; its next forward or edit waits until the block has run. Not taken
    within :data:`TURN_WAIT_S`: refused, the message ending with ``fix``; or (``fix`` None) the block runs without
    it, as it must where it gives the user's model back (that forward stopped part-way: its thread's next forward
    takes it back)."""
    deadline, guard = time.monotonic() + TURN_WAIT_S, cache.using
    with _asking(cache):
        while not _take_turn(cache):
            if time.monotonic() > deadline:
                if fix is None:
                    break
                raise _refusal(fix)
            with guard:
                guard.pause(0.01)
    try:
        yield
    finally:
        guard.give_turn()


@contextlib.asynccontextmanager
async def aturn(cache: TieredCache) -> AsyncIterator[None]:
    """:func:`turn` for asave: the event loop runs while it waits."""
    deadline = time.monotonic() + TURN_WAIT_S
    with _asking(cache):
        while not _take_turn(cache):
            if time.monotonic() > deadline:
                raise _refusal(SAVE_FIX)
            await asyncio.sleep(0.005)
    try:
        yield
    finally:
        cache.using.give_turn()


@contextlib.contextmanager
def _asking(cache: TieredCache) -> Iterator[None]:
    """This thread asks for the turn meanwhile: the other threads' next forward gives way to it."""
    with cache.using:
        cache.using.asking += 1
    try:
        yield
    finally:
        with cache.using:
            cache.using.asking -= 1


def _take_turn(cache: TieredCache) -> bool:
    with cache.using:
        return cache.using.take_turn(cache.forward.begun_elsewhere(cache.uses_per_forward()))


def _refusal(fix: str) -> InvalidConfigError:
    return InvalidConfigError(
        f"this TieredCache is in the middle of a forward on another thread, which did not finish within "
        f"{TURN_WAIT_S:.0f} s (or stopped part-way with an error): {fix}.")
