"""The manifest: which block records of a persistent directory are complete, and how recently each was used.

A block file counts only once the manifest lists it. The manifest is one checksummed record
(:mod:`tierkv.persist.record`, ``kind: "manifest"``, the JSON listing as payload) replaced atomically —
written to a fresh temporary file, fsynced, ``os.replace``d over the old one, the directory fsynced — so a
reader sees the old listing or the new one, never a torn one, even after a SIGKILL or a power cut.

The listing is input like any file on a shared disk: every key must be a block key (lowercase hex of
:data:`~tierkv.persist.keys.KEY_BYTES` bytes — it becomes a file name) and every number an integer in range,
or the whole manifest is refused (:class:`~tierkv.errors.IntegrityError`) and the store starts empty. So
the writer lists nothing the reader would refuse: a new entry is checked by the same rule (:func:`entry`)
before it is listed, and a listing holds at most :data:`MAX_ENTRIES` blocks, which bounds the file (and so
each read of it) by :data:`MAX_BYTES`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from tierkv import safefs
from tierkv.errors import IntegrityError
from tierkv.inputs import parse_json
from tierkv.persist import record
from tierkv.persist.keys import KEY_BYTES

FORMAT = 1
NAME = "manifest"
MAX_ENTRIES = 1 << 20  # listed blocks: the store evicts beyond it (each costs a few hundred bytes once parsed)
ENTRY_BYTES = 96  # the longest entry written: '"<32 hex>":[<13 digits>,<19 digits>,<19 digits>],' is 91 bytes
MAX_BYTES = MAX_ENTRIES * ENTRY_BYTES + (64 << 10)  # about 96 MiB; a larger file is not a manifest tierkv wrote
MAX_RECORD_BYTES = 1 << 40  # a listed record's size: larger is a corrupt or crafted listing
MAX_COUNT = 1 << 62  # a clock tick or a depth
KEY = re.compile(rf"^[0-9a-f]{{{2 * KEY_BYTES}}}$")


@dataclass(slots=True)
class Entry:
    """One listed block: its file's size, the clock tick of its last use (LRU), its depth in its chain."""

    nbytes: int
    last_used: int
    depth: int


@dataclass(slots=True)
class Manifest:
    """Listed blocks by key; ``clock`` is a logical time that advances with every change (never wall time,
    so processes with skewed clocks still agree on the order)."""

    entries: dict[str, Entry] = field(default_factory=dict)
    clock: int = 0

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries.values())

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def victims(self) -> list[str]:
        """Keys in eviction order: least recently used first; among blocks used together (a prefix loaded
        or written at once) the deepest first, since a chain is only usable up to its first missing block."""
        return sorted(self.entries, key=lambda key: (self.entries[key].last_used, -self.entries[key].depth))


def load(path: Path) -> Manifest:
    """The manifest at ``path`` (``<directory>/tierkv-persist/manifest``; empty if there is none): :func:`load_at`."""
    with safefs.directory(path.parent) as directory:
        return load_at(directory, str(path))


def load_at(directory: int, what: str) -> Manifest:
    """The manifest in ``directory`` (a descriptor; empty if there is none); ``what`` names it in errors.
    IntegrityError if it exists but is not a regular file, or does not verify, or lists a key or a number
    out of range."""
    try:
        with safefs.opened(directory, NAME, what) as fd:
            data = safefs.read_whole(fd, what, MAX_BYTES)
    except FileNotFoundError:
        return Manifest()
    header, payload = record.decode(data, what=what)
    record.check_format(header, "manifest", FORMAT, what)
    try:
        listing = parse_json(bytes(payload))
    except (ValueError, RecursionError) as error:  # RecursionError: nested past the parser's stack
        raise IntegrityError(f"{what}: unreadable manifest listing ({str(error)[:200]}).") from None
    if not isinstance(listing, dict) or not isinstance(listing.get("blocks"), dict):
        raise IntegrityError(f"{what}: field 'blocks' is not an object.")
    clock = _count(listing.get("clock"), what, "clock")
    if len(listing["blocks"]) > MAX_ENTRIES:
        raise IntegrityError(f"{what}: lists {len(listing['blocks'])} blocks, more than the {MAX_ENTRIES} tierkv "
                             "keeps.")
    entries = {key: entry(key, values, clock, what) for key, values in listing["blocks"].items()}
    return Manifest(entries, clock)


def entry(key: str, values: object, clock: int, what: str) -> Entry:
    """The listed block ``key`` of ``values`` ``[nbytes, last_used, depth]``; IntegrityError unless ``key`` is a
    block key and each number an integer in range (``last_used`` up to ``clock``). The one rule of the reader
    and of the writer (:meth:`tierkv.persist.blockfile.PersistentStore.put`)."""
    if not isinstance(key, str) or not KEY.match(key):
        raise IntegrityError(f"{what}: field 'blocks' lists {str(key)[:80]!r}, not a block key ({2 * KEY_BYTES} "
                             "lowercase hex digits).")
    if not isinstance(values, list) or len(values) != 3:
        raise IntegrityError(f"{what}: field 'blocks.{key}' is not [nbytes, last_used, depth].")
    return Entry(_count(values[0], what, f"blocks.{key}.nbytes", record.PREFIX_BYTES, MAX_RECORD_BYTES),
                 _count(values[1], what, f"blocks.{key}.last_used", 0, clock),
                 _count(values[2], what, f"blocks.{key}.depth"))


def _count(value: object, what: str, name: str, low: int = 0, high: int = MAX_COUNT) -> int:
    if type(value) is not int or not low <= value <= high:
        raise IntegrityError(f"{what}: field {name!r} is {str(value)[:40]!r}, not an integer in [{low}, {high}].")
    return value


def write(directory: int, manifest: Manifest) -> None:
    """Replace the manifest in ``directory`` (a descriptor) atomically: a fresh temporary file (``O_EXCL``,
    mode 0600), fsync, ``os.replace``, fsync of the directory (:func:`tierkv.safefs.replacing`)."""
    listing = {"clock": manifest.clock,
               "blocks": {key: [e.nbytes, e.last_used, e.depth] for key, e in manifest.entries.items()}}
    head, payload = record.encode({"kind": "manifest", "format": FORMAT},
                                  json.dumps(listing, separators=(",", ":")).encode())
    with safefs.replacing(directory, NAME) as fd:
        safefs.write_all(fd, (head, payload))
