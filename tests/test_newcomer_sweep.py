"""What a newcomer tripped over in a first hour with the ``tierkv`` command, each run as they ran it (subprocesses,
real files): a misspelt option reported as a missing one, tracebacks and late errors where a one-line usage error
belongs, runs that could never fit the disk or RAM refused only minutes in, silently ignored options, an estimate
in millions of minutes, and an eval whose long trials said nothing for minutes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import psutil
import pytest
import torch

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
    """With the random model: the demo model takes no context that long (its max_position_embeddings)."""
    from tierkv.commands.demo import _random_config

    per_token = TieredCache.kv_bytes_per_token(_random_config(64), torch.float32)
    context = (shutil.disk_usage(tmp_path).free + (4 << 30)) // per_token
    line = one_line_error(tierkv("demo", "--random-model", "--context", str(context), "--gpu-gb", "1", "--cpu-gb",
                                 "1", "--disk-dir", str(tmp_path), "--no-reference"))
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



# --------------------------------------------------------------------------- second sweep: names, limits, wording
@pytest.mark.parametrize(("name", "planned"), [("smollm2", "smollm2-135m"), ("gemma3", "gemma3-270m"),
                                               ("demo", "demo")])
def test_plan_takes_the_model_names_demo_takes(name, planned, capsys):
    from tierkv.cli import main

    assert main(["plan", "--model", name, "--context", "4K", "--gpu-gb", "1", "--cpu-gb", "1", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == planned


def test_the_demo_model_is_planned_from_its_shipped_config():
    from tierkv.model_presets import resolve_model

    demo = resolve_model("demo")
    config = json.loads((WEIGHTS_DIR / "config.json").read_text())
    assert (demo.layers, demo.kv_heads, demo.head_dim, demo.max_positions) == (
        config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"],
        config["max_position_embeddings"])


@pytest.mark.parametrize("name", ["gemma3", "demo"])
def test_a_name_means_the_same_model_to_plan_and_demo_and_a_folder_is_a_path(tmp_path, monkeypatch, name):
    """``--model gemma3`` is Gemma 3 270M to plan as to demo, whatever folders the working directory holds (an empty
    ``./demo`` made plan fail); the folder is read when given as a path (``./gemma3``)."""
    from tierkv.model_presets import resolve_model

    config = json.loads((WEIGHTS_DIR / "config.json").read_text())
    config["num_hidden_layers"] = 7
    (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path)
    named = resolve_model(name)
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert resolve_model(name) == named and named.layers != 7
    assert resolve_model(f"./{name}").layers == 7


@pytest.mark.parametrize(("typed", "suggested"), [("llama3-8b", "'llama-3-8b'"), ("smolm2", "'smollm2'"),
                                                  ("qwen", "'qwen2.5-7b'")])
def test_plan_suggests_the_closest_model_name(typed, suggested, capsys):
    from tierkv.cli import main

    assert main(["plan", "--model", typed, "--context", "4K", "--gpu-gb", "1", "--cpu-gb", "1"]) == 2
    err = capsys.readouterr().err
    assert f"unknown model '{typed}'; did you mean {suggested}?" in err, err


def test_a_token_count_of_new_tokens_suggests_counts_that_fit(capsys):
    from tierkv.cli import main

    assert main(["demo", "--max-new-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "must be at least 1 token; e.g. 16, 64 or '1K' (1024)" in err and "131072" not in err, err


@pytest.fixture
def no_run(monkeypatch):
    """The demo stops where it would build its haystack: what it printed before that is the test's."""
    import tierkv.commands.demo as demo

    monkeypatch.setattr(demo, "_run", lambda args: 0)


@pytest.mark.parametrize(("context", "decoded"), [("150K", 16), ("128K", 16), ("131061", 12)])
def test_demo_refuses_a_context_past_its_models_positions(capsys, no_run, context, decoded):
    """The prompt is --context tokens and the tokens decoded come after it: 128K and 16 more are past 131072."""
    from tierkv.cli import main

    argv = ["demo", "--context", context] + (["--max-new-tokens", str(decoded)] if decoded != 16 else [])
    assert main(argv) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"tierkv demo: error: --context {context}: demo takes at most 131072 positions "
                           f"(max_position_embeddings), {decoded} of them for the tokens it decodes; give "
                           "--context "), line
    assert main(["demo", "--context", str(131072 - decoded), "--max-new-tokens", str(decoded)]) == 0


def _demo_args(*argv: str):
    from tierkv.cli import build_parser

    return build_parser("demo").parse_args(["demo", *argv])


def test_demo_notes_a_context_past_its_trained_positions():
    from tierkv.commands.demo import _untrained_note

    note = _untrained_note(_demo_args("--context", "100K"))
    assert note is not None and note.startswith("--context 100K is past demo's trained 80000 tokens"), note
    assert _untrained_note(_demo_args("--context", "64K")) is None
    assert _untrained_note(_demo_args("--random-model", "--context", "100K")) is None


def test_a_random_model_takes_any_context(no_run):
    from tierkv.cli import main

    assert main(["demo", "--random-model", "--context", "150K"]) == 0


@pytest.mark.parametrize(("budgets", "where"), [
    (["--gpu-gb", "1", "--cpu-gb", "1"], "all of it on the device, none on host or disk"),
    (["--gpu-gb", "1MB", "--cpu-gb", "1"], "the rest on the host, none on disk"),
    (["--gpu-gb", "1MB", "--cpu-gb", "1KB"], "the rest on disk"),
])  # fmt: skip
def test_the_demo_plan_says_where_the_kv_goes(budgets, where, tmp_path, capsys):
    from tierkv.cli import main

    assert main(["demo", "--random-model", "--context", "512", "--block-tokens", "16", "--prefill-chunk", "256",
                 "--chunk-tokens", "128", "--max-new-tokens", "2", "--no-reference", "--disk-dir", str(tmp_path),
                 *budgets, "--json", str(tmp_path / "out.json")]) == 0
    plan = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("plan: "))
    assert f"(host), {where}, decode" in plan, plan
    resident = json.loads((tmp_path / "out.json").read_text())["bytes_resident"]
    assert (resident["disk"] > 0) == (where == "the rest on disk")
    assert (resident["host"] > 0) == (where == "the rest on the host, none on disk")


def test_settings_describe_prints_a_table_and_stays_a_dict(monkeypatch):
    from tierkv import settings

    for variable in [name for name in os.environ if name.startswith("TIERKV_")]:
        monkeypatch.delenv(variable)
    with settings.override(io_queue_depth=4):
        described = settings.describe()
    assert described["io_queue_depth"] == (4, "override(io_queue_depth=4)")
    lines = str(described).splitlines()
    assert lines[0].split() == ["variable", "value", "source"] and len(lines) == len(settings.SETTINGS) + 1
    row = next(line for line in lines if line.startswith("TIERKV_IO_QUEUE_DEPTH "))
    assert row.split() == ["TIERKV_IO_QUEUE_DEPTH", "4", "override(io_queue_depth=4)"]
    assert next(line for line in lines if line.startswith("TIERKV_DISK_ENGINE ")).split()[-1] in (
        "default", "environment")


@pytest.mark.parametrize("command", [["demo", "--context", "1K", "--gpu-gb", "1KB"],
                                     ["eval", "--stage", "measure"]])
def test_on_a_terminal_the_imports_show_a_spinner_at_once(command):
    """The seconds demo and eval spend importing torch and transformers showed nothing (eval) before the first
    phase: on a terminal (a real pseudo-terminal here) a spinner names them; the run's usage error follows."""
    import pty

    primary, secondary = pty.openpty()
    environment = {k: v for k, v in os.environ.items() if k not in ("TIERKV_DEBUG", "NO_COLOR")} | {"TERM": "xterm"}
    process = subprocess.Popen([sys.executable, "-m", "tierkv.cli", *command], stdin=secondary, stdout=secondary,
                               stderr=secondary, env=environment, close_fds=True)
    os.close(secondary)
    seen = b""
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # the terminal closed: the process ended
            break
        if not chunk:
            break
        seen += chunk
    os.close(primary)
    assert process.wait(timeout=120) == 2, seen
    text = seen.decode(errors="replace")
    assert "importing torch and transformers" in text and "error:" in text, text
    assert text.index("importing torch and transformers") < text.index("error:")
