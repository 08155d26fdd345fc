"""User-supplied inputs outside the API: JSON files (link profiles, model presets) and ``TIERKV_*`` text knobs."""

from __future__ import annotations

import json
import os
from typing import Any

from tierkv.errors import InvalidConfigError


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
