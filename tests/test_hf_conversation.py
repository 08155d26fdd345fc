"""tierkv.hf.conversation: a conversation file is untrusted input — its K/V never reaches the shared stores under
the token ids it claims — and the sync and async faces load the same cache."""

from __future__ import annotations

import asyncio

import pytest
import torch
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.hf import cache_keyword

BT = 4


def _generate(model, ids, cache, new: int) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_keyword(model): cache},
                          max_new_tokens=new, do_sample=False)


def _poisoned_file(model, tmp_path, claimed: torch.Tensor, computed: torch.Tensor):
    """A conversation file with valid checksums whose K/V is ``computed``'s but whose ids say ``claimed``: made
    by a cache told one prompt and run on another (its own persistent directory, apart from the victim's)."""
    path = tmp_path / "poisoned.tkv"
    with TieredCache(block_tokens=BT, disk_dir=tmp_path / "attacker", persist=True) as cache:
        cache.load_prefix(model, claimed)  # records the claimed ids, loads nothing
        model(computed, **{cache_keyword(model): cache})
        cache.save(path, model=model)
    return path


def test_a_poisoned_conversation_never_reaches_the_persistent_store(tmp_path):
    model = tiny_model("llama")
    claimed, _ = prompt(1, 24, seed=7)
    computed, _ = prompt(1, 24, seed=8)
    path = _poisoned_file(model, tmp_path, claimed, computed)
    victim = dict(block_tokens=BT, disk_dir=tmp_path / "shared", persist=True)
    with TieredCache.load(path, model=model, **victim) as loaded:
        _generate(model, torch.cat([claimed, claimed[:, -1:]], dim=1), loaded, 3)  # decodes on top of it
        loaded.flush()
    with TieredCache(**victim) as fresh:
        assert fresh.load_prefix(model, claimed) == 0  # nothing was stored under the claimed ids
        expected = model(claimed, past_key_values=DynamicCache()).logits
        torch.testing.assert_close(model(claimed, **{cache_keyword(model): fresh}).logits, expected,
                                   atol=1e-5, rtol=0)


def test_a_loaded_conversation_records_no_ids_and_stays_private_across_turns(tmp_path):
    model = tiny_model("llama")
    ids, _ = prompt(1, 16, seed=3)
    options = dict(block_tokens=BT, disk_dir=tmp_path / "d", persist=True)
    with TieredCache(**options) as cache:
        cache.load_prefix(model, ids)
        so_far = _generate(model, ids, cache, 1)
        cache.save(tmp_path / "c.tkv", model=model)
    with TieredCache.load(tmp_path / "c.tkv", model=model, **options) as loaded:
        assert loaded.session.ids is None and loaded.session.private
        following = torch.cat([so_far, ids[:, :5]], dim=1)
        assert loaded.load_prefix(model, following) == ids.shape[1]  # the next turn: nothing recorded
        assert loaded.session.ids is None
        _generate(model, following, loaded, 2)
        loaded.reset()  # a new sequence is this process's own again
        assert not loaded.session.private


@pytest.mark.parametrize("face", ["sync", "async"])
def test_both_faces_load_the_same_conversation(tmp_path, face):
    pytest.importorskip("aiofiles")
    model = tiny_model("llama")
    ids, _ = prompt(1, 18, seed=4)
    reference = DynamicCache()
    model(ids, past_key_values=reference)
    with TieredCache(block_tokens=BT) as cache:
        model(ids, **{cache_keyword(model): cache})
        cache.save(tmp_path / "c.tkv", model=model)
    loaded = TieredCache.load(tmp_path / "c.tkv", model=model) if face == "sync" else \
        asyncio.run(TieredCache.aload(tmp_path / "c.tkv", model=model))
    with loaded:
        token = ids[:, -1:]
        torch.testing.assert_close(model(token, **{cache_keyword(model): loaded}).logits,
                                   model(token, past_key_values=reference).logits, atol=1e-5, rtol=0)
