"""Rows that share their open tail block (beams or returned sequences repeated from one prompt) get their own
copy of it at their next token: each row reads back exactly the tokens appended to it, never another row's."""

from __future__ import annotations

import torch
from helpers import kv, make_store


def test_a_shared_tail_is_copied_before_each_row_writes_its_token(tmp_path):
    store = make_store(tmp_path, device_slots=16, host_slots=16)
    keys, values = kv(1, 6, seed=1)  # one full block and an open tail of two tokens
    store.append(0, keys, values)
    store.select_rows([0, 0])  # two rows, every block shared
    assert all(block.refcount == 2 for block in store.table.blocks.values())
    new_keys, new_values = kv(2, 1, seed=2)  # a different token for each row
    store.append(0, new_keys, new_values)
    got = store.read_tokens(0)
    for row in range(2):
        expected_keys = torch.cat((keys[0], new_keys[row]), dim=1)
        expected_values = torch.cat((values[0], new_values[row]), dim=1)
        torch.testing.assert_close(got[0, row], expected_keys, rtol=0, atol=0)
        torch.testing.assert_close(got[1, row], expected_values, rtol=0, atol=0)
    store.check()
    store.close()
