"""A disk bounce buffer grows geometrically with the reads and writes it stages, but never past its limit
(``BOUNCE_BYTES`` by default) unless one request alone is larger: host memory counted in no budget stays bounded."""

from __future__ import annotations

from tierkv.tiers.disk import BOUNCE_BYTES, BounceBuffer

MiB = 2**20


def test_growth_stops_at_the_limit_given():
    buffer = BounceBuffer()
    try:
        assert buffer.get(3 * MiB, 4 * MiB).nbytes == 3 * MiB
        assert buffer.nbytes == 3 * MiB
        view = buffer.get(3 * MiB + 4096, 4 * MiB)  # doubling would take 6 MiB
        assert view.nbytes == 3 * MiB + 4096 and buffer.nbytes == 4 * MiB
        buffer.get(5 * MiB, 4 * MiB)  # one request larger than the limit: exactly its size
        assert buffer.nbytes == 5 * MiB
    finally:
        buffer.release()
    assert buffer.nbytes == 0


def test_growth_stops_at_bounce_bytes_by_default():
    buffer = BounceBuffer()
    try:
        buffer.get(BOUNCE_BYTES // 2 + MiB)
        buffer.get(BOUNCE_BYTES // 2 + 2 * MiB)  # doubling would pass BOUNCE_BYTES
        assert buffer.nbytes == BOUNCE_BYTES
    finally:
        buffer.release()
