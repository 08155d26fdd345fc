"""The ways users drive a cache through transformers, each against ``DynamicCache`` token for token (logits within
1e-4), under exact gather, streaming and split attention, with blocks on the device, host and disk tiers:

- assisted generation (an assistant model) and prompt lookup, which crop the rejected candidates from the cache;
- a conversation: ``generate`` again on ``out.past_key_values`` with the previous output (and the next turn's
  tokens), greedy and sampling;
- rows dropped, repeated and reordered, a crop and a multi-token step between decode steps, as a server does;
- a shorter prompt than the cache holds (a pipeline or a new request reusing the cache) is refused with the fix,
  and the cache continues as before;
- the ``Cache`` API transformers' multimodal models and generic code read: ``is_initialized`` as DynamicCache
  answers it, ``offload`` / ``prefetch`` that move nothing (the tiers place the blocks);
- what streaming and split attention cannot serve is refused with the fix and gives its step back: attention
  weights (``output_attentions``), a model in training mode with dropout, a model object other than the engaged
  one, a config instead of the model;
- rows repeated after decoding still decode at ``min_device_bytes`` for the new row count.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from helpers import assert_same_generation
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.errors import InvalidConfigError, TierKVError

ATOL = 1e-4
BLOCK = 4
CHUNK = 8
SLOT = 4096  # bytes of one block slot of the tiny models
EXECUTORS = ["gather", "streaming", "split"]
MODELS = [("llama", "sdpa", None), ("gemma2", "eager", 8)]  # gemma2: sliding and full layers, soft-capping
MODEL_IDS = ["llama", "gemma2-sw8"]


def small_cache(tmp_path, model, executor: str, batch: int, context: int) -> TieredCache:
    """A cache with the config whose device holds the executor's minimum for ``batch`` rows of ``context`` tokens
    and a few blocks, the host four: the prompts below reach the disk tier."""
    config = model.config
    if executor == "gather":
        device = TieredCache.min_device_bytes(config, context, batch, BLOCK) + 2 * SLOT
    elif executor == "split":
        device = TieredCache.min_split_device_bytes(config, batch, BLOCK, CHUNK) + 4 * SLOT
    else:
        device = TieredCache.min_streaming_device_bytes(config, batch, BLOCK, CHUNK) + 4 * SLOT
    return TieredCache(gpu_gb=f"{device}B", cpu_gb=f"{4 * SLOT}B", disk_dir=tmp_path, block_tokens=BLOCK,
                       config=config)  # fmt: skip


def engaged(cache: TieredCache, model, executor: str) -> contextlib.AbstractContextManager:
    if executor == "gather":
        return contextlib.nullcontext()
    return getattr(cache, executor)(model, chunk_tokens=CHUNK)


def generate(model, ids, mask, cache, **kwargs):
    kwargs.setdefault("do_sample", False)
    return model.generate(ids, attention_mask=mask, max_new_tokens=10, output_logits=True,
                          return_dict_in_generate=True, cache=cache, **kwargs)  # fmt: skip


def assert_on_disk(cache: TieredCache) -> None:
    """Blocks went down to the disk tier (some may have been freed since: crops, dropped rows)."""
    moved = cache.stats()["bytes_moved"]
    assert moved["host->disk"] + moved["device->disk"] > 0, moved


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("how", ["assistant", "prompt-lookup"])
@pytest.mark.parametrize(("family", "attn", "window"), MODELS, ids=MODEL_IDS)
def test_speculative_decoding_crops_the_rejected_candidates_exactly(tmp_path, family, attn, window, how, executor):
    model = tiny_model(family, attn, window)
    ids, _ = prompt(1, 22, seed=3)
    ids = torch.cat([ids, ids[:, :10]], dim=1)  # a repeated span: prompt lookup finds candidates
    mask = torch.ones_like(ids)
    kwargs = (dict(assistant_model=tiny_model(family, attn, window, layers=1)) if how == "assistant"
              else dict(prompt_lookup_num_tokens=3))  # fmt: skip
    reference = generate(model, ids, mask, DynamicCache(), **kwargs)
    with small_cache(tmp_path, model, executor, 1, 42) as cache, engaged(cache, model, executor):
        out = generate(model, ids, mask, cache, **kwargs)
        assert_on_disk(cache)
        assert cache.get_seq_length() == out.sequences.shape[1] - 1
    assert_same_generation(out, reference, atol=ATOL)


def conversation(model, ids, mask, turn, cache) -> list:
    """Three turns, each ``generate`` on the previous output's ``past_key_values``: greedy, then sampling (fixed
    seed) on the first output and the next turn's tokens, then greedy on the second output."""
    first = generate(model, ids, mask, cache)
    ids2 = torch.cat((first.sequences, turn), dim=1)
    mask2 = torch.cat((mask, torch.ones(2, ids2.shape[1] - mask.shape[1], dtype=mask.dtype)), dim=1)
    torch.manual_seed(7)
    second = generate(model, ids2, mask2, first.past_key_values, do_sample=True)
    mask3 = torch.cat((mask2, torch.ones(2, 10, dtype=mask.dtype)), dim=1)
    torch.manual_seed(8)
    third = generate(model, second.sequences, mask3, second.past_key_values)
    assert third.past_key_values is cache
    return [first, second, third]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize(("family", "attn", "window"), MODELS, ids=MODEL_IDS)
def test_a_conversation_continues_on_the_returned_cache(tmp_path, family, attn, window, executor):
    model = tiny_model(family, attn, window)
    ids, mask = prompt(2, 13, seed=3, left_pad=(0, 3))
    turn, _ = prompt(2, 5, seed=4)
    reference = conversation(model, ids, mask, turn, DynamicCache())
    with small_cache(tmp_path, model, executor, 2, 48) as cache, engaged(cache, model, executor):
        outputs = conversation(model, ids, mask, turn, cache)
        assert_on_disk(cache)
    for got, expected in zip(outputs, reference, strict=True):
        assert_same_generation(got, expected, atol=ATOL)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize(("family", "attn", "window"), MODELS, ids=MODEL_IDS)
def test_rows_dropped_repeated_and_reordered_between_steps(tmp_path, family, attn, window, executor):
    """A server's edits between forwards: rows repeated for samples, beams reordered (a row twice), a crop of the
    last tokens, a step of three tokens after decoding, finished rows dropped."""
    model = tiny_model(family, attn, window)
    ids, mask = prompt(3, 40, seed=3, left_pad=(0, 3, 5))
    dynamic = DynamicCache()  # no config: crops past a sliding window stay defined; the tiered one keeps enough
    edits = [("batch_repeat_interleave", 2), "step", ("reorder_cache", [5, 5, 0, 1, 2, 3]), "step", ("crop", -2),
             "three", "step", ("batch_select_indices", [1, 3, 4]), "step", ("batch_select_indices", [2, 0]),
             "step"]  # fmt: skip
    with small_cache(tmp_path, model, executor, 6, 47) as cache, engaged(cache, model, executor), \
            torch.no_grad():
        logits = model(ids, attention_mask=mask, cache=dynamic).logits
        real = mask.bool()  # a padding position attends to nothing: its output is undefined
        torch.testing.assert_close(model(ids, attention_mask=mask, cache=cache).logits[real], logits[real], atol=ATOL,
                                   rtol=0)  # fmt: skip
        for edit in edits:
            token = logits[:, -1:].argmax(-1)
            if isinstance(edit, str):
                step = token if edit == "step" else token.repeat(1, 3)
                mask = torch.cat((mask, torch.ones_like(step)), dim=1)
                logits = model(step, attention_mask=mask, cache=dynamic).logits
                got = model(step, attention_mask=mask, cache=cache).logits
                torch.testing.assert_close(got, logits, atol=ATOL, rtol=0, msg=lambda m, e=edit: f"{edits}, {e}: {m}")
                continue
            name, argument = edit
            for each in (dynamic, cache):
                getattr(each, name)(argument if name in ("crop", "batch_repeat_interleave") else torch.tensor(argument))
            if name == "crop":
                mask = mask[:, :argument]
            elif name == "batch_repeat_interleave":
                mask, logits = mask.repeat_interleave(argument, 0), logits.repeat_interleave(argument, 0)
            else:
                mask, logits = mask[argument], logits[argument]
            assert cache.get_seq_length() == dynamic.get_seq_length()
        assert_on_disk(cache)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_prompt_the_cache_already_holds_is_refused_with_the_fix(tmp_path, executor):
    """A second, shorter request through the same cache (a pipeline call) would reach the model with no new tokens,
    which fails on an empty reshape; refused with the fix, and the conversation continues exactly."""
    model = tiny_model("llama")
    ids, mask = prompt(1, 12, seed=5)
    reference = generate(model, ids, mask, DynamicCache())
    with small_cache(tmp_path, model, executor, 1, 26) as cache, engaged(cache, model, executor):
        out = generate(model, ids, mask, cache)
        held = cache.get_seq_length()
        for shorter in (ids[:, :5], ids[:, :1]):
            with pytest.raises(InvalidConfigError, match="no new tokens.*cache.reset()"):
                model.generate(shorter, max_new_tokens=3, cache=cache)
            assert cache.get_seq_length() == held
        longer = torch.cat((out.sequences, reference.sequences[:, :1]), dim=1)
        continued = generate(model, longer, torch.ones_like(longer), cache)
        expected = generate(model, longer, torch.ones_like(longer), reference.past_key_values)
        assert_same_generation(continued, expected, atol=ATOL)
        cache.reset()
        assert_same_generation(generate(model, ids[:, :5], mask[:, :5], cache),
                               generate(model, ids[:, :5], mask[:, :5], DynamicCache()), atol=ATOL)  # fmt: skip


def test_is_initialized_answers_as_dynamic_cache(tmp_path):
    """PaliGemma, Molmo2 and HRM tell a prefill from a later step by ``cache.is_initialized``."""
    model = tiny_model("gemma2", "eager", 8)
    ids, mask = prompt(2, 9, seed=6)
    with small_cache(tmp_path, model, "gather", 2, 9) as cache, torch.no_grad():
        dynamic = DynamicCache(config=model.config)
        assert cache.is_initialized is dynamic.is_initialized is False
        for each in (dynamic, cache):
            model(ids, attention_mask=mask, cache=each)
        assert cache.is_initialized is dynamic.is_initialized is True
        for each in (dynamic, cache):
            each.reset()
        assert cache.is_initialized is dynamic.is_initialized is False


def test_offload_and_prefetch_move_nothing(tmp_path):
    """transformers' per-layer offloading calls: the tiers already place the blocks, so they keep every token."""
    model = tiny_model("llama")
    ids, mask = prompt(1, 12, seed=7)
    reference = generate(model, ids, mask, DynamicCache())
    with small_cache(tmp_path, model, "gather", 1, 21) as cache:
        with torch.no_grad():
            model(ids[:, :-1], attention_mask=mask[:, :-1], cache=cache)
        for layer in range(len(cache.layers)):
            cache.offload(layer, only_non_sliding=False)
            cache.prefetch(layer, only_non_sliding=False)
        assert cache.get_seq_length() == 11
        assert_same_generation(generate(model, ids, mask, cache), reference, atol=ATOL)


def test_rows_repeated_after_decoding_decode_at_min_device_bytes(tmp_path):
    """Rows repeated after a decode step (samples drawn from a shared prompt), then a step of three tokens across a
    block edge (a speculative check), decode to ``context`` tokens at exactly ``min_device_bytes(config, context,
    rows)``, as rows there from the start do."""
    model = tiny_model("llama")
    ids, mask = prompt(3, 40, seed=3)
    device = TieredCache.min_device_bytes(model.config, 47, 6, BLOCK)
    with TieredCache(gpu_gb=f"{device}B", cpu_gb=f"{4 * SLOT}B", disk_dir=tmp_path, block_tokens=BLOCK,
                     config=model.config) as cache, torch.no_grad():  # fmt: skip
        logits = model(ids, attention_mask=mask, cache=cache).logits
        for tokens in (1, "repeat", 1, 3, 1, 1):
            if tokens == "repeat":
                cache.batch_repeat_interleave(2)
                mask, logits = mask.repeat_interleave(2, 0), logits.repeat_interleave(2, 0)
                continue
            step = logits[:, -1:].argmax(-1).repeat(1, tokens)
            mask = torch.cat((mask, torch.ones_like(step)), dim=1)
            logits = model(step, attention_mask=mask, cache=cache).logits
        assert cache.get_seq_length() == 47


@pytest.mark.parametrize("executor", ["streaming", "split"])
def test_attention_weights_are_refused_where_they_are_never_formed_and_nothing_is_lost(tmp_path, executor):
    """``output_attentions=True`` under streaming or split attention used to return no weights, silently; refused
    with the fix on a conversation's second turn, and the cache then continues it exactly."""
    model = tiny_model("llama", "eager")
    ids, mask = prompt(1, 13, seed=8)
    first = generate(model, ids, mask, DynamicCache())
    then = first.sequences
    reference = generate(model, then, torch.ones_like(then), first.past_key_values)
    with small_cache(tmp_path, model, executor, 1, 33) as cache, engaged(cache, model, executor):
        assert_same_generation(generate(model, ids, mask, cache), first, atol=ATOL)
        with pytest.raises(InvalidConfigError, match="output_attentions=True.*exact gather"):
            generate(model, then, torch.ones_like(then), cache, output_attentions=True)
        assert [cache.get_seq_length(layer) for layer in range(len(cache.layers))] == [22, 22]
        assert_same_generation(generate(model, then, torch.ones_like(then), cache), reference, atol=ATOL)


def test_a_step_refused_in_training_mode_is_given_back(tmp_path):
    """Streaming attention refuses a model in training mode with dropout at its first layer's attention; that
    layer's step is given back, so the forward retried after ``model.eval()`` is DynamicCache's (it used to run on
    a first layer a step ahead of the second, silently)."""
    model = copy.deepcopy(tiny_model("llama"))
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    ids, mask = prompt(1, 13, seed=9)
    expected = model(ids, attention_mask=mask, cache=DynamicCache()).logits
    with small_cache(tmp_path, model, "streaming", 1, 13) as cache, engaged(cache, model, "streaming"), \
            torch.no_grad():
        model.train()
        with pytest.raises(TierKVError, match="model.eval()"):
            model(ids, attention_mask=mask, cache=cache)
        assert [cache.get_seq_length(layer) for layer in range(len(cache.layers))] == [0, 0]
        model.eval()
        torch.testing.assert_close(model(ids, attention_mask=mask, cache=cache).logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("executor", ["streaming", "split"])
def test_a_cache_engaged_with_another_model_object_is_refused(tmp_path, executor):
    """A copy of the model engaged and the original called: the original's own attention saw only each step's K/V
    (other tokens, silently); refused with the fix before anything is stored."""
    model = tiny_model("llama")
    ids, mask = prompt(1, 13, seed=10)
    reference = generate(model, ids, mask, DynamicCache())
    with small_cache(tmp_path, model, executor, 1, 23) as cache:
        with engaged(cache, copy.deepcopy(model), executor):
            with pytest.raises(InvalidConfigError, match="not the engaged one.*pass that very model"):
                generate(model, ids, mask, cache)
            assert cache.get_seq_length() == 0
        with engaged(cache, model, executor):
            assert_same_generation(generate(model, ids, mask, cache), reference, atol=ATOL)


@pytest.mark.parametrize("how", ["streaming", "split", "sparse", "exact"])
def test_a_config_instead_of_the_model_is_refused_with_the_fix(how):
    config = tiny_model("llama").config
    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", block_tokens=BLOCK) as cache, \
            pytest.raises(InvalidConfigError, match=rf"cache.{how}\(model\) takes the model object.*not its config"):
        getattr(cache, how)(config)


@pytest.mark.parametrize("executor", ["streaming", "split"])
def test_an_implementation_set_inside_the_block_is_refused_and_kept_after_it(tmp_path, executor):
    """``set_attn_implementation`` inside the block replaced the executors' attention: the next forward was refused
    as "not the engaged model", and leaving the block undid the user's choice. Now the refusal says what happened,
    nothing is stored, and the model keeps the implementation set."""
    model = copy.deepcopy(tiny_model("llama"))  # (the shared one is left as it is)
    ids, mask = prompt(1, 13, seed=11)
    with small_cache(tmp_path, model, executor, 1, 23) as cache:
        with engaged(cache, model, executor):
            model.set_attn_implementation("eager")
            with pytest.raises(InvalidConfigError, match="set to 'eager' inside .*set it before entering"):
                generate(model, ids, mask, cache)
            assert cache.get_seq_length() == 0
        assert model.config._attn_implementation == "eager"
        assert_same_generation(generate(model, ids, mask, cache), generate(model, ids, mask, DynamicCache()),
                               atol=ATOL)


def test_a_copy_of_the_model_made_inside_the_block_is_told_how_to_attend(tmp_path):
    model = tiny_model("llama")
    ids, mask = prompt(1, 13, seed=12)
    with small_cache(tmp_path, model, "streaming", 1, 23) as cache, engaged(cache, model, "streaming"):
        twin = copy.deepcopy(model)
    with pytest.raises(TierKVError, match=r"copy.deepcopy.*set_attn_implementation\('sdpa'\)"):
        generate(twin, ids, mask, DynamicCache())
    twin.set_attn_implementation("sdpa")
    assert_same_generation(generate(twin, ids, mask, DynamicCache()), generate(model, ids, mask, DynamicCache()),
                           atol=ATOL)


def test_a_compiled_forward_decodes_exactly_around_the_cache_and_fullgraph_names_the_fix(tmp_path):
    """torch.compile traced into the tiers (threads, locks, I/O: recompiles, minutes) and, with fullgraph=True,
    failed in dynamo on the cache's lock with no word of tierkv's. The cache's calls run outside the graph now."""
    model = tiny_model("llama")
    ids, mask = prompt(1, 13, seed=13)
    reference = generate(model, ids, mask, DynamicCache())
    for fullgraph in (False, True):
        torch.compiler.reset()  # (compiled code is found by the forward's code object, whatever fullgraph says)
        compiled = copy.deepcopy(model)
        compiled.forward = torch.compile(compiled.forward, fullgraph=fullgraph)
        with small_cache(tmp_path / str(fullgraph), model, "gather", 1, 23) as cache:
            if fullgraph:
                with pytest.raises(Exception, match="TieredCache runs outside torch.compile's graph.*without "
                                                    "fullgraph=True"):  # fmt: skip
                    generate(compiled, ids, mask, cache)
                assert cache.get_seq_length() == 0
            else:
                assert_same_generation(generate(compiled, ids, mask, cache), reference, atol=ATOL)
