"""A sweep of attacks on tierkv where its K/V leaves the process, each tried for real (real files, a real
``redis-server``, another user's links) through the public API; each test failed before its fix
(docs/reliability.md, "Security"):

- a JSON header nested past the parser's stack (``[`` x 10**5, its checksum computed: anyone can) in a
  conversation file, a remote value, a persisted record or the manifest raised ``RecursionError`` out of
  ``load``/``load_prefix``/the store's open; it is now an ``IntegrityError``, a corrupt miss, a dropped block
  or an empty listing, as any other unreadable header;
- a symbolic link another user planted in a shared directory (/tmp) where the user's ``disk_dir`` is about
  to be made pointed the cache at any directory of this user's (with ``fs.protected_symlinks`` off); it is
  refused, naming the link's owner and the fix;
- ``TIERKV_REMOTE_TIMEOUT=١٢`` (Arabic-Indic digits) or ``1_0`` was read as 12 or 10 seconds while the
  integer knobs take ASCII digits only; both seconds knobs now refuse them too.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash
from helpers import prefix_worker
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import settings
from tierkv.errors import DiskTierError, IntegrityError, InvalidConfigError
from tierkv.hf import TieredCache
from tierkv.persist import manifest, record
from tierkv.persist.blockfile import DIRECTORY_NAME, PersistentStore
from tierkv.persist.keys import Namespace, block_keys
from tierkv.remote.framing import frame

BT = 16
NEW = 4
NESTED = b"[" * 100_000 + b"]" * 100_000  # valid JSON nesting, deeper than the parser's stack
SHALLOW_NESTED = b"[" * 5_000 + b"]" * 5_000  # the same, small enough for a remote value's bound


OTHER_UID = 1001  # another user of the machine (mallory), who owns the links she plants
needs_other_user = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a planted link another owner")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3)


@pytest.fixture(autouse=True)
def _no_tierkv_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for setting in settings.SETTINGS.values():
        monkeypatch.delenv(setting.variable, raising=False)


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A directory as /tmp is (1777): another user can make names in it."""
    path = Path(tempfile.mkdtemp(prefix="tierkv-sweep-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def raw_record(text: bytes, payload: bytes = b"") -> bytes:
    """A record (tierkv.persist.record's layout) of header ``text``, any bytes, with its right checksum: what
    anyone can write, since xxh3 is no secret."""
    digest = xxhash.xxh3_64()
    digest.update(text)
    digest.update(payload)
    return struct.pack("<4sHHIQQ", record.MAGIC, record.VERSION, 0, len(text), len(payload),
                       digest.intdigest()) + text + payload


def reference(model, ids) -> torch.Tensor:
    return model.generate(ids, cache=DynamicCache(), max_new_tokens=NEW, do_sample=False)


# ------------------------------------------------------------------------------- nested JSON headers
def test_a_nested_conversation_header_is_an_integrity_error(model, tmp_path) -> None:
    """A file handed to ``TieredCache.load`` (sync and async) whose first record's header is nested JSON."""
    path = tmp_path / "chat.tkv"
    path.write_bytes(raw_record(NESTED))
    with pytest.raises(IntegrityError, match="unreadable header"):
        TieredCache.load(path, model=model)
    pytest.importorskip("aiofiles")
    import asyncio

    with pytest.raises(IntegrityError, match="unreadable header"):
        asyncio.run(TieredCache.aload(path, model=model))


def test_a_nested_remote_record_is_a_corrupt_miss(model, redis_server, caplog) -> None:
    """Block 1's value on the shared server replaced by an intact frame around a record whose header is nested
    JSON: a miss after block 0, counted corrupt and replaced, never an exception out of ``load_prefix``."""
    ids, _ = prompt(1, 100)
    expected = reference(model, ids)
    prefix_worker(model, ids, BT, NEW, remote=redis_server.url)
    root = Namespace.of_model(model, BT).root
    key = block_keys(root, ids[0], BT)[1]
    raw = redis_server.client()
    raw.set(f"tierkv:{root}:{key}", frame(key.encode(), raw_record(SHALLOW_NESTED)))
    out, loaded, stats = prefix_worker(model, ids, BT, NEW, remote=redis_server.url)
    assert loaded == BT and torch.equal(out, expected)
    assert stats["remote"]["corrupt"] == 1 and "unreadable header" in caplog.text
    out, loaded, _ = prefix_worker(model, ids, BT, NEW, remote=redis_server.url)  # the write-through replaced it
    assert loaded == 96 and torch.equal(out, expected)


def test_a_nested_manifest_or_record_header_is_a_miss(model, tmp_path) -> None:
    """What a member of a group-shared store (or a damaged disk) can leave: a listed record whose header is nested
    JSON is dropped and recomputed; a manifest whose listing is nested JSON starts the store empty."""
    ids, _ = prompt(1, 100)
    expected = reference(model, ids)
    disk = dict(disk_dir=tmp_path, persist=True)
    prefix_worker(model, ids, BT, NEW, **disk)
    root = tmp_path / DIRECTORY_NAME
    key = block_keys(Namespace.of_model(model, BT).root, ids[0], BT)[2]
    listing = manifest.load(root / manifest.NAME)
    planted = raw_record(SHALLOW_NESTED)
    (root / "blocks" / key[:2] / f"{key}.tkv").write_bytes(planted)
    listing.entries[key].nbytes = len(planted)  # listed at its real size: only the header is wrong
    manifest.write(os.open(root, os.O_RDONLY), listing)
    out, loaded, _ = prefix_worker(model, ids, BT, NEW, **disk)
    assert loaded == 2 * BT and torch.equal(out, expected)

    head, payload = record.encode({"kind": "manifest", "format": manifest.FORMAT}, b"")
    nested = raw_record(head[record.PREFIX_BYTES:], NESTED)
    (root / manifest.NAME).write_bytes(nested)
    store = PersistentStore(tmp_path, 1 << 30)
    assert store.recovery.manifest_lost and store.stats()["blocks"] == 0
    store.close()
    out, loaded, _ = prefix_worker(model, ids, BT, NEW, **disk)
    assert loaded == 0 and torch.equal(out, expected)


# --------------------------------------------------------------------- a disk_dir another user linked
@needs_other_user
@pytest.mark.parametrize("persist", [False, True])
def test_a_disk_dir_link_another_user_planted_is_refused(model, public_tmp, tmp_path, persist) -> None:
    """The user names ``/tmp/kv`` (not made yet); another user made it a link to a directory of this user's.
    Followed, the cache wrote its files there; it is refused, and the target stays as it was. A link of the
    user's own is still followed (their choice)."""
    target = tmp_path / "mine"
    target.mkdir(mode=0o700)
    (target / "precious").write_bytes(b"precious")
    link = public_tmp / "kv"
    link.symlink_to(target)
    os.lchown(link, OTHER_UID, OTHER_UID)
    ids, _ = prompt(1, 40)
    with pytest.raises(DiskTierError, match=r"symbolic link of another user \(uid 1001\)"), \
            TieredCache(gpu_gb="64KB", cpu_gb="64KB", disk_dir=link, persist=persist, block_tokens=BT) as cache:
        if persist:
            cache.load_prefix(model, ids)
        with torch.no_grad():
            model(ids, past_key_values=cache)
    assert sorted(os.listdir(target)) == ["precious"]
    os.lchown(link, os.geteuid(), os.getegid())  # the user's own link: followed
    with TieredCache(gpu_gb="64KB", cpu_gb="64KB", disk_dir=link, persist=persist, block_tokens=BT) as cache:
        if persist:
            cache.load_prefix(model, ids)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        assert len(os.listdir(target)) > 1


# ----------------------------------------------------------------------------------- environment
@pytest.mark.parametrize("variable", ["TIERKV_REMOTE_TIMEOUT", "TIERKV_REMOTE_QUEUE_WAIT"])
@pytest.mark.parametrize("value", ["١٢", "٤", "1_0"])
def test_seconds_knobs_take_ascii_digits_only(monkeypatch, variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    name = next(s.name for s in settings.SETTINGS.values() if s.variable == variable)
    with pytest.raises(InvalidConfigError, match=f"{variable}.*ASCII digits"):
        settings.get(name)
    monkeypatch.setenv(variable, " 1.5 ")
    assert settings.get(name) == 1.5
