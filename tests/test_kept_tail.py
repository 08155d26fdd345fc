"""A kept layer never serves a unit's bytes from before it was the open tail: the tail changes (tokens are appended
to it), so a kept copy of a unit that is now the tail is forgotten, and reading it again later is a miss."""

from __future__ import annotations

import numpy as np
import torch

from tierkv.attention.kept import KeptLayer


def test_a_kept_unit_that_became_the_tail_is_forgotten_and_read_again():
    kept = KeptLayer(torch.zeros(1 << 12, dtype=torch.uint8), batch=2, capacity=3, unit_tokens=4)
    ids = np.array([[7, 8], [9, 10]], dtype=np.int64)
    columns = np.array([[0, 1], [0, 1]], dtype=np.int64)
    none = np.zeros(ids.shape, dtype=bool)
    first = kept.place(ids, columns, none, step=0)
    assert not first.hit.any() and (first.positions >= 0).all()
    kept.record(first, ids)
    again = kept.place(ids, columns, none, step=1)
    assert again.hit.all()  # held: nothing to read
    tail = np.array([[False, True], [False, False]])  # a table edit made row 0's unit 8 the open tail again
    as_tail = kept.place(ids, columns, tail, step=2)
    assert not as_tail.hit[0, 1] and as_tail.positions[0, 1] == -1  # the tail is read, never kept
    later = kept.place(ids, columns, none, step=3)  # unit 8 is full again: its bytes changed while it was the tail
    assert later.hit.tolist() == [[True, False], [True, True]]
    assert later.targets[0, 1] == 1  # read again into its staging position
