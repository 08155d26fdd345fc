"""What ``crop`` and ``reset`` do to the recurrent state of hybrid models (state kept on the device beside K/V).

A layer's state can be taken back only to the copy made where the last forward began: a crop to anywhere else, or
after a row selection changed the state's rows, is refused before any layer changes, and ``crop(0)`` changes
nothing.
``reset`` empties the state of a layer that keeps K/V and state side by side (Falcon-H1), so an unrelated prompt
decodes as in a fresh ``DynamicCache``.
"""

from __future__ import annotations

import pytest
import torch
from models import prompt
from test_hf_state import hybrid, tiered
from transformers import DynamicCache

from tierkv.errors import InvalidConfigError
from tierkv.hf import sizing

pytestmark = pytest.mark.skipif(not sizing.HOLDS_STATE, reason="this transformers' cache holds no recurrent state")


SMALL_MAMBA = dict(mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=16)


@pytest.fixture(scope="module")
def qwen3_next():
    return hybrid("qwen3_next")


def lengths(cache) -> set[int]:
    return {layer.furthest() for layer in cache.holding}


def test_crop_zero_changes_nothing(tmp_path, qwen3_next):
    """``crop(0)`` after a prompt and a step takes nothing back and refuses nothing: the next step's logits are
    those without it."""
    model = qwen3_next
    ids, mask = prompt(1, 8, seed=43)
    token = torch.tensor([[5]])
    with torch.no_grad():
        reference = DynamicCache(config=model.config)
        model(ids, attention_mask=mask, past_key_values=reference, use_cache=True)
        model(token, past_key_values=reference, use_cache=True)
        expected = model(token, past_key_values=reference, use_cache=True).logits
        with tiered(model, tmp_path) as cache:
            model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            model(token, past_key_values=cache, use_cache=True)
            cache.crop(0)
            assert lengths(cache) == {ids.shape[1] + 1}
            got = model(token, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_crop_into_the_middle_of_the_last_forward_is_refused(tmp_path, qwen3_next):
    """After a three-token forward the state is known only before all three: crop(-1) would need the state after
    two, which no layer kept, so it is refused before any layer (K/V or state) changes."""
    model = qwen3_next
    ids, mask = prompt(1, 8, seed=47)
    with torch.no_grad(), tiered(model, tmp_path) as cache:
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        model(torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)
        with pytest.raises(InvalidConfigError, match="activate_past_recording"):
            cache.crop(-1)
        assert lengths(cache) == {ids.shape[1] + 3}


def test_a_crop_after_a_row_selection_is_refused(tmp_path, qwen3_next):
    """The copy a forward made holds the rows the state had then: after ``batch_select_indices`` it no longer
    matches the K/V's rows, so taking the step back is refused rather than giving the state other rows."""
    model = qwen3_next
    ids, mask = prompt(2, 8, seed=53)
    with torch.no_grad(), tiered(model, tmp_path) as cache:
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        model(torch.tensor([[5], [6]]), attention_mask=torch.ones(2, 9, dtype=mask.dtype), past_key_values=cache,
              use_cache=True)
        cache.batch_select_indices(torch.tensor([1]))
        with pytest.raises(InvalidConfigError, match="recurrent state"):
            cache.crop(-1)
        assert lengths(cache) == {ids.shape[1] + 1}


def test_reset_empties_the_state_of_a_layer_with_kv_and_state(tmp_path):
    """Falcon-H1 runs attention and Mamba in every layer: after ``reset`` an unrelated prompt's logits equal a
    fresh DynamicCache's, so no state of the first prompt is left in the Mamba part."""
    model = hybrid("falcon_h1", num_hidden_layers=2, **SMALL_MAMBA)
    first, first_mask = prompt(1, 8, seed=59)
    other, other_mask = prompt(1, 6, seed=61)
    with torch.no_grad():
        expected = model(other, attention_mask=other_mask, past_key_values=DynamicCache(config=model.config),
                         use_cache=True).logits
        with tiered(model, tmp_path) as cache:
            model(first, attention_mask=first_mask, past_key_values=cache, use_cache=True)
            cache.reset()
            assert lengths(cache) == {0}
            got = model(other, attention_mask=other_mask, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
