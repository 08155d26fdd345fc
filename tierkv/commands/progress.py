"""Progress of a command's phases (loading, prefill, decode, reference check) on stderr, never silent.

On a terminal a phase shows a live spinner or bar that disappears when it ends; piped into a file (CI, ``nohup``,
``| tee``) nothing redraws. Either way each phase ends with one line that names it and its elapsed time, so a
log reads ``prefill 4,096 tokens: 12.3 s (333 tok/s)``. :func:`quiet_transformers` keeps transformers' and
huggingface_hub's own bars and info messages out of the command's output.
"""

from __future__ import annotations

import contextlib
import functools
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


def between(estimate: float) -> str:
    """A rough estimate as the range it is good for, half to twice it: ``'between 10.0 s and 40.0 s'`` (the host's
    speed is measured in a fraction of a second, as loaded as the host is then; runs differ that much)."""
    return f"between {seconds(estimate / 2)} and {seconds(estimate * 2)}"


REESTIMATE_S = 10.0  # a running estimate is said at most this often
WEIGHT_TOKENS = 1024  # a token's weight matmuls cost about as much as attending this many tokens


def forward_cost(start: int, n: int) -> float:
    """Relative cost of a forward of ``n`` tokens after ``start``: their tokens times (the tokens before them + half
    their own + :data:`WEIGHT_TOKENS`); what running estimates weigh a measured rate by."""
    return n * (start + n / 2 + WEIGHT_TOKENS)


class Remaining:
    """The time left of work made of parts whose relative costs are known, re-estimated from the rate measured
    so far and said on ``console`` about every ``every_s`` seconds: at the end of a part when the next one would
    end past that (so parts of several seconds never leave ``every_s`` silent). The first part (warm-up,
    allocation) is left out of the rate: one noisy part extrapolated over the run is what made earlier estimates
    9x off; until a second part ends the line says only how many are done."""

    def __init__(self, console: Console, label: str, costs: list[float], every_s: float = REESTIMATE_S,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.console, self.label, self.costs = console, label, costs
        self.every_s, self.clock = every_s, clock
        self.done = 0  # parts done
        self.measured_from: float | None = None  # when the first part ended
        self.measured_cost = 0.0  # cost of the parts done since
        self.first_s = 0.0  # how long the first part took (the next part's guess until there is a rate)
        self.said = clock()

    def part_done(self) -> None:
        """One more part is done (in order); says the time left when it is due and there is a rate to go by."""
        now = self.clock()
        self.done += 1
        rate: float | None = None
        if self.measured_from is None:
            self.measured_from, self.first_s = now, now - self.said
        else:
            self.measured_cost += self.costs[self.done - 1]
            rate = (now - self.measured_from) / self.measured_cost
        left = sum(self.costs[self.done:])
        upcoming = self.first_s if rate is None else rate * self.costs[self.done] if left > 0 else 0.0
        if left > 0 and now - self.said + upcoming >= self.every_s:
            estimate = " (measuring the rate)" if rate is None else f", about {seconds(rate * left)} to go"
            self.console.print(f"{self.label}: {self.done:,}/{len(self.costs):,} done{estimate}", highlight=False,
                               soft_wrap=True)
            self.said = now


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
    def phase(self, label: str, total: int | None = None,
              announce: bool = False) -> Iterator[Callable[[int], None]]:
        """Run a phase: yields ``advance(n)`` (a no-op without ``total``); prints :meth:`done`'s line after it.
        ``announce``: without a terminal (a pipe, a CI log) the label is printed as it begins too, so a phase
        known to be long (a first load's dequantisation) is not a silent minute."""
        started = time.perf_counter()
        if self.live:
            columns = [SpinnerColumn(), TextColumn(label)]
            if total:
                columns += [BarColumn(), MofNCompleteColumn()]
            with Progress(*columns, TimeElapsedColumn(), console=self.console, transient=True) as progress:
                task = progress.add_task(label, total=total)
                yield lambda n: progress.advance(task, n)
        else:
            if announce:
                self.console.print(f"{label} ...", highlight=False, soft_wrap=True)
            yield lambda n: None
        self.done(label, time.perf_counter() - started)


FIRST_LOAD = {"smollm2": "10 s to 1 min", "gemma3": "30 s to 2 min"}
"""How long the first load of a named GGUF model takes on two CPU cores (joining and dequantising it), as a range:
SmolLM2 took 14-18 s, Gemma 3 42-110 s, and the host's other work moves it either way."""


def first_load(name: str) -> bool:
    """Whether loading the named model dequantises its GGUF now (a minute or so: announced as it begins)."""
    from tierkv import models

    found = models.spec(name)
    return found.checkpoint is not None and not (found.checkpoint() / "config.json").is_file()


def load_label(name: str) -> str:
    """What loading the named model (:mod:`tierkv.models`) is about to do: ``loading X``, or for a GGUF model
    not yet dequantised, that it is dequantised now (first load only) and the range that takes."""
    from tierkv import models

    found = models.spec(name)
    if not first_load(name):
        return f"loading {found.description}"
    # short: a terminal's live line is cut at its width, and the time is what the user waits to read
    return f"dequantising {name}'s GGUF (first load only: {FIRST_LOAD[name]} on 2 cores; then seconds)"


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Within: no "Loading weights" bars and info logs from transformers, no huggingface_hub bars, no bar of the
    GGUF dequantisation on a model's first load (it calls tqdm directly, past transformers' switch: its ``tqdm``
    is swapped for a disabled one); the command shows its own progress, warnings and errors still print. The
    caller's settings come back after."""
    import huggingface_hub.utils as hub  # a dependency of transformers
    from transformers import modeling_gguf_pytorch_utils as gguf
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hub_bars = not hub.are_progress_bars_disabled()
    hub.disable_progress_bars()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    gguf_bar = gguf.tqdm
    gguf.tqdm = functools.partial(gguf_bar, disable=True)
    try:
        yield
    finally:
        gguf.tqdm = gguf_bar
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if hub_bars:
            hub.enable_progress_bars()
