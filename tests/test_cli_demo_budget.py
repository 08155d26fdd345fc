"""``tierkv demo``'s default ``--gpu-gb`` and its advice for a too-small one are budgets the cache accepts."""

from __future__ import annotations

import pytest

from tierkv.cli import main


@pytest.mark.parametrize(("executor", "block_tokens", "options"), [
    ("sparse", 3, []),
    ("sparse", 5, ["--sparse-rest-bits", "2"]),
    ("sparse", 16, ["--page-tokens", "1", "--sparse-rest-bits", "0"]),
    ("sparse", 64, ["--page-tokens", "1", "--sparse-rest-bits", "8"]),
    ("sparse", 8, ["--sparse-tokens", "40", "--page-tokens", "2"]),
    ("streaming", 5, []),
    ("split", 3, []),
    ("gather", 7, []),
])  # fmt: skip
def test_default_budget_and_the_advised_minimum_are_accepted(tmp_path, capsys, executor, block_tokens, options):
    """Regression: the demo's own floor for ``--executor sparse`` (its summaries, selection and rest copy, counted
    apart from the cache's) was below ``TieredCache.min_sparse_device_bytes`` for small blocks and pages: the
    default ``--gpu-gb`` was refused mid-run, and so was the ``give --gpu-gb X or more`` it advised."""
    argv = ["demo", "--random-model", "--context", "256", "--max-new-tokens", "2", "--no-reference",
            "--disk-dir", str(tmp_path), "--executor", executor, "--block-tokens", str(block_tokens), *options]
    assert main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main([*argv, "--gpu-gb", "1KB"]) == 2
    err = capsys.readouterr().err
    assert "is below this run's minimum: give --gpu-gb " in err, err
    minimum = err.split("give --gpu-gb ")[1].split()[0]
    assert main([*argv, "--gpu-gb", minimum]) == 0, capsys.readouterr().err
