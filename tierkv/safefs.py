"""Files and directories tierkv creates, handled so that nobody else's link, FIFO or directory is followed.

The rules (docs/reliability.md, "Security"):

- A directory tierkv makes inside a directory the user named (``tierkv-persist`` and its ``blocks``/``tmp``,
  the cache dir's ``models``) is opened with ``O_NOFOLLOW | O_DIRECTORY`` and checked with ``fstat``: owned by
  this user and writable by nobody else (OpenSSH's StrictModes). With the group-shared opt-in
  (``TIERKV_SHARED_GROUP=1``) it may belong to another member of its group, but is never writable by others.
  Everything below it is named relative to the directory's descriptor (``dir_fd=``), so a directory renamed
  or replaced after it was checked is never followed.
- A directory the user named is refused when another user could rename tierkv's files in it: when it belongs
  to another user (root aside), or its group, every user or a POSIX ACL entry of another user or group can write
  it and it lacks the sticky bit. With the group-shared opt-in it may belong to, and be writable by, a group of
  this process. So is one that is a symbolic link of another user (root aside), or whose path goes through a link
  that another user planted in a sticky directory every user can write (the rule of Linux's
  ``fs.protected_symlinks``): planted in /tmp, it would point tierkv at any directory of this user's.
- Files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a random name (a planted name fails, it is
  never opened) and ``fchmod``-ed to 0600 (0660 shared) whatever the umask; a file is replaced by renaming
  such a temporary file over it (a symlink in its place is replaced, not followed); its writer holds its
  ``flock`` until the rename, so the next write of that file removes the temporaries of writers that died
  (:func:`reap_temporaries`), never a live one's. A created file is opened again only through its descriptor
  (:func:`reopen`), never by name: a file renamed into its place is never opened.
- Files are opened for reading with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO opens without waiting for a writer)
  and refused unless ``fstat`` says they are regular; a read is bounded by that size.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path, PosixPath

from tierkv.errors import DiskTierError, IntegrityError

log = logging.getLogger("tierkv")

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
NOFOLLOW = _NOFOLLOW


def shared_group() -> bool:
    """The group-shared opt-in (setting ``shared_group``, ``TIERKV_SHARED_GROUP``)."""
    from tierkv import settings

    return bool(settings.get("shared_group"))


def file_mode(shared: bool | None = None) -> int:
    """Mode of the files tierkv creates: 0600, or 0660 with the group-shared opt-in."""
    return 0o660 if (shared_group() if shared is None else shared) else 0o600


def dir_mode(shared: bool | None = None) -> int:
    """Mode of the directories tierkv creates: 0700, or 2770 (setgid: new files keep the group) when shared."""
    return 0o2770 if (shared_group() if shared is None else shared) else 0o700


def refuse(path: str | os.PathLike, why: str, fix: str, code: int = errno.EPERM) -> DiskTierError:
    """The error for a path tierkv will not use: what it is, why that is unsafe, and what to do."""
    return DiskTierError(code, f"tierkv refuses {os.fspath(path)!r}: {why}. {fix}")


UNWRITABLE = "Name a directory you can write."


def open_user_directory(path: str | os.PathLike, unwritable: str = UNWRITABLE) -> int:
    """A descriptor of the directory the user named (links in *its* path are the user's choice and followed, but
    not one another user planted in a sticky directory: :func:`_check_planted_links`), made 0700 if tierkv
    creates it; refused when another user could rename or replace tierkv's files in it: one owned by another user
    (root aside), or one its group, every user or an ACL entry of another user or group can write without the
    sticky bit. The group-shared opt-in accepts a directory of a group of this process (owned or writable by it).
    One this user may not create or open is refused with ``unwritable`` as the fix."""
    path = Path(path)
    try:
        _check_planted_links(path)
        if not path.exists():
            _make_directories(path)
        seen = _check_link_owner(path)
        fd = os.open(path, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    except PermissionError as error:
        raise _denied(path, unwritable) from error
    try:
        status = os.fstat(fd)
        if seen is None or not stat.S_ISLNK(seen.st_mode) and \
                (seen.st_dev, seen.st_ino) != (status.st_dev, status.st_ino):
            raise refuse(path, "it was replaced while tierkv opened it (another user swapping a directory for a "
                         "link?)", "Name a directory only you can write, in a directory only you can write.",
                         errno.ELOOP)
        _check_user_directory(path, status)
        if not status.st_mode & stat.S_ISVTX:
            _check_acl(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _denied(path: str | os.PathLike, fix: str) -> DiskTierError:
    return refuse(path, "this user may not create or open it (permission denied)", fix, errno.EACCES)


def _make_directories(path: Path) -> None:
    """Create ``path`` and its missing parents, each with :func:`dir_mode` (0700: a parent that the umask left
    writable by every user would let another user replace what tierkv makes under it)."""
    missing = [path, *(parent for parent in path.parents if not parent.exists())]
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, dir_mode())


_MAX_LINKS = 40  # links the kernel follows in one path before it gives up (ELOOP)


def _check_planted_links(path: Path) -> None:
    """Refuse (:func:`refuse`) ``path`` if resolving it goes through a symbolic link in a sticky directory every
    user can write (/tmp) that neither this user nor that directory's owner owns: another user planted it, and can
    point it at any directory of this user's. Linux's ``fs.protected_symlinks`` refuses to follow such a link
    only where it is on; tierkv checks it itself. Links of this user's, or in other directories, are followed.
    Each component is looked at as the kernel resolves it (``..`` after a link goes up from its target); a missing
    one is taken for the directory tierkv will make there."""
    current = Path("/")  # the link-free directory resolved so far
    pending = list(reversed((path if path.is_absolute() else Path.cwd() / path).parts[1:]))  # the next one last
    links = 0
    while pending:
        name = pending.pop()
        if name == "..":
            current = current.parent
            continue
        entry = current / name
        try:
            status = os.lstat(entry)
        except OSError:  # missing (tierkv makes it, a directory) or unreachable (opening it fails): no link
            current = entry
            continue
        if not stat.S_ISLNK(status.st_mode):
            current = entry
            continue
        try:
            folder = os.stat(current)
        except OSError:
            return  # gone meanwhile: opening it says so
        shared = folder.st_mode & stat.S_ISVTX and folder.st_mode & stat.S_IWOTH
        if shared and status.st_uid not in (os.geteuid(), folder.st_uid):
            raise refuse(path, f"{str(entry)!r} is a symbolic link of another user (uid {status.st_uid}) "
                         f"in {str(current)!r}, a sticky directory every user can write, so that user can point it "
                         "at any directory of yours", "Remove the link and name a directory of your own, or name "
                         "the link's target itself if you trust it.", errno.ELOOP)
        links += 1
        try:
            target = os.readlink(entry)
        except OSError:
            return  # gone meanwhile: opening it says so
        if links > _MAX_LINKS:
            return  # a loop: opening it says so (ELOOP)
        parts = Path(target).parts
        if os.path.isabs(target):
            current, parts = Path("/"), parts[1:]
        pending.extend(reversed(parts))


def _check_link_owner(path: Path) -> os.stat_result | None:
    """Refuse (:func:`refuse`) ``path`` if it is a symbolic link another user owns (root aside): planted in a
    shared directory such as /tmp (before tierkv made the directory, or instead of it), it points tierkv at any
    directory of this user's. The kernel's ``fs.protected_symlinks`` refuses that only where it is on; in a
    sticky directory nobody else can replace a link of this user's, so the check holds until the open. Returns
    what is there (None: nothing), so that the open can check it opened that very directory."""
    try:
        status = os.lstat(path)
    except OSError:
        return None  # nothing there: the open says so
    if stat.S_ISLNK(status.st_mode) and status.st_uid not in (os.geteuid(), 0):
        raise refuse(path, f"it is a symbolic link of another user (uid {status.st_uid}), who can point it at any "
                     "directory of yours", "Remove the link and name a directory of your own (tierkv creates a "
                     "missing one 0700), or name the link's target itself if you trust it.", errno.ELOOP)
    return status


def _check_user_directory(path: Path, status: os.stat_result) -> None:
    """Refuse (:func:`refuse`) a directory of ``status`` in which another user could rename tierkv's files."""
    sticky = status.st_mode & stat.S_ISVTX
    group = shared_group() and status.st_gid in _groups()
    if status.st_mode & stat.S_IWOTH and not sticky:
        raise refuse(path, "every user can write it and it has no sticky bit, so another user could replace "
                     "tierkv's files in it", "Use a directory only you can write (chmod o-w), or set the "
                     "sticky bit as /tmp has (chmod +t).")
    if status.st_uid not in (os.geteuid(), 0) and not group:
        raise refuse(path, f"it belongs to another user (uid {status.st_uid}), who could rename or replace "
                     "tierkv's files in it", "Use a directory of your own (tierkv creates a missing one 0700, "
                     "e.g. a new name in /tmp); a directory shared by a group needs TIERKV_SHARED_GROUP=1 and a "
                     "directory of that group.")
    if status.st_mode & stat.S_IWGRP and not sticky and not group and not _private_group(status.st_gid):
        raise refuse(path, f"its group (gid {status.st_gid}) can write it and it has no sticky bit, so another "
                     "member could replace tierkv's files in it", "chmod g-w it or use a directory only you "
                     "can write; for a directory shared by that group, set TIERKV_SHARED_GROUP=1.")


_ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = 2
_ACL_USER, _ACL_GROUP, _ACL_MASK = 0x02, 0x08, 0x10  # tags of named users, named groups and the mask
_ACL_WRITE = 0x02


def _check_acl(path: Path, fd: int) -> None:
    """Refuse (:func:`refuse`) the directory ``fd`` if its POSIX ACL lets another user (root aside) or a named
    group write it: ``chmod`` bits show only the ACL's mask, so ``setfacl -m u:other:rwx`` leaves it looking
    private. A group of this process with the group-shared opt-in, or this user's private group, is this user's.
    No ACL, or a filesystem without them, is nothing to refuse."""
    fix = f"Remove the ACL (setfacl -b {str(path)!r}) or use a directory only you can write."
    try:
        acl = os.getxattr(fd, _ACL_XATTR)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return  # no ACL, or a filesystem without them
        raise refuse(path, f"its POSIX ACL cannot be read ({exc.strerror}), so it may let others write it",
                     fix) from None
    if len(acl) < 4 or (len(acl) - 4) % 8 or int.from_bytes(acl[:4], "little") != _ACL_VERSION:
        raise refuse(path, "it has a POSIX ACL tierkv cannot read, which may let others write it", fix)
    entries = [(int.from_bytes(acl[at:at + 2], "little"), int.from_bytes(acl[at + 2:at + 4], "little"),
                int.from_bytes(acl[at + 4:at + 8], "little")) for at in range(4, len(acl), 8)]
    mask = next((perm for tag, perm, _ in entries if tag == _ACL_MASK), _ACL_WRITE)
    groups = _groups() if shared_group() else set()
    for tag, perm, ident in entries:
        if not perm & mask & _ACL_WRITE:
            continue
        if tag == _ACL_USER and ident not in (os.geteuid(), 0):
            who = f"another user (uid {ident})"
        elif tag == _ACL_GROUP and ident not in groups and not _private_group(ident):
            who = f"the group gid {ident}"
        else:
            continue
        raise refuse(path, f"its POSIX ACL lets {who} write it and it has no sticky bit, so they could replace "
                     "tierkv's files in it (its mode shows only the ACL's mask)", fix)


def _private_group(gid: int) -> bool:
    """Whether this user is the only one in group ``gid``: a user private group, as Debian and Ubuntu give every
    user (their umask 002 makes a new directory group-writable, and no one else can write it)."""
    import grp
    import pwd

    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
        members = grp.getgrgid(gid).gr_mem
    except KeyError:
        return False
    return all(member == name for member in members) and \
        all(user.pw_uid == uid for user in pwd.getpwall() if user.pw_gid == gid)


def open_user_subdirectory(folder: Path, unwritable: str = UNWRITABLE) -> int:
    """A descriptor of ``folder``, tierkv's own private directory (0700, never group-shared) in the user's
    directory ``folder.parent``, both checked as :func:`open_user_directory` and :func:`open_own_directory` say;
    one this user may not create or open is refused with ``unwritable`` as the fix."""
    parent = open_user_directory(folder.parent, unwritable)
    try:
        return open_own_directory(parent, folder.name, folder, shared=False)
    except PermissionError as error:
        raise _denied(folder, unwritable) from error
    finally:
        os.close(parent)


def open_own_directory(parent: int, name: str, where: str | os.PathLike, create: bool = True,
                       shared: bool | None = None) -> int:
    """A descriptor of tierkv's directory ``name`` in the directory ``parent`` (a descriptor), created if
    missing; refused if it is a link or not a directory, if another user owns it (outside the group-shared
    opt-in), or if others can write it. A directory of this user with looser modes is tightened. ``shared``
    None: as the group-shared opt-in says (a directory that can be shared); False: private whatever it says."""
    hint = ("; a store shared by a group needs TIERKV_SHARED_GROUP=1 and a directory of that group" if shared is None
            else " (tierkv makes it again)")
    shared = shared_group() if shared is None else shared
    mode = dir_mode(shared)
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, mode, dir_fd=parent)
    try:
        fd = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise refuse(where, "it is a symbolic link or not a directory (tierkv never follows a link in its own "
                         "tree: another user may have planted it)", "Remove it, and use a directory only you can "
                         "write.", exc.errno) from exc
        raise
    try:
        status = os.fstat(fd)
        mine = status.st_uid == os.geteuid()
        if not mine and not (shared and status.st_gid in _groups()):
            raise refuse(where, f"it belongs to another user (uid {status.st_uid}), who could change what tierkv "
                         "reads and deletes there", f"Remove it (or ask its owner to), or use a directory of "
                         f"your own{hint}.")
        if not mine and status.st_mode & stat.S_IWOTH:  # a group's directory: never one every user can write
            raise refuse(where, f"mode {stat.S_IMODE(status.st_mode):o} lets others write it", "chmod o-w it, or "
                         "remove it.")
        if mine and stat.S_IMODE(status.st_mode) != mode:
            os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


def create_file(directory: int, prefix: str, suffix: str = "", shared: bool | None = None) -> tuple[int, str]:
    """``(fd, name)``: a new, empty, regular file opened read/write in ``directory`` (a descriptor) under a
    random name (``O_EXCL``: nothing planted is ever opened), mode 0600 (0660 shared) whatever the umask."""
    mode = file_mode(shared)
    for _ in range(100):
        name = f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode, dir_fd=directory)
        except FileExistsError:
            continue
        try:
            os.fchmod(fd, mode)
        except BaseException:
            _discard(directory, fd, name)
            raise
        return fd, name
    raise FileExistsError(errno.EEXIST, f"no free temporary name {prefix}*{suffix}")


def _discard(directory: int, fd: int, name: str) -> None:
    """Close and remove a file just created whose setup failed (the caller raises its error)."""
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=directory)


_FD_DIRECTORY = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"


def fd_path(fd: int) -> str:
    """A name of the file the descriptor ``fd`` is open on, wherever it was renamed to (``/proc/self/fd/N``:
    opening it opens that file, not whatever a path now names)."""
    return f"{_FD_DIRECTORY}/{fd}"


def check_same_file(created: int, opened: int, where: str | os.PathLike) -> None:
    """Refuse (:func:`refuse`) unless the descriptors ``created`` and ``opened`` are open on one file."""
    a, b = os.fstat(created), os.fstat(opened)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        raise refuse(where, "opened again, it is not the file tierkv created (another file took its place)",
                     "Use a directory only you can write.", errno.ESTALE)


def reopen(fd: int, flags: int, where: str | os.PathLike) -> int:
    """A new descriptor with ``flags`` (``O_DIRECT``, say) on the file ``fd`` is open on, through :func:`fd_path`
    (never by name: a file another user renamed into its place is not opened) and checked to be that file."""
    opened = os.open(fd_path(fd), flags | _CLOEXEC)
    try:
        check_same_file(fd, opened, where)
    except BaseException:
        os.close(opened)
        raise
    return opened


class CreatedPath(PosixPath):
    """The path of a file tierkv created, with ``fd``, the descriptor it was created through (open while its
    creator holds it): the disk engines open the file from ``fd`` (:func:`reopen`), never by this name. A path
    derived from it (``parent``, ``/``) has no descriptor (``fd`` None)."""

    fd: int | None = None

    @classmethod
    def of(cls, path: str | os.PathLike, fd: int) -> CreatedPath:
        """``path``, created through ``fd``."""
        created = cls(path)
        created.fd = fd
        return created


def open_path(path: str | os.PathLike, flags: int) -> int:
    """``path`` opened with ``flags``: from its descriptor if tierkv created it (:class:`CreatedPath`, checked to
    be that file), else by name, a symbolic link there refused (ELOOP)."""
    if isinstance(path, CreatedPath) and path.fd is not None:
        return reopen(path.fd, flags, path)
    return os.open(path, flags | _NOFOLLOW | _CLOEXEC)


def open_own_file(directory: int, name: str, where: str | os.PathLike) -> int:
    """A read-only descriptor of ``name`` in ``directory`` (a descriptor), never through a link: refused
    (:func:`refuse`) unless it is a regular file of this user that nobody else can write (what tierkv runs as
    code). FileNotFoundError if it is not there."""
    try:
        fd = open_regular(directory, name, os.fspath(where))
    except IntegrityError as exc:
        what = "a symbolic link (tierkv never follows a link in its own tree: another user may have planted it)" \
            if exc.errno == errno.ELOOP else "not a regular file"
        raise refuse(where, f"it is {what}", "Remove it.", exc.errno or errno.EINVAL) from exc
    try:
        status = os.fstat(fd)
        if status.st_uid != os.geteuid():
            raise refuse(where, f"it belongs to another user (uid {status.st_uid}), who could have planted it",
                         "Remove it (tierkv builds it again).")
        if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise refuse(where, f"mode {stat.S_IMODE(status.st_mode):o} lets others write it", "Remove it "
                         "(tierkv builds it again).")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(directory: int | None, name: str | os.PathLike, what: str, flags: int = os.O_RDONLY,
                 follow: bool = False, mode: int = 0o600) -> int:
    """Open ``name`` (in ``directory``, a descriptor, or None: a path) without following a link (unless
    ``follow``) or waiting for a FIFO's writer; IntegrityError unless it is a regular file. ``mode``: of a
    file ``flags`` create (``os.O_CREAT``)."""
    try:
        fd = os.open(name, flags | _NONBLOCK | _CLOEXEC | (0 if follow else _NOFOLLOW), mode, dir_fd=directory)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise IntegrityError(errno.ELOOP, f"{what}: a symbolic link where tierkv keeps a file; refused (tierkv "
                                 "never follows one).") from None
        raise
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise IntegrityError(errno.EINVAL, f"{what}: not a regular file (mode {status.st_mode:o}: a FIFO, device "
                                 "or directory); refused, never read.")
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_whole(fd: int, what: str, limit: int) -> bytearray:
    """The whole regular file ``fd``: its ``fstat`` size, refused above ``limit`` before anything is allocated."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise IntegrityError(errno.EFBIG, f"{what}: {size} bytes, more than the {limit} such a file can hold.")
    data = bytearray(size)
    view, done = memoryview(data), 0
    while done < size:
        got = os.readv(fd, [view[done:]])
        if got == 0:
            raise IntegrityError(errno.EIO, f"{what}: ended after {done} of {size} bytes (truncated meanwhile).")
        done += got
    return data


def write_all(fd: int, chunks: Iterable[bytes | memoryview]) -> None:
    """Write every byte of ``chunks`` to ``fd`` (a short write goes on where it stopped)."""
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view.nbytes:
            view = view[os.write(fd, view):]


def fsync_directory(fd: int) -> None:
    """Make renames and unlinks in the directory ``fd`` durable."""
    os.fsync(fd)


_TEMPORARY_TAIL = re.compile(r"[0-9a-f]{12}\.tmp")  # what create_file's random part and ".tmp" make
_TEMPORARY_EXTRA = len(".") + len(".") + 12 + len(".tmp")  # bytes a temporary adds to its file's name
_DIGEST_HEX = 16  # hex digits of the digest that tells apart the temporaries of long names cut alike


def temporary_prefix(directory: int, name: str) -> str:
    """What the names of ``name``'s temporaries in ``directory`` start with, before :func:`create_file`'s 12 random
    hex digits and ``.tmp``: ``.<name>.``, or, where that would make a temporary longer than the filesystem's
    NAME_MAX, ``.<name cut short>.<digest of name>-`` — so every name the filesystem takes can be written. The
    ``-`` before the random part keeps the two forms apart: no temporary of one name is ever taken for another's."""
    longest = _longest_name(directory)
    if len(os.fsencode(name)) + _TEMPORARY_EXTRA <= longest:
        return f".{name}."
    budget = longest - _TEMPORARY_EXTRA - _DIGEST_HEX - len("-")
    cut = name
    while len(os.fsencode(cut)) > budget:
        cut = cut[:-1]
    return f".{cut}.{hashlib.blake2b(os.fsencode(name), digest_size=_DIGEST_HEX // 2).hexdigest()}-"


def _longest_name(directory: int) -> int:
    """The longest file name, in bytes, the filesystem of ``directory`` (a descriptor) takes (255 if it won't say)."""
    try:
        return os.fpathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def new_temporary(directory: int, name: str, shared: bool | None = None) -> tuple[int, str]:
    """``(fd, temporary)``: a fresh temporary file for a new version of ``name`` in ``directory``, exclusively
    ``flock``-ed before a byte is written; keep ``fd`` open until the temporary is renamed or removed. First
    removes the temporaries of ``name`` that writers killed mid-write left behind (:func:`reap_temporaries`),
    so a ``save()`` killed again and again does not fill the disk with copies. Its name fits NAME_MAX whenever
    ``name`` does (:func:`temporary_prefix`)."""
    reap_temporaries(directory, name)
    fd, temporary = create_file(directory, temporary_prefix(directory, name), ".tmp", shared)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a new file nobody else has locked: never waits
    except BaseException:
        _discard(directory, fd, temporary)
        raise
    return fd, temporary


def reap_temporaries(directory: int, name: str) -> int:
    """Remove the temporaries of ``name`` in ``directory`` (:func:`temporary_prefix`, 12 hex, ``.tmp``), and only
    its, whose writer died (SIGKILL, a crash, a power cut) and return how many. A writer (:func:`new_temporary`)
    holds its temporary's ``flock`` from before its first byte until after the rename, and the kernel drops it when
    the writer dies, so a temporary that is not empty and can be locked is abandoned; a live writer's (locked, or
    still empty) is left alone, and so is anything that is not this user's regular file."""
    prefix = temporary_prefix(directory, name)
    try:
        with os.scandir(directory) as entries:
            candidates = [entry.name for entry in entries
                          if entry.name.startswith(prefix) and _TEMPORARY_TAIL.fullmatch(entry.name[len(prefix):])]
    except OSError:  # a directory that can be written but not listed (mode -wx): nothing to reap from here
        return 0
    removed = 0
    for candidate in candidates:
        try:
            fd = os.open(candidate, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=directory)
        except OSError:  # gone meanwhile (renamed into place, reaped by another process), or a link
            continue
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode) or not is_ours(status) or status.st_size == 0:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its writer lives
            here = os.stat(candidate, dir_fd=directory, follow_symlinks=False)
            if (here.st_dev, here.st_ino) == (status.st_dev, status.st_ino):
                os.unlink(candidate, dir_fd=directory)
                removed += 1
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def replacing(directory: int, name: str, shared: bool | None = None) -> Iterator[int]:
    """Write a new version of ``name`` in ``directory`` (a descriptor): yields the descriptor of a fresh
    temporary file (:func:`new_temporary`); on success it is fsynced and renamed over ``name`` (whatever is there,
    a link too, is replaced, never followed), and the directory fsynced; on failure it is removed and ``name`` is
    untouched. The descriptor (and its lock) is closed only after the rename, so no reaper takes it before."""
    fd, temporary = new_temporary(directory, name, shared)
    try:
        try:
            yield fd
            os.fsync(fd)
            os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=directory)
        raise
    fsync_directory(directory)


SPECIAL_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                 (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


def kind_of(mode: int) -> str:
    """What a non-regular file of ``mode`` is, in words ("a FIFO", "a character device" ...)."""
    return next((kind for special, kind in SPECIAL_KINDS if special(mode)), "not a regular file")


def replace_problem(directory: int | None, name: str | os.PathLike) -> tuple[int, str] | None:
    """Why a new file must not be renamed over ``name`` (in ``directory``, a descriptor, or None: a path): a
    directory, FIFO, device or socket is there, or a link to one (``/dev/stdout``, ``/dev/null``) — replacing it
    would destroy what other programs use; or another user's entry in a sticky directory (:func:`foreign_in_sticky`),
    which the rename would fail on. ``(errno, phrase)``, or None where nothing, a regular file, a link to one or a
    dangling link is there (a link is replaced, never followed)."""
    try:
        status = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except OSError:
        return None
    if foreign_in_sticky(directory, name, status):
        return errno.EPERM, ("belongs to another user in a sticky directory (as /tmp is), where tierkv may not "
                             "replace it")
    if stat.S_ISLNK(status.st_mode):
        try:
            status = os.stat(name, dir_fd=directory)  # what the link names, if anything
        except OSError:
            return None
    if stat.S_ISREG(status.st_mode):
        return None
    code = errno.EISDIR if stat.S_ISDIR(status.st_mode) else errno.EEXIST
    return code, f"is {kind_of(status.st_mode)}, which tierkv does not replace with a file"


def foreign_in_sticky(directory: int | None, name: str | os.PathLike, status: os.stat_result) -> bool:
    """Whether the entry ``name`` (``status``: its ``lstat``) in ``directory`` (a descriptor, or None: ``name`` is a
    path) is one this process may not rename over: its folder is sticky (/tmp's 1777), and this user owns neither
    the entry nor the folder (root may)."""
    user = os.geteuid()
    if user == 0 or status.st_uid == user:
        return False
    try:
        folder = os.stat(directory) if directory is not None else os.stat(os.path.dirname(os.fspath(name)) or ".")
    except OSError:
        return False
    return bool(folder.st_mode & stat.S_ISVTX) and folder.st_uid != user


def write_file(path: str | os.PathLike, chunks: Iterable[bytes | memoryview], shared: bool | None = None) -> None:
    """Replace the file ``path`` atomically with ``chunks`` (mode 0600; :func:`replacing`); refused (DiskTierError)
    where :func:`replace_problem` finds a device, FIFO, socket or directory there."""
    path = Path(path)
    with directory(path.parent) as parent:
        write_at(parent, path.name, chunks, path, shared)


def write_at(folder: int, name: str, chunks: Iterable[bytes | memoryview], where: str | os.PathLike,
             shared: bool | None = None) -> None:
    """:func:`write_file` of ``name`` in ``folder`` (a descriptor; ``where``: its path, for errors)."""
    problem = replace_problem(folder, name)
    if problem is not None:
        fix = "Choose a path of your own." if problem[0] == errno.EPERM else "Give the path of a regular file."
        raise refuse(where, problem[1], fix, problem[0])
    with replacing(folder, name, shared) as fd:
        write_all(fd, chunks)


@contextlib.contextmanager
def scratch_file(directory: str | os.PathLike, prefix: str, size: int) -> Iterator[CreatedPath]:
    """A new file of ``size`` bytes (a hole) in the user's ``directory`` (created 0700 if missing; refused as
    :func:`open_user_directory` refuses), created ``O_EXCL`` at mode 0600 under a random name: a name planted in
    a shared directory such as /tmp is never opened. Its descriptor stays open for the block (a
    :class:`CreatedPath`: the disk engines open the file from it, not by name). Removed after the block."""
    fd_dir = open_user_directory(directory)
    try:
        fd, name = create_file(fd_dir, prefix, ".bin", shared=False)
        try:
            try:
                os.ftruncate(fd, size)
                yield CreatedPath.of(Path(directory) / name, fd)
            finally:
                os.close(fd)
        finally:
            remove_regular(fd_dir, name)
    finally:
        os.close(fd_dir)


def is_regular_here(directory: int, name: str) -> os.stat_result | None:
    """``lstat`` of ``name`` in ``directory`` if it is a regular file (not a link), else None."""
    try:
        status = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except OSError:
        return None
    return status if stat.S_ISREG(status.st_mode) else None


@contextlib.contextmanager
def opened(directory: int, name: str, what: str) -> Iterator[int]:
    """:func:`open_regular` (read-only) for the block (closed after it)."""
    fd = open_regular(directory, name, what)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def directory(path: str | os.PathLike) -> Iterator[int]:
    """A descriptor of the directory ``path`` (the user's: links in its path are followed) for the block."""
    fd = os.open(path, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def directory_at(parent: int, name: str) -> Iterator[int]:
    """A descriptor of the directory ``name`` in ``parent`` for the block, never through a link (ELOOP)."""
    fd = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=parent)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def own_directory(parent: int, name: str, where: str | os.PathLike, create: bool = True) -> Iterator[int]:
    """:func:`open_own_directory` for the block (closed after it)."""
    fd = open_own_directory(parent, name, where, create)
    try:
        yield fd
    finally:
        os.close(fd)


def remove_tree(parent: int, name: str) -> bool:
    """Remove tierkv's directory ``name`` in ``parent`` holding only files: its regular files are unlinked,
    then the directory; a link or any other entry in it is left (and so is the directory). True if it went."""
    try:
        with directory_at(parent, name) as fd:
            for entry in os.listdir(fd):
                remove_regular(fd, entry)
        os.rmdir(name, dir_fd=parent)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("tierkv: left %s in place (%s): it holds something tierkv did not create", name,
                    exc.strerror or exc)
        return False
    return True


def is_ours(status: os.stat_result) -> bool:
    """Whether tierkv may remove a file of this ``stat``: this user's, or, with the group-shared opt-in, its
    group's (a store shared by a group evicts every member's blocks)."""
    return status.st_uid == os.geteuid() or (shared_group() and status.st_gid in _groups())


def remove_regular(directory: int, name: str) -> bool:
    """Unlink ``name`` in ``directory`` only if it is a regular file tierkv may remove (:func:`is_ours`): True if
    it was removed. A link, FIFO, device, directory or another user's file there is left alone. A file that cannot
    be looked at (the directory lost its search permission) raises the ``OSError``, as a failed unlink does: the
    caller's cleanup logs it and retries, never takes it for a file already gone."""
    try:
        status = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(status.st_mode) or not is_ours(status):
        return False
    try:
        os.unlink(name, dir_fd=directory)
    except FileNotFoundError:
        return False
    return True
