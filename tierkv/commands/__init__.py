"""What every ``tierkv`` subcommand shares: argument types that validate before any work, and one ``--json``.

Argument types turn a bad value into an ``argparse`` error (one line, exit status 2) while the command line
is parsed, so ``--context 0`` fails in milliseconds, not after a model was loaded. ``--json [PATH]`` means
the same in every command: write the result as JSON to ``PATH``, or to stdout when ``PATH`` is ``-`` or
left out (the human-readable output then goes to stderr, so stdout stays valid JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from tierkv import safefs
from tierkv.errors import InvalidConfigError
from tierkv.inputs import creation_problem, longest_name, output_problem
from tierkv.units import (
    MAX_CHUNK_TOKENS,
    format_size_option,
    format_tokens,
    parse_size,
    parse_token_list,
    parse_tokens,
)

STDOUT = "-"


def _typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a parser that raises InvalidConfigError (its message becomes argparse's)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except InvalidConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def tokens(option: str, minimum: int = 1, examples: str | None = None) -> Callable[[str], int]:
    """Type of a token-count option (``32768``, ``1.5K``, ``1M``; see :mod:`tierkv.units`); ``examples``: valid
    values its errors suggest, where context lengths would not fit (a count of new tokens)."""
    return _typed(lambda text: parse_tokens(text, name=option, minimum=minimum, examples=examples))


def chunk_tokens(option: str = "--chunk-tokens") -> Callable[[str], int]:
    """Type of a streaming chunk length: a token count up to :data:`~tierkv.units.MAX_CHUNK_TOKENS`, the bound
    ``cache.streaming(model, chunk_tokens=)`` sets (a chunk's two device buffers hold that many tokens)."""
    return _typed(lambda text: parse_tokens(text, name=option, maximum=MAX_CHUNK_TOKENS,
                                            examples="1024, 4096 or '4K' (4096)"))


def sparse_tokens(option: str) -> Callable[[str], int | float]:
    """Type of a sparse budget, in the forms ``cache.sparse(model, tokens=...)`` takes: a fraction of the context
    in (0, 1] (``0.1``, a float) or a token count (``2048``, ``2K``, an int; a bare ``1`` is one token)."""

    def parse(text: str) -> int | float:
        try:
            fraction = float(text)
        except ValueError:
            fraction = None
        if fraction is not None and 0.0 < fraction <= 1.0 and not text.strip().isdigit():
            return fraction
        try:
            return parse_tokens(text, name=option)
        except InvalidConfigError:
            raise InvalidConfigError(f"{option}={text!r} is neither a token count nor a fraction of the context; "
                                     "give a count (2048, 2K) or a fraction in (0, 1] (0.1).") from None

    return _typed(parse)


def token_list(option: str) -> Callable[[str], list[int]]:
    """Type of a comma-separated list of token counts (``4K,16K,1.5K``)."""
    return _typed(lambda text: parse_token_list(text, name=option))


class Size(int):
    """A size option's bytes that remember the text typed, so an error says ``--cpu-gb 20GiB`` back as typed, not
    as bytes or a rounding of them."""

    typed: str

    def __new__(cls, nbytes: int, typed: str) -> Size:
        value = super().__new__(cls, nbytes)
        value.typed = typed
        return value


def size(option: str) -> Callable[[str], int]:
    """Type of a size option, in bytes (``20`` is GB; ``512MB``, ``20GiB``): a :class:`Size`."""
    return _typed(lambda text: Size(parse_size(text, name=option), text))


def as_typed(nbytes: int) -> str:
    """A size option's value as the user typed it, or (a value the command chose) its shortest spelling."""
    return nbytes.typed if isinstance(nbytes, Size) else format_size_option(nbytes)


def check_fits_machine(option: str, nbytes: int | None, default: str = "", smaller: str = "") -> None:
    """Refuse a ``--gpu-gb`` or ``--cpu-gb`` (``option``) of ``nbytes`` beyond what this machine could ever give, in
    the command's flags and before a model loads: the bound ``TieredCache`` checks when it is built
    (:func:`tierkv.hf.sizing.machine_memory`), whose own message names its Python API. ``default``:
    how the command chose ``nbytes`` when the option was not given; ``smaller``: the options that shrink it."""
    if nbytes is None:
        return
    from tierkv.hf import sizing

    memory, where = sizing.machine_memory()
    if nbytes > memory:
        chosen = "" if isinstance(nbytes, Size) or not default else f" ({default}, the default)"
        fix = f"a smaller {option}" + (f" or {smaller}" if smaller and not isinstance(nbytes, Size) else "")
        raise InvalidConfigError(f"{option} {as_typed(nbytes)}{chosen} does not fit: this machine has {where}; give "
                                 f"{fix}.")


def integer(option: str, minimum: int, maximum: int | None = None, why: str = "") -> Callable[[str], int]:
    """Type of a whole-number option of at least ``minimum`` and, if given, at most ``maximum`` (``why``: what the
    maximum is). ``1e3`` is read as 1000; a fraction, a word or an absurd exponent is refused saying which."""

    def parse(text: str) -> int:
        value = _whole(option, text)
        if value < minimum:
            raise InvalidConfigError(f"{option}={text!r} must be at least {minimum}.")
        if maximum is not None and value > maximum:
            raise InvalidConfigError(f"{option}={text!r} is too large: it must be at most {maximum:,}"
                                     f"{f' ({why})' if why else ''}.")
        return value

    return _typed(parse)


def _whole(option: str, text: str) -> int:
    """``text`` as an int: digits, or a decimal that is whole (``1e3``); else an error saying what is wrong."""
    try:
        value = Decimal(text.strip()) if text.strip().isascii() else Decimal("nan")
    except InvalidOperation:
        value = Decimal("nan")
    if not value.is_finite():
        raise InvalidConfigError(f"{option}={text!r} is not a number; give an integer in digits, e.g. 42.")
    if value.adjusted() > _MAX_DIGITS:  # (int() of 1e999999999 would take the machine's memory)
        raise InvalidConfigError(f"{option}={text!r} is too large; give an integer of at most {_MAX_DIGITS} digits.")
    if value != value.to_integral_value():
        raise InvalidConfigError(f"{option}={text!r} is not a whole number; give an integer, e.g. "
                                 f"{value.to_integral_value(rounding=ROUND_CEILING)}.")
    return int(value)


_MAX_DIGITS = 40
"""Longest integer an option reads (every bounded option's maximum is far below 10**40)."""

SEED_MAX = 2**64 - 1
"""Largest ``--seed``: torch's generators take seeds in [0, 2**64 - 1] (a larger one overflows mid-run)."""


def seed(option: str = "--seed") -> Callable[[str], int]:
    """Type of a ``--seed`` option: an integer in torch's seed range, so demo and eval take the same seeds."""
    return integer(option, 0, SEED_MAX, "the seed range of torch's generators, 2**64 - 1")


def number(option: str, low: float = 0.0, high: float = math.inf, *, above: bool = False) -> Callable[[str], float]:
    """Type of a real-number option in ``[low, high]`` (``above``: ``low`` itself excluded, for a rate or a time
    the command divides by)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise InvalidConfigError(f"{option}={text!r} is not a number.") from None
        if not low <= value <= high or (above and value == low) or not math.isfinite(value):
            bounds = f"{'>' if above else '>='} {low:g}"
            if math.isfinite(high):
                bounds = f"{bounds} and at most {high:,.15g}" if above else f"in [{low:g}, {high:,.15g}]"
            finite = "" if math.isfinite(value) else "finite "
            raise InvalidConfigError(f"{option}={text!r} must be a {finite}number {bounds}.")
        return value

    return _typed(parse)


def fractions(option: str) -> Callable[[str], list[float]]:
    """Type of a comma-separated list of fractions in [0, 1] (``0,0.25,1``)."""
    one = number(option, 0.0, 1.0)

    def parse(text: str) -> list[float]:
        values = [one(part) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"{option}={text!r} has no values; give e.g. 0,0.5,1.")
        return values

    return parse


def _path(option: str, text: str) -> Path:
    """``text`` as a path, refused where it is empty or blank: ``Path("")`` is the current directory, which the
    user never named (an unset shell variable: ``--disk-dir "$DIR"``)."""
    if not text.strip():
        raise InvalidConfigError(f"{option} {text!r} names no path (an unset shell variable?); give one, or leave "
                                 f"{option} out for its default.")
    return Path(text).expanduser()


def named_path(option: str) -> Callable[[str], str]:
    """Type of an option naming a path that the command checks where it reads it: refused here where empty."""

    def parse(text: str) -> str:
        _path(option, text)
        return text

    return _typed(parse)


def existing_file(option: str) -> Callable[[str], Path]:
    """Type of an option naming a file that must exist."""

    def parse(text: str) -> Path:
        path = _path(option, text)
        if not path.exists():
            raise InvalidConfigError(f"{option} {text!r}: file not found.")
        if not path.is_file():
            raise InvalidConfigError(f"{option} {text!r} is not a file.")
        return path

    return _typed(parse)


def writable_dir(option: str) -> Callable[[str], Path]:
    """Type of an option naming a directory to write into (it may not exist yet: its nearest existing parent
    must then be a writable directory), checked while parsing so a typo fails before a model loads."""

    def parse(text: str) -> Path:
        path = _path(option, text)
        if path.is_symlink() and not path.exists():
            raise InvalidConfigError(f"{option} {text!r} is a symbolic link to {os.readlink(path)!r}, which does not "
                                     "exist; give a directory (it is created if missing), or create the link's target.")
        if path.exists() and not path.is_dir():
            raise InvalidConfigError(f"{option} {text!r} is a file; give a directory (it is created if missing).")
        existing = path
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise InvalidConfigError(f"{option} {text!r}: {str(existing)!r} is a file; give a directory.")
        _check_writable(option, text, existing)
        return path

    return _typed(parse)


def _check_writable(option: str, text: str, folder: Path) -> None:
    """Refuse a directory this process cannot write files in: no permission, a read-only filesystem, or one
    that takes no files (``/proc``, ``/sys``: root passes ``os.access`` there). Tried with a temporary file: a
    filesystem that reports no size (ramfs) is still one to write to."""
    stat = os.statvfs(folder)
    if not os.access(folder, os.W_OK | os.X_OK) or stat.f_flag & os.ST_RDONLY or creation_problem(folder) is not None:
        raise InvalidConfigError(f"{option} {text!r}: {str(folder)!r} is not a writable directory; give a "
                                 "directory on a disk you can write to.")


def existing_dir(option: str, what: str) -> Callable[[str], Path]:
    """Type of an option naming a directory that must exist and be writable (it is never created: a typo would
    otherwise make a folder somewhere unexpected); ``what``: what the directory is for, for the message."""

    def parse(text: str) -> Path:
        path = _path(option, text)
        existing = next(folder for folder in (path, *path.parents) if folder.exists())
        if not existing.is_dir():
            raise InvalidConfigError(f"{option} {text!r}: {str(existing)!r} is a file, not a directory; give a "
                                     f"directory ({what}).")
        if existing != path:
            raise InvalidConfigError(f"{option} {text!r}: folder not found; create it, or give an existing "
                                     f"directory ({what}).")
        _check_writable(option, text, path)
        return path

    return _typed(parse)


def checkpoint_folder(option: str) -> Callable[[str], Path]:
    """Type of an option naming a local Hugging Face checkpoint folder (it must hold ``config.json``)."""

    def parse(text: str) -> Path:
        path = _path(option, text)
        if not path.exists():
            raise InvalidConfigError(f"{option} {text!r}: folder not found; give a local checkpoint folder.")
        if not path.is_dir():
            raise InvalidConfigError(f"{option} {text!r} is a file; give the checkpoint's folder.")
        if not (path / "config.json").is_file():
            raise InvalidConfigError(
                f"{option} {text!r} has no config.json; give a folder saved by save_pretrained() (nothing is "
                "downloaded)."
            )
        return path

    return _typed(parse)


def model_or_folder(option: str) -> Callable[[str], str | Path]:
    """Type of an option naming a model of :mod:`tierkv.models` (``smollm2``: a ``str``) or a local
    checkpoint folder (a ``Path``, checked as :func:`checkpoint_folder` does)."""
    folder = checkpoint_folder(option)

    def parse(text: str) -> str | Path:
        from tierkv.models import names

        if text in names():
            return text
        try:
            return folder(text)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{str(exc).rstrip('.')}, or a named model: {', '.join(names())}.") \
                from None

    return parse


def writable_file(option: str, example: str, or_else: str = "") -> Callable[[str], Path]:
    """Type of an option naming a file to write (``example``: a file name to suggest): its folder must exist and
    be writable, checked while parsing so a long run never ends in a file it cannot write; ``or_else`` ends the
    unwritable message with another way out (``--json``: "or - for stdout")."""

    def parse(text: str) -> Path:
        if not text:
            raise InvalidConfigError(f"{option} '' names no file; give a file name such as {example}.")
        path = Path(text).expanduser()
        folder = path.parent
        if not folder.is_dir():
            raise InvalidConfigError(f"{option} {text!r}: folder {str(folder)!r} does not exist; create it or give "
                                     "another path.")
        longest = longest_name(folder)
        if len(os.fsencode(path.name)) > longest:  # (before any stat of it: that raises "File name too long")
            raise InvalidConfigError(f"{option}: the file name {path.name[:40]!r}... is longer than the {longest} "
                                     f"bytes {str(folder)!r} takes; give a shorter one.")
        if path.is_dir():
            raise InvalidConfigError(f"{option} {text!r} is a directory; give a file name such as {example}.")
        if path.exists() and not path.is_file():  # (a link to a file is replaced by the file, never written through)
            raise InvalidConfigError(f"{option} {text!r} is {safefs.kind_of(path.stat().st_mode)}, not a file; give "
                                     f"a file name such as {example}{or_else}.")
        if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)) \
                or creation_problem(folder) is not None:  # (root passes os.access in /proc, where no file can be made)
            raise InvalidConfigError(f"{option} {text!r} is not writable; give a path you can write to{or_else}.")
        problem = output_problem(path)  # another user's entry in a sticky folder (/tmp): no rename replaces it
        if problem is not None:
            raise InvalidConfigError(f"{option} {text!r} {problem[1]}; give a path of your own{or_else}.")
        return path

    return _typed(parse)


_json_file = writable_file("--json", "out.json", ", or - for stdout")


def free_bytes(folder: Path) -> int:
    """Free bytes of the filesystem ``folder`` is (or will be made) on: its nearest existing ancestor's."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def past_trained(context: int, model: str, trained: int, limit: str) -> str:
    """The start of a note for a ``--context`` past the length ``model`` was trained for (``limit``: where that
    length comes from); each command ends it with what that means for its output."""
    return f"--context {format_tokens(context)} is past {model}'s trained {format_tokens(trained)} tokens ({limit})"


def require_model_package(name: str) -> None:
    """Refuse a named model (:mod:`tierkv.models`) whose pip package is not installed, before anything loads: the
    library's own message, with the install command, as a usage error."""
    from tierkv.models import ModelPackageMissingError, spec

    found = spec(name)
    if found.install is None:  # shipped with tierkv (the demo model falls back to a random one without weights)
        return
    try:
        found.locate()
    except ModelPackageMissingError as exc:
        raise InvalidConfigError(f"--model {name}: {exc}") from None


def json_target(text: str) -> str:
    """Type of ``--json``: ``-`` (stdout) or a file :func:`writable_file` accepts."""
    return text if text == STDOUT else str(_json_file(text))


def add_json_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--json [PATH]``: the same flag, with the same meaning, in every command."""
    parser.add_argument("--json", nargs="?", type=json_target, const=STDOUT, default=None, metavar="PATH",
                        help=f"write {what} as JSON to PATH, or to stdout with '-' or no PATH "
                             "(the tables then go to stderr)")


def json_to_stdout(args: argparse.Namespace) -> bool:
    """True when ``--json`` claims stdout, so human-readable output must go to stderr."""
    return getattr(args, "json", None) == STDOUT


def write_json(data: Any, target: str) -> str | None:
    """Write ``data`` to ``target`` (a path, or ``-`` for stdout); returns the path written, None for stdout."""
    text = json.dumps(data, indent=2) + "\n"
    if target == STDOUT:
        if sys.stdout is None:  # started with stdout closed (">&-")
            raise InvalidConfigError("--json -: stdout is closed; give --json a file path.")
        sys.stdout.write(text)
        sys.stdout.flush()
        return None
    safefs.write_file(target, [text.encode()])  # a fresh file renamed into place: never through a planted link
    return target
