"""The rest of a sparse step: attention over the candidate pages its selection did not read.

A sparse decode step attends the pages it selected exactly (:mod:`tierkv.attention.sparse`). With ``rest_bits``
the other candidate pages are attended too, from their low-bit rest copy on the device
(:mod:`tierkv.store.summaries`; in CPU memory straight from its codes, :mod:`tierkv.attention.rest_kernel`), and
with ``rest_means`` from each page's mean key and value, which the summaries hold anyway. Either is one (output,
log-sum-exp) pair the executor merges with the read pages' (:func:`tierkv.attention.lse.merge_all`): one softmax,
in pieces. Nothing here reads the tiers; the bytes it reads on the device are counted in the step's counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tierkv.attention import rest_kernel
from tierkv.attention.lse import merge, partial_attention, position_bias
from tierkv.store import KVStore

if TYPE_CHECKING:
    from tierkv.attention.sparse import SparseCounters

REST_CHUNK_TOKENS = 16384  # the rest copy is decoded and attended this many candidate tokens at a time
REST_PRUNE_MASS = 1e-3  # the rest copy leaves out pages whose summed mass is bounded below this share of the read's


@dataclass(frozen=True, slots=True)
class SummaryRows:
    """Where the candidates' summaries are: ``index`` ``[B·C]`` table rows on the device and ``rows`` ``[B, C]`` the
    same in numpy (0 where a block has none); ``missing`` (device) and ``none`` (numpy) ``[B, C]``: the blocks
    without one (None: every block has one)."""

    index: torch.Tensor
    missing: torch.Tensor | None
    rows: np.ndarray
    none: np.ndarray | None


class RestAttention:
    """A sparse executor's attention over the pages a step did not read, and each layer's lookup of its candidate
    blocks' summary rows (kept per grid version: :meth:`rows`)."""

    def __init__(self, store: KVStore, counters: SparseCounters) -> None:
        self.store = store
        self.counters = counters
        self._rows_cache: dict[int, tuple] = {}  # layer -> (key, SummaryRows)

    def forget(self, layer: int | None = None) -> None:
        """Drop the cached summary rows of ``layer`` (None: of every layer): a table edit."""
        if layer is None:
            self._rows_cache.clear()
        else:
            self._rows_cache.pop(layer, None)

    def rows(self, layer: int, rows, lo: int, hi: int, summaries, device: torch.device) -> SummaryRows:
        """Summary table rows of candidate columns ``[lo, hi)`` (:class:`SummaryRows`); looked up once per grid
        version, candidate range and summaries (the store rebuilds them when ``rest_bits`` or ``page_tokens``
        changes)."""
        key = (rows.version, lo, hi, summaries)
        cached = self._rows_cache.get(layer)
        if cached is None or cached[0] != key:
            found = summaries.rows(rows.ids[:, lo:hi])  # [B, C]; -1: no summary (always a candidate)
            none = found < 0 if (found < 0).any() else None
            held = found.clip(0)
            cached = self._rows_cache[layer] = (key, SummaryRows(
                torch.from_numpy(held.ravel()).to(device), None if none is None else torch.from_numpy(none).to(device),
                held, none))  # fmt: skip
        return cached[1]

    def from_copy(self, layer: int, candidates: tuple[int, int], start: int, stop: int, read: np.ndarray, per: int,
                  q: torch.Tensor, mask: torch.Tensor | None, scaling: float, softcap: float | None, summaries,
                  read_lses: list[torch.Tensor],
                  bound: tuple[int, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Attention of ``q`` over the pages of candidate columns ``candidates`` ``[lo, hi)`` the selection did not
        read (``read`` ``[B, K]``: the pages, as ``column · per + page``, or the blocks where ``per`` is 1), from
        their rest copy on the device: the
        output and log-sum-exp to merge with the read ones' (the same softmax, in two pieces; None: nothing to
        attend). Blocks without a copy (none was summarised yet) and the pages read are left out, and so are the
        pages whose attention mass cannot matter: by Quest's bound (:mod:`tierkv.store.summaries`) no key of a
        page has a logit above its bound, so its mass is at most ``page_tokens · exp(bound)``; the pages with the
        least such mass are left out while their sum stays within :data:`REST_PRUNE_MASS` of the read pages' mass
        (``read_lses``: each read part's log-sum-exp ``[B, H_kv, G, 1]``), in every query head — a bounded error,
        not a guess (``bound``: the last scoring's layer and bound ``[B, H_kv, G, C·per]``; None or another
        layer's: nothing is left out). The C kernel (:mod:`~tierkv.attention.rest_kernel`) attends them from their
        codes in one call; torch decodes :data:`REST_CHUNK_TOKENS` tokens at a time, merged by log-sum-exp, so its
        temporaries stay bounded."""
        lo, hi = candidates
        rows = self.store.table.rows[layer]
        bt, batch, device = self.store.block_tokens, rows.batch, q.device
        page, units = bt // per, (hi - lo) * per
        found = self.rows(layer, rows, lo, hi, summaries, device)
        skip = _not_from_copy(read, lo, hi, per, found)  # the page lists are built in numpy: small arrays
        if REST_PRUNE_MASS > 0 and bound is not None and bound[0] == layer and bound[1].shape[-1] >= units:
            # each page's log mass over the read's, the most any query head may give it [B, units]
            read_lse = torch.logsumexp(torch.stack(read_lses), dim=0).float()
            worst = np.where(skip, -np.inf, (bound[1][..., :units] - read_lse).flatten(1, 2).amax(
                dim=1).cpu().numpy() + math.log(page))  # fmt: skip
            # the least bounded page alone over the limit: none can be left out (the usual case, measured: Quest's
            # bound is loose) without the sort and cumulative sum
            if np.where(skip, np.inf, worst).min() <= math.log(REST_PRUNE_MASS):
                order = np.argsort(worst, axis=1, kind="stable")
                ordered = np.take_along_axis(worst, order, axis=1)
                within = np.logaddexp.accumulate(ordered, axis=1) <= math.log(REST_PRUNE_MASS)
                pruned = np.zeros_like(skip)
                np.put_along_axis(pruned, order, within, axis=1)
                self.counters.rest_pages_pruned += int((pruned & ~skip).sum())
                skip |= pruned
        count = units - skip.sum(axis=1)  # [B]
        most = int(count.max())
        if most == 0:
            return None
        unit = np.argsort(skip, axis=1, kind="stable")[:, :most]  # each row's needed pages first, ascending
        valid = np.arange(most) < count[:, None]  # [B, most] (rows with fewer: padded, masked below)
        block, part = np.divmod(unit, per)
        pages = torch.from_numpy(np.take_along_axis(found.rows, block, axis=1) * per + part).to(device)  # [B, most]
        native_kernel = rest_kernel.runs_on(device) and rest_kernel.takes(q.shape[2], q.shape[-1], page)
        bias = None  # the C kernel never reads padding: without a mask and a window it needs no bias
        if not native_kernel or mask is not None or lo * bt < start:
            positions = ((lo + block) * bt + part * page)[:, :, None] + np.arange(page)
            positions = torch.from_numpy(np.where(valid[:, :, None], positions, -1).reshape(batch, -1)).to(device)
            bias = position_bias(positions, start, stop, mask, q.dtype)  # [B, 1, 1, most · page]
        chunk = most if native_kernel else max(1, REST_CHUNK_TOKENS // page)  # (the kernel makes no temporaries)
        out = lse = None
        scaled = (q[:, :, :, 0].float() * scaling).contiguous() if native_kernel else q  # the C kernel's query
        for c in range(0, most, chunk):
            picked = pages[:, c : c + chunk].reshape(-1)
            counts = valid[:, c : c + chunk].sum(axis=1)  # [B]: each row's pages of this chunk
            self.counters.rest_bytes_read += summaries.rest_nbytes(layer, int(counts.sum()))
            native = None
            if native_kernel:
                codes, table, scales = summaries.rest_packed(layer)
                native = rest_kernel.rest_attention(
                    scaled, codes, table, scales, pages[:, c : c + chunk].contiguous(), torch.from_numpy(counts),
                    None if bias is None else bias[:, 0, 0, c * page : (c + chunk) * page].float().contiguous(),
                    summaries.rest_bits, softcap)
            if native is not None:  # attended straight from the codes
                out, lse = merge(out, lse, native[0].unsqueeze(-2), native[1].unsqueeze(-1))
                continue
            assert bias is not None  # (built above wherever the kernel does not run)
            keys, values = summaries.rest(layer, picked, q.dtype)  # [H_kv, B·n, page, D]: decoded, then attended
            heads, dim = keys.shape[0], keys.shape[-1]
            keys = keys.view(heads, batch, -1, dim).transpose(0, 1)  # [B, H_kv, n·page, D]
            values = values.view(heads, batch, -1, dim).transpose(0, 1)
            padded = ~valid[:, c : c + chunk]
            if padded.any():  # a padded position may name a row never written (NaN there would survive any bias)
                padded = torch.from_numpy(np.repeat(padded, page, axis=1)).to(device)[:, None, :, None]
                keys, values = keys.masked_fill(padded, 0), values.masked_fill(padded, 0)
            out, lse = merge(out, lse, *partial_attention(q, keys, values, bias[..., c * page : (c + chunk) * page],
                                                          scaling, softcap))
        self.counters.rest_layer_steps += 1
        return None if out is None or lse is None else (out, lse)

    def from_means(self, layer: int, candidates: tuple[int, int], start: int, stop: int, read: np.ndarray, per: int,
                   q: torch.Tensor, mask: torch.Tensor | None, scaling: float, softcap: float | None, summaries,
                   means: tuple[int, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Attention of ``q`` over the candidate pages the selection did not read (``candidates``, ``read``: as in
        :meth:`from_copy`), each from its mean key and value standing for its tokens: logit ``q · k̄`` plus
        the log of the page's attended tokens (those inside ``[start, stop)`` and the mask), value ``v̄`` — the
        output and log-sum-exp to merge with the read pages' (None: nothing to attend). The means are the
        summaries' own, gathered by the last scoring (``means``: its layer and ``[B, H_kv, units, 2·D]``; another
        layer's: gathered here)."""
        lo, hi = candidates
        store = self.store
        rows = store.table.rows[layer]
        bt, batch, device = store.block_tokens, rows.batch, q.device
        page, units = bt // per, (hi - lo) * per
        found = self.rows(layer, rows, lo, hi, summaries, device)
        if means is not None and means[0] == layer:
            pairs = means[1][:, :, :units]  # [B, H_kv, units, 2·D]
        else:  # no scoring this step (nothing selected): gather them
            table = summaries.table(layer)
            gathered = table.index_select(1, found.index)[:, :, :, 2:]  # [H_kv, B·C, pages, 2, D]
            self.counters.summary_bytes_read += gathered.numel() * gathered.element_size()
            pairs = gathered.reshape(table.shape[0], batch, units, -1).transpose(0, 1)
        dim = pairs.shape[-1] // 2
        keys, values = pairs[..., :dim].to(q.dtype), pairs[..., dim:].to(q.dtype)
        skip = torch.from_numpy(_not_from_copy(read, lo, hi, per, found)).to(device)
        firsts = lo * bt + torch.arange(units, device=device) * page  # [units]
        positions = (firsts[:, None] + torch.arange(page, device=device)).flatten()[None].expand(batch, -1)
        lowest = torch.finfo(q.dtype).min
        allowed = position_bias(positions, start, stop, mask, q.dtype) > lowest / 2  # [B, 1, 1, units·page]
        count = allowed.view(batch, units, page).sum(dim=2).masked_fill(skip, 0)  # [B, units]
        if not bool(count.any()):
            return None
        bias = torch.log(count.to(torch.float32)).clamp_min(torch.finfo(q.dtype).min).to(q.dtype)[:, None, None]
        self.counters.rest_layer_steps += 1
        return partial_attention(q, keys, values, bias, scaling, softcap)


def _not_from_copy(read: np.ndarray, lo: int, hi: int, per: int, found: SummaryRows) -> np.ndarray:
    """``[B, units]`` over the units (pages, or blocks where ``per`` is 1) of candidate columns ``[lo, hi)``: those
    the rest copy leaves out, the ones read (``read`` ``[B, K]``: as ``column · per + page``) and those of
    blocks without a summary."""
    skip = np.zeros((read.shape[0], (hi - lo) * per), dtype=bool)
    row, position = np.nonzero((read >= lo * per) & (read < hi * per))
    skip[row, read[row, position] - lo * per] = True
    if found.none is not None:
        skip |= np.repeat(found.none, per, axis=1)
    return skip
