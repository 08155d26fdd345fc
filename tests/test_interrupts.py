"""Ctrl-C at any line: a SIGINT delivered at the n-th line that runs inside tierkv's store, tiers, policy,
persist and block-table modules (``sys.settrace``), for many n, during real store and cache operations.

After each interrupt: every slot of every tier is free or held by exactly one live block (or the write-back
in flight), the policy indexes exactly the live blocks, budgets hold, the interrupted operation either took
effect or did not (every layer reads back its contents before or after it, equal to a reference), and
``reset()``/``close()`` then free everything. The interrupt is delivered the way CPython delivers Ctrl-C: the
SIGINT handler installed at that moment is called there (the default one raises ``KeyboardInterrupt``; inside
a :func:`tierkv.atomic.deferred_interrupts` commit the store's handler holds it until the commit is done).
Not at the line event that starts a ``with`` statement's exit code: CPython checks for signals only after
``__exit__`` was called there (a ``with lock:`` always releases it), so an interrupt there cannot happen.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import os
import random
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from types import CodeType

import numpy as np
import pytest
import torch
from helpers import kv, make_store

import tierkv
from tierkv.blocks import Tier
from tierkv.layout import BlockLayout
from tierkv.persist import record
from tierkv.policy.lru import LRUPolicy
from tierkv.tiers.base import Scratch
from tierkv.tiers.disk import BounceBuffer, DiskTier

PACKAGE = Path(tierkv.__file__).parent
TRACED = tuple(str(PACKAGE / name) for name in ("store/", "tiers/", "policy/", "persist/", "blocks.py", "atomic.py"))
RUNS_PER_OPERATION = 40  # interrupt points per operation: every line when it runs fewer, else a spread sample


@functools.cache
def with_exits(code: CodeType) -> frozenset[int]:
    """Offsets where a ``with`` block's exit starts (``__exit__(None, None, None)``, or the exception path's
    ``PUSH_EXC_INFO; WITH_EXCEPT_START``): no signal is handled before ``__exit__`` runs. The bytecode differs by
    version: 3.10 ``LOAD_CONST None; DUP_TOP; DUP_TOP; CALL_FUNCTION 3`` (its exception path starts at
    ``WITH_EXCEPT_START``), 3.11 ``LOAD_CONST None`` x3 then ``PRECALL 2; CALL 2``, 3.12 and later no ``PRECALL``."""
    ops = [o for o in dis.get_instructions(code) if o.opname != "PRECALL"]
    exits = set()
    for i, op in enumerate(ops):
        window = [(o.opname, o.argval if o.opname == "LOAD_CONST" else o.arg) for o in ops[i : i + 4]]
        if window[:2] == [("PUSH_EXC_INFO", None), ("WITH_EXCEPT_START", None)] or (
                window[0][0] == "WITH_EXCEPT_START" and ops[i - 1].opname != "PUSH_EXC_INFO") or window in (
                [("LOAD_CONST", None)] * 3 + [("CALL", 2)],  # 3.11+
                [("LOAD_CONST", None), ("DUP_TOP", None), ("DUP_TOP", None), ("CALL_FUNCTION", 3)]):  # 3.10
            exits.add(op.offset)
    return frozenset(exits)


class Interrupt:
    """Deliver SIGINT at the ``nth`` line executed in :data:`TRACED` files (``nth=0``: never; count them)."""

    def __init__(self, nth: int = 0, traced: tuple[str, ...] = TRACED, functions: frozenset[str] | None = None) -> None:
        self.nth, self.lines, self.fired, self.where = nth, 0, False, ""
        self.traced, self.functions = traced, functions  # functions: only lines of these (by name), if given

    def __enter__(self) -> Interrupt:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.settrace(None)

    def _call(self, frame, event, arg):
        code = frame.f_code
        if not code.co_filename.startswith(self.traced):
            return None
        return self._line if self.functions is None or code.co_name in self.functions else None

    def _line(self, frame, event, arg):
        if event != "line" or self.fired:
            return None if self.fired else self._line
        if frame.f_lasti in with_exits(frame.f_code) or _in_finalizer(frame):
            return self._line
        self.lines += 1
        if self.lines == self.nth:
            self.fired = True
            code = frame.f_code
            self.where = f"{Path(code.co_filename).relative_to(PACKAGE)}:{frame.f_lineno} ({code.co_name})"
            sys.settrace(None)
            signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)  # what CPython does when Ctrl-C arrives
        return self._line


def _in_finalizer(frame) -> bool:
    """A line that a ``weakref.finalize`` callback runs (when the garbage collector frees an object, at any line of
    the operation): not an interrupt point. CPython reports a KeyboardInterrupt raised there as unraisable and
    goes on, and a trace function that raises there leaves the interpreter's tracing state broken."""
    while frame is not None:
        if frame.f_code.co_filename == weakref.__file__:
            return True
        frame = frame.f_back
    return False


def points(lines: int, runs: int = RUNS_PER_OPERATION) -> list[int]:
    """Which lines to interrupt at: all of them, or an even spread plus a fixed random sample."""
    if lines <= runs:
        return list(range(1, lines + 1))
    spread = {1 + round(i * (lines - 1) / (runs // 2 - 1)) for i in range(runs // 2)}
    return sorted(spread | set(random.Random(lines).sample(range(1, lines + 1), runs // 2)))


def interrupt_everywhere(setup: Callable, operation: Callable, check: Callable, runs: int = RUNS_PER_OPERATION,
                         traced: tuple[str, ...] = TRACED, functions: frozenset[str] | None = None) -> int:
    """Run ``operation(state)`` once to count its lines in ``traced`` files (in ``functions``, if given), then
    again from a fresh ``setup()`` for each interrupt point; ``check(state, interrupted)`` after each. Returns the
    lines counted. (A run may execute a few lines fewer than the count, e.g. when a background write finished
    sooner: then it is not interrupted.)"""
    state = setup()
    with Interrupt(traced=traced, functions=functions) as counter:
        operation(state)
    check(state, False)
    assert counter.lines > 0
    fired = 0
    for nth in points(counter.lines, runs):
        state = setup()
        interrupted = False
        with Interrupt(nth, traced, functions) as interrupt:
            try:
                operation(state)
            except KeyboardInterrupt:
                interrupted = True
        fired += interrupt.fired
        try:
            check(state, interrupted)
        except AssertionError as exc:
            raise AssertionError(f"interrupted at line {nth} of {counter.lines}, {interrupt.where}: {exc}") from exc
    assert fired >= len(points(counter.lines, runs)) * 0.9, f"only {fired} runs reached their interrupt point"
    return counter.lines


# ------------------------------------------------------------------------------------------ invariants
def check_policy(store) -> None:
    """The LRU index holds exactly the live blocks that are not pinned, each under its tier and slot size."""
    policy = store.policy
    assert isinstance(policy, LRUPolicy)
    indexed = {}
    for tier, slot_bytes, layer, block in policy.indexed():
        assert block.id not in indexed, f"block {block.id} indexed twice"
        assert (block.tier, block.slot_bytes, block.layer) == (tier, slot_bytes, layer), block
        indexed[block.id] = block
    live = store.table.blocks
    for block_id, block in indexed.items():
        assert live.get(block_id) is block, f"dead block {block_id} still indexed by the policy"
    pinned = store.writeback.pending_ids
    missing = set(live) - set(indexed) - pinned
    assert not missing, f"live blocks {sorted(missing)} unknown to the policy: never demoted"


def check_store(store) -> None:
    store.check()
    check_policy(store)
    for tier in store.tiers.values():
        assert tier.allocated_bytes <= tier.budget, tier


def contents(store) -> dict[int, torch.Tensor]:
    return {layer: store.read_tokens(layer) for layer in store.table.rows if store.seq_length(layer)}


def same(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def check_frees_everything(store) -> None:
    store.reset()
    check_store(store)
    assert all(used == 0 for tier in store.tiers.values() for used in tier.slot_counts().values())
    keys, values = kv(2, 9, seed=99)
    store.append(0, keys, values)  # works as new
    assert torch.equal(store.read_tokens(0), torch.stack((keys, values)))
    store.close()


# --------------------------------------------------------------------------------------- store operations
def _filled(tmp_path, name: str, tokens: int = 22, batch: int = 2, layers: int = 2, **sizes):
    """A store with ``tokens`` tokens in each of ``layers`` layers: blocks on the device, host and disk."""
    counter = [0]

    def setup():
        counter[0] += 1
        store = make_store(tmp_path / f"{name}-{counter[0]}", **{"device_slots": 6, "host_slots": 6, **sizes})
        for step, length in enumerate((tokens - 1, 1)):  # a prefill, then one decode token
            for layer in range(layers):
                store.append(layer, *kv(batch, length, seed=100 * step + layer))
        store.writeback.reap(wait=True)
        return store

    return setup


def _append(tokens: int):
    def operation(store):
        for layer in sorted(store.table.rows):
            store.append(layer, *kv(store.batch_size(layer), tokens, seed=7 + layer))
    return operation


def _expect_append(before, tokens: int):
    after = {}
    for layer, held in before.items():
        keys, values = kv(held.shape[1], tokens, seed=7 + layer)
        after[layer] = torch.cat((held, torch.stack((keys, values))), dim=3)
    return after


def _store_case(tmp_path, name, setup, operation, expect, per_layer: bool = True) -> None:
    """Interrupt ``operation`` everywhere; each layer (or, ``per_layer=False``, the whole store) must hold its
    contents before or after it (``expect(before)``); then reset and close free everything."""
    befores = {}

    def fresh():
        store = setup()
        befores[id(store)] = contents(store)
        return store

    def check(store, interrupted):
        store.writeback.reap(wait=True)  # a write-back left in flight by the interrupt lands or fails now
        check_store(store)
        before = befores.pop(id(store))
        after = expect(before)
        now = contents(store)
        if per_layer:
            for layer in before.keys() | after.keys():
                got = {layer: now[layer]} if layer in now else {}
                was = {layer: before[layer]} if layer in before else {}
                will = {layer: after[layer]} if layer in after else {}
                assert same(got, was) or same(got, will), f"layer {layer} is neither before nor after the operation"
        else:
            assert same(now, before) or same(now, after), "the store is neither before nor after the operation"
        if not interrupted:
            assert same(now, after)
        check_frees_everything(store)

    interrupt_everywhere(fresh, operation, check)


def test_appends(tmp_path):
    """Prefill-sized and decode appends into a full device: allocation, demotion to host and disk, write-back."""
    setup = _filled(tmp_path, "append")
    _store_case(tmp_path, "prefill", setup, _append(9), lambda before: _expect_append(before, 9))
    _store_case(tmp_path, "decode", setup, _append(1), lambda before: _expect_append(before, 1))
    _store_case(tmp_path, "new-block", _filled(tmp_path, "edge", tokens=24), _append(1),
                lambda before: _expect_append(before, 1))


def test_writeback_completion(tmp_path):
    """Reaping a finished background write: blocks move from host to disk, host slots are freed."""
    filled = _filled(tmp_path, "writeback")

    def setup():
        store = filled()
        for step in range(64):  # decode until the host is full enough to start a background write
            store.append(step % 2, *kv(2, 1, seed=step))
            if store.writeback.pending is not None:
                break
        assert store.writeback.pending is not None, "the workload must leave a write-back in flight"
        store.writeback.pending.handle.wait()
        return store

    def expect(before):
        return before

    def reap(store):
        store.writeback.reap(wait=True)

    _store_case(tmp_path, "reap", setup, reap, expect)


def test_demotion(tmp_path):
    """An explicit demotion of every device block (device -> host, host -> disk cascades)."""
    def demote(store):
        store.demote([b for b in list(store.table.blocks.values()) if b.tier == Tier.DEVICE and b.tokens == 4])

    _store_case(tmp_path, "demote", _filled(tmp_path, "demote", device_slots=12), demote, lambda before: before)


def _rows(indices):
    def operation(store):
        store.select_rows(indices)

    def expect(before):
        return {layer: held[:, indices] for layer, held in before.items()}

    return operation, expect


def test_select_rows_and_crop(tmp_path):
    """Beam reorder and batch selection (all layers at once), then crops through shared and demoted blocks."""
    setup = _filled(tmp_path, "rows", device_slots=10)
    for indices in ([1, 0], [0, 0, 1], [1]):
        _store_case(tmp_path, f"select-{indices}", setup, *_rows(indices), per_layer=False)

    def shared():
        store = setup()
        store.select_rows([0, 0, 1])  # rows 0 and 1 share every block: a crop through one copies it
        return store

    for remove in (3, 9, 22):
        def crop(store, remove=remove):
            for layer in sorted(store.table.rows):
                store.crop(layer, remove)

        def expect(before, remove=remove):
            return {layer: held[..., : held.shape[3] - remove, :] for layer, held in before.items()
                    if held.shape[3] > remove}

        _store_case(tmp_path, f"crop-{remove}", shared, crop, expect)


def test_drop_front_and_reset(tmp_path):
    setup = _filled(tmp_path, "front")

    def drop(store):
        for layer in sorted(store.table.rows):
            store.drop_front(layer, 10)

    _store_case(tmp_path, "drop-front", setup, drop,
                lambda before: {layer: held[..., 8:, :] for layer, held in before.items()})
    _store_case(tmp_path, "reset", setup, lambda store: store.reset(), lambda before: {}, per_layer=False)


# --------------------------------------------------------------------------------------- cache operations
CACHE_RUNS = 12  # interrupt points per cache operation (a forward runs thousands of traced lines)
FILE_RUNS = 8  # ... per save, load and load_prefix


@functools.cache
def _model():
    from models import small_llama

    return small_llama()


def _cache_case(tmp_path, name: str, operation: Callable, persist: bool = False) -> None:
    """A real model's cache with blocks on every tier: ``operation(cache, reference)`` interrupted anywhere leaves
    every layer at one length, before or after it, equal to ``DynamicCache``; then ``close()`` removes the files."""
    from transformers import DynamicCache

    from tierkv import TieredCache

    model = _model()
    ids = torch.randint(2, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    counter = [0]

    def setup():
        counter[0] += 1
        directory = tmp_path / f"{name}-{counter[0]}"
        cache = TieredCache(gpu_gb="40KB", cpu_gb="24KB", disk_dir=directory, block_tokens=4, persist=persist)
        reference = DynamicCache()
        with torch.no_grad():
            model(ids, past_key_values=cache)
            model(ids, past_key_values=reference)
        assert cache.stats()["blocks"]["disk"] > 0
        return cache, reference, directory

    def run(state):
        cache, reference, _ = state
        operation(model, cache, reference, ids)

    def check(state, interrupted):
        cache, reference, directory = state
        store = cache.store
        store.writeback.reap(wait=True)
        check_store(store)
        length = cache.get_seq_length()
        assert {layer.get_seq_length() for layer in cache.layers} == {length}, "layers differ in length"
        assert length in (24, reference.get_seq_length()), length
        for index, layer in enumerate(reference.layers):
            stored = store.read_tokens(index)
            # the prefill was exact gather (bit-exact); a streaming step's token is within float rounding
            torch.testing.assert_close(stored[0], layer.keys[..., :length, :], atol=1e-5, rtol=0)
            torch.testing.assert_close(stored[1], layer.values[..., :length, :], atol=1e-5, rtol=0)
        cache.close()
        assert not [p for p in directory.iterdir() if p.name.startswith("tierkv-") and p.is_file()]

    interrupt_everywhere(setup, run, check, runs=CACHE_RUNS)


def _decode(model, cache, reference, ids):
    token = ids[:, -1:]
    with torch.no_grad():
        model(token, past_key_values=reference)
        model(token, past_key_values=cache)


def _decode_streaming(model, cache, reference, ids):
    token = ids[:, -1:]
    with torch.no_grad():
        model(token, past_key_values=reference)
        with cache.streaming(model, chunk_tokens=8):  # two chunks of 8 tokens fit the 40 KB device budget
            model(token, past_key_values=cache)


def test_decode_steps_with_both_executors(tmp_path):
    _cache_case(tmp_path, "exact", _decode)
    _cache_case(tmp_path, "streaming", _decode_streaming)



class SecondInterrupt:
    """Once ``first`` has fired, deliver another SIGINT at the ``nth`` Python call into :data:`TRACED` files while
    the first unwinds (its undo). A profile hook, not a trace: raising from the trace function switched tracing
    off. Call ``1`` is typically the entry of an undo's ``deferred_interrupts()``, before it holds signals."""

    def __init__(self, first: Interrupt, nth: int, function: str | None = None) -> None:
        self.first, self.nth, self.calls, self.fired = first, nth, 0, False
        self.function = function  # count only calls of this function (by name), if given

    def __enter__(self) -> SecondInterrupt:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.setprofile(None)

    def _profile(self, frame, event, arg):
        code = frame.f_code
        if event != "call" or self.fired or not self.first.fired or not code.co_filename.startswith(TRACED) \
                or self.function not in (None, code.co_name):
            return
        self.calls += 1
        if self.calls == self.nth:
            self.fired = True
            sys.setprofile(None)
            signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)



def test_a_second_ctrl_c_during_the_stores_recover(tmp_path):
    """An append interrupted as one of its commits starts (slots taken, not yet recorded), then again as its
    ``recover()`` starts (before it holds signals): the slots stay taken until the next store operation, which
    recovers first; then no slot is leaked."""
    setup = _filled(tmp_path, "twice")
    operation = _append(9)
    commits = frozenset({"deferred_interrupts"})
    with Interrupt(functions=commits) as counter:
        operation(setup())
    leaked_then_recovered = 0
    for nth in points(counter.lines):
        store = setup()
        with Interrupt(nth, functions=commits) as first, SecondInterrupt(first, 1, "recover"), \
                contextlib.suppress(KeyboardInterrupt):
            operation(store)
        store.writeback.reap(wait=True)
        try:
            store.check()
        except AssertionError:
            leaked_then_recovered += 1
        _append(1)(store)  # the next operation
        store.writeback.reap(wait=True)
        check_store(store)
        check_frees_everything(store)
    assert leaked_then_recovered, "no second interrupt cut a recover() short: the test reached nothing"

def test_a_second_ctrl_c_during_the_undo_of_the_first(tmp_path):
    """A decode step interrupted twice, the second time inside the undo of the first (cache rollback, the store's
    recover, an in-place append's undo): the next step settles whatever the cut undo left, and the cache then
    equals ``DynamicCache`` with no slot leaked; ``close()`` removes the files."""
    from transformers import DynamicCache

    from tierkv import TieredCache

    model = _model()
    ids = torch.randint(2, 128, (1, 26), generator=torch.Generator().manual_seed(3))
    prompt, step, after = ids[:, :24], ids[:, 24:25], ids[:, 25:26]

    def fresh(directory):
        cache = TieredCache(gpu_gb="40KB", cpu_gb="24KB", disk_dir=directory, block_tokens=4)
        with torch.no_grad():
            model(prompt, past_key_values=cache)
        assert cache.stats()["blocks"]["disk"] > 0
        return cache

    reference = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=reference)
    cache = fresh(tmp_path / "count")
    with Interrupt() as counter, torch.no_grad():
        model(step, past_key_values=cache)
    cache.close()
    seconds_fired = 0
    for run, (nth, second) in enumerate((n, m) for n in points(counter.lines, 16) for m in (1, 2, 4, 8)):
        directory = tmp_path / f"run-{run}"
        cache = fresh(directory)
        with Interrupt(nth) as first, SecondInterrupt(first, second) as again:
            try:
                with torch.no_grad():
                    model(step, past_key_values=cache)
            except KeyboardInterrupt:
                pass
        where = f"first at line {nth} ({first.where}), second at call {second}: "
        seconds_fired += again.fired
        with torch.no_grad():
            length = cache.get_seq_length()  # what generate() asks first
            assert length in (24, 25), where + str(length)
            if length == 24:
                model(step, past_key_values=cache)
            model(after, past_key_values=cache)  # a store operation after the interrupts
        store = cache.store
        store.writeback.reap(wait=True)
        try:
            check_store(store)
            assert {layer.get_seq_length() for layer in cache.layers} == {26}
            for index, layer in enumerate(reference.layers):
                stored = store.read_tokens(index)
                torch.testing.assert_close(stored[0], layer.keys, atol=1e-5, rtol=0)
                torch.testing.assert_close(stored[1], layer.values, atol=1e-5, rtol=0)
        except AssertionError as exc:
            raise AssertionError(where + str(exc)) from exc
        cache.close()
        assert not [p for p in directory.iterdir() if p.name.startswith("tierkv-") and p.is_file()], where
    assert seconds_fired > 10, f"only {seconds_fired} second interrupts were delivered"


def test_a_ctrl_c_in_the_models_own_code_between_two_layers(tmp_path):
    """SIGINT inside a decoder layer's own forward (no tierkv code on the stack) leaves the layers before it one
    step ahead. The next forward's first update rolls them back and refuses that forward with a clear error (its
    positions came from layer 0's length); the one after resumes, and generate() then gives DynamicCache's tokens
    and logits."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from tierkv import TieredCache
    from tierkv.errors import InterruptedStepError

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(2, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    options = dict(do_sample=False, max_new_tokens=6, output_scores=True, return_dict_in_generate=True)
    reference = model.generate(ids, past_key_values=DynamicCache(), **options)

    for stop_at in (0, 1, 2):  # the decoder layer whose MLP is interrupted (after its attention updated the cache)
        cache = TieredCache(gpu_gb="48KB", cpu_gb="16KB", disk_dir=tmp_path / f"at-{stop_at}", block_tokens=4,
                            config=config)
        with torch.no_grad():
            model(ids[:, :-1], past_key_values=cache)
        assert cache.stats()["blocks"]["disk"] > 0

        def interrupt(module, args):
            raise KeyboardInterrupt

        hook = model.model.layers[stop_at].mlp.register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            model(ids[:, -1:], past_key_values=cache)
        hook.remove()
        lengths = [layer.get_seq_length() for layer in cache.layers]
        assert lengths == [24] * (stop_at + 1) + [23] * (3 - stop_at), lengths  # what the interrupt left
        with pytest.raises(InterruptedStepError, match="Call generate"):
            model.generate(ids, past_key_values=cache, **options)
        assert [layer.get_seq_length() for layer in cache.layers] == [23] * 4
        check_store(cache.store)
        out = model.generate(ids, past_key_values=cache, **options)
        assert torch.equal(out.sequences, reference.sequences)
        for got, want in zip(out.scores, reference.scores, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        cache.close()

def test_save_load_and_load_prefix(tmp_path):
    """An interrupted save leaves no file or a complete one; an interrupted load or load_prefix leaves no cache
    files behind and the persistent directory opens clean with every listed block valid."""
    from tierkv import TieredCache
    from tierkv.persist.blockfile import PersistentStore

    model = _model()
    ids = torch.randint(2, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    options = dict(gpu_gb="40KB", cpu_gb="24KB", block_tokens=4)
    source = TieredCache(disk_dir=tmp_path / "source", persist=True, **options)
    source.load_prefix(model, ids)
    with torch.no_grad():
        model(ids, past_key_values=source)
    saved = tmp_path / "saved.tkv"
    source.save(saved, model)
    source.close()
    expected = TieredCache.load(saved, model, disk_dir=tmp_path / "check", **options)
    want = [expected.store.read_tokens(i) for i in range(2)]
    expected.close()
    counter = [0]

    def save_setup():
        counter[0] += 1
        return TieredCache.load(saved, model, disk_dir=tmp_path / f"s{counter[0]}", **options), counter[0]

    def save(state):
        state[0].save(tmp_path / f"out{state[1]}.tkv", model)

    def save_check(state, interrupted):
        cache, n = state
        cache.close()
        out = tmp_path / f"out{n}.tkv"
        if out.exists():  # a complete file, or none
            loaded = TieredCache.load(out, model, disk_dir=tmp_path / f"v{n}", **options)
            assert all(torch.equal(loaded.store.read_tokens(i), want[i]) for i in range(2))
            loaded.close()
        else:
            assert interrupted

    interrupt_everywhere(save_setup, save, save_check, runs=FILE_RUNS)

    def load_setup():
        counter[0] += 1
        return tmp_path / f"l{counter[0]}", []

    def load(state):
        state[1].append(TieredCache.load(saved, model, disk_dir=state[0], **options))

    def load_check(state, interrupted):
        directory, caches = state
        for cache in caches:
            assert all(torch.equal(cache.store.read_tokens(i), want[i]) for i in range(2))
            cache.close()
        left = [p for p in directory.iterdir() if p.is_file()] if directory.exists() else []
        assert not [p for p in left if p.name.startswith("tierkv-")], left

    interrupt_everywhere(load_setup, load, load_check, runs=FILE_RUNS)

    def prefix_setup():
        counter[0] += 1
        return TieredCache(disk_dir=tmp_path / "source", persist=True, **options)

    def prefix(cache):
        cache.load_prefix(model, ids)

    def prefix_check(cache, interrupted):
        held = cache.get_seq_length()
        assert held in (0, 20), held
        if held:
            check_store(cache.store)
        cache.close()
        store = PersistentStore(tmp_path / "source", 2**30)
        assert store.verify() == []  # every listed block still reads back valid
        store.close()

    interrupt_everywhere(prefix_setup, prefix, prefix_check, runs=FILE_RUNS)


class _Watched:
    """An engine handle that records whether anyone waited for it."""

    def __init__(self, handle) -> None:
        self.handle, self.waited = handle, False

    def wait(self) -> None:
        self.waited = True
        self.handle.wait()

    def done(self) -> bool:
        return self.handle.done()


def test_ctrl_c_inside_the_engines_write_submit_loses_no_handle(tmp_path):
    """A SIGINT that lands inside the disk engine's submit (its writes already queued, the handle not yet
    returned) is delivered only once the handle is held, and the write is waited for before the interrupt
    propagates: the caller frees those slots, so no queued write of ours may land in them later."""
    layout = BlockLayout(2, 8, 4, torch.float32)
    tier = DiskTier(tmp_path, budget=16 * layout.slot_bytes, extent_bytes=16 * layout.slot_bytes)
    slots = np.array([tier.alloc(layout.slot_bytes) for _ in range(4)], dtype=np.int64)
    file = tier.files[layout.slot_bytes].file
    submit, watched = file.submit_writes, []

    def interrupted_submit(requests):
        watched.append(_Watched(submit(requests)))
        signal.raise_signal(signal.SIGINT)  # Ctrl-C arrives after the writes were queued
        return watched[-1]

    file.submit_writes = interrupted_submit
    data = torch.randn(4, *layout.shape)
    try:
        tier.write_from(layout, slots, data, Scratch(BounceBuffer))
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the SIGINT was never delivered")
    assert watched and all(handle.waited for handle in watched)
    del file.submit_writes
    tier.close()


class _Late:
    """A read the engine queued but has not carried out yet: it lands when waited for, or when ``land()`` is
    called (the moment a lost read would land on its own — after the next read into the same buffer)."""

    def __init__(self, start: Callable) -> None:
        self.start, self.real = start, None

    def land(self):
        if self.real is None:
            self.real = self.start()
            self.real.wait()
        return self.real

    def wait(self) -> None:
        self.land().wait()

    def done(self) -> bool:
        return self.real is not None and self.real.done()


def test_ctrl_c_inside_the_engines_read_submit_lands_nothing_in_a_reused_buffer(tmp_path):
    """A SIGINT that lands inside the engine's read submit (the read queued, its handle not yet returned) is
    delivered once the handle is recorded, and the bounce buffer's next user waits for that read: a read
    abandoned by the interrupt never lands in the bytes of the next read (which would then fail its checksum
    or, unverified, return another block's K/V)."""
    layout = BlockLayout(2, 8, 4, torch.float32)
    tier = DiskTier(tmp_path, budget=16 * layout.slot_bytes, extent_bytes=16 * layout.slot_bytes, engine="posix")
    scratch = Scratch(BounceBuffer)
    slots = np.array([tier.alloc(layout.slot_bytes) for _ in range(8)], dtype=np.int64)
    data = torch.randn(8, *layout.shape)
    tier.write_from(layout, slots, data, scratch)
    file = tier.files[layout.slot_bytes].file
    submit, late = file.submit_hashed_reads, []

    def interrupted_submit(requests, unit):
        if not late:  # the first read: queued, then Ctrl-C arrives before its handle is returned
            late.append(_Late(lambda: submit(requests, unit)[0]))
            signal.raise_signal(signal.SIGINT)
            return late[-1], None
        handle, digests = submit(requests, unit)
        handle.wait()
        for lost in late:
            lost.land()  # a read nobody waited for lands now, after the next read into its buffer
        return handle, digests

    file.submit_hashed_reads = interrupted_submit
    try:
        tier.start_read(layout, slots[:4], scratch)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the SIGINT was never delivered")
    for first in (4, 0):  # the next reads through the same bounce buffer are exact
        out = torch.empty(4, *layout.shape)
        tier.start_read(layout, slots[first : first + 4], scratch).finish([(0, 4, out)])
        assert torch.equal(out, data[first : first + 4])
    del file.submit_hashed_reads
    tier.close()


# ------------------------------------------------------------------------------- the persistence writer
PERSIST_RUNS = 30  # interrupt points per persistent-store operation
UPDATE_RUNS = 160  # every line of a put's listing change: its own code, the manifest's write, the lock
UPDATE_CODE = frozenset({"_update", "write", "fsync_directory", "locked", "deferred_interrupts"})
STORE_CODE = tuple(str(PACKAGE / name) for name in ("persist/blockfile.py", "persist/manifest.py", "persist/lock.py",
                                                    "atomic.py"))  # record.py and keys.py: pure functions
PERSIST_CODE = (*STORE_CODE, str(PACKAGE / "persist/prefix.py"))
FLUSH_RUNS = 120  # every line of a flush in those files


def _open_under(directory: Path) -> list[str]:
    """This process's descriptors open on files under ``directory`` (a leaked lock or record file)."""
    found = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith(str(directory)):
                found.append(target)
    return found


def _check_directory(directory: Path, item) -> None:
    """After an interrupted operation, its store closed: no descriptor of ours is left open (a held lock); the
    manifest parses; the next store opens the directory without error (removing what a dead writer left),
    every listed block verifies, a new block can be written and read back, and nothing is left in ``tmp/``."""
    from tierkv.persist import manifest as manifests
    from tierkv.persist.blockfile import DIRECTORY_NAME, PersistentStore

    root = directory / DIRECTORY_NAME
    assert not _open_under(directory), f"descriptors left open: {_open_under(directory)}"
    ours = [p for p in (root / "tmp").iterdir() if p.name.startswith(f"{os.getpid()}-")] if root.exists() else []
    assert not ours, f"scratch areas or owner locks of this process left behind: {ours}"
    listing = manifests.load(root / "manifest")  # parses (or is absent)
    for key, entry in listing.entries.items():  # and every block it lists is there and verifies, as it is now
        path = root / "blocks" / key[:2] / f"{key}.tkv"
        assert path.exists(), f"listed block {key} has no file"
        header, _ = record.decode(path.read_bytes(), what=str(path))
        assert header["key"] == key and path.stat().st_size == entry.nbytes
    store = PersistentStore(directory, 2**30)
    try:
        assert store.verify() == [], "a listed block does not verify"
        store.put([item])
        assert len(store.get([item.key])) == 1
    finally:
        store.close()
    left = list((root / "tmp").iterdir())
    assert not _open_under(directory) and not left, f"left in tmp/ after the next store closed: {left}"


def test_persistent_store_operations(tmp_path):
    """What the background writer runs (``put``: records written, renamed, the manifest replaced, evictions),
    what ``load_prefix`` runs (``get`` marks blocks used), ``verify`` and opening a directory with a dead
    writer's leftovers, run on the main thread so that a SIGINT can reach every one of their lines."""
    from tierkv.persist.blockfile import DIRECTORY_NAME, Item, PersistentStore

    def item(n: int) -> Item:
        payload = bytes([n % 251]) * 4096
        return Item(f"{n:032x}", n % 3, *record.encode({"kind": "block", "key": f"{n:032x}"}, payload))

    items = [item(n) for n in range(8)]
    size = len(items[0].head) + len(items[0].payload)
    counter = [0]

    def prepared():
        """A directory listing 4 blocks (at capacity), and the scratch area and unlisted block of a dead writer."""
        counter[0] += 1
        directory = tmp_path / f"p{counter[0]}"
        store = PersistentStore(directory, 4 * size)
        store.put(items[:4])
        store.close()
        root = directory / DIRECTORY_NAME
        (root / "tmp" / "999999-dead").mkdir()
        (root / "tmp" / "999999-dead" / "x.tkv").write_bytes(b"torn")
        (root / "tmp" / "999999-dead.lock").touch()
        (root / "blocks" / "ff").mkdir(exist_ok=True)
        (root / "blocks" / "ff" / f"{'f' * 32}.tkv").write_bytes(b"renamed, never listed")
        return directory

    def opened():
        directory = prepared()
        return directory, [PersistentStore(directory, 4 * size)]

    def check(state, interrupted):
        directory, stores = state
        for store in stores:
            store.close()
        _check_directory(directory, items[7])

    def put(state):
        state[1][0].put(items[3:6], touch=[items[0].key])  # two evictions, one listed already

    interrupt_everywhere(opened, put, check, runs=PERSIST_RUNS, traced=STORE_CODE)
    # every line of the listing's change (renames, evictions, the manifest's replacement, the lock)
    lines = interrupt_everywhere(opened, put, check, runs=UPDATE_RUNS, traced=STORE_CODE, functions=UPDATE_CODE)
    assert lines <= UPDATE_RUNS, f"{lines} lines: raise UPDATE_RUNS so that every line is interrupted"
    interrupt_everywhere(opened, lambda s: s[1][0].get([items[0].key, items[1].key]), check, runs=PERSIST_RUNS,
                         traced=STORE_CODE)
    interrupt_everywhere(opened, lambda s: s[1][0].verify(), check, runs=PERSIST_RUNS, traced=STORE_CODE)

    def open_setup():
        return prepared(), []

    def open_directory(state):
        state[1].append(PersistentStore(state[0], 4 * size))

    interrupt_everywhere(open_setup, open_directory, check, runs=PERSIST_RUNS, traced=STORE_CODE)


def test_flush_of_a_persistent_cache(tmp_path):
    """``cache.flush()`` (block columns exported from the store, queued for the writer thread, waited for)
    interrupted anywhere: the cache stays consistent, a second ``flush()`` returns (the writer is not lost)
    and ``close()`` releases everything; a fresh cache then loads the prefix that was written and decodes
    exactly as ``DynamicCache``."""
    from transformers import DynamicCache

    from tierkv import TieredCache
    from tierkv.persist.blockfile import Item

    model = _model()
    ids = torch.randint(2, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    options = dict(gpu_gb="40KB", cpu_gb="24KB", block_tokens=4)
    reference = DynamicCache()
    with torch.no_grad():
        model(ids[:, :20], past_key_values=reference)
        expect = model(ids[:, 20:], past_key_values=reference).logits  # the tail after a prefix of 5 blocks
    spare = Item("e" * 32, 0, *record.encode({"kind": "block", "key": "e" * 32}, b"spare"))
    counter = [0]

    def setup():
        counter[0] += 1
        directory = tmp_path / f"f{counter[0]}"
        cache = TieredCache(disk_dir=directory, persist=True, **options)
        cache.load_prefix(model, ids)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        return cache, directory

    def flush(state):
        state[0].flush()

    def in_thread(call: Callable) -> None:
        done = threading.Thread(target=call, daemon=True)
        done.start()
        done.join(30)
        assert not done.is_alive(), f"{call.__name__} never returns: the writer thread was lost"

    def check(state, interrupted):
        cache, directory = state
        check_store(cache.store)
        assert cache.get_seq_length() == 24
        in_thread(cache.flush)
        in_thread(cache.close)
        _check_directory(directory, spare)
        fresh = TieredCache(disk_dir=directory, persist=True, **options)
        held = fresh.load_prefix(model, ids)
        assert held == 20, f"the flushed prefix was not stored: {held} tokens loaded"
        with torch.no_grad():
            got = model(ids[:, held:], past_key_values=fresh).logits
        torch.testing.assert_close(got, expect, atol=1e-5, rtol=0)
        fresh.close()
        assert not _open_under(directory)

    # every line of the persistence code but the pure key hashing (the store's export of the blocks is covered
    # by the store operations above)
    lines = interrupt_everywhere(setup, flush, check, runs=FLUSH_RUNS, traced=PERSIST_CODE)
    assert lines <= FLUSH_RUNS, f"{lines} lines: raise FLUSH_RUNS so that every line is interrupted"


@pytest.mark.parametrize("sigint", [signal.default_int_handler, signal.SIG_IGN], ids=["handled", "ignored"])
def test_a_forced_interrupt_inside_a_commit_comes_when_it_ends_whatever_sigints_handler(sigint):
    """SIGTERM's way out of a command (:func:`tierkv.atomic.interrupt`): inside a commit it waits for the commit's
    end, then raises even where SIGINT is ignored (a script's background job), where a held SIGINT is dropped. It
    was dropped too: a demo sent SIGTERM then finished its run and exited 0."""
    from tierkv import atomic

    previous = signal.signal(signal.SIGINT, sigint)
    try:
        finished = []
        with pytest.raises(KeyboardInterrupt), atomic.deferred_interrupts():
            atomic.interrupt()
            finished.append(True)  # the commit runs to its end first
        assert finished == [True]
        with pytest.raises(KeyboardInterrupt):
            atomic.interrupt()  # outside a commit: at once
        with atomic.deferred_interrupts():
            pass  # nothing left held
    finally:
        signal.signal(signal.SIGINT, previous)


def _stopped_after_layer(model, layer: int, ids, cache) -> None:
    """A forward of ``ids`` interrupted in decoder layer ``layer``'s MLP (after its attention updated the cache)."""
    hook = model.model.layers[layer].mlp.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            model(ids, past_key_values=cache)
    finally:
        hook.remove()


@pytest.mark.parametrize("edit", ["crop past the stopped layers", "crop back to empty", "save and load",
                                  "crop a sliding layer"])
def test_an_edit_after_a_forward_stopped_part_way_applies_to_layers_of_one_length(tmp_path, edit):
    """Regressions (a soak of mixed operations): after a forward stopped between two layers, a ``crop`` cut the
    uneven layers unevenly and a layer left empty hid the unevenness from the next forward (0.25 off, no error);
    a crop back to empty made the next stopped forward look complete (a raw torch error on retrying); a crop on a
    sliding model left the rollback refused by the window while the error said all was even (0.04 off); a save
    wrote uneven layers that loading then called crafted. An edit now rolls the stopped forward back first (as
    the next forward would), a crop counting from layer 0's tokens as transformers does; every step after equals
    DynamicCache's."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from tierkv import TieredCache
    from tierkv.errors import InterruptedStepError

    sliding = edit == "crop a sliding layer"
    torch.manual_seed(0)
    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2)
    config = MistralConfig(**shape, sliding_window=16) if sliding else LlamaConfig(**shape)
    model = (MistralForCausalLM if sliding else LlamaForCausalLM)(config).eval()
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    options = dict(gpu_gb="1MB", cpu_gb="64KiB", block_tokens=4, config=config)
    cache = TieredCache(disk_dir=tmp_path / "d", **options)
    held = {"crop past the stopped layers": 4, "crop back to empty": 10, "save and load": 20,
            "crop a sliding layer": 31}[edit]
    with torch.no_grad():
        model(ids[:, :held], past_key_values=cache)
        if edit == "crop back to empty":
            cache.crop(-held)
            held = 0
        step = 5 if edit != "crop a sliding layer" else 1
        _stopped_after_layer(model, 1, ids[:, held : held + step], cache)  # layers 0 and 1 took the step
        assert [layer.get_seq_length() for layer in cache.layers] == [held + step] * 2 + [held]
        if edit == "crop past the stopped layers":
            cache.crop(-(step + 1))  # the stopped step and one token more: layer 0's 9 -> 3
            held -= 1
        elif edit == "crop a sliding layer":
            cache.crop(-step)
        elif edit == "save and load":
            cache.save(tmp_path / "chat.tkv", model=model)
            cache.close()
            cache = TieredCache.load(tmp_path / "chat.tkv", model=model, disk_dir=tmp_path / "e", **options)
        if edit == "crop back to empty":
            with pytest.raises(InterruptedStepError):  # no edit between: the retry is refused once, as documented
                model(ids[:, :step], past_key_values=cache)
        assert [layer.get_seq_length() for layer in cache.layers] == [held] * 3
        reference = DynamicCache(config=config)
        if held:
            model(ids[:, :held], past_key_values=reference)
        for start in range(held, held + 3):  # the retried / next steps
            torch.testing.assert_close(model(ids[:, start : start + 1], past_key_values=cache).logits,
                                       model(ids[:, start : start + 1], past_key_values=reference).logits,
                                       atol=1e-5, rtol=0)
    cache.close()


def test_ctrl_c_while_the_store_opens_its_directories_leaves_none_open(tmp_path, monkeypatch):
    """A Ctrl-C that arrives while the persistent store opens its directories is held until that section ends
    and raised there: the store that raises it closes the descriptors it opened, at once (not when the half-made
    store is collected)."""
    from tierkv.persist import blockfile

    opened = blockfile._Tree.__init__

    def interrupted(self, directory):
        opened(self, directory)
        signal.raise_signal(signal.SIGINT)  # held: the section is deferred_interrupts'

    monkeypatch.setattr(blockfile._Tree, "__init__", interrupted)
    try:
        blockfile.PersistentStore(tmp_path, 1 << 20)
    except KeyboardInterrupt:  # while the traceback (and the half-made store in it) is alive
        assert not _open_under(tmp_path), f"descriptors left open: {_open_under(tmp_path)}"
    else:
        pytest.fail("the Ctrl-C was lost")
