"""``tierkv bench``: measure this host's links, print them, save a link profile and a plot.

Example::

    tierkv bench --dir /nvme/tierkv --disk-size 1GiB --max-size 1GiB
    tierkv plan ... --profile tierkv-profile.json      # plan with measured links instead of presets

``--quick`` runs small sizes in seconds (the tests use it); its numbers are indicative only. The measuring
and the fit are :mod:`tierkv.calibrate`; this module parses the options (``--help`` imports no torch),
:mod:`tierkv.commands.bench_run` measures, prints and saves. Errors propagate to
``tierkv.cli.main``, which prints them as one line (exit status 2 for bad arguments, 1 for a failure while
measuring, such as a disk error).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from tierkv.commands import add_json_argument, existing_dir, integer, size, writable_file
from tierkv.io import ALIGN, ENGINES
from tierkv.units import format_bytes

FULL_RUN_S = (120, 360)
"""How long ``tierkv bench`` takes at its default sizes on 2 cores: 161 s on the project's quiet 2-core VM, 4 min 35 s
on a busy one (the store's layers alone take a minute to write there)."""
FULL_RUN = f"about {FULL_RUN_S[0] // 60}-{FULL_RUN_S[1] // 60} min on 2 cores (the longer on a busy host), less on more"


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


def run(args: argparse.Namespace) -> int:
    """Measure and report (:mod:`tierkv.commands.bench_run`, imported here: ``--help`` needs none of torch)."""
    from tierkv.commands import bench_run

    return bench_run.run(args)
