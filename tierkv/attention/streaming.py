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
from dataclasses import dataclass

import torch

from tierkv.mover import MoveHandle, ThreadMover
from tierkv.store import KVStore

DEFAULT_CHUNK_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class ChunkRead:
    """Tokens ``[start, start + count)`` of a layer on their way into staging buffer ``buffer``."""

    start: int
    count: int
    buffer: int
    handle: MoveHandle


class StreamingAttention:
    def __init__(self, store: KVStore, mover: ThreadMover, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        block = store.block_tokens
        self.store = store
        self.mover = mover
        self.chunk_tokens = max(block, chunk_tokens // block * block)  # whole blocks: one segment per block
        self.buffers: list[torch.Tensor] = []
        self.reserved = 0
        self.in_flight: list[ChunkRead] = []
        self.stall_s = 0.0  # time attention waited for chunks to land

    def attend(self, layer: int, start: int, query: torch.Tensor, mask: torch.Tensor | None, scaling: float,
               softcap: float | None = None) -> torch.Tensor:
        """Attention of ``query`` ``[B, H_q, q, D]`` over stored tokens ``[start, seq_length)`` of ``layer``.

        ``mask`` is ``None`` (causal) or boolean / additive ``[B, 1, q, kv]`` over those tokens.
        Returns ``[B, q, H_q, D]`` in the query's dtype, like transformers' attention functions.
        """
        stop = self.store.seq_length(layer)
        layout = self.store.layouts[layer]
        batch, heads, q_len, dim = query.shape
        groups = heads // layout.kv_heads
        self._ensure_buffers(batch, layout.token_bytes)
        q = query.float().view(batch, layout.kv_heads, groups, q_len, dim)  # [B, H_kv, G, q, D]
        running_max = torch.full((batch, layout.kv_heads, groups, q_len), float("-inf"), device=query.device)
        normaliser = torch.zeros_like(running_max)
        acc = torch.zeros((batch, layout.kv_heads, groups, q_len, dim), device=query.device)
        chunks = list(range(start, stop, self.chunk_tokens))
        pending = self._issue(layer, chunks[0], stop, 0) if chunks else None
        for index, chunk_start in enumerate(chunks):
            current = pending
            waited_from = time.perf_counter()
            current.handle.wait()
            self.stall_s += time.perf_counter() - waited_from
            pending = self._issue(layer, chunks[index + 1], stop, (index + 1) % 2) if index + 1 < len(chunks) else None
            staging = self._staging(current.buffer, layer, batch)
            keys = staging[0, :, :, : current.count].float()  # [B, H_kv, c, D]
            values = staging[1, :, :, : current.count].float()
            scores = torch.einsum("bhgqd,bhkd->bhgqk", q, keys) * scaling
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            scores = self._apply_mask(scores, mask, chunk_start - start, stop - start, q_len)
            new_max = torch.maximum(running_max, scores.amax(dim=-1))
            correction = torch.exp(running_max - new_max).nan_to_num(0.0)
            weights = torch.exp(scores - new_max.unsqueeze(-1))
            normaliser = normaliser * correction + weights.sum(dim=-1)
            acc = acc * correction.unsqueeze(-1) + torch.einsum("bhgqk,bhkd->bhgqd", weights, values)
            running_max = new_max
        out = acc / normaliser.unsqueeze(-1)
        return out.view(batch, heads, q_len, dim).transpose(1, 2).to(query.dtype)

    @staticmethod
    def _apply_mask(scores: torch.Tensor, mask: torch.Tensor | None, offset: int, total: int,
                    q_len: int) -> torch.Tensor:
        """Mask columns ``[offset, offset + c)`` of the ``total`` keys; ``None`` means causal."""
        count = scores.shape[-1]
        lowest = torch.finfo(scores.dtype).min  # finite, like eager masks: a fully masked row stays finite
        if mask is None:
            key_pos = torch.arange(offset, offset + count, device=scores.device)
            query_pos = torch.arange(total - q_len, total, device=scores.device)
            allowed = key_pos[None, :] <= query_pos[:, None]  # [q, c]
            return scores.masked_fill(~allowed, lowest)
        part = mask[..., offset : offset + count].unsqueeze(2)  # [B, 1, 1, q, c]
        if part.dtype == torch.bool:
            return scores.masked_fill(~part, lowest)
        return (scores + part.float()).clamp_min(lowest)

    def _issue(self, layer: int, start: int, stop: int, buffer: int) -> ChunkRead:
        count = min(self.chunk_tokens, stop - start)
        staging = self._staging(buffer, layer, self.store.batch_size(layer))
        segments = self.store.plan_read(layer, start, start + count)
        handle = self.mover.submit(lambda: self.store.read_into(layer, segments, staging))
        read = ChunkRead(start, count, buffer, handle)
        self.in_flight = [r for r in self.in_flight if not r.handle.done()] + [read]
        return read

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

    def wait_all(self) -> None:
        """Barrier: every chunk read has finished (a failed one raises where attention waits for it)."""
        for read in self.in_flight:
            read.handle.settle()
        self.in_flight = []

    def close(self) -> None:
        self.wait_all()
        if self.reserved:
            self.store.device.unreserve(self.reserved)
        self.buffers, self.reserved = [], 0
