"""``PersistentStore``: block records addressed by key in a directory that outlives processes.

::

    <directory>/tierkv-persist/
        lock                  flock: exclusive to change the listing or recover, shared to add a scratch area
        manifest              the listing (tierkv.persist.manifest), replaced atomically
        blocks/ab/abcd....tkv one record per key (tierkv.persist.record), immutable once listed
        tmp/<pid>-<tag>.lock  held (flock) by a live writer for its lifetime
        tmp/<pid>-<tag>/      that writer's records being written

Writing: a record is written and fsynced in the writer's own scratch area, then — under the exclusive
lock — renamed into ``blocks/`` and listed in a new manifest. A process killed at any point leaves at most
a scratch area whose owner lock nobody holds, renamed files the manifest does not list, or a stale
temporary manifest: the next store to open the directory removes all three (under the exclusive lock,
so no live writer is between rename and listing). Listed records are checked (size at open, checksum on
every read); one that does not verify is removed and reads as a miss — wrong bytes are never returned.

Reading needs no lock: the manifest is replaced atomically, and a record evicted by another process
after it was looked up reads as a miss. Eviction keeps the listed bytes under ``capacity_bytes``:
least recently used first (:meth:`~tierkv.persist.manifest.Manifest.victims`).

The store moves bytes only (no torch): callers encode and decode records.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tierkv.atomic import deferred_interrupts
from tierkv.errors import DiskTierError, IntegrityError, InvalidConfigError
from tierkv.persist import manifest as manifests
from tierkv.persist import record
from tierkv.persist.lock import OwnerLock, is_abandoned, locked
from tierkv.persist.manifest import Entry, Manifest

log = logging.getLogger("tierkv")

DIRECTORY_NAME = "tierkv-persist"
SUFFIX = ".tkv"


@dataclass(frozen=True, slots=True)
class Item:
    """A record to store under ``key``: write ``head`` then ``payload`` (from :func:`tierkv.persist.record.encode`)."""

    key: str
    depth: int
    head: bytes
    payload: bytes | memoryview


@dataclass(frozen=True, slots=True)
class Recovery:
    """What opening a directory cleaned up after processes that died."""

    scratch_areas: int = 0  # abandoned writers' scratch areas removed
    unlisted: int = 0  # block files no manifest listed (renamed, then killed before listing) removed
    torn: int = 0  # listed files of the wrong size removed
    missing: int = 0  # listed keys without a file dropped from the listing
    manifest_lost: bool = False  # the manifest did not verify: started empty


class PersistentStore:
    """Content-addressed, size-capped block records in ``directory``, shared safely by processes."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise InvalidConfigError(f"the persistent store's capacity must be a positive byte count, "
                                     f"got {capacity_bytes!r}.")
        self.capacity_bytes = capacity_bytes
        self.root = Path(directory) / DIRECTORY_NAME
        self._blocks, self._tmp = self.root / "blocks", self.root / "tmp"
        self._lock, self._manifest_path = self.root / "lock", self.root / "manifest"
        try:
            self._blocks.mkdir(parents=True, exist_ok=True)
            self._tmp.mkdir(exist_ok=True)
            with locked(self._lock, exclusive=True):
                self.recovery = self._recover()
            with locked(self._lock, exclusive=False):  # recovery (exclusive) never sees a half-made scratch area
                name = f"{os.getpid()}-{secrets.token_hex(4)}"
                self._scratch = self._tmp / name
                try:
                    with deferred_interrupts():  # the lock file and the finalizer that removes it, together
                        self._owner = OwnerLock(self._tmp / f"{name}.lock")  # a new file: its flock never waits
                        self._finalizer = weakref.finalize(self, _release, self._owner, self._scratch)
                    self._scratch.mkdir()
                except BaseException:  # an interrupt too: nothing of this store stays behind
                    if getattr(self, "_finalizer", None) is not None:
                        self._finalizer()
                    raise
        except OSError as error:
            raise DiskTierError(f"cannot open the persistent block directory {self.root}: {error}. Pass a "
                                "disk_dir on a writable filesystem.") from error
        self._mutex = threading.Lock()  # the cached manifest, between this process's threads
        self._cached: tuple[tuple[int, int, int], Manifest] | None = None

    # --------------------------------------------------------------------------------------- reading
    def __contains__(self, key: str) -> bool:
        return key in self._listing().entries

    def lookup(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are listed (a chain is usable up to its first miss)."""
        entries = self._listing().entries
        count = 0
        for key in keys:
            if key not in entries:
                break
            count += 1
        return count

    def get(self, keys: Sequence[str]) -> list[bytearray]:
        """The verified records of the leading ``keys`` that are listed and intact (stops at the first that is
        not; a record that fails its checksum is removed). Marks the returned ones as used."""
        entries = self._listing().entries
        found: list[bytearray] = []
        bad: list[str] = []
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                break
            data = self._read(key, entry)
            if data is None:
                bad.append(key)
                break
            found.append(data)
        if found or bad:
            self._update(touch=keys[: len(found)], remove=bad)
        return found

    def verify(self) -> list[str]:
        """Read and check every listed record; remove and return the keys of those that fail."""
        bad = [key for key, entry in self._listing().entries.items() if self._read(key, entry) is None]
        if bad:
            self._update(remove=bad)
        return bad

    def stats(self) -> dict[str, int]:
        listing = self._listing()
        return {"blocks": len(listing.entries), "bytes": listing.nbytes, "capacity_bytes": self.capacity_bytes}

    # --------------------------------------------------------------------------------------- writing
    def put(self, items: Sequence[Item], touch: Sequence[str] = ()) -> int:
        """Store the ``items`` not listed yet; return how many were added. The others, and ``touch`` (the keys
        of the chain the items extend), are marked as used. Records are fsynced before they are listed; the
        least recently used are evicted to make room — but never a block marked used by this call: a record
        that does not fit otherwise is dropped, with the deeper ones after it."""
        listed = self._listing().entries
        staged: list[tuple[Item, Path, int]] = []
        try:
            for item in items:
                if item.key in listed:
                    continue
                path = self._scratch / f"{item.key}{SUFFIX}"
                with open(path, "wb") as f:
                    f.write(item.head)
                    f.write(item.payload)
                    f.flush()
                    os.fsync(f.fileno())
                staged.append((item, path, len(item.head) + len(item.payload)))
            return self._update(touch=[*touch, *(item.key for item in items)], add=staged)
        except OSError as error:
            raise DiskTierError(f"writing persistent blocks under {self.root} failed: {error}. Free space there "
                                "or lower persist_gb.") from error
        finally:
            for _, path, _ in staged:
                path.unlink(missing_ok=True)  # only those that were not renamed into place remain

    def close(self) -> None:
        """Release this store's scratch area (listed records stay for the next process)."""
        self._finalizer()

    # ------------------------------------------------------------------------------------- internals
    def _path(self, key: str) -> Path:
        return self._blocks / key[:2] / f"{key}{SUFFIX}"

    def _read(self, key: str, entry: Entry) -> bytearray | None:
        """The record of ``key`` checked (size, checksum, key); None if it is gone or does not verify."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = bytearray(entry.nbytes)
                got = f.readinto(data)
                extra = f.read(1)
            if got != entry.nbytes or extra:
                raise IntegrityError(f"{path}: {got}{'+' if extra else ''} bytes, the manifest lists {entry.nbytes}.")
            header, _ = record.decode(data, what=str(path))
            if header.get("key") != key:
                raise IntegrityError(f"{path}: holds {header.get('key')}, not {key}.")
        except FileNotFoundError:  # evicted by another process since the listing was read
            return None
        except IntegrityError as error:
            log.warning("tierkv: persistent block dropped, it will be recomputed: %s", error)
            return None
        return data

    def _listing(self) -> Manifest:
        """The current manifest, re-read only when the file changed (it is replaced, never edited)."""
        try:
            status = os.stat(self._manifest_path)
        except FileNotFoundError:
            return Manifest()
        signature = (status.st_ino, status.st_mtime_ns, status.st_size)
        with self._mutex:
            if self._cached is not None and self._cached[0] == signature:
                return self._cached[1]
        try:
            listing = manifests.load(self._manifest_path)
        except IntegrityError as error:
            log.warning("tierkv: %s; persistent blocks are ignored until the next write repairs it", error)
            return Manifest()
        with self._mutex:
            self._cached = (signature, listing)
        return listing

    def _update(self, touch: Sequence[str] = (), remove: Sequence[str] = (),
                add: Sequence[tuple[Item, Path, int]] = ()) -> int:
        """One change of the listing under the exclusive lock: mark ``touch`` used, remove ``remove``, rename
        ``add``'s staged files into place (evicting to fit); then write the new manifest, and only then delete the
        files it no longer lists — so whatever stops it (a SIGKILL, a Ctrl-C), every listed block has its file
        (what is left unlisted is removed at the next open). Returns #added."""
        with locked(self._lock, exclusive=True):
            listing = self._load_for_update()
            tick = listing.tick()
            for key in touch:
                entry = listing.entries.get(key)
                if entry is not None:
                    entry.last_used = tick
            unlisted = [key for key in remove if listing.entries.pop(key, None) is not None]
            total = listing.nbytes
            victims = iter(listing.victims())
            added: list[str] = []
            for item, path, nbytes in add:
                if item.key in listing.entries:  # another process stored it meanwhile
                    continue
                while total + nbytes > self.capacity_bytes:
                    victim = next(victims, None)
                    if victim is None or listing.entries[victim].last_used == tick:
                        break  # what is left was used by this call (victims come oldest first)
                    total -= listing.entries.pop(victim).nbytes
                    unlisted.append(victim)
                if total + nbytes > self.capacity_bytes:
                    break  # deeper blocks of this batch are useless without this one
                target = self._path(item.key)
                target.parent.mkdir(exist_ok=True)
                os.replace(path, target)
                listing.entries[item.key] = Entry(nbytes, tick, item.depth)
                total += nbytes
                added.append(item.key)
            for parent in {self._path(key).parent for key in added}:
                manifests.fsync_directory(parent)
            manifests.write(self._manifest_path, listing)
            for key in unlisted:  # only once no manifest lists them (a listed block's file is always there)
                self._path(key).unlink(missing_ok=True)
            return len(added)

    def _load_for_update(self) -> Manifest:
        """The manifest as it is on disk now (under the exclusive lock); a copy, so the cached one stays."""
        try:
            return manifests.load(self._manifest_path)
        except IntegrityError as error:
            log.warning("tierkv: %s; starting a new listing (unlisted blocks are removed at the next open)", error)
            return Manifest()

    def _recover(self) -> Recovery:
        """Clean up after processes that died (called under the exclusive lock: no writer is mid-commit)."""
        manifest_lost = False
        try:
            listing = manifests.load(self._manifest_path)
        except IntegrityError as error:
            log.warning("tierkv: %s; starting with an empty listing", error)
            listing, manifest_lost = Manifest(), True
        self._manifest_path.with_name(self._manifest_path.name + ".tmp").unlink(missing_ok=True)
        scratch_areas = 0
        for name in {path.name.removesuffix(".lock") for path in self._tmp.iterdir()}:
            owner = self._tmp / f"{name}.lock"
            if is_abandoned(owner):  # its writer died (or died before taking its lock)
                area = self._tmp / name
                if area.is_dir():
                    shutil.rmtree(area, ignore_errors=True)
                    scratch_areas += 1
                owner.unlink(missing_ok=True)
        unlisted = torn = 0
        seen: set[str] = set()
        for folder in self._blocks.iterdir():
            files = list(folder.iterdir()) if folder.is_dir() else [folder]
            for path in files:
                entry = listing.entries.get(path.stem) if path.suffix == SUFFIX else None
                if entry is None:
                    unlisted += 1
                elif path.stat().st_size != entry.nbytes:
                    torn += 1
                    del listing.entries[path.stem]
                else:
                    seen.add(path.stem)
                    continue
                path.unlink(missing_ok=True)
        missing = [key for key in listing.entries if key not in seen]
        for key in missing:
            del listing.entries[key]
        recovery = Recovery(scratch_areas, unlisted, torn, len(missing), manifest_lost)
        if recovery != Recovery():
            manifests.write(self._manifest_path, listing)
            log.info("tierkv: persistent directory %s recovered: %s", self.root, recovery)
        return recovery


def _release(owner: OwnerLock, scratch: Path) -> None:
    with deferred_interrupts():  # all of it, or a Ctrl-C would leave the lock held on a removed scratch area
        shutil.rmtree(scratch, ignore_errors=True)
        owner.release()
        owner.path.unlink(missing_ok=True)
