"""The rest copy attends only the tokens a layer may attend: in a sliding window that starts inside a candidate
block, the tokens of that block before the window's start are left out of the rest copy's part too, whichever
path attends it (the C kernel straight from the codes, or torch). Checked against a float64 softmax over exactly
the window's tokens: an 8-bit copy stays within its rounding of it."""

from __future__ import annotations

import pytest
import torch
from test_sparse_selection_rules import DIM, GROUPS, HEADS, make_store, query

from tierkv.attention import rest_kernel
from tierkv.attention.base import Span
from tierkv.attention.sparse import SparseAttention, SparseBudget
from tierkv.mover import ThreadMover


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "torch"])
def test_the_rest_copy_leaves_out_the_tokens_before_the_window(monkeypatch, native):
    """Keys the query likes best sit at tokens 48-51, in the window's first block but before its start (56): the
    step (three pages read, the rest from an 8-bit copy) must match attention over tokens 56 onwards alone."""
    if native and not rest_kernel.available():
        pytest.skip("no C compiler: the kernel cannot be built")
    monkeypatch.setattr(rest_kernel, "runs_on", lambda device, native=native: native)
    bt, page = 16, 4
    tokens, start = 10 * bt + 2, 3 * bt + 8
    store, kv = make_store(bt, tokens, (6 * bt + 4, 6 * bt + 8), page=page, stronger=(3 * bt, 3 * bt + 4))
    executor = SparseAttention(store, ThreadMover())
    executor.budget = SparseBudget(3 * page, recent=0, page_tokens=page, rest_bits=8)
    q = query()
    out, _ = executor.attend(Span.of(store, 0, start), q, None, DIM**-0.5, None)
    assert executor.counters.rest_layer_steps == 1
    reference = []
    for row in range(2):
        k = kv[0, row][:, start:].double().repeat_interleave(GROUPS, 0)
        v = kv[1, row][:, start:].double().repeat_interleave(GROUPS, 0)
        weights = torch.softmax(q[row, :, 0].double()[:, None] @ k.transpose(1, 2) * DIM**-0.5, dim=-1)
        reference.append((weights @ v)[:, 0])
    assert out.shape == (2, HEADS * GROUPS, 1, DIM)
    torch.testing.assert_close(out[:, :, 0].double(), torch.stack(reference), atol=0.01, rtol=0)
    executor.close()
