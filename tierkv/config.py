"""Budgets and options: validation with errors that say how to fix the input.

Sizes and token counts are parsed by :mod:`tierkv.units` (``parse_size`` is re-exported here, where the
callers of older versions import it). The checks below run when a ``TieredCache`` is built, so a mistake is
reported at construction, not at the first ``generate``.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from tierkv.errors import InvalidConfigError
from tierkv.units import format_bytes, parse_size

__all__ = ["check_budgets_fit_machine", "check_count", "check_disk_engine", "check_model_config", "env_str",
           "parse_size", "read_json"]


def check_model_config(config: object, *, name: str = "config") -> None:
    """Refuse anything but a transformers config, naming the usual slip (the model instead of ``model.config``).

    Checked when the cache is built, so the mistake is not an ``AttributeError`` from deep inside the first
    ``generate``.
    """
    from transformers import PreTrainedConfig

    if isinstance(config, PreTrainedConfig):
        return
    if isinstance(getattr(config, "config", None), PreTrainedConfig):
        raise InvalidConfigError(
            f"{name}= got a {type(config).__name__} (a model); pass its config: {name}=model.config."
        )
    raise InvalidConfigError(
        f"{name}= must be a transformers PreTrainedConfig (e.g. model.config or AutoConfig.from_pretrained(path)), "
        f"not {type(config).__name__}."
    )


def check_disk_engine(engine: str | None) -> None:
    """Refuse an unknown or unloadable forced disk engine (``engine=`` or ``TIERKV_DISK_ENGINE``) up front.

    Without this a typo such as ``"io_uring"`` would only fail at the first write to the disk tier, mid-prefill.
    """
    from tierkv import settings
    from tierkv.io.base import EngineUnavailableError
    from tierkv.io.select import ENGINES, load_engine

    if engine is None:
        name, source = settings.get("disk_engine"), settings.source("disk_engine")
    elif isinstance(engine, str) and engine in ("auto", *ENGINES):
        name, source = engine, f"disk_engine={engine!r}"
    else:
        raise InvalidConfigError(
            f"disk_engine={engine!r} is not a disk engine; choose one of {', '.join(ENGINES)}, or 'auto' (None)."
        )
    if name == "auto":
        return
    try:
        load_engine(name)
    except EngineUnavailableError as exc:
        raise InvalidConfigError(
            f"disk engine {name!r} ({source}) cannot load here: {exc.reason}; use disk_engine='auto' to pick one "
            "that does."
        ) from exc


def _machine_memory() -> tuple[int, str]:
    """The largest memory one tier could use here, and how to say it: RAM, or the largest GPU if bigger."""
    import psutil
    import torch

    ram = psutil.virtual_memory().total
    where = f"{format_bytes(ram)} of RAM"
    if torch.cuda.is_available():
        gpu = max(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        where += f" and a {format_bytes(gpu)} GPU"
        return max(ram, gpu), where
    return ram, where + " and no GPU"


def _disk_usage(directory: str | os.PathLike[str]) -> tuple[int, int]:
    """(total, free) bytes of the filesystem that holds ``directory`` (or its nearest existing parent)."""
    path = os.path.abspath(os.fspath(directory))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    usage = shutil.disk_usage(path)
    return usage.total, usage.free


def check_budgets_fit_machine(gpu: int | None, cpu: int | None, disk: int | None,
                              disk_dir: str | os.PathLike[str] | None) -> None:
    """Refuse a budget larger than this machine could ever provide (bytes; None = not given), and a disk budget
    larger than the free space under ``disk_dir`` (it would end in ENOSPC mid-generation).

    The usual cause is a byte count passed where GB are expected (``gpu_gb=TieredCache.min_device_bytes(...)``
    is a petabyte budget); the message says how to pass bytes.
    """
    budgets = {"gpu_gb": gpu, "cpu_gb": cpu}
    if any(v is not None for v in budgets.values()):
        memory, where = _machine_memory()
        for name, nbytes in budgets.items():
            if nbytes is not None and nbytes > memory:
                raise InvalidConfigError(
                    f"{name} is {format_bytes(nbytes)} but this machine has {where}; a bare number counts GB, so "
                    f"pass a byte count as a string (e.g. {name}=f\"{{n}}B\") or give a size that fits."
                )
    if disk is not None and disk_dir is not None:
        total, free = _disk_usage(disk_dir)
        if disk > total:
            raise InvalidConfigError(
                f"disk_gb is {format_bytes(disk)} but the filesystem under {os.fspath(disk_dir)!r} holds "
                f"{format_bytes(total)}; give a size that fits, or leave disk_gb unset (90% of its free space)."
            )
        if disk > free:  # it would run out of space mid-generation (ENOSPC), long after this call
            raise InvalidConfigError(
                f"disk_gb is {format_bytes(disk)} but only {format_bytes(free)} are free on the filesystem "
                f"under {os.fspath(disk_dir)!r} (of {format_bytes(total)}); free some space, give a smaller "
                "disk_gb, or leave it unset (90% of the free space)."
            )


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


def check_count(value: object, *, name: str, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum`` (a bool or a float is refused: ``batch=True`` is a slip, not 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidConfigError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return value
