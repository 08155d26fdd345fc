"""A prefix store (``persist=``, ``remote=``) keeps a block of every layer: where the layers cache K/V of several
shapes (Gemma 4: its full-attention layers' heads are twice as wide as its sliding ones') a block record holds each
layer's K/V in its own shape, one after the other, and the namespace says each layer's shape. A prefix stored by
one cache is loaded by the next (on disk and in a real Redis), exactly; a saved conversation of such a cache keeps
its namespace; records and files of another geometry are refused. Only a model whose layers differ in shape *and*
some of which hold no K/V of their own is still refused, with the fix."""

from __future__ import annotations

import pytest
import torch
from models import prompt
from test_hf_architectures import architecture
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.errors import IntegrityError, InvalidConfigError
from tierkv.persist import record
from tierkv.persist.keys import Namespace

NEW = 4


def generated(model, ids, mask, cache):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, past_key_values=cache)


def assert_same(out, reference) -> None:
    assert torch.equal(out.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(reference.logits), atol=1e-4, rtol=0)


@pytest.mark.parametrize("config", [True, False], ids=["config", "no-config"])
def test_a_prefix_of_layers_of_two_widths_is_stored_and_loaded_exactly(tmp_path, config):
    model = architecture("gemma4_text")
    ids, mask = prompt(1, 24, seed=1)
    reference = generated(model, ids, mask, DynamicCache(config=model.config))
    options = dict(gpu_gb="1MB", cpu_gb="8KB", disk_dir=tmp_path, block_tokens=4, persist=True,
                   **({"config": model.config} if config else {}))
    with TieredCache(**options) as cache:
        assert cache.load_prefix(model, ids) == 0
        assert_same(generated(model, ids, mask, cache), reference)
        cache.flush()
        namespace = cache.session.namespace
    assert namespace.shapes == ((2, 16), (2, 32)) and namespace.block_shape == (2 * 2 * 4 * 16 + 2 * 2 * 4 * 32,)
    with TieredCache(**options) as cache:
        assert cache.load_prefix(model, ids) == 20
        assert_same(generated(model, ids, mask, cache), reference)


def test_layers_of_one_shape_in_a_heterogeneous_config_keep_the_namespace_they_had(tmp_path):
    """Gemma 4 with full-attention heads as wide as its sliding ones: one shape, the five-dimensional blocks and
    the root of a namespace without per-layer shapes (stores written before stay valid)."""
    model = architecture("gemma4_text", global_head_dim=16)
    ids, mask = prompt(1, 24, seed=1)
    options = dict(gpu_gb="1MB", cpu_gb="8KB", disk_dir=tmp_path, block_tokens=4, persist=True, config=model.config)
    with TieredCache(**options) as cache:
        assert cache.load_prefix(model, ids) == 0
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, past_key_values=cache)
        cache.flush()
        namespace = cache.session.namespace
    assert namespace.shapes == () and "shapes" not in namespace.to_dict()
    assert namespace.block_shape == (2, 2, 2, 4, 16)
    with TieredCache(**options) as cache:
        assert cache.load_prefix(model, ids) == 20


def test_a_prefix_of_layers_of_two_widths_through_redis(tmp_path, redis_server):
    model = architecture("gemma4_text")
    ids, mask = prompt(1, 24, seed=2)
    reference = generated(model, ids, mask, DynamicCache(config=model.config))
    options = dict(gpu_gb="1MB", cpu_gb="8KB", block_tokens=4, remote=redis_server.url, config=model.config)
    with TieredCache(disk_dir=tmp_path / "a", **options) as cache:
        cache.load_prefix(model, ids)
        generated(model, ids, mask, cache)
        cache.flush()
    with TieredCache(disk_dir=tmp_path / "b", **options) as cache:
        assert cache.load_prefix(model, ids) == 20
        assert_same(generated(model, ids, mask, cache), reference)


def test_a_block_of_another_geometry_is_refused():
    """A record under the right key but in another geometry (the layers' shapes swapped, or one shape for all)
    is not this namespace's block; one in its own is read back as written."""
    model = architecture("gemma4_text")
    mixed = Namespace.of_model(model, 4, shapes=[(2, 16), (2, 32)])
    swapped = Namespace.of_model(model, 4, shapes=[(2, 32), (2, 16)])
    assert mixed.root != swapped.root and mixed.block_shape == swapped.block_shape
    key = mixed.root

    def sealed(namespace: str, kv: torch.Tensor) -> bytearray:
        head, body = record.encode_block(key, namespace, 0, kv)
        return bytearray(head + bytes(body))

    for wrong in (sealed(swapped.root, torch.zeros(swapped.block_shape)),
                  sealed(mixed.root, torch.zeros(2, 2, 2, 4, 24))):  # the same bytes in five dimensions
        with pytest.raises(IntegrityError, match="differ from the expected"):
            record.decode_block(wrong, key=key, namespace=mixed)
    kv = torch.arange(mixed.block_shape[0], dtype=torch.float32)
    assert torch.equal(record.decode_block(sealed(mixed.root, kv), key=key, namespace=mixed), kv)


def test_layers_of_several_widths_some_without_their_own_kv_are_refused():
    model = architecture("gemma4_text")
    with pytest.raises(InvalidConfigError, match="2 shapes .*2 x 16, 2 x 32.*hold none of their own.*without "
                                                 "persist= / remote="):
        Namespace.of_model(model, 4, shapes=[(2, 16), (2, 32), (2, 32)])  # three K/V layers of a 2-layer model


def test_a_saved_conversation_keeps_each_layers_shape_and_a_crafted_one_is_refused(tmp_path):
    """The file's namespace lists each layer's shape; loaded, the conversation continues as DynamicCache does."""
    model = architecture("gemma4_text")
    ids, mask = prompt(1, 12, seed=4)
    budgets = dict(gpu_gb="1MB", cpu_gb="4KB", block_tokens=4)
    with TieredCache(disk_dir=tmp_path / "a", persist=True, config=model.config, **budgets) as cache:
        cache.load_prefix(model, ids)
        sequence = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                                  past_key_values=cache)
        cache.save(tmp_path / "turn.tkv", model=model)
    reference = generated(model, sequence, torch.ones_like(sequence), DynamicCache(config=model.config))
    with TieredCache.load(tmp_path / "turn.tkv", model=model, disk_dir=tmp_path / "b", **budgets) as cache:
        assert_same(generated(model, sequence, torch.ones_like(sequence), cache), reference)
    records = _records(tmp_path / "turn.tkv")
    assert records[0][0]["namespace"]["shapes"] == [[2, 16], [2, 32]]
    for crafted in ([[2, 16], [2, 16]], [[2, 16]], [[2, 32], [2, 16]], [[2, 16], [2, "32"]], [[2, 16], [2, 0]]):
        header = {**records[0][0], "namespace": {**records[0][0]["namespace"], "shapes": crafted}}
        path = tmp_path / "crafted.tkv"
        _write(path, [(header, records[0][1]), *records[1:]])
        with pytest.raises(IntegrityError, match="shapes|heads"):
            TieredCache.load(path, model=model, disk_dir=tmp_path / "c", **budgets)


def _records(path) -> list[tuple[dict, bytearray]]:
    out = []
    with open(path, "rb") as f:
        while f.peek(1):
            out.append(record.read(f, "file"))
    return out


def _write(path, records) -> None:
    with open(path, "wb") as f:
        for header, payload in records:
            head, body = record.encode(header, payload)
            f.write(head)
            f.write(body)
