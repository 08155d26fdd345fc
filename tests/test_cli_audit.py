"""The newcomer audit's CLI findings (/tmp/audit_newcomer/REPORT.md #1-3, 6-8, 11-13): each through the real
command where it can be, no timing assertions."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from test_cli import PLAN, assert_one_line_error, tierkv

from tierkv.bandwidth import HostAttention, Link, LinkProfile
from tierkv.calibrate import BenchResult, Measurement
from tierkv.calibrate.consistency import contradictions
from tierkv.cli import main
from tierkv.commands.progress import Phases, Remaining, between, first_load, load_label, quiet_transformers
from tierkv.planner import WARNINGS_KEY, host_attention_rate
from tierkv.staging import DEFAULT_REST_BITS

KiB, MiB = 1 << 10, 1 << 20


def _plan_json(tmp_path: Path, capsys, *argv: str) -> tuple[dict, str]:
    out = tmp_path / "plan.json"
    assert main([*argv, "--json", str(out)]) == 0, capsys.readouterr().err
    return json.loads(out.read_text()), " ".join(capsys.readouterr().out.split())


def _sparse(data: dict) -> dict:
    return next(e for e in data["executors"] if e["executor"] == "sparse")


# #1: plan prices sparse as cache.sparse() runs it
def test_plan_prices_sparse_with_the_librarys_rest_copy(tmp_path, capsys):
    default, _ = _plan_json(tmp_path, capsys, *PLAN, "--context", "128K")
    library, _ = _plan_json(tmp_path, capsys, *PLAN, "--context", "128K", "--sparse-rest-bits",
                            str(DEFAULT_REST_BITS))
    bare, _ = _plan_json(tmp_path, capsys, *PLAN, "--context", "128K", "--sparse-rest-bits", "0")
    assert _sparse(default)["staging_bytes"] == _sparse(library)["staging_bytes"] > _sparse(bare)["staging_bytes"]


def test_readme_plan_says_sparse_does_not_fit_and_the_way_out(tmp_path, capsys):
    argv = ["plan", "--model", "llama-3-8b", "--context", "1M", "--gpu-gb", "20", "--cpu-gb", "128", "--link",
            "pcie5", "--disk", "nvme-gen4"]
    data, printed = _plan_json(tmp_path, capsys, *argv)
    assert not _sparse(data)["fits"] and "--sparse-rest-bits 0" in _sparse(data)["reason"]
    assert "better choice" not in printed
    enough = re.search(r"--sparse-rest-bits 0 \(.*--gpu-gb (\d+) is enough", _sparse(data)["reason"])
    assert enough, _sparse(data)["reason"]
    data, _ = _plan_json(tmp_path, capsys, *argv, "--sparse-rest-bits", "0")
    assert not _sparse(data)["fits"]  # 20 GB: still short of the selection, its summaries and the open blocks
    data, _ = _plan_json(tmp_path, capsys, *[a if a != "20" else enough[1] for a in argv], "--sparse-rest-bits", "0")
    assert _sparse(data)["fits"]  # the budget the advice names


# #7: one grammar for a sparse budget
def test_plan_takes_a_fraction_of_the_context_as_demo_does(tmp_path, capsys):
    data, printed = _plan_json(tmp_path, capsys, *PLAN, "--context", "32K", "--sparse-tokens", "0.1")
    assert "sparse, 3,276 tokens" in printed
    count, _ = _plan_json(tmp_path, capsys, *PLAN, "--context", "32K", "--sparse-tokens", "3276")
    assert _sparse(data)["predicted_step_s"] == _sparse(count)["predicted_step_s"]


@pytest.mark.parametrize("command", [[*PLAN, "--context", "32K"], ["demo", "--executor", "sparse"]])
def test_a_bad_sparse_budget_names_both_forms_in_plan_and_demo(command):
    assert_one_line_error(tierkv(*command, "--sparse-tokens", "1.5"), 2, "--sparse-tokens='1.5'",
                          "a count (2048, 2K) or a fraction in (0, 1] (0.1)")


def test_plan_notes_a_sparse_budget_that_covers_the_context(tmp_path, capsys):
    data, printed = _plan_json(tmp_path, capsys, *PLAN, "--context", "32K", "--sparse-tokens", "1M")
    assert "--sparse-tokens 1M covers the whole 32K-token context" in printed and len(data["notes"]) == 2


# #13: a context past the model's trained length is noted, not refused
def test_plan_notes_a_context_past_the_trained_length(tmp_path, capsys):
    argv = ["plan", "--model", "smollm2-135m", "--gpu-gb", "8", "--cpu-gb", "64"]
    data, printed = _plan_json(tmp_path, capsys, *argv, "--context", "1M")
    assert "note: --context 1M is past smollm2-135m's trained 8K tokens" in printed and len(data["notes"]) == 1
    data, printed = _plan_json(tmp_path, capsys, *argv, "--context", "8K")
    assert data["notes"] == [] and "note:" not in printed


def test_a_config_files_trained_length_is_read(tmp_path, capsys):
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "vocab_size": 100,
              "max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, printed = _plan_json(tmp_path, capsys, "plan", "--model", str(tmp_path / "config.json"), "--context", "4K",
                            "--gpu-gb", "1", "--cpu-gb", "1")
    assert "past" in printed and "trained 2K tokens" in printed


# #3: bench's contradictions, the rate plans use, and plan repeating the warnings
def _result(attention: HostAttention | None, memcpy_64k_s: float) -> BenchResult:
    points = [Measurement("host->host", "memcpy", size, size, 1, s)
              for size, s in ((64 * KiB, memcpy_64k_s), (MiB, 10e-6), (4 * MiB, 40e-6))]
    profile = LinkProfile({"host->host": Link("memcpy", 100e9, 0.0)}, {}, host_attention=attention)
    return BenchResult(points, profile, {})


def test_bench_names_points_that_contradict_each_other():
    assert contradictions(_result(HostAttention(20e9, 10e9, 2), 1e-6)) == []
    found = contradictions(_result(HostAttention(0.9e9, 30e9, 2), 6.5e-3))
    assert len(found) == 2
    assert found[0].startswith("host->host memcpy: 64.00 KiB took 650x as long as 1.00 MiB")
    assert found[1].startswith("host attention: 2 threads measured 0.90 GB/s, below 1 thread's 30.00 GB/s")


def test_plans_use_the_one_thread_rate_where_every_thread_measured_slower():
    profile = LinkProfile({"host->host": Link("memcpy", 100e9, 0.0)}, {}, host_attention=HostAttention(0.9e9, 30e9, 2))
    rate = host_attention_rate(profile)
    assert rate.bytes_per_s == 30e9 and "1 thread" in rate.source and "2 threads measured slower" in rate.source


def test_plan_repeats_the_warnings_of_a_doubtful_profile(tmp_path, capsys):
    path = tmp_path / "profile.json"
    profile = LinkProfile.from_presets("pcie4", "nvme-gen4")
    profile.machine[WARNINGS_KEY] = "the host was busy"
    profile.save(path)
    data, printed = _plan_json(tmp_path, capsys, "plan", "--model", "smollm2-135m", "--context", "8K", "--gpu-gb",
                               "0.05", "--cpu-gb", "1", "--profile", str(path))
    assert "the --profile was measured with warnings (the host was busy)" in printed and len(data["notes"]) == 1


# #2: time estimates that hold
def test_time_left_is_measured_past_the_first_part_and_re_estimated():
    now = [0.0]
    said: list[str] = []

    class Console:
        def print(self, text: str, **_) -> None:
            said.append(text)

    remaining = Remaining(Console(), "run", [1.0] * 10, every_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type]
    for elapsed in (100.0, 2.0, 2.0, 4.0):  # a slow warm-up part, then 2 s per part, then 4 s
        now[0] += elapsed
        remaining.part_done()
    assert said == ["run: 1/10 done (measuring the rate)", "run: 2/10 done, about 16.0 s to go",
                    "run: 3/10 done, about 14.0 s to go", "run: 4/10 done, about 16.0 s to go"]


def test_parts_of_several_seconds_never_leave_the_interval_silent():
    """Regression: a line came only at a part's end at least ``every_s`` after the last one, so 4.5 s parts left
    13.5 s silent (SmolLM2's demo: 13 s from the plan to the first line). A line now comes at the part's end
    where the next part would end past the interval."""
    now, lines = [0.0], []

    class Console:
        def print(self, text: str, **_) -> None:
            lines.append(now[0])

    remaining = Remaining(Console(), "run", [1.0] * 12, every_s=10.0, clock=lambda: now[0])  # type: ignore[arg-type]
    for _ in range(11):
        now[0] += 4.5
        remaining.part_done()
    gaps = [b - a for a, b in zip([0.0, *lines], [*lines, now[0]])]
    assert lines and max(gaps) <= 10.0, gaps


def test_estimates_before_a_run_are_ranges():
    assert between(20) == "between 10.0 s and 40.0 s"
    result = tierkv("demo", "--random-model", "--context", "512", "--block-tokens", "16", "--prefill-chunk", "256",
                    "--chunk-tokens", "128", "--max-new-tokens", "2", "--no-reference")
    assert result.returncode == 0, result.stderr
    assert "between " in result.stderr.splitlines()[0] and "re-estimated as it runs" in result.stderr


# #6: an empty prompt is refused before loading
@pytest.mark.parametrize("text", ["", "\n", "  \t\n"])
def test_demo_refuses_an_empty_prompt_file(tmp_path, text):
    (tmp_path / "config.json").write_text("{}")  # transformers cannot load it: a refusal must come first
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text)
    result = tierkv("demo", "--model", str(tmp_path), "--prompt-file", str(prompt))
    assert_one_line_error(result, 2, "--prompt-file", "is empty", "give a file with the prompt text")


# #8: measure without a reference
def test_eval_measure_without_out_names_the_stage():
    assert_one_line_error(tierkv("eval", "--stage", "measure"), 2, "--stage measure needs --out")


def test_python_dash_m_tierkv_is_the_command():
    result = subprocess.run([sys.executable, "-m", "tierkv", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("tierkv ")


def test_eval_measure_without_a_reference_is_refused_before_loading(tmp_path):
    result = tierkv("eval", "--stage", "measure", "--out", str(tmp_path / "empty"))
    assert_one_line_error(result, 2, "holds no reference (reference.json)", "--stage reference --out DIR")
    assert not (tmp_path / "empty").exists()


def test_load_label_mentions_gguf_only_for_a_gguf_model():
    assert load_label("demo").startswith("loading ") and "GGUF" not in load_label("demo") and not first_load("demo")


def test_a_phase_known_to_be_long_is_announced_as_it_begins_in_a_log():
    """Piped (a CI log, ``| tee``), a first load's dequantisation printed nothing for up to a minute: its line
    came only when it was done. Announced, its label comes first; other phases keep one line each."""
    log = io.StringIO()
    phases = Phases(Console(file=log, width=200))
    with phases.phase("dequantising the GGUF", announce=True):
        assert log.getvalue() == "dequantising the GGUF ...\n"
    with phases.phase("loading the demo model"):
        pass
    assert log.getvalue().splitlines()[1].startswith("dequantising the GGUF: ")
    assert log.getvalue().splitlines()[2].startswith("loading the demo model: ")


# #11: paths neither created nor misreported
def test_bench_refuses_a_missing_dir_and_creates_nothing(tmp_path):
    missing = tmp_path / "nope"
    assert_one_line_error(tierkv("bench", "--quick", "--dir", str(missing)), 2, "--dir", "folder not found",
                          "create it")
    assert not missing.exists()


@pytest.mark.parametrize("argv", [["demo", "--disk-dir", "/proc/x"], ["eval", "--out", "/proc/x"],
                                  ["bench", "--quick", "--dir", "/proc"]])
def test_a_directory_on_no_storage_is_not_writable(argv):
    assert_one_line_error(tierkv(*argv), 2, "'/proc' is not a writable directory")


# #12: the GGUF dequantisation's bar stays off
def test_the_gguf_bar_is_off_within_quiet_transformers(capsys):
    from transformers import modeling_gguf_pytorch_utils as gguf

    with quiet_transformers():
        list(gguf.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert "Converting" not in capsys.readouterr().err
    list(gguf.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert "Converting" in capsys.readouterr().err  # restored after


def test_eval_time_left_weighs_the_longer_trials_to_come(capsys):
    """Trials run shortest first: after a 256-token trial, a 1K one is left, about 5x its cost (the old average
    per trial said 1x)."""
    assert main(["eval", "--lengths", "256,1K", "--depths", "0", "--samples", "1"]) == 0
    first = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("[1/2]"))
    elapsed, left = (float(part.split(" s")[0]) for part in first.rsplit("(", 1)[1].split(", about "))
    assert left >= 2 * elapsed, first
