"""The KV layout and the store that the store-level measurements (gather, contention, layer overhead) run on.

Llama-3-8B's KV heads in fp16, in ``block_bytes`` blocks, in a real :class:`~tierkv.store.KVStore` with LRU
and no disk tier: the runtime's own code, not a model of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierkv.calibrate.config import BenchConfig

if TYPE_CHECKING:
    from tierkv.store import KVStore

KV_HEADS, HEAD_DIM, KV_DTYPE = 8, 128, torch.float16
KV_TOKEN_BYTES = 2 * KV_HEADS * HEAD_DIM * KV_DTYPE.itemsize
"""Bytes of K and V of one token of one layer."""
CPU = torch.device("cpu")  # contention and layer overhead are measured on CPU-only hosts


def block_tokens(cfg: BenchConfig) -> int:
    """Tokens per block: as many as fit in ``cfg.block_bytes``."""
    return max(1, cfg.block_bytes // KV_TOKEN_BYTES)


def bench_store(cfg: BenchConfig, device_bytes: int, host_bytes: int, device: torch.device) -> KVStore:
    """A ``KVStore`` of this layout with these tier budgets; the host tier is pinned on CUDA, as the
    runtime's is. ``device`` must be an indexed CUDA device (``cuda:0``), the one its tensors report."""
    from tierkv.blocks import Tier
    from tierkv.policy import make_policy
    from tierkv.store import KVStore
    from tierkv.tiers.memory import MemoryTier

    return KVStore(MemoryTier(Tier.DEVICE, device_bytes, device),
                   MemoryTier(Tier.HOST, host_bytes, torch.device("cpu"), pin=device.type == "cuda"),
                   None, make_policy("lru"), block_tokens(cfg))  # fmt: skip


def kv_tensor(tokens: int, device: torch.device) -> torch.Tensor:
    """K (or V) of ``tokens`` tokens for one layer, ``[1, H_kv, T, D]``."""
    return torch.ones(1, KV_HEADS, tokens, HEAD_DIM, dtype=KV_DTYPE, device=device)


def compute_device() -> torch.device:
    """Where the device tier lives: the current CUDA device, indexed (``cuda:0``, never a bare ``cuda``,
    which compares unequal to the device its tensors report), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
