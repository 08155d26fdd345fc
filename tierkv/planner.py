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
    predict_step,
)
from tierkv.errors import BudgetTooSmallError, CapacityError, InvalidConfigError
from tierkv.model_presets import ModelSpec, resolve_model
from tierkv.staging import REST_BITS, gather_staging_bytes, rest_copy_bytes, round_to_blocks, streaming_staging_bytes
from tierkv.units import format_bytes, parse_size, parse_tokens

__all__ = ["DEVICES", "DeviceSpec", "Plan", "PlanRequest", "TierBytes", "WhatIf", "build_request", "parse_tokens",
           "plan", "sparse_advice", "sparse_what_if", "what_ifs"]


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


EXECUTORS = ("gather", "streaming", "sparse")

DEVICES: dict[str, DeviceSpec] = {
    # Data-sheet peaks: HBM/GDDR bandwidth and dense BF16 tensor FLOPs (no sparsity).
    "h100-sxm": DeviceSpec("h100-sxm", 3.35e12, 989e12),
    "h200": DeviceSpec("h200", 4.8e12, 989e12),
    "a100-80gb": DeviceSpec("a100-80gb", 2.04e12, 312e12),
    "l40s": DeviceSpec("l40s", 0.864e12, 362e12),
    "rtx4090": DeviceSpec("rtx4090", 1.008e12, 165e12),
}


def resolve_device(name: str) -> DeviceSpec:
    if name not in DEVICES:
        raise InvalidConfigError(f"unknown device {name!r}; choose one of: {', '.join(DEVICES)}.")
    return DEVICES[name]


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
    # "sparse": decode steps read only the top blocks (sparse_tokens per row and layer), prefill streams
    chunk_tokens: int = 4096
    sparse_tokens: int = 2048  # attended tokens per row and layer in sparse mode (sinks and recent included)
    sparse_rest_bits: int = 0  # sparse: the blocks not read attended from a copy of this many bits on the device
    block_tokens: int = 256  # staging is whole blocks (TieredCache's default block)

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise InvalidConfigError(f"executor={self.executor!r}; choose one of {', '.join(EXECUTORS)}.")
        if self.chunk_tokens < 1:
            raise InvalidConfigError(f"chunk_tokens={self.chunk_tokens} must be >= 1.")
        if self.sparse_tokens < 1:
            raise InvalidConfigError(f"sparse_tokens={self.sparse_tokens} must be >= 1.")
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
        return self.bytes_moved_per_step["device->device"] + self.bytes_moved_per_step["host->device"]

    @property
    def compute_source(self) -> str:
        """Where the compute time comes from: the user's measurement, or the roofline of a device preset."""
        return "given" if self.request.compute_s_per_step is not None else f"roofline, {self.request.device.name}"

    def busy_rows(self) -> list[tuple[str, float]]:
        """Each resource's busy time in one step, named as it runs on this host, the device first.

        On a CPU-only host (``serial_mover``) one mover thread does the device gather *and* the host->device
        copies, so its copy time is not zero when no KV is on the host; on CUDA the gather runs on the device
        beside the compute and each link has its own queue.
        """
        fc = self.forecast
        if self.request.links.serial_mover:
            return [("compute thread busy", fc.compute_s), ("mover: gather + host->device", fc.host_to_device_s),
                    ("mover: disk->host", fc.disk_s)]
        return [("device busy", fc.compute_s), ("host->device link busy", fc.host_to_device_s),
                ("disk->host link busy", fc.disk_s)]

    @property
    def bound_label(self) -> str:
        """The resource that bounds the step, in :meth:`busy_rows`' words."""
        fc = self.forecast
        if fc.bottleneck is Bottleneck.COMPUTE:
            return "compute"
        if self.request.links.serial_mover:
            return "mover"
        return "host->device" if fc.bottleneck is Bottleneck.HOST_TO_DEVICE else "disk->host"

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
            "not_overlapped_s": fc.step_s - fc.lower_bound_s,
            "predicted_step_s": fc.step_s,
            "tokens_per_s": self.tokens_per_s,
            "bottleneck": fc.bottleneck.value,
            "busy_s": {"compute": fc.compute_s, "host->device": fc.host_to_device_s, "disk": fc.disk_s},
            "fill_s": fc.fill_s,
            "overlap_efficiency": fc.overlap_efficiency,
        }


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


def _plan_at_depth(req: PlanRequest, depth: int) -> Plan:
    model = req.model
    layer_kv = _layer_kv_bytes(model, req.context, req.batch)
    total = sum(layer_kv)
    token_bytes = model.kv_bytes_per_token_per_layer
    if req.executor == "streaming":  # the runtime's sizes (tierkv.staging): the planner and the cache agree
        staging = streaming_staging_bytes(req.batch, req.chunk_tokens, token_bytes, req.block_tokens)
    elif req.executor == "sparse":
        staging = sparse_staging_bytes(req)
    else:
        held = max(model.tokens_held(i, req.context) for i in range(model.layers))
        staging = gather_staging_bytes(req.batch, held, token_bytes, req.block_tokens, depth)
    if staging > req.gpu_bytes:
        what = {"streaming": "streaming chunk buffers",
                "sparse": "streaming chunk buffers, the sparse selection's buffer and the key summaries"
                          + (" with their rest copy" if req.sparse_rest_bits else "")}.get(
            req.executor, f"exact-gather staging of {depth + 1} layers' full K/V")
        raise BudgetTooSmallError(
            f"the device budget {req.gpu_bytes / 1e9:.1f} GB cannot hold the {what} ({staging / 1e9:.1f} GB at "
            f"context {req.context}, batch {req.batch}); raise --gpu-gb to at least {math.ceil(staging / 1e9)}, "
            "lower --context or --batch" + (", or --prefetch-depth" if depth > 0 and req.executor == "gather"
                                            else "")
            + (", or use --executor streaming (two chunks instead of whole layers)"
               if req.executor == "gather" else "") + "."
        )
    device = min(total, req.gpu_bytes - staging)
    host = min(total - device, req.cpu_bytes)
    disk = total - device - host
    if req.disk_bytes is not None and disk > req.disk_bytes:
        short = disk - req.disk_bytes
        raise CapacityError(
            f"{model.name} at context {req.context} x batch {req.batch} needs {total / 1e9:.1f} GB of KV "
            f"but the budgets hold {(device + req.cpu_bytes + req.disk_bytes) / 1e9:.1f} GB "
            f"(device {device / 1e9:.1f} after {staging / 1e9:.1f} GB staging, "
            f"host {req.cpu_bytes / 1e9:.1f}, disk {req.disk_bytes / 1e9:.1f}); "
            f"raise --disk-gb or --cpu-gb by {math.ceil(short / 1e9)} GB, or lower --context or --batch."
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
    else:
        layers = tuple(_load(c, kv, shares) for c, kv in zip(per_layer, layer_kv, strict=True))
    forecast = predict_step(Placement(layers, other), req.links, depth, read_ahead=DISK_READ_AHEAD)
    new_kv = req.batch * model.kv_bytes_per_token
    moved = {
        "device->device": sum(layer.device_bytes for layer in layers),  # the gather of device-resident KV
        "host->device": sum(layer.host_bytes + layer.disk_bytes for layer in layers),
        "disk->host": sum(layer.disk_bytes for layer in layers),
        "device->host": new_kv if host + disk > 0 else 0,
        "host->disk": new_kv if disk > 0 else 0,
    }
    return Plan(
        request=req,
        kv_bytes_per_token=model.kv_bytes_per_token,
        kv_bytes_total=total,
        staging_bytes=staging,
        bytes_per_tier=TierBytes(device, host, disk),
        bytes_moved_per_step=moved,
        compute_s_per_step=sum(layer.compute_s for layer in layers) + other,
        forecast=forecast,
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
    measured ``compute_s_per_step``) the layer's compute is spread evenly over its chunks.
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
        loads = [_load(attention / chunks, kv / chunks, shares) for _ in range(chunks)]
        loads[-1] = dataclasses.replace(loads[-1], compute_s=loads[-1].compute_s + rest)
        stages += loads
    return tuple(stages)


SUMMARY_VECTORS = 3  # per block and KV head: the keys' per-channel min, max and mean (tierkv.store.summaries)


def summary_bytes(blocks: int, token_bytes: int) -> int:
    """Bytes of ``blocks`` key summaries, ``SUMMARY_VECTORS · H_kv · D`` values each, from one token's K+V bytes
    (``2 · H_kv · D`` values)."""
    return blocks * token_bytes * SUMMARY_VECTORS // 2


def kv_summary_bytes(kv_bytes: int, block_tokens: int) -> int:
    """Bytes of the key summaries of ``kv_bytes`` of K/V in blocks of ``block_tokens``: 3/(2 · block_tokens) of it."""
    return summary_bytes(kv_bytes // block_tokens, 1)


def sparse_summary_bytes(req: PlanRequest) -> int:
    """Device bytes of the key summaries: per full block of every layer and row, a per-channel min, max and mean
    of its keys — 1.5 tokens' K+V bytes (:mod:`tierkv.store.summaries`) — and the blocks' rest copy if asked."""
    model = req.model
    blocks = sum(model.tokens_held(i, req.context) // req.block_tokens for i in range(model.layers))
    return summary_bytes(req.batch * blocks, model.kv_bytes_per_token_per_layer) + _rest_bytes(req, blocks)


def _rest_bytes(req: PlanRequest, blocks: int) -> int:
    """Device bytes of the rest copy of ``blocks`` full blocks per row (0 without ``sparse_rest_bits``)."""
    model = req.model
    kv = req.batch * blocks * req.block_tokens * model.kv_bytes_per_token_per_layer
    return rest_copy_bytes(kv, req.sparse_rest_bits, model.dtype_bytes, model.head_dim)


def sparse_fetched_tokens(req: PlanRequest, layer: int) -> int:
    """Tokens a sparse decode step reads of ``layer`` per row: the budget in whole blocks (rounded down, as the
    executor's cap; at least the open tail's block), at most the layer."""
    held = req.model.tokens_held(layer, req.context)
    if req.sparse_tokens >= held:
        return held
    return min(held, max(1, req.sparse_tokens // req.block_tokens) * req.block_tokens)


def sparse_staging_bytes(req: PlanRequest) -> int:
    """Device bytes sparse mode holds besides blocks: the exact prefill's two streaming chunks, the buffer of
    one layer's selected blocks, and the key summaries."""
    token_bytes = req.model.kv_bytes_per_token_per_layer
    chunks = streaming_staging_bytes(req.batch, req.chunk_tokens, token_bytes, req.block_tokens)
    largest = max(sparse_fetched_tokens(req, i) for i in range(req.model.layers))
    selection = req.batch * round_to_blocks(largest, req.block_tokens) * token_bytes
    return chunks + selection + sparse_summary_bytes(req)


def _sparse_layers(req: PlanRequest, per_layer: list[float], layer_kv: list[int],
                   shares: tuple[float, float, float]) -> tuple[LayerLoad, ...]:
    """A sparse decode step as it runs: each layer scores its blocks' summaries (on the device), then reads the
    selected blocks — a ``fetched / held`` fraction of its KV, spread over the tiers as the KV is (a uniform
    placement: with ``policy="attention"`` hot blocks gather on the device, so off-device reads can only be
    fewer) — and only then attends. The read waits for the layer's query, so nothing is prefetched (depth 0);
    scattered blocks cross the links as one transfer each.

    Compute: the roofline of the layer with attention over the fetched tokens only, plus the scoring pass (it
    reads every summary and does ``6 · heads · D`` FLOPs per block and row) and, with a rest copy, attention
    over every block from it (its bytes read, ``4 · heads · D`` FLOPs per token); a measured
    ``compute_s_per_step`` (of exact decoding) is kept and these added.
    """
    model, loads = req.model, []
    weights = model.params_per_layer * model.dtype_bytes
    for layer, (compute, kv) in enumerate(zip(per_layer, layer_kv, strict=True)):
        held = model.tokens_held(layer, req.context)
        fetched = sparse_fetched_tokens(req, layer)
        blocks = held // req.block_tokens
        summaries = summary_bytes(req.batch * blocks, model.kv_bytes_per_token_per_layer)
        scoring = req.device.time(summaries, 6 * req.batch * model.attention_heads * model.head_dim * blocks)
        if req.sparse_rest_bits:
            rest_tokens = req.batch * blocks * req.block_tokens
            flops = 4 * rest_tokens * model.attention_heads * model.head_dim
            scoring += req.device.time(_rest_bytes(req, blocks), flops)
        if req.compute_s_per_step is None:
            fetched_kv = req.batch * fetched * model.kv_bytes_per_token_per_layer
            flops = req.batch * (2 * model.params_per_layer + 4 * model.attention_heads * model.head_dim * fetched)
            compute = req.device.time(weights + fetched_kv, flops)
        load = _load(compute + scoring, kv * fetched / held if held else 0, shares)
        selected = req.batch * math.ceil(fetched / req.block_tokens)
        loads.append(dataclasses.replace(load, host_transfers=max(1, round(selected * shares[1])),
                                         disk_transfers=max(1, round(selected * shares[2]))))
    return tuple(loads)


def plan(req: PlanRequest, *, tolerance: float = 0.01) -> Plan:
    """Place the KV and forecast the step for ``req``.

    With ``req.prefetch_depth`` None the planner weighs depth against device memory: each level of depth
    adds a layer of staging, which pushes KV off the device. It tries every depth from 1 that fits the
    budget and keeps the shallowest one within ``tolerance`` of the fastest.
    Raises :class:`BudgetTooSmallError` when even one layer-ahead staging does not fit the device budget,
    :class:`CapacityError` when the KV does not fit all tiers together.
    """
    if req.executor == "streaming":  # two chunk buffers: one chunk ahead, across layers (_streaming_stages)
        return _plan_at_depth(req, 1)
    if req.executor == "sparse":  # the selection needs the layer's query: read synchronously (_sparse_layers)
        return _plan_at_depth(req, 0)
    if req.prefetch_depth is not None:
        return _plan_at_depth(req, req.prefetch_depth)
    plans = [_plan_at_depth(req, 1)]
    for depth in range(2, req.model.layers + 1):
        try:
            plans.append(_plan_at_depth(req, depth))
        except BudgetTooSmallError:
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
    compute; on a CPU-only host the gather is a copy by the same mover thread at the device->device rate.
    The auto prefetch depth can also change (it keeps the shallowest depth within 1% of the fastest).
    """
    if alt.forecast.step_s <= base.forecast.step_s * (1 + 1e-9):
        return ""
    reasons = []
    more_on_device = alt.bytes_per_tier.device - base.bytes_per_tier.device
    if more_on_device > 0:
        links = alt.request.links
        if links.serial_mover:
            gather, copy = links.link("device->device"), links.link("host->device")
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
    req = base.request
    links = req.links.links
    options = [
        (
            f"+{extra_gpu_bytes / 1e9:g} GB device",
            dataclasses.replace(req, gpu_bytes=req.gpu_bytes + extra_gpu_bytes),
        )
    ]
    pcie5 = {"host->device": PRESETS["pcie5"], "device->host": PRESETS["pcie5"]}
    gen5 = {"disk->host": PRESETS["nvme-gen5"], "host->disk": PRESETS["nvme-gen5-write"]}
    # A serial-mover profile is a CPU-only host: it has no PCIe link to upgrade.
    faster_link = not req.links.serial_mover and links.get("host->device") != PRESETS["pcie5"]
    faster_disk = base.bytes_per_tier.disk > 0 and links.get("disk->host") != PRESETS["nvme-gen5"]
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
            share = alt.bytes_read_per_step / max(base.bytes_read_per_step, 1)
            label = f"sparse, {req.sparse_tokens:,} tokens"
            note = (f"approximate attention: reads {share:.1%} of the KV bytes exact decoding reads per step "
                    "(the top blocks by key summaries, plus sinks and the recent window; quality in docs/quality.md)")
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
    device: str = "h100-sxm",
    compute_ms_per_step: float | None = None,
    prefetch_depth: int | None = None,
    executor: str = "gather",
    chunk_tokens: int = 4096,
    sparse_tokens: int | str = 2048,
    sparse_rest_bits: int = 0,
) -> PlanRequest:
    """A :class:`PlanRequest` from user-level values: names, size strings, ``"1M"`` contexts.

    Links: a measured ``profile`` JSON if given, else presets (``pcie4`` / ``nvme-gen4``); an explicit
    ``link`` or ``disk_link`` preset replaces that link in either.
    """
    if batch < 1:
        raise InvalidConfigError(f"batch={batch} must be >= 1.")
    links = (
        LinkProfile.load(profile)
        if profile
        else LinkProfile.from_presets(link or "pcie4", disk_link or "nvme-gen4")
    )
    if profile and (link or disk_link):
        presets = LinkProfile.from_presets(link or "pcie4", disk_link or "nvme-gen4").links
        keys = (["host->device", "device->host"] if link else []) + (
            ["disk->host", "host->disk"] if disk_link else []
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
        device=resolve_device(device),
        compute_s_per_step=None if compute_ms_per_step is None else compute_ms_per_step / 1e3,
        prefetch_depth=prefetch_depth,
        executor=executor,
        chunk_tokens=chunk_tokens,
        sparse_tokens=parse_tokens(sparse_tokens),
        sparse_rest_bits=sparse_rest_bits,
    )
