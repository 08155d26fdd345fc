"""Errors of the disk tier and of tierkv's file writes name the real problem and its fix: file names up to the
filesystem's NAME_MAX, no inode left, a read-only or immutable filesystem, a failed read, hugetlbfs."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import mounted, tiny_tmpfs

from tierkv import safefs
from tierkv.errors import DiskFullError, DiskTierError, InvalidConfigError
from tierkv.io import aligned_empty
from tierkv.layout import SlotBytes
from tierkv.persist import conversation
from tierkv.tiers.base import Scratch
from tierkv.tiers.disk import BounceBuffer, DiskTier

SLOT = 4096


def _longest(folder: Path) -> int:
    return os.pathconf(folder, "PC_NAME_MAX")


@pytest.mark.parametrize("extra", [0, 1, 18])
def test_names_up_to_name_max_are_written(tmp_path: Path, extra: int) -> None:
    """A file name the filesystem takes can be written atomically, however close to NAME_MAX: its temporary
    must fit too."""
    name = "n" * (_longest(tmp_path) - extra)
    safefs.write_file(tmp_path / name, [b"data"])
    assert (tmp_path / name).read_bytes() == b"data"
    assert os.listdir(tmp_path) == [name]


def test_conversation_saves_to_a_name_of_name_max_bytes(tmp_path: Path) -> None:
    """save() to a legal name of NAME_MAX bytes writes it (nothing refused or left behind)."""
    path = tmp_path / ("c" * (_longest(tmp_path) - 4) + ".tkv")
    conversation.save(path, [(b"head", memoryview(b"payload"))])
    assert path.read_bytes() == b"headpayload" and os.listdir(tmp_path) == [path.name]


def _abandoned_temporary(directory: int, name: str) -> str:
    """A temporary of ``name`` whose writer died: not empty, its lock released."""
    fd, temporary = safefs.new_temporary(directory, name)
    os.write(fd, b"x")
    os.close(fd)
    return temporary


def test_reaping_takes_only_the_temporaries_of_its_own_long_name(tmp_path: Path) -> None:
    """Long names cut to the same start keep their temporaries apart: reaping one's leaves the other's, and a
    short name's, alone."""
    longest = _longest(tmp_path)
    first, second = "a" * longest, "a" * (longest - 1) + "b"
    short = "a" * 20
    with safefs.directory(tmp_path) as directory:
        others = {_abandoned_temporary(directory, second), _abandoned_temporary(directory, short)}
        mine = _abandoned_temporary(directory, first)
        assert all(len(os.fsencode(n)) <= longest for n in {mine, *others})
        assert safefs.reap_temporaries(directory, first) == 1
    assert set(os.listdir(tmp_path)) == others


def test_no_inode_left_when_the_cache_is_built_says_so(tmp_path: Path) -> None:
    """A disk_dir with free space but no free inode is refused naming inodes, not as "not writable"."""
    with tiny_tmpfs(tmp_path / "inodes", "4m", inodes=3) as mount:
        for name in ("a", "b"):  # the root and these two: every inode taken
            (mount / name).touch()
        with pytest.raises(DiskFullError, match="no inodes left.*remove files there"):
            DiskTier(mount, 2**20)


@contextlib.contextmanager
def _immutable(path: Path) -> Iterator[None]:
    """``path`` made immutable (``chattr +i``; root, on a filesystem that has it) for the block, mutable after."""
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("cannot make a file immutable here (needs root and a filesystem with chattr)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


def _spill(tier: DiskTier) -> int:
    """Write one block to the tier as a spill does (growing its file first if it must); its slot."""
    slot = tier.alloc(SLOT)
    assert slot is not None
    tier.write_from(SlotBytes(SLOT), np.array([slot]), torch.zeros(1, SLOT, dtype=torch.uint8), Scratch(BounceBuffer))
    return slot


def test_a_write_into_an_immutable_file_names_the_fix(tmp_path: Path) -> None:
    """A tier file made immutable: the write's error says so and how to undo it, not "check the drive"."""
    tier = DiskTier(tmp_path / "disk", 2**22)
    try:
        _spill(tier)
        with _immutable(tier.files[SLOT].path), \
                pytest.raises(DiskTierError, match="read-only or immutable.*chattr -i") as info:
            _spill(tier)
        assert info.value.errno == errno.EPERM and "check the drive" not in str(info.value)
    finally:
        tier.close()


@pytest.fixture
def ext4(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A fresh 8 MiB ext4 image loop-mounted with errors=remount-ro: ``(mount point, loop device name)``;
    unmounted at the end. Skips where it cannot be made (not root, no mkfs.ext4)."""
    image, mount = tmp_path / "fs.img", tmp_path / "ext4"
    with open(image, "wb") as file:
        file.truncate(8 << 20)
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True).returncode \
            or subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(mount)],
                              capture_output=True).returncode:  # fmt: skip
        pytest.skip("cannot loop-mount an ext4 image here (needs root and mkfs.ext4)")
    try:
        source = subprocess.run(["findmnt", "-no", "SOURCE", str(mount)], capture_output=True, text=True).stdout
        yield mount, Path(source.strip()).name
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_write_after_a_read_only_remount_names_the_fix(ext4: tuple[Path, str]) -> None:
    """ext4 remounted read-only by a filesystem error under a live tier: the write's error says the filesystem was
    made read-only and how to get it back, not "check the drive"."""
    mount, device = ext4
    trigger = Path(f"/sys/fs/ext4/{device}/trigger_fs_error")
    if not trigger.exists():
        pytest.skip("this kernel cannot be made to report an ext4 error")
    tier = DiskTier(mount, 2**22)
    try:
        _spill(tier)
        trigger.write_text("test\n")
        with pytest.raises(DiskTierError, match="read-only or immutable.*read-write mount") as info:
            _spill(tier)
        assert info.value.errno == errno.EROFS and "check the drive" not in str(info.value)
    finally:
        tier.close()


EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32): every later I/O on the filesystem fails with EIO
EXT4_GOING_FLAGS_NOLOGFLUSH = 2


def test_a_failed_read_does_not_claim_the_blocks_are_intact(ext4: tuple[Path, str]) -> None:
    """EIO reading blocks back (the filesystem shut down under the tier): the error says what is known (nothing
    of the read was used; whether the blocks can be read is unknown), not that they are intact."""
    mount, _ = ext4
    tier = DiskTier(mount, 2**22)
    try:
        slot = _spill(tier)
        descriptor = os.open(mount, os.O_RDONLY)
        try:
            fcntl.ioctl(descriptor, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
        except OSError:
            pytest.skip("this kernel cannot shut an ext4 filesystem down")
        finally:
            os.close(descriptor)
        buffer = aligned_empty(SLOT)
        with pytest.raises(DiskTierError) as info:
            tier.wait(tier.read(SLOT, np.array([slot]), buffer)[0], SLOT)
        message = str(info.value)
        assert info.value.errno == errno.EIO and "intact" not in message
        assert "Nothing of that read was used" in message and "dmesg" in message
    finally:
        tier.close()


def test_saving_onto_a_read_only_filesystem_says_it_is_read_only(tmp_path: Path) -> None:
    """save() onto a read-only mount is refused before the work, saying the filesystem is read-only (not that
    the folder is missing)."""
    with mounted(tmp_path / "ro", "tmpfs", "size=1m") as mount:
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, capture_output=True)
        with pytest.raises(DiskTierError, match="mounted read-only: save to a writable filesystem") as info:
            conversation.check_target(mount / "chat.tkv")
        assert info.value.errno == errno.EROFS and "makedirs" not in str(info.value)


def test_a_disk_dir_that_refuses_writes_is_refused_when_the_cache_is_built(tmp_path: Path) -> None:
    """hugetlbfs makes files but refuses write(2): refused at build, naming the filesystem, not at the first
    spill as "Invalid argument ... check the drive"."""
    with mounted(tmp_path / "huge", "hugetlbfs") as mount:
        with pytest.raises(InvalidConfigError, match="refuses to write them.*hugetlbfs"):
            DiskTier(mount, 2**22)
        assert not [entry for entry in os.listdir(mount) if entry.endswith(".kv")]  # the probe is removed
