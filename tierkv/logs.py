"""Warnings that many caches of one process would each repeat (a server opens a cache per request): logged at
most once per :data:`WARN_INTERVAL_S` for each subject (a server, a directory) and kind, process-wide."""

from __future__ import annotations

import threading
import time

WARN_INTERVAL_S = 60.0

_WARNED: dict[tuple[str, str], float] = {}  # (subject, kind) -> when it was last warned (time.monotonic())
_WARNED_LOCK = threading.Lock()


def due(subject: str, kind: str) -> bool:
    """Whether a warning of ``kind`` about ``subject`` is due now (none in the last interval); if so, it is
    recorded as logged."""
    now = time.monotonic()
    with _WARNED_LOCK:
        if now - _WARNED.get((subject, kind), -WARN_INTERVAL_S) < WARN_INTERVAL_S:
            return False
        _WARNED[(subject, kind)] = now
        return True


def forget() -> None:
    """Every warning is due again (as in a new process)."""
    with _WARNED_LOCK:
        _WARNED.clear()
