"""Values and paths the command line refuses while it is parsed (one line, exit status 2), which a second CLI
audit found accepted: a thread count that crashes torch, repeat counts of days, an empty engine list, transfer
sizes beyond the RAM, output paths a run could only fail to write at its end, a dangling link for a folder, and
``TIERKV_*`` variables read only after a model loaded (or, for the trace, when the cache closed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_cli import PLAN, assert_one_line_error, tierkv


@pytest.mark.parametrize(("argv", "needles"), [
    (["--threads", "100000"], ["--threads", "at most"]),  # torch's pool segfaulted the process
    (["--repeats", "1000000000"], ["--repeats", "at most"]),
    (["--engines", ","], ["--engines", "names no disk engine"]),  # measured nothing, then a raw ValueError
    (["--max-size", "200GB", "--disk-size", "256MiB"], ["--max-size", "available"]),  # a raw allocator error
])
def test_bench_refuses_values_no_run_can_take(tmp_path: Path, argv: list[str], needles: list[str]) -> None:
    result = tierkv("bench", "--quick", "--dir", str(tmp_path), *argv)
    assert_one_line_error(result, 2, *needles)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("name", "needle"), [("/dev/null", "is a character device"), ("fifo", "is a FIFO"),
                                              ("", "names no file"), ("x" * 300 + ".json", "is longer than"),
                                              ("/proc/plan.json", "is not writable")])
def test_a_json_path_that_cannot_take_a_file_is_refused_while_parsing(tmp_path: Path, name: str,
                                                                      needle: str) -> None:
    """It was accepted, and the whole plan (or bench) ran before the write failed with exit status 1."""
    target = name
    if name == "fifo":
        os.mkfifo(tmp_path / name)
        target = str(tmp_path / name)
    elif name.endswith(".json"):
        target = str(tmp_path / name)
    assert_one_line_error(tierkv(*PLAN, "--context", "8K", "--json", target), 2, "--json", needle)


def test_a_disk_dir_that_is_a_dangling_link_is_refused_while_parsing(tmp_path: Path) -> None:
    """It passed as a folder still to create; the demo then failed after loading its model, naming disk_dir=None."""
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "missing")
    result = tierkv("demo", "--random-model", "--no-reference", "--disk-dir", str(link))
    assert_one_line_error(result, 2, "--disk-dir", "symbolic link", "does not exist")
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize(("variable", "value", "needle"), [
    ("TIERKV_PROFILE", "/etc/hostname", "TIERKV_PROFILE"),  # read only once a cache was built, after the model
    ("TIERKV_TRACE", "/proc/x", "cannot be created"),  # found when the cache closed: a logged traceback, exit 0
    ("TIERKV_CACHE_DIR", "relative/cache", "absolute path"),  # a model cache built again in every folder
])
def test_a_bad_variable_is_refused_before_the_command_starts(variable: str, value: str, needle: str) -> None:
    command = ["demo"] if variable == "TIERKV_TRACE" else [*PLAN, "--context", "8K"]  # (plan traces no cache)
    assert_one_line_error(tierkv(*command, env={variable: value}), 2, variable, needle)


@pytest.mark.parametrize(("argv", "needles"), [
    (["--block-tokens", "1000000", "--context", "512"], ["--block-tokens", "more than the whole sequence"]),
    (["--max-new-tokens", "100000000", "--context", "256"], ["--max-new-tokens (100,000,000)"]),  # named the rest
])
def test_demo_names_the_flag_that_makes_a_run_impossible(tmp_path: Path, argv: list[str], needles: list[str]) -> None:
    """A million-token block reserved GiBs for a 512-token run; a budget too large for the RAM blamed only
    --gpu-gb and --context where --max-new-tokens made it so."""
    result = tierkv("demo", "--random-model", "--no-reference", "--disk-dir", str(tmp_path), *argv)
    assert_one_line_error(result, 2, *needles)


@pytest.mark.parametrize(("argv", "needles"), [
    (["--kind", "multikey", "--lengths", "16"], ["--lengths 16 is too short for --kind multikey", "at least"]),
    (["--samples", "1000000000"], ["--samples", "at most"]),  # said "62 to 248 days", then ran
])
def test_eval_refuses_a_run_it_cannot_or_should_not_make(argv: list[str], needles: list[str]) -> None:
    """The too-short haystack was found after the model loaded, in the library's words (context_tokens=16)."""
    assert_one_line_error(tierkv("eval", "--depths", "0", *argv), 2, *needles)
