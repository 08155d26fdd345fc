"""The ``tierkv`` command's failure modes, run as a user would (subprocesses): one line on stderr that says
what is wrong and how to fix it, exit status 2 for usage errors, 1 for runtime failures, 130 on Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from tierkv import __version__
from tierkv.cli import main

PLAN = ["plan", "--model", "llama-3-8b", "--gpu-gb", "20", "--cpu-gb", "64"]


def tierkv(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "TIERKV_DEBUG"} | (env or {})
    return subprocess.run([sys.executable, "-m", "tierkv.cli", *argv], capture_output=True, text=True,
                          env=environment, timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess, status: int, *needles: str) -> None:
    assert result.returncode == status, result.stderr
    assert result.stdout == ""
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, result.stderr
    command = next((a for a in result.args[3:] if not a.startswith("-")), None)
    assert line.startswith(f"tierkv {command}: error: ") or line.startswith("tierkv: error: "), line
    for needle in needles:
        assert needle in line, line


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt")
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompt") / "prompt.txt"
    path.write_text("the pass key is 713 . " * 10)
    return path


@pytest.mark.parametrize(("argv", "needles"), [
    (["--context", "0"], ["--context='0' must be at least 64 tokens"]),
    (["--context", "abc"], ["--context='abc' is not a token count", "128K"]),
    (["--depth", "1.5"], ["--depth='1.5' must be a number in [0, 1]"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens='0' must be at least 1"]),
    (["--gpu-gb", "12 apples"], ["--gpu-gb='12 apples' is not a size"]),
    (["--prompt-file", "/nonexistent/prompt.txt"], ["--prompt-file", "file not found"]),
    (["--model", "/nonexistent", "--prompt-file", "PROMPT"], ["--model '/nonexistent': folder not found"]),
    (["--model", "CKPT"], ["--model needs --prompt-file"]),
    (["--prompt-file", "PROMPT"], ["--prompt-file needs --model"]),
])  # fmt: skip
def test_demo_usage_errors(argv, needles, checkpoint_dir, prompt_file):
    argv = [{"CKPT": str(checkpoint_dir), "PROMPT": str(prompt_file)}.get(a, a) for a in argv]
    assert_one_line_error(tierkv("demo", *argv), 2, *needles)


def test_demo_checkpoint_that_transformers_cannot_load(checkpoint_dir, prompt_file):
    result = tierkv("demo", "--model", str(checkpoint_dir), "--prompt-file", str(prompt_file))
    assert_one_line_error(result, 2, f"--model '{checkpoint_dir}': transformers cannot load it")


@pytest.mark.parametrize(("argv", "needles"), [
    (["--context", "0"], ["--context='0' must be at least 1 token"]),
    (["--context", "1M", "--gpu-gb", "1e30"], ["--gpu-gb='1e30' is beyond any machine"]),
    (["--context", "1M", "--batch", "1.5"], ["--batch='1.5' is not a whole number"]),
    (["--context", "1M", "--disk-gb", "1"], ["needs 137.4 GB of KV", "raise --disk-gb or --cpu-gb"]),
    (["--context", "1M", "--model", "gpt-17"], ["unknown model 'gpt-17'", "llama-3-8b"]),
    (["--context", "1M", "--profile", "/nonexistent.json"], ["does not exist", "tierkv bench"]),
])  # fmt: skip
def test_plan_usage_errors(argv, needles):
    assert_one_line_error(tierkv(*PLAN, *argv), 2, *needles)


def test_plan_runtime_os_error_is_status_1(tmp_path):
    target = tmp_path / "missing" / "plan.json"
    result = tierkv(*PLAN, "--context", "128K", "--json", str(target))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"tierkv plan: error: No such file or directory: '{target}'; check the path and its permissions"
    ]


@pytest.mark.parametrize("argv", [["--json", "-"], ["--json"]])
def test_plan_json_to_stdout_keeps_stdout_pure(argv):
    result = tierkv(*PLAN, "--context", "128K", *argv)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["context"] == 131072 and data["compute_source"] == "roofline, h100-sxm"
    assert "predicted step" in result.stderr  # the table went to stderr
    assert not Path("-").exists()


@pytest.mark.parametrize(("argv", "needles"), [
    (["--lengths", "1.5X"], ["--lengths='1.5X' is not a token count"]),
    (["--lengths", ","], ["no token counts"]),
    (["--depths", "0,2"], ["--depths='2' must be a number in [0, 1]"]),
    (["--samples", "0"], ["--samples='0' must be at least 1"]),
    (["--model", "/nonexistent"], ["folder not found"]),
])  # fmt: skip
def test_eval_usage_errors(argv, needles):
    assert_one_line_error(tierkv("eval", *argv), 2, *needles)


def test_top_level_usage_and_version():
    assert_one_line_error(tierkv(), 2, "the following arguments are required: command")
    assert_one_line_error(tierkv("nope"), 2, "invalid choice: 'nope'")
    version = tierkv("--version")
    assert version.returncode == 0 and version.stdout.startswith(f"tierkv {__version__} (python ")


@pytest.mark.parametrize(("argv", "env"), [(["--debug"], None), ([], {"TIERKV_DEBUG": "1"})])
def test_debug_shows_the_traceback(argv, env):
    result = tierkv(*argv, *PLAN, "--context", "1M", "--disk-gb", "1", env=env)
    assert result.returncode == 1 and "Traceback" in result.stderr and "CapacityError" in result.stderr


def test_bad_debug_variable_is_one_line():
    result = tierkv(*PLAN, "--context", "1M", env={"TIERKV_DEBUG": "maybe"})
    assert_one_line_error(result, 2, "TIERKV_DEBUG='maybe'")


def test_ctrl_c_exits_130_with_one_line():
    script = ("import sys, time\n"
              "import tierkv.commands.plan as plan\n"
              "def run(args):\n"
              "    print('ready', flush=True)\n"
              "    time.sleep(120)\n"
              "plan.run = run\n"
              "from tierkv.cli import main\n"
              f"sys.exit(main({PLAN + ['--context', '1M']!r}))\n")
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip() == "tierkv plan: interrupted"


def test_in_process_usage_error_returns_2(capsys):
    assert main(["demo", "--context", "0"]) == 2
    assert "--context='0'" in capsys.readouterr().err


def test_prompt_that_tokenizes_to_far_fewer_tokens_warns(tmp_path):
    from tierkv.commands.demo import _tokenize_prompt

    whole_text = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))  # no pre-tokenizer: 1 token
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=whole_text, unk_token="<unk>")
    path = tmp_path / "prompt.txt"
    path.write_text("word " * 400)
    log = io.StringIO()
    assert len(_tokenize_prompt(tokenizer, path, Console(file=log, width=200))) == 1
    assert "warning: --prompt-file has 400 words but" in log.getvalue() and "made 1 token of it" in log.getvalue()
