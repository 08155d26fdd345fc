"""Reading stored blocks out of the store for persistence (prefix files, saved conversations), not for decoding."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tierkv.blocks import Tier
from tierkv.errors import InvalidConfigError

if TYPE_CHECKING:
    from tierkv.store.kvstore import KVStore


def export_blocks(store: KVStore, layer: int, first: int, stop: int) -> torch.Tensor:
    """Blocks ``[first, stop)`` (sequence indices) of every row of ``layer`` as a fresh host tensor
    ``[B, n, 2, H_kv, block_tokens, D]``, one read per source tier. No access is recorded (the policy must not
    take a save for attention); a partial tail comes with its unused positions zeroed."""
    rows = store.table.rows[layer]
    layout = store.layouts[layer]
    lo, hi = first - rows.front, stop - rows.front
    if not 0 <= lo <= hi <= rows.count:
        raise InvalidConfigError(f"blocks [{first}, {stop}) of layer {layer} are not held (it holds "
                                 f"[{rows.front}, {rows.front + rows.count})).")
    tiers, slots = rows.tiers[:, lo:hi], rows.slots[:, lo:hi]
    out = torch.empty((rows.batch, hi - lo, *layout.shape), dtype=layout.dtype)
    for tier in np.unique(tiers).tolist():
        where = tiers == tier
        into = Tier.DEVICE if tier == Tier.DEVICE else Tier.HOST  # the source's side, then to this host tensor
        out[torch.from_numpy(where)] = store.transfer.read_blocks(layout, Tier(tier), slots[where].tolist(),
                                                                  into=into).cpu()
    return out
