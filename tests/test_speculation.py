"""Speculative disk reads of sparse attention (``tierkv.attention.speculation``): they never change what is
attended, a block they missed is still fetched, a failed one is read again, and their bytes are counted.

References: the same decode with speculation off (identical logits, bit for bit), and full softmax attention
over exactly the selected tokens (float64) for the store-level cases.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models import prompt, tiny_model
from test_integrity import flip
from test_sparse import BT, COLUMNS, DIM, attend, query_for_head, reference_attention, store_with_needles

from tierkv import TieredCache
from tierkv.attention import kept as kept_module
from tierkv.attention.sparse import SparseAttention, SparseBudget
from tierkv.attention.speculation import Claim
from tierkv.blocks import Tier
from tierkv.errors import DiskTierError, IntegrityError
from tierkv.mover import ThreadMover

# (id, blocks kept of earlier steps, runners-up per guess): without kept blocks the previous selection is what
# a guess holds; with room for it kept, only the runners-up are left to guess; a layer that keeps part of its
# selection guesses the rest of it
VARIANTS = [("previous-selection", "none", 0), ("kept-and-runners-up", "all", 3), ("partly-kept", "part", 0)]


def decode(model, ids, mask, directory, *, speculate: bool, runners: int, tokens: int = 16, new: int = 10,
           monkeypatch=None, block_tokens: int = 4, gpu: str = "128KB"):
    """Greedy sparse decoding through a cache that holds most blocks on disk; returns (output, stats)."""
    monkeypatch.setattr(SparseAttention, "speculate", speculate)
    monkeypatch.setattr(SparseAttention, "speculate_runners", runners)
    with TieredCache(gpu_gb=gpu, cpu_gb="24KB", disk_dir=directory, block_tokens=block_tokens,
                     config=model.config) as cache:
        with cache.sparse(model, tokens=tokens, chunk_tokens=8, rest_bits=0):  # speculation, not the rest copy
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, cache=cache)
        cache.store.check()  # nothing dropped, the table consistent
        stats = cache.stats()
    assert stats["peak_bytes_allocated"]["device"] <= stats["budget_bytes"]["device"]
    return out, stats


@pytest.mark.parametrize(("name", "keep", "runners"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_speculation_never_changes_results(tmp_path, monkeypatch, name, keep, runners):
    """A left-padded batch of two on a real model class: the same tokens and bit-identical logits with and
    without speculation, while speculation did hit (else this would test nothing). Its wasted blocks are the
    only extra bytes read from disk: budgets hold with speculative reads counted."""
    model = tiny_model("llama")
    if keep == "none":
        monkeypatch.setattr(kept_module, "KEEP_SHARE", 0.0)  # no kept layers: every step reads its selection
    elif keep == "part":  # a share of 1.5 blocks per layer: each keeps 1 of its 4 (2 rows, 4 tokens, 2 x 16, fp32)
        layers, block_bytes = model.config.num_hidden_layers, 2 * 4 * 2 * 2 * 16 * 4
        monkeypatch.setattr(kept_module, "KEEP_SHARE", 1.5 * layers * block_bytes / 128_000)
    ids, mask = prompt(2, 96, seed=9, left_pad=(0, 5))
    plain, off = decode(model, ids, mask, tmp_path / "off", speculate=False, runners=runners, monkeypatch=monkeypatch)
    guessed, on = decode(model, ids, mask, tmp_path / "on", speculate=True, runners=runners, monkeypatch=monkeypatch)
    assert torch.equal(guessed.sequences, plain.sequences)
    for got, expected in zip(guessed.logits, plain.logits):
        assert torch.equal(got, expected)
    speculation = on["sparse"]["speculation"]
    assert speculation["hits"] > 0 and speculation["failed"] == 0, speculation
    assert off["sparse"]["speculation"]["reads"] == 0
    assert on["sparse"]["blocks_selected"] == off["sparse"]["blocks_selected"]
    block_bytes = 4 * 2 * 2 * 16 * 4  # block_tokens · K/V · KV heads · head_dim · fp32
    extra = on["bytes_moved"]["disk->device"] - off["bytes_moved"]["disk->device"]
    assert extra == speculation["wasted"] * block_bytes  # every speculated block counted, hits once


def test_speculation_on_the_demo_model_keeps_its_answer(tmp_path, monkeypatch):
    """The shipped (trained) demo model on a passkey prompt, batch 1 (no mask: the bias-free attention path):
    identical logits with and without speculation."""
    from tierkv.demo.model import load_demo_model
    from tierkv.demo.task import make_example

    monkeypatch.setattr(kept_module, "KEEP_SHARE", 0.0)
    model, _ = load_demo_model()
    ids = torch.tensor([make_example(0, 768, depth=0.4).prompt_ids])
    mask = torch.ones_like(ids)
    runs = [decode(model, ids, mask, tmp_path / str(flag), speculate=flag, runners=0, tokens=96, new=6,
                   monkeypatch=monkeypatch, block_tokens=16, gpu="400KB") for flag in (False, True)]
    (plain, _), (guessed, on) = runs
    assert on["sparse"]["speculation"]["hits"] > 0 and on["blocks"]["disk"] > on["blocks"]["device"]
    assert torch.equal(guessed.sequences, plain.sequences)
    for got, expected in zip(guessed.logits, plain.logits):
        assert torch.equal(got, expected)


def test_a_steps_disk_bytes_count_its_speculative_reads(tmp_path, monkeypatch):
    """``stats()["steps"]``: a decode step's disk bytes are those it moved (``bytes_moved``), its speculative reads
    (submitted during the step, off its path) and, in the first sparse step, the summaries' read of the prompt's
    blocks included."""
    monkeypatch.setattr(kept_module, "KEEP_SHARE", 0.0)  # no kept layers: every step guesses its selection
    model = tiny_model("llama")
    ids, _ = prompt(1, 96, seed=9)
    moved, recorded = [], {}
    with TieredCache(gpu_gb="128KB", cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache, \
            cache.sparse(model, tokens=16, chunk_tokens=8, rest_bits=0), torch.no_grad():
        token = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(6):
            before = cache.stats()["bytes_moved"].get("disk->device", 0)
            token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            stats = cache.stats()
            moved.append((stats["tokens"], stats["bytes_moved"]["disk->device"] - before))
            last = stats["steps"]["last"]  # the last step closed: the one before this forward's
            recorded[last["context"]] = last["bytes_by_link"].get("disk->device", 0)
        assert stats["sparse"]["speculation"]["reads"] >= 4
    compared = [(context, nbytes) for context, nbytes in moved if context in recorded]
    assert len(compared) >= 5 and compared[0][0] == moved[0][0]
    assert compared == [(context, recorded[context]) for context, _ in compared]


def test_a_mis_speculated_block_is_still_fetched(tmp_path):
    """The guess holds each row's sink and a block no query wants: the sinks come out of the speculative read,
    the needles (not guessed) are read from disk as usual, the wrong blocks are wasted, and the output is exact."""
    store, kv = store_with_needles(tmp_path, {0: 5, 1: 10})
    executor = SparseAttention(store, ThreadMover())
    q = query_for_head(0)
    disk_before = store.bytes_moved["disk->device"]
    executor.speculation.remember(0, np.array([[0, 3], [0, 3]]), None)
    executor.speculation.launch(0, None)
    out = attend(executor, q, None, DIM**-0.5, None, SparseBudget(3 * BT, sinks=BT, recent=0))
    columns = executor.last_columns
    assert columns.tolist() == [[0, 5, COLUMNS - 1], [0, 10, COLUMNS - 1]]
    torch.testing.assert_close(out.double(), reference_attention(q, kv, columns, DIM**-0.5), atol=1e-5, rtol=0)
    speculation = executor.counters.speculation
    assert (speculation.reads, speculation.blocks, speculation.hits, speculation.misses, speculation.wasted) == \
        (1, 4, 2, 2, 2)
    assert executor.counters.by_tier["disk"] == 4  # every selected disk block, speculated or not
    block_bytes = BT * store.layouts[0].token_bytes
    assert store.bytes_moved["disk->device"] - disk_before == (4 + 2) * block_bytes  # the guess, then the misses
    store.check()
    torch.testing.assert_close(store.read_tokens(0), kv)  # nothing dropped, nothing changed
    executor.close()


def test_a_failed_speculative_read_is_read_again(tmp_path, monkeypatch):
    """A speculative read that fails is not an error of the step: its hits are read again the ordinary way."""
    store, kv = store_with_needles(tmp_path, {0: 5, 1: 10})
    executor = SparseAttention(store, ThreadMover())
    q = query_for_head(0)
    executor.speculation.remember(0, np.array([[0, 5], [0, 10]]), None)
    executor.speculation.launch(0, None)

    land = Claim.land

    def failing(self, dest, block_tokens):
        land(self, dest, block_tokens)
        grid = dest[..., : self.hits.shape[1] * block_tokens, :].unflatten(3, (self.hits.shape[1], block_tokens))
        rows, positions = np.nonzero(self.hits)
        grid[:, rows, :, positions] = float("nan")  # what landed in the hits' places is garbage ...
        raise DiskTierError("injected: checksum mismatch")  # ... and the read says so

    monkeypatch.setattr(Claim, "land", failing)
    out = attend(executor, q, None, DIM**-0.5, None, SparseBudget(3 * BT, sinks=BT, recent=0))
    assert executor.counters.speculation.failed == 1 and executor.counters.speculation.hits == 4
    torch.testing.assert_close(out.double(), reference_attention(q, kv, executor.last_columns, DIM**-0.5),
                               atol=1e-5, rtol=0)
    executor.close()


def test_a_table_edit_drops_the_speculation(tmp_path):
    """A guess made before a table edit (a crop) is dropped unused, however right it was; the step reads what
    it selects the ordinary way."""
    store, kv = store_with_needles(tmp_path, {0: 5, 1: 10})
    executor = SparseAttention(store, ThreadMover())
    executor.speculation.remember(0, np.array([[0, 5], [0, 10]]), None)
    executor.speculation.launch(0, None)
    store.crop(0, BT)
    executor.invalidate()
    out = attend(executor, query_for_head(0), None, DIM**-0.5, None, SparseBudget(3 * BT, sinks=BT, recent=0))
    assert executor.counters.speculation.hits == 0 and executor.counters.speculation.reads == 1
    cropped = kv[..., : kv.shape[3] - BT, :]
    torch.testing.assert_close(out.double(), reference_attention(query_for_head(0), cropped, executor.last_columns,
                                                                 DIM**-0.5), atol=1e-5, rtol=0)
    executor.close()


def test_a_corrupted_speculated_block_is_refused(tmp_path):
    """A hit comes out of the speculative read only after its checksum is verified: a byte flipped on disk in a
    guessed needle's slot fails the speculation, and the ordinary read of it raises IntegrityError — the step
    never attends the corrupted bytes."""
    store, _ = store_with_needles(tmp_path, {0: 5, 1: 10})
    executor = SparseAttention(store, ThreadMover())
    slot_file = next(iter(store.tiers[Tier.DISK].files.values()))
    slot = int(store.table.layer_rows(0).slots[0, 5])
    flip(slot_file.path, slot * slot_file.slot_bytes + 7, 0x10)
    executor.speculation.remember(0, np.array([[0, 5], [0, 10]]), None)
    executor.speculation.launch(0, None)
    with pytest.raises(IntegrityError, match=f"slot {slot} "):
        attend(executor, query_for_head(0), None, DIM**-0.5, None, SparseBudget(3 * BT, sinks=BT, recent=0))
    assert executor.counters.speculation.failed == 1 and executor.counters.speculation.hits == 4
    executor.close()
