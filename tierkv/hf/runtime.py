"""What a cache holds beyond Python objects, and which executor runs each step.

:class:`Runtime` owns the store (its tiers), the mover, the telemetry and the executors, apart from the cache
itself: the cache's finalizer holds it, and it holds nothing of the cache, so no cycle keeps a dropped cache
alive. A :class:`Mode` says which registered executor runs multi-token steps (prefill) and which one-token
steps (decode); ``cache.streaming()`` / ``cache.sparse()`` push one for their block. Switching modes releases
the staging of every executor the new mode does not run, so each ``min_*_device_bytes`` holds whatever ran
before.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tierkv import accel
from tierkv.attention import sparse as _sparse  # noqa: F401 - registers the sparse executor
from tierkv.attention import streaming as _streaming  # noqa: F401 - registers the streaming executor
from tierkv.attention.base import EXECUTORS, PipelinedExecutor
from tierkv.attention.exact_gather import ExactGather
from tierkv.attention.streaming import DEFAULT_CHUNK_TOKENS
from tierkv.bandwidth import LinkProfile
from tierkv.blocks import Tier
from tierkv.errors import BudgetTooSmallError
from tierkv.hf import sizing
from tierkv.layout import BlockLayout
from tierkv.mover import make_mover
from tierkv.policy import Policy
from tierkv.staging import gather_staging_bytes, landing_bytes, open_tail_bytes, streaming_staging_bytes
from tierkv.stats import Timeline, Trace, add_counts, make_timeline
from tierkv.store import KVStore
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.memory import MemoryTier
from tierkv.units import format_gb, format_size_option, plural

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from tierkv.attention.sparse import SparseBudget

log = logging.getLogger("tierkv")

DEFAULT_DEVICE_FRACTION = 0.25  # of free device memory (CPU RAM on a CPU-only host), when gpu_gb is None
DEFAULT_HOST_FRACTION = 0.5  # of available RAM, when cpu_gb is None
EXACT = "exact_gather"
COUNTERS = ("prefetch_hits", "prefetch_misses", "stall_s", "read_ahead_hits")
"""The executors' counters ``stats()`` sums (a retired executor's are carried over: they never go back)."""


@dataclass(frozen=True, slots=True)
class Mode:
    """The registered executors that run multi-token steps (``prefill``) and one-token steps (``decode``), their
    construction options (an executor built with other options is rebuilt), a sparse step's budget, and the
    engaged model's config (a sparse mode's budget errors name ``min_sparse_device_bytes`` of it)."""

    prefill: str = EXACT
    decode: str = EXACT
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    budget: SparseBudget | None = None
    config: PreTrainedConfig | None = None


@dataclass(slots=True)
class Budgets:
    """The tier budgets and options a store is built with (bytes; None: a share of what is free)."""

    gpu: int | None
    cpu: int | None
    block_tokens: int
    policy: Policy
    prefetch_depth: int | str
    profile: LinkProfile | str | Any | None


class Runtime:
    """The store, mover, telemetry and executors of one cache, and the mode stack that picks executors."""

    def __init__(self, budgets: Budgets, disk: DiskTier | None, trace: Trace | None) -> None:
        self.budgets = budgets
        self.disk = disk
        self.trace = trace
        self.store: KVStore | None = None
        self.mover: Any = None
        self.timeline: Timeline | None = None
        self.executors: dict[str, PipelinedExecutor] = {}  # by registered name, built on first use
        self.built_with: dict[str, dict[str, Any]] = {}  # name -> the options it was built with
        self.modes: list[Mode] = []
        self.num_layers: int | None = None  # known from the config, else learnt by the executors
        self.prefill: PipelinedExecutor | None = None  # the executors of the current mode (None: not built yet)
        self.decode: PipelinedExecutor | None = None
        self.attending: PipelinedExecutor | None = None  # the executor of the last step
        self.retired: dict[str, float] = dict.fromkeys(COUNTERS, 0)  # the counters of executors closed so far
        self.retired_own: dict[str, Any] = {}  # executor name -> its own counters (``counters``) summed when closed
        self.moved: dict[str, int] = {}  # the store's bytes_moved when it closed (readable after close())

    @property
    def mode(self) -> Mode:
        return self.modes[-1] if self.modes else Mode(options={EXACT: {"prefetch_depth": self.budgets.prefetch_depth}})

    @property
    def exact(self) -> ExactGather:
        """The exact-gather executor (the default path; it exists once the store does)."""
        return self.executors[EXACT]  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------- building
    def open_store(self, key_states: torch.Tensor) -> KVStore:
        """The store, built on the device of the first K/V it will hold."""
        if self.store is not None:
            return self.store
        budgets, device = self.budgets, key_states.device
        gpu, cpu = self.memory_budgets(device)
        if self.disk is not None:  # bounce buffers shrink with the host memory the budgets give (docs/reliability.md)
            self.disk.fit_bounce(cpu + (gpu if device.type == "cpu" else 0))
        device_tier = MemoryTier(Tier.DEVICE, gpu, device)
        accelerated = accel.backend(device).streams  # CUDA, or its checking stand-in on the CPU
        host_tier = MemoryTier(Tier.HOST, cpu, torch.device("cpu"), pin=accelerated)
        store = self.store = KVStore(device_tier, host_tier, self.disk, budgets.policy, budgets.block_tokens)
        self.mover = make_mover(device)
        self.timeline = make_timeline(budgets.profile, device)
        slot_bytes = BlockLayout.of(key_states, budgets.block_tokens).slot_bytes  # a landing piece holds a block
        if accelerated and not store.enable_landing(landing_bytes(gpu, slot_bytes)):
            log.warning("tierkv: no room for the landing buffers in gpu_gb; host runs cross PCIe block by block")
        self.executor(EXACT, {"prefetch_depth": budgets.prefetch_depth})
        return store

    def memory_budgets(self, device: torch.device) -> tuple[int, int]:
        """The device and host tiers' budgets on ``device``: ``gpu_gb`` and ``cpu_gb``, or where left out the
        shares of free device memory (RAM on a CPU-only host) and of available RAM the store takes."""
        budgets = self.budgets
        available = sizing.host_memory()[1] if budgets.cpu is None or budgets.gpu is None else 0
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available
        gpu = budgets.gpu if budgets.gpu is not None else int(free * DEFAULT_DEVICE_FRACTION)
        host = DEFAULT_HOST_FRACTION
        if device.type != "cuda" and budgets.gpu is None:  # both from the same RAM: together no more than the host's
            host -= DEFAULT_DEVICE_FRACTION  # share, the rest left to the model, its activations and the allocator
        cpu = budgets.cpu if budgets.cpu is not None else int(available * host)
        return gpu, cpu

    def executor(self, name: str, options: dict[str, Any]) -> PipelinedExecutor:
        """The registered executor ``name``, built with ``options`` (rebuilt if it was built with others)."""
        executor = self.executors.get(name)
        if executor is not None and self.built_with[name] == options:
            return executor
        if executor is not None:
            executor.close()  # e.g. streaming buffers are sized per chunk length
            self.retire(executor)
            del self.executors[name]
        exact = self.executors.get(EXACT)
        layers = self.num_layers if self.num_layers is not None else \
            exact.num_layers if exact is not None and exact.layers_known else None
        assert self.store is not None, "executors are built once the store is"
        executor = EXECUTORS[name](self.store, self.mover, num_layers=layers, timeline=self.timeline,
                                   trace=self.trace, **options)
        self.executors[name] = executor
        self.built_with[name] = options
        return executor

    def retire(self, executor: PipelinedExecutor) -> None:
        """Carry a closed executor's counters over, so ``stats()``' counters never go back."""
        for name in COUNTERS:
            self.retired[name] += getattr(executor, name)
        own = getattr(executor, "counters", None)  # e.g. what sparse steps read (``stats()["sparse"]``)
        if own is not None:
            add_counts(self.retired_own.setdefault(executor.name, type(own)()), own)

    def own_counters(self, name: str) -> Any:
        """Executor ``name``'s own counters over this cache's life (its retired predecessors' added), or None
        where no such executor was built."""
        live = self.executors.get(name)
        retired = self.retired_own.get(name)
        if live is None or retired is None:
            return live.counters if live is not None else retired  # type: ignore[attr-defined]
        total = copy.deepcopy(retired)
        add_counts(total, live.counters)  # type: ignore[attr-defined]
        return total

    def counters(self) -> dict[str, Any]:
        """The prefetch counters of every executor of this cache's life, the retired ones' included."""
        executors = list(self.executors.values())
        total = {name: self.retired[name] + sum(getattr(e, name) for e in executors) for name in COUNTERS}
        return {"prefetch_hits": int(total["prefetch_hits"]), "prefetch_misses": int(total["prefetch_misses"]),
                "prefetch_stall_s": float(total["stall_s"]), "disk_read_ahead_hits": int(total["read_ahead_hits"])}

    def stats(self, tokens: int, remote: dict[str, Any] | None) -> dict[str, Any]:
        """``TieredCache.stats()``: the store's occupancy and traffic, the executors' (docs/architecture.md). Before
        the store exists every tier is empty; after ``close()`` too, but the counters keep their final figures."""
        extra = {"remote": remote} if remote is not None else {}  # lookups, hits, bytes on the wire (docs/remote.md)
        if self.store is None:
            empty = {tier.label: 0 for tier in Tier}
            closed = {"steps": self.timeline.summary()} if self.timeline is not None else {}
            sparse = self.own_counters("sparse")
            if sparse is not None:
                closed["sparse"] = {**sparse.as_dict(), "summaries_device_bytes": 0, "rest_copy_device_bytes": 0}
            return {"bytes_resident": empty, "bytes_moved": dict(self.moved), "blocks": dict(empty), "tokens": 0,
                    **self.counters(), **closed, **extra}
        stats = {**self.store.stats(), **extra, **self.counters()}
        exact = self.exact
        summaries = self.store.summaries
        held = summaries.summary_nbytes if summaries is not None else 0
        rest = summaries.nbytes - held if summaries is not None else 0
        buffers = len(exact.buffers)  # one, not depth + 1, where the budget left no room to prefetch
        stats.update(tokens=tokens, bytes_summaries=held, bytes_rest_copy=rest, mover=exact.mover.name,
                     disk_engine=self.disk.engine_name if self.disk else None,
                     prefetch_depth=min(exact.prefetch_depth, buffers - 1) if buffers else exact.prefetch_depth,
                     prefetch_auto=list(exact.auto_choices),
                     steps=exact.timeline.summary() if exact.timeline is not None else {})
        sparse = self.own_counters("sparse")
        if sparse is not None:
            stats["sparse"] = {**sparse.as_dict(), "summaries_device_bytes": held, "rest_copy_device_bytes": rest}
        return stats

    def budget_error(self, error: BudgetTooSmallError, context: int, batch: int,
                     record_past: bool = False) -> BudgetTooSmallError:
        """``error`` told in the current mode: where the budget is below what a step at ``context`` tokens needs (the
        staging and every layer's open block, what ``min_device_bytes`` / ``min_streaming_device_bytes`` promise,
        where the store that raised it knows only the layers it has seen so far), that one minimum, and the way
        out of this mode (streaming for gather; shorter chunks inside streaming). ``record_past``: sliding layers
        keep their whole past (sparse's minimum counts it). The same error comes back with its message replaced,
        so ``raise budget_error(error, ...) from error`` shows one traceback, not a chain."""
        store = self.store
        if store is None or not store.layouts:
            return error
        layout = max(store.layouts.values(), key=lambda layout: layout.slot_bytes)
        exact = self.executors.get(EXACT)
        known = self.num_layers is not None or (exact is not None and exact.layers_known)
        layers = self.num_layers or max(len(store.layouts), exact.num_layers if exact is not None else 0)
        mode = self.mode
        chunk = mode.options.get("streaming", {}).get("chunk_tokens")
        split = self.executors.get("split")
        scratch = split.staging.reserved if mode.decode == "split" and split is not None else 0  # 0 on a CPU host
        config = mode.config
        sparse = mode.budget if mode.decode == "sparse" and config is not None else None

        def minimum(chunk_tokens: int | None) -> int:
            """The budget a step needs with exact gather (None) or with streaming in ``chunk_tokens`` chunks (a
            sparse mode: its prefill's chunks, its selection and key summaries: ``min_sparse_device_bytes``)."""
            if sparse is not None and config is not None and chunk_tokens is not None:
                return sizing.min_sparse_device_bytes(config, context, sparse.tokens, batch, store.block_tokens,
                                                      sparse.page_tokens, sparse.rest_bits, chunk_tokens,
                                                      layout.dtype, store.device.device, record_past)  # fmt: skip
            if chunk_tokens is None:
                depth = self.budgets.prefetch_depth if isinstance(self.budgets.prefetch_depth, int) else 1
                staging = gather_staging_bytes(batch, context, layout.token_bytes, store.block_tokens, depth)
            else:
                staging = streaming_staging_bytes(batch, chunk_tokens, layout.token_bytes, store.block_tokens) + \
                    scratch
            tails = open_tail_bytes(layers, batch, layout.slot_bytes)
            return sizing.device_minimum(staging, tails, layout.slot_bytes, store.device.device)

        need, budget = minimum(chunk), store.device.budget
        if need <= budget:  # the store's own reason stands (its numbers); only the way out depends on the mode
            error.args = (str(error).rstrip(". ") + self._way_out(chunk, minimum, budget, need),)
            return error
        over = plural(layers, "layer") if known else \
            f"the {plural(layers, 'layer')} seen so far (pass config=model.config to TieredCache to count all)"
        how = "exact gather" if chunk is None else f"{mode.decode} attention in {chunk}-token chunks"
        api = "min_device_bytes gives it for the context you decode to" if chunk is None else \
            "min_sparse_device_bytes gives it for the context you decode to" + (
                "" if not record_past or not any(sizing.layer_windows(config)) else
                ", with record_past=True: this cache was built without config=, so its sliding-window layers keep "
                "every token (TieredCache(config=model.config) keeps their windows)" if self.num_layers is None else
                ", with record_past=True while activate_past_recording() keeps the sliding layers' whole past"
                ) if sparse is not None and config is not None else \
            f"{'min_split_device_bytes' if mode.decode == 'split' else 'min_streaming_device_bytes'} gives it"
        least = "; TieredCache(prefetch_depth=0, ...), which reads no layer ahead (slower), needs less: " \
            "min_device_bytes(..., prefetch_depth=0)" if chunk is None and self.budgets.prefetch_depth != 0 else ""
        rows = f" in {batch} rows" if batch > 1 else ""
        api += f", with batch={batch}: the rows a step decodes, the batch times num_beams or num_return_sequences" \
            if batch > 1 else ""  # fmt: skip
        taken = format_size_option(need)
        taken += "GB" if taken[-1].isdigit() else ""  # the option's bare number counts GB: '3.91' reads '3.91GB'
        error.args = (f"the device budget ({format_gb(budget)}) is too small for {how} over {over} at {context:,} "
                      f"tokens{rows}: gpu_gb=\"{need}B\" holds the staging and every layer's open block, which takes "
                      f"{taken}; raise gpu_gb to at least that (TieredCache.{api}{least})"
                      f"{self._way_out(chunk, minimum, budget, need)}",)
        return error

    def _way_out(self, chunk: int | None, minimum: Callable[[int | None], int], budget: int, need: int) -> str:
        """The end of a budget error: with exact gather, streaming where it needs less; inside streaming (sparse,
        split), shorter chunks: the longest that fits ``budget``, else the shortest and what it needs."""
        if chunk is None:
            streaming = minimum(DEFAULT_CHUNK_TOKENS)
            if streaming >= need:
                return "."
            return (f", or attend with cache.streaming(model), which stages two {DEFAULT_CHUNK_TOKENS}-token chunks "
                    f"instead of layers: gpu_gb=\"{streaming}B\" at any context.")
        shorter = [c for c in (chunk >> i for i in range(1, chunk.bit_length())) if c >= self.budgets.block_tokens]
        if not shorter:
            return "."
        fits = next((c for c in shorter if minimum(c) <= budget), None)
        call = f"cache.{self.mode.decode}(model, chunk_tokens="
        if fits is not None:
            return f", or stream in shorter chunks: {call}{fits}) fits this budget."
        return f", or stream in shorter chunks: {call}{shorter[-1]}) needs gpu_gb=\"{minimum(shorter[-1])}B\"."

    # ---------------------------------------------------------------------------------------- modes
    def hand_off(self, new_tokens: int) -> PipelinedExecutor:
        """The executor of a step of ``new_tokens`` in the current mode (built if needed); a step by another
        executor than the last one ends the last one's step in progress (telemetry)."""
        if self.prefill is None or self.decode is None:
            mode = self.mode
            prefill = self.prefill = self.executor(mode.prefill, mode.options.get(mode.prefill, {}))
            decode = self.decode = self.executor(mode.decode, mode.options.get(mode.decode, {}))
            if mode.budget is not None:  # a sparse mode: its decode executor reads within the budget
                decode.budget = mode.budget  # type: ignore[attr-defined]
        else:
            prefill, decode = self.prefill, self.decode
        executor = decode if new_tokens == 1 else prefill
        if executor is not self.attending:
            if self.attending is not None:
                self.attending.pause_telemetry()
            self.attending = executor
        return executor

    def push(self, mode: Mode) -> None:
        self.modes.append(mode)
        self.switch()

    def pop(self) -> None:
        self.modes.pop()
        self.switch()

    def switch(self) -> None:
        """Entering or leaving a mode: staged data is stale, the step in progress ends here, and the executors
        the new mode does not run give their staging back (the next ones may need all of the budget)."""
        self.invalidate()
        mode = self.mode
        for name, executor in self.executors.items():
            executor.pause_telemetry()
            if name not in (mode.prefill, mode.decode):
                executor.release_staging()
        if mode.decode != "sparse" and self.store is not None:
            # sparse attention stops: its summaries and rest copy grow with every block that fills, and no other
            # mode's minimum counts them
            self.store.drop_summaries()
        self.prefill = self.decode = self.attending = None

    def invalidate(self) -> None:
        """Table edits (crop, reorder, reset, rollback): data staged by any executor is stale."""
        for executor in self.executors.values():
            executor.invalidate()

    def close(self) -> None:
        """Close executors, the mover and the store (its tiers), and write the trace where it has a path; log each
        failure and go on. The counters stay readable (``stats()``)."""
        if self.store is not None:
            self.moved = dict(self.store.bytes_moved)
        steps = [*(executor.close for executor in self.executors.values())]
        if self.trace is not None and self.trace.path is not None:
            steps.append(self.save_trace)
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
        for executor in self.executors.values():
            self.retire(executor)
        self.executors.clear()
        self.prefill = self.decode = self.attending = None
        self.store = self.mover = self.disk = None

    def save_trace(self) -> None:
        """Write the trace to its path (a cache closed before any forward writes an empty one); a folder removed
        or a disk filled since the cache was built is logged, not raised."""
        assert self.trace is not None and self.trace.path is not None
        try:
            self.trace.save(self.trace.path)
        except OSError as exc:
            log.warning("tierkv: the timeline trace could not be written to %s (%s); the cache closed without it. "
                        "Give trace= a path in a folder that stays writable.", self.trace.path, exc)
