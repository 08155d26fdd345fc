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

**A lock held for ever** (a stopped process, another member of a group-shared directory) stops nobody: each
wait for the ``lock`` ends after ``TIERKV_PERSIST_LOCK_TIMEOUT`` seconds (:mod:`tierkv.persist.lock`), and
the store goes on without what needed it, logging a warning that names the lock file, its holder and the fix:
opening skips the recovery, a write (or a read's marking of what it used, or its removal of a record that
failed its checks) is skipped and its scratch files removed. After one such timeout the store tries the lock
once, without waiting, until it gets it again, so one stuck holder costs one timeout, not one per write.
Persistence is a copy: nothing the cache holds is lost, and the listing is only ever changed under the lock.

**Trust** (docs/reliability.md, "Security"). The tree is this user's (0700 directories, 0600 files; 2770/0660
with ``TIERKV_SHARED_GROUP=1``): a ``tierkv-persist``, ``blocks`` or ``tmp`` that is a link, belongs to another
user or is writable by others is refused (:mod:`tierkv.safefs`). Every name is taken relative to a directory
descriptor opened once, without following links; recovery and eviction unlink only regular files of this
user, named by validated block keys (the manifest refuses any other key); a record is read only up to its
real size, which must equal the listed one, and, read for a namespace, no larger than a block record of that
namespace can be (:func:`tierkv.persist.record.max_block_bytes`). ``put`` checks every item by the manifest's
own rule (:func:`tierkv.persist.manifest.entry`), so the store never lists what its readers would refuse. A
directory, FIFO or link planted where the ``lock`` or ``manifest`` file belongs is refused with an error that
names it and how to remove it.

The store moves bytes: callers encode and decode records (a read for a namespace checks the record's header
against it, importing torch only for the dtype's item size).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tierkv import forks, logs, safefs, settings
from tierkv.atomic import deferred_interrupts
from tierkv.errors import DiskFullError, DiskTierError, IntegrityError, InvalidConfigError, NewerFormatError
from tierkv.persist import manifest as manifests
from tierkv.persist import record
from tierkv.persist.lock import LockTimeoutError, OwnerLock, is_abandoned, locked
from tierkv.persist.manifest import KEY, Entry, Manifest
from tierkv.units import format_bytes, plural

if TYPE_CHECKING:
    from tierkv.persist.keys import Namespace

log = logging.getLogger("tierkv")

DIRECTORY_NAME = "tierkv-persist"
SUFFIX = ".tkv"
LOCK = "lock"
_FOLDER = re.compile(r"^[0-9a-f]{2}$")
_SCRATCH_LOCK = re.compile(r"^(\d+-[0-9a-f]+)\.lock$")
_STALE_MANIFEST = re.compile(rf"^(\.{manifests.NAME}\..*\.tmp|{manifests.NAME}\.tmp)$")
@dataclass(frozen=True, slots=True)
class Item:
    """A record to store under ``key``: write ``head`` then ``payload`` (from :func:`tierkv.persist.record.encode`)."""

    key: str
    depth: int
    head: bytes
    payload: bytes | memoryview
    parent: str | None = None  # the block before it in its chain: where given, it is listed only beside that one


@dataclass(frozen=True, slots=True)
class Recovery:
    """What opening a directory cleaned up after processes that died."""

    scratch_areas: int = 0  # abandoned writers' scratch areas removed
    unlisted: int = 0  # block files no manifest listed (renamed, then killed before listing) removed
    torn: int = 0  # listed files of the wrong size removed
    missing: int = 0  # listed keys without a file dropped from the listing
    manifest_lost: bool = False  # the manifest did not verify: started empty
    skipped: bool = False  # another process held the lock past the deadline: nothing was cleaned up


class _Tree:
    """The store's open directories (descriptors: ``tierkv-persist``, ``blocks``, ``tmp``, the scratch area)
    and its owner lock; :func:`_release` removes the scratch area and closes them all."""

    def __init__(self, directory: Path) -> None:
        self.root = self.blocks = self.tmp = self.scratch = -1
        self.owner: OwnerLock | None = None
        self.scratch_name = ""
        where = directory / DIRECTORY_NAME
        user = safefs.open_user_directory(directory)
        try:
            self.root = safefs.open_own_directory(user, DIRECTORY_NAME, where)
        finally:
            os.close(user)
        try:
            self.blocks = safefs.open_own_directory(self.root, "blocks", where / "blocks")
            self.tmp = safefs.open_own_directory(self.root, "tmp", where / "tmp")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for name in ("scratch", "tmp", "blocks", "root"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)


class PersistentStore:
    """Content-addressed, size-capped block records in ``directory``, shared safely by processes."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise InvalidConfigError(f"the persistent store's capacity must be a positive byte count, "
                                     f"got {capacity_bytes!r}.")
        self.capacity_bytes = capacity_bytes
        self.root = Path(directory) / DIRECTORY_NAME
        self._blocks = self.root / "blocks"
        self._scratch = self.root / "tmp"
        self._lock_busy = False  # a wait for the lock timed out: try it once, without waiting, until it is had
        self._lock_warned = False  # that was logged as a warning (later ones at debug level)
        self._scratch_mutex = threading.Lock()  # one scratch area per store, whichever thread makes it
        finalizer = None  # set with the descriptors it closes
        try:
            try:
                with deferred_interrupts():  # the descriptors and the finalizer that closes them, together
                    tree = _Tree(Path(directory))
                    self._tree = tree
                    self._finalizer = finalizer = forks.finalize(self, _release, tree)
                try:
                    with self._locked(exclusive=True):
                        self.recovery = self._recover()
                except LockTimeoutError as error:
                    self.recovery = Recovery(skipped=True)
                    self._lock_timed_out(error, "this store opens without cleaning up after dead processes "
                                                "(the next one to get the lock does)")
                self._open_scratch()
            except BaseException:  # an interrupt too (one held while the descriptors were opened is raised as
                # that block ends): nothing of this store stays behind
                if finalizer is not None:
                    finalizer()
                raise
        except DiskTierError:
            raise
        except OSError as error:
            raise DiskTierError(f"cannot open the persistent block directory {self.root}: {error}. Pass a "
                                "disk_dir on a writable filesystem.") from error
        self._mutex = threading.Lock()  # the cached manifest, between this process's threads
        self._cached: tuple[tuple[int, int, int], Manifest] | None = None
        self._closed_stats: dict[str, int] | None = None  # stats() when it closed (its directory is let go)
        # bytes the filesystem must keep free after a record is written: the disk tier's budget it has not reserved
        # yet, where both share the filesystem (set by the cache's prefix session); None: no such bound
        self.keep_free: Callable[[], int] | None = None
        self.skipped_for_space = 0  # records not written: the filesystem's free space is the disk tier's
        self._warned: set[str] = set()  # what was logged as a warning (once per store; later at debug level)

    def _open_scratch(self) -> bool:
        """Make this store's scratch area (under the shared lock, so that recovery never sees a half-made one);
        False, with a warning, while another process holds the lock past the deadline (nothing can be written
        then). Made once: by the open, or by the first write after the lock was free again."""
        tree = self._tree
        with self._scratch_mutex:
            if tree.scratch >= 0:
                return True
            try:
                with self._locked(exclusive=False):  # recovery (exclusive) never sees a half-made area
                    name = f"{os.getpid()}-{secrets.token_hex(4)}"
                    self._scratch = self.root / "tmp" / name
                    with deferred_interrupts():  # the lock file and the record that _release removes it, together
                        tree.owner = OwnerLock(tree.tmp, f"{name}.lock")  # a new file: its flock never waits
                        tree.scratch_name = name
                    os.mkdir(name, safefs.dir_mode(), dir_fd=tree.tmp)
                    with deferred_interrupts():
                        tree.scratch = safefs.open_own_directory(tree.tmp, name, self._scratch, create=False)
            except LockTimeoutError as error:
                self._lock_timed_out(error, "this store writes no blocks until it gets the lock")
                return False
        return True

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

    def get(self, keys: Sequence[str], namespace: Namespace | None = None) -> list[bytearray]:
        """The verified records of the leading ``keys`` that are listed and intact (stops at the first that is
        not; a record that fails a check is removed). Marks the returned ones as used. With ``namespace``
        (``keys`` are then a chain from its first block), each must be a block record of ``namespace`` at its
        depth, and one listed larger than such a record can be is refused before it is read."""
        entries = self._listing().entries
        limit = record.max_block_bytes(namespace) if namespace is not None else manifests.MAX_RECORD_BYTES
        found: list[bytearray] = []
        bad: list[str] = []
        for depth, key in enumerate(keys):
            entry = entries.get(key)
            if entry is None:
                break
            data = self._read(key, entry, bad, limit, namespace, depth)
            if data is None:
                break
            found.append(data)
        if found or bad:
            try:
                self._update(touch=keys[: len(found)], remove=bad)
            except LockTimeoutError as error:  # the records read are verified: only the bookkeeping is skipped
                self._lock_timed_out(error, "the blocks read are not marked as used, nor a bad one removed")
            except NewerFormatError as error:  # a newer tierkv took the store over since the listing was read
                self._newer_store(error)
        return found

    def verify(self) -> list[str]:
        """Read and check every listed record; remove and return the keys of those that fail."""
        bad: list[str] = []
        for key, entry in self._listing().entries.items():
            self._read(key, entry, bad)
        if bad:
            try:
                self._update(remove=bad)
            except LockTimeoutError as error:  # still listed: read as misses (and dropped) until removed
                self._lock_timed_out(error, "the records that failed their checks stay listed for now")
            except NewerFormatError as error:
                self._newer_store(error)
        return bad

    def stats(self) -> dict[str, int]:
        if self._closed_stats is not None:
            return dict(self._closed_stats)
        listing = self._listing()
        return {"blocks": len(listing.entries), "bytes": listing.nbytes, "capacity_bytes": self.capacity_bytes,
                "skipped_for_space": self.skipped_for_space}

    # --------------------------------------------------------------------------------------- writing
    def put(self, items: Sequence[Item], touch: Sequence[str] = ()) -> int:
        """Store the ``items`` not listed yet; return how many were added. The others, and ``touch`` (the keys
        of the chain the items extend), are marked as used. Records are fsynced before they are listed; the
        least recently used are evicted to make room — but never a block marked used by this call: a record
        that does not fit otherwise is dropped, with the deeper ones after it."""
        for item in items:
            try:
                manifests.entry(item.key, [len(item.head) + len(item.payload), 0, item.depth], 0,
                                f"persistent block {str(item.key)[:80]!r}")
            except IntegrityError as error:
                raise InvalidConfigError(f"{error} An item is a block key, its index in its chain "
                                         "and its record: Item(key, depth, *record.encode_block(...)).") from None
        listed = self._listing().entries
        if not self._open_scratch():  # the lock is held past the deadline: skipped (logged)
            return 0
        # what the listing keeps whatever this call adds (marked used by it: never its victims), so a record past
        # the rest of the capacity would be dropped as soon as written: not written (the listing decides again)
        room = self.capacity_bytes - sum(listed[key].nbytes for key in {*touch, *(item.key for item in items)}
                                         if key in listed)
        staged: list[tuple[Item, str, int]] = []
        written = 0  # the staged records fsynced whole (a failure may cut the next one short)
        scratch = self._tree.scratch
        fd = -1  # the record being written
        try:
            for position, item in enumerate(items):
                nbytes = len(item.head) + len(item.payload)
                if item.key in listed:
                    continue
                if item.parent is not None and item.parent not in listed \
                        and all(item.parent != other.key for other, _, _ in staged):
                    continue  # its chain lost a block before it (or this call did not write that one)
                if nbytes > room:
                    self._dropped_for_capacity(len(items) - position, nbytes, self.capacity_bytes - room)
                    break  # deeper blocks are useless without this one
                if not self._room_for(nbytes):
                    self._skip_for_space(len(items) - position)  # deeper blocks are useless without this one
                    break
                room -= nbytes
                try:
                    with deferred_interrupts():  # the new file and the record that removes it, together
                        fd, name = safefs.create_file(scratch, f"{item.key}.", SUFFIX)
                        staged.append((item, name, nbytes))
                    safefs.write_all(fd, (item.head, item.payload))
                    os.fsync(fd)
                    written = len(staged)
                finally:
                    with deferred_interrupts():  # closed and forgotten together: never closed twice, never leaked
                        if fd >= 0:
                            os.close(fd)
                        fd = -1
            return self._update(touch=[*touch, *(item.key for item in items)], add=staged)
        except LockTimeoutError as error:  # the staged files are removed below: the store is as it was
            self._lock_timed_out(error, f"{len(staged)} blocks were not persisted (they are recomputed next time)")
            return 0
        except NewerFormatError as error:  # the staged files are removed below: that store stays as it is
            self._newer_store(error)
            return 0
        except DiskTierError:  # a refusal (a link where a folder belongs) says why itself
            raise
        except OSError as error:
            self._keep_written(staged, written)
            raise _write_error(error, self.root) from error
        finally:
            if fd >= 0:  # an interrupt before the loop's close began (it closes and forgets it in one deferred block)
                os.close(fd)
            for _, name, _ in staged:
                safefs.remove_regular(scratch, name)  # only those that were not renamed into place remain

    def _room_for(self, nbytes: int) -> bool:
        """Whether writing a record of ``nbytes`` (and the manifest copy and folder that list it) leaves the free
        space that :attr:`keep_free` asks for: persistence is a copy and must never take the disk tier's room."""
        if self.keep_free is None:
            return True
        keep = self.keep_free()
        if keep <= 0:
            return True
        usage = os.statvfs(self._tree.scratch)
        if usage.f_blocks == 0:  # a filesystem that reports no size (ramfs): its free space cannot be measured
            return True
        unit = usage.f_frsize or usage.f_bsize or 4096
        manifest = self._manifest_bytes()
        needed = -(-nbytes // unit) * unit + -(-manifest // unit) * unit + unit  # rounded to the allocation unit
        return usage.f_bavail * unit - needed >= keep

    def _manifest_bytes(self) -> int:
        """The manifest's size now (a listing change writes a new copy beside it before the rename)."""
        try:
            return os.stat(manifests.NAME, dir_fd=self._tree.root, follow_symlinks=False).st_size
        except OSError:
            return 0

    def _skip_for_space(self, count: int) -> None:
        """Count ``count`` records not written for the disk tier's room; a warning the first time."""
        self.skipped_for_space += count
        self._warn_once("space", "tierkv: %s not persisted: writing them would leave less free space under %s than "
                        "the disk tier's budget still needs (persistence is a copy: decoding goes on; "
                        "stats()['skipped_for_space'] counts them). Free space there, or lower disk_gb or persist_gb.",
                        plural(count, "block"), self.root)

    def _newer_store(self, error: NewerFormatError) -> None:
        """A newer tierkv's manifest replaced this one's while it runs: warned once; nothing of it is changed."""
        self._warn_once("newer", "tierkv: %s This tierkv leaves that store as it is: it reads and writes no "
                        "persistent blocks there.", error)

    def _warn_once(self, kind: str, message: str, *arguments: object) -> None:
        """Log ``message``: a warning the first time this store logs a ``kind`` unless a store of this process
        warned it for this directory within :data:`tierkv.logs.WARN_INTERVAL_S`, else at debug level."""
        loud = kind not in self._warned and logs.due(str(self.root), kind)
        log.log(logging.WARNING if loud else logging.DEBUG, message, *arguments)
        self._warned.add(kind)

    def _keep_written(self, staged: list[tuple[Item, str, int]], written: int) -> None:
        """A write failed (a disk that filled up) after ``written`` of ``staged`` were fsynced whole: free the
        others' space, then list those, the shallow end of the chain, so the next process reuses them. Best effort:
        where even the listing fails, nothing is listed, as before."""
        for _, name, _ in staged[written:]:
            safefs.remove_regular(self._tree.scratch, name)
        del staged[written:]
        if staged:
            with contextlib.suppress(OSError):  # a DiskTierError too: the write's own error is the one raised
                self._update(add=staged)

    def close(self) -> None:
        """Release this store's scratch area (listed records stay for the next process); ``stats()`` keeps its
        figures of now."""
        if self._finalizer.alive and self._closed_stats is None:
            try:
                self._closed_stats = self.stats()
            except OSError:  # e.g. the directory gone: nothing to report
                self._closed_stats = {"blocks": 0, "bytes": 0, "capacity_bytes": self.capacity_bytes,
                                      "skipped_for_space": self.skipped_for_space}
        self._finalizer()

    # ------------------------------------------------------------------------------------- internals
    def _path(self, key: str) -> Path:
        return self._blocks / key[:2] / f"{key}{SUFFIX}"

    def _read(self, key: str, entry: Entry, bad: list[str], limit: int = manifests.MAX_RECORD_BYTES,
              namespace: Namespace | None = None, depth: int = 0) -> bytearray | None:
        """The record of ``key`` checked (size, checksum, key; with ``namespace``, a block of it at ``depth``);
        None if it is gone, cannot be read now or does not verify — only then is ``key`` added to ``bad`` (to be
        unlisted: a failure of this process, such as no memory or no file descriptor left, says nothing of a record
        other processes share). Its listed size must be at most ``limit`` (the largest record it can be), and its
        file's real size must equal it, before anything is allocated."""
        what = str(self._path(key))
        try:
            if entry.nbytes > limit:
                raise IntegrityError(f"{what}: listed at {entry.nbytes} bytes, more than the {limit} a block record "
                                     "of this model's namespace has.")
            with safefs.directory_at(self._tree.blocks, key[:2]) as folder, \
                    safefs.opened(folder, f"{key}{SUFFIX}", what) as fd:
                size = os.fstat(fd).st_size
                if size != entry.nbytes:
                    raise IntegrityError(f"{what}: {size} bytes, the manifest lists {entry.nbytes}.")
                data = safefs.read_whole(fd, what, entry.nbytes)
            header, payload = record.decode(data, what=what)
            if header.get("key") != key:
                raise IntegrityError(f"{what}: holds {str(header.get('key'))[:80]!r}, not {key}.")
            if namespace is not None:
                record.check_block(header, len(payload), key, namespace, what, depth)
        except FileNotFoundError:  # evicted by another process since the listing was read (and maybe stored again)
            return None
        except NewerFormatError as error:  # a newer tierkv's record: a miss, left for it
            self._warn_once("newer", "tierkv: %s It is left as it is and recomputed here.", error)
            return None
        except IntegrityError as error:
            log.warning("tierkv: persistent block dropped, it will be recomputed: %s", error)
            bad.append(key)
            return None
        except MemoryError:  # a record this process cannot hold now: a miss, never the caller's error
            log.warning("tierkv: persistent block %s (%d bytes) does not fit in this process's memory now; it will "
                        "be recomputed", key, entry.nbytes)
            return None
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR):  # a link or a file where a folder of blocks belongs
                log.warning("tierkv: persistent block %s dropped, it will be recomputed: %s", key, error)
                bad.append(key)
            else:  # this process's trouble (no descriptor left, an I/O error): the record stays for the others
                log.warning("tierkv: persistent block %s unreadable now, it will be recomputed: %s", key, error)
            return None
        return data

    def _listing(self) -> Manifest:
        """The current manifest, re-read only when the file changed (it is replaced, never edited)."""
        try:
            status = os.stat(manifests.NAME, dir_fd=self._tree.root, follow_symlinks=False)
        except FileNotFoundError:
            return Manifest()
        signature = (status.st_ino, status.st_mtime_ns, status.st_size)
        with self._mutex:
            if self._cached is not None and self._cached[0] == signature:
                return self._cached[1]
        try:
            listing = manifests.load_at(self._tree.root, str(self.root / manifests.NAME))
        except NewerFormatError as error:
            self._newer_store(error)
            return Manifest()
        except IntegrityError as error:
            log.warning("tierkv: %s; persistent blocks are ignored until the next write repairs it", error)
            return Manifest()
        with self._mutex:
            self._cached = (signature, listing)
        return listing

    def _update(self, touch: Sequence[str] = (), remove: Sequence[str] = (),
                add: Sequence[tuple[Item, str, int]] = ()) -> int:
        """One change of the listing under the exclusive lock: mark ``touch`` used, remove ``remove``, rename
        ``add``'s staged files into place (evicting to fit); then write the new manifest, and only then delete the
        files it no longer lists — so whatever stops it (a SIGKILL, a Ctrl-C), every listed block has its file
        (what is left unlisted is removed at the next open). Returns #added."""
        tree = self._tree
        with self._locked(exclusive=True):
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
            unreachable = 0
            failed: OSError | None = None
            for position, (item, name, nbytes) in enumerate(add):
                if item.key in listing.entries:  # another process stored it meanwhile
                    continue
                if item.parent is not None and item.parent not in listing.entries:
                    unreachable += 1  # its chain lost a shallower block: no lookup would reach it (nor what follows)
                    continue
                while total + nbytes > self.capacity_bytes or len(listing.entries) >= manifests.MAX_ENTRIES:
                    victim = next(victims, None)
                    if victim is None or listing.entries[victim].last_used == tick:
                        break  # what is left was used by this call (victims come oldest first)
                    total -= listing.entries.pop(victim).nbytes
                    unlisted.append(victim)
                if total + nbytes > self.capacity_bytes or len(listing.entries) >= manifests.MAX_ENTRIES:
                    self._dropped_for_capacity(len(add) - position, nbytes, total)
                    break  # deeper blocks of this batch are useless without this one
                try:
                    with safefs.own_directory(tree.blocks, item.key[:2], self._blocks / item.key[:2]) as folder:
                        os.replace(name, f"{item.key}{SUFFIX}", src_dir_fd=tree.scratch, dst_dir_fd=folder)
                        safefs.fsync_directory(folder)
                except OSError as error:  # a full disk (a new folder takes a block): list those moved before it,
                    failed = error  # in the room the others leave (the manifest takes some)
                    for _, unmoved, _ in add[position:]:
                        safefs.remove_regular(tree.scratch, unmoved)
                    break
                listing.entries[item.key] = Entry(nbytes, tick, item.depth)
                total += nbytes
                added.append(item.key)
            self._write_manifest(listing)
            for key in unlisted:  # only once no manifest lists them (a listed block's file is always there)
                self._remove_record(key)
            if unreachable:
                log.debug("tierkv: %s not persisted: the blocks before them in their chain were evicted (the next "
                          "sequence that computes the chain stores it from its start)", plural(unreachable, "block"))
            if failed is not None:
                raise failed
            return len(added)

    def _dropped_for_capacity(self, count: int, nbytes: int, kept: int) -> None:
        """Log (a warning once, then at debug level) ``count`` records dropped as soon as written: the next, of
        ``nbytes``, does not fit in ``capacity_bytes`` beside the ``kept`` bytes this write just used."""
        message = ("tierkv: %s not persisted: a record of %s does not fit in persist_gb (%s) beside the %s of blocks "
                   "this write uses; pass a larger persist_gb to keep them")
        self._warn_once("capacity", message, plural(count, "block"), format_bytes(nbytes),
                        format_bytes(self.capacity_bytes), format_bytes(kept))

    def _remove_record(self, key: str) -> bool:
        """Unlink the record file of ``key`` (a validated key) if it is a regular file of this user."""
        try:
            with safefs.directory_at(self._tree.blocks, key[:2]) as folder:
                return safefs.remove_regular(folder, f"{key}{SUFFIX}")
        except OSError:  # no such folder, or a link in its place: nothing of ours to remove
            return False

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        """The directory's lock (:func:`tierkv.persist.lock.locked`); a non-file planted at its name is refused
        with the fix (:func:`_refuse_planted`), never waited on."""
        with contextlib.ExitStack() as held:
            busy = self._lock_busy
            try:
                held.enter_context(locked(self._tree.root, LOCK, exclusive,
                                          0.0 if busy else settings.get("persist_lock_timeout"), str(self.root / LOCK)))
            except LockTimeoutError:
                self._lock_busy = True  # the next waits try once: one stuck holder costs one timeout
                raise
            except OSError:
                _refuse_planted(self._tree.root, LOCK, self.root / LOCK)
                raise
            if busy:
                self._lock_busy = self._lock_warned = False
                log.info("tierkv: the lock %s is free again; persistent blocks are written again", self.root / LOCK)
            yield

    def _lock_timed_out(self, error: LockTimeoutError, consequence: str) -> None:
        """Log a wait for the lock that ended at its deadline (``error`` names the lock, its holder and the fix):
        a warning for the first, then at debug level until the lock is had again."""
        if self._lock_warned:
            log.debug("tierkv: %s Meanwhile %s.", error, consequence)
            return
        self._lock_warned = True
        log.warning("tierkv: %s Meanwhile %s (persistence is a copy: nothing the cache holds is lost); set "
                    "TIERKV_PERSIST_LOCK_TIMEOUT to wait longer.", error, consequence)

    def _write_manifest(self, listing: Manifest) -> None:
        """Replace the manifest (:func:`tierkv.persist.manifest.write`); a directory planted at its name, which
        a rename cannot replace, is refused with the fix."""
        try:
            manifests.write(self._tree.root, listing)
        except OSError:
            _refuse_planted(self._tree.root, manifests.NAME, self.root / manifests.NAME)
            raise

    def _load_for_update(self) -> Manifest:
        """The manifest as it is on disk now (under the exclusive lock); a copy, so the cached one stays."""
        try:
            return manifests.load_at(self._tree.root, str(self.root / manifests.NAME))
        except NewerFormatError:  # a newer tierkv's store: never replaced by this one's listing
            raise
        except IntegrityError as error:
            log.warning("tierkv: %s; starting a new listing (unlisted blocks are removed at the next open)", error)
            return Manifest()

    def _recover(self) -> Recovery:
        """Clean up after processes that died (called under the exclusive lock: no writer is mid-commit).
        Only regular files of this user with tierkv's names are removed; anything else is left and logged."""
        tree = self._tree
        manifest_lost = False
        try:
            listing = manifests.load_at(tree.root, str(self.root / manifests.NAME))
        except NewerFormatError as error:  # nothing of it removed: refused, with the way out
            raise NewerFormatError(f"{error} This tierkv leaves that store as it is: upgrade tierkv, or give this "
                                   "version a disk_dir of its own to persist blocks in.") from None
        except IntegrityError as error:
            log.warning("tierkv: %s; starting with an empty listing", error)
            listing, manifest_lost = Manifest(), True
        for name in os.listdir(tree.root):
            if _STALE_MANIFEST.match(name):
                safefs.remove_regular(tree.root, name)
        scratch_areas = 0
        for name in os.listdir(tree.tmp):
            match = _SCRATCH_LOCK.match(name)
            area = match.group(1) if match else name if re.match(r"^\d+-[0-9a-f]+$", name) else None
            if area is None or not is_abandoned(tree.tmp, f"{area}.lock"):
                continue  # its writer lives (or died before taking its lock: then the lock name is matched)
            if safefs.remove_tree(tree.tmp, area):
                scratch_areas += 1
            safefs.remove_regular(tree.tmp, f"{area}.lock")
        unlisted = torn = 0
        seen: set[str] = set()
        foreign: list[str] = []
        for folder_name in os.listdir(tree.blocks):
            if not _FOLDER.match(folder_name):
                foreign.append(folder_name)
                continue
            try:
                with safefs.own_directory(tree.blocks, folder_name, self._blocks / folder_name, False) as folder:
                    for name in os.listdir(folder):
                        key = name.removesuffix(SUFFIX)
                        status = safefs.is_regular_here(folder, name)
                        if not (name.endswith(SUFFIX) and KEY.match(key) and key.startswith(folder_name)) or \
                                status is None or not safefs.is_ours(status):
                            continue  # not a record tierkv wrote: never removed
                        entry = listing.entries.get(key)
                        if entry is None:
                            unlisted += 1
                        elif status.st_size != entry.nbytes:
                            torn += 1
                            del listing.entries[key]
                        else:
                            seen.add(key)
                            continue
                        safefs.remove_regular(folder, name)
            except OSError as error:  # a link, a file or another user's directory where a folder belongs
                log.warning("tierkv: %s", error)
        if foreign:  # one line however many: a directory another program filled must not flood the log
            shown = ", ".join(map(repr, sorted(foreign)[:3])) + (f" and {len(foreign) - 3:,} more"
                                                                 if len(foreign) > 3 else "")
            log.warning("tierkv: %s holds %s that %s not tierkv's (%s); left alone", self._blocks,
                        plural(len(foreign), "name"), "is" if len(foreign) == 1 else "are", shown)
        missing = [key for key in listing.entries if key not in seen]
        for key in missing:
            del listing.entries[key]
        recovery = Recovery(scratch_areas, unlisted, torn, len(missing), manifest_lost)
        if recovery != Recovery():
            self._write_manifest(listing)
            log.info("tierkv: persistent directory %s recovered: %s", self.root, recovery)
        return recovery


def listed_bytes(directory: str | os.PathLike) -> int:
    """The bytes the persistent store in ``directory`` lists now (0 where there is none or its manifest does not
    read): already on the filesystem, so a budget check counts only the rest of ``persist_gb``."""
    try:
        return manifests.load(Path(directory) / DIRECTORY_NAME / manifests.NAME).nbytes
    except (OSError, IntegrityError):
        return 0


def _refuse_planted(directory: int, name: str, where: Path) -> None:
    """Raise a DiskTierError that names what is at tierkv's file ``name`` in ``directory`` and how to remove it,
    if it is not a regular file (a directory, FIFO, link ... that tierkv never made, so never removes)."""
    try:
        mode = os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise safefs.refuse(where, f"it is {safefs.kind_of(mode)} where tierkv keeps a file of its own (another "
                            "program or user made it; tierkv never uses nor removes it)",
                            f"Remove it (rm -r '{where}') while no tierkv process uses this disk_dir; tierkv makes the "
                            "file again.")


def _release(tree: _Tree) -> None:
    with deferred_interrupts():  # all of it, or a Ctrl-C would leave the lock held on a removed scratch area
        if tree.scratch_name:
            if tree.scratch >= 0:
                os.close(tree.scratch)
                tree.scratch = -1
            safefs.remove_tree(tree.tmp, tree.scratch_name)
        if tree.owner is not None:
            tree.owner.release()
            safefs.remove_regular(tree.tmp, tree.owner.name)
            tree.owner = None
        tree.close()


def _write_error(error: OSError, root: Path) -> DiskTierError:
    """A failed write of persistent blocks as a DiskTierError with the errno and the fix that fits it: a full
    disk says to free space; a folder removed under a running store says that this store writes nothing more
    (it works through the folders it opened) and that the next cache makes them again."""
    why = error.strerror or str(error)
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(error.errno, f"writing persistent blocks under {root} failed ({why}). Free space "
                                          "there or lower persist_gb.")
    if error.errno == errno.ENOENT:
        return DiskTierError(error.errno, f"writing persistent blocks under {root} failed ({why}): its folders "
                                          "were removed while this cache used them, so it persists nothing more; "
                                          "a new cache on the same disk_dir makes them again.")
    return DiskTierError(error.errno, f"writing persistent blocks under {root} failed ({why}). Check the drive "
                                      "and the directory's permissions.")
