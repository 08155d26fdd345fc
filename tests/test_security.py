"""tierkv on a shared machine, tried as an adversary would (docs/reliability.md, "Security"): links, FIFOs and
foreign files planted at every name tierkv creates in a shared ``disk_dir``; manifests and conversation files
whose checksums are right but whose lengths and fields are crafted; files of another model; two processes
opening caches on one directory at once. Each test asserts the refusal (a tierkv error that says why, never a
hang, a ``MemoryError`` or a bare ``KeyError``), the modes of what tierkv wrote, and that nothing outside the
directory it was given changed (a "victim" directory beside it, snapshotted before and compared after)."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import decode_rss
from models import prompt, tiny_model

from tierkv import safefs
from tierkv import settings as tierkv_settings
from tierkv.errors import CheckpointError, DiskTierError, IntegrityError, InvalidConfigError
from tierkv.hf import TieredCache
from tierkv.io import EngineUnavailableError, aligned_empty, engine_status, native, open_disk_file
from tierkv.persist import record
from tierkv.persist.blockfile import DIRECTORY_NAME, Item, PersistentStore
from tierkv.stats import Trace
from tierkv.tiers import disk as disk_module
from tierkv.tiers.disk import DiskTier

KEY = "ab" + "0" * 30
BT = 4
ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # this tierkv


# ------------------------------------------------------------------------------------------ helpers
def _victim(tmp_path: Path) -> Path:
    """A directory of files tierkv must never touch (another user's, root's), with names tierkv would use."""
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in (f"{KEY}.tkv", "chat.tkv", "important", "tierkv-1-abc.lock"):
        (victim / name).write_bytes(b"precious " + name.encode())
    return victim


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _item(key: str) -> Item:
    return Item(key, 0, *record.encode({"kind": "block", "key": key}, bytes(1000)))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _in_subprocess(code: str, *args: str, timeout: float = 60, limit_bytes: int | None = None) -> str:
    """Run ``code`` in a fresh interpreter (under an address-space limit, if given, set after the imports):
    a hang is a timeout, not a stuck test run. Returns its stdout."""
    prelude = "import resource, sys\n"
    if limit_bytes is not None:
        prelude += f"resource.setrlimit(resource.RLIMIT_AS, ({limit_bytes}, {limit_bytes}))\n"
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code).replace("#LIMIT", prelude), *args],
                            capture_output=True, text=True, timeout=timeout, env=ENV)
    assert result.returncode == 0, result.stderr
    return result.stdout


# ------------------------------------------------------------------------ links in the persistent tree
@pytest.mark.parametrize("name", ["tierkv-persist", "tierkv-persist/blocks", "tierkv-persist/tmp"])
def test_a_linked_persistent_directory_is_refused(tmp_path, name):
    victim = _victim(tmp_path)
    before = _snapshot(victim)
    disk_dir = tmp_path / "shared"
    (disk_dir / DIRECTORY_NAME).mkdir(parents=True)
    link = disk_dir / name
    if link.exists():
        link.rmdir()
    link.symlink_to(victim)
    with pytest.raises(DiskTierError, match="symbolic link"):
        PersistentStore(disk_dir, 1 << 20)
    assert _snapshot(victim) == before


def test_links_inside_the_tree_are_never_followed_nor_removed(tmp_path):
    """The issue's attack: ``blocks/ab -> /some/dir`` made recovery unlink every file listed there. Also a
    linked manifest, stale temporary manifest, scratch area and owner lock."""
    victim = _victim(tmp_path)
    before = _snapshot(victim)
    store = PersistentStore(tmp_path / "shared", 1 << 20)
    store.put([_item("cd" + "1" * 30)])
    store.close()
    root = tmp_path / "shared" / DIRECTORY_NAME
    (root / "blocks" / "ab").symlink_to(victim)  # holds a file named like an unlisted record
    (root / "blocks" / "ef").mkdir()
    (root / "blocks" / "ef" / f"ef{'2' * 30}.tkv").symlink_to(victim / "important")
    (root / ".manifest.x.tmp").symlink_to(victim / "important")
    (root / "tmp" / "999999-dead").symlink_to(victim)
    (root / "tmp" / "999998-dead.lock").symlink_to(victim / "tierkv-1-abc.lock")
    again = PersistentStore(tmp_path / "shared", 1 << 20)
    with pytest.raises(DiskTierError, match="symbolic link"):  # never written through the linked folder
        again.put([_item(KEY)])
    assert again.get([KEY]) == [] and again.lookup(["cd" + "1" * 30]) == 1
    again.close()
    (root / "manifest").unlink()
    (root / "manifest").symlink_to(victim / "important")
    third = PersistentStore(tmp_path / "shared", 1 << 20)
    assert third.recovery.manifest_lost  # a link is not a manifest: refused, never read
    third.put([_item("cd" + "3" * 30)])  # the new manifest replaces the link, the file it pointed at stays
    assert not (root / "manifest").is_symlink()
    third.close()
    assert _snapshot(victim) == before


def test_special_files_never_hang_and_dev_zero_is_not_read(tmp_path):
    """A FIFO as the manifest, as a lock file and as a disk tier's lock; ``manifest -> /dev/zero``."""
    for case in ("manifest-fifo", "manifest-zero", "lock-fifo"):
        disk_dir = tmp_path / case
        root = disk_dir / DIRECTORY_NAME
        (root / "blocks").mkdir(parents=True)
        if case == "manifest-fifo":
            os.mkfifo(root / "manifest")
        elif case == "manifest-zero":
            (root / "manifest").symlink_to("/dev/zero")
        else:
            os.mkfifo(root / "lock")
        out = _in_subprocess("""
            import sys
            from tierkv.errors import DiskTierError
            from tierkv.persist.blockfile import PersistentStore
            try:
                store = PersistentStore(sys.argv[1], 1 << 20)
            except DiskTierError as error:
                print("refused:", error)
            else:
                print("opened", store.recovery.manifest_lost)
                store.close()
        """, str(disk_dir), timeout=60)
        expected = "refused: " if case == "lock-fifo" else "opened True"
        assert out.startswith(expected), (case, out)
    (tmp_path / "tier").mkdir()
    os.mkfifo(tmp_path / "tier" / "tierkv-1-0a.lock")  # named like a dead tier's lock file
    os.mkfifo(tmp_path / "tier" / ".tierkv-x.tmp")
    out = _in_subprocess("""
        import sys
        from tierkv.tiers.disk import DiskTier
        DiskTier(sys.argv[1], budget=1 << 20).close()
        print("ok")
    """, str(tmp_path / "tier"))
    assert out.strip() == "ok"
    assert stat.S_ISFIFO(os.lstat(tmp_path / "tier" / "tierkv-1-0a.lock").st_mode)  # left alone


def test_foreign_manifest_keys_never_become_paths(tmp_path):
    """A manifest with a right checksum listing ``/abs/path/chat`` and ``../../x``: refused as a whole, so
    eviction never unlinks ``/abs/path/chat.tkv``."""
    victim = _victim(tmp_path)
    before = _snapshot(victim)
    store = PersistentStore(tmp_path / "shared", 1 << 20)
    store.close()
    root = tmp_path / "shared" / DIRECTORY_NAME
    for key in (str(victim / "chat"), "../../victim/chat", "AB" + "0" * 30, "ab"):
        listing = {"clock": 5, "blocks": {key: [1000, 1, 0]}}
        head, payload = record.encode({"kind": "manifest", "format": 1}, json.dumps(listing).encode())
        (root / "manifest").write_bytes(head + bytes(payload))
        other = PersistentStore(tmp_path / "shared", 1100)
        assert other.recovery.manifest_lost, key
        other.put([_item("cd" + "4" * 30)])  # evicts to fit: nothing outside
        other.close()
    for values in ([10**15, 1, 0], [1000, "1", 0], [1000, 1], "x", [True, 1, 0]):  # numbers out of range
        listing = {"clock": 5, "blocks": {KEY: values}}
        head, payload = record.encode({"kind": "manifest", "format": 1}, json.dumps(listing).encode())
        (root / "manifest").write_bytes(head + bytes(payload))
        other = PersistentStore(tmp_path / "shared", 1 << 20)
        assert other.recovery.manifest_lost and other.get([KEY]) == [], values
        other.close()
    assert _snapshot(victim) == before


def test_a_listed_size_beyond_the_file_is_a_miss_without_allocating(tmp_path):
    """A manifest (written under the lock, as a co-tenant's process would) listing 10^15 bytes for a record."""
    store = PersistentStore(tmp_path, 1 << 60)
    store.put([_item(KEY)])
    from tierkv.persist import manifest as manifests

    listing = manifests.load(tmp_path / DIRECTORY_NAME / "manifest")
    listing.entries[KEY].nbytes = 10**15
    with safefs.directory(tmp_path / DIRECTORY_NAME) as root:
        manifests.write(root, listing)
    assert store.get([KEY]) == []  # refused by its real size: no 10^15-byte buffer
    store.close()


# ------------------------------------------------------------------------------ the disk tier's files
def test_disk_tier_files_and_refusals(tmp_path):
    victim = _victim(tmp_path)
    before = _snapshot(victim)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "tierkv-1-0b.lock").symlink_to(victim / "tierkv-1-abc.lock")  # a dead tier's lock, by its name
    (shared / "tierkv-999999-0b-x-4096.kv").symlink_to(victim / "important")  # a dead pid's data file
    (shared / ".tierkv-y.tmp").symlink_to(victim / "important")
    old = os.umask(0)
    try:
        tier = DiskTier(shared, budget=1 << 20)
        tier.alloc(4096)
    finally:
        os.umask(old)
    files = [p for p in shared.iterdir() if not p.is_symlink()]
    assert files and all(_mode(p) == 0o600 for p in files), {p.name: oct(_mode(p)) for p in files}
    tier.close()
    assert sorted(p.name for p in shared.iterdir()) == [".tierkv-y.tmp", "tierkv-1-0b.lock",
                                                        "tierkv-999999-0b-x-4096.kv"]  # the links stay
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(DiskTierError, match="sticky"):
        DiskTier(open_dir, budget=1 << 20)
    open_dir.chmod(0o777 | stat.S_ISVTX)  # as /tmp: others cannot rename what tierkv made
    DiskTier(open_dir, budget=1 << 20).close()
    assert _snapshot(victim) == before


def test_the_disk_file_grows_with_the_kv(tmp_path):
    """One slot of 4 KiB takes a small file, not a 256 MiB extent; the file doubles as blocks come."""
    tier = DiskTier(tmp_path, budget=1 << 30)
    tier.alloc(4096)
    assert tier.allocated_bytes <= 1 << 20
    for _ in range(1000):
        tier.alloc(4096)
    assert 1000 * 4096 <= tier.allocated_bytes <= 2 * 1001 * 4096
    tier.close()


def test_two_processes_open_caches_on_one_directory_at_once(tmp_path):
    """Each constructs and closes disk tiers as fast as it can while the other does; no construction fails
    (the pending lock file a reclaimer took is made again)."""
    code = """
        import sys
        from tierkv.tiers.disk import DiskTier
        failures = 0
        for _ in range(int(sys.argv[2])):
            try:
                DiskTier(sys.argv[1], budget=1 << 20).close()
            except Exception as error:
                failures += 1
                last = error
        print(failures)
    """
    children = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(tmp_path), "1500"],
                                 stdout=subprocess.PIPE, text=True, env=ENV) for _ in range(2)]
    outputs = [child.communicate(timeout=300)[0] for child in children]
    assert [int(out) for out in outputs] == [0, 0], outputs
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- modes, whatever the umask
def test_everything_written_is_private_whatever_the_umask(tmp_path):
    """Missing parents of ``disk_dir`` too (made 0777 under umask 0 before: another user could then replace
    ``disk_dir`` under them)."""
    model = tiny_model("llama")
    ids, _ = prompt(1, 9, seed=1)
    old = os.umask(0)
    try:
        with TieredCache(disk_dir=tmp_path / "p" / "q" / "d", persist=True, block_tokens=BT, gpu_gb="1MiB",
                         cpu_gb="1MiB", trace=True) as cache:
            cache.load_prefix(model, ids)
            with torch.no_grad():
                model(ids, past_key_values=cache)
            cache.flush()
            cache.save(tmp_path / "chat.tkv", model=model)
            cache.save_trace(tmp_path / "trace.json")
            written = [tmp_path / "p", *(tmp_path / "p").rglob("*")]
    finally:
        os.umask(old)
    dirs = [p for p in written if p.is_dir()]
    files = [p for p in written if p.is_file()]
    assert any(p.suffix == ".tkv" for p in files) and len(dirs) >= 3
    assert {oct(_mode(p)) for p in dirs} == {"0o700"}, {str(p): oct(_mode(p)) for p in dirs}
    assert {oct(_mode(p)) for p in files} == {"0o600"}, {str(p): oct(_mode(p)) for p in files}
    assert _mode(tmp_path / "chat.tkv") == 0o600 and _mode(tmp_path / "trace.json") == 0o600


def test_the_group_shared_store_is_an_explicit_opt_in(tmp_path):
    """Only the persistent tree is shared: a conversation file (a prompt's K/V) stays 0600 (it was 0660)."""
    model = tiny_model("llama")
    with tierkv_settings.override(shared_group=True):
        store = PersistentStore(tmp_path, 1 << 20)
        store.put([_item(KEY)])
        store.close()
        with TieredCache(block_tokens=BT) as cache:
            model(prompt(1, 9, seed=1)[0], past_key_values=cache)
            cache.save(tmp_path / "chat.tkv", model=model)
            asyncio.run(cache.asave(tmp_path / "chat_async.tkv", model=model))
    assert _mode(tmp_path / "chat.tkv") == 0o600 and _mode(tmp_path / "chat_async.tkv") == 0o600
    root = tmp_path / DIRECTORY_NAME
    assert _mode(root) == 0o2770 and _mode(root / "blocks") == 0o2770
    assert _mode(root / "blocks" / "ab" / f"{KEY}.tkv") == 0o660 and _mode(root / "manifest") == 0o660
    PersistentStore(tmp_path, 1 << 20).close()  # without the opt-in the tree is made private again
    assert _mode(root) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a directory of another user (needs root)")
def test_a_directory_of_another_user_is_refused(tmp_path):
    (tmp_path / DIRECTORY_NAME).mkdir()
    os.chown(tmp_path / DIRECTORY_NAME, 65534, 65534)
    with pytest.raises(DiskTierError, match="another user"):
        PersistentStore(tmp_path, 1 << 20)


# ------------------------------------------------------------------------------ save and trace paths
def test_links_at_save_and_trace_paths_are_replaced_not_followed(tmp_path):
    victim = _victim(tmp_path)
    before = _snapshot(victim)
    model = tiny_model("llama")
    ids, _ = prompt(1, 9, seed=1)
    with TieredCache(block_tokens=BT, trace=True) as cache:
        with torch.no_grad():
            model(ids, past_key_values=cache)
        (tmp_path / "chat.tkv").symlink_to(victim / "chat.tkv")
        (tmp_path / "chat.tkv.tmp").symlink_to(victim / "important")  # the fixed name earlier versions used
        cache.save(tmp_path / "chat.tkv", model=model)
        (tmp_path / "trace.json").symlink_to(victim / "important")
        cache.save_trace(tmp_path / "trace.json")
    assert not (tmp_path / "chat.tkv").is_symlink() and not (tmp_path / "trace.json").is_symlink()
    TieredCache.load(tmp_path / "chat.tkv", model=model).close()
    Trace().save(tmp_path / "trace.json")
    assert _snapshot(victim) == before


@pytest.mark.parametrize("planted", ["FIFO", "link to a FIFO", "directory", "link to a directory"])
def test_a_device_fifo_or_directory_at_a_save_or_trace_path_is_never_replaced(tmp_path, planted):
    """Saving renames a new file over the path: where a FIFO, a device (``/dev/null``, ``/dev/stdout``) or a
    directory is, or a link to one, that would destroy what other programs use. Refused (when the path is given,
    and again at the write), and what was there is left."""
    model = tiny_model("llama")
    ids, _ = prompt(1, 9, seed=1)
    special = tmp_path / "special"
    if planted.endswith("FIFO"):
        os.mkfifo(special)
    else:
        special.mkdir()
    path = tmp_path / "out"
    if planted.startswith("link"):
        path.symlink_to(special)
    else:
        path = special
    with pytest.raises(InvalidConfigError, match="does not replace"):
        TieredCache(trace=path)
    with TieredCache(block_tokens=BT, trace=True) as cache:
        with torch.no_grad():
            model(ids, past_key_values=cache)
        with pytest.raises(DiskTierError, match="does not replace"):
            cache.save(path, model=model)
        with pytest.raises(InvalidConfigError, match="does not replace"):  # (save_trace checks its path as trace=)
            cache.save_trace(path)
    assert path.is_symlink() == planted.startswith("link")
    assert stat.S_ISFIFO(special.stat().st_mode) if planted.endswith("FIFO") else special.is_dir()


def test_a_linked_models_folder_in_the_cache_dir_is_refused(tmp_path):
    """Dequantised checkpoints are written and renamed into ``$TIERKV_CACHE_DIR/models``: never through a link."""
    from tierkv import models

    victim = _victim(tmp_path)
    before = _snapshot(victim)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "models").symlink_to(victim)
    linked = tmp_path / "cache" / "models"
    with pytest.raises(DiskTierError, match="symbolic link"), models._own_models_directory(linked):
        pass
    with models._own_models_directory(tmp_path / "fresh" / "models"):
        pass
    assert _mode(tmp_path / "fresh" / "models") == 0o700 and _snapshot(victim) == before


def test_a_disk_dir_swapped_for_a_link_while_it_is_opened_is_refused(tmp_path, monkeypatch):
    """Regression: ``disk_dir`` was checked (not another user's link) and then opened by name, following links:
    another user who owns the name in a sticky directory could swap her directory for her link in between (an
    audit's racer got the victim's private directory 11,791 times in 8 s). The directory opened must be the one
    checked. The swap is made right after the check here, with a link of this user's (the same race)."""
    victim = _victim(tmp_path)
    before = _snapshot(victim)
    disk_dir = tmp_path / "shared" / "kv"
    disk_dir.mkdir(parents=True)
    check = safefs._check_link_owner

    def check_then_swap(path):
        seen = check(path)
        disk_dir.rename(tmp_path / "shared" / "away")
        disk_dir.symlink_to(victim)
        return seen

    monkeypatch.setattr(safefs, "_check_link_owner", check_then_swap)
    with pytest.raises(DiskTierError, match="replaced while tierkv opened it"):
        TieredCache(disk_dir=disk_dir, gpu_gb="1MiB", cpu_gb="1MiB")
    assert _snapshot(victim) == before and set(os.listdir(victim)) == set(before)  # nothing made there
    monkeypatch.undo()
    TieredCache(disk_dir=tmp_path / "shared" / "away", gpu_gb="1MiB", cpu_gb="1MiB").close()  # unswapped: opens


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="root writes anywhere")
def test_a_cache_dir_this_user_cannot_write_names_the_setting_to_change(tmp_path):
    """A TIERKV_CACHE_DIR (or ~/.cache) this user may not create was a bare PermissionError from deep in
    safefs; it is a DiskTierError naming the path and the setting (root is run without its override of file
    permissions)."""
    readonly = tmp_path / "ro"
    readonly.mkdir(mode=0o555)
    as_user = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--inh-caps=-all"] \
        if os.geteuid() == 0 else []
    script = ("from tierkv import cbuild\n"
              "from tierkv.errors import DiskTierError\n"
              "try:\n"
              "    cbuild._open_cache_dir()\n"
              "except DiskTierError as error:\n"
              "    print(error)\n")
    result = subprocess.run([*as_user, sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "TIERKV_CACHE_DIR": str(readonly / "cache")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"tierkv refuses '{readonly / 'cache'}': this user may not create or open it")
    assert "Set TIERKV_CACHE_DIR to a directory you can write" in result.stdout
    assert not (readonly / "cache").exists()


def test_bench_scratch_files_are_new_private_files(tmp_path):
    victim = _victim(tmp_path)
    before = _snapshot(victim)
    (tmp_path / f"tierkv-bench-{os.getpid()}.bin").symlink_to(victim / "important")  # the fixed name of old
    with safefs.scratch_file(tmp_path, f"tierkv-bench-{os.getpid()}-", 1 << 16) as path:
        assert _mode(path) == 0o600 and path.stat().st_size == 1 << 16 and not path.is_symlink()
        path.write_bytes(b"x")
    assert not path.exists() and _snapshot(victim) == before


# ------------------------------------------------------ another user of the machine (a real second uid)
def _other_user() -> tuple[int, int]:
    """uid and gid of a second real user: ``mallory`` where she exists, else nobody."""
    try:
        entry = pwd.getpwnam("mallory")
    except KeyError:
        return 65534, 65534
    return entry.pw_uid, entry.pw_gid


OTHER_UID, OTHER_GID = _other_user()
needs_other_user = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                      reason="plants files as a second real user (needs root and setpriv)")
needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
SECRET = np.frombuffer(b"SECRET-PROMPT-KV" * 256, dtype=np.uint8)  # one 4 KiB slot
_SWAP = 'umask 0; : > "$1/.hers" && mv -f "$1/.hers" "$1/$2"'
"""The other user's move: a 0666 file of hers renamed over the name of the file tierkv just created."""


def _as_other_user(*argv: str, gid: int = OTHER_GID) -> None:
    """Run ``argv`` as the other user (her uid, group ``gid`` only)."""
    result = subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={gid}", "--clear-groups", *argv],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A directory as /tmp is (1777): the other user can reach it and make names in it (pytest's tmp_path is inside
    a 0700 folder of root's)."""
    path = Path(tempfile.mkdtemp(prefix="tierkv-security-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _group_store(parent: Path) -> Path:
    """A store shared by group 0 (2770, root's): with TIERKV_SHARED_GROUP=1 its members, the other user too
    when she runs in that group, may write it, so she can rename names in it."""
    store = parent / "store"
    store.mkdir()
    store.chmod(0o2770)
    return store


@needs_other_user
@pytest.mark.parametrize("engine", ["posix", "native"])
def test_a_disk_tier_file_another_user_swaps_is_never_opened(public_tmp, monkeypatch, engine):
    """The slot file was created ``O_EXCL`` through the directory's descriptor, then reopened by its name: in that
    instant a member of a shared disk_dir's group renamed her own 0666 file over the name, and the KV was written
    to (and read back from, checksums passing) her file. The engine now opens the created file's descriptor."""
    if engine_status()[engine] is not None:
        pytest.skip(f"engine {engine} unavailable: {engine_status()[engine]}")
    store = _group_store(public_tmp)
    opened = disk_module.open_disk_file

    def swapped_first(path, engine=None):  # the other user moves exactly between the create and the open
        _as_other_user("sh", "-c", _SWAP, "sh", str(store), path.name, gid=0)
        return opened(path, engine=engine)

    monkeypatch.setattr(disk_module, "open_disk_file", swapped_first)
    with tierkv_settings.override(shared_group=True):
        tier = DiskTier(store, budget=1 << 20, engine=engine)
    try:
        slot = tier.alloc(4096)
        slot_file = tier.files[4096]
        buffer = aligned_empty(4096)
        buffer[:] = SECRET
        tier.wait(tier.write(4096, [slot], buffer), 4096)
        back = aligned_empty(4096)
        handle, _ = tier.read(4096, np.array([slot]), back)
        handle.wait()
        hers = store / slot_file.path.name
        assert hers.stat().st_uid == OTHER_UID  # her file holds the name ...
        assert b"SECRET" not in hers.read_bytes()  # ... and never got the KV
        engine_file, created = os.fstat(slot_file.file.fd), os.fstat(slot_file.fd)
        assert (engine_file.st_dev, engine_file.st_ino) == (created.st_dev, created.st_ino)
        assert bytes(back) == bytes(SECRET)  # the tier still works, on its own file
    finally:
        tier.close()


@needs_other_user
def test_a_bench_file_another_user_swaps_is_never_opened(public_tmp):
    """``safefs.scratch_file`` yielded a path the bench reopened by name; it now carries the created descriptor,
    which the engines open instead."""
    store = _group_store(public_tmp)
    with tierkv_settings.override(shared_group=True), safefs.scratch_file(store, "tierkv-bench-", 1 << 16) as path:
        _as_other_user("sh", "-c", _SWAP, "sh", str(store), path.name, gid=0)
        buffer = aligned_empty(4096)
        buffer[:] = SECRET
        with open_disk_file(path, engine="posix") as f:
            f.write(0, buffer)
            assert b"SECRET" not in (store / path.name).read_bytes()
            assert os.fstat(f.fd).st_ino == os.fstat(path.fd).st_ino
            f.read(4096, buffer)  # the created file's hole: zeros
            assert not buffer.any()


@needs_other_user
@pytest.mark.parametrize(("plant", "match"), [
    ("theirs", "another user"),  # a predictable /tmp/<name> the other user made first
    ("theirs, sticky", "another user"),  # sticky, but its owner may rename anything in it
    ("their group", "its group"),  # root's, writable by the other user's group
    ("our group", "its group"),  # writable by a group of ours: only with TIERKV_SHARED_GROUP=1
])
def test_a_disk_dir_another_user_could_rename_files_in_is_refused(public_tmp, plant, match, monkeypatch):
    """A disk_dir owned by another user, or that her group can write without the sticky bit, is refused for the
    disk tier and the persistent store, with the fix; a store shared by a group of ours works with the opt-in."""
    monkeypatch.setattr(safefs, "_private_group", lambda gid: False)  # our group (root's) has other members too
    where = public_tmp / "dir"
    if plant.startswith("theirs"):
        _as_other_user("mkdir", "-m", "1777" if "sticky" in plant else "755", str(where))
    else:
        where.mkdir()
        os.chown(where, 0, OTHER_GID if plant == "their group" else 0)
        where.chmod(0o770)
    with pytest.raises(DiskTierError, match=match) as refused:
        DiskTier(where, budget=1 << 20)
    assert str(where) in str(refused.value) and "TIERKV_SHARED_GROUP=1" in str(refused.value)  # and the fixes
    with pytest.raises(DiskTierError, match=match):
        PersistentStore(where, 1 << 20)
    with tierkv_settings.override(shared_group=True):
        if plant == "our group":  # the legitimately shared store: accepted with the opt-in
            DiskTier(where, budget=1 << 20).close()
            store = PersistentStore(where, 1 << 20)
            store.put([_item(KEY)])
            assert store.lookup([KEY]) == 1
            store.close()
        else:  # the opt-in trusts the groups of this process only
            with pytest.raises(DiskTierError, match=match):
                DiskTier(where, budget=1 << 20)
    assert list(where.iterdir()) == ([] if plant != "our group" else [where / DIRECTORY_NAME])


def test_a_disk_dir_only_our_private_group_can_write_is_ours(tmp_path):
    """Debian's and Ubuntu's umask 002 makes a new directory group-writable, by a group that holds only its user:
    accepted without the group-shared opt-in (here root's group, which holds only root)."""
    if os.geteuid() != 0 or not safefs._private_group(0):
        pytest.skip("needs root, and a root group that holds only root")
    where = tmp_path / "dir"
    where.mkdir()
    os.chown(where, 0, 0)
    where.chmod(0o775)
    DiskTier(where, budget=1 << 20).close()
    store = PersistentStore(where, 1 << 20)
    store.put([_item(KEY)])
    assert store.lookup([KEY]) == 1
    store.close()


_PLANTED_C = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


@pytest.fixture
def fresh_native(monkeypatch) -> Iterator[None]:
    """The native engine's library built on first use (no install-built extension), nothing loaded yet."""
    monkeypatch.setattr(native, "extension", lambda: None)
    native._build.cache_clear()
    yield
    native._build.cache_clear()


@needs_other_user
@needs_compiler
@pytest.mark.parametrize(("plant", "match"), [
    ("folder", "another user"),  # her native/ in a cache dir anyone may create names in (sticky, as /tmp)
    ("file", "another user"),  # her library in a native/ that was made 0777 (an older version, umask 0)
    ("link", "symbolic link"),  # a link to her library there
])
def test_a_planted_native_library_is_never_loaded(public_tmp, fresh_native, plant, match):
    """A library in ``$TIERKV_CACHE_DIR/native`` under the name computable from the public source was loaded
    with ctypes after only checking it exists: her constructor ran as the tierkv user. Refused now, with the
    path, the problem and the fix; a library built on first use still loads, from its descriptor."""
    own = public_tmp / "own-cache"
    with tierkv_settings.override(cache_dir=own):  # legitimate use: built on first use (its name is the target)
        assert native.load() is native.NativeFile
    built = next((own / "native").glob("tierkv_io-*.so"))
    native._build.cache_clear()

    marker = public_tmp / "ran"
    hers = public_tmp / "hers"
    hers.mkdir()
    (hers / "planted.c").write_text(_PLANTED_C % marker)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(hers / "planted.so"), str(hers / "planted.c")], check=True)
    for path in (hers, hers / "planted.so"):
        os.chown(path, OTHER_UID, OTHER_GID)
    cache = public_tmp / "cache"
    cache.mkdir()
    cache.chmod(0o1777)
    target = cache / "native" / built.name
    if plant == "folder":
        _as_other_user("mkdir", "-m", "755", str(cache / "native"))
    else:
        (cache / "native").mkdir()
        (cache / "native").chmod(0o777)
    _as_other_user("ln" if plant == "link" else "cp", *(["-s"] if plant == "link" else []), str(hers / "planted.so"),
                   str(target))
    with tierkv_settings.override(cache_dir=cache), pytest.raises(EngineUnavailableError, match=match) as refused:
        native.library()
    assert str(cache / "native") in str(refused.value) and "Remove it" in str(refused.value)
    assert not marker.exists()  # her code never ran
    assert target.is_symlink() if plant == "link" else target.stat().st_uid == OTHER_UID  # and was left alone

    native._build.cache_clear()
    with tierkv_settings.override(cache_dir=own):  # ours loads again from the cache, not rebuilt
        native.library()
    assert sorted((own / "native").iterdir()) == [built, built.with_name(f"{built.name}.sum")]  # its sha256 beside it
    assert _mode(own / "native") == 0o700 and _mode(built) == 0o700 and built.stat().st_uid == os.geteuid()


class _Loaded(Exception):
    """Raised by :class:`_SpyModel` once tierkv asked it to load a folder."""


class _SpyModel:
    """A model class that records the folder tierkv would load weights from."""

    loaded: list[Path] = []

    @classmethod
    def from_pretrained(cls, folder, **_):
        cls.loaded.append(Path(folder))
        raise _Loaded


@needs_other_user
@pytest.mark.parametrize(("plant", "match"), [
    ("models", "another user"),  # her models/ in a cache dir anyone may create names in (sticky, as /tmp)
    ("checkpoint", "another user"),  # her checkpoint folder in a models/ made 0777 (an older version, umask 0)
    ("link", "symbolic link"),  # models/ as a link to her folder
])
def test_planted_weights_in_the_cache_dir_are_never_loaded(public_tmp, monkeypatch, plant, match):
    """A complete checkpoint already in ``$TIERKV_CACHE_DIR/models/<name>`` was loaded without any check: another
    user's folder supplied the weights. It is refused now; our own checkpoint still loads."""
    from tierkv import models

    monkeypatch.setattr(_SpyModel, "loaded", [])
    files = " ".join(f'"$1/{name}"' for name in models._CHECKPOINT_FILES)
    cache = public_tmp / "cache"
    cache.mkdir()
    cache.chmod(0o1777)
    checkpoint = cache / "models" / "smollm2-135m-instruct-q4_1-1.0"
    if plant == "checkpoint":
        (cache / "models").mkdir()
        (cache / "models").chmod(0o777)
        _as_other_user("sh", "-c", f'mkdir "$1" && touch {files}', "sh", str(checkpoint))
    elif plant == "models":
        _as_other_user("sh", "-c", f'mkdir -p "$1" && touch {files}', "sh", str(checkpoint))
    else:
        _as_other_user("sh", "-c", f'mkdir -p "$1/ck" && touch {files.replace("$1/", "$1/ck/")} && ln -s "$1" "$2"',
                       "sh", str(public_tmp / "hers"), str(cache / "models"))
        checkpoint = cache / "models" / "ck"
    unused = lambda _: pytest.fail("a complete checkpoint is never converted again")  # noqa: E731
    with pytest.raises(DiskTierError, match=match) as refused:
        models._load_checkpoint(checkpoint, unused, "", _SpyModel, "cpu")
    assert "tierkv refuses" in str(refused.value) and "Remove it" in str(refused.value)
    assert _SpyModel.loaded == []

    own = public_tmp / "own-cache" / "models" / checkpoint.name  # legitimate use: our own checkpoint loads
    own.mkdir(parents=True)
    for name in models._CHECKPOINT_FILES:
        (own / name).write_bytes(b"")
    with pytest.raises(_Loaded):
        models._load_checkpoint(own, unused, "", _SpyModel, "cpu")
    assert _SpyModel.loaded == [own]


# ---------------------------------------------------------------------- crafted conversation files
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[tuple[dict, bytes]]]:
    """A real conversation file (2 layers, 9 tokens, its ids known) and its records."""
    model = tiny_model("llama")
    ids, _ = prompt(1, 9, seed=1)
    path = tmp_path_factory.mktemp("saved") / "chat.tkv"
    with TieredCache(block_tokens=BT, disk_dir=path.parent / "d", persist=True) as cache:
        cache.load_prefix(model, ids)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        cache.save(path, model=model)
    return path, _records(path)


def _records(path: Path) -> list[tuple[dict, bytes]]:
    out, size = [], path.stat().st_size
    with open(path, "rb") as f:
        while f.tell() < size:
            header, payload = record.read(f)
            out.append((header, bytes(payload)))
    return out


def _write(path: Path, records: list[tuple[dict, bytes]]) -> None:
    with open(path, "wb") as f:
        for header, payload in records:
            head, body = record.encode(header, payload)
            f.write(head)
            f.write(body)


def _crafted(saved, index: int, **fields) -> list[tuple[dict, bytes]]:
    records = [(dict(h), p) for h, p in saved[1]]
    records[index][0].update(fields)
    return records


def _refused(path: Path, match: str, model=None) -> None:
    with pytest.raises(IntegrityError, match=match):
        TieredCache.load(path, model=model or tiny_model("llama"))  # load() requires the model


@pytest.mark.parametrize(("fields", "match"), [
    ({"block_tokens": "4"}, "block_tokens"),
    ({"block_tokens": 0}, "block_tokens"),
    ({"batch": 2}, "ids_shape"),
    ({"batch": None}, "batch"),
    ({"layers": {"0": 1}}, "layers"),
    ({"layers": [{"index": 0, "sliding_window": None, "dropped": 0}]}, "layers\\[0\\]"),
    ({"layers": [{"index": 0, "sliding_window": None, "dropped": 0, "length": 9},
                 {"index": "1", "sliding_window": None, "dropped": 0, "length": 9}]}, "layers\\[1\\].index"),
    ({"layers": [{"index": 0, "sliding_window": None, "dropped": 10, "length": 9},
                 {"index": 1, "sliding_window": None, "dropped": 0, "length": 9}]}, "dropped"),
    ({"layers": [{"index": 0, "sliding_window": -1, "dropped": 0, "length": 9},
                 {"index": 1, "sliding_window": None, "dropped": 0, "length": 9}]}, "sliding_window"),
    ({"ids_shape": [1, 10]}, "ids_shape"),
    ({"ids_shape": [1]}, "ids_shape"),
    ({"namespace": {"fingerprint": "x"}}, "namespace"),
    ({"fingerprint": None}, "fingerprint"),
    ({"fingerprint": "../../etc"}, "fingerprint"),
    ({"extra": 1}, "fields"),
])  # fmt: skip
def test_crafted_header_fields_are_refused(saved, tmp_path, fields, match):
    path = tmp_path / "crafted.tkv"
    _write(path, _crafted(saved, 0, **fields))
    _refused(path, match)


@pytest.mark.parametrize(("fields", "match"), [
    ({"layer": 7}, "layer"),
    ({"layer": "0"}, "layer"),
    ({"first": -1}, "first"),
    ({"dtype": "nn"}, "dtype"),
    ({"dtype": "int64"}, "dtype"),
    ({"shape": "[1]"}, "shape"),
    ({"shape": [1, 3, 2, 2, 2, 32]}, "block_tokens"),  # the same bytes as [1, 3, 2, 2, 4, 16]: once scrambled K/V
    ({"shape": [1, 3, 2, 4, 4, 8]}, "kv_heads|heads"),
    ({"shape": [1, 5, 2, 2, 4, 16]}, "blocks"),
    ({"kind": "conversation"}, "unexpected record"),
])  # fmt: skip
def test_crafted_kv_records_are_refused(saved, tmp_path, fields, match):
    path = tmp_path / "crafted.tkv"
    _write(path, _crafted(saved, 1, **fields))
    _refused(path, match)


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16", "float8_e4m3fn"])
def test_kv_records_in_another_dtype_than_the_models_are_refused_at_load(tmp_path, dtype):
    """A file saved without ``load_prefix`` names no dtype in its header: each K/V record's is checked against
    the model's at load (not at the first step, and never a bare error from a tier that cannot hold it)."""
    model = tiny_model("llama")
    ids, _ = prompt(1, 9, seed=2)
    path = tmp_path / "chat.tkv"
    with TieredCache(block_tokens=BT) as cache:
        with torch.no_grad():
            model(ids, past_key_values=cache)
        cache.save(path, model=model)
    records = _records(path)
    for i, (head, payload) in enumerate(records):
        if head["kind"] == "kv":
            kv = torch.frombuffer(bytearray(payload), dtype=torch.float32).to(getattr(torch, dtype))
            records[i] = ({**head, "dtype": dtype}, kv.view(torch.uint8).numpy().tobytes())
    _write(path, records)
    _refused(path, f"holds {dtype} K/V; the model computes float32")


def test_lengths_beyond_the_file_are_refused_before_allocating(saved, tmp_path):
    """A ~100-byte file claiming 10^15 bytes or 2^64 - 1 bytes of payload: an IntegrityError, not a MemoryError or
    an OverflowError; and under a 1 GiB address-space limit a 3 GiB claim is refused at once."""
    for claim in (10**15, 2**64 - 1, 3 << 30):
        head, _ = record.encode({"kind": "conversation"}, b"")
        prefix = bytearray(head[: record.PREFIX_BYTES])
        prefix[12:20] = claim.to_bytes(8, "little")
        path = tmp_path / f"claim-{claim}.tkv"
        path.write_bytes(bytes(prefix) + head[record.PREFIX_BYTES:] + bytes(64))
        _refused(path, "claims")
        with pytest.raises(IntegrityError, match="claims"):  # the asyncio reader checks the same
            asyncio.run(TieredCache.aload(path, model=tiny_model("llama")))
    out = _in_subprocess("""
        import sys
        from tierkv.errors import IntegrityError
        from tierkv.persist import record
        #LIMIT
        try:
            with open(sys.argv[1], "rb") as f:
                record.read(f, "claim")
        except IntegrityError as error:
            print("refused", error)
    """, str(tmp_path / f"claim-{3 << 30}.tkv"), limit_bytes=1 << 30)
    assert out.startswith("refused"), out


def test_a_fifo_is_not_a_conversation_file(tmp_path):
    os.mkfifo(tmp_path / "chat.tkv")
    out = _in_subprocess("""
        import sys
        from tierkv.errors import IntegrityError
        import torch
        from tierkv.hf import TieredCache
        try:
            TieredCache.load(sys.argv[1], model=torch.nn.Linear(1, 1))  # any model: the FIFO is refused at open
        except IntegrityError as error:
            print("refused", error)
    """, str(tmp_path / "chat.tkv"))
    assert out.startswith("refused") and "not a regular file" in out, out


def test_a_file_of_another_model_is_refused(saved, tmp_path):
    path, _ = saved
    with pytest.raises(InvalidConfigError, match="another model"):
        TieredCache.load(path, model=tiny_model("qwen2"))
    loaded = TieredCache.load(path, model=tiny_model("llama"))
    assert loaded.get_seq_length() == 9
    loaded.close()


def test_conversation_ids_and_payload_must_agree(saved, tmp_path):
    """The token ids' bytes must be exactly what ``ids_shape`` says, and a K/V record's payload exactly its shape."""
    records = [(dict(h), p) for h, p in saved[1]]
    records[0] = (records[0][0], records[0][1] + bytes(8))
    _write(tmp_path / "a.tkv", records)
    _refused(tmp_path / "a.tkv", "ids")
    records = [(dict(h), p) for h, p in saved[1]]
    records[1] = (records[1][0], records[1][1][:-4])
    _write(tmp_path / "b.tkv", records)
    _refused(tmp_path / "b.tkv", "payload bytes")
    assert np.frombuffer(saved[1][0][1], dtype="<i8").size == 9


# --------------------------------------------------------------------------- memory within the budgets
RSS_BUDGETS = """
def budgets(executor, context):
    if executor == "streaming":
        return 96 * 2**20, 32 * 2**20
    return TieredCache.min_device_bytes(config, context + 64, block_tokens=BLOCK), 16 * 2**20
"""


def test_rss_stays_within_small_budgets_with_most_kv_on_disk(tmp_path):
    """The issue's regression: with 200 MB of budgets and most of the KV on disk, RSS grew by more than the whole
    KV (bounce buffers of 32 MiB whatever the budgets: 1.9x the budgets for exact gather, 1.4x for streaming).
    The bounce buffers now shrink with the host memory the budgets give (``DiskTier.fit_bounce``): RSS grows by
    at most the budgets plus 25%, with 75%+ of the KV on disk, for both executors at ~130-200 MB of budgets."""
    env = {**ENV, "MALLOC_MMAP_THRESHOLD_": "131072"}  # glibc's retention is no buffer of tierkv's (see the docs)
    results = decode_rss(RSS_BUDGETS, [("exact_gather", 16384), ("streaming", 32768)], layers=4, max_positions=33280,
                         steps=3, env=env, directory=str(tmp_path))  # fmt: skip
    for executor, result in results.items():
        blocks = result["blocks"]
        assert blocks["disk"] >= 3 * (blocks["device"] + blocks["host"]), (executor, blocks)  # 75%+ on disk
        assert 100 * 2**20 < result["budgets"] < 200 * 2**20
        assert result["growth"] <= 1.25 * result["budgets"], (
            f"{executor}: RSS grew {result['growth'] / 2**20:.1f} MiB, budgets {result['budgets'] / 2**20:.1f} MiB")


# ------------------------------------------------------------------------------ checkpoints (demo --model)
class _Payload:
    """Unpickled, it would create ``marker``: a stand-in for code a crafted checkpoint runs."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoint_folders_fail_in_one_line_and_nothing_is_unpickled(tmp_path):
    """``tierkv demo --model DIR`` loads through :func:`tierkv.models.load_folder`: a pickle checkpoint is refused
    before anything reads it; a folder transformers cannot load (incomplete, corrupt) is one CheckpointError
    with the reason, never a traceback of another type."""
    import pickle

    from tierkv import models

    marker = tmp_path / "unpickled"
    model = tiny_model("llama")
    pickled = tmp_path / "pickled"
    model.config.save_pretrained(pickled)
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps({"weight": _Payload(str(marker))}))
    with pytest.raises(CheckpointError, match="pickle"):
        models.load_folder(pickled)
    assert not marker.exists()
    incomplete = tmp_path / "incomplete"
    model.config.save_pretrained(incomplete)
    corrupt = tmp_path / "corrupt"
    model.config.save_pretrained(corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\xff" * 64)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (broken / "model.safetensors").write_bytes(b"")
    for folder in (incomplete, corrupt, broken, tmp_path / "missing"):
        with pytest.raises(CheckpointError) as caught:
            models.load_folder(folder, what=f"--model {str(folder)!r}")
        assert str(caught.value).startswith(f"--model {str(folder)!r}") and "\n" not in str(caught.value)


def test_cli_json_and_a_bench_profile_replace_a_planted_link_instead_of_writing_through_it(tmp_path):
    """``--json PATH`` and a saved link profile are written to a fresh file renamed over PATH: a symlink planted
    there is replaced, and the file it pointed to is untouched."""
    from tierkv.bandwidth import LinkProfile
    from tierkv.cli import main

    victim = tmp_path / "victim"
    victim.write_text("keep me")
    for name in ("plan.json", "profile.json"):
        (tmp_path / name).symlink_to(victim)
    assert main(["plan", "--model", "llama-3-8b", "--context", "128K", "--gpu-gb", "20", "--cpu-gb", "64",
                 "--json", str(tmp_path / "plan.json")]) == 0
    LinkProfile.from_presets().save(tmp_path / "profile.json")
    assert victim.read_text() == "keep me"
    for name in ("plan.json", "profile.json"):
        path = tmp_path / name
        assert not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600
    assert json.loads((tmp_path / "plan.json").read_text())
