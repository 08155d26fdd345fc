"""What a calibration run says while it measures: each phase as it begins, with its points' relative costs, and
each point as it ends; ``tierkv bench`` turns them into progress lines and time-left estimates."""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.calibrate.config import BenchConfig


class Progress:
    """Where :func:`~tierkv.calibrate.run.run_bench` reports its phases and points. This base says nothing (the
    library's and the benchmarks' runs); ``tierkv bench`` prints them (a full run takes minutes)."""

    def phase(self, what: str, costs: Sequence[float] = ()) -> None:
        """A phase begins: what it measures, and the relative cost of each of its points in order (none for a
        phase not measured point by point)."""

    def point(self) -> None:
        """The phase's next point has been measured."""


SILENT = Progress()


def point_cost(nbytes: int, cfg: BenchConfig, inner: int = 1) -> float:
    """A timed point's relative cost: the bytes its warm-ups and repeats move, ``inner`` operations of ``nbytes``
    each (what a phase's time left is estimated by)."""
    return float(nbytes * inner * (cfg.warmup + cfg.repeats))
