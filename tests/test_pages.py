"""Page reads (``KVStore.read_pages``): token ranges inside blocks, from the device, host and disk tiers of a real
cache in one call, bit-exact against ``read_tokens``; disk pages read as verified 4 KiB sectors (a flipped byte in
a page's sector raises, a page elsewhere in the same block still reads), counted as the sectors read."""

from __future__ import annotations

import gc
import itertools
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tierkv import IntegrityError, InvalidConfigError, TieredCache, accel, cuda_standin
from tierkv import settings as tierkv_settings
from tierkv.blocks import Tier
from tierkv.io import aligned_empty
from tierkv.io.checksum import xxh3_rows
from tierkv.store import KVStore
from tierkv.tiers.disk import SECTOR_BYTES, DiskTier, _runs

SENTINEL = -3.0


def filled(tmp_path: Path, batch: int, heads: int, dim: int, block_tokens: int, blocks: int, dtype: torch.dtype,
           engine: str = "native", layers: int = 2, seed: int = 0) -> tuple[TieredCache, KVStore]:
    """A real cache whose layers hold ``blocks`` full blocks of random K/V per row, spread over all three tiers:
    the first third of each layer's blocks moved to disk, the next third to the host, the rest on the device."""
    cache = TieredCache(gpu_gb="8MB", cpu_gb="8MB", disk_dir=tmp_path, block_tokens=block_tokens, disk_engine=engine)
    generator = torch.Generator().manual_seed(seed)
    tokens = blocks * block_tokens
    store = None
    for layer in range(layers):
        for _ in range(2):  # two appends: the second lands beside the first
            keys, values = (torch.randn(batch, heads, tokens // 2, dim, generator=generator).to(dtype) for _ in "kv")
            store = cache.runtime.open_store(keys)
            store.append(layer, keys, values)
    assert store is not None
    third = blocks // 3
    live = list(store.table.blocks.values())
    store.demote([b for b in live if b.index < 2 * third])
    store.demote([b for b in live if b.index < third])
    store.writeback.reap(wait=True)
    counts = store.stats()["blocks"]
    assert counts["device"] and counts["host"] and counts["disk"], counts
    return cache, store


def selection(store: KVStore, layer: int, count: int, page_tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random ``[B, count]`` columns (about a fifth -1) and pages, each row its own, repeats allowed."""
    rng = np.random.default_rng(seed)
    rows = store.table.rows[layer]
    columns = rng.integers(0, rows.count, size=(rows.batch, count))
    columns[rng.random(columns.shape) < 0.2] = -1
    return columns, rng.integers(0, store.block_tokens // page_tokens, size=columns.shape)


def expected(store: KVStore, layer: int, columns: np.ndarray, pages: np.ndarray, page_tokens: int,
             dest: torch.Tensor) -> torch.Tensor:
    """What ``dest`` must hold after the read: ``read_tokens`` sliced at every page's token range."""
    full = store.read_tokens(layer)
    want = dest.clone()
    bt = store.block_tokens
    for b, k in zip(*np.nonzero(columns >= 0)):
        start = int(columns[b, k]) * bt + int(pages[b, k]) * page_tokens
        want[:, b, :, k * page_tokens : (k + 1) * page_tokens] = full[:, b, :, start : start + page_tokens]
    return want


def tiers_of(store: KVStore, layer: int, columns: np.ndarray) -> np.ndarray:
    rows = store.table.rows[layer]
    picked = rows.tiers[np.arange(rows.batch)[:, None], np.where(columns < 0, 0, columns)]
    return picked[columns >= 0]


GEOMETRIES = [  # batch, kv heads, head dim, block tokens, page tokens, dtype
    (2, 2, 64, 64, 8, torch.bfloat16),  # 1 KiB runs, 2 sectors per head: pages share sectors
    (3, 4, 32, 32, 16, torch.float16),  # runs of exactly one sector
    (1, 1, 16, 16, 4, torch.float32),  # a whole block in one sector
    (2, 3, 24, 48, 12, torch.float32),  # runs across sector boundaries, a padded slot
]


@pytest.mark.parametrize(("batch", "heads", "dim", "bt", "pt", "dtype"), GEOMETRIES)
def test_pages_from_every_tier_match_read_tokens(tmp_path, batch, heads, dim, bt, pt, dtype):
    cache, store = filled(tmp_path, batch, heads, dim, bt, blocks=12, dtype=dtype)
    with cache:
        for layer in range(2):
            for seed in range(3):
                columns, pages = selection(store, layer, 9, pt, seed=seed + 10 * layer)
                assert set(tiers_of(store, layer, columns).tolist()) == {Tier.DEVICE, Tier.HOST, Tier.DISK}
                dest = torch.full((2, batch, heads, 9 * pt + 5, dim), SENTINEL, dtype=dtype)
                want = expected(store, layer, columns, pages, pt, dest)
                store.read_pages(layer, columns, pages, pt, dest)
                assert torch.equal(dest, want)  # the -1 positions and the extra tokens are left alone
        store.check()


def test_bytes_counted_per_link_are_pages_and_disk_sectors(tmp_path):
    """Memory tiers count the page bytes; the disk counts the 4 KiB sectors it read: fewer than whole blocks."""
    cache, store = filled(tmp_path, 2, 2, 64, 64, blocks=12, dtype=torch.bfloat16)
    with cache:
        layout = store.layouts[0]
        columns, pages = selection(store, 0, 10, 8, seed=5)
        tiers = tiers_of(store, 0, columns)
        before = dict(store.bytes_moved)
        store.read_pages(0, columns, pages, 8, torch.zeros(2, 2, 2, 80, 64, dtype=torch.bfloat16))
        moved = {name: store.bytes_moved[name] - before.get(name, 0) for name in store.bytes_moved}
        page_bytes = 8 * layout.token_bytes
        assert moved["device->device"] == np.count_nonzero(tiers == Tier.DEVICE) * page_bytes
        assert moved["host->device"] == np.count_nonzero(tiers == Tier.HOST) * page_bytes
        on_disk = np.count_nonzero(tiers == Tier.DISK)
        assert on_disk and moved["disk->device"] % SECTOR_BYTES == 0
        assert on_disk * page_bytes <= moved["disk->device"] < on_disk * layout.block_bytes
        assert moved["disk->device"] <= on_disk * 2 * layout.kv_heads * SECTOR_BYTES  # one sector per run


def flip(path: Path, position: int) -> None:
    """Change one byte of the file on disk, as a failing drive or another program would."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, position)[0] ^ 0x5A]), position)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("engine", ["posix", "native"])
def test_a_flipped_byte_in_a_page_sector_raises_and_other_sectors_read(tmp_path, engine):
    """bf16, 64 tokens x 64 dims: each head's K is two sectors, pages 0-3 in the first, 4-7 in the second. A byte
    flipped in page 1's run of head 0's K: reading page 0 or 1 (same sector) of that block raises, naming the
    file and slot; page 5 of that block, and the block's other pages of untouched sectors, read exactly."""
    cache, store = filled(tmp_path, 1, 2, 64, 64, blocks=12, dtype=torch.bfloat16, engine=engine, layers=1)
    with cache:
        rows = store.table.rows[0]
        column = int(np.flatnonzero(rows.tiers[0] == Tier.DISK)[0])
        slot = int(rows.slots[0, column])
        slot_file = next(iter(store.tiers[Tier.DISK].files.values()))
        full = store.read_tokens(0)
        flip(slot_file.path, slot * slot_file.slot_bytes + 1 * 8 * 64 * 2 + 100)  # page 1, head 0's K
        dest = torch.full((2, 1, 2, 8, 64), SENTINEL, dtype=torch.bfloat16)
        for page in (0, 1):
            with pytest.raises(IntegrityError, match=f"sector checksum mismatch .* slot {slot} ") as info:
                store.read_pages(0, np.array([[column]]), np.array([[page]]), 8, dest)
            assert str(slot_file.path) in str(info.value) and "cache.reset()" in str(info.value)
        assert (dest == SENTINEL).all()  # nothing of the bad sector was copied
        for page in (4, 5, 7):  # the second sector of every head: untouched
            store.read_pages(0, np.array([[column]]), np.array([[page]]), 8, dest)
            start = column * 64 + page * 8
            assert torch.equal(dest, full[..., start : start + 8, :])
        with pytest.raises(IntegrityError):  # the whole-block path still verifies the slot
            store.read_tokens(0)


def test_reads_larger_than_the_bounce_limit_run_in_rounds(tmp_path):
    cache, store = filled(tmp_path, 2, 2, 64, 64, blocks=12, dtype=torch.bfloat16, layers=1)
    with cache:
        store.tiers[Tier.DISK].bounce_bytes = 3 * SECTOR_BYTES  # a page's four sectors: one page per round
        columns, pages = selection(store, 0, 24, 8, seed=9)
        dest = torch.full((2, 2, 2, 24 * 8, 64), SENTINEL, dtype=torch.bfloat16)
        want = expected(store, 0, columns, pages, 8, dest)
        reads = []
        submit = store.tiers[Tier.DISK].read_sectors

        def counting(*args):
            reads.append(args[1].size)
            return submit(*args)

        store.tiers[Tier.DISK].read_sectors = counting
        store.read_pages(0, columns, pages, 8, dest)
        assert torch.equal(dest, want)
        assert len(reads) == np.count_nonzero(tiers_of(store, 0, columns) == Tier.DISK) and max(reads) <= 4


def test_one_engine_submission_per_call(tmp_path):
    """Every disk page of a call, in any rows, is one batched engine submission of coalesced sector runs."""
    cache, store = filled(tmp_path, 3, 2, 32, 32, blocks=12, dtype=torch.float16, layers=1)
    with cache:
        rows = store.table.rows[0]
        columns = np.tile(np.flatnonzero(rows.tiers[0] == Tier.DISK), (3, 1))  # every disk block, every page
        pages = np.tile(np.arange(columns.shape[1]) % 2, (3, 1))
        columns = np.concatenate([columns, columns], axis=1)
        pages = np.concatenate([pages, 1 - pages], axis=1)
        dest = torch.zeros(2, 3, 2, columns.shape[1] * 16, 32, dtype=torch.float16)
        want = expected(store, 0, columns, pages, 16, dest)
        slot_file = next(iter(store.tiers[Tier.DISK].files.values()))
        calls = []
        submit = slot_file.file.submit_array

        def counting(offsets, *args, **kwargs):
            calls.append(len(offsets))
            return submit(offsets, *args, **kwargs)

        slot_file.file.submit_array = counting
        store.read_pages(0, columns, pages, 16, dest)
        assert torch.equal(dest, want)
        # both pages of every disk block of every row: whole slots, coalesced across consecutive slots
        assert len(calls) == 1 and calls[0] <= np.count_nonzero(rows.tiers == Tier.DISK)


def chunk_of(store: KVStore, layer: int, tier: Tier) -> np.ndarray:
    """``[B, columns]``: the slab chunk holding each block of ``layer`` on the memory tier ``tier`` (-1 elsewhere)."""
    rows = store.table.rows[layer]
    pool = store.tiers[tier].pools[store.layouts[layer].slot_bytes]
    chunks = pool.locate(np.where(rows.tiers == tier, rows.slots, 0))[0]
    return np.where(rows.tiers == tier, chunks, -1)


def test_pages_across_many_slab_chunks(tmp_path):
    """Memory tiers whose pools hold several chunks: pages from all of them in one call, exact, and the Python the
    call runs is the same whether its pages sit in one chunk per tier or are spread over every chunk — apart from
    the accelerator backend's own copy calls, one per chunk in device memory (``_Sink.land``; the CUDA stand-in
    also records each one), which are not counted."""
    cache, store = filled(tmp_path, 2, 2, 64, 64, blocks=48, dtype=torch.bfloat16, layers=2)
    with cache:
        for tier in (Tier.DEVICE, Tier.HOST):
            assert len(store.tiers[tier].pools[store.layouts[0].slot_bytes].chunks) >= 3
        for seed in range(3):
            columns, pages = selection(store, 0, 40, 8, seed=seed)
            for tier in (Tier.DEVICE, Tier.HOST):
                chunks = chunk_of(store, 0, tier)[np.arange(2)[:, None], columns][columns >= 0]
                assert np.unique(chunks[chunks >= 0]).size >= 3
            dest = torch.full((2, 2, 2, 40 * 8, 64), SENTINEL, dtype=torch.bfloat16)
            want = expected(store, 0, columns, pages, 8, dest)
            store.read_pages(0, columns, pages, 8, dest)
            assert torch.equal(dest, want)

        backends = {accel.__file__, cuda_standin.__file__}

        def events(columns: np.ndarray) -> int:
            count = 0

            def tracer(frame, event, arg):
                nonlocal count
                if event == "call":
                    caller = frame
                    while caller is not None:
                        if caller.f_code.co_filename in backends:
                            return None  # the backend's copy call and what it runs
                        caller = caller.f_back
                count += 1
                return tracer

            dest = torch.zeros(2, 2, 2, columns.shape[1] * 8, 64, dtype=torch.bfloat16)
            pages = np.arange(columns.size).reshape(columns.shape) % 8
            gc.collect()  # the call's own Python: no collector (and the finalizers it runs) inside
            gc.disable()
            sys.settrace(tracer)
            try:
                store.read_pages(0, columns, pages, 8, dest)
            finally:
                sys.settrace(None)
                gc.enable()
            return count

        device, host = chunk_of(store, 0, Tier.DEVICE), chunk_of(store, 0, Tier.HOST)
        for b in range(2):
            assert np.unique(device[b][device[b] >= 0]).size >= 2 and np.unique(host[b][host[b] >= 0]).size >= 2

        def pick(spread: bool) -> np.ndarray:
            """Per row: 8 device and 8 host blocks, from one chunk of each tier or from every chunk."""
            picked = []
            for b in range(2):
                row = []
                for chunks in (device[b], host[b]):
                    held = np.flatnonzero(chunks >= 0)
                    if spread:
                        groups = [held[chunks[held] == c] for c in np.unique(chunks[held])]
                        row += [int(g[i // len(groups) % len(g)]) for i, g in
                                zip(range(8), itertools.cycle(groups))]
                    else:
                        row += np.repeat(held[chunks[held] == chunks[held][0]], 8)[:8].tolist()
                picked.append(row)
            return np.array(picked)

        assert events(pick(spread=False)) == events(pick(spread=True))


def test_bad_arguments_are_refused(tmp_path):
    cache, store = filled(tmp_path, 1, 2, 16, 16, blocks=6, dtype=torch.float32, layers=1)
    with cache:
        dest = torch.zeros(2, 1, 2, 8, 16)
        ok = np.array([[0, 1]])
        with pytest.raises(InvalidConfigError, match="divisor"):
            store.read_pages(0, ok, ok, 5, dest)
        with pytest.raises(InvalidConfigError, match=r"pages must be in \[0, 4\)"):
            store.read_pages(0, ok, np.array([[0, 4]]), 4, dest)
        with pytest.raises(InvalidConfigError, match="full blocks only"):
            store.read_pages(0, np.array([[0, 6]]), ok, 4, dest)
        with pytest.raises(InvalidConfigError, match="dest"):
            store.read_pages(0, ok, ok, 4, torch.zeros(2, 1, 2, 7, 16))
        with pytest.raises(InvalidConfigError, match="contiguous"):
            store.read_pages(0, ok, ok, 4, torch.zeros(2, 1, 2, 16, 8).transpose(3, 4))
        keys = torch.randn(1, 2, 3, 16)
        store.append(0, keys, keys)  # an open tail: column 6 holds 3 of 4 tokens
        with pytest.raises(InvalidConfigError, match="full blocks only"):
            store.read_pages(0, np.array([[6, -1]]), ok, 4, dest)


def test_page_reads_follow_the_gpu_protocol_on_the_standin(tmp_path):
    """The accelerator path (pinned staging, one copy per tier, index ops on the stream) on the CPU stand-in:
    exact pages, no pageable copy, and no access its race detector flags."""
    with tierkv_settings.override(cuda_standin=True, prefetch_min=0):
        standin = cuda_standin.fresh()
        cache, store = filled(tmp_path, 2, 2, 64, 64, blocks=12, dtype=torch.bfloat16)
        with cache:
            for seed in range(3):
                columns, pages = selection(store, 1, 9, 8, seed=seed)
                dest = store.transfer.accel.empty_blocks((2, 2, 2, 72, 64), torch.bfloat16, store.device.device)
                dest.fill_(SENTINEL)
                want = expected(store, 1, columns, pages, 8, dest)
                pageable = standin.pageable_copies
                store.read_pages(1, columns, pages, 8, dest)
                standin.used(dest)  # attention reads it on the compute stream
                assert torch.equal(dest, want) and standin.pageable_copies == pageable
    standin.check()


@pytest.mark.parametrize("seed", range(5))
def test_sector_runs_match_a_plain_scan(seed):
    """The coalescing of a page read's sorted, unique sectors into runs (``disk._runs``), against a plain scan:
    empty, single, all-consecutive and scattered inputs."""
    rng = np.random.default_rng(seed)
    cases = [np.zeros(0, np.int64), np.array([7]), np.arange(5, 12)]
    cases += [np.unique(rng.integers(0, 3 * n + 1, size=n)) for n in (2, 9, 200)]
    for items in cases:
        want_first, want_count = [], []
        for i, item in enumerate(items.tolist()):
            if i and item == items[i - 1] + 1:
                want_count[-1] += 1
            else:
                want_first.append(i)
                want_count.append(1)
        first, count = _runs(items.astype(np.int64))
        assert first.tolist() == want_first and count.tolist() == want_count


@pytest.mark.parametrize("seed", range(6))
def test_round_plans_match_each_rounds_own_runs(tmp_path, seed):
    """``DiskTier.plan_rounds`` (all rounds at once) against each round's slots coalesced on their own
    (``disk._runs`` of the round): the same requests, round by round, for random slot orders and round sizes."""
    rng = np.random.default_rng(seed)
    slot = 2 * SECTOR_BYTES
    tier = DiskTier(tmp_path / "disk", 1 << 22)
    try:
        tier.alloc(slot)  # the slot file exists
        for _ in range(20):
            n = int(rng.integers(1, 40))
            slots = np.cumsum(rng.choice([1, 1, 1, 2, 5, -3], size=n))  # runs, gaps, steps back
            slots -= min(int(slots.min()), 0)  # slot ids are not negative
            per_round = int(rng.integers(1, n + 2))
            plans = tier.plan_rounds(slot, slots, per_round)
            assert len(plans) == -(-n // per_round)
            for k, plan in enumerate(plans):
                own = slots[k * per_round : (k + 1) * per_round]
                first, count = _runs(own)
                assert plan.offsets.tolist() == (own[first] * slot).tolist()
                assert plan.lengths.tolist() == (count * slot).tolist()
                assert plan.starts.tolist() == (first * slot).tolist()
                assert plan.extent == own.size * slot and plan.units == own.size
    finally:
        tier.close()


@pytest.mark.parametrize("per_round", [1, 3, 4, 64])
def test_rounds_planned_once_read_the_slots_of_each_round(tmp_path, per_round):
    """``DiskTier.plan_rounds``: each round's requests (a run of consecutive slots cut where a round starts) read
    that round's slots into its own buffer from byte 0, with the digests of what was written, again and again,
    into any buffer; against the slots read one by one."""
    slot = 2 * SECTOR_BYTES
    tier = DiskTier(tmp_path / "disk", 1 << 22)
    try:
        slots = [tier.alloc(slot) for _ in range(24)]
        assert None not in slots
        data = np.random.default_rng(per_round).integers(0, 256, (24, slot), dtype=np.uint8)
        source = aligned_empty(data.nbytes)
        source[:] = data.reshape(-1)
        tier.write(slot, np.array(slots), source).wait()
        order = np.array([5, 6, 7, 8, 2, 3, 11, 12, 13, 14, 15, 0, 23])  # runs that cross round boundaries
        wanted = np.array(slots)[order]
        plans = tier.plan_rounds(slot, wanted, per_round)
        assert len(plans) == -(-order.size // per_round)
        for _ in range(2):  # planned once, read twice into fresh buffers
            for k, plan in enumerate(plans):
                rows = order[k * per_round : (k + 1) * per_round]
                buffer = aligned_empty(len(rows) * slot)
                handle, digests = tier.read(slot, wanted[k * per_round : (k + 1) * per_round], buffer, plan)
                handle.wait()
                np.testing.assert_array_equal(buffer.reshape(len(rows), slot), data[rows])
                if digests is not None:
                    np.testing.assert_array_equal(digests, xxh3_rows(data[rows]))
                    tier.files[slot].verify(wanted[k * per_round : (k + 1) * per_round], digests)
        with pytest.raises(ValueError, match="outside"):  # a buffer smaller than its round: refused, nothing read
            tier.read(slot, wanted[:per_round], aligned_empty(slot // 2), plans[0])
    finally:
        tier.close()
