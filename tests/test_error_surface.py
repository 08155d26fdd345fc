"""One error surface: the faults of the issue's list that are about input and the disk directory, each a
TierKVError (also the fitting builtin) whose message names the problem and the fix, with the cache still
closable afterwards."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess

import pytest
import torch
from models import small_llama
from transformers import DynamicCache

from tierkv import DiskTierError, InvalidConfigError, TieredCache, TierKVError
from tierkv.hf import cache_keyword


@pytest.fixture(scope="module")
def model():
    return small_llama()


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(gpu_gb="1e30"), "beyond any machine"),
    (dict(cpu_gb=10**400), "beyond any machine"),
    (dict(gpu_gb=10**400), "beyond any machine"),
    (dict(block_tokens=True), "block_tokens must be a positive int"),
    (dict(block_tokens=4.0), "block_tokens must be a positive int"),
])  # fmt: skip
def test_the_issues_inputs_are_refused_at_construction(kwargs, needle):
    with pytest.raises(InvalidConfigError, match=needle) as info:
        TieredCache(**kwargs)
    assert isinstance(info.value, ValueError)


def test_a_layer_beyond_the_configs_count_is_refused(model):
    """Regression: a 12-layer model fed into a cache built from an 8-layer config was silently accepted."""
    cache = TieredCache(gpu_gb="1MB", config=model.config)
    keys = torch.zeros(1, 2, 1, 16)
    cache.update(keys, keys, 1)
    with pytest.raises(InvalidConfigError, match="layer_idx 2 is beyond the 2 layers of the config"):
        cache.update(keys, keys, 2)
    with pytest.raises(InvalidConfigError, match="layer_idx must be an int >= 0"):
        cache.update(keys, keys, -1)
    assert len(cache.layers) == 2
    cache.close()


def test_a_zero_host_budget_with_a_disk_tier_demotes_straight_to_disk(model, tmp_path):
    """Regression: ``cpu_gb="0"`` with a disk tier failed mid-generation (victims moved only one tier down)."""
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    with TieredCache(gpu_gb="40KB", cpu_gb="0", disk_dir=tmp_path, block_tokens=4) as cache:
        reference = DynamicCache()
        out = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False)
        expected = model.generate(ids, past_key_values=reference, max_new_tokens=6, do_sample=False)
        assert torch.equal(out, expected)
        blocks = cache.stats()["blocks"]
        assert blocks["host"] == 0 and blocks["disk"] > 0


def test_disk_dir_removed_before_the_first_spill(model, tmp_path):
    """Regression: a raw FileNotFoundError at the first spill, and close() then raised."""
    directory = tmp_path / "kv"
    cache = TieredCache(gpu_gb="40KB", cpu_gb="24KB", disk_dir=directory, block_tokens=4)
    shutil.rmtree(directory)
    with pytest.raises(DiskTierError, match="no longer exists .*recreate it") as info:
        model(torch.randint(2, 128, (1, 40)), past_key_values=cache)
    assert isinstance(info.value, TierKVError) and isinstance(info.value, OSError)
    cache.close()


def test_disk_dir_made_immutable_before_the_first_spill(model, tmp_path):
    """Regression: a raw PermissionError at the first spill, and close() then raised and left the file."""
    directory = tmp_path / "kv"
    cache = TieredCache(gpu_gb="40KB", cpu_gb="24KB", disk_dir=directory, block_tokens=4)
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode != 0:
        cache.close()
        pytest.skip("cannot make a directory immutable here (needs root and a filesystem with chattr)")
    try:
        with pytest.raises(DiskTierError, match="no longer accepts new files .*chattr -i"):
            model(torch.randint(2, 128, (1, 40)), past_key_values=cache)
        cache.close()  # logs that its lock file stays, does not raise
    finally:
        subprocess.run(["chattr", "-i", str(directory)], capture_output=True)
    TieredCache(disk_dir=directory).close()  # the next cache removes what was left
    assert not list(directory.iterdir())


@pytest.mark.parametrize("command", ["demo", "bench", "plan", "eval"])
def test_every_example_in_a_size_or_token_option_help_parses(command):
    """The examples a command's help gives for its sizes and token counts (``'512MB'``, ``8K``, ``1.5K``) are
    valid input to that very option: the help and the grammar of tierkv.units cannot drift apart."""
    import re

    from tierkv.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    checked = 0
    for action in sub._actions:
        name = getattr(action.type, "__name__", "")
        if not action.help or action.type is None or name not in ("<lambda>", "convert", "parse_size"):
            continue
        quoted = re.findall(r"'([^']+)'", action.help)
        listed = re.findall(r"e\.g\. ([0-9][^;)(]*)", action.help)
        defaults = re.findall(r"(?:default:? |; )([0-9][0-9.]*[A-Za-z]*)(?= with| \(|\)|;|$)", action.help)
        examples = quoted + defaults + [word.strip() for text in listed for word in text.split(",")]
        for example in examples:
            if example and example[0].isdigit():
                action.type(example.split()[0])
                checked += 1
    assert checked, command


def test_a_tiny_budget_error_reads_its_sizes_and_counts_right(model):
    """``gpu_gb="1KB"``: the message shows sizes a reader can compare (never "0.00 MB") and counts in words
    ("1 block", not "1 blocks")."""
    cache = TieredCache(gpu_gb="1KB", cpu_gb="64MB", config=model.config)
    with pytest.raises(TierKVError) as info:
        model(input_ids=torch.arange(8)[None], cache=cache)
    cache.close()
    message = str(info.value)
    assert "0.00 MB" not in message and "1 blocks" not in message and "(1 x " not in message, message


def test_a_trace_path_that_cannot_be_written_is_refused_when_the_cache_is_built(model, tmp_path, monkeypatch):
    """Sweep finding 9: ``TIERKV_TRACE=<a directory>`` was accepted, and at close() the trace was lost with only a
    logged traceback. A directory, or a path in a missing directory, is an InvalidConfigError when the cache is
    built, naming the variable (or ``trace=``) and the fix; nothing is written, and a file path gets the trace."""
    folder = tmp_path / "traces"
    folder.mkdir()
    for value, problem in ((folder, "is a directory"), (tmp_path / "missing" / "t.json", "not an existing directory")):
        monkeypatch.setenv("TIERKV_TRACE", str(value))
        with pytest.raises(InvalidConfigError, match=problem) as info:
            TieredCache(block_tokens=4)
        assert f"TIERKV_TRACE={value}:" in str(info.value) and "give a file path" in str(info.value)
        monkeypatch.delenv("TIERKV_TRACE")
        with pytest.raises(InvalidConfigError, match=f"trace={str(value)!r}: .*{problem}"):
            TieredCache(block_tokens=4, trace=value)
    assert not list(folder.iterdir()) and not (tmp_path / "missing").exists()
    path = folder / "t.json"
    monkeypatch.setenv("TIERKV_TRACE", str(path))
    with TieredCache(block_tokens=4) as cache:
        model(torch.randint(2, 128, (1, 12)), **{cache_keyword(model): cache})
    assert json.loads(path.read_text())["traceEvents"]


def test_a_trace_that_cannot_be_written_at_close_is_one_warning(model, tmp_path, caplog):
    """Its folder removed after the cache was built: close() logged the whole traceback of the failed write. It
    logs one line naming the path and the fix now, and still closes everything."""
    folder = tmp_path / "traces"
    folder.mkdir()
    cache = TieredCache(block_tokens=4, trace=folder / "t.json")
    model(torch.randint(2, 128, (1, 12)), **{cache_keyword(model): cache})
    folder.rmdir()
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        cache.close()
    records = [r for r in caplog.records if "trace" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is None and "could not be written" in records[0].getMessage()
    assert cache.closed
