"""What a newcomer tripped over in a first hour with the ``tierkv`` command, each run as they ran it (subprocesses,
real files): a misspelt option reported as a missing one, tracebacks and late errors where a one-line usage error
belongs, runs that could never fit the disk or RAM refused only minutes in, silently ignored options, an estimate
in millions of minutes, and an eval whose long trials said nothing for minutes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import psutil
import pytest
import torch
from transformers import LlamaConfig

from tierkv import TieredCache
from tierkv.commands.progress import seconds
from tierkv.demo.evaluate import greedy_generate
from tierkv.demo.model import WEIGHTS_DIR, load_demo_model

PLAN = ["plan", "--model", "llama-3-8b", "--context", "8K", "--gpu-gb", "20", "--cpu-gb", "1"]


def tierkv(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``tierkv ARGV`` as a user runs it (no TIERKV_* of the test run's environment)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")} | (env or {})
    return subprocess.run([sys.executable, "-m", "tierkv.cli", *argv], capture_output=True, text=True,
                          env=environment, timeout=timeout)


def one_line_error(result: subprocess.CompletedProcess, status: int = 2) -> str:
    """The single stderr line of a failed command (nothing else printed: no traceback, no progress)."""
    assert result.returncode == status, result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, result.stderr
    assert line.startswith("tierkv "), line
    return line


def test_a_misspelt_option_is_named_not_the_required_one_it_hides():
    line = one_line_error(tierkv("plan", "--model", "llama-3-8b", "--contxt", "8K", "--gpu-gb", "20",
                                 "--cpu-gb", "1"))
    assert "unrecognized arguments: --contxt" in line and "did you mean --context?" in line, line
    assert "required" not in line, line


def test_plan_refuses_a_zero_compute_time_while_parsing():
    line = one_line_error(tierkv(*PLAN, "--compute-ms-per-token", "0"))
    assert "--compute-ms-per-token='0' must be a number > 0" in line, line


@pytest.mark.parametrize(("value", "needle"), [("0", "must be a number > 0"), ("inf", "must be a finite number > 0")])
def test_plan_refuses_a_host_rate_it_cannot_use_in_its_own_flag(value, needle):
    line = one_line_error(tierkv(*PLAN, "--host-dram-gbps", value))
    assert f"--host-dram-gbps='{value}' {needle}" in line and "bytes per second" not in line, line


def test_a_bad_tierkv_variable_fails_before_any_work_without_a_traceback():
    line = one_line_error(tierkv("demo", "--context", "2K", "--no-reference", env={"TIERKV_PREFETCH_MIN": "-1"}))
    assert line.startswith("tierkv demo: error: TIERKV_PREFETCH_MIN='-1'"), line


def test_bench_refuses_a_test_file_the_disk_cannot_hold(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    too_big = (2 * free + (1 << 30)) // 4096 * 4096
    line = one_line_error(tierkv("bench", "--quick", "--dir", str(tmp_path), "--disk-size", f"{too_big}B"))
    assert "does not fit in --dir" in line and "free there" in line and "--disk-size" in line, line
    assert list(tmp_path.iterdir()) == []


def test_demo_refuses_a_disk_dir_without_room_before_loading(tmp_path):
    if not (WEIGHTS_DIR / "config.json").is_file():
        pytest.skip("the demo model's weights are not installed")
    model_config = LlamaConfig.from_pretrained(WEIGHTS_DIR)
    per_token = TieredCache.kv_bytes_per_token(model_config, torch.float32)
    context = (shutil.disk_usage(tmp_path).free + (4 << 30)) // per_token
    line = one_line_error(tierkv("demo", "--context", str(context), "--gpu-gb", "1", "--cpu-gb", "1",
                                 "--disk-dir", str(tmp_path), "--no-reference"))
    assert f"--disk-dir '{tmp_path}' has" in line and "free" in line and "--context" in line, line


def test_demo_refuses_a_host_budget_beyond_ram_in_its_flags_before_loading():
    ram = psutil.virtual_memory().total
    line = one_line_error(tierkv("demo", "--context", "2K", "--cpu-gb", f"{2 * ram}B", "--no-reference"))
    assert "--cpu-gb" in line and "of RAM" in line and "cpu_gb" not in line, line


def test_eval_refuses_quality_options_it_would_ignore():
    line = one_line_error(tierkv("eval", "--budgets", "0.1"))
    assert "--budgets applies only to the sparse attention quality runs" in line and "--tasks" in line, line


def test_eval_says_how_long_and_keeps_its_table_title_on_one_line():
    result = tierkv("eval", "--lengths", "256", "--depths", "0", "--samples", "1")
    assert result.returncode == 0, result.stderr
    announce = next(line for line in result.stderr.splitlines() if line.startswith("1 trial: "))
    assert "in all by this host's speed now" in announce and "between " in announce, announce
    assert result.stdout.splitlines()[0].strip() == "passkey accuracy, greedy, 1 haystack per cell", result.stdout


def test_eval_prefill_reports_each_chunk():
    """A 64K trial prefills for minutes: ``on_prefill`` hears of every chunk, so ``tierkv eval`` can say so."""
    model, _ = load_demo_model()
    heard: list[tuple[int, int]] = []
    greedy_generate(model, list(range(5, 205)), 1, prefill_chunk_size=64, on_prefill=lambda *n: heard.append(n))
    assert heard == [(64, 200), (128, 200), (192, 200), (200, 200)]


def test_a_named_model_typo_reads_as_one_sentence():
    line = one_line_error(tierkv("demo", "--model", "smolm2"))
    assert "or a named model: demo, smollm2, gemma3." in line and ". (" not in line, line


@pytest.mark.parametrize(("value", "text"), [(59.94, "59.9 s"), (125, "2 min 05 s"), (12_000, "3 h 20 min"),
                                             (1e9, "11,574 days")])
def test_long_estimates_read_in_hours_and_days(value, text):
    assert seconds(value) == text

