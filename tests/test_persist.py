"""Persistence: content addresses, the record format, the persistent store, and prefix reuse through
``TieredCache(persist=True)`` on real transformers models (tests/models.py)."""

from __future__ import annotations

import io

import pytest
import torch
from models import tiny_model

from tierkv.errors import IntegrityError
from tierkv.persist import record
from tierkv.persist.keys import Namespace, block_keys, model_fingerprint

BT = 4


# ------------------------------------------------------------------------------------------------ keys
def test_block_keys_chain_over_the_whole_prefix():
    root = "r" * 32
    ids = list(range(10, 30))  # 5 full blocks of 4
    keys = block_keys(root, ids, BT)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert block_keys(root, ids + [7, 7], BT) == keys  # a partial last block has no key
    changed = ids.copy()
    changed[9] = 99  # block 2
    other = block_keys(root, changed, BT)
    assert other[:2] == keys[:2] and all(a != b for a, b in zip(other[2:], keys[2:]))
    assert all(a != b for a, b in zip(block_keys("s" * 32, ids, BT), keys))  # another namespace: nothing shared
    # the same tokens in a later block have another key (the chain, not the block's own tokens)
    repeated = block_keys(root, [1, 2, 3, 4] * 2, BT)
    assert repeated[0] != repeated[1]
    assert block_keys(root, torch.tensor(ids), BT) == keys


def test_namespace_separates_models_dtypes_layouts_and_attention():
    model = tiny_model("llama")
    base = Namespace.of_model(model, BT)
    assert base == Namespace.of_model(model, BT)  # deterministic
    assert base.block_shape == (2, 2, 2, BT, 16)
    others = {
        "qwen2": Namespace.of_model(tiny_model("qwen2"), BT),
        "layers": Namespace.of_model(tiny_model("llama", layers=3), BT),
        "eager": Namespace.of_model(tiny_model("llama", attn="eager"), BT),
        "block_tokens": Namespace.of_model(model, BT * 2),
    }
    roots = {name: ns.root for name, ns in others.items()}
    assert base.root not in roots.values() and len(set(roots.values())) == len(roots)
    half = Namespace(**{**base.to_dict(), "dtype": "bfloat16"})
    assert half.root != base.root


def test_fingerprint_sees_weights_not_the_load_path():
    model = tiny_model("llama")
    before = model_fingerprint(model)
    changed = tiny_model.__wrapped__("llama")  # a fresh copy of the same weights
    assert model_fingerprint(changed) == before
    changed.config._name_or_path = "/somewhere/else"
    assert model_fingerprint(changed) == before
    with torch.no_grad():
        changed.model.layers[1].self_attn.k_proj.weight.add_(1e-3)  # a fine-tune of one matrix
    assert model_fingerprint(changed) != before
    assert model_fingerprint(changed.to(torch.bfloat16)) != before


# ---------------------------------------------------------------------------------------------- record
def _block(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn((2, 2, 2, BT, 16), generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_record_round_trip(dtype):
    ns = Namespace.of_model(tiny_model("llama"), BT)
    ns = Namespace(**{**ns.to_dict(), "dtype": str(dtype).removeprefix("torch.")})
    kv = _block(1, dtype)
    head, payload = record.encode_block("k" * 32, ns.root, 3, kv)
    data = bytearray(head) + payload
    back = record.decode_block(data, key="k" * 32, namespace=ns)
    assert back.dtype == dtype and torch.equal(back, kv)
    header, _ = record.read(io.BytesIO(bytes(data)))
    assert header["depth"] == 3 and header["kind"] == "block"
    with pytest.raises(IntegrityError, match="not"):
        record.decode_block(data, key="x" * 32)
    with pytest.raises(IntegrityError, match="differ"):
        record.decode_block(data, namespace=Namespace(**{**ns.to_dict(), "fingerprint": "other"}))


def test_every_flipped_byte_and_every_truncation_is_detected():
    head, payload = record.encode({"kind": "test", "n": 1}, bytes(range(64)))
    data = bytes(head) + bytes(payload)
    for position in range(len(data)):
        for bit in (0, 7):
            flipped = bytearray(data)
            flipped[position] ^= 1 << bit
            with pytest.raises(IntegrityError):
                record.decode(flipped)
    for length in range(len(data)):
        with pytest.raises(IntegrityError):
            record.decode(data[:length])
        with pytest.raises(IntegrityError):
            record.read(io.BytesIO(data[:length]))
    with pytest.raises(IntegrityError):
        record.decode(data + b"\0")


def test_records_stream_back_to_back(tmp_path):
    aiofiles = pytest.importorskip("aiofiles")
    import asyncio

    path = tmp_path / "two"
    with open(path, "wb") as f:
        for n in (1, 2):
            head, payload = record.encode({"n": n}, bytes([n]) * (n * 1000))
            f.write(head)
            f.write(payload)
    with open(path, "rb") as f:
        assert [record.read(f)[0]["n"] for _ in range(2)] == [1, 2]

    async def both():
        async with aiofiles.open(path, "rb") as f:
            return [(await record.aread(f)) for _ in range(2)]

    (first, one), (second, two) = asyncio.run(both())
    assert (first["n"], second["n"]) == (1, 2) and bytes(two) == b"\2" * 2000 and len(one) == 1000
