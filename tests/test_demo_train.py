"""The demo model's training script: its schedule, and that a run is reproducible bit for bit (a tiny model)."""

from __future__ import annotations

import pytest

from tierkv.demo import train
from tierkv.errors import InvalidConfigError

TINY = ["--layers", "1", "--hidden", "32", "--steps", "8", "--extend-steps", "3", "--min-len", "64",
        "--max-len", "96", "--extend-len", "128", "--batch-tokens", "256", "--check-every", "0", "--eval-lengths"]


def test_schedule_grows_prompts_then_extends_them():
    args = train.parse_args(["--steps", "1200", "--extend-steps", "300", "--max-len", "2048", "--extend-len", "8192"])
    assert train.length_range(args, 0) == (64, 64)
    assert train.length_range(args, 600) == (64, 2048)  # full range from half of the main steps on
    assert train.length_range(args, 1199) == (64, 2048)
    assert train.length_range(args, 1200) == (2048, 8192)  # extension: long prompts only
    assert train.lr_at(args, 99) == pytest.approx(2e-3)  # end of warm-up
    assert train.lr_at(args, 1199) < 1e-6  # the main cosine has decayed...
    assert train.lr_at(args, 1200) == pytest.approx(5e-4)  # ...and the extension restarts lower
    assert train.lr_at(args, 1499) < 1e-7


def test_training_is_reproducible(tmp_path):
    first = train.train(train.parse_args([*TINY, "--out", str(tmp_path / "a")]))
    train.train(train.parse_args([*TINY, "--out", str(tmp_path / "b")]))
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert first["steps"] + first["extend_steps"] == 11 and (tmp_path / "a" / "tokenizer.json").is_file()


def test_lengths_must_be_ordered_and_inside_the_trained_positions():
    with pytest.raises(InvalidConfigError, match="--max-len <= --extend-len"):
        train.parse_args(["--max-len", "4096", "--extend-len", "2048"])
    with pytest.raises(InvalidConfigError, match="--extend-len <= 80000"):
        train.parse_args(["--extend-len", "90000"])  # caught here, not after the main schedule
    assert train.parse_args(["--max-len", "16384", "--extend-steps", "0"]).extend_steps == 0  # no extension
