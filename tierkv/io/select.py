"""Choosing the engine and the I/O mode for a file, and saying once which was chosen and why.

Auto-selection takes the native C engine (O_DIRECT, io_uring-style queue depth), else posix. kvikio is used
only when forced (``engine="kvikio"`` / ``TIERKV_DISK_ENGINE=kvikio``): the disk tier reads into host bounce
buffers, which kvikio reads with POSIX through the page cache whatever its compat mode — GDS serves device
memory only — so it never beats O_DIRECT there (see :mod:`tierkv.io.kvikio_engine`). Each choice is a named
mode logged once on the ``tierkv`` logger, e.g.::

    disk engine: native unavailable (no C compiler), using posix (O_DIRECT)

A *forced* engine (``engine=``, or the ``disk_engine`` setting: ``TIERKV_DISK_ENGINE`` or an override) that
cannot load is an error, not a fallback: whoever forced it wants to know.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

from tierkv import settings
from tierkv.errors import InvalidConfigError
from tierkv.io.base import DiskFile, EngineUnavailableError

logger = logging.getLogger("tierkv")

ENGINES: tuple[str, ...] = settings.DISK_ENGINES
"""Every engine."""

AUTO_ENGINES: tuple[str, ...] = ("native", "posix")
"""What auto-selection tries, in order: the engines that read host buffers with O_DIRECT."""


def _load_posix() -> type[DiskFile]:
    from tierkv.io.posix import PosixFile

    return PosixFile


def _load_native() -> type[DiskFile]:
    from tierkv.io.native import load

    return load()


def _load_kvikio() -> type[DiskFile]:
    from tierkv.io.kvikio_engine import load

    return load()


_LOADERS: dict[str, Callable[[], type[DiskFile]]] = {
    "kvikio": _load_kvikio,
    "native": _load_native,
    "posix": _load_posix,
}


def load_engine(name: str) -> type[DiskFile]:
    """Return the file class of engine ``name``; raise :class:`EngineUnavailableError` if it cannot load."""
    if name not in _LOADERS:
        valid = ", ".join(ENGINES)
        raise InvalidConfigError(f"unknown disk engine {name!r}; valid engines: {valid} (or 'auto').")
    return _LOADERS[name]()


def engine_status() -> dict[str, str | None]:
    """Map each engine to ``None`` if it loads here, else the reason it does not (for ``tierkv bench``)."""
    status: dict[str, str | None] = {}
    for name in ENGINES:
        try:
            load_engine(name)
            status[name] = None
        except EngineUnavailableError as exc:
            status[name] = exc.reason
    return status


def available_engines() -> list[str]:
    """Names of the engines that load on this host, auto-selection's first (kvikio, forced only, last)."""
    status = engine_status()
    return [name for name in (*AUTO_ENGINES, *(e for e in ENGINES if e not in AUTO_ENGINES)) if status[name] is None]


@functools.cache
def _log_choice(message: str) -> None:
    """Log each distinct choice once per process: a disk tier reopens files, the log must not repeat."""
    logger.info(message)


def open_disk_file(
    path: str | os.PathLike[str], *, engine: str | None = None, direct: bool | None = None
) -> DiskFile:
    """Open an existing file for reading and writing through a disk engine.

    Parameters
    ----------
    path:
        An existing file (the disk tier creates and sizes it). A :class:`~tierkv.safefs.CreatedPath` (what the
        disk tier and the bench create) is opened from its descriptor, never by name.
    engine:
        ``"kvikio"``, ``"native"``, ``"posix"`` or ``"auto"``; ``None`` reads the ``disk_engine`` setting
        (``TIERKV_DISK_ENGINE``, default auto). A forced engine that cannot load raises
        :class:`InvalidConfigError`.
    direct:
        ``True`` requires O_DIRECT, ``False`` uses the page cache, ``None`` reads the ``direct_io`` setting
        (``TIERKV_DIRECT_IO``: 0/1), whose default tries O_DIRECT and falls back to buffered where the
        filesystem refuses it.

    >>> import tempfile
    >>> from tierkv.io import ALIGN, aligned_empty
    >>> with tempfile.NamedTemporaryFile() as tmp:
    ...     _ = tmp.truncate(ALIGN)
    ...     with open_disk_file(tmp.name, engine="posix") as f:
    ...         buf = aligned_empty(ALIGN)
    ...         f.read(0, buf)
    """
    source = "engine=" if engine is not None else settings.source("disk_engine")
    name = engine if engine is not None else settings.get("disk_engine")
    direct_source = "direct=" if direct is not None else settings.source("direct_io")
    if direct is None:
        direct = settings.get("direct_io")
    notes: list[str] = []  # the engines auto-selection passed over, and why
    forced = ""
    if name == "auto":
        try:
            load_engine("kvikio")
            notes.append("kvikio not auto-selected (it reads host buffers through the page cache)")
        except EngineUnavailableError as exc:
            notes.append(f"kvikio unavailable ({exc.reason})")
        for candidate in AUTO_ENGINES:
            try:
                cls = load_engine(candidate)
                break
            except EngineUnavailableError as exc:
                notes.append(f"{candidate} unavailable ({exc.reason})")
    else:
        try:
            cls = load_engine(name)
        except EngineUnavailableError as exc:
            raise InvalidConfigError(
                f"disk engine {name!r} was forced by {source} but cannot load: {exc.reason}. "
                f"{exc.fix or 'Choose another engine or unset TIERKV_DISK_ENGINE for auto-selection.'}"
            ) from exc
        forced = f", forced by {source}"
    file = cls(path, direct)
    if file.direct:
        mode = "O_DIRECT"
    elif direct is False:
        mode = f"buffered, requested by {direct_source}"
    else:
        mode = f"buffered, {file.direct_refused}"
    _log_choice(f"disk engine: {', '.join([*notes, f'using {file.engine_name} ({mode}){forced}'])}")
    return file
