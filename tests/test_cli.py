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
import torch
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
    assert_one_line_error(result, 1, f"--model '{checkpoint_dir}': transformers cannot load it")


def test_demo_pickle_checkpoint_is_one_line_exit_1_and_never_unpickled(tmp_path, prompt_file):
    """A checkpoint whose weights are a pickle: refused before anything reads it, one line, exit 1 (a failure
    while running; the folder itself was a valid argument)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    result = tierkv("demo", "--model", str(tmp_path), "--prompt-file", str(prompt_file))
    assert_one_line_error(result, 1, "are pickle files, which tierkv never loads")


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


def test_plan_runtime_os_error_is_status_1(tmp_path, capsys, monkeypatch):
    """An OS error while running (here the disk filling up as the JSON is written; a --json path that cannot be
    written at all is a usage error found while parsing) is one line and status 1."""
    target = tmp_path / "plan.json"

    def full(data, path):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr("tierkv.commands.plan.write_json", full)
    assert main([*PLAN, "--context", "128K", "--json", str(target)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"tierkv plan: error: No space left on device: '{target}'; free space there, or choose another path"
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


@pytest.mark.parametrize(("stop", "sigint"), [(signal.SIGTERM, "handled"), (signal.SIGTERM, "ignored"),
                                             (signal.SIGHUP, "handled")])  # ignored: a shell script's background job
def test_sigterm_ends_a_demo_like_ctrl_c_and_leaves_no_temporary_files(tmp_path, stop, sigint):
    """Regression: SIGTERM (``timeout``, ``kill``) and SIGHUP (a closed terminal, a dropped ssh session) killed a
    running demo outright, leaving its temporary disk tier (a 16 MiB file and a lock) in the temp dir. They end the
    command as Ctrl-C does: one line, exit 128 + the signal, nothing left behind."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    before = signal.SIG_IGN if sigint == "ignored" else signal.SIG_DFL
    demo = ["demo", "--context", "8K", "--no-reference", "--max-new-tokens", "2K"]  # decodes for seconds after prefill
    with subprocess.Popen([sys.executable, "-m", "tierkv.cli", *demo],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, before)) as proc:
        for line in proc.stderr:  # the tiered run has begun: its disk tier exists
            if line.startswith("prefill"):
                break
        assert list(tmp_path.glob("tierkv-*")), "the demo's temporary folder exists while it runs"
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + stop, err
    assert err.strip().splitlines()[-1] == "tierkv demo: terminated"
    assert list(tmp_path.glob("tierkv-*")) == []  # (torch's own folders may stay)


def test_under_nohup_a_hangup_leaves_the_demo_running(tmp_path):
    """SIGHUP ends a command as SIGTERM does, but not where it is ignored (``nohup tierkv demo &``, then logging
    out): the run goes on to its end."""
    demo = ["demo", "--random-model", "--context", "512", "--block-tokens", "16", "--prefill-chunk", "256",
            "--chunk-tokens", "128", "--max-new-tokens", "8", "--no-reference"]
    with subprocess.Popen([sys.executable, "-m", "tierkv.cli", *demo], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path)},
                          preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) as proc:
        for line in proc.stderr:
            if line.startswith("plan:"):
                break
        proc.send_signal(signal.SIGHUP)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "terminated" not in err and "tierkv demo" in out


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


# ------------------------------------------------------------------------------- issue 29: fast help, CLI terms
def test_bare_help_and_version_import_no_command_module_nor_torch():
    """``tierkv``, ``tierkv --help`` and ``tierkv --version`` in one fresh interpreter: torch is never imported
    (it alone takes seconds), and bare ``tierkv`` names every command."""
    script = (
        "import contextlib, io, json, sys\n"
        "from tierkv.cli import main\n"
        "codes, outs = [], []\n"
        "for argv in ([], ['--help'], ['--version']):\n"
        "    out, err = io.StringIO(), io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
        "        codes.append(main(argv))\n"
        "    outs.append(out.getvalue() + err.getvalue())\n"
        "print(json.dumps({'codes': codes, 'outs': outs, 'torch': 'torch' in sys.modules,\n"
        "                  'commands': sorted(m for m in sys.modules if m.startswith('tierkv.commands.'))}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    data = json.loads(result.stdout)
    assert data["codes"] == [2, 0, 0] and not data["torch"] and data["commands"] == [], data
    bare, help_text, version = data["outs"]
    for name in ("demo", "bench", "plan", "eval"):
        assert name in bare and name in help_text
    assert version.startswith(f"tierkv {__version__} (python ")


@pytest.mark.parametrize("command", ["demo", "bench", "plan", "eval"])
def test_unknown_option_error_names_the_subcommand(command, capsys):
    assert main([command, "--no-such-option"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tierkv {command}: error: ") and f"see tierkv {command} --help" in err


@pytest.mark.parametrize("command", ["demo", "bench", "plan", "eval"])
def test_every_command_takes_json(command, capsys):
    assert main([command, "--help"]) == 0
    assert "--json [PATH]" in capsys.readouterr().out


def test_plan_json_into_a_missing_folder_fails_while_parsing(tmp_path, capsys):
    assert main([*PLAN, "--context", "128K", "--json", str(tmp_path / "missing" / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierkv plan: error: --json ") and "does not exist" in err


def test_incomplete_checkpoint_error_says_what_is_missing(tmp_path, prompt_file, capsys):
    """A folder with config.json and weights but no tokenizer files: transformers' reason spans several lines,
    and the one line keeps all of it (the first line alone stops before naming the missing files)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    capsys.readouterr()  # save_pretrained's own progress bar
    assert main(["demo", "--model", str(tmp_path), "--prompt-file", str(prompt_file)]) == 1
    err = capsys.readouterr().err.strip()
    assert "transformers cannot load it" in err and "serialization file" in err and "\n" not in err, err


# ------------------------------------------------------------------------------------------ newcomer sweep
UNWRITABLE = "/proc/self"  # a folder no one, root included, can create files or folders in


def _one_line(err: str, command: str, *needles: str) -> None:
    line = err.strip()
    assert line.startswith(f"tierkv {command}: error: ") and "\n" not in line and "Traceback" not in line, err
    for needle in needles:
        assert needle in line, line


def test_plan_keeps_the_deepest_prefetch_that_fits_a_disk_budget(tmp_path, capsys):
    """Sweep 3: with ``--disk-gb`` the auto depth search met a deeper depth whose staging left too little room
    for the KV (CapacityError) and refused a plan that fits at depth 1; it stops the search there instead."""
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "llama-3-8b", "--context", "128K", "--gpu-gb", "20", "--cpu-gb", "12"]
    assert main([*argv, "--disk-gb", "0", "--json", str(out)]) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["bytes_per_tier"]["disk"] == 0 and data["prefetch_depth"] >= 1


@pytest.mark.parametrize(("argv", "needles"), [
    (["--context", "-4K"], ["--context='-4K' is negative"]),
    (["--context", "128K", "--gpu-gb", "-1GB"], ["--gpu-gb='-1GB' is negative"]),
    (["--context", "128K", "--sparse-page-tokens", "7"],
     ["--sparse-page-tokens 7 does not divide the plans' 256-token block", "e.g. 16"]),
])  # fmt: skip
def test_plan_values_are_refused_in_flags(argv, needles, capsys):
    """Sweep 13, 14: a negative value with a unit reaches the option's own check (not argparse's "expected one
    argument"); a page that does not divide the block is named as the flag, without internal field names."""
    argv = ["plan", "--model", "llama-3-8b", "--gpu-gb", "20", "--cpu-gb", "64", *argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    _one_line(err, "plan", *needles)
    assert "block_tokens" not in err and "sparse_page_tokens" not in err


@pytest.fixture
def no_eval_load(monkeypatch):
    """An eval that reaches the model load fails the test: these errors must come before it."""
    monkeypatch.setattr("tierkv.demo.model.load_demo_model", lambda *a, **k: pytest.fail("the model was loaded"))


@pytest.mark.parametrize(("argv", "needles"), [
    (["--device", "foo"], ["--device 'foo' is not a torch device", "give cpu, cuda or cuda:N"]),
    (["--out", UNWRITABLE + "/results"], ["--out", "is not a writable directory"]),
    (["--cache", "dynamic", "--gpu-gb", "1"], ["--gpu-gb applies only with --cache tiered", "add --cache tiered"]),
    (["--cpu-gb", "1", "--executor", "gather"], ["--cpu-gb, --executor apply only with --cache tiered"]),
    (["--cache", "tiered", "--executor", "gather", "--chunk-tokens", "1K"],
     ["--chunk-tokens applies only with --executor streaming"]),
])  # fmt: skip
def test_eval_refuses_before_loading(argv, needles, capsys, no_eval_load):
    """Sweep 4, 5, 6: a bad device, an --out that cannot be written, an option that would be ignored: exit 2
    before the model loads (a default eval runs for minutes, and its results were lost to --out)."""
    assert main(["eval", *argv]) == 2
    _one_line(capsys.readouterr().err, "eval", *needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_eval_cuda_device_without_cuda_is_one_line(capsys, no_eval_load):
    assert main(["eval", "--device", "cuda"]) == 2
    _one_line(capsys.readouterr().err, "eval", "--device 'cuda'", "no CUDA GPU", "--device cpu")
