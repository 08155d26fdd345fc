"""Exact streaming attention: attend chunk by chunk over KV in any tier, merged by log-sum-exp.

Exact gather needs a whole layer's K/V on the device (twice, with prefetch). Streaming needs only two
chunk buffers: each chunk of ``chunk_tokens`` tokens (whole blocks) is copied into device staging (the
next one is on its way while this one is used), partial attention is computed with its log-sum-exp and
merged (:mod:`tierkv.attention.lse`), and the result equals softmax attention over all tokens up to float
rounding::

    for chunk c:  s = q·k_cᵀ·scale (+softcap, +mask)      # [B, H_kv, G, q, c]
                  out, lse = merge(out, lse, softmax(s)·v_c, logsumexp(s))

The device budget then bounds the resident blocks plus ``2 · B · chunk_tokens`` tokens of staging,
independent of the context length. ``tierkv.hf`` plugs it into transformers' ``AttentionInterface``
(``TieredCache.streaming(model)``); this module knows nothing of transformers.

Chunks are whole block columns: chunk ``i`` of a layer covers columns ``[first + i·n, first + (i+1)·n)``
where ``first`` holds the first attended token (a sliding window may start mid-block: the first chunk's
keys then start at that token's offset).
"""

from __future__ import annotations

import time

import torch

from tierkv.attention.base import READ_AHEAD, ColumnRead, PipelinedExecutor, Span, register_executor, wait_quietly
from tierkv.attention.lse import mask_bias, merge, partial_attention
from tierkv.errors import InvalidConfigError
from tierkv.mover import ThreadMover
from tierkv.staging import streaming_chunk_tokens
from tierkv.stats import Timeline, Trace
from tierkv.store import KVStore

DEFAULT_CHUNK_TOKENS = 4096


@register_executor
class StreamingAttention(PipelinedExecutor):
    """Chunked exact attention with one chunk always in flight, across layer boundaries.

    While chunk ``i`` is attended, chunk ``i + 1`` is being copied into the other buffer; during a layer's
    last chunk the *next layer's* first chunk is (its tokens are already stored: this step's new token is
    appended after it), and after the last layer, layer 0's for the next step. So the copies form one
    pipeline over all chunks of a step, which is what :func:`tierkv.bandwidth.predict_step` models with
    the chunks as stages and prefetch depth 1. A prefetched chunk is used only if its layer, first column
    and the table version still match; columns that were not full when it was issued are read on top.

    Telemetry (optional :class:`~tierkv.stats.Timeline`): the *stages* of a step are its chunks in order;
    a stage's compute is the time from its data landing to the wait for the next chunk (its partial
    attention, and after a layer's last chunk the rest of the model up to the next layer's attention).
    """

    name = "streaming"
    read_ahead = 2 * READ_AHEAD
    """Chunk reads are smaller than a gather's layer reads (two per layer at 8K tokens of 4K-token chunks), so
    twice as many are kept in flight: with four, the disk's queue runs dry between them (a quarter of a step
    idle); with eight it stays busy (docs/architecture.md, "Disk reads")."""

    def __init__(self, store: KVStore, mover: ThreadMover, *, num_layers: int | None = None,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, timeline: Timeline | None = None,
                 trace: Trace | None = None) -> None:
        super().__init__(store, mover, num_layers=num_layers, timeline=timeline, trace=trace)
        self.chunk_tokens = streaming_chunk_tokens(chunk_tokens, store.block_tokens)
        self.chunk_columns = self.chunk_tokens // store.block_tokens
        self.in_flight: list[ColumnRead] = []
        self.ahead: ColumnRead | None = None  # the next layer's first chunk, issued during this layer's last
        self._stage = -1  # telemetry: index of the current chunk within the step
        self._mark: float | None = None  # telemetry: when the current stage's data landed
        self._excluded = 0.0  # telemetry: time since _mark that was not compute (waits, top-up reads)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self.staging.buffers

    def attend(self, span: Span, query: torch.Tensor, mask: torch.Tensor | None, scaling: float,
               softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``query`` ``[B, H_q, q, D]`` over stored tokens ``[span.start, span.stop)`` of ``span.layer``.

        ``mask`` is ``None`` (causal) or boolean / additive ``[B, 1, q, kv]`` over those tokens.
        Returns the output ``[B, H_q, q, D]`` and its log-sum-exp ``[B, H_q, q]``, fp32 (:meth:`Executor.attend`).
        """
        layer, start, stop = span.layer, span.start, span.stop
        layout = self.store.layouts[layer]
        batch, heads, q_len, dim = query.shape
        bt = self.store.block_tokens
        self._begin_layer(layer, stop, q_len)
        self._see_layer(span)
        self._ensure_buffers(batch, layout.token_bytes)
        q = query.view(batch, layout.kv_heads, heads // layout.kv_heads, q_len, dim)  # [B, H_kv, G, q, D]
        out = lse = None  # running state: normalised output [B, H_kv, G, q, D] and its log-sum-exp [.., q]
        first, end = start // bt, -(-stop // bt)
        chunks = list(range(first, end, self.chunk_columns))  # first column of each chunk
        pending = self._take_ahead(layer, first, stop) if chunks else None
        if chunks and pending is None:
            pending = self._issue(layer, chunks[0], stop, 0)
        for index, column in enumerate(chunks):
            assert pending is not None  # issued before the loop, and by every iteration but the last
            current = self._wait(pending)
            last = index + 1 == len(chunks)
            other = 1 - current.buffer
            pending = None if last else self._issue(layer, chunks[index + 1], stop, other)
            if last:
                self._issue_ahead(layer, other)
            self._read_ahead(self._upcoming(layer, chunks[index + 2 :], stop))
            staging = self._staging(current.buffer, layer, batch)
            lo = max(start, column * bt) - column * bt  # first attended token within the chunk
            hi = min(stop, (column + self.chunk_columns) * bt) - column * bt
            keys = staging[0, :, :, lo:hi]  # [B, H_kv, c, D]
            values = staging[1, :, :, lo:hi]
            bias = mask_bias(mask, column * bt + lo - start, hi - lo, stop - start, q_len, query.dtype, query.device)
            self._accel.used(keys, values)
            out, lse = merge(out, lse, *partial_attention(q, keys, values, bias, scaling, softcap))
        if out is None or lse is None:
            raise InvalidConfigError(f"layer {layer} has no tokens in [{start}, {stop}) to attend to.")
        return out.reshape(batch, heads, q_len, dim), lse.reshape(batch, heads, q_len)

    # ------------------------------------------------------------------------------------ reads
    def _issue(self, layer: int, column: int, stop: int, buffer: int) -> ColumnRead:
        bt = self.store.block_tokens
        end = min(column + self.chunk_columns, -(-stop // bt))
        staging = self._staging(buffer, layer, self.store.batch_size(layer))
        plan = self.store.plan_read(layer, column * bt, min(stop, end * bt))
        handle, timings = self._read_later(layer, plan, staging)
        read = ColumnRead(layer, column, end - column, min(end, stop // bt) - column, buffer, self.version, handle,
                         timings)
        self.in_flight = [r for r in self.in_flight if not r.handle.done()] + [read]
        return read

    def _upcoming(self, layer: int, columns: list[int], stop: int) -> list[tuple[int, int, int]]:
        """The next :attr:`read_ahead` chunk reads after the one in flight, as ``(layer, start, stop)``: this
        layer's chunks from ``columns`` on, then the next layers' (wrapping once the layer count is known)."""
        bt = self.store.block_tokens
        out = [(layer, c * bt, min(stop, (c + self.chunk_columns) * bt)) for c in columns[: self.read_ahead]]
        target = layer
        while len(out) < self.read_ahead:
            following = self.next_layer(target)
            if following is None or following == layer or following not in self.store.layouts:
                break
            target = following
            start, end = self.start_of(target), self.store.seq_length(target)
            for c in range(start // bt, -(-end // bt), self.chunk_columns):
                out.append((target, c * bt, min(end, (c + self.chunk_columns) * bt)))
        return out[: self.read_ahead]

    def _issue_ahead(self, layer: int, buffer: int) -> None:
        """During ``layer``'s last chunk: start the next layer's first chunk into the free ``buffer``."""
        target = self.next_layer(layer)
        if target is None or target == layer or target not in self.store.layouts:
            return
        start, stop = self.start_of(target), self.store.seq_length(target)
        per_token = self.store.batch_size(target) * self.store.layouts[target].token_bytes
        if stop <= start or per_token * self.chunk_tokens > self.buffers[0].numel():
            return
        self.ahead = self._issue(target, start // self.store.block_tokens, stop, buffer)

    def _take_ahead(self, layer: int, first: int, stop: int) -> ColumnRead | None:
        """The prefetched first chunk of ``layer`` if still valid, topped up with columns not full before."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        waited_from = time.perf_counter()
        ok = wait_quietly(ahead.handle)
        self._excluded += self._stalled(waited_from, ahead.layer)
        bt = self.store.block_tokens
        end = min(first + self.chunk_columns, -(-stop // bt))
        if not ok or ahead.layer != layer or ahead.first != first or ahead.version != self.version \
                or ahead.columns > end - first:
            self._discard(ahead)
            return None
        self.prefetch_hits += 1
        if ahead.full == end - first:
            return ahead
        begun = time.perf_counter()
        staging = self._staging(ahead.buffer, layer, self.store.batch_size(layer))
        plan = self.store.plan_read(layer, (first + ahead.full) * bt, min(stop, end * bt))
        timings = self._read_now(layer, plan, staging[..., ahead.full * bt :, :])
        if self.timeline is not None:
            self.timeline.add_reads(self._stage + 1, timings, sync=True)
        self._excluded += time.perf_counter() - begun  # a read on this thread, not compute
        full = min(end, stop // bt) - first
        return ColumnRead(layer, first, end - first, full, ahead.buffer, self.version, ahead.handle, ahead.timings)

    def _discard(self, ahead: ColumnRead) -> None:
        """A prefetched chunk that will not be used (stale, failed, dropped, buffers resized): a miss whose
        bytes still count as moved."""
        self.prefetch_misses += 1
        self._record_reads(ahead, sync=False)

    def _wait(self, read: ColumnRead) -> ColumnRead:
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

    def _record_reads(self, read: ColumnRead, sync: bool) -> None:
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
        self.release_staging()
        self.staging.allocate(2, per_buffer)

    # ---------------------------------------------------------------------------------- control
    def invalidate(self) -> None:
        self.wait_all()
        self._drop_all_ahead()
        self.version += 1

    def reset(self) -> None:
        self.invalidate()

    def drop(self, layer: int) -> None:
        if self.ahead is not None and self.ahead.layer == layer:
            self._drop_ahead()
        for key in [key for key in self._disk_ahead if key[0] == layer]:
            self._drop_ahead_read(key)

    def _drop_ahead(self) -> None:
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.handle.settle()
            self._discard(ahead)

    def _paused(self) -> None:
        self._stage, self._mark, self._excluded = -1, None, 0.0

    def wait_all(self) -> None:
        for read in self.in_flight:
            read.handle.settle()
        self.in_flight = []
        self._settle_ahead()

    def release_staging(self) -> None:
        self.wait_all()
        ahead, self.ahead = self.ahead, None
        if ahead is not None:  # switched out: its bytes moved, but no step of this executor missed it
            ahead.handle.settle()
            self._record_reads(ahead, sync=False)
        self.staging.release()

    def close(self) -> None:
        self.wait_all()
        self._drop_ahead()
        self.release_staging()
