"""Persistence: content addresses, the record format, the persistent store, and prefix reuse through
``TieredCache(persist=True)`` on real transformers models (tests/models.py)."""

from __future__ import annotations

import contextlib
import copy
import errno
import io
import os
import stat
import subprocess
import sys
import tracemalloc

import pytest
import torch
import transformers
from helpers import tiny_tmpfs
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import safefs
from tierkv.errors import DiskFullError, DiskTierError, IntegrityError, InvalidConfigError, NewerFormatError
from tierkv.hf import TieredCache, cache_keyword
from tierkv.hf.session import rope_limit
from tierkv.persist import keys, record
from tierkv.persist import manifest as manifests
from tierkv.persist.blockfile import DIRECTORY_NAME, Item, PersistentStore, Recovery
from tierkv.persist.keys import Namespace, block_keys, model_fingerprint
from tierkv.persist.prefix import PrefixPersistence

BT = 4


# ------------------------------------------------------------------------------------------------ keys
def test_block_keys_chain_over_the_whole_prefix():
    root = "r" * 32
    ids = list(range(10, 30))  # 5 full blocks of 4
    keys = block_keys(root, ids, BT)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert block_keys(root, ids + [7, 7], BT) == keys  # a partial last block has no key
    changed = ids.copy()
    changed[9] = 99  # block 2
    other = block_keys(root, changed, BT)
    assert other[:2] == keys[:2] and all(a != b for a, b in zip(other[2:], keys[2:]))
    assert all(a != b for a, b in zip(block_keys("s" * 32, ids, BT), keys))  # another namespace: nothing shared
    # the same tokens in a later block have another key (the chain, not the block's own tokens)
    repeated = block_keys(root, [1, 2, 3, 4] * 2, BT)
    assert repeated[0] != repeated[1]
    assert block_keys(root, torch.tensor(ids), BT) == keys


def test_namespace_separates_models_dtypes_layouts_and_attention():
    model = tiny_model("llama")
    base = Namespace.of_model(model, BT)
    assert base == Namespace.of_model(model, BT)  # deterministic
    assert base.block_shape == (2, 2, 2, BT, 16)
    others = {
        "qwen2": Namespace.of_model(tiny_model("qwen2"), BT),
        "layers": Namespace.of_model(tiny_model("llama", layers=3), BT),
        "eager": Namespace.of_model(tiny_model("llama", attn="eager"), BT),
        "block_tokens": Namespace.of_model(model, BT * 2),
    }
    roots = {name: ns.root for name, ns in others.items()}
    assert base.root not in roots.values() and len(set(roots.values())) == len(roots)
    half = Namespace(**{**base.to_dict(), "dtype": "bfloat16"})
    assert half.root != base.root


def test_a_namespace_needs_a_transformers_model():
    with pytest.raises(InvalidConfigError, match="no .config"):
        Namespace.of_model(torch.nn.Linear(2, 2), BT)


def test_prefix_load_needs_a_started_sequence(tmp_path):
    persistence = PrefixPersistence(PersistentStore(tmp_path, 1 << 20), BT)
    try:
        with pytest.raises(InvalidConfigError, match="start"):
            persistence.load()
    finally:
        persistence.close()


def test_fingerprint_sees_weights_not_the_load_path():
    model = tiny_model("llama")
    before = model_fingerprint(model)
    changed = tiny_model.__wrapped__("llama")  # a fresh copy of the same weights
    assert model_fingerprint(changed) == before
    changed.config._name_or_path = "/somewhere/else"
    assert model_fingerprint(changed) == before
    with torch.no_grad():
        changed.model.layers[1].self_attn.k_proj.weight.add_(1e-3)  # a fine-tune of one matrix
    assert model_fingerprint(changed) != before
    assert model_fingerprint(changed.to(torch.bfloat16)) != before


# ---------------------------------------------------------------------------------------------- record
def _block(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn((2, 2, 2, BT, 16), generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_record_round_trip(dtype):
    ns = Namespace.of_model(tiny_model("llama"), BT)
    ns = Namespace(**{**ns.to_dict(), "dtype": str(dtype).removeprefix("torch.")})
    kv = _block(1, dtype)
    head, payload = record.encode_block("k" * 32, ns.root, 3, kv)
    data = bytearray(head) + payload
    back = record.decode_block(data, key="k" * 32, namespace=ns)
    assert back.dtype == dtype and torch.equal(back, kv)
    header, _ = record.read(io.BytesIO(bytes(data)))
    assert header["depth"] == 3 and header["kind"] == "block"
    with pytest.raises(IntegrityError, match="not"):
        record.decode_block(data, key="x" * 32)
    with pytest.raises(IntegrityError, match="differ"):
        record.decode_block(data, namespace=Namespace(**{**ns.to_dict(), "fingerprint": "other"}))


def test_every_flipped_byte_and_every_truncation_is_detected():
    head, payload = record.encode({"kind": "test", "n": 1}, bytes(range(64)))
    data = bytes(head) + bytes(payload)
    for position in range(len(data)):
        for bit in (0, 7):
            flipped = bytearray(data)
            flipped[position] ^= 1 << bit
            with pytest.raises(IntegrityError):
                record.decode(flipped)
    for length in range(len(data)):
        with pytest.raises(IntegrityError):
            record.decode(data[:length])
        with pytest.raises(IntegrityError):
            record.read(io.BytesIO(data[:length]))
    with pytest.raises(IntegrityError):
        record.decode(data + b"\0")


def test_records_stream_back_to_back(tmp_path):
    aiofiles = pytest.importorskip("aiofiles")
    import asyncio

    path = tmp_path / "two"
    with open(path, "wb") as f:
        for n in (1, 2):
            head, payload = record.encode({"n": n}, bytes([n]) * (n * 1000))
            f.write(head)
            f.write(payload)
    with open(path, "rb") as f:
        assert [record.read(f)[0]["n"] for _ in range(2)] == [1, 2]

    async def both():
        async with aiofiles.open(path, "rb") as f:
            return [(await record.aread(f)) for _ in range(2)]

    (first, one), (second, two) = asyncio.run(both())
    assert (first["n"], second["n"]) == (1, 2) and bytes(two) == b"\2" * 2000 and len(one) == 1000


# ----------------------------------------------------------------------------------------------- store
def _item(key: str, size: int = 1000, depth: int = 0) -> Item:
    head, payload = record.encode({"kind": "block", "key": key}, bytes([len(key) % 251]) * size)
    return Item(key, depth, head, bytes(payload))


def _keys(n: int, tag: str = "a") -> list[str]:
    return [f"{tag}{i:031x}" for i in range(n)]


def test_store_round_trip_shared_by_two_stores(tmp_path):
    one = PersistentStore(tmp_path, 1 << 20)
    keys = _keys(4)
    assert one.put([_item(k, depth=i) for i, k in enumerate(keys[:3])]) == 3
    assert one.put([_item(keys[0])]) == 0  # already listed
    two = PersistentStore(tmp_path, 1 << 20)  # a second store (another process would be the same) sees them
    assert two.recovery == Recovery()
    assert two.lookup(keys) == 3 and two.lookup(keys[1:]) == 2 and two.lookup(_keys(2, "b")) == 0
    found = two.get(keys)
    assert len(found) == 3
    assert [record.decode(data)[0]["key"] for data in found] == keys[:3]
    assert two.verify() == [] and two.stats()["blocks"] == 3
    one.close()
    two.close()
    assert [p.name for p in (tmp_path / DIRECTORY_NAME / "tmp").iterdir()] == []


def test_a_corrupt_block_is_a_miss_and_is_removed(tmp_path, caplog):
    store = PersistentStore(tmp_path, 1 << 20)
    keys = _keys(3)
    store.put([_item(k, depth=i) for i, k in enumerate(keys)])
    path = store._path(keys[1])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    assert len(store.get(keys)) == 1  # the chain stops at the corrupt block
    assert "checksum" in caplog.text and not path.exists()
    assert store.lookup(keys) == 1 and keys[2] in store
    store.close()


def test_opening_removes_what_dead_writers_left(tmp_path):
    store = PersistentStore(tmp_path, 1 << 20)
    keys = _keys(3)
    store.put([_item(k) for k in keys])
    root = tmp_path / DIRECTORY_NAME
    (root / "blocks" / "ff").mkdir()
    (root / "blocks" / "ff" / f"{'f' * 32}.tkv").write_bytes(b"renamed but never listed")
    (root / "blocks" / "zz").mkdir()  # not a name tierkv makes (keys are hex): never removed
    (root / "blocks" / "zz" / f"{'z' * 32}.tkv").write_bytes(b"not tierkv's")
    (root / "tmp" / "999-dead").mkdir()
    (root / "tmp" / "999-dead" / "x.tkv").write_bytes(b"half a record")
    (root / "tmp" / "998-dead.lock").write_bytes(b"")  # died between taking its lock and making its area
    (root / "manifest.tmp").write_bytes(b"torn manifest")
    torn = store._path(keys[2])
    torn.write_bytes(torn.read_bytes()[:100])
    store._path(keys[1]).unlink()
    other = PersistentStore(tmp_path, 1 << 20)
    assert other.recovery == Recovery(scratch_areas=1, unlisted=1, torn=1, missing=1)
    assert other.lookup(keys) == 1 and other.verify() == []
    assert sorted(p.name for p in (root / "tmp").iterdir()) == sorted(  # the live stores' areas stay
        [store._scratch.name, f"{store._scratch.name}.lock", other._scratch.name, f"{other._scratch.name}.lock"])
    assert not (root / "manifest.tmp").exists()
    assert not (root / "blocks" / "ff" / f"{'f' * 32}.tkv").exists()
    assert (root / "blocks" / "zz" / f"{'z' * 32}.tkv").read_bytes() == b"not tierkv's"
    store.close()
    other.close()


def test_a_corrupt_manifest_starts_empty(tmp_path):
    store = PersistentStore(tmp_path, 1 << 20)
    store.put([_item(k) for k in _keys(2)])
    store.close()
    manifest = tmp_path / DIRECTORY_NAME / "manifest"
    manifest.write_bytes(manifest.read_bytes()[:-1])
    again = PersistentStore(tmp_path, 1 << 20)
    assert again.recovery.manifest_lost and again.recovery.unlisted == 2 and again.stats()["blocks"] == 0
    again.close()


def _rewrite_manifest(path, header=None, version=None) -> None:
    """Replace the manifest at ``path`` by its listing under ``header`` and/or record version ``version``."""
    _, listing = record.decode(path.read_bytes())
    head, payload = record.encode(header or {"kind": "manifest", "format": manifests.FORMAT}, bytes(listing))
    if version is not None:
        head = head[:4] + version.to_bytes(2, "little") + head[6:]
    path.write_bytes(head + bytes(payload))


@pytest.mark.parametrize("newer", ["format", "record"])
def test_a_store_a_newer_tierkv_wrote_is_refused_and_left_as_it_is(tmp_path, newer, caplog):
    """A manifest of a later format (or record version) is a newer tierkv's store, not a damaged one: opening it
    is refused with the way out and removes nothing (it used to start an empty listing and delete every block);
    one that appears while a store is open is left alone too (no write replaces it, no read is bookkept)."""
    store = PersistentStore(tmp_path, 1 << 20)
    keys = _keys(3)
    store.put([_item(k, depth=i) for i, k in enumerate(keys)])
    manifest = tmp_path / DIRECTORY_NAME / "manifest"
    if newer == "format":
        _rewrite_manifest(manifest, {"kind": "manifest", "format": manifests.FORMAT + 1})
    else:
        _rewrite_manifest(manifest, version=record.VERSION + 1)
    def files() -> dict:
        return {path: path.read_bytes() for path in (tmp_path / DIRECTORY_NAME / "blocks").rglob("*")
                if path.is_file()} | {manifest: manifest.read_bytes()}  # fmt: skip

    before = files()
    assert len(before) == 4
    assert store.lookup(keys) == 0 and store.get(keys) == []
    assert store.put([_item(k) for k in _keys(2, tag="b")]) == 0
    store.close()
    with pytest.raises(NewerFormatError, match=r"newer tierkv .*upgrade tierkv, or give this version a disk_dir"):
        PersistentStore(tmp_path, 1 << 20)
    assert files() == before
    assert caplog.text.count("leaves that store as it is") == 1  # warned once


@pytest.mark.parametrize("found", [True, 1.0, "1", None, 0])
def test_a_manifest_format_is_an_integer_exactly(tmp_path, found):
    store = PersistentStore(tmp_path, 1 << 20)
    store.put([_item(k) for k in _keys(2)])
    store.close()
    _rewrite_manifest(tmp_path / DIRECTORY_NAME / "manifest", {"kind": "manifest", "format": found})
    with pytest.raises(IntegrityError, match="not a tierkv manifest of format 1"):
        manifests.load(tmp_path / DIRECTORY_NAME / "manifest")


def test_a_block_record_of_a_newer_tierkv_is_a_miss_left_in_place(tmp_path, caplog):
    store = PersistentStore(tmp_path, 1 << 20)
    keys = _keys(2)
    store.put([_item(k, depth=i) for i, k in enumerate(keys)])
    path = next((tmp_path / DIRECTORY_NAME / "blocks").rglob(f"{keys[1]}*"))
    data = bytearray(path.read_bytes())
    data[4:6] = (record.VERSION + 1).to_bytes(2, "little")
    path.write_bytes(data)
    assert len(store.get(keys)) == 1 and path.read_bytes() == data and keys[1] in store
    assert "newer tierkv" in caplog.text
    assert store.verify() == [] and path.exists()
    store.close()


@pytest.mark.parametrize("depth", [2**70, 2**63, -1, True, 1.5])
def test_put_refuses_what_the_manifest_reader_would_refuse(tmp_path, depth):
    """The writer checks every item by the reader's rule: a depth out of range (a crafted remote header) is an
    error, never listed, so the manifest stays readable and the blocks already stored stay."""
    store = PersistentStore(tmp_path, 1 << 20)
    keys = _keys(3)
    store.put([_item(k, depth=i) for i, k in enumerate(keys)])
    with pytest.raises(InvalidConfigError, match="depth"):
        store.put([_item("b" * 32, depth=depth)])
    with pytest.raises(InvalidConfigError, match="block key"):
        store.put([_item("B" * 32)])
    store.close()
    again = PersistentStore(tmp_path, 1 << 20)
    assert again.recovery == Recovery() and again.lookup(keys) == 3 and "b" * 32 not in again
    again.close()


@pytest.mark.parametrize("fault", [
    pytest.param(MemoryError(), id="no-memory"),
    pytest.param(OSError(errno.EMFILE, "Too many open files"), id="no-descriptor"),
    pytest.param(OSError(errno.EIO, "Input/output error"), id="io-error"),
])
def test_a_record_this_process_cannot_read_now_is_a_miss_kept_for_the_others(tmp_path, monkeypatch, caplog, fault):
    """No memory, no file descriptor or an I/O error while reading a record is this process's miss: the record
    stays listed and on disk for the processes sharing the store (it was unlisted and deleted for all of them)."""
    store = PersistentStore(tmp_path, 1 << 20)
    keys = _keys(2)
    store.put([_item(k, depth=i) for i, k in enumerate(keys)])

    read_whole = safefs.read_whole

    def failing(fd: int, what: str, limit: int) -> bytearray:
        if what.endswith(".tkv"):  # records, not the manifest
            raise fault
        return read_whole(fd, what, limit)

    monkeypatch.setattr(safefs, "read_whole", failing)
    assert store.get(keys) == [] and "recomputed" in caplog.text
    assert store.verify() == []
    monkeypatch.setattr(safefs, "read_whole", read_whole)
    other = PersistentStore(tmp_path, 1 << 20)
    assert other.lookup(keys) == 2 and len(other.get(keys)) == 2
    other.close()
    store.close()


def test_the_manifest_is_read_within_a_bound_the_writer_keeps(tmp_path, monkeypatch):
    """A sparse manifest beyond ``MAX_BYTES`` is refused by its size before anything is allocated; the writer
    evicts to keep the listing within ``MAX_ENTRIES`` (which bounds the file), never a block of the same call."""
    store = PersistentStore(tmp_path, 1 << 20)
    store.put([_item(k) for k in _keys(2)])
    store.close()
    manifest = tmp_path / DIRECTORY_NAME / "manifest"
    os.truncate(manifest, 200 << 20)  # a hole: nothing is written, reading it would allocate 200 MiB
    tracemalloc.start()
    try:
        again = PersistentStore(tmp_path, 1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert again.recovery.manifest_lost and peak < 1 << 20
    monkeypatch.setattr(manifests, "MAX_ENTRIES", 3)
    keys = _keys(5, "b")
    assert again.put([_item(k, depth=i) for i, k in enumerate(keys)]) == 3  # the rest would evict its own chain
    assert again.put([_item("c" * 32)]) == 1 and again.stats()["blocks"] == 3
    assert again.lookup(keys) == 2 and "c" * 32 in again  # the deepest of the older chain went first
    again.close()


def test_names_another_program_left_in_blocks_are_one_warning(tmp_path, caplog):
    """Thousands of names tierkv did not make in ``blocks/`` are left alone and said once (they flooded the log
    with one warning each at every open)."""
    PersistentStore(tmp_path, 1 << 20).close()
    blocks = tmp_path / DIRECTORY_NAME / "blocks"
    for i in range(2000):
        (blocks / f"junk-{i}").write_bytes(b"")
    with caplog.at_level("WARNING", logger="tierkv"):
        PersistentStore(tmp_path, 1 << 20).close()
    lines = [r.getMessage() for r in caplog.records if "not tierkv's" in r.getMessage()]
    assert len(lines) == 1 and "2,000 names" in lines[0] and "and 1,997 more" in lines[0]
    assert len(list(blocks.iterdir())) == 2000


def test_a_hard_link_planted_at_the_lock_is_refused_and_its_file_unchanged(tmp_path):
    """A lock file with another name elsewhere (a hard link to someone's file) is never locked nor chmod-ed."""
    store = PersistentStore(tmp_path, 1 << 20)
    store.close()
    lock = tmp_path / DIRECTORY_NAME / "lock"
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    outside.chmod(0o444)
    lock.unlink()
    os.link(outside, lock)
    with pytest.raises(IntegrityError, match="hard link"):
        PersistentStore(tmp_path, 1 << 20)
    assert stat.S_IMODE(outside.stat().st_mode) == 0o444 and outside.read_bytes() == b"keep"
    lock.unlink()
    PersistentStore(tmp_path, 1 << 20).close()


@pytest.mark.parametrize("name,planted", [("manifest", "directory"), ("lock", "directory"), ("lock", "FIFO"),
                                          ("lock", "symbolic link")])
def test_a_non_file_planted_at_the_lock_or_manifest_is_named_with_its_fix(tmp_path, name, planted):
    """Every open is refused with what is there and how to remove it (not "a writable filesystem"); nothing
    planted is removed or followed, and once it is removed the store opens again."""
    store = PersistentStore(tmp_path, 1 << 20)
    keys = _keys(2)
    store.put([_item(k, depth=i) for i, k in enumerate(keys)])
    store.close()
    path = tmp_path / DIRECTORY_NAME / name
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    path.unlink(missing_ok=True)
    if planted == "directory":
        path.mkdir()
        (path / "inside").write_bytes(b"keep")
    elif planted == "FIFO":
        os.mkfifo(path)
    else:
        path.symlink_to(outside)
    for _ in range(2):
        with pytest.raises(DiskTierError, match=f"it is a {planted} where tierkv keeps a file") as refused:
            PersistentStore(tmp_path, 1 << 20)
        assert f"rm -r '{path}'" in str(refused.value) and "writable filesystem" not in str(refused.value)
    assert outside.read_bytes() == b"keep" and (path.is_symlink() or path.exists())
    if planted == "directory":
        assert (path / "inside").read_bytes() == b"keep"
        (path / "inside").unlink()
        path.rmdir()
    else:
        path.unlink()
    again = PersistentStore(tmp_path, 1 << 20)
    assert again.lookup(keys) == (2 if name == "lock" else 0)  # a manifest that was a directory listed nothing
    again.close()


def test_capacity_evicts_least_recently_used_and_keeps_chains_usable(tmp_path):
    size = len(_item("x" * 32).head) + 1000
    store = PersistentStore(tmp_path, 5 * size)
    old, new = _keys(3, "a"), _keys(3, "b")
    store.put([_item(k, depth=i) for i, k in enumerate(old)])
    store.put([_item(k, depth=i) for i, k in enumerate(new[:2])])
    store.get(old[:1])  # old[0] is now the most recently used
    store.put([_item(new[2], depth=2)], touch=new[:2])
    assert store.stats()["bytes"] <= 5 * size
    # one had to go: the least recently used chain's deepest block; new's chain was touched
    assert store.lookup(old) == 2 and store.lookup(new) == 3 and old[2] not in store
    store.put([_item(k, depth=3 + i) for i, k in enumerate(_keys(2, "d"))], touch=new)
    assert store.lookup(old) == 0 and store.lookup(new) == 3  # the two oldest went: old[1], then old[0]
    # a chain longer than the capacity keeps its shallow blocks
    long = _keys(8, "c")
    store.put([_item(k, depth=i) for i, k in enumerate(long)])
    assert store.lookup(long) == 5 and store.stats()["blocks"] == 5
    store.close()


WRITER = """
import sys
from tierkv.persist import keys, record
from tierkv.persist.blockfile import Item, PersistentStore
store = PersistentStore(sys.argv[1], 1 << 30)
for i in range(40):
    key = f"{sys.argv[2]}{i:031x}"
    head, payload = record.encode({"kind": "block", "key": key}, bytes(5000))
    store.put([Item(key, i, head, payload)])
store.close()
"""


def test_two_processes_write_one_directory(tmp_path):
    children = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), tag]) for tag in "cd"]  # keys are hex
    here = PersistentStore(tmp_path, 1 << 30)
    mine = _keys(40, "e")
    for key in mine:
        here.put([_item(key)])
    assert [child.wait(timeout=60) for child in children] == [0, 0]
    assert all(here.lookup(_keys(40, tag)) == 40 for tag in "cde")
    assert here.verify() == [] and here.stats()["blocks"] == 120
    here.close()


# ------------------------------------------------------------------------------ prefix reuse (TieredCache)
SLOT = 4096  # one 4-token block of the tiny models (1 KiB of K/V) in its 4 KiB slot
PROMPT = 26  # 6 full blocks and 2 tokens
NEW = 6
# (family, attention, sliding window): Mistral's every layer and Gemma2's every other layer slide over 8 tokens
FAMILIES = [("llama", "sdpa", None), ("qwen2", "sdpa", None), ("phi3", "sdpa", None),
            ("mistral", "sdpa", 8), ("gemma2", "eager", 8)]


def _cache(model, directory, context: int = PROMPT + NEW, batch: int = 1, **options) -> TieredCache:
    """Budgets small enough that the K/V spreads over device, host and disk (as in test_hf_exactness)."""
    device = TieredCache.min_device_bytes(model.config, context, batch, BT) + 2 * SLOT
    options.setdefault("persist", True)
    return TieredCache(gpu_gb=f"{device}B", cpu_gb=f"{4 * SLOT}B", disk_gb="64MiB", disk_dir=directory,
                       block_tokens=BT, config=model.config, **options)


def _generate(model, ids, cache=None, new: int = NEW):
    return model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_keyword(model): cache}, max_new_tokens=new,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)


class _Counter:
    """Counts the token positions the model computes (its embedding's inputs), per forward: a forward hook of the
    test's own, so nothing is persisted while it counts (it could change the K/V)."""

    def __init__(self, model) -> None:
        self.calls: list[int] = []
        self._hook = model.get_input_embeddings().register_forward_pre_hook(
            lambda _, args: self.calls.append(args[0].shape[1]))

    def __enter__(self) -> _Counter:
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()



def _persist(model, ids: torch.Tensor, tmp_path):
    """A cold process: prefill ``ids`` with persistence on and generate; returns its output, checked against
    DynamicCache's (the tests' reference for the warm caches, so it must be right itself). The reference runs on
    a copy made first: a model's dynamic RoPE scaling depends on the longest forward the object ran."""
    plain = copy.deepcopy(model)
    with _cache(model, tmp_path) as cold:
        cold.load_prefix(model, ids)
        out = _generate(model, ids, cold)
    _assert_same(_generate(plain, ids, DynamicCache(config=model.config)), out)
    return out


def _assert_same(ref, out) -> None:
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.logits, out.logits):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family,attn,window", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_later_cache_reuses_the_prefix_and_computes_only_the_tail(family, attn, window, tmp_path):
    model = tiny_model(family, attn, window)
    ids, _ = prompt(1, PROMPT, seed=3)
    reference = _generate(model, ids, DynamicCache(config=model.config))
    with _cache(model, tmp_path) as cold:  # (no counter here: a hook of the test's own would stop persistence)
        assert cold.load_prefix(model, ids) == 0
        _assert_same(reference, _generate(model, ids, cold))
    with _cache(model, tmp_path) as warm:
        loaded = warm.load_prefix(model, ids)
        assert loaded == (PROMPT // BT) * BT == 24
        with _Counter(model) as counted:
            out = _generate(model, ids, warm)
        assert counted.calls == [PROMPT - loaded] + [1] * (NEW - 1)  # only the uncached tail was prefilled
        _assert_same(reference, out)
        warm.store.check()


def test_a_stalled_store_never_stalls_decoding_and_catches_up(tmp_path, monkeypatch):
    """Regression: the writer's queue holds a few batches, and a forward waited for room in it, so a store that
    writes slowly (a remote server behind a slow link) stalled decode steps for seconds. A forward now queues
    what fits and leaves the rest in the tiers for a later one; ``close()`` waits for it all, and a later cache
    reuses every block."""
    import threading

    from tierkv.persist import prefix

    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=8)
    reference = _generate(model, ids, DynamicCache(config=model.config))
    monkeypatch.setattr(prefix, "BATCH_BYTES", 1)  # one block column per batch: 6 batches, the queue holds 4
    release = threading.Event()
    put = PersistentStore.put

    def stalled(self, items, touch=()):
        assert release.wait(60), "the test's store was never released"
        return put(self, items, touch)

    monkeypatch.setattr(PersistentStore, "put", stalled)
    result: list = []
    with _cache(model, tmp_path) as cold:
        assert cold.load_prefix(model, ids) == 0
        worker = threading.Thread(target=lambda: result.append(_generate(model, ids, cold)))
        worker.start()
        worker.join(30)
        stalled_decoding = worker.is_alive()
        release.set()  # the store catches up (and a stalled generate, before the fix, finishes)
        worker.join(60)
    assert not stalled_decoding, "a decode step waited for the stalled store"
    _assert_same(reference, result[0])
    monkeypatch.setattr(PersistentStore, "put", put)
    with _cache(model, tmp_path) as warm:
        assert warm.load_prefix(model, ids) == (PROMPT // BT) * BT  # every block was written in the end
        _assert_same(reference, _generate(model, ids, warm))


def test_two_threads_submitting_first_start_one_writer(tmp_path, monkeypatch):
    """Regression: the writer thread was started lazily without a lock, so two threads submitting at once (a
    flush() from another thread beside a decoding one) started two; close() queued one stop and joined the
    writer that had not taken it: a hang."""
    import threading
    import time

    from tierkv.persist import prefix

    start = threading.Thread.start

    def slow_start(self):  # widens the window between "no writer yet" and "writer recorded"
        time.sleep(0.05)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    store = PersistentStore(tmp_path, 1 << 20)
    writer = prefix._Writer(store)
    submitters = [threading.Thread(target=writer.submit, args=("r" * 32, [], [])) for _ in range(2)]
    for thread in submitters:
        start(thread)
    for thread in submitters:
        thread.join()
    monkeypatch.setattr(threading.Thread, "start", start)
    assert sum(thread.name == "tierkv-persist" for thread in threading.enumerate()) == 1
    closer = threading.Thread(target=writer.close)
    start(closer)
    closer.join(10)
    assert not closer.is_alive(), "close() waits for a second writer that never stops"
    store.close()


def test_flush_from_another_thread_while_decoding(tmp_path):
    """Regression: ``flush()`` exported blocks without the cache's lock while another thread decoded. Now it
    exports under the lock a batch at a time and waits for the writer outside it: the decoding thread's tokens
    equal DynamicCache's, and every block is persisted."""
    import threading

    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=9)
    reference = _generate(model, ids, DynamicCache(config=model.config), 24)
    with _cache(model, tmp_path, context=PROMPT + 24) as cache:
        cache.load_prefix(model, ids)
        result: list = []
        worker = threading.Thread(target=lambda: result.append(_generate(model, ids, cache, 24)))
        worker.start()
        while worker.is_alive():
            cache.flush()
        worker.join()
        _assert_same(reference, result[0])
    with _cache(model, tmp_path) as warm:
        assert warm.load_prefix(model, ids) == (PROMPT // BT) * BT


def test_at_least_one_token_is_left_to_compute(tmp_path):
    model = tiny_model("llama")
    ids, _ = prompt(1, 6 * BT, seed=4)  # a whole number of blocks
    reference = _persist(model, ids, tmp_path)
    with _cache(model, tmp_path) as warm:
        assert warm.load_prefix(model, ids) == 5 * BT  # the sixth block holds the last token: computed again
        _assert_same(reference, _generate(model, ids, warm))
    with _cache(model, tmp_path) as short:
        assert short.load_prefix(model, ids[:, :1]) == 0


def test_a_shared_prefix_with_another_suffix(tmp_path):
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=5)
    _persist(model, ids, tmp_path)
    other = ids.clone()
    other[0, 10:] = (other[0, 10:] + 1) % 120 + 2  # shares tokens 0..9: blocks 0 and 1
    reference = _generate(model, other, DynamicCache(config=model.config))
    with _cache(model, tmp_path) as warm:
        assert warm.load_prefix(model, other) == 2 * BT
        _assert_same(reference, _generate(model, other, warm))


def test_another_model_dtype_layout_or_attention_never_matches(tmp_path):
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=6)
    _persist(model, ids, tmp_path)
    half = tiny_model.__wrapped__("llama").to(torch.bfloat16)
    for other in (tiny_model("qwen2"), tiny_model("llama", attn="eager"), tiny_model("llama", layers=3), half):
        with _cache(other, tmp_path) as cache:
            assert cache.load_prefix(other, ids) == 0
    device = TieredCache.min_device_bytes(model.config, PROMPT + NEW, 1, 2 * BT) + 2 * SLOT
    with TieredCache(gpu_gb=f"{device}B", disk_dir=tmp_path, block_tokens=2 * BT, persist=True) as cache:
        assert cache.load_prefix(model, ids) == 0  # another block size


def test_models_that_differ_in_one_weight_element_never_share_blocks(tmp_path, monkeypatch):
    """The fingerprint hashes every parameter byte: a copy with one element changed (an element no sampling of
    a few values per tensor would see) loads nothing of the original's blocks; the digest is computed once per
    model object and again after an in-place change, or with ``cached=False`` after a write through ``.data``."""
    model = tiny_model.__wrapped__("llama")
    ids, _ = prompt(1, PROMPT, seed=6)
    _persist(model, ids, tmp_path)
    with _cache(model, tmp_path) as warm:
        assert warm.load_prefix(model, ids) == PROMPT // BT * BT  # the original's own blocks are found
    other = tiny_model.__wrapped__("llama")
    weight = other.model.layers[1].mlp.down_proj.weight  # [64, 128]: element 1 of 8192
    original = weight.view(-1)[1].item()
    with torch.no_grad():
        weight.view(-1)[1] += 1e-3
    assert model_fingerprint(other) != model_fingerprint(model)
    with _cache(other, tmp_path) as cache:
        assert cache.load_prefix(other, ids) == 0

    hashed = []
    real = keys._tensors_digest
    monkeypatch.setattr(keys, "_tensors_digest", lambda tensors: hashed.append(1) or real(tensors))
    first = model_fingerprint(other)  # computed above (load_prefix): kept per model object
    assert model_fingerprint(other) == first and not hashed
    with torch.no_grad():
        weight.view(-1)[1] = original  # in place: torch counts it, the digest is computed again
    assert model_fingerprint(other) == model_fingerprint(model) and len(hashed) == 1
    weight.data.view(-1)[2] += 1.0  # through .data: torch does not count it
    assert model_fingerprint(other) == model_fingerprint(model)
    assert model_fingerprint(other, cached=False) != model_fingerprint(model)


def test_batches_load_what_every_row_shares(tmp_path):
    model = tiny_model("llama")
    ids, _ = prompt(2, PROMPT, seed=7)
    with _cache(model, tmp_path, batch=2) as cold:
        cold.load_prefix(model, ids[:1])  # row 0 alone: its 6 blocks are stored
        _generate(model, ids[:1], cold)
    both = ids.clone()
    both[1, : 3 * BT] = both[0, : 3 * BT]  # row 1 shares row 0's first 3 blocks
    reference = _generate(model, both, DynamicCache(config=model.config))
    with _cache(model, tmp_path, batch=2) as warm:
        assert warm.load_prefix(model, both) == 3 * BT
        _assert_same(reference, _generate(model, both, warm))
    with _cache(model, tmp_path, batch=2) as again:  # now row 1's blocks were persisted too
        assert again.load_prefix(model, both) == 6 * BT


def test_a_conversation_persists_its_generated_tokens_on_the_next_turn(tmp_path):
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=8)
    with _cache(model, tmp_path, context=64) as cache:
        cache.load_prefix(model, ids)
        first = _generate(model, ids, cache).sequences  # the cache holds all but its last token
        follow, _ = prompt(1, 5, seed=9)
        turn = torch.cat((first, follow), dim=1)
        wrong = turn.clone()
        wrong[0, 3] += 1
        with pytest.raises(InvalidConfigError, match="do not start with"):
            cache.load_prefix(model, wrong)
        assert cache.load_prefix(model, turn) == first.shape[1] - 1
        second = _generate(model, turn, cache)
    reference = _generate(model, turn, DynamicCache(config=model.config))
    _assert_same(reference, second)
    with _cache(model, tmp_path, context=64) as later:  # the first turn's generated tokens were persisted
        assert later.load_prefix(model, turn) == (turn.shape[1] - 1) // BT * BT
        _assert_same(reference, _generate(model, turn, later))


@pytest.mark.parametrize("change", ["load_state_dict", "through .data"])
def test_weights_changed_between_turns_persist_nothing_more(tmp_path, change):
    """The model load_prefix was given changed its weights in place before the next turn (a fine-tune's
    load_state_dict, an optimizer's write through .data): the blocks computed from then on are another model's over
    this one's K/V, and were persisted under the first model's keys, so a worker with the first model loaded them
    and decoded other tokens. Nothing of the sequence is persisted after the change; what was persisted before stays
    valid."""
    model = tiny_model("llama")
    worker = copy.deepcopy(model)
    ids, _ = prompt(1, PROMPT, seed=8)
    with _cache(model, tmp_path, context=80) as cache:
        cache.load_prefix(worker, ids)
        first = _generate(worker, ids, cache).sequences
        cache.flush()
        stored = _listed(tmp_path)
        assert stored == ids.shape[1] // BT  # the prompt's (generated ids are known at the next turn)
        if change == "load_state_dict":
            worker.load_state_dict({name: value * 1.5 if "v_proj" in name else value
                                    for name, value in model.state_dict().items()})  # fmt: skip
        else:  # as an optimizer or an EMA writes: torch counts no version
            for name, parameter in worker.named_parameters():
                if "v_proj" in name:
                    parameter.data.mul_(1.5)
        turn = torch.cat((first, prompt(1, 12, seed=9)[0]), dim=1)
        cache.load_prefix(worker, turn)
        _generate(worker, turn, cache)
        cache.flush()
        after = _listed(tmp_path)
    reference = _generate(model, turn, DynamicCache(config=model.config))
    with _cache(model, tmp_path, context=80) as later:
        loaded = later.load_prefix(model, turn)
        _assert_same(reference, _generate(model, turn, later))
    assert loaded == stored * BT and after == stored


def _listed(directory) -> int:
    """The blocks the persistent store under ``directory`` lists."""
    store = PersistentStore(directory, 1 << 30)
    try:
        return store.stats()["blocks"]
    finally:
        store.close()


def _roomy(model, directory) -> TieredCache:
    """A persisting cache with room for any executor (the device holds it all)."""
    return TieredCache(gpu_gb="64MB", cpu_gb="64MB", disk_dir=directory, persist=True, block_tokens=BT,
                       config=model.config)


def test_kv_decoded_with_sparse_attention_is_never_persisted(tmp_path):
    """Regression: a conversation decoded inside ``cache.sparse(model)`` persisted its generated tokens' blocks on
    the next turn like any others, but their K/V came from approximate attention (every layer's K/V after the
    first depends on the attention before it): an exact worker that loaded them decoded other logits than
    DynamicCache. Nothing from the first sparse step on is persisted now; the exact prefill before it is."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=8)
    follow, _ = prompt(1, 5, seed=9)
    with _roomy(model, tmp_path) as cache:
        cache.load_prefix(model, ids)
        with cache.sparse(model, tokens=BT):
            turn = torch.cat((_generate(model, ids, cache).sequences, follow), dim=1)
            cache.load_prefix(model, turn)
            last = torch.cat((_generate(model, turn, cache).sequences, follow), dim=1)
    reference = _generate(model, last, DynamicCache(config=model.config))
    with _roomy(model, tmp_path) as later:
        assert later.load_prefix(model, last) == PROMPT // BT * BT  # the prompt's full blocks, nothing decoded
        _assert_same(reference, _generate(model, last, later))


@pytest.mark.parametrize("mode", ["streaming", "split", "sparse"])
def test_an_engaged_cache_shares_the_prefix_with_plain_ones(mode, tmp_path):
    """Regression: inside ``cache.streaming/split/sparse(model)`` the model's attention implementation is tierkv's
    switch, and the namespace took that name: an engaged cache found none of the blocks a plain one stored (and
    every engaged executor, sparse included, shared one namespace of their own). It is the model's own attention
    now, which streaming and split compute."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=8)
    reference = _generate(model, ids, DynamicCache(config=model.config))
    with _roomy(model, tmp_path) as plain:
        plain.load_prefix(model, ids)
        _assert_same(reference, _generate(model, ids, plain))
    with _roomy(model, tmp_path) as cache, getattr(cache, mode)(model):
        assert cache.load_prefix(model, ids) == PROMPT // BT * BT
        out = _generate(model, ids, cache)
    if mode != "sparse":
        _assert_same(reference, out)


def _masked_generate(model, ids, mask, cache):
    return model.generate(ids, attention_mask=mask, **{cache_keyword(model): cache}, max_new_tokens=NEW,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)


def test_a_padded_batch_is_neither_stored_nor_served_under_its_ids(tmp_path):
    """A block's key is its ids, but a masked token changes every later token's K/V (and, left-padded, their
    positions): a padded row is not persisted, a forward that masks tokens loaded from the store is refused
    before it runs, and ``load_prefix(..., attention_mask=)`` loads only the tokens before the first masked
    one; what is decoded equals DynamicCache throughout."""
    model = tiny_model("llama")
    ids, mask = prompt(2, PROMPT, seed=31, left_pad=(8, 0))
    padded = _masked_generate(model, ids, mask, DynamicCache(config=model.config))
    with _cache(model, tmp_path, batch=2) as cold:  # load_prefix not told of the padding: the forward says it
        assert cold.load_prefix(model, ids) == 0
        _assert_same(padded, _masked_generate(model, ids, mask, cold))
    row = ids[:1]  # 8 PAD ids, then tokens
    with _cache(model, tmp_path) as probe:
        assert probe.load_prefix(model, row) == 0  # the padded batch stored nothing under these ids
    _persist(model, row, tmp_path)  # the same ids, every token attended (a prompt that starts with PAD ids)
    with _cache(model, tmp_path) as warm:
        assert warm.load_prefix(model, row) == PROMPT // BT * BT
        with pytest.raises(InvalidConfigError, match="masks token 0") as refused:
            _masked_generate(model, row, mask[:1], warm)
        assert "attention_mask" in str(refused.value) and warm.get_seq_length() == PROMPT // BT * BT
    reference = _masked_generate(model, row, mask[:1], DynamicCache(config=model.config))
    with _cache(model, tmp_path) as told:
        with pytest.raises(InvalidConfigError, match="attention_mask has shape"):
            told.load_prefix(model, row, attention_mask=mask)  # the batch's, not this row's
        assert told.load_prefix(model, row, attention_mask=mask[:1].tolist()) == 0
        _assert_same(reference, _masked_generate(model, row, mask[:1], told))
    middle = torch.ones_like(row)
    middle[0, 13] = 0  # tokens 0-12 attend as when stored; block 3 (tokens 12-15) holds the masked one
    reference = _masked_generate(model, row, middle, DynamicCache(config=model.config))
    with _cache(model, tmp_path) as partly:
        assert partly.load_prefix(model, row, attention_mask=middle) == 3 * BT
        _assert_same(reference, _masked_generate(model, row, middle, partly))


def test_positions_a_length_dependent_rope_rescales_are_neither_stored_nor_served(tmp_path):
    """Dynamic NTK scaling rescales every position of a forward that reaches ``max_position_embeddings``: its K/V
    is not persisted under its ids, a prompt that long loads nothing, and a forward that would take loaded K/V
    past that length is refused; what is decoded equals DynamicCache throughout. (The scaling also depends on
    the longest forward the model object ran, so each run gets a fresh copy of the same weights.)"""
    limit = 32
    config = transformers.LlamaConfig(**{**tiny_model("llama").config.to_dict(), "max_position_embeddings": limit,
                                         "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                             "rope_theta": 10000.0}})

    def fresh() -> transformers.LlamaForCausalLM:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
        model.generation_config.eos_token_id = None
        return model

    assert rope_limit(config) == limit
    long, _ = prompt(1, limit + 8, seed=33)
    short = long[:, :PROMPT]
    _persist(fresh(), long, tmp_path)  # one 40-token forward: every position rescaled
    reference = _generate(fresh(), short, DynamicCache(config=config))
    for loads in (0, PROMPT // BT * BT):  # nothing of the long prompt's; then the short prompt's own blocks
        with _cache(model := fresh(), tmp_path, context=64) as warm:
            assert warm.load_prefix(model, short) == loads
            _assert_same(reference, _generate(model, short, warm))
    reference = _generate(fresh(), long, DynamicCache(config=config))
    with _cache(model := fresh(), tmp_path, context=64) as whole:
        assert whole.load_prefix(model, long) == 0  # its forward rescales what the stored blocks did not
        _assert_same(reference, _generate(model, long, whole))
    with _cache(model := fresh(), tmp_path, context=64) as told_less:
        assert told_less.load_prefix(model, short) == PROMPT // BT * BT
        with pytest.raises(InvalidConfigError, match="rescales every position"):
            _generate(model, long, told_less)
        assert told_less.get_seq_length() == PROMPT // BT * BT


@pytest.mark.parametrize("how", ["position_ids", "inputs_embeds", "other ids", "training mode", "base model",
                                 "another model object", "token_type_ids"])
def test_forwards_whose_kv_is_not_of_their_ids_alone_persist_nothing(tmp_path, how):
    """The ids load_prefix was given are stored only with K/V a checked forward computed from exactly them at
    their own positions: other positions, embeddings, other ids, dropout, an unchecked input, or a forward the
    hook on the model never saw (the base model, another object of the same weights) persist nothing."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=41)
    with _cache(model, tmp_path) as cold, torch.no_grad():
        cold.load_prefix(model, ids)
        run = {"position_ids": lambda: model(ids, position_ids=torch.arange(PROMPT)[None] + 3, past_key_values=cold),
               "inputs_embeds": lambda: model(inputs_embeds=model.get_input_embeddings()(ids), past_key_values=cold),
               "other ids": lambda: model(ids.flip(1), past_key_values=cold),
               "training mode": lambda: model.train()(ids, past_key_values=cold),
               "base model": lambda: model.model(ids, past_key_values=cold),
               "another model object": lambda: copy.deepcopy(model)(ids, past_key_values=cold),
               "token_type_ids": lambda: model(ids, token_type_ids=torch.zeros_like(ids), past_key_values=cold)}
        try:
            run[how]()
        except TypeError:  # llama takes no token_type_ids: refused by the model after the hook ran
            assert how == "token_type_ids"
        finally:
            model.eval()
    with _cache(model, tmp_path) as later:
        assert later.load_prefix(model, ids) == 0


def test_a_conversation_cropped_into_its_loaded_prefix_decodes_on(tmp_path):
    """Cropped back into the tokens loaded from the store, a forward of another branch that masks one of its own
    tokens (past the crop, where loaded tokens were) is not taken for one that masks loaded tokens: it decodes as
    DynamicCache cropped alike."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=49)
    _persist(model, ids, tmp_path)
    reference = DynamicCache(config=model.config)
    with _cache(model, tmp_path) as warm, torch.no_grad():
        assert warm.load_prefix(model, ids) == 24
        model(ids[:, 24:], past_key_values=warm)
        model(ids, past_key_values=reference)
        warm.crop(-10)
        reference.crop(-10)
        branch, mask = (ids[:, 16:20] + 1) % 120 + 2, torch.ones(1, 20, dtype=torch.long)
        mask[0, 18] = 0
        torch.testing.assert_close(model(branch, attention_mask=mask, past_key_values=warm).logits,
                                   model(branch, attention_mask=mask, past_key_values=reference).logits,
                                   atol=1e-5, rtol=0)


def test_generate_repeating_rows_persists_each_rows_own_kv(tmp_path):
    """``num_return_sequences`` repeats each row before the first forward: the ids' rows are repeated alike, so
    a later process loading row 1 gets row 1's K/V (it used to get row 0's)."""
    model = tiny_model("llama")
    ids, _ = prompt(2, PROMPT, seed=43)
    with _cache(model, tmp_path, batch=4) as cold:
        cold.load_prefix(model, ids)
        torch.manual_seed(0)
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cold, do_sample=True, num_return_sequences=2,
                       max_new_tokens=3)
    for row in (0, 1):
        reference = _generate(model, ids[row:row + 1], DynamicCache(config=model.config))
        with _cache(model, tmp_path) as later:
            assert later.load_prefix(model, ids[row:row + 1]) == PROMPT // BT * BT
            _assert_same(reference, _generate(model, ids[row:row + 1], later))


def test_a_forward_of_other_rows_refused_by_a_cache_that_holds_tokens_keeps_persisting(tmp_path, caplog):
    """Regression: ``generate(num_beams=3)`` on a cache that holds its prompt is refused (DynamicCache cannot either),
    but the prefix hook had repeated the known ids' rows for it first: the next persist failed with an IndexError
    (logged), nothing more of the sequence was persisted, and a later process loaded none of it."""
    model = tiny_model("llama")
    ids, _ = prompt(2, PROMPT, seed=44)
    with _cache(model, tmp_path, batch=2) as cache:
        cache.load_prefix(model, ids)
        model(ids, past_key_values=cache)
        with pytest.raises(InvalidConfigError, match="holds 2 sequences"):
            model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=2,
                           num_beams=3, do_sample=False)
    assert "persisting" not in caplog.text
    for row in (0, 1):
        reference = _generate(model, ids[row:row + 1], DynamicCache(config=model.config))
        with _cache(model, tmp_path) as later:
            assert later.load_prefix(model, ids[row:row + 1]) == PROMPT // BT * BT
            _assert_same(reference, _generate(model, ids[row:row + 1], later))


def test_beams_over_a_loaded_prefix_run_after_the_rows_are_repeated_as_the_refusal_says(tmp_path):
    """Beams over a prefix ``load_prefix`` loaded are refused (the cache holds one row; DynamicCache cannot either),
    with the way that works: ``cache.batch_repeat_interleave(n)`` first, then the same beams as a cold run's."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=45)
    with _cache(model, tmp_path) as first:
        first.load_prefix(model, ids)
        _generate(model, ids, first)
    beams = dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW, num_beams=3, num_return_sequences=3,
                 do_sample=False)
    reference = model.generate(ids, past_key_values=DynamicCache(config=model.config), **beams)
    with _cache(model, tmp_path, batch=3) as cache:
        assert cache.load_prefix(model, ids) == PROMPT // BT * BT
        with pytest.raises(InvalidConfigError, match=r"cache.batch_repeat_interleave\(3\)"):
            model.generate(ids, past_key_values=cache, **beams)
        cache.batch_repeat_interleave(3)
        assert torch.equal(model.generate(ids, past_key_values=cache, **beams), reference)


def test_the_next_turn_must_repeat_the_tokens_the_cache_generated(tmp_path):
    """The generated tokens' K/V is persisted under the next turn's ids only if those repeat what was generated."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=47)
    with _cache(model, tmp_path, context=64) as cache:
        cache.load_prefix(model, ids)
        first = _generate(model, ids, cache).sequences
        claimed = torch.cat((first, torch.tensor([[5]])), dim=1)
        claimed[0, PROMPT + 1] += 1  # a generated token the cache did not compute
        with pytest.raises(InvalidConfigError, match="differ from the ones it computed"):
            cache.load_prefix(model, claimed)
        assert cache.load_prefix(model, torch.cat((first, torch.tensor([[5]])), dim=1)) == first.shape[1] - 1


def test_the_rope_limit_of_each_kind_of_rotary_embedding():
    base = tiny_model("llama").config.to_dict()
    assert rope_limit(transformers.LlamaConfig(**base)) is None
    for kind in ("linear", "llama3", "yarn"):  # scaled, but the same at every length
        parameters = {"rope_type": kind, "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        assert rope_limit(transformers.LlamaConfig(**{**base, "rope_parameters": parameters})) is None
    phi = transformers.Phi3Config(**{**tiny_model("phi3").config.to_dict(), "max_position_embeddings": 256,
                                     "original_max_position_embeddings": 64,
                                     "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                         "long_factor": [2.0] * 8, "rope_theta": 10000.0,
                                                         "original_max_position_embeddings": 64}})
    assert rope_limit(phi) == 64
    gemma = transformers.AutoConfig.for_model("gemma3_text")  # a rope per layer type, none length-dependent
    assert rope_limit(gemma) is None


def test_a_corrupt_persisted_block_is_recomputed(tmp_path, caplog):
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=10)
    reference = _persist(model, ids, tmp_path)
    store = PersistentStore(tmp_path, 1 << 30)
    keys = block_keys(Namespace.of_model(model, BT).root, ids[0].tolist(), BT)
    path = store._path(keys[3])
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01  # the low bit of one stored value
    path.write_bytes(bytes(data))
    with _cache(model, tmp_path) as warm:
        assert warm.load_prefix(model, ids) == 3 * BT
        _assert_same(reference, _generate(model, ids, warm))
    assert "checksum" in caplog.text
    store.close()


def test_a_listed_size_beyond_a_block_record_is_refused_before_allocating(tmp_path, caplog):
    """A record made a sparse 64 MiB file and listed at that size (a valid manifest): ``load_prefix`` refuses it
    by the size a block record of the model's namespace can have, before reading, removes it, and the model
    recomputes from there, exactly."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=12)
    reference = _persist(model, ids, tmp_path)
    keys = block_keys(Namespace.of_model(model, BT).root, ids[0].tolist(), BT)
    store = PersistentStore(tmp_path, 1 << 30)
    path = store._path(keys[2])
    os.truncate(path, 64 << 20)
    with safefs.directory(tmp_path / DIRECTORY_NAME) as root:
        listing = manifests.load_at(root, "manifest")
        listing.entries[keys[2]].nbytes = 64 << 20
        manifests.write(root, listing)
    store.close()
    with _cache(model, tmp_path) as warm:
        tracemalloc.start()
        try:
            loaded = warm.load_prefix(model, ids)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert loaded == 2 * BT and peak < 16 << 20 and not path.exists()
        assert "a block record of this model's namespace has" in caplog.text
        _assert_same(reference, _generate(model, ids, warm))
    with _cache(model, tmp_path) as later:  # the recomputed block took its place
        assert later.load_prefix(model, ids) == 6 * BT


@pytest.mark.parametrize("wrong", ["shape", "depth"])
def test_a_listed_block_of_another_shape_or_depth_is_removed_and_recomputed(tmp_path, caplog, wrong):
    """A listed record under the right key and namespace, but of another shape (the same bytes) or at another
    depth: a miss, removed from the store, so the block computed next takes its place and the prefix loads
    whole again (the remote tier's local copies used to stay listed and cut the prefix for good)."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=14)
    reference = _persist(model, ids, tmp_path)
    namespace = Namespace.of_model(model, BT)
    keys = block_keys(namespace.root, ids[0].tolist(), BT)
    store = PersistentStore(tmp_path, 1 << 30)
    path = store._path(keys[1])
    layers, _, heads, tokens, dim = namespace.block_shape
    kv = torch.zeros(layers, 2, 1, tokens, heads * dim) if wrong == "shape" else torch.ones(namespace.block_shape)
    head, payload = record.encode_block(keys[1], namespace.root, 1 if wrong == "shape" else 7, kv)
    assert len(head) + len(payload) == path.stat().st_size  # still the listed size: only the content is wrong
    path.write_bytes(head + bytes(payload))
    store.close()
    with _cache(model, tmp_path) as warm:
        assert warm.load_prefix(model, ids) == BT and not path.exists()
        assert wrong in caplog.text
        _assert_same(reference, _generate(model, ids, warm))
    with _cache(model, tmp_path) as later:
        assert later.load_prefix(model, ids) == 6 * BT
        _assert_same(reference, _generate(model, ids, later))


def test_the_size_cap_keeps_the_shallow_blocks(tmp_path):
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=11)
    head, payload = record.encode_block("k" * 32, "r" * 32, 5, torch.zeros(2, 2, 2, BT, 16))
    cap = 3 * (len(head) + len(payload)) + 100  # room for 3 of the 6 block-rows
    with _cache(model, tmp_path, persist_gb=f"{cap}B") as cold:
        cold.load_prefix(model, ids)
        _generate(model, ids, cold)
        cold.flush()
        stats = cold.session.prefix.store.stats()
        assert stats["bytes"] <= cap and stats["blocks"] == 3
    with _cache(model, tmp_path) as warm:
        assert warm.load_prefix(model, ids) == 3 * BT


def test_persistence_arguments_are_checked(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(InvalidConfigError, match="disk_dir"):
        TieredCache(persist=True)
    with pytest.raises(InvalidConfigError, match="persist=True"):
        TieredCache(disk_dir=tmp_path, persist_gb=1)
    with pytest.raises(InvalidConfigError, match="persist must be"):
        TieredCache(disk_dir=tmp_path, persist="yes")
    with TieredCache(disk_dir=tmp_path) as cache, pytest.raises(InvalidConfigError, match="persist=True"):
        cache.load_prefix(model, [1, 2, 3])
    with _cache(model, tmp_path) as cache:
        with pytest.raises(InvalidConfigError, match="token ids"):
            cache.load_prefix(model, torch.zeros(1, 3))
        ids, _ = prompt(1, 9, seed=1)
        cache.load_prefix(model, ids)
        _generate(model, ids, cache, new=1)
        with pytest.raises(InvalidConfigError, match="at least one new token"):
            cache.load_prefix(model, ids)


@pytest.mark.cuda
def test_prefix_reuse_and_save_load_on_cuda(tmp_path):
    """The CUDA path: blocks exported from HBM and the pinned host tier, loaded back onto the GPU."""
    model = tiny_model.__wrapped__("llama").cuda()
    ids, _ = prompt(1, 40, seed=12)
    ids = ids.cuda()
    reference = _generate(model, ids, DynamicCache(config=model.config))
    options = dict(gpu_gb="256MiB", cpu_gb=f"{4 * SLOT}B", disk_dir=tmp_path, block_tokens=BT, persist=True)
    with TieredCache(**options) as cold:
        cold.load_prefix(model, ids)
        _assert_same(reference, _generate(model, ids, cold))
        cold.save(tmp_path / "c.tkv", model=model)
    with TieredCache(**options) as warm:
        assert warm.load_prefix(model, ids) == 36
        _assert_same(reference, _generate(model, ids, warm))
    continued = _generate(model, reference.sequences, DynamicCache(config=model.config))
    with TieredCache.load(tmp_path / "c.tkv", model=model, **options) as loaded:
        assert loaded.store.device.device.type == "cuda"
        _assert_same(continued, _generate(model, reference.sequences, loaded))


def test_a_failing_persistent_disk_never_fails_decoding(tmp_path, monkeypatch, caplog):
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=13)
    reference = _generate(model, ids, DynamicCache(config=model.config))

    def full(self, items, touch=()):
        raise DiskTierError(28, "No space left on device")

    monkeypatch.setattr(PersistentStore, "put", full)
    with _cache(model, tmp_path) as cache:
        cache.load_prefix(model, ids)
        _assert_same(reference, _generate(model, ids, cache))
    assert "persisting blocks failed" in caplog.text
    monkeypatch.undo()
    with _cache(model, tmp_path) as later:
        assert later.load_prefix(model, ids) == 0  # nothing was listed: recomputed, not wrong
        _assert_same(reference, _generate(model, ids, later))


def test_a_folder_the_full_disk_cannot_make_still_lists_the_records_moved_before(tmp_path):
    """Regression: on ext4 a new ``blocks/<ab>/`` folder takes a block, so a disk that filled up while a batch was
    written failed again at the folder of a record written whole, and that aborted the listing of the records
    already moved into place (none listed, all removed at the next open). Here the filesystem runs out of inodes:
    the records before the one whose folder cannot be made are listed, the error is a DiskFullError."""
    with tiny_tmpfs(tmp_path / "tiny", "1m", inodes=64) as mount:
        store = PersistentStore(mount, 1 << 20)
        assert store.put([_item("a0" + "0" * 30)]) == 1  # folder a0 exists from here on
        filler = mount / "other-program"
        filler.mkdir()
        made = 0
        with contextlib.suppress(OSError):  # another program takes every inode left ...
            while True:
                (filler / str(made)).touch()
                made += 1
        for name in range(made - 3, made):  # ... but three
            (filler / str(name)).unlink()
        keys = ["a0" + "1" * 30, "a0" + "2" * 30, "b0" + "3" * 30, "a0" + "4" * 30, "a0" + "5" * 30]
        with pytest.raises(DiskFullError):
            store.put([_item(key, depth=i) for i, key in enumerate(keys)])
        store.close()
        again = PersistentStore(mount, 1 << 20)
        assert again.lookup(keys) == 2 and again.verify() == []
        again.close()


def test_a_disk_that_fills_up_mid_batch_keeps_the_records_written_before(tmp_path):
    """Regression: a batch of a chain's records hitting ENOSPC (a real tmpfs) listed none of them, so the next
    process reloaded nothing. The records fsynced whole before the failure are listed (the shallow end of the
    chain, usable alone); the cut one is removed; the error is a DiskFullError."""
    with tiny_tmpfs(tmp_path / "tiny", "256k") as mount:
        store = PersistentStore(mount, 1 << 20)
        keys = _keys(12)
        with pytest.raises(DiskFullError, match="Free space"):
            store.put([_item(key, size=40_000, depth=i) for i, key in enumerate(keys)])
        store.close()
        again = PersistentStore(mount, 1 << 20)
        kept = again.lookup(keys)
        assert 1 <= kept < len(keys)
        assert [record.decode(data)[0]["key"] for data in again.get(keys)] == keys[:kept]
        assert again.verify() == [] and again.stats()["blocks"] == kept
        again.close()
        assert [p.name for p in (mount / DIRECTORY_NAME / "tmp").iterdir()] == []


def test_the_forward_hook_of_another_threads_cache_never_breaks_a_forward(tmp_path):
    """Regression: torch reads a pre-hook's ``with_kwargs`` after taking the model's hook list, so a hook that
    another request's cache registered (``load_prefix``) or removed (``close``) meanwhile was called as
    ``hook(module, args)``: a TypeError in an unrelated request's forward. Called so, the hook does nothing."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=2)
    with _cache(model, tmp_path) as cache:
        cache.load_prefix(model, ids)
        (hook,) = model._forward_pre_hooks.values()
        assert hook(model, (ids,)) is None
        _assert_same(_generate(model, ids), _generate(model, ids, cache))


def test_a_ctrl_c_during_close_comes_after_the_cleanup(tmp_path, monkeypatch):
    """A Ctrl-C while close() writes the queued blocks cut it half way: the store's scratch area and threads stayed
    until exit, and a second close() had nothing left to finish. The interrupt now comes once close() is done."""
    import signal
    import threading

    from tierkv.persist import prefix

    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=8)
    before = set(threading.enumerate())
    cache = _cache(model, tmp_path)
    cache.load_prefix(model, ids)
    _generate(model, ids, cache)
    writer_close = prefix._Writer.close

    def interrupted(writer) -> None:
        signal.raise_signal(signal.SIGINT)  # Ctrl-C, as the queued blocks are written
        writer_close(writer)

    monkeypatch.setattr(prefix._Writer, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.close()
    assert cache.closed and not list((tmp_path / DIRECTORY_NAME / "tmp").iterdir())
    assert not [thread for thread in threading.enumerate() if thread not in before and thread.is_alive()]
    assert _listed(tmp_path) == PROMPT // BT  # what was queued was written
