"""``tierkv plan``'s table, row by row, against figures worked out by hand: a batch's bytes per generated token,
and the device row as the sum of the rows it is made of."""

from __future__ import annotations

import re

import pytest

from tierkv.cli import main

ARGS = ["plan", "--model", "llama-3-8b", "--context", "128K", "--gpu-gb", "80", "--cpu-gb", "128", "--link", "pcie5"]


def _rows(capsys, monkeypatch, *extra: str) -> dict[str, str]:
    monkeypatch.setenv("COLUMNS", "200")
    assert main([*ARGS, *extra]) == 0
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 2 and cells[0]:
            rows[cells[0]] = cells[1]
    return rows


def _ms(text: str) -> float:
    return float(re.match(r"([\d,.]+) ms", text).group(1).replace(",", ""))


@pytest.mark.parametrize("batch", ["1", "4"])
def test_gathered_bytes_per_token_is_one_rows_context(capsys, monkeypatch, batch):
    """Llama-3-8B holds 128 KiB of K/V per token (32 layers x 8 KV heads x 128 x 2 x bf16); each generated token
    attends its own row's 128K tokens: 16 GiB per token, whatever the batch."""
    rows = _rows(capsys, monkeypatch, "--batch", batch)
    assert rows["KV per token"] == "128.00 KiB"
    assert rows["gathered on device per token"].startswith("16.00 GiB")


def test_device_busy_is_compute_plus_the_gather_row(capsys, monkeypatch):
    rows = _rows(capsys, monkeypatch, "--batch", "4")
    compute = next(v for k, v in rows.items() if k.startswith("compute per step"))
    extra = next(v for k, v in rows.items() if k.startswith("+ device gather"))
    device = next(v for k, v in rows.items() if k.startswith("= device"))
    assert _ms(compute) + _ms(extra) == pytest.approx(_ms(device), abs=0.11)  # each rounded to 0.1 ms
    assert _ms(extra) > 0
