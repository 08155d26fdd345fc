"""The names tierkv's layers share: data links and attention executors, each spelled once.

The runtime counts bytes per :class:`LinkName` (``stats()["bytes_moved"]``), the bandwidth model prices them
(:mod:`tierkv.bandwidth`), the planner predicts them and the CLI prints them; executors are registered under
their :class:`ExecutorName` and chosen on the command line by the shorter :data:`CLI_EXECUTORS` spellings.
Members are ``str`` subclasses, so they work wherever the plain strings did (dict keys, JSON, comparisons) and
format as their value (``f"{LinkName.HOST_TO_DEVICE}"`` is ``host->device``).
"""

from __future__ import annotations

import enum


class _Name(str, enum.Enum):
    """A ``str`` enum that formats as its value in every Python version (3.11 changed ``format()``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, format_spec: str) -> str:
        return format(str(self.value), format_spec)


class LinkName(_Name):
    """A direction data moves in. ``device->device`` is the gather of device-resident blocks into staging;
    ``disk->device`` a batched engine read through a host bounce buffer; ``host->host`` a memcpy (bench)."""

    DEVICE_TO_DEVICE = "device->device"
    HOST_TO_DEVICE = "host->device"
    DISK_TO_DEVICE = "disk->device"
    DEVICE_TO_HOST = "device->host"
    HOST_TO_DISK = "host->disk"
    DEVICE_TO_DISK = "device->disk"
    DISK_TO_HOST = "disk->host"
    HOST_TO_HOST = "host->host"


READ_LINKS: tuple[LinkName, ...] = (LinkName.DEVICE_TO_DEVICE, LinkName.HOST_TO_DEVICE, LinkName.DISK_TO_DEVICE)
"""The links an attention read uses, one per source tier (``stats()["steps"]`` and the trace name them)."""

PROFILE_LINKS: tuple[LinkName, ...] = (LinkName.HOST_TO_DEVICE, LinkName.DEVICE_TO_HOST, LinkName.DISK_TO_HOST,
                                       LinkName.HOST_TO_DISK, LinkName.DEVICE_TO_DEVICE, LinkName.HOST_TO_HOST)
"""The links a :class:`~tierkv.bandwidth.LinkProfile` prices (``tierkv bench`` measures them)."""


class ExecutorName(_Name):
    """An attention executor, as registered (``tierkv.attention``) and recorded in results."""

    EXACT_GATHER = "exact_gather"
    STREAMING = "streaming"
    SPARSE = "sparse"
    SPLIT = "split"  # each tier's share attended where it lives (tierkv plan prices it, tierkv demo runs it)


CLI_EXECUTORS: dict[str, ExecutorName] = {"gather": ExecutorName.EXACT_GATHER, "streaming": ExecutorName.STREAMING,
                                          "sparse": ExecutorName.SPARSE}
"""Short ``--executor`` spellings -> executor: ``tierkv demo`` offers these and ``split``, ``tierkv eval`` these
but ``sparse``."""

PLAN_EXECUTORS: dict[str, ExecutorName] = {**CLI_EXECUTORS, "split": ExecutorName.SPLIT}
"""``tierkv plan --executor`` spellings (the planner's ``executor=``): :data:`CLI_EXECUTORS` and ``split``."""


def executor_name(text: str) -> ExecutorName:
    """The executor a CLI spelling (``gather``) or a registered name (``exact_gather``) means."""
    if text in PLAN_EXECUTORS:
        return PLAN_EXECUTORS[text]
    return ExecutorName(text)
