"""``tierkv bench`` is never silent for long: every phase of a calibration run reports its points, and the log gets
a line at least every :data:`~tierkv.commands.progress.REESTIMATE_S` (a default run took 4 min 35 s on a busy
2-core host, silent for 37 s, 91 s and 85 s in three of its phases). Timed in fake time: no timing assertions."""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from tierkv.calibrate import BenchConfig, run_bench
from tierkv.calibrate.kv import compute_device
from tierkv.commands.bench import FULL_RUN, FULL_RUN_S
from tierkv.commands.bench_run import BenchProgress
from tierkv.commands.progress import REESTIMATE_S

SETUP_S = 25.0  # fake time a phase takes before its first point (allocating, writing a layer): over the interval
POINT_S = 3.0  # fake time each point takes


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Log(io.StringIO):
    """A console's file that keeps each line with the fake time it was written at."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.lines += [(self.clock.now, line) for line in text.splitlines() if line.strip()]
        return len(text)


class FakeTimeProgress(BenchProgress):
    """The bench's progress where the work between two calls takes fake time (``SETUP_S`` before a phase's first
    point, ``POINT_S`` before each other, and ``SETUP_S`` for a phase without points), the ticker's check running
    every fake second as its thread does; keeps what each phase declared and the points it reported."""

    def __init__(self, console: Console, clock: FakeClock) -> None:
        super().__init__(console, clock=clock)
        self.fake = clock
        self.phases: list[tuple[str, int, int]] = []  # (what, points declared, points reported)

    def _pass(self, duration: float) -> None:
        for _ in range(round(duration)):
            self.fake.now += 1.0
            self.ticker.tick()

    def phase(self, what: str, costs: Sequence[float] = ()) -> None:
        if self.phases:
            self._pass(SETUP_S if self.done == 0 else POINT_S)  # the end of the last phase (or all of it)
        super().phase(what, costs)
        self.phases.append((what, len(costs), 0))

    def point(self) -> None:
        self._pass(SETUP_S if self.done == 0 else POINT_S)
        super().point()
        what, declared, reported = self.phases[-1]
        self.phases[-1] = (what, declared, reported + 1)


def _fake_time_run(tmp_path: Path) -> tuple[FakeTimeProgress, list[tuple[float, str]]]:
    clock = FakeClock()
    log = Log(clock)
    progress = FakeTimeProgress(Console(file=log, width=200), clock)
    cfg = BenchConfig.quick(tmp_path, repeats=1, warmup=0, min_size=64 * 1024, engines=("posix",))
    run_bench(cfg, progress=progress)
    progress.phase("matmul")  # closes the run's last phase, as the command's next one does
    return progress, log.lines


def test_every_phase_reports_its_points_and_the_log_is_never_silent_past_the_interval(tmp_path: Path) -> None:
    progress, lines = _fake_time_run(tmp_path)
    times = [0.0] + [at for at, _ in lines]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) <= REESTIMATE_S, [line for line in lines]
    assert lines[-1][0] >= 300, "the fake run is long enough to need many progress lines"

    names = [what for what, _, _ in progress.phases[:-1]]
    expected = ["host memcpy", "host attention", "block gather", "the store's own gather", "from host blocks",
                "host<->device" if compute_device().type == "cuda" else "", "disk: writing",
                "disk: reads and writes", "disk: batches"]
    if compute_device().type == "cpu":
        expected += ["the store's gather beside compute", "disk reads (posix) beside compute", "own work per layer"]
    for needle, what in zip([e for e in expected if e], names, strict=True):
        assert needle in what, (needle, names)
    texts = [text for _, text in lines]
    for what, declared, reported in progress.phases[:-1]:
        assert reported == declared, what
        ended = [text for text in texts if text.startswith(f"{what}: ") and " so far" not in text]
        assert ended == [f"{what}: {ended[0].split(': ')[-1].split(' (')[0]}"
                         + (f" ({declared} points)" if declared else "")], (what, ended)
        assert f"measuring {what}" in " ".join(texts)
    # a phase's first point, slow with its setup, leaves the rate to the next ones; then the time left is said
    assert any(re.search(r": \d+\.\d s so far, 0/\d+ points$", text) for text in texts), texts
    assert any(re.search(r"so far, \d+/\d+ points, about .* to go$", text) for text in texts), texts


def test_the_time_left_goes_by_the_points_after_the_first(tmp_path: Path) -> None:
    """Points of costs 1, 1, 2, 4: the first (with its setup) takes 30 s, the second 1 s, so 1 s a cost; 1 s into
    the third, 2 + 4 - 1 s are left. A point that runs past its share says so, not "0.0 s to go"."""
    clock = FakeClock()
    log = Log(clock)
    progress = BenchProgress(Console(file=log, width=200), clock=clock)
    progress.phase("store gather", [1, 1, 2, 4])
    clock.now = 30.0
    progress.point()
    clock.now = 31.0
    progress.point()
    clock.now = 32.0  # 1 s into the third point
    progress._still_running(1.0)
    assert log.lines[-1] == (32.0, "store gather: 32.0 s so far, 2/4 points, about 5.0 s to go")
    clock.now = 40.0  # 9 s into the third point, rated at 2 s: no "0.0 s to go"
    progress._still_running(8.0)
    assert log.lines[-1] == (40.0, "store gather: 40.0 s so far, 2/4 points, the next running for 9.0 s, then about "
                                   "4.0 s more")
    clock.now = 41.0
    progress.point()
    clock.now = 60.0  # the last point, rated at 4 s
    progress._still_running(20.0)
    assert log.lines[-1] == (60.0, "store gather: 1 min 00 s so far, 3/4 points, the next running for 19.0 s")


def test_on_a_terminal_the_spinner_says_it_and_only_phase_ends_are_lines(tmp_path: Path) -> None:
    class Spinner:
        def __init__(self) -> None:
            self.texts: list[str] = []

        def update(self, text: str) -> None:
            self.texts.append(text)

    clock = FakeClock()
    log = Log(clock)
    spinner = Spinner()
    progress = BenchProgress(Console(file=log, width=200), spinner, clock=clock)  # type: ignore[arg-type]
    progress.phase("host memcpy", [1, 1, 1])
    for _ in range(3):
        clock.now += 4
        progress.point()
    progress.phase("matmul")
    assert spinner.texts[:2] == ["measuring host memcpy", "measuring host memcpy: 4.0 s so far, 1/3 points"]
    assert spinner.texts[-1] == "measuring matmul"
    assert [text for _, text in log.lines] == ["host memcpy: 12.0 s (3 points)"]


def test_the_start_line_gives_a_range_that_holds_a_busy_host(tmp_path: Path, capsys, monkeypatch) -> None:
    """A default run took 161 s on a quiet 2-core VM and 4 min 35 s on a busy one; the start line said 2-4 min."""
    from tierkv.cli import main

    def fail(cfg, progress):
        raise OSError(5, "Input/output error", str(tmp_path))

    monkeypatch.setattr("tierkv.commands.bench_run.run_bench", fail)
    argv = ["bench", "--dir", str(tmp_path), "--disk-size", "32MiB", "--max-size", "4MiB",
            "--profile-out", str(tmp_path / "p.json"), "--plot-out", str(tmp_path / "p.png")]
    assert main(argv) == 1
    assert f"measuring every link at the default sizes: {FULL_RUN}" in capsys.readouterr().err
    assert FULL_RUN_S[0] <= 161 and FULL_RUN_S[1] >= 275
