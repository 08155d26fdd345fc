"""The native engine's library: built by ``setup.py`` as an optional extension, else on first use.

The suite builds once into a temporary folder (never into the checkout: conftest's ``built_extensions``) and
each test points the loader at what was built, so the outcome does not depend on how this checkout was installed.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, build_ext, mounted, tiny_tmpfs

from tierkv import settings
from tierkv.io import native
from tierkv.io.base import EngineUnavailableError

needs_checkout = pytest.mark.skipif(not (ROOT / "setup.py").exists(), reason="not a source checkout")
needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module")
def built_extension(built_extensions: Path) -> Path:
    """The native engine's library that ``setup.py build_ext`` built (the session's one build)."""
    found = list((built_extensions / "tierkv" / "io").glob("_native*.so"))
    assert len(found) == 1, found
    return found[0]


@pytest.fixture
def fresh_loader(tmp_path: Path) -> Iterator[None]:
    """An empty build cache and no cached load outcome, before and after the test."""
    native._build.cache_clear()
    with settings.override(cache_dir=tmp_path / "cache"):
        yield
    native._build.cache_clear()


@needs_checkout
@needs_compiler
def test_setup_builds_the_extension_with_the_source_hash(built_extension: Path) -> None:
    assert native._built_from(ctypes.CDLL(str(built_extension))) == native.source_digest()


@needs_checkout
def test_install_without_a_compiler_still_succeeds(tmp_path: Path) -> None:
    result = build_ext(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert result.returncode == 0, result.stderr
    assert "tierkv.io._native" in result.stderr + result.stdout  # setuptools says the optional build failed
    assert not list(tmp_path.rglob("_native*.so"))


@needs_checkout
@needs_compiler
def test_the_extension_is_loaded_first(
    built_extension: Path, fresh_loader: None, monkeypatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tierkv")
    monkeypatch.setattr(native, "extension", lambda: built_extension)
    assert native.load() is native.NativeFile
    assert "the extension built at install" in caplog.text
    assert not (tmp_path / "cache").exists()  # nothing compiled on first use


@needs_checkout
@needs_compiler
def test_an_extension_from_an_older_source_is_rebuilt(
    built_extension: Path, fresh_loader: None, monkeypatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tierkv")
    monkeypatch.setattr(native, "extension", lambda: built_extension)
    monkeypatch.setattr(native, "source_digest", lambda: "0" * 16)  # the checkout's C file changed since
    native.library()
    assert "built from an older tierkv_io.c" in caplog.text
    assert len(list((tmp_path / "cache" / "native").glob("tierkv_io-*.so"))) == 1


def test_no_extension_and_no_source_is_unavailable_with_the_reason(
    fresh_loader: None, monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(native, "extension", lambda: None)
    monkeypatch.setattr(native, "SOURCE", tmp_path / "missing.c")  # a wheel installed without the extension
    with pytest.raises(EngineUnavailableError, match="not built at install") as info:
        native.library()
    assert "TIERKV_DISK_ENGINE=posix" in str(info.value)


def test_the_source_digest_covers_the_headers_it_includes_from_its_folder(tmp_path: Path) -> None:
    """A build compiles the headers a source includes with quotes: changing one changes the digest (the loaders
    then rebuild), a system header's name does not count."""
    from tierkv import cbuild

    (tmp_path / "shared.h").write_text("static int a;\n")
    source = tmp_path / "kernel.c"
    source.write_text('#include <stdint.h>\n#include "shared.h"\n')
    before = cbuild.source_digest(source)
    (tmp_path / "shared.h").write_text("static int b;\n")
    assert cbuild.source_digest(source) != before
    assert cbuild.source_bytes(source).endswith(b"static int b;\n")


_LOAD = """
from tierkv.io import native
native.extension = lambda: None  # built on first use into the cache, whatever the install built
native.library()
print("loaded")
"""


@needs_compiler
def test_a_cached_library_cut_short_is_built_again_not_loaded(tmp_path: Path) -> None:
    """Regression: a library built on first use was renamed into place without an fsync and loaded after checking
    only its owner and mode: cut short (a crash before the disk had it, an interrupted copy of the cache), it
    killed every process that loaded it with SIGBUS. Now its sha256, recorded beside it, is checked first: it is
    built again, with a warning. (In subprocesses: a regression kills the process.)"""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TIERKV_CACHE_DIR": str(tmp_path / "cache")}

    def load() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=300)

    first = load()
    assert first.returncode == 0 and "loaded" in first.stdout, first.stderr
    (library,) = (tmp_path / "cache" / "native").glob("tierkv_io-*.so")
    assert library.with_name(library.name + ".sum").exists()
    os.truncate(library, 1000)
    again = load()
    assert again.returncode == 0 and "loaded" in again.stdout, (again.returncode, again.stderr)
    assert "is not the file that was built" in again.stderr
    assert library.stat().st_size > 1000


def _hanging_compiler(monkeypatch, tmp_path: Path, script: str) -> Path:
    """``CC`` set to a shell ``script`` that hangs, stopped after 2 s (a warning after 0.5 s); nothing built at
    install: the native engine builds on first use."""
    from tierkv import cbuild

    monkeypatch.setattr(cbuild, "SLOW_COMPILE_S", 0.5)
    monkeypatch.setattr(cbuild, "COMPILE_TIMEOUT_S", 2)
    compiler = tmp_path / "cc"
    compiler.write_text(f"#!/bin/sh\n{script}\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setattr(native, "extension", lambda: None)
    return compiler


@needs_compiler
def test_a_hung_compiler_is_stopped_with_its_children(fresh_loader: None, monkeypatch, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A compiler that hangs (a ccache or distcc waiting for a server that is gone) is stopped after
    ``COMPILE_TIMEOUT_S`` with the processes it started, after a warning that says what the first use waits for;
    the engine is unavailable with the reason. A build's temporary that a killed process left is removed by the
    next build once it is older than any build runs."""
    import os
    import time

    from tierkv import cbuild

    child = tmp_path / "child.pid"
    _hanging_compiler(monkeypatch, tmp_path, f"sleep 60 &\necho $! > {child}\nwait")
    folder = tmp_path / "cache" / "native"
    folder.mkdir(parents=True, mode=0o700)
    stale, fresh = folder / ".tierkv_io-0.so.0123456789ab.tmp", folder / ".tierkv_io-1.so.0123456789ab.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"x")
        path.chmod(0o600)
    os.utime(stale, (time.time() - 2 * cbuild.STALE_TEMPORARY_S,) * 2)
    with caplog.at_level(logging.WARNING, logger="tierkv"), pytest.raises(EngineUnavailableError):
        native.library()
    assert "is taking more than" in caplog.text
    pid = int(child.read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the compiler's child still runs")
    assert not stale.exists() and fresh.exists()


@needs_compiler
def test_a_compiler_that_timed_out_is_not_run_again_for_a_while(fresh_loader: None, monkeypatch,
                                                                tmp_path: Path) -> None:
    """Regression: a compiler that timed out was run again for every library a process opened (the disk engine
    and three kernels: four timeouts in a row) and by every new process. Now a marker in the cache folder, named
    by the compiler command, keeps this process and the next ones from running it for ``TIMED_OUT_RETRY_S``: they
    are refused at once, naming the marker; another compiler command is tried at once; an expired marker goes."""
    import os
    import subprocess
    import sys
    import time

    from tierkv import cbuild

    runs = tmp_path / "runs"
    compiler = _hanging_compiler(monkeypatch, tmp_path, f"echo run >> {runs}\nexec sleep 60")
    with pytest.raises(EngineUnavailableError, match="failed"):
        native.library()
    assert runs.read_text().count("run") == 1
    (marker,) = (tmp_path / "cache" / "native").glob("timed-out-*")

    native._build.cache_clear()  # the next library this process opens
    started = time.monotonic()
    with pytest.raises(EngineUnavailableError, match="is not run again") as refused:
        native.library()
    assert str(marker) in str(refused.value) and time.monotonic() - started < 1
    env = {**os.environ, "TIERKV_CACHE_DIR": str(tmp_path / "cache")}  # a new process: refused at once too
    other = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=60)
    assert other.returncode != 0 and "is not run again" in other.stderr, other.stderr[-2000:]
    assert runs.read_text().count("run") == 1

    monkeypatch.setenv("CC", f"{compiler} -O2")  # another command: tried
    native._build.cache_clear()
    with pytest.raises(EngineUnavailableError, match="failed"):
        native.library()
    assert runs.read_text().count("run") == 2

    monkeypatch.setenv("CC", str(compiler))
    old = time.time() - cbuild.TIMED_OUT_RETRY_S - 1
    os.utime(marker, (old, old))  # expired: removed, and the compiler run again
    native._build.cache_clear()
    with pytest.raises(EngineUnavailableError, match="failed"):
        native.library()
    assert runs.read_text().count("run") == 3


@needs_compiler
def test_a_compiler_that_builds_nothing_puts_nothing_in_the_cache(fresh_loader: None, monkeypatch,
                                                                  tmp_path: Path) -> None:
    """Regression: a compiler that exits 0 without building (``CC=/bin/true``) left an empty library in the cache
    under the name every later build looks for, and every process after failed to load it ("file too short"), a
    working compiler too. Now the build is refused, naming the compiler, and nothing is cached: the next one
    builds."""
    monkeypatch.setattr(native, "extension", lambda: None)
    monkeypatch.setenv("CC", shutil.which("true") or "/bin/true")
    with pytest.raises(EngineUnavailableError, match="exited 0 but built no shared library") as refused:
        native.library()
    assert "its output is empty" in str(refused.value)
    assert list((tmp_path / "cache" / "native").glob("tierkv_io-*.so")) == []
    monkeypatch.delenv("CC")
    native._build.cache_clear()
    native.library()


@needs_compiler
def test_a_cached_library_that_does_not_load_is_removed_and_built_again(tmp_path: Path) -> None:
    """Regression: a cached library the loader refuses though its checksum matches (the empty file an earlier
    version cached for a compiler that built nothing, with that file's sum beside it) failed every process that
    opened it, for good. Now it is removed, with a warning, and built again."""
    import hashlib
    import os
    import subprocess
    import sys

    env = {**os.environ, "TIERKV_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("CC", None)

    def load() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=300)

    first = load()
    assert first.returncode == 0 and "loaded" in first.stdout, first.stderr
    (library,) = (tmp_path / "cache" / "native").glob("tierkv_io-*.so")
    library.write_bytes(b"")
    library.with_name(library.name + ".sum").write_text(hashlib.sha256(b"").hexdigest())
    again = load()
    assert again.returncode == 0 and "loaded" in again.stdout, again.stderr
    assert "does not load" in again.stderr and "building it again" in again.stderr
    assert library.stat().st_size > 0


@needs_compiler
def test_another_compiler_builds_its_own_library(fresh_loader: None, monkeypatch, tmp_path: Path) -> None:
    """The cache name covers ``CC``: a library one compiler built is not taken for another's (a broken one's
    output never shadows a working one's)."""
    monkeypatch.setattr(native, "extension", lambda: None)
    monkeypatch.setenv("CC", "cc")
    native.library()
    monkeypatch.setenv("CC", "cc -O0")
    native._build.cache_clear()
    native.library()
    assert len(list((tmp_path / "cache" / "native").glob("tierkv_io-*.so"))) == 2


def test_a_cache_dir_on_a_noexec_mount_names_the_fix(fresh_loader: None, monkeypatch, tmp_path: Path) -> None:
    """A cache dir on a filesystem mounted ``noexec`` failed with the loader's "failed to map segment from shared
    object" after a build. Now it is refused before any build, naming the mount option and the setting to
    change."""
    monkeypatch.setattr(native, "extension", lambda: None)
    with (mounted(tmp_path / "noexec", "tmpfs", "noexec,size=16m,mode=0700") as mount,
          settings.override(cache_dir=mount),
          pytest.raises(EngineUnavailableError, match="mounted noexec") as refused):
        native.library()
    assert "Set TIERKV_CACHE_DIR to a directory on a filesystem mounted without noexec" in str(refused.value)


@needs_compiler
def test_a_full_tmpdir_names_the_space_to_free(fresh_loader: None, monkeypatch, tmp_path: Path) -> None:
    """A full ``TMPDIR`` during a build said only "compiling tierkv_io.c failed: compilation terminated." (the
    compiler's last line). Now it says the compiler ran out of space, and where to free it."""
    monkeypatch.setattr(native, "extension", lambda: None)
    with tiny_tmpfs(tmp_path / "tmp", "64k") as full:
        (full / "filler").write_bytes(b"\0" * 60 * 1024)  # what is left is less than a compiler's output
        monkeypatch.setenv("TMPDIR", str(full))
        with pytest.raises(EngineUnavailableError, match="no space left for the compiler's files") as refused:
            native.library()
    assert f"Free space in {full}" in str(refused.value) and "set TMPDIR" in str(refused.value)
