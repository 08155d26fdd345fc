"""Sparse attention selecting pages inside blocks (tierkv.attention.sparse with ``page_tokens`` < ``block_tokens``):
the page a query needs is fetched from whatever tier holds it, without its block; outputs are exact over what was
read (against a float64 softmax over exactly those tokens), nothing is dropped, the rest copy attends every page
not read, and every byte read is counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import InvalidConfigError, TieredCache
from tierkv.attention.base import Span
from tierkv.attention.sparse import SparseAttention, SparseBudget
from tierkv.attention.sparse_store import SparseBlocks
from tierkv.blocks import Tier
from tierkv.hf import cache_keyword
from tierkv.mover import ThreadMover
from tierkv.policy import make_policy
from tierkv.staging import default_page_tokens
from tierkv.store import KVStore
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.memory import MemoryTier

BT, PAGE, HEADS, GROUPS, DIM, COLUMNS = 64, 8, 2, 2, 32, 12  # a page: one 4 KiB sector per head's K or V
PER = BT // PAGE


def attend(executor: SparseAttention, query: torch.Tensor, budget: SparseBudget,
           mask: torch.Tensor | None = None) -> torch.Tensor:
    executor.budget = budget
    out, _ = executor.attend(Span.of(executor.store, 0), query, mask, DIM**-0.5, None)
    return out.transpose(1, 2).to(query.dtype)


def store_with_needles(tmp_path, needles: dict[int, tuple[int, int]], policy: str = "lru",
                       on_disk: bool = True, tail_tokens: int = 3, heads: int = 1) -> tuple[KVStore, torch.Tensor]:
    """A 2-row store of ``COLUMNS`` 64-token blocks (the last one partial), the full ones on disk (else spread
    over device and host); in row ``r`` the keys of the first ``heads`` KV heads in page ``needles[r] = (column,
    page)`` point along the query direction ``e_0``, every other key away from it."""
    device = MemoryTier(Tier.DEVICE, 2**21, torch.device("cpu"), chunk_bytes=2**16)
    host = MemoryTier(Tier.HOST, 2**21, torch.device("cpu"), chunk_bytes=2**16)
    store = KVStore(device, host, DiskTier(tmp_path / "disk", 2**24), make_policy(policy), BT)
    generator = torch.Generator().manual_seed(0)
    tokens = (COLUMNS - 1) * BT + tail_tokens
    keys = torch.randn(2, HEADS, tokens, DIM, generator=generator) * 0.1
    values = torch.randn(2, HEADS, tokens, DIM, generator=generator)
    keys[..., 0] = -1.0
    for row, (column, page) in needles.items():
        first = column * BT + page * PAGE
        keys[row, :heads, first : first + PAGE, 0] = 4.0
    for start in range(0, tokens, 7):  # blocks fill across appends
        store.append(0, keys[:, :, start : start + 7], values[:, :, start : start + 7])
    SparseBlocks(store).enable_summaries(page_tokens=PAGE)
    full = [b for b in store.table.blocks.values() if b.tokens == BT]
    if on_disk:
        for _ in range(2):
            store.demote([b for b in full if b.tier != Tier.DISK])
        assert all(b.tier == Tier.DISK for b in full)
    else:
        store.demote(full[::2])  # every other block to the host (or below)
    return store, torch.stack((keys, values))


def reference(q: torch.Tensor, kv: torch.Tensor, positions: list[list[int]]) -> torch.Tensor:
    """Softmax attention of ``q`` ``[B, H_q, 1, D]`` over exactly the tokens ``positions[b]`` of each row, float64."""
    out = []
    for row in range(q.shape[0]):
        k, v = kv[0, row][:, positions[row]].double(), kv[1, row][:, positions[row]].double()
        k, v = k.repeat_interleave(GROUPS, 0), v.repeat_interleave(GROUPS, 0)
        weights = torch.softmax(q[row, :, 0].double()[:, None] @ k.transpose(1, 2) * DIM**-0.5, dim=-1)
        out.append((weights @ v)[:, 0])
    return torch.stack(out)[:, None]


def read_positions(executor: SparseAttention, tokens: int) -> list[list[int]]:
    """Every token position the last step read, per row: its whole blocks and its pages."""
    positions = []
    for row in range(executor.last_columns.shape[0]):
        held = [t for c in executor.last_columns[row] for t in range(c * BT, min((c + 1) * BT, tokens))]
        pages = executor.last_pages[row] if executor.last_pages is not None else []
        held += [t for p in pages for t in range(p // PER * BT + p % PER * PAGE, p // PER * BT + p % PER * PAGE + PAGE)]
        positions.append(sorted(held))
    return positions


def tail_positions(executor: SparseAttention, tokens: int) -> list[list[int]]:
    """Every token position the last step attended, per row, where the open tail's full pages competed: the pages
    read, the tail's chosen pages and its newest token's page."""
    chosen, full = executor._tail_kept
    tail_first = (COLUMNS - 1) * BT
    positions = []
    for row in range(chosen.shape[0]):
        held = [t for p in executor.last_pages[row] if p >= 0
                for t in range(p // PER * BT + p % PER * PAGE, p // PER * BT + p % PER * PAGE + PAGE)]
        held += [tail_first + p * PAGE + t for p in chosen[row] if p >= 0 for t in range(PAGE)]
        held += list(range(tail_first + full * PAGE, tokens))
        positions.append(sorted(held))
    return positions


def needle_query() -> torch.Tensor:
    q = torch.zeros(2, HEADS * GROUPS, 1, DIM)
    q[:, :, 0, 1] = 1.0
    q[:, 0, 0, 0], q[:, 0, 0, 1] = 3.0, 0.0
    return q


def test_the_page_a_query_needs_is_read_from_disk_without_its_block(tmp_path):
    """Row 0 needs page 2 of block 5, row 1 page 1 of block 9, both on disk: a budget of three pages reads the
    open tail (its one filled page, whole), the sink page and exactly that page; the disk reads cover less than the
    blocks; the output is exact over what was read, and the store is unchanged."""
    store, kv = store_with_needles(tmp_path, {0: (5, 2), 1: (9, 1)})
    executor = SparseAttention(store, ThreadMover())
    q = needle_query()
    disk = store.bytes_moved["disk->device"]
    out = attend(executor, q, SparseBudget(3 * PAGE, recent=0, page_tokens=PAGE))
    assert executor.last_columns.tolist() == [[COLUMNS - 1]] * 2
    assert executor.last_pages.tolist() == [[0, 5 * PER + 2], [0, 9 * PER + 1]]
    block_bytes = BT * store.layouts[0].token_bytes
    assert 0 < store.bytes_moved["disk->device"] - disk < 4 * block_bytes  # whole blocks: 4 (2 rows x 2)
    torch.testing.assert_close(out.double(), reference(q, kv, read_positions(executor, kv.shape[3])),
                               atol=1e-5, rtol=0)
    counters = executor.counters.as_dict()
    assert counters["pages_selected"] == 4 and counters["staged_bytes_read_per_step"] > 0
    assert counters["tokens_read_fraction"] == pytest.approx((2 * PAGE + 3) / kv.shape[3])  # 2 pages, the tail
    assert counters["summary_bytes_read_per_step"] > 0 and counters["link_bytes_per_step"]["disk->device"] > 0
    store.check()
    torch.testing.assert_close(store.read_tokens(0), kv)  # nothing dropped, nothing changed
    executor.close()


@pytest.mark.parametrize("on_disk", [True, False], ids=["disk", "device-and-host"])
def test_pages_from_every_tier_give_exact_attention_over_the_selection(tmp_path, on_disk):
    """A random query, a budget of about a third: whatever pages each row selects, from whichever tiers, the output
    is a float64 softmax over exactly the tokens read; a padding mask hides tokens inside the pages too."""
    store, kv = store_with_needles(tmp_path, {0: (5, 2), 1: (9, 1)}, on_disk=on_disk)
    executor = SparseAttention(store, ThreadMover())
    q = torch.randn(2, HEADS * GROUPS, 1, DIM, generator=torch.Generator().manual_seed(3))
    budget = SparseBudget(0.33, page_tokens=PAGE)
    out = attend(executor, q, budget)
    positions = read_positions(executor, kv.shape[3])
    assert executor.last_pages.shape[1] > 1 and len(positions[0]) <= int(0.33 * kv.shape[3])
    torch.testing.assert_close(out.double(), reference(q, kv, positions), atol=1e-5, rtol=0)
    mask = torch.ones(2, 1, 1, kv.shape[3], dtype=torch.bool)
    mask[1, ..., : 2 * BT + 5] = False  # row 1 left-padded into its third block
    out = attend(executor, q, budget, mask)
    positions = read_positions(executor, kv.shape[3])
    positions[1] = [t for t in positions[1] if t >= 2 * BT + 5]
    torch.testing.assert_close(out.double(), reference(q, kv, positions), atol=1e-5, rtol=0)
    store.check()
    torch.testing.assert_close(store.read_tokens(0), kv)
    executor.close()


def test_the_rest_copy_attends_every_page_not_read(tmp_path):
    """With an 8-bit rest copy the pages not read are attended from it: the output is within the copy's rounding
    of full attention, far closer than the selection alone, and the rest copy's device reads are counted."""
    store, kv = store_with_needles(tmp_path, {0: (5, 2), 1: (9, 1)}, on_disk=False)
    q = torch.randn(2, HEADS * GROUPS, 1, DIM, generator=torch.Generator().manual_seed(4))
    full = reference(q, kv, [list(range(kv.shape[3]))] * 2)
    alone = SparseAttention(store, ThreadMover())
    without = attend(alone, q, SparseBudget(0.25, page_tokens=PAGE))
    alone.close()
    executor = SparseAttention(store, ThreadMover())
    with_rest = attend(executor, q, SparseBudget(0.25, page_tokens=PAGE, rest_bits=8))
    error, baseline = (with_rest.double() - full).abs().max(), (without.double() - full).abs().max()
    assert error < 0.02 and error < baseline / 5
    assert executor.counters.as_dict()["rest_bytes_read_per_step"] > 0 and executor.counters.rest_layer_steps == 1
    executor.close()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_rest_copy_attended_from_its_codes_equals_its_torch_decoding(tmp_path, monkeypatch, bits):
    """The native kernel (straight from the codes) and torch (decode, then attend) give the same step, with a
    padding mask and rows that leave out different pages; a missing C library falls back to torch."""
    from tierkv.attention import rest_kernel

    if not rest_kernel.available():
        pytest.skip("no C compiler: the kernel cannot be built")
    store, kv = store_with_needles(tmp_path, {0: (5, 2), 1: (9, 1)}, on_disk=False)
    q = torch.randn(2, HEADS * GROUPS, 1, DIM, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 1, 1, kv.shape[3], dtype=torch.bool)
    mask[1, ..., : BT + 9] = False
    budget = SparseBudget(0.25, page_tokens=PAGE, rest_bits=bits)
    outputs = []
    for native in (True, False):
        monkeypatch.setattr(rest_kernel, "runs_on", lambda device, native=native: native)
        executor = SparseAttention(store, ThreadMover())
        outputs.append(attend(executor, q, budget, mask))
        assert executor.counters.rest_layer_steps == 1
        executor.close()
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-5, rtol=1e-4)


def test_rest_pages_whose_mass_is_bounded_below_the_threshold_are_left_out_within_that_bound(tmp_path, monkeypatch):
    """A query whose every head finds its needle: the read pages hold nearly all the mass, so Quest's bound proves
    most pages not read negligible and the rest copy leaves them out. The output stays within the bound's promise
    of the output that attends every page's copy (omitted mass <= REST_PRUNE_MASS of the read pages'), and fewer
    rest bytes are read."""
    from tierkv.attention import sparse_rest as rest_module

    store, kv = store_with_needles(tmp_path, {0: (5, 2), 1: (9, 1)}, on_disk=False, heads=HEADS)
    q = torch.zeros(2, HEADS * GROUPS, 1, DIM)
    q[..., 0] = 12.0  # every head looks for the needle: the pages not read are negligible to all of them
    budget = SparseBudget(3 * PAGE, recent=0, page_tokens=PAGE, rest_bits=8)
    pruned = SparseAttention(store, ThreadMover())
    out = attend(pruned, q, budget)
    limit = 2 * rest_module.REST_PRUNE_MASS * kv[1].abs().max()  # the omitted mass times the largest value
    monkeypatch.setattr(rest_module, "REST_PRUNE_MASS", 0.0)  # log(0): nothing provably negligible
    every = SparseAttention(store, ThreadMover())
    reference_out = attend(every, q, budget)
    assert pruned.counters.rest_pages_pruned > 0 and every.counters.rest_pages_pruned == 0
    assert pruned.counters.rest_bytes_read < every.counters.rest_bytes_read
    assert (out - reference_out).abs().max() <= limit
    pruned.close()
    every.close()


def test_a_copying_head_keeps_its_page_through_the_sticky_share(tmp_path):
    """A page that took most of a head's attention at the previous step is selected again even when the summaries
    now rank other pages higher."""
    store, kv = store_with_needles(tmp_path, {0: (5, 2), 1: (9, 1)}, on_disk=False)
    executor = SparseAttention(store, ThreadMover())
    budget = SparseBudget(3 * PAGE, recent=0, page_tokens=PAGE)
    attend(executor, needle_query(), budget)
    assert executor.last_pages.tolist() == [[0, 5 * PER + 2], [0, 9 * PER + 1]]
    away = torch.zeros(2, HEADS * GROUPS, 1, DIM)
    away[:, :, 0, 2] = 1.0  # scores no page above the others by much
    attend(executor, away, budget)
    assert executor.last_pages.tolist() == [[0, 5 * PER + 2], [0, 9 * PER + 1]]
    executor.close()


def test_the_open_tails_full_pages_compete_with_the_others(tmp_path):
    """A tail with five full pages before the newest token's: they are candidates like any page (scored from
    summaries made from the tail's slot), so a three-page budget reads the sink page, the newest token's page and
    the needle's page inside the tail; the tail's other pages are not attended. With a rest copy they are
    attended exactly (they are on the device)."""
    store, kv = store_with_needles(tmp_path, {0: (COLUMNS - 1, 2), 1: (4, 3)}, tail_tokens=5 * PAGE + 3)
    executor = SparseAttention(store, ThreadMover())
    q = needle_query()
    out = attend(executor, q, SparseBudget(3 * PAGE, recent=0, page_tokens=PAGE))
    chosen, full = executor._tail_kept
    assert full == 5 and chosen.tolist() == [[-1, 2], [-1, -1]]
    assert executor.last_pages.tolist() == [[0, -1], [0, 4 * PER + 3]]
    torch.testing.assert_close(out.double(), reference(q, kv, tail_positions(executor, kv.shape[3])),
                               atol=1e-5, rtol=0)
    for buffer in executor.staging.buffers:  # stale bytes where row 0 reads no page (its tail page): NaN
        buffer.view(torch.float32).fill_(float("nan"))
    out = attend(executor, q, SparseBudget(3 * PAGE, recent=0, page_tokens=PAGE))
    torch.testing.assert_close(out.double(), reference(q, kv, tail_positions(executor, kv.shape[3])),
                               atol=1e-5, rtol=0)
    executor.close()


def test_the_open_tails_page_summaries_are_made_again_after_a_table_edit(tmp_path):
    """The tail's full pages are summarised once and kept while the tail fills; a crop inside the tail, then other
    keys appended in place of the cut ones (the same tokens, the needle now in tail page 3), is followed after the
    adapter's invalidate: the selection picks page 3, not the summaries of what was cut."""
    tail_tokens = 5 * PAGE + 3
    store, kv = store_with_needles(tmp_path, {0: (COLUMNS - 1, 2), 1: (4, 3)}, tail_tokens=tail_tokens)
    executor = SparseAttention(store, ThreadMover())
    q = needle_query()
    budget = SparseBudget(3 * PAGE, recent=0, page_tokens=PAGE)
    attend(executor, q, budget)
    attend(executor, q, budget)  # the kept summaries
    assert executor._tail_kept[0].tolist() == [[-1, 2], [-1, -1]]
    tail_first = (COLUMNS - 1) * BT
    store.crop(0, tail_tokens - 2 * PAGE)
    executor.invalidate()
    replaced = kv.clone()
    replaced[0, :, :, tail_first + 2 * PAGE :, 0] = -1.0  # row 0's needle moves from tail page 2 to page 3
    replaced[0, 0, :1, tail_first + 3 * PAGE : tail_first + 4 * PAGE, 0] = 4.0
    store.append(0, replaced[0, :, :, tail_first + 2 * PAGE :], replaced[1, :, :, tail_first + 2 * PAGE :])
    out = attend(executor, q, budget)
    assert executor._tail_kept[0].tolist() == [[-1, 3], [-1, -1]]
    torch.testing.assert_close(out.double(), reference(q, replaced, tail_positions(executor, kv.shape[3])),
                               atol=1e-5, rtol=0)
    executor.close()


def test_a_page_size_that_does_not_divide_the_block_is_refused_by_name(tmp_path):
    store, _ = store_with_needles(tmp_path, {0: (5, 2)}, on_disk=False)
    executor = SparseAttention(store, ThreadMover())
    with pytest.raises(InvalidConfigError, match="page_tokens=6 does not divide the cache's block_tokens=64"):
        attend(executor, needle_query(), SparseBudget(0.2, page_tokens=6))
    with pytest.raises(InvalidConfigError, match="page_tokens=0"):
        SparseBudget(0.2, page_tokens=0)
    executor.close()


@pytest.mark.parametrize(("family", "attn", "window"), [("llama", "sdpa", None), ("gemma2", "eager", 24)])
def test_pages_at_a_budget_covering_everything_match_dynamic_cache(tmp_path, family, attn, window):
    """Through transformers: 32-token blocks, 8-token pages. A budget covering the context is DynamicCache token
    for token and logit for logit; half the context with an 8-bit rest copy stays close to it, and stats() counts
    the pages and every device read."""
    model = tiny_model(family, attn, window)
    ids, mask = prompt(2, 200, seed=3, left_pad=(0, 6))

    def run(cache):
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, **{cache_keyword(model): cache})

    reference_out = run(DynamicCache())
    with TieredCache(gpu_gb="512KB", cpu_gb="64KB", disk_dir=tmp_path, block_tokens=32) as cache:
        with cache.sparse(model, tokens=1.0, page_tokens=8, chunk_tokens=32):
            out = run(cache)
        assert torch.equal(out.sequences, reference_out.sequences)
        for got, want in zip(out.logits, reference_out.logits, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with TieredCache(gpu_gb="512KB", cpu_gb="64KB", disk_dir=tmp_path, block_tokens=32) as cache:
        with cache.sparse(model, tokens=0.5, page_tokens=8, rest_bits=8, chunk_tokens=32):
            out = run(cache)
            sparse = cache.stats()["sparse"]  # (leaving the block gives the summaries' bytes back)
        assert sparse["pages_selected"] > 0 and sparse["rest_bytes_read_per_step"] > 0
        assert sparse["summaries_device_bytes"] > 0 and sparse["rest_copy_device_bytes"] > 0
        assert sparse["device_bytes_read_per_step"] == pytest.approx(
            sparse["summary_bytes_read_per_step"] + sparse["rest_bytes_read_per_step"]
            + sparse["staged_bytes_read_per_step"])
        cache.store.check()
    # Close in logits, not in probabilities: over this vocabulary every probability is about 1/128, so no two
    # distributions differ by much (decoding a wrong context moves them by < 0.01, its logits by 0.45 or more).
    # Measured here: logits within 2.1e-3 of DynamicCache's, every argmax the same.
    for got, want in zip(out.logits, reference_out.logits, strict=True):
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.5
        torch.testing.assert_close(got, want, atol=2e-2, rtol=0)


def test_the_page_means_attend_the_pages_not_read_closer_to_full_attention(tmp_path):
    """Without a copy, ``rest_means`` attends each page not read from its mean key and value (weighted by its
    tokens): nearer full attention than the selection alone, with no rest copy held and none read."""
    store, kv = store_with_needles(tmp_path, {0: (5, 2), 1: (9, 1)}, on_disk=False)
    q = torch.randn(2, HEADS * GROUPS, 1, DIM, generator=torch.Generator().manual_seed(6))
    full = reference(q, kv, [list(range(kv.shape[3]))] * 2)
    errors = {}
    for means in (False, True):
        executor = SparseAttention(store, ThreadMover())
        out = attend(executor, q, SparseBudget(0.2, page_tokens=PAGE, rest_means=means))
        errors[means] = float((out.double() - full).abs().max())
        assert executor.counters.rest_bytes_read == 0 and executor.counters.rest_layer_steps == int(means)
        executor.close()
    assert errors[True] < errors[False] / 2
    assert store.summaries.nbytes == store.summaries.summary_nbytes  # no copy kept


def test_attention_policy_moves_a_hot_pages_block_to_the_device(tmp_path, monkeypatch):
    """Without kept pages (none fit): read in pages every step, the needle's page gathers mass; its block is read
    whole once and promoted, so the next steps read the page from the device; every token stays where the table
    says."""
    from tierkv.attention import kept as kept_module

    monkeypatch.setattr(kept_module, "KEEP_SHARE", 0.0)
    store, kv = store_with_needles(tmp_path, {0: (5, 2), 1: (5, 2)}, policy="attention")
    executor = SparseAttention(store, ThreadMover())
    budget = SparseBudget(3 * PAGE, recent=0, page_tokens=PAGE)
    for _ in range(3):
        attend(executor, needle_query(), budget)
    needle = store.table.blocks[int(store.table.rows[0].ids[0, 5])]
    assert needle.tier == Tier.DEVICE and executor.counters.promotions >= 1
    gathered = store.bytes_moved["device->device"]
    attend(executor, needle_query(), budget)
    assert executor.last_pages.tolist()[0] == [0, 5 * PER + 2]
    assert store.bytes_moved["device->device"] > gathered  # the needle's page now comes from the device
    store.check()
    torch.testing.assert_close(store.read_tokens(0), kv)
    executor.close()


def test_a_layer_keeping_its_hot_pages_does_not_read_their_blocks_whole_to_promote_them(tmp_path):
    """With the needle's page kept on the device, a whole-block read to promote its block would cost more than it
    saves: nothing is promoted, and after the first step the page comes from the kept buffer, not the disk."""
    store, kv = store_with_needles(tmp_path, {0: (5, 2), 1: (5, 2)}, policy="attention")
    executor = SparseAttention(store, ThreadMover())
    budget = SparseBudget(3 * PAGE, recent=0, page_tokens=PAGE)
    attend(executor, needle_query(), budget)
    disk = store.bytes_moved["disk->device"]
    for _ in range(3):
        attend(executor, needle_query(), budget)
    assert executor.last_pages.tolist()[0] == [0, 5 * PER + 2]
    assert store.bytes_moved["disk->device"] == disk and executor.counters.promotions == 0
    assert executor.counters.pages_reused > 0
    store.check()
    torch.testing.assert_close(store.read_tokens(0), kv)
    executor.close()


def test_pages_kept_from_earlier_steps_are_not_read_again(tmp_path, monkeypatch):
    """A layer keeps the pages it read on the device: the same query again reads nothing from disk (every page a
    kept hit: on a CPU host attended where it is kept, so no page byte moves; on an accelerator gathered, counted on
    ``device->device``) and gives the same output; a new query reads only what it lacks and is
    exact over its selection. With keeping off, the repeat reads the disk again."""
    from tierkv.attention import kept as kept_module

    store, kv = store_with_needles(tmp_path, {0: (5, 2), 1: (9, 1)})
    executor = SparseAttention(store, ThreadMover())
    generator = torch.Generator().manual_seed(4)
    q, other = (torch.randn(2, HEADS * GROUPS, 1, DIM, generator=generator) for _ in range(2))
    budget = SparseBudget(0.25, page_tokens=PAGE)
    disk = store.bytes_moved["disk->device"]
    first = attend(executor, q, budget)
    read = store.bytes_moved["disk->device"] - disk
    assert read > 0
    device = store.bytes_moved.get("device->device", 0)
    again = attend(executor, q, budget)
    selected = int((executor.last_pages >= 0).sum())
    assert store.bytes_moved["disk->device"] - disk == read  # nothing more from disk
    assert executor.counters.pages_reused == selected
    page_bytes = PAGE * store.layouts[0].token_bytes
    gathered = store.bytes_moved["device->device"] - device
    if store.transfer.accel.streams:
        assert gathered >= selected * page_bytes
    else:
        assert gathered < page_bytes  # the open tail's copy only
    assert torch.equal(again, first)
    out = attend(executor, other, budget)
    torch.testing.assert_close(out.double(), reference(other, kv, read_positions(executor, kv.shape[3])),
                               atol=1e-5, rtol=0)
    store.check()
    executor.close()

    monkeypatch.setattr(kept_module, "KEEP_SHARE", 0.0)
    executor = SparseAttention(store, ThreadMover())
    attend(executor, q, budget)
    disk = store.bytes_moved["disk->device"]
    torch.testing.assert_close(attend(executor, q, budget), first, atol=1e-6, rtol=0)
    assert store.bytes_moved["disk->device"] > disk and executor.counters.pages_reused == 0
    executor.close()


def test_pages_attended_in_place_equal_the_staged_path(tmp_path, monkeypatch):
    """On a CPU host the selected pages and the whole blocks are attended where they are (pages of blocks on disk,
    and a whole block on disk as its pages, in the kept layer, the misses read straight into it; no gather, no
    staging): over steps with and without a padding mask, under the attention policy, the outputs, the selections
    and the measured page shares (what the sticky selection and the policy are given) equal those of the staged
    path (blocks and pages gathered into staging, attended by torch); the kept hits move no bytes, and nothing is
    promoted (the disk block the staged path reads whole, and promotes, is kept as pages instead)."""
    runs = []
    for in_place in (True, False):
        store, kv = store_with_needles(tmp_path / str(in_place), {0: (5, 2), 1: (9, 1)}, policy="attention")
        if store.transfer.accel.streams:
            pytest.skip("an accelerator's pages are gathered into staging (the host kernel reads host memory)")
        executor = SparseAttention(store, ThreadMover())
        if not in_place:
            monkeypatch.setattr(executor, "_pages_here", lambda *args: None)
        as_pages: list = []  # the recent block is on disk: attended as pages beside the others in place

        def block_pages(*args, found=executor.inplace.disk_block_pages, as_pages=as_pages):
            as_pages.append(found(*args))
            return as_pages[-1]

        monkeypatch.setattr(executor.inplace, "disk_block_pages", block_pages)
        masses: list[np.ndarray] = []
        told = store.policy.on_attention

        def spy(layer, tick, ids, weights, told=told, masses=masses):
            masses.append(np.array(weights))
            return told(layer, tick, ids, weights)

        monkeypatch.setattr(store.policy, "on_attention", spy)
        mask = torch.ones(2, 1, 1, kv.shape[3], dtype=torch.bool)
        mask[1, ..., : 2 * BT + 5] = False
        generator = torch.Generator().manual_seed(6)
        outs, picks, sticky = [], [], []
        for step in range(6):
            q = needle_query() if step % 3 == 0 else torch.randn(2, HEADS * GROUPS, 1, DIM, generator=generator)
            budget = SparseBudget(0.2, page_tokens=PAGE, recent=BT)  # the last full block read whole, from disk
            outs.append(attend(executor, q, budget, mask if step % 2 else None))
            picks.append(executor.last_pages.copy())
            sticky.append(executor._sticky[0][1].clone())
        assert (executor.staging.reserved == 0) == in_place  # in place: the blocks too, nothing staged
        assert any(found is not None for found in as_pages)
        runs.append((outs, picks, sticky, masses, executor.counters.promotions, store.bytes_moved["device->device"]))
        torch.testing.assert_close(store.read_tokens(0), kv)
        executor.close()
    (outs, picks, sticky, masses, promoted, moved), (outs_, picks_, sticky_, masses_, promoted_, moved_) = runs
    for step in range(6):
        torch.testing.assert_close(outs[step], outs_[step], atol=1e-5, rtol=0)
        assert np.array_equal(picks[step], picks_[step])
        torch.testing.assert_close(sticky[step], sticky_[step], atol=1e-5, rtol=0)
    assert any((s > 0).any() for s in sticky) and len(masses) == len(masses_) > 0
    for mass, mass_ in zip(masses, masses_):
        np.testing.assert_allclose(mass, mass_, atol=1e-5)
    assert promoted == 0 and moved < moved_  # in place a disk block's pages are kept instead of its block promoted


def test_the_rest_copy_is_attended_while_the_disk_pages_are_read(tmp_path, monkeypatch):
    """On a CPU host the read of a step's disk pages is submitted before the rest copy is attended and finished
    after it (the disk reads while the CPU attends), and the output is the same softmax; an error while the read is
    in flight waits for it (nothing lands in the bounce buffer later), and the next step is exact again."""
    from tierkv.store import pages as pages_module

    store, kv = store_with_needles(tmp_path, {0: (5, 2), 1: (9, 1)})
    if store.transfer.accel.streams:
        pytest.skip("an accelerator's pages are read into staging, before the rest copy")
    executor = SparseAttention(store, ThreadMover())
    events: list[str] = []
    finish, settle, rest = pages_module.PageRead.finish, pages_module.PageRead.settle, executor.rest.from_copy

    def finishing(self):
        events.append("finish")
        return finish(self)

    def settling(self):
        events.append("settle")
        return settle(self)

    def resting(*args, **kwargs):
        events.append("rest")
        return rest(*args, **kwargs)

    monkeypatch.setattr(pages_module.PageRead, "finish", finishing)
    monkeypatch.setattr(pages_module.PageRead, "settle", settling)
    monkeypatch.setattr(executor.rest, "from_copy", resting)
    budget = SparseBudget(0.25, page_tokens=PAGE, rest_bits=4)
    q = torch.randn(2, HEADS * GROUPS, 1, DIM, generator=torch.Generator().manual_seed(8))
    out = attend(executor, q, budget)
    assert events == ["rest", "finish"]
    events.clear()

    def failing(*args, **kwargs):
        raise RuntimeError("the rest copy failed")

    monkeypatch.setattr(executor.rest, "from_copy", failing)
    other = torch.randn(2, HEADS * GROUPS, 1, DIM, generator=torch.Generator().manual_seed(9))
    with pytest.raises(RuntimeError, match="rest copy failed"):
        attend(executor, other, budget)
    assert events == ["settle"]  # the new pages' read was in flight: waited for, not landed
    monkeypatch.setattr(executor.rest, "from_copy", resting)
    executor.kept.clear()
    torch.testing.assert_close(attend(executor, q, budget), out, atol=1e-5, rtol=0)
    store.check()
    torch.testing.assert_close(store.read_tokens(0), kv)
    executor.close()


def test_packed_slabs_attend_exactly_as_their_chunks():
    """The host kernel over slab chunks packed once (``host_kernel.pack_slabs``, what a CPU host's sparse step
    passes) gives bit-identical outputs, log-sum-exps and page shares to the same call over the chunks; the torch
    version refuses packed slabs by name (they hold addresses only)."""
    from tierkv.attention import host_kernel

    if not host_kernel.available():
        pytest.skip(f"the C kernel does not load here: {host_kernel._build()}")
    generator = torch.Generator().manual_seed(3)
    slab = torch.randn(9, 2, HEADS, BT, DIM, generator=generator).to(torch.bfloat16)
    chunks = list(torch.tensor_split(slab, (2, 5)))  # slot ids count on across the three chunks
    table = torch.randint(0, 9, (2, 6), generator=generator).numpy()
    table[1, 4] = -1
    starts = torch.randint(0, PER, (2, 6), generator=generator).numpy() * PAGE
    positions = np.arange(6)[None].repeat(2, axis=0) * BT + starts
    query = torch.randn(2, HEADS * GROUPS, 1, DIM, generator=generator)
    results = []
    for slabs in (chunks, host_kernel.pack_slabs(chunks)):
        shares = torch.empty((2, HEADS * GROUPS, 1, 6), dtype=torch.float32)
        out, lse = host_kernel.paged_attention(query, slabs, table, 6 * BT, scaling=DIM**-0.5, positions=positions,
                                               starts=starts, entry_tokens=PAGE, entry_lse=shares)  # fmt: skip
        results.append((out, lse, shares))
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)
    with pytest.raises(InvalidConfigError, match="packed slabs"):
        host_kernel.paged_attention_torch(query, host_kernel.pack_slabs(chunks), table, 6 * BT, scaling=1.0,
                                          positions=positions, starts=starts, entry_tokens=PAGE)  # fmt: skip


def test_in_place_slabs_are_packed_once_and_again_when_a_pool_changes(tmp_path):
    """A CPU host's sparse step joins and packs the memory tiers' chunks once (the same packed slabs step after
    step), and again when a pool grows or gives a chunk back: the packed slot count follows the pools."""
    from tierkv.attention import host_kernel

    if not host_kernel.available():
        pytest.skip(f"the C kernel does not load here: {host_kernel._build()}")
    store, _ = store_with_needles(tmp_path, {}, on_disk=False)
    executor = SparseAttention(store, ThreadMover())
    columns = np.arange(COLUMNS - 1)[None].repeat(2, axis=0)
    held = np.ones(columns.shape, dtype=bool)

    def packed() -> host_kernel.PackedSlabs:
        slabs, _ = executor.inplace._memory_table(0, columns, held)
        assert isinstance(slabs, host_kernel.PackedSlabs)
        return slabs

    slot_bytes = store.layouts[0].slot_bytes
    pools = [store.tiers[tier].pools[slot_bytes] for tier in (Tier.DEVICE, Tier.HOST)]

    def slots() -> int:
        return sum(pool.capacity for pool in pools)

    first = packed()
    assert packed() is first and first.slots == slots()
    pool = pools[1]
    pool.add_chunk(4)
    grown = packed()
    assert grown is not first and grown.slots == first.slots + 4 == slots()
    pool.drop_last_chunk()
    assert packed().slots == first.slots
    executor.close()


@pytest.mark.parametrize(("block_tokens", "page", "tokens"), [(8, 2, 24), (8, 1, 20), (16, 4, 30)])
def test_attended_tokens_are_counted_within_the_cap(block_tokens, page, tokens):
    """``tokens`` caps what a layer-step attends (the sinks and the open tail are within it); the open tail's full
    pages that the selection leaves out are read with the tail but masked, and not counted as attended."""
    model = tiny_model("llama")
    ids, mask = prompt(1, 100)
    with TieredCache(gpu_gb="4MB", cpu_gb="1MB", block_tokens=block_tokens, config=model.config) as cache, \
            cache.sparse(model, tokens=tokens, page_tokens=page, rest_bits=0), torch.no_grad():
        model.generate(ids, attention_mask=mask, **{cache_keyword(model): cache}, max_new_tokens=12, do_sample=False)
        counters = cache.executors["sparse"].counters
    assert counters.exact_layer_steps == 0 and counters.layer_steps > 0
    assert counters.tokens_read <= tokens * counters.layer_steps


@pytest.mark.parametrize(("block", "page"), [(256, 16), (255, 15), (250, 10), (100, 10), (12, 12), (24, 12), (17, 1),
                                             (5, 5), (1, 1)])
def test_the_default_page_is_the_blocks_largest_divisor_up_to_16(block, page):
    """As documented (``cache.sparse``, ``SparseBudget``): not the largest power-of-two divisor, which made 1-token
    pages of 255-token blocks (summaries per token: a device minimum 4.4x larger)."""
    assert default_page_tokens(block) == page
    assert SparseBudget(tokens=0.1).page_size(block) == page
    assert SparseBudget(tokens=0.1, page_tokens=1).page_size(block) == 1  # a page given is kept
