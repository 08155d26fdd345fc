"""What another user of the machine can plant in, or around, a ``disk_dir``: names with tierkv's patterns in a
shared sticky directory, a POSIX ACL that lets her write the user's directory, a link above the directory.
Each is planted with real files owned by another uid (root gives them to her), never simulated."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import pytest

from tierkv import safefs
from tierkv.errors import DiskTierError
from tierkv.tiers import disk as disk_module
from tierkv.tiers import lease
from tierkv.tiers.disk import DiskTier

OTHER_UID = 1002  # another user of the machine (mallory), who plants files and links
THIRD_UID = 1003  # yet another user
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a planted file another owner")
HUGE = "99999999999999999999"  # more digits than any pid (beyond a C long, which psutil.pid_exists takes)


def _plant(directory: Path, name: str, uid: int = OTHER_UID) -> Path:
    """An empty file ``name`` in ``directory`` owned by ``uid``."""
    path = directory / name
    path.touch()
    os.chown(path, uid, uid)
    return path


def _open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# ------------------------------------------------------------------------- names planted in a shared disk_dir
@needs_root
def test_another_users_names_in_a_shared_disk_dir_are_skipped_unread(public_tmp, monkeypatch) -> None:
    """Another user's files with tierkv's names (a pid no process can have, a lock, a pending lock) are skipped
    after one ``lstat``: no pid is looked up and nothing is opened for them, and they stay; the tier opens."""
    planted = [_plant(public_tmp, f"tierkv-{HUGE}-ab-x.kv"), _plant(public_tmp, "tierkv-4000000-ab-x.kv"),
               _plant(public_tmp, "tierkv-4000001-ab.lock"), _plant(public_tmp, ".tierkv-0123456789ab.tmp")]
    looked_up: list[object] = []
    opened: list[str] = []
    open_regular = safefs.open_regular
    monkeypatch.setattr(lease.psutil, "pid_exists", lambda pid: looked_up.append(pid) or False)
    monkeypatch.setattr(lease.safefs, "open_regular",
                        lambda directory, name, what: opened.append(name) or open_regular(directory, name, what))
    DiskTier(public_tmp, budget=1 << 20).close()
    assert looked_up == [] and [name for name in opened if name.startswith(("tierkv-", ".tierkv-"))] == []
    assert all(path.exists() for path in planted)


def test_a_file_of_ours_whose_pid_no_process_can_have_is_reclaimed(tmp_path) -> None:
    """A ``.kv`` file of this user named with a pid beyond any pid (out of pid_t's range) is a dead process's:
    removed when a tier opens the directory (it raised OverflowError from ``DiskTier``)."""
    left = tmp_path / f"tierkv-{HUGE}-ab-x.kv"
    left.touch()
    DiskTier(tmp_path, budget=1 << 20).close()
    assert not left.exists()


def test_the_directory_descriptor_is_closed_whatever_fails_while_the_tier_opens(tmp_path, monkeypatch) -> None:
    """An error that is no ``OSError`` while the tier opens (here from reclaiming) leaves no descriptor open."""
    def fail(directory: int, where: Path) -> list[Path]:
        raise ValueError("reclaiming failed")

    monkeypatch.setattr(disk_module, "reclaim_dead", fail)
    before = _open_descriptors()
    with pytest.raises(ValueError, match="reclaiming failed"):
        DiskTier(tmp_path, budget=1 << 20)
    assert _open_descriptors() == before


# --------------------------------------------------------------------------- a POSIX ACL on the user's dir
def _set_acl(path: Path, *entries: tuple[int, int, int]) -> None:
    """Give ``path`` the POSIX ACL ``entries`` (tag, permissions, id), in the kernel's xattr format (which takes
    them in the order of their tags)."""
    ordered = sorted(entries, key=lambda entry: (entry[0], entry[2]))
    acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in ordered)
    try:
        os.setxattr(path, "system.posix_acl_access", acl)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            pytest.skip("this filesystem has no POSIX ACLs")
        raise


ANY = 0xFFFFFFFF  # the id of entries that name no one
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20


@pytest.mark.parametrize("named", [(USER, OTHER_UID), (GROUP, OTHER_UID)])
def test_a_disk_dir_whose_acl_lets_another_user_write_is_refused(tmp_path, named) -> None:
    """A directory of this user's, 0700 but with an ACL entry giving another user (or a group of hers) rwx, shows
    as 0770 (the mask) and was taken as private; it is refused with the fix, and nothing is made in it. The same
    entry without write, or with the mask taking write away, is accepted."""
    where = tmp_path / "kv"
    where.mkdir(mode=0o700)
    tag, ident = named
    _set_acl(where, (USER_OBJ, 7, ANY), (tag, 7, ident), (GROUP_OBJ, 0, ANY), (MASK, 7, ANY), (OTHER, 0, ANY))
    with pytest.raises(DiskTierError, match=r"POSIX ACL lets .*write it") as refused:
        DiskTier(where, budget=1 << 20)
    assert "setfacl -b" in str(refused.value) and list(where.iterdir()) == []
    _set_acl(where, (USER_OBJ, 7, ANY), (tag, 7, ident), (GROUP_OBJ, 0, ANY), (MASK, 5, ANY), (OTHER, 0, ANY))
    DiskTier(where, budget=1 << 20).close()
    _set_acl(where, (USER_OBJ, 7, ANY), (tag, 5, ident), (GROUP_OBJ, 0, ANY), (MASK, 7, ANY), (OTHER, 0, ANY))
    DiskTier(where, budget=1 << 20).close()


def test_an_acl_entry_for_this_user_alone_is_accepted(tmp_path) -> None:
    """An ACL that names only this user is no one else's write."""
    where = tmp_path / "kv"
    where.mkdir(mode=0o700)
    _set_acl(where, (USER_OBJ, 7, ANY), (USER, 7, os.geteuid()), (GROUP_OBJ, 0, ANY), (MASK, 7, ANY),
             (OTHER, 0, ANY))
    DiskTier(where, budget=1 << 20).close()


@pytest.mark.parametrize(("code", "refused"), [(errno.EACCES, True), (errno.EIO, True), (errno.EINVAL, False),
                                               (errno.ENOSYS, False)])
def test_an_acl_that_cannot_be_read_is_refused_and_a_filesystem_without_acls_is_not(tmp_path, monkeypatch, code,
                                                                                    refused) -> None:
    """Where reading the ACL fails (some FUSE and container filesystems), the directory is refused with the reason
    unless the error says the filesystem has no ACLs."""
    where = tmp_path / "kv"
    where.mkdir(mode=0o700)

    def failing(*args: object, **kwargs: object) -> bytes:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(safefs.os, "getxattr", failing)
    if refused:
        with pytest.raises(DiskTierError, match="its POSIX ACL cannot be read"):
            DiskTier(where, budget=1 << 20)
    else:
        DiskTier(where, budget=1 << 20).close()


# ------------------------------------------------------------------------------- a link above the disk_dir
@needs_root
def test_a_link_another_user_planted_above_the_disk_dir_is_refused(public_tmp, tmp_path) -> None:
    """``disk_dir=/tmp/team/kv`` where another user made ``/tmp/team`` a link to a directory of this user's: it
    went into that directory. Refused naming the link, through a second link too, and nothing made there; a link
    of this user's, or of the sticky directory's owner, or in a directory not every user can write, is
    followed (the rule of Linux's fs.protected_symlinks)."""
    target = tmp_path / "mine"
    target.mkdir(mode=0o700)
    link = public_tmp / "team"
    link.symlink_to(target)
    os.lchown(link, OTHER_UID, OTHER_UID)
    hop = public_tmp / "hop"
    hop.symlink_to("team")  # this user's link to hers
    for disk_dir in (link / "kv", hop / "kv", public_tmp / "x" / ".." / "team" / "kv"):
        with pytest.raises(DiskTierError, match=r"'.*/team' is a symbolic link of another user "
                           rf"\(uid {OTHER_UID}\)"):
            DiskTier(disk_dir, budget=1 << 20)
    assert list(target.iterdir()) == []
    os.lchown(link, os.geteuid(), os.getegid())  # this user's own link: followed
    DiskTier(link / "kv", budget=1 << 20).close()
    os.chown(public_tmp, THIRD_UID, THIRD_UID)
    os.lchown(link, THIRD_UID, THIRD_UID)  # the sticky directory's owner's link: followed
    DiskTier(link / "kv", budget=1 << 20).close()
    os.lchown(link, OTHER_UID, OTHER_UID)
    public_tmp.chmod(0o755)  # not a directory every user can write: the link is its owner's choice
    DiskTier(link / "kv", budget=1 << 20).close()
