"""tierkv: tiered KV-cache offloading (device HBM / pinned host RAM / NVMe) for LLM decoding.

    from tierkv import TieredCache
    cache = TieredCache(gpu_gb=20, disk_dir="/nvme/tierkv")
    out = model.generate(ids, cache=cache, max_new_tokens=256)

    with tierkv.settings.override(disk_engine="posix"):   # every TIERKV_* knob, scoped
        ...

``TieredCache`` and ``settings`` are imported lazily so ``import tierkv`` (and ``tierkv plan``) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierkv.errors import (
    BudgetTooSmallError,
    CapacityError,
    DiskFullError,
    DiskTierError,
    IntegrityError,
    InvalidConfigError,
    TierKVError,
)

if TYPE_CHECKING:
    from tierkv.hf import TieredCache

__version__ = "0.1.0"
__all__ = [
    "BudgetTooSmallError",
    "CapacityError",
    "DiskFullError",
    "DiskTierError",
    "IntegrityError",
    "InvalidConfigError",
    "TierKVError",
    "TieredCache",
]


def __getattr__(name: str) -> Any:
    if name == "TieredCache":
        from tierkv.hf import TieredCache

        return TieredCache
    if name == "settings":
        import tierkv.settings

        return tierkv.settings
    raise AttributeError(f"module 'tierkv' has no attribute {name!r}")
