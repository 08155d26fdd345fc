"""tierkv's loggers: their messages without control characters (:class:`PrintableMessages`), and warnings that
many caches of one process would each repeat (a server opens a cache per request) logged at most once per
:data:`WARN_INTERVAL_S` for each subject (a server, a directory) and kind, process-wide."""

from __future__ import annotations

import logging
import threading
import time

from tierkv.inputs import printable

LOGGERS = ("tierkv", "tierkv.remote")
"""The loggers tierkv logs through (a logger's filters see only its own records, not its children's)."""


class PrintableMessages(logging.Filter):
    """Drops the control characters of a record's formatted message: a message may quote a file name, a record's
    key or a server's reply that anyone sharing a store may write, whose newline would forge a log line and whose
    escapes would drive the terminal. The record's traceback (``exc_info``) is formatted by the handler, as ever."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a message that does not format: the handler reports it, as without us
            return True
        shown = printable(message)
        if shown != message:
            record.msg, record.args = shown, None
        return True


def install() -> None:
    """Put one :class:`PrintableMessages` on each of :data:`LOGGERS` (again: no second)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, PrintableMessages) for existing in logger.filters):
            logger.addFilter(PrintableMessages())


install()

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
