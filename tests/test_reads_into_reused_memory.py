"""Reads land where the destination says, whatever was read before: a destination at the same address with
another shape (a staging buffer reused for a longer context) gets the blocks laid out by its own strides, and
``read_tokens`` returns exactly the token range asked for."""

from __future__ import annotations

import torch
from helpers import kv, make_store


def test_a_destination_at_a_reused_address_with_another_shape_gets_the_right_tokens(tmp_path):
    store = make_store(tmp_path, device_slots=4, host_slots=4)  # blocks on every tier
    keys, values = kv(1, 30, seed=3)
    store.append(0, keys, values)
    expected = torch.stack((keys, values))  # [2, B, H, 30, D]
    plan = store.plan_read(0, 0, 30)
    _, batch, heads, _, dim = expected.shape
    width = plan.blocks * store.block_tokens  # 32 tokens of whole blocks
    base = torch.zeros(2 * batch * heads * 2 * width * dim)
    for tokens in (width, 2 * width):  # one address, two shapes (and strides)
        dest = base[: 2 * batch * heads * tokens * dim].view(2, batch, heads, tokens, dim)
        dest.zero_()
        store.read_into(0, plan, dest)
        torch.testing.assert_close(dest[..., :30, :], expected, rtol=0, atol=0)
    store.close()


def test_read_tokens_returns_the_range_asked_for(tmp_path):
    store = make_store(tmp_path, device_slots=4, host_slots=4)
    keys, values = kv(2, 30, seed=4)
    store.append(0, keys, values)
    expected = torch.stack((keys, values))
    for start, stop in ((0, 30), (5, 10), (8, 30), (13, 14), (29, 30)):
        torch.testing.assert_close(store.read_tokens(0, start, stop), expected[..., start:stop, :], rtol=0, atol=0)
    store.close()
