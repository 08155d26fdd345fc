"""Progress of a command's phases (loading, prefill, decode, reference check) on stderr, never silent.

On a terminal a phase shows a live spinner or bar that disappears when it ends; piped into a file (CI, ``nohup``,
``| tee``) nothing redraws. Either way each phase ends with one line that names it and its elapsed time, so a
log reads ``prefill 4,096 tokens: 12.3 s (333 tok/s)``. :func:`quiet_transformers` keeps transformers' and
huggingface_hub's own bars and info messages out of the command's output.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from tierkv.units import plural


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


REESTIMATE_S = 10.0  # a long run says how it goes at least this often (docs/demo.md)
WEIGHT_TOKENS = 1024  # a token's weight matmuls cost about as much as attending this many tokens


def forward_cost(start: int, n: int) -> float:
    """Relative cost of a forward of ``n`` tokens after ``start``: their tokens times (the tokens before them + half
    their own + :data:`WEIGHT_TOKENS`); what running estimates weigh a measured rate by."""
    return n * (start + n / 2 + WEIGHT_TOKENS)


class Ticker:
    """A background thread that calls ``say(silent_s)`` whenever ``every_s`` (default :data:`REESTIMATE_S`) passes
    with no :meth:`beat` (a line said), so one long part (a 26 s prefill chunk, a quality prompt, a first load)
    still shows a line at that interval. :meth:`tick` is one check; the thread runs it every second or so while
    the ``with`` block runs."""

    def __init__(self, say: Callable[[float], None], every_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.say, self.clock = say, clock
        self.every_s = REESTIMATE_S if every_s is None else every_s  # (read now: a test may lower it)
        self.last = clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierkv-progress", daemon=True)

    def beat(self) -> None:
        """A line was said now: the next tick line is due ``every_s`` from here."""
        self.last = self.clock()

    def tick(self) -> None:
        """Say the line when ``every_s`` passed with none."""
        now = self.clock()
        if now - self.last >= self.every_s:
            self.say(now - self.last)
            self.last = now

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s / 10)):
            self.tick()

    def __enter__(self) -> Ticker:
        self.beat()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class Remaining:
    """The time left of a greedy run: prefill chunks then decode steps, whose relative costs are known
    (:func:`forward_cost`), re-estimated from the rates measured so far and said on ``console`` about every
    ``every_s`` seconds: at the end of a part when the next one would end past that, and (within ``with``, from
    a :class:`Ticker`) while a part longer than that runs.

    Prefill and decode are timed apart: a decode step of transformers' in-memory cache on a CPU took 10x what the
    prefill's rate predicted (a 64-token decode said "1.7 s to go" and took 57 s), so the decode's time left
    waits for its own rate. The first part of each (warm-up, allocation, new shapes) is left out of its rate:
    one noisy part extrapolated over the run is what made earlier estimates 9x off."""

    def __init__(self, console: Console, label: str, prefill: list[float], decode: Sequence[float] = (),
                 every_s: float | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.console, self.label, self.clock = console, label, clock
        self.groups = (list(prefill), list(decode))
        self.total = sum(map(len, self.groups))
        self.done = 0  # parts done
        self.measured = [[0.0, 0.0], [0.0, 0.0]]  # per group: seconds and cost of its parts done after its first
        self.last = self.said = clock()  # when the last part ended (or the run began), when a line was last said
        self.last_s = 0.0  # how long the last part took (the next one's guess until its group has a rate)
        self.ticker = Ticker(self._still_running, every_s, clock)
        self.every_s = self.ticker.every_s
        self._lock = threading.Lock()  # the ticker's thread reads what part_done writes

    def __enter__(self) -> Remaining:
        self.ticker.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ticker.__exit__(*exc)

    def part_done(self) -> None:
        """One more part is done (in order); says the time left when it is due."""
        with self._lock:
            now = self.clock()
            group, index = self._where(self.done)
            self.last_s = now - self.last
            if index > 0:
                self.measured[group][0] += self.last_s
                self.measured[group][1] += self.groups[group][index]
            self.done += 1
            self.last = now
            if self.done < self.total and now - self.said + self._next_s() >= self.every_s:
                self._say(now, f"{self.label}: {self.done:,}/{self.total:,} done{self._left(0.0)}")

    def _still_running(self, silent_s: float) -> None:
        """The ticker's line: what is done, how long the part now running has taken, and the time left."""
        with self._lock:
            now = self.clock()
            if self.done < self.total:
                self._say(now, f"{self.label}: {self.done:,}/{self.total:,} done, the next running for "
                               f"{seconds(now - self.last)}{self._left(now - self.last)}")

    def _say(self, now: float, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)
        self.said = now
        self.ticker.beat()

    def _where(self, part: int) -> tuple[int, int]:
        """(group, index in it) of part number ``part``."""
        prefill = len(self.groups[0])
        return (0, part) if part < prefill else (1, part - prefill)

    def _rate(self, group: int) -> float | None:
        seconds_, cost = self.measured[group]
        return seconds_ / cost if cost > 0 else None

    def _next_s(self) -> float:
        """The next part's expected time: by its group's rate, else as long as the last part."""
        group, index = self._where(self.done)
        rate = self._rate(group)
        return self.last_s if rate is None else rate * self.groups[group][index]

    def _left(self, running_s: float) -> str:
        """``", about 40.0 s to go"`` (``running_s``: how long the part now running has run), or what is still
        being measured."""
        group, index = self._where(self.done)
        left = [sum(self.groups[0][index:]) if group == 0 else 0.0, sum(self.groups[1][index if group else 0:])]
        rates = [self._rate(0), self._rate(1)]
        if left[0] > 0 and rates[0] is None:
            return " (measuring the rate)"
        prefill_s = (rates[0] or 0.0) * left[0]
        if left[1] > 0 and rates[1] is None:
            steps = plural(len(self.groups[1]) - (index if group else 0), "decode step")
            if left[0] > 0:
                return f", about {seconds(max(prefill_s - running_s, 0.0))} of prefill to go, then {steps}"
            return f" (prefill done; measuring the rate of the {steps} left)"
        total = prefill_s + (rates[1] or 0.0) * left[1]
        after = total - self._next_s()  # the parts after the one running: the time left is never less
        return f", about {seconds(max(total - running_s, after))} to go"


def animated(console: Console) -> bool:
    """Whether ``console`` may show spinners and live panels: a terminal, really. rich's ``is_terminal`` is also true
    under ``FORCE_COLOR`` (set by many CI systems) with the output in a log, which then got every redraw (tens of
    KB a second of cursor movements) and none of the lines a log gets."""
    isatty = getattr(console.file, "isatty", None)
    return console.is_terminal and not console.is_dumb_terminal and bool(isatty and isatty())


class Phases:
    """One line per finished phase on ``console`` (stderr), a transient live view while it runs on a terminal."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live = animated(console)

    def done(self, label: str, elapsed: float, detail: str = "") -> None:
        """The line that closes a phase: ``'{label}: {elapsed}'`` and an optional detail in parentheses."""
        self.console.print(f"{label}: {seconds(elapsed)}" + (f" ({detail})" if detail else ""), highlight=False,
                           soft_wrap=True)

    @contextlib.contextmanager
    def phase(self, label: str, total: int | None = None,
              announce: bool = False) -> Iterator[Callable[[int], None]]:
        """Run a phase: yields ``advance(n)`` (a no-op without ``total``); prints :meth:`done`'s line after it.
        ``announce``: without a terminal (a pipe, a CI log) the label is printed as it begins too, and the time so
        far every :data:`REESTIMATE_S`, so a phase known to be long (a first load's dequantisation) is not a silent
        minute."""
        started = time.perf_counter()
        if self.live:
            columns = [SpinnerColumn(), TextColumn(label)]
            if total:
                columns += [BarColumn(), MofNCompleteColumn()]
            with Progress(*columns, TimeElapsedColumn(), console=self.console, transient=True) as progress:
                task = progress.add_task(label, total=total)
                yield lambda n: progress.advance(task, n)
        elif announce:  # a log: "label ...", then "label: 10.0 s so far" every REESTIMATE_S until it ends
            self.console.print(f"{label} ...", highlight=False, soft_wrap=True)
            with Ticker(lambda _: self.console.print(f"{label}: {seconds(time.perf_counter() - started)} so far",
                                                     highlight=False, soft_wrap=True)):
                yield lambda n: None
        else:
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


IMPORTING = "importing torch and transformers"
"""What demo and eval do in the seconds before their model loads (a terminal shows it with a spinner)."""


@contextlib.contextmanager
def importing(console: Console) -> Iterator[None]:
    """The seconds a command spends importing torch and transformers before its first phase: a spinner on a
    terminal. A log (a pipe, a CI job) gets nothing here: a usage error found after the imports stays its one line."""
    with console.status(IMPORTING) if animated(console) else contextlib.nullcontext():
        yield


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
