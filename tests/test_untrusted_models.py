"""Checkpoint folders handed to ``tierkv demo --model DIR`` and ``tierkv eval --model DIR`` as untrusted input: a
folder's Python never runs (whatever stdin says), a file transformers would read whole is refused by name when it is
no file or oversized, and every failure is one line naming the folder, without control characters."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.models import tiny_model
from tierkv import models
from tierkv.cli import main
from tierkv.demo.model import WEIGHTS_DIR
from tierkv.errors import CheckpointError


def _folder(tmp_path: Path, name: str = "model", **config: object) -> Path:
    """A tiny Llama checkpoint (safetensors, the demo's tokenizer.json), its config.json updated with ``config``."""
    folder = tmp_path / name
    tiny_model("llama").save_pretrained(folder, safe_serialization=True)
    shutil.copy(WEIGHTS_DIR / "tokenizer.json", folder / "tokenizer.json")
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def _with_code(tmp_path: Path) -> tuple[Path, Path]:
    """A folder whose config.json maps a model type transformers does not ship to the folder's own Python, which
    would leave a marker file if it ran."""
    marker = tmp_path / "code-ran"
    folder = _folder(tmp_path, model_type="evilllama",
                     auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evilllama'\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n")
    return folder, marker


def _error_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"tierkv {command}: error: "), line
    return line


def _prompt(tmp_path: Path) -> Path:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("some text")
    return prompt


def test_a_folders_own_code_is_refused_by_name_and_never_run(tmp_path, capsys, monkeypatch):
    """`echo y | tierkv demo --model DIR`: transformers would ask whether to run the folder's code and take the
    "y"; the config's auto_map is refused by name before that, and nothing of the folder runs."""
    folder, marker = _with_code(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 10))
    assert main(["demo", "--model", str(folder), "--prompt-file", str(_prompt(tmp_path))]) == 1
    line = _error_line(capsys, "demo")
    assert "auto_map" in line and "'evilllama'" in line and "never runs a folder's code" in line, line
    assert not marker.exists()


def test_transformers_is_told_never_to_run_a_folders_code(tmp_path, monkeypatch):
    """Past the auto_map refusal (a config transformers reads otherwise), every transformers call is told not to
    run the folder's code: a "y" on stdin runs nothing, and the load fails in one line."""
    folder, marker = _with_code(tmp_path)
    monkeypatch.setattr(models, "_check_no_code", lambda config, what: None)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 10))
    with pytest.raises(CheckpointError, match="transformers cannot load it") as refused:
        models.load_folder(folder)
    assert "\n" not in str(refused.value)
    assert not marker.exists()


def test_an_auto_map_of_a_model_type_transformers_ships_loads_with_its_own_classes(tmp_path, monkeypatch):
    folder, marker = _with_code(tmp_path)
    config = folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "llama"}))
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 10))
    model, _ = models.load_folder(folder)
    assert type(model).__name__ == "LlamaForCausalLM" and not marker.exists()


@pytest.mark.parametrize(("name", "size", "bound"), [("config.json", (16 << 20) + 1, "16 MiB"),
                                                     ("tokenizer.json", (64 << 20) + 1, "64 MiB"),
                                                     ("generation_config.json", 1 << 33, "16 MiB"),
                                                     ("model.safetensors.index.json", (16 << 20) + 1, "16 MiB")])
def test_an_oversized_file_transformers_reads_whole_is_refused_by_name(tmp_path, capsys, name, size, bound):
    """A sparse file past its bound (a wrong or planted folder) is refused naming it and the bound, before
    transformers reads it whole; the bound leaves room for real tokenizers (Gemma 3's is some 35 MB)."""
    folder = _folder(tmp_path)
    (folder / name).touch()
    os.truncate(folder / name, size)
    assert main(["demo", "--model", str(folder), "--prompt-file", str(_prompt(tmp_path))]) == 1
    line = _error_line(capsys, "demo")
    assert f"its {name!r} is {size:,} bytes, more than the {bound}" in line, line


def test_files_transformers_does_not_read_are_left_alone_whatever_their_size(tmp_path):
    """A trainer's state or logs beside a checkpoint (large after a long run) are not what a load reads."""
    folder = _folder(tmp_path)
    for name in ("trainer_state.json", "train_log.txt"):
        (folder / name).touch()
        os.truncate(folder / name, (16 << 20) + 1)
    model, _ = models.load_folder(folder)
    assert model.config.num_hidden_layers == 2


def test_a_fifo_among_the_files_transformers_reads_is_refused_not_waited_on(tmp_path):
    folder = _folder(tmp_path)
    os.mkfifo(folder / "tokenizer_config.json")
    with pytest.raises(CheckpointError, match="its 'tokenizer_config.json' is a FIFO, not a file"):
        models.load_folder(folder)


def test_links_of_a_snapshot_folder_are_followed(tmp_path):
    """A Hugging Face snapshot folder is links into its blobs: followed, their targets checked."""
    blobs = _folder(tmp_path, "blobs")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for entry in blobs.iterdir():
        (snapshot / entry.name).symlink_to(entry)
    model, _ = models.load_folder(snapshot)
    assert model.config.num_hidden_layers == 2


def test_eval_refuses_an_oversized_config_of_its_model_folder_by_name(tmp_path, capsys):
    folder = _folder(tmp_path)
    os.truncate(folder / "config.json", 1 << 33)
    assert main(["eval", "--model", str(folder), "--lengths", "1K", "--depths", "0.5", "--samples", "1"]) == 1
    assert "its 'config.json' is 8,589,934,592 bytes, more than the 16 MiB" in _error_line(capsys, "eval")


def test_eval_with_a_folder_transformers_refuses_is_one_line_naming_it(tmp_path, capsys):
    """`tierkv eval --model DIR` with a config transformers refuses: one line naming the folder, no traceback."""
    folder = _folder(tmp_path, hidden_size="x")
    assert main(["eval", "--model", str(folder), "--lengths", "1K", "--depths", "0.5", "--samples", "1"]) == 1
    line = _error_line(capsys, "eval")
    assert f"demo model folder {str(folder)!r}: transformers cannot load it: " in line and "hidden_size" in line, line


def test_file_names_and_transformers_messages_lose_their_control_characters(tmp_path, capsys):
    """A pickle file's name, and a config's model_type that transformers quotes, reach the one-line error
    without the escapes that would set the terminal's title or clear it."""
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text('{"model_type": "llama"}')
    (pickled / "x\x1b]0;OWNED\x07\x1b[2J.bin").write_bytes(b"")
    strange = _folder(tmp_path, "strange", model_type="ev\x1b[2Jil\x1b]0;OWNED\x07")
    for folder, said in ((pickled, "pickle files"), (strange, "transformers cannot load it")):
        with pytest.raises(CheckpointError, match=said) as refused:
            models.load_folder(folder)
        assert not any(ch in str(refused.value) for ch in "\x1b\x07\n"), refused.value


def test_every_cli_error_line_loses_its_control_characters(tmp_path, capsys, monkeypatch):
    """Whatever an error quotes (a file's text, a server's reply), the CLI's one line carries no control
    character."""
    def refused(folder, **kwargs):
        raise CheckpointError(f"{folder}: quoted \x1b]0;OWNED\x07\x1b[2J\rforged\x9b line")

    monkeypatch.setattr(models, "load_folder", refused)
    assert main(["demo", "--model", str(_folder(tmp_path)), "--prompt-file", str(_prompt(tmp_path))]) == 1
    line = _error_line(capsys, "demo")
    assert "quoted ]0;OWNED[2J forged line" in line and not any(ch in line for ch in "\x1b\x07\r\x9b"), line
