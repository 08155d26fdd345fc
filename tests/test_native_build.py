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
from helpers import ROOT, build_ext

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
