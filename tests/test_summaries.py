"""Key summaries (tierkv.store.summaries) against the keys they summarise, their device reservation, and the store
keeping them with its blocks (tierkv.attention.sparse_store)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import kv, make_store

from tierkv.attention.sparse_store import SparseBlocks
from tierkv.blocks import Tier
from tierkv.errors import BudgetTooSmallError, InvalidConfigError
from tierkv.store.summaries import KeySummaries


class Reservation:
    """Counts what a KeySummaries reserves; refuses once ``limit`` bytes would be exceeded."""

    def __init__(self, limit: int | None = None) -> None:
        self.held, self.limit = 0, limit

    def reserve(self, nbytes: int) -> None:
        if self.limit is not None and self.held + nbytes > self.limit:
            raise BudgetTooSmallError("no room")
        self.held += nbytes

    def unreserve(self, nbytes: int) -> None:
        self.held -= nbytes


@pytest.mark.parametrize("page_tokens", [None, 1, 2, 4])
def test_the_bound_is_above_every_key_logit_and_the_mean_logit_is_exact(page_tokens):
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randn(6, 2, 2, 4, 8, generator=generator, dtype=torch.float64)  # [n, 2, H_kv, bt, D]
    summaries = KeySummaries(torch.device("cpu"), Reservation().reserve, Reservation().unreserve,
                             page_tokens=page_tokens)
    summaries.add(0, list(range(6)), blocks)
    pages = 4 // (page_tokens or 4)
    rows = torch.from_numpy(summaries.rows(np.arange(6)))
    table = summaries.table(0)[:, rows]  # [H_kv, n, pages, 4, D]: keys' min, max, mean, values' mean of each page
    assert table.shape == (2, 6, pages, 4, 8)
    q = torch.randn(2, 8, generator=generator, dtype=torch.float64)  # one query per KV head
    keys = blocks[:, 0].transpose(0, 1).unflatten(2, (pages, -1))  # [H_kv, n, pages, page_tokens, D]
    logits = torch.einsum("hd,hnptd->hnpt", q, keys)
    lo, hi, mean = table[..., 0, :], table[..., 1, :], table[..., 2, :]
    bound = (q.clamp(min=0)[:, None, None] * hi + q.clamp(max=0)[:, None, None] * lo).sum(-1)  # [H_kv, n, pages]
    assert (bound[..., None] >= logits - 1e-12).all()
    torch.testing.assert_close(torch.einsum("hd,hnpd->hnp", q, mean), logits.mean(-1))
    values = blocks[:, 1].transpose(0, 1).unflatten(2, (pages, -1))  # [H_kv, n, pages, page_tokens, D]
    torch.testing.assert_close(table[..., 3, :], values.mean(3))
    if pages > 1:  # tighter than one summary of the block: some page's bound is below the block's
        block_bound = (q.clamp(min=0)[:, None] * keys.amax((2, 3)) + q.clamp(max=0)[:, None] * keys.amin((2, 3)))
        assert (bound < block_bound.sum(-1)[..., None] - 1e-9).any()


def test_fp32_keys_are_summarised_in_bf16_with_the_bound_rounded_outward():
    """fp32 K/V get bf16 summaries (half the bytes): every key still lies in its page's stored [min, max], on every
    channel, so Quest's bound over them still bounds every logit; the means are within bf16's rounding; the rest copy
    is coded on the stored bounds and decodes within half a step of the keys."""
    generator = torch.Generator().manual_seed(1)
    blocks = torch.randn(5, 2, 2, 32, 16, generator=generator) * 3 + 0.01  # values that bf16 rounds
    summaries = KeySummaries(torch.device("cpu"), Reservation().reserve, Reservation().unreserve, rest_bits=8,
                             page_tokens=8)
    summaries.add(0, list(range(5)), blocks)
    table = summaries.table(0)[:, torch.from_numpy(summaries.rows(np.arange(5)))]  # [H_kv, 5, pages, 4, D]
    assert table.dtype == torch.bfloat16
    keys = blocks[:, 0].transpose(0, 1).unflatten(2, (4, 8))  # [H_kv, n, pages, page_tokens, D]
    lo, hi = table[..., 0, :].float()[..., None, :], table[..., 1, :].float()[..., None, :]
    assert (keys >= lo).all() and (keys <= hi).all()
    assert ((lo.squeeze(-2) < keys.amin(3)) | (hi.squeeze(-2) > keys.amax(3))).any()  # some were rounded outward
    torch.testing.assert_close(table[..., 2, :].float(), keys.mean(3), atol=0.02, rtol=0.01)
    rows = torch.from_numpy(summaries.rows(np.arange(5)))
    decoded, _ = summaries.rest(0, (rows[:, None] * 4 + torch.arange(4)).ravel(), torch.float32)
    step = (hi - lo).flatten(1, 2) / 255
    assert ((decoded - keys.flatten(1, 2)).abs() <= step / 2 + 1e-5).all()


def test_a_page_size_that_does_not_divide_the_block_is_refused_by_name():
    summaries = KeySummaries(torch.device("cpu"), Reservation().reserve, Reservation().unreserve, page_tokens=3)
    with pytest.raises(InvalidConfigError, match="page_tokens=3 does not divide"):
        summaries.add(0, [0], torch.randn(1, 2, 2, 4, 8))
    with pytest.raises(InvalidConfigError, match="page_tokens=0"):
        KeySummaries(torch.device("cpu"), Reservation().reserve, Reservation().unreserve, page_tokens=0)


def test_rows_are_reused_after_release_and_clear_gives_every_byte_back():
    reservation = Reservation()
    summaries = KeySummaries(torch.device("cpu"), reservation.reserve, reservation.unreserve)
    blocks = torch.randn(3, 2, 2, 4, 8)
    summaries.add(0, [10, 11, 12], blocks)
    assert reservation.held == summaries.nbytes > 0 and len(summaries) == 3
    row = int(summaries.rows(np.array([11]))[0])
    summaries.release(11)
    assert summaries.rows(np.array([11, 99]))[0] == -1 and summaries.rows(np.array([99]))[0] == -1
    summaries.add(0, [13], blocks[:1])
    assert int(summaries.rows(np.array([13]))[0]) == row  # the freed row, no growth
    summaries.clear()
    assert reservation.held == 0 and len(summaries) == 0 and summaries.table(0) is None


def test_a_refused_reservation_leaves_the_summaries_as_they_were():
    row_bytes = 4 * 2 * 8 * 2  # min, max, mean, mean value of 2 heads x 8 channels, bf16 (of fp32 KV)
    reservation = Reservation(limit=8 * row_bytes)  # the first table (8 rows), no growth
    summaries = KeySummaries(torch.device("cpu"), reservation.reserve, reservation.unreserve)
    summaries.add(0, list(range(8)), torch.randn(8, 2, 2, 4, 8))
    before = summaries.table(0).clone()
    with pytest.raises(BudgetTooSmallError):
        summaries.add(0, [8, 9], torch.randn(2, 2, 2, 4, 8))
    assert len(summaries) == 8 and (summaries.rows(np.array([8, 9])) == -1).all()
    assert torch.equal(summaries.table(0), before) and reservation.held == summaries.nbytes


def test_summaries_enabled_late_are_backfilled_from_every_tier_and_kept_with_the_blocks(tmp_path):
    store = make_store(tmp_path, device_slots=6, host_slots=4)
    keys, values = kv(2, 30, seed=1)
    store.append(0, keys, values)  # 7 full blocks a row, spread over device, host and disk
    assert {b.tier for b in store.table.blocks.values()} >= {Tier.HOST, Tier.DISK}
    sparse = SparseBlocks(store)
    summaries = sparse.enable_summaries()
    assert sparse.enable_summaries() is summaries  # the same rest_bits: kept
    full = store.table.rows[0].ids[:, :7]
    table = summaries.table(0)[:, torch.from_numpy(summaries.rows(full.ravel()))]  # [H_kv, B·7, 1, 4, D]
    blocks = keys[:, :, :28].unflatten(2, (7, 4))  # [B, H_kv, 7, bt, D]
    expected = blocks.amax(dim=3).permute(1, 0, 2, 3).flatten(1, 2)  # [H_kv, B·7, D]
    stored = table[:, :, 0, 1].float()  # bf16 for fp32 KV: the max rounded up, by at most one bf16 step
    assert (stored >= expected).all()
    torch.testing.assert_close(stored, expected, rtol=2**-7, atol=0)
    assert store.device.reserved == summaries.nbytes  # counted in the device budget
    store.append(0, *kv(2, 2, seed=2))  # the tail fills: its summary is added by the store
    assert (summaries.rows(store.table.rows[0].ids[:, 7]) >= 0).all()
    replaced = sparse.enable_summaries(rest_bits=4)  # other rest_bits: rebuilt, the old bytes given back
    assert replaced is not summaries and store.summaries is replaced
    assert store.device.reserved == replaced.nbytes
    store.crop(0, 32)
    assert len(replaced) == 0  # freed with their blocks
    store.close()
    assert store.device.reserved == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_planners_summary_size_is_the_tables(dtype):
    """tierkv.staging.summary_element_size (torch-free, for the planner and sizing) agrees with the table."""
    from tierkv.staging import summary_element_size
    from tierkv.store.summaries import summary_dtype

    assert summary_element_size(dtype.itemsize) == summary_dtype(dtype).itemsize
