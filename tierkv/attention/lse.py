"""Partial attention with its log-sum-exp, and the exact merge of partial results.

Every executor that attends in pieces (streaming's chunks, split's tiers, sparse's parts) computes, per piece,
the softmax-normalised output and the log-sum-exp of its scores, then merges pieces by their share of the
total mass — FlashAttention's (and FlashInfer's cascade) merge, exact up to float rounding::

    lse = logaddexp(lse_a, lse_b);   out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

two at a time as they come (:func:`merge`), or all of a step's at once (:func:`merge_all`: fewer tensor calls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, part_out: torch.Tensor,
          part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a piece ``part_out`` ``[..., q, D]`` / ``part_lse`` ``[..., q]`` into the running state (None: first)."""
    if out is None or lse is None:
        return part_out, part_lse
    merged = torch.logaddexp(lse, part_lse)
    return out * torch.exp(lse - merged).unsqueeze(-1) + part_out * torch.exp(part_lse - merged)[..., None], merged


def merge_all(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge pieces ``(out [..., q, D], lse [..., q])`` (at least one, alike in shape) in one pass: the same sum as
    :func:`merge` applied in turn, in a fixed number of tensor operations however many pieces there are."""
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([lse for _, lse in parts])
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total).unsqueeze(-1)
    return (torch.stack([out for out, _ in parts]) * weights).sum(dim=0), total


def mask_bias(mask: torch.Tensor | None, offset: int, count: int, total: int, q_len: int, dtype: torch.dtype,
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


@dataclass(frozen=True, slots=True)
class MaskedRows:
    """A mask's fully masked query rows ``[B or 1, 1, q]`` (the padding of a left-padded row), each None where there
    is none. Such a row has no softmax of its own, so each implementation gives it its own output — ``uniform``:
    every key at the additive mask's lowest finite value, a softmax of equal logits (eager's, and sdpa's with a float
    mask): the mean of the keys; ``empty``: every key hidden outright (a boolean mask, ``-inf``): sdpa's zeros — and
    a log-sum-exp merge would weigh its pieces alike whatever their key counts (every piece's is the same)."""

    uniform: torch.Tensor | None
    empty: torch.Tensor | None


def fully_masked(mask: torch.Tensor) -> MaskedRows | None:
    """:class:`MaskedRows` of ``mask`` ``[B or 1, 1, q, kv]`` (one device sync), None where no row is fully masked."""
    if mask.dtype == torch.bool:
        uniform, empty = torch.zeros_like(mask[..., 0]), ~mask.any(dim=-1)
    elif mask.is_floating_point():
        empty = (mask == float("-inf")).all(dim=-1)
        uniform = (mask <= torch.finfo(mask.dtype).min).all(dim=-1) & ~empty
    else:
        return None
    any_uniform, any_empty = torch.stack([uniform.any(), empty.any()]).tolist()
    if not (any_uniform or any_empty):
        return None
    return MaskedRows(uniform if any_uniform else None, empty if any_empty else None)


class FullyMaskedRows:
    """:func:`fully_masked` of each mask a forward's layers attend with, found once a forward (a model passes one
    mask object per layer kind to every layer of that kind): forgotten when the next forward begins."""

    def __init__(self) -> None:
        self._found: dict[int, tuple[torch.Tensor, MaskedRows | None]] = {}

    def __call__(self, mask: torch.Tensor) -> MaskedRows | None:
        found = self._found.get(id(mask))
        if found is None or found[0] is not mask:
            found = self._found[id(mask)] = (mask, fully_masked(mask))
        return found[1]

    def forget(self) -> None:
        """A forward begins: its masks are new (or a user's, edited in place since)."""
        self._found.clear()


def position_bias(positions: torch.Tensor, start: int, stop: int, mask: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """Additive bias ``[B, 1, 1, T]`` over staged tokens at ``positions`` ``[B, T]``: positions outside
    ``[start, stop)`` (the tail's empty slots, a sliding window's first block) and those ``mask`` hides get the
    lowest finite value (like eager masks: a fully masked row stays finite)."""
    lowest = torch.finfo(dtype).min
    allowed = (positions >= start) & (positions < stop)
    bias = torch.zeros(positions.shape, dtype=dtype, device=positions.device)
    if mask is not None:
        part = mask[:, 0, -1]  # [B or 1, kv] over tokens [start, stop)
        index = (positions - start).clamp(0, part.shape[-1] - 1)
        picked = part.expand(positions.shape[0], -1).gather(1, index)
        if picked.dtype == torch.bool:
            allowed &= picked
        else:
            bias = picked.to(dtype).clamp_min(lowest)
    return bias.masked_fill(~allowed, lowest)[:, None, None, :]


def partial_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
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
        # the private op reads each row's last dimension as contiguous (the public SDPA makes it so first): a
        # query, key or value strided there (gpt-oss's rotary at head dim 2) read other memory
        rows, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (rows, keys, values))
        if bias is not None:
            bias = bias.unsqueeze(2).expand(bias.shape[0], 1, groups, q_len, bias.shape[-1])
            bias = bias.reshape(bias.shape[0], 1, groups * q_len, bias.shape[-1])
        out, lse = _FUSED_CPU(rows, keys, values, 0.0, False, attn_mask=bias, scale=scaling)
        return out.float().view(q.shape), lse.float().view(q.shape[:-1])
    scores = _scores(q, keys, bias, scaling, softcap)
    peak = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - peak)
    total = weights.sum(dim=-1)
    out = torch.einsum("bhgqk,bhkd->bhgqd", weights, values.float()) / total.unsqueeze(-1)
    return out, peak.squeeze(-1) + torch.log(total)


def weighted_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
                       scaling: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`partial_attention` that also returns each key's weight ``[B, H_kv, G, q, c]`` (fp32): one pass
    for a caller that needs the weights (sparse attention's per-block shares), instead of scoring the keys a
    second time after the fused kernel. Returns the output, the weights and the log-sum-exp."""
    scores = _scores(q, keys, bias, scaling, softcap)
    peak = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - peak)  # one exp, as a softmax; its sum gives the log-sum-exp too
    total = weights.sum(dim=-1, keepdim=True)
    weights /= total
    lse = (peak + torch.log(total)).squeeze(-1)
    batch, kv_heads, groups, q_len, _ = weights.shape
    out = torch.matmul(weights.view(batch, kv_heads, groups * q_len, -1), values.float())
    return out.view(q.shape), weights, lse


def _scores(q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor | None, scaling: float,
            softcap: float | None) -> torch.Tensor:
    """Attention logits ``[B, H_kv, G, q, c]`` in fp32 (soft-capped, bias added; masked ones finite)."""
    batch, kv_heads, groups, q_len, dim = q.shape
    rows = q.float().reshape(batch, kv_heads, groups * q_len, dim) * scaling
    scores = torch.matmul(rows, keys.float().transpose(-1, -2)).view(batch, kv_heads, groups, q_len, -1)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = (scores + bias.float().unsqueeze(2)).clamp_min(torch.finfo(torch.float32).min)
    return scores


# PyTorch's fused CPU flash attention that also returns the log-sum-exp (a private op: looked up, not required).
_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
