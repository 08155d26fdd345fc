"""The files tierkv runs as code (its cached native libraries and their checksums) are opened only when nobody
but this user can write them: a library its group may write is someone else's code as much as an other-writable one."""

from __future__ import annotations

import os

import pytest

from tierkv import safefs
from tierkv.errors import DiskTierError


@pytest.mark.parametrize("mode", [0o620, 0o660, 0o602, 0o622])
def test_a_library_others_or_the_group_can_write_is_refused(tmp_path, mode):
    (tmp_path / "lib.so").write_bytes(b"\x7fELF")
    os.chmod(tmp_path / "lib.so", mode)
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(DiskTierError, match="lets others write it"):
            safefs.open_own_file(directory, "lib.so", tmp_path / "lib.so")
    finally:
        os.close(directory)


def test_a_library_only_this_user_can_write_opens(tmp_path):
    (tmp_path / "lib.so").write_bytes(b"\x7fELF")
    os.chmod(tmp_path / "lib.so", 0o700)
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = safefs.open_own_file(directory, "lib.so", tmp_path / "lib.so")
        try:
            assert os.read(fd, 4) == b"\x7fELF"
        finally:
            os.close(fd)
    finally:
        os.close(directory)
