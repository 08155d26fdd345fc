"""Budgets + model + links -> bytes per tier, bytes moved per step, predicted tokens/s and bottleneck.

The planner answers "what will this model decode at, at this context, on this machine, with these
budgets, and what would buy more speed" before anything is allocated. It fills the tiers top down for the
exact-gather executor, where every byte of KV is read every decode step:

1. the device budget first pays for the staging buffers: ``prefetch_depth + 1`` layers of full K/V
   (the layer being attended and the ones being prefetched);
2. the rest of the device budget holds KV; then the host budget; then disk;
3. each tier's share is spread evenly over the layers (every layer keeps the same fraction of its tokens
   on each tier), because equal per-layer transfers pipeline best: a layer entirely off-device would
   stall the pipeline while the others idle the links.

The step time comes from :func:`tierkv.bandwidth.predict_step`; the compute time from a roofline of the
model's weights, KV reads and FLOPs on a :class:`DeviceSpec` (see ``docs/bandwidth-model.md``).

The split executor (each tier's KV attended where it lives) stages no layer: its device holds the prefill's two
streaming chunks and, on a GPU host, a decode step's bounded scratch (:func:`split_min_device_bytes`, the
runtime's own :func:`tierkv.staging.split_device_minimum`), and its step is priced by
:func:`tierkv.bandwidth.predict_split_step` at the host attention rate :func:`host_attention_rate` gives.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tierkv.bandwidth import (
    DISK_READ_AHEAD,
    PRESETS,
    Bottleneck,
    LayerLoad,
    LinkProfile,
    Placement,
    StepForecast,
    capped_latencies,
    predict_split_step,
    predict_step,
)
from tierkv.errors import BudgetTooSmallError, CapacityError, InvalidConfigError
from tierkv.model_presets import ModelSpec, resolve_model
from tierkv.settings import DIRECT_IO_ALIGN
from tierkv.staging import (
    DEFAULT_REST_BITS,
    GROWTH,
    MAX_PREFETCH_DEPTH,
    REST_BITS,
    SLOT_ALIGN,
    default_page_tokens,
    device_minimum,
    gather_capacity,
    gather_staging_bytes,
    landed_device_minimum,
    open_tail_bytes,
    rest_copy_bytes,
    sparse_budget_tokens,
    split_device_minimum,
    split_staging_bytes,
    streaming_staging_bytes,
    summary_element_size,
    summary_table_rows,
)
from tierkv.stats import default_profile
from tierkv.units import format_bytes, format_gb, format_size_option, parse_size, parse_tokens, plural
from tierkv.vocabulary import CLI_EXECUTORS, PLAN_EXECUTORS, LinkName

__all__ = ["DEVICES", "DeviceSpec", "ExecutorOption", "HostAttentionRate", "Plan", "PlanRequest", "TierBytes", "WhatIf",
           "build_request", "compare_executors", "fastest_advice", "host_attention_rate", "min_device_bytes",
           "parse_tokens", "plan", "sparse_advice", "sparse_what_if", "split_min_device_bytes", "split_what_if",
           "what_ifs"]


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """The compute assumption: a decode step is a roofline over the device's memory bandwidth and FLOPs.

    ``efficiency`` is the achieved fraction of both peaks. Decode at small batch is memory-bound; well
    tuned decoders reach 60-80 % of peak HBM bandwidth (gpt-fast reports its MBU), so 0.7 is the default.
    """

    name: str
    memory_bandwidth_bytes_per_s: float
    peak_flops: float
    efficiency: float = 0.7

    def time(self, nbytes: float, flops: float) -> float:
        """Roofline time of a kernel that reads ``nbytes`` and does ``flops``."""
        return max(nbytes / self.memory_bandwidth_bytes_per_s, flops / self.peak_flops) / self.efficiency


EXECUTORS = tuple(CLI_EXECUTORS)
"""The short ``--executor`` spellings of :mod:`tierkv.vocabulary` (:data:`~tierkv.vocabulary.CLI_EXECUTORS`)."""
PLANNED = tuple(PLAN_EXECUTORS)
"""``executor=`` values: :data:`EXECUTORS` and ``split``."""

DEVICES: dict[str, DeviceSpec] = {
    # Data-sheet peaks: HBM/GDDR bandwidth and dense BF16 tensor FLOPs (no sparsity).
    "h100-sxm": DeviceSpec("h100-sxm", 3.35e12, 989e12),
    "h200": DeviceSpec("h200", 4.8e12, 989e12),
    "a100-80gb": DeviceSpec("a100-80gb", 2.04e12, 312e12),
    "l40s": DeviceSpec("l40s", 0.864e12, 362e12),
    "rtx4090": DeviceSpec("rtx4090", 1.008e12, 165e12),
}


CPU = "cpu"
CPU_PRESET = DeviceSpec(CPU, 20e9, 100e9, efficiency=0.5)
"""A CPU host without a measured profile: dual-channel DDR4/DDR5 memcpy (~20 GB/s) and ~100 GFLOP/s of
float32 matmul (a few AVX2 cores); decode on CPUs reaches about half of either. ``tierkv bench`` measures
both (its profile's ``host->host`` link and ``machine["compute_flops"]``), and a plan with ``--profile`` uses
those instead."""
COMPUTE_FLOPS_KEY = "compute_flops"
"""Key of a :class:`LinkProfile`'s ``machine`` that holds the host's measured matmul FLOP/s (``tierkv bench``)."""
WARNINGS_KEY = "warnings"
"""Key of a :class:`LinkProfile`'s ``machine`` that holds why ``tierkv bench`` doubted its numbers (a busy host,
contradicting points: :mod:`tierkv.calibrate.consistency`); ``tierkv plan --profile`` repeats it."""
QUICK_NOTE = "measured with --quick (small sizes: a smoke test, not a profile to plan with)"
"""The warning ``tierkv bench --quick`` ends a profile's ``machine["warnings"]`` with; ``tierkv plan --profile``
tells such a profile apart by it."""
GPU_KEY = "gpu"
"""Key of a :class:`LinkProfile`'s ``machine`` that names the measured host's GPU (``"none"`` on a CPU-only host)."""


MEMCPY_TRAFFIC = 2
"""Bytes a memcpy moves over the memory bus per byte copied (it reads each byte and writes it): memory read
bandwidth is this times the ``host->host`` memcpy rate."""


def cpu_device(profile: LinkProfile | None = None) -> DeviceSpec:
    """The CPU as the compute device: where a ``tierkv bench`` profile measured them, memory read bandwidth from its
    ``host->host`` memcpy rate (:data:`MEMCPY_TRAFFIC` times it) and FLOP/s from its ``machine["compute_flops"]``
    (a matmul's achieved rate). Rates measured on this host are reached, not peaks, so the roofline takes them at
    efficiency 1, and one not measured as :data:`CPU_PRESET` reaches it (its peak times its efficiency). Neither
    measured: :data:`CPU_PRESET` itself."""
    if profile is None:
        return CPU_PRESET
    memcpy = profile.links.get(LinkName.HOST_TO_HOST)
    try:
        flops = float(profile.machine.get(COMPUTE_FLOPS_KEY, ""))
    except ValueError:
        flops = 0.0
    bandwidth = MEMCPY_TRAFFIC * memcpy.bandwidth_bytes_per_s if memcpy is not None else 0.0
    if bandwidth <= 0 and flops <= 0:
        return CPU_PRESET
    reached = CPU_PRESET.efficiency
    return DeviceSpec("cpu, measured",
                      bandwidth if bandwidth > 0 else CPU_PRESET.memory_bandwidth_bytes_per_s * reached,
                      flops if flops > 0 else CPU_PRESET.peak_flops * reached, efficiency=1.0)


def resolve_device(name: str, profile: LinkProfile | None = None) -> DeviceSpec:
    """A GPU preset of :data:`DEVICES` by name, or ``"cpu"`` (:func:`cpu_device` of ``profile``)."""
    if name == CPU:
        return cpu_device(profile)
    if name not in DEVICES:
        raise InvalidConfigError(f"unknown device {name!r}; choose one of: {', '.join([*DEVICES, CPU])}.")
    return DEVICES[name]


DEFAULT_HOST_CORES = 32
"""Host cores a GPU-host plan assumes without a measured profile (``--host-cores``): one socket of a GPU server."""
PER_CORE_ATTENTION = 8e9
"""Bytes of fp16/bf16 K/V one core attends per second: a core streams ~10 GB/s from DRAM (single-threaded memcpy,
the ``dram`` preset's note), and the kernel's fp32 multiply-adds (with GQA, one per query head of the group per
element) keep it a little under that."""
SERVER_DRAM = 300e9
"""Host DRAM read bandwidth a GPU-host plan assumes (``--host-dram-gbps``): one socket of 8-channel DDR5-4800
(307 GB/s peak); a two-socket server streams 300-600 GB/s."""
DRAM_READ_SHARE = 0.8
"""The share of DRAM read bandwidth the kernel reaches (its target: >= 0.8x a plain read of the same slabs)."""
ATTENTION_OF_MEMCPY = 0.8
"""Host attention rate per memcpy rate where only memcpy was measured: a memcpy reads and writes each byte, the
kernel only reads, so this under-states it on most hosts (the estimate stays conservative)."""


@dataclass(frozen=True, slots=True)
class HostAttentionRate:
    """Bytes of K/V per second the host's CPUs attend in place (the split executor's host share), and where the
    number comes from: a ``tierkv bench`` measurement, or an estimate that says its formula."""

    bytes_per_s: float
    source: str


def host_estimate_applies(links: LinkProfile) -> bool:
    """Whether a split plan prices the host's attention from its cores and DRAM (``host_cores``,
    ``host_dram_bytes_per_s``): a GPU host's presets, or a profile with neither the kernel's measurement nor a
    memcpy link; otherwise the links give the rate and those two are unused."""
    if links.host_attention is not None:
        return False
    presets = links.machine.get("source", "").startswith("presets")
    return (presets and not links.serial_mover) or LinkName.HOST_TO_HOST not in links.links


def host_attention_rate(links: LinkProfile, host_cores: int | None = None,
                        host_dram_bytes_per_s: float | None = None) -> HostAttentionRate:
    """The host attention rate a split plan assumes, in order:

    1. measured: the profile's ``host_attention`` (``tierkv bench``, every torch thread; the one-thread rate where
       every thread measured slower, which on an otherwise idle host does not happen: the slower rate is the
       other work's, not the kernel's);
    2. a GPU host's presets: ``min(cores x PER_CORE_ATTENTION, DRAM_READ_SHARE x DRAM)``, cores
       :data:`DEFAULT_HOST_CORES` and DRAM :data:`SERVER_DRAM` unless given;
    3. otherwise (a profile measured before the kernel was, or a CPU-only host's presets):
       ``ATTENTION_OF_MEMCPY x`` its ``host->host`` memcpy link — or, where it has none, the formula of 2.
    """
    if host_cores is not None and (isinstance(host_cores, bool) or not isinstance(host_cores, int) or host_cores < 1):
        raise InvalidConfigError(f"host_cores={host_cores!r} must be an int >= 1 (the host's CPU cores).")
    if host_dram_bytes_per_s is not None and not (math.isfinite(host_dram_bytes_per_s) and host_dram_bytes_per_s > 0):
        raise InvalidConfigError(f"host DRAM bandwidth {host_dram_bytes_per_s!r} must be a positive number of "
                                 "bytes per second (--host-dram-gbps 300).")
    measured = links.host_attention
    if host_estimate_applies(links):
        cores = host_cores or DEFAULT_HOST_CORES
        dram = host_dram_bytes_per_s or SERVER_DRAM
        rate = min(cores * PER_CORE_ATTENTION, DRAM_READ_SHARE * dram)
        return HostAttentionRate(rate, (
            f"preset: min({cores} cores x {PER_CORE_ATTENTION / 1e9:g} GB/s, {DRAM_READ_SHARE:g} x "
            f"{dram / 1e9:g} GB/s host DRAM); --host-cores, --host-dram-gbps, or measure with tierkv bench"))
    if measured is not None and measured.bandwidth_bytes_per_s < measured.single_thread_bytes_per_s:
        return HostAttentionRate(measured.single_thread_bytes_per_s, (
            f"measured by tierkv bench: 1 thread ({measured.kernel} kernel; {plural(measured.threads, 'thread')} "
            f"measured slower, {measured.bandwidth_bytes_per_s / 1e9:.1f} GB/s: a busy host)"))
    if measured is not None:
        return HostAttentionRate(measured.bandwidth_bytes_per_s, (
            f"measured by tierkv bench: {plural(measured.threads, 'thread')} ({measured.kernel} kernel; 1 thread "
            f"{measured.single_thread_bytes_per_s / 1e9:.1f} GB/s)"))
    memcpy = links.links[LinkName.HOST_TO_HOST]  # (host_estimate_applies where there is none)
    where = "preset" if links.machine.get("source", "").startswith("presets") else "measured"
    return HostAttentionRate(ATTENTION_OF_MEMCPY * memcpy.bandwidth_bytes_per_s, (
        f"estimate: {ATTENTION_OF_MEMCPY:g} x the {where} memcpy ({memcpy.bandwidth_bytes_per_s / 1e9:.1f} GB/s); "
        "rerun tierkv bench to measure the kernel"))


def default_device(profile: LinkProfile | None) -> str:
    """``"cpu"`` for a profile measured on a CPU-only host (its mover is serial), else ``"h100-sxm"``."""
    return CPU if profile is not None and profile.serial_mover else "h100-sxm"


PLAN_BLOCK_TOKENS = 256
"""Tokens per block of every plan (TieredCache's default block): the unit of staging and of sparse pages."""



@dataclass(frozen=True, slots=True)
class PlanRequest:
    """Everything a plan depends on; a what-if is this with one field replaced.

    ``gpu_bytes`` is the KV cache's device budget (weights and activations are not in it); ``disk_bytes``
    None means no limit. ``compute_s_per_step`` overrides the roofline estimate of one step's compute;
    ``prefetch_depth`` None lets the planner choose.
    """

    model: ModelSpec
    context: int
    batch: int
    gpu_bytes: int
    cpu_bytes: int
    links: LinkProfile
    disk_bytes: int | None = None
    device: DeviceSpec = DEVICES["h100-sxm"]
    compute_s_per_step: float | None = None
    prefetch_depth: int | None = None
    executor: str = "gather"  # "gather": whole layers staged on the device; "streaming": two chunks;
    # "sparse": decode steps read only the top blocks (sparse_tokens per row and layer), prefill streams;
    # "split": each tier's KV attended where it lives (the host's on the CPUs), no staging
    chunk_tokens: int = 4096
    sparse_tokens: int = 2048  # attended tokens per row and layer in sparse mode (sinks and recent included)
    sparse_rest_bits: int = DEFAULT_REST_BITS  # sparse: the blocks not read attended from a copy of this many
    # bits on the device (cache.sparse's default)
    sparse_page_tokens: int | None = None  # sparse: tokens per selected page (None: the library's default page)
    block_tokens: int = PLAN_BLOCK_TOKENS  # staging is whole blocks (TieredCache's default block)
    host_cores: int | None = None  # split, GPU-host presets: the host's cores (host_attention_rate)
    host_dram_bytes_per_s: float | None = None  # ... and its DRAM read bandwidth
    notes: tuple[str, ...] = ()  # what was changed in the inputs to plan with them (a busy host's latencies capped)

    def __post_init__(self) -> None:
        if self.executor not in PLANNED:
            raise InvalidConfigError(f"executor={self.executor!r}; choose one of {', '.join(PLANNED)}.")
        if self.chunk_tokens < 1:
            raise InvalidConfigError(f"chunk_tokens={self.chunk_tokens} must be >= 1.")
        if self.sparse_tokens < 1:
            raise InvalidConfigError(f"sparse_tokens={self.sparse_tokens} must be >= 1.")
        if self.sparse_page_tokens is not None and (self.sparse_page_tokens < 1
                                                    or self.block_tokens % self.sparse_page_tokens):
            raise InvalidConfigError(f"sparse_page_tokens={self.sparse_page_tokens} must divide block_tokens="
                                     f"{self.block_tokens} (e.g. 16 for 256-token blocks).")
        if self.sparse_rest_bits not in REST_BITS:
            raise InvalidConfigError(f"sparse_rest_bits={self.sparse_rest_bits} must be one of "
                                     f"{', '.join(map(str, REST_BITS))} (0: no rest copy).")
        if self.context < 1 or self.batch < 1:
            raise InvalidConfigError(f"context={self.context} and batch={self.batch} must both be >= 1.")
        if self.compute_s_per_step is not None and not (
            math.isfinite(self.compute_s_per_step) and self.compute_s_per_step >= 0
        ):
            raise InvalidConfigError(
                f"compute time per step {self.compute_s_per_step!r} must be a number >= 0."
            )
        if self.prefetch_depth is not None and self.prefetch_depth < 0:
            raise InvalidConfigError(f"prefetch_depth={self.prefetch_depth} must be >= 0 (0 = no prefetch).")
        deepest = max_prefetch_depth(self.model)
        if self.prefetch_depth is not None and self.prefetch_depth > deepest:
            raise InvalidConfigError(
                f"prefetch depth {self.prefetch_depth} stages more layers than {self.model.name} has "
                f"({self.model.layers}, one computing and {self.model.layers - 1} ahead); give at most {deepest} "
                "(--prefetch-depth), or leave it out for auto."
                if deepest < MAX_PREFETCH_DEPTH else
                f"prefetch depth {self.prefetch_depth} is more than the runtime reads ahead; give at most "
                f"{MAX_PREFETCH_DEPTH} (--prefetch-depth), or leave it out for auto.")


def max_prefetch_depth(model: ModelSpec) -> int:
    """The deepest prefetch a plan of ``model`` takes: the runtime's cap, and never more staged layers than
    the model has (one computing, the rest ahead)."""
    return max(0, min(MAX_PREFETCH_DEPTH, model.layers - 1))


@dataclass(frozen=True, slots=True)
class TierBytes:
    """KV bytes resident on each tier (staging not included)."""

    device: int
    host: int
    disk: int


@dataclass(frozen=True, slots=True)
class Plan:
    """The planner's answer for one :class:`PlanRequest`.

    ``bytes_moved_per_step`` is keyed by link direction. Reads: every off-device byte crosses
    host->device each step, disk bytes also disk->host. Writes: the step's new K/V (``batch`` tokens)
    eventually moves down to the lowest tier in use once the device is full (amortized, small).
    """

    request: PlanRequest
    kv_bytes_per_token: int
    kv_bytes_total: int
    staging_bytes: int
    bytes_per_tier: TierBytes
    bytes_moved_per_step: dict[str, int]
    compute_s_per_step: float
    forecast: StepForecast
    host_attention: HostAttentionRate | None = None  # split: the rate its host share was priced at
    notes: tuple[str, ...] = ()  # what the numbers above do not show (the prefill's peak, a capped latency)

    @property
    def tokens_per_s(self) -> float:
        """Decoded tokens per second over the batch: ``batch / step time``."""
        return self.request.batch / self.forecast.step_s if self.forecast.step_s > 0 else math.inf

    @property
    def bottleneck(self) -> Bottleneck:
        return self.forecast.bottleneck

    @property
    def bytes_read_per_step(self) -> int:
        """KV bytes read per decode step from every tier (the device's own gather included)."""
        return self.bytes_moved_per_step[LinkName.DEVICE_TO_DEVICE] + self.bytes_moved_per_step[LinkName.HOST_TO_DEVICE]

    @property
    def compute_source(self) -> str:
        """Where the compute time comes from: the user's measurement, or the roofline of a device preset."""
        return "given" if self.request.compute_s_per_step is not None else f"roofline, {self.request.device.name}"

    def busy_rows(self) -> list[tuple[str, float]]:
        """Each resource's busy time in one step, named as it runs on this host, the device first.

        On a CPU-only host (``serial_mover``) one mover thread does the device gather *and* the host->device
        copies, so its copy time is not zero when no KV is on the host, while the disk engine's threads read
        ahead beside it (``DISK_READ_AHEAD``); on CUDA the gather runs on the device beside the compute and each
        link has its own queue.
        """
        fc = self.forecast
        if self.request.executor == "split":
            if fc.attention_on_compute:
                return [("compute thread: layers", fc.compute_s), ("compute thread: attention in place",
                        fc.host_attention_s), ("disk reads (engine threads)", fc.disk_s)]
            return [("device busy, its KV in place", fc.compute_s),
                    ("host CPUs attend host + disk KV", fc.host_attention_s),
                    ("query down, (out, lse) up", fc.host_to_device_s), ("disk->host link busy", fc.disk_s)]
        if self.request.links.serial_mover:  # plans read the disk ahead, on the engine's threads, not the mover's
            return [("compute thread busy", fc.compute_s), ("mover: gather + host->device", fc.host_to_device_s),
                    ("disk reads (engine threads)", fc.disk_s)]
        return [("device busy", fc.compute_s), ("host->device link busy", fc.host_to_device_s),
                ("disk->host link busy", fc.disk_s)]

    @property
    def bound_label(self) -> str:
        """The resource that bounds the step, in :meth:`busy_rows`' words."""
        fc = self.forecast
        if fc.bottleneck in (Bottleneck.COMPUTE, Bottleneck.HOST_ATTENTION):
            return fc.bottleneck.value
        if self.request.links.serial_mover:
            return "disk reads" if fc.bottleneck is Bottleneck.DISK else "mover"
        return LinkName.HOST_TO_DEVICE if fc.bottleneck is Bottleneck.HOST_TO_DEVICE else LinkName.DISK_TO_HOST

    def to_dict(self) -> dict:
        """JSON-ready summary (the ``tierkv plan --json`` file)."""
        req, fc = self.request, self.forecast
        return {
            "model": req.model.name,
            "context": req.context,
            "batch": req.batch,
            "budgets": {"gpu_bytes": req.gpu_bytes, "cpu_bytes": req.cpu_bytes, "disk_bytes": req.disk_bytes},
            "links": {key: dataclasses.asdict(link) for key, link in req.links.links.items()},
            "device": dataclasses.asdict(req.device),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_total": self.kv_bytes_total,
            "staging_bytes": self.staging_bytes,
            "prefetch_depth": fc.prefetch_depth,
            "bytes_per_tier": dataclasses.asdict(self.bytes_per_tier),
            "bytes_moved_per_step": self.bytes_moved_per_step,
            "bytes_moved_per_token": {k: v / req.batch for k, v in self.bytes_moved_per_step.items()},
            "compute_s_per_step": self.compute_s_per_step,
            "compute_source": self.compute_source,
            "serial_mover": req.links.serial_mover,
            "lower_bound_s": fc.lower_bound_s,
            "not_overlapped_s": max(0.0, fc.step_s - fc.lower_bound_s),
            "predicted_step_s": fc.step_s,
            "tokens_per_s": self.tokens_per_s,
            "bottleneck": fc.bottleneck.value,
            "busy_s": {"compute": fc.compute_s, LinkName.HOST_TO_DEVICE: fc.host_to_device_s, "disk": fc.disk_s},
            "fill_s": fc.fill_s,
            "overlap_efficiency": fc.overlap_efficiency,
            **({"host_attention": {"bytes_per_s": self.host_attention.bytes_per_s, "source": self.host_attention.source,
                                   "busy_s": fc.host_attention_s}} if self.host_attention is not None else {}),
        }


def _gb_words(nbytes: int) -> str:
    """At least ``nbytes`` as a ``--*-gb`` value in words: ``'64 GB'``, ``'15.73MB'``."""
    option = format_size_option(nbytes)
    return f"{option} GB" if option[-1].isdigit() else option


def _layer_kv_bytes(model: ModelSpec, context: int, batch: int) -> list[int]:
    return [
        batch * model.tokens_held(i, context) * model.kv_bytes_per_token_per_layer
        for i in range(model.layers)
    ]


def compute_s_per_layer(model: ModelSpec, context: int, batch: int, device: DeviceSpec) -> list[float]:
    """Roofline compute time of each layer for one decode step.

    A layer reads its weights once (shared by the batch) and all of its K/V, and does ``2 * params`` FLOPs
    per sequence for the projections and MLP plus ``4 * heads * head_dim * tokens`` for QK^T and PV.
    Weights are assumed to be in the KV dtype.
    """
    weight_bytes = model.params_per_layer * model.dtype_bytes
    times = []
    for layer, kv in enumerate(_layer_kv_bytes(model, context, batch)):
        tokens = model.tokens_held(layer, context)
        flops = batch * (2 * model.params_per_layer + 4 * model.attention_heads * model.head_dim * tokens)
        times.append(device.time(weight_bytes + kv, flops))
    return times


def _lm_head_s(model: ModelSpec, batch: int, device: DeviceSpec) -> float:
    """The LM head (the only large matrix outside the layers; the embedding lookup reads ``batch`` rows)."""
    return device.time(
        model.vocab_size * model.hidden_size * model.dtype_bytes,
        2 * batch * model.vocab_size * model.hidden_size,
    )


def _slot_bytes(req: PlanRequest) -> int:
    """Bytes of one block's slot: its K/V rounded up to :data:`~tierkv.staging.SLOT_ALIGN` (``BlockLayout``)."""
    return -(-req.model.kv_bytes_per_token_per_layer * req.block_tokens // SLOT_ALIGN) * SLOT_ALIGN


def _staging_bytes(req: PlanRequest, depth: int) -> int:
    """Device bytes ``req``'s executor holds besides blocks (gather: ``depth`` layers read ahead), sized by the
    runtime's own :mod:`tierkv.staging` arithmetic."""
    model, token_bytes = req.model, req.model.kv_bytes_per_token_per_layer
    if req.executor == "streaming":
        return streaming_staging_bytes(req.batch, req.chunk_tokens, token_bytes, req.block_tokens)
    if req.executor == "sparse":
        return sparse_staging_bytes(req)
    if req.executor == "split":  # prefill chunks and a bounded scratch, at any context
        return split_staging_bytes(req.batch, req.chunk_tokens, token_bytes, req.block_tokens,
                                   model.attention_heads, model.kv_heads, model.head_dim, _accelerated(req))
    return gather_staging_bytes(req.batch, req.context, token_bytes, req.block_tokens, depth)


def min_device_bytes(req: PlanRequest, depth: int = 1) -> int:
    """The smallest device budget the runtime takes for ``req``'s executor (gather: reading ``depth`` layers
    ahead): its staging beside every layer's open tail block, in the 15/16 of the budget the slabs leave, and on a
    GPU host the two landing buffers (:func:`tierkv.staging.device_minimum`, :func:`~tierkv.staging
    .landed_device_minimum`). The same number as ``TieredCache.min_device_bytes`` / ``min_streaming_device_bytes``
    / ``min_sparse_device_bytes`` / ``min_split_device_bytes`` for the model's config."""
    if req.executor == "split":
        return split_min_device_bytes(req)
    slot = _slot_bytes(req)
    staging = _staging_bytes(req, depth)
    tails = open_tail_bytes(req.model.layers, req.batch, slot)
    return landed_device_minimum(staging, tails, slot) if _accelerated(req) else device_minimum(staging, tails)


def _too_small(req: PlanRequest, depth: int) -> BudgetTooSmallError:
    """Why the device budget is below the minimum of ``req``'s executor, with the budgets that run it; for gather,
    the runtime's floor (no layer read ahead: it turns prefetch off below ``depth``'s minimum) and ``depth``'s."""
    minimum = min_device_bytes(req, 0 if req.executor == "gather" else depth)
    what = {"streaming": "streaming chunk buffers",
            "sparse": "streaming chunk buffers, the sparse selection's buffer and the key summaries"
                      + (" with their rest copy" if req.sparse_rest_bits else ""),
            "split": "open tail blocks, the prefill's two streaming chunks"
                     + ("" if req.links.serial_mover else " and the decode step's bounded scratch")}.get(
        req.executor, "exact-gather staging of one layer's full K/V")
    if req.executor != "split":
        what += " beside every layer's open block"
    streaming = min_device_bytes(dataclasses.replace(req, executor="streaming")) if req.executor == "gather" \
        else minimum
    ahead = (f" to decode with prefetch off (slower), {format_size_option(min_device_bytes(req, depth))} to read "
             f"{plural(depth, 'layer')} ahead" if req.executor == "gather" and depth else "")
    return BudgetTooSmallError(
        f"the device budget {format_gb(req.gpu_bytes)} cannot hold the {what} ({format_gb(minimum)} at "
        f"context {req.context:,}, batch {req.batch}); raise --gpu-gb to at least {format_size_option(minimum)}"
        f"{ahead}, "
        + ("lower --batch (split's minimum does not grow with the context)" if req.executor == "split"
           else "lower --context or --batch")
        + (f", or --sparse-rest-bits 0 (no rest copy: the pages not read are not attended; --gpu-gb "
           f"{format_size_option(min_device_bytes(dataclasses.replace(req, sparse_rest_bits=0)))} is enough)"
           if req.executor == "sparse" and req.sparse_rest_bits else "")
        + (f", or use --executor streaming (two chunks instead of whole layers: --gpu-gb "
           f"{format_size_option(streaming)} is enough)" if streaming < minimum else "") + "."
    )


def _plan_at_depth(req: PlanRequest, depth: int) -> Plan:
    model = req.model
    notes = req.notes
    layer_kv = _layer_kv_bytes(model, req.context, req.batch)
    total = sum(layer_kv)
    if min_device_bytes(req, depth) > req.gpu_bytes:
        raise _too_small(req, depth)
    staging = _staging_bytes(req, depth)
    room = req.gpu_bytes - staging
    device = min(total, room)
    host = min(total - device, req.cpu_bytes)
    disk = total - device - host
    prefill = model.prefill_kv_bytes(req.context, req.batch)
    prefill_room = req.gpu_bytes - staging if req.executor != "gather" else req.gpu_bytes - (depth + 1) * req.batch \
        * gather_capacity(req.context, req.block_tokens) * model.kv_bytes_per_token_per_layer  # staging sans growth
    if prefill > total:
        at_prefill = [min(prefill, prefill_room), min(max(0, prefill - prefill_room), req.cpu_bytes)]
        at_prefill.append(prefill - sum(at_prefill))
        notes = (*notes, f"sliding layers hold the whole prompt until the first decode step: the tiers need "
                         f"{format_bytes(prefill)} at the prefill (device / host / disk "
                         f"{' / '.join(format_bytes(n) for n in at_prefill)}), {format_bytes(total)} while decoding")
    at_peak = prefill - prefill_room > total - room  # the prefill is what does not fit
    kv, space = (prefill, prefill_room) if at_peak else (total, room)
    short = kv - space - req.cpu_bytes - (req.disk_bytes or 0)
    if req.disk_bytes is not None and short > 0:
        held = (f"{format_gb(prefill)} of KV at the prefill (sliding layers hold the whole prompt until the first "
                f"decode step; {format_gb(total)} while decoding)" if at_peak else f"{format_gb(total)} of KV")
        raise CapacityError(
            f"{model.name} at context {req.context:,} x batch {req.batch} needs {held} "
            f"but the budgets hold {format_gb(space + req.cpu_bytes + req.disk_bytes)} "
            f"(device {format_gb(space)} after {format_gb(req.gpu_bytes - space)} staging, "
            f"host {format_gb(req.cpu_bytes)}, disk {format_gb(req.disk_bytes)}); "
            f"raise --disk-gb or --cpu-gb by {_gb_words(short)}, or lower --context or --batch."
        )
    if req.compute_s_per_step is None:
        per_layer = compute_s_per_layer(model, req.context, req.batch, req.device)
        other = _lm_head_s(model, req.batch, req.device)
    else:
        per_layer = [req.compute_s_per_step / model.layers] * model.layers
        other = 0.0
    shares = (device / total, host / total, disk / total)
    if req.executor == "streaming":
        layers = _streaming_stages(req, per_layer, layer_kv, shares)
    elif req.executor == "sparse":
        layers = _sparse_layers(req, per_layer, layer_kv, shares)
    elif req.executor == "split":
        layers = _split_layers(req, per_layer, layer_kv, shares)
    else:
        layers = tuple(_load(c, kv, shares) for c, kv in zip(per_layer, layer_kv, strict=True))
    new_kv = req.batch * model.kv_bytes_per_token
    rate = None
    moved: dict[str, int]
    if req.executor == "split":
        rate = host_attention_rate(req.links, req.host_cores, req.host_dram_bytes_per_s)
        query, partial = split_merge_bytes(model, req.batch)
        forecast = predict_split_step(Placement(layers, other), req.links, rate.bytes_per_s, query_bytes=query,
                                      partial_bytes=partial, on_compute_thread=req.links.serial_mover)
        cpu_layers = sum(1 for layer in layers if layer.host_bytes + layer.disk_bytes)
        moved = {  # nothing staged: only queries down and the CPU part's (out, lse) up cross the link
            LinkName.DEVICE_TO_DEVICE: 0,
            LinkName.HOST_TO_DEVICE: 0 if req.links.serial_mover else partial * cpu_layers,
            LinkName.DISK_TO_HOST: sum(layer.disk_bytes for layer in layers),
            LinkName.DEVICE_TO_HOST: (0 if req.links.serial_mover else query * cpu_layers)
                                     + (new_kv if host + disk > 0 else 0),
            LinkName.HOST_TO_DISK: new_kv if disk > 0 else 0,
        }
    else:
        forecast = predict_step(Placement(layers, other), req.links, depth, read_ahead=DISK_READ_AHEAD)
        moved = {
            LinkName.DEVICE_TO_DEVICE: sum(layer.device_bytes * layer.repeat for layer in layers),  # device KV's gather
            LinkName.HOST_TO_DEVICE: sum((layer.host_bytes + layer.disk_bytes) * layer.repeat for layer in layers),
            LinkName.DISK_TO_HOST: sum(layer.disk_bytes * layer.repeat for layer in layers),
            LinkName.DEVICE_TO_HOST: new_kv if host + disk > 0 else 0,
            LinkName.HOST_TO_DISK: new_kv if disk > 0 else 0,
        }
    return Plan(
        request=req,
        kv_bytes_per_token=model.kv_bytes_per_token,
        kv_bytes_total=total,
        staging_bytes=staging,
        bytes_per_tier=TierBytes(device, host, disk),
        bytes_moved_per_step=moved,
        compute_s_per_step=sum(layer.compute_s * layer.repeat for layer in layers) + other,
        forecast=forecast,
        host_attention=rate,
        notes=notes,
    )


def _load(compute_s: float, kv: float, shares: tuple[float, float, float]) -> LayerLoad:
    """``kv`` bytes split over device / host / disk by ``shares``."""
    device, host, disk = (round(kv * share) for share in shares)
    return LayerLoad(compute_s, device_bytes=device, host_bytes=host, disk_bytes=disk)


def _streaming_stages(req: PlanRequest, per_layer: list[float], layer_kv: list[int],
                      shares: tuple[float, float, float]) -> tuple[LayerLoad, ...]:
    """Exact streaming as the pipeline it runs: every chunk of every layer is one stage, and one chunk is in
    flight while the previous one is attended, across layer boundaries (prefetch depth 1 over stages).

    A chunk's compute is its share of the layer's attention; the rest of the layer (projections, MLP) runs
    after its last chunk, before the next layer's first chunk is needed. Without a roofline split (a
    measured ``compute_s_per_step``) the layer's compute is spread evenly over its chunks. A layer's chunks but
    its last are equal: one load repeated, so the stages cost the same at any context and chunk size.
    """
    model, stages = req.model, []
    weights = model.params_per_layer * model.dtype_bytes
    for layer, (compute, kv) in enumerate(zip(per_layer, layer_kv, strict=True)):
        tokens = model.tokens_held(layer, req.context)
        chunks = max(1, math.ceil(tokens / req.chunk_tokens))
        if req.compute_s_per_step is None:
            attention = req.device.time(kv, 4 * req.batch * model.attention_heads * model.head_dim * tokens)
            rest = req.device.time(weights, 2 * req.batch * model.params_per_layer)
            scale = compute / (attention + rest)
            attention, rest = attention * scale, rest * scale
        else:
            attention, rest = compute, 0.0
        chunk = _load(attention / chunks, kv / chunks, shares)
        if chunks > 1:  # one run of equal stages: bounded work at any context (LayerLoad.repeat)
            stages.append(dataclasses.replace(chunk, repeat=chunks - 1))
        stages.append(dataclasses.replace(chunk, compute_s=chunk.compute_s + rest))
    return tuple(stages)


def split_merge_bytes(model: ModelSpec, batch: int) -> tuple[int, int]:
    """Bytes of one layer-step's merge traffic for one-token decoding: the query (``batch x heads x D`` in the
    model's dtype) going down to the host, and the CPU part's (host and disk shares merged there) result coming
    up: the fp32 output and log-sum-exp, ``batch x heads x (D + 1)`` floats."""
    query = batch * model.attention_heads * model.head_dim * model.dtype_bytes
    return query, batch * model.attention_heads * (model.head_dim + 1) * 4


def _accelerated(req: PlanRequest) -> bool:
    """Whether the request's device is an accelerator (a GPU host), not the CPU of a CPU-only host."""
    return not req.links.serial_mover


def split_min_device_bytes(req: PlanRequest) -> int:
    """The smallest device budget (bytes) the split executor needs for ``req``'s model, batch, blocks and chunks,
    at any context: the runtime's own :func:`tierkv.staging.split_device_minimum` (``TieredCache
    .min_split_device_bytes`` computes the same from a model config)."""
    model = req.model
    return split_device_minimum(model.layers, req.batch, model.attention_heads, model.kv_heads, model.head_dim,
                                model.dtype_bytes, req.block_tokens, req.chunk_tokens, _accelerated(req))


def _split_layers(req: PlanRequest, per_layer: list[float], layer_kv: list[int],
                  shares: tuple[float, float, float]) -> tuple[LayerLoad, ...]:
    """A split decode step's loads: each layer's KV spread over the tiers as placed, attended where it lives.

    Compute is the device's part only: the layer's roofline with attention over its device-resident tokens (read
    in place; a GPU host), or without attention on a CPU-only host (``links.serial_mover``), whose every share the
    host kernel attends at the host attention rate (:func:`~tierkv.bandwidth.predict_split_step`). A measured
    ``compute_s_per_step`` (of exact decoding: attention over every token included) keeps the fraction of it the
    roofline gives the same device part, so the attention the host attends is not also counted in it.
    """
    model, loads = req.model, []
    weights = model.params_per_layer * model.dtype_bytes
    on_device = 0.0 if req.links.serial_mover else shares[0]  # the share the device attends itself
    for layer, (compute, kv) in enumerate(zip(per_layer, layer_kv, strict=True)):
        load = _load(compute, kv, shares)
        tokens = model.tokens_held(layer, req.context)
        attention = 4 * req.batch * model.attention_heads * model.head_dim * tokens
        part = req.device.time(weights + kv * on_device, 2 * req.batch * model.params_per_layer + attention * on_device)
        if req.compute_s_per_step is not None:  # measured: the roofline's share of it that is the device part
            exact = req.device.time(weights + kv, 2 * req.batch * model.params_per_layer + attention)
            part = compute * part / exact if exact > 0 else compute
        loads.append(dataclasses.replace(load, compute_s=part))
    return tuple(loads)


SUMMARY_VECTORS = 4  # per page and KV head: the keys' per-channel min, max, mean and the values' mean (summaries)


def summary_bytes(blocks: int, token_bytes: int, element_size: int = 2) -> int:
    """Bytes of ``blocks`` key summaries, ``SUMMARY_VECTORS · H_kv · D`` values each, from one token's K+V bytes
    (``2 · H_kv · D`` values of ``element_size`` bytes): held in the summaries' own element size
    (:func:`tierkv.staging.summary_element_size`: fp32 K/V's are bf16)."""
    return blocks * token_bytes * SUMMARY_VECTORS // 2 * summary_element_size(element_size) // element_size


def kv_summary_bytes(kv_bytes: int, block_tokens: int, element_size: int = 2) -> int:
    """Bytes of the summaries of ``kv_bytes`` of K/V (``element_size``-byte elements) in pages of ``block_tokens``:
    2/``block_tokens`` of it, halved for fp32 K/V (bf16 summaries)."""
    return summary_bytes(kv_bytes // block_tokens, 1, element_size)


def sparse_page_tokens(req: PlanRequest) -> int:
    """Tokens per page a sparse step selects: ``req.sparse_page_tokens``, else the library's default page."""
    return req.sparse_page_tokens or default_page_tokens(req.block_tokens)


def sparse_table_bytes(req: PlanRequest) -> int:
    """Device bytes of the key summaries and rest copy ``cache.sparse`` holds at ``req.context``: a table per layer
    with a row per full block it holds (a sliding layer: its window and the block it fills), reserved as
    :func:`~tierkv.staging.summary_table_rows` says; a row is a page's :data:`SUMMARY_VECTORS` per KV head
    and the block's rest copy. ``TieredCache.min_sparse_device_bytes`` counts the same
    (:func:`tierkv.hf.sizing.sparse_table_bytes`)."""
    model, block = req.model, req.block_tokens
    pages = block // sparse_page_tokens(req)
    row = model.kv_heads * model.head_dim * summary_element_size(model.dtype_bytes) * SUMMARY_VECTORS * pages \
        + rest_copy_bytes(block * model.kv_bytes_per_token_per_layer, req.sparse_rest_bits, model.dtype_bytes,
                          model.head_dim)
    held = [min(req.context, model.sliding_window + block)
            if layer < model.sliding_layers and model.sliding_window is not None else req.context
            for layer in range(model.layers)]
    return sum(summary_table_rows(req.batch, tokens, block) * row for tokens in held)


def _rest_bytes(req: PlanRequest, blocks: int) -> int:
    """Device bytes of the rest copy of ``blocks`` full blocks per row (0 without ``sparse_rest_bits``)."""
    model = req.model
    kv = req.batch * blocks * req.block_tokens * model.kv_bytes_per_token_per_layer
    return rest_copy_bytes(kv, req.sparse_rest_bits, model.dtype_bytes, model.head_dim)


def sparse_fetched_tokens(req: PlanRequest, layer: int) -> int:
    """Tokens a sparse decode step reads of ``layer`` per row: the budget in whole pages (rounded down, as the
    executor's cap; at least one page), at most the layer."""
    held = req.model.tokens_held(layer, req.context)
    if req.sparse_tokens >= held:
        return held
    page = sparse_page_tokens(req)
    return min(held, max(1, req.sparse_tokens // page) * page)


def sparse_staging_bytes(req: PlanRequest) -> int:
    """Device bytes sparse mode holds besides blocks, as ``TieredCache.min_sparse_device_bytes`` counts them: the
    exact prefill's two streaming chunks, one layer's selection (the budget and a block, with growth headroom), a
    column of blocks read to summarise, and the key summaries and rest copy (:func:`sparse_table_bytes`)."""
    token_bytes = req.model.kv_bytes_per_token_per_layer
    chunks = streaming_staging_bytes(req.batch, req.chunk_tokens, token_bytes, req.block_tokens)
    budget = sparse_budget_tokens(req.sparse_tokens, req.context)
    selection = math.ceil(req.batch * (budget + req.block_tokens) * token_bytes * GROWTH)
    backfill = req.batch * _slot_bytes(req)
    return chunks + selection + backfill + sparse_table_bytes(req)


def _sparse_layers(req: PlanRequest, per_layer: list[float], layer_kv: list[int],
                   shares: tuple[float, float, float]) -> tuple[LayerLoad, ...]:
    """A sparse decode step as it runs: each layer scores its pages' summaries (on the device), then reads the
    selected pages — a ``fetched / held`` fraction of its KV, spread over the tiers as the KV is (a uniform
    placement: with ``policy="attention"`` hot blocks gather on the device, and kept pages are not read again, so
    off-device reads can only be fewer) — and only then attends. The read waits for the layer's query, so nothing
    is prefetched (depth 0). Pages are read with one batched request per tier (:mod:`tierkv.store.pages`), the
    disk's in whole 4 KiB sectors: a page's K or V run of one KV head (``page · D`` elements) is rounded up to
    them, so runs smaller than a sector read more than they hold. Whole blocks (the page is the block) cross the
    links as one transfer each.

    Compute: the roofline of the layer with attention over the fetched tokens only, plus the scoring pass (it
    reads every summary and does ``6 · heads · D`` FLOPs per page and row) and, with a rest copy, attention
    over every block from it (its bytes read, ``4 · heads · D`` FLOPs per token); a measured
    ``compute_s_per_step`` (of exact decoding) is kept and these added.
    """
    model, loads = req.model, []
    weights = model.params_per_layer * model.dtype_bytes
    for layer, (compute, kv) in enumerate(zip(per_layer, layer_kv, strict=True)):
        held = model.tokens_held(layer, req.context)
        fetched = sparse_fetched_tokens(req, layer)
        blocks = held // req.block_tokens
        page = sparse_page_tokens(req)
        pages = blocks * (req.block_tokens // page)
        summaries = summary_bytes(req.batch * pages, model.kv_bytes_per_token_per_layer, model.dtype_bytes)
        scoring = req.device.time(summaries, 6 * req.batch * model.attention_heads * model.head_dim * pages)
        if req.sparse_rest_bits:
            rest_tokens = req.batch * blocks * req.block_tokens
            flops = 4 * rest_tokens * model.attention_heads * model.head_dim
            scoring += req.device.time(_rest_bytes(req, blocks), flops)
        if req.compute_s_per_step is None:
            fetched_kv = req.batch * fetched * model.kv_bytes_per_token_per_layer
            flops = req.batch * (2 * model.params_per_layer + 4 * model.attention_heads * model.head_dim * fetched)
            compute = req.device.time(weights + fetched_kv, flops)
        load = _load(compute + scoring, kv * fetched / held if held else 0, shares)
        if page < req.block_tokens:  # one batched read per tier; the disk's rounded up to sectors
            run = page * model.head_dim * model.dtype_bytes
            sectors = -(-run // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN  # the disk tier's sector (tierkv.tiers.disk)
            loads.append(dataclasses.replace(load, disk_bytes=load.disk_bytes * sectors // run))
            continue
        selected = req.batch * math.ceil(fetched / page)
        loads.append(dataclasses.replace(load, host_transfers=max(1, round(selected * shares[1])),
                                         disk_transfers=max(1, round(selected * shares[2]))))
    return tuple(loads)


def plan(req: PlanRequest, *, tolerance: float = 0.01) -> Plan:
    """Place the KV and forecast the step for ``req``.

    Gather reads as many layers ahead as the runtime would: ``req.prefetch_depth``, or with none given, the
    shallowest depth from 1 (the runtime's default) within ``tolerance`` of the fastest of those whose staging
    fits (each level of depth adds a layer of staging, which pushes KV off the device). A depth fits where the
    budget holds the runtime's minimum (:func:`min_device_bytes`); below it, down to depth 0's, the runtime turns
    prefetch off, and so does the plan (its staging row says why).
    Raises :class:`BudgetTooSmallError` when the device budget is below the executor's minimum (gather: at depth
    0), :class:`CapacityError` when the KV does not fit all tiers together.
    """
    if req.executor == "streaming":  # two chunk buffers: one chunk ahead, across layers (_streaming_stages)
        return _plan_at_depth(req, 1)
    if req.executor in ("sparse", "split"):  # both need the layer's query first: nothing is prefetched
        return _plan_at_depth(req, 0)
    wanted = 1 if req.prefetch_depth is None else req.prefetch_depth
    if min_device_bytes(req, wanted) > req.gpu_bytes:
        if not wanted or min_device_bytes(req, 0) > req.gpu_bytes:
            raise _too_small(req, wanted)
        return _plan_at_depth(req, 0)  # the runtime turns prefetch off once its staging outgrows the budget
    if req.prefetch_depth is not None:
        return _plan_at_depth(req, req.prefetch_depth)
    plans = [_plan_at_depth(req, 1)]  # the runtime's default depth wherever it fits
    for depth in range(2, max_prefetch_depth(req.model) + 1):
        if min_device_bytes(req, depth) > req.gpu_bytes:  # a deeper depth's staging does not fit: stop there
            break
        try:
            plans.append(_plan_at_depth(req, depth))
        except CapacityError:  # its staging leaves the tiers too little room
            break
    best = min(p.forecast.step_s for p in plans)
    return next(p for p in plans if p.forecast.step_s <= best * (1.0 + tolerance))


@dataclass(frozen=True, slots=True)
class WhatIf:
    """One alternative and its forecast, for the "what would buy speed" table; ``note`` says why it is not
    faster when it is not (empty otherwise)."""

    label: str
    plan: Plan
    note: str = ""


def _why_slower(base: Plan, alt: Plan) -> str:
    """Why ``alt`` (more of something) is predicted slower than ``base``, or "" when it is not.

    More device memory puts more KV on the device, where it is *gathered* rather than copied: on CUDA that
    gather runs on the device, in series with compute, while the host->device copies it replaces overlapped
    compute; on a CPU-only host the gather is a copy by the same mover thread at the device->device rate. The
    split executor gathers nothing: the device attends its share inside its compute, which the host's CPUs did
    beside it.
    The auto prefetch depth can also change (it keeps the shallowest depth within 1% of the fastest).
    """
    if alt.forecast.step_s <= base.forecast.step_s * (1 + 1e-9):
        return ""
    reasons = []
    more_on_device = alt.bytes_per_tier.device - base.bytes_per_tier.device
    if more_on_device > 0:
        links = alt.request.links
        if alt.request.executor == "split":
            if not links.serial_mover:  # (on a CPU host both shares are attended on the compute thread)
                reasons.append(f"{format_bytes(more_on_device)} more KV is attended on the device, in series with "
                               "its compute, instead of by the host's CPUs beside it")
        elif links.serial_mover:
            gather, copy = links.link(LinkName.DEVICE_TO_DEVICE), links.link(LinkName.HOST_TO_DEVICE)
            reasons.append(
                f"{format_bytes(more_on_device)} more KV is gathered on the device by the mover at "
                f"{gather.bandwidth_bytes_per_s / 1e9:.2f} GB/s instead of copied at "
                f"{copy.bandwidth_bytes_per_s / 1e9:.2f} GB/s"
            )
        else:
            reasons.append(
                f"{format_bytes(more_on_device)} more KV is gathered on the device, in series with compute, instead "
                "of copied host->device in the background"
            )
    if alt.forecast.prefetch_depth != base.forecast.prefetch_depth:
        reasons.append(f"auto prefetch depth {base.forecast.prefetch_depth} -> {alt.forecast.prefetch_depth}")
    return "slower: " + ("; ".join(reasons) if reasons else "less of the transfer time is hidden behind compute")


def what_ifs(base: Plan, *, extra_gpu_bytes: int = 16 * 10**9) -> list[WhatIf]:
    """Re-plan with more device memory, the faster PCIe link, the faster NVMe, and both links.

    Each is the plan the runtime would follow with that change, so it can be slower; its ``note`` then says
    why (see :func:`_why_slower`). Links already at the faster preset are not offered again. Presets replace
    measured links, so the answer to "what would PCIe 5.0 buy on this machine" keeps the rest of the measured
    profile.
    """
    if extra_gpu_bytes < 1:
        raise InvalidConfigError(f"extra_gpu_bytes={extra_gpu_bytes} must be >= 1 (0 re-plans the plan itself).")
    req = base.request
    links = req.links.links
    options = [
        (
            f"+{extra_gpu_bytes // 2**30} GiB device" if extra_gpu_bytes % 2**30 == 0 else
            f"+{extra_gpu_bytes / 1e9:g} GB device",
            dataclasses.replace(req, gpu_bytes=req.gpu_bytes + extra_gpu_bytes),
        )
    ]
    pcie5 = {LinkName.HOST_TO_DEVICE: PRESETS["pcie5"], LinkName.DEVICE_TO_HOST: PRESETS["pcie5"]}
    gen5 = {LinkName.DISK_TO_HOST: PRESETS["nvme-gen5"], LinkName.HOST_TO_DISK: PRESETS["nvme-gen5-write"]}
    # A serial-mover profile is a CPU-only host: it has no PCIe link to upgrade.
    faster_link = not req.links.serial_mover and links.get(LinkName.HOST_TO_DEVICE) != PRESETS["pcie5"]
    faster_disk = base.bytes_per_tier.disk > 0 and links.get(LinkName.DISK_TO_HOST) != PRESETS["nvme-gen5"]
    if faster_link:
        options.append(("PCIe 5.0 x16", dataclasses.replace(req, links=req.links.replace(**pcie5))))
    if faster_disk:
        options.append(("NVMe Gen5", dataclasses.replace(req, links=req.links.replace(**gen5))))
    if faster_link and faster_disk:
        options.append(
            ("PCIe 5.0 + NVMe Gen5", dataclasses.replace(req, links=req.links.replace(**pcie5, **gen5)))
        )
    alternatives = [(label, plan(option)) for label, option in options]
    return [WhatIf(label, alt, _why_slower(base, alt)) for label, alt in alternatives]


def sparse_what_if(base: Plan) -> WhatIf | None:
    """The other side of the exact/sparse choice, re-planned: sparse attention at ``sparse_tokens`` for an exact
    plan; for a sparse plan the exact executor that fits (gather, else streaming). None when the budget covers
    the context (sparse would read everything) or nothing else fits."""
    req = base.request
    if req.executor != "sparse":
        if req.sparse_tokens >= req.context:
            return None
        options = [dataclasses.replace(req, executor="sparse")]
    else:
        options = [dataclasses.replace(req, executor=name) for name in ("gather", "streaming")]
    for option in options:
        try:
            alt = plan(option)
        except (BudgetTooSmallError, CapacityError):
            continue
        if option.executor == "sparse":
            share = alt.bytes_read_per_step / max(base.kv_bytes_total, 1)  # split moves fewer than it attends
            label = f"sparse, {req.sparse_tokens:,} tokens"
            note = (f"approximate attention: reads {share:.1%} of the KV bytes exact decoding attends per step "
                    "(the top pages by key summaries, plus sinks and the recent window; quality in docs/quality.md)")
        else:
            label, note = f"exact ({option.executor})", "exact attention over every token"
        return WhatIf(label, alt, note)
    return None


def sparse_advice(base: Plan, alt: WhatIf | None) -> str:
    """One sentence on whether sparse attention is the better choice for this request (empty: no alternative)."""
    if alt is None:
        return ""
    speedup = base.forecast.step_s / alt.plan.forecast.step_s if alt.plan.forecast.step_s > 0 else math.inf
    if base.request.executor == "sparse":
        return (f"sparse is predicted {1 / speedup:.1f}x faster than {alt.label} here" if speedup < 1 else
                f"sparse is not faster than {alt.label} here ({speedup:.2f}x): prefer exact attention")
    if speedup > 1.05:
        return (f"sparse attention ({alt.label}) is predicted {speedup:.1f}x faster: the better choice if its "
                "quality at this budget is enough (approximate; see docs/quality.md)")
    return f"sparse attention ({alt.label}) is not predicted faster here ({speedup:.2f}x): stay exact"


@dataclass(frozen=True, slots=True)
class ExecutorOption:
    """One executor re-planned for the same request: its plan, or why it cannot run (``plan`` None)."""

    executor: str
    plan: Plan | None
    note: str = ""

    @property
    def exact(self) -> bool:
        return self.executor != "sparse"


def compare_executors(base: Plan) -> list[ExecutorOption]:
    """Every executor of :data:`PLANNED` planned for ``base``'s request (``base`` itself for its own), in that
    order; one that does not fit the budgets carries the planner's reason instead of a plan."""
    options = []
    for name in PLANNED:
        if name == base.request.executor:
            options.append(ExecutorOption(name, base, "approximate" if name == "sparse" else "exact"))
            continue
        try:
            alt = plan(dataclasses.replace(base.request, executor=name))
        except (BudgetTooSmallError, CapacityError) as exc:
            options.append(ExecutorOption(name, None, f"does not fit: {exc}"))
            continue
        options.append(ExecutorOption(name, alt, "approximate" if name == "sparse" else "exact"))
    return options


def fastest_advice(options: list[ExecutorOption]) -> str:
    """Which exact executor is predicted fastest on this machine, and by how much against gather."""
    exact = [o for o in options if o.exact and o.plan is not None]
    if not exact:
        return ""
    best = min(exact, key=lambda o: o.plan.forecast.step_s)  # type: ignore[union-attr]
    assert best.plan is not None
    gather = next((o.plan for o in exact if o.executor == "gather"), None)
    versus = (f", {gather.forecast.step_s / best.plan.forecast.step_s:.1f}x gather"
              if gather is not None and best.executor != "gather" else "")
    rate = (f"; host attention at {best.plan.host_attention.bytes_per_s / 1e9:.0f} GB/s "
            f"({best.plan.host_attention.source})" if best.plan.host_attention is not None else "")
    return (f"fastest exact executor for this machine: {best.executor} ({_rate_words(best.plan.tokens_per_s)} "
            f"tok/s{versus}){rate}")


def split_what_if(base: Plan, options: list[ExecutorOption]) -> WhatIf | None:
    """The split executor as a what-if row for a plan that is not split (None when it is, or split does not fit)."""
    if base.request.executor == "split":
        return None
    split = next((o.plan for o in options if o.executor == "split"), None)
    if split is None:
        return None
    assert split.host_attention is not None
    return WhatIf("split: attend in place", split,
                  f"host share attended on the CPUs at {split.host_attention.bytes_per_s / 1e9:.0f} GB/s "
                  f"({split.host_attention.source}); no layer staged")


def _rate_words(tokens_per_s: float) -> str:
    return f"{tokens_per_s:.3g}" if tokens_per_s < 1000 else f"{tokens_per_s:,.0f}"


def build_request(
    model: str | ModelSpec,
    context: int | str,
    *,
    gpu: float | str,
    cpu: float | str,
    disk: float | str | None = None,
    batch: int = 1,
    link: str | None = None,
    disk_link: str | None = None,
    profile: str | None = None,
    device: str | None = None,
    compute_ms_per_step: float | None = None,
    prefetch_depth: int | None = None,
    executor: str = "gather",
    chunk_tokens: int = 4096,
    sparse_tokens: int | str = 2048,
    sparse_rest_bits: int = DEFAULT_REST_BITS,
    sparse_page_tokens: int | None = None,
    host_cores: int | None = None,
    host_dram_gbps: float | None = None,
) -> PlanRequest:
    """A :class:`PlanRequest` from user-level values: names, size strings, ``"1M"`` contexts.

    Links: a measured ``profile`` JSON if given, else presets (``pcie4`` / ``nvme-gen4``); an explicit
    ``link`` or ``disk_link`` preset replaces that link in either. ``device`` None picks by the profile: the
    CPU for one measured on a CPU-only host, else ``h100-sxm`` (:func:`default_device`; ``tierkv plan``'s default).
    ``host_cores`` and ``host_dram_gbps`` set the host attention estimate of a GPU host's presets
    (:func:`host_attention_rate`).
    """
    if batch < 1:
        raise InvalidConfigError(f"batch={batch} must be >= 1.")
    measured = LinkProfile.load(profile) if profile else None
    if measured is not None and measured.serial_mover and link:
        raise InvalidConfigError(f"link={link!r}: the profile {profile} was measured on a CPU-only host, which has no "
                                 "PCIe link (its device tier is host memory); leave --link out, or measure with "
                                 "`tierkv bench` on the GPU host to plan with its links.")
    notes: list[str] = []
    if measured is not None:
        links, notes = capped_latencies(measured)
    elif device == CPU:  # the "device" tier is host memory: every copy is a memcpy by one mover thread
        if link:
            raise InvalidConfigError(f"link={link!r}: a CPU-only host has no PCIe link (its device tier is host "
                                     "memory); leave --link out with --device cpu.")
        disk_links = {LinkName.DISK_TO_HOST: PRESETS[disk_link],
                      LinkName.HOST_TO_DISK: PRESETS[f"{disk_link}-write"]} if disk_link else {}
        links = default_profile("cpu").replace(**disk_links)
    else:
        links = LinkProfile.from_presets(link or "pcie4", disk_link or "nvme-gen4")
    if profile and (link or disk_link):
        presets = LinkProfile.from_presets(link or "pcie4", disk_link or "nvme-gen4").links
        keys = ([LinkName.HOST_TO_DEVICE, LinkName.DEVICE_TO_HOST] if link else []) + (
            [LinkName.DISK_TO_HOST, LinkName.HOST_TO_DISK] if disk_link else []
        )
        links = links.replace(**{key: presets[key] for key in keys})
    return PlanRequest(
        model=model if isinstance(model, ModelSpec) else resolve_model(model),
        context=parse_tokens(context),
        batch=batch,
        gpu_bytes=parse_size(gpu, name="gpu budget"),
        cpu_bytes=parse_size(cpu, name="cpu budget"),
        disk_bytes=None if disk is None else parse_size(disk, name="disk budget"),
        links=links,
        device=resolve_device(device or default_device(measured), measured),
        compute_s_per_step=None if compute_ms_per_step is None else compute_ms_per_step / 1e3,
        prefetch_depth=prefetch_depth,
        executor=executor,
        chunk_tokens=chunk_tokens,
        sparse_tokens=parse_tokens(sparse_tokens),
        sparse_rest_bits=sparse_rest_bits,
        sparse_page_tokens=sparse_page_tokens,
        host_cores=host_cores,
        host_dram_bytes_per_s=None if host_dram_gbps is None else host_dram_gbps * 1e9,
        notes=tuple(notes),
    )
