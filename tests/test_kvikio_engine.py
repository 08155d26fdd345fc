"""The kvikio engine's mode reporting and automatic selection, on any host (kvikio itself runs only under the
``cuda`` marker, in tests/test_io.py and benchmarks/gpu_check.sh)."""

from __future__ import annotations

import enum
import logging

import pytest

from tierkv.errors import InvalidConfigError
from tierkv.io import select
from tierkv.io.kvikio_engine import compat_from
from tierkv.io.posix import PosixFile


class CompatMode(enum.IntEnum):
    """The shape of ``kvikio.CompatMode`` (releases from 24.10 return it from ``compat_mode()``)."""

    OFF = 0
    ON = 1
    AUTO = 2


def test_compat_mode_enum_is_read_by_name_not_truthiness():
    assert bool(CompatMode.AUTO)  # why reading it as a bool was wrong
    assert compat_from(CompatMode.OFF) is False
    assert compat_from(CompatMode.ON) is True
    assert compat_from(CompatMode.AUTO) is True  # nothing here says cuFile works: the safe side
    assert compat_from(False) is False and compat_from(True) is True  # releases that return a bool


def test_auto_selection_never_prefers_kvikio(tmp_path, monkeypatch, caplog):
    """Even where kvikio loads, auto takes an O_DIRECT engine: the disk tier hands it host buffers, which kvikio
    reads through the page cache."""

    class LoadsFine(PosixFile):
        engine_name = "kvikio"

    monkeypatch.setitem(select._LOADERS, "kvikio", lambda: LoadsFine)
    path = tmp_path / "kv.bin"
    path.write_bytes(bytes(1 << 16))
    caplog.set_level(logging.INFO, logger="tierkv")
    with select.open_disk_file(path, engine="auto") as f:
        assert f.engine_name in ("native", "posix")
    with select.open_disk_file(path, engine="kvikio") as f:  # forcing it still works
        assert f.engine_name == "kvikio"
    assert "kvikio" not in select.AUTO_ENGINES


@pytest.mark.cuda
def test_kvikio_reports_its_real_mode(tmp_path):
    """On a GPU host with kvikio: ``direct`` only when host reads really bypass the page cache."""
    if select.engine_status()["kvikio"] is not None:
        pytest.skip(f"kvikio unavailable: {select.engine_status()['kvikio']}")
    path = tmp_path / "kv.bin"
    path.write_bytes(bytes(1 << 20))
    with select.open_disk_file(path, engine="kvikio") as f:
        assert f.direct or "page cache" in f.direct_refused
        print(f"kvikio: gds={f.gds} host direct={f.direct} {f.direct_refused}")
        reads_direct = f.direct
    if reads_direct:  # KVIKIO_AUTO_DIRECT_IO_READ: buffered reads cannot be had from kvikio, so asking is refused
        with pytest.raises(InvalidConfigError, match="buffered I/O was requested.*KVIKIO_AUTO_DIRECT_IO_READ"):
            select.open_disk_file(path, engine="kvikio", direct=False)
