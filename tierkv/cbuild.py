"""Native libraries that are plain C files loaded with ctypes: the extension ``setup.py`` built, else one built on
first use from the source checkout (FlashInfer-style), else unavailable with the reason.

Shared by the native disk engine (:mod:`tierkv.io.native`) and the attention kernels
(:mod:`tierkv.attention.host_kernel`, :mod:`tierkv.attention.rest_kernel`: :func:`open_kernel`), which differ only
in their source, flags and names. A library built on
first use lives in the ``cache_dir`` setting's ``native/`` folder under a name that carries a hash of source,
flags and ``CC`` (another compiler builds its own), written aside, fsynced and renamed into place, so concurrent
processes never load a half-written file, with its sha256 beside it (``<name>.sum``), checked before every load: a
file cut short (a crash before the disk had it, an interrupted copy of the cache) killed the process that mapped it
(SIGBUS); now it is built again. A build whose output is no shared library for this machine is never put in place,
and a cached library the loader refuses is removed and built again once. The
source's hash is compiled into every build, so an extension built from an older source is noticed and rebuilt.
A compiler that hangs is stopped with its children after :data:`COMPILE_TIMEOUT_S` (a warning says what it
waits for), and is not run again for :data:`TIMED_OUT_RETRY_S` by this or any other process of the user (a marker
in the cache folder, named by the compiler command: another ``CC`` is tried at once); a build's temporary file that
a killed process left behind is removed by the next build.

A library in the cache is code this process runs, and its name is computable from the public source, so it is
loaded only from a ``native/`` that is this user's own (not a link, nobody else can write it, in a cache dir
another user cannot rename it in: :mod:`tierkv.safefs`), and only if the file is this user's, not a link, and
writable by nobody else. It is checked through one descriptor and loaded through that descriptor
(``/proc/self/fd/N``), so what was checked is what is loaded. A refusal is an :class:`EngineUnavailableError`
that names the path, the problem and the fix (never a fallback to loading it).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.machinery
import logging
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

from tierkv import safefs, settings
from tierkv.errors import DiskTierError
from tierkv.io.base import EngineUnavailableError

logger = logging.getLogger("tierkv")

COMPILE_TIMEOUT_S = 120
"""The longest one compiler run may take (a ccache or distcc waiting for a server that is gone hangs)."""
SLOW_COMPILE_S = 10  # past this a build says what the first use waits for
STALE_TEMPORARY_S = 2 * COMPILE_TIMEOUT_S  # a build's temporary this old belongs to no running build
TIMED_OUT_RETRY_S = 3600
"""How long a compiler command that timed out is not run again (each library a process opens would wait for it
once more, and every new process too)."""
_TEMPORARY = re.compile(r"\..+\.so\.[0-9a-f]{12}\.tmp")


def cache_dir() -> Path:
    """Where libraries built on first use are kept (per user, survives restarts, safe to delete)."""
    return Path(settings.get("cache_dir")) / "native"


def _open_cache_dir() -> int:
    """A descriptor of :func:`cache_dir`, created 0700 if missing; refused (DiskTierError) unless it is this
    user's own, not a link, writable by nobody else, in a cache dir no other user could rename it in."""
    return safefs.open_user_subdirectory(cache_dir(), settings.UNWRITABLE_CACHE_DIR)


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


def compile_library(source: Path, directory: int, name: str, flag_sets: Sequence[Sequence[str]],
                    libraries: Sequence[str], fix: str) -> None:
    """Compile ``source`` into ``name`` in the cache folder ``directory`` (a descriptor of :func:`cache_dir`), made
    0700, with the first of ``flag_sets`` that works; raise :class:`EngineUnavailableError` saying why not. What a
    compiler leaves that is no shared library for this machine (``CC=/bin/true`` exits 0 and leaves nothing) never
    goes into the cache: every later process would fail to load it."""
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or "cc"]
    if shutil.which(compiler[0]) is None:
        raise EngineUnavailableError(f"no C compiler ({compiler[0]!r} not found)", fix)
    marker = _timed_out_marker(compiler)
    since = _timed_out_since(directory, marker)
    if since is not None:
        raise EngineUnavailableError(
            f"not building {source.name}: the compiler {shlex.join(compiler)!r} did not finish within "
            f"{COMPILE_TIMEOUT_S} s {since:.0f} s ago, and is not run again for {TIMED_OUT_RETRY_S} s (delete "
            f"{cache_dir() / marker} to try it now)", fix)
    _remove_stale_temporaries(directory)
    fd, partial = safefs.create_file(directory, f".{name}.", ".tmp", shared=False)
    os.close(fd)
    try:
        for flags in flag_sets:
            try:
                returncode, output = _compile([*compiler, *flags, "-o", str(cache_dir() / partial), str(source),
                                               *libraries], source.name)  # fmt: skip
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError), safefs.replacing(directory, marker, shared=False):
                    pass  # its time is its mtime
                raise
            if returncode == 0:
                built = os.open(partial, os.O_RDONLY | safefs.NOFOLLOW, dir_fd=directory)
                try:
                    problem = _not_a_library(built)
                    if problem:
                        raise EngineUnavailableError(f"the compiler {shlex.join(compiler)!r} exited 0 but built no "
                                                     f"shared library of {source.name} for this machine ({problem})",
                                                     fix)
                    os.fchmod(built, 0o700)  # the linker's own mode follows the umask (group-writable at 002)
                    os.fsync(built)
                    digest = _sha256(built)
                finally:
                    os.close(built)
                with safefs.replacing(directory, f"{name}.sum", shared=False) as sums:  # first: a library in place
                    safefs.write_all(sums, [digest.encode()])  # always has its sum (fsynced, with the folder)
                os.replace(partial, name, src_dir_fd=directory, dst_dir_fd=directory)
                return
        raise _compile_failed(source, output, fix)
    finally:
        safefs.remove_regular(directory, partial)


_NO_SPACE = ("No space left on device", "Disk quota exceeded")


def _compile_failed(source: Path, output: str, fix: str) -> EngineUnavailableError:
    """The error for a compiler run that failed with ``output``: its first line that names an error (the last one,
    "compilation terminated.", says nothing), and where the compiler ran out of space, where to free it."""
    lines = output.strip().splitlines() or ["no output"]
    line = next((x for x in lines if "error" in x.lower() or any(s in x for s in _NO_SPACE)), lines[-1]).strip()
    if any(s in output for s in _NO_SPACE):
        return EngineUnavailableError(
            f"compiling {source.name} failed: no space left for the compiler's files ({line})",
            f"Free space in {os.environ.get('TMPDIR') or '/tmp'} (its temporary files; or set TMPDIR to a "
            f"directory with room) and in {cache_dir()} (the library it builds)")
    return EngineUnavailableError(f"compiling {source.name} failed: {line}", fix)


def _compile(command: list[str], what: str) -> tuple[int, str]:
    """Run one compiler ``command`` in its own process group: ``(returncode, output)``. Past
    :data:`SLOW_COMPILE_S` a warning says what the first use waits for; past :data:`COMPILE_TIMEOUT_S` the group is
    killed (a wrapper's children too) and TimeoutExpired raised."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        try:
            output, _ = process.communicate(timeout=SLOW_COMPILE_S)
        except subprocess.TimeoutExpired:
            logger.warning("tierkv: compiling %s (first use: %s) is taking more than %d s; it is stopped after %d s "
                           "(set CC to a compiler that works, or install tierkv where one did)", what, command[0],
                           SLOW_COMPILE_S, COMPILE_TIMEOUT_S)
            output, _ = process.communicate(timeout=COMPILE_TIMEOUT_S - SLOW_COMPILE_S)
    except BaseException:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    return process.returncode, output or ""


def _timed_out_marker(compiler: Sequence[str]) -> str:
    """The cache folder's file that says ``compiler`` (the command) timed out, named by the command's hash."""
    return f"timed-out-{hashlib.sha256(shlex.join(compiler).encode()).hexdigest()[:16]}"


def _timed_out_since(directory: int, marker: str) -> float | None:
    """Seconds since the compiler of ``marker`` timed out, if less than :data:`TIMED_OUT_RETRY_S` ago (an older
    marker is removed)."""
    status = safefs.is_regular_here(directory, marker)
    if status is None or not safefs.is_ours(status):
        return None
    age = time.time() - status.st_mtime
    if 0 <= age < TIMED_OUT_RETRY_S:
        return age
    safefs.remove_regular(directory, marker)
    return None


_ELF_SHARED_OBJECT = 3  # e_type ET_DYN


def _not_a_library(fd: int) -> str | None:
    """Why the file behind ``fd`` is no shared library this process could load, from its ELF header (None: it may
    be one): empty, not ELF, not a shared object, or for another machine than this Python's."""
    header = os.pread(fd, 20, 0)
    if not header:
        return "its output is empty"
    if len(header) < 20 or header[:4] != b"\x7fELF":
        return "its output is not an ELF file"
    if int.from_bytes(header[16:18], "little" if header[5] == 1 else "big") != _ELF_SHARED_OBJECT:
        return "its output is not a shared object"
    own = _own_elf_header()
    if header[4:6] != own[4:6] or header[18:20] != own[18:20]:
        return "its output is for another machine (a cross compiler?)"
    return None


@cache
def _own_elf_header() -> bytes:
    """The ELF header of this process's executable: the class, byte order and machine a library must have."""
    with open("/proc/self/exe", "rb") as executable:
        return executable.read(20)


def _sha256(fd: int) -> str:
    """sha256 of the whole file behind ``fd`` (read with pread: its offset is left alone)."""
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _remove_stale_temporaries(directory: int) -> None:
    """Remove the temporaries of builds whose process was killed (older than any build runs)."""
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if _TEMPORARY.fullmatch(entry.name):
                with contextlib.suppress(OSError):
                    status = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(status.st_mode) and safefs.is_ours(status) and \
                            time.time() - status.st_mtime > STALE_TEMPORARY_S:  # fmt: skip
                        os.unlink(entry.name, dir_fd=directory)


class _Unloadable(OSError):
    """A cached library that the dynamic loader refused (empty, truncated, for another machine): removed."""


def _load_cached(directory: int, name: str, where: Path) -> ctypes.CDLL:
    """Load the library ``name`` of the cache folder ``directory`` through the descriptor it was checked on
    (:func:`tierkv.safefs.open_own_file`); FileNotFoundError if it is not there. The descriptor stays open while
    the process lives, as the library stays loaded: the dynamic loader knows a library by the name it was loaded
    under, so a ``/proc/self/fd/N`` name is never reused for another one. One the loader refuses is removed (it
    is this user's own regular file: checked on opening) and :class:`_Unloadable` raised, so it is built again
    rather than refused by every later process."""
    fd = safefs.open_own_file(directory, name, where)
    try:
        intact = _intact(directory, name, fd)
        if not intact:
            if intact is None:
                logger.info("tierkv: %s has no checksum recorded beside it; building it again", where)
            else:
                logger.warning("tierkv: %s is not the file that was built (cut short or changed since: a crash before "
                               "the disk had it, an interrupted copy); building it again", where)
            safefs.remove_regular(directory, name)
            raise FileNotFoundError(where)
        try:
            return ctypes.CDLL(safefs.fd_path(fd))
        except OSError as exc:
            safefs.remove_regular(directory, name)
            raise _Unloadable(str(exc)) from exc
    except BaseException:
        os.close(fd)
        raise


def _intact(directory: int, name: str, fd: int) -> bool | None:
    """Whether the library behind ``fd`` has the sha256 recorded beside it when it was built (None: none is)."""
    try:
        sums = safefs.open_own_file(directory, f"{name}.sum", cache_dir() / f"{name}.sum")
    except FileNotFoundError:
        return None
    try:
        recorded = os.pread(sums, 128, 0).decode("ascii", "replace").strip()
    finally:
        os.close(sums)
    return recorded == _sha256(fd)


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
    built_with = " ".join(" ".join(f) for f in flag_sets) + "\0" + os.environ.get("CC", "")
    name = f"{source.stem}-{hashlib.sha256(source_bytes(source) + built_with.encode()).hexdigest()[:16]}.so"
    target = cache_dir() / name
    try:
        directory = _open_cache_dir()
        try:
            if os.fstatvfs(directory).f_flag & os.ST_NOEXEC:
                raise EngineUnavailableError(
                    f"{label} cannot be built on first use: {cache_dir()} is on a filesystem mounted noexec, where "
                    "no library can be loaded", "Set TIERKV_CACHE_DIR to a directory on a filesystem mounted "
                    "without noexec.")
            try:
                lib = _load_cached(directory, name, target)
            except (FileNotFoundError, _Unloadable) as exc:
                if isinstance(exc, _Unloadable):
                    logger.warning("tierkv: %s does not load (%s); removed, building it again", target, exc)
                compile_library(source, directory, name, flag_sets, libraries, fix)
                lib = _load_cached(directory, name, target)
        finally:
            os.close(directory)
    except DiskTierError as exc:  # a folder or file another user could have planted: never loaded
        logger.warning("%s: %s", label, exc.strerror)
        raise EngineUnavailableError(f"{label} not loaded: {exc.strerror}".rstrip(".")) from exc
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
