"""The machine a calibration ran on: what a reader needs to judge its numbers."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

import psutil
import torch

from tierkv.calibrate.config import GiB


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def filesystem_of(directory: Path) -> str:
    """``"ext4 on /dev/vda (/)"``: the mount that holds ``directory`` (longest mount-point prefix)."""
    target = os.path.realpath(directory)
    best = None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and (
            best is None or len(mount) > len(best.mountpoint)
        ):
            best = part
    return "unknown" if best is None else f"{best.fstype} on {best.device} ({best.mountpoint})"


def machine_description(directory: Path) -> dict[str, str]:
    """CPU, cores, RAM, GPU, the disk's filesystem, the load and the date; on a CPU-only host, what the
    profile's "device" links then are (there is no PCIe)."""
    cuda = torch.cuda.is_available()
    machine = {
        "cpu": _cpu_model(),
        "cores": f"{os.cpu_count()} logical ({torch.get_num_threads()} torch threads)",
        "ram": f"{psutil.virtual_memory().total / GiB:.1f} GiB",
        "gpu": torch.cuda.get_device_name(0) if cuda else "none",
        "disk_dir": str(directory),
        "filesystem": filesystem_of(directory),
        "kernel": platform.release(),
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),  # other work on the host skews every timing
        "torch": torch.__version__,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    if not cuda:
        machine["host->device"] = (
            "CPU-only host: the store's copy from the host tier into staging in CPU memory; no PCIe"
        )
        machine["device->host"] = "CPU-only host: memcpy from the device tier into the host tier; no PCIe"
        machine["device->device"] = "the store's block gather within CPU memory (read_into the staging tensor)"
    return machine
