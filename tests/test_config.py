"""Size parsing: every accepted spelling, and errors that say how to write a size."""

import pytest

from tierkv.config import parse_size
from tierkv.errors import InvalidConfigError, TierKVError


@pytest.mark.parametrize(("value", "expected"), [
    (20, 20 * 10**9), (0.5, 5 * 10**8), ("512MB", 512 * 10**6), ("20GiB", 20 * 2**30), ("1.5 gb", 1_500_000_000),
    ("4096", 4096 * 10**9), ("64KiB", 65536), ("0", 0),
])
def test_parse_size(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["12 apples", "-1GB", -3, float("nan"), True, None, "GB"])
def test_parse_size_rejects(value):
    with pytest.raises(InvalidConfigError, match="gpu_gb") as info:
        parse_size(value, name="gpu_gb")
    assert isinstance(info.value, ValueError) and isinstance(info.value, TierKVError)
