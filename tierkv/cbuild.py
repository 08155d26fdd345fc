"""Native libraries that are plain C files loaded with ctypes: the extension ``setup.py`` built, else one built on
first use from the source checkout (FlashInfer-style), else unavailable with the reason.

Shared by the native disk engine (:mod:`tierkv.io.native`) and the attention kernels
(:mod:`tierkv.attention.host_kernel`, :mod:`tierkv.attention.rest_kernel`: :func:`open_kernel`), which differ only
in their source, flags and names. A library built on
first use lives in the ``cache_dir`` setting's ``native/`` folder under a name that carries a hash of source and
flags, written aside and renamed into place, so concurrent processes never load a half-written file. The
source's hash is compiled into every build, so an extension built from an older source is noticed and rebuilt.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import logging
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from tierkv import settings
from tierkv.io.base import EngineUnavailableError

logger = logging.getLogger("tierkv")


def cache_dir() -> Path:
    """Where libraries built on first use are kept (per user, survives restarts, safe to delete)."""
    return Path(settings.get("cache_dir")) / "native"


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.MULTILINE)


def source_bytes(source: Path) -> bytes:
    """``source`` followed by each header it includes from its own folder (``#include "name.h"``, in order): what a
    build of it compiles, so its hash changes with any of them (``setup.py`` hashes the same bytes)."""
    text = source.read_bytes()
    return text + b"".join((source.parent / name.decode()).read_bytes() for name in _LOCAL_INCLUDE.findall(text))


def source_digest(source: Path) -> str | None:
    """sha256 of :func:`source_bytes` (16 hex digits, as ``setup.py`` compiles it in); None without the source."""
    try:
        return hashlib.sha256(source_bytes(source)).hexdigest()[:16]
    except OSError:
        return None


def extension(package_dir: Path, stem: str) -> Path | None:
    """The library the install built (``package_dir/<stem><ABI suffix>``), if it did."""
    return next((p for s in importlib.machinery.EXTENSION_SUFFIXES if (p := package_dir / f"{stem}{s}").exists()),
                None)


def built_from(lib: ctypes.CDLL, symbol: str) -> str:
    """The source hash compiled into ``lib``, which returns it from the C function ``symbol`` ("" if it has none: a
    library from before the hash existed)."""
    try:
        function = getattr(lib, symbol)
    except AttributeError:
        return ""
    function.restype = ctypes.c_char_p
    return (function() or b"").decode()


def compile_library(source: Path, target: Path, flag_sets: Sequence[Sequence[str]], libraries: Sequence[str],
                    fix: str) -> None:
    """Compile ``source`` into ``target`` with the first of ``flag_sets`` that works; raise
    :class:`EngineUnavailableError` saying why not."""
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or "cc"]
    if shutil.which(compiler[0]) is None:
        raise EngineUnavailableError(f"no C compiler ({compiler[0]!r} not found)", fix)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        for flags in flag_sets:
            result = subprocess.run([*compiler, *flags, "-o", partial, str(source), *libraries], capture_output=True,
                                    text=True, timeout=120)  # fmt: skip
            if result.returncode == 0:
                os.replace(partial, target)
                return
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise EngineUnavailableError(f"compiling {source.name} failed: {tail[0]}", fix)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def open_library(label: str, source: Path, digest: str | None, built: Path | None,
                 built_from: Callable[[ctypes.CDLL], str], flag_sets: Sequence[Sequence[str]],
                 libraries: Sequence[str], fix: str, reinstall: str) -> ctypes.CDLL:
    """The extension ``built`` if it was built from ``digest``'s source, else a library built on first use from
    ``source``; raise :class:`EngineUnavailableError` (``fix``, or ``reinstall`` without a source). ``label``
    names the library in the log line that says which one loaded."""
    stale = ""
    if built is not None:
        try:
            lib = ctypes.CDLL(str(built))
        except OSError as exc:
            stale = f"the extension {built.name} does not load ({exc})"
        else:
            if digest is None or built_from(lib) == digest:
                logger.info("%s: the extension built at install (%s)", label, built)
                return lib
            stale = f"the extension {built.name} was built from an older {source.name}"
    if digest is None:
        raise EngineUnavailableError("not built at install (no C compiler then?) and no C source to build it from",
                                     reinstall)
    flags = " ".join(" ".join(f) for f in flag_sets).encode()
    target = cache_dir() / f"{source.stem}-{hashlib.sha256(source_bytes(source) + flags).hexdigest()[:16]}.so"
    try:
        if not target.exists():
            compile_library(source, target, flag_sets, libraries, fix)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        raise EngineUnavailableError(f"building or loading {target} failed ({exc})", fix) from exc
    logger.info("%s: built on first use into %s (%s)", label, target, stale or "no extension built at install")
    return lib


KERNEL_FLAG_SETS = (("-O3", "-shared", "-fPIC", "-fopenmp"), ("-O3", "-shared", "-fPIC"))
"""An attention kernel's flags: with OpenMP where the compiler has it, else single-threaded."""


def open_kernel(label: str, source: Path, digest: str | None, built: Path | None,
                built_from_: Callable[[ctypes.CDLL], str], fix: str,
                functions: dict[str, tuple[object, list | None]], args: tuple[str, int]) -> ctypes.CDLL:
    """An attention kernel opened by :func:`open_library` (OpenMP flags, libm; the other arguments as there), its
    ``functions`` (name -> restype, argtypes or None) declared and its argument struct's size checked (``args``: the
    C function that returns it, the size the Python side packs); raise :class:`EngineUnavailableError`."""
    lib = open_library(label, source, digest, built, built_from_, KERNEL_FLAG_SETS, ("-lm",), fix,
                       "Reinstall tierkv where a C compiler is available.")
    for name, (restype, argtypes) in functions.items():
        function = getattr(lib, name)
        function.restype = restype
        if argtypes is not None:
            function.argtypes = argtypes
    size_function, size = args
    if getattr(lib, size_function)() != size:
        raise EngineUnavailableError(f"{source.name}'s argument struct does not match the loader's", fix)
    return lib
