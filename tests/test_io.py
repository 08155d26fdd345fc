"""Disk engines: round trips, alignment rules, errno propagation, selection and its log.

Every behavioural test runs over each engine that loads here (kvikio only on a CUDA host). Error paths
use real kernel errors where the host allows: ``/dev/full`` refuses O_DIRECT (EINVAL at open) and
fails writes with ENOSPC; a 1 MiB tmpfs, mounted if we may, runs out of space for real.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv import settings as tierkv_settings
from tierkv.errors import InvalidConfigError
from tierkv.io import (
    ALIGN,
    ENGINES,
    AlignmentError,
    aligned_empty,
    available_engines,
    engine_status,
    open_disk_file,
)
from tierkv.io import native as native_engine
from tierkv.io import select as select_module
from tierkv.io.checksum import xxh3_rows

MiB = 1 << 20
ENGINE_PARAMS = [
    pytest.param("kvikio", marks=pytest.mark.cuda),
    pytest.param("native"),
    pytest.param("posix"),
]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No engine or mode leaks in from the caller's shell; every test starts with a fresh log."""
    for name in ("TIERKV_DISK_ENGINE", "TIERKV_DIRECT_IO", "TIERKV_IO_QUEUE_DEPTH", "TIERKV_IO_CHUNK"):
        monkeypatch.delenv(name, raising=False)
    select_module._log_choice.cache_clear()


@pytest.fixture(params=ENGINE_PARAMS)
def engine(request: pytest.FixtureRequest) -> str:
    reason = engine_status()[request.param]
    if reason is not None:
        pytest.skip(f"{request.param} unavailable: {reason}")
    return request.param


def skip_unless_mode(engine: str, path: str, direct: bool) -> None:
    """kvikio reads host buffers with O_DIRECT only on releases and settings that offer it, and then for every file
    of the process (``KVIKIO_AUTO_DIRECT_IO_READ``): skip (saying why) where it does not read as ``direct`` asks;
    the other engines fall back or refuse by the filesystem, which the tests check."""
    if engine == "kvikio":
        with open_disk_file(path, engine=engine) as f:
            if direct and not f.direct:
                pytest.skip(f"kvikio here: {f.direct_refused}")
            if not direct and f.direct:
                pytest.skip("kvikio here reads host buffers with O_DIRECT (KVIKIO_AUTO_DIRECT_IO_READ)")


def make_file(path: os.PathLike[str] | str, nbytes: int) -> str:
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return os.fspath(path)


def random_bytes(nbytes: int, seed: int = 0) -> np.ndarray:
    buf = aligned_empty(nbytes)
    buf[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return buf


# --- aligned buffers ------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [0, 1, ALIGN - 1, ALIGN, 3 * MiB + 5])
def test_aligned_empty_is_aligned(nbytes: int) -> None:
    buf = aligned_empty(nbytes)
    assert buf.dtype == np.uint8 and buf.nbytes == nbytes and buf.flags.writeable
    assert buf.ctypes.data % ALIGN == 0


# --- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_batches(engine: str, direct: bool, tmp_path) -> None:
    """Many requests per batch, some larger than the chunk size so they are split across workers."""
    path = make_file(tmp_path / "kv.bin", 8 * MiB)
    skip_unless_mode(engine, path, direct)
    src = random_bytes(8 * MiB)
    with tierkv_settings.override(io_chunk="64KiB"), open_disk_file(path, engine=engine, direct=direct) as f:
        assert f.engine_name == engine and f.direct is direct
        sizes = [ALIGN, 3 * ALIGN, 256 * 1024, MiB, 2 * MiB + 8 * ALIGN]  # mixed, some > chunk
        offsets = np.cumsum([0, *sizes[:-1]])
        f.submit_writes([(int(o), src[o : o + n]) for o, n in zip(offsets, sizes, strict=True)]).wait()
        f.submit_writes([(4 * MiB, src[4 * MiB :])]).wait()  # one 4 MiB request
        dst = aligned_empty(8 * MiB)
        handle = f.submit_reads([(i * MiB, dst[i * MiB : (i + 1) * MiB]) for i in reversed(range(8))])
        handle.wait()
        assert handle.done()
    end = int(offsets[-1] + sizes[-1])
    np.testing.assert_array_equal(dst[:end], src[:end])
    np.testing.assert_array_equal(dst[4 * MiB :], src[4 * MiB :])


def test_round_trip_on_tmpfs_in_auto_mode(engine: str) -> None:
    """/dev/shm: older kernels refuse O_DIRECT on tmpfs (auto mode falls back to buffered), 6.6+ accept
    it; either way the data must come back and the mode must say which happened."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = make_file(f"/dev/shm/tierkv-test-{os.getpid()}.bin", MiB)
    try:
        src, dst = random_bytes(MiB), aligned_empty(MiB)
        with open_disk_file(path, engine=engine) as f:
            assert f.direct or f.direct_refused
            f.write(0, src)
            f.read(0, dst)
        np.testing.assert_array_equal(dst, src)
    finally:
        os.unlink(path)


def test_buffered_accepts_unaligned_requests(engine: str, tmp_path) -> None:
    path = make_file(tmp_path / "kv.bin", MiB)
    src = np.arange(1000, dtype=np.float32)  # any C-contiguous dtype is moved as its bytes
    dst = np.zeros(1000, dtype=np.float32)
    skip_unless_mode(engine, path, False)
    with open_disk_file(path, engine=engine, direct=False) as f:
        f.write(13, src)
        f.read(13, dst)
    np.testing.assert_array_equal(dst, src)


def test_empty_batch_and_zero_length_request(engine: str, tmp_path) -> None:
    path = make_file(tmp_path / "kv.bin", MiB)
    with open_disk_file(path, engine=engine) as f:
        handle = f.submit_reads([])
        assert handle.done()
        handle.wait()
        f.submit_reads([(0, aligned_empty(0)), (0, aligned_empty(ALIGN))]).wait()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blocks=st.lists(st.tuples(st.integers(0, 63), st.integers(1, 4)), min_size=1, max_size=24))
def test_posix_and_native_agree_with_a_bytearray_model(blocks: list[tuple[int, int]], tmp_path) -> None:
    """Random batches of block writes, then one read of everything, against a plain in-memory model."""
    path = make_file(tmp_path / "prop.bin", 64 * ALIGN + 4 * ALIGN)
    model = np.zeros(68 * ALIGN, dtype=np.uint8)
    engines = [e for e in ("native", "posix") if e in available_engines()]
    with open(path, "r+b") as f:  # hypothesis reuses tmp_path across examples: start from zeros
        f.write(bytes(model.nbytes))
    for name in engines:
        with open_disk_file(path, engine=name) as f:
            requests = []
            for seed, (block, count) in enumerate(blocks):
                data = random_bytes(count * ALIGN, seed=seed + 7 * block)
                requests.append((block * ALIGN, data))
            # Overlapping requests in one batch have no defined order: submit one batch per request.
            for offset, data in requests:
                f.submit_writes([(offset, data)]).wait()
                model[offset : offset + data.nbytes] = data
            out = aligned_empty(model.nbytes)
            f.submit_reads([(0, out)]).wait()
            np.testing.assert_array_equal(out, model)


# --- request checks -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offset", "start", "nbytes", "what"),
    [(100, 0, ALIGN, "offset=100"), (0, 0, 1000, "nbytes=1000"), (0, 8, ALIGN, "address=")],
)
def test_direct_io_alignment_errors(
    engine: str, tmp_path, offset: int, start: int, nbytes: int, what: str
) -> None:
    path = make_file(tmp_path / "kv.bin", MiB)
    skip_unless_mode(engine, path, True)
    buf = aligned_empty(2 * ALIGN)[start : start + nbytes]
    with open_disk_file(path, engine=engine, direct=True) as f:
        for submit in (f.submit_reads, f.submit_writes):
            with pytest.raises(AlignmentError, match=what) as info:
                submit([(0, aligned_empty(ALIGN)), (offset, buf)])
            assert isinstance(info.value, ValueError) and "request 1" in str(info.value)


def test_bad_buffers_are_refused(engine: str, tmp_path) -> None:
    path = make_file(tmp_path / "kv.bin", MiB)
    readonly = aligned_empty(ALIGN)
    skip_unless_mode(engine, path, False)
    readonly.flags.writeable = False
    with open_disk_file(path, engine=engine, direct=False) as f:
        with pytest.raises(ValueError, match="writable"):
            f.submit_reads([(0, readonly)])
        f.submit_writes([(0, readonly)]).wait()  # a write only needs to read the buffer
        with pytest.raises(ValueError, match="contiguous"):
            f.submit_writes([(0, np.zeros((64, 64), dtype=np.uint8)[:, ::2])])
        with pytest.raises(ValueError, match="negative"):
            f.submit_writes([(-ALIGN, aligned_empty(ALIGN))])


# --- array submission -----------------------------------------------------------------------------


def sector_runs(rng: np.random.Generator, sectors: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` disjoint runs of whole sectors in a file of ``sectors``: (file offsets, lengths) in bytes, shuffled."""
    cuts = np.sort(rng.choice(np.arange(1, sectors), size=2 * count - 1, replace=False))
    bounds = np.concatenate([[0], cuts]).reshape(count, 2)  # every other gap is a run: [start, end)
    order = rng.permutation(count)
    return bounds[order, 0] * ALIGN, (bounds[order, 1] - bounds[order, 0]) * ALIGN


@pytest.mark.parametrize("direct", [True, False])
def test_submit_array_round_trip(engine: str, direct: bool, tmp_path) -> None:
    """Scattered runs written from and read into one buffer at given offsets (not in file order, some larger
    than a chunk), against the same bytes moved request by request; hashed reads hash what landed."""
    rng = np.random.default_rng(3)
    path = make_file(tmp_path / "kv.bin", 512 * ALIGN)
    skip_unless_mode(engine, path, direct)
    offsets, lengths = sector_runs(rng, 512, 40)
    starts = np.concatenate([[0], np.cumsum(lengths[:-1])])  # packed in the buffer in submission order
    src = random_bytes(int(lengths.sum()), seed=4)
    with tierkv_settings.override(io_chunk="16KiB"), open_disk_file(path, engine=engine, direct=direct) as f:
        handle, digests = f.submit_array(offsets, lengths, src, starts, write=True)
        assert digests is None
        handle.wait()
        want = aligned_empty(src.nbytes)
        f.submit_reads([(int(o), want[s : s + n]) for o, s, n in zip(offsets, starts, lengths)]).wait()
        np.testing.assert_array_equal(want, src)  # the writes landed where the arrays said
        spread = lengths[::-1].cumsum()[::-1] - lengths  # packed in the buffer the other way round
        dst = aligned_empty(src.nbytes)
        handle, digests = f.submit_array(offsets, lengths, dst, spread, write=False, unit=ALIGN)
        handle.wait()
        for start, at, n in zip(starts.tolist(), spread.tolist(), lengths.tolist()):
            np.testing.assert_array_equal(dst[at : at + n], src[start : start + n])
        landed = np.concatenate([dst[at : at + n] for at, n in zip(spread, lengths)]).reshape(-1, ALIGN)
        assert digests is None if engine != "native" else np.array_equal(digests, xxh3_rows(landed))
        empty, none = f.submit_array(np.zeros(0, np.int64), np.zeros(0, np.int64), dst, np.zeros(0, np.int64),
                                     write=False)
        assert empty.done() and none is None
        plan = f.plan_array(offsets, lengths, spread, write=False, unit=ALIGN)
        for _ in range(2):  # planned once, submitted into two buffers: the same bytes and digests
            again = aligned_empty(src.nbytes)
            handle, planned = f.submit_plan(plan, again)
            handle.wait()
            np.testing.assert_array_equal(again, dst)
            assert (planned is None) == (digests is None) and (planned is None or np.array_equal(planned, digests))
        with pytest.raises(ValueError, match="outside"):
            f.submit_plan(plan, aligned_empty(src.nbytes - ALIGN))
        if f.direct:
            with pytest.raises(AlignmentError, match="address="):
                f.submit_plan(plan, aligned_empty(src.nbytes + ALIGN)[8 : 8 + src.nbytes])


def test_submit_array_read_past_end_of_file_names_the_request(engine: str, tmp_path) -> None:
    path = make_file(tmp_path / "kv.bin", 2 * ALIGN)
    with open_disk_file(path, engine=engine) as f:
        handle, _ = f.submit_array(np.array([0, ALIGN, 8 * ALIGN]), np.array([ALIGN, 2 * ALIGN, ALIGN]),
                                   aligned_empty(4 * ALIGN), np.array([0, ALIGN, 3 * ALIGN]), write=False)
        with pytest.raises(OSError, match="offset 4096") as info:
            handle.wait()
        assert info.value.errno == errno.EIO


ARRAY_REFUSALS = [  # (offsets, lengths, buffer offsets, unit, error, message): request 1 is the bad one
    ([0, 100], [ALIGN, ALIGN], [0, ALIGN], 0, AlignmentError, "offset=100"),
    ([0, ALIGN], [ALIGN, 1000], [0, ALIGN], 0, AlignmentError, "nbytes=1000"),
    ([0, ALIGN], [ALIGN, ALIGN], [0, 8], 0, AlignmentError, "address="),
    ([0, ALIGN], [ALIGN, 2 * ALIGN], [0, 3 * ALIGN], 0, ValueError, "outside its 16384 bytes"),
    ([0, ALIGN], [ALIGN, ALIGN], [0, -ALIGN], 0, ValueError, "outside"),
    ([0, -ALIGN], [ALIGN, ALIGN], [0, ALIGN], 0, ValueError, "negative"),
    ([0, ALIGN], [ALIGN, -ALIGN], [0, ALIGN], 0, ValueError, "negative"),
    ([0, ALIGN], [2 * ALIGN, ALIGN], [0, 2 * ALIGN], 2 * ALIGN, ValueError, "multiple of the unit"),
]


@pytest.mark.parametrize(("offsets", "lengths", "starts", "unit", "error", "what"), ARRAY_REFUSALS)
def test_submit_array_refusals_submit_nothing(engine: str, tmp_path, offsets, lengths, starts, unit, error,
                                              what) -> None:
    """Every check of the tuple form, vectorized, plus requests inside the buffer and whole units; a refused batch
    moves no byte of its good requests either."""
    path = make_file(tmp_path / "kv.bin", 16 * ALIGN)
    buffer = random_bytes(4 * ALIGN, seed=1)
    with open_disk_file(path, engine=engine, direct=True if engine != "kvikio" else None) as f:
        if not f.direct and error is AlignmentError:
            pytest.skip("alignment is only required with O_DIRECT")
        args = (np.array(offsets), np.array(lengths), buffer, np.array(starts))
        for write in ([False] if unit else [False, True]):
            with pytest.raises(error, match=what) as info:
                f.submit_array(*args, write=write, unit=unit)
            assert "request 1" in str(info.value)
            with pytest.raises(error, match=what) as info:  # planned: refused by the plan, or by the buffer
                f.submit_plan(f.plan_array(*args[:2], args[3], write=write, unit=unit), buffer)
            assert "request 1" in str(info.value)
        untouched = aligned_empty(16 * ALIGN)
        f.read(0, untouched)
    assert not untouched.any()  # request 0 was fine: it did not run


def test_submit_array_names_the_first_bad_request_and_its_first_failed_check(engine: str, tmp_path) -> None:
    """Several bad requests, one failing several checks: the error is the first request's (submission order),
    for the first check it fails in the tuple form's order (negative before misaligned)."""
    path = make_file(tmp_path / "kv.bin", 16 * ALIGN)
    buffer = aligned_empty(4 * ALIGN)
    offsets, lengths, starts = np.array([0, -ALIGN, 5]), np.array([ALIGN, 1000, -1]), np.array([0, ALIGN, 2 * ALIGN])
    with open_disk_file(path, engine=engine, direct=True if engine != "kvikio" else None) as f:
        with pytest.raises(ValueError, match="request 1: file offset -4096 is negative") as info:
            f.submit_array(offsets, lengths, buffer, starts, write=False)
        assert not isinstance(info.value, AlignmentError)


@pytest.mark.parametrize("depth", [1, 3, 16])
def test_native_batches_queued_back_to_back_all_complete(depth: int, tmp_path, monkeypatch) -> None:
    """Many batches of 1 to 64 small pieces queued before any is waited on, on pools smaller and larger than a
    batch: every piece is read (each worker that takes a piece wakes the next ones; none is left sleeping while
    pieces wait) and hashed as it landed."""
    if "native" not in available_engines():
        pytest.skip("native engine unavailable")
    monkeypatch.setenv("TIERKV_IO_QUEUE_DEPTH", str(depth))
    rng = np.random.default_rng(depth)
    path = make_file(tmp_path / "kv.bin", 256 * ALIGN)
    want = np.fromfile(path, dtype=np.uint8)
    with open_disk_file(path, engine="native", direct=False) as f:
        pending = []
        for _ in range(60):
            count = int(rng.integers(1, 65))
            sectors = rng.choice(256, size=count, replace=False)
            buffer = aligned_empty(count * ALIGN)
            handle, digests = f.submit_array(sectors * ALIGN, np.full(count, ALIGN), buffer,
                                             np.arange(count) * ALIGN, write=False, unit=ALIGN)
            pending.append((handle, digests, sectors, buffer))
        for handle, digests, sectors, buffer in pending:
            handle.wait()
            rows = buffer.reshape(-1, ALIGN)
            np.testing.assert_array_equal(rows, want.reshape(-1, ALIGN)[sectors])
            np.testing.assert_array_equal(digests, xxh3_rows(rows))


def test_submit_array_refuses_bad_arrays_and_buffers(engine: str, tmp_path) -> None:
    path = make_file(tmp_path / "kv.bin", 16 * ALIGN)
    readonly = aligned_empty(2 * ALIGN)
    readonly.flags.writeable = False
    skip_unless_mode(engine, path, False)
    one, zero = np.array([ALIGN]), np.array([0])
    with open_disk_file(path, engine=engine, direct=False) as f:
        with pytest.raises(ValueError, match="writable"):
            f.submit_array(zero, one, readonly, zero, write=False)
        f.submit_array(zero, one, readonly, zero, write=True)[0].wait()  # a write only reads the buffer
        with pytest.raises(ValueError, match="contiguous"):
            f.submit_array(zero, one, np.zeros((64, 128), dtype=np.uint8)[:, ::2], zero, write=True)
        with pytest.raises(ValueError, match="one entry per request"):
            f.submit_array(np.array([0, ALIGN]), one, readonly, zero, write=True)
        with pytest.raises(ValueError, match="integers"):
            f.submit_array(np.array([0.5]), one, readonly, zero, write=True)
        with pytest.raises(ValueError, match="int64 range"):
            f.submit_array(np.array([2**64 - ALIGN], dtype=np.uint64), one, readonly, zero, write=True)
        with pytest.raises(ValueError, match="0 for writes"):
            f.submit_array(zero, one, readonly, zero, write=True, unit=ALIGN)
        with pytest.raises(ValueError, match="byte count"):
            f.submit_array(zero, one, aligned_empty(ALIGN), zero, write=False, unit=-1)


def test_native_submit_array_runs_no_python_per_request(tmp_path) -> None:
    """The native engine's array form hands the arrays to C: the Python a submission executes is the same for 4
    requests as for 400 (traced, every line and call)."""
    if "native" not in available_engines():
        pytest.skip("native engine unavailable")
    path = make_file(tmp_path / "kv.bin", 1024 * ALIGN)
    buffer = aligned_empty(1024 * ALIGN)

    def traced(count: int) -> int:
        events = 0

        def tracer(frame, event, arg):
            nonlocal events
            events += 1
            return tracer

        offsets = np.arange(count) * 2 * ALIGN  # none adjacent: one request each
        lengths, starts = np.full(count, ALIGN), np.arange(count) * ALIGN
        with open_disk_file(path, engine="native", direct=False) as f:
            sys.settrace(tracer)
            try:
                handle, digests = f.submit_array(offsets, lengths, buffer, starts, write=False, unit=ALIGN)
            finally:
                sys.settrace(None)
            handle.wait()
            assert digests is not None and digests.size == count
        return events

    assert traced(4) == traced(400)


def test_read_past_end_of_file_is_an_oserror(engine: str, tmp_path) -> None:
    path = make_file(tmp_path / "kv.bin", 2 * ALIGN)
    with open_disk_file(path, engine=engine) as f:
        good = aligned_empty(ALIGN)
        handle = f.submit_reads(
            [(0, good), (ALIGN, aligned_empty(2 * ALIGN)), (8 * ALIGN, aligned_empty(ALIGN))]
        )
        with pytest.raises(OSError, match="end of file") as info:
            handle.wait()
        assert info.value.errno == errno.EIO and "offset 4096" in str(info.value)  # the first failure
        assert handle.done()
        with pytest.raises(OSError, match="offset 4096"):  # waiting again re-raises the same error
            handle.wait()


def test_a_dropped_file_releases_its_descriptor(engine: str, tmp_path) -> None:
    """A file dropped without ``close()`` (a cache garbage-collected mid-use) leaves no open descriptor."""
    path = make_file(tmp_path / "kv.bin", MiB)
    f = open_disk_file(path, engine=engine)
    f.submit_reads([(0, aligned_empty(MiB))]).wait()
    assert _open_on(path)
    del f
    # the pool's worker drops its last reference to the finished runner (and so to the file) just after the
    # handle completes, so the finalizer may run on that thread a moment later: wait for it, bounded
    deadline = time.monotonic() + 10
    while _open_on(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _open_on(path)


def _open_on(path: str) -> bool:
    fds = Path("/proc/self/fd")
    return any(os.path.realpath(fds / fd) == os.path.realpath(path) for fd in os.listdir(fds))


def test_close_is_idempotent_and_io_after_close_fails(engine: str, tmp_path) -> None:
    path = make_file(tmp_path / "kv.bin", MiB)
    f = open_disk_file(path, engine=engine)
    pending = f.submit_writes([(i * ALIGN, random_bytes(ALIGN, i)) for i in range(64)])  # not waited
    f.close()
    f.close()
    assert pending.done()
    with pytest.raises(ValueError, match="closed"):
        f.submit_reads([(0, aligned_empty(ALIGN))])


def test_open_missing_file(engine: str, tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        open_disk_file(tmp_path / "absent.bin", engine=engine)


# --- errno propagation ----------------------------------------------------------------------------


def test_dev_full_refuses_o_direct_and_reports_enospc(engine: str, caplog: pytest.LogCaptureFixture) -> None:
    """/dev/full is a real kernel fault injector: EINVAL for O_DIRECT, ENOSPC for every write."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    caplog.set_level(logging.INFO, logger="tierkv")
    with open_disk_file("/dev/full", engine=engine) as f:
        assert not f.direct
        handle = f.submit_writes([(0, aligned_empty(ALIGN)), (ALIGN, aligned_empty(MiB))])
        with pytest.raises(OSError) as info:
            handle.wait()
        assert info.value.errno == errno.ENOSPC
        refused = f.direct_refused  # kvikio in compat mode names its own reason (host reads through the cache)
    assert refused == "filesystem refuses O_DIRECT" or engine == "kvikio"
    assert f"buffered, {refused}" in caplog.text
    with pytest.raises(InvalidConfigError, match="refuses O_DIRECT" if engine != "kvikio" else re.escape(refused)):
        open_disk_file("/dev/full", engine=engine, direct=True)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs, if this process may mount one (root in a container); skipped otherwise."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_enospc_on_a_full_filesystem(engine: str, tiny_tmpfs) -> None:
    path = make_file(tiny_tmpfs / "kv.bin", 4 * MiB)  # sparse: bigger than the filesystem
    with open_disk_file(path, engine=engine) as f:
        handle = f.submit_writes([(i * MiB, random_bytes(MiB, i)) for i in range(4)])
        with pytest.raises(OSError) as info:
            handle.wait()
    assert info.value.errno == errno.ENOSPC


def test_posix_fault_injection_keeps_errno_and_finishes_the_batch(tmp_path, monkeypatch) -> None:
    """Failures are reported in submission order, after every other request has run."""
    from tierkv.io import posix

    path = make_file(tmp_path / "kv.bin", MiB)
    real_pwritev = os.pwritev
    written: list[int] = []

    def pwritev(fd: int, buffers, offset: int) -> int:
        if offset in (2 * ALIGN, 5 * ALIGN):
            raise OSError(errno.ENOSPC if offset == 2 * ALIGN else errno.EIO, "injected")
        written.append(offset)
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(posix.os, "pwritev", pwritev)
    with open_disk_file(path, engine="posix") as f:
        handle = f.submit_writes([(i * ALIGN, aligned_empty(ALIGN)) for i in range(8)])
        with pytest.raises(OSError) as info:
            handle.wait()
    assert info.value.errno == errno.ENOSPC
    assert sorted(written) == [i * ALIGN for i in (0, 1, 3, 4, 6, 7)]


# --- selection ------------------------------------------------------------------------------------


def test_auto_selection_and_log_once(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tierkv")
    path = make_file(tmp_path / "kv.bin", MiB)
    for _ in range(3):
        with open_disk_file(path) as f:
            assert f.engine_name == available_engines()[0]
    records = [r for r in caplog.records if r.name == "tierkv" and r.message.startswith("disk engine:")]
    assert len(records) == 1
    message = records[0].message
    assert f"using {f.engine_name} (O_DIRECT)" in message
    for name, reason in engine_status().items():
        if reason is not None:
            assert f"{name} unavailable ({reason})" in message
    with open_disk_file(path, direct=False):  # a different choice is logged, once
        pass
    assert "buffered, requested by direct=" in caplog.records[-1].message


def test_env_vars_force_engine_and_mode(tmp_path, monkeypatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tierkv")
    path = make_file(tmp_path / "kv.bin", MiB)
    monkeypatch.setenv("TIERKV_DISK_ENGINE", "posix")
    monkeypatch.setenv("TIERKV_DIRECT_IO", "0")
    with open_disk_file(path) as f:
        assert (f.engine_name, f.direct) == ("posix", False)
    assert (
        "using posix (buffered, requested by TIERKV_DIRECT_IO=0), forced by TIERKV_DISK_ENGINE=posix" in caplog.text
    )
    monkeypatch.setenv("TIERKV_DIRECT_IO", "1")
    with open_disk_file(path) as f:
        assert f.direct
    with open_disk_file(path, engine="posix", direct=False) as f:  # arguments beat the environment
        assert not f.direct
    monkeypatch.setenv("TIERKV_DIRECT_IO", "maybe")
    with pytest.raises(InvalidConfigError, match="TIERKV_DIRECT_IO"):
        open_disk_file(path)


def test_unknown_engine_lists_valid_names(tmp_path, monkeypatch) -> None:
    path = make_file(tmp_path / "kv.bin", MiB)
    with pytest.raises(InvalidConfigError) as info:
        open_disk_file(path, engine="uring")
    assert all(name in str(info.value) for name in ENGINES)
    monkeypatch.setenv("TIERKV_DISK_ENGINE", "gds")
    with pytest.raises(InvalidConfigError, match="'gds'"):
        open_disk_file(path)


def test_forced_kvikio_without_kvikio_says_why(tmp_path) -> None:
    reason = engine_status()["kvikio"]
    if reason is None:
        pytest.skip("kvikio works here")
    with pytest.raises(InvalidConfigError, match="forced by engine=") as info:
        open_disk_file(make_file(tmp_path / "kv.bin", MiB), engine="kvikio")
    assert reason in str(info.value) and "pip install" in str(info.value)


@pytest.fixture
def no_extension(tmp_path, monkeypatch):
    """The native engine as installed without its extension built, with an empty build cache."""
    monkeypatch.setattr(native_engine, "extension", lambda: None)
    native_engine._build.cache_clear()
    with tierkv_settings.override(cache_dir=tmp_path / "cache"):
        yield
    native_engine._build.cache_clear()  # later tests load the extension or the real cache (a file lookup)


@pytest.fixture
def no_compiler(no_extension, tmp_path, monkeypatch):
    """The native engine as on a host with no C compiler: not built at install, cannot build now."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))


def test_no_compiler_falls_back_to_posix(tmp_path, no_compiler, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tierkv")
    path = make_file(tmp_path / "kv.bin", MiB)
    assert "no C compiler" in engine_status()["native"]
    with open_disk_file(path) as f:
        assert f.engine_name in ("kvikio", "posix")
    assert "native unavailable (no C compiler" in caplog.text
    with pytest.raises(InvalidConfigError, match="no C compiler") as info:
        open_disk_file(path, engine="native")
    assert "TIERKV_DISK_ENGINE=posix" in str(info.value)


def test_native_builds_into_the_cache_dir(tmp_path, no_extension) -> None:
    """Installed without the extension: the engine compiles the checkout's source on first use."""
    if engine_status()["native"] is not None:
        pytest.skip("native unavailable here")
    native_engine.library()
    built = list((tmp_path / "cache" / "native").glob("tierkv_io-*.so"))
    assert len(built) == 1 and not list((tmp_path / "cache" / "native").glob("tmp*"))


def test_bad_tuning_knobs(tmp_path, monkeypatch) -> None:
    path = make_file(tmp_path / "kv.bin", MiB)
    monkeypatch.setenv("TIERKV_IO_QUEUE_DEPTH", "0")
    with pytest.raises(InvalidConfigError, match="TIERKV_IO_QUEUE_DEPTH"):
        open_disk_file(path, engine="posix")
    monkeypatch.setenv("TIERKV_IO_QUEUE_DEPTH", "4")
    monkeypatch.setenv("TIERKV_IO_CHUNK", "6KiB")
    with pytest.raises(InvalidConfigError, match="TIERKV_IO_CHUNK"):
        open_disk_file(path, engine="posix")


def test_import_loads_no_engine() -> None:
    """``import tierkv.io`` must not import kvikio or compile anything."""
    code = (
        "import sys, tierkv.io; "
        "assert 'kvikio' not in sys.modules and 'tierkv.io.native' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([os.sys.executable, "-c", code], check=True)


# --- kvikio on a GPU host -------------------------------------------------------------------------


@pytest.mark.cuda
def test_kvikio_reads_into_cuda_tensors(tmp_path) -> None:
    import torch

    if engine_status()["kvikio"] is not None:
        pytest.skip(f"kvikio unavailable: {engine_status()['kvikio']}")
    path = make_file(tmp_path / "kv.bin", 4 * MiB)
    src = torch.randn(2 * MiB // 2, dtype=torch.bfloat16, device="cuda")  # 2 MiB of bf16
    dst = torch.empty_like(src)
    skip_unless_mode("kvikio", path, False)
    with open_disk_file(path, engine="kvikio", direct=False) as f:
        f.submit_writes([(MiB, src)]).wait()
        f.submit_reads([(MiB, dst[: dst.numel() // 2]), (2 * MiB, dst[dst.numel() // 2 :])]).wait()
    assert torch.equal(src, dst)


@pytest.mark.parametrize("threads_that_start", [0, 2])
def test_posix_engine_without_threads_to_start_runs_the_batch_itself(tmp_path, monkeypatch, caplog,
                                                                     threads_that_start: int) -> None:
    """Regression: where the process could not start another thread (a thread, process or address-space limit),
    the posix engine raised "I/O on closed" on an open file, and the batch it said had failed stayed queued: it
    ran when a later batch started a thread, into the buffer the caller had reused. Now the threads that started
    and the calling thread run the batch, which is finished when it returns; nothing of it lands later; a warning
    says the engine goes on with fewer threads."""
    import threading

    path = tmp_path / "f.bin"
    data = np.random.default_rng(3).integers(0, 256, 8 * 65536, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    start, started = threading.Thread.start, []

    def limited(thread: threading.Thread) -> None:
        if thread.name.startswith("tierkv-posix-io") and len(started) >= threads_that_start:
            raise RuntimeError("can't start new thread")
        started.append(thread)
        start(thread)

    with tierkv_settings.override(io_chunk="64KiB"), open_disk_file(path, engine="posix", direct=False) as f:
        monkeypatch.setattr(threading.Thread, "start", limited)
        first = aligned_empty(data.size)
        with caplog.at_level(logging.WARNING, logger="tierkv"):
            f.submit_reads([(0, first)]).wait()  # 8 pieces for at most threads_that_start threads
        assert np.array_equal(first, data)
        assert "could not start another I/O thread" in caplog.text
        monkeypatch.setattr(threading.Thread, "start", start)
        first[:] = 7  # reused by the caller
        second = aligned_empty(65536)
        for _ in range(4):  # later batches start threads: a runner queued without one finds nothing left to do
            f.submit_reads([(65536, second)]).wait()
        time.sleep(0.05)
        assert np.array_equal(second, data[65536 : 2 * 65536])
        assert (first == 7).all()
