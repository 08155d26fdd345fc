"""``tierkv bench --quick`` end to end, and the pieces of ``tierkv.calibrate`` it is built from (no timed
assertions)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
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
from tierkv.planner import WARNINGS_KEY

KiB, MiB = 1 << 10, 1 << 20


def test_quick_bench_writes_a_loadable_profile_and_a_png(tmp_path: Path, capsys) -> None:
    profile_path, plot_path = tmp_path / "profile.json", tmp_path / "bench"  # no suffix: still exactly there
    (tmp_path / "disk").mkdir()  # --dir must exist (a typo never creates a folder)
    status = main(["bench", "--quick", "--dir", str(tmp_path / "disk"), "--profile-out", str(profile_path),
                   "--plot-out", str(plot_path)])  # fmt: skip
    assert status == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "numbers indicative only" in captured.err  # --quick says so in its output, not only in the docs
    assert "measuring the store's own gather" in captured.err  # the gather phases are named one by one
    assert "measuring disk: reads and writes of 4.00 KiB to 4.00 MiB" in captured.err  # a minute or more in full
    assert re.search(r"\ndisk: reads and writes of 4.00 KiB to 4.00 MiB: \d+\.\d s \(\d+ points\)\n", captured.err)
    assert "writing the 32.00 MiB test file" in captured.err  # 20 s at the full size were silent
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
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot -> {plot_path}" in caption
    assert "--quick" in profile.machine[WARNINGS_KEY]  # plan --profile repeats it: a smoke test, not a profile
    assert not list((tmp_path / "disk").iterdir())  # the test files (links, contention) are removed
    assert profile.host_attention is not None and profile.host_attention.bandwidth_bytes_per_s > 0
    assert "Host attention kernel" in printed and "host attention" in printed


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
    assert "--dir" in err and "is a file" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(InvalidConfigError, match="is a file, not a directory"):
        BenchConfig(a_file)


def test_bench_runtime_failure_is_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr("tierkv.commands.bench_run.run_bench", fail)
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


def _fake_result(tmp_path: Path) -> BenchResult:
    """A bench result without measuring: two measurements and the preset profile (``run_bench`` replaced)."""
    measurements = [Measurement("host->host", "memcpy", MiB, MiB, 1, 1e-4),
                    Measurement("disk->host", "raw O_DIRECT", MiB, MiB, 1, 1e-3)]
    machine = {key: "x" for key in ("date", "cpu", "cores", "ram", "gpu", "filesystem", "kernel", "torch",
                                    "load_average")} | {"disk_dir": str(tmp_path)}
    return BenchResult(measurements, LinkProfile.from_presets(), machine)


@pytest.mark.parametrize("target", ["-", "FILE"])
def test_bench_json_writes_every_measurement_and_the_profile(tmp_path: Path, capsys, monkeypatch, target) -> None:
    """``tierkv bench --json``: the README promises ``--json`` on every command (bench refused it)."""
    from tierkv.planner import COMPUTE_FLOPS_KEY

    monkeypatch.setattr("tierkv.commands.bench_run.run_bench", lambda cfg, progress: _fake_result(tmp_path))
    path = tmp_path / "bench.json"
    argv = ["bench", "--quick", "--dir", str(tmp_path), "--profile-out", str(tmp_path / "p.json"),
            "--plot-out", str(tmp_path / "p.png"), "--json", str(path) if target == "FILE" else "-"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    data = json.loads(path.read_text() if target == "FILE" else captured.out)
    assert [m["method"] for m in data["measurements"]] == ["memcpy", "raw O_DIRECT"]
    assert data["measurements"][0]["gbps"] == pytest.approx(MiB / 1e-4 / 1e9)
    assert "host->device" in data["profile"]["links"] and data["machine"]["cpu"] == "x"
    assert float(LinkProfile.load(tmp_path / "p.json").machine[COMPUTE_FLOPS_KEY]) > 1e8  # plan --device cpu's


def test_host_attention_is_measured_on_one_thread_and_all_and_fitted(tmp_path: Path) -> None:
    """The kernel over 1/64, 1/16 and 1/4 of a 16 MiB slab of fp16 K/V (blocks of 16 tokens of Llama-3-8B's 8 KV
    heads): one series per thread count, and the fitted rates in the profile's units (bytes of K/V per second)."""
    from tierkv.attention import host_kernel
    from tierkv.bandwidth import HostAttention
    from tierkv.calibrate.attention import ATTENTION, attention_sizes, measure_host_attention, method

    cfg = BenchConfig.quick(tmp_path, gather_pool_bytes=16 * MiB, repeats=3, warmup=1)
    assert attention_sizes(cfg) == [256 * KiB, MiB, 4 * MiB]
    rows, fitted = measure_host_attention(cfg)
    threads = torch.get_num_threads()
    assert {(m.link, m.method) for m in rows} == {(ATTENTION, method(1)), (ATTENTION, method(threads))}
    assert sorted(m.size for m in rows if m.method == method(1)) == [256 * KiB, MiB, 4 * MiB]
    assert all(m.nbytes == m.size and m.seconds > 0 for m in rows)
    assert isinstance(fitted, HostAttention), fitted
    assert fitted.threads == threads and fitted.bandwidth_bytes_per_s > 0 and fitted.single_thread_bytes_per_s > 0
    assert fitted.kernel == ("native" if host_kernel.available() else "torch")
    assert method(1) == "paged, 1 thread" and method(4) == "paged, 4 threads"
    too_small = BenchConfig.quick(tmp_path, gather_pool_bytes=256 * KiB)  # 4 blocks: 1/64 and 1/16 are no block
    assert attention_sizes(too_small) == [64 * KiB]
    assert measure_host_attention(too_small) == ([], "host attention: the gather pool holds too few blocks for 2 "
                                                     "sizes (give a larger pool)")


def test_bench_prints_and_saves_the_host_attention_rate(tmp_path: Path, capsys, monkeypatch) -> None:
    from tierkv.bandwidth import HostAttention

    def measured(cfg, progress):
        result = _fake_result(tmp_path)
        result.profile.host_attention = HostAttention(21e9, 7e9, 8, "native")
        result.measurements.append(Measurement("host attention", "paged, 1 thread", MiB, MiB, 1, 1e-4))
        return result

    monkeypatch.setattr("tierkv.commands.bench_run.run_bench", measured)
    path = tmp_path / "bench.json"
    argv = ["bench", "--quick", "--dir", str(tmp_path), "--profile-out", str(tmp_path / "p.json"),
            "--plot-out", str(tmp_path / "p.png"), "--json", str(path)]
    assert main(argv) == 0
    words = " ".join(capsys.readouterr().out.replace("│", " ").replace("┃", " ").split())
    assert "host attention (native kernel, K/V attended in place) 21.00 (8 threads)" in words
    assert "host attention, 1 thread 7.00" in words and "memcpy 20.00 GB/s" in words
    assert "attended in place (one decode query, 32 heads)" in words and "K/V paged, 1 thread" in words
    assert "1.00 MiB 10.49" in words
    assert LinkProfile.load(tmp_path / "p.json").host_attention == HostAttention(21e9, 7e9, 8, "native")
    assert json.loads(path.read_text())["profile"]["host_attention"]["bandwidth_bytes_per_s"] == 21e9


# ------------------------------------------------------------------------------------------ newcomer sweep
UNWRITABLE = "/proc/self"  # a folder no one, root included, can create files or folders in


@pytest.fixture
def no_measuring(monkeypatch):
    """A bench that starts measuring fails the test: these errors must come before it."""
    monkeypatch.setattr("tierkv.commands.bench_run.run_bench", lambda *a, **k: pytest.fail("measuring started"))


@pytest.mark.parametrize(("argv", "needles"), [
    (["--min-size", "8MiB", "--max-size", "4MiB"], ["--min-size (8.00 MiB) is larger than --max-size (4.00 MiB)"]),
    (["--min-size", "8MiB"], ["--max-size (4.00 MiB, the default with --quick)", "raise --max-size"]),
    (["--min-size", "1KiB"], ["--min-size 1KiB is 1.00 KiB; give a multiple of 4KiB"]),
    (["--max-size", "0"], ["--max-size 0 is 0 B; give at least 4KiB"]),
    (["--disk-size", "0"], ["--disk-size 0 is 0 B; give a multiple of 4KiB"]),
    (["--disk-size", "1KiB"], ["--disk-size 1KiB is 1.00 KiB"]),
    (["--disk-size", "8MiB", "--min-size", "16MiB", "--max-size", "16MiB"],
     ["--min-size (16.00 MiB) is larger than --disk-size (8.00 MiB)", "raise --disk-size"]),
    (["--block-size", "0"], ["--block-size 0 is 0 B; give a multiple of 4KiB"]),
    (["--block-size", "64MiB"], ["--block-size (64.00 MiB) is larger than --disk-size (32.00 MiB, the default"]),
    (["--dir", UNWRITABLE], ["--dir", "is not a writable directory"]),
    (["--profile-out", UNWRITABLE + "/p.json"], ["--profile-out", "is not writable"]),
    (["--plot-out", UNWRITABLE + "/p.png"], ["--plot-out", "is not writable"]),
])  # fmt: skip
def test_bench_bad_sizes_and_paths_are_refused_before_measuring(argv, needles, tmp_path, capsys, no_measuring):
    """Sweep 1, 5: sizes the bench cannot use (they ended in a ValueError or ZeroDivisionError traceback) and
    outputs it cannot write (found after the run) are one line, exit 2, naming the flag, before any measuring."""
    outputs = ["--profile-out", str(tmp_path / "p.json"), "--plot-out", str(tmp_path / "p.png")]
    assert main(["bench", "--quick", "--dir", str(tmp_path), *outputs, *argv]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("tierkv bench: error: ") and "\n" not in line and "Traceback" not in line, line
    for needle in needles:
        assert needle in line, line


def test_bench_progress_is_a_line_per_phase_when_piped(tmp_path, capsys, monkeypatch):
    """Sweep 17: piped, each phase prints a line as it starts (stderr), not nothing until the end."""
    def phases(cfg, progress):
        progress.phase("host memcpy")
        raise OSError(5, "Input/output error", str(tmp_path))

    monkeypatch.setattr("tierkv.commands.bench_run.run_bench", phases)
    outputs = ["--profile-out", str(tmp_path / "p.json"), "--plot-out", str(tmp_path / "p.png")]
    assert main(["bench", "--quick", "--dir", str(tmp_path), *outputs]) == 1
    assert "measuring host memcpy" in capsys.readouterr().err


def test_bench_help_says_where_its_files_go(capsys):
    assert main(["bench", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "tierkv-profile.json in the current directory" in text and "tierkv-bench.png in the current" in text
