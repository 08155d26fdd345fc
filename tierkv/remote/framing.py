"""The bytes of one remote value: a small header with a checksum over the key and the payload.

A value read back from a shared server is trusted only after this check, so a torn or overwritten value,
one written by another format version, or one stored under the wrong key is a miss, never wrong KV::

    offset  size  field
    0       4     magic  b"TKR1" (tierkv remote, format 1)
    4       8     payload length, little-endian
    12      8     xxh3-64 of (key, payload), little-endian
    20      n     payload (the block's serialized bytes, opaque here)

The key is part of the checksum because a content-addressed store must also catch a value that is intact
but belongs to another block.
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"TKR1"
HEADER = struct.Struct("<4sQQ")


def _digest(key: bytes, payload: bytes | bytearray | memoryview) -> int:
    hasher = xxhash.xxh3_64(key)
    hasher.update(payload)
    return hasher.intdigest()


def frame(key: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    """The value stored under ``key``: header + ``payload``."""
    return HEADER.pack(MAGIC, len(payload), _digest(key, payload)) + payload


def unframe(key: bytes, value: bytes) -> memoryview | None:
    """The payload of ``value`` if it is intact and belongs to ``key``, else None (a view: no copy)."""
    if len(value) < HEADER.size:
        return None
    magic, length, digest = HEADER.unpack_from(value)
    payload = memoryview(value)[HEADER.size:]
    if magic != MAGIC or length != len(payload) or digest != _digest(key, payload):
        return None
    return payload
