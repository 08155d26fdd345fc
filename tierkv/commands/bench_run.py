"""The body of ``tierkv bench`` (:mod:`tierkv.commands.bench` parses its options): configure, measure through
:mod:`tierkv.calibrate`, print the tables, save the profile and the plot."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.status import Status
from rich.table import Table

from tierkv.calibrate import BenchConfig, BenchResult, Measurement, plot, run_bench
from tierkv.calibrate.attention import ATTENTION
from tierkv.calibrate.consistency import RERUN, contradictions, host_load
from tierkv.calibrate.report import Progress
from tierkv.commands import free_bytes, json_to_stdout, write_json
from tierkv.commands.bench import FULL_RUN
from tierkv.commands.estimate import measure_cpu
from tierkv.commands.progress import REESTIMATE_S, Ticker, animated, seconds
from tierkv.errors import InvalidConfigError
from tierkv.hf.sizing import host_memory
from tierkv.io import ENGINES, engine_status
from tierkv.planner import COMPUTE_FLOPS_KEY, QUICK_NOTE, WARNINGS_KEY
from tierkv.units import format_bytes, plural
from tierkv.vocabulary import LinkName

MEMORY_COPIES = 4  # buffers of --max-size the memory links hold at once (a gather's pool is twice its output)


def _check_free_space(folder: Path, disk_bytes: int, shown: str) -> None:
    """Refuse a test file larger than the free space under ``--dir`` before any measuring: otherwise the disk
    phase fails only after the memory phases, with the OS's "No space left on device"."""
    free = free_bytes(folder)
    if disk_bytes > free:
        raise InvalidConfigError(f"{shown} does not fit in --dir {str(folder)!r}: {format_bytes(free)} free there; "
                                 "give a smaller --disk-size (a bare number counts GB: e.g. 256MiB), free space, or "
                                 "a --dir on a disk with more room.")


def _engines(text: str | None) -> tuple[str, ...] | None:
    """``--engines``: each name must be an engine that loads here (None, left out: all that do; ``""`` names none)."""
    if text is None:
        return None
    engines = tuple(e.strip() for e in text.split(",") if e.strip())
    if not engines:
        raise InvalidConfigError(f"--engines {text!r} names no disk engine; give one or more of {', '.join(ENGINES)} "
                                 "separated by commas, or leave --engines out to measure all that load here.")
    status = engine_status()
    for name in engines:
        if name not in status:
            raise InvalidConfigError(f"--engines: unknown disk engine {name!r}; valid engines: {', '.join(ENGINES)}.")
        if status[name] is not None:
            raise InvalidConfigError(f"--engines: disk engine {name!r} is unavailable here: {status[name]}.")
    return engines


def _config(args: argparse.Namespace) -> BenchConfig:
    """The flags given (the rest from the full or ``--quick`` defaults), checked together before any measuring:
    an error names the flags, and a default it compares with says it is one."""
    base = BenchConfig.quick(args.dir) if args.quick else BenchConfig(args.dir)
    flags = {"min_size": ("--min-size", args.min_size), "max_size": ("--max-size", args.max_size),
             "disk_bytes": ("--disk-size", args.disk_size), "block_bytes": ("--block-size", args.block_size)}
    value = {field: getattr(base, field) if given is None else given for field, (_, given) in flags.items()}

    def shown(field: str) -> str:
        option, given = flags[field]
        default = "" if given is not None else f", the default{' with --quick' if args.quick else ''}"
        return f"{option} ({format_bytes(value[field])}{default})"

    for small, large, fix in (("min_size", "max_size", "lower --min-size or raise --max-size"),
                              ("min_size", "disk_bytes", "the test file holds the smallest transfer: raise "
                                                         "--disk-size or lower --min-size"),
                              ("block_bytes", "disk_bytes", "the test file holds the disk's blocks: raise "
                                                            "--disk-size or lower --block-size")):
        if value[small] > value[large]:
            raise InvalidConfigError(f"{shown(small)} is larger than {shown(large)}; {fix}.")
    _check_free_space(args.dir, value["disk_bytes"], shown("disk_bytes"))
    available = host_memory()[1]
    if MEMORY_COPIES * value["max_size"] > available:
        raise InvalidConfigError(f"{shown('max_size')} needs about {MEMORY_COPIES} buffers of it in memory at once "
                                 f"(source, destination, a gather's pool), more than the {format_bytes(available)} "
                                 "available here; give a smaller --max-size.")
    overrides = {field: given for field, (_, given) in flags.items() if given is not None}
    if args.repeats is not None:
        overrides["repeats"] = args.repeats
    overrides["engines"] = _engines(args.engines)
    return dataclasses.replace(base, **overrides)


_SHORT = {
    (LinkName.HOST_TO_HOST, "memcpy"): "memcpy",
    (LinkName.DEVICE_TO_DEVICE, "plain copy"): "plain copy",
    (LinkName.DEVICE_TO_DEVICE, "gather index_select"): "gather idx_sel",
    (LinkName.DEVICE_TO_DEVICE, "gather per-block copy_"): "gather per-blk",
    (LinkName.HOST_TO_DEVICE, "pinned"): "H2D pinned",
    (LinkName.HOST_TO_DEVICE, "pageable"): "H2D pageable",
    (LinkName.DEVICE_TO_HOST, "pinned"): "D2H pinned",
    (LinkName.DEVICE_TO_HOST, "pageable"): "D2H pageable",
    ("host<->device", "pinned both ways"): "H2D+D2H pinned",
    (LinkName.DEVICE_TO_DEVICE, "store read_into"): "store gather, device blocks",
    (LinkName.HOST_TO_DEVICE, "store read_into"): "store gather, host blocks",
}
_MEMORY_LINKS = (LinkName.HOST_TO_HOST, LinkName.DEVICE_TO_DEVICE, LinkName.HOST_TO_DEVICE, LinkName.DEVICE_TO_HOST,
                 "host<->device")  # the last: pinned copies both ways at once (bench only)


def _pivot(
    result: BenchResult, links: tuple[str, ...]
) -> tuple[list[str], dict[int, dict[str, Measurement]]]:
    """Rows by transfer size, one column per (link, method), named by its short label."""
    columns: list[str] = []
    rows: dict[int, dict[str, Measurement]] = defaultdict(dict)
    for m in result.measurements:
        if m.link in links and not m.method.endswith(" block batch"):
            name = _SHORT.get((m.link, m.method), m.method)
            if name not in columns:
                columns.append(name)
            rows[m.size][name] = m
    return columns, dict(sorted(rows.items()))


def tables(result: BenchResult) -> list[Table]:
    """The tables ``run`` prints: memory links, disk read/write with ratios to raw, the fitted profile."""
    out = []
    columns, rows = _pivot(result, _MEMORY_LINKS)
    if rows:
        table = Table(title="Memory links, GB/s; gather = blocks from random slots, ratio to a plain copy")
        table.add_column("size", justify="right")
        for name in columns:
            table.add_column(name, justify="right")
        table.add_column("idx_sel/plain", justify="right")
        table.add_column("per-blk/plain", justify="right")
        for size, by_name in rows.items():
            plain = by_name.get("plain copy")
            ratios = [
                f"{by_name[g].gbps / plain.gbps:.2f}" if g in by_name and plain else ""
                for g in ("gather idx_sel", "gather per-blk")
            ]
            table.add_row(
                format_bytes(size), *[f"{by_name[c].gbps:.2f}" if c in by_name else "" for c in columns], *ratios
            )
        out.append(table)
    columns, rows = _pivot(result, (ATTENTION,))
    if rows:
        table = Table(title="Host attention kernel: GB/s of K/V attended in place (one decode query, 32 heads)")
        table.add_column("K/V", justify="right")
        for name in columns:
            table.add_column(name, justify="right")
        for size, by_name in rows.items():
            table.add_row(format_bytes(size), *[f"{by_name[c].gbps:.2f}" if c in by_name else "" for c in columns])
        out.append(table)
    for link, title in ((LinkName.DISK_TO_HOST, "Disk read"), (LinkName.HOST_TO_DISK, "Disk write")):
        columns, rows = _pivot(result, (link,))
        if not rows:
            continue
        table = Table(title=f"{title}, GB/s (engine / raw O_DIRECT, same request size)")
        table.add_column("request", justify="right")
        for name in columns:
            table.add_column(name, justify="right")
        for size, by_name in rows.items():
            raw = by_name.get("raw O_DIRECT")
            cells = []
            for name in columns:
                m = by_name.get(name)
                ratio = f" ({m.gbps / raw.gbps:.2f})" if m and raw and m is not raw else ""
                cells.append(f"{m.gbps:.2f}{ratio}" if m else "")
            table.add_row(format_bytes(size), *cells)
        out.append(table)
    batches = [m for m in result.measurements if m.method.endswith(" block batch")]
    if batches:
        table = Table(title="Disk read of one layer's blocks: a batch of scattered blocks, GB/s")
        for name in ("engine", "blocks", "batch", "GB/s", "ms"):
            table.add_column(name, justify="right")
        block = min(m.nbytes for m in batches)
        for m in batches:
            engine = m.method.removesuffix(" block batch")
            table.add_row(engine, str(m.nbytes // block), format_bytes(m.nbytes), f"{m.gbps:.2f}",
                          f"{m.seconds * 1e3:.2f}")
        out.append(table)
    table = Table(title="Fitted link profile: t = latency + bytes / bandwidth")
    for name in ("link", "bandwidth GB/s", "latency us"):
        table.add_column(name, justify="right" if name != "link" else "left")
    for key, fitted in result.profile.links.items():
        table.add_row(key, f"{fitted.bandwidth_bytes_per_s / 1e9:.2f}", f"{fitted.latency_s * 1e6:.1f}")
    if result.profile.serial_mover:
        c = result.profile.contention
        table.caption = (f"one mover thread beside compute. Where they overlap, compute slows "
                         f"{c.compute_by_copies:.2f}x and copies {c.copies_by_compute:.2f}x; beside disk reads, "
                         f"compute slows {c.compute_by_disk:.2f}x and the reads {c.disk_by_compute:.2f}x. "
                         f"The cache's own work per layer: {result.profile.layer_overhead_s * 1e6:.0f} us")
    attention = result.profile.host_attention
    if attention is not None:
        memcpy = result.profile.links.get(LinkName.HOST_TO_HOST)
        versus = f"; memcpy {memcpy.bandwidth_bytes_per_s / 1e9:.2f} GB/s" if memcpy is not None else ""
        table.add_row(f"{ATTENTION} ({attention.kernel} kernel, K/V attended in place)",
                      f"{attention.bandwidth_bytes_per_s / 1e9:.2f} ({plural(attention.threads, 'thread')})", "")
        table.add_row(f"{ATTENTION}, 1 thread", f"{attention.single_thread_bytes_per_s / 1e9:.2f}", "")
        caption = f"split prices its host share at the {attention.threads}-thread rate{versus}"
        if attention.bandwidth_bytes_per_s < attention.single_thread_bytes_per_s:  # other work took the cores
            caption = (f"The {attention.threads}-thread rate measured below the 1-thread one: split prices its host "
                       f"share at the 1-thread rate{versus}")
        table.caption = f"{table.caption}. {caption}" if table.caption else caption
    out.append(table)
    return out


def to_dict(result: BenchResult) -> dict:
    """The ``--json`` record: the machine, every measurement and the fitted profile (as ``--profile-out``)."""
    profile = result.profile
    return {
        "machine": dict(result.machine),
        "notes": list(result.notes),
        "measurements": [{"link": m.link, "method": m.method, "size_bytes": m.size, "bytes": m.nbytes,
                          "transfers": m.transfers, "seconds": m.seconds, "gbps": m.gbps}
                         for m in result.measurements],
        "profile": {"links": {key: {"name": link.name, "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
                                    "latency_s": link.latency_s} for key, link in profile.links.items()},
                    "serial_mover": profile.serial_mover, "layer_overhead_s": profile.layer_overhead_s,
                    "host_attention": None if profile.host_attention is None else dataclasses.asdict(
                        profile.host_attention)},
    }


class BenchProgress(Progress):
    """``tierkv bench``'s progress on ``console`` (stderr), never silent for more than ``every_s``: a line as each
    phase begins, then every ``every_s`` (a :class:`~tierkv.commands.progress.Ticker`) the points measured and the
    time left, and a line as it ends with its time (as :class:`~tierkv.commands.progress.Phases` ends one). A
    phase's first point also builds its buffers (a 1 GiB layer of the store takes tens of seconds on 2 cores), so
    the time left goes by the rate of the points after it. On a terminal a ``status`` spinner says the same in
    place of the lines but the last."""

    def __init__(self, console: Console, status: Status | None = None, every_s: float = REESTIMATE_S,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.console, self.status, self.clock = console, status, clock
        self.ticker = Ticker(self._still_running, every_s, clock)
        self.started = clock()
        self.what = ""  # the phase running ("": none yet)
        self.costs: list[float] = []  # its points' relative costs
        self.done = 0  # its points measured
        self.began = self.last = self.started  # when it began, when its last point ended
        self.rate_from: float | None = None  # when its first point ended
        self.rate_cost = 0.0  # cost of the points since
        self._lock = threading.Lock()  # the ticker's thread reads what the measuring thread writes

    def __enter__(self) -> BenchProgress:
        self.ticker.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.ticker.__exit__(kind, *exc)
        if kind is None:  # a failure is said by the command: no "done" line for the phase it cut short
            self._end(self.clock())

    def phase(self, what: str, costs: Sequence[float] = ()) -> None:
        with self._lock:
            now = self.clock()
            self._end(now)
            self.what, self.costs, self.done = what, list(costs), 0
            self.began = self.last = now
            self.rate_from, self.rate_cost = None, 0.0
            self._say(f"[{seconds(now - self.started)}] measuring {what}", f"measuring {what}")

    def point(self) -> None:
        with self._lock:
            now = self.clock()
            self.done += 1
            if self.rate_from is None:
                self.rate_from = now
            else:
                self.rate_cost += self.costs[self.done - 1]
            self.last = now
            if self.status is not None:
                self.status.update(f"measuring {self.what}: {self._state(now)}")

    def _still_running(self, silent_s: float) -> None:
        """The ticker's line: how long the phase has run, its points measured and its time left."""
        with self._lock:
            if self.what:
                state = self._state(self.clock())
                self._say(f"{self.what}: {state}", f"measuring {self.what}: {state}")

    def _state(self, now: float) -> str:
        """``'40.0 s so far, 3/12 points, about 25.0 s to go'``: the time left once two points are measured, by
        their rate; while a point runs past what that rate gave it, how long it has run and the time left after."""
        state = f"{seconds(now - self.began)} so far"
        if not self.costs:
            return state
        state += f", {self.done}/{len(self.costs)} points"
        if self.rate_from is None or self.rate_cost == 0 or self.done == len(self.costs):
            return state
        rate = (self.last - self.rate_from) / self.rate_cost
        running, after = now - self.last, rate * sum(self.costs[self.done + 1:])
        left = rate * sum(self.costs[self.done:]) - running
        if left > after:
            return f"{state}, about {seconds(left)} to go"
        state += f", the next running for {seconds(running)}"
        return f"{state}, then about {seconds(after)} more" if after else state

    def _say(self, line: str, spinner: str) -> None:
        """``line`` on the log, or ``spinner`` as the spinner's text on a terminal."""
        if self.status is not None:
            self.status.update(spinner)
        else:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        self.ticker.beat()

    def _end(self, now: float) -> None:
        """The line that closes the phase running (if any): its time and points (``--dir`` may hold brackets: no
        markup, unlike :meth:`~tierkv.commands.progress.Phases.done`)."""
        if self.what:
            points = f" ({self.done} points)" if self.costs else ""
            self.console.print(f"{self.what}: {seconds(now - self.began)}{points}", markup=False, highlight=False,
                               soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=json_to_stdout(args))
    if not console.is_terminal:  # piped into a file or a doc: keep the table columns readable
        console = Console(width=132, stderr=json_to_stdout(args))
    cfg = _config(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    log = Console(stderr=True, highlight=False)  # progress: a spinner on a terminal, else a line per phase
    busy = host_load()
    if busy:
        log.print(f"[yellow]warning:[/yellow] {busy}: other work skews every timing; {RERUN}.", soft_wrap=True)
    if args.quick:
        log.print("--quick: small sizes, numbers indicative only (a smoke test, not a profile to plan with)",
                  soft_wrap=True)
    else:
        log.print(f"measuring every link at the default sizes: {FULL_RUN} (--quick: 10-40 s)", soft_wrap=True)
    with (log.status("measuring") if animated(log) else contextlib.nullcontext() as status,
          BenchProgress(log, status) as progress):
        result = run_bench(cfg, progress=progress)
        progress.phase("matmul FLOP/s (the compute estimate of tierkv plan --device cpu)")
        result.profile.machine[COMPUTE_FLOPS_KEY] = f"{measure_cpu().peak_flops:.4g}"
    warnings = ([busy] if busy else []) + contradictions(result)
    noted = warnings + ([QUICK_NOTE] if args.quick else [])  # last: plan --profile tells it by the end
    if noted:  # plan --profile repeats them
        result.profile.machine[WARNINGS_KEY] = "; ".join(noted)
    m = result.machine
    console.print(f"[bold]tierkv bench[/bold] {m['date']}")
    console.print(f"CPU {m['cpu']}, {m['cores']}, RAM {m['ram']}, GPU {m['gpu']}", markup=False)
    console.print(f"disk dir {m['disk_dir']}: {m['filesystem']}; kernel {m['kernel']}, torch {m['torch']}",
                  markup=False)
    console.print(f"load average before the run: {m['load_average']}")
    if LinkName.HOST_TO_DEVICE in m:
        console.print(f"host->device: {m['host->device']}")
    for note in result.notes:
        console.print(f"disk: {note}")
    for table in tables(result):
        console.print(table)
    console.print(f"CPU matmul: {float(result.profile.machine[COMPUTE_FLOPS_KEY]) / 1e9:.1f} GFLOP/s (float32)")
    for warning in warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False, soft_wrap=True)
    if warnings:
        console.print(f"[yellow]warning:[/yellow] these numbers are not this host's own; {RERUN}.", highlight=False,
                      soft_wrap=True)
    result.profile.save(args.profile_out)
    plot(result, args.plot_out)
    console.print(f"profile -> {args.profile_out}, plot -> {args.plot_out}", markup=False)
    if args.json:
        written = write_json(to_dict(result), args.json)
        if written:
            console.print(f"wrote {written}", markup=False, highlight=False, soft_wrap=True)
    return 0
