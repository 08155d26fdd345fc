"""Progress of a command's phases (loading, prefill, decode, reference check) on stderr, never silent.

On a terminal a phase shows a live spinner or bar that disappears when it ends; piped into a file (CI, ``nohup``,
``| tee``) nothing redraws. Either way each phase ends with one line that names it and its elapsed time, so a
log reads ``prefill 4,096 tokens: 12.3 s (333 tok/s)``. :func:`quiet_transformers` keeps transformers' and
huggingface_hub's own bars and info messages out of the command's output.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


def seconds(value: float) -> str:
    """``'0.4 s'``, ``'12.3 s'``, ``'2 min 05 s'``, ``'3 h 20 min'``, ``'41 days'``: how long a phase took or may
    take (an estimate of weeks reads as such, not as millions of minutes)."""
    if value < 60:
        return f"{value:.1f} s"
    if value < 3600:
        minutes, rest = divmod(round(value), 60)
        return f"{minutes} min {rest:02d} s"
    if value < 2 * 86400:
        hours, rest = divmod(round(value / 60), 60)
        return f"{hours} h {rest:02d} min"
    return f"{round(value / 86400):,} days"


class Phases:
    """One line per finished phase on ``console`` (stderr), a transient live view while it runs on a terminal."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live = console.is_terminal

    def done(self, label: str, elapsed: float, detail: str = "") -> None:
        """The line that closes a phase: ``'{label}: {elapsed}'`` and an optional detail in parentheses."""
        self.console.print(f"{label}: {seconds(elapsed)}" + (f" ({detail})" if detail else ""), highlight=False,
                           soft_wrap=True)

    @contextlib.contextmanager
    def phase(self, label: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
        """Run a phase: yields ``advance(n)`` (a no-op without ``total``); prints :meth:`done`'s line after it."""
        started = time.perf_counter()
        if self.live:
            columns = [SpinnerColumn(), TextColumn(label)]
            if total:
                columns += [BarColumn(), MofNCompleteColumn()]
            with Progress(*columns, TimeElapsedColumn(), console=self.console, transient=True) as progress:
                task = progress.add_task(label, total=total)
                yield lambda n: progress.advance(task, n)
        else:
            yield lambda n: None
        self.done(label, time.perf_counter() - started)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Within: no "Loading weights" bars and info logs from transformers, no huggingface_hub bars (the command
    shows its own progress; warnings and errors still print). The caller's settings come back after."""
    import huggingface_hub.utils as hub  # a dependency of transformers
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hub_bars = not hub.are_progress_bars_disabled()
    hub.disable_progress_bars()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if hub_bars:
            hub.enable_progress_bars()
