"""The KV block store, split along its concepts.

- :mod:`.facade` — :class:`KVStore`: appends, table edits (crop, select, drop front), reads, lifecycle;
- :mod:`.plan` — :class:`ReadPlan`: a layer's read as index arrays per source tier, cached;
- :mod:`.placement` — placement, demotion down the tier chain, staging reservation and evacuation;
- :mod:`.transfer` — data movement (reads into staging, block writes, slot copies) and byte counters;
- :mod:`.writeback` — background host->disk write-back ahead of need.
"""

from tierkv.store.facade import KVStore, Reader
from tierkv.store.plan import ReadPlan, Run, TierPart
from tierkv.store.transfer import LINKS, ReadProbe

__all__ = ["LINKS", "KVStore", "ReadPlan", "ReadProbe", "Reader", "Run", "TierPart"]
