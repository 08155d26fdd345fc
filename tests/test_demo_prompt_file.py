"""``tierkv demo --prompt-file``: a file larger than a prompt can be is refused before it is read, with its size,
the bound and the fix; a ``--context`` long enough raises the bound."""

from __future__ import annotations

import os

import pytest

from tierkv.cli import main
from tierkv.commands.demo import PROMPT_BYTES_PER_TOKEN, PROMPT_MIN_BYTES, _read_prompt
from tierkv.errors import InvalidConfigError


def sparse_file(path, size: int):
    """A file of ``size`` zero bytes that takes no disk (sparse)."""
    with open(path, "wb") as file:
        os.truncate(file.fileno(), size)
    return path


def test_a_prompt_file_past_the_bound_is_refused_before_the_model_loads(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")  # transformers cannot load it: the refusal must come first
    prompt = sparse_file(tmp_path / "prompt.txt", PROMPT_MIN_BYTES + 1)
    assert main(["demo", "--model", str(tmp_path), "--prompt-file", str(prompt)]) == 2
    error = capsys.readouterr().err
    assert "\n" not in error.strip(), error
    for needle in (f"--prompt-file {str(prompt)!r} is 16,777,217 bytes (16.00 MiB)",
                   "more than the 16,777,216 (16.00 MiB) a prompt file may hold", "16 bytes per token of --context",
                   "give a shorter prompt", "--context 1048577 or more"):
        assert needle in error, error


def test_a_huge_sparse_prompt_file_is_never_read(tmp_path) -> None:
    prompt = sparse_file(tmp_path / "huge.txt", 64 << 30)
    with pytest.raises(InvalidConfigError, match=r"is 68,719,476,736 bytes \(64\.00 GiB\), .* --context 4096M or more"):
        _read_prompt(prompt, None)


def test_a_longer_context_raises_the_bound(tmp_path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"word " * (PROMPT_MIN_BYTES // 5 + 1))
    with pytest.raises(InvalidConfigError, match="more than the 16,777,216"):
        _read_prompt(prompt, None)
    context = -(-prompt.stat().st_size // PROMPT_BYTES_PER_TOKEN)
    assert _read_prompt(prompt, context) == prompt.read_text()
