"""Budgets and options: size parsing and validation with errors that say how to fix the input."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from tierkv.errors import InvalidConfigError

_UNITS = {
    "": 10**9,  # a bare number is GB, like the `gpu_gb=` keyword that carries it
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(value: float | int | str, *, name: str = "size") -> int:
    """Return a byte count from a number of GB (``20``, ``0.5``) or a string (``"512MB"``, ``"20GiB"``).

    >>> parse_size("512MiB")
    536870912
    >>> parse_size(0.5)
    500000000
    """
    if isinstance(value, bool):
        raise InvalidConfigError(f"{name}={value!r} is a bool; give a number of GB (e.g. 20) or a string like '512MB'.")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise InvalidConfigError(
                f"{name}={value!r} is not a size; write a number with an optional unit, e.g. '512MB', '20GiB' or 1.5 "
                f"(GB). Units: {', '.join(u for u in _UNITS if u)}."
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise InvalidConfigError(
            f"{name} must be a number of GB or a size string like '20GiB', not {type(value).__name__}."
        )
    if number != number or number in (float("inf"), float("-inf")):
        raise InvalidConfigError(f"{name}={value!r} is not finite; give a finite size such as '8GB'.")
    if number < 0:
        raise InvalidConfigError(f"{name}={value!r} is negative; budgets must be >= 0.")
    return int(number * _UNITS[unit])


def env_str(name: str, default: str | None = None) -> str | None:
    """Read a ``TIERKV_*`` environment knob (empty counts as unset)."""
    value = os.environ.get(name, "").strip()
    return value or default


def read_json(path: str | os.PathLike[str], what: str, fix: str) -> Any:
    """Load a user-supplied JSON file; a missing or malformed file is an InvalidConfigError saying ``fix``."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise InvalidConfigError(f"{what} {os.fspath(path)!r} does not exist; {fix}.") from None
    except json.JSONDecodeError as e:
        raise InvalidConfigError(f"{what} {os.fspath(path)!r} is not valid JSON ({e}).") from None
