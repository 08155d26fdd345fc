"""The attention modes of a :class:`~tierkv.hf.cache.TieredCache`: context managers that switch a model's
attention to an executor that reads the cache itself (streaming, sparse, split) and restore the model's own on
exit. A mixin, so the cache class stays the list of layers and their lifetime."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, cast

import torch
from transformers import PreTrainedConfig

from tierkv import accel
from tierkv.attention.sparse import SparseBudget
from tierkv.hf import sizing
from tierkv.hf.attention import Engagement, check_model, split_mode, streaming_mode, takes_attention_functions
from tierkv.hf.choice import choose_executor
from tierkv.hf.sizing import DEFAULT_CHUNK_TOKENS
from tierkv.stats import resolve_profile

if TYPE_CHECKING:
    from tierkv.hf.cache import TieredCache
    from tierkv.hf.runtime import Runtime


class AttentionModes:
    """``streaming()``, ``sparse()``, ``split()`` and ``exact()`` of :class:`~tierkv.hf.cache.TieredCache`."""

    runtime: Runtime
    block_tokens: int
    chosen: str

    @property
    def _cache(self) -> TieredCache:
        return cast("TieredCache", self)

    def streaming(self, model: torch.nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Engagement:
        """Run ``model``'s attention as exact *streaming* attention over this cache while inside the block.

        Each layer attends chunk by chunk (``chunk_tokens`` at a time, merged by log-sum-exp), so the device
        needs two chunk buffers instead of a whole layer's K/V: contexts far beyond ``min_device_bytes``
        fit (the exact-gather staging is released on entry). The model's own attention implementation is
        restored on exit. Use it as a context manager (a call that is never entered fails the next forward)::

            with TieredCache(gpu_gb=2, disk_dir="/nvme") as cache, cache.streaming(model):
                model.generate(ids, cache=cache)
        """
        return Engagement(self._cache, model, streaming_mode(chunk_tokens), "streaming")

    def sparse(self, model: torch.nn.Module, tokens: int | float | str = 2048, sinks: int | None = None,
               recent: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
               dense_layers: int = 0, rest_bits: int | None = None, page_tokens: int | None = None,
               rest_means: bool = False) -> Engagement:
        """Decode with query-aware *sparse* attention over this cache while inside the block (approximate).

        Each decode step, every layer scores its pages by their key summaries and attends exactly over the
        best ones within ``tokens`` (an int or a count such as "2K", or a fraction in (0, 1] of the sequence's
        tokens), which include ``sinks`` (first tokens; default one page) and ``recent`` (last tokens; default:
        the newest token's page) — fetched from whatever tier holds them. ``dense_layers``: the first layers
        attend in full. Nothing is dropped. Prefill and other multi-token steps stay exact (streaming attention,
        ``chunk_tokens``).
        ``rest_bits`` (2, 4 — the default; 8 for a head dim 4 bits do not pack — or 8; 0: none): the pages a step
        does not read are attended too, from a
        low-bit copy on the device (a page whose mass Quest's bound proves negligible is left out); without a copy,
        ``rest_means`` attends them from each page's mean key and value (kept with the summaries, nothing more).
        ``page_tokens``: the unit of selection inside each block (default 16 tokens, or the largest divisor of
        ``block_tokens`` below it), so the blocks stay large transfers while the selection is fine
        (docs/quality.md, :mod:`tierkv.attention.sparse`)::

            with TieredCache(gpu_gb=2, disk_dir="/nvme") as cache, cache.sparse(model, tokens=0.1):
                model.generate(ids, cache=cache)
        """
        config = getattr(model, "config", None)  # a model without one is refused when engaged (check_model)
        budget = SparseBudget(tokens, sinks, recent, dense_layers, sizing.rest_bits_for(config, rest_bits),
                              page_tokens, rest_means)  # (each argument checked: rest_bits_for, SparseBudget, the mode)
        return Engagement(self._cache, model, streaming_mode(chunk_tokens, budget, config), "sparse")

    def split(self, model: torch.nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Engagement:
        """Decode with exact *split* attention over this cache while inside the block: no staging copy.

        Which path each phase takes: one-token steps (decode) attend each tier's blocks where they live — the
        host's and the disk's share (read into a host buffer) on the CPU with the host kernel
        (:mod:`tierkv.attention.host_kernel`), the device's share in place on the device — and merge the parts by
        log-sum-exp; only the query goes to the CPU and (out, lse) comes back. Multi-token steps (prefill) run
        as exact streaming attention in ``chunk_tokens`` chunks. So the device needs only the open tail blocks
        and two chunk buffers, whatever the context (:meth:`min_split_device_bytes`); outputs equal
        ``DynamicCache``'s. On CUDA the CPU part runs concurrently with the device part. Use it as a context
        manager (a call that is never entered fails the next forward)::

            with TieredCache(gpu_gb=2, cpu_gb=64, disk_dir="/nvme") as cache, cache.split(model):
                model.generate(ids, cache=cache)
        """
        return Engagement(self._cache, model, split_mode(chunk_tokens), "split")

    def exact(self, model: torch.nn.Module, executor: str = "auto",
              chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> contextlib.AbstractContextManager[TieredCache]:
        """Decode exactly with the executor that is faster on this machine while inside the block: ``"gather"``
        (the default path, the model's own attention over staged K/V), ``"split"`` (:meth:`split`), or
        ``"auto"``: split where the profile's measured host-kernel rate beats gather's copy and read and
        ``gpu_gb`` holds :meth:`min_split_device_bytes`, else gather (:func:`tierkv.hf.choice.choose_executor`;
        :attr:`chosen` says which). Outputs equal
        ``DynamicCache``'s either way. A cache used without it decodes with gather: only an engaged model can
        hand split its queries::

            with TieredCache(gpu_gb=2, config=model.config) as cache, cache.exact(model):
                model.generate(ids, cache=cache)
        """
        check_model(model, "exact")
        device = next(model.parameters()).device
        major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 0
        profile, _ = resolve_profile(self.runtime.budgets.profile, device.type, major)
        self.chosen = choose_executor(profile, accel.backend(device).streams, executor)
        gpu = self.runtime.budgets.gpu
        config = cast(PreTrainedConfig, model.config)
        if executor == "auto" and self.chosen == "split" and gpu is not None and gpu < sizing.min_split_device_bytes(
                config, block_tokens=self.block_tokens, chunk_tokens=chunk_tokens, device=device):
            self.chosen = "gather"  # split's streaming prefill needs two chunks of device memory; gather fits
        if executor == "auto" and (not takes_attention_functions(model) or sizing.kv_producers(config)):
            self.chosen = "gather"  # the model attends with its own code, or reuses K/V: only gather serves it
        if self.chosen == "split":
            return self.split(model, chunk_tokens)
        return contextlib.nullcontext(self._cache)
