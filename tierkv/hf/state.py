"""Layers that keep recurrent state (Mamba, gated delta nets, short convolutions) instead of, or beside, K/V.

Such state is constant in the context (a layer's convolution window and its recurrent matrix), so it is not
tiered: it stays on the model's device, as in ``DynamicCache`` (the device budget bounds K/V and staging only;
``stats()["state_bytes"]`` counts the state and its copy). What tierkv adds is the rollback every layer of a
TieredCache has: the first time a forward touches a layer's state, the state is copied aside — the model may
change it in place, as the one-token convolution does — so a forward that fails part-way puts every layer back
where it began (:class:`~tierkv.hf.forward.Forward`), and ``crop`` can take back the last forward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tierkv.errors import InvalidConfigError
from tierkv.hf.layer import OfCache, TieredLayer
from tierkv.hf.sizing import HOLDS_STATE, LinearAttentionLayer

if TYPE_CHECKING:
    from tierkv.hf.cache import TieredCache

Base: Any = LinearAttentionLayer if HOLDS_STATE else object  # without it, sizing refuses such layers


@dataclass
class Snapshot:
    """A layer's state as a forward found it: the tensors (None: not yet initialized) and the token count."""

    tokens: int
    conv: dict[int, torch.Tensor | None]
    recurrent: dict[int, torch.Tensor | None]
    previous: dict[int, bool]


class StateLayer(OfCache, Base):
    """One model layer's recurrent / convolution state, on the model's device, with the copy that rolls it back."""

    cumulative_length_linear: torch.Tensor  # the tokens the state has taken in (transformers' name)

    def __init__(self, cache: TieredCache, position: int, number_of_states: int = 1) -> None:
        Base.__init__(self, number_of_states=number_of_states)
        self._cache = weakref.ref(cache)
        self.position = position  # the model's layer index
        self.saved: Snapshot | None = None
        self.saved_in = -1  # the forward (Forward.number) the snapshot was taken in

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        Base.lazy_initialization(self, *args, **kwargs)
        # the token count stays a host tensor: reading it (get_seq_length, every rollback check) must not sync a GPU
        self.cumulative_length_linear = self.cumulative_length_linear.cpu()

    def touch(self, number: int) -> bool:
        """The state is about to be read or changed in forward ``number``: on the first touch there, copy it
        aside. Whether this was the first."""
        if self.saved_in == number:
            return False
        self.saved = Snapshot(self.tokens(), _copies(self.conv_states), _copies(self.recurrent_states),
                              dict(self.has_previous_state))
        self.saved_in = number
        return True

    def tokens(self) -> int:
        return int(self.cumulative_length_linear)

    def get_seq_length(self) -> int:
        return self.tokens()

    def furthest(self) -> int:
        return self.tokens()

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the last forward (``tokens_to_remove`` = minus its tokens): the state it found is restored.
        Further back needs transformers' record of past states (``activate_past_recording``, as assisted
        decoding turns on)."""
        if self.record_past:
            Base.crop(self, tokens_to_remove)
            return
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. Please "
                             f"use a negative integer to remove that number of tokens from the cache instead.")
        if tokens_to_remove:
            StateLayer.check_crop(self, tokens_to_remove)
            assert self.saved is not None
            self._restore(self.saved)

    def check_crop(self, tokens_to_remove: int) -> None:
        """Refuse :meth:`crop` where the state cannot go back that far (before the cache crops any layer)."""
        saved, held = self.saved, self.tokens()
        target = held + tokens_to_remove
        if self.record_past or target >= held or (saved is not None and saved.tokens == target):
            return
        since = f"{held - saved.tokens} tokens" if saved is not None else "nothing it kept"
        raise InvalidConfigError(
            f"layer {self.position} keeps recurrent state, which can be taken back only to where the last forward "
            f"began ({since} ago), not {held - target} tokens: crop at most the last step, or call "
            f"cache.activate_past_recording() before the steps to take back (as assisted decoding does).")

    def _restore(self, saved: Snapshot) -> None:
        self.cumulative_length_linear.fill_(saved.tokens)
        for i in range(self.number_of_states):
            self.conv_states[i] = saved.conv[i]
            self.is_conv_states_initialized[i] = saved.conv[i] is not None
            self.recurrent_states[i] = saved.recurrent[i]
            self.is_recurrent_states_initialized[i] = saved.recurrent[i] is not None
            self.has_previous_state[i] = saved.previous[i]
        self.saved, self.saved_in = None, -1  # restored once: its tensors are the state now

    def parts(self) -> list[tuple[str, int, torch.Tensor]]:
        """Every state this layer holds: ``(conv / recurrent, index, tensor)``."""
        return [(part, i, state) for part, states in (("conv", self.conv_states), ("recurrent", self.recurrent_states))
                for i, state in states.items() if state is not None and self.has_previous_state[i]]

    def restore(self, parts: dict[tuple[str, int], torch.Tensor], tokens: int, device: torch.device) -> None:
        """Take the states a saved conversation held (``parts`` by (conv / recurrent, index)) after ``tokens``."""
        for (part, i), state in parts.items():
            state = state.to(device)
            if part == "conv":
                self.conv_states[i], self.is_conv_states_initialized[i] = state, True
                self.conv_kernel_size[i] = state.shape[-1]
            else:
                self.recurrent_states[i], self.is_recurrent_states_initialized[i] = state, True
            self.has_previous_state[i] = True
            self.device, self.dtype = device, state.dtype
        self.cumulative_length_linear = torch.tensor(tokens)

    def select_rows(self, indices: torch.Tensor) -> None:
        """Keep (or repeat) these batch rows of every state, as the K/V's rows are."""
        for states in (self.conv_states, self.recurrent_states):
            for i, state in states.items():
                if state is not None:
                    states[i] = state.index_select(0, indices.to(state.device))
        self.saved, self.saved_in = None, -1

    def state_bytes(self) -> int:
        """Device bytes of this layer's state, of the copy kept for the rollback, and of the past states
        transformers records while past recording is on (assisted decoding turns it on, and leaves it on)."""
        saved = self.saved
        held = (self.conv_states, self.recurrent_states) + ((saved.conv, saved.recurrent) if saved else ())
        now = sum(state.nbytes for states in held for state in states.values() if state is not None)
        history = getattr(self, "recurrent_states_history", None) or {}
        lists = {id(past): past for past in history.values()}.values()  # (one list may serve every index)
        return now + sum(state.nbytes for past in lists for state in past if state is not None)

    def reset(self) -> None:
        Base.reset(self)
        self.saved, self.saved_in = None, -1


class HybridLayer(StateLayer, TieredLayer):
    """A layer with both (Falcon-H1 runs attention and Mamba side by side): K/V in the tiers, state on the device."""

    def __init__(self, cache: TieredCache, position: int, index: int, sliding_window: int | None,
                 number_of_states: int = 1) -> None:
        TieredLayer.__init__(self, cache, index, sliding_window)
        StateLayer.__init__(self, cache, position, number_of_states)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        if len(args) == 2 and not kwargs:  # the attention's update(keys, values)
            TieredLayer.lazy_initialization(self, *args)
        else:
            StateLayer.lazy_initialization(self, **kwargs)

    def get_seq_length(self) -> int:
        """The K/V part's tokens, as transformers' hybrid layers answer (Inkling asks for its mask sizes after its
        convolutions took the step, before the K/V does)."""
        return TieredLayer.get_seq_length(self)

    def furthest(self) -> int:
        """The tokens of the part further on: a forward that failed between the layer's two parts took one and not
        the other, and the rollback brings each back to where the layer's other layers are."""
        return max(TieredLayer.get_seq_length(self), self.tokens())

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            StateLayer.crop(self, tokens_to_remove)  # refused, as every layer refuses it
        target = self.furthest() + tokens_to_remove
        for held, crop in ((self.tokens(), StateLayer.crop), (TieredLayer.get_seq_length(self), TieredLayer.crop)):
            if held > target:
                crop(self, target - held)

    def check_crop(self, tokens_to_remove: int) -> None:
        target = self.furthest() + tokens_to_remove
        StateLayer.check_crop(self, min(0, target - self.tokens()))
        TieredLayer.check_crop(self, min(0, target - TieredLayer.get_seq_length(self)))

    def reset(self) -> None:
        StateLayer.reset(self)
        TieredLayer.reset(self)

    def activate_past_recording(self, **kwargs: Any) -> None:
        """The state's record (transformers' own, which keeps its history) and with it ``record_past``, which the
        K/V part's sliding window reads too."""
        StateLayer.activate_past_recording(self, **kwargs)


def _copies(states: dict[int, torch.Tensor | None]) -> dict[int, torch.Tensor | None]:
    return {i: None if state is None else state.clone() for i, state in states.items()}
