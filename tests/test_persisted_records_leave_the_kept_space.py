"""The persistent store writes a record only if the filesystem keeps ``keep_free`` bytes free after it (the disk
tier's room): the record's own size counts, not only the free space before it. A real, small tmpfs."""

from __future__ import annotations

import os
from pathlib import Path

from helpers import tiny_tmpfs

from tierkv.persist import record
from tierkv.persist.blockfile import Item, PersistentStore

RECORD = 64 << 10


def _free(directory: Path) -> int:
    usage = os.statvfs(directory)
    return usage.f_bavail * usage.f_frsize


def _item(key: str) -> Item:
    head, payload = record.encode({"kind": "block", "key": key}, bytes(RECORD))
    return Item(key, 0, head, bytes(payload))


def test_a_record_that_would_eat_into_the_kept_space_is_skipped(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "tiny", "1m") as directory:
        store = PersistentStore(directory, 1 << 20)
        try:
            keep = _free(directory) - RECORD // 2  # free now, but not once a record is written
            store.keep_free = lambda: keep
            assert store.put([_item(f"a{0:031x}")]) == 0
            assert store.skipped_for_space == 1
            assert _free(directory) >= keep
            keep = _free(directory) - 4 * RECORD  # room for the record, its manifest and folder
            assert store.put([_item(f"b{0:031x}")]) == 1
            assert _free(directory) >= keep
        finally:
            store.close()
