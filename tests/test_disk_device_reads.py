"""Disk reads straight into device memory (kvikio with GPUDirect Storage) and their on-device checksum.

Where the disk tier's engine reads into GPU memory (``DiskFile.reads_device_memory``: kvikio not in compat
mode), a CUDA store's disk blocks land in the device landing buffer without a host bounce and are verified
there with :func:`~tierkv.tiers.disk.positional_sums`, which the write side stores beside the xxh3-64. On a
CPU-only host the path runs on the CUDA stand-in with the posix engine flagged as device-capable (its reads
are real file I/O into the stand-in's device memory); the real GDS test needs a GPU and kvikio (``cuda``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models import tiny_model
from transformers import DynamicCache

from tierkv import IntegrityError, TieredCache, cuda_standin
from tierkv import settings as tierkv_settings
from tierkv.io import posix
from tierkv.tiers import disk as disk_module
from tierkv.tiers.disk import positional_sums


def reference_sums(row: np.ndarray) -> tuple[int, int]:
    words = row.view(np.uint16).astype(object)
    return int(words.sum()), int(sum(int(w) * (i % 65521 + 1) for i, w in enumerate(words)))


def test_positional_sums_are_exact_integers() -> None:
    rows = np.random.default_rng(0).integers(0, 256, (3, 8192), dtype=np.uint8)
    rows[2] = 255  # the largest words: no overflow
    sums = positional_sums(torch.from_numpy(rows))
    assert [tuple(map(int, s)) for s in sums] == [reference_sums(r) for r in rows]


def test_positional_sums_catch_flips_swaps_and_zeroed_sectors() -> None:
    rng = np.random.default_rng(1)
    row = rng.integers(0, 256, (1, 1 << 17), dtype=np.uint8)
    base = positional_sums(torch.from_numpy(row))
    changed = []
    for position in rng.integers(0, row.shape[1], 20):
        flipped = row.copy()
        flipped[0, position] ^= 1 << int(rng.integers(0, 8))
        changed.append(flipped)
    swapped = row.copy()
    swapped[0, :4096], swapped[0, 4096:8192] = row[0, 4096:8192], row[0, :4096]
    zeroed = row.copy()
    zeroed[0, 8192:12288] = 0
    for bad in [*changed, swapped, zeroed]:
        assert not torch.equal(positional_sums(torch.from_numpy(bad)), base)


@pytest.fixture
def device_capable_posix(monkeypatch: pytest.MonkeyPatch) -> None:
    """The posix engine claims to read into device memory, as kvikio does with GDS (its I/O stays real)."""
    monkeypatch.setattr(posix.PosixFile, "reads_device_memory", True, raising=False)


def _cache(model, tmp_path):
    budget = TieredCache.min_device_bytes(model.config, 64, block_tokens=4, device="cpu") + 8 * 1024
    return TieredCache(gpu_gb=f"{budget}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4, config=model.config,
                       disk_engine="posix")


def test_device_direct_reads_on_the_standin_are_exact_and_ordered(tmp_path, device_capable_posix, monkeypatch):
    """Decoding with the disk read into the device landing buffer: the same tokens as DynamicCache, no host
    bounce used for a decode read, and no access the stand-in's race detector flags."""
    model = tiny_model("llama")
    ids = torch.randint(2, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    ref = model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=DynamicCache())
    on_device = []
    finish = disk_module._DiskRead._finish_on_device

    def counting(self, dests, landing):
        on_device.append(len(self.slots))
        finish(self, dests, landing)

    monkeypatch.setattr(disk_module._DiskRead, "_finish_on_device", counting)
    with tierkv_settings.override(cuda_standin=True, prefetch_min=0, direct_io=False):  # the landing buffer is
        standin = cuda_standin.fresh()  # torch's CPU memory here (not 4 KiB aligned); cuFile takes any address
        with _cache(model, tmp_path) as cache:
            out = model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=cache)
            assert cache.stats()["blocks"]["disk"] >= 8 and cache.stats()["mover"] == "cuda-stream"
    assert torch.equal(out, ref)
    standin.check()
    assert sum(on_device) >= 8


def test_a_flipped_byte_read_into_device_memory_raises(tmp_path, device_capable_posix):
    model = tiny_model("llama")
    ids = torch.randint(2, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    with tierkv_settings.override(cuda_standin=True, prefetch_min=0, direct_io=False):
        cuda_standin.fresh()
        with _cache(model, tmp_path) as cache:
            model.generate(ids, max_new_tokens=1, do_sample=False, past_key_values=cache)
            slot_file = next(iter(cache.store.tiers[max(cache.store.tiers)].files.values()))
            assert slot_file.device_reads and slot_file.written.any()
            slot = int(np.flatnonzero(slot_file.written)[0])
            with open(slot_file.path, "r+b") as f:
                f.seek(slot * slot_file.slot_bytes + 100)
                byte = f.read(1)[0]
                f.seek(slot * slot_file.slot_bytes + 100)
                f.write(bytes([byte ^ 0x10]))
            with pytest.raises(IntegrityError, match=f"slot {slot} "):
                model.generate(torch.cat([ids, ids[:, :1]], dim=1), max_new_tokens=1, do_sample=False,
                               past_key_values=cache)


@pytest.mark.cuda
def test_kvikio_gds_reads_into_device_staging(tmp_path):
    """On a GPU with kvikio in GDS mode: the decode reads disk blocks into device memory, exact tokens.
    Never run yet (no GPU has been lent with kvikio installed): see docs/reliability.md."""
    kvikio = pytest.importorskip("kvikio")
    from tierkv.io.kvikio_engine import _compat_mode_on

    if _compat_mode_on():
        pytest.skip(f"kvikio {kvikio.__version__} is in compat mode here: no GPUDirect Storage to test")
    model = tiny_model("llama").cuda()
    ids = torch.randint(2, 128, (1, 48), generator=torch.Generator().manual_seed(0)).cuda()
    ref = model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=DynamicCache())
    budget = TieredCache.min_device_bytes(model.config, 64, block_tokens=4, device="cuda") + 8 * 1024
    with TieredCache(gpu_gb=f"{budget}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4, config=model.config,
                     disk_engine="kvikio") as cache:
        out = model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=cache)
        slot_file = next(iter(cache.store.tiers[max(cache.store.tiers)].files.values()))
        assert slot_file.device_reads and cache.stats()["blocks"]["disk"] >= 8
    assert torch.equal(out, ref)
