"""The KV block store: the table, where each block lives, and moving the bytes.

- :mod:`.kvstore` — :class:`KVStore`: appends, table edits (crop, select, drop front), reads, device
  reservations, lifecycle;
- :mod:`.edits` — the two phases (allocate and write, then commit) of an append's general path and a crop;
- :mod:`.plan` — :class:`ReadPlan`: a layer's read as index arrays per source tier, cached;
- :mod:`.placement` — placement, demotion down (and promotion up) the tier chain, staging reservation and
  evacuation;
- :mod:`.transfer` — data movement (reads into staging, block writes, slot copies) and byte counters;
- :mod:`.writeback` — background host->disk write-back ahead of need;
- :mod:`.summaries` — per-block key summaries (and the rest copy) that sparse attention ranks blocks by;
- :mod:`.consistency` — the store's invariants (for tests) and recovery after an interrupted operation;
- :mod:`.export` — blocks read out for persistence.

Services only sparse attention uses (summaries, promotion) are in :mod:`tierkv.attention.sparse_store`.
"""

from tierkv.store.kvstore import KVStore, Reader
from tierkv.store.plan import ReadPlan, Run, TierPart
from tierkv.store.transfer import LINKS, PartTiming

__all__ = ["LINKS", "KVStore", "PartTiming", "ReadPlan", "Reader", "Run", "TierPart"]
