"""Exactness of ``TieredCache`` against transformers' ``DynamicCache``.

Greedy generation through a ``TieredCache`` must give the same tokens, and fp32 logits within 1e-5, as
``DynamicCache`` — for Llama, Mistral, Qwen2, Qwen3, Gemma2 (sliding-window layers) and Phi3, built from
tiny configs — while budgets of a few KiB force the KV into all three tiers (device, host, disk). Also:
batch 2 with left padding, chunked prefill, seeded sampling, beam search (reorder), direct ``model(...)``
calls step by step, ``crop``, ``reset`` and ``get_seq_length``.

One block of these models (4 tokens x 2 KV heads x 16 dims x K+V x fp32 = 1 KiB) takes a 4 KiB slot. The
device budget is ``TieredCache.min_device_bytes`` plus two slots and the host budget four slots, so the
prompt alone spills to disk.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from models import prompt, tiny_model
from packaging import version
from transformers import DynamicCache

from tierkv.errors import BudgetTooSmallError, InvalidConfigError
from tierkv.hf import TieredCache, cache_keyword

ATOL = 1e-5
BLOCK = 4
SLOT = 4096  # bytes of one block slot of these models (1 KiB of K/V padded to the 4 KiB alignment)
WINDOW = 8  # sliding window of the Mistral / Gemma2 variants: shorter than every context below
PROMPT = 24
NEW = 10
LEFT_PAD = (0, 5)

# (id, family, attention implementation, sliding window)
MODELS = [
    ("llama-sdpa", "llama", "sdpa", None),
    ("llama-eager", "llama", "eager", None),
    ("mistral-sw8", "mistral", "sdpa", WINDOW),
    ("qwen2", "qwen2", "sdpa", None),
    ("qwen3", "qwen3", "sdpa", None),
    ("gemma2-sw8", "gemma2", "eager", WINDOW),  # Gemma2 has no sdpa path in transformers 5.x
    ("phi3", "phi3", "sdpa", None),
]
MODEL_IDS = [m[0] for m in MODELS]
SLIDING = ["mistral-sw8", "gemma2-sw8"]


def model_of(name: str):
    _, family, attn, window = next(m for m in MODELS if m[0] == name)
    return tiny_model(family, attn, window)


@pytest.fixture
def make_cache(tmp_path):
    """``make_cache(model, context, batch, with_config=False)``: a ``TieredCache`` with budgets so small that
    ``context`` tokens of ``batch`` rows land on all three tiers."""
    count = iter(range(1000))

    def make(model, context: int, batch: int, with_config: bool = False, host_slots: int = 4) -> TieredCache:
        device = TieredCache.min_device_bytes(model.config, context, batch, BLOCK) + 2 * SLOT
        return TieredCache(gpu_gb=f"{device}B", cpu_gb=f"{host_slots * SLOT}B", disk_gb="64MiB",
                           disk_dir=tmp_path / f"d{next(count)}", block_tokens=BLOCK,
                           config=model.config if with_config else None)

    return make


def assert_within_budget(cache: TieredCache) -> dict:
    stats = cache.stats()
    for tier, allocated in stats["bytes_allocated"].items():
        assert allocated <= stats["budget_bytes"][tier], (tier, stats)
    for tier, peak in stats.get("peak_bytes_allocated", {}).items():
        assert peak <= stats["budget_bytes"][tier], (tier, stats)
    return stats


def assert_tiered(cache: TieredCache) -> None:
    """No tier ever exceeded its budget, and every tier held blocks and moved bytes.

    Exception: when every layer is sliding (Mistral with ``config=``) the window bounds the KV to a few
    blocks per row, which fit above the disk tier; only the budgets are checked then.
    """
    stats = assert_within_budget(cache)
    if all(getattr(layer, "is_sliding", False) for layer in cache.layers):
        return
    assert stats["blocks"]["disk"] > 0, stats
    assert stats["blocks"]["host"] > 0, stats
    moved = stats["bytes_moved"]
    assert moved["disk->device"] > 0, moved
    assert moved["host->device"] > 0, moved
    assert moved["host->disk"] + moved["device->disk"] > 0, moved


def assert_same_generation(ref, out) -> None:
    assert torch.equal(ref.sequences, out.sequences)
    assert len(ref.logits) == len(out.logits)
    for step, (a, b) in enumerate(zip(ref.logits, out.logits)):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0, msg=lambda m, step=step: f"step {step}: {m}")


def generate(model, ids, mask, cache=None, **kwargs):
    kwargs.setdefault("do_sample", False)
    if cache is not None:
        kwargs["past_key_values"] = cache
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, output_logits=True,
                          return_dict_in_generate=True, **kwargs)


def layer_lengths(cache) -> list[int]:
    return [cache.get_seq_length(i) for i in range(len(cache.layers))]


# --------------------------------------------------------------------------------------------- generate
@pytest.mark.parametrize("with_config", [False, True], ids=["no-config", "config"])
@pytest.mark.parametrize("name", MODEL_IDS)
def test_greedy_generation_matches_dynamic_cache(name, with_config, make_cache):
    model = model_of(name)
    ids, mask = prompt(2, PROMPT, seed=1, left_pad=LEFT_PAD)
    ref = generate(model, ids, mask)
    dynamic = DynamicCache(config=model.config)
    generate(model, ids, mask, cache=dynamic)
    with make_cache(model, PROMPT + NEW, 2, with_config) as cache:
        out = generate(model, ids, mask, cache=cache)
        assert_same_generation(ref, out)
        assert_tiered(cache)
        assert cache.get_seq_length() == dynamic.get_seq_length() == PROMPT + NEW - 1
        assert layer_lengths(cache) == layer_lengths(dynamic)


@pytest.mark.parametrize("name", MODEL_IDS)
def test_chunked_prefill_matches_dynamic_cache(name, make_cache):
    model = model_of(name)
    ids, mask = prompt(2, PROMPT + 3, seed=2, left_pad=LEFT_PAD)
    ref = generate(model, ids, mask, cache=DynamicCache(config=model.config), prefill_chunk_size=6)
    with make_cache(model, PROMPT + 3 + NEW, 2, with_config=name in SLIDING) as cache:
        out = generate(model, ids, mask, cache=cache, prefill_chunk_size=6)
        assert_same_generation(ref, out)
        assert_tiered(cache)
    # chunking itself changes nothing either (a check of transformers: 5.0.0's own chunked prefill of
    # sliding-window models differs from its unchunked one; 5.17 and 5.24 agree)
    if version.parse(transformers.__version__) > version.parse("5.0.0") or name not in SLIDING:
        assert torch.equal(generate(model, ids, mask).sequences, ref.sequences)


@pytest.mark.parametrize("name", MODEL_IDS)
def test_seeded_sampling_matches_dynamic_cache(name, make_cache):
    model = model_of(name)
    ids, mask = prompt(2, PROMPT, seed=3, left_pad=LEFT_PAD)
    torch.manual_seed(77)
    ref = generate(model, ids, mask, do_sample=True, top_k=0, temperature=1.5)
    with make_cache(model, PROMPT + NEW, 2, with_config=name in SLIDING) as cache:
        torch.manual_seed(77)
        out = generate(model, ids, mask, cache=cache, do_sample=True, top_k=0, temperature=1.5)
        assert_same_generation(ref, out)
        assert_tiered(cache)


@pytest.mark.parametrize("name", ["llama-sdpa", "mistral-sw8", "qwen3", "gemma2-sw8", "phi3"])
def test_beam_search_matches_dynamic_cache(name, make_cache, monkeypatch):
    model = model_of(name)
    ids, mask = prompt(2, PROMPT, seed=4, left_pad=LEFT_PAD)
    kwargs = dict(num_beams=2, num_return_sequences=2, output_scores=True)
    ref = generate(model, ids, mask, **kwargs)
    selections = []
    original = TieredCache._select_rows
    monkeypatch.setattr(TieredCache, "_select_rows",
                        lambda self, rows: (selections.append(list(rows)), original(self, rows))[1])
    with make_cache(model, PROMPT + NEW, 4, with_config=name in SLIDING) as cache:
        out = generate(model, ids, mask, cache=cache, **kwargs)
        assert torch.equal(ref.sequences, out.sequences)
        torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=ATOL, rtol=0)
        for a, b in zip(ref.logits, out.logits):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
        assert_tiered(cache)
    # the beams were reordered through the cache, and not always as the identity
    assert selections and any(rows != sorted(rows) or len(set(rows)) < len(rows) for rows in selections)


# ------------------------------------------------------------------------------------- direct forward
def forward(model, ids, mask, cache):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_keyword(model): cache}).logits


@pytest.mark.parametrize("with_config", [False, True], ids=["no-config", "config"])
@pytest.mark.parametrize("name", MODEL_IDS)
def test_forward_step_by_step_matches_dynamic_cache(name, with_config, make_cache):
    """Prefill, multi-token chunks that straddle block edges, then single tokens, fed by hand."""
    model = model_of(name)
    ids, mask = prompt(2, 13, seed=5, left_pad=(3, 0))
    extra, _ = prompt(2, 8, seed=6)
    chunks = [ids, extra[:, :3], extra[:, 3:8]] + [None] * 6
    dynamic = DynamicCache(config=model.config)
    ref_logits = None
    with make_cache(model, 13 + 8 + 6, 2, with_config) as cache:
        for chunk in chunks:
            if chunk is None:  # greedy continuation of the reference
                chunk = ref_logits[:, -1:].argmax(-1)
            if chunk is not ids:
                mask = torch.cat((mask, torch.ones_like(chunk)), dim=1)
            ref_logits = forward(model, chunk, mask, dynamic)
            logits = forward(model, chunk, mask, cache)
            torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
            assert cache.get_seq_length() == dynamic.get_seq_length() == mask.shape[1]
            assert layer_lengths(cache) == layer_lengths(dynamic)
        assert_tiered(cache)


@pytest.mark.parametrize("name", SLIDING)
def test_sliding_layers_keep_only_their_window(name, make_cache):
    """With ``config=``, sliding layers free whole blocks that left the window; full layers keep all."""
    model = model_of(name)
    ids, mask = prompt(2, PROMPT, seed=7, left_pad=LEFT_PAD)
    with make_cache(model, PROMPT + NEW, 2, with_config=True) as cache:
        generate(model, ids, mask, cache=cache)
        kinds = getattr(model.config, "layer_types", None) or ["sliding_attention"] * len(cache.layers)
        expected = [WINDOW if kind == "sliding_attention" else None for kind in kinds]
        assert [layer.sliding_window for layer in cache.layers] == expected
        assert WINDOW in expected
        for layer in cache.layers:
            assert layer.get_seq_length() == PROMPT + NEW - 1
            if layer.is_sliding:
                assert WINDOW - 1 <= layer.stored() <= WINDOW - 1 + BLOCK - 1
                assert layer.dropped == PROMPT + NEW - 1 - layer.stored()
            else:
                assert layer.stored() == PROMPT + NEW - 1
    with make_cache(model, PROMPT + NEW, 2, with_config=False) as cache:
        generate(model, ids, mask, cache=cache)
        assert all(layer.stored() == PROMPT + NEW - 1 for layer in cache.layers)


# ------------------------------------------------------------------------------------ crop and reset
@pytest.mark.parametrize("name", MODEL_IDS)
def test_crop_then_decode_matches_dynamic_cache(name, make_cache):
    """Crop 7 tokens (across a block edge) from both caches, then continue decoding from both."""
    model = model_of(name)
    ids, mask = prompt(2, PROMPT + 6, seed=8, left_pad=LEFT_PAD)
    dynamic = DynamicCache()  # no config: sliding layers keep all, so cropping past the window is defined
    with make_cache(model, PROMPT + 6, 2) as cache:
        forward(model, ids, mask, dynamic)
        forward(model, ids, mask, cache)
        dynamic.crop(-7)
        cache.crop(-7)
        mask = mask[:, :-7]
        assert cache.get_seq_length() == dynamic.get_seq_length() == PROMPT - 1
        nxt = ids[:, PROMPT - 1 : PROMPT]  # re-feed the last cropped-away token first
        for _ in range(6):
            mask = torch.cat((mask, torch.ones_like(nxt)), dim=1)
            ref_logits = forward(model, nxt, mask, dynamic)
            torch.testing.assert_close(forward(model, nxt, mask, cache), ref_logits, atol=ATOL, rtol=0)
            nxt = ref_logits[:, -1:].argmax(-1)
        assert cache.get_seq_length() == dynamic.get_seq_length() == PROMPT + 5
        assert_tiered(cache)


def test_a_positive_crop_means_what_the_installed_transformers_means(make_cache):
    """Later releases refuse ``crop(n)`` with ``n > 0``; transformers 5.0's ``crop(max_length)`` keeps the first ``n``
    tokens (its assisted decoding calls it so), as DynamicCache does there."""
    from tierkv.hf.cache import CROP_KEEPS_LENGTH

    model = model_of("llama-sdpa")
    ids, mask = prompt(1, 10)
    with make_cache(model, 10, 1) as cache:
        forward(model, ids, mask, cache)
        if CROP_KEEPS_LENGTH:
            reference = DynamicCache()
            forward(model, ids, mask, reference)
            cache.crop(12)  # beyond the length: nothing to crop
            cache.crop(7)
            reference.crop(7)
            assert cache.get_seq_length() == reference.get_seq_length() == 7
            step = (ids[:, 7:8], mask[:, :8])
            torch.testing.assert_close(forward(model, *step, cache), forward(model, *step, reference), atol=ATOL,
                                       rtol=0)  # fmt: skip
        else:
            with pytest.raises(ValueError, match="negative integer"):
                cache.crop(3)
            cache.crop(0)
            assert cache.get_seq_length() == 10


@pytest.mark.parametrize("remove", [2, 5])
def test_crop_of_sliding_layer_is_exact_or_refused(remove, make_cache):
    """With ``config=``, a sliding layer freed the tokens before its window: a crop is either exact (the
    tokens still needed are held) or refused with InvalidConfigError — never silently wrong."""
    model = model_of("gemma2-sw8")
    ids, mask = prompt(1, 22, seed=9)
    dynamic = DynamicCache()
    with make_cache(model, 22, 1, with_config=True) as cache:
        forward(model, ids, mask, dynamic)
        forward(model, ids, mask, cache)
        dynamic.crop(-remove)
        try:
            cache.crop(-remove)
        except InvalidConfigError:
            return
        mask = mask[:, :-remove]
        nxt = ids[:, 22 - remove : 23 - remove]
        for _ in range(3):
            mask = torch.cat((mask, torch.ones_like(nxt)), dim=1)
            ref_logits = forward(model, nxt, mask, dynamic)
            torch.testing.assert_close(forward(model, nxt, mask, cache), ref_logits, atol=ATOL, rtol=0)
            nxt = ref_logits[:, -1:].argmax(-1)


def _full_then_sliding() -> transformers.PreTrainedModel:
    """A Gemma2 of a full-attention layer before a sliding one (window ``WINDOW``), eager attention."""
    config = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       query_pre_attn_scalar=16, sliding_window=WINDOW,
                                       layer_types=["full_attention", "sliding_attention"])  # fmt: skip
    torch.manual_seed(3)
    model = transformers.Gemma2ForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model


def test_past_recording_lets_a_sliding_layer_crop_beyond_its_window(make_cache):
    """Regression: ``activate_past_recording()`` (what transformers' assisted decoding turns on for long drafts)
    was ignored by sliding layers, so a crop beyond the window was refused where ``DynamicCache(config=)`` crops.
    Recording keeps what leaves the window until the next crop, which brings the layer back to its window; the
    continuation equals DynamicCache's, logit for logit."""
    if not hasattr(DynamicCache, "activate_past_recording"):
        pytest.skip("this transformers release records no past")
    model = _full_then_sliding()
    config = model.config
    ids, mask = prompt(1, 40, seed=4)
    dynamic = DynamicCache(config=config)
    shown = {}  # the K/V each cache's layers show (layers[i].keys) while recording, and after the crop

    def decode_and_crop(each) -> None:
        forward(model, ids[:, :20], mask[:, :20], each)
        each.activate_past_recording()
        for start in range(20, 36):  # decode steps past the window
            forward(model, ids[:, start : start + 1], mask[:, : start + 1], each)
        recording = [layer.keys for layer in each.layers]
        each.crop(-(WINDOW + 3))  # further back than the window holds
        shown[type(each).__name__] = (recording, [layer.keys for layer in each.layers])

    try:
        decode_and_crop(dynamic)
    except RuntimeError as exc:  # 5.17's sliding layer hands attention more keys than its mask while recording
        pytest.skip(f"this transformers release's DynamicCache fails its own past recording: {str(exc)[:60]}")
    with make_cache(model, 48, 1, with_config=True) as cache:
        decode_and_crop(cache)
        assert cache.get_seq_length() == dynamic.get_seq_length() == 36 - WINDOW - 3
        assert cache.layers[1].dropped > 0  # the crop brought the sliding layer back to its window
        for ours, theirs in zip(shown["TieredCache"], shown["DynamicCache"]):  # the past too, then the window
            for got, expected in zip(ours, theirs):
                torch.testing.assert_close(got, expected, atol=0, rtol=0)
        at = cache.get_seq_length()
        for start in range(at, at + 6):
            step = (ids[:, start : start + 1], mask[:, : start + 1])
            torch.testing.assert_close(forward(model, *step, cache), forward(model, *step, dynamic), atol=ATOL,
                                       rtol=0)  # fmt: skip


def test_a_refused_crop_changes_no_layer(make_cache):
    """Regression: with a full layer before a sliding one, the full layer was cropped before the sliding layer
    refused, and the next step's logits were 0.16 off with no error. A crop into what a window dropped is refused
    before any layer changes; the cache decodes on exactly."""
    model = _full_then_sliding()
    config = model.config
    ids, mask = prompt(1, 30, seed=4)
    dynamic = DynamicCache(config=config)
    with make_cache(model, 40, 1, with_config=True) as cache:
        for start in (0, *range(20, 30)):  # decode steps: the sliding layer frees what leaves its window
            stop = 20 if start == 0 else start + 1
            forward(model, ids[:, start:stop], mask[:, :stop], dynamic)
            forward(model, ids[:, start:stop], mask[:, :stop], cache)
        with pytest.raises(InvalidConfigError, match="at most [0-9]+ can be cropped"):
            cache.crop(-20)
        assert [layer.get_seq_length() for layer in cache.layers] == [30, 30]
        nxt, mask = ids[:, -1:], torch.cat((mask, mask[:, -1:]), dim=1)
        torch.testing.assert_close(forward(model, nxt, mask, cache), forward(model, nxt, mask, dynamic), atol=ATOL,
                                   rtol=0)  # fmt: skip


def test_a_crop_through_blocks_the_rows_share_takes_no_device_room(make_cache, monkeypatch):
    """Regression: a crop through a block the rows share (after a beam expansion) copied it for each row onto the
    device, so where the device had no room the crop failed after cutting the layers before (a cache of 32 tokens
    held 22 in two layers and 32 in the third). The rows keep the block, shared, until a step writes into it:
    with no device slot to be had, every layer is cut, and the rows decode on exactly."""
    model = model_of("llama-sdpa")
    ids, mask = prompt(2, 31, seed=5)
    ids[1], mask[1] = ids[0], mask[0]
    dynamic = DynamicCache()
    with make_cache(model, 40, 2) as cache:
        for step in (dynamic, cache):
            forward(model, ids[:1, :29], mask[:1, :29], step)
            step.batch_repeat_interleave(2)
        placement = cache.runtime.store.placement

        def no_room(*args, **kwargs):
            raise BudgetTooSmallError("no device room (injected)")

        with monkeypatch.context() as patch:
            patch.setattr(placement, "alloc_device", no_room)
            cache.crop(-3)
        dynamic.crop(-3)
        assert [layer.get_seq_length() for layer in cache.layers] == [26, 26]
        for start in range(26, 31):
            step = (ids[:, start : start + 1], mask[:, : start + 1])
            torch.testing.assert_close(forward(model, *step, cache), forward(model, *step, dynamic), atol=ATOL,
                                       rtol=0)  # fmt: skip


def test_a_crop_of_more_than_is_held_empties_the_cache_as_dynamic_cache_does(make_cache):
    """Regression: without a sliding window, ``crop(-n)`` past the tokens held was refused with a message about
    sliding windows; DynamicCache empties the layer, and so does the cache (which then decodes a new prompt)."""
    model = model_of("llama-sdpa")
    ids, mask = prompt(1, 9)
    dynamic = DynamicCache()
    with make_cache(model, 20, 1) as cache:
        forward(model, ids, mask, dynamic)
        forward(model, ids, mask, cache)
        dynamic.crop(-100)
        cache.crop(-100)
        assert cache.get_seq_length() == dynamic.get_seq_length() == 0
        torch.testing.assert_close(forward(model, ids, mask, cache), forward(model, ids, mask, dynamic), atol=ATOL,
                                   rtol=0)  # fmt: skip


def test_a_cache_filled_in_inference_mode_is_edited_and_decodes_outside_it(make_cache):
    """Regression: slabs made under ``torch.inference_mode()`` (as servers generate) are inference tensors, so a
    crop outside it (README's prompt reuse) failed halfway with torch's RuntimeError, one layer cropped, and any
    later ``no_grad`` forward failed too. The tiers' tensors are normal whatever the caller's mode."""
    model = model_of("llama-sdpa")
    ids, mask = prompt(1, 30, seed=6)
    dynamic = DynamicCache()
    with make_cache(model, 40, 1) as cache:
        with torch.inference_mode():
            forward(model, ids, mask, dynamic)
            forward(model, ids, mask, cache)
        dynamic.crop(-5)
        cache.crop(-5)  # into a block
        assert [layer.get_seq_length() for layer in cache.layers] == [25, 25]
        mask = mask[:, :26]
        got, expected = forward(model, ids[:, 25:26], mask, cache), forward(model, ids[:, 25:26], mask, dynamic)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        assert cache.stats()["blocks"]["disk"] > 0


@pytest.mark.parametrize("name", ["llama-sdpa", "gemma2-sw8"])
def test_reset_then_generate_again(name, make_cache):
    """After ``reset`` the cache is empty and serves new batches (other padding, batch size) exactly."""
    model = model_of(name)
    ids, mask = prompt(2, PROMPT, seed=10, left_pad=LEFT_PAD)
    ids2, mask2 = prompt(2, PROMPT + 4, seed=11, left_pad=(6, 1))
    ids3, mask3 = prompt(1, PROMPT - 4, seed=12)
    with make_cache(model, PROMPT + 4 + NEW, 2, with_config=name in SLIDING) as cache:
        assert_same_generation(generate(model, ids, mask), generate(model, ids, mask, cache=cache))
        cache.reset()
        assert cache.get_seq_length() == 0
        assert all(layer.get_seq_length() == 0 for layer in cache.layers)
        assert cache.stats()["blocks"] == {"device": 0, "host": 0, "disk": 0}
        assert_same_generation(generate(model, ids2, mask2), generate(model, ids2, mask2, cache=cache))
        assert cache.get_seq_length() == PROMPT + 4 + NEW - 1
        assert_tiered(cache)
        cache.reset()
        assert_same_generation(generate(model, ids3, mask3), generate(model, ids3, mask3, cache=cache))
        assert cache.get_seq_length() == PROMPT - 4 + NEW - 1
        assert_within_budget(cache)


def test_get_seq_length_of_empty_and_closed_cache(tmp_path):
    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", disk_dir=tmp_path, block_tokens=BLOCK) as cache:
        assert cache.get_seq_length() == 0
        assert cache.stats()["tokens"] == 0


# ------------------------------------------------------------------------------------------ known bugs
def test_demoting_a_chunk_larger_than_the_host_tier(tmp_path):
    """block_tokens=1 makes every token a 4 KiB slot: a 1 MiB device tier grows its pool 16 slots at a time,
    and once it is full, growing the staging area evacuates a 16-block chunk towards a 4-slot host tier."""
    model = model_of("llama-sdpa")
    ids, mask = prompt(4, 40, seed=13)
    with TieredCache(gpu_gb="1MiB", cpu_gb=f"{4 * SLOT}B", disk_dir=tmp_path, block_tokens=1) as cache:
        assert_same_generation(generate(model, ids, mask), generate(model, ids, mask, cache=cache))
        assert_tiered(cache)


@pytest.mark.parametrize("prefetch_depth", [1, 2])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_three_layer_models(family, prefetch_depth, make_cache, tmp_path):
    """Regression: with 3+ layers, the first forward must not prefetch layer 0 before the layer count is known
    (it used to wrap around at layer 1 and layer 2 then reused that pending buffer: step 1 read layer 2's
    K/V as layer 0's). 22 tokens: not a block multiple, so the first decode step reuses the staging."""
    model = tiny_model(family, "eager", WINDOW if family == "gemma2" else None, layers=3)
    ids, mask = prompt(1, 22, seed=12)
    ref = generate(model, ids, mask)
    with TieredCache(disk_dir=tmp_path, block_tokens=BLOCK, prefetch_depth=prefetch_depth) as cache:
        assert_same_generation(ref, generate(model, ids, mask, cache=cache))
        assert cache.stats()["prefetch_hits"] > 0
    with make_cache(model, 22 + NEW, 1, with_config=True) as cache:
        assert_same_generation(ref, generate(model, ids, mask, cache=cache))
