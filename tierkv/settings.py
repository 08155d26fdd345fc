"""Every ``TIERKV_*`` environment variable in one place, each with a typed default and a scoped override.

A setting's value comes from, in order: the innermost :func:`override` in effect, else its environment
variable, else its default. Values are validated the same way whichever way they come, and a bad one is an
:class:`~tierkv.errors.InvalidConfigError` that names where it came from and shows a valid example::

    import tierkv.settings

    tierkv.settings.get("disk_engine")              # "auto", or $TIERKV_DISK_ENGINE
    with tierkv.settings.override(disk_engine="posix", io_queue_depth=4):
        ...                                         # every disk file opened here uses posix at depth 4
    tierkv.settings.source("disk_engine")           # "TIERKV_DISK_ENGINE=posix", "override(...)", "default"

This is KvikIO's ``kvikio.defaults`` pattern: a runtime knob has an environment variable *and* a context
manager that restores the previous value on exit (tests use the override, never ``os.environ``). Overrides
are process-wide, not per thread, because the threads that read them (the mover, the disk engines' workers)
are not the thread that entered the ``with``. Each :func:`override` pushes its values on a per-setting stack
and removes exactly its own entries on exit, so nested overrides restore in any exit order, also when two
threads override at once. The environment is read on every :func:`get` (a dictionary lookup and a parse),
so a variable set after import counts; no setting is read on a per-block path.

Settings (variable, default, range). Every number has a lower *and* an upper bound, checked whenever it is
read, so a slip (``TIERKV_IO_QUEUE_DEPTH=4294967296``) is an error naming the variable, its range and a valid
value, never a pool of 0 threads or an allocation of terabytes:

====================  ===========================  ===========  ===============  ======================================
name                  variable                     default      range            meaning
====================  ===========================  ===========  ===============  ======================================
disk_engine           TIERKV_DISK_ENGINE           auto         engine name      auto, kvikio, native or posix
direct_io             TIERKV_DIRECT_IO             None (auto)  1, 0, auto       O_DIRECT: on, off (page cache), try it
io_queue_depth        TIERKV_IO_QUEUE_DEPTH        16           1 - 256          I/O requests (threads) per disk file
io_chunk              TIERKV_IO_CHUNK              4 MiB        4 KiB - 256 MiB  largest single I/O, 4 KiB multiple
cache_dir             TIERKV_CACHE_DIR             XDG cache    a directory      native engine build, models
profile               TIERKV_PROFILE               None         a file           link profile JSON (tierkv bench)
trace                 TIERKV_TRACE                 None         a file           Chrome trace of each cache
debug                 TIERKV_DEBUG                 False        1, 0             full tracebacks from the CLI
prefetch_min          TIERKV_PREFETCH_MIN          4 MiB        0 - 64 GiB       smallest layer read prefetched
redis_password        TIERKV_REDIS_PASSWORD        None         a string         Redis password if not in the URL
cuda_standin          TIERKV_CUDA_STANDIN          False        1, 0             CUDA paths on a CPU stand-in
remote_timeout        TIERKV_REMOTE_TIMEOUT        2.0          0.001 - 600 s    a remote command's longest wait
remote_queue          TIERKV_REMOTE_QUEUE          64 MiB       4 KiB - 16 GiB   bytes queued for remote writes
remote_queue_wait     TIERKV_REMOTE_QUEUE_WAIT     10.0         0 - 600 s        wait for room, no write sent
shared_group          TIERKV_SHARED_GROUP          False        1, 0             persistent blocks group-shared
persist_lock_timeout  TIERKV_PERSIST_LOCK_TIMEOUT  30.0         0 - 600 s        wait for the persistent store's lock
====================  ===========================  ===========  ===============  ======================================

Secrets (``redis_password``) are never shown: :func:`source` and :func:`describe` print ``***`` for them. A
``TIERKV_*`` variable that names none of these (a misspelling) is warned about once (``TIERKV_BENCH_*`` are the
benchmarks' own).
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv import forks
from tierkv.errors import InvalidConfigError
from tierkv.units import format_bytes, parse_size

DISK_ENGINES: tuple[str, ...] = ("kvikio", "native", "posix")
"""The disk engines; ``tierkv.io`` loads them by these names (auto-selection: native, then posix)."""

DIRECT_IO_ALIGN = 4096
"""Alignment of direct I/O (``tierkv.io.ALIGN``): the I/O chunk must be a multiple of it."""

MAX_IO_QUEUE_DEPTH = 256
"""Most I/O threads per disk file (``io_queue_depth``): NVMe reaches its bandwidth from about 16; far more
threads only cost memory, and the native pool refuses more."""

MAX_IO_CHUNK = 256 << 20
"""Largest ``io_chunk``: past a few MiB a larger piece only serialises a request onto one thread."""

UNWRITABLE_CACHE_DIR = ("Set TIERKV_CACHE_DIR to a directory you can write (tierkv keeps the kernels it builds and "
                        "dequantised model weights there).")
"""The fix where the cache directory (``cache_dir``) cannot be created or opened."""

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class _Invalid(ValueError):
    """Why a value was refused (a phrase); :func:`_convert` adds how the value was given."""


@dataclass(frozen=True, slots=True)
class Setting:
    """One knob: its variable, its default, how a value (an env string or a Python value) becomes typed."""

    name: str
    variable: str
    default: Callable[[], Any]  # called on each read: a default may depend on other environment (XDG)
    convert: Callable[[Any], Any]  # raw value -> typed value; raises _Invalid with the reason
    example: str  # a valid environment value, for error messages
    doc: str


def _engine(value: Any) -> str:
    name = str(value).strip().lower()
    if name not in ("auto", *DISK_ENGINES):
        raise _Invalid(f"is not a disk engine; valid: auto, {', '.join(DISK_ENGINES)}")
    return name


def _tristate(value: Any) -> bool | None:
    """``True``/``False``/``None`` as themselves; strings 1/0 (or true/false, yes/no, on/off) and auto."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise _Invalid("must be 1 (on), 0 (off) or auto")


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise _Invalid("must be 1 or 0 (or true/false, yes/no, on/off)")


def _count(high: int) -> Callable[[Any], int]:
    """A converter to an int in ``[1, high]``."""
    def convert(value: Any) -> int:
        # ASCII digits only: str.isdigit() also accepts superscripts ('²'), which int() refuses
        digits = isinstance(value, str) and value.strip().isascii() and value.strip().isdigit() \
            and len(value.strip().lstrip("0")) <= len(str(high))  # int() of thousands of digits raises ValueError
        if isinstance(value, bool) or not (isinstance(value, int) or digits) or not 1 <= int(value) <= high:
            raise _Invalid(f"must be a positive integer of at most {high} (range 1-{high})")
        return int(value)

    return convert


def _seconds_in(low: float, high: float) -> Callable[[Any], float]:
    """A converter to a number of seconds in ``[low, high]`` (``low`` 0 accepts 0; else ``low`` is the least)."""
    def convert(value: Any) -> float:
        # ASCII only, as the integer knobs: float() also reads other scripts' digits ('١٢') and '1_0'
        if isinstance(value, str) and not (value.strip().isascii() and "_" not in value):
            raise _Invalid("must be a number of seconds such as 0.5, in ASCII digits")
        try:
            seconds = float(value) if not isinstance(value, bool) else -1.0
        except (TypeError, ValueError):
            raise _Invalid("must be a number of seconds such as 0.5") from None
        if not low <= seconds <= high:  # also refuses nan
            raise _Invalid(f"must be a number of seconds from {low:g} to {high:g}")
        return seconds

    return convert


def _size(value: int | str) -> int:
    """Bytes: an int as it is (Python), a string as :func:`tierkv.units.parse_size` reads it (a bare number is
    GB, as everywhere in tierkv)."""
    try:
        return value if isinstance(value, int) else parse_size(value)
    except InvalidConfigError:
        raise _Invalid("is not a size (a number with an optional unit: B, KB, MB, GB, TB or KiB, MiB, GiB, TiB; a "
                       "bare number is GB)") from None


def _bounded_size(low: int, high: int, what: str) -> Callable[[Any], int]:
    """A converter to a size in bytes in ``[low, high]`` (a bare number in the environment is GB, as everywhere
    in tierkv; in Python an int is bytes)."""
    def convert(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise _Invalid(f"must be a size such as {what} (or a number of bytes in Python)")
        size = 0 if isinstance(value, str) and value.strip() == "0" else _size(value)
        if not low <= size <= high:
            raise _Invalid(f"must be a size from {format_bytes(low) if low else 0} to {format_bytes(high)}"
                           f"{_bare_number_hint(value)}")
        return size

    return convert


def _chunk(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _Invalid("must be a size such as 4MiB (or a number of bytes in Python)")
    size = _size(value)
    if size < DIRECT_IO_ALIGN or size % DIRECT_IO_ALIGN or size > MAX_IO_CHUNK:
        raise _Invalid(f"must be a positive multiple of {DIRECT_IO_ALIGN} bytes of at most "
                       f"{format_bytes(MAX_IO_CHUNK)}{_bare_number_hint(value)}")
    return size


def _bare_number_hint(value: Any) -> str:
    """For a size given as digits alone (a byte count, most likely), that it was read as GB and how to write
    those bytes: ``" (a bare number is GB: 4096 is 4096 GB; for bytes give a unit, e.g. 4KiB or 4096B)"``."""
    text = value.strip() if isinstance(value, str) else ""
    if not (text.isascii() and text.isdigit()) or len(text) > 20:
        return ""
    count = int(text)
    binary = next((f"{count >> shift}{unit} or " for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB"))
                   if count and count % (1 << shift) == 0), "")
    return f" (a bare number is GB: {text} is {text} GB; for bytes give a unit, e.g. {binary}{text}B)"


def _path_or_none(value: Any) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value).strip():
        raise _Invalid("must be a file path")
    try:
        return Path(os.fspath(value)).expanduser()
    except RuntimeError:  # "~user/..." of a user this machine does not know, or "~" without $HOME
        raise _Invalid(f"starts with {os.fspath(value).split(os.sep)[0]!r}, whose home directory cannot be found "
                       "(no such user, or $HOME unset); give an absolute path") from None


def _directory(value: Any) -> Path:
    path = _path_or_none(value)
    if path is None:
        raise _Invalid("must be a directory path")
    if not path.is_absolute():
        raise _Invalid("must be an absolute path (a relative one puts the cache under whatever folder each command "
                       "runs in, built again there)")
    existing = next(folder for folder in (path, *path.parents) if os.path.lexists(folder))  # ("/" always exists)
    if not existing.is_dir():  # (refused here, in the setting's words, not as a raw NotADirectoryError on first use)
        where = "" if existing == path else f"is below {str(existing)!r}, which "
        raise _Invalid(f"{where}is not a directory (a file, or a link to none); give a directory (created if "
                       "missing)")
    return path


def _secret(value: Any) -> str | None:
    """A non-empty string that encodes as UTF-8 (as it is sent): a byte of another encoding in the environment
    (a Latin-1 locale's) comes as a surrogate escape, which redis-py would fail on, quoting it."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _Invalid("must be a non-empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _Invalid("holds a byte that is not UTF-8 (set in a non-UTF-8 locale?); give the password as UTF-8 "
                       "text") from None
    return value


def _xdg_cache() -> Path:
    """``$XDG_CACHE_HOME/tierkv``, else ``~/.cache/tierkv``. A relative value (``~/.cache`` unexpanded, as a systemd
    unit or a .env file passes it) is ignored, as the XDG spec says: it made a folder named ``~`` wherever the
    process ran."""
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if not os.path.isabs(xdg):
        xdg = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "tierkv"


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting("disk_engine", "TIERKV_DISK_ENGINE", lambda: "auto", _engine, "posix",
                "disk engine of the disk tier; auto picks native, else posix (kvikio only when forced)"),
        Setting("direct_io", "TIERKV_DIRECT_IO", lambda: None, _tristate, "0",
                "O_DIRECT for disk files: 1 requires it, 0 uses the page cache, auto tries it"),
        Setting("io_queue_depth", "TIERKV_IO_QUEUE_DEPTH", lambda: 16, _count(MAX_IO_QUEUE_DEPTH), "16",
                "requests in flight per disk file (NVMe reaches its bandwidth from about 16)"),
        Setting("io_chunk", "TIERKV_IO_CHUNK", lambda: 4 << 20, _chunk, "4MiB",
                "largest single I/O an engine issues: larger requests are cut so the workers share them"),
        Setting("cache_dir", "TIERKV_CACHE_DIR", _xdg_cache, _directory, "~/.cache/tierkv",
                "per-user cache: the native engine is compiled into its native/ folder on first use, and "
                "tierkv.models writes dequantised checkpoints into models/"),
        Setting("profile", "TIERKV_PROFILE", lambda: None, _path_or_none, "tierkv-profile.json",
                "link profile (JSON written by `tierkv bench`) for telemetry, prefetch_depth='auto' and the links "
                "of `tierkv plan` without --profile"),
        Setting("trace", "TIERKV_TRACE", lambda: None, _path_or_none, "/tmp/tierkv-trace.json",
                "record a Chrome trace of every cache and write it to this path when the cache closes"),
        Setting("debug", "TIERKV_DEBUG", lambda: False, _flag, "1",
                "the CLI shows full tracebacks instead of a one-line error"),
        Setting("prefetch_min", "TIERKV_PREFETCH_MIN", lambda: 4 << 20, _bounded_size(0, 64 << 30, "4MiB, or 0"),
                "4MiB",
                "layers whose read weighs less (its bytes and 2 KiB a block) are read when they come, not "
                "prefetched (0: prefetch all)"),
        Setting("redis_password", "TIERKV_REDIS_PASSWORD", lambda: None, _secret, "s3cret",
                "password of the remote tier's Redis (remote=...) when the URL carries none"),
        Setting("cuda_standin", "TIERKV_CUDA_STANDIN", lambda: False, _flag, "1",
                "a cache on the CPU runs the CUDA code paths on tierkv.cuda_standin, which checks stream ordering"),
        Setting("remote_timeout", "TIERKV_REMOTE_TIMEOUT", lambda: 2.0, _seconds_in(0.001, 600.0), "0.5",
                "longest wait of one remote-tier command; slower is a miss and the server is left alone a while"),
        Setting("remote_queue", "TIERKV_REMOTE_QUEUE", lambda: 64 << 20, _bounded_size(4 << 10, 16 << 30, "64MiB"),
                "64MiB", "host memory for blocks waiting to be written to the remote tier (counted in no budget)"),
        Setting("remote_queue_wait", "TIERKV_REMOTE_QUEUE_WAIT", lambda: 10.0, _seconds_in(0.0, 600.0), "10",
                "how long the persistence thread waits for room in the remote write queue while no write is sent "
                "before it drops blocks (0: never wait)"),
        Setting("shared_group", "TIERKV_SHARED_GROUP", lambda: False, _flag, "1",
                "the persistent block directory is shared with its group (dirs 2770, files 0660) instead of "
                "private to its owner (0700/0600); see docs/reliability.md (Security)"),
        Setting("persist_lock_timeout", "TIERKV_PERSIST_LOCK_TIMEOUT", lambda: 30.0, _seconds_in(0.0, 600.0), "30",
                "longest wait for the persistent block store's lock held by another process (a stopped one): then "
                "that store is used without it (no recovery, writes skipped, a warning) (0: try once)"),
    )
}  # fmt: skip
"""Every setting by name."""

SECRETS = frozenset({"redis_password"})
"""Settings whose values are never printed (their source reads ``TIERKV_REDIS_PASSWORD=***``)."""

_lock = threading.Lock()
forks.lock_anew_in_child(globals(), "_lock")
_overrides: dict[str, list[tuple[int, Any, str]]] = {}  # name -> stack of (override token, typed value, source)
_tokens = itertools.count()


def _setting(name: str) -> Setting:
    if name not in SETTINGS:
        raise InvalidConfigError(f"unknown tierkv setting {name!r}; valid: {', '.join(SETTINGS)}.")
    return SETTINGS[name]


def _convert(setting: Setting, value: Any, given: str) -> Any:
    try:
        return setting.convert(value)
    except _Invalid as exc:
        raise InvalidConfigError(
            f"{given} {exc}; e.g. {setting.variable}={setting.example}, or unset it for the default "
            f"({setting.doc})."
        ) from None


def _resolve(setting: Setting) -> tuple[Any, str]:
    with _lock:
        stack = _overrides.get(setting.name)
        if stack:
            return stack[-1][1], stack[-1][2]
    raw = os.environ.get(setting.variable, "")  # empty counts as unset; a password keeps its spaces
    if setting.name not in SECRETS:
        raw = raw.strip()
    if raw:
        shown = "***" if setting.name in SECRETS else raw
        return _convert(setting, raw, f"{setting.variable}={shown!r}"), f"{setting.variable}={shown}"
    return setting.default(), "default"


def get(name: str) -> Any:
    """The value of setting ``name`` (see the module's table): override, else environment, else default.

    >>> with override(io_queue_depth=4):
    ...     get("io_queue_depth")
    4
    """
    return _resolve(_setting(name))[0]


def check_all() -> None:
    """Resolve every setting: a malformed ``TIERKV_*`` variable is refused (naming it) where this is called — when
    a cache is built — rather than inside a forward that would then give back its work. A ``TIERKV_*`` variable
    that names no setting (a misspelt one, which would be silently ignored) is warned about once."""
    for name in SETTINGS:
        get(name)
    for message in unknown_variables():
        warnings.warn(message, stacklevel=3)


_BENCHMARK_PREFIX = "TIERKV_BENCH_"  # the benchmarks' own knobs (benchmarks/), not the library's
_reported: set[str] = set()


def unknown_variables() -> list[str]:
    """One message per ``TIERKV_*`` environment variable that names no setting and was not reported before in
    this process, with the closest setting's variable where one is close."""
    messages = []
    for variable, hint in _ignored_variables():
        if variable not in _reported:
            _reported.add(variable)
            messages.append(f"{variable} is not a tierkv setting and is ignored{hint}")
    return messages


def _ignored_variables() -> list[tuple[str, str]]:
    """``(variable, hint)`` for each ``TIERKV_*`` environment variable that names no setting: the hint names the
    closest setting's variable where one is close."""
    known = [setting.variable for setting in SETTINGS.values()]
    ignored = []
    for variable in sorted(os.environ):
        if variable.startswith("TIERKV_") and not variable.startswith(_BENCHMARK_PREFIX) and variable not in known:
            close = difflib.get_close_matches(variable, known, n=1, cutoff=0.8)
            ignored.append((variable, f"; did you mean {close[0]}?" if close else
                            " (tierkv/settings.py lists every setting)"))
    return ignored


def source(name: str) -> str:
    """How the value of ``name`` was given, for messages: ``"TIERKV_DISK_ENGINE=posix"``,
    ``"override(disk_engine='posix')"`` or ``"default"``."""
    return _resolve(_setting(name))[1]


class Described(dict[str, tuple[Any, str]]):
    """``{name: (value, source)}`` of every setting; ``str()`` (what ``print`` shows) is a table of one line per
    setting: its variable, value and source (``default``, ``environment`` or the ``override(...)``), then one line
    per ``TIERKV_*`` variable that names no setting (``ignored``: a misspelling has no effect)."""

    def __init__(self, values: dict[str, tuple[Any, str]], ignored: list[tuple[str, str]]) -> None:
        super().__init__(values)
        self.ignored = ignored

    def __str__(self) -> str:
        rows = [("variable", "value", "source")]
        for name, (value, src) in self.items():
            variable = SETTINGS[name].variable
            rows.append((variable, str(value), "environment" if src.startswith(f"{variable}=") else src))
        widths = [max(len(row[i]) for row in rows) for i in range(2)]
        lines = [f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}" for row in rows]
        lines += [f"{variable} is not a tierkv setting and is ignored{hint}" for variable, hint in self.ignored]
        return "\n".join(lines)


def describe() -> Described:
    """Every setting's value and source, for reports and debug output; ``print(describe())`` shows them as a
    table (:class:`Described`), secrets as ``***``."""
    described = {name: _resolve(s) for name, s in SETTINGS.items()}
    return Described({name: ("***", src) if name in SECRETS and value is not None else (value, src)
                      for name, (value, src) in described.items()}, _ignored_variables())


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Set settings for the duration of a ``with`` block, whatever the environment says.

    Values are checked before any is applied (a bad one leaves every setting as it was). Strings are read
    as the environment variable would be; Python values may also be typed (``direct_io=False``,
    ``io_chunk=1 << 20`` in bytes, ``trace=None`` to turn a ``TIERKV_TRACE`` off in the block).
    """
    entries = {}
    for name, value in values.items():
        given = f"override({name}={'***' if name in SECRETS else repr(value)})"
        entries[name] = (_convert(_setting(name), value, given), given)
    token = next(_tokens)
    with _lock:
        for name, (typed, given) in entries.items():
            _overrides.setdefault(name, []).append((token, typed, given))
    try:
        yield
    finally:
        with _lock:
            for name in entries:
                _overrides[name] = [entry for entry in _overrides[name] if entry[0] != token]
