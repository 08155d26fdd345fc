"""Query-aware sparse attention over blocks on any tier (Quest-style), exact over the blocks it reads.

Each decode step (one query token per row), per layer, over the *pages* of the candidate blocks (``page_tokens``
consecutive tokens, :data:`~tierkv.staging.DEFAULT_PAGE_TOKENS` by default: the unit of selection, finer than the
block, which stays the unit of placement and of large transfers)::

    bound[b, p, h, g] = q⁺·hi_p + q⁻·lo_p                 # ≥ every key logit of page p (tierkv.store.summaries)
    mean[b, p, h, g]  = q·m_p                              # the page's mean key logit, exactly
    share[b, p, h, g] = softmax over p of (bound + mean) / 2 · scale   # each head's estimated attention share
    score[b, p]       = max over heads of share               # a page matters if any query head needs it
    score[b, p]       = max(score, measured share at the layer's previous step, where >= sticky_share)
    selected[b]       = sinks ∪ top_k(score[b]) ∪ recent      # per row: rows select different pages
    CPU host: attend the selection where it is (the host kernel, tierkv.attention.host_kernel): the sink and
        recent blocks and the pages of blocks in memory in the tiers' slabs, the pages of blocks on disk in the
        layer's kept buffer, the misses read straight into it (KVStore.start_read_pages: the disk's covering
        aligned sectors, read while the rest copy below is attended); nothing gathered or staged
    accelerator: read the sink and recent blocks whole (one ReadPlan) and the selected pages (one page read per
        tier; kept ones gathered) into device staging
    out = softmax attention over the selected tokens (tierkv.attention.lse), exact over them
    rest_bits: + every other candidate page from its low-bit copy on the device, merged by log-sum-exp
        (in CPU memory attended straight from its codes: tierkv.attention.rest_kernel)

Each layer keeps the units it read in its recent steps on the device (:mod:`tierkv.attention.kept`): pages, or
blocks where ``page_tokens`` equals the block's tokens (the page is then the block, and the selected blocks are
also read ahead from disk by speculation); a step reads from the tiers only the units it did not hold. On a CPU
host a layer keeps only its disk pages (the others are attended in their slabs), and attends them in the kept
buffer: a kept page moves no byte, and the kernel measures each page's share of the softmax in the same pass
(``entry_lse``). The attention policy promotes the blocks of hot units.

Why the estimate mixes the bound with the mean: Quest's bound alone is loose (one outlying channel lifts it),
and on SmolLM2 at 10% of a 2K context it found 5 of 18 needles against full attention's 15, the mix 11
(docs/quality.md, with the oracle that ranks by the true attention mass for comparison).

GQA: a page is fetched for all KV heads at once, so its score is the best over every query head of every
KV-head group, and every head attends every page read. Each head's
estimates become shares by a softmax over the blocks first, so a head whose logits are flat (no block stands
out: each gets 1/C) does not drown a head that points at one block, and a head with large logits does not
drown the others. Selecting per KV head instead (each head its own top blocks, the union read, each head
masked to its own) read 1.7x the blocks for about the same top-1 (docs/quality.md, "Choosing the selection
rule"): the block, all heads together, is the unit of I/O.
Nothing is dropped from the store: a block that is not selected now is read the step a query needs it, from
whatever tier holds it.

The budget ``tokens`` counts every attended token in whole pages: the sinks (the layer's first blocks), the
recent window (its last blocks, always including the open tail that holds the new token; by default that tail
alone) and the top-scored pages in between. ``dense_layers`` attends the first layers in full (Quest does so
for two: their attention is diffuse) and takes their blocks out of the other layers' budgets, so the total over
layers stays within ``tokens`` per layer. Fast path: when the budget covers every block of the layer, the step
reads them all and is exact (no scoring). Prefill and multi-token steps are not this executor's: the adapter
runs them through exact streaming attention. Key summaries are turned on in the store the first time this executor
runs (blocks already full are summarised then, read once).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tierkv.attention import score_kernel
from tierkv.attention.base import PipelinedExecutor, Span, register_executor
from tierkv.attention.kept import KeptBlocks, KeptLayer
from tierkv.attention.lse import merge, merge_all, partial_attention, position_bias, weighted_attention
from tierkv.attention.sparse_in_place import SparseInPlace
from tierkv.attention.sparse_rest import RestAttention
from tierkv.attention.sparse_store import SparseBlocks
from tierkv.attention.speculation import Speculation, SpeculationCounters
from tierkv.blocks import Tier
from tierkv.errors import InvalidConfigError
from tierkv.layout import BlockLayout
from tierkv.mover import ThreadMover
from tierkv.staging import DEFAULT_REST_BITS, GROWTH, REST_BITS, default_page_tokens, sparse_budget_tokens
from tierkv.stats import ReadTiming, Timeline, Trace
from tierkv.store import KVStore, ReadPlan
from tierkv.store.transfer import link
from tierkv.units import parse_tokens

_LABELS = tuple(tier.label for tier in Tier)  # each tier's label by its value, looked up without the enum
_INTO_DEVICE = tuple(link(tier, Tier.DEVICE) for tier in Tier)  # the links into the device
_FROM_DEVICE = tuple(link(Tier.DEVICE, tier) for tier in Tier)  # ... and out of it


@dataclass(frozen=True, slots=True)
class SparseBudget:
    """How much of a layer a sparse decode step reads.

    ``tokens``: attended tokens per row and layer — an int, or a float in (0, 1] for that fraction of the
    layer's context — sinks and recent window included, rounded down to whole blocks (a cap: the attended
    tokens never exceed it, unless the sinks and the open tail alone do). ``sinks``: tokens at the
    start always attended (default: one block). ``recent``: the last tokens always attended (default 0: the
    open tail, attended in any case; the blocks before it compete like any other — a forced last full block
    measured worse on SmolLM2, docs/quality.md). ``dense_layers``: the first layers attended in full, their
    blocks taken out of the other layers' budgets (default 0: measured worse at 10% on SmolLM2). ``rest_bits``:
    the blocks a step does not read are attended too, from a copy of this many bits (2, 4 or 8) kept on the
    device beside the summaries (:mod:`tierkv.store.summaries`; default 0: not attended) — nothing more is read.
    ``page_tokens``: tokens per selected page, a divisor of the cache's ``block_tokens`` (default: the largest
    divisor up to :data:`~tierkv.staging.DEFAULT_PAGE_TOKENS`; the block's tokens: whole blocks). ``rest_means``:
    without a rest copy, the pages a step does not read are attended from their mean key and value (each standing
    for the page's tokens), which the summaries hold anyway: nothing more is kept or read.
    """

    tokens: int | float | str
    sinks: int | None = None
    recent: int | None = None
    dense_layers: int = 0
    rest_bits: int = 0
    page_tokens: int | None = None
    rest_means: bool = False

    def __post_init__(self) -> None:
        tokens = self.tokens
        if isinstance(tokens, str):  # a count as the CLI writes it: "2K", "2048"
            tokens = parse_tokens(tokens, name="sparse tokens")
            object.__setattr__(self, "tokens", tokens)
        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)):
            raise InvalidConfigError(f"sparse tokens={tokens!r}: give an int budget (e.g. 2048 or '2K') or a "
                                     "fraction of the context in (0, 1] (e.g. 0.05).")
        if isinstance(tokens, int) and tokens < 1:
            raise InvalidConfigError(f"sparse tokens={tokens} must be >= 1 (or a fraction in (0, 1]).")
        if isinstance(tokens, float) and not 0.0 < tokens <= 1.0:
            raise InvalidConfigError(f"sparse tokens={tokens} as a fraction must be in (0, 1]; give an int for a "
                                     "number of tokens.")
        bits = self.rest_bits
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in REST_BITS:  # 4.0 == 4: not an int
            raise InvalidConfigError(f"sparse rest_bits={self.rest_bits!r}: give one of "
                                     f"{', '.join(map(str, REST_BITS))} (0: the blocks not read are not attended).")
        page = self.page_tokens
        if page is not None and (isinstance(page, bool) or not isinstance(page, int) or page < 1):
            raise InvalidConfigError(f"sparse page_tokens={page!r} must be an int >= 1 dividing the cache's "
                                     "block_tokens (e.g. 16 for 256-token blocks).")
        for name in ("sinks", "recent", "dense_layers"):
            value = getattr(self, name)
            if (value is not None or name == "dense_layers") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 0):
                unit = "layers" if name == "dense_layers" else "tokens"
                raise InvalidConfigError(f"sparse {name}={value!r} must be an int >= 0 ({unit}).")
        if not isinstance(self.rest_means, bool):
            raise InvalidConfigError(f"sparse rest_means={self.rest_means!r} must be True or False (True: the pages "
                                     "not read are attended from their mean key and value, without a rest copy).")
        if self.rest_means and bits:  # the copy would attend the pages not read: the means would do nothing
            raise InvalidConfigError(f"sparse rest_means=True stands in for a rest copy, which rest_bits={bits} keeps "
                                     f"(cache.sparse's default: {DEFAULT_REST_BITS} bits); pass rest_bits=0 with "
                                     "rest_means=True, or leave rest_means out.")

    def budget_tokens(self, context: int) -> int:
        """Attended tokens per row, at most, for a layer attending over ``context`` tokens."""
        assert not isinstance(self.tokens, str)  # "2K" was parsed to a count
        return sparse_budget_tokens(self.tokens, context)

    def page_size(self, block_tokens: int) -> int:
        """Tokens per selected page in a cache of ``block_tokens``-token blocks (raises if it does not divide)."""
        page = self.page_tokens if self.page_tokens is not None else default_page_tokens(block_tokens)
        if block_tokens % page:
            raise InvalidConfigError(f"sparse page_tokens={page} does not divide the cache's block_tokens="
                                     f"{block_tokens}: give a divisor of it (e.g. 16 for 256-token blocks).")
        return page

    def budget_blocks(self, context: int, columns: int, block_tokens: int, num_layers: int) -> int:
        """Units (blocks or pages) of ``block_tokens`` tokens a sparse layer of ``columns`` such units holding
        ``context`` tokens reads per row: the budget in whole units, less the dense layers' units beyond their
        own budget (each taken to hold as many). Sinks and the recent window are read even where that leaves
        less (``stats()`` counts what was read)."""
        nominal = self.budget_tokens(context) // block_tokens  # a cap: whole blocks within the budget
        dense = min(self.dense_layers, num_layers)
        if not dense or dense == num_layers:
            return nominal
        return (num_layers * nominal - dense * columns) // (num_layers - dense)


@dataclass(slots=True)
class SparseCounters:
    """What sparse decode steps read (``cache.stats()["sparse"]``)."""

    layer_steps: int = 0  # layers attended sparsely (one query token)
    exact_layer_steps: int = 0  # ... of which the budget covered every block (fast path: all read)
    steps: int = 0  # passes through the layers
    blocks_selected: int = 0  # blocks read, over rows and layers
    blocks_total: int = 0  # blocks the same layer-steps could read (from the one their first token is in), over rows
    blocks_reused: int = 0  # ... of which were kept on the device from earlier steps (not read again)
    bytes_fetched: int = 0  # KV bytes read for the other selected blocks (every tier, the device's own included)
    bytes_fetched_off_device: int = 0  # ... of which came from the host and disk tiers
    promotions: int = 0  # blocks moved up to the device after being attended (policy="attention")
    rest_layer_steps: int = 0  # layer-steps that attended the blocks not read from their rest copy (rest_bits)
    rest_pages_pruned: int = 0  # ... pages (or blocks) left out there: mass bounded below sparse_rest.REST_PRUNE_MASS
    pages_selected: int = 0  # pages read on their own (page_tokens < block_tokens), over rows and layers
    pages_reused: int = 0  # ... of which were kept on the device from earlier steps (not read from their tier)
    tokens_read: int = 0  # tokens staged and attended exactly (whole blocks and pages), over rows and layers
    tokens_total: int = 0  # tokens in those blocks, over rows
    link_bytes: dict[str, int] = field(default_factory=dict)  # bytes the steps moved into the device, per link
    summary_bytes_read: int = 0  # key summaries read on the device to score the candidates
    rest_bytes_read: int = 0  # rest copy read on the device (codes, scales and the keys' page bounds)
    staged_bytes_read: int = 0  # selected K/V attended from staging
    by_tier: dict[str, int] = field(default_factory=dict)  # blocks read (or attended in place) per tier, reused not
    speculation: SpeculationCounters = field(default_factory=SpeculationCounters)  # disk reads ahead of need

    def add_fetched(self, before: dict[str, int], now: dict[str, int]) -> None:
        """Count what moved into the device between two looks at the links' counters as fetched (off the device
        where its link starts elsewhere)."""
        for name, nbytes in now.items():
            delta = nbytes - before.get(name, 0)
            self.bytes_fetched += delta
            if name not in _FROM_DEVICE:
                self.bytes_fetched_off_device += delta

    def as_dict(self) -> dict:
        steps = max(self.steps, 1)
        device_reads = self.summary_bytes_read + self.rest_bytes_read + self.staged_bytes_read
        return {
            "pages_selected": self.pages_selected, "pages_reused": self.pages_reused,
            "rest_pages_pruned": self.rest_pages_pruned,
            "link_bytes_per_step": {name: nbytes / steps for name, nbytes in self.link_bytes.items()},
            "summary_bytes_read_per_step": self.summary_bytes_read / steps,
            "rest_bytes_read_per_step": self.rest_bytes_read / steps,
            "staged_bytes_read_per_step": self.staged_bytes_read / steps,
            "device_bytes_read_per_step": device_reads / steps,
            "layer_steps": self.layer_steps, "exact_layer_steps": self.exact_layer_steps, "steps": self.steps,
            "blocks_selected": self.blocks_selected, "blocks_total": self.blocks_total,
            "blocks_reused": self.blocks_reused,
            "selected_fraction": self.blocks_selected / self.blocks_total if self.blocks_total else 0.0,
            "tokens_read_fraction": self.tokens_read / self.tokens_total if self.tokens_total else 0.0,
            "blocks_selected_by_tier": dict(self.by_tier),
            "bytes_fetched": self.bytes_fetched, "bytes_fetched_per_step": self.bytes_fetched / steps,
            "bytes_fetched_off_device": self.bytes_fetched_off_device,
            "bytes_fetched_off_device_per_step": self.bytes_fetched_off_device / steps,
            "promotions": self.promotions, "rest_layer_steps": self.rest_layer_steps,
            "speculation": self.speculation.as_dict(),
        }


@register_executor
class SparseAttention(PipelinedExecutor):
    """Sparse decode attention: score blocks by their key summaries, read the top ones, attend exactly.

    Staging: one buffer ``[2, B, H_kv, capacity, D]`` of the selected blocks (capacity: the budget in whole
    blocks, grown by 25% steps when a fractional budget grows with the context), reserved against the device
    budget. The selection needs this layer's query, so the read of what it selects is synchronous (its disk part
    submitted first and overlapped with the memory tiers' copies); what the next layer is likely to select is
    read from disk speculatively while this one attends (:mod:`tierkv.attention.speculation`), and the blocks
    each layer keeps from its recent steps are not read at all (:mod:`tierkv.attention.kept`).
    """

    name = "sparse"
    approximate = True  # whatever the budget: a step that reads every page is exact, but no step promises it
    speculate = True  # read the next layer's likely selection from disk while a layer attends
    speculate_runners = 0  # best-scored unselected blocks a guess adds per row (0: the previous selection only)
    sticky_share = 0.5  # a block that got this share of some query head's attention is read at the next step too

    def __init__(self, store: KVStore, mover: ThreadMover, *, num_layers: int | None = None,
                 budget: SparseBudget | None = None, timeline: Timeline | None = None,
                 trace: Trace | None = None) -> None:
        super().__init__(store, mover, num_layers=num_layers, timeline=timeline, trace=trace)
        self.budget = budget  # what each step reads (TieredCache.sparse sets it)
        self.counters = SparseCounters()
        self.rest = RestAttention(store, self.counters)  # the pages a step does not read
        self._tail_cache: dict[int, tuple] = {}  # layer -> (key, its open tail's full pages' summaries)
        self.last_columns: np.ndarray | None = None  # the last layer-step's whole blocks [B, K] (grid columns)
        self.last_pages: np.ndarray | None = None  # ... and its pages [B, P] (column · per + page; None: blocks)
        self.sparse_blocks = SparseBlocks(store)  # summaries, open-tail copies, promotion
        self.kept = KeptBlocks(store)  # each layer's blocks of earlier steps, on the device
        self.inplace = SparseInPlace(store, self.counters, self._moved_in)  # a CPU host's selection, where it lies
        self.speculation = Speculation(store, self.counters.speculation)
        self._ranked: tuple[int, int, torch.Tensor] | None = None  # (layer, lo, score [B, C]) of the last scoring
        self._sticky: dict[int, tuple[np.ndarray, torch.Tensor]] = {}  # layer -> (columns [B, K], shares [B, K])
        self._scored = False  # whether the last selection ranked blocks (not the exact fast path)
        self._unread: tuple[int, int] | None = None  # the last selection's candidates [lo, hi), some not read
        self._tail_kept: tuple[np.ndarray, int] | None = None  # (the tail's chosen pages [B, P] or -1, its E pages)
        self._bound: tuple[int, torch.Tensor] | None = None  # (layer, Quest's bound [B, H_kv, G, C·per]) last scored
        self._means: tuple[int, torch.Tensor] | None = None  # (layer, each page's mean key and value) last scored
        self._unstaged: dict[tuple[BlockLayout, int], torch.Tensor] = {}  # (layout, batch) -> empty staging

    @property
    def reserved(self) -> int:
        return self.staging.reserved

    def attend(self, span: Span, query: torch.Tensor, mask: torch.Tensor | None, scaling: float,
               softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse attention of ``query`` ``[B, H_q, 1, D]`` over stored tokens ``[span.start, span.stop)``.

        ``mask`` is ``None`` (causal) or boolean / additive ``[B or 1, 1, 1, kv]`` over those tokens.
        ``span.context``: the sequence's tokens so far, of which a fractional budget is a share. A sliding-window
        layer holds only its window, so a share of the window would make it sparse where the sequence's budget
        covers all of it (Gemma 3 at 10% of 16K: 1,638 tokens, window 512).
        Returns the output ``[B, H_q, 1, D]`` and its log-sum-exp ``[B, H_q, 1]``, fp32 (:meth:`Executor.attend`).
        """
        batch, heads, q_len, dim = query.shape
        if q_len != 1:
            raise InvalidConfigError(f"sparse attention runs decode steps (one query token), got {q_len}.")
        budget = self.budget
        if budget is None:
            raise InvalidConfigError("sparse attention has no budget; enter `with cache.sparse(model, tokens=...)`.")
        layer, start, stop, context = span.layer, span.start, span.stop, span.context
        store = self.store
        bt = store.block_tokens
        page = budget.page_size(bt)
        per = bt // page  # pages per block
        self._begin_layer(span)  # first: the summaries' one-off read of the prompt's blocks is this step's
        summaries = self.sparse_blocks.enable_summaries(budget.rest_bits, None if per == 1 else page, layer,
                                                        read=self._read_unclaimed)  # fmt: skip
        moved = self._moved_in()
        self._speculate_after(layer)
        layout = store.layouts[layer]
        q = query.view(batch, layout.kv_heads, heads // layout.kv_heads, 1, dim)  # [B, H_kv, G, 1, D]
        columns, pages = self._select(layer, start, stop, context, q, budget, summaries, scaling, softcap, per)
        self.last_columns, self.last_pages = columns, pages
        self.speculation.remember(layer, columns, self._runners_up(layer, columns))
        count, picked = columns.shape[1], 0 if pages is None else pages.shape[1]
        chosen_pages = 0 if pages is None else int((pages >= 0).sum())  # the pages selected (-1: none)
        rest = budget.rest_bits or budget.rest_means
        # a CPU host attends the whole blocks where they are too: those on disk as pages in the kept layer, after
        # the selection's (``attended``: the pages attended in place, the selection's first)
        host_only = self.inplace.host_only()
        in_place = host_only and (self._tail_kept is None or bool(rest))  # (no mask of unchosen tail pages)
        host_query = query.float().contiguous() if host_only else query  # the host kernel's, converted once
        blocks_in_place, here, attended, disk_blocks = self._in_place(layer, batch, columns, pages, per, page,
                                                                      start, in_place)  # fmt: skip
        blocks_here = None  # the whole blocks attended in place: (out, lse, each block's own lse [B, H_q, K])
        if blocks_in_place:
            blocks_here = self.inplace.blocks(layer, columns, host_query, mask, start, stop, scaling, softcap,
                                            disk_as_pages=disk_blocks is not None)  # fmt: skip
        staging, page_staging = self._staging(layer, batch, 0 if blocks_here is not None else count,
                                              0 if here is not None else picked * page)  # fmt: skip
        parts = []  # staged (keys, values, bias), attended by torch
        masked = 0  # staged tokens not attended: the open tail's full pages the selection left out
        if blocks_here is None:
            self._fill(layer, columns, staging, keep=pages is None)
            parts.append(self._block_part(columns, staging, start, stop, mask, query))
            if self._tail_kept is not None and not rest:  # the tail's pages not chosen: not attended
                parts[0] = (*parts[0][:2], _tail_bias(parts[0][2], *self._tail_kept, page, parts[0][0].shape[2],
                                                      query))  # fmt: skip
                chosen_in_tail, full_pages = self._tail_kept
                masked = (batch * full_pages - int(np.count_nonzero(chosen_in_tail >= 0))) * page
        else:  # nothing read: the blocks counted by the tier each was attended in
            self._count(layer, ReadPlan(layer, 0, 0, ()), columns, 0, 0)
            tiers = store.table.rows[layer].tiers[np.arange(batch)[:, None], columns]
            for label, n in zip(_LABELS, np.bincount(tiers.ravel(), minlength=len(_LABELS)).tolist()):  # 3 tiers
                if n:
                    self.counters.by_tier[label] = self.counters.by_tier.get(label, 0) + n
        if pages is not None and picked and here is None:
            self._read_pages(layer, pages, per, page, page_staging)
            if (pages < 0).any():  # positions left alone hold stale bytes, maybe NaN: masked, and zero
                stale = torch.from_numpy(pages < 0).to(query.device).repeat_interleave(page, dim=1)
                page_staging.masked_fill_(stale[None, :, None, :, None], 0)
            parts.append((page_staging[0], page_staging[1],
                          _page_bias(pages, per, page, start, mask, self._unread, query.dtype, query.device)))
        wants_mass = getattr(store.policy, "wants_mass", False)
        sticky = bool(self.sticky_share) and self._scored  # an exact layer-step (all blocks read) chose nothing
        out, lse, pieces = self._attend_parts(q, parts, wants_mass or sticky, scaling, softcap)
        attended_parts = [] if out is None or lse is None else [(out, lse)]  # (out, lse) each: merged once, below
        if blocks_here is not None:
            attended_parts.append((blocks_here[0].view(*q.shape[:3], 1, dim), blocks_here[1].view(*q.shape[:3], 1)))
        assert attended_parts  # the open tail is always attended, staged or in place
        page_parts = []  # where the pages are attended in place: (out, lse, each page's own lse [B, H_q, P])
        pending = None  # ... and the read of their misses on disk, in flight while the rest copy is attended
        if here is not None:
            assert attended is not None
            self.counters.pages_selected += chosen_pages
            in_memory = self.inplace.memory_pages(layer, attended, per, page, host_query, mask, start, stop, scaling,
                                                  softcap)  # fmt: skip
            page_parts += [in_memory] if in_memory is not None else []
            pending = self.inplace.start_disk_pages(layer, here, attended, per, page)
        try:
            attended_parts += [(page_out.view(*q.shape[:3], 1, dim), part_lse.view(*q.shape[:3], 1))
                               for page_out, part_lse, _ in page_parts]
            if self._unread is not None and rest and summaries.table(layer) is not None:
                read = columns if pages is None else pages
                # pruned against the mass read so far: the disk pages in flight are not in it yet, so fewer pages
                # are left out than against all of it (the bound holds all the more)
                unread = self.rest.from_copy(layer, self._unread, start, stop, read, per, q, mask, scaling, softcap,
                                             summaries, [part_lse for _, part_lse in attended_parts], self._bound) \
                    if budget.rest_bits else self.rest.from_means(layer, self._unread, start, stop, read, per, q, mask,
                                                                  scaling, softcap, summaries, self._means)
                attended_parts += [unread] if unread is not None else []  # the pages not read, from their copy
            if pending is not None:
                assert attended is not None
                page_parts.append(self.inplace.attend_disk_pages(layer, pending, attended, per, page, host_query, mask,
                                                                 start, stop, scaling, softcap))  # fmt: skip
                attended_parts.append((page_parts[-1][0].view(*q.shape[:3], 1, dim),
                                       page_parts[-1][1].view(*q.shape[:3], 1)))  # fmt: skip
                pending = None
        finally:
            if pending is not None and pending.read is not None:
                pending.read.settle()
        out, lse = merge_all(attended_parts)  # one softmax over every part
        page_lse = None
        if page_parts:  # each page is in one part: -inf in the others
            page_lse = page_parts[0][2] if len(page_parts) == 1 else torch.logaddexp(page_parts[0][2], page_parts[1][2])
        if blocks_here is not None and disk_blocks is not None:  # the disk blocks' own: their pages' (after the
            assert page_lse is not None  # selection's)
            blocks_here = (*blocks_here[:2], self.inplace.with_disk_blocks(blocks_here[2], page_lse[:, :, picked:],
                                                                   disk_blocks[1]))  # fmt: skip
            page_lse = page_lse[:, :, :picked] if picked else None
        units = [(columns, bt, None if blocks_here is None else blocks_here[2])]
        units += [(pages, page, page_lse)] if pages is not None and picked else []
        attended = columns if pages is None else np.concatenate((columns, pages // per), axis=1)
        mass = self._shares(layer, units, pieces, lse, wants_mass, sticky)
        self._promote(layer, attended, mass, columns, staging if blocks_here is None else None)
        self._count_moved(moved)
        self._count_attended(layer, parts, columns, here is not None and pages is not None, chosen_pages, page,
                             blocks_here is not None, start, stop, masked)
        self._left_at = time.perf_counter()
        return out.reshape(batch, heads, 1, dim), lse.reshape(batch, heads, 1)

    def _shares(self, layer: int, units: list, pieces: list, lse: torch.Tensor, wants_mass: bool,
                sticky: bool) -> torch.Tensor | None:
        """Each selected unit's measured share of each query head's softmax (``lse``: the merged log-sum-exp, shaped
        as the query's groups), kept for the layer's sticky units (``sticky``) and returned for the policy
        (``wants_mass``: ``[B, K]``, averaged over heads; else None). ``units``: (chosen ``[B, K]``, tokens each,
        their own log-sum-exp ``[B, H_q, K]``, or None: from the staged ``pieces``' weights)."""
        if not (wants_mass or sticky):
            self._sticky.pop(layer, None)
            return None
        batch = units[0][0].shape[0]
        staged = iter(weights * torch.exp(part_lse - lse)[..., None] for weights, part_lse in pieces)
        unit_shares = [_unit_shares(next(staged), chosen.shape[1], size) if own is None  # [B, H_q, K] each
                       else torch.exp(own - lse.reshape(batch, -1, 1)) for chosen, size, own in units]
        if sticky:  # the selected units' measured shares: blocks, or pages where pages are the unit
            chosen, measured = units[-1][0], unit_shares[-1]
            strongest = measured.amax(dim=1)  # [B, K]: the most some query head gave each
            self._sticky[layer] = (chosen, strongest.masked_fill(strongest < self.sticky_share, 0.0))
        else:
            self._sticky.pop(layer, None)  # never a share older than the previous step
        return torch.cat([s.mean(dim=1) for s in unit_shares], dim=1) if wants_mass else None

    def _in_place(self, layer: int, batch: int, columns: np.ndarray, pages: np.ndarray | None, per: int, page: int,
                  start: int, in_place: bool) -> tuple[bool, KeptLayer | None, np.ndarray | None,
                                                      tuple[np.ndarray, np.ndarray] | None]:
        """Where a CPU host attends a selection (``in_place``: it may): whether the whole blocks of ``columns`` are
        attended in their slabs; the kept layer of the pages attended in place (None: staged); those pages (the
        selection's, then the disk blocks' as pages); the disk blocks' pages
        (:meth:`SparseInPlace.disk_block_pages`; None: none, or the whole blocks staged)."""
        here: KeptLayer | None = None
        for _ in range(3):  # until no allocation came after the look at the tiers (a kept layer's may move blocks)
            disk_blocks = self.inplace.disk_block_pages(layer, columns, per, page, start) \
                if in_place and per > 1 else None  # fmt: skip
            extra = None if disk_blocks is None else disk_blocks[0]
            attended = pages if extra is None else extra if pages is None else np.concatenate((pages, extra), axis=1)
            if attended is None or not attended.shape[1]:
                here = None
                break
            if here is not None and here.capacity >= attended.shape[1]:
                break
            here = self._pages_here(layer, batch, attended.shape[1], page)
            if here is None:
                break
        else:
            here = None  # the blocks kept moving: stage them this step
        if in_place and (disk_blocks is None or here is not None):  # (whole-block selection: only with none on disk)
            return True, here, attended, disk_blocks
        if disk_blocks is not None:  # the kept layer cannot hold them: every whole block staged, pages as selected
            picked = 0 if pages is None else pages.shape[1]
            return False, self._pages_here(layer, batch, picked, page) if picked else None, pages, None
        return False, here, attended, None

    def _block_part(self, columns: np.ndarray, staging: torch.Tensor, start: int, stop: int,
                    mask: torch.Tensor | None, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor | None]:
        """Keys, values and bias (None: none needed) of the whole blocks ``columns`` staged in ``staging``."""
        bt = self.store.block_tokens
        tokens = _attended_prefix(columns, bt, start, stop, mask)
        bias = None
        if tokens is None:  # a mask, or a first block partly before ``start``: mask the selection's tokens
            tokens = _staged_tokens(columns, bt, stop)
            bias = _selection_bias(columns, bt, start, stop, mask, query.dtype, query.device)[..., :tokens]
        return staging[0, :, :, :tokens], staging[1, :, :, :tokens], bias

    @staticmethod
    def _attend_parts(q: torch.Tensor, parts: list, weighted: bool, scaling: float,
                      softcap: float | None) -> tuple[torch.Tensor | None, torch.Tensor | None, list]:
        """One softmax over every part (keys, values, bias), merged by log-sum-exp: (out, lse; None without parts),
        and with
        ``weighted`` each part's keys' weights in its own softmax ``[B, H_kv, G, 1, T]`` and log-sum-exp (the
        attention's own: no second scoring)."""
        out = lse = None
        pieces = []
        for keys, values, bias in parts:
            if weighted:
                part_out, weights, part_lse = weighted_attention(q, keys, values, bias, scaling, softcap)
                pieces.append((weights, part_lse))
            else:
                part_out, part_lse = partial_attention(q, keys, values, bias, scaling, softcap)
            out, lse = merge(out, lse, part_out, part_lse)
        return out, lse, pieces

    # ---------------------------------------------------------------------------------- selection
    def _select(self, layer: int, start: int, stop: int, context: int, q: torch.Tensor, budget: SparseBudget,
                summaries, scaling: float, softcap: float | None, per: int) -> tuple[np.ndarray, np.ndarray | None]:
        """What each row reads: grid columns read whole ``[B, K]`` ascending, and pages ``[B, P]`` ascending as
        ``column · per + page`` (None where the page is the block, ``per`` 1: the top-scored blocks are then among
        the columns). Whole: the recent window (the open tail at least), and with ``per`` 1 the sink blocks too;
        pages: the sinks (the first ``sinks`` tokens from ``start``, in pages) and the top-scored pages."""
        store = self.store
        bt = store.block_tokens
        rows = store.table.rows[layer]
        first, end = start // bt, -(-stop // bt)
        page = bt // per
        wanted = budget.budget_tokens(context)
        if layer < budget.dense_layers or wanted >= stop - start:  # dense, or a budget covering every column
            total = (end - first) * per
        else:
            total = budget.budget_blocks(context, (end - first) * per, page, len(store.layouts))
        sink_tokens = (bt if per == 1 else page) if budget.sinks is None else budget.sinks  # default: one unit
        recent_tokens = budget.recent or 0  # default: the open tail only
        recent_from = min(end - 1, max(start, stop - recent_tokens) // bt)  # the tail column at least
        recent = (end - 1 - recent_from) * per + -(-(stop - (end - 1) * bt) // page)  # its units, the tail's filled
        sinks = min(recent_from - first, -(-sink_tokens // bt)) if per == 1 else 0  # whole sink blocks, not recent
        lo, hi = first + sinks, recent_from  # candidates: blocks [lo, hi), all full
        tail = self._tail_pages(layer, stop, page) if per > 1 and recent_from == end - 1 else None
        if tail is not None:  # the open tail's full pages compete too: only the newest token's page is forced
            recent -= tail.shape[2]
        top = total - sinks - recent  # units (pages, or blocks where per is 1) to select
        self.counters.layer_steps += 1
        competing = (hi - lo) * per + (0 if tail is None else tail.shape[2])
        self._scored = 0 < top < competing
        self._unread = None
        self._tail_kept = None
        self._bound = self._means = None
        batch = rows.batch
        if top >= competing:  # the budget covers every block: read them all (exact)
            self.counters.exact_layer_steps += 1
            return np.arange(first, end)[None].repeat(batch, axis=0), None
        self._unread = (lo, hi) if hi > lo else None  # (no candidate block: none left for the rest copy)
        head, tail_columns = np.arange(first, lo), np.arange(recent_from, end)
        if top <= 0:
            chosen = np.empty((batch, 0), dtype=np.int64)
        else:
            offset = start // page - lo * per if per > 1 else 0  # pages before the window's start
            score = self._scores(layer, rows, lo, hi, q, summaries, scaling, softcap, tail, offset)  # [B, C·per (+ E)]
            if per > 1:  # pages before the window's start never; the sink pages always
                score[:, :offset] = -math.inf
                score[:, offset : offset + -(-sink_tokens // page)] = math.inf
            score = self._with_sticky(layer, lo * per, lo * per + score.shape[1], score)
            self._ranked = (layer, lo, score) if per == 1 else None
            chosen = score.topk(top, dim=1).indices.sort(dim=1).values.cpu().numpy() + lo * per
        recent_columns = tail_columns[None].repeat(batch, axis=0)  # (a method: np.broadcast_to costs ~6 calls)
        if per == 1:
            return np.concatenate((head[None].repeat(batch, axis=0), chosen, recent_columns), axis=1), None
        if tail is not None:  # the tail's chosen pages are attended in it (read whole, from its slot): -1 here
            in_tail = chosen >= (end - 1) * per
            self._tail_kept = (np.where(in_tail, chosen - (end - 1) * per, -1), tail.shape[2])
            chosen = np.where(in_tail, -1, chosen)[:, : chosen.shape[1] - int(in_tail.sum(axis=1).min())]
        return recent_columns, chosen

    def _scores(self, layer: int, rows, lo: int, hi: int, q: torch.Tensor, summaries, scaling: float,
                softcap: float | None, extra: torch.Tensor | None = None, before: int = 0) -> torch.Tensor:
        """Each row's score of the pages of candidate columns ``[lo, hi)``, then of the ``extra`` summaries
        ``[B, H_kv, E, 4·D]`` (the open tail's full pages): ``[B, C · pages + E]`` (one vectorized pass, no
        loop; one softmax over them all). The first ``before`` pages lie before a sliding window's start: they
        take no share of the softmax (a key outside the window would lower every page's share inside it). In CPU
        memory the C kernel (:mod:`~tierkv.attention.score_kernel`) reads the candidates' summaries where the
        table holds them; elsewhere, and where the page means are attended (they are gathered anyway), torch
        gathers them and runs the same computation."""
        table = summaries.table(layer)
        found = self.rest.rows(layer, rows, lo, hi, summaries, q.device)
        index, missing = found.index, found.missing
        batch, columns = rows.batch, hi - lo
        pages = summaries.pages(self.store.block_tokens)
        if table is None:
            return torch.zeros((batch, columns * pages + (0 if extra is None else extra.shape[2])), device=q.device)
        heads = table.shape[0]
        budget = self.budget
        means = budget is not None and budget.rest_means and not budget.rest_bits  # the page means attend the rest
        vectors = 4 if means else 3  # the values' mean is read only when it is attended
        query = (q[:, :, :, 0].float() * scaling).contiguous()  # [B, H_kv, G, D]
        dim = query.shape[-1]
        self.counters.summary_bytes_read += heads * index.numel() * pages * vectors * dim * table.element_size()
        stacked = None  # [B, H_kv, C·pages (+ E), vectors·D]: the rows gathered (torch; the means come from it)
        scored = None  # (bound, logits) [B, H_kv, G, C·pages] each
        if not means and score_kernel.runs_on(table.device):  # read where they are: nothing gathered
            entries = (index.view(batch, columns, 1) * pages + torch.arange(pages)).view(batch, -1)  # [B, C·pages]
            scored = score_kernel.page_scores(query, table.flatten(1, 2), entries)
        if scored is None:  # [H_kv, B·C, pages, 4, D] -> rows of (min, max, mean[, mean value])
            gathered = table[:, :, :, :vectors].index_select(1, index)
            stacked = gathered.view(heads, batch, columns * pages, -1).transpose(0, 1).float()
            scored = score_kernel.page_scores_torch(query, stacked)
        bound, logits = scored
        if extra is not None:
            tail = extra[..., : vectors * dim].float()  # [B, H_kv, E, vectors·D]
            tail_bound, tail_logits = score_kernel.page_scores_torch(query, tail)
            bound, logits = torch.cat((bound, tail_bound), dim=-1), torch.cat((logits, tail_logits), dim=-1)
            stacked = None if stacked is None else torch.cat((stacked, tail), dim=2)
            if missing is not None:
                missing = torch.nn.functional.pad(missing.repeat_interleave(pages, dim=1), (0, extra.shape[2]))
                pages = 1
        if softcap is not None:  # monotonic: a capped bound still bounds the capped logits
            logits = torch.tanh(logits / softcap) * softcap
            bound = torch.tanh(bound / softcap) * softcap
        self._bound = (layer, bound if missing is None else bound.masked_fill(
            missing.repeat_interleave(pages, dim=1)[:, None, None], math.inf))
        self._means = (layer, stacked[..., 2 * dim :]) if means and stacked is not None else None
        if before > 0:  # (finite: a row of nothing else stays a softmax, not NaN)
            logits = logits.clone()
            logits[..., :before] = torch.finfo(logits.dtype).min
        share = torch.softmax(logits, dim=-1)  # each head's estimated attention share
        score = share.flatten(1, 2).amax(dim=1)  # [B, C·pages]: the most any query head would give the page
        return score if missing is None else score.masked_fill(missing.repeat_interleave(pages, dim=1), math.inf)

    def _tail_pages(self, layer: int, stop: int, page: int) -> torch.Tensor | None:
        """Summaries ``[B, H_kv, E, 4·D]`` of the full pages of each row's open tail before the one that holds the
        newest token (E of them), computed from its device slot (the store keeps none: a tail changes every step)
        when a page fills and kept until then (a full page's tokens change only by a table edit, which
        :meth:`invalidate` follows, or a new or moved tail, which changes the grid's version); None where a tail
        is not on the device or has no such page."""
        bt = self.store.block_tokens
        full = (stop - 1 - (-(-stop // bt) - 1) * bt) // page  # pages of the tail before the newest token's
        key = (self.store.table.rows[layer].version, full, page)
        cached = self._tail_cache.get(layer)
        if cached is not None and cached[0] == key:
            return cached[1]
        _, views = self.store.tail_views(layer)
        if full == 0 or any(view is None for view in views):
            return None
        tails = torch.stack([view[:, :, : full * page] for view in views])  # type: ignore[index]
        paged = tails.unflatten(3, (full, page))  # [B, 2, H_kv, E, page, D]
        self.counters.summary_bytes_read += tails.numel() * tails.element_size()
        keys, values = paged[:, 0], paged[:, 1]
        summary = torch.stack((keys.amin(3), keys.amax(3), keys.float().mean(3).to(keys.dtype),
                               values.float().mean(3).to(keys.dtype)), dim=3).flatten(3)
        self._tail_cache[layer] = (key, summary)
        return summary

    def _with_sticky(self, layer: int, lo: int, hi: int, score: torch.Tensor) -> torch.Tensor:
        """``score`` ``[B, C]`` of candidate units (pages, or blocks) ``[lo, hi)``, raised to the share a unit got
        from some query head at the layer's previous step where that share was at least ``sticky_share``. Why: a
        head that copies (the digits of a retrieved number, one per step) keeps attending the unit it read from,
        and the summaries can miss it on the next step (docs/quality.md: both multi-needle misses on 8-token
        blocks dropped the number's last digit); a measured share is no estimate. One scatter, no loop."""
        previous = self._sticky.get(layer)
        if previous is None or previous[0].shape[0] != score.shape[0]:
            return score
        columns, shares = previous  # shares: 0 where below sticky_share
        candidate = columns - lo  # [B, K]: positions among the candidates (the others get share 0)
        inside = (candidate >= 0) & (candidate < hi - lo)
        index = torch.from_numpy(np.where(inside, candidate, 0)).to(score.device)
        # scores and shares are >= 0: an amax scatter into the scores raises each block to its share, in one op
        return score.scatter_reduce(1, index, shares * torch.from_numpy(inside).to(score.device), "amax")

    # ---------------------------------------------------------------------------------- reading
    def _fill(self, layer: int, columns: np.ndarray, staging: torch.Tensor, keep: bool) -> None:
        """Put the blocks of ``columns`` ``[B, K]`` into ``staging`` in order: those kept from earlier steps by
        one gather, the others by one read, which the kept layer then keeps as far as it has room
        (:mod:`tierkv.attention.kept`); without a kept layer (or ``keep`` False: the layer keeps pages), one read."""
        store = self.store
        rows = store.table.rows[layer]
        kept = self.kept.layer(layer, rows.batch, columns.shape[1]) if keep else None
        if kept is None:
            plan, hits = self._read_selection(layer, rows, columns, staging)
            self._count(layer, plan, columns, 0, hits)
            return
        ids = rows.ids[np.arange(rows.batch)[:, None], columns]  # [B, K]
        tail = columns == rows.count - 1
        placed = kept.place(ids, columns, tail, self.counters.layer_steps)
        layout = store.layouts[layer]
        kept.gather(layout, placed, staging)  # first: the read below overwrites the positions it does not hold
        targets = placed.targets
        if tail[:, -1].all():  # the open tail (every row's last column) copied from its slot, not planned
            copied = self.sparse_blocks.copy_open_tails(layer, staging, np.full(rows.batch, columns.shape[1] - 1))
            if copied:
                counters = self.counters
                counters.bytes_fetched += copied
                counters.by_tier[Tier.DEVICE.label] = counters.by_tier.get(Tier.DEVICE.label, 0) + rows.batch
                targets = targets.copy()
                targets[:, -1] = -1
        plan, hits = self._read_selection(layer, rows, targets, staging)
        kept.hold(layout, placed, ids, staging)
        self.sparse_blocks.count_reused(layer, placed.reused)
        self._count(layer, plan, columns, placed.reused, hits)

    def _read_selection(self, layer: int, rows, targets: np.ndarray, dest: torch.Tensor) -> tuple[ReadPlan, int]:
        """Read grid columns ``targets`` ``[B, P]`` (-1: none) into ``dest``'s positions: the blocks a speculation
        holds out of its buffer, the others with one ReadPlan. Returns the plan and the speculated hits."""
        store = self.store
        claim = self.speculation.claim(layer, rows, targets)
        if claim is None and not (targets >= 0).any():  # every block held already: nothing to plan
            return ReadPlan(layer, 0, 0, ()), 0
        plan = store.plan_columns(layer, targets if claim is None else np.where(claim.hits, -1, targets))
        if plan.parts:
            self._read(layer, plan, dest)
        if claim is None:
            return plan, 0
        if not self.speculation.land(claim, dest):  # the speculative read failed: read them the ordinary way
            self._read(layer, store.plan_columns(layer, np.where(claim.hits, targets, -1)), dest)
        return plan, int(np.count_nonzero(claim.hits))

    # ---------------------------------------------------------------------------------- speculation
    def _speculate_after(self, layer: int) -> None:
        """Layer ``layer`` starts attending: submit the disk read of the next layer's likely selection (after the
        last layer, layer 0's, for the next step)."""
        if not self.speculate:
            return
        following = self.next_layer(layer)
        if following is None:
            return
        kept = self.kept.layers.get(following)
        whole = kept if kept is not None and kept.unit_tokens == self.store.block_tokens else None  # pages: no guess
        nbytes = self.speculation.launch(following, whole.ids if whole is not None else None)
        if nbytes and self.timeline is not None:  # the step's disk traffic, read off its path (as a prefetch is)
            self.timeline.add_reads(following, [ReadTiming(link(Tier.DISK, Tier.DEVICE), nbytes, 1)], sync=False)

    def _runners_up(self, layer: int, columns: np.ndarray) -> np.ndarray | None:
        """The ``speculate_runners`` best-scored candidates of this layer-step that it did not select ``[B, r]``
        (grid columns), from the scores it just computed; None without scores or runners."""
        ranked, self._ranked = self._ranked, None
        if not self.speculate_runners or ranked is None or ranked[0] != layer:
            return None
        _, lo, score = ranked
        rest = score.float().cpu().numpy().copy()  # [B, C]
        candidate = np.asarray(columns) - lo
        row, position = np.nonzero((candidate >= 0) & (candidate < rest.shape[1]))
        rest[row, candidate[row, position]] = -np.inf  # the selected ones out
        count = min(self.speculate_runners, rest.shape[1] - int(np.bincount(row, minlength=rest.shape[0]).max()))
        if count <= 0:
            return None
        return np.argpartition(-rest, count - 1, axis=1)[:, :count] + lo

    def _read(self, layer: int, plan: ReadPlan, dest: torch.Tensor, claim: bool = True) -> None:
        timings = self._read_now(layer, plan, dest, claim)
        if self.timeline is not None:
            self.timeline.add_reads(layer, timings, sync=True)

    def _read_unclaimed(self, layer: int, plan: ReadPlan, dest: torch.Tensor) -> None:
        """A read outside the selection's (the summaries' backfill), in the step's telemetry like the others."""
        self._read(layer, plan, dest, claim=False)

    # ---------------------------------------------------------------------------------- promotion
    def _promote(self, layer: int, attended: np.ndarray, mass: torch.Tensor | None, columns: np.ndarray,
                 staging: torch.Tensor | None) -> None:
        """Tell the policy what was attended (``attended`` ``[B, A]``: the block of every unit read, with its
        ``mass``); copy the blocks it wants up to the device in one batched write: from staging where they were
        read whole (``columns``; found with one vectorized comparison), else read whole now from their tier (a
        block read in pages: at most :data:`~tierkv.attention.sparse_store.PROMOTE_PER_LAYER` per layer-step,
        counted on its link like any read), so hot pages' blocks gather on the device. ``staging`` None: the
        blocks were attended in place (a CPU host), none staged."""
        weights = mass.cpu().numpy() if mass is not None else None
        wanted = self.sparse_blocks.attended(layer, attended, weights)
        if not wanted:
            return
        store = self.store
        rows = store.table.rows[layer]
        ids = rows.ids[np.arange(rows.batch)[:, None], columns]  # [B, K]
        match = ids.ravel()[None, :] == np.array([b.id for b in wanted])[:, None]  # [n, B·K]
        if staging is None:
            match[:] = False
        found = match.any(axis=1)
        kept = self.kept.layers.get(layer)
        if kept is not None and kept.unit_tokens < store.block_tokens and not found.all():
            # the layer keeps its hot pages on the device already: a whole block read to promote one would cost
            # more than the reads it saves; only blocks staged whole move up
            wanted = [b for b, hit in zip(wanted, found.tolist()) if hit]
            if not wanted:
                return
            match, found = match[found], found[found]
        bt, layout = store.block_tokens, store.layouts[layer]
        if staging is None:
            data = torch.empty((len(wanted), *layout.shape), dtype=layout.dtype, device=store.device.device)
        else:
            row, position = np.divmod(np.argmax(match, axis=1), columns.shape[1])
            blocks = staging.unflatten(3, (-1, bt))  # [2, B, H_kv, K, bt, D]
            device = staging.device
            data = blocks[:, torch.from_numpy(row).to(device), :, torch.from_numpy(position).to(device)]  # [n, 2, ...]
        if not found.all():  # read in pages only: their blocks whole, from each tier
            for tier in {wanted[i].tier for i in np.flatnonzero(~found).tolist()}:
                picked = [i for i in np.flatnonzero(~found).tolist() if wanted[i].tier == tier]
                data[picked] = store.transfer.read_blocks(layout, tier, [wanted[i].slot for i in picked])
                store.transfer.count(link(tier, Tier.DEVICE), len(picked) * bt * layout.token_bytes)
        self.counters.promotions += self.sparse_blocks.promote(wanted, data, ids)

    def _read_pages(self, layer: int, pages: np.ndarray, per: int, page: int, dest: torch.Tensor) -> None:
        """Put pages ``pages`` ``[B, P]`` (``column · per + page``; -1: none) into ``dest`` ``[2, B, H_kv, P · page,
        D]``: those the layer kept from earlier steps by one gather (counted on ``device->device``), the others by
        one page read per tier (:meth:`KVStore.read_pages`), which the kept layer then keeps as far as it has room."""
        store, counters = self.store, self.counters
        before = self._moved_in()
        rows = store.table.rows[layer]
        kept = self.kept.layer(layer, rows.batch, pages.shape[1], page)
        targets = pages
        if kept is not None:
            none = pages < 0
            columns = np.where(none, 0, pages // per)
            ids = np.where(none, -1, rows.ids[np.arange(rows.batch)[:, None], columns] * per + pages % per)
            placed = kept.place(ids, pages, none, counters.layer_steps)
            layout = store.layouts[layer]
            kept.gather(layout, placed, dest)  # first: the read below overwrites the positions it does not hold
            targets = placed.targets
        if (targets >= 0).any():
            columns, index = np.divmod(targets, per)
            store.read_pages(layer, columns, index, page, dest)
        if kept is not None:
            kept.hold(layout, placed, ids, dest)
            counters.pages_reused += placed.reused
            store.transfer.count(link(Tier.DEVICE, Tier.DEVICE), placed.reused * page * layout.token_bytes)
        counters.pages_selected += int(np.count_nonzero(pages >= 0))
        counters.add_fetched(before, self._moved_in())

    def _pages_here(self, layer: int, batch: int, picked: int, page: int) -> KeptLayer | None:
        """The kept layer for the disk pages of a selection attended in place (``SparseInPlace.start_disk_pages``),
        or None: attended from staging. In place where the device is the host's memory (the host kernel reads every
        tier's slab there) and the layer keeps pages with room for a whole selection (every miss has a position)."""
        if not self.inplace.host_only():
            return None
        kept = self.kept.layer(layer, batch, picked, page)
        return kept if kept is not None and kept.capacity >= picked else None

    # ---------------------------------------------------------------------------------- telemetry
    def _count_attended(self, layer: int, parts: list, columns: np.ndarray, pages_in_place: bool, chosen_pages: int,
                        page: int, blocks_in_place: bool, start: int, stop: int, masked: int = 0) -> None:
        """Count a layer-step's reads on the device: the staged ``parts`` (keys, values, bias), the ``chosen_pages``
        selected (read by the kernel where ``pages_in_place``) and the whole blocks (likewise); ``masked`` of the
        staged tokens were read but not attended (the open tail's pages the selection left out)."""
        counters = self.counters
        token_bytes = self.store.layouts[layer].token_bytes
        batch = columns.shape[0]
        counters.staged_bytes_read += sum(k.numel() * k.element_size() for k, _, _ in parts) * 2  # K and V
        if pages_in_place:  # the pages attended in place: read once, by the kernel
            counters.staged_bytes_read += chosen_pages * page * token_bytes
        whole = _staged_tokens(columns, self.store.block_tokens, stop) if blocks_in_place else parts[0][0].shape[2]
        if blocks_in_place:  # the blocks attended in place: read once, by the kernel
            counters.staged_bytes_read += batch * whole * token_bytes
        counters.tokens_read += batch * whole - masked + chosen_pages * page
        bt = self.store.block_tokens
        first = start // bt  # the block the step's first token is in (a sliding window starts inside one)
        counters.blocks_total += batch * (-(-stop // bt) - first)
        counters.tokens_total += batch * (stop - first * bt)

    def _moved_in(self) -> dict[str, int]:
        """The store's byte counters of the links into the device, now."""
        moved = self.store.transfer.bytes_moved
        return {name: moved.get(name, 0) for name in _INTO_DEVICE}

    def _count_moved(self, before: dict[str, int]) -> None:
        """Add what moved into the device since ``before`` (:meth:`_moved_in`) to the per-link counts."""
        link_bytes = self.counters.link_bytes
        for name, nbytes in self._moved_in().items():
            if nbytes != before.get(name, 0):
                link_bytes[name] = link_bytes.get(name, 0) + nbytes - before.get(name, 0)

    def _count(self, layer: int, plan: ReadPlan, columns: np.ndarray, reused: int, speculated: int) -> None:
        store, counters = self.store, self.counters
        bt = store.block_tokens
        layout = store.layouts[layer]
        tail_tokens = store.table.tail(layer).tokens
        counters.blocks_selected += columns.size
        counters.blocks_reused += reused
        if speculated:  # full disk blocks read ahead (their bytes counted in bytes_moved when submitted)
            nbytes = speculated * bt * layout.token_bytes
            counters.bytes_fetched += nbytes
            counters.bytes_fetched_off_device += nbytes
            counters.by_tier[Tier.DISK.label] = counters.by_tier.get(Tier.DISK.label, 0) + speculated
        for part in plan.parts:
            nbytes = (part.blocks * bt - part.tail_blocks * (bt - tail_tokens)) * layout.token_bytes
            counters.bytes_fetched += nbytes
            if part.tier != store.chain[0]:
                counters.bytes_fetched_off_device += nbytes
            counters.by_tier[part.tier.label] = counters.by_tier.get(part.tier.label, 0) + part.blocks

    def _begin_layer(self, span: Span) -> None:
        """A layer at or below the last one starts a new pass (a decode step)."""
        layer = span.layer
        new_step = layer <= self.last_layer or self.last_layer < 0
        if new_step:
            self.counters.steps += 1
        timeline = self.timeline
        now = time.perf_counter()
        if timeline is not None:
            if self._left_at is not None and timeline.current is not None:
                timeline.add_compute(self.last_layer, now - self._left_at)
            if new_step or timeline.current is None:
                timeline.begin_step(now, 1, span.stop, 0)
        self._see_layer(span)

    # ---------------------------------------------------------------------------------- staging
    def _staging(self, layer: int, batch: int, columns: int, page_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The staging buffer for ``layer``'s layout as two contiguous parts: ``[2, B, H_kv, columns ·
        block_tokens, D]`` for whole blocks, and ``[2, B, H_kv, page_tokens, D]`` for pages after it."""
        layout = self.store.layouts[layer]
        whole = batch * columns * self.store.block_tokens * layout.token_bytes
        nbytes = whole + batch * page_tokens * layout.token_bytes
        staging = self.staging
        if not nbytes:  # everything attended in place (a CPU host): no staging at all (one empty view, kept)
            empty = self._unstaged.get((layout, batch))
            if empty is None:
                shape = (2, batch, layout.kv_heads, 0, layout.head_dim)
                empty = self._unstaged[(layout, batch)] = torch.empty(shape, dtype=layout.dtype,
                                                                      device=self.store.device.device)
            return empty, empty
        if not staging.buffers or staging.buffers[0].numel() < nbytes:
            grown = max(nbytes, int(staging.reserved * GROWTH))
            staging.release()
            staging.allocate(1, grown)  # the kept units give way if the device has no other room for it
        flat = staging.buffers[0]
        heads, dim = layout.kv_heads, layout.head_dim
        return (flat[:whole].view(layout.dtype).view(2, batch, heads, columns * self.store.block_tokens, dim),
                flat[whole:nbytes].view(layout.dtype).view(2, batch, heads, page_tokens, dim))

    # ---------------------------------------------------------------------------------- control
    def invalidate(self) -> None:
        self.rest.forget()
        self._tail_cache.clear()
        self._sticky.clear()
        self.kept.clear()
        self.speculation.drop()

    def reset(self) -> None:
        self.invalidate()

    def drop(self, layer: int) -> None:
        self.rest.forget(layer)
        self._tail_cache.pop(layer, None)
        self._sticky.pop(layer, None)
        self.kept.clear(layer)
        self.speculation.forget(layer)

    def wait_all(self) -> None:
        self.speculation.settle()  # speculative reads are the only ones in flight between calls

    def release_staging(self) -> None:
        self.invalidate()
        self.staging.release()
        self.kept.release()

    def close(self) -> None:
        self.release_staging()
        self.kept.close()


def _attended_prefix(columns: np.ndarray, bt: int, start: int, stop: int, mask: torch.Tensor | None) -> int | None:
    """How many leading tokens of the staged selection are attended when no bias is needed, else None.

    Without a mask, and with every row's first block at or after ``start``, the only staged tokens outside
    ``[start, stop)`` are the open tail's empty slots, and the tail is every row's last selected block: attending
    the first ``(K - 1) · bt + tail tokens`` is exact, with no bias to build or add (a decode step's usual case)."""
    end = -(-stop // bt)
    if mask is not None or columns.shape[1] == 0:
        return None
    if (columns[:, 0] * bt < start).any() or (columns[:, -1] != end - 1).any():
        return None
    return _staged_tokens(columns, bt, stop)


def _staged_tokens(columns: np.ndarray, bt: int, stop: int) -> int:
    """Staged tokens the bias path attends: every selected block's, less the open tail's empty slots where the
    tail is every row's last block — never-written slab memory there may hold NaN, and a zero weight times NaN
    is NaN, so those slots are not attended at all."""
    count = columns.shape[1]
    end = -(-stop // bt)
    if count and (columns[:, -1] == end - 1).all():
        return (count - 1) * bt + stop - (end - 1) * bt
    return count * bt


def _selection_bias(columns: np.ndarray, bt: int, start: int, stop: int, mask: torch.Tensor | None,
                    dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive bias ``[B, 1, 1, K·bt]`` over the selected blocks' tokens (:func:`_bias`)."""
    cols = torch.from_numpy(np.array(columns, dtype=np.int64)).to(device)  # a copy: broadcast views are read-only
    return position_bias((cols[:, :, None] * bt + torch.arange(bt, device=device)).flatten(1), start, stop, mask, dtype)


def _page_bias(pages: np.ndarray, per: int, page: int, start: int, mask: torch.Tensor | None,
               candidates: tuple[int, int] | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Additive bias ``[B, 1, 1, P·page]`` over the selected pages' tokens (:func:`_bias`); None where none is
    needed: no mask, and every candidate block (``[lo, hi)``, all full) at or after ``start``."""
    unread = pages < 0  # positions the read left alone (pages chosen in the open tail)
    if mask is None and candidates is not None and candidates[0] * per * page >= start and not unread.any():
        return None
    firsts = torch.from_numpy((pages // per * per * page + pages % per * page).astype(np.int64)).to(device)
    positions = (firsts[:, :, None] + torch.arange(page, device=device)).flatten(1)  # [B, P·page]
    positions = positions.masked_fill(torch.from_numpy(unread).to(device).repeat_interleave(page, dim=1), -1)
    return position_bias(positions, start, int(positions.max()) + 1, mask, dtype)


def _tail_bias(bias: torch.Tensor | None, chosen: np.ndarray, pages: int, page: int, tokens: int,
               query: torch.Tensor) -> torch.Tensor:
    """``bias`` (None: zeros) ``[B, 1, 1, tokens]`` over the open tail's staged tokens, with its first ``pages`` full
    pages masked out but those ``chosen`` ``[B, P]`` (page indexes in the tail, -1: none)."""
    batch = chosen.shape[0]
    allowed = np.zeros((batch, pages + 1), dtype=bool)
    rows, picks = np.nonzero(chosen >= 0)
    allowed[rows, chosen[rows, picks]] = True
    allowed[:, pages] = True  # the newest token's page and after
    index = np.minimum(np.arange(tokens) // page, pages)
    hidden = torch.from_numpy(~allowed[:, index]).to(query.device)[:, None, None]  # [B, 1, 1, tokens]
    if bias is None:
        bias = torch.zeros((batch, 1, 1, tokens), dtype=query.dtype, device=query.device)
    return bias.masked_fill(hidden, torch.finfo(query.dtype).min)


def _unit_shares(weights: torch.Tensor, count: int, size: int) -> torch.Tensor:
    """Each selected unit's (block's or page's) share of each query head's softmax, ``[B, H_q, K]``, from the
    attended tokens' weights ``[B, H_kv, G, 1, T]`` (only the K·size selected tokens of one query: no attention
    matrix)."""
    weights = weights[:, :, :, 0]  # [B, H_kv, G, T]
    weights = torch.nn.functional.pad(weights, (0, count * size - weights.shape[-1]))  # the tail's empty slots
    return weights.unflatten(-1, (count, size)).sum(-1).flatten(1, 2)  # [B, H_q, K]
