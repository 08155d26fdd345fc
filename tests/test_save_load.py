"""Saving and loading a conversation: ``cache.save(path)`` / ``TieredCache.load(path)`` (and the asyncio
``asave`` / ``aload``) resume decoding without prefill, token for token as the uninterrupted cache does, on
real transformers models (tests/models.py) with their K/V spread over device, host and disk."""

from __future__ import annotations

import asyncio
import errno
import sys

import pytest
import torch
from helpers import saves_while_generating
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv.errors import DiskTierError, IntegrityError, InvalidConfigError, TierKVError
from tierkv.hf import TieredCache, cache_keyword

BT = 4
SLOT = 4096
PROMPT = 22
NEW = 5
MORE = 6
FAMILIES = [("llama", "sdpa", None), ("qwen3", "sdpa", None), ("mistral", "sdpa", 8), ("gemma2", "eager", 8)]


def _options(model, tmp_path, batch: int = 1, name: str = "disk") -> dict:
    device = TieredCache.min_device_bytes(model.config, PROMPT + NEW + MORE, batch, BT) + 2 * SLOT
    return dict(gpu_gb=f"{device}B", cpu_gb=f"{4 * SLOT}B", disk_gb="64MiB", disk_dir=tmp_path / name)


def _generate(model, ids, cache, new: int):
    return model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_keyword(model): cache}, max_new_tokens=new,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)


def _computed(model):
    """A list that collects the number of positions each forward computes."""
    calls: list[int] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda _, args: calls.append(args[0].shape[1]))
    return calls, hook


def _conversation(model, tmp_path, batch: int = 1, with_config: bool = True):
    """A cache after a first turn, the tokens so far, and the uninterrupted continuation."""
    ids, _ = prompt(batch, PROMPT, seed=2)
    cache = TieredCache(block_tokens=BT, config=model.config if with_config else None,
                        **_options(model, tmp_path, batch, "first"))
    so_far = _generate(model, ids, cache, NEW).sequences
    return cache, so_far


@pytest.mark.parametrize("family,attn,window", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_loaded_conversation_continues_like_the_uninterrupted_one(family, attn, window, tmp_path):
    model = tiny_model(family, attn, window)
    cache, so_far = _conversation(model, tmp_path)
    path = tmp_path / "conversation.tkv"
    cache.save(path, model=model)
    uninterrupted = _generate(model, so_far, cache, MORE)
    cache.close()
    loaded = TieredCache.load(path, model=model, **_options(model, tmp_path))
    assert loaded.get_seq_length() == so_far.shape[1] - 1
    assert [layer.sliding_window for layer in loaded.layers] == [layer.sliding_window for layer in cache.layers]
    calls, hook = _computed(model)
    try:
        resumed = _generate(model, so_far, loaded, MORE)
    finally:
        hook.remove()
    assert calls == [1] * MORE  # no prefill: the first forward computes the one token not in the cache
    assert torch.equal(resumed.sequences, uninterrupted.sequences)
    for a, b in zip(uninterrupted.logits, resumed.logits):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    loaded.store.check()
    loaded.close()


def test_asave_and_aload_round_trip(tmp_path):
    model = tiny_model("llama")
    cache, so_far = _conversation(model, tmp_path, batch=2, with_config=False)
    path = tmp_path / "async.tkv"
    asyncio.run(cache.asave(path, model=model))
    uninterrupted = _generate(model, so_far, cache, MORE)
    cache.close()
    loaded = asyncio.run(TieredCache.aload(path, model=model, **_options(model, tmp_path, batch=2)))
    assert torch.equal(_generate(model, so_far, loaded, MORE).sequences, uninterrupted.sequences)
    loaded.close()
    # the synchronous reader reads what the asynchronous writer wrote, and the other way round
    TieredCache.load(path, model=model, **_options(model, tmp_path, batch=2, name="again")).close()


def test_a_cancelled_asave_or_aload_touches_no_other_file_and_leaks_nothing(tmp_path, monkeypatch):
    """Regression: cancelling ``asave`` (``task.cancel()``, ``asyncio.wait_for``'s timeout) closed its descriptors
    while a worker thread still wrote through them, so the rest of the record landed in whatever file the
    application opened next (descriptor numbers are reused at once); cancelled before its first worker call,
    it leaked the directory's descriptor. Now a cancellation takes effect when the worker's call returns: the
    application's files stay empty, no descriptor is left open, the old file (or none) stays, and the cache
    decodes on; a cancelled ``aload`` likewise."""
    import os
    import threading
    import time

    model = tiny_model("llama")
    cache, so_far = _conversation(model, tmp_path)
    target = tmp_path / "chat.tkv"
    write, main = os.write, threading.main_thread()

    def slow_write(fd, data):  # a slow disk, on the worker threads only
        if threading.current_thread() is not main:
            time.sleep(0.05)
        return write(fd, data)

    monkeypatch.setattr(os, "write", slow_write)

    def descriptors() -> set[str]:
        return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")}

    async def cancelled(work, after: float) -> None:
        task = asyncio.ensure_future(work)
        await asyncio.sleep(after)
        task.cancel()
        try:
            loaded = await task  # a load this fast may be done before the cancellation
        except asyncio.CancelledError:
            loaded = None
        assert loaded is None or isinstance(loaded, TieredCache)
        if loaded is not None:
            loaded.close()
        mine = [os.open(tmp_path / f"app{i}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for i in range(3)]
        await asyncio.sleep(0.3)  # a worker still writing would write into these
        for fd in mine:
            os.close(fd)

    before = descriptors()
    for after in (0, 0.01, 0.03):  # before the first worker call, inside a write, further on (each takes 50 ms)
        asyncio.run(cancelled(cache.asave(target, model=model), after))
        assert all(os.path.getsize(tmp_path / f"app{i}.log") == 0 for i in range(3))
        assert not target.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    monkeypatch.setattr(os, "write", write)
    cache.save(target, model=model)
    monkeypatch.setattr(os, "write", slow_write)
    for after in (0, 0.001, 0.003):
        asyncio.run(cancelled(TieredCache.aload(target, model=model, **_options(model, tmp_path, name="l")), after))
    assert descriptors() <= before | {str(target)}, descriptors() - before
    assert torch.equal(_generate(model, so_far, cache, MORE).sequences[:, :so_far.shape[1]], so_far)
    cache.close()


def _continues_as(reference, model, path, tmp_path) -> int:
    """Load the snapshot at ``path`` and continue it with ``reference``'s next token: it must generate what
    ``reference`` holds after it. Returns the snapshot's length."""
    loaded = TieredCache.load(path, model=model, **_options(model, tmp_path, name=f"load-{path.stem}"))
    try:
        held = loaded.get_seq_length()
        assert PROMPT <= held < reference.shape[1], held
        more = min(3, reference.shape[1] - held - 1)
        if more:
            continued = _generate(model, reference[:, : held + 1], loaded, more).sequences
            assert torch.equal(continued, reference[:, : held + 1 + more]), held
        return held
    finally:
        loaded.close()


def test_a_save_from_another_thread_takes_the_cache_between_two_forwards(tmp_path):
    """A save from another thread (a server snapshotting a conversation that a worker thread generates) waits for
    the forward in progress to finish and takes the cache between two forwards; the worker's next forward waits
    until the save has read every record. Every save succeeds, each file continues as the uninterrupted decoding
    does, and the worker decodes as DynamicCache. (Regressions: such a save rolled back the worker's forward, half
    done, and generate() died; then it was refused, or failed whenever a forward changed the cache under it.)"""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=4)
    reference = _generate(model, ids, DynamicCache(config=model.config), 40).sequences
    cache = TieredCache(block_tokens=BT, config=model.config, **_options(model, tmp_path, name="busy"))
    result, saved = saves_while_generating(cache, model, lambda: _generate(model, ids, cache, 40).sequences,
                                           tmp_path, 12)
    assert result and torch.equal(result[0], reference)
    assert len(saved) >= 2
    lengths = [_continues_as(reference, model, path, tmp_path) for path in (saved[0], saved[-1])]
    assert lengths[0] < lengths[1], lengths  # the worker went on between the saves
    cache.close()


def test_an_asave_while_generate_runs_in_a_worker_thread(tmp_path):
    """An asyncio server's pattern: generate() in ``asyncio.to_thread`` and periodic ``await cache.asave`` on the
    loop. Each asave takes the cache between two forwards (the loop keeps running while it waits); the files
    continue as the uninterrupted decoding does, which decodes as DynamicCache."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=5)
    reference = _generate(model, ids, DynamicCache(config=model.config), 30).sequences
    cache = TieredCache(block_tokens=BT, config=model.config, **_options(model, tmp_path, name="busy"))

    async def serve() -> tuple[torch.Tensor, list]:
        task = asyncio.ensure_future(asyncio.to_thread(_generate, model, ids, cache, 30))
        saved: list = []
        while not task.done():
            if cache.get_seq_length() and len(saved) < 8:
                saved.append(tmp_path / f"a{len(saved)}.tkv")
                await cache.asave(saved[-1], model=model)
            await asyncio.sleep(0.005)
        return (await task).sequences, saved

    sequences, saved = asyncio.run(serve())
    assert torch.equal(sequences, reference)
    assert saved
    _continues_as(reference, model, saved[-1], tmp_path)
    cache.close()


def test_a_save_waits_no_longer_than_its_limit_for_a_forward_stopped_on_a_live_thread(tmp_path, monkeypatch):
    """A forward stopped part-way by an error on a thread that lives on never finishes: a save from another thread
    is refused after ``TURN_WAIT_S`` with the fix (it would roll back a forward that may still be running), and
    goes through once that thread ended (the stopped forward rolled back first)."""
    import threading

    from tierkv.hf import turn

    monkeypatch.setattr(turn, "TURN_WAIT_S", 0.3)
    model = tiny_model("llama")
    cache, so_far = _conversation(model, tmp_path)
    stopped, leave = threading.Event(), threading.Event()

    def fail(*_):
        raise RuntimeError("an error in the model between two layers")

    def decode() -> None:
        hook = model.model.layers[0].mlp.register_forward_pre_hook(fail)
        try:
            with torch.no_grad():
                model(so_far[:, -1:], **{cache_keyword(model): cache}, use_cache=True)
        except RuntimeError:
            stopped.set()
        finally:
            hook.remove()
        leave.wait()

    worker = threading.Thread(target=decode)
    worker.start()
    assert stopped.wait(30)
    with pytest.raises(InvalidConfigError, match="did not finish within"):
        cache.save(tmp_path / "refused.tkv", model=model)
    assert not (tmp_path / "refused.tkv").exists()
    leave.set()
    worker.join()
    cache.save(tmp_path / "after.tkv", model=model)
    assert cache.get_seq_length() == so_far.shape[1] - 1
    cache.close()


def test_a_save_asked_while_a_stopped_forward_waits_for_its_thread_takes_the_turn_after_its_next_forward(
        tmp_path, monkeypatch):
    """Regression: a forward stopped part-way on a thread that lives on, a save from another thread, then that
    thread's next forward: the forward gave way to the save, which waited for the stopped forward, and both stalled
    ``TURN_WAIT_S`` (60 s) before the save failed. The forward goes first (it takes the stopped one back and is
    refused once, as on one thread); the save then goes through, and the file holds the tokens before it."""
    import threading
    import time

    from tierkv.errors import InterruptedStepError
    from tierkv.hf import turn

    monkeypatch.setattr(turn, "TURN_WAIT_S", 10.0)
    model = tiny_model("llama")
    cache, so_far = _conversation(model, tmp_path)
    held = cache.get_seq_length()

    def fail(*_):
        raise RuntimeError("an error in the model between two layers")

    def step() -> None:
        with torch.no_grad():
            model(so_far[:, -1:], **{cache_keyword(model): cache}, use_cache=True)

    hook = model.model.layers[0].mlp.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="between two layers"):
        step()
    hook.remove()
    saved: list[BaseException | None] = []

    def save() -> None:
        try:
            cache.save(tmp_path / "asked.tkv", model=model)
            saved.append(None)
        except BaseException as error:  # noqa: BLE001 - what the save raised, checked below
            saved.append(error)

    saver = threading.Thread(target=save)
    saver.start()
    while not cache.using.asking and saver.is_alive():
        time.sleep(0.01)
    with pytest.raises(InterruptedStepError):
        step()
    saver.join()
    assert saved == [None]  # (it waited for the stopped forward until TURN_WAIT_S, and failed)
    with TieredCache.load(tmp_path / "asked.tkv", model=model, **_options(model, tmp_path, name="loaded")) as loaded:
        assert loaded.get_seq_length() == held


@pytest.mark.parametrize("edit", ["crop and continue", "reorder rows"])
def test_an_edit_while_an_asave_is_pending_fails_it_and_keeps_the_old_file(tmp_path, monkeypatch, edit):
    """Regression: ``asave`` exports its records between awaited writes, after its header was fixed; an edit
    meanwhile (a crop and another continuation, a beam reorder) landed between two records, and the file held
    layers of two states, passed every check at load and decoded as neither. Now the save fails with the fix
    and the file saved before stays."""
    import os
    import threading
    import time

    model = tiny_model("llama")
    cache, so_far = _conversation(model, tmp_path, batch=2)
    target = tmp_path / "chat.tkv"
    cache.save(target, model=model)
    saved = target.read_bytes()
    write, main = os.write, threading.main_thread()

    def slow_write(fd, data):  # a slow disk, on the worker threads only: the edit lands mid-save
        if threading.current_thread() is not main:
            time.sleep(0.02)
        return write(fd, data)

    monkeypatch.setattr(os, "write", slow_write)

    async def save_and_edit() -> None:
        task = asyncio.ensure_future(cache.asave(target, model=model))
        await asyncio.sleep(0.03)
        with torch.no_grad():
            if edit == "crop and continue":
                cache.crop(-2)
                model(so_far[:, -3:-1], **{cache_keyword(model): cache}, use_cache=True)
            else:
                cache.reorder_cache(torch.tensor([1, 0]))
        await task

    with pytest.raises(InvalidConfigError, match="changed while it was being saved"):
        asyncio.run(save_and_edit())
    assert target.read_bytes() == saved
    cache.close()


def test_damaged_files_are_refused(tmp_path):
    model = tiny_model("llama")
    cache, _ = _conversation(model, tmp_path)
    path = tmp_path / "c.tkv"
    cache.save(path, model=model)
    cache.close()
    data = path.read_bytes()
    options = _options(model, tmp_path)
    for position in (5, 100, len(data) // 2, len(data) - 3):
        flipped = bytearray(data)
        flipped[position] ^= 0x40
        path.write_bytes(bytes(flipped))
        with pytest.raises(IntegrityError):
            TieredCache.load(path, model=model, **options)
    for length in (10, len(data) // 3, len(data) - 40):  # cut inside a record and at the end record
        path.write_bytes(data[:length])
        with pytest.raises(IntegrityError):
            TieredCache.load(path, model=model, **options)
    path.write_bytes(data + b"x")
    with pytest.raises(IntegrityError, match="after the end"):
        TieredCache.load(path, model=model, **options)
    path.write_bytes(data)
    with pytest.raises(InvalidConfigError, match="another model"):
        TieredCache.load(path, model=tiny_model("qwen2"), **options)
    with pytest.raises(InvalidConfigError, match="block_tokens"):
        TieredCache.load(path, model=model, block_tokens=8, **options)
    with pytest.raises(InvalidConfigError, match="sliding windows"):
        TieredCache.load(path, model=model, config=tiny_model("gemma2", "eager", 8).config, **options)
    TieredCache.load(path, model=model, **options).close()


@pytest.mark.parametrize("change", ["format 2", "record version 2", "format true", "format 1.0"])
def test_a_file_of_a_newer_tierkv_says_so(tmp_path, change):
    """A file of a later format is refused as a newer tierkv's, with the fix (upgrade), not as a damaged file;
    the format is an integer exactly (true and 1.0 are not format 1)."""
    from helpers import conversation_records

    from tierkv.errors import NewerFormatError
    from tierkv.persist import record

    model = tiny_model("llama")
    cache, _ = _conversation(model, tmp_path)
    path = tmp_path / "c.tkv"
    cache.save(path, model=model)
    cache.close()
    records = conversation_records(path)
    header = dict(records[0][0])
    if change.startswith("format"):
        header["format"] = {"format 2": 2, "format true": True, "format 1.0": 1.0}[change]
    parts = [record.encode(h, p) for h, p in [(header, records[0][1]), *records[1:]]]
    data = b"".join(head + bytes(payload) for head, payload in parts)
    if change == "record version 2":
        data = data[:4] + (2).to_bytes(2, "little") + data[6:]
    path.write_bytes(data)
    newer = change in ("format 2", "record version 2")
    with pytest.raises(NewerFormatError if newer else IntegrityError,
                       match="written by a newer tierkv .*upgrade tierkv" if newer else "not a tierkv conversation"):
        TieredCache.load(path, model=model, **_options(model, tmp_path))


def test_saving_is_atomic_and_needs_tokens(tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "c.tkv"
    with TieredCache(block_tokens=BT) as empty, pytest.raises(InvalidConfigError, match="no tokens"):
        empty.save(path)
    cache, _ = _conversation(model, tmp_path)
    with pytest.raises(InvalidConfigError, match="model=model"):  # a file must say which model computed its K/V
        cache.save(path)
    assert not path.exists() and not list(tmp_path.glob(".c.tkv.*"))
    cache.save(path, model=model)
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk gone")

    original = cache.store.export_blocks
    cache.store.export_blocks = fail  # the write dies half way through
    with pytest.raises(OSError, match="disk gone"):
        cache.save(path, model=model)
    cache.store.export_blocks = original
    assert path.read_bytes() == before  # the previous file is intact
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".c.tkv")] == []  # no temporary file left
    assert path.stat().st_mode & 0o777 == 0o600
    cache.close()
    with pytest.raises(InvalidConfigError, match="closed"):
        cache.save(path, model=model)


def test_a_loaded_conversation_is_private(tmp_path):
    """K/V from a file is not this process's own computation: neither it nor what is computed on top of it is
    persisted under the ids the file claims (issue 26: a crafted file would poison the shared store)."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=4)
    options = dict(_options(model, tmp_path, name="persist"), persist=True)
    with TieredCache(block_tokens=BT, **options) as cache:
        cache.load_prefix(model, ids)
        so_far = _generate(model, ids, cache, 1).sequences  # one forward: nothing persisted yet
        cache.save(tmp_path / "c.tkv")
        cache.session.reset()  # this one forgets its ids (so only the loaded cache could persist)
    with TieredCache.load(tmp_path / "c.tkv", model=model, **options) as loaded:
        _generate(model, so_far, loaded, 2)
    with TieredCache(block_tokens=BT, **options) as later:
        assert later.load_prefix(model, ids) == 0


def test_async_without_aiofiles_says_what_to_install(tmp_path, monkeypatch):
    model = tiny_model("llama")
    cache, _ = _conversation(model, tmp_path)
    monkeypatch.setitem(sys.modules, "aiofiles", None)
    with pytest.raises(InvalidConfigError, match="pip install"):
        asyncio.run(cache.asave(tmp_path / "x.tkv", model=model))
    with pytest.raises(InvalidConfigError, match="pip install"):
        asyncio.run(TieredCache.aload(tmp_path / "x.tkv", model=model))
    cache.close()


def test_load_needs_the_model(tmp_path):
    """Sweep finding 5: ``load(path)`` without ``model=`` took a file of another model and decoded on its K/V
    with no error. Now load and aload refuse with the fix before reading K/V, and the file loaded with its model
    decodes as DynamicCache does."""
    model = tiny_model("llama")
    ids, _ = prompt(1, PROMPT, seed=5)
    reference = DynamicCache()
    model(ids[:, :-1], past_key_values=reference)
    path = tmp_path / "c.tkv"
    with TieredCache(block_tokens=BT) as cache:
        model(ids[:, :-1], **{cache_keyword(model): cache})
        cache.save(path, model=model)
    with pytest.raises(InvalidConfigError, match=r"TieredCache\.load\(path, model=model\)"):
        TieredCache.load(path, disk_dir=tmp_path / "d")
    with pytest.raises(InvalidConfigError, match=r"TieredCache\.load\(path, model=model\)"):
        asyncio.run(TieredCache.aload(path, disk_dir=tmp_path / "d"))
    assert not (tmp_path / "d").exists()  # refused before any cache was built
    with TieredCache.load(path, model=model) as loaded:
        torch.testing.assert_close(model(ids[:, -1:], **{cache_keyword(model): loaded}).logits,
                                   model(ids[:, -1:], past_key_values=reference).logits, atol=1e-5, rtol=0)


def test_save_and_load_paths_name_the_problem_and_the_fix(tmp_path):
    """Sweep finding 9: saving to a directory or into a missing one, and loading a missing file, raised bare
    OSErrors (the first naming a temporary file). Each is a DiskTierError (a TierKVError and an OSError) that
    names the path and the fix, nothing is written, and the conversation still saves and resumes exactly."""
    pytest.importorskip("aiofiles")
    model = tiny_model("llama")
    cache, so_far = _conversation(model, tmp_path)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "mine.txt").write_text("kept")
    for target, problem in ((folder, "is a directory"), (tmp_path / "missing" / "c.tkv", "not an existing directory")):
        for face in ("sync", "async"):
            with pytest.raises(DiskTierError, match=problem) as info:
                cache.save(target, model=model) if face == "sync" else asyncio.run(cache.asave(target, model=model))
            message = str(info.value)
            assert isinstance(info.value, TierKVError) and isinstance(info.value, OSError)
            assert repr(str(target)) in message and "give a file path in an existing directory" in message
    assert [p.name for p in folder.iterdir()] == ["mine.txt"] and not (tmp_path / "missing").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "folder"]  # no temporary file left anywhere
    absent = tmp_path / "absent.tkv"
    for face in ("sync", "async"):
        with pytest.raises(DiskTierError, match="No such file.*cache.save") as info:
            TieredCache.load(absent, model=model) if face == "sync" else \
                asyncio.run(TieredCache.aload(absent, model=model))
        assert repr(str(absent)) in str(info.value) and info.value.errno == errno.ENOENT
    path = tmp_path / "c.tkv"
    cache.save(path, model=model)
    uninterrupted = _generate(model, so_far, cache, MORE)
    cache.close()
    with TieredCache.load(path, model=model, **_options(model, tmp_path)) as loaded:
        assert torch.equal(_generate(model, so_far, loaded, MORE).sequences, uninterrupted.sequences)


def test_a_loaded_sliding_window_conversation_saves_and_loads_again(tmp_path):
    """Regression: a loaded sliding layer numbered its blocks from 0 while its window had dropped the first ones,
    so saving it again asked for blocks it never held ("blocks [7, 13) of layer 0 are not held"). Each turn is
    saved, loaded and continued; every step equals DynamicCache's."""
    model = tiny_model("mistral", "sdpa", 8)
    reference = DynamicCache(config=model.config)
    cache = TieredCache(block_tokens=BT, config=model.config, **_options(model, tmp_path, name="turn0"))
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for turn in range(3):
            for tokens in (9, 1, 1, 1):  # a turn's prompt, then decode steps: the window drops front blocks
                ids = torch.randint(1, 100, (1, tokens), generator=generator)
                torch.testing.assert_close(model(ids, **{cache_keyword(model): cache}).logits,
                                           model(ids, past_key_values=reference).logits, atol=1e-5, rtol=0)
            assert cache.layers[0].dropped > 0
            cache.save(tmp_path / "chat.tkv", model=model)
            cache.close()
            cache = TieredCache.load(tmp_path / "chat.tkv", model=model, **_options(model, tmp_path, name=f"t{turn}"))
    cache.close()


def test_a_conversation_of_a_cache_built_without_config_is_loaded_without_it(tmp_path):
    """A sliding-window model's conversation saved from a cache built without ``config=`` (its layers keep every
    token) loads without ``config=`` and decodes on exactly; with the model's own config the refusal says why and
    what to do (it said the config "describes other layers" and to pass the model's own, which it was)."""
    model = tiny_model("mistral", "sdpa", 8)
    ids, _ = prompt(1, 20, seed=12)
    path = tmp_path / "chat.tkv"
    with TieredCache(block_tokens=BT, **_options(model, tmp_path, name="saved")) as cache, torch.no_grad():
        model(ids, **{cache_keyword(model): cache})
        cache.save(path, model=model)
    with pytest.raises(InvalidConfigError, match="built without config=.*load it without config= too"):
        TieredCache.load(path, model=model, config=model.config, **_options(model, tmp_path, name="with"))
    reference = DynamicCache(config=model.config)
    step = torch.tensor([[7]])
    with TieredCache.load(path, model=model, **_options(model, tmp_path, name="without")) as loaded, torch.no_grad():
        model(ids, past_key_values=reference)
        torch.testing.assert_close(model(step, **{cache_keyword(model): loaded}).logits,
                                   model(step, past_key_values=reference).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("load", ["load", "aload"])
def test_a_conversation_loaded_in_inference_mode_decodes_in_and_outside_it(tmp_path, load):
    """Regression: a conversation loaded under ``torch.inference_mode()`` (as servers decode) built the tiers'
    tensors as inference tensors, so the next step that moved a block failed with torch's raw "Inplace update to
    inference tensor outside InferenceMode". Loaded in it, the cache decodes on in it and outside it, as the
    uninterrupted conversation does."""
    model = tiny_model("llama")
    cache, so_far = _conversation(model, tmp_path)
    path = tmp_path / "chat.tkv"
    cache.save(path, model=model)
    uninterrupted = _generate(model, so_far, cache, MORE)
    cache.close()
    options = _options(model, tmp_path, name="loaded")
    with torch.inference_mode():
        if load == "load":
            loaded = TieredCache.load(path, model=model, **options)
        else:
            loaded = asyncio.run(TieredCache.aload(path, model=model, **options))
        resumed = _generate(model, so_far, loaded, MORE // 2)
    resumed = _generate(model, resumed.sequences, loaded, MORE - MORE // 2)
    assert loaded.stats()["blocks"]["disk"] > 0
    loaded.close()
    assert torch.equal(resumed.sequences, uninterrupted.sequences)
