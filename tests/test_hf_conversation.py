"""tierkv.hf.conversation: a conversation file is untrusted input — its K/V never reaches the shared stores under
the token ids it claims — and the sync and async faces load the same cache."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import conversation_records
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.errors import IntegrityError, InvalidConfigError
from tierkv.hf import cache_keyword
from tierkv.persist import record

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


def _rewritten(path, layers: list[dict], blocks: tuple[int, int], at: int | None = None, shape=None) -> None:
    """``path`` with the header's ``layers`` replaced and each layer's K/V record cut to the saved ``blocks``
    (first, stop: real bytes; each layer is one record in these small files), placed at block ``at`` (default:
    first); checksums valid. ``shape``: another [kv_heads, head_dim] for the same bytes. A layer beyond the
    saved ones repeats the last one's K/V."""
    records = conversation_records(path)
    head, ids = records[0]
    kv = [(h, p) for h, p in records[1:] if h["kind"] == "kv"]
    out = [({**head, "layers": layers}, ids)]
    first, stop = blocks
    for index in range(len(layers)):
        h, p = kv[min(index, len(kv) - 1)]
        per = len(p) // h["shape"][1]
        heads, dim = shape or (h["shape"][3], h["shape"][5])
        out.append(({**h, "layer": index, "first": first if at is None else at,
                     "shape": [h["shape"][0], stop - first, 2, heads, h["shape"][4], dim]},
                    p[per * first: per * stop]))
    out.append(({"kind": "end", "records": len(out)}, b""))
    with open(path, "wb") as f:
        for h, p in out:
            f.write(b"".join(record.encode(h, p)))


def _saved(model, tmp_path, tokens: int):
    """A real conversation of ``tokens`` tokens (a cache built from the config), its header's layers and ids."""
    ids, _ = prompt(1, tokens, seed=9)
    path = tmp_path / "c.tkv"
    with TieredCache(block_tokens=BT, config=model.config) as cache:
        model(ids, **{cache_keyword(model): cache})
        cache.save(path, model=model)
    return path, conversation_records(path)[0][0]["layers"], ids


@pytest.mark.parametrize(("family", "window", "change", "blocks", "at", "match"), [
    ("llama", None, {"dropped": 4}, (1, 5), None, "no sliding window"),
    # a window of 8 over 18 tokens still reaches back to token 11
    ("mistral", 8, {"dropped": 12}, (3, 5), None, "window of 8 over 18 tokens still reaches token 11"),
    ("mistral", 8, {"dropped": 6}, (1, 5), None, "not a whole number of blocks"),
    ("llama", None, {"sliding_window": 8}, (0, 5), None, "sliding window is 8, the model's None"),
    ("llama", None, "one layer more", (0, 5), None, "it holds 3 layers, the model 2"),
    # (no cache holds layers of different lengths: layer 1 would attend 4 tokens fewer, 0.05 off)
    ("llama", None, {1: {"length": 14}}, (0, 4), None, r"its layers hold \[14, 18\] tokens"),
])  # fmt: skip
def test_impossible_layer_state_is_refused_before_a_cache_is_built(tmp_path, family, window, change, blocks, at,
                                                                     match):
    """Sweep finding 8: a file whose K/V bytes are the model's own but whose per-layer state the cache can never
    make (a full-attention layer missing its first block, a window's tokens dropped, another window or layer
    count) loaded and decoded wrong. Each is an IntegrityError naming the
    file, raised before any tier exists; the untouched file still decodes as DynamicCache does."""
    model = tiny_model(family, "sdpa", window)
    path, layers, ids = _saved(model, tmp_path, 18)  # 18 tokens: blocks 0-4 in every layer
    crafted = tmp_path / "crafted.tkv"
    crafted.write_bytes(path.read_bytes())
    if change == "one layer more":
        layers = layers + [{**layers[-1], "index": 2}]
    elif 1 in change:  # one layer's fields
        layers = [{**layer, **change.get(i, {})} for i, layer in enumerate(layers)]
    else:
        layers = [{**layer, **change} for layer in layers]
    _rewritten(crafted, layers, blocks, at)
    with pytest.raises(IntegrityError, match=match) as info:
        TieredCache.load(crafted, model=model, disk_dir=tmp_path / "tiers")
    assert str(crafted) in str(info.value)
    assert not (tmp_path / "tiers").exists()  # refused before any tier was made
    _decodes_like_dynamic_cache(model, path, ids)


def test_kv_of_another_geometry_than_the_models_config_is_refused(tmp_path):
    """Sweep finding 8: K/V records whose heads and head dim differ from the model's config (same bytes, the
    file carries no namespace) loaded, and only the first forward refused them. Now loading does."""
    model = tiny_model("llama")
    path, layers, ids = _saved(model, tmp_path, 18)
    crafted = tmp_path / "crafted.tkv"
    crafted.write_bytes(path.read_bytes())
    _rewritten(crafted, layers, (0, 5), shape=(4, 8))
    with pytest.raises(IntegrityError, match="4 heads of 8; the model's config has 2 heads of 16"):
        TieredCache.load(crafted, model=model)
    _decodes_like_dynamic_cache(model, path, ids)


def _decodes_like_dynamic_cache(model, path, ids) -> None:
    """The conversation at ``path`` (of ``ids``) loads and its next step equals DynamicCache's."""
    reference = DynamicCache()
    model(ids, past_key_values=reference)
    token = ids[:, -1:]
    with TieredCache.load(path, model=model) as loaded:
        torch.testing.assert_close(model(token, **{cache_keyword(model): loaded}).logits,
                                   model(token, past_key_values=reference).logits, atol=1e-5, rtol=0)


def test_a_close_while_saving_stops_the_save_with_a_clear_error(tmp_path):
    """Regression: ``save()`` read the tiers without the cache's lock, so a ``close()`` from another thread released
    them mid-save and the save failed with a raw KeyError. Each record is made under the lock (a close waits for
    it); a close between two stops the save with the cache's error, and no file is written."""
    model = tiny_model("llama")
    ids, _ = prompt(1, 40, seed=3)
    cache = TieredCache(gpu_gb="4MB", cpu_gb="16KB", disk_dir=tmp_path / "kv", block_tokens=4, config=model.config)
    with torch.no_grad():
        model(ids, **{cache_keyword(model): cache})
    store, export = cache.store, cache.store.export_blocks

    def export_then_close(*args, **kwargs):  # a close that lands right after the first record (the lock is reentrant)
        exported = export(*args, **kwargs)
        cache.close()
        return exported

    store.export_blocks = export_then_close
    with pytest.raises(InvalidConfigError, match="closed while it was being saved"):
        cache.save(tmp_path / "chat.tkv", model=model)
    assert not (tmp_path / "chat.tkv").exists()
