"""Regression: budgets beyond the machine refused in flags before any model loads, time left that holds when decode
steps cost more than the prefill's rate says, a line at least every interval however long a part runs, a
misspelt command named, ``--help`` without torch, and README install steps that work as pasted."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from tierkv.cli import SUBCOMMANDS, main
from tierkv.commands import check_fits_machine
from tierkv.commands import progress as progress_module
from tierkv.commands.demo import _costs
from tierkv.commands.eval import _Log
from tierkv.commands.progress import Phases, Remaining, Ticker
from tierkv.errors import InvalidConfigError

ROOT = Path(__file__).resolve().parent.parent
BEYOND_ANY_MACHINE = "100000000"  # GB: 100 PB, more than any machine's RAM or GPU


def _refused(capsys, argv: list[str]) -> str:
    """The one error line of ``tierkv ARGV``, which must exit 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _no_loading(monkeypatch) -> None:
    """Any model load fails the test: the refusals below come before one."""
    from tierkv import models
    from tierkv.demo import model as demo_model

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the budgets were checked")

    monkeypatch.setattr(models, "load", loaded)
    monkeypatch.setattr(models, "load_folder", loaded)
    monkeypatch.setattr(demo_model, "load_demo_model", loaded)


# 1: budgets beyond this machine, in the command's flags, before a model loads
@pytest.mark.parametrize("flag", ["--cpu-gb", "--gpu-gb"])
def test_demo_with_a_real_model_refuses_a_budget_beyond_the_machine_before_loading(monkeypatch, capsys, flag):
    """Regression: ``tierkv demo --model smollm2 --cpu-gb 100`` failed after the load and the plan, with
    ``TieredCache``'s message (``cpu_gb is 93.13 GiB ... cpu_gb=f"{n}B"``)."""
    from tierkv.commands import demo

    _no_loading(monkeypatch)
    monkeypatch.setattr(demo, "require_model_package", lambda name: None)  # the test needs no model package
    line = _refused(capsys, ["demo", "--model", "smollm2", flag, BEYOND_ANY_MACHINE, "--no-reference"])
    assert f"{flag} {BEYOND_ANY_MACHINE} does not fit: this machine has " in line, line
    assert line.endswith(f"give a smaller {flag}.") and "_gb" not in line, line


def test_demo_with_a_checkpoint_folder_refuses_a_budget_beyond_the_machine_before_loading(monkeypatch, capsys,
                                                                                       tmp_path):
    _no_loading(monkeypatch)
    (tmp_path / "config.json").write_text("{}")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("some text")
    line = _refused(capsys, ["demo", "--model", str(tmp_path), "--prompt-file", str(prompt), "--gpu-gb", "100000TB"])
    assert "--gpu-gb 100000TB does not fit: this machine has " in line and "gpu_gb" not in line, line


@pytest.mark.parametrize("flag", ["--cpu-gb", "--gpu-gb"])
def test_eval_tiered_refuses_a_budget_beyond_the_machine_before_loading(monkeypatch, capsys, flag):
    _no_loading(monkeypatch)
    line = _refused(capsys, ["eval", "--lengths", "4K", "--samples", "1", "--depths", "0.5", "--cache", "tiered",
                             flag, BEYOND_ANY_MACHINE])
    assert f"{flag} {BEYOND_ANY_MACHINE} does not fit: this machine has " in line and "_gb" not in line, line


def test_a_default_budget_beyond_the_machine_names_the_option_that_shrinks_it():
    with pytest.raises(InvalidConfigError) as refused:
        check_fits_machine("--cpu-gb", 10**17, "1/4 of the KV", "--context")
    assert re.fullmatch(r"--cpu-gb 100000000 \(1/4 of the KV, the default\) does not fit: this machine has .+ of "
                        r"RAM.*; give a smaller --cpu-gb or --context\.", str(refused.value)), refused.value


# 2: the reference check's time left with a prompt file
def test_decode_steps_are_timed_apart_from_the_prefill():
    """Regression: a 1,532-token prompt (2 prefill chunks) and 64 new tokens said "2/65 done, about 1.7 s to go" and
    ran 57 s more: the prefill's rate was applied to decode steps that took 0.9 s each on a CPU."""
    now, said = [0.0], []
    console = Console(file=io.StringIO())
    console.print = lambda text, **_: said.append(text)  # type: ignore[method-assign]
    remaining = Remaining(console, "reference check", *_costs(1532, 64, 1024), every_s=0.5, clock=lambda: now[0])
    for took in (10.0, 12.4, *[0.9] * 3):  # the two chunks, then three decode steps of the 63
        now[0] += took
        remaining.part_done()
    assert said[1] == "reference check: 2/65 done (prefill done; measuring the rate of the 63 decode steps left)"
    assert said[2] == "reference check: 3/65 done (prefill done; measuring the rate of the 62 decode steps left)"
    left = float(re.search(r"about ([\d.]+) s to go", said[-1]).group(1))  # type: ignore[union-attr]
    assert left == pytest.approx(0.9 * 60, rel=0.05), said[-1]


def test_the_prefill_time_left_says_decode_steps_follow():
    now, said = [0.0], []
    console = Console(file=io.StringIO())
    console.print = lambda text, **_: said.append(text)  # type: ignore[method-assign]
    remaining = Remaining(console, "tiered run", [1.0] * 4, [1.0] * 3, every_s=0.5, clock=lambda: now[0])
    for _ in range(2):
        now[0] += 2.0
        remaining.part_done()
    assert said[-1] == "tiered run: 2/7 done, about 4.0 s of prefill to go, then 3 decode steps"


# 3: a line at least every interval, however long a part runs
def test_a_part_longer_than_the_interval_is_not_silent():
    """Regression: a 26 s prefill chunk left the log silent for 26 s though docs/demo.md promises a line every
    10 s; the ticker says the part running and the time left meanwhile."""
    now, said = [0.0], []
    console = Console(file=io.StringIO())
    console.print = lambda text, **_: said.append((now[0], text))  # type: ignore[method-assign]
    remaining = Remaining(console, "run", [1.0] * 4, every_s=10.0, clock=lambda: now[0])
    for _ in range(2):  # two 1 s parts: rate measured, nothing due
        now[0] += 1.0
        remaining.part_done()
    for _ in range(26):  # the third part runs 26 s; the ticker checks every second
        now[0] += 1.0
        remaining.ticker.tick()
    assert [t for t, _ in said] == [10.0, 20.0], said
    assert said[0][1] == "run: 2/4 done, the next running for 8.0 s, about 1.0 s to go", said


def _wait_for(buffer: io.StringIO, text: str) -> str:
    """What ``buffer`` holds once ``text`` is in it (the ticker's thread writes it), or after a minute."""
    for _ in range(600):
        if text in buffer.getvalue():
            break
        time.sleep(0.1)
    return buffer.getvalue()


def test_the_ticker_thread_says_lines_until_its_block_ends():
    heard = threading.Event()
    with Ticker(lambda silent_s: heard.set(), every_s=0.01):
        assert heard.wait(60)


def test_an_announced_phase_says_its_time_so_far_in_a_log(monkeypatch):
    monkeypatch.setattr(progress_module, "REESTIMATE_S", 0.01)
    log = io.StringIO()
    with Phases(Console(file=log, width=200)).phase("dequantising the GGUF", announce=True):
        assert "dequantising the GGUF: " in _wait_for(log, "so far")
    assert re.search(r"^dequantising the GGUF: [\d.]+ s so far$", log.getvalue(), re.M), log.getvalue()


def test_the_quality_runs_say_they_are_still_running(monkeypatch):
    """Regression: ``tierkv eval --model smollm2 --tasks needle`` was silent 23 s while a prompt ran."""
    monkeypatch.setattr(progress_module, "REESTIMATE_S", 0.01)
    log = io.StringIO()
    with _Log(Console(file=log, width=200)) as status:
        status.log("full attention on 1 prompt")
        assert "since the last line of the run" in _wait_for(log, "still running")


# 4: README's own-project install steps work as pasted
def test_the_own_project_install_puts_the_cpu_torch_first_and_installs_build():
    readme = (ROOT / "README.md").read_text()
    own = readme[readme.index("To use tierkv in a project of your own"):readme.index("## Use it")]
    cpu_torch = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert cpu_torch in own and own.index(cpu_torch) < own.index('pip install ".[redis,metrics,aio]"'), own
    assert "pip install build && python -m build" in own, own


# 5: a misspelt command
def test_a_misspelt_command_is_named(capsys):
    line = _refused(capsys, ["bnch"])
    assert line == "tierkv: error: invalid choice: 'bnch' (did you mean bench?); see tierkv --help", line


# 6: --help imports neither torch nor transformers
@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_help_imports_neither_torch_nor_transformers(command):
    """Regression: ``tierkv eval --help`` took 9.4 s on a loaded host, importing torch and transformers to list
    options."""
    code = ("import contextlib, io, sys\nfrom tierkv.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()):\n    assert main([{command!r}, '--help']) == 0\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
