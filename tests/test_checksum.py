"""xxh3-64 per block: :func:`tierkv.io.checksum.xxh3_rows` and the native engine's hashed reads give the
``xxhash`` package's digests of the same bytes (files and checksums stay compatible across paths)."""

from __future__ import annotations

import numpy as np
import pytest
from xxhash import xxh3_64_intdigest

from tierkv import settings
from tierkv.io import aligned_empty, checksum, engine_status, open_disk_file


def reference(rows: np.ndarray) -> np.ndarray:
    return np.array([xxh3_64_intdigest(row.tobytes()) for row in rows], dtype=np.uint64)


@pytest.fixture(params=["native", "fallback"])
def path_taken(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "fallback":
        monkeypatch.setattr(checksum, "_native_rows", lambda: None)  # as without a compiler
    elif checksum._native_rows() is None:
        pytest.skip("the native library does not build here")
    return request.param


@pytest.mark.parametrize("row_bytes", [0, 1, 16, 17, 128, 129, 240, 241, 1024, 4096, 65_536 + 7])
def test_rows_match_the_xxhash_package(path_taken: str, row_bytes: int) -> None:
    rows = np.random.default_rng(row_bytes).integers(0, 256, (5, row_bytes), dtype=np.uint8)
    np.testing.assert_array_equal(checksum.xxh3_rows(rows), reference(rows))


def test_strided_rows_and_no_rows(path_taken: str) -> None:
    wide = np.random.default_rng(1).integers(0, 256, (6, 9000), dtype=np.uint8)
    rows = wide[::2, 13:13 + 4096]  # a row stride that is not the row length, an unaligned start
    np.testing.assert_array_equal(checksum.xxh3_rows(rows), reference(rows))
    assert checksum.xxh3_rows(np.zeros((0, 64), dtype=np.uint8)).shape == (0,)


def test_bad_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="uint8"):
        checksum.xxh3_rows(np.zeros((2, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="contiguous"):
        checksum.xxh3_rows(np.zeros((4, 8), dtype=np.uint8).T)


@pytest.mark.parametrize("chunk", ["8KiB", "12KiB", "4MiB"])  # pieces smaller than, not a multiple of, above a unit
def test_native_reads_hash_each_unit_as_it_lands(tmp_path, chunk: str) -> None:
    if engine_status()["native"] is not None:
        pytest.skip(f"native unavailable: {engine_status()['native']}")
    unit, units = 8192, 24
    data = np.random.default_rng(2).integers(0, 256, unit * units, dtype=np.uint8)
    path = tmp_path / "f.kv"
    path.write_bytes(data.tobytes())
    buffer = aligned_empty(unit * 10)
    requests = [(0, buffer[: 3 * unit]), (10 * unit, buffer[3 * unit : 9 * unit]), (23 * unit, buffer[9 * unit :])]
    with settings.override(io_chunk=chunk), open_disk_file(path, engine="native") as f:
        handle, digests = f.submit_hashed_reads(requests, unit)
        handle.wait()
        with pytest.raises(ValueError, match="whole 8192-byte units"):
            f.submit_hashed_reads([(0, buffer[:4096])], unit)
    np.testing.assert_array_equal(buffer, np.concatenate([data[: 3 * unit], data[10 * unit : 16 * unit],
                                                          data[23 * unit :]]))
    np.testing.assert_array_equal(digests, reference(buffer.reshape(10, unit)))


def test_posix_reads_leave_hashing_to_the_caller(tmp_path) -> None:
    path = tmp_path / "f.kv"
    path.write_bytes(bytes(8192))
    buffer = aligned_empty(8192)
    with open_disk_file(path, engine="posix") as f:
        handle, digests = f.submit_hashed_reads([(0, buffer)], 4096)
        handle.wait()
    assert digests is None
