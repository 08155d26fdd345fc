"""Architectures beyond the core families of ``tests/models.py``, and those whose attention differs from theirs.

- Thirty-four more transformers architectures (partial rotary, MoE, QK norms, parallel blocks, learned positions,
  NoPE layers, sliding and full layers, wider heads in some layers than in others, a hybrid with convolution
  layers) decode exactly as ``DynamicCache`` through exact gather, split and sparse attention at a full budget,
  with blocks on every tier.
- Gemma 3n and Gemma 4 let their last layers attend over the K/V of earlier layers (KV shared across layers): exact
  gather keeps those layers' staging buffers for the rest of the forward and decodes exactly, with or without the
  config; the executors that hand the model only each step's K/V are refused with the fix.
- gpt-oss adds a learnt logit per query head to the softmax's denominator (attention sinks, ``s_aux``): the
  executors fold it in from their log-sum-exp, and decode exactly as ``DynamicCache`` on all three tiers.
- Bloom attends with its own code (ALiBi), not through transformers' AttentionInterface: engaging it is refused
  before anything changes, and ``cache.exact(model)`` picks gather for it.
- Doge passes a mask per head (its dynamic mask): the step is refused with an error that names the fix, and every
  token accepted before it still reads back.
- Multi-head latent attention (DeepSeek V2 / V3, MiniCPM3) caches keys and values of two head dims (the latent and
  the rotary key, or expanded keys wider than values): stored at the wider, decoded exactly by exact gather from
  every tier, saved and loaded; the executors that attend the stored K/V are refused, nothing stored.
- T5 (encoder-decoder): the cache serves as the decoder's self-attention cache inside an EncoderDecoderCache.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import transformers
from helpers import assert_same_generation
from models import BOS, PAD, VOCAB, prompt
from transformers import DynamicCache

from tierkv import TieredCache, settings
from tierkv.errors import InvalidConfigError
from tierkv.hf import TieredLayer, cache_keyword
from tierkv.hf.attention import takes_attention_functions
from tierkv.hf.sizing import HOLDS_STATE, kv_bytes_held, kv_producers

NEW = 6
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, pad_token_id=PAD,
             bos_token_id=BOS, eos_token_id=None, tie_word_embeddings=False)  # fmt: skip


def build(config_name: str, model_name: str, **kwargs) -> transformers.PreTrainedModel:
    if not hasattr(transformers, config_name):
        pytest.skip(f"this transformers release has no {config_name}")
    return instantiate(getattr(transformers, model_name), getattr(transformers, config_name)(**SMALL, **kwargs))


def instantiate(model_class, config) -> transformers.PreTrainedModel:
    """An fp32 eval-mode model of ``config`` from a fixed seed, generating without an end token."""
    torch.manual_seed(99)
    model = model_class(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


SLIDING = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
ARCHITECTURES: dict[str, dict] = {  # model_type -> config arguments beside SMALL's and GQA's
    "gpt_neox": dict(num_attention_heads=4, rotary_pct=0.5), "gpt2": dict(n_head=4),
    "opt": dict(num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64),
    "falcon": dict(num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2),
    "persimmon": dict(num_attention_heads=4), "phi": dict(num_attention_heads=4, partial_rotary_factor=0.5),
    "stablelm": dict(num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.25),
    "olmo2": {}, "cohere": {}, "starcoder2": {}, "granite": {}, "glm4": {}, "exaone4": {}, "ministral": {},
    "helium": {}, "arcee": {}, "seed_oss": {}, "ernie4_5": {}, "bitnet": {}, "apertus": {}, "hunyuan_v1_dense": {},
    "cohere2": SLIDING, "olmo3": SLIDING, "gemma3_text": dict(SLIDING, query_pre_attn_scalar=16),
    "smollm3": dict(no_rope_layers=[1, 0]),
    "llama4_text": dict(no_rope_layers=[1, 0], num_local_experts=2, num_experts_per_tok=1,
                        intermediate_size_mlp=128),
    "qwen3_moe": dict(MOE, num_experts=4), "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(MOE, n_routed_experts=4, first_k_dense_replace=1, n_group=1, topk_group=1),
    "gemma3n_text": dict(SLIDING, num_kv_shared_layers=0, laurel_rank=8, altup_num_inputs=2,
                         activation_sparsity_pattern=[0.0, 0.0], vocab_size_per_layer_input=VOCAB,
                         hidden_size_per_layer_input=8, intermediate_size=[128, 128]),
    "gemma4_text": dict(SLIDING, global_head_dim=32, hidden_size_per_layer_input=8,
                        vocab_size_per_layer_input=VOCAB),  # full-attention layers' heads twice as wide
    "afmoe": {},  # its attention output is .view()ed: the executors' must be contiguous
    # its attention modules update cache layer layer_idx + cycle_offset; they are multi-head whatever the config
    # says (HrmTextConfig has no num_key_value_heads: GQA's would be a stray attribute that sizes half the KV)
    "hrm_text": dict(num_key_value_heads=4),
    "lfm2": {},  # convolution layers beside attention: the cache holds only the attention layers' KV
    "xlm-roberta-xl": dict(num_attention_heads=4),  # built without is_decoder: attends both ways (not causal)
}
GQA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
OWN_HEADS = {"gpt_neox", "gpt2", "opt", "falcon", "persimmon", "phi", "stablelm", "xlm-roberta-xl"}  # no GQA


def architecture(model_type: str, **overrides) -> transformers.PreTrainedModel:
    kwargs = {**SMALL, **({} if model_type in OWN_HEADS else GQA), **ARCHITECTURES.get(model_type, {}), **overrides}
    try:
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
    except (KeyError, ValueError):
        pytest.skip(f"this transformers release has no {model_type}")
    return instantiate(transformers.AutoModelForCausalLM.from_config, config)


@pytest.mark.parametrize("executor", ["gather", "split", "sparse"])
@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_more_architectures_decode_exactly(tmp_path, model_type, executor):
    model = architecture(model_type)
    if executor != "gather" and not takes_attention_functions(model):  # its own attention code in this release
        with TieredCache(gpu_gb="1MB", block_tokens=4) as cache, \
                pytest.raises(InvalidConfigError, match="attends with its own code"):  # fmt: skip
            engage(cache, model, executor).__enter__()
        return
    ids, mask = prompt(2, 40, seed=3, left_pad=(0, 5))
    reference = run(model, ids, mask, DynamicCache(config=model.config))
    gpu = f"{TieredCache.min_device_bytes(model.config, 64, 2, block_tokens=4) + 16384}B" if executor == "gather" \
        else budget(model, executor)  # fmt: skip
    with TieredCache(gpu_gb=gpu, cpu_gb="64KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache:
        with contextlib.nullcontext() if executor == "gather" else engage(cache, model, executor):
            out = run(model, ids, mask, cache)
        blocks = cache.stats()["blocks"]
        assert blocks["host"] + blocks["disk"] > 0  # (sparse's device minimum holds these models' whole context)
    assert_same_generation(out, reference, atol=1e-4)


@pytest.mark.parametrize("executor", ["streaming", "split"])
def test_attention_that_is_not_causal_attends_every_key_without_a_mask(tmp_path, executor):
    """Regression: a BERT-style model built without ``is_decoder`` attends both ways (its modules are not causal,
    and an unpadded batch has no mask); the executors took the missing mask for a causal one: logits 0.24 off
    DynamicCache's, with no error. Without a mask a non-causal step attends every key, as sdpa does."""
    model = architecture("xlm-roberta-xl")
    assert not model.config.is_decoder
    ids, _ = prompt(2, 40, seed=3)
    reference = run(model, ids, None, DynamicCache(config=model.config))
    with TieredCache(gpu_gb=budget(model, executor), cpu_gb="64KB", disk_dir=tmp_path, block_tokens=4,
                     config=model.config) as cache:  # fmt: skip
        with engage(cache, model, executor):
            out = run(model, ids, None, cache)
        assert cache.stats()["blocks"]["disk"] > 0
    assert_same_generation(out, reference, atol=1e-4)


def gpt_oss(sinks: bool = True) -> transformers.PreTrainedModel:
    """Two layers, sliding (window 8) then full, 4 query heads over 2 KV heads, 4 experts; the sinks drawn large
    so that leaving them out changes every logit (or set to -inf: no sinks at all)."""
    model = build("GptOssConfig", "GptOssForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    with torch.no_grad():
        for layer in model.model.layers:
            sink = layer.self_attn.sinks
            sink.copy_(torch.randn(sink.shape, generator=torch.Generator().manual_seed(5)) * 2 if sinks
                       else torch.full(sink.shape, float("-inf")))  # fmt: skip
    return model


def run(model, ids, mask, cache):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, past_key_values=cache)


def engage(cache: TieredCache, model, executor: str):
    if executor == "split":
        return cache.split(model, chunk_tokens=8)
    if executor == "sparse":  # every token attended: exact
        return cache.sparse(model, tokens=1.0, chunk_tokens=8)
    return cache.streaming(model, chunk_tokens=8)


def budget(model, executor: str) -> str:
    config = model.config
    minimum = {"split": lambda: TieredCache.min_split_device_bytes(config, 2, block_tokens=4, chunk_tokens=8),
               "sparse": lambda: TieredCache.min_sparse_device_bytes(config, 64, 1.0, 2, block_tokens=4,
                                                                     chunk_tokens=8),
               "streaming": lambda: TieredCache.min_streaming_device_bytes(config, 2, block_tokens=4,
                                                                           chunk_tokens=8)}[executor]()  # fmt: skip
    return f"{minimum + 16384}B"


@pytest.mark.parametrize("executor", ["split", "sparse", "streaming"])
def test_attention_sinks_decode_exactly_on_every_tier(tmp_path, executor):
    model = gpt_oss()
    ids, mask = prompt(2, 40, seed=11, left_pad=(0, 5))
    reference = run(model, ids, mask, DynamicCache(config=model.config))
    without = run(gpt_oss(sinks=False), ids, mask, DynamicCache(config=model.config))
    assert (without.logits[0] - reference.logits[0]).abs().max() > 1e-2  # the sinks matter to every step
    with TieredCache(gpu_gb=budget(model, executor), cpu_gb="64KB", disk_dir=tmp_path, block_tokens=4,
                     config=model.config) as cache:  # fmt: skip
        with engage(cache, model, executor):
            out = run(model, ids, mask, cache)
        blocks = cache.stats()["blocks"]
        assert blocks["host"] > 0 and blocks["disk"] > 0
    assert_same_generation(out, reference, atol=1e-4)


@pytest.mark.parametrize("executor", ["split", "sparse", "streaming"])
def test_sinks_take_all_of_a_padding_querys_mass(tmp_path, executor):
    """A padding query (every key masked) of a model with sinks: eager gives the sinks all the mass, so zeros."""
    model = gpt_oss()
    ids, mask = prompt(2, 30, seed=12, left_pad=(0, 9))
    expected = model(ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config)).logits
    with TieredCache(gpu_gb=budget(model, executor), cpu_gb="64KB", disk_dir=tmp_path, block_tokens=4,
                     config=model.config) as cache, engage(cache, model, executor):  # fmt: skip
        got = model(ids, attention_mask=mask, past_key_values=cache).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def bloom() -> transformers.PreTrainedModel:
    return build("BloomConfig", "BloomForCausalLM", n_head=4)


@pytest.mark.parametrize("executor", ["split", "sparse", "streaming"])
@pytest.mark.parametrize("model_type", ["bloom", "git"])  # git: its vision attention uses the interface, not its text
def test_a_model_with_its_own_attention_code_is_refused_before_anything_changes(tmp_path, executor, model_type):
    model = bloom() if model_type == "bloom" else architecture(model_type)
    before = model.config._attn_implementation
    with TieredCache(gpu_gb="1MB", cpu_gb="16KB", block_tokens=4, config=model.config) as cache:
        engagement = engage(cache, model, executor)
        with pytest.raises(InvalidConfigError, match=f"{type(model).__name__} attends with its own code.*leave "
                                                     f"out the `with cache.{executor}"):  # fmt: skip
            engagement.__enter__()
        assert model.config._attn_implementation == before
        assert not cache.runtime.modes  # no mode was left pushed


def test_exact_picks_gather_for_a_model_with_its_own_attention_code(tmp_path, monkeypatch):
    monkeypatch.setattr("tierkv.hf.modes.choose_executor", lambda *args: "split")  # as a fast host kernel would
    model = bloom()
    ids, mask = prompt(1, 30, seed=2)
    reference = run(model, ids, mask, DynamicCache(config=model.config))
    with TieredCache(gpu_gb="1MB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache:
        with cache.exact(model):
            out = run(model, ids, mask, cache)
        assert cache.chosen == "gather"
    assert_same_generation(out, reference, atol=1e-5)


def test_a_mask_per_head_is_refused_and_nothing_is_lost(tmp_path):
    model = build("DogeConfig", "DogeForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    ids, _ = prompt(1, 12, seed=4)
    with TieredCache(gpu_gb="1MB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache:
        model(input_ids=ids, past_key_values=cache)  # exact gather: accepted
        with cache.split(model, chunk_tokens=8), pytest.raises(InvalidConfigError, match="one per head.*exact "
                                                                                           "gather"):  # fmt: skip
            model(input_ids=prompt(1, 3, seed=5)[0], past_key_values=cache)
        assert cache.get_seq_length() == 12
        following = prompt(1, 3, seed=6)[0]
        out = model(input_ids=following, past_key_values=cache).logits
    reference_cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=reference_cache)
    expected = model(input_ids=following, past_key_values=reference_cache).logits
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("executor", ["split", "sparse", "streaming"])
@pytest.mark.parametrize("model_type", ["diffllama", "jetmoe"])
def test_kv_the_model_changes_before_attending_is_refused_and_nothing_is_lost(tmp_path, model_type, executor):
    """DiffLlama attends twice, each time with half of the values the update returned; JetMoE repeats keys and
    values per expert (its own attention would then see only the step's, silently at batch 1). The executors
    read the stored K/V, so the step is refused (rolled back) with the fix, and exact gather decodes exactly."""
    model = architecture(model_type)
    ids, mask = prompt(1, 30, seed=2)
    with TieredCache(gpu_gb="1MB", cpu_gb="64KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache:
        # (transformers 5.0's DiffLlama attends with its own code: refused when the block is entered)
        with pytest.raises(InvalidConfigError, match="(values other than|attends with its own code).*exact gather"), \
                engage(cache, model, executor):  # fmt: skip
            run(model, ids, mask, cache)
        assert cache.get_seq_length() == 0
        out = run(model, ids, mask, cache)
    assert_same_generation(out, run(model, ids, mask, DynamicCache(config=model.config)), atol=1e-4)


@pytest.mark.parametrize(("model_type", "extra", "match"), [
    # Mamba layers only: held with config= where transformers' cache holds recurrent state (tests/test_hf_state.py)
    ("falcon_mamba", {}, r"convolution or recurrent state.*(config=model\.config|DynamicCache)"),
    ("deepseek_v4", GQA, r"layer\.store_compression_weights.*DynamicCache"),  # compressed attention's own state
])
def test_a_model_keeping_other_state_in_its_cache_is_refused_without_a_config(tmp_path, model_type, extra, match):
    """Built without config=, the cache learns of such a model only when the model asks for that state: the
    request is refused with the fix (it was an IndexError or AttributeError inside transformers); with config=
    the cache refuses a model whose state it cannot hold when it is built."""
    try:
        config = transformers.AutoConfig.for_model(model_type, **SMALL, **extra)
    except (KeyError, ValueError):
        pytest.skip(f"this transformers release has no {model_type}")
    model = instantiate(transformers.AutoModelForCausalLM.from_config, config)
    if not {"cache", "past_key_values"} & set(inspect.signature(model.forward).parameters):
        pytest.skip("this release passes the model's state as cache_params, its own class: no Cache goes in")
    ids, _ = prompt(1, 12, seed=4)
    with TieredCache(gpu_gb="1MB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4) as cache, \
            pytest.raises(InvalidConfigError, match=match):  # fmt: skip
        model.generate(ids, max_new_tokens=2, do_sample=False, past_key_values=cache)
    if model_type == "deepseek_v4" or not HOLDS_STATE:
        with pytest.raises(InvalidConfigError, match="DynamicCache"):
            TieredCache(gpu_gb="1MB", block_tokens=4, config=config)
    assert not hasattr(TieredLayer(TieredCache(block_tokens=4), 0), "store_compression_weights")


MLA = dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8, kv_lora_rank=32, q_lora_rank=32,
           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
MLA_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32,
               n_group=1, topk_group=1)


@pytest.mark.parametrize(("family", "extra"), [("DeepseekV3", MLA_MOE), ("DeepseekV2", MLA_MOE), ("MiniCPM3", {}),
                                               ("SarvamMLA", MLA_MOE)])
def test_latent_attention_decodes_exactly_with_keys_and_values_of_two_widths(tmp_path, family, extra):
    """Multi-head latent attention caches keys of 32 dims and values of 8 (transformers' latent and rotary key; in
    releases that cache them expanded, 24 and 16): stored at the wider, exact from the device and disk tiers at
    ``min_device_bytes``, continued after save and load; streaming, split and sparse refused, nothing stored.
    Sarvam-MLA runs DeepSeek-V3's modeling code under its own model type."""
    code = "DeepseekV3" if family == "SarvamMLA" else family
    model = build(f"{family}Config", f"{code}ForCausalLM", **MLA, **extra)
    ids, mask = prompt(2, 30, seed=2, left_pad=(0, 5))
    reference_cache = DynamicCache(config=model.config)
    reference = run(model, ids, mask, reference_cache)
    gpu = TieredCache.min_device_bytes(model.config, 30 + NEW, 2, block_tokens=4)
    with TieredCache(gpu_gb=f"{gpu}B", cpu_gb="8KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache:
        out = run(model, ids, mask, cache)
        assert cache.stats()["blocks"]["disk"] > 0
        assert cache.layers[1].keys.shape == reference_cache.layers[1].keys.shape
        assert torch.equal(cache.layers[1].values, reference_cache.layers[1].values)
        cache.save(tmp_path / "conversation.tkv", model=model)
        for executor in ("streaming", "split", "sparse"):
            with TieredCache(gpu_gb="1MB", block_tokens=4, config=model.config) as other:
                with pytest.raises(InvalidConfigError, match="keys of .* values of .* dims.*exact gather"), \
                        engage(other, model, executor):  # fmt: skip
                    run(model, ids, mask, other)
                assert other.get_seq_length() == 0
    assert_same_generation(out, reference, atol=1e-4)
    mask = torch.cat([mask, mask.new_ones(2, NEW)], dim=1)
    with TieredCache.load(tmp_path / "conversation.tkv", model=model, gpu_gb=f"{gpu}B", cpu_gb="8KB",
                          disk_dir=tmp_path / "loaded") as loaded:  # fmt: skip
        assert torch.equal(loaded.layers[1].values, reference_cache.layers[1].values)  # at its own head dim
        continued = run(model, out.sequences, mask, loaded)
    assert_same_generation(continued, run(model, out.sequences, mask, reference_cache), atol=1e-4)


def test_an_encoder_decoder_model_decodes_exactly_with_the_cache_as_its_self_attention(tmp_path):
    """T5: wrapped in an EncoderDecoderCache (cross-attention K/V in a DynamicCache) the decoder's self-attention
    KV lives on the tiers; given the cache alone, the model's second update of a layer is refused with that fix."""
    config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                   decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=None)  # fmt: skip
    model = instantiate(transformers.T5ForConditionalGeneration, config)
    ids, _ = prompt(2, 30, seed=8)
    reference = model.generate(ids, max_new_tokens=36, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)  # fmt: skip
    gpu = TieredCache.min_device_bytes(config, 40, 2, block_tokens=4) + 4096
    with TieredCache(gpu_gb=f"{gpu}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4) as cache:
        wrapped = transformers.EncoderDecoderCache(cache, DynamicCache())
        out = model.generate(ids, max_new_tokens=36, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, past_key_values=wrapped)  # fmt: skip
        assert cache.stats()["blocks"]["disk"] > 0
    assert_same_generation(out, reference, atol=1e-5)
    with TieredCache(gpu_gb="1MB", cpu_gb="16KB", disk_dir=tmp_path / "alone", block_tokens=4,
                     config=config) as cache:  # fmt: skip
        for _ in range(2):  # not mistaken for an interrupted step that a second call would resume
            with pytest.raises(InvalidConfigError, match=r"updated twice in one forward.*cache\.encoder_decoder\(\)"):
                model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=cache)
            assert cache.get_seq_length() == 0


def _bart(seed: int) -> transformers.PreTrainedModel:
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=None,
                                     decoder_start_token_id=BOS, forced_bos_token_id=None, forced_eos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.BartForConditionalGeneration(config).float().eval()
    settings = model.generation_config
    settings.eos_token_id = settings.forced_bos_token_id = settings.forced_eos_token_id = None
    settings.pad_token_id = PAD
    return model


@pytest.mark.parametrize("mode", ["assisted", "prompt lookup", "beams"])
def test_an_encoder_decoder_cache_takes_the_crops_of_assisted_decoding(tmp_path, mode):
    """Regression: assisted decoding (and prompt lookup) crops the cache after each rejected draft;
    transformers' EncoderDecoderCache allows that only on DynamicCache halves and raised a raw TypeError for a
    TieredCache. ``cache.encoder_decoder()`` takes them: BART decodes as with two DynamicCaches, the
    self-attention K/V on every tier."""
    from transformers import EncoderDecoderCache

    model = _bart(99)
    source, _ = prompt(1, 20, seed=3)
    options = {"assisted": dict(assistant_model=_bart(7)), "prompt lookup": dict(prompt_lookup_num_tokens=3),
               "beams": dict(num_beams=2)}[mode]
    try:
        two = EncoderDecoderCache(DynamicCache(), DynamicCache())
        reference = model.generate(source, **{cache_keyword(model): two}, max_new_tokens=30, do_sample=False,
                                   **options)
    except TypeError as exc:  # 5.0's prompt lookup on BART: isin(..., None) in its candidate generator
        pytest.skip(f"this transformers release fails {mode} with two DynamicCaches: {str(exc)[:60]}")
    gpu = TieredCache.min_device_bytes(model.config, 40, 2 if mode == "beams" else 1, block_tokens=4)
    with TieredCache(gpu_gb=f"{gpu}B", cpu_gb="4KB", disk_dir=tmp_path, block_tokens=4) as cache:
        out = model.generate(source, **{cache_keyword(model): cache.encoder_decoder()}, max_new_tokens=30,
                             do_sample=False, **options)
        assert cache.stats()["blocks"]["disk"] > 0
    assert torch.equal(out, reference)


@pytest.mark.parametrize("executor", ["streaming", "split"])
def test_a_position_bias_the_executors_cannot_apply_is_refused_and_nothing_is_lost(tmp_path, executor):
    """Regression: T5 hands its relative position bias to the attention function (``position_bias=``, sized to the
    keys the model sees: the step's alone under streaming), which the executors dropped: logits 0.76 off with no
    error. Any tensor keyword they cannot apply refuses the step with the fix; the cache holds what it held."""
    config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                   decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=None)  # fmt: skip
    model = instantiate(transformers.T5ForConditionalGeneration, config)
    ids, _ = prompt(1, 12, seed=8)
    # Refused on entering where this release attends T5 with its own code (5.0) or its attention modules keep an
    # implementation of their own (5.17: the stacks' configs are copies); else at the step that passes the bias.
    refused = "passes `position_bias`.*exact gather|attends with its own code"
    with TieredCache(gpu_gb="8MB", cpu_gb="1MB", disk_dir=tmp_path, block_tokens=4) as cache:
        with pytest.raises(InvalidConfigError, match=refused), engage(cache, model, executor):
            model.generate(ids, max_new_tokens=4, do_sample=False,
                           past_key_values=transformers.EncoderDecoderCache(cache, DynamicCache()))  # fmt: skip
        assert cache.get_seq_length() == 0


def whisper() -> tuple[transformers.PreTrainedModel, dict]:
    config = transformers.WhisperConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                        decoder_ffn_dim=128, num_mel_bins=8, max_source_positions=16,
                                        max_target_positions=64, pad_token_id=PAD, bos_token_id=BOS,
                                        eos_token_id=None, decoder_start_token_id=BOS, suppress_tokens=None,
                                        begin_suppress_tokens=None)  # fmt: skip
    model = instantiate(transformers.WhisperForConditionalGeneration, config)
    model.generation_config.forced_decoder_ids = None
    return model, {"input_features": torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))}


def llava() -> tuple[transformers.PreTrainedModel, dict]:
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=16, patch_size=8, projection_dim=32)
    text = transformers.LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=VOCAB - 1,
                                      image_seq_length=5, vision_feature_select_strategy="full",
                                      vision_feature_layer=-1)  # fmt: skip
    model = instantiate(transformers.LlavaForConditionalGeneration, config)
    ids = torch.cat([torch.tensor([[BOS] + [VOCAB - 1] * 5]), prompt(1, 10, seed=3)[0]], 1)
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    return model, {"input_ids": ids, "pixel_values": pixels}


def mllama() -> tuple[transformers.PreTrainedModel, dict]:
    """A tiny Mllama: its text layer 1 is a cross-attention layer over the image."""
    from transformers.models.mllama import configuration_mllama as mllama_configs

    vision = mllama_configs.MllamaVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_global_layers=1, attention_heads=2, image_size=16, patch_size=8,
                                               max_num_tiles=1, vision_output_dim=64, intermediate_layers_indices=[0],
                                               supported_aspect_ratios=[[1, 1]])  # fmt: skip
    text = mllama_configs.MllamaTextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                           cross_attention_layers=[1], pad_token_id=PAD, bos_token_id=BOS,
                                           eos_token_id=None, tie_word_embeddings=False)  # fmt: skip
    config = transformers.MllamaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                                       image_token_index=VOCAB - 1)
    model = instantiate(transformers.MllamaForConditionalGeneration, config)
    ids = torch.cat([torch.tensor([[BOS, VOCAB - 1]]), prompt(1, 10, seed=3)[0]], 1)
    return model, {"input_ids": ids, "pixel_values": torch.randn(1, 1, 1, 3, 16, 16,
                                                                 generator=torch.Generator().manual_seed(2)),
                   "aspect_ratio_ids": torch.ones(1, 1, dtype=torch.long),
                   "aspect_ratio_mask": torch.ones(1, 1, 1, dtype=torch.long),
                   "cross_attention_mask": torch.ones(1, ids.shape[1], 1, 1, dtype=torch.long)}


@pytest.mark.parametrize("beams", [1, 2])
@pytest.mark.parametrize("with_config", [True, False], ids=["config", "no-config"])
def test_a_decoder_whose_cross_attention_keeps_an_image_in_the_cache_is_refused(tmp_path, with_config, beams):
    """Regression: Mllama's cross-attention layers cache the image's K/V and read it back on later steps without an
    update; the cache took the steps that skip them for stopped forwards and rolled the other layers back to the
    image's length (greedy: refused as "a Ctrl-C"; beams: other tokens, 0.69 off, without an error). Refused with
    the fix: by the config, else at the first forward, whose layers cache different token counts."""
    model, inputs = mllama()
    config = dict(config=model.config) if with_config else {}
    with pytest.raises(InvalidConfigError, match="DynamicCache"), \
            TieredCache(gpu_gb="64MB", cpu_gb="64MB", disk_dir=tmp_path, block_tokens=4, **config) as cache:
        model.generate(**inputs, past_key_values=cache, max_new_tokens=3, num_beams=beams, do_sample=False)


@pytest.mark.parametrize("executor", ["streaming", "split"])
@pytest.mark.parametrize("family", ["whisper", "llava"])
def test_attention_without_a_layer_index_keeps_its_own_implementation(tmp_path, family, executor):
    """Regression: a Whisper encoder's or a Llava vision tower's attention modules have no ``layer_idx``, so the
    engagement recorded no implementation for them and their forward raised "runs only inside `with
    cache.streaming(model):`" inside that very block. They attend as before; the decoder's K/V through the tiers."""
    model, inputs = {"whisper": whisper, "llava": llava}[family]()
    encoder_decoder = family == "whisper"

    def generate(cache):
        cache = transformers.EncoderDecoderCache(cache, DynamicCache()) if encoder_decoder else cache
        return model.generate(**inputs, max_new_tokens=20, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, past_key_values=cache)  # fmt: skip

    reference = generate(DynamicCache(config=None if encoder_decoder else model.config))
    text = model.config.get_text_config(decoder=True)
    gpu = {"split": TieredCache.min_split_device_bytes, "streaming": TieredCache.min_streaming_device_bytes}[executor]
    with TieredCache(gpu_gb=f"{gpu(text, 1, block_tokens=4, chunk_tokens=8) + 4096}B", cpu_gb="1KB",
                     disk_dir=tmp_path, block_tokens=4, config=None if encoder_decoder else model.config) as cache:
        with engage(cache, model, executor):
            out = generate(cache)
        assert cache.stats()["blocks"]["disk"] > 0
    assert_same_generation(out, reference, atol=1e-4)


@pytest.mark.parametrize("left_by", ["closed", "rolled back"])
def test_a_hand_over_no_attention_took_is_not_taken_for_the_next_forward(tmp_path, left_by):
    """Regression: a step handed over that no attention took (direct ``cache.update`` calls; a model attending with
    its own code, refused at its next step) stayed on the thread after its cache was closed or the step given
    back, and the next forward's first attention — a Whisper encoder's, which builds no mask — was refused as
    changing that cache's K/V (raising "garbage-collected", or rolling the other cache back)."""
    model, inputs = whisper()
    kv = torch.randn(1, 4, 3, 16)
    left = TieredCache(gpu_gb="1MB", cpu_gb="1KB", disk_dir=tmp_path / "left", block_tokens=4)
    with left.streaming(model, chunk_tokens=8):
        left.update(kv, kv, 0)  # handed over; no attention takes it
        if left_by == "rolled back":
            with pytest.raises(InvalidConfigError, match="multi-head latent attention"):
                left.update(kv, kv[..., :8], 1)  # values narrower than keys: refused under streaming
            assert left.get_seq_length() == 0
    if left_by == "closed":
        left.close()
    reference = model.generate(**inputs, max_new_tokens=6, do_sample=False, output_logits=True,
                               return_dict_in_generate=True,
                               past_key_values=transformers.EncoderDecoderCache(DynamicCache(), DynamicCache()))
    with TieredCache(gpu_gb="1MB", cpu_gb="1KB", disk_dir=tmp_path, block_tokens=4) as cache, \
            cache.streaming(model, chunk_tokens=8):  # fmt: skip
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True,
                             past_key_values=transformers.EncoderDecoderCache(cache, DynamicCache()))
    assert_same_generation(out, reference, atol=1e-4)
    if left_by == "rolled back":
        assert left.get_seq_length() == 0
        left.close()


# Six layers, the last three reusing the K/V of layer 0 (full) and layer 2 (sliding): the two layers whose K/V is kept
# are not neighbours, so a third staging buffer is needed while layer 1 attends.
KINDS = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention", "full_attention",
         "full_attention"]  # fmt: skip
SHARED_KV = {"gemma3n_text": dict(num_hidden_layers=6, layer_types=KINDS, num_kv_shared_layers=3,
                                  activation_sparsity_pattern=[0.0] * 6, intermediate_size=[128] * 6),
             "gemma4_text": dict(num_hidden_layers=6, layer_types=KINDS, num_kv_shared_layers=3)}  # fmt: skip


@pytest.mark.parametrize("with_config", [True, False], ids=["config", "no-config"])
@pytest.mark.parametrize("model_type", list(SHARED_KV))
def test_layers_that_reuse_earlier_layers_kv_decode_exactly(tmp_path, model_type, with_config):
    """Every layer is prefetched (``prefetch_min`` 0), so a buffer the model still reads would be overwritten."""
    model = architecture(model_type, **SHARED_KV[model_type])
    assert kv_producers(model.config) == [0, 2]
    ids, mask = prompt(2, 40, seed=3, left_pad=(0, 5))
    reference = run(model, ids, mask, DynamicCache(config=model.config))
    gpu = TieredCache.min_device_bytes(model.config, 48, 2, block_tokens=4, prefetch_depth=0)  # blocks move down
    with settings.override(prefetch_min=0), \
            TieredCache(gpu_gb=f"{gpu}B", cpu_gb="64KB", disk_dir=tmp_path, block_tokens=4,
                        config=model.config if with_config else None) as cache:  # fmt: skip
        out = run(model, ids, mask, cache)
        blocks = cache.stats()["blocks"]
        assert blocks["host"] > 0 and blocks["disk"] > 0
        assert cache.get_seq_length() == 40 + NEW - 1
    assert_same_generation(out, reference, atol=1e-4)


@pytest.mark.parametrize("executor", ["split", "sparse", "streaming"])
def test_executors_that_hand_over_only_the_step_refuse_layers_that_reuse_kv(tmp_path, executor, monkeypatch):
    model = architecture("gemma3n_text", **SHARED_KV["gemma3n_text"])
    before = model.config._attn_implementation
    with TieredCache(gpu_gb="1MB", cpu_gb="64KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache:
        engagement = engage(cache, model, executor)
        with pytest.raises(InvalidConfigError, match=f"K/V of earlier layers.*leave out the `with "
                                                     f"cache.{executor}"):  # fmt: skip
            engagement.__enter__()
        assert model.config._attn_implementation == before and not cache.runtime.modes
        monkeypatch.setattr("tierkv.hf.modes.choose_executor", lambda *args: "split")  # as a fast host kernel would
        ids, mask = prompt(1, 30, seed=2)
        with cache.exact(model):
            out = run(model, ids, mask, cache)
        assert cache.chosen == "gather"
    assert_same_generation(out, run(model, ids, mask, DynamicCache(config=model.config)), atol=1e-4)


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma3n_text"])
def test_sizes_count_each_layers_own_heads_and_only_the_layers_that_hold_kv(model_type, monkeypatch):
    """Gemma 4's full-attention layers hold 32-dim heads, its sliding ones 16; Gemma 3n's last three layers hold
    nothing. The device minimum counts a staging buffer for each of the two layers whose K/V is kept."""
    model = architecture(model_type, **SHARED_KV[model_type])
    ids, _ = prompt(1, 6, seed=1)  # under the window of 8: every layer holds every token
    reference = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=reference)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in reference.layers
               if getattr(layer, "keys", None) is not None)  # fmt: skip
    assert kv_bytes_held(model.config, 6) == held
    minimum = TieredCache.min_device_bytes(model.config, 512, prefetch_depth=1)
    monkeypatch.setattr("tierkv.hf.sizing.kv_producers", lambda config: [])
    assert minimum == TieredCache.min_device_bytes(model.config, 512, prefetch_depth=3)


@pytest.mark.parametrize(("model_type", "extra"), [
    ("cpmant", dict(num_attention_heads=4, dim_head=32)),  # its head dim is dim_head, not hidden_size / heads
    ("qwen3_next", dict(GQA, num_hidden_layers=4, num_experts=2, num_experts_per_tok=1,
                        moe_intermediate_size=32)),  # K/V in one layer of four
])
def test_kv_bytes_held_is_what_dynamic_cache_holds(model_type, extra):
    """The sizes a budget is chosen from count the K/V the model really caches: its own head dim, and only the
    layers that hold K/V."""
    try:
        config = transformers.AutoConfig.for_model(model_type, **{**SMALL, **extra})
    except (KeyError, ValueError):
        pytest.skip(f"this transformers release has no {model_type}")
    if model_type == "qwen3_next" and not HOLDS_STATE:
        pytest.skip("this transformers' cache holds no recurrent state")
    model = instantiate(transformers.AutoModelForCausalLM.from_config, config)
    ids, _ = prompt(1, 6, seed=1)
    reference = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=reference)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in reference.layers
               if getattr(layer, "keys", None) is not None)  # fmt: skip
    assert held and kv_bytes_held(model.config, reference.get_seq_length()) == held  # (CPM-Ant adds 32 tokens)


def _recurrent_gemma() -> transformers.PreTrainedModel:
    """A tiny RecurrentGemma: recurrent blocks (state in the model's own modules, though its config lists them as
    linear-attention layers) between sliding-window attention layers."""
    try:
        config = transformers.AutoConfig.for_model(
            "recurrent_gemma", **{**SMALL, "num_hidden_layers": 4}, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, block_types=["recurrent", "attention"], attention_window_size=24, lru_width=64)
    except (KeyError, ValueError):
        pytest.skip("this transformers release has no recurrent_gemma")
    if not HOLDS_STATE:
        pytest.skip("this transformers' cache holds no recurrent state: its config's layer kinds are not known")
    return instantiate(transformers.AutoModelForCausalLM.from_config, config)


@pytest.mark.parametrize("mode", ["gather", "streaming", "split", "sparse"])
def test_a_model_that_keeps_its_recurrent_state_itself_decodes_exactly(tmp_path, mode):
    """RecurrentGemma never uses the cache layers its config makes recurrent: the cache learns so at the first
    forward (a K/V update with an earlier state layer untouched) and counts only its attention layers' updates —
    where a forward was taken for one that stopped half-way (the refusal said to call generate again, which could
    not help). Exact against DynamicCache; a conversation file, which could not hold the model's own state, is
    refused."""
    model = _recurrent_gemma()
    ids, _ = prompt(1, 40, seed=4)
    options = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    reference = model.generate(ids, past_key_values=DynamicCache(config=model.config), **options)
    config, context = model.config, ids.shape[1] + NEW
    least = {"gather": TieredCache.min_device_bytes(config, context, block_tokens=4),
             "streaming": TieredCache.min_streaming_device_bytes(config, block_tokens=4, chunk_tokens=8),
             "split": TieredCache.min_split_device_bytes(config, block_tokens=4, chunk_tokens=8),
             "sparse": TieredCache.min_sparse_device_bytes(config, context, 1.0, block_tokens=4, chunk_tokens=8)}
    with TieredCache(gpu_gb=f"{least[mode] + 2048}B", cpu_gb=0, disk_dir=tmp_path, block_tokens=4,
                     config=config) as cache:
        modes = {"gather": contextlib.nullcontext, "streaming": lambda: cache.streaming(model, chunk_tokens=8),
                 "split": lambda: cache.split(model, chunk_tokens=8),
                 "sparse": lambda: cache.sparse(model, tokens=1.0, chunk_tokens=8)}
        with modes[mode]():
            out = model.generate(ids, past_key_values=cache, **options)
        assert cache.stats()["blocks"]["disk"] > 0
        assert cache.get_seq_length() == ids.shape[1] + NEW - 1
        with pytest.raises(InvalidConfigError, match="keeps its recurrent layers' state in its own modules"):
            cache.save(tmp_path / "chat.tkv", model=model)
    assert_same_generation(out, reference, atol=1e-4)


@pytest.mark.parametrize("mode", ["streaming", "split", "sparse"])
def test_a_recurrent_model_carries_its_padding_queries_outputs_as_with_dynamic_cache(tmp_path, mode):
    """RecurrentGemma's recurrence runs over a left-padded row's padding too, so what attention gives a fully
    masked query reaches the row's real tokens: each executor gives it what the model's own attention does."""
    model = _recurrent_gemma()
    ids, mask = prompt(2, 40, seed=6, left_pad=(0, 9))
    options = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    reference = model.generate(ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config), **options)
    with TieredCache(gpu_gb=budget(model, mode), cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4,
                     config=model.config) as cache:  # fmt: skip
        with engage(cache, model, mode):
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, **options)
        assert cache.stats()["blocks"]["disk"] > 0
    assert_same_generation(out, reference, atol=1e-4)


def test_a_model_that_skips_cache_layers_without_config_is_told_to_pass_it(tmp_path):
    model = _recurrent_gemma()
    ids, _ = prompt(1, 20, seed=4)
    with TieredCache(gpu_gb="1MB", cpu_gb="8KB", disk_dir=tmp_path, block_tokens=4) as cache, \
            pytest.raises(InvalidConfigError, match=r"never updated the cache's layer 0 .*config=model\.config"):
        model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
