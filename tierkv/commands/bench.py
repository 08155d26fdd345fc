"""``tierkv bench``: measure this host's links, print them, save a link profile and a plot.

Example::

    tierkv bench --dir /nvme/tierkv --disk-size 1GiB --max-size 1GiB
    tierkv plan ... --profile tierkv-profile.json      # plan with measured links instead of presets

``--quick`` runs small sizes in seconds (the tests use it); its numbers are indicative only. The measuring
and the fit are :mod:`tierkv.calibrate`; this module parses, prints and saves. Errors propagate to
``tierkv.cli.main``, which prints them as one line (exit status 2 for bad arguments, 1 for a failure while
measuring, such as a disk error).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tierkv.calibrate import BenchConfig, BenchResult, Measurement, plot, run_bench
from tierkv.calibrate.attention import ATTENTION
from tierkv.calibrate.consistency import RERUN, contradictions, host_load
from tierkv.commands import (
    add_json_argument,
    existing_dir,
    free_bytes,
    integer,
    json_to_stdout,
    size,
    writable_file,
    write_json,
)
from tierkv.commands.estimate import measure_cpu
from tierkv.commands.progress import seconds
from tierkv.errors import InvalidConfigError
from tierkv.hf.sizing import host_memory
from tierkv.io import ALIGN, ENGINES, engine_status
from tierkv.planner import COMPUTE_FLOPS_KEY, QUICK_NOTE, WARNINGS_KEY
from tierkv.units import format_bytes, plural
from tierkv.vocabulary import LinkName

FULL_RUN = "about 2-4 min on 2 cores, less on more"
"""How long ``tierkv bench`` takes at its default sizes (161 s on the project's 2-core VM)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir", type=existing_dir("--dir", "on the disk to measure"), default=Path(tempfile.gettempdir()),
        help="an existing directory on the disk to measure (put it where the disk tier will live; default: the temp "
             "dir); its test files are removed after",
    )  # fmt: skip
    parser.add_argument("--disk-size", type=_aligned_size("--disk-size"), default=None,
                        help="test file size, a multiple of 4KiB (default 1GiB; 32MiB with --quick)")  # fmt: skip
    parser.add_argument("--max-size", type=_aligned_size("--max-size", aligned=False), default=None,
                        help="largest transfer size, at least 4KiB (default 1GiB; 4MiB with --quick)")  # fmt: skip
    parser.add_argument("--min-size", type=_aligned_size("--min-size"), default=None,
                        help="smallest transfer size, a multiple of 4KiB (default 4KiB)")  # fmt: skip
    parser.add_argument("--block-size", type=_aligned_size("--block-size"), default=None,
                        help="block size of the gather benchmarks, a multiple of 4KiB (default 256KiB; 64KiB with "
                             "--quick)")  # fmt: skip
    parser.add_argument(
        "--engines", default=None,
        help=f"comma-separated disk engines to measure ({', '.join(ENGINES)}; default: all that load here)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=integer("--repeats", 1, MAX_REPEATS), default=None,
                        help="timed repeats per point; the median is kept (default 5; 3 with --quick)")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, 10-40 s on 2 cores; numbers indicative only (smoke tests)")
    parser.add_argument(
        "--threads", type=integer("--threads", 1, MAX_THREADS, "4 threads for each of this host's cores"),
        default=None,
        help="torch intra-op threads for the memory links (default: torch's choice; recorded in the profile)",
    )  # fmt: skip
    parser.add_argument(
        "--profile-out", type=writable_file("--profile-out", "tierkv-profile.json"), default="tierkv-profile.json",
        help="where to write the link profile JSON that tierkv plan --profile reads (default: %(default)s in the "
             "current directory)",
    )  # fmt: skip
    parser.add_argument(
        "--plot-out", type=writable_file("--plot-out", "tierkv-bench.png"), default="tierkv-bench.png",
        help="where to write the bandwidth plot, a PNG (default: %(default)s in the current directory)",
    )  # fmt: skip
    add_json_argument(parser, "every measurement, the fitted profile and the machine")


MAX_REPEATS = 1000  # timed repeats per point: more only multiplies the run's minutes
MAX_THREADS = 4 * (os.cpu_count() or 1)  # torch's pool crashes the process at some tens of thousands
MEMORY_COPIES = 4  # buffers of --max-size the memory links hold at once (a gather's pool is twice its output)


def _aligned_size(option: str, aligned: bool = True) -> Callable[[str], int]:
    """Type of a bench size: at least the disk's sector (O_DIRECT's 4 KiB) and, where ``aligned``, a multiple of
    it (transfer sizes grow from ``--min-size``; blocks and the test file are read with O_DIRECT)."""
    parse = size(option)

    def convert(text: str) -> int:
        nbytes = parse(text)
        if nbytes < ALIGN or (aligned and nbytes % ALIGN):
            what = "a multiple of 4KiB" if aligned else "at least 4KiB"
            raise argparse.ArgumentTypeError(
                f"{option} {text} is {format_bytes(nbytes)}; give {what} (the disk's 4,096-byte sector that O_DIRECT "
                "reads in), e.g. 4KiB, 64KiB or 1MiB.")
        return nbytes

    return convert


def _check_free_space(folder: Path, disk_bytes: int, shown: str) -> None:
    """Refuse a test file larger than the free space under ``--dir`` before any measuring: otherwise the disk
    phase fails only after the memory phases, with the OS's "No space left on device"."""
    free = free_bytes(folder)
    if disk_bytes > free:
        raise InvalidConfigError(f"{shown} does not fit in --dir {str(folder)!r}: {format_bytes(free)} free there; "
                                 "give a smaller --disk-size (a bare number counts GB: e.g. 256MiB), free space, or "
                                 "a --dir on a disk with more room.")


def _engines(text: str | None) -> tuple[str, ...] | None:
    """``--engines``: each name must be an engine that loads here (None: all that do)."""
    if not text:
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
    started = time.perf_counter()
    with log.status("measuring") if log.is_terminal else contextlib.nullcontext() as status:

        def progress(what: str) -> None:
            if status is not None:
                status.update(f"measuring {what}")
            else:
                log.print(f"[{seconds(time.perf_counter() - started)}] measuring {what}", markup=False,
                          soft_wrap=True)

        result = run_bench(cfg, progress=progress)
        progress("matmul FLOP/s (the compute estimate of tierkv plan --device cpu)")
        result.profile.machine[COMPUTE_FLOPS_KEY] = f"{measure_cpu().peak_flops:.4g}"
    warnings = ([busy] if busy else []) + contradictions(result)
    noted = warnings + ([QUICK_NOTE] if args.quick else [])  # last: plan --profile tells it by the end
    if noted:  # plan --profile repeats them
        result.profile.machine[WARNINGS_KEY] = "; ".join(noted)
    m = result.machine
    console.print(f"[bold]tierkv bench[/bold] {m['date']}")
    console.print(f"CPU {m['cpu']}, {m['cores']}, RAM {m['ram']}, GPU {m['gpu']}")
    console.print(f"disk dir {m['disk_dir']}: {m['filesystem']}; kernel {m['kernel']}, torch {m['torch']}")
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
    console.print(f"profile -> {args.profile_out}, plot -> {args.plot_out}")
    if args.json:
        written = write_json(to_dict(result), args.json)
        if written:
            console.print(f"wrote {written}")
    return 0
