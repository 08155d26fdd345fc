"""Persistence and the filesystem's space: a persistent store that could keep nothing is refused (ramfs, a full
filesystem, a persist_gb under one record), records dropped for persist_gb are logged, and persisted blocks never
take the room the disk tier's disk_gb counts on (checked when the cache is built, and by the writer)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from helpers import mounted, tiny_tmpfs
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.errors import InvalidConfigError

BT = 16
PROMPT = 96  # six full blocks
CONTEXT = 128  # the device budget holds this many tokens: the prompt stays off the disk, decoding spills


def _reference(model: torch.nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    return model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=new, do_sample=False)


def _cache(model: torch.nn.Module, directory: Path, **options: object) -> TieredCache:
    """A persistent cache whose memory tiers hold the prompt (the disk tier grows only while decoding)."""
    device = TieredCache.min_device_bytes(model.config, CONTEXT, block_tokens=BT)
    arguments: dict = dict(gpu_gb=f"{device}B", cpu_gb="16KB", disk_dir=directory, block_tokens=BT,
                           config=model.config, persist=True)
    return TieredCache(**{**arguments, **options})


def _fill(directory: Path, leave: int) -> None:
    """Write a file (another program's) that leaves ``leave`` bytes free under ``directory``."""
    usage = os.statvfs(directory)
    size = usage.f_bavail * usage.f_frsize - leave
    assert size > 0
    with open(directory / "other-program", "wb") as file:
        file.write(bytes(size))


def test_persist_on_a_filesystem_without_a_size_needs_persist_gb(tmp_path: Path) -> None:
    """On ramfs (no size reported) the default capacity, a share of the free space, would be nothing: refused
    when the cache is built, naming persist_gb; with it, a second cache loads the prefix and decodes exactly."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=3)
    reference = _reference(model, ids, 8)
    with mounted(tmp_path / "ram", "ramfs") as directory:
        with pytest.raises(InvalidConfigError, match="reports no size.*pass persist_gb"):
            _cache(model, directory, disk_gb="4MB")
        for loaded in (0, PROMPT - BT):  # never the last token: the model computes one
            with _cache(model, directory, disk_gb="4MB", persist_gb="4MB") as cache:
                assert cache.load_prefix(model, ids) == loaded
                out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
                cache.flush()
            assert torch.equal(out, reference)


def test_a_default_capacity_under_one_record_is_refused(tmp_path: Path) -> None:
    """A nearly full filesystem makes the default capacity smaller than one block record: load_prefix refuses it
    (every block would be dropped as soon as written), naming persist_gb and the size one record needs."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=4)
    with tiny_tmpfs(tmp_path / "tiny", "256k") as directory:
        _fill(directory, 48 << 10)
        with _cache(model, directory, disk_gb="16KB") as cache, \
                pytest.raises(InvalidConfigError, match=r"can keep nothing.*free under disk_dir.*persist_gb="):
            cache.load_prefix(model, ids)


def test_a_persist_gb_under_one_record_is_refused(tmp_path: Path) -> None:
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=5)
    with _cache(model, tmp_path, persist_gb="4KB") as cache, \
            pytest.raises(InvalidConfigError, match=r"can keep nothing.*\(persist_gb\).*Pass persist_gb="):
        cache.load_prefix(model, ids)


def test_records_dropped_for_persist_gb_are_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A persist_gb of two records keeps a prompt's first two blocks; the rest are dropped with one warning."""
    model = tiny_model("llama")
    with caplog.at_level(logging.WARNING, logger="tierkv"), _cache(model, tmp_path, persist_gb="25000B") as cache:
        for seed in (6, 7):
            ids, _ = prompt(1, PROMPT, seed=seed)
            cache.load_prefix(model, ids)
            model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
            cache.flush()
            cache.reset()
        assert cache.session.prefix.store.stats()["blocks"] == 2
    dropped = [r for r in caplog.records if "does not fit in persist_gb" in r.getMessage()]
    assert len(dropped) == 1 and r"pass a larger persist_gb" in dropped[0].getMessage()


def test_disk_gb_and_persist_gb_must_fit_the_free_space_together(tmp_path: Path) -> None:
    """Each fits the free space alone but not both: refused when the cache is built, naming both and the fix.
    What the store already holds is on disk already: only the rest of persist_gb counts."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=8)
    with tiny_tmpfs(tmp_path / "tiny", "256k") as directory:
        refused = r"disk_gb \(187.50 KiB\) and persist_gb \(125.00 KiB.*lower persist_gb"
        with pytest.raises(InvalidConfigError, match=refused):
            _cache(model, directory, disk_gb="192KB", persist_gb="128KB")
        with _cache(model, directory, disk_gb="128KB", persist_gb="96KB") as cache:
            cache.load_prefix(model, ids)
            model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
            cache.flush()
            held = cache.session.prefix.store.stats()["bytes"]
        free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
        assert held > 0 and (128 << 10) + (96 << 10) > free >= (128 << 10) + (96 << 10) - held
        with _cache(model, directory, disk_gb="128KB", persist_gb="96KB") as again:
            assert again.load_prefix(model, ids) == PROMPT - BT


def test_persisted_blocks_never_take_the_disk_tiers_room(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another program fills the filesystem after the cache was built: the writer skips the records that would
    leave less free space than the disk tier has yet to reserve (counted, one warning), and decoding, which grows
    the disk tier only after the prompt's blocks were persisted, never meets a full disk; tokens are exact."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=9)
    reference = _reference(model, ids, 33)
    with tiny_tmpfs(tmp_path / "tiny", "512k") as directory, caplog.at_level(logging.WARNING, logger="tierkv"):
        with _cache(model, directory, disk_gb="64KB", persist_gb="128KB") as cache:
            _fill(directory, (64 << 10) + (20 << 10))  # the tier's budget and about one record
            cache.load_prefix(model, ids)
            first = model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False)
            cache.flush()  # the prompt's records are written (or skipped) before the tier grows
            assert cache.runtime.disk.allocated_bytes == 0
            cache.load_prefix(model, first)
            out = model.generate(first, past_key_values=cache, max_new_tokens=32, do_sample=False)
            cache.flush()
            assert cache.runtime.disk.allocated_bytes > 0
            stats = cache.session.prefix.store.stats()
        assert torch.equal(out, reference)
        assert stats["skipped_for_space"] > 0 and stats["blocks"] < PROMPT // BT
        skipped = [r for r in caplog.records if "disk tier's budget still needs" in r.getMessage()]
        assert len(skipped) == 1
