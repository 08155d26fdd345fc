"""Where the CLI's output goes: a reader that leaves (``| head``), a full disk, a closed stdout, a locale that cannot
encode a character, a CI log with ``FORCE_COLOR``, a narrow terminal, a path that reads as rich markup. Each is a
real process writing to a real pipe or file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PLAN = ["plan", "--model", "llama-3-8b", "--context", "1M", "--gpu-gb", "20", "--cpu-gb", "128", "--link", "pcie5"]
ELLIPSIS = "\N{HORIZONTAL ELLIPSIS}"
DEMO = ["demo", "--random-model", "--context", "512", "--block-tokens", "16", "--prefill-chunk", "256",
        "--chunk-tokens", "128", "--max-new-tokens", "8", "--no-reference"]


def _environment(**extra: str) -> dict[str, str]:
    drop = ("TIERKV_DEBUG", "PYTHONUNBUFFERED", "FORCE_COLOR", "NO_COLOR", "COLUMNS", "PYTHONIOENCODING")
    return {k: v for k, v in os.environ.items() if k not in drop} | extra


def _command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "tierkv.cli", *argv]


@pytest.mark.parametrize("unbuffered", ["", "1"])
@pytest.mark.parametrize("argv", [PLAN, ["--help"], [*PLAN, "--json", "-"]])
def test_a_reader_that_leaves_ends_the_command_quietly(argv, unbuffered):
    """``tierkv plan | head -1``: the pipe's reader gone, the command printed "Exception ignored ...
    BrokenPipeError" (exit 120) or "error: Broken pipe; check the path and its permissions" (exit 1). It ends as a
    process killed by SIGPIPE would: nothing on stderr but what it printed there before, exit 141 (``--help``
    unbuffered: argparse drops the failed write itself and exits 0)."""
    read, write = os.pipe()
    os.close(read)  # the reader left before the first line
    environment = _environment(**({"PYTHONUNBUFFERED": unbuffered} if unbuffered else {}))
    try:
        result = subprocess.run(_command(*argv), stdout=write, stderr=subprocess.PIPE, text=True, env=environment,
                                timeout=120)
    finally:
        os.close(write)
    assert result.returncode == (0 if argv == ["--help"] and unbuffered else 141), result.stderr
    for noise in ("Exception ignored", "Broken pipe", "BrokenPipeError", "Traceback", "error:"):
        assert noise not in result.stderr, result.stderr
    assert result.stderr == "" or argv[-1] == "-"  # --json -: the tables went to stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize(("argv", "unbuffered"), [(PLAN, ""), (PLAN, "1"), (["--help"], ""), (DEMO, ""), (DEMO, "1")])
def test_a_full_disk_under_a_redirection_is_one_line(argv, unbuffered):
    """``tierkv plan > /dev/full`` said "No space left on device; free space there, or choose another path" and then
    "Exception ignored ... OSError" at exit (120): now one line that says the output could not be written. Unbuffered
    (``PYTHONUNBUFFERED=1``), a write that failed left nothing to flush, and the plan and the demo said the first
    again, never naming the output. (``--help`` unbuffered: argparse drops the failed write itself and exits 0.)"""
    environment = _environment(**({"PYTHONUNBUFFERED": unbuffered} if unbuffered else {}))
    with open("/dev/full", "w") as full:
        result = subprocess.run(_command(*argv), stdout=full, stderr=subprocess.PIPE, text=True, env=environment,
                                timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("error:") == 1 and "Exception ignored" not in result.stderr, result.stderr
    assert argv == DEMO or "\n" not in result.stderr.strip(), result.stderr  # the demo's progress lines come first
    line = result.stderr.strip().splitlines()[-1]
    assert line.endswith("error: cannot write the output: No space left on device"), result.stderr


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_a_demo_into_a_file_on_a_full_disk_is_one_line(tmp_path, unbuffered):
    """``tierkv demo > out.txt`` on a filesystem that is full, unbuffered: the result table's write was dropped whole
    and the command said "No space left on device; free space there, or choose another path", never naming the
    output."""
    from helpers import tiny_tmpfs

    environment = _environment(**({"PYTHONUNBUFFERED": unbuffered} if unbuffered else {}))
    with tiny_tmpfs(tmp_path / "full", "64k") as full:
        (full / "filler").write_bytes(b"\0" * 64 * 1024)
        with open(full / "out.txt", "w") as out:
            result = subprocess.run(_command(*DEMO), stdout=out, stderr=subprocess.PIPE, text=True,
                                    env=environment, timeout=300)
    assert result.returncode == 1, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line == "tierkv demo: error: cannot write the output: No space left on device", result.stderr


def test_json_to_a_closed_stdout_names_the_fix():
    """``--json -`` with stdout closed (``>&-``) was an AttributeError traceback."""
    result = subprocess.run(_command(*PLAN, "--json", "-"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=_environment(), timeout=120, preexec_fn=lambda: os.close(1))
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line == "tierkv plan: error: --json -: stdout is closed; give --json a file path.", result.stderr


def test_plan_at_40_columns_cuts_no_number():
    """At 40 columns rich cut cells short with an ellipsis: a speed-up of 3.33 read "3." and an ellipsis."""
    result = subprocess.run(_command(*PLAN), capture_output=True, text=True, env=_environment(COLUMNS="40"),
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "what-if" in result.stdout and ELLIPSIS not in result.stdout, result.stdout


def test_a_demo_in_a_ci_log(tmp_path):
    """A CI job's log: ``FORCE_COLOR=1`` made rich take it for a terminal (the log filled with spinner redraws, tens
    of KB a second of cursor movements, and none of the lines a log gets); an ASCII-only stdout
    (``PYTHONIOENCODING=ascii``, a C or Latin-1 locale) made the result table's cut answer (its ellipsis) a
    UnicodeEncodeError traceback after the whole run; a ``--json`` path holding ``[...]`` was read as markup
    (``wrote out.json`` named another file)."""
    target = tmp_path / "out[v2].json"
    demo = ["demo", "--random-model", "--context", "512", "--block-tokens", "16", "--prefill-chunk", "256",
            "--chunk-tokens", "128", "--max-new-tokens", "48", "--no-reference", "--json", str(target)]
    result = subprocess.run(_command(*demo), capture_output=True, timeout=300,
                            env=_environment(FORCE_COLOR="1", PYTHONIOENCODING="ascii"))
    err = result.stderr.decode("ascii", "replace")
    assert result.returncode == 0, err
    assert "\x1b[1A" not in err and "\x1b[2K" not in err, err[:2000]
    assert "prefill 512 tokens through the tiers: " in err and "Traceback" not in err, err
    assert f"wrote {target}\n" in err and len(json.loads(target.read_text())["answer"]) > 40
    assert b"..." in result.stdout  # the cut answer's cell


def test_a_closed_terminal_ends_the_demo_with_129_and_no_files_left(tmp_path):
    """A real hangup (the terminal's other side closes): SIGHUP comes and every later write to the terminal fails
    (EIO), which replaced the interrupt: exit 1 with "Input/output error; check the path". It is 129, and the
    disk tier's files are gone."""
    import pty
    import select
    import time

    pid, terminal = pty.fork()
    if pid == 0:  # the child: the demo on the pseudo-terminal
        os.environ.update(TMPDIR=str(tmp_path), TERM="xterm")
        os.environ.pop("TIERKV_DEBUG", None)
        os.execv(sys.executable, [sys.executable, "-m", "tierkv.cli", "demo", "--random-model", "--context", "8K",
                                  "--no-reference", "--max-new-tokens", "2K"])
    seen, deadline = b"", time.monotonic() + 240
    while not list(tmp_path.glob("tierkv-*")) and time.monotonic() < deadline:  # until the tiered run began
        if select.select([terminal], [], [], 0.1)[0]:
            try:
                seen += os.read(terminal, 65536)
            except OSError:
                break
    assert list(tmp_path.glob("tierkv-*")), seen[-2000:]
    os.close(terminal)  # hang up
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 129
    assert list(tmp_path.glob("tierkv-*")) == []


def test_main_in_process_gives_the_callers_streams_back():
    """``tierkv.cli.main()`` called from a program: the streams' error handling it sets for the run is undone, and a
    reader that left stdout does not take the caller's stderr away."""
    script = (
        "import os, sys\n"
        "from tierkv.cli import main\n"
        "before = sys.stdout.errors\n"
        "read, write = os.pipe(); os.close(read)\n"
        "saved = os.dup(1); os.dup2(write, 1)\n"
        "code = main(['plan', '--model', 'llama-3-8b', '--context', '8K', '--gpu-gb', '20', '--cpu-gb', '64'])\n"
        "os.dup2(saved, 1)\n"
        "print('code', code, 'errors kept', sys.stdout.errors == before, file=sys.stderr, flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_environment(),
                            timeout=120)
    assert result.stderr.strip().splitlines()[-1] == "code 141 errors kept True", result.stderr


def test_memory_the_process_cannot_get_is_one_line():
    """An allocation refused mid-run (a ulimit -v here; a container's limit elsewhere) printed torch's traceback from
    wherever it happened; it is one line that says what ran out, exit 1."""
    script = (
        "import resource, sys, torch, transformers, tierkv.cli, tierkv.hf, tierkv.demo.model\n"
        "size = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
        "resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 20), resource.RLIM_INFINITY))\n"
        "sys.exit(tierkv.cli.main(['demo', '--context', '8K', '--no-reference']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=_environment())
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr[-2000:]
    assert errors[-1].startswith("tierkv demo: error: out of memory: this process could not get"), errors
    assert "Traceback" not in done.stderr
