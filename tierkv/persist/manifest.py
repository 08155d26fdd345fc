"""The manifest: which block records of a persistent directory are complete, and how recently each was used.

A block file counts only once the manifest lists it. The manifest is one checksummed record
(:mod:`tierkv.persist.record`, ``kind: "manifest"``, the JSON listing as payload) replaced atomically —
written to a temporary file, fsynced, ``os.replace``d over the old one, the directory fsynced — so a
reader sees the old listing or the new one, never a torn one, even after a SIGKILL or a power cut.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.atomic import deferred_interrupts
from tierkv.errors import IntegrityError
from tierkv.persist import record

FORMAT = 1


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
    """The manifest at ``path`` (empty if there is none). IntegrityError if it exists but does not verify."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return Manifest()
    header, payload = record.decode(data, what=str(path))
    if header.get("kind") != "manifest" or header.get("format") != FORMAT:
        raise IntegrityError(f"{path}: not a tierkv manifest of format {FORMAT} ({header}).")
    try:
        listing = json.loads(bytes(payload))
        entries = {str(key): Entry(*(int(v) for v in values)) for key, values in listing["blocks"].items()}
        return Manifest(entries, int(listing["clock"]))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise IntegrityError(f"{path}: unreadable manifest listing ({error!r}).") from None


def write(path: Path, manifest: Manifest) -> None:
    """Replace the manifest at ``path`` atomically (temporary file, fsync, ``os.replace``, fsync of the
    directory). The caller holds the directory's exclusive lock, so one temporary name is enough."""
    listing = {"clock": manifest.clock,
               "blocks": {key: [e.nbytes, e.last_used, e.depth] for key, e in manifest.entries.items()}}
    head, payload = record.encode({"kind": "manifest", "format": FORMAT},
                                  json.dumps(listing, separators=(",", ":")).encode())
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as f:
        f.write(head)
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fsync_directory(path.parent)


def fsync_directory(path: Path) -> None:
    """Make renames and unlinks in ``path`` durable."""
    with deferred_interrupts():  # one fsync: no Ctrl-C between the open and the close of the descriptor
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
