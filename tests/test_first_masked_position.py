"""What a forward's attention mask lets be persisted: only the tokens before the first position that *any* row
masks (a left-padded row masks its first positions even where the other rows do not), so K/V computed beside
padding is never stored under the ids alone."""

from __future__ import annotations

import torch

from tierkv.hf.session import first_masked


def test_the_first_position_any_row_masks():
    assert first_masked(torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])) == 0  # one left-padded row
    assert first_masked(torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])) == 2
    assert first_masked(torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])) == 1
    assert first_masked(torch.ones(2, 4, dtype=torch.long)) is None
    assert first_masked(None) is None
    assert first_masked(torch.ones(1, 1, 4, 4), fallback=3) == 3  # a 4-D mask may mask anything
