"""Exact streaming attention: attend chunk by chunk over KV in any tier, merged by log-sum-exp.

Exact gather needs a whole layer's K/V on the device (twice, with prefetch). Streaming needs only two
chunk buffers: each chunk of ``chunk_tokens`` tokens is copied into device staging (the next one is on its
way while this one is used), partial attention is computed with the running max ``m``, normaliser ``l``
and weighted sum ``acc`` of online softmax (FlashAttention's merge), and the result equals softmax
attention over all tokens up to float rounding::

    for chunk c:  s = q·k_cᵀ·scale (+softcap, +mask)      # [B, H_kv, G, q, c]
                  m' = max(m, max(s));  l = l·e^(m-m') + Σ e^(s-m');  acc = acc·e^(m-m') + e^(s-m')·v_c
    out = acc / l

The device budget then bounds the resident blocks plus ``2 · B · chunk_tokens`` tokens of staging,
independent of the context length. ``tierkv.hf`` plugs it into transformers' ``AttentionInterface``
(``TieredCache.streaming(model)``); this module knows nothing of transformers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierkv.attention.timed_read import resolve_cuda_events, timed_read
from tierkv.mover import MoveHandle, ThreadMover
from tierkv.stats import ReadTiming, Timeline, Trace
from tierkv.store import KVStore

DEFAULT_CHUNK_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class ChunkRead:
    """Tokens ``[start, start + count)`` of ``layer`` on their way into staging buffer ``buffer``."""

    layer: int
    start: int
    count: int
    buffer: int
    version: int
    handle: MoveHandle
    timings: list[ReadTiming] | None = field(default=None, compare=False)  # filled when telemetry is on


class StreamingAttention:
    """Chunked exact attention with one chunk always in flight, across layer boundaries.

    While chunk ``i`` is attended, chunk ``i + 1`` is being copied into the other buffer; during a layer's
    last chunk the *next layer's* first chunk is (its tokens are already stored: this step's new token is
    appended after it), and after the last layer, layer 0's for the next step. So the copies form one
    pipeline over all chunks of a step, which is what :func:`tierkv.bandwidth.predict_step` models with
    the chunks as stages and prefetch depth 1. A prefetched chunk is used only if its layer, start and
    the table version still match; tokens appended since it was issued are read on top of it.

    Telemetry (optional :class:`~tierkv.stats.Timeline`): the *stages* of a step are its chunks in order;
    a stage's compute is the time from its data landing to the wait for the next chunk (its partial
    attention, and after a layer's last chunk the rest of the model up to the next layer's attention).
    """

    def __init__(self, store: KVStore, mover: ThreadMover, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 timeline: Timeline | None = None, trace: Trace | None = None) -> None:
        block = store.block_tokens
        self.store = store
        self.mover = mover
        self.chunk_tokens = max(block, chunk_tokens // block * block)  # whole blocks: one segment per block
        self.timeline = timeline
        self.trace = trace
        self._cuda = store.device.device.type == "cuda"
        if timeline is not None and self._cuda:
            timeline.resolve = resolve_cuda_events
        self.buffers: list[torch.Tensor] = []
        self.reserved = 0
        self.in_flight: list[ChunkRead] = []
        self.ahead: ChunkRead | None = None  # the next layer's first chunk, issued during this layer's last
        self.version = 0  # bumped by table edits that make staged chunks stale
        self.start_of: Callable[[int], int] = lambda layer: 0  # first stored token a layer's attention reads
        self.num_layers = 0
        self.layers_known = False  # a full pass was seen (or the cache was built from a config)
        self.last_layer = -1
        self.stall_s = 0.0  # time attention waited for chunks to land
        self.prefetch_hits = 0  # next-layer chunks that were used
        self.prefetch_misses = 0  # next-layer chunks dropped (table edit, other start, buffers resized)
        self._stage = -1  # telemetry: index of the current chunk within the step
        self._mark: float | None = None  # telemetry: when the current stage's data landed
        self._excluded = 0.0  # telemetry: time since _mark that was not compute (waits, top-up reads)

    def attend(self, layer: int, start: int, query: torch.Tensor, mask: torch.Tensor | None, scaling: float,
               softcap: float | None = None) -> torch.Tensor:
        """Attention of ``query`` ``[B, H_q, q, D]`` over stored tokens ``[start, seq_length)`` of ``layer``.

        ``mask`` is ``None`` (causal) or boolean / additive ``[B, 1, q, kv]`` over those tokens.
        Returns ``[B, q, H_q, D]`` in the query's dtype, like transformers' attention functions.
        """
        stop = self.store.seq_length(layer)
        layout = self.store.layouts[layer]
        batch, heads, q_len, dim = query.shape
        if layer == 0 and self.num_layers > 1 and self.last_layer == self.num_layers - 1:
            self.layers_known = True  # a full pass was seen: prefetching layer 0 after the last is safe
        self._begin_layer(layer, stop, q_len)
        self.num_layers = max(self.num_layers, layer + 1)
        self.last_layer = layer
        self._ensure_buffers(batch, layout.token_bytes)
        q = query.view(batch, layout.kv_heads, heads // layout.kv_heads, q_len, dim)  # [B, H_kv, G, q, D]
        out = lse = None  # running state: normalised output [B, H_kv, G, q, D] and its log-sum-exp [.., q]
        chunks = list(range(start, stop, self.chunk_tokens))
        pending = self._take_ahead(layer, start, stop) if chunks else None
        if chunks and pending is None:
            pending = self._issue(layer, chunks[0], stop, 0)
        for index, chunk_start in enumerate(chunks):
            current = self._wait(pending)
            last = index + 1 == len(chunks)
            other = 1 - current.buffer
            pending = None if last else self._issue(layer, chunks[index + 1], stop, other)
            if last:
                self._issue_ahead(layer, other)
            staging = self._staging(current.buffer, layer, batch)
            keys = staging[0, :, :, : current.count]  # [B, H_kv, c, D]
            values = staging[1, :, :, : current.count]
            bias = _mask_bias(mask, chunk_start - start, current.count, stop - start, q_len, query.dtype, query.device)
            part_out, part_lse = _partial_attention(q, keys, values, bias, scaling, softcap)
            if out is None:
                out, lse = part_out, part_lse
            else:  # merge two softmax states: weights are each part's share of the total mass
                merged = torch.logaddexp(lse, part_lse)
                out = out * torch.exp(lse - merged).unsqueeze(-1) + part_out * torch.exp(part_lse - merged)[..., None]
                lse = merged
        return out.reshape(batch, heads, q_len, dim).transpose(1, 2).to(query.dtype)

    # ------------------------------------------------------------------------------------ reads
    def _issue(self, layer: int, start: int, stop: int, buffer: int) -> ChunkRead:
        count = min(self.chunk_tokens, stop - start)
        staging = self._staging(buffer, layer, self.store.batch_size(layer))[..., :count, :]
        segments = self.store.plan_read(layer, start, start + count)
        timings: list[ReadTiming] | None = None
        if self.timeline is None and self.trace is None:
            handle = self.mover.submit(lambda: self.store.read_into(layer, segments, staging))
        else:
            timings = []
            handle = self.mover.submit(lambda: timed_read(self.store, layer, segments, staging, timings,
                                                          cuda=self._cuda, trace=self.trace, category="prefetch"))
        read = ChunkRead(layer, start, count, buffer, self.version, handle, timings)
        self.in_flight = [r for r in self.in_flight if not r.handle.done()] + [read]
        return read

    def _issue_ahead(self, layer: int, buffer: int) -> None:
        """During ``layer``'s last chunk: start the next layer's first chunk into the free ``buffer``."""
        target = layer + 1
        if target >= self.num_layers:
            if not self.layers_known:
                return  # the layer count is not known yet: the next attention may not be layer 0
            target = 0
        if target == layer or target not in self.store.layouts:
            return
        start, stop = self.start_of(target), self.store.seq_length(target)
        per_token = self.store.batch_size(target) * self.store.layouts[target].token_bytes
        if stop <= start or per_token * self.chunk_tokens > self.buffers[0].numel():
            return
        self.ahead = self._issue(target, start, stop, buffer)

    def _take_ahead(self, layer: int, start: int, stop: int) -> ChunkRead | None:
        """The prefetched first chunk of ``layer`` if still valid, topped up with tokens appended since."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        waited_from = time.perf_counter()
        try:
            ahead.handle.wait()
            failed = False
        except Exception:  # noqa: BLE001 - a failed prefetch is a miss; the synchronous read reports
            failed = True
        self._stalled(waited_from, ahead.layer)
        if failed or ahead.layer != layer or ahead.start != start or ahead.version != self.version \
                or ahead.count > stop - start:
            self._discard(ahead)
            return None
        self.prefetch_hits += 1
        count = min(self.chunk_tokens, stop - start)
        if count == ahead.count:
            return ahead
        begun = time.perf_counter()
        staging = self._staging(ahead.buffer, layer, self.store.batch_size(layer))[..., ahead.count:count, :]
        segments = self.store.plan_read(layer, start + ahead.count, start + count)
        timings: list[ReadTiming] = []
        if self.timeline is None and self.trace is None:
            self.store.read_into(layer, segments, staging)
        else:
            timed_read(self.store, layer, segments, staging, timings, cuda=self._cuda, trace=self.trace,
                       category="read")
        if self.timeline is not None:
            self.timeline.add_reads(self._stage + 1, timings, sync=True)
        self._excluded += time.perf_counter() - begun  # a read on this thread, not compute
        return ChunkRead(layer, start, count, ahead.buffer, self.version, ahead.handle, ahead.timings)

    def _discard(self, ahead: ChunkRead) -> None:
        """A prefetched chunk that will not be used (stale, failed, dropped, buffers resized): a miss whose
        bytes still count as moved."""
        self.prefetch_misses += 1
        self._record_reads(ahead, sync=False)

    def _wait(self, read: ChunkRead) -> ChunkRead:
        waited_from = time.perf_counter()
        if self.timeline is not None and self._mark is not None:
            self.timeline.add_compute(self._stage, waited_from - self._mark - self._excluded)
        if self.trace is not None and self._mark is not None:
            self.trace.span(f"compute S{self._stage}", "compute", self._mark, waited_from)
        read.handle.wait()
        self._stalled(waited_from, read.layer)
        self._stage += 1
        self._record_reads(read, sync=False)
        self._mark, self._excluded = time.perf_counter(), 0.0
        return read

    def _stalled(self, waited_from: float, layer: int) -> None:
        """Attention waited from ``waited_from`` until now for a chunk of ``layer``: stall, not compute."""
        landed = time.perf_counter()
        self.stall_s += landed - waited_from
        self._excluded += landed - waited_from
        if self.timeline is not None:
            self.timeline.add_stall(landed - waited_from)
        if self.trace is not None:
            self.trace.span(f"wait L{layer}", "stall", waited_from, landed)

    def _record_reads(self, read: ChunkRead, sync: bool) -> None:
        if self.timeline is not None and read.timings is not None:
            self.timeline.add_reads(max(self._stage, 0), read.timings, sync)
            read.timings.clear()  # counted once, even if the chunk is used after a top-up

    def _begin_layer(self, layer: int, stop: int, new_tokens: int) -> None:
        """Telemetry: a layer at or below the last one starts a new step (pass through the layers); the step's
        new tokens are the query's length (attention runs after the layer stored them)."""
        timeline = self.timeline
        if timeline is None:
            return
        if layer <= self.last_layer or timeline.current is None:
            now = time.perf_counter()
            if self._mark is not None and timeline.current is not None:  # the previous step's tail (LM head, ...)
                timeline.add_compute(self._stage, now - self._mark - self._excluded)
            timeline.begin_step(now, new_tokens, stop, 1)
            self._stage, self._mark, self._excluded = -1, None, 0.0
        else:
            current = timeline.current
            current.new_tokens = max(current.new_tokens, new_tokens)

    # ---------------------------------------------------------------------------------- buffers
    def _staging(self, buffer: int, layer: int, batch: int) -> torch.Tensor:
        layout = self.store.layouts[layer]
        flat = self.buffers[buffer][: batch * self.chunk_tokens * layout.token_bytes].view(layout.dtype)
        return flat.view(2, batch, layout.kv_heads, self.chunk_tokens, layout.head_dim)

    def _ensure_buffers(self, batch: int, token_bytes: int) -> None:
        per_buffer = batch * self.chunk_tokens * token_bytes
        if self.buffers and self.buffers[0].numel() >= per_buffer:
            return
        self.close()
        self.store.reserve_device(2 * per_buffer)
        self.reserved = 2 * per_buffer
        device = self.store.device.device
        self.buffers = [torch.empty(per_buffer, dtype=torch.uint8, device=device) for _ in range(2)]

    # ---------------------------------------------------------------------------------- control
    def invalidate(self) -> None:
        """Table edits (crop, reorder, reset, a rollback) make a prefetched chunk stale."""
        self.wait_all()
        self.version += 1

    def drop(self, layer: int) -> None:
        """Forget ``layer``'s prefetched chunk (its token positions shifted: a sliding window dropped blocks)."""
        if self.ahead is not None and self.ahead.layer == layer:
            self._drop_ahead()

    def _drop_ahead(self) -> None:
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.handle.settle()
            self._discard(ahead)

    def pause_telemetry(self) -> None:
        """The other executor takes over: end the step in progress; the next attention starts a new one."""
        if self.timeline is not None:
            self.timeline.end_step(time.perf_counter())
        self._stage, self._mark, self._excluded = -1, None, 0.0
        self.last_layer = -1

    def wait_all(self) -> None:
        """Barrier: every chunk read has finished (a failed one raises where attention waits for it)."""
        for read in self.in_flight:
            read.handle.settle()
        self.in_flight = []

    def close(self) -> None:
        self.wait_all()
        self._drop_ahead()
        if self.reserved:
            self.store.device.unreserve(self.reserved)
        self.buffers, self.reserved = [], 0


def _mask_bias(mask: torch.Tensor | None, offset: int, count: int, total: int, q_len: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor | None:
    """Additive bias ``[B or 1, 1, q, c]`` for key columns ``[offset, offset + c)`` of ``total``; None: no mask.

    Masked entries get the dtype's lowest *finite* value, like eager masks, so a fully masked row (a padding
    query) stays finite — uniform over its keys — instead of turning into NaN.
    """
    lowest = torch.finfo(dtype).min
    if mask is None:  # causal: query i sits at key position total - q_len + i
        if q_len == 1:
            return None  # the newest query sees every key
        key_pos = torch.arange(offset, offset + count, device=device)
        query_pos = torch.arange(total - q_len, total, device=device)
        allowed = key_pos[None, :] <= query_pos[:, None]  # [q, c]
        return torch.zeros((1, 1, q_len, count), dtype=dtype, device=device).masked_fill(~allowed, lowest)
    part = mask[..., offset : offset + count]
    if part.dtype == torch.bool:
        return torch.zeros(part.shape, dtype=dtype, device=device).masked_fill(~part, lowest)
    return part.to(dtype).clamp_min(lowest)


def _partial_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
                       scaling: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` ``[B, H_kv, G, q, D]`` over one chunk ``[B, H_kv, c, D]``.

    Returns the normalised output ``[B, H_kv, G, q, D]`` and the log-sum-exp of the scores
    ``[B, H_kv, G, q]``, both fp32 — the state two chunks merge with. On CPU without soft-capping it uses
    PyTorch's fused flash kernel (which returns the log-sum-exp); query groups of a KV head become extra
    query rows, so K/V are never repeated.
    """
    batch, kv_heads, groups, q_len, dim = q.shape
    if softcap is None and q.device.type == "cpu" and _FUSED_CPU is not None and keys.dtype == q.dtype:
        rows = q.reshape(batch, kv_heads, groups * q_len, dim)
        if bias is not None:
            bias = bias.unsqueeze(2).expand(bias.shape[0], 1, groups, q_len, bias.shape[-1])
            bias = bias.reshape(bias.shape[0], 1, groups * q_len, bias.shape[-1])
        out, lse = _FUSED_CPU(rows, keys, values, 0.0, False, attn_mask=bias, scale=scaling)
        return out.float().view(q.shape), lse.float().view(q.shape[:-1])
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q.float(), keys.float()) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = (scores + bias.float().unsqueeze(2)).clamp_min(torch.finfo(torch.float32).min)
    peak = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - peak)
    total = weights.sum(dim=-1)
    out = torch.einsum("bhgqk,bhkd->bhgqd", weights, values.float()) / total.unsqueeze(-1)
    return out, peak.squeeze(-1) + torch.log(total)


# PyTorch's fused CPU flash attention that also returns the log-sum-exp (a private op: looked up, not required).
_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
