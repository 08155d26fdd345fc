"""The host's paged decode-attention kernel (``native/tierkv_attn.c``) and its torch version, against plain
float64 softmax attention over the same keys laid out contiguously, and against torch's SDPA.

K/V are placed the way a memory tier holds them: blocks ``[2, H_kv, block_tokens, D]`` in shuffled slots of a
uint8 slab whose slots are padded to the I/O alignment (``BlockLayout.blocks_of``), optionally split into
several chunks like a growing ``SlabPool``.
"""

from __future__ import annotations

import logging
import math
import shutil

import numpy as np
import pytest
import torch
from helpers import check_extension_loads_first
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv import settings as tierkv_settings
from tierkv.attention import host_kernel
from tierkv.attention.lse import merge
from tierkv.errors import InvalidConfigError
from tierkv.layout import BlockLayout

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler: the C kernel cannot be built")  # fmt: skip


def _native(*args, **kwargs):
    if not host_kernel.available():
        pytest.fail(f"the C kernel does not load: {host_kernel._build()}")
    return host_kernel.paged_attention(*args, **kwargs)


IMPLEMENTATIONS = [pytest.param(_native, id="native", marks=needs_compiler),
                   pytest.param(host_kernel.paged_attention_torch, id="torch")]  # fmt: skip


class Placed:
    """Contiguous K/V ``[B, H_kv, T, D]`` scattered into the slots of a padded slab (in ``chunks`` pieces)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, block_tokens: int, *, chunks: int = 1,
                 seed: int = 0, spare: int = 3) -> None:  # fmt: skip
        batch, kv_heads, tokens, dim = keys.shape
        self.layout = BlockLayout(kv_heads, dim, block_tokens, keys.dtype)
        n = math.ceil(tokens / block_tokens)
        rng = np.random.default_rng(seed)
        total = batch * n + spare
        self.table = rng.permutation(total)[: batch * n].reshape(batch, n).astype(np.int64)
        raw = torch.full((total, self.layout.slot_bytes), 0xFF, dtype=torch.uint8)  # padding reads as NaN
        blocks = self.layout.blocks_of(raw)
        padded = n * block_tokens
        k = torch.zeros(batch, kv_heads, padded, dim, dtype=keys.dtype)
        v = torch.zeros_like(k)
        k[:, :, :tokens], v[:, :, :tokens] = keys, values
        for b in range(batch):  # test setup, not the code under test
            for j in range(n):
                blocks[self.table[b, j], 0] = k[b, :, j * block_tokens : (j + 1) * block_tokens]
                blocks[self.table[b, j], 1] = v[b, :, j * block_tokens : (j + 1) * block_tokens]
        cuts = sorted(rng.choice(np.arange(1, total), size=min(chunks, total) - 1, replace=False).tolist())
        self.slabs = [self.layout.blocks_of(piece) for piece in torch.tensor_split(raw, cuts)]
        self.slab = self.slabs[0] if chunks == 1 else self.slabs


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: list[int], *, scaling: float,
              softcap: float | None = None, query_start: list[int] | None = None, window: int | None = None,
              bias: torch.Tensor | None = None, mask_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Plain softmax attention in float64 over contiguous keys (positions 0..T-1), GQA by repeating K/V."""
    scores = reference_scores(q, keys, lengths, scaling=scaling, softcap=softcap, query_start=query_start,
                              window=window, bias=bias, mask_start=mask_start)  # fmt: skip
    v = values.double().repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(scores, dim=-1).nan_to_num(0.0), v)
    return out, lse


def reference_entries(scores: torch.Tensor, entries: int, entry_tokens: int) -> torch.Tensor:
    """The log-sum-exp of each run of ``entry_tokens`` keys of :func:`reference_scores`' ``[B, H_q, q, T]``:
    ``[B, H_q, q, entries]`` (keys past ``T`` count as not attended)."""
    padded = torch.nn.functional.pad(scores, (0, entries * entry_tokens - scores.shape[-1]), value=float("-inf"))
    return torch.logsumexp(padded.unflatten(-1, (entries, entry_tokens)), dim=-1)


def reference_scores(q: torch.Tensor, keys: torch.Tensor, lengths: list[int], *, scaling: float,
                     softcap: float | None = None, query_start: list[int] | None = None, window: int | None = None,
                     bias: torch.Tensor | None = None, mask_start: int = 0) -> torch.Tensor:  # fmt: skip
    """:func:`reference`'s float64 logits ``[B, H_q, q, T]``, ``-inf`` where a key is not attended."""
    batch, q_heads, q_len, _ = q.shape
    group = q_heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double() * scaling, k)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    key_pos = torch.arange(keys.shape[2])
    allowed = key_pos[None, None, :] < torch.tensor(lengths)[:, None, None]  # [B, 1, T]
    allowed = allowed.expand(batch, q_len, -1)
    if query_start is not None:
        query_pos = torch.tensor(query_start)[:, None, None] + torch.arange(q_len)[None, :, None]
        allowed = allowed & (key_pos <= query_pos)
        if window is not None:
            allowed = allowed & (key_pos > query_pos - window)
    if bias is not None:  # additive [B or 1, q, M] over positions mask_start..
        allowed = allowed & (key_pos >= mask_start)
        column = (key_pos - mask_start).clamp(0, bias.shape[-1] - 1)
        scores = scores + bias.double()[:, None][..., column]
        scores = scores.clamp_min(torch.finfo(torch.float32).min)
    return scores.masked_fill(~allowed[:, None], float("-inf"))


def _close(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], tol: float = 2e-5) -> None:
    out, lse = got
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want[0], atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want[1], atol=tol, rtol=tol)


def _kv(batch: int, kv_heads: int, tokens: int, dim: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, tokens, dim, generator=gen).to(dtype)
    values = torch.randn(batch, kv_heads, tokens, dim, generator=gen).to(dtype)
    return keys, values


SHAPES = dict(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4, 5]),
    dim=st.sampled_from([64, 128, 8, 20, 33, 72]),
    q_len=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    window=st.one_of(st.none(), st.integers(1, 40)),
    softcap=st.sampled_from([None, 2.0, 30.0]),
    ragged=st.booleans(),
    chunks=st.integers(1, 3),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
"""The random-shape tests' strategies, besides how the keys are cut into table entries."""


@given(**SHAPES, block_tokens=st.sampled_from([1, 3, 16]), tokens=st.integers(1, 70))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
def test_matches_float64_softmax_on_random_shapes(attend, batch, kv_heads, group, dim, block_tokens, tokens, q_len,
                                                  dtype, window, softcap, ragged, chunks, threads, seed):  # fmt: skip
    """Any geometry, dtype, partial last block, per-row length, query count, window and soft-cap: the
    kernel's normalised output and log-sum-exp equal float64 softmax attention over the same keys."""
    q_len = min(q_len, tokens)
    keys, values = _kv(batch, kv_heads, tokens, dim, dtype, seed)
    q = torch.randn(batch, kv_heads * group, q_len, dim, generator=torch.Generator().manual_seed(seed + 1))
    placed = Placed(keys, values, block_tokens, chunks=chunks, seed=seed)
    rng = np.random.default_rng(seed)
    lengths = [int(rng.integers(q_len, tokens + 1)) if ragged else tokens for _ in range(batch)]
    start = [length - q_len for length in lengths]
    scaling = dim**-0.5
    got = attend(q, placed.slab, placed.table, lengths, scaling=scaling, softcap=softcap, window=window,
                 threads=threads)  # fmt: skip
    want = reference(q, keys, values, lengths, scaling=scaling, softcap=softcap, query_start=start, window=window)
    _close(got, want)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_c_kernel_and_the_torch_version_agree(dtype):
    """The fallback is the same function: same inputs, same (output, lse), in every dtype, with a mask."""
    keys, values = _kv(2, 2, 45, 64, dtype, seed=3)
    q = torch.randn(2, 8, 3, 64, generator=torch.Generator().manual_seed(4))
    placed = Placed(keys, values, 16, chunks=2)
    mask = torch.rand(2, 1, 3, 45, generator=torch.Generator().manual_seed(5)) > 0.2
    kwargs = dict(scaling=0.125, softcap=20.0, window=30, mask=mask)
    native = _native(q, placed.slab, placed.table, 45, **kwargs)
    fallback = host_kernel.paged_attention_torch(q, placed.slab, placed.table, 45, **kwargs)
    torch.testing.assert_close(native, fallback, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
def test_matches_torch_sdpa_with_a_padding_mask(attend):
    """Left-padded rows (a bool attention mask, as transformers builds it) against torch's own SDPA."""
    batch, kv_heads, group, tokens, dim = 2, 2, 3, 37, 64
    keys, values = _kv(batch, kv_heads, tokens, dim, torch.bfloat16, seed=7)
    q = torch.randn(batch, kv_heads * group, 2, dim, generator=torch.Generator().manual_seed(8))
    mask = torch.ones(batch, 1, 2, tokens, dtype=torch.bool)
    mask[1, :, :, :9] = False  # row 1 is padded on the left
    mask[:, :, 0, -1] = False  # causal: the first of the two queries does not see the last key
    placed = Placed(keys, values, 8)
    out, _ = attend(q, placed.slab, placed.table, tokens, scaling=0.1, causal=False, mask=mask)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1),
        attn_mask=mask, scale=0.1)  # fmt: skip
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
def test_parts_named_by_positions_merge_into_attention_over_all_keys(attend):
    """The split executor's use: the table's columns divided between tiers (any subset, named by their
    positions; absent entries -1), each part attended alone, merged by log-sum-exp = attention over all."""
    batch, kv_heads, tokens, dim, bt = 2, 2, 150, 128, 16
    keys, values = _kv(batch, kv_heads, tokens, dim, torch.float16, seed=11)
    q = torch.randn(batch, 4 * kv_heads, 1, dim, generator=torch.Generator().manual_seed(12))
    placed = Placed(keys, values, bt, chunks=3)
    n = placed.table.shape[1]
    where = np.random.default_rng(13).integers(0, 3, size=(batch, n))  # which "tier" holds each entry
    positions = np.broadcast_to(np.arange(n) * bt, (batch, n))
    out = lse = None
    for part in range(3):
        table = np.where(where == part, placed.table, -1)
        out, lse = merge(out, lse, *attend(q, placed.slab, table, tokens, scaling=0.09, positions=positions,
                                           window=100))  # fmt: skip
    want = reference(q, keys, values, [tokens] * batch, scaling=0.09, query_start=[tokens - 1] * batch, window=100)
    _close((out, lse), want)


@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
def test_an_additive_mask_from_a_later_position(attend):
    """An additive bias that covers key positions from ``mask_start`` on (keys before it are not attended)."""
    keys, values = _kv(1, 1, 40, 16, torch.float32, seed=21)
    q = torch.randn(1, 2, 1, 16, generator=torch.Generator().manual_seed(22))
    bias = torch.randn(1, 1, 1, 30, generator=torch.Generator().manual_seed(23))
    placed = Placed(keys, values, 4)
    got = attend(q, placed.slab, placed.table, 40, scaling=0.3, causal=False, mask=bias, mask_start=10)
    _close(got, reference(q, keys, values, [40], scaling=0.3, bias=bias[:, 0], mask_start=10))


@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
def test_a_query_with_no_key_is_an_empty_part(attend):
    """A query whose keys all lie elsewhere (another tier's part) returns output 0 and lse -inf, which merges
    as nothing."""
    keys, values = _kv(1, 1, 32, 64, torch.float16, seed=31)
    q = torch.randn(1, 1, 1, 64)
    placed = Placed(keys, values, 16)
    out, lse = attend(q, placed.slab, placed.table[:, :1], 32, scaling=0.1, window=8)  # keys 0..15, query at 31
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    full = attend(q, placed.slab, placed.table, 32, scaling=0.1, window=8)
    merged = merge(*full, out, lse)
    torch.testing.assert_close(merged, full)


@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
def test_a_query_whose_every_key_is_masked_gets_their_mean_as_eager_softmax_does(attend):
    """A boolean mask hiding every key of a query: the scores all sit at the float minimum, and softmax spreads the
    weight evenly (the mean of the values). The torch version gave their sum: ``exp(scores - lse)`` is not
    normalised where the logsumexp rounds back to the float minimum."""
    keys, values = _kv(1, 1, 3, 4, torch.float32, seed=5)
    q = torch.randn(1, 1, 1, 4)
    placed = Placed(keys, values, 1)
    mask = torch.zeros(1, 1, 1, 3, dtype=torch.bool)
    out, _ = attend(q, placed.slab, placed.table, 3, scaling=1.0, causal=False, mask=mask)
    scores = q[0, 0, 0] @ keys[0, 0].T + torch.finfo(torch.float32).min
    torch.testing.assert_close(out[0, 0, 0], torch.softmax(scores, -1) @ values[0, 0])
    torch.testing.assert_close(out[0, 0, 0], values[0, 0].mean(0))


@needs_compiler
def test_many_threads_split_the_keys_and_merge_exactly():
    """A long row on several threads is attended in key ranges merged inside the kernel: the result does not
    depend on the thread count."""
    keys, values = _kv(1, 1, 4000, 128, torch.bfloat16, seed=41)
    q = torch.randn(1, 4, 1, 128, generator=torch.Generator().manual_seed(42))
    placed = Placed(keys, values, 16)
    want = reference(q, keys, values, [4000], scaling=0.09, query_start=[3999])
    for threads in (1, 2, 5):
        _close(_native(q, placed.slab, placed.table, 4000, scaling=0.09, threads=threads), want)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("isa", range(len(host_kernel.ISAS)), ids=host_kernel.ISAS)
def test_every_code_path_matches_float64_softmax(isa, dtype, monkeypatch):
    """Each code path the CPU has (AVX-512, AVX2, portable C), pinned in turn, on shapes that reach each of its
    tiles: GQA groups of 7 (query rows in fours, twos and ones), head_dim 80 (a 64-column slice, then a 16-column
    one), key counts that leave partial tiles, blocks cut by the length and by a sliding window."""
    if not host_kernel.available():
        pytest.fail(f"the C kernel does not load: {host_kernel._build()}")
    if isa > host_kernel.library().tkv_attn_isa():
        pytest.skip(f"this CPU cannot run the {host_kernel.ISAS[isa]} path")
    monkeypatch.setattr(host_kernel, "ISA", isa)
    for dim, group, q_len, block_tokens, tokens in ((80, 7, 2, 37, 300), (128, 4, 1, 256, 700),
                                                    (128, 1, 3, 16, 99), (16, 2, 1, 5, 50)):  # fmt: skip
        keys, values = _kv(2, 2, tokens, dim, dtype, seed=dim + group)
        q = torch.randn(2, 2 * group, q_len, dim, generator=torch.Generator().manual_seed(dim))
        placed = Placed(keys, values, block_tokens, chunks=2)
        lengths = [tokens, tokens - 13]
        start = [length - q_len for length in lengths]
        got = _native(q, placed.slab, placed.table, lengths, scaling=dim**-0.5, window=200)
        _close(got, reference(q, keys, values, lengths, scaling=dim**-0.5, query_start=start, window=200))


@pytest.mark.parametrize("isa", range(len(host_kernel.ISAS)), ids=host_kernel.ISAS)
@pytest.mark.parametrize("threads", [1, 3])
def test_a_nan_or_infinite_key_makes_its_queries_nan_as_softmax_does(isa, threads, monkeypatch):
    """A NaN or infinite key (a model that overflowed) makes the queries that attend it NaN, as SDPA and
    ``DynamicCache`` do, whichever lane or key range it falls in: the SIMD max and the exp's clamp dropped it (an
    almost-zero weight, a finite output: other tokens than DynamicCache's). The torch version and the merge of
    parts keep it too; a query with no key in a part stays an empty part."""
    if isa > 0 and (not host_kernel.available() or isa > host_kernel.library().tkv_attn_isa()):
        pytest.skip(f"this CPU cannot run the {host_kernel.ISAS[isa]} path")
    monkeypatch.setattr(host_kernel, "ISA", isa)
    keys, values = _kv(1, 2, 40, 16, torch.float32, seed=7)
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(8))
    for where, value in [(5, math.nan), (37, math.nan), (20, math.inf), (3, -math.inf)]:
        poisoned = keys.clone()
        poisoned[0, 0, where, 0] = value  # one channel of one key of KV head 0
        want = torch.nn.functional.scaled_dot_product_attention(q, poisoned.repeat_interleave(2, 1),
                                                                values.repeat_interleave(2, 1), scale=0.25)
        placed = Placed(poisoned, values, 8)
        for attend in (_native, host_kernel.paged_attention_torch):
            out, lse = attend(q, placed.slab, placed.table, 40, scaling=0.25, threads=threads)
            assert torch.equal(out.isnan(), want.isnan()), (where, value, attend)
            assert torch.equal(~lse.isfinite(), want.isnan().any(-1)), (where, value, attend)  # NaN or +inf
            empty = attend(q, placed.slab, placed.table[:, :1], 40, scaling=0.25, window=8)  # no key: empty part
            merged, _ = merge(out, lse, *empty)
            assert torch.equal(merged.isnan(), want.isnan())


def _errors_cases():
    slab = torch.zeros(4, 2, 2, 4, 8, dtype=torch.float16)
    q = torch.zeros(1, 4, 1, 8)
    table = np.array([[0, 1]])
    return [
        ("slab must be", dict(slabs=slab[:, 0])),
        ("not supported", dict(slabs=slab.to(torch.int32))),
        ("does not fit", dict(query=torch.zeros(1, 4, 1, 16))),
        ("does not fit", dict(query=torch.zeros(1, 3, 1, 8))),
        ("query must be", dict(query=torch.zeros(4, 1, 8))),
        ("rows", dict(block_table=np.array([[0], [1]]))),
        ("names slot 9", dict(block_table=np.array([[0, 9]]))),
        ("integer array", dict(block_table=np.array([0.0, 1.0]))),
        ("one per row", dict(lengths=[8, 8])),
        ("need causal", dict(causal=False, window=4)),
        ("window must be", dict(window=0)),
        ("softcap must be", dict(softcap=-1.0)),
        ("mask must be", dict(mask=torch.ones(1, 1, 2, 8, dtype=torch.bool))),
        ("mask covers", dict(mask=torch.ones(1, 1, 1, 4, dtype=torch.bool))),
        ("positions", dict(positions=np.array([[0]]))),
        ("slab chunks differ", dict(slabs=[slab, slab.float()])),
        ("contiguous block", dict(slabs=slab.transpose(3, 4))),
        ("threads must be", dict(threads=0)),
        ("threads must be", dict(threads=1.5)),
        # beyond +-2**62 the C kernel's int64 sums of two of them wrapped: a silently wrong key range
        ("positions must lie within", dict(positions=np.array([[-2**63, 0]]))),
        ("query_start must lie within", dict(query_start=2**63 - 1)),
        ("window must lie within", dict(window=2**63 - 1)),
        ("lengths must lie within", dict(lengths=2**62)),
    ], dict(query=q, slabs=slab, block_table=table, lengths=8, scaling=1.0)


@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
@pytest.mark.parametrize("index", range(len(_errors_cases()[0])))
def test_wrong_inputs_are_refused_with_a_clear_error(attend, index):
    cases, good = _errors_cases()
    expected, change = cases[index]
    args = {**good, **change}
    with pytest.raises(InvalidConfigError, match=expected):
        attend(args.pop("query"), args.pop("slabs"), args.pop("block_table"), args.pop("lengths"), **args)


@needs_compiler
def test_built_on_first_use_into_the_cache_dir(tmp_path, monkeypatch, caplog):
    """Without an extension built at install, the source is compiled once into the cache directory."""
    caplog.set_level(logging.INFO, logger="tierkv")
    monkeypatch.setattr(host_kernel, "extension", lambda: None)
    host_kernel._build.cache_clear()
    try:
        with tierkv_settings.override(cache_dir=tmp_path):
            assert host_kernel.available()
        assert list((tmp_path / "native").glob("tierkv_attn-*.so"))
        assert "built on first use" in caplog.text
    finally:
        host_kernel._build.cache_clear()


def test_without_a_compiler_the_torch_version_answers(tmp_path, monkeypatch, caplog):
    """No extension and no compiler: the kernel is unavailable, saying why, and paged_attention falls back."""
    monkeypatch.setattr(host_kernel, "extension", lambda: None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    host_kernel._build.cache_clear()
    host_kernel._log_fallback.cache_clear()
    keys, values = _kv(1, 1, 20, 16, torch.float16, seed=51)
    placed = Placed(keys, values, 4)
    q = torch.randn(1, 2, 1, 16)
    try:
        with tierkv_settings.override(cache_dir=tmp_path), caplog.at_level(logging.WARNING, logger="tierkv"):
            assert not host_kernel.available()
            got = host_kernel.paged_attention(q, placed.slab, placed.table, 20, scaling=0.25)
        assert "no C compiler" in caplog.text
        _close(got, reference(q, keys, values, [20], scaling=0.25, query_start=[19]))
    finally:
        host_kernel._build.cache_clear()


@needs_compiler
def test_setup_builds_the_extension_with_the_source_hash(built_extensions, tmp_path, monkeypatch, caplog):
    check_extension_loads_first(host_kernel, "_attn", built_extensions, tmp_path, monkeypatch, caplog)


@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
def test_keys_at_negative_positions_are_not_attended(attend):
    """A span that starts inside its first block (a sliding window): positions counted from the span's start make
    that block's earlier keys negative, and they are left out. An empty table is an empty part."""
    keys, values = _kv(2, 2, 30, 32, torch.bfloat16, seed=61)
    q = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(62))
    placed = Placed(keys, values, 8)
    positions = np.broadcast_to(np.arange(placed.table.shape[1]) * 8 - 5, placed.table.shape)  # span starts at 5
    got = attend(q, placed.slab, placed.table, 25, scaling=0.2, positions=positions)
    _close(got, reference(q, keys[:, :, 5:], values[:, :, 5:], [25, 25], scaling=0.2, query_start=[24, 24]))
    out, lse = attend(q, placed.slab, placed.table[:, :0], 25, scaling=0.2)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


# ------------------------------------------------------------------ pages inside blocks (sparse attention's use)
class Pages:
    """Random K/V in every slot of a padded slab (in ``chunks`` pieces), and per row ``entries`` table entries that
    name a page (``entry_tokens`` tokens at a random page index) of a random slot: slots repeat within and across
    rows, and each row names its own; a share ``absent`` of the entries is -1."""

    def __init__(self, batch: int, kv_heads: int, dim: int, block_tokens: int, entry_tokens: int, entries: int,
                 dtype: torch.dtype, *, chunks: int = 1, seed: int = 0, absent: float = 0.0) -> None:  # fmt: skip
        self.layout = BlockLayout(kv_heads, dim, block_tokens, dtype)
        self.entry_tokens = entry_tokens
        rng = np.random.default_rng(seed)
        slots = max(3, batch * entries // 2)
        raw = torch.full((slots, self.layout.slot_bytes), 0xFF, dtype=torch.uint8)  # padding reads as NaN
        self.blocks = self.layout.blocks_of(raw)
        self.blocks.copy_(torch.randn(self.blocks.shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
        self.table = rng.integers(0, slots, size=(batch, entries)).astype(np.int64)
        self.table[rng.random((batch, entries)) < absent] = -1
        pages = rng.integers(0, block_tokens // entry_tokens, size=(batch, entries))
        self.starts = (pages * entry_tokens).astype(np.int64)
        cuts = sorted(rng.choice(np.arange(1, slots), size=min(chunks, slots) - 1, replace=False).tolist())
        self.slabs = [self.layout.blocks_of(piece) for piece in torch.tensor_split(raw, cuts)]
        self.slab = self.slabs[0] if chunks == 1 else self.slabs

    def gathered(self, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The tokens the entries name at concatenated positions (entry ``j``: ``j * entry_tokens ..``) below each
        row's length, in table order, absent entries skipped: keys and values ``[B, H_kv, T, D]`` (zero-padded)
        and the count per row."""
        batch, entries = self.table.shape
        size = self.entry_tokens
        rows: list[list[torch.Tensor]] = []
        for b in range(batch):  # test setup, not the code under test
            rows.append([self.blocks[slot, :, :, start : start + min(size, lengths[b] - j * size)]
                         for j, (slot, start) in enumerate(zip(self.table[b], self.starts[b]))
                         if slot >= 0 and j * size < lengths[b]])  # fmt: skip
        counts = [sum(part.shape[2] for part in parts) for parts in rows]
        _, kv_heads, _, dim = self.layout.shape
        kv = torch.zeros(2, batch, kv_heads, max(counts + [1]), dim, dtype=self.blocks.dtype)
        for b, parts in enumerate(rows):
            if parts:
                kv[:, b, :, : counts[b]] = torch.cat(parts, dim=2)
        return kv[0], kv[1], counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
def test_pages_of_random_slots_match_float64_softmax_over_the_gathered_tokens(attend, dtype):
    """Sparse attention's call: each row names its own pages of random slots (absent entries among them, GQA,
    several chunks, the last page of a row cut by its length), one query after every key: the result equals
    float64 softmax over exactly the named tokens, with or without causal placement."""
    pages = Pages(3, 2, 64, 32, 8, 11, dtype, chunks=3, seed=71, absent=0.2)
    q = torch.randn(3, 8, 1, 64, generator=torch.Generator().manual_seed(72))
    lengths = [88, 85, 60]  # 11 pages of 8; row 1's last page is cut; row 2 stops after page 7
    keys, values, counts = pages.gathered(lengths)
    want = reference(q, keys, values, counts, scaling=0.125)
    for causal in (True, False):
        got = attend(q, pages.slab, pages.table, lengths, scaling=0.125, causal=causal, starts=pages.starts,
                     entry_tokens=8)  # fmt: skip
        _close(got, want)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_c_kernel_and_the_torch_version_agree_on_pages(dtype):
    """The fallback attends the same tokens of the same pages: with a mask, a soft-cap, a window and three
    queries."""
    pages = Pages(2, 2, 32, 16, 4, 9, dtype, chunks=2, seed=81, absent=0.3)
    q = torch.randn(2, 6, 3, 32, generator=torch.Generator().manual_seed(82))
    mask = torch.rand(2, 1, 3, 36, generator=torch.Generator().manual_seed(83)) > 0.2
    kwargs = dict(scaling=0.2, softcap=20.0, window=25, mask=mask, starts=pages.starts, entry_tokens=4)
    native = _native(q, pages.slab, pages.table, 36, **kwargs)
    fallback = host_kernel.paged_attention_torch(q, pages.slab, pages.table, 36, **kwargs)
    torch.testing.assert_close(native, fallback, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
def test_entry_shares_are_each_pages_part_of_the_softmax(attend):
    """``entry_lse`` with absent entries, a mask and a soft-cap: absent entries get ``-inf``, fully masked-out ones
    a share of 0, and ``exp(entry_lse - lse)`` summed over the entries is 1 for every query — each page's share of
    the softmax (what sparse attention's sticky selection and the attention policy measure)."""
    pages = Pages(2, 2, 32, 16, 4, 9, torch.bfloat16, chunks=2, seed=111, absent=0.3)
    q = torch.randn(2, 6, 1, 32, generator=torch.Generator().manual_seed(112))
    mask = torch.ones(2, 1, 1, 36, dtype=torch.bool)
    mask[1, 0, 0, 8:12] = False  # row 1's third entry: no key attended
    entry_lse = torch.empty(2, 6, 1, 9)
    _, lse = attend(q, pages.slab, pages.table, 36, scaling=0.2, softcap=20.0, mask=mask, starts=pages.starts,
                    entry_tokens=4, entry_lse=entry_lse)  # fmt: skip
    absent = torch.from_numpy(pages.table < 0)
    assert absent.any() and torch.isneginf(entry_lse[absent[:, None, None, :].expand_as(entry_lse)]).all()
    shares = torch.exp(entry_lse - lse[..., None])
    assert (shares[1, :, :, 2] == 0).all() and (shares[1, :, :, 3] > 0).all()
    torch.testing.assert_close(shares.sum(-1), torch.ones_like(lse))
    with pytest.raises(InvalidConfigError, match="entry_lse must be"):
        attend(q, pages.slab, pages.table, 36, scaling=0.2, starts=pages.starts, entry_tokens=4,
               entry_lse=torch.empty(2, 6, 9))  # fmt: skip


@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
def test_pages_at_their_positions_in_parts_merge_into_attention_over_all_keys(attend):
    """Pages across tiers: every page of every block named by its slot and start, in a shuffled order per row and
    placed at its real position (block position + start), divided at random between two parts; each part
    attended alone (two causal queries, a sliding window), merged by log-sum-exp = attention over all keys."""
    batch, kv_heads, tokens, dim, bt, page = 2, 2, 150, 64, 32, 8
    keys, values = _kv(batch, kv_heads, tokens, dim, torch.bfloat16, seed=91)
    q = torch.randn(batch, 3 * kv_heads, 2, dim, generator=torch.Generator().manual_seed(92))
    placed = Placed(keys, values, bt, chunks=2)
    per_block = bt // page
    columns = placed.table.shape[1] * per_block  # column c: page c % per_block of block c // per_block
    rng = np.random.default_rng(93)
    order = rng.permuted(np.tile(np.arange(columns), (batch, 1)), axis=1)
    table = np.take_along_axis(np.repeat(placed.table, per_block, axis=1), order, axis=1)
    starts = order % per_block * page
    positions = order * page
    where = rng.integers(0, 2, size=table.shape)
    out = lse = None
    for part in range(2):
        out, lse = merge(out, lse, *attend(q, placed.slab, np.where(where == part, table, -1), tokens, scaling=0.1,
                                           window=100, positions=positions, starts=starts,
                                           entry_tokens=page))  # fmt: skip
    want = reference(q, keys, values, [tokens] * batch, scaling=0.1, query_start=[tokens - 2] * batch, window=100)
    _close((out, lse), want)


@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
def test_whole_block_entries_through_starts_are_the_block_table(attend):
    """``entry_tokens=block_tokens`` with every start 0 names the same keys as the plain block table: the same
    result, bit for bit."""
    keys, values = _kv(2, 2, 45, 64, torch.float16, seed=101)
    q = torch.randn(2, 4, 2, 64, generator=torch.Generator().manual_seed(102))
    placed = Placed(keys, values, 16, chunks=2)
    plain = attend(q, placed.slab, placed.table, 45, scaling=0.125, window=30)
    paged = attend(q, placed.slab, placed.table, 45, scaling=0.125, window=30, starts=np.zeros_like(placed.table),
                   entry_tokens=16)  # fmt: skip
    assert torch.equal(plain[0], paged[0]) and torch.equal(plain[1], paged[1])


@given(**SHAPES, geometry=st.sampled_from([(16, 4), (16, 8), (16, 16), (6, 3), (6, 1), (32, 16)]),
       entries=st.integers(1, 6))  # fmt: skip
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
def test_pages_match_float64_softmax_on_random_shapes(attend, batch, kv_heads, group, dim, geometry, entries,
                                                      q_len, dtype, window, softcap, ragged, chunks, threads,
                                                      seed):  # fmt: skip
    """Any geometry, page size dividing the block, dtype, per-row length, query count, window and soft-cap: the
    pages concatenated in table order are attended like contiguous keys at those positions."""
    block_tokens, entry_tokens = geometry
    pages = Pages(batch, kv_heads, dim, block_tokens, entry_tokens, entries, dtype, chunks=chunks, seed=seed)
    tokens = entries * entry_tokens
    q_len = min(q_len, tokens)
    q = torch.randn(batch, kv_heads * group, q_len, dim, generator=torch.Generator().manual_seed(seed + 1))
    rng = np.random.default_rng(seed)
    lengths = [int(rng.integers(q_len, tokens + 1)) if ragged else tokens for _ in range(batch)]
    start = [length - q_len for length in lengths]
    keys, values, _ = pages.gathered([tokens] * batch)
    entry_lse = torch.empty(batch, kv_heads * group, q_len, entries)
    got = attend(q, pages.slab, pages.table, lengths, scaling=dim**-0.5, softcap=softcap, window=window,
                 starts=pages.starts, entry_tokens=entry_tokens, threads=threads, entry_lse=entry_lse)  # fmt: skip
    want = reference(q, keys, values, lengths, scaling=dim**-0.5, softcap=softcap, query_start=start, window=window)
    _close(got, want)
    scores = reference_scores(q, keys, lengths, scaling=dim**-0.5, softcap=softcap, query_start=start, window=window)
    torch.testing.assert_close(entry_lse.double(), reference_entries(scores, entries, entry_tokens), atol=2e-5,
                               rtol=2e-5)  # fmt: skip


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("isa", range(len(host_kernel.ISAS)), ids=host_kernel.ISAS)
def test_every_code_path_attends_pages(isa, dtype, monkeypatch):
    """Each code path, pinned in turn, on pages that reach its tiles: GQA groups of 7, head_dim 80, pages of 8 in
    blocks of 40, of 16 in blocks of 256 (enough bytes for two threads' key ranges), of 5; lengths and a window
    that cut pages."""
    if not host_kernel.available():
        pytest.fail(f"the C kernel does not load: {host_kernel._build()}")
    if isa > host_kernel.library().tkv_attn_isa():
        pytest.skip(f"this CPU cannot run the {host_kernel.ISAS[isa]} path")
    monkeypatch.setattr(host_kernel, "ISA", isa)
    for dim, group, q_len, block_tokens, entry_tokens, entries in ((80, 7, 2, 40, 8, 9), (128, 4, 1, 256, 16, 70),
                                                                   (16, 2, 1, 10, 5, 13)):  # fmt: skip
        pages = Pages(2, 2, dim, block_tokens, entry_tokens, entries, dtype, chunks=2, seed=dim)
        q = torch.randn(2, 2 * group, q_len, dim, generator=torch.Generator().manual_seed(dim))
        tokens = entries * entry_tokens
        lengths = [tokens, tokens - 3]
        start = [length - q_len for length in lengths]
        keys, values, _ = pages.gathered([tokens, tokens])
        entry_lse = torch.empty(2, 2 * group, q_len, entries)
        got = _native(q, pages.slab, pages.table, lengths, scaling=dim**-0.5, window=60, starts=pages.starts,
                      entry_tokens=entry_tokens, threads=2, entry_lse=entry_lse)  # fmt: skip
        _close(got, reference(q, keys, values, lengths, scaling=dim**-0.5, query_start=start, window=60))
        scores = reference_scores(q, keys, lengths, scaling=dim**-0.5, query_start=start, window=60)
        torch.testing.assert_close(entry_lse.double(), reference_entries(scores, entries, entry_tokens), atol=2e-5,
                                   rtol=2e-5)  # fmt: skip


@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
@pytest.mark.parametrize(("expected", "change"), [
    ("go together", dict(starts=np.array([[0, 4]]))),
    ("go together", dict(entry_tokens=2)),
    ("positive divisor", dict(starts=np.array([[0, 1]]), entry_tokens=3)),
    ("positive divisor", dict(starts=np.array([[0, 1]]), entry_tokens=0)),
    ("must match", dict(starts=np.array([[0]]), entry_tokens=2)),
    ("names token 1 ", dict(starts=np.array([[0, 1]]), entry_tokens=2)),
    ("names token 4 ", dict(starts=np.array([[0, 4]]), entry_tokens=2)),
    ("names token -2 ", dict(starts=np.array([[-2, 0]]), entry_tokens=2)),
])  # fmt: skip
def test_wrong_pages_are_refused_with_a_clear_error(attend, expected, change):
    """A start that is a page index instead of a token, past the block, or negative; a page size that does not
    divide the block; starts without their size: each refused, by the C kernel's own check too."""
    slab = torch.zeros(4, 2, 2, 4, 8, dtype=torch.float16)
    with pytest.raises(InvalidConfigError, match=expected):
        attend(torch.zeros(1, 4, 1, 8), slab, np.array([[0, 1]]), 8, scaling=1.0, **change)


# ------------------------------------------------------------------ prepared calls (a layer's decode steps)
@needs_compiler
@given(**SHAPES, block_tokens=st.sampled_from([1, 3, 16]), tokens=st.integers(1, 70), calls=st.integers(1, 4),
       masked=st.sampled_from([None, torch.bool, torch.float32]))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_prepared_call_is_paged_attention_of_each_new_query(batch, kv_heads, group, dim, block_tokens, tokens,
                                                              q_len, dtype, window, softcap, ragged, chunks, threads,
                                                              seed, calls, masked):  # fmt: skip
    """A :class:`PagedCall` (checked and packed once; a call writes only the query, the key count, the mask and,
    rewritten in place, the positions): each call with a new query at a new key count — with a new mask (bool or
    additive, one per row or shared) where ``masked``, positions shifted where ``ragged`` draws it, as a sliding
    window's start moving inside its first block — gives bit for bit what ``paged_attention`` gives for the same
    arguments, and float64 softmax attention over the same keys."""
    q_len = min(q_len, tokens)
    window = None if masked else window  # a window places causal queries; a mask places them itself
    keys, values = _kv(batch, kv_heads, tokens, dim, dtype, seed)
    placed = Placed(keys, values, block_tokens, chunks=chunks, seed=seed)
    columns = np.broadcast_to(np.arange(placed.table.shape[1]) * block_tokens, placed.table.shape)
    generator = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(batch, kv_heads * group, q_len, dim, generator=generator)
    options = dict(scaling=0.3, softcap=softcap, window=window, causal=masked is None, threads=threads)
    call = host_kernel.prepare(query, placed.slab, placed.table, tokens, masked=masked is not None,
                               positions=columns, **options)  # fmt: skip
    assert call is not None and call.positions is not None
    rng = np.random.default_rng(seed)
    for _ in range(calls):
        shift = int(rng.integers(0, min(block_tokens, tokens - q_len + 1))) if ragged else 0
        length = int(rng.integers(q_len, tokens - shift + 1))
        np.subtract(columns, shift, out=call.positions)
        query = torch.randn(batch, kv_heads * group, q_len, dim, generator=generator)
        mask = bias = None
        if masked is not None:
            rows = batch if rng.random() < 0.5 else 1
            allowed = torch.from_numpy(rng.random((rows, 1, q_len, length)) < 0.8)
            mask = allowed if masked == torch.bool else torch.randn(allowed.shape, generator=generator) * allowed
            bias = mask.float() if masked != torch.bool else torch.zeros(allowed.shape).masked_fill(
                ~allowed, torch.finfo(torch.float32).min)  # fmt: skip
        got = call(query, length, mask)
        want = host_kernel.paged_attention(query, placed.slab, placed.table, length, mask=mask,
                                           positions=columns - shift, **options)  # fmt: skip
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        start = [length - q_len] * batch if masked is None else None
        _close(got, reference(query, keys[:, :, shift:], values[:, :, shift:], [length] * batch, scaling=0.3,
                              softcap=softcap, query_start=start, window=window,
                              bias=None if bias is None else bias[:, 0]))  # fmt: skip


@needs_compiler
def test_a_prepared_call_keeps_no_slab_alive_and_refuses_what_does_not_fit():
    """The call holds the slab's addresses, not its chunks (the caller keeps them, and prepares again when its pool
    changes); a query of another shape is refused, a non-fp32 or strided one converted; a table naming a slot past
    the chunks is refused by the call (the C kernel checks the slots) with the error paged_attention gives."""
    import weakref

    keys, values = _kv(1, 2, 40, 16, torch.float32, seed=71)
    placed = Placed(keys, values, 8, chunks=2)
    query = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(72))
    call = host_kernel.prepare(query, placed.slabs, placed.table, 40, scaling=0.25)
    assert call is not None
    want = host_kernel.paged_attention(query, placed.slabs, placed.table, 40, scaling=0.25)
    strided = torch.randn(1, 1, 4, 32).to(torch.float64)[..., ::2].transpose(1, 2)
    strided[:] = query
    got = call(strided, 40)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(InvalidConfigError, match=r"prepared for a CPU query of shape \(1, 4, 1, 16\).*prepare"):
        call(torch.randn(2, 4, 1, 16), 40)
    with pytest.raises(InvalidConfigError, match=r"without a mask, got \(1, 4, 1, 16\) on cpu with one"):
        call(query, 40, torch.ones(1, 1, 1, 40, dtype=torch.bool))
    chunk = weakref.ref(placed.slabs[0])
    placed.slabs = placed.slab = []
    assert chunk() is None  # freed: the call did not keep it
    past = Placed(keys, values, 8, chunks=2)
    past.table[0, 1] = sum(int(c.shape[0]) for c in past.slabs)  # one slot past the chunks: the C kernel refuses it
    call = host_kernel.prepare(query, past.slabs, past.table, 40, scaling=0.25)
    assert call is not None
    with pytest.raises(InvalidConfigError, match=r"block_table names slot \d+ of a slab of \d+ slots"):
        call(query, 40)


@needs_compiler
def test_a_prepared_call_refuses_lengths_and_mask_starts_beyond_the_bound():
    """The +-2**62 bound held for paged_attention but not for a prepared call (the per-step path), whose length
    comes per call and whose mask start comes at prepare(masked=True) without a mask."""
    slab, q, table = torch.randn(4, 2, 1, 16, 8), torch.randn(1, 1, 1, 8), np.array([[0, 1]])
    call = host_kernel.prepare(q, slab, table, 32, scaling=1.0)
    assert call is not None
    with pytest.raises(InvalidConfigError, match="lengths must lie within"):
        call(q, 2**62 + 5)
    with pytest.raises(InvalidConfigError, match="mask_start must lie within"):
        host_kernel.prepare(q, slab, table, 32, scaling=1.0, causal=False, masked=True, mask_start=-(2**62 + 5))


def test_prepare_without_the_c_kernel_is_none(monkeypatch):
    """Where the C kernel does not load, there is nothing to prepare: callers call paged_attention (torch)."""
    from tierkv.io.base import EngineUnavailableError

    monkeypatch.setattr(host_kernel, "_build", lambda: EngineUnavailableError("not here", "none"))
    keys, values = _kv(1, 1, 8, 16, torch.float32, seed=81)
    placed = Placed(keys, values, 4)
    assert host_kernel.prepare(torch.randn(1, 1, 1, 16), placed.slab, placed.table, 8, scaling=0.25) is None
