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
  integer knobs take ASCII digits only; both seconds knobs now refuse them too;
- a 4 KiB *sparse* conversation file whose header claims 1 GiB of token ids (checksum computed) made ``load()``
  allocate ~3.4 GiB before refusing it, and a K/V record could claim far more than the 64 MiB chunks ``save``
  writes: each record's payload is now bounded by its own header (and the header's K/V by the budgets) before
  anything is allocated;
- a process holding the persistent store's ``lock`` for ever (a stopped tierkv process, a member of a
  group-shared store) made every other cache hang at open and in ``flush()``/``close()``; the waits now end
  after ``TIERKV_PERSIST_LOCK_TIMEOUT`` and the store carries on without the lock (no recovery, writes
  skipped with a warning naming the lock, its holder and the fix).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import xxhash
from helpers import ROOT, prefix_worker
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import settings
from tierkv.errors import DiskTierError, IntegrityError, InvalidConfigError
from tierkv.hf import TieredCache
from tierkv.persist import manifest, record
from tierkv.persist.blockfile import DIRECTORY_NAME, PersistentStore
from tierkv.persist.keys import Namespace, block_keys
from tierkv.remote.framing import frame

pytestmark = pytest.mark.usefixtures("no_tierkv_env")  # the environment's TIERKV_* knobs: none

BT = 16
NEW = 4
NESTED = b"[" * 100_000 + b"]" * 100_000  # valid JSON nesting, deeper than the parser's stack
SHALLOW_NESTED = b"[" * 5_000 + b"]" * 5_000  # the same, small enough for a remote value's bound


OTHER_UID = 1001  # another user of the machine (mallory), who owns the links she plants
needs_other_user = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a planted link another owner")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3)


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
    # 3.13's json parses 5,000 levels (its C recursion limit is higher): a list, "not a JSON object"
    assert stats["remote"]["corrupt"] == 1 and ("unreadable header" in caplog.text or
                                                "the header is not a JSON object" in caplog.text)
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
@pytest.mark.parametrize("variable", ["TIERKV_REMOTE_TIMEOUT", "TIERKV_REMOTE_QUEUE_WAIT",
                                      "TIERKV_PERSIST_LOCK_TIMEOUT"])
@pytest.mark.parametrize("value", ["١٢", "٤", "1_0"])
def test_seconds_knobs_take_ascii_digits_only(monkeypatch, variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    name = next(s.name for s in settings.SETTINGS.values() if s.variable == variable)
    with pytest.raises(InvalidConfigError, match=f"{variable}.*ASCII digits"):
        settings.get(name)
    monkeypatch.setenv(variable, " 1.5 ")
    assert settings.get(name) == 1.5


# ------------------------------------------------------------------------- sparse conversation files
GiB = 1 << 30
TESTS = Path(__file__).resolve().parent
LOAD_UNDER_LIMIT = """
import asyncio, json, resource, sys
sys.path.insert(0, sys.argv[3])
from models import tiny_model
from tierkv.hf import TieredCache

model = tiny_model("llama", layers=3)
options = json.loads(sys.argv[2])
size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
limit = size + 768 * 2**20  # far less than the 1 GiB claimed: a loader that believes the claim fails
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
loads = [lambda: TieredCache.load(sys.argv[1], model=model, **options)]
try:
    import aiofiles  # noqa: F401
    loads.append(lambda: asyncio.run(TieredCache.aload(sys.argv[1], model=model, **options)))
except ImportError:
    pass
for load in loads:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        load().close()
        result = {"error": None}
    except BaseException as error:  # a MemoryError too: what the attack caused
        result = {"error": type(error).__name__, "message": str(error)}
    result["grew"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def saved_chat(model, tmp_path_factory) -> list[tuple[dict, bytes]]:
    """The records of a real conversation file (3 layers, 40 tokens, its ids known)."""
    ids, _ = prompt(1, 40, seed=3)
    folder = tmp_path_factory.mktemp("chat")
    with TieredCache(block_tokens=BT, disk_dir=folder / "d", persist=True) as cache:
        cache.load_prefix(model, ids)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        cache.save(folder / "chat.tkv", model=model)
    out = []
    with open(folder / "chat.tkv", "rb") as f:
        while f.tell() < (folder / "chat.tkv").stat().st_size:
            header, payload = record.read(f)
            out.append((header, bytes(payload)))
    return out


def sparse_record(f, header: dict, payload_bytes: int) -> None:
    """Write a record of ``header`` whose payload is ``payload_bytes`` zeros left as a hole (a sparse file: none
    of it on disk), with its right checksum (xxh3 is no secret)."""
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    digest = xxhash.xxh3_64(text)
    zeros, left = memoryview(bytes(16 << 20)), payload_bytes
    while left:
        digest.update(zeros[: min(left, len(zeros))])
        left -= min(left, len(zeros))
    f.write(struct.pack("<4sHHIQQ", record.MAGIC, record.VERSION, 0, len(text), payload_bytes, digest.intdigest()))
    f.write(text)
    f.seek(payload_bytes, os.SEEK_CUR)
    f.truncate()


def load_under_limit(path: Path, **options) -> list[dict]:
    """``TieredCache.load`` (and ``aload`` where aiofiles is installed) of ``path`` in a fresh interpreter whose
    address space is limited to what it uses plus 768 MiB: what each raised, and how much its peak RSS grew."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for setting in settings.SETTINGS.values():
        env.pop(setting.variable, None)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(LOAD_UNDER_LIMIT), str(path),
                             json.dumps(options), str(TESTS)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def long_layers(header: dict, length: int) -> list[dict]:
    return [{**layer, "length": length} for layer in header["layers"]]


@pytest.mark.parametrize("attack", ["ids beyond the layers", "K/V beyond the budgets", "a K/V record beyond a chunk",
                                    "one block column beyond the device"])
def test_a_sparse_conversation_file_is_refused_before_it_costs_memory(saved_chat, tmp_path, attack) -> None:
    """A 4 KiB sparse file whose record claims 1 GiB (checksum computed) is refused from its header, before the
    payload is allocated: the ids may be no more than the longest layer holds; the K/V the header claims must
    fit the budgets of the cache it is loaded into (before the ids are read); a K/V record holds at most a
    chunk. Before the fix, ``load()`` allocated the claim (3.4 GiB for the ids): a ``MemoryError`` under the
    limit; a header of one token per layer in blocks of 2**20 tokens for 32 rows made the loader read a 1 GiB
    "block column" (the padded block a record carries whole), bounded only by the disk budget: every layer's open
    block must fit the device budget. The cache built meanwhile is closed: the disk tier's folder is left empty."""
    (head, ids), (kv_head, _) = saved_chat[0], saved_chat[1]
    path, disk_dir = tmp_path / "chat.tkv", tmp_path / "disk"
    disk_dir.mkdir()
    options = dict(gpu_gb="64MB", cpu_gb="64MB", disk_dir=str(disk_dir), disk_gb="64MB")
    with open(path, "wb") as f:
        if attack == "ids beyond the layers":  # 2**27 ids (1 GiB) for 40 tokens
            sparse_record(f, {**head, "ids_shape": [1, GiB // 8]}, GiB)
            expected = ("IntegrityError", r"field 'ids_shape' is \[1, 134217728\]: the ids of 134217728 tokens, "
                                          "but its longest layer holds 40")
        elif attack == "K/V beyond the budgets":  # layers as long as the ids: 96 GiB of K/V
            sparse_record(f, {**head, "layers": long_layers(head, GiB // 8), "ids_shape": [1, GiB // 8]}, GiB)
            expected = ("CapacityError", r"holds 96\.00 GiB of K/V \(103079215104 bytes\), more than the .* "
                                         r"\(\d+ bytes\) of the cache's budgets .*raise the budgets")
        elif attack == "one block column beyond the device":  # 1 token a layer, 1 GiB in its padded block
            rows, tokens = 32, GiB // (32 * 2 * 2 * 16 * 4)
            sparse_record(f, {**head, "block_tokens": tokens, "batch": rows, "ids_shape": None,
                              "namespace": None, "layers": long_layers(head, 1)}, 0)  # fmt: skip
            sparse_record(f, {**kv_head, "shape": [rows, 1, 2, 2, tokens, 16]}, GiB)
            expected = ("BudgetTooSmallError", r"saved with block_tokens=131072 for 32 rows: one block of every "
                                               r"layer .* takes 3\.00 GiB, more than the device budget's 61\.04 MiB")
        else:  # a valid header whose layers hold 4M tokens (3 GiB: within budgets of 4 GB), then a 1 GiB record
            blocks = GiB // (2 * 2 * BT * 16 * 4)
            text, body = record.encode({**head, "layers": long_layers(head, blocks * BT)}, ids)
            f.write(text + body)
            sparse_record(f, {**kv_head, "shape": [1, blocks, 2, 2, BT, 16]}, GiB)
            options.update(gpu_gb="2GB", cpu_gb="2GB")
            expected = ("IntegrityError", r"field 'record 1\.shape' is \[1, 262144, 2, 2, 16, 16\]: 1073741824 bytes "
                                          r"of layer 0's K/V in one record, more than the 67108864")
    assert path.stat().st_size > GiB and path.stat().st_blocks * 512 <= 64 << 10  # sparse: the claim is a hole
    for outcome in load_under_limit(path, **options):
        assert outcome["error"] == expected[0], outcome
        assert re.search(expected[1], outcome["message"]), outcome["message"]
        assert outcome["grew"] < 64 << 20, outcome  # nothing of the claim was allocated
    assert os.listdir(disk_dir) == []  # the cache built before the refusal was closed: its files are gone


def test_conversation_records_are_bounded_by_their_own_header(saved_chat, tmp_path) -> None:
    """In process, the same bounds refused with the field named, for each kind of record: the ids payload must be
    exactly ``batch x ids_shape[1] x 8``, an end record has no payload, and a K/V record no more than its
    shape; a file as ``save`` writes it still loads (its ids no longer than its layers)."""
    def write(records: list[tuple[dict, bytes]]) -> Path:
        path = tmp_path / "crafted.tkv"
        path.write_bytes(b"".join(raw_record(json.dumps(h, sort_keys=True, separators=(",", ":")).encode(), p)
                                  for h, p in records))
        return path

    model = tiny_model("llama", layers=3)
    records = list(saved_chat)
    with pytest.raises(IntegrityError, match=r"claims 328 payload bytes, but its field 'ids_shape' \[1, 40\]"):
        TieredCache.load(write([(records[0][0], records[0][1] + bytes(8)), *records[1:]]), model=model)
    with pytest.raises(IntegrityError, match="'end' record claims 8 payload bytes"):
        TieredCache.load(write([*records[:-1], (records[-1][0], bytes(8))]), model=model)
    with pytest.raises(IntegrityError, match=r"'kv' record claims \d+ payload bytes, but its field 'record 1\.shape'"):
        TieredCache.load(write([records[0], (records[1][0], records[1][1] + bytes(4)), *records[2:]]), model=model)
    with TieredCache.load(write(records), model=model) as cache:
        assert cache.get_seq_length() == 40


# -------------------------------------------------------------------- a persistent lock held for ever
HOLD_THE_LOCK = """
import fcntl, sys, time
f = open(sys.argv[1], "rb")
fcntl.flock(f, fcntl.LOCK_EX)  # a member of a group-shared store that never lets go
print("held", flush=True)
time.sleep(600)
"""
STOPPED_MID_WRITE = """
import os, signal, sys
from tierkv.persist import blockfile, record
from tierkv.persist.blockfile import Item, PersistentStore

write = blockfile.manifests.write


def stop_then_write(*args, **kwargs):  # a tierkv process stopped (SIGSTOP, a debugger) inside a listing change
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    return write(*args, **kwargs)


blockfile.manifests.write = stop_then_write
key = "ab" + "0" * 30
PersistentStore(sys.argv[1], 1 << 30).put([Item(key, 0, *record.encode({"kind": "block", "key": key}, bytes(64)))])
"""


def start_holder(code: str, *args: str) -> subprocess.Popen:
    """A real second process that holds the persistent store's lock (it prints "held" once it does)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE,
                              text=True, env=env)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def decode_with_persistence(model, disk_dir: Path, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """One persistent cache: load the stored prefix of each prompt, generate, then ``flush()`` and ``close()``."""
    results = []
    with TieredCache(block_tokens=BT, disk_dir=disk_dir, persist=True) as cache:
        for ids in prompts:
            cache.reset()
            loaded = cache.load_prefix(model, ids)
            results.append((model.generate(ids, cache=cache, max_new_tokens=NEW, do_sample=False), loaded))
            cache.flush()
    return results


@pytest.mark.parametrize("holder_kind", ["a process holding the lock", "a tierkv process stopped mid-write"])
def test_a_persistent_lock_held_for_ever_never_hangs(model, tmp_path, caplog, holder_kind) -> None:
    """Another process holds ``tierkv-persist/lock`` and never lets go. Before the fix, the next cache on that
    ``disk_dir`` waited for ever (at open, then in ``flush()``/``close()``). Now it waits
    ``TIERKV_PERSIST_LOCK_TIMEOUT`` (1 s here) once, warns naming the lock, the holder's pid and the fix, still
    loads the stored prefix (reads take no lock), decodes exactly, skips its writes; once the holder is gone the
    store is intact (every listed block verifies, nothing of the holder is left) and persists again."""
    ids_a, _ = prompt(1, 100, seed=5)
    ids_b, _ = prompt(1, 100, seed=6)
    expected = [reference(model, ids_a), reference(model, ids_b)]
    prefix_worker(model, ids_a, BT, NEW, disk_dir=tmp_path, persist=True)  # stored before the holder came
    lock = tmp_path / DIRECTORY_NAME / "lock"
    holder = start_holder(HOLD_THE_LOCK, str(lock)) if holder_kind.startswith("a process") else \
        start_holder(STOPPED_MID_WRITE, str(tmp_path))
    results: list = []
    try:
        with settings.override(persist_lock_timeout=1), caplog.at_level(logging.WARNING, logger="tierkv"):
            worker = threading.Thread(target=lambda: results.append(decode_with_persistence(
                model, tmp_path, [ids_a, ids_b])), daemon=True)
            worker.start()
            worker.join(timeout=60)
        assert not worker.is_alive(), "the cache hung on the persistent store's lock"
        [(out_a, loaded_a), (out_b, loaded_b)] = results[0]
        assert loaded_a == 96 and torch.equal(out_a, expected[0])  # the stored prefix, read without the lock
        assert loaded_b == 0 and torch.equal(out_b, expected[1])
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(str(lock) in w and f"process {holder.pid}" in w and "TIERKV_PERSIST_LOCK_TIMEOUT" in w
                   for w in warnings), warnings
        assert len([w for w in warnings if str(lock) in w]) == 1, warnings  # one warning, not one per write
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    store = PersistentStore(tmp_path, 1 << 30)  # recovers what the holder left (a stopped writer's scratch area)
    assert store.verify() == [] and store.stats()["blocks"] == 6  # ids_a's blocks; ids_b's were never written
    store.close()
    assert os.listdir(tmp_path / DIRECTORY_NAME / "tmp") == []
    out, loaded, _ = prefix_worker(model, ids_b, BT, NEW, disk_dir=tmp_path, persist=True)
    assert loaded == 0 and torch.equal(out, expected[1])
    out, loaded, _ = prefix_worker(model, ids_b, BT, NEW, disk_dir=tmp_path, persist=True)  # persisted again
    assert loaded == 96 and torch.equal(out, expected[1])
