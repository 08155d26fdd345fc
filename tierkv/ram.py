"""The RAM this process may use: the host's (psutil), bounded by its cgroup's memory limit.

A container (Docker ``--memory``, a Kubernetes limit) or a systemd unit (``MemoryMax=``) caps a process's memory
below the host's, and psutil reports the host's: budgets sized from it (``cpu_gb`` left out) or checked against
it would pass, and the kernel's OOM killer would end the process mid-generation with no message. The limit is
the tightest of the process's cgroup and its ancestors' (cgroup v2 ``memory.max``, v1
``memory.limit_in_bytes``); what is available under it is the limit less the memory charged to the cgroup, of
which inactive file pages count as free (the kernel reclaims them before it kills anything). A disk tier on a
memory filesystem (tmpfs, ramfs) is RAM as well.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a number near 2**63


class Limit(NamedTuple):
    """A cgroup's memory limit and what it may still take (bytes)."""

    limit: int
    available: int


def cgroup_limit(root: Path = CGROUP_ROOT, membership: str | None = None) -> Limit | None:
    """This process's cgroup memory limit (``membership``: the text of ``/proc/self/cgroup``), or None where it has
    none or none can be read (no cgroup filesystem, a host without the memory controller)."""
    if membership is None:
        try:
            membership = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    for line in membership.splitlines():
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and not controllers and (root / "cgroup.controllers").exists():
            return _limit(root, path, "memory.max", "memory.current", "inactive_file")
        if "memory" in controllers.split(","):
            return _limit(root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                          "total_inactive_file")
    return None


def _limit(mount: Path, path: str, limit_file: str, usage_file: str, inactive_key: str) -> Limit | None:
    """The tightest limit from the cgroup at ``path`` under ``mount`` up to the mount's root (inside a container the
    mount's root is the container's own cgroup, and the host's path for it does not exist there)."""
    folders = [mount / path.strip("/")] if path.strip("/") else []
    folders += [folder for folder in (folders[0].parents if folders else ()) if folder.is_relative_to(mount)]
    folders = [folder for folder in dict.fromkeys([*folders, mount]) if folder.is_dir()]
    limits = [value for folder in folders if (value := _number(folder / limit_file)) is not None and value < UNLIMITED]
    if not limits or not folders:
        return None
    leaf = folders[0]
    usage = _number(leaf / usage_file) or 0
    inactive = _stat(leaf / "memory.stat", inactive_key)
    limit = min(limits)
    return Limit(limit, max(0, limit - max(0, usage - inactive)))


def _number(path: Path) -> int | None:
    """The integer a cgroup file holds (None: unreadable, or ``max``: no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    """One counter of a cgroup's ``memory.stat`` (0 where it is not there)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def memory_filesystem(path: str | os.PathLike[str]) -> str | None:
    """The type of the filesystem under ``path`` (or its nearest existing parent) where its files are RAM (tmpfs,
    ramfs: ``/dev/shm``, a container's ``--tmpfs`` or memory-backed emptyDir), else None."""
    import psutil

    real = os.path.realpath(path)
    try:
        mounts = psutil.disk_partitions(all=True)
    except OSError:
        return None
    under = [mount for mount in mounts
             if real == mount.mountpoint or real.startswith(mount.mountpoint.rstrip("/") + "/")]
    best = max(under, key=lambda mount: len(mount.mountpoint), default=None)
    return best.fstype if best is not None and best.fstype in MEMORY_FILESYSTEMS else None


def usable_memory() -> tuple[int, int, bool]:
    """``(total, available, limited)``: the host's RAM and what is available now (psutil), each bounded by this
    process's cgroup limit where it has one (``limited``: the limit is the smaller). OSError where the host's
    memory cannot be read (a process out of file descriptors cannot open /proc/meminfo)."""
    import psutil

    memory = psutil.virtual_memory()
    total, available = memory.total, memory.available
    cgroup = cgroup_limit() if os.name == "posix" else None
    if cgroup is None or cgroup.limit >= total:
        return total, available, False
    return cgroup.limit, min(available, cgroup.available), True
