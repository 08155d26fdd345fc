"""Split attention attends a disk share round by round where each round landed, in the disk tier's bounce buffer,
while the next round is read (issue 28: with most of the KV on disk, the step within 1.1x max(compute, disk
bytes / raw O_DIRECT)). Checked against DynamicCache with a bounce limit of a few slots, so each layer's disk
share takes several rounds through a ring of pieces of three bounce buffers; at the tier, the rounds are verified
before they are handed out, ``parts - 1`` are in flight while one is used, and an error leaves no read in flight
into the buffers."""

from __future__ import annotations

import copy
import ctypes
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same_generation, teacher_forced, use_host_kernel
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import DiskTierError, IntegrityError, TieredCache, accel
from tierkv.attention import host_kernel
from tierkv.attention import split as split_module
from tierkv.attention.base import READ_AHEAD
from tierkv.attention.split import SplitAttention, _DiskShare, merge, merge_all
from tierkv.blocks import Tier
from tierkv.layout import BlockLayout
from tierkv.tiers import disk as disk_module
from tierkv.tiers.base import Scratch
from tierkv.tiers.disk import BounceBuffer, DiskTier

NEW = 6
SLOT = 4096  # the tiny models' blocks of 4 tokens (1 KiB in fp32, 512 B in bf16) each take one 4 KiB slot


@pytest.fixture(params=["native", "torch"])
def kernel(request, monkeypatch):
    """The C kernel, and the torch version (where the C kernel does not load: no prepared calls either)."""
    return use_host_kernel(request.param, monkeypatch)


def rounds_of(monkeypatch: pytest.MonkeyPatch, slots: int) -> None:
    """Split's disk reads in rounds of ``slots`` slots: a bounce limit of two rounds, so each read's ring (two pieces
    of each of three bounce buffers: :meth:`SplitAttention.ring`) is six rounds, five in flight while one is
    attended."""
    monkeypatch.setattr(disk_module, "BOUNCE_BYTES", 2 * slots * SLOT)
    monkeypatch.setattr(split_module, "RING_PIECE_BYTES", slots * SLOT)


def gpu(model: torch.nn.Module, batch: int) -> str:
    """The split minimum and room for a few blocks (as tests/test_split.py): most blocks go to the disk."""
    return f"{TieredCache.min_split_device_bytes(model.config, batch, block_tokens=4, chunk_tokens=8) + 16384}B"


class Watch:
    """What split did with the disk: the rounds each read handed out (by read), the reads it took from the reads
    ahead, the host kernel calls over one slab tensor (a round; the memory tiers' share is a prepared call or a
    list of chunks) and whether each lay inside the calling thread's bounce buffers, and whole-share host buffers
    allocated by split."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cache: TieredCache) -> None:
        self.rounds: dict[int, int] = defaultdict(int)  # id(read) -> rounds handed out
        self.looped = 0  # reads whose rounds were all attended in one C loop (consume_rounds)
        self.stepped: set[int] = set()  # ids of reads attended round by round in Python (each_round)
        self.ahead: set[int] = set()  # ids of reads submitted ahead and claimed
        self.in_bounce: list[bool] = []  # per round attended: inside a bounce buffer of the calling thread
        self.allocated = 0  # host_blocks calls from tierkv/attention/split.py
        self.inside = False
        each_round, claim, attend = disk_module._DiskRead.each_round, SplitAttention._claim_ahead, SplitAttention.attend
        consume = disk_module._DiskRead.consume_rounds
        kernel, bind = host_kernel.paged_attention, host_kernel.PagedCall.bind
        backend = type(accel.backend(torch.device("cpu")))
        host_blocks = backend.host_blocks

        def counted_rounds(read):  # split's, inside attend (a prefill's reads finish through the rounds too)
            for landed in each_round(read):
                self.rounds[id(read)] += self.inside
                if self.inside:
                    self.stepped.add(id(read))
                yield landed

        def consumed(read, consumer, arguments):  # the C loop: every round handed to the kernel in turn
            outcome = consume(read, consumer, arguments)
            if outcome.failed is None:
                self.rounds[id(read)] += read.rounds * self.inside
                self.looped += self.inside
            return outcome

        def claimed(executor, layer, plan):
            entry = claim(executor, layer, plan)
            if entry is not None:
                self.ahead.add(id(entry.pending))
            return entry

        def attending(executor, *args, **kwargs):
            self.inside = True
            try:
                return attend(executor, *args, **kwargs)
            finally:
                self.inside = False

        def record(slabs):  # a round's blocks (a memory share is a list of chunks)
            if isinstance(slabs, torch.Tensor):
                first = slabs.data_ptr()
                end = first + slabs.shape[0] * slabs.stride(0) * slabs.element_size()
                buffers = cache.store.transfer.scratch._local.__dict__.get("bounces", {}).values()
                self.in_bounce.append(any(b._buffer.ctypes.data <= first and end <= b._buffer.ctypes.data
                                          + b._buffer.nbytes for b in buffers))  # fmt: skip

        def attended(query, slabs, *args, **kwargs):  # without the C kernel
            record(slabs)
            return kernel(query, slabs, *args, **kwargs)

        def bound(call, slab):  # the round's prepared call
            record(slab)
            return bind(call, slab)

        def allocating(self_backend, *args, **kwargs):  # by split itself (a demotion inside attend may: a cold path)
            self.allocated += sys._getframe(1).f_code.co_filename == split_module.__file__
            return host_blocks(self_backend, *args, **kwargs)

        monkeypatch.setattr(disk_module._DiskRead, "each_round", counted_rounds)
        monkeypatch.setattr(disk_module._DiskRead, "consume_rounds", consumed)
        monkeypatch.setattr(SplitAttention, "_claim_ahead", claimed)
        monkeypatch.setattr(SplitAttention, "attend", attending)
        monkeypatch.setattr(host_kernel, "paged_attention", attended)
        monkeypatch.setattr(host_kernel.PagedCall, "bind", bound)
        monkeypatch.setattr(backend, "host_blocks", allocating)

    def check(self, kernel: str) -> None:
        """Some reads took several rounds (one taken from the reads ahead among them), each round was attended
        once, inside the caller's bounce buffers, and no host buffer for a share was allocated; with the C kernel,
        every read's rounds in one C loop, none round by round in Python."""
        assert max(self.rounds.values()) > 1, dict(self.rounds)
        assert (self.looped and not self.stepped) if kernel == "native" else (self.stepped and not self.looped)
        assert any(self.rounds[read] > 1 for read in self.ahead), "no read ahead was consumed round by round"
        assert len(self.in_bounce) == sum(self.rounds.values()) and all(self.in_bounce), self.in_bounce
        assert self.allocated == 0


CASES = [  # (id, family, attention implementation, sliding window, slots per round)
    ("llama-rounds-of-3", "llama", "sdpa", None, 3),
    ("llama-rounds-of-1", "llama", "eager", None, 1),
    ("mistral-sw8", "mistral", "sdpa", 8, 2),  # the window from the mask (no config: every token kept)
    ("gemma2-sw8", "gemma2", "eager", 8, 2),  # soft-capping, sliding and full layers
    ("qwen3", "qwen3", "sdpa", None, 2),
]


@pytest.mark.parametrize(("name", "family", "attn", "window", "per_round"), CASES, ids=[c[0] for c in CASES])
def test_disk_rounds_attended_in_the_bounce_buffer_match_dynamic_cache(tmp_path, monkeypatch, kernel, name, family,
                                                                       attn, window, per_round):
    """A batch of two with left padding (a mask; rows whose blocks lie on different tiers, rounds across both
    rows), GQA, most blocks on disk, read in rounds of ``per_round`` slots: tokens equal, logits within 1e-4."""
    rounds_of(monkeypatch, per_round)
    model = tiny_model(family, attn, window)
    ids, mask = prompt(2, 40, seed=3, left_pad=(0, 6))
    run = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
               return_dict_in_generate=True)  # fmt: skip
    reference = model.generate(ids, past_key_values=DynamicCache(), prefill_chunk_size=16, **run)
    with TieredCache(gpu_gb=gpu(model, 2), cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4) as cache:
        watch = Watch(monkeypatch, cache)
        with cache.split(model, chunk_tokens=8):
            out = model.generate(ids, past_key_values=cache, prefill_chunk_size=16, **run)
        stats = cache.stats()
        assert stats["blocks"]["disk"] > stats["blocks"]["host"] + stats["blocks"]["device"]
        assert cache.store.tiers[Tier.DISK].bounce_bytes == 2 * per_round * SLOT
        executor = cache.executors["split"]
        assert executor.read_ahead_hits > 0
        rounds = sum(watch.rounds.values())  # each of one block at least, counted as disk->host bytes as before
        assert stats["bytes_moved"]["disk->host"] >= rounds * cache.store.layouts[0].block_bytes
        watch.check(kernel)
    assert_same_generation(out, reference, atol=1e-4)


def test_disk_rounds_in_bf16(tmp_path, monkeypatch, kernel):
    """bf16 K/V (a 512-byte block in a 4 KiB slot: the round's blocks are a strided view of the bounce buffer),
    rounds of two slots: logits to bf16 rounding at every step, teacher-forced (as tests/test_split.py)."""
    rounds_of(monkeypatch, 2)
    model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)
    ids, _ = prompt(2, 40, seed=1)
    inputs, expected = teacher_forced(model, ids, NEW)
    with TieredCache(gpu_gb=gpu(model, 2), cpu_gb="12KB", disk_dir=tmp_path, block_tokens=4) as cache:
        watch = Watch(monkeypatch, cache)
        with cache.split(model, chunk_tokens=8):
            for tokens, want in zip(inputs, expected):
                got = model(tokens, past_key_values=cache).logits[:, -1]
                torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
        assert cache.store.layouts[0].dtype == torch.bfloat16 and cache.store.layouts[0].block_bytes < SLOT
        watch.check(kernel)


def test_merge_all_is_the_pairwise_merge(kernel):
    """Merging every round's part at once gives the running pairwise merge's result, rows no part attended
    included (output 0, log-sum-exp -inf)."""
    generator = torch.Generator().manual_seed(0)
    parts = [(torch.randn(2, 4, 1, 16, generator=generator), torch.randn(2, 4, 1, generator=generator) * 3)
             for _ in range(5)]  # fmt: skip
    for out, lse in parts[1:3]:  # rows 1 hold no block in these parts
        out[1], lse[1] = 0.0, float("-inf")
    parts.append((torch.zeros(2, 4, 1, 16), torch.full((2, 4, 1), float("-inf"))))
    out = lse = None
    for part in parts:
        out, lse = merge(out, lse, *part)
    merged_out, merged_lse = merge_all(parts)
    torch.testing.assert_close(merged_out, out, atol=1e-6, rtol=0)
    torch.testing.assert_close(merged_lse, lse, atol=1e-6, rtol=0)
    nothing = merge_all([(torch.zeros(1, 1, 1, 2), torch.full((1, 1, 1), float("-inf")))] * 3)
    assert torch.equal(nothing[0], torch.zeros(1, 1, 1, 2)) and nothing[1].isneginf().all()


def test_a_disk_shares_round_table_names_its_blocks_in_the_bounce_buffer():
    """Blocks ``[lo, hi)`` of a share in row-major order: each round's table holds ids 0.. in that order over the
    columns the round touches (a round may span both rows), -1 elsewhere."""
    table = np.array([[7, -1, 3, 9], [-1, 4, 5, -1]])  # disk slots; row-major: 7, 3, 9, 4, 5
    share = _DiskShare(table)
    assert share.slots.tolist() == [7, 3, 9, 4, 5]
    round_table, columns = share.round(1, 4)  # slots 3, 9 (row 0), 4 (row 1)
    assert columns.tolist() == [1, 2, 3]
    assert round_table.tolist() == [[-1, 0, 1], [2, -1, -1]]
    assert share.round(1, 4)[0] is round_table  # kept for the next steps
    assert share.round(4, 5)[0].tolist() == [[-1], [0]] and share.round(4, 5)[1].tolist() == [2]


# ------------------------------------------------------------------------------------------------ at the tier
class Watched:
    """An engine handle that remembers whether it was waited for."""

    def __init__(self, handle) -> None:
        self.handle, self.waited = handle, False

    def wait(self) -> None:
        try:
            self.handle.wait()
        finally:
            self.waited = True

    def done(self) -> bool:
        return self.handle.done()


def flip(path: Path, position: int) -> None:
    """Change one byte of the tier's file, as a failing drive would."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, position)[0] ^ 0x40]), position)
    finally:
        os.close(fd)


@pytest.fixture
def nine(tmp_path, monkeypatch):
    """A disk tier with 9 blocks written, read in rounds of two slots: yields (tier, layout, slots, data)."""
    layout = BlockLayout(2, 8, 4, torch.float32)
    monkeypatch.setattr(disk_module, "BOUNCE_BYTES", 4 * layout.slot_bytes)
    tier = DiskTier(tmp_path, budget=64 * layout.slot_bytes, extent_bytes=16 * layout.slot_bytes)
    slots = np.array([tier.alloc(layout.slot_bytes) for _ in range(9)], dtype=np.int64)
    data = torch.randn(9, *layout.shape, generator=torch.Generator().manual_seed(0))
    tier.write_from(layout, slots, data, Scratch(BounceBuffer))
    yield tier, layout, slots, data
    tier.close()


@pytest.fixture
def written(nine, monkeypatch):
    """:func:`nine`, and ``watched`` collecting each round's handle: yields (tier, layout, slots, data, watched)."""
    tier, layout, slots, data = nine
    watched: list[Watched] = []
    submit = disk_module._DiskRead._submit

    def watching(read, k):
        submit(read, k)
        read.handles[k] = Watched(read.handles[k])
        watched.append(read.handles[k])

    monkeypatch.setattr(disk_module._DiskRead, "_submit", watching)
    return tier, layout, slots, data, watched


def test_each_round_hands_out_verified_rounds_in_place_the_next_in_flight(written):
    tier, layout, slots, data, watched = written
    scratch = Scratch(BounceBuffer)
    order = slots[::-1].copy()
    read = tier.start_read(layout, order, scratch)
    assert read.rounds == 5 and len(watched) == 2  # both halves are read from the start
    bounce = scratch.bounce_buffer("read")._buffer
    got = []
    for lo, _, staged in read.each_round():
        assert bounce.ctypes.data <= staged.data_ptr() < bounce.ctypes.data + bounce.nbytes  # in place
        assert len(watched) == min(read.rounds, lo // 2 + 2)  # the round after this one is in flight
        got.append(layout.blocks_of(staged).clone())
    torch.testing.assert_close(torch.cat(got), data.flip(0), rtol=0, atol=0)
    finished = torch.empty(9, *layout.shape)
    tier.start_read(layout, order, scratch).finish([(0, 4, finished[:4]), (4, 9, finished[4:])])  # the same rounds
    torch.testing.assert_close(finished, data.flip(0), rtol=0, atol=0)


@pytest.mark.parametrize("how", ["each_round", "finish"])
def test_a_flipped_byte_in_a_later_round_raises_and_leaves_no_read_in_flight(written, how):
    """The third round's first block changed on disk: the read raises IntegrityError naming its slot after
    handing out the first two rounds only, and the fourth round, already in flight into the other half, was
    waited for before the error surfaced."""
    tier, layout, slots, _, watched = written
    flip(next(iter(tier.files.values())).path, int(slots[4]) * layout.slot_bytes + 100)
    read = tier.start_read(layout, slots, Scratch(BounceBuffer))
    handed = []
    with pytest.raises(IntegrityError, match=f"slot {int(slots[4])} "):
        if how == "finish":
            read.finish([(0, 9, torch.empty(9, *layout.shape))])
        else:
            handed.extend(lo for lo, _, _ in read.each_round())
    assert how == "finish" or handed == [0, 2]
    assert len(watched) == 4 and all(handle.waited for handle in watched)


def test_leaving_the_rounds_early_waits_for_the_round_in_flight(written):
    """A consumer that stops after the first round (an error in its kernel call, an interrupt) closes the
    generator: the round in flight into the other half is waited for before the buffer can be used again."""
    tier, layout, slots, _, watched = written
    rounds = tier.start_read(layout, slots, Scratch(BounceBuffer)).each_round()
    next(rounds)
    rounds.close()
    assert len(watched) == 2 and all(handle.waited for handle in watched)


@pytest.mark.parametrize(("parts", "per_round"), [(3, 2), (6, 1)])
def test_a_ring_keeps_parts_minus_one_rounds_in_flight_while_one_is_used(written, parts, per_round):
    """A ring of ``parts`` pieces of ``per_round`` slots in a limit of ``parts * per_round`` slots: ``parts`` rounds
    are submitted at once, and while the consumer holds round k the next ``parts - 1`` are in flight (submitted, not
    yet waited for); the pieces stay within the limit, each round is handed out in place, and the blocks are exact
    (``finish`` through the same ring too)."""
    tier, layout, slots, data, watched = written
    scratch = Scratch(BounceBuffer)
    limit = parts * per_round * layout.slot_bytes
    order = slots[::-1].copy()
    read = tier.start_read(layout, order, scratch, limit=limit, parts=parts)
    assert read.rounds == -(-9 // per_round) and len(read.pieces) == parts and len(watched) == parts
    assert sum(piece.nbytes for piece in read.pieces) <= limit
    bounce = scratch.bounce_buffer("read")._buffer
    got = []
    for k, (lo, hi, staged) in enumerate(read.each_round()):
        assert (lo, hi) == (k * per_round, min(9, (k + 1) * per_round))
        assert bounce.ctypes.data <= staged.data_ptr() < bounce.ctypes.data + bounce.nbytes  # in place
        assert len(watched) == min(read.rounds, k + parts)  # the ring's other pieces are being read into
        in_flight = [handle for handle in watched if not handle.waited]
        assert len(in_flight) == min(parts - 1, read.rounds - 1 - k)
        got.append(layout.blocks_of(staged).clone())
    torch.testing.assert_close(torch.cat(got), data.flip(0), rtol=0, atol=0)
    finished = torch.empty(9, *layout.shape)
    tier.start_read(layout, order, scratch, limit=limit, parts=parts).finish([(0, 5, finished[:5]),
                                                                              (5, 9, finished[5:])])  # fmt: skip
    torch.testing.assert_close(finished, data.flip(0), rtol=0, atol=0)


def test_a_ring_through_several_buffers_takes_them_in_turn_each_within_its_limit(written):
    """Split's shape of ring: two one-slot pieces in each of three buffers of at most two slots. Round k lands in
    buffer k % 3, five rounds are in flight while one is used, no buffer grows past its limit, the blocks are exact
    (``finish`` through the same ring too)."""
    tier, layout, slots, data, watched = written
    scratch, names, limit = Scratch(BounceBuffer), ["x", "y", "z"], 2 * layout.slot_bytes
    read = tier.start_read(layout, slots, scratch, purpose=names, limit=limit, parts=2)
    assert read.rounds == 9 and len(read.pieces) == 6 and len(watched) == 6
    buffers = [scratch.bounce_buffer(name)._buffer for name in names]
    assert [buffer.nbytes for buffer in buffers] == [limit] * 3
    got = []
    for k, (_, _, staged) in enumerate(read.each_round()):
        buffer = buffers[k % 3]
        assert buffer.ctypes.data <= staged.data_ptr() < buffer.ctypes.data + buffer.nbytes
        assert sum(not handle.waited for handle in watched) == min(5, 8 - k)
        got.append(layout.blocks_of(staged).clone())
    torch.testing.assert_close(torch.cat(got), data, rtol=0, atol=0)
    finished = torch.empty(9, *layout.shape)
    tier.start_read(layout, slots, scratch, purpose=names, limit=limit, parts=2).finish([(0, 9, finished)])
    torch.testing.assert_close(finished, data, rtol=0, atol=0)
    assert [scratch.bounce_buffer(name).nbytes for name in names] == [limit] * 3


def test_a_read_that_fits_its_ring_is_cut_into_pieces_all_in_flight(written):
    """``in_pieces``: 9 slots in a ring of three pieces of 3 slots each are three rounds, all submitted at once
    (the consumer attends the first while the others land); without it they are one round, as before."""
    tier, layout, slots, data, watched = written
    scratch = Scratch(BounceBuffer)
    limit = 9 * layout.slot_bytes
    read = tier.start_read(layout, slots, scratch, limit=limit, parts=3, in_pieces=True)
    assert read.rounds == 3 and len(watched) == 3 and not any(handle.waited for handle in watched)
    got = [layout.blocks_of(staged).clone() for _, _, staged in read.each_round()]
    torch.testing.assert_close(torch.cat(got), data, rtol=0, atol=0)
    assert tier.start_read(layout, slots, scratch, limit=limit, parts=3).rounds == 1


def test_a_flipped_byte_in_a_later_round_of_a_ring_raises_and_leaves_no_read_in_flight(written):
    """A ring of three pieces of two slots: the fifth round (slots 8..) is submitted only when the consumer asks for
    the third; a byte changed in it raises IntegrityError naming its slot after rounds 0-3 were handed out, and
    every round submitted was waited for before the error surfaced."""
    tier, layout, slots, _, watched = written
    flip(next(iter(tier.files.values())).path, int(slots[8]) * layout.slot_bytes + 100)
    read = tier.start_read(layout, slots, Scratch(BounceBuffer), limit=6 * layout.slot_bytes, parts=3)
    handed = []
    with pytest.raises(IntegrityError, match=f"slot {int(slots[8])} "):
        handed.extend(lo for lo, _, _ in read.each_round())
    assert handed == [0, 2, 4, 6]
    assert len(watched) == 5 and all(handle.waited for handle in watched)


def test_leaving_a_ring_early_waits_for_every_round_in_flight(written):
    """A consumer that stops at the second round of a ring of four closes the generator: the four rounds in flight
    (three of the first ring's, and the one submitted into the first round's piece) were waited for."""
    tier, layout, slots, _, watched = written
    rounds = tier.start_read(layout, slots, Scratch(BounceBuffer), limit=4 * layout.slot_bytes, parts=4).each_round()
    next(rounds)
    next(rounds)  # round 4 submitted into round 0's piece
    rounds.close()
    assert len(watched) == 5 and all(handle.waited for handle in watched)


# ------------------------------------------------------------------------------------------------ the C loop
CONSUMER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class Consumer:
    """A C-callable consumer for :meth:`~tierkv.tiers.disk._DiskRead.consume_rounds` written in Python (a ctypes
    callback): each round's argument is its index; it records the round, where its bytes lay and a copy of its
    blocks, and returns ``refuse`` at round ``refuse_at`` (else 0)."""

    def __init__(self, read, layout: BlockLayout, refuse_at: int | None = None, refuse: int = 7) -> None:
        self.views = read.ring_views()
        assert self.views is not None and len(self.views) == read.rounds
        self.layout, self.refuse_at, self.refuse = layout, refuse_at, refuse
        self.got: list[tuple[int, int, torch.Tensor]] = []
        self.function = CONSUMER(self._consume)  # kept alive while the loop may call it
        self.address = ctypes.cast(self.function, ctypes.c_void_p).value
        self.arguments = np.arange(read.rounds, dtype=np.uint64)

    def _consume(self, argument: int | None) -> int:
        k = int(argument or 0)
        staged = self.views[k][2]
        self.got.append((k, staged.data_ptr(), self.layout.blocks_of(staged).clone()))
        return self.refuse if k == self.refuse_at else 0


def quiet_pieces(read) -> None:
    """Nothing lands in the ring's pieces any more: bytes written into them stay (a read still in flight would
    overwrite them within the wait)."""
    for piece in read.pieces:
        piece[:] = 0xAB
    time.sleep(0.05)
    assert all((piece == 0xAB).all() for piece in read.pieces)


def test_consume_rounds_hands_every_round_verified_in_place_to_a_c_consumer(nine):
    """A ring of three pieces of two slots over nine blocks (five rounds, three submitted at the start, the rest by
    the C loop into the piece its consumer left): each round reaches the consumer once, in order, in its piece of
    the ring, with the blocks written; nothing is left in flight or held."""
    tier, layout, slots, data = nine
    order = slots[::-1].copy()
    read = tier.start_read(layout, order, Scratch(BounceBuffer), limit=6 * layout.slot_bytes, parts=3)
    assert read.rounds == 5 and len(read.pieces) == 3 and len(read.handles) == 3
    consumer = Consumer(read, layout)
    outcome = read.consume_rounds(consumer.address, consumer.arguments)
    assert outcome.failed is None and outcome.waited_s >= 0
    assert [k for k, _, _ in consumer.got] == [0, 1, 2, 3, 4]
    assert all(pointer == read.pieces[k % 3].ctypes.data for k, pointer, _ in consumer.got)  # in place
    torch.testing.assert_close(torch.cat([blocks for _, _, blocks in consumer.got]), data.flip(0), rtol=0, atol=0)
    assert not read.handles and read.ring_views() is None  # consumed: nothing to hand out again
    quiet_pieces(read)


def test_consume_rounds_raises_a_flipped_byte_before_its_round_reaches_the_consumer(nine):
    """A byte changed in the fifth round (submitted by the C loop): IntegrityError naming its slot once rounds 0-3
    were consumed, and nothing in flight after it."""
    tier, layout, slots, _ = nine
    flip(next(iter(tier.files.values())).path, int(slots[8]) * layout.slot_bytes + 100)
    read = tier.start_read(layout, slots, Scratch(BounceBuffer), limit=6 * layout.slot_bytes, parts=3)
    consumer = Consumer(read, layout)
    with pytest.raises(IntegrityError, match=f"slot {int(slots[8])} "):
        read.consume_rounds(consumer.address, consumer.arguments)
    assert [k for k, _, _ in consumer.got] == [0, 1, 2, 3] and not read.handles
    quiet_pieces(read)


def test_consume_rounds_stops_at_the_consumers_refusal_and_returns_it(nine):
    tier, layout, slots, _ = nine
    read = tier.start_read(layout, slots, Scratch(BounceBuffer), limit=6 * layout.slot_bytes, parts=3)
    consumer = Consumer(read, layout, refuse_at=1, refuse=-5)
    outcome = read.consume_rounds(consumer.address, consumer.arguments)
    assert (outcome.failed, outcome.refused, outcome.status) == (1, True, -5)
    assert [k for k, _, _ in consumer.got] == [0, 1] and not read.handles
    quiet_pieces(read)


def test_consume_rounds_raises_a_read_past_the_end_of_the_file_as_a_disk_error(nine):
    """The tier's file cut after the first four slots once the first two rounds were submitted: the third round,
    submitted by the C loop, hits its end; DiskTierError naming the file, after rounds 0 and 1 were consumed."""
    tier, layout, slots, _ = nine
    order = np.sort(slots)
    read = tier.start_read(layout, order, Scratch(BounceBuffer))  # two halves of two slots: five rounds
    assert read.rounds == 5 and len(read.handles) == 2
    read.settle()  # the first two rounds landed whole
    slot_file = next(iter(tier.files.values()))
    os.truncate(slot_file.path, int(order[4]) * layout.slot_bytes)
    consumer = Consumer(read, layout)
    with pytest.raises(DiskTierError, match=str(slot_file.path)):
        read.consume_rounds(consumer.address, consumer.arguments)
    assert [k for k, _, _ in consumer.got] == [0, 1] and not read.handles
    quiet_pieces(read)


def test_consume_rounds_raises_a_failed_round_settled_before_the_loop(nine):
    """The file cut after two slots before the read: its second round (submitted at the start) fails and a settle
    waits for it; the loop raises that DiskTierError before any round reaches the consumer."""
    tier, layout, slots, _ = nine
    order = np.sort(slots)
    slot_file = next(iter(tier.files.values()))
    os.truncate(slot_file.path, int(order[2]) * layout.slot_bytes)
    read = tier.start_read(layout, order, Scratch(BounceBuffer))
    read.settle()
    consumer = Consumer(read, layout)
    with pytest.raises(DiskTierError, match=str(slot_file.path)):
        read.consume_rounds(consumer.address, consumer.arguments)
    assert consumer.got == [] and not read.handles


def test_split_reads_ahead_through_rings_within_the_read_ahead_bound(tmp_path, monkeypatch, kernel):
    """Split's disk reads at a small bounce limit (two slots): each a ring of six one-slot rounds through three
    bounce buffers, so while a round is attended five more are in flight (two halves would allow one); the next
    layer's read was submitted before this layer's rounds are attended, and the read of the layer after it once
    this layer was attended (into its ring: across the layer boundary); the buffers split's reads hold at once never
    exceed ``(READ_AHEAD + 2) * bounce_bytes``, the bound of exact gather's reads ahead, and no buffer grows past
    ``bounce_bytes``. Tokens and logits as DynamicCache's."""
    rounds_of(monkeypatch, 1)
    model = tiny_model("llama", layers=3)
    ids, _ = prompt(1, 60, seed=2)
    run = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    reference = model.generate(ids, past_key_values=DynamicCache(), prefill_chunk_size=16, **run)
    seen: list[tuple[int, int, int, set[int]]] = []  # per round attended: layer, in flight, bytes held, layers ahead
    after: list[tuple[int, set[int]]] = []  # per layer attended: the layers read ahead when attend returned
    attending: list[tuple[SplitAttention, int]] = []
    each_round, attend = disk_module._DiskRead.each_round, SplitAttention.attend

    def observed_rounds(read):
        for landed in each_round(read):
            if attending:
                executor, layer = attending[-1]
                bounces = executor.store.transfer.scratch
                held = sum(bounces.bounce_buffer(name).nbytes for purpose in executor._buffer_users
                           for name in executor.ring_names(purpose))  # fmt: skip
                seen.append((layer, len(read.handles), held, {key[0] for key in executor._disk_ahead}))
            yield landed

    def watched_attend(executor, span, *args, **kwargs):
        attending.append((executor, span.layer))
        try:
            out = attend(executor, span, *args, **kwargs)
        finally:
            attending.pop()
        after.append((span.layer, {key[0] for key in executor._disk_ahead}))
        return out

    monkeypatch.setattr(disk_module._DiskRead, "each_round", observed_rounds)
    monkeypatch.setattr(disk_module._DiskRead, "ring_views", lambda read: None)  # round by round, to look inside
    monkeypatch.setattr(SplitAttention, "attend", watched_attend)
    with TieredCache(gpu_gb=gpu(model, 1), cpu_gb="8KB", disk_dir=tmp_path, block_tokens=4) as cache:
        with cache.split(model, chunk_tokens=8):
            out = model.generate(ids, past_key_values=cache, prefill_chunk_size=16, **run)
        executor, disk = cache.executors["split"], cache.store.tiers[Tier.DISK]
        bounce = disk.bounce_bytes
        assert bounce == 2 * SLOT and executor.read_ahead == 2 and executor.ring() == (3, bounce, 2)
        assert executor.ring_names("ahead1") == ["ahead3", "ahead4", "ahead5"]
        assert max(b.nbytes for b in cache.store.transfer.scratch._local.bounces.values()) <= bounce
        assert executor.read_ahead_hits > 0
    assert_same_generation(out, reference, atol=1e-4)
    assert max(in_flight for _, in_flight, _, _ in seen) == 5  # parts - 1 (two halves: 1)
    assert max(held for _, _, held, _ in seen) <= (READ_AHEAD + 2) * bounce
    assert max(held for _, _, held, _ in seen) > 2 * bounce  # rings, not a bounce buffer each
    assert all(ahead == {(layer + 1) % 3} for layer, _, _, ahead in seen[len(seen) // 2 :]), seen  # while attended
    assert all(ahead == {(layer + 1) % 3, (layer + 2) % 3} for layer, ahead in after[len(after) // 2 :]), after


def test_a_multi_token_step_between_decode_steps_does_not_reuse_a_read_ahead_it_overwrote(tmp_path):
    """Split's decode steps leave the next step's layer-0 read ahead in a read-ahead buffer; a two-token step in
    between (streaming, the mode's prefill executor, reading ahead into the same buffers of the thread) fills that
    buffer with its own reads, and the decode step after it (the table unchanged: the tokens fit the open block)
    must not attend what is there: the executor that hands over drops its reads ahead. Logits as DynamicCache's at
    every step (wrong by ~5e-2 before)."""
    model = tiny_model("llama", layers=3)
    ids, _ = prompt(1, 48, seed=2)
    steps = [ids, *(torch.tensor([tokens]) for tokens in ([5], [7], [9, 11], [13], [15]))]
    reference = DynamicCache()
    with torch.no_grad():
        expected = [model(tokens, past_key_values=reference).logits[:, -1] for tokens in steps]
    budget = TieredCache.min_split_device_bytes(model.config, 1, block_tokens=8, chunk_tokens=8) + 16384
    with torch.no_grad(), TieredCache(gpu_gb=f"{budget}B", cpu_gb="8KB", disk_dir=tmp_path, block_tokens=8) as cache, \
            cache.split(model, chunk_tokens=8):
        for index, (tokens, want) in enumerate(zip(steps, expected)):
            executor = cache.executors.get("split")
            if index == 3:
                assert executor is not None and 0 in {layer for layer, _ in executor._disk_ahead}
            torch.testing.assert_close(model(tokens, past_key_values=cache).logits[:, -1], want, atol=1e-4, rtol=0)
        assert cache.executors["split"].read_ahead_hits > 0 and cache.stats()["blocks"]["disk"] > 8


def test_a_flipped_byte_on_disk_stops_split_decode_with_no_read_in_flight(tmp_path, monkeypatch, kernel):
    """Through the model: a byte flipped in a disk block that a later round of layer 0's read reads raises
    IntegrityError from the decode step, and every round submitted for that read was waited for before the error
    left ``attend``."""
    monkeypatch.setattr(disk_module, "BOUNCE_BYTES", SLOT)  # rings of three one-slot rounds: the 4th read after
    model = tiny_model("llama")
    ids, _ = prompt(1, 60, seed=2)
    reads: list[tuple[disk_module._DiskRead, list[Watched]]] = []
    unsettled: list[int] = []
    flipped: list[int] = []
    submit, attend = disk_module._DiskRead._submit, SplitAttention.attend

    def watching(read, k):
        submit(read, k)
        read.handles[k] = Watched(read.handles[k])
        if not reads or reads[-1][0] is not read:
            reads.append((read, []))
        next(handles for each, handles in reads if each is read).append(read.handles[k])

    def attending(executor, span, *args, **kwargs):
        try:
            return attend(executor, span, *args, **kwargs)
        except IntegrityError:
            unsettled.extend(sum(not h.waited for h in handles) for read, handles in reads if flipped[0] in read.slots)
            raise

    monkeypatch.setattr(disk_module._DiskRead, "_submit", watching)
    monkeypatch.setattr(SplitAttention, "attend", attending)
    with TieredCache(gpu_gb=gpu(model, 1), cpu_gb="8KB", disk_dir=tmp_path, block_tokens=4) as cache, \
            cache.split(model, chunk_tokens=8):
        model(ids, past_key_values=cache)
        token = torch.tensor([[5]])
        for _ in range(2):  # the layers' tables built, the layer count learnt: layer 0's read is submitted ahead
            model(token, past_key_values=cache)
        assert cache.executors["split"].read_ahead_hits > 0
        cache.store.writeback.reap(wait=True)
        rows = cache.store.table.rows[0]
        on_disk = rows.slots[0][rows.tiers[0] == Tier.DISK]  # the order of layer 0's read
        assert on_disk.size >= 5, cache.stats()["blocks"]
        slot_file = next(iter(cache.store.tiers[Tier.DISK].files.values()))
        flipped.append(int(on_disk[3]))
        flip(slot_file.path, flipped[0] * slot_file.slot_bytes + 100)  # its fourth round: submitted after now
        with pytest.raises(IntegrityError, match=f"slot {flipped[0]} "):
            model(token, past_key_values=cache)
    assert unsettled and not any(unsettled), f"rounds still in flight when the error left attend: {unsettled}"


def test_a_flipped_byte_on_disk_stops_the_c_loop_of_split_decode(tmp_path, monkeypatch):
    """As above, through the C kernel's loop over a read's rounds: the decode step raises IntegrityError from the
    loop (the flipped block's round never reaches the kernel), and the read has nothing in flight afterwards."""
    use_host_kernel("native", monkeypatch)
    monkeypatch.setattr(disk_module, "BOUNCE_BYTES", SLOT)
    model = tiny_model("llama")
    ids, _ = prompt(1, 60, seed=2)
    looped, failed = [], []
    consume = disk_module._DiskRead.consume_rounds

    def consuming(read, consumer, arguments):
        looped.append(read)
        try:
            return consume(read, consumer, arguments)
        except IntegrityError:
            failed.append(read)
            raise

    monkeypatch.setattr(disk_module._DiskRead, "consume_rounds", consuming)
    with TieredCache(gpu_gb=gpu(model, 1), cpu_gb="8KB", disk_dir=tmp_path, block_tokens=4) as cache, \
            cache.split(model, chunk_tokens=8):
        model(ids, past_key_values=cache)
        token = torch.tensor([[5]])
        for _ in range(2):
            model(token, past_key_values=cache)
        assert looped and not failed
        cache.store.writeback.reap(wait=True)
        rows = cache.store.table.rows[0]
        on_disk = rows.slots[0][rows.tiers[0] == Tier.DISK]
        slot_file = next(iter(cache.store.tiers[Tier.DISK].files.values()))
        flip(slot_file.path, int(on_disk[3]) * slot_file.slot_bytes + 100)  # layer 0's fourth round
        with pytest.raises(IntegrityError, match=f"slot {int(on_disk[3])} "):
            model(token, past_key_values=cache)
        assert len(failed) == 1 and not failed[0].handles
        quiet_pieces(failed[0])
