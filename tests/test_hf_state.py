"""Models whose layers keep recurrent state (Mamba, gated delta nets, short convolutions) beside or instead of K/V.

- Every hybrid family of the installed transformers tried here (Qwen3-Next / Qwen3.5, OLMo hybrid, Bamba, Jamba,
  Granite 4 hybrid, Nemotron-H with MoE / MLP layers that keep nothing (and without its Mamba layers), LFM-style
  convolution layers, Falcon-H1 and Zamba with attention and Mamba in one layer, a sliding-window hybrid, pure
  Mamba) decodes exactly as ``DynamicCache(config=...)``, K/V on every tier; the attention executors too.
- A forward that fails part-way (in an attention layer after the state layers ran, or a Ctrl-C in the model's own
  code) leaves every layer's state as it was: the retry decodes exactly. ``crop`` takes back the last step, and
  prompt lookup's crops go through transformers' record of past states.
- Beams and batch edits move the state's rows with the K/V's; a saved conversation keeps every layer's state and
  continues exactly, and a crafted one cannot give a layer a wrong or missing state; what cannot be kept for such
  a model (a prefix store) is refused with the fix, and without ``config=`` the model's first request for state
  names it.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import torch
import transformers
from helpers import assert_same_generation, conversation_records, held_before, saves_while_generating
from models import prompt
from test_hf_architectures import SMALL, engage, instantiate
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.errors import IntegrityError, InterruptedStepError, InvalidConfigError, UnsupportedLayerError
from tierkv.hf import sizing
from tierkv.persist import record
from tierkv.store import KVStore

pytestmark = pytest.mark.skipif(not sizing.HOLDS_STATE, reason="this transformers' cache holds no recurrent state")

NEW = 6
GQA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
ALTERNATE = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
# the recurrent layers' own dims, small: their defaults (128 Mamba heads of a 256-wide state, 16 x 128 linear-attention
# heads, 128 experts) run transformers' reference kernels 10-30x longer and test nothing more
MAMBA = dict(mamba_n_heads=8, mamba_d_state=16, mamba_chunk_size=16)
LINEAR = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              shared_expert_intermediate_size=32)
FAMILIES: dict[str, dict] = {  # model_type -> config arguments beside SMALL's and GQA's (four layers)
    "qwen3_next": dict(LINEAR, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32),
    "qwen3_5_text": LINEAR,
    "olmo_hybrid": {},
    "bamba": dict(MAMBA, attn_layer_indices=[1, 3]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, num_experts=2),
    "granitemoehybrid": dict(MAMBA, layer_types=ALTERNATE, num_local_experts=2),
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], n_routed_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, mamba_num_heads=4, mamba_head_dim=16,
                       n_groups=1, ssm_state_size=16),
    "lfm3": {},  # convolution layers
    "lara_mini": dict(LINEAR, layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                           "full_attention"], sliding_window=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32),
    "falcon_h1": dict(MAMBA, mamba_d_ssm=128, mamba_d_head=16),  # attention and Mamba side by side in every layer
    "zamba": dict(attn_layer_period=2, attn_layer_offset=1, layers_block_type=None),
    "falcon_mamba": {},  # Mamba only: no K/V at all
    "nemotron_h, no Mamba": dict(layers_block_type=["full_attention", "mlp", "full_attention", "moe"],
                                 n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
}


def hybrid(family: str, **overrides) -> transformers.PreTrainedModel:
    """A four-layer model of ``family`` (a model type, or one and a variant after a comma)."""
    model_type = family.split(",")[0]
    try:
        config = transformers.AutoConfig.for_model(model_type, **{**SMALL, "num_hidden_layers": 4, **GQA,
                                                                  **FAMILIES[family], **overrides})
    except (KeyError, ValueError):
        pytest.skip(f"this transformers release has no {model_type}")
    return instantiate(transformers.AutoModelForCausalLM.from_config, config)


def run(model, ids, mask, cache, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, past_key_values=cache, **kwargs)


def tiered(model, tmp_path, executor: str = "gather", rows: int = 2) -> TieredCache:
    """K/V on every tier: the device budget at the executor's minimum for 64 tokens of ``rows`` rows."""
    config = model.config
    minimum = {"gather": lambda: TieredCache.min_device_bytes(config, 64, rows, block_tokens=4),
               "split": lambda: TieredCache.min_split_device_bytes(config, rows, block_tokens=4, chunk_tokens=8),
               "sparse": lambda: TieredCache.min_sparse_device_bytes(config, 64, 1.0, rows, block_tokens=4,
                                                                     chunk_tokens=8),
               "streaming": lambda: TieredCache.min_streaming_device_bytes(config, rows, block_tokens=4,
                                                                           chunk_tokens=8)}[executor]()  # fmt: skip
    return TieredCache(gpu_gb=f"{minimum + 16384}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4, config=config)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_models_with_recurrent_state_decode_exactly(tmp_path, model_type):
    model = hybrid(model_type)
    ids, mask = prompt(2, 40, seed=3, left_pad=(0, 5))
    reference = run(model, ids, mask, DynamicCache(config=model.config))
    with tiered(model, tmp_path) as cache:
        out = run(model, ids, mask, cache)
        kinds = {type(layer).__name__ for layer in cache.layers}
        stats = cache.stats()
        assert (stats["state_bytes"] > 0) == cache.stateful
        if kinds - {"StateLayer"}:
            assert stats["blocks"]["host"] + stats["blocks"]["disk"] > 0
        else:  # Mamba only: nothing for the tiers
            assert TieredCache.min_device_bytes(model.config, 1024) == 0 and cache.store is None
    assert kinds & {"StateLayer", "HybridLayer", "DummyLayer"}
    assert_same_generation(out, reference, atol=1e-4)


@pytest.mark.parametrize("executor", ["split", "sparse", "streaming"])
@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1", "lara_mini"])
def test_the_attention_executors_decode_hybrid_models_exactly(tmp_path, model_type, executor):
    model = hybrid(model_type)
    ids, mask = prompt(2, 40, seed=5, left_pad=(0, 3))
    reference = run(model, ids, mask, DynamicCache(config=model.config))
    with tiered(model, tmp_path, executor) as cache, engage(cache, model, executor):
        out = run(model, ids, mask, cache)
    assert_same_generation(out, reference, atol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1"])
def test_beams_and_sampling_rows_move_the_state_with_the_kv(tmp_path, model_type):
    model = hybrid(model_type)
    ids, mask = prompt(2, 24, seed=7, left_pad=(0, 2))
    options = dict(num_beams=3, num_return_sequences=2)
    reference = run(model, ids, mask, DynamicCache(config=model.config), **options)
    with tiered(model, tmp_path, rows=6) as cache:
        out = run(model, ids, mask, cache, **options)
    assert torch.equal(out.sequences, reference.sequences)


@pytest.mark.parametrize("index", [[True, False, True], [0, 2], [-3, -1]])
def test_a_row_mask_or_negative_rows_select_the_same_rows_of_state_and_kv(tmp_path, index):
    model = hybrid("bamba")
    ids, mask = prompt(3, 20, seed=2, left_pad=(0, 2, 4))
    step = torch.randint(3, 100, (2, 1), generator=torch.Generator().manual_seed(1))
    logits = []
    for cache in (DynamicCache(config=model.config), tiered(model, tmp_path, rows=3)):
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
            if isinstance(cache, TieredCache):
                cache.batch_select_indices(torch.tensor(index))
            else:  # transformers' hybrid layers select no rows: the K/V's and the state's rows by hand
                cache = DynamicCache(config=model.config)
                model(ids[[0, 2]], attention_mask=mask[[0, 2]], past_key_values=cache)
            logits.append(model(step, attention_mask=torch.cat([mask[[0, 2]], torch.ones(2, 1, dtype=mask.dtype)],
                                                             dim=1), past_key_values=cache).logits)
        if isinstance(cache, TieredCache):
            cache.close()
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1"])
def test_prompt_lookup_crops_the_state_through_transformers_record_of_it(tmp_path, model_type):
    """Assisted decoding turns on transformers' record of past states and crops the rejected candidates: the
    state layers take it (``record_past``), the K/V layers crop in the tiers; tokens and logits as DynamicCache's."""
    model = hybrid(model_type)
    ids, mask = prompt(1, 30, seed=2)
    ids[0, 20:26] = ids[0, 5:11]  # a repeat for the lookup to find
    reference = run(model, ids, mask, DynamicCache(config=model.config), prompt_lookup_num_tokens=3)
    with tiered(model, tmp_path) as cache:
        out = run(model, ids, mask, cache, prompt_lookup_num_tokens=3)
    assert_same_generation(out, reference, atol=1e-4)


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1", "bamba"])
def test_a_forward_failing_after_the_state_layers_ran_leaves_every_state_as_it_was(tmp_path, model_type,
                                                                                  monkeypatch):
    """The last K/V layer's update fails at the third decode step, after every earlier layer changed its state:
    the cache rolls every layer back at once, so generating on from the tokens it holds decodes exactly."""
    model = hybrid(model_type)
    ids, mask = prompt(1, 30, seed=11)
    reference = run(model, ids, mask, DynamicCache(config=model.config))
    appends = {"n": 0}
    append = KVStore.append

    def failing(store, layer, keys, values, *args, **kwargs):
        if layer == cache.runtime.num_layers - 1 and keys.shape[2] == 1:
            appends["n"] += 1
            if appends["n"] == 3:
                raise Boom("injected")
        return append(store, layer, keys, values, *args, **kwargs)

    with tiered(model, tmp_path) as cache:
        monkeypatch.setattr(KVStore, "append", failing)
        with pytest.raises(Boom):
            run(model, ids, mask, cache)
        monkeypatch.undo()
        held = cache.get_seq_length()
        assert held == ids.shape[1] + 2 and {layer.get_seq_length() for layer in cache.holding} == {held}
        continued = reference.sequences[:, :held + 1]  # the tokens held and the one the failed step took in
        out = run(model, continued, torch.ones_like(continued), cache)
    assert torch.equal(out.sequences[:, : reference.sequences.shape[1]], reference.sequences)
    for got, expected in zip(out.logits, reference.logits[3:], strict=False):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_a_ctrl_c_in_the_models_own_code_between_state_layers_is_rolled_back(tmp_path):
    """A KeyboardInterrupt in the second linear-attention layer's own code (no tierkv code runs there): the next
    forward finds the first layer a step ahead, rolls it back and refuses itself; the one after decodes exactly."""
    model = hybrid("qwen3_next")
    ids, mask = prompt(1, 20, seed=13)
    reference = run(model, ids, mask, DynamicCache(config=model.config))
    mixer = model.model.layers[1].linear_attn
    original = mixer.forward
    with tiered(model, tmp_path) as cache:
        out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        first = out.logits[:, -1].argmax(-1, keepdim=True)
        assert torch.equal(first, reference.sequences[:, ids.shape[1]: ids.shape[1] + 1])

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        mixer.forward = interrupted
        with pytest.raises(KeyboardInterrupt):
            model(first, past_key_values=cache, use_cache=True)
        mixer.forward = original
        with pytest.raises(InterruptedStepError, match="rolled back"):
            model(first, past_key_values=cache, use_cache=True)
        assert {layer.get_seq_length() for layer in cache.holding} == {ids.shape[1]}
        step = model(first, past_key_values=cache, use_cache=True)
    torch.testing.assert_close(step.logits[:, -1], reference.logits[1], atol=1e-4, rtol=0)


def test_a_second_thread_is_refused_while_anothers_forward_is_between_state_layers(tmp_path):
    """A request thread held before the last layer of its first forward (its three linear-attention layers have
    taken the prompt into their state) while a second thread calls the model with the same cache: the second is
    refused at its first use of a layer's state, which it would otherwise have taken for a new forward; the first
    thread's tokens equal DynamicCache's."""
    model = hybrid("qwen3_next")
    ids, mask = prompt(1, 20, seed=29)
    reference = run(model, ids, mask, DynamicCache(config=model.config))
    outputs: list = []
    with tiered(model, tmp_path) as cache, held_before(model.model.layers[-1]) as (between, resume):
        worker = threading.Thread(target=lambda: outputs.append(run(model, ids, mask, cache)))
        worker.start()
        assert between.wait(60)
        with pytest.raises(InvalidConfigError, match="another thread"), torch.no_grad():
            model(ids[:, :5], past_key_values=cache)
        resume.set()
        worker.join(120)
    assert outputs and torch.equal(outputs[0].sequences, reference.sequences)


@pytest.mark.parametrize("held", [0, -1])
def test_a_reset_from_another_thread_between_state_layers_refuses_the_rest_of_that_forward(tmp_path, held):
    """A server resets a hybrid cache while its request thread is held before a layer of a decode step (a
    linear-attention layer, whose state is used in the model's code: the first, after the step took its positions
    and mask from the cache, or the last): the rest of that forward is refused, so it neither reads the emptied
    state nor writes its step into the cache; the next request decodes as DynamicCache."""
    model = hybrid("qwen3_next")
    ids, mask = prompt(1, 20, seed=31)
    errors: list = []

    def request() -> None:
        try:
            run(model, ids, mask, cache)
        except InvalidConfigError as error:
            errors.append(error)

    with tiered(model, tmp_path) as cache:
        with held_before(model.model.layers[held], call=2) as (between, resume):  # the first decode step
            worker = threading.Thread(target=request)
            worker.start()
            assert between.wait(60)
            cache.reset()
            resume.set()
            worker.join(120)
        assert len(errors) == 1 and ("before its first layer" if held == 0 else "in the middle of this thread's "
                                     "forward") in str(errors[0]), errors
        assert not any(layer.furthest() for layer in cache.holding)
        other, other_mask = prompt(1, 12, seed=32)
        reference = run(model, other, other_mask, DynamicCache(config=model.config))
        assert torch.equal(run(model, other, other_mask, cache).sequences, reference.sequences)


@pytest.mark.parametrize(("model_type", "overrides"), [
    ("qwen3_next", {}),
    ("granitemoehybrid", dict(layer_types=["full_attention", "linear_attention"] * 2)),  # K/V layers first
])
def test_crop_takes_back_the_last_step_of_a_model_with_state(tmp_path, model_type, overrides):
    """``crop`` of the last step restores every layer's state (the next step's logits are bit-identical); further
    back is refused before any layer changes."""
    model = hybrid(model_type, **overrides)
    ids, mask = prompt(1, 20, seed=17)
    with tiered(model, tmp_path) as cache:
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        token = torch.tensor([[5]])
        before = model(token, past_key_values=cache, use_cache=True).logits
        cache.crop(-1)
        assert {layer.get_seq_length() for layer in cache.holding} == {ids.shape[1]}
        again = model(token, past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(again, before, atol=0, rtol=0)
        model(token, past_key_values=cache, use_cache=True)
        with pytest.raises(InvalidConfigError, match="activate_past_recording"):
            cache.crop(-3)
        assert {layer.get_seq_length() for layer in cache.holding} == {ids.shape[1] + 2}


def test_what_a_model_with_state_cannot_use_is_refused_with_the_fix(tmp_path):
    """A prefix store holds K/V blocks only: refused for such a model, with the fix; a cache built without
    ``config=`` cannot know the layers' kinds: the model's first request for state names the fix."""
    model = hybrid("qwen3_next")
    with pytest.raises(InvalidConfigError, match="without persist="):
        TieredCache(disk_dir=tmp_path, persist=True, config=model.config)
    ids, _ = prompt(1, 12, seed=4)
    with TieredCache(gpu_gb="1MB", block_tokens=4) as cache, \
            pytest.raises(UnsupportedLayerError, match=r"config=model\.config"):  # fmt: skip
        model.generate(ids, max_new_tokens=2, do_sample=False, past_key_values=cache)


def saved(model, tmp_path, ids, mask) -> tuple[Path, object]:
    """A conversation of ``ids`` and the 6 tokens generated after them, saved; and the generation's output."""
    path = tmp_path / "conversation.tkv"
    with tiered(model, tmp_path) as cache:
        out = run(model, ids, mask, cache)
        cache.save(path, model=model)
    return path, out


def saved_and_continued(model, tmp_path, ids, mask) -> tuple[Path, object, object, torch.Tensor, object]:
    """:func:`saved`'s conversation and generation; DynamicCache's generation of the same ids; the ids that continue
    it (the last token generated, and one more); and DynamicCache's continuation of them."""
    path, first = saved(model, tmp_path, ids, mask)
    reference_cache = DynamicCache(config=model.config)
    reference_first = run(model, ids, mask, reference_cache)
    more = torch.cat([first.sequences, torch.full((ids.shape[0], 1), 7)], dim=1)
    return path, first, reference_first, more, run(model, more, None, reference_cache)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_saved_conversation_continues_exactly_with_every_layers_state(tmp_path, model_type):
    """Saved after a generation and loaded into a new cache, the conversation (K/V and every layer's state)
    continues as DynamicCache continues the same conversation."""
    model = hybrid(model_type)
    ids, mask = prompt(2, 24, seed=19)
    path, first, reference_first, more, reference = saved_and_continued(model, tmp_path, ids, mask)
    assert torch.equal(first.sequences, reference_first.sequences)
    more_mask = None  # (Mamba's first continued step cannot take a mask longer than its input)
    with TieredCache.load(path, model=model, gpu_gb=f"{TieredCache.min_device_bytes(model.config, 64, 2, 4) + 16384}B",
                          cpu_gb="16KB", disk_dir=tmp_path) as loaded:
        assert loaded.get_seq_length() == first.sequences.shape[1] - 1
        out = run(model, more, more_mask, loaded)
    assert_same_generation(out, reference, atol=1e-4)


def test_a_conversation_with_state_loaded_in_inference_mode_continues_outside_it(tmp_path):
    """Regression: the states and K/V a conversation loaded under ``torch.inference_mode()`` were inference
    tensors, so the model's next step outside it (which updates its states in place) failed with torch's raw
    error. They are normal tensors: the conversation continues as DynamicCache continues it."""
    model = hybrid("qwen3_next")
    ids, mask = prompt(2, 24, seed=19)
    path, _, _, more, reference = saved_and_continued(model, tmp_path, ids, mask)
    with torch.inference_mode():
        loaded = TieredCache.load(path, model=model, cpu_gb="16KB", disk_dir=tmp_path / "loaded",
                                  gpu_gb=f"{TieredCache.min_device_bytes(model.config, 64, 2, 4) + 16384}B")
    with loaded:
        out = run(model, more, None, loaded)
    assert_same_generation(out, reference, atol=1e-4)


def _write(path: Path, records: list[tuple[dict, bytes]]) -> None:
    """``records`` as a file, the end record's count and every checksum valid."""
    records = [r for r in records if r[0]["kind"] != "end"]
    records.append(({"kind": "end", "records": len(records)}, b""))
    with open(path, "wb") as f:
        for head, payload in records:
            f.write(b"".join(record.encode(head, payload)))


@pytest.mark.parametrize("attack", ["missing recurrent", "state of an attention layer", "huge claim",
                                    "tokens ahead", "repeated", "unlisted layers", "reshaped", "float16", "float64"])
def test_a_crafted_conversation_cannot_give_a_layer_a_wrong_or_missing_state(tmp_path, attack):
    """A file is untrusted: its state records are checked against the header and the model before they are used,
    a claim beyond the budgets before its payload is read; each crafted file is refused (IntegrityError) and
    nothing of it is kept."""
    model = hybrid("qwen3_next")
    ids, mask = prompt(1, 16, seed=23)
    path, _ = saved(model, tmp_path, ids, mask)
    records = conversation_records(path)
    head = records[0][0]
    states = [i for i, (h, _) in enumerate(records) if h["kind"] == "state"]
    if attack == "missing recurrent":  # layer 0 would decode on from a zero state
        records = [r for i, r in enumerate(records) if not (i in states and r[0]["layer"] == 0
                                                            and r[0]["part"] == "recurrent")]
    elif attack == "state of an attention layer":
        h, p = records[states[0]]
        records[states[0]] = ({**h, "layer": 3}, p)
    elif attack == "huge claim":
        h, p = records[states[0]]
        records[states[0]] = ({**h, "shape": [1, 1 << 20, 1 << 12]}, p)  # 16 GiB of float32 claimed
    elif attack == "tokens ahead":
        records[0] = ({**head, "states": [{**s, "tokens": s["tokens"] + 1} for s in head["states"]]},
                      records[0][1])
    elif attack == "repeated":
        records.insert(states[0] + 1, records[states[0]])
    elif attack == "reshaped":  # the same bytes as another shape: the convolution window read as channels
        h, p = records[states[0]]
        records[states[0]] = ({**h, "shape": [h["shape"][0], *reversed(h["shape"][1:])]}, p)
    elif attack in ("float16", "float64"):  # a state the model never makes, silently cast on use
        h, p = records[states[0]]
        state = torch.frombuffer(bytearray(p), dtype=getattr(torch, h["dtype"])).to(getattr(torch, attack))
        records[states[0]] = ({**h, "dtype": attack}, state.numpy().tobytes())
    else:
        records[0] = ({**head, "states": head["states"][:1]}, records[0][1])
    _write(path, records)
    with pytest.raises(IntegrityError) as refused:
        TieredCache.load(path, model=model, cpu_gb="64MB", disk_dir=tmp_path)
    if attack in ("reshaped", "float16", "float64"):
        assert "the model makes float32 of shape" in str(refused.value)


@pytest.mark.parametrize("family", ["qwen3_next", "llama"])
@pytest.mark.parametrize("after_reset", [False, True], ids=["fresh", "after-reset"])
def test_a_first_forward_stopped_between_layers_is_rolled_back(tmp_path, family, after_reset):
    """Regression: a forward stopped in the model's own code between two layers was caught only where a complete
    forward had shown how many layers one updates; the cache's first (a fresh cache's prefill, the first after
    ``reset()``) left the layers it reached holding the prompt, the others empty, and decoded on 0.65 off. The
    config says how many a forward updates: the next forward rolls back and refuses itself, the one after is exact."""
    model = hybrid(family) if family != "llama" else architecture_llama()
    ids, mask = prompt(1, 20, seed=5)
    with tiered(model, tmp_path, rows=1) as cache:
        if after_reset:
            run(model, ids.flip(1), mask, cache)
            cache.reset()
        _stopped_then_resumed(model, cache, model.model.layers[2], ids, mask, "rolled back to 0 tokens")


def _stopped_then_resumed(model, cache: TieredCache, where: torch.nn.Module, ids, mask, refused: str) -> None:
    """A first forward stopped by an error raised as ``where`` is called: the next is refused (``refused``) with
    every layer back to empty, the one after equals DynamicCache's."""
    reference = run(model, ids, mask, DynamicCache(config=model.config))

    def stop(*_):
        raise RuntimeError("stopped in the model's own code")

    handle = where.register_forward_pre_hook(stop)
    with pytest.raises(RuntimeError, match="stopped in the model"):
        run(model, ids, mask, cache)
    handle.remove()
    with pytest.raises(InterruptedStepError, match=refused):
        run(model, ids, mask, cache)
    assert {layer.get_seq_length() for layer in cache.holding} == {0}
    assert_same_generation(run(model, ids, mask, cache), reference, atol=1e-4)


@pytest.mark.parametrize("executor", ["gather", "streaming", "split"])
def test_a_first_forward_stopped_after_one_layer_is_rolled_back(tmp_path, executor):
    """Regression: a first forward stopped after exactly one layer update (an error in layer 0's MLP) was taken
    for an encoder-decoder model's second update of layer 0 and let through: layer 0 kept the prompt twice, gather
    then failed with a raw size mismatch and streaming / split decoded on 0.19 off. A forward sizes its mask
    before its first update, which an encoder-decoder's cross-attention does not: the next forward rolls layer 0
    back and refuses itself, the one after is exact."""
    model = architecture_llama()
    ids, mask = prompt(1, 20, seed=5)
    with tiered(model, tmp_path, executor, rows=1) as cache, contextlib.nullcontext() if executor == "gather" \
            else getattr(cache, executor)(model, chunk_tokens=8):  # fmt: skip
        _stopped_then_resumed(model, cache, model.model.layers[0].mlp, ids, mask, "after 1 of the 4 layer updates")


def test_generate_after_a_stopped_chunk_resumes(tmp_path):
    """Regression: a forward that stopped part-way after its layers took more tokens than the next generate()
    input brought left layer 0 long enough that generate() passed the model no tokens, refused as "the input brings
    no new tokens" with that wrong length, on every retry (the stopped forward was never rolled back). Now it is
    rolled back and the call refused once (InterruptedStepError); the next call decodes exactly."""
    model = architecture_llama()
    ids, mask = prompt(1, 20, seed=5)
    longer, _ = prompt(1, 60, seed=6)
    turn = torch.cat((ids, longer[:, :5]), dim=1)
    reference = run(model, turn, torch.ones_like(turn), DynamicCache(config=model.config))

    def stop(*_):
        raise KeyboardInterrupt

    with tiered(model, tmp_path, rows=1) as cache:
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
            handle = model.model.layers[2].mlp.register_forward_pre_hook(stop)
            with pytest.raises(KeyboardInterrupt):
                model(input_ids=longer, past_key_values=cache)
            handle.remove()
        with pytest.raises(InterruptedStepError, match="rolled back to 20 tokens"):
            run(model, turn, torch.ones_like(turn), cache)
        assert_same_generation(run(model, turn, torch.ones_like(turn), cache), reference, atol=1e-4)


def architecture_llama() -> transformers.PreTrainedModel:
    return instantiate(transformers.LlamaForCausalLM, transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": 4},
                                                                               **GQA))


def test_state_bytes_count_the_past_states_transformers_records(tmp_path):
    """Regression: prompt lookup turns transformers' record of past recurrent states on (and leaves it on), so the
    state grows a copy per step; ``stats()["state_bytes"]`` left that record out (127 KB reported of 496 KB)."""
    model = hybrid("qwen3_next")
    ids, _ = prompt(1, 30, seed=2)
    ids[0, 20:26] = ids[0, 5:11]  # a repeat for prompt lookup to draft from
    with tiered(model, tmp_path, rows=1) as cache:
        sequence = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=cache,
                                  prompt_lookup_num_tokens=3)  # fmt: skip
        model.generate(sequence, max_new_tokens=8, do_sample=False, past_key_values=cache)
        held = 0
        for layer in cache.holding:
            if hasattr(layer, "recurrent_states"):
                states = [*layer.conv_states.values(), *layer.recurrent_states.values(),
                          *(t for past in layer.recurrent_states_history.values() for t in past)]
                if layer.saved is not None:
                    states += [*layer.saved.conv.values(), *layer.saved.recurrent.values()]
                held += sum(t.nbytes for t in states if t is not None)
        assert any(layer.recurrent_states_history.get(0) for layer in cache.holding
                   if hasattr(layer, "recurrent_states_history"))
        assert cache.stats()["state_bytes"] == held


def test_a_conversation_of_layers_with_convolution_state_only_loads(tmp_path):
    """Regression: Inkling 2's hybrid layers keep convolution states and no recurrent one; the loader assumed every
    hybrid layer has both and refused tierkv's own file as damaged. It expects what the model makes."""
    try:
        config = transformers.AutoConfig.for_model(
            "inkling2_text", **{**SMALL, "num_hidden_layers": 4, **GQA}, unpadded_vocab_size=SMALL["vocab_size"],
            layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"], sliding_window_size=8,
            swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, n_layers_per_attn_res_block=2, rel_extent=16, d_rel=4)
    except (KeyError, ValueError):
        pytest.skip("this transformers release has no inkling2_text")
    model = instantiate(transformers.AutoModelForCausalLM.from_config, config)
    ids, mask = prompt(1, 24, seed=2)
    path, _, _, more, reference = saved_and_continued(model, tmp_path, ids, mask)
    with TieredCache.load(path, model=model, gpu_gb="8MB", cpu_gb="16KB", disk_dir=tmp_path / "loaded") as loaded:
        out = run(model, more, None, loaded)
    assert_same_generation(out, reference, atol=1e-4)


def test_a_hybrid_layer_answers_its_mask_sizes_by_its_kv(tmp_path):
    """Regression: Inkling's attention runs its K/V convolutions (state) before it asks the cache for its mask
    sizes and query offset, then updates the K/V; a hybrid layer answered by the part further on (the state, a
    step ahead) and the prefill failed in sdpa. It answers by its K/V, as transformers' hybrid layers do."""
    try:
        config = transformers.AutoConfig.for_model(
            "inkling_text", **{**SMALL, "num_hidden_layers": 4, **GQA}, unpadded_vocab_size=SMALL["vocab_size"],
            layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"], sliding_window_size=8,
            swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, rel_extent=16, d_rel=4,
            mlp_layer_types=["dense"] * 4)
    except (KeyError, ValueError):
        pytest.skip("this transformers release has no inkling_text")
    model = instantiate(transformers.AutoModelForCausalLM.from_config, config)
    ids, mask = prompt(1, 20, seed=3)
    reference = run(model, ids, mask, DynamicCache(config=model.config))
    with tiered(model, tmp_path, rows=1) as cache:
        assert_same_generation(run(model, ids, mask, cache), reference, atol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1"])
def test_saves_from_another_thread_take_a_hybrid_cache_between_two_forwards(tmp_path, model_type):
    """A hybrid model's forward begins at its first use of any layer's state, not at layer 0's K/V: saves from
    another thread while a worker generates still wait for the forward in progress and hold off the next, so each
    file holds K/V and state of one step (it continues as DynamicCache does) and the worker decodes exactly."""
    model = hybrid(model_type)
    ids, mask = prompt(1, 20, seed=23)
    steps = 16
    reference_cache = DynamicCache(config=model.config)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                               past_key_values=reference_cache)
    with tiered(model, tmp_path / "busy", rows=1) as cache:
        result, paths = saves_while_generating(cache, model, lambda: model.generate(
            ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, past_key_values=cache), tmp_path, 6)
    assert result and torch.equal(result[0], reference)
    assert paths
    budget = f"{TieredCache.min_device_bytes(model.config, 64, 1, 4) + 16384}B"
    with TieredCache.load(paths[-1], model=model, gpu_gb=budget, cpu_gb="16KB", disk_dir=tmp_path / "load") as loaded:
        held = loaded.get_seq_length()
        more = min(3, reference.shape[1] - held - 1)
        if more:
            out = model.generate(reference[:, : held + 1], max_new_tokens=more, do_sample=False,
                                 past_key_values=loaded)
            assert torch.equal(out, reference[:, : held + 1 + more]), held
