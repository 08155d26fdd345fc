"""Boundaries of the masks the attention paths build and take: exactly the keys in ``[start, stop)`` are attended,
and a mask one column short of the keys is refused (the C kernel would read past it)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tierkv.attention import host_kernel
from tierkv.attention.lse import position_bias
from tierkv.errors import InvalidConfigError
from tierkv.layout import BlockLayout


def _reference_bias(positions: torch.Tensor, start: int, stop: int, mask: torch.Tensor | None) -> torch.Tensor:
    lowest = torch.finfo(torch.float32).min
    out = torch.zeros(positions.shape, dtype=torch.float32)
    for b in range(positions.shape[0]):
        for t in range(positions.shape[1]):
            p = int(positions[b, t])
            inside = start <= p < stop
            if inside and mask is not None and not bool(mask[b if mask.shape[0] > 1 else 0, 0, -1, p - start]):
                inside = False
            out[b, t] = 0.0 if inside else lowest
    return out[:, None, None, :]


@pytest.mark.parametrize("masked", [False, True])
def test_position_bias_attends_exactly_the_positions_from_start_to_before_stop(masked):
    """A staged position equal to ``stop`` (the open tail's first empty slot) is not attended, nor one before
    ``start`` or after ``stop``; inside, the mask decides."""
    start, stop = 3, 11
    positions = torch.tensor([[0, 2, 3, 4, 10, 11, 12, 15], [3, 5, 7, 9, 10, 11, -1, 13]])
    mask = None
    if masked:
        mask = torch.ones(2, 1, 1, stop - start, dtype=torch.bool)
        mask[1, 0, 0, 2] = False  # row 1 hides position 5
    got = position_bias(positions, start, stop, mask, torch.float32)
    torch.testing.assert_close(got, _reference_bias(positions, start, stop, mask), rtol=0, atol=0)


_needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                     reason="no C compiler: the C kernel cannot be built")  # fmt: skip


@pytest.mark.parametrize("attend", [pytest.param(host_kernel.paged_attention, id="native", marks=_needs_compiler),
                                    pytest.param(host_kernel.paged_attention_torch, id="torch")])
@pytest.mark.parametrize("mask_start", [0, 5])
def test_a_mask_one_key_short_is_refused_and_an_exact_one_attends(attend, mask_start):
    """The mask must cover every key position below the length: one column short is refused (the C kernel would
    read the column past its end: another query's row, or past the buffer), exactly enough is attended."""
    gen = torch.Generator().manual_seed(0)
    kv_heads, dim, bt, tokens = 1, 8, 8, 16
    layout = BlockLayout(kv_heads, dim, bt, torch.float32)
    raw = torch.zeros((2, layout.slot_bytes), dtype=torch.uint8)
    slab = layout.blocks_of(raw)
    slab.copy_(torch.randn(slab.shape, generator=gen))
    table = np.array([[0, 1]], dtype=np.int64)
    q = torch.randn(1, 2, 1, dim, generator=gen)
    short = torch.ones(1, 1, 1, tokens - mask_start - 1, dtype=torch.bool)
    with pytest.raises(InvalidConfigError, match="mask covers"):
        attend(q, slab, table, tokens, scaling=0.3, causal=False, mask=short, mask_start=mask_start)
    exact = torch.ones(1, 1, 1, tokens - mask_start, dtype=torch.bool)
    out, lse = attend(q, slab, table, tokens, scaling=0.3, causal=False, mask=exact, mask_start=mask_start)
    keys = slab[:, 0].permute(1, 0, 2, 3).reshape(kv_heads, tokens, dim)[:, mask_start:]
    values = slab[:, 1].permute(1, 0, 2, 3).reshape(kv_heads, tokens, dim)[:, mask_start:]
    scores = (q[0] * 0.3) @ keys.transpose(-1, -2)  # [H_q, 1, keys] (one kv head)
    torch.testing.assert_close(out[0], scores.softmax(-1) @ values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[0], scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
