"""min_sparse_device_bytes on a model shaped like Gemma 3 (five sliding-window layers to each global one, one KV head
wider than the hidden size's share): the budget it promises holds ``cache.sparse`` at its defaults after a prompt
prefilled through the model in one forward, as ``generate`` does, and a sliding layer's key summaries and rest copy
stay the size of its window (what :func:`tierkv.hf.sizing.sparse_table_bytes` counts): each layer summarises its
full blocks when it first attends sparsely, after it dropped those that left its window; the kept pages give way
when a table grows; a refused first step gives back what it reserved."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from models import BOS, PAD, VOCAB, prompt, tiny_model

from tierkv import BudgetTooSmallError, TieredCache
from tierkv.hf import sizing

BLOCK, CHUNK, WINDOW = 32, 64, 24  # 32-token blocks of 2 default pages; a window shorter than a block
PROMPT, NEW = 600, 8

@functools.cache
def gemma3_shaped() -> transformers.Gemma3ForCausalLM:
    """Six layers (Gemma 3's pattern: five sliding, one global), one KV head of 64 channels, fp32."""
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=2048, sliding_window=WINDOW,
        query_pre_attn_scalar=64, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=None)
    torch.manual_seed(1234)
    model = transformers.Gemma3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


def _generate(model: transformers.PreTrainedModel, gpu: int | str, folder, length: int, new: int,
              piece: int | None = None) -> dict:
    """Prefill ``length`` tokens (one forward, or ``piece``-token forwards) and greedily decode ``new`` more with
    ``cache.sparse(model, tokens=0.1)`` at its defaults; ``stats()`` after it."""
    ids, mask = prompt(1, length, seed=9)
    with TieredCache(gpu_gb=gpu if isinstance(gpu, str) else f"{gpu}B", cpu_gb="16KB", disk_dir=folder,
                     block_tokens=BLOCK, config=model.config) as cache, cache.sparse(model, tokens=0.1,
                                                                                    chunk_tokens=CHUNK):
        if piece is not None:  # the prompt but its last token in pieces, then generate from that cache
            with torch.no_grad():  # not inference tensors: generate goes on writing into the same blocks
                for start in range(0, length - 1, piece):
                    model(ids[:, start : min(start + piece, length - 1)], past_key_values=cache)
        model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, cache=cache)
        return cache.stats()


def test_the_model_is_shaped_like_gemma3():
    config = gemma3_shaped().config
    assert sizing.layer_windows(config) == [WINDOW] * 5 + [None]
    layout = sizing.layout_of_config(config, BLOCK, None)
    assert (layout.kv_heads, layout.head_dim) == (1, 64)


@pytest.mark.parametrize("piece", [
    pytest.param(None, id="one-forward"),
    pytest.param(WINDOW // 2, id="pieces-within-the-window"),
])
def test_sliding_layers_keep_summaries_of_their_window(tmp_path, piece):
    """The summaries and rest copy held after the prompt and a few steps are within what ``sparse_table_bytes``
    counts (a sliding layer: its window and the block it fills), whichever way the prompt was prefilled."""
    model = gemma3_shaped()
    sparse = _generate(model, "64MB", tmp_path, PROMPT, NEW, piece)["sparse"]
    held = sparse["summaries_device_bytes"] + sparse["rest_copy_device_bytes"]
    assert held <= sizing.sparse_table_bytes(model.config, PROMPT + NEW, block_tokens=BLOCK)


def test_min_sparse_device_bytes_holds_a_prompt_prefilled_in_one_forward(tmp_path):
    """Exactly ``min_sparse_device_bytes`` prefills the prompt in one forward and decodes, most KV off the device."""
    model = gemma3_shaped()
    need = sizing.min_sparse_device_bytes(model.config, PROMPT + NEW, tokens=0.1, block_tokens=BLOCK,
                                          chunk_tokens=CHUNK, device="cpu")
    placed = _generate(model, need, tmp_path, PROMPT, NEW)["blocks"]
    assert placed["disk"] > placed["device"]


def test_min_sparse_device_bytes_holds_the_tables_growth(tmp_path):
    """Exactly ``min_sparse_device_bytes`` for the whole sequence decodes past a block that fills while the global
    layer's table is full (the prompt fills 18 blocks: its table is 18 rows, and grows at the 19th)."""
    model = gemma3_shaped()
    new = 2 * NEW
    need = sizing.min_sparse_device_bytes(model.config, PROMPT + new, tokens=0.1, block_tokens=BLOCK,
                                          chunk_tokens=CHUNK, device="cpu")
    placed = _generate(model, need, tmp_path, PROMPT, new)["blocks"]
    assert placed["disk"] > placed["device"]


def test_a_refused_first_sparse_step_gives_back_what_it_reserved(tmp_path):
    """A budget between the streaming minimum and the sparse one: the first decode step is refused while the summaries
    are built (the first layer's table fits, the second's does not), and afterwards the device holds no staging but
    the summaries it kept (none)."""
    model = tiny_model("llama")  # two global layers
    ids, mask = prompt(1, 240, seed=9)
    need = sizing.min_sparse_device_bytes(model.config, 248, tokens=0.1, block_tokens=BLOCK, chunk_tokens=CHUNK,
                                          device="cpu")
    least = sizing.min_streaming_device_bytes(model.config, block_tokens=BLOCK, chunk_tokens=CHUNK, device="cpu")
    with TieredCache(gpu_gb=f"{least + (need - least) // 3}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=BLOCK,
                     config=model.config) as cache:
        with pytest.raises(BudgetTooSmallError), cache.sparse(model, tokens=0.1, chunk_tokens=CHUNK):
            model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, cache=cache)
        stats = cache.stats()
        assert stats["bytes_staging"] == stats["bytes_summaries"]


def test_blocks_full_before_the_summaries_are_read_to_summarise_within_the_budget(tmp_path, monkeypatch):
    """Regression: the first sparse step read up to 64 block columns of a prefilled prompt into device memory that
    no budget counted (249 MiB of RSS beside 91 MiB of budgets at 16K tokens). The pieces it reads are reserved
    in the device budget first, as many columns as its free room holds; at ``min_sparse_device_bytes``, one."""
    from tierkv.attention.sparse_store import SparseBlocks

    model = tiny_model("llama")
    length = 100 * BLOCK  # more columns than one piece
    ids, mask = prompt(1, length, seed=9)
    need = sizing.min_sparse_device_bytes(model.config, length + NEW, tokens=0.1, block_tokens=BLOCK,
                                          chunk_tokens=CHUNK, device="cpu")
    pieces: list[tuple[int, int]] = []  # (bytes read, bytes reserved beside the summaries' when read)
    backfill = SparseBlocks._backfill

    def watched(self, summaries, layer, read):
        device = self.store.device

        def counted(layer, plan, data):  # each piece read to summarise
            assert device.allocated_bytes <= device.budget
            pieces.append((data.numel() * data.element_size(), device.reserved - summaries.nbytes))
            return read(layer, plan, data)

        backfill(self, summaries, layer, counted)

    monkeypatch.setattr(SparseBlocks, "_backfill", watched)
    with TieredCache(gpu_gb=f"{need}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=BLOCK,
                     config=model.config) as cache:  # fmt: skip
        with torch.no_grad(), cache.streaming(model, chunk_tokens=CHUNK):  # a prefill that keeps no summaries
            model(ids[:, :-1], attention_mask=mask[:, :-1], past_key_values=cache)
        with cache.sparse(model, tokens=0.1, chunk_tokens=CHUNK):
            model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, cache=cache)
        assert cache.stats()["peak_bytes_allocated"]["device"] <= need
    assert pieces and all(read <= reserved for read, reserved in pieces)


def test_min_sparse_device_bytes_holds_one_token_pages_of_wide_heads(tmp_path):
    """Regression: at ``min_sparse_device_bytes`` (3-token blocks of one-token pages, 128-wide heads) the first
    decode step was refused: the pieces that summarise the prompt's blocks took the free room the summaries' table
    then needed. The table grows first; every suggested budget works."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                      max_position_embeddings=512, pad_token_id=PAD, bos_token_id=BOS)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids, _ = prompt(1, 70, seed=1)
    need = sizing.min_sparse_device_bytes(config, 75, 0.1, 1, block_tokens=3, page_tokens=1, chunk_tokens=7)
    with TieredCache(gpu_gb=f"{need}B", cpu_gb="64MB", block_tokens=3, config=config) as cache, \
            cache.sparse(model, tokens=0.1, page_tokens=1, chunk_tokens=7), torch.no_grad():  # fmt: skip
        logits = model(input_ids=ids, past_key_values=cache).logits
        for _ in range(4):
            logits = model(input_ids=logits[:, -1:].argmax(-1), past_key_values=cache).logits
        assert cache.stats()["peak_bytes_allocated"]["device"] <= need


def _gpt2(head_dim: int) -> transformers.PreTrainedModel:
    """GPT-2 (no rotary: any head dim builds) with four heads of ``head_dim``."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=4 * head_dim, n_head=4, n_layer=2, n_positions=512,
                                     pad_token_id=PAD, bos_token_id=BOS, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.generation_config.pad_token_id = PAD
    return model


@pytest.mark.parametrize("head_dim", [3, 5])
def test_the_default_rest_copy_packs_an_odd_head_dim_in_whole_bytes(tmp_path, head_dim):
    """Regression: at the default ``rest_bits=4`` a head dim that 4-bit codes do not pack into whole bytes (odd)
    failed the first sparse step with torch's raw "unflatten" error. The default takes 8 bits there: at a full
    budget sparse decodes as DynamicCache; an explicit ``rest_bits`` that does not pack is refused with the fix."""
    from transformers import DynamicCache

    from tierkv.errors import InvalidConfigError

    model = _gpt2(head_dim)
    ids, mask = prompt(1, 40, seed=2)
    options = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    reference = model.generate(ids, attention_mask=mask, past_key_values=DynamicCache(), **options)
    with TieredCache(gpu_gb="4MB", cpu_gb="64KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache:
        with pytest.raises(InvalidConfigError, match="rest_bits=8"):
            cache.sparse(model, tokens=1.0, rest_bits=4)
        with cache.sparse(model, tokens=1.0, chunk_tokens=8):
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, **options)
            assert cache.stats()["sparse"]["rest_copy_device_bytes"] > 0
        cache.reset()
        with cache.sparse(model, tokens=0.25, chunk_tokens=8):  # pages not read: attended from the 8-bit copy
            part = model.generate(ids, attention_mask=mask, past_key_values=cache, **options)
            assert cache.stats()["sparse"]["rest_layer_steps"] > 0
    assert all(torch.isfinite(logits).all() for logits in part.logits)
    assert torch.equal(out.sequences, reference.sequences)
    for got, want in zip(out.logits, reference.logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_sparse_budget_above_the_context_sizes_for_the_context():
    """Regression: ``tokens`` above the context (the default 2048 on a short prompt, "1M") sized the selection's
    buffers for tokens that are not there: ``min_sparse_device_bytes`` and the budget error asked for thousands of
    times the memory that decodes."""
    config = tiny_model("llama").config
    whole = TieredCache.min_sparse_device_bytes(config, 64, tokens=1.0, block_tokens=4)
    assert TieredCache.min_sparse_device_bytes(config, 64, tokens=1 << 20, block_tokens=4) == whole
    assert TieredCache.min_sparse_device_bytes(config, 64, tokens="1M", block_tokens=4) == whole


def _steps(model: transformers.PreTrainedModel, cache, ids: torch.Tensor, pieces: list[int]) -> torch.Tensor:
    """Forward ``ids`` through ``cache`` in pieces of ``pieces`` tokens in turn; the last piece's logits."""
    with torch.no_grad():
        for piece in ids.split(pieces, dim=1):
            logits = model(piece, past_key_values=cache).logits
    return logits


LONG = 20 * BLOCK  # a step far longer than the window: the sliding layers drop all but its last blocks next step


def test_a_long_step_after_decoding_summarises_only_what_its_window_keeps(tmp_path):
    """Exactly ``min_sparse_device_bytes`` holds a step of many blocks after sparse decode steps: a sliding layer
    summarises only the blocks its window keeps (it summarised every block the step filled, and its table outgrew
    the window the budget counts), and stays within ``sparse_table_bytes``."""
    model = gemma3_shaped()
    pieces = [PROMPT, 1, 1, LONG, 1, 1]
    need = sizing.min_sparse_device_bytes(model.config, sum(pieces), tokens=0.1, block_tokens=BLOCK,
                                          chunk_tokens=CHUNK, device="cpu")
    with TieredCache(gpu_gb=f"{need}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=BLOCK,
                     config=model.config) as cache, cache.sparse(model, tokens=0.1, chunk_tokens=CHUNK):
        _steps(model, cache, prompt(1, sum(pieces), seed=3)[0], pieces)
        sparse = cache.stats()["sparse"]
    held = sparse["summaries_device_bytes"] + sparse["rest_copy_device_bytes"]
    assert held <= sizing.sparse_table_bytes(model.config, sum(pieces), block_tokens=BLOCK)


def test_a_crop_back_into_unsummarised_blocks_summarises_them(tmp_path):
    """A crop after a long step brings blocks the sliding window was to drop (and that got no summary) back into
    it: the next sparse steps summarise them first, and select (8 tokens: fewer than the window, so the sliding
    layers score their blocks) and attend as a cache that never saw the cropped tokens."""
    model = gemma3_shaped()
    crop = 2 * BLOCK + 5
    ids = prompt(1, PROMPT + 1 + LONG + 2, seed=3)[0]
    kept = torch.cat((ids[:, : PROMPT + 1 + LONG - crop], ids[:, -2:]), dim=1)
    logits = []
    for cropped in (True, False):
        with TieredCache(gpu_gb="64MB", cpu_gb="16KB", disk_dir=tmp_path / str(cropped), block_tokens=BLOCK,
                         config=model.config) as cache, cache.sparse(model, tokens=8, chunk_tokens=CHUNK):
            if cropped:
                _steps(model, cache, ids[:, :-2], [PROMPT, 1, LONG])
                cache.crop(-crop)
                logits.append(_steps(model, cache, ids[:, -2:], [1, 1]))
            else:
                logits.append(_steps(model, cache, kept, [PROMPT, 1, LONG - crop, 1, 1]))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


def test_a_cache_built_without_config_is_sized_as_keeping_its_sliding_layers_whole_past(tmp_path):
    """A sliding model's cache built without ``config=`` keeps every token of its sliding layers, so the model
    config's ``min_sparse_device_bytes`` is too small: the refusal (it said only "beside the blocks being filled")
    names the minimum with ``record_past=True`` and why, and that minimum decodes."""
    model = tiny_model("mistral", "sdpa", 8)
    ids, mask = prompt(2, 40, seed=3)
    options = dict(tokens=1.0, batch=2, block_tokens=3, page_tokens=1, chunk_tokens=5, device="cpu")  # 1-token
    windows = sizing.min_sparse_device_bytes(model.config, 58, **options)  # pages: the past's summaries weigh
    whole = sizing.min_sparse_device_bytes(model.config, 58, record_past=True, **options)
    assert whole > windows
    for budget in (windows, whole):
        with TieredCache(gpu_gb=f"{budget}B", cpu_gb="4KB", disk_dir=tmp_path / str(budget), block_tokens=3) as cache, \
                cache.sparse(model, tokens=1.0, chunk_tokens=5, page_tokens=1):
            if budget == windows:
                with pytest.raises(BudgetTooSmallError, match="record_past=True: this cache was built without config="):
                    model.generate(ids, attention_mask=mask, max_new_tokens=18, do_sample=False, cache=cache)
            else:
                model.generate(ids, attention_mask=mask, max_new_tokens=18, do_sample=False, cache=cache)
