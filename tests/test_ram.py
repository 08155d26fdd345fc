"""The RAM a process may use is its cgroup's limit where that is below the host's (a container's): budgets left
out are shares of it, and budgets beyond it are refused, instead of the kernel killing the process mid-generation.
Checked in a real cgroup (v1 or v2, where this host lets the tests make one) and on cgroup files of both kinds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from tierkv import InvalidConfigError, TieredCache
from tierkv.hf.sizing import host_memory
from tierkv.ram import UNLIMITED, Limit, cgroup_limit, memory_filesystem

GiB = 1 << 30


def _write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_a_v2_limit_is_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    _write(tmp_path, {"cgroup.controllers": "cpu memory\n", "memory.max": "max\n"})
    _write(tmp_path / "user", {"memory.max": str(3 * GiB)})
    _write(tmp_path / "user" / "app", {"memory.max": "max\n", "memory.current": str(GiB),
                                       "memory.stat": f"anon 1\ninactive_file {GiB // 4}\n"})
    found = cgroup_limit(tmp_path, "0::/user/app\n")
    assert found == Limit(3 * GiB, 3 * GiB - (GiB - GiB // 4))


def test_a_v1_limit_counts_the_memory_controllers_line(tmp_path):
    _write(tmp_path / "memory", {"memory.limit_in_bytes": str(UNLIMITED + 4096)})
    _write(tmp_path / "memory" / "job", {"memory.limit_in_bytes": str(2 * GiB), "memory.usage_in_bytes": str(GiB),
                                         "memory.stat": "total_inactive_file 0\n"})
    assert cgroup_limit(tmp_path, "5:cpu,cpuacct:/job\n4:memory:/job\n0::/\n") == Limit(2 * GiB, GiB)


def test_inside_a_container_the_mounts_root_is_the_cgroup(tmp_path):
    """A container sees the host's path of its cgroup, which its own cgroup mount does not have."""
    _write(tmp_path, {"cgroup.controllers": "memory\n", "memory.max": str(GiB), "memory.current": "0"})
    assert cgroup_limit(tmp_path, "0::/docker/0123abcd\n") == Limit(GiB, GiB)


@pytest.mark.parametrize("membership", ["", "0::/\n", "4:memory:/\n", "garbage\n"])
def test_no_limit_is_none(tmp_path, membership):
    _write(tmp_path, {"cgroup.controllers": "memory\n", "memory.max": "max\n"})
    _write(tmp_path / "memory", {"memory.limit_in_bytes": str(UNLIMITED)})
    assert cgroup_limit(tmp_path, membership) is None


def _limited_cgroup(limit: int) -> Path | None:
    """A real cgroup with a memory limit of ``limit`` bytes (v1 memory controller, or v2), or None where this host
    does not let the tests make one (not root, a read-only cgroup mount)."""
    name = f"tierkv-test-{uuid.uuid4().hex[:8]}"
    for folder, limit_file in ((Path("/sys/fs/cgroup/memory") / name, "memory.limit_in_bytes"),
                               (Path("/sys/fs/cgroup") / name, "memory.max")):
        try:
            folder.mkdir()
        except OSError:
            continue
        try:
            (folder / limit_file).write_text(str(limit))
            return folder
        except OSError:
            folder.rmdir()
    return None


@pytest.fixture
def cgroup():
    limit = min(2 * GiB, psutil.virtual_memory().total // 2)
    folder = _limited_cgroup(limit)
    if folder is None:
        pytest.skip("this host does not let the tests make a cgroup with a memory limit (needs root)")
    yield folder, limit
    os.rmdir(folder)


def test_a_process_in_a_limited_cgroup_sizes_and_refuses_budgets_by_its_limit(cgroup):
    folder, limit = cgroup
    script = textwrap.dedent(f"""
        import os, sys
        with open({str(folder / "cgroup.procs")!r}, "w") as procs:
            procs.write(str(os.getpid()))
        from tierkv import InvalidConfigError, TieredCache
        from tierkv.hf import sizing
        total, available = sizing.host_memory()
        assert total == {limit} and 0 < available <= {limit}, (total, available)
        try:
            TieredCache(cpu_gb={limit} * 1.5 / 1e9)
        except InvalidConfigError as error:
            print("refused:", error)
        cache = TieredCache(config=None)
        gpu, cpu = cache.runtime.memory_budgets(__import__("torch").device("cpu"))
        assert gpu + cpu <= 0.55 * available, (gpu, cpu, available)  # half of it: the rest is the model's
        print("budgets within the limit:", gpu, cpu)
        try:
            TieredCache(gpu_gb="64MB", cpu_gb="64MB", disk_dir="/dev/shm/tierkv-cgroup-test")
        except InvalidConfigError as error:
            print("tmpfs refused:", error)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "refused: cpu_gb is" in done.stdout and "memory limit of this process's cgroup" in done.stdout
    assert "budgets within the limit" in done.stdout
    if memory_filesystem("/dev/shm") and shutil.disk_usage("/dev/shm").free > limit:  # its default disk_gb: RAM
        assert "tmpfs refused: gpu_gb (" in done.stdout and "disk_gb defaults to 90% of it" in done.stdout


def test_budgets_that_together_exceed_the_ram_are_refused_where_the_device_is_ram():
    if torch.cuda.is_available():
        pytest.skip("with a GPU the device tier is not RAM")
    total = host_memory()[0]
    with pytest.raises(InvalidConfigError, match="gpu_gb .* and cpu_gb .* together take .*device tier is RAM too"):
        TieredCache(gpu_gb=f"{total * 6 // 10}B", cpu_gb=f"{total * 6 // 10}B")
    TieredCache(gpu_gb=f"{total * 4 // 10}B", cpu_gb=f"{total * 4 // 10}B").close()


def test_a_disk_tier_on_tmpfs_counts_as_ram(tmp_path):
    if memory_filesystem("/dev/shm") is None:
        pytest.skip("no tmpfs at /dev/shm")
    assert memory_filesystem(tmp_path) is None or memory_filesystem(tmp_path) in ("tmpfs", "ramfs")
    total = host_memory()[0]
    free = shutil.disk_usage("/dev/shm").free
    folder = Path("/dev/shm") / f"tierkv-test-{uuid.uuid4().hex[:8]}"
    disk = min(free, total) * 7 // 10
    try:
        with pytest.raises(InvalidConfigError, match="disk_dir is on tmpfs, whose files are RAM"):
            TieredCache(gpu_gb="64MB", cpu_gb=f"{total // 2}B", disk_dir=folder, disk_gb=f"{disk}B")
        TieredCache(gpu_gb="64MB", cpu_gb="64MB", disk_dir=folder, disk_gb=f"{disk}B").close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_host_memory_that_is_not_there_is_a_capacity_error_and_every_token_stays():
    """Budgets are caps; where the process cannot get the memory they allow (a ulimit -v here), growing a tier is
    refused with the fix, the step taken back, and what the cache held stays readable."""
    script = textwrap.dedent("""
        import resource, torch
        from tierkv import CapacityError, TieredCache
        cache = TieredCache(gpu_gb="4GB", cpu_gb="4GB", block_tokens=16)
        step = torch.ones(1, 8, 256, 128)
        for _ in range(4):
            cache.update(step, step, 0)
        held = cache.get_seq_length()
        size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.RLIM_INFINITY))
        try:
            for _ in range(200):
                cache.update(step, step, 0)
        except CapacityError as error:
            print("refused:", error)
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        after = cache.get_seq_length()
        assert after >= held and torch.equal(cache.layers[0].keys[:, :, :after], torch.ones(1, 8, after, 128))
        print("held", after)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused:" in done.stdout and "could not allocate" in done.stdout, done.stdout
    assert "the memory is not there" in done.stdout
