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
        self._ensure_buffers(batch, layout.token_bytes)
        q = query.view(batch, layout.kv_heads, heads // layout.kv_heads, q_len, dim)  # [B, H_kv, G, q, D]
        out = lse = None  # running state: normalised output [B, H_kv, G, q, D] and its log-sum-exp [.., q]
        chunks = list(range(start, stop, self.chunk_tokens))
        pending = self._issue(layer, chunks[0], stop, 0) if chunks else None
        for index, chunk_start in enumerate(chunks):
            current = pending
            waited_from = time.perf_counter()
            current.handle.wait()
            self.stall_s += time.perf_counter() - waited_from
            pending = self._issue(layer, chunks[index + 1], stop, (index + 1) % 2) if index + 1 < len(chunks) else None
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
