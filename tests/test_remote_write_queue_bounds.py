"""The remote tier's write-behind queue (tierkv.remote.writer.WriteBehind) holds at most ``max_items`` writes and
``max_bytes`` bytes beside the batch its thread is sending (one block larger than the bound still goes alone);
what does not fit is dropped and reported, and ``flush`` returns True only once every write was sent."""

from __future__ import annotations

import threading

from tierkv.remote.writer import WriteBehind


class Sink:
    """Where the writer thread sends its batches: it holds each batch until ``gate`` opens."""

    def __init__(self) -> None:
        self.gate, self.taken = threading.Event(), threading.Event()
        self.written: list[str] = []
        self.drops: list[tuple[int, str]] = []
        self.errors: list[BaseException] = []

    def write(self, batch) -> None:
        self.taken.set()
        assert self.gate.wait(30)
        self.written.extend(key for key, _ in batch)

    def queue(self, **bounds) -> WriteBehind:
        return WriteBehind(self.write, lambda size, reason: self.drops.append((size, reason)), self.errors.append,
                           **bounds)


def test_the_queue_holds_max_items_beside_the_batch_in_flight():
    sink = Sink()
    writer = sink.queue(max_items=2, max_bytes=1 << 20)
    try:
        assert writer.offer("k0", b"x" * 10)
        assert sink.taken.wait(30)  # the thread holds k0: the queue is empty again
        assert writer.pending == 1 and not writer.flush(0.2)  # but k0 was not sent yet
        assert [writer.offer(f"k{i}", b"x" * 10) for i in range(1, 5)] == [True, True, False, False]
        assert sink.drops == [(10, "full"), (10, "full")]
        assert writer.pending == 3
        assert not writer.flush(0.2)  # k0 is still being sent
        sink.gate.set()
        assert writer.flush(30)
        assert sink.written == ["k0", "k1", "k2"] and writer.pending == 0
    finally:
        sink.gate.set()
        writer.close()
    assert sink.errors == []


def test_the_queue_holds_max_bytes_and_one_larger_block_alone():
    sink = Sink()
    writer = sink.queue(max_items=100, max_bytes=25)
    try:
        assert writer.offer("k0", b"x" * 10)
        assert sink.taken.wait(30)
        assert [writer.offer(f"k{i}", b"x" * 10) for i in range(1, 4)] == [True, True, False]  # 30 > 25 bytes
        assert sink.drops == [(10, "full")]
        sink.gate.set()
        assert writer.flush(30)
        sink.gate.clear()
        sink.taken.clear()
        assert writer.offer("big", b"y" * 100)  # larger than the bound, into an empty queue: sent alone
        assert sink.taken.wait(30)
        assert writer.offer("k4", b"x" * 25)
        assert not writer.offer("k5", b"x" * 1)
        sink.gate.set()
        assert writer.flush(30)
        assert sink.written == ["k0", "k1", "k2", "big", "k4"]
    finally:
        sink.gate.set()
        writer.close()
    assert sink.errors == []
