"""``TieredCache``: the transformers ``Cache`` whose K/V live in tierkv's three-tier block store.

Usage::

    from tierkv import TieredCache
    with TieredCache(gpu_gb=20, disk_dir="/nvme/tierkv") as cache:
        out = model.generate(ids, cache=cache, max_new_tokens=256)
        print(cache.stats())

Each attention layer calls ``cache.update(k, v, layer_idx)``: the new tokens are appended to the store
(tail blocks on the device), and the layer's full K/V is assembled in device staging from all tiers by
the exact-gather executor and handed to the model's own attention — so outputs equal ``DynamicCache``'s.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil
import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

try:  # transformers >= 5.x (after 5.0): how its caches read layer types from a config
    from transformers.cache_utils import get_layer_types_and_kwargs
except ImportError:  # 5.0: DynamicCache inlines the same rule (see _layer_types_of_config)
    get_layer_types_and_kwargs = None

from tierkv import accel
from tierkv.atomic import deferred_interrupts
from tierkv.attention.base import EXECUTORS, Executor
from tierkv.attention.exact_gather import ExactGather
from tierkv.attention.sparse import SparseAttention, SparseBudget
from tierkv.attention.streaming import DEFAULT_CHUNK_TOKENS, StreamingAttention
from tierkv.bandwidth import LinkProfile
from tierkv.blocks import Tier
from tierkv.config import check_budgets_fit_machine, check_count, check_disk_engine, check_model_config, parse_size
from tierkv.errors import IntegrityError, InterruptedStepError, InvalidConfigError, TierKVError
from tierkv.layout import BlockLayout
from tierkv.mover import make_mover
from tierkv.persist import conversation
from tierkv.persist import record as records
from tierkv.persist.keys import Namespace, model_fingerprint
from tierkv.persist.prefix import PrefixPersistence
from tierkv.persist.store import PersistentStore
from tierkv.policy import Policy, make_policy
from tierkv.staging import (
    device_minimum,
    gather_staging_bytes,
    landing_bytes,
    open_tail_bytes,
    rest_copy_bytes,
    streaming_staging_bytes,
)
from tierkv.stats import make_timeline, make_trace
from tierkv.store import KVStore
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.memory import MemoryTier

if TYPE_CHECKING:
    from tierkv.remote.chain import ChainedBlockStore

log = logging.getLogger("tierkv")

DEFAULT_BLOCK_TOKENS = 256
DEFAULT_DEVICE_FRACTION = 0.25  # of free device memory (CPU RAM on a CPU-only host), when gpu_gb is None
DEFAULT_HOST_FRACTION = 0.5  # of available RAM, when cpu_gb is None
DEFAULT_DISK_FRACTION = 0.9  # of free space under disk_dir, when disk_gb is None
DEFAULT_PERSIST_FRACTION = 0.1  # of free space under disk_dir, when persist=True and persist_gb is None
SLIDING_TYPES = ("sliding_attention", "chunked_attention")
STREAMING_ATTENTION = "tierkv_streaming"  # the AttentionInterface name of the streaming executor


class TieredLayer(CacheLayerMixin):
    """One model layer's view of the shared store. Sliding-window layers keep only their window."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: TieredCache, index: int, sliding_window: int | None = None) -> None:
        super().__init__()
        self._cache = weakref.ref(cache)  # the cache holds its layers: a strong reference back would be a cycle
        self.index = index
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.dropped = 0  # tokens freed from the front (sliding layers only)
        self.attend_from = 0  # first stored token the pending streaming attention reads
        self.length_before = 0  # sequence length before the update in progress (the rollback target)
        self.pending_keys: torch.Tensor | None = None  # what update() handed the model, to match the attention call

    @property
    def cache(self) -> TieredCache:
        cache = self._cache()
        if cache is None:
            raise TierKVError("this layer's TieredCache was garbage-collected; keep a reference to the cache while "
                              "its layers are in use.")
        return cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.cache._update_layer(self, key_states, value_states)

    def stored(self) -> int:
        store = self.cache.store
        return store.seq_length(self.index) if store is not None else 0

    def get_seq_length(self) -> int:
        return self.dropped + self.stored()

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # transformers 5.0 passes the cache positions
            query_length = query_length.shape[0]
        length = self.get_seq_length()
        if self.sliding_window is None:
            return length + query_length, 0
        window = self.sliding_window
        offset = max(length - window + 1, 0)
        visible = window - 1 if length >= window else length
        return visible + query_length, offset

    def get_max_length(self) -> int:
        return self.sliding_window or -1

    get_max_cache_shape = get_max_length  # its name in transformers 5.0

    def attention_start(self, new_tokens: int) -> int:
        """First stored token attention reads after ``new_tokens`` were appended (HF's sliding semantics)."""
        if self.sliding_window is None:
            return 0
        before = self.get_seq_length() - new_tokens
        visible = min(before, self.sliding_window - 1) + new_tokens
        return self.stored() - visible

    def crop(self, tokens_to_remove: int) -> None:
        self.cache._crop_layer(self, tokens_to_remove)

    def reset(self) -> None:
        self.dropped = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.cache.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.cache.batch_select_indices(indices)


class TieredCache(Cache):
    """A transformers ``Cache`` backed by device, host and disk tiers.

    Args:
        gpu_gb: device-tier budget (GB as a float, or a string like ``"512MB"``, ``"20GiB"``). It bounds
            *all* device memory the cache holds, the attention staging area included (see
            :meth:`min_device_bytes`). Default: 25% of free device memory.
        cpu_gb: host-tier budget (pinned RAM on CUDA hosts). Default: half of the available RAM.
        disk_dir: directory of the disk tier's files; no disk tier when None.
        disk_gb: disk-tier budget. Default: 90% of the free space under ``disk_dir``.
        block_tokens: tokens per block, the unit of placement and I/O.
        policy: residency policy name (``"lru"``) or a :class:`tierkv.policy.Policy`.
        prefetch_depth: layers gathered ahead of the one computing (each costs one staging buffer), or
            ``"auto"``: chosen by the bandwidth model from the first decode steps (docs/benchmarks.md).
        config: the model config; lets sliding-window layers (Gemma2/3, Mistral) keep only their window.
        disk_engine: force a disk engine (``"posix"``, ``"native"``, ``"kvikio"``); default: automatic.
        profile: the :class:`~tierkv.bandwidth.LinkProfile` (or its JSON path) for the predicted times in
            ``stats()["steps"]`` and for ``prefetch_depth="auto"``; default ``$TIERKV_PROFILE``, else presets
            by device type (:func:`tierkv.stats.default_profile`).
        trace: record a timeline trace (True; or a path written at ``close()``); default ``$TIERKV_TRACE``.
            See :meth:`save_trace`.
        persist: keep full blocks in ``disk_dir`` after the process ends, content-addressed by model and
            token ids, so a later cache reuses a shared prefix (:meth:`load_prefix`; docs/reliability.md).
        persist_gb: size cap of the persisted blocks (least recently used evicted first). Default: 10% of
            the free space under ``disk_dir``.
        remote: URL of a Redis/Valkey server (or cluster) shared by many workers — ``redis://host:6379/0``,
            ``rediss://`` (TLS), ``redis+cluster://h1:p1,h2:p2``; password in the URL or
            ``$TIERKV_REDIS_PASSWORD``. Full blocks are written to it in the background and
            :meth:`load_prefix` loads a prefix from it after the local persistent blocks (docs/remote.md).
    """

    def __init__(self, gpu_gb: float | str | None = None, cpu_gb: float | str | None = None,
                 disk_dir: str | os.PathLike | None = None, disk_gb: float | str | None = None,
                 block_tokens: int = DEFAULT_BLOCK_TOKENS, policy: str | Policy = "lru",
                 prefetch_depth: int | str = 1, config: PreTrainedConfig | None = None,
                 disk_engine: str | None = None, profile: LinkProfile | str | os.PathLike | None = None,
                 trace: bool | str | os.PathLike | None = None, persist: bool = False,
                 persist_gb: float | str | None = None, remote: str | None = None) -> None:
        if not isinstance(block_tokens, int) or isinstance(block_tokens, bool) or block_tokens <= 0:
            raise InvalidConfigError(f"block_tokens must be a positive int (e.g. 256), got {block_tokens!r}.")
        if prefetch_depth != "auto" and (not isinstance(prefetch_depth, int) or prefetch_depth < 0):
            raise InvalidConfigError(f"prefetch_depth must be an int >= 0 or 'auto', got {prefetch_depth!r}.")
        if config is not None:
            check_model_config(config)
        self.profile = profile  # resolved with the device in _ensure_store (see tierkv.stats.resolve_profile)
        self.trace = make_trace(trace)  # None when off (also reads TIERKV_TRACE)
        self.gpu_budget = None if gpu_gb is None else parse_size(gpu_gb, name="gpu_gb")
        self.cpu_budget = None if cpu_gb is None else parse_size(cpu_gb, name="cpu_gb")
        self.disk_budget = None if disk_gb is None else parse_size(disk_gb, name="disk_gb")
        if disk_gb is not None and disk_dir is None:
            raise InvalidConfigError("disk_gb was given without disk_dir; pass disk_dir='/path/on/nvme' to enable "
                                     "the disk tier, or drop disk_gb.")
        if disk_engine is not None and disk_dir is None:
            raise InvalidConfigError("disk_engine was given without disk_dir; pass disk_dir='/path/on/nvme' to enable "
                                     "the disk tier, or drop disk_engine.")
        if not isinstance(persist, bool):
            raise InvalidConfigError(f"persist must be True or False, got {persist!r}.")
        if (persist or persist_gb is not None) and (disk_dir is None or not persist):
            raise InvalidConfigError("persist=True keeps blocks in disk_dir and persist_gb caps them; pass both "
                                     "disk_dir='/path/on/nvme' and persist=True (persist_gb is optional).")
        check_budgets_fit_machine(self.gpu_budget, self.cpu_budget, self.disk_budget, disk_dir)
        if disk_dir is not None:
            check_disk_engine(disk_engine)
        self.disk_dir = disk_dir
        self.disk_engine = disk_engine
        self.block_tokens = block_tokens
        self.policy = make_policy(policy)
        self.prefetch_depth = prefetch_depth
        self.store: KVStore | None = None
        self._chunk_tokens = DEFAULT_CHUNK_TOKENS
        self._streaming_depth = 0  # > 0 inside `streaming(model)`
        self._unsettled: int | None = None  # the length a rollback cut short by a second Ctrl-C still owes
        self._step_layers = 0  # layers updated since the current forward's update of layer 0
        self._full_step = 0  # layers a complete forward updates (the most one has updated)
        self._sparse: SparseBudget | None = None  # inside `sparse(model)`: decode steps attend sparsely
        self._attending: str | None = None  # the executor of the last attention call (streaming or sparse)
        self._closed = False
        self._disk: DiskTier | None = None
        self._resources = _Resources()
        self.executors = self._resources.executors  # by name (tierkv.attention.EXECUTORS), built with the store
        # dropped without close() (or alive at exit), the cache still releases threads, descriptors and files
        self._finalizer = weakref.finalize(self, self._resources.close)
        self._layers_from_config = config is not None  # the layer count is known before the first pass
        layers: list[CacheLayerMixin] = []
        if config is not None:
            layer_types, kwargs = _layer_types(config.get_text_config(decoder=True))
            unsupported = sorted(set(layer_types) - {"full_attention", *SLIDING_TYPES})
            if unsupported:
                raise InvalidConfigError(
                    f"this model has {', '.join(unsupported)} layers; TieredCache holds full and sliding-window "
                    "attention KV only. Use transformers' DynamicCache for this architecture."
                )
            layers = [TieredLayer(self, i, kw.get("sliding_window") if kind in SLIDING_TYPES else None)
                      for i, (kind, kw) in enumerate(zip(layer_types, kwargs))]
        if disk_dir is not None:
            self._disk = self._resources.disk = DiskTier(disk_dir, self.disk_budget, DEFAULT_DISK_FRACTION,
                                                         engine=disk_engine)
        self._prefix: PrefixPersistence | None = None
        self._remote: ChainedBlockStore | None = None
        if remote is not None and not isinstance(remote, str):
            raise InvalidConfigError(f"remote must be a Redis URL such as 'redis://host:6379/0', got {remote!r}.")
        if persist or remote is not None:
            local = None
            if persist:
                capacity = parse_size(persist_gb, name="persist_gb") if persist_gb is not None else \
                    int(psutil.disk_usage(os.fspath(disk_dir)).free * DEFAULT_PERSIST_FRACTION)
                local = PersistentStore(disk_dir, max(capacity, 1))
            if remote is not None:
                from tierkv.remote.chain import ChainedBlockStore  # imports redis-py only when asked for

                try:
                    self._remote = ChainedBlockStore(local, remote)
                except BaseException:
                    if local is not None:
                        local.close()
                    raise
            self._prefix = PrefixPersistence(self._remote or local, block_tokens)
        super().__init__(layers=layers)

    # ------------------------------------------------------------------------------ transformers API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self._unsettled is not None:
            self._roll_back_to(self._unsettled)
        if not 0 <= layer_idx < len(self.layers):
            self._add_layers(layer_idx)
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self._unsettled is not None:  # generate() asks before its first update: finish the rollback first
            self._roll_back_to(self._unsettled)
        return super().get_seq_length(layer_idx)

    def _add_layers(self, layer_idx: int) -> None:
        """Layers up to ``layer_idx`` (a model seen without ``config=``); refused beyond the config's count."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise InvalidConfigError(f"layer_idx must be an int >= 0, got {layer_idx!r}.")
        if self._layers_from_config:
            raise InvalidConfigError(
                f"layer_idx {layer_idx} is beyond the {len(self.layers)} layers of the config this cache was built "
                "with; pass the config of the model that uses the cache (config=model.config), or build the cache "
                "without config=."
            )
        while len(self.layers) <= layer_idx:
            self.layers.append(TieredLayer(self, len(self.layers)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None:
            self._select_rows([i for i in range(self._batch()) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(torch.as_tensor(indices).tolist())

    def reset(self) -> None:
        if self._prefix is not None:
            self._persist_new_blocks()
            self._prefix.reset()
        if self.store is not None:
            for executor in self.executors.values():
                executor.reset()
            self.store.reset()
        for layer in self.layers:
            layer.reset()
        self._unsettled = None
        self._step_layers = 0

    # ----------------------------------------------------------------------------------- tierkv API
    def stats(self) -> dict[str, Any]:
        """Occupancy and traffic; see docs/architecture.md ("Statistics") for every key."""
        if self.store is None:
            empty = {tier.label: 0 for tier in Tier}
            return {"bytes_resident": empty, "bytes_moved": {}, "blocks": dict(empty), "tokens": 0,
                    "prefetch_hits": 0, "prefetch_misses": 0, "prefetch_stall_s": 0.0,
                    **({"remote": self._remote.stats()} if self._remote is not None else {})}
        stats = self.store.stats()
        if self._remote is not None:
            stats["remote"] = self._remote.stats()  # lookups, hits, bytes on the wire ... (docs/remote.md)
        executors = list(self.executors.values())
        stats.update(tokens=self.get_seq_length(), prefetch_hits=sum(e.prefetch_hits for e in executors),
                     prefetch_misses=sum(e.prefetch_misses for e in executors),
                     prefetch_stall_s=sum(e.stall_s for e in executors),
                     disk_read_ahead_hits=sum(e.read_ahead_hits for e in executors),
                     mover=self.executor.mover.name,
                     disk_engine=self._disk.engine_name if self._disk else None,
                     prefetch_depth=self.executor.prefetch_depth, prefetch_auto=list(self.executor.auto_choices),
                     steps=self.executor.timeline.summary() if self.executor.timeline is not None else {})
        sparse = self.executors.get("sparse")
        if sparse is not None:
            stats["sparse"] = sparse.counters.as_dict()
        return stats

    def load_prefix(self, model: torch.nn.Module, input_ids: torch.Tensor | Sequence[int]) -> int:
        """Load the longest persisted prefix of ``input_ids`` ``[B, T]`` into this empty cache and remember the
        ids, so the sequence's own full blocks are persisted in turn (needs ``persist=True``). Returns the
        tokens the cache now holds; ``model.generate(input_ids, cache=cache)`` then computes only the rest —
        always at least the last token. Blocks match only for the same model weights and config, dtype,
        device type, attention implementation and ``block_tokens``.

        On a cache that already holds a conversation, it records the ids of the next turn (they must start
        with the ones it holds: pass the previous ids, the generated tokens, then the new ones), loads nothing
        and returns the tokens held.
        """
        if self._prefix is None:
            raise InvalidConfigError("load_prefix needs persistent or remote blocks: remote='redis://...', or "
                                     "TieredCache(disk_dir='/path/on/nvme', persist=True).")
        if self._closed:
            raise InvalidConfigError("this TieredCache was closed (its tiers are released); create a new one.")
        ids = _token_ids(input_ids)
        held = self.get_seq_length()
        if held:
            if ids.shape[1] <= held or (self.store is not None and ids.shape[0] != self._batch()):
                raise InvalidConfigError(
                    f"the cache holds {held} tokens of {self._batch()} rows; load_prefix needs the same rows with at "
                    f"least one new token, got ids of shape {tuple(ids.shape)}. Call cache.reset() for a new prompt.")
            self._prefix.extend(ids, held)
            return held
        namespace = Namespace.of_model(model, self.block_tokens)
        if self._layers_from_config and len(self.layers) != namespace.layers:
            raise InvalidConfigError(f"the model has {namespace.layers} layers but this cache was built for "
                                     f"{len(self.layers)} (config=); pass that model's config.")
        self._prefix.start(namespace, ids)
        if self._remote is not None:
            self._remote.bind(namespace.root)
        blocks, kv = self._prefix.load()
        if blocks:
            self._import(kv, next(model.parameters()).device)
        return blocks * self.block_tokens

    def flush(self) -> None:
        """Persist the full blocks with known ids now and wait until they are written (``persist=True``;
        also done on ``close()``)."""
        if self._prefix is not None:
            self._persist_new_blocks()
            self._prefix.flush()
        if self._remote is not None:
            self._remote.flush()  # the remote's writes (each bounded by its timeout)

    def save(self, path: str | os.PathLike, model: torch.nn.Module | None = None) -> None:
        """Write this conversation (every layer's K/V, the token ids it knows, per-layer state) to ``path``, so
        :meth:`load` resumes it without prefill. Atomic: a crash while saving leaves the previous file.
        ``model``: recorded by fingerprint, so that loading with another model is refused."""
        target = Path(path)
        with open(conversation.temporary(target), "wb") as f:
            for head, payload in self._conversation_records(model):
                f.write(head)
                f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        conversation.finish(target)

    async def asave(self, path: str | os.PathLike, model: torch.nn.Module | None = None) -> None:
        """:meth:`save` for asyncio servers: the file I/O (aiofiles) does not block the event loop; the K/V is
        copied out of the tiers on the loop's thread, one chunk (``CHUNK_BYTES``) at a time."""
        aiofiles = _aiofiles()
        import asyncio

        target = Path(path)
        async with aiofiles.open(conversation.temporary(target), "wb") as f:
            for head, payload in self._conversation_records(model):
                await f.write(head)
                await f.write(payload)
            await f.flush()
            await asyncio.to_thread(os.fsync, f.fileno())
        await asyncio.to_thread(conversation.finish, target)

    @classmethod
    def load(cls, path: str | os.PathLike, model: torch.nn.Module | None = None,
             device: str | torch.device | None = None, **options: Any) -> TieredCache:
        """A cache holding the conversation saved at ``path``: ``model.generate(ids, cache=cache)`` continues
        it with no prefill. ``options`` are :class:`TieredCache` arguments (budgets, ``disk_dir`` ...);
        ``device`` defaults to ``model``'s, else the CPU. Every record is verified (IntegrityError)."""
        what = os.fspath(path)
        with open(path, "rb") as f:
            header = conversation.parse_header(*records.read(f, what), what)
            cache = cls._for_conversation(header, model, options, what)
            try:
                reader = conversation.Reader(header, what)
                while (chunk := reader.take(*records.read(f, what))) is not None:
                    cache._restore_chunk(chunk, header, model, device)
                if f.read(1):
                    raise IntegrityError(f"{what}: data after the end record.")
                cache._restored(header)
            except BaseException:
                cache.close()
                raise
        return cache

    @classmethod
    async def aload(cls, path: str | os.PathLike, model: torch.nn.Module | None = None,
                    device: str | torch.device | None = None, **options: Any) -> TieredCache:
        """:meth:`load` for asyncio servers (the file is read with aiofiles)."""
        aiofiles = _aiofiles()
        what = os.fspath(path)
        async with aiofiles.open(path, "rb") as f:
            header = conversation.parse_header(*(await records.aread(f, what)), what)
            cache = cls._for_conversation(header, model, options, what)
            try:
                reader = conversation.Reader(header, what)
                while (chunk := reader.take(*(await records.aread(f, what)))) is not None:
                    cache._restore_chunk(chunk, header, model, device)
                if await f.read(1):
                    raise IntegrityError(f"{what}: data after the end record.")
                cache._restored(header)
            except BaseException:
                cache.close()
                raise
        return cache

    def save_trace(self, path: str | os.PathLike) -> None:
        """Write the timeline trace (``TieredCache(trace=True)``) as Chrome trace JSON (chrome://tracing,
        https://ui.perfetto.dev): mover copies/reads per link, synchronous reads, prefetch waits, compute."""
        if self.trace is None:
            raise InvalidConfigError("no trace was recorded; create the cache with TieredCache(trace=True) "
                                     "or set TIERKV_TRACE=path.")
        self.trace.save(path)

    @staticmethod
    def min_device_bytes(config: PreTrainedConfig, context: int, batch: int = 1,
                         block_tokens: int = DEFAULT_BLOCK_TOKENS, prefetch_depth: int = 1,
                         dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> int:
        """Smallest ``gpu_gb`` (in bytes) that decodes ``context`` tokens: staging for the largest layer
        (``prefetch_depth + 1`` buffers of one layer's full K/V, with 25% growth headroom), one tail block
        per (row, layer), and on CUDA (``device``; default: CUDA if available) the two landing buffers.
        Bytes, not GB: pass it on as ``gpu_gb=f"{n}B"``."""
        check_model_config(config)
        check_count(context, name="context")
        check_count(batch, name="batch")
        check_count(block_tokens, name="block_tokens")
        check_count(prefetch_depth, name="prefetch_depth", minimum=0)
        layout = _layout_of_config(config, block_tokens, dtype)
        staging = gather_staging_bytes(batch, context, layout.token_bytes, block_tokens, prefetch_depth)
        layers = config.get_text_config(decoder=True).num_hidden_layers
        return _device_minimum(staging, open_tail_bytes(layers, batch, layout.slot_bytes), layout.slot_bytes, device)

    @staticmethod
    def min_streaming_device_bytes(config: PreTrainedConfig, batch: int = 1,
                                   block_tokens: int = DEFAULT_BLOCK_TOKENS,
                                   chunk_tokens: int = DEFAULT_CHUNK_TOKENS, dtype: torch.dtype | None = None,
                                   device: str | torch.device | None = None) -> int:
        """Smallest ``gpu_gb`` (bytes) for :meth:`streaming`: two chunk buffers plus the open tail blocks (and
        the landing buffers on CUDA) — independent of the context length. Bytes, not GB: pass it on as
        ``gpu_gb=f"{n}B"``."""
        check_model_config(config)
        check_count(batch, name="batch")
        check_count(block_tokens, name="block_tokens")
        check_count(chunk_tokens, name="chunk_tokens")
        layout = _layout_of_config(config, block_tokens, dtype)
        staging = streaming_staging_bytes(batch, chunk_tokens, layout.token_bytes, block_tokens)
        layers = config.get_text_config(decoder=True).num_hidden_layers
        return _device_minimum(staging, open_tail_bytes(layers, batch, layout.slot_bytes), layout.slot_bytes, device)

    @staticmethod
    def kv_bytes_per_token(config: PreTrainedConfig, dtype: torch.dtype | None = None) -> int:
        """K and V bytes of one token across all layers (every layer counted, as full attention)."""
        check_model_config(config)
        layout = _layout_of_config(config, 1, dtype)
        return layout.token_bytes * config.get_text_config(decoder=True).num_hidden_layers

    @staticmethod
    def kv_bytes_held(config: PreTrainedConfig, tokens: int, dtype: torch.dtype | None = None) -> int:
        """K and V bytes the cache holds after ``tokens`` tokens: a sliding-window layer keeps only its window
        (Gemma 3 270M at 16K: 15 of its 18 layers hold 512 tokens), so this is what the tiers must hold."""
        check_model_config(config)
        token_bytes = _layout_of_config(config, 1, dtype).token_bytes
        layer_types, kwargs = _layer_types(config.get_text_config(decoder=True))
        return sum(token_bytes * (min(tokens, kw["sliding_window"]) if kind in SLIDING_TYPES else tokens)
                   for kind, kw in zip(layer_types, kwargs, strict=True))

    @staticmethod
    def rest_copy_bytes(config: PreTrainedConfig, tokens: int, rest_bits: int, dtype: torch.dtype | None = None) -> int:
        """Device bytes of the ``rest_bits`` copy that ``cache.sparse(..., rest_bits=)`` keeps of ``tokens``
        tokens' K/V (every layer): to add to ``gpu_gb`` besides the key summaries."""
        layout = _layout_of_config(config, 1, dtype)
        kv_bytes = TieredCache.kv_bytes_per_token(config, dtype) * tokens
        return rest_copy_bytes(kv_bytes, rest_bits, layout.dtype.itemsize, layout.head_dim)

    def close(self) -> None:
        """Release every tier and delete the disk tier's files; persisted blocks (``persist=True``) stay, the
        last ones written first. Idempotent; a failure while cleaning up is logged, never raised (a file that
        cannot be removed is retried at exit, or by the next cache that opens its directory). A cache dropped
        without ``close()`` is closed when it is garbage-collected."""
        self._close_persistence()
        self._finalizer()
        self.store = None
        self.executors = {}
        self._closed = True

    @contextlib.contextmanager
    def streaming(self, model: torch.nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Iterator[TieredCache]:
        """Run ``model``'s attention as exact *streaming* attention over this cache while inside the block.

        Each layer attends chunk by chunk (``chunk_tokens`` at a time, merged by log-sum-exp), so the device
        needs two chunk buffers instead of a whole layer's K/V: contexts far beyond ``min_device_bytes``
        fit. The model's own attention implementation is restored on exit::

            with TieredCache(gpu_gb=2, disk_dir="/nvme") as cache, cache.streaming(model):
                model.generate(ids, cache=cache)
        """
        if not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
            raise InvalidConfigError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}.")
        _register_streaming_attention()
        previous = model.config._attn_implementation
        modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)]
        streamer = self.executors.get("streaming")
        if streamer is not None and chunk_tokens != self._chunk_tokens:
            streamer.close()  # buffers are sized per chunk length; the next attention makes new ones
            del self.executors["streaming"]
        self._chunk_tokens = chunk_tokens
        self._switch_executor()  # exact-gather prefetches do not survive a stretch of streaming steps
        self._streaming_depth += 1
        try:  # every change to the user's model happens inside the try, so the finally undoes all of it
            for module in modules:
                module._tierkv_cache = self
            model.set_attn_implementation(STREAMING_ATTENTION)
            yield self
        finally:
            with deferred_interrupts():  # a Ctrl-C while leaving waits until the model is the user's again
                self._streaming_depth -= 1
                try:
                    self._switch_executor()
                finally:  # the model is restored even if the executors' bookkeeping fails
                    for module in modules:
                        module.__dict__.pop("_tierkv_cache", None)
                    model.set_attn_implementation(previous)

    @contextlib.contextmanager
    def sparse(self, model: torch.nn.Module, tokens: int | float = 2048, sinks: int | None = None,
               recent: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
               dense_layers: int = 0, rest_bits: int = 0) -> Iterator[TieredCache]:
        """Decode with query-aware *sparse* attention over this cache while inside the block (approximate).

        Each decode step, every layer scores its blocks by their key summaries and attends exactly over the
        best ones within ``tokens`` (an int, or a fraction in (0, 1] of the sequence's tokens: a sliding-window
        layer reads its whole window where that is within the budget), which include ``sinks``
        (first tokens; default one block) and ``recent`` (last tokens; default: the open tail) — fetched from
        whatever tier holds them (:mod:`tierkv.attention.sparse`). ``dense_layers``: the first layers attend in
        full, their blocks taken out of the other layers' budgets. Nothing is dropped: a later step can read any
        block again. Prefill and other multi-token steps stay exact (streaming attention, ``chunk_tokens``).
        ``rest_bits`` (2, 4 or 8): the blocks a step does not read are attended as well, from a copy of that many
        bits per key and value kept on the device (of fp16 KV bytes: 15.6% at 2 bits, 28% at 4, besides the
        summaries; no more reads, but device compute over every block each step). On SmolLM2 at 10% of 2K-8K,
        4 bits raised top-1 agreement with full attention from 90-96% to 99.6-99.8% and kept every needle;
        2 bits reached 95% but lost a needle (docs/quality.md).
        Blocks are selected whole, so small blocks select better: on SmolLM2 at 10% of a 2K context 8-token
        blocks found the 15 needles full attention found (of 18), 16-token ones 11 (docs/quality.md); their key
        summaries take 3 / (2 · block_tokens) of the KV bytes on the device. The default 256-token blocks suit
        exact decoding, so give sparse decoding its own ``block_tokens``::

            with TieredCache(gpu_gb=2, disk_dir="/nvme", block_tokens=8) as cache, cache.sparse(model, tokens=0.1):
                model.generate(ids, cache=cache)
        """
        budget = SparseBudget(tokens, sinks, recent, dense_layers, rest_bits)
        with self.streaming(model, chunk_tokens):
            previous, self._sparse = self._sparse, budget
            try:
                yield self
            finally:
                self._sparse = previous

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ internals
    def _ensure_store(self, key_states: torch.Tensor) -> KVStore:
        if self.store is not None:
            return self.store
        device = key_states.device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
        else:
            free = psutil.virtual_memory().available
        gpu = self.gpu_budget if self.gpu_budget is not None else int(free * DEFAULT_DEVICE_FRACTION)
        cpu = self.cpu_budget if self.cpu_budget is not None else \
            int(psutil.virtual_memory().available * DEFAULT_HOST_FRACTION)
        device_tier = MemoryTier(Tier.DEVICE, gpu, device)
        accelerated = accel.backend(device).streams  # CUDA, or its checking stand-in on the CPU
        host_tier = MemoryTier(Tier.HOST, cpu, torch.device("cpu"), pin=accelerated)
        store = self.store = KVStore(device_tier, host_tier, self._disk, self.policy, self.block_tokens)
        self._mover = self._resources.mover = make_mover(device)
        self._resources.store = store
        self._timeline = make_timeline(self.profile, device)
        slot_bytes = BlockLayout.of(key_states, self.block_tokens).slot_bytes  # a landing piece holds a block
        if accelerated and not store.enable_landing(landing_bytes(gpu, slot_bytes)):
            log.warning("tierkv: no room for the landing buffers in gpu_gb; host runs cross PCIe block by block")
        self.executors["exact_gather"] = self._make_executor("exact_gather", prefetch_depth=self.prefetch_depth)
        return store

    def _update_layer(self, layer: TieredLayer, key_states: torch.Tensor,
                      value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._closed:
            raise InvalidConfigError("this TieredCache was closed (its tiers are released); create a new one.")
        store = self._ensure_store(key_states)
        if layer.index == 0:
            self._begin_forward()
            if self._prefix is not None:
                self._persist_new_blocks()  # the previous forward is complete: its full blocks can be persisted
        self._step_layers += 1
        layer.length_before = layer.get_seq_length()
        try:
            # Blocks that left the window during the previous step go now, not then: until this step is
            # committed, a rollback may still need them.
            self._drop_out_of_window(layer)
            store.append(layer.index, key_states, value_states)
            if self._streaming_depth:  # attention streams from the store in _attend; hand back what came in
                layer.attend_from = layer.attention_start(key_states.shape[2])
                layer.pending_keys = key_states
                return key_states, value_states
            return self.executor.gather(layer.index, layer.attention_start(key_states.shape[2]))
        except BaseException:  # a KeyboardInterrupt too: the layers that took this step give it back
            self._unsettled = layer.length_before  # first, by assignment: no signal is handled here
            self._step_layers = 0  # this forward is undone: the next one is not a resumption of it
            self._roll_back_to(layer.length_before)
            raise

    def _attend(self, layer_idx: int, query: torch.Tensor, mask: torch.Tensor | None, scaling: float,
                softcap: float | None) -> torch.Tensor:
        """Streaming attention of ``query`` ``[B, H_q, q, D]`` over layer ``layer_idx``: ``[B, q, H_q, D]``."""
        layer = self.layers[layer_idx]
        layer.pending_keys = None
        try:
            name = "sparse" if self._sparse is not None and query.shape[2] == 1 else "streaming"
            if name not in self.executors:
                options = {"chunk_tokens": self._chunk_tokens} if name == "streaming" else {}
                self.executors[name] = self._make_executor(name, **options)
            if self._attending != name:  # a hand-off: the other executor's step in progress ends here
                if self._attending in self.executors:
                    self.executors[self._attending].pause_telemetry()
                self._attending = name
            if name == "sparse":
                sparse: SparseAttention = self.executors["sparse"]  # type: ignore[assignment]
                return sparse.attend(layer_idx, layer.attend_from, query, mask, scaling, softcap, self._sparse,
                                     context=layer.get_seq_length())
            return self.streamer.attend(layer_idx, layer.attend_from, query, mask, scaling, softcap)
        except BaseException:
            self._unsettled = layer.length_before  # first, by assignment: no signal is handled here
            self._step_layers = 0  # this forward is undone: the next one is not a resumption of it
            self._roll_back_to(layer.length_before)
            raise

    def _make_executor(self, name: str, **options: Any) -> Executor:
        """Build a registered executor with everything it needs (it registers with the store as a reader)."""
        known = self.executor.num_layers if self.executors and self.executor.layers_known else None
        layers = len(self.layers) if self._layers_from_config else known
        return EXECUTORS[name](self.store, self._mover, start_of=functools.partial(_attention_start, self.layers),
                               num_layers=layers, timeline=self._timeline, trace=self.trace, **options)

    @property
    def executor(self) -> ExactGather:
        """The exact-gather executor (the default path); it exists once the first update built the store."""
        return self.executors["exact_gather"]  # type: ignore[return-value]

    @property
    def streamer(self) -> StreamingAttention | None:
        return self.executors.get("streaming")  # type: ignore[return-value]

    def _switch_executor(self) -> None:
        """Entering or leaving streaming: staged data is stale, and the step in progress ends here (the other
        executor records the next one; the gap between them is not either one's compute)."""
        self._invalidate_staged()
        for executor in self.executors.values():
            executor.pause_telemetry()

    def _invalidate_staged(self) -> None:
        """Table edits (crop, reorder, reset, rollback): data staged by either executor is stale."""
        for executor in self.executors.values():
            executor.invalidate()

    def _drop_out_of_window(self, layer: TieredLayer) -> None:
        """Free a sliding layer's whole blocks that can no longer be attended to."""
        if layer.sliding_window is None or self.store is None:
            return
        dropped = self.store.drop_front(layer.index, layer.stored() - (layer.sliding_window - 1))
        if dropped:
            layer.dropped += dropped
            for executor in self.executors.values():
                executor.drop(layer.index)  # its prefetch counted tokens from the old front

    def _begin_forward(self) -> None:
        """A forward's first update: if the previous forward updated fewer layers than a complete one does, it
        stopped between two layers in the model's own code (no tierkv code ran to undo it), so its layers differ
        in length. Roll back the ones it reached and refuse this forward: its positions were computed from
        layer 0's length, one step ahead."""
        reached, self._step_layers = self._step_layers, 0
        if not reached or reached >= self._full_step:
            self._full_step = max(self._full_step, reached)
            return
        lengths = {layer.get_seq_length() for layer in self.layers if isinstance(layer, TieredLayer)} - {0}
        if len(lengths) < 2:  # every layer that holds tokens holds as many (an update's own rollback ran)
            return
        behind = min(lengths)
        self._unsettled = behind  # by assignment first, as in update's rollback
        self._roll_back_to(behind)
        raise InterruptedStepError(
            f"the previous forward stopped after {reached} of {self._full_step} layers (a Ctrl-C or an error in the "
            f"model between layers); the layers it reached were rolled back to {behind} tokens, so every layer "
            "holds the same tokens again. Call generate() / the model again: it will resume from there."
        )

    def _roll_back_to(self, length: int) -> None:
        """After a failed update: layers that already took this step's tokens give them back.

        Called while an error propagates; a failure here is logged, so the original error is the one raised. A
        second Ctrl-C meanwhile is held until every layer is back (the undo is a few table edits per layer); one
        that lands before the hold starts leaves ``_unsettled`` set, and the next ``update`` or
        ``get_seq_length`` finishes the rollback.
        """
        if self.store is None:
            self._unsettled = None
            return
        try:
            with deferred_interrupts():
                self._invalidate_staged()
                for layer in self.layers:
                    if isinstance(layer, TieredLayer) and layer.get_seq_length() > length:
                        self._crop_layer(layer, length - layer.get_seq_length())
                self._unsettled = None
        except Exception:
            log.exception("tierkv: rolling back a failed update failed; layers may differ in length")
            self._unsettled = None  # not retried: the failure is logged once

    def _crop_layer(self, layer: TieredLayer, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        remove = -tokens_to_remove
        if remove == 0 or self.store is None:
            return
        keep_window = layer.sliding_window - 1 if layer.sliding_window is not None and layer.dropped else 0
        if remove > layer.stored() - keep_window:
            raise InvalidConfigError(
                f"cannot crop {remove} tokens from layer {layer.index}: its sliding window only keeps the last "
                f"{layer.stored()}; crop fewer tokens, or build the cache without config= to keep all tokens."
            )
        self._invalidate_staged()
        self.store.crop(layer.index, remove)
        if self._prefix is not None:
            self._prefix.truncate(layer.get_seq_length())

    def _select_rows(self, indices: Sequence[int]) -> None:
        if self.store is None:
            return
        self._invalidate_staged()
        self.store.select_rows(list(indices))
        if self._prefix is not None:
            self._prefix.select_rows(indices)

    def _persist_new_blocks(self) -> None:
        """Hand the full blocks with known ids that are not persisted yet to the background writer. Never raises:
        persistence is a copy, and its failure must not fail decoding (it is logged)."""
        if self.store is None or self._prefix is None:
            return
        layers = [layer for layer in self.layers if isinstance(layer, TieredLayer)]
        try:
            self._prefix.collect(self.store, [layer.get_seq_length() for layer in layers],
                                 [layer.dropped for layer in layers])
        except Exception:
            log.exception("tierkv: persisting this sequence's blocks failed; it is no longer persisted")
            self._prefix.reset()

    def _close_persistence(self) -> None:
        if self._prefix is None:
            return
        if not self._closed:
            self._persist_new_blocks()
        prefix, self._prefix = self._prefix, None
        try:
            prefix.close()  # waits for the writer, releases the store
        except Exception:  # noqa: BLE001 - close() never raises; what was listed stays listed
            log.exception("tierkv: closing the persistent block store failed")

    def _import(self, kv: list[torch.Tensor], device: torch.device) -> None:
        """Append ``kv[layer]`` ``[2, B, H_kv, T, D]`` to every layer of this empty cache (all or nothing)."""
        while len(self.layers) < len(kv):
            self.layers.append(TieredLayer(self, len(self.layers)))
        try:
            for index, layer_kv in enumerate(kv):
                layer_kv = layer_kv.to(device)
                self._ensure_store(layer_kv[0]).append(index, layer_kv[0], layer_kv[1])
        except BaseException:
            with deferred_interrupts():  # all or nothing, even under a second Ctrl-C
                self.reset()
            raise

    def _conversation_records(self, model: torch.nn.Module | None) -> Iterator[tuple[bytes, memoryview]]:
        if self._closed:
            raise InvalidConfigError("this TieredCache was closed (its tiers are released); save before close().")
        if self.store is None or not self.get_seq_length():
            raise InvalidConfigError("this cache holds no tokens yet; save it after a forward pass or generate().")
        prefix = self._prefix
        namespace = prefix.namespace if prefix is not None else None
        fingerprint = model_fingerprint(model) if model is not None else namespace.fingerprint if namespace else None
        layers = tuple(conversation.LayerState(layer.index, layer.sliding_window, layer.dropped,
                                               layer.get_seq_length()) for layer in self.layers)
        header = conversation.Header(self.block_tokens, self._batch(), layers,
                                     prefix.ids if prefix is not None else None,
                                     namespace.to_dict() if namespace is not None else None, fingerprint)
        return conversation.records(self.store, header)

    @classmethod
    def _for_conversation(cls, header: conversation.Header, model: torch.nn.Module | None,
                          options: dict[str, Any], what: str) -> TieredCache:
        """An empty cache shaped like the saved one (its layers, windows and block size)."""
        if options.setdefault("block_tokens", header.block_tokens) != header.block_tokens:
            raise InvalidConfigError(f"{what} was saved with block_tokens={header.block_tokens}; load it with the "
                                     "same (or leave block_tokens out).")
        if model is not None and header.fingerprint is not None and model_fingerprint(model) != header.fingerprint:
            raise InvalidConfigError(f"{what} was saved from another model (weights or config differ); load it "
                                     "with the model that produced it.")
        cache = cls(**options)
        windows = [layer.sliding_window for layer in header.layers]
        if cache._layers_from_config and [layer.sliding_window for layer in cache.layers] != windows:
            cache.close()
            raise InvalidConfigError(f"{what} holds {len(windows)} layers with sliding windows {windows}; the "
                                     "config= given describes other layers. Pass the model's own config, or none.")
        cache.layers = [TieredLayer(cache, i, window) for i, window in enumerate(windows)]
        cache._layers_from_config = True
        return cache

    def _restore_chunk(self, chunk: tuple[int, int, torch.Tensor], header: conversation.Header,
                       model: torch.nn.Module | None, device: str | torch.device | None) -> None:
        index, first, blocks = chunk  # blocks: [B, n, 2, H, bt, D]
        layer = header.layers[index]
        bt = header.block_tokens
        end = min((first + blocks.shape[1]) * bt, layer.length) - first * bt  # tokens of this chunk
        kv = blocks.permute(2, 0, 3, 1, 4, 5).flatten(3, 4)[:, :, :, :end]  # [2, B, H, tokens, D]
        where = device if device is not None else next(model.parameters()).device if model is not None else "cpu"
        kv = kv.to(where)
        self._ensure_store(kv[0]).append(index, kv[0], kv[1])

    def _restored(self, header: conversation.Header) -> None:
        """Set what the K/V records do not carry, and check every layer's length against the header."""
        for saved, layer in zip(header.layers, self.layers):
            layer.dropped = saved.dropped
            if layer.get_seq_length() != saved.length:
                raise IntegrityError(f"layer {saved.index} holds {layer.get_seq_length()} tokens after loading, "
                                     f"the file says {saved.length}.")
        if self._prefix is not None and header.ids is not None and header.namespace is not None:
            self._prefix.start(Namespace(**header.namespace), header.ids)

    def _batch(self) -> int:
        return max((self.store.batch_size(layer) for layer in self.store.layouts), default=0)


class _Resources:
    """What a cache holds beyond Python objects (threads, descriptors, files, pinned and device memory), apart
    from the cache itself: a finalizer that holds it keeps no cycle through the cache alive."""

    def __init__(self) -> None:
        self.disk: DiskTier | None = None
        self.store: KVStore | None = None
        self.mover: Any = None
        self.executors: dict[str, Executor] = {}

    def close(self) -> None:
        """Close executors, the mover and the store (its tiers); log each failure and go on."""
        steps = [*(executor.close for executor in self.executors.values())]
        if self.mover is not None:
            steps.append(self.mover.close)
        if self.store is not None:
            steps.append(self.store.close)
        if self.disk is not None:
            steps.append(self.disk.close)  # idempotent: the store closed it already, if there is one
        for step in steps:
            try:
                step()
            except Exception:  # noqa: BLE001 - cleanup goes on: every other resource is still released
                log.exception("tierkv: closing the cache: %s failed", getattr(step, "__qualname__", step))
        self.executors.clear()
        self.store = self.mover = self.disk = None


def _attention_start(layers: list[CacheLayerMixin], index: int) -> int:
    """The first stored token layer ``index`` attends to (the executors' ``start_of``)."""
    return layers[index].attention_start(0)  # type: ignore[attr-defined]


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword this transformers release's ``forward`` takes the cache by: ``cache`` (newer 5.x, where
    ``past_key_values`` warns that it goes away) or ``past_key_values`` (earlier 5.x, e.g. 5.17, where a
    ``cache=`` would land in ``**kwargs`` and be ignored: decoding without the cache)."""
    return _cache_keyword(type(model))


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _layer_types(config: PreTrainedConfig) -> tuple[list[str], list[dict[str, Any]]]:
    """Per-layer attention types and kwargs from transformers, across its 5.x releases: some return one
    kwargs dict per layer, others (5.17) one dict of per-layer lists or shared values; 5.0 has no such
    function (its DynamicCache's rule is replayed)."""
    if get_layer_types_and_kwargs is None:
        layer_types, kwargs = _layer_types_of_config(config)
    else:
        layer_types, kwargs = get_layer_types_and_kwargs(config)
    layer_types = list(layer_types) if layer_types else ["full_attention"] * config.num_hidden_layers
    if isinstance(kwargs, dict):
        def value(item: Any, i: int) -> Any:
            return item[i] if isinstance(item, (list, tuple)) else item

        kwargs = [{key: value(item, i) for key, item in kwargs.items()} for i in range(len(layer_types))]
    kwargs = list(kwargs) if kwargs else [{} for _ in layer_types]
    if "sliding_window" not in {key for kw in kwargs for key in kw} and getattr(config, "sliding_window", None):
        kwargs = [{**kw, "sliding_window": config.sliding_window} for kw in kwargs]
    return layer_types, kwargs


def _layer_types_of_config(config: PreTrainedConfig) -> tuple[list[str], dict[str, Any]]:
    """transformers 5.0's ``DynamicCache(config=...)`` rule: ``layer_types``, else all sliding when the config
    has a window (or a chunk size), else all full; shared KV layers (Gemma3n) hold no cache."""
    window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        kind = "sliding_attention" if window is not None else "full_attention"
        layer_types = [kind] * config.num_hidden_layers
    shared = getattr(config, "num_kv_shared_layers", None)
    if shared:
        layer_types = layer_types[:-shared]
    return list(layer_types), ({"sliding_window": window} if window is not None else {})


def _token_ids(input_ids: torch.Tensor | Sequence[int]) -> np.ndarray:
    """Token ids as an int64 ``[B, T]`` array (a 1-D sequence is one row)."""
    ids = np.asarray(input_ids.detach().cpu() if isinstance(input_ids, torch.Tensor) else input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise InvalidConfigError(f"input_ids must be token ids of shape [batch, tokens], got {ids.dtype} "
                                 f"{tuple(ids.shape)}.")
    return ids.astype(np.int64)


def _aiofiles() -> Any:
    try:
        import aiofiles
    except ImportError:
        raise InvalidConfigError("asave/aload need aiofiles: pip install 'tierkv[aio]' (or pip install aiofiles); "
                                 "save/load work without it.") from None
    return aiofiles


def _device_minimum(staging: int, tails: int, slot_bytes: int, device: str | torch.device | None) -> int:
    """The smallest budget for ``staging`` beside ``tails`` (:func:`tierkv.staging.device_minimum`), plus on CUDA
    (``device``; None: CUDA if available) the two landing buffers, which are staging too and are sized from
    the budget itself: found by bisection, as the smallest budget that holds what it implies."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not accel.backend(torch.device(device)).streams:  # CUDA (or its stand-in): landing buffers too
        return device_minimum(staging, tails)

    def needs(budget: int) -> int:
        return device_minimum(staging + 2 * landing_bytes(budget, slot_bytes), tails)

    low, high = device_minimum(staging, tails), needs(1 << 62)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if needs(middle) <= middle else (middle + 1, high)
    return high


def _layout_of_config(config: PreTrainedConfig, block_tokens: int, dtype: torch.dtype | None) -> BlockLayout:
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dtype = dtype or getattr(text, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return BlockLayout(heads, head_dim, block_tokens, dtype)


def _streaming_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                                 scaling: float | None = None, dropout: float = 0.0, softcap: float | None = None,
                                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function for ``TieredCache.streaming``: ``key``/``value`` are only this step's
    tokens (already stored); attention runs over everything the cache holds for ``module.layer_idx``."""
    cache = getattr(module, "_tierkv_cache", None)
    if cache is None:
        raise TierKVError(f"attention '{STREAMING_ATTENTION}' runs only inside `with cache.streaming(model):`.")
    if module.training and dropout:
        raise TierKVError("streaming attention is for inference; call model.eval() (dropout is not supported).")
    if kwargs.get("s_aux") is not None:
        raise TierKVError("streaming attention does not support attention sinks (s_aux); use exact gather "
                          "(no `cache.streaming`).")
    layer = cache.layers[module.layer_idx] if module.layer_idx < len(cache.layers) else None
    if layer is None or layer.pending_keys is not key:
        raise TierKVError("inside `cache.streaming(model)` the model must be called with that cache "
                          "(cache=cache); another cache was passed, or none.")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return cache._attend(module.layer_idx, query, attention_mask, scale, softcap), None


@functools.cache
def _register_streaming_attention() -> None:
    """Register the attention function and its (boolean, sdpa-style) mask builder once per process."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(STREAMING_ATTENTION, _streaming_attention_forward)
    AttentionMaskInterface.register(STREAMING_ATTENTION, sdpa_mask)
