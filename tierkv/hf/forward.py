"""The forward pass in progress across a cache's layers, and the rollback that keeps every layer at one length.

A forward updates layer 0, 1, ... in the model's own code. When a layer's step fails, or the cache refuses one
(a layer beyond its config), the layers that already took the step give it back (:meth:`Forward.roll_back`);
when a forward stops between two layers where no tierkv code runs (a Ctrl-C in the model), the next forward
finds the layers at different lengths, rolls them back and refuses itself (:meth:`Forward.begin`). A cache serves
one sequence of forwards at a time: another thread's update while a forward is half done is refused
(:meth:`Forward.claim`), not taken for a forward that stopped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

from tierkv.atomic import deferred_interrupts
from tierkv.errors import InterruptedStepError, InvalidConfigError

if TYPE_CHECKING:
    from tierkv.hf.runtime import Runtime


class Holding(Protocol):
    """A layer that holds K/V or state: its length (a hybrid layer's part further on), and how it gives tokens
    back."""

    def furthest(self) -> int: ...

    def crop(self, tokens_to_remove: int) -> None: ...

log = logging.getLogger("tierkv")


def alive(ident: int) -> bool:
    """Whether the thread ``ident`` is still running."""
    return any(thread.ident == ident for thread in threading.enumerate())


def changed_since_sized() -> InvalidConfigError:
    """What a forward's first update answers where another thread edited the cache (a reset, crop, batch edit, loaded
    prefix, or a forward) after this forward took its positions and sized its mask from it."""
    return InvalidConfigError(
        "another thread changed this TieredCache (a reset, crop, batch edit, loaded prefix or forward) after this "
        "thread's forward took its positions and mask from it, before its first layer: the forward would attend a "
        "sequence the cache no longer holds, so it is refused (nothing of it is stored). Run the request again; edit "
        "a cache from another thread only once its generate() has returned.")


def closed_error() -> InvalidConfigError:
    """What a closed cache answers to any use."""
    return InvalidConfigError("this TieredCache was closed (its tiers are released); create a new one.")


class Forward:
    """How far the current forward got, and the length a rollback still owes."""

    def __init__(self) -> None:
        self.layers_updated = 0  # layers updated since the current forward's update of layer 0
        self.full = 0  # layers a complete forward updates (the most one has updated)
        self.completed = False  # whether a forward completed since the cache was last empty
        self.unsettled: int | None = None  # the length a rollback cut short by a second Ctrl-C still owes
        self.thread: int | None = None  # the thread of the last update
        # with recurrent state (layers the model uses without update): the forwards begun, and the first and the
        # last use of a layer in the current one, (model layer, call, state index)
        self.number = 0
        self.first: tuple[int, str, int] | None = None
        self.last = -1
        self.last_update = -1  # the store index of the K/V layer updated last in this forward (-1: none yet)
        self.tokens: int | None = None  # what its first K/V update appended (every one appends as many)
        self.may_repeat = False  # it began at a second update of layer 0: maybe an encoder-decoder's cross-attention
        self.announced = False  # a forward's mask was sized since the last update (a new forward began)
        # a thread whose forward a reset from another thread cut in half, and that forward's first use (see cut_off)
        self.cut: tuple[int, tuple[int, str, int] | None] | None = None
        # (thread, the cache's edits) as a forward sized its mask from it, until that forward's first update
        self.sized: tuple[int, int] | None = None

    def entered(self, position: int, call: str, state_idx: int) -> bool:
        """Whether this use of model layer ``position`` begins a forward: a model runs its layers in order, so a
        forward begins where a layer before the last one used is used again, or the current forward's first use
        comes again."""
        use = (position, call, state_idx)
        new = self.begins(position, call, state_idx)
        if new:
            self.first = use
            self.number += 1
        self.last = position
        return new

    def begins(self, position: int, call: str, state_idx: int) -> bool:
        """Whether this use of model layer ``position`` would begin a forward (:meth:`entered`, which records it)."""
        return self.first is None or position < self.last or (position, call, state_idx) == self.first

    def reset(self) -> None:
        """The cache was emptied: the next use begins a forward of its own."""
        self.unsettled, self.layers_updated, self.first, self.last, self.last_update = None, 0, None, -1, -1
        self.tokens, self.may_repeat = None, False
        self.completed = False

    def claim(self, layers: int | None) -> None:
        """An update on this thread: refused while a forward of another thread that is still running is half done
        (two threads decoding with one cache would interleave their layers' steps). ``layers``: the updates a
        forward makes, where the config told them (else a forward is known complete only from the second on)."""
        if self.elsewhere(layers):
            raise InvalidConfigError(
                "this TieredCache is in the middle of a forward on another thread (or that thread's forward stopped "
                "part-way with an error, and the thread lives on): a cache holds one sequence of steps, so give each "
                "concurrent request (thread) its own TieredCache, or wait for the other's forward to finish; a "
                "forward stopped there is taken back by that thread's next forward (or cache.reset() from any).")
        self.thread = threading.get_ident()

    def cut_off(self, layers: int | None) -> None:
        """A ``reset()`` on this thread while another live thread's forward is half done: that forward's later layers
        would attend a cache that no longer holds its sequence, and write their step into it, so that thread's next
        use is refused unless it begins a new forward (:meth:`refuse_cut`)."""
        if self.elsewhere(layers):
            self.cut = (cast(int, self.thread), self.first)  # (elsewhere: a thread's)

    def refuse_cut(self, beginning: bool) -> None:
        """A use of the cache on this thread: refused where a reset from another thread cut this thread's forward
        in half and this use continues that forward (``beginning`` False); a new forward goes on."""
        if self.cut is None or self.cut[0] != threading.get_ident():
            return
        self.cut = None
        if not beginning:
            raise InvalidConfigError(
                "another thread reset this TieredCache in the middle of this thread's forward: "
                "the layers the forward had not reached would attend a cache that no longer holds its sequence, so "
                "the rest of the forward is refused (nothing of it is stored). Run the request again; to end a "
                "generate() early, stop it with a StoppingCriteria and edit the cache once generate() has returned.")

    def half_done(self, layers: int | None) -> bool:
        """Whether the last forward is half done (running, or stopped part-way by an error)."""
        return 0 < self.layers_updated < (self.full or layers or 0)

    def taken_in_part(self, layers: Sequence[Holding], expected: int | None) -> bool:
        """Whether the current forward took its step in some layers and not yet in all: fewer updates than a complete
        forward makes, or, before a forward's count is known (no config, none completed), layers of unequal length.
        A refusal then takes that step back; after a complete forward there is nothing to take back."""
        if not self.layers_updated:
            return False
        complete = self.full or expected or 0
        if complete:
            return self.layers_updated < complete
        return self._behind(layers, self.layers_updated) is not None

    def elsewhere(self, layers: int | None) -> bool:
        """Whether a forward of another thread, which is still alive, is half done."""
        return self.thread != threading.get_ident() and self.half_done(layers) and self.thread is not None \
            and alive(self.thread)

    def begun_elsewhere(self, layers: int | None) -> bool:
        """Whether a forward of another live thread is half done, or has sized its mask from the cache and not yet
        reached its first layer (it attends as the cache was then: nothing may switch under it)."""
        sized = self.sized
        return self.elsewhere(layers) or (sized is not None and sized[0] != threading.get_ident() and alive(sized[0]))

    def sized_here(self) -> bool:
        """Whether this thread's forward has sized its mask and not yet reached its first layer (it gave way to a
        thread asking for the turn then: it does not again at its first layer)."""
        return self.sized is not None and self.sized[0] == threading.get_ident()

    def stopped_here(self, layers: int | None) -> bool:
        """Whether a forward of this thread stopped half done: this thread's next forward takes it back, which no
        other thread can do first (so that forward does not give way to another's save)."""
        return self.thread == threading.get_ident() and self.half_done(layers)

    def begin(self, layers: Sequence[Holding], runtime: Runtime, expected: int | None = None) -> None:
        """A forward's first update: if the previous forward updated fewer layers than a complete one does (the
        most one has updated, or ``expected``: what the config says), it stopped between two layers in the model's
        own code (no tierkv code ran to undo it), so its layers differ in length. Roll back the ones it reached and
        refuse this forward: its positions were computed from layer 0's length, one step ahead."""
        reached, self.layers_updated, self.last_update, self.tokens = self.layers_updated, 0, -1, None
        announced, self.announced = self.announced, False
        self.may_repeat = reached == 1 and not announced  # (then refused as a repeated update, not as uneven)
        complete = self.full or expected or 0
        if not reached or reached >= complete:
            self.full = max(self.full, reached)
            self.completed = self.completed or bool(reached)
            return
        behind = self._behind(layers, reached, repeat_possible=not announced)
        if behind is None:
            return
        self.unsettled = behind  # by assignment first, as in roll_back
        self.settle(layers, runtime)
        if self._behind(layers, reached) is not None:  # a rollback that failed (logged): the layers still differ
            raise InterruptedStepError(
                f"the previous forward stopped part-way, after {reached} of the {complete} layer updates a forward "
                "makes, and its layers could not be rolled back to one length (the log says why): this cache "
                "cannot continue the sequence. Call cache.reset() and start it again.")
        raise InterruptedStepError(
            f"the previous forward stopped part-way, after {reached} of the {complete} layer updates a forward makes "
            f"(a Ctrl-C or an error in the model between layers); the layers it reached were rolled back to {behind} "
            "tokens, so every layer holds the same tokens again. Call generate() / the model again: it will resume "
            "from there. (An encoder-decoder model such as T5, BART or Whisper given this cache alone updates each "
            "layer twice per forward, self- and cross-attention: pass cache.encoder_decoder() instead.)"
        )

    def _behind(self, layers: Sequence[Holding], reached: int, repeat_possible: bool = False) -> int | None:
        """The length the layers of a forward that stopped after ``reached`` updates go back to (None: they hold
        as many tokens each, as when an update's own rollback ran). ``repeat_possible``: no new forward was seen
        starting (no mask was sized since the last update)."""
        lengths = {layer.furthest() for layer in layers}
        if self.completed or (reached < 2 and repeat_possible):
            # after a complete forward a layer that holds nothing never does (the K/V it reuses); a first forward
            # that reached one layer, with no new forward seen starting since, may be an encoder-decoder model's
            # given the cache alone, whose cross-attention updates layer 0 again (refused as a repeated update),
            # not a stopped one
            lengths -= {0}
        return min(lengths) if len(lengths) > 1 else None

    def settle_stopped(self, layers: Sequence[Holding], runtime: Runtime, expected: int | None = None) -> bool:
        """Before an edit between forwards (a crop, a row selection, a save): the layers of a forward that stopped
        part-way go back as the next forward would take them back, so that the edit applies to layers of one
        length (a crop of unequal layers kept them unequal, and the next forward decoded wrong). Whether any did."""
        reached = self.layers_updated
        if not reached or reached >= (self.full or expected or 0):
            return False
        if self.elsewhere(expected):  # rolling it back would break a forward that is still running
            raise InvalidConfigError(
                "this TieredCache is in the middle of a forward on another thread (or that thread's forward stopped "
                "part-way with an error): save, crop or reorder it from that thread, or once its generate() has "
                "returned.")
        behind = self._behind(layers, reached)
        if behind is None:
            return False
        self.layers_updated = 0  # undone: the next forward does not continue it
        self.unsettled = behind
        self.settle(layers, runtime)
        log.warning("tierkv: the previous forward stopped part-way (after %d layer updates); its layers were rolled "
                    "back to %d tokens before this edit", reached, behind)
        return True

    def roll_back(self, layers: Sequence[Holding], runtime: Runtime, length: int) -> None:
        """A step failed (or was refused) at some layer: every layer gives back what it took, to ``length``."""
        self.unsettled = length  # first, by assignment: no signal is handled here
        self.layers_updated = 0  # this forward is undone: the next one is not a resumption of it
        self.settle(layers, runtime)

    def settle(self, layers: Sequence[Holding], runtime: Runtime) -> None:
        """Crop every layer longer than :attr:`unsettled` back to it.

        Called while an error propagates; a failure here is logged, so the original error is the one raised. A
        second Ctrl-C meanwhile is held until every layer is back (the undo is a few table edits per layer); one
        that lands before the hold starts leaves ``unsettled`` set, and the cache's next ``update`` or
        ``get_seq_length`` settles it.
        """
        length = self.unsettled
        if length is None:
            return
        try:
            with deferred_interrupts():
                if runtime.store is not None:
                    runtime.invalidate()
                for layer in layers:
                    if layer.furthest() > length:
                        layer.crop(length - layer.furthest())
                self.unsettled = None
        except Exception:
            log.exception("tierkv: rolling back a failed update failed; layers may differ in length")
            self.unsettled = None  # not retried: the failure is logged once
