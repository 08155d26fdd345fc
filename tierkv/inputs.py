"""User-supplied inputs outside the API: JSON files (link profiles, model presets) and ``TIERKV_*`` text knobs."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any

from tierkv import safefs, settings
from tierkv.errors import InvalidConfigError

MAX_JSON_BYTES = 4 << 20
"""Largest JSON file :func:`read_json` reads: link profiles are a few KB and a Hugging Face ``config.json`` tens
of KB, so this bounds what a wrong path (``/dev/zero``, a huge log) can cost without refusing a real file."""

PARSE_FACTOR = 12
"""Most bytes of Python objects :func:`parse_json` lets a JSON text become, per byte of the text: a file tierkv
writes becomes 2-8 times its size (token ids, records of a few fields); ``[{},{},...]`` would become 24 times
(an empty dict for every three bytes), which is refused before parsing."""
_OBJECT_BYTES = {b"{": 72, b"[": 72, b'"': 28, b",": 28}
"""What each of these bytes costs parsed, at most about: a dict or list (and its slot), half a short string (a
string has two quotes), one more value (a slot and a number)."""

JSON_SETTINGS = ("profile",)
"""Settings whose value is the path of a JSON file :func:`read_json` reads (its errors name the variable)."""

def env_str(name: str, default: str | None = None) -> str | None:
    """Read a ``TIERKV_*`` environment knob (empty counts as unset)."""
    value = os.environ.get(name, "").strip()
    return value or default

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
"""C0 and C1 control characters and DEL: what makes a terminal move the cursor, set its title or clear the screen."""


def printable(value: object) -> str:
    """``value`` as text with its control characters removed: text from a file or a server anyone may write (a
    profile's link names, a remote server's error reply) reaches the terminal and the logs, and must not drive the
    one or forge lines in the other."""
    return _CONTROL.sub("", str(value))


def read_json(path: str | os.PathLike[str], what: str, fix: str, limit: int = MAX_JSON_BYTES,
              follow: bool = True) -> Any:
    """Load a user-supplied JSON file. Only a regular file of at most ``limit`` bytes is read (a FIFO is never
    waited on, a device never read), through a symbolic link only if ``follow`` (False for files found in a
    folder a user hands over, where anything may be planted); anything else, or malformed JSON, is an
    InvalidConfigError naming the path (and the ``TIERKV_*`` variable that gave it) and saying ``fix``."""
    name = os.fspath(path)
    try:
        return parse_json(_read_regular(name, limit, follow))
    except _Unusable as exc:
        problem = str(exc)
    except FileNotFoundError:
        problem = "does not exist"
    except OSError as exc:
        problem = ("is a symbolic link, which tierkv does not follow here" if exc.errno == errno.ELOOP and not follow
                   else f"cannot be read ({exc.strerror or exc})")
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError; nesting beyond the stack
        problem = f"is not valid JSON ({str(exc)[:200] or type(exc).__name__})"
    variable = _variable_naming(name)
    given, unset = (f" ({variable})", f", or unset {variable}") if variable else ("", "")
    raise InvalidConfigError(f"{what} {name!r}{given} {problem}; {fix}{unset}.")


class _Unusable(Exception):
    """Why a JSON input is not read (a phrase)."""


class CostlyJSONError(_Unusable, ValueError):
    """A JSON text that would take far more memory parsed than a file tierkv writes (:func:`parse_json`)."""


def parse_json(data: bytes | bytearray) -> Any:
    """``json.loads(data)``, refused (:class:`CostlyJSONError`) before parsing where the objects it would build are
    estimated from a count of its structural bytes at more than :data:`PARSE_FACTOR` times its size: a text of
    nothing but empty objects or tiny strings would otherwise cost 10-25 times its size in memory whatever bound
    its file size has."""
    estimate = sum(data.count(byte) * cost for byte, cost in _OBJECT_BYTES.items())
    if estimate > PARSE_FACTOR * len(data) + (64 << 10):
        raise CostlyJSONError(f"would take about {estimate >> 20} MiB of memory to parse ({len(data):,} bytes "
                              "of text, nearly all brackets, braces, quotes and commas), more than such a file does")
    return json.loads(data)


def _read_regular(name: str, limit: int, follow: bool) -> bytearray:
    """The bytes of the regular file ``name``: opened with ``O_NONBLOCK`` so that a FIFO cannot hang (and
    ``O_NOFOLLOW`` unless ``follow``), checked with ``fstat``, read up to ``limit`` bytes (a file's ``st_size`` may
    lie: /proc)."""
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _Unusable(f"is {safefs.kind_of(mode)}, not a JSON file")
        os.set_blocking(fd, True)
        data = bytearray()
        while len(data) <= limit and (chunk := os.read(fd, limit + 1 - len(data))):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > limit:
        raise _Unusable(f"is larger than {limit >> 20} MiB, more than such a file holds")
    return data


def _variable_naming(name: str) -> str | None:
    """The ``TIERKV_*`` variable that gave the path ``name`` (so that a message says what to change), or None."""
    for setting in JSON_SETTINGS:
        variable = settings.SETTINGS[setting].variable
        try:
            if settings.source(setting).startswith(f"{variable}=") and settings.get(setting) == Path(name):
                return variable
        except InvalidConfigError:  # malformed itself: then it did not give this path
            continue
    return None


def output_problem(path: str | os.PathLike[str]) -> tuple[int, str] | None:
    """Why no file can be written at the user's ``path`` (its errno and a phrase: "is a directory", "is a FIFO",
    its folder is missing), or None; checked when the path is given, so that the failure is not found only at the
    write (which checks again: :func:`tierkv.safefs.write_file`)."""
    target = Path(path)
    problem = safefs.replace_problem(None, target)
    if problem is not None:
        return problem
    if not target.parent.is_dir():
        return errno.ENOENT, f"is in {os.fspath(target.parent)!r}, which is not an existing directory"
    refused = creation_problem(target.parent)
    if refused is not None:
        return refused.errno or errno.EACCES, f"cannot be created in {os.fspath(target.parent)!r} ({refused.strerror})"
    longest = longest_name(target.parent)
    if len(os.fsencode(target.name)) > longest:
        return errno.ENAMETOOLONG, f"has a name longer than the {longest} bytes {os.fspath(target.parent)!r} takes"
    return None


def creation_problem(folder: str | os.PathLike[str]) -> OSError | None:
    """Why no file can be created in ``folder`` (one that takes no files, such as ``/proc``, where root passes
    ``os.access``; read-only; not this user's to write), tried with an unnamed temporary file; None if one can."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as exc:
        return exc


def longest_name(folder: str | os.PathLike[str]) -> int:
    """The longest file name, in bytes, that ``folder``'s filesystem takes."""
    return os.pathconf(folder, "PC_NAME_MAX")
