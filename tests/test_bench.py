"""``tierkv bench --quick`` end to end, and the pieces of ``tierkv.calibrate`` it is built from (no timed
assertions)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from tierkv.bandwidth import LINK_KEYS, MAX_SLOWDOWN, LinkProfile
from tierkv.calibrate import (
    BenchConfig,
    BenchResult,
    Measurement,
    build_profile,
    filesystem_of,
    transfer_sizes,
)
from tierkv.calibrate.kv import compute_device
from tierkv.calibrate.plot import figure, link_label
from tierkv.cli import main
from tierkv.errors import InvalidConfigError

KiB, MiB = 1 << 10, 1 << 20


def test_quick_bench_writes_a_loadable_profile_and_a_png(tmp_path: Path, capsys) -> None:
    profile_path, plot_path = tmp_path / "profile.json", tmp_path / "bench.png"
    status = main(["bench", "--quick", "--dir", str(tmp_path / "disk"), "--profile-out", str(profile_path),
                   "--plot-out", str(plot_path)])  # fmt: skip
    assert status == 0
    printed = capsys.readouterr().out
    for heading in ("CPU", "RAM", "GPU", "Memory links", "Disk read", "Disk write", "raw O_DIRECT"):
        assert heading in printed
    profile = LinkProfile.load(profile_path)
    assert {"host->host", "disk->host", "host->disk"} <= set(profile.links) <= set(LINK_KEYS)
    for link in profile.links.values():
        assert math.isfinite(link.bandwidth_bytes_per_s) and link.bandwidth_bytes_per_s > 0
    for key in ("cpu", "cores", "ram", "gpu", "filesystem", "date", "disk_engine"):
        assert profile.machine[key]
    assert profile.serial_mover  # this CPU-only host: one mover thread
    assert all(1.0 <= factor <= MAX_SLOWDOWN for factor in dataclasses.astuple(profile.contention))
    assert 0 < profile.layer_overhead_s < 0.1  # the executor's bookkeeping: microseconds to a millisecond
    caption = " ".join(printed.split())  # the table caption wraps
    assert "compute slows" in caption and "beside disk reads" in caption and "own work per layer" in caption
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "disk").iterdir())  # the test files (links, contention) are removed


def test_bench_rejects_unknown_engine(tmp_path: Path, capsys) -> None:
    assert main(["bench", "--quick", "--dir", str(tmp_path), "--engines", "uring"]) == 2
    assert "unknown disk engine 'uring'" in capsys.readouterr().err


@pytest.mark.parametrize("below", ["", "sub"])
def test_bench_dir_that_is_a_file_is_one_line(tmp_path: Path, capsys, below: str) -> None:
    """``--dir /etc/passwd`` (or a folder under a file): a one-line usage error, not a FileExistsError."""
    a_file = tmp_path / "passwd"
    a_file.write_text("root\n")
    assert main(["bench", "--quick", "--dir", str(a_file / below)]) == 2
    err = capsys.readouterr().err
    assert "not a directory" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(InvalidConfigError, match="is a file, not a directory"):
        BenchConfig(a_file)


def test_bench_runtime_failure_is_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr("tierkv.commands.bench.run_bench", fail)
    assert main(["bench", "--quick", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Permission denied" in err and "Traceback" not in err


def test_transfer_sizes() -> None:
    assert transfer_sizes(4 * KiB, 1 << 30)[:3] == [4 * KiB, 16 * KiB, 64 * KiB]
    assert transfer_sizes(4 * KiB, 1 << 30)[-1] == 1 << 30
    assert transfer_sizes(4 * KiB, 4 * KiB) == [4 * KiB]


def test_config_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="min_size"):
        BenchConfig(tmp_path, min_size=MiB, max_size=4 * KiB)
    with pytest.raises(ValueError, match="disk size"):
        BenchConfig(tmp_path, disk_bytes=5000)
    assert BenchConfig.quick(tmp_path, repeats=1).repeats == 1


def test_profile_is_fitted_from_the_runtime_series() -> None:
    """disk links come from the chosen engine; an unfittable series is reported, not guessed."""
    rows = [
        Measurement("disk->host", "posix", s, 4 * s, 4, 4 * (50e-6 + s / 2e9))
        for s in (64 * KiB, MiB, 4 * MiB)
    ] + [Measurement("disk->host", "raw O_DIRECT", s, s, 1, s / 9e9) for s in (64 * KiB, MiB)]
    rows += [Measurement("host->host", "memcpy", MiB, MiB, 1, 1e-4)]
    profile, notes = build_profile(rows, {"cpu": "test"}, "posix")
    link = profile.link("disk->host")
    assert link.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert link.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert profile.machine["disk_engine"] == "posix"
    assert "host->host" not in profile.links and any("host->host" in n for n in notes)



def test_filesystem_of_names_the_mount(tmp_path: Path) -> None:
    assert "(" in filesystem_of(tmp_path)


def test_plot_names_tiers_as_on_this_host_on_log_axes() -> None:
    """A CPU-only host has no "device" memory of its own: lines say CPU memory (device tier)."""
    rows = [Measurement("host->device", "store read_into", s, s, 1, s / 5e9) for s in (64 * KiB, MiB)]
    rows += [Measurement("device->device", "gather per-block copy_", s, s, 16, s / 1e8) for s in (64 * KiB, MiB)]
    rows += [Measurement("disk->host", "posix", s, s, 1, s / 1e9) for s in (64 * KiB, MiB)]
    result = BenchResult(rows, LinkProfile({}), {"cpu": "test", "cores": "2", "gpu": "none", "filesystem": "ext4",
                                                 "date": "today"})  # fmt: skip
    fig = figure(result)
    labels = [text.get_text() for ax in fig.axes if ax.get_legend() for text in ax.get_legend().get_texts()]
    assert "CPU memory (host tier) -> CPU memory (device tier): store read_into" in labels
    assert "within CPU memory (device tier): gather per-block copy_" in labels
    panels = [ax for ax in fig.axes if ax.lines]
    assert len(panels) == 2 and all(ax.get_yscale() == "log" and ax.get_xscale() == "log" for ax in panels)
    pinned = link_label("host->device", "pinned", gpu=True)
    assert pinned == "CPU memory (host tier) -> GPU memory (device tier): pinned"


def test_compute_device_is_indexed() -> None:
    """The bench's device tier compares equal to the device its tensors report (``cuda:0``, not ``cuda``)."""
    device = compute_device()
    assert torch.empty(1, device=device).device == device
    assert device.type == "cpu" or device.index is not None
