"""Disk faults and interrupts: a real engine that fails reads, tears writes and fills up, short transfers, and
KeyboardInterrupt at every I/O point of the store. Each leaves the cache consistent: a clear TierKVError,
every layer at one length, every accepted token readable, no slot leaked."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import kv, make_store, tiny_tmpfs
from models import small_llama
from transformers import DynamicCache

from tierkv import DiskFullError, DiskTierError, IntegrityError, TieredCache
from tierkv.blocks import Tier
from tierkv.io.posix import PosixFile
from tierkv.tiers import disk as disk_module


class Faults:
    """What the faulty engine does next (shared by every file it opens)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.read_eio = False  # reads fail with EIO
        self.torn_silent = False  # writes put half their bytes down and report success
        self.torn_eio = False  # writes put half their bytes down, then fail with EIO
        self.space: int | None = None  # bytes writable before ENOSPC
        self.short = False  # the kernel moves at most 1000 bytes per call (short reads and writes)
        self.reads = 0


FAULTS = Faults()


class FaultyFile(PosixFile):
    """The posix engine with faults injected where the system calls are."""

    engine_name = "faulty"

    def _read_piece(self, offset: int, view) -> None:
        FAULTS.reads += 1
        if FAULTS.read_eio:
            raise OSError(errno.EIO, "Input/output error", self.path)
        if FAULTS.short:
            done = 0
            while done < view.nbytes:
                done += os.preadv(self.fd, [view[done : done + 1000]], offset + done)
            return
        super()._read_piece(offset, view)

    def _write_piece(self, offset: int, view) -> None:
        if FAULTS.space is not None:
            if view.nbytes > FAULTS.space:
                raise OSError(errno.ENOSPC, "No space left on device", self.path)
            FAULTS.space -= view.nbytes
        if FAULTS.torn_silent or FAULTS.torn_eio:
            os.pwritev(self.fd, [view[: view.nbytes // 2]], offset)
            if FAULTS.torn_eio:
                raise OSError(errno.EIO, "Input/output error", self.path)
            return
        if FAULTS.short:
            done = 0
            while done < view.nbytes:
                done += os.pwritev(self.fd, [view[done : done + 1000]], offset + done)
            return
        super()._write_piece(offset, view)


@pytest.fixture
def faulty(monkeypatch):
    """Every disk tier file opened during the test goes through :class:`FaultyFile` (buffered I/O)."""
    FAULTS.reset()
    monkeypatch.setattr(disk_module, "open_disk_file", lambda path, engine=None: FaultyFile(str(path), False))
    yield FAULTS
    FAULTS.reset()


@pytest.fixture(scope="module")
def model():
    return small_llama()


def decode(model, cache, reference, token, steps):
    for _ in range(steps):
        model(token, past_key_values=cache)
        model(token, past_key_values=reference)


def assert_consistent(cache, reference):
    """Every layer at one length, slot accounting intact, and every accepted token reads back exactly."""
    length = cache.get_seq_length()
    assert all(layer.get_seq_length() == length for layer in cache.layers)
    cache.store.check()
    for index, layer in enumerate(reference.layers):
        stored = cache.store.read_tokens(index)
        torch.testing.assert_close(stored[0], layer.keys[..., :length, :], rtol=0, atol=0)
        torch.testing.assert_close(stored[1], layer.values[..., :length, :], rtol=0, atol=0)


def start(model, tmp_path):
    ids = torch.randint(2, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    cache = TieredCache(gpu_gb="40KB", cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4)
    reference = DynamicCache()
    model(ids, past_key_values=cache)
    model(ids, past_key_values=reference)
    assert cache.stats()["blocks"]["disk"] > 0
    return cache, reference, ids[:, -1:]


def test_failed_reads_are_a_clear_error_and_decoding_resumes(model, tmp_path, faulty):
    cache, reference, token = start(model, tmp_path)
    faulty.read_eio = True
    with pytest.raises(DiskTierError, match="I/O failed on .*check the drive") as info:
        decode(model, cache, reference, token, 1)
    assert info.value.errno == errno.EIO and not isinstance(info.value, IntegrityError)
    faulty.read_eio = False
    assert_consistent(cache, reference)
    decode(model, cache, reference, token, 6)  # the fault is gone: decoding goes on, exactly
    assert_consistent(cache, reference)
    cache.close()


def test_silently_torn_writes_are_caught_on_read(model, tmp_path, faulty):
    """A write that reports success but put down only half its bytes: the read after it raises
    IntegrityError instead of returning the stale half."""
    ids = torch.randint(2, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    faulty.torn_silent = True
    with TieredCache(gpu_gb="40KB", cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4) as cache:
        with pytest.raises(IntegrityError, match="checksum mismatch"):
            for _ in range(3):
                model(ids, past_key_values=cache)
        cache.store.check()


def test_torn_write_that_fails_keeps_the_cache_consistent(model, tmp_path, faulty):
    cache, reference, token = start(model, tmp_path)
    faulty.torn_eio = True
    with pytest.raises(DiskTierError, match="I/O failed"):
        decode(model, cache, reference, token, 40)
    faulty.torn_eio = False
    assert_consistent(cache, reference)
    decode(model, cache, reference, token, 4)
    assert_consistent(cache, reference)
    cache.close()


def test_a_disk_that_fills_up_keeps_every_accepted_token(model, tmp_path, faulty):
    cache, reference, token = start(model, tmp_path)
    faulty.space = 12 * 4096
    with pytest.raises(DiskFullError, match="ran out of space") as info:
        decode(model, cache, reference, token, 200)
    assert info.value.errno == errno.ENOSPC
    assert_consistent(cache, reference)
    cache.close()
    assert not list(tmp_path.iterdir())



@pytest.mark.parametrize("asynchronous", [False, True])
def test_saving_to_a_full_filesystem_is_a_disk_full_error_and_keeps_the_old_file(model, tmp_path, asynchronous):
    """Regression: ``save()`` onto a real filesystem that fills up raised a bare ``OSError`` (ENOSPC) from the
    temporary file's write. It is a DiskFullError naming the path and the fix; the previous file and the cache
    are untouched, no temporary file is left, and the cache goes on decoding exactly."""
    with tiny_tmpfs(tmp_path / "tiny", "64k") as mount:
        cache, reference, token = start(model, tmp_path / "kv")
        target = mount / "chat.tkv"
        cache.save(target, model=model)
        saved = target.read_bytes()
        decode(model, cache, reference, token, 4)
        filler = os.open(mount / "other-program", os.O_WRONLY | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):  # someone else fills the filesystem
            while True:
                os.write(filler, bytes(4096))
        os.close(filler)
        with pytest.raises(DiskFullError, match="cannot save the conversation to .*chat.tkv.*free space") as info:
            if asynchronous:
                asyncio.run(cache.asave(target, model=model))
            else:
                cache.save(target, model=model)
        assert info.value.errno == errno.ENOSPC
        assert target.read_bytes() == saved and sorted(p.name for p in mount.iterdir()) == ["chat.tkv",
                                                                                            "other-program"]
        assert_consistent(cache, reference)
        decode(model, cache, reference, token, 4)
        assert_consistent(cache, reference)
        cache.close()

def test_a_nearly_full_disk_dir_is_warned_of_when_the_cache_is_made(tmp_path, caplog):
    """The disk tier's default budget is 90% of the free space: on a nearly full filesystem a few bytes, and the
    cache failed only once its KV reached the disk ("disk 0 B of 0 B"). Made, it says so and names the fix."""
    with tiny_tmpfs(tmp_path / "tiny", "1m") as mount, caplog.at_level(logging.WARNING, logger="tierkv"), \
            TieredCache(gpu_gb="1MB", cpu_gb="1MB", disk_dir=mount) as cache:  # fmt: skip
        assert cache.runtime.disk is not None and cache.runtime.disk.budget < 2**20
    assert re.search(r"has [\d.,]+ [KM]iB free.*is [\d.,]+ KiB.*pass disk_gb", caplog.text), caplog.text
    caplog.clear()
    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", disk_dir=tmp_path / "roomy"):
        pass
    assert "disk_gb" not in caplog.text  # a disk with room: nothing said


def test_short_reads_and_writes_move_every_byte(model, tmp_path, faulty):
    faulty.short = True
    cache, reference, token = start(model, tmp_path)
    decode(model, cache, reference, token, 8)
    assert faulty.reads > 0
    assert_consistent(cache, reference)
    cache.close()


# ------------------------------------------------------------------------------ KeyboardInterrupt
INTERRUPT_POINTS = [
    ("tiers", Tier.DISK, "alloc"),
    ("tiers", Tier.DISK, "write"),
    ("tiers", Tier.DISK, "read"),
    ("tiers", Tier.DISK, "wait"),
    ("tiers", Tier.HOST, "alloc"),
    ("tiers", Tier.HOST, "write_from"),
    ("writeback", None, "_start"),
    ("transfer", None, "copy_slots"),
]


def _target(store, where, tier):
    return {"tiers": lambda: store.tiers[tier], "writeback": lambda: store.writeback,
            "transfer": lambda: store.transfer}[where]()


@pytest.mark.parametrize(("where", "tier", "name"), INTERRUPT_POINTS, ids=lambda v: getattr(v, "label", v))
def test_keyboard_interrupt_anywhere_leaks_no_slot(tmp_path, monkeypatch, where, tier, name):
    """A KeyboardInterrupt at the n-th call of each I/O point (for every n the workload reaches) leaves the
    slot accounting exact (``check()``), and ``reset()`` frees every slot; the store then works as new."""
    for nth in range(1, 60, 3):
        store = make_store(tmp_path / f"{name}-{nth}", device_slots=6, host_slots=16)
        target = _target(store, where, tier)
        real = getattr(target, name)
        calls = [0]

        def interrupting(*args, real=real, calls=calls, nth=nth, **kwargs):
            calls[0] += 1
            if calls[0] == nth:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(target, name, interrupting)
        interrupted = False
        try:
            for step in range(12):
                for layer in range(2):
                    store.append(layer, *kv(2, 3, seed=10 * step + layer))
                    store.read_tokens(layer)
        except KeyboardInterrupt:
            interrupted = True
        monkeypatch.setattr(target, name, real)
        store.writeback.reap(wait=True)
        store.check()
        store.reset()
        assert all(used == 0 for t in store.tiers.values() for used in t.slot_counts().values())
        keys, values = kv(2, 9, seed=1)
        store.append(0, keys, values)
        torch.testing.assert_close(store.read_tokens(0), torch.stack((keys, values)), rtol=0, atol=0)
        store.close()
        if not interrupted:
            break  # the workload makes fewer calls than nth: every point was reached
    assert nth > 1, f"{where}.{name} was never called by the workload"


# Closes an engine file on the main thread while another thread keeps submitting reads and waiting for them, many
# times over; prints the errors the reader saw once every round is done.
CLOSE_UNDER_A_READER = """
import sys, threading
from tierkv.io.base import aligned_empty
from tierkv.io.select import open_disk_file

path, engine, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(path, "wb") as f:
    f.truncate(1 << 20)
seen = set()
for _ in range(rounds):
    file = open_disk_file(path, engine=engine, direct=False)
    started = threading.Event()

    def read_until_closed():
        buffer = aligned_empty(1 << 20)
        try:
            while True:
                handle = file.submit_reads([(k << 16, buffer[k << 16 : (k + 1) << 16]) for k in range(16)])
                started.set()
                handle.wait()
        except Exception as exc:
            seen.add(f"{type(exc).__name__}: {str(exc)[:13]}")

    reader = threading.Thread(target=read_until_closed)
    reader.start()
    started.wait()
    file.close()
    reader.join()
print(sorted(seen), flush=True)
"""


@pytest.mark.parametrize("engine", ["native", "posix"])
def test_closing_an_engine_file_while_another_thread_reads_it(tmp_path, engine):
    """Regression: ``close()`` on one thread while another submitted and waited (a server closing a cache whose
    request thread decodes, or the mover's read): the native engine freed its C pool under a ``tkv_wait`` or
    ``tkv_submit`` (a segfault, or a deadlock on the freed mutex), the posix engine raised AttributeError /
    RuntimeError. Now the pool lives until the last C call is out, and the reader only ever sees "I/O on closed"."""
    from tierkv.io.select import engine_status

    reason = engine_status()[engine]
    if reason is not None:
        pytest.skip(f"{engine} unavailable: {reason}")
    child = subprocess.run([sys.executable, "-X", "faulthandler", "-c", CLOSE_UNDER_A_READER,
                            str(tmp_path / "file.bin"), engine, "300"], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.strip() == "['ValueError: I/O on closed']"
