"""``TieredCache``: the transformers ``Cache`` whose K/V live in tierkv's three-tier block store.

Usage::

    from tierkv import TieredCache
    with TieredCache(gpu_gb=20, disk_dir="/nvme/tierkv") as cache:
        out = model.generate(ids, cache=cache, max_new_tokens=256)
        print(cache.stats())

Each attention layer calls ``cache.update(k, v, layer_idx)``; its :class:`~tierkv.hf.layer.TieredLayer` appends
the new tokens to the store and runs the active executor: by default exact gather, which assembles the layer's
K/V in device staging from all tiers for the model's own attention — so outputs equal ``DynamicCache``'s. The
cache is the list of layers, their resources (:class:`~tierkv.hf.runtime.Runtime`), the executor modes, and
the forward-level rollback that keeps every layer at the same length whatever fails.
"""

from __future__ import annotations

import inspect
import operator
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

try:  # a layer that keeps nothing (an MoE or MLP block between recurrent and attention layers)
    from transformers.cache_utils import DummyLayer
except ImportError:  # releases without it refuse such configs (sizing.layer_kinds)
    DummyLayer = type("DummyLayer", (), {})  # type: ignore[misc,assignment]

from tierkv import forks, settings
from tierkv.atomic import deferred_interrupts
from tierkv.attention.base import PipelinedExecutor
from tierkv.attention.exact_gather import ExactGather
from tierkv.attention.lse import FullyMaskedRows
from tierkv.bandwidth import LinkProfile
from tierkv.errors import DiskTierError, InvalidConfigError, TierKVError, UnsupportedLayerError
from tierkv.hf import conversation, sizing
from tierkv.hf.attention import Engagement, drop_hand_over
from tierkv.hf.encoder_decoder import TieredEncoderDecoderCache
from tierkv.hf.forward import Forward, alive, changed_since_sized, closed_error
from tierkv.hf.layer import TieredLayer, Uncopyable, not_held
from tierkv.hf.modes import AttentionModes
from tierkv.hf.runtime import Budgets, Runtime
from tierkv.hf.session import PrefixSession
from tierkv.hf.sizing import DEFAULT_BLOCK_TOKENS, DEFAULT_DISK_FRACTION
from tierkv.hf.state import HybridLayer, StateLayer
from tierkv.persist.keys import layer_shapes
from tierkv.policy import Policy, make_policy
from tierkv.stats import check_profile, checked_trace_path, make_trace
from tierkv.store import KVStore
from tierkv.tiers.disk import DiskTier, limit_advice
from tierkv.units import parse_size

_NOT_COMPILED = ("a TieredCache runs outside torch.compile's graph (its tiers move blocks with threads and I/O): "
                 "compile without fullgraph=True, so the model's layers are compiled around the cache's calls")
_NOT_COPIED = ("a TieredCache cannot be copied or pickled: it owns its budgets, I/O threads and disk files. To "
               "continue one prompt several ways (transformers' deepcopy of a prompt cache), crop it back to the "
               "prompt after each continuation: `cache.crop(prompt_tokens - cache.get_seq_length())` (a negative "
               "count of tokens to remove); across processes, keep the prompt's blocks with "
               "persist=True and `load_prefix` them; to write a conversation to a file, `cache.save(path, "
               "model=model)`.")


class CacheGuard:
    """The cache's lock, held by whatever touches its tiers (a layer-step, an edit, a save, ``close()``), so another
    thread's ``close()`` waits for it; its holder runs outside inference mode, without grad, so the slabs and
    buffers the tiers allocate are normal tensors that any later call may write in place (made under a caller's
    ``torch.inference_mode()``, as servers decode, a later ``crop`` or ``no_grad`` forward could not write them).

    And the cache's *turn*: a save takes it between two forwards (:meth:`take_turn`), so that other threads' next
    forward or edit waits (:meth:`wait_turn`) until the save has read every record, instead of changing the cache
    under it; a thread that asked for the turn (``asking``) is given it at the next forward's start, and a forward
    that waited for a save starts before the next save takes the turn (saves in a loop never starve a decode)."""

    __slots__ = ("_lock", "_local", "owner", "_turn", "holder", "asking", "starting", "owed")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._local = threading.local()  # .modes: per entry, the mode contexts it entered (None: none needed)
        self.owner = forks.Owner()
        self._turn = threading.Condition(self._lock)
        self.holder: int | None = None  # the thread that holds the turn
        self.asking = 0  # threads waiting to take it
        self.starting = 0  # forwards waiting to start
        self.owed = False  # a forward waited for the last holder: it starts before the turn is taken again

    def take_turn(self, busy: bool) -> bool:
        """Under the guard: take the turn unless another live thread holds it or ``busy`` (another thread's forward
        is half done); whether this thread holds it now."""
        me, holder = threading.get_ident(), self.holder
        if (holder is not None and holder != me and alive(holder)) or (self.owed and self.starting):
            return False
        self.owed = False
        self.holder = None if busy else me
        return not busy

    def give_turn(self) -> None:
        """Give the turn back (the threads waiting for it go on)."""
        with self:
            if self.holder == threading.get_ident():
                self.holder = None
                self.owed = self.starting > 0
            self._turn.notify_all()

    def pause(self, seconds: float) -> None:
        """Under the guard: let other threads take it for up to ``seconds`` (or until the turn changes hands)."""
        self._turn.wait(seconds)

    def wait_turn(self, starting: bool = False) -> None:
        """Under the guard, before an edit or (``starting``) a forward's start: wait while another live thread holds
        the turn (a save), so that nothing changes under it; a forward's start also gives way to a thread asking for
        it (the one moment between two forwards that a save can count on)."""
        me = threading.get_ident()
        self.starting += starting
        try:
            while True:
                holder = self.holder
                if holder is not None and holder != me and not alive(holder):
                    self.holder = holder = None  # its thread ended without giving it back
                if holder == me or (holder is None and not (starting and self.asking and not self.owed)):
                    self.owed = self.owed and not starting
                    return
                self._turn.wait(0.05)
        finally:
            self.starting -= starting

    def __enter__(self) -> None:
        if os.getpid() != self.owner.pid:  # before the lock: in a forked child, a parent's thread may hold it
            self.owner.check("TieredCache")
        self._lock.acquire()
        modes = None
        if torch.is_inference_mode_enabled():  # (leaving inference mode turns grad on: no_grad keeps it off)
            modes = (torch.inference_mode(False), torch.no_grad())
            for mode in modes:
                mode.__enter__()
        self._local.__dict__.setdefault("modes", []).append(modes)

    def __exit__(self, *exc_info: object) -> None:
        try:
            modes = self._local.modes.pop()
            if modes is not None:
                for mode in reversed(modes):
                    mode.__exit__(None, None, None)
        finally:
            self._lock.release()


MAX_LAYERS = 1 << 14
"""Most layers a cache built without ``config=`` grows to (an index past it is a slip, not a model: each layer
index up to it becomes a layer)."""


def _checked_update(key_states: object, value_states: object, layer_idx: object) -> int:
    """``update``'s arguments refused before any layer changes where they are not a layer's step: K/V tensors
    ``[B, H_kv, T, D]`` of one dtype (strided: a sparse tensor has no storage to copy) and an int layer index (a
    bool is a slip); the index as an int."""
    dtypes = []
    for name, states in (("key_states", key_states), ("value_states", value_states)):
        if not isinstance(states, torch.Tensor):
            raise InvalidConfigError(f"update() takes {name} as a torch.Tensor [batch, kv_heads, tokens, head_dim], "
                                     f"got {type(states).__name__}; nothing changed.")
        if states.dim() != 4 or states.layout != torch.strided:
            raise InvalidConfigError(
                f"update() takes {name} as a dense tensor [batch, kv_heads, tokens, head_dim], got "
                f"{'a ' + str(states.layout) + ' ' if states.layout != torch.strided else ''}shape "
                f"{tuple(states.shape)}; nothing changed.")
        dtypes.append(states.dtype)
    if dtypes[0] != dtypes[1]:
        raise InvalidConfigError(f"update() got keys in {dtypes[0]} and values in {dtypes[1]}: a layer's K/V is stored "
                                 "in one dtype (the other would lose precision); cast both to the model's dtype. "
                                 "Nothing changed.")
    try:  # (not sizing.check_count: this runs in every layer-step, within this module)
        index = None if isinstance(layer_idx, bool) else operator.index(layer_idx)  # type: ignore[arg-type]
    except TypeError:
        index = None
    if index is None or index < 0:
        raise InvalidConfigError(f"layer_idx must be an int >= 0, got {layer_idx!r}.")
    return index


CROP_KEEPS_LENGTH = "max_length" in inspect.signature(DynamicLayer.crop).parameters
"""Whether the installed transformers' ``crop(n)`` with ``n > 0`` keeps the first ``n`` tokens (5.0, what its
assisted decoding calls) rather than refusing it (later releases crop by a negative count only)."""


class TieredCache(Uncopyable, AttentionModes, Cache):
    """A transformers ``Cache`` backed by device, host and disk tiers.

    Args:
        gpu_gb: device-tier budget (GB as a float, or a string like ``"512MB"``, ``"20GiB"``). It bounds
            *all* device memory the cache holds, the attention staging area included (see
            :meth:`min_device_bytes`). Default: 25% of free device memory.
        cpu_gb: host-tier budget (pinned RAM on CUDA hosts). Default: half of the available RAM (a quarter
            where the device tier is RAM too and ``gpu_gb`` is left out).
        disk_dir: directory of the disk tier's files; no disk tier when None.
        disk_gb: disk-tier budget. Default: 90% of the free space under ``disk_dir``.
        block_tokens: tokens per block, the unit of placement and I/O.
        policy: residency policy name (``"lru"``) or a :class:`tierkv.policy.Policy`.
        prefetch_depth: layers gathered ahead of the one computing (each costs one staging buffer), or
            ``"auto"``: chosen by the bandwidth model from the first decode steps (docs/architecture.md,
            "Statistics and telemetry").
        config: the model config; lets sliding-window layers (Gemma2/3, Mistral) keep only their window.
        disk_engine: force a disk engine (``"posix"``, ``"native"``, ``"kvikio"``); default: automatic.
        profile: the :class:`~tierkv.bandwidth.LinkProfile` (or its JSON path) for the predicted times in
            ``stats()["steps"]`` and for ``prefetch_depth="auto"``; default ``$TIERKV_PROFILE``, else presets
            by device type (:func:`tierkv.stats.default_profile`).
        trace: record a timeline trace (True; or a path written at ``close()``, empty if no forward ran); default
            ``$TIERKV_TRACE`` (the n-th cache of a process it traces writes the first free name of
            ``<stem>-<n><suffix>``, ``<stem>-<n+1><suffix>``, ..., logged).
            See :meth:`save_trace`.
        persist: keep full blocks in ``disk_dir`` after the process ends, content-addressed by model and
            token ids, so a later cache reuses a shared prefix (:meth:`load_prefix`; docs/reliability.md).
        persist_gb: size cap of the persisted blocks (least recently used evicted first). Default: 10% of
            the free space under ``disk_dir``.
        remote: URL of a Redis/Valkey server (or cluster) shared by many workers — ``redis://host:6379/0``,
            ``rediss://`` (TLS), ``redis+cluster://h1:p1,h2:p2``; password in the URL or
            ``$TIERKV_REDIS_PASSWORD``. Full blocks are written to it in the background and
            :meth:`load_prefix` loads a prefix from it after the local persistent blocks (docs/remote.md).
    """

    layers: list[TieredLayer]  # type: ignore[assignment]  # transformers declares its own layer kinds
    min_device_bytes = staticmethod(sizing.min_device_bytes)
    min_streaming_device_bytes = staticmethod(sizing.min_streaming_device_bytes)
    min_split_device_bytes = staticmethod(sizing.min_split_device_bytes)
    min_sparse_device_bytes = staticmethod(sizing.min_sparse_device_bytes)
    kv_bytes_per_token = staticmethod(sizing.kv_bytes_per_token)
    kv_bytes_held = staticmethod(sizing.kv_bytes_held)
    rest_copy_bytes = staticmethod(sizing.rest_copy_bytes)

    def __init__(self, gpu_gb: float | str | None = None, cpu_gb: float | str | None = None,
                 disk_dir: str | os.PathLike | None = None, disk_gb: float | str | None = None,
                 block_tokens: int = DEFAULT_BLOCK_TOKENS, policy: str | Policy = "lru",
                 prefetch_depth: int | str = 1, config: PreTrainedConfig | None = None,
                 disk_engine: str | None = None, profile: LinkProfile | str | os.PathLike | None = None,
                 trace: bool | str | os.PathLike | None = None, persist: bool = False,
                 persist_gb: float | str | None = None, remote: str | None = None) -> None:
        sizing.check_arguments(block_tokens, prefetch_depth, config, disk_dir, disk_gb, disk_engine, persist,
                               persist_gb, remote)
        settings.check_all()  # every TIERKV_* knob: a bad one is refused now, not inside the first forward
        check_profile(profile)
        self.trace = make_trace(trace)  # None when off (also reads TIERKV_TRACE)
        budgets = Budgets(None if gpu_gb is None else parse_size(gpu_gb, name="gpu_gb"),
                          None if cpu_gb is None else parse_size(cpu_gb, name="cpu_gb"),
                          block_tokens, make_policy(policy), prefetch_depth, profile)
        disk_budget = None if disk_gb is None else parse_size(disk_gb, name="disk_gb")
        persist_budget = parse_size(persist_gb, name="persist_gb") if persist and persist_gb is not None else None
        sizing.check_budgets_fit_machine(budgets.gpu, budgets.cpu, disk_budget, disk_dir, persist=persist_budget)
        self.block_tokens = block_tokens
        self.closed = False
        self.unentered: Engagement | None = None  # a streaming()/sparse() made but not entered (never honoured)
        self.chosen = "gather"  # the exact executor the last exact() chose
        self.sized_at: int | None = None  # masks_built() when a forward last asked for mask sizes (hf.attention)
        self.forward = Forward()  # how far the current forward got; the rollback it may owe
        self.fully_masked = FullyMaskedRows()  # the padding queries of the masks the layers attend with
        # a leaf that requires grad once K/V with autograd history were stored (a forward with gradients on): later
        # forwards tie their outputs to it, so a backward that would need those K/V's gradients raises (hf.layer)
        self.history: torch.Tensor | None = None
        self.edits = 0  # forwards begun and edits (crop, rows, reset): a save checks it is unchanged between records
        # held by each update and an engaged layer's attention, and by close(): a close() on another thread waits
        # for the layer-step in progress, whose next update then finds the cache closed
        self.using = CacheGuard()  # held by whatever touches the tiers
        disk = DiskTier(disk_dir, disk_budget, DEFAULT_DISK_FRACTION, engine=disk_engine) if disk_dir else None
        self.runtime = Runtime(budgets, disk, self.trace)
        # dropped without close() (or alive at exit), the cache still releases threads, descriptors and files
        self._finalizer = forks.finalize(self, self.runtime.close)
        layers = self._layers_of(config) if config is not None else []
        self.stateful = any(isinstance(layer, StateLayer) for layer in layers)  # recurrent state beside or for K/V
        self.mixed = any(isinstance(layer, (StateLayer, DummyLayer)) for layer in layers)  # not K/V alone
        if self.stateful and (persist or remote is not None):
            raise InvalidConfigError(
                "persist= and remote= reuse a prefix's K/V blocks, but this model also keeps recurrent state in its "
                "layers (Mamba, linear attention, convolutions), which no K/V block holds: a loaded prefix would "
                "decode from the wrong state. Build the cache without persist= / remote= for this model.")
        if (persist or remote is not None) and config is not None:
            layer_shapes(sizing.kv_shapes(config), config.get_text_config(decoder=True).num_hidden_layers)
        self.session = PrefixSession(disk_dir, persist, persist_gb, remote, block_tokens) \
            if persist or remote is not None else None
        self.remote_closed: dict[str, Any] | None = None  # the remote tier's final stats (``stats()`` after close)
        self.state_in_model = False  # the model keeps its recurrent state itself (:meth:`_leave_skipped_state`)
        super().__init__(layers=cast(list, layers))  # transformers types its own layer kinds

    # ------------------------------------------------------------------------------ transformers API
    @torch.compiler.disable(reason=_NOT_COMPILED)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        with self.using:
            guard = self.using
            if (guard.holder is not None or guard.asking) and layer_idx == 0 and not self.stateful \
                    and not self.forward.sized_here():
                # not while another thread's save holds the turn or asks for it (unless it waits for this one)
                self._give_way()
            if self.forward.thread != threading.get_ident():  # (the same thread's updates: no call)
                self.forward.claim(self.uses_per_forward())
            if self.forward.unsettled is not None:
                self.forward.settle(self.holding, self.runtime)
            try:
                layer_idx = _checked_update(key_states, value_states, layer_idx)
            except BaseException:
                self._take_back_part()
                raise
            if not self.stateful:  # (a stateful cache checks in enter: its forwards may begin at a state layer)
                layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
                beginning = isinstance(layer, TieredLayer) and layer.index == 0
                if self.forward.cut is not None:
                    self.forward.refuse_cut(beginning)
                if beginning and self.forward.sized is not None and not self.closed:  # (closed: said as such)
                    self._check_sized()
            if not 0 <= layer_idx < len(self.layers):
                try:
                    self._add_layers(layer_idx)
                except BaseException as error:  # past every layer: the forward of a model with more layers, refused
                    outcome = self._take_back_part(beyond=layer_idx >= len(self.layers))
                    if outcome and isinstance(error, TierKVError):
                        error.args = (f"{error} {outcome}",)
                    raise
            try:
                return self.layers[layer_idx].update(key_states, value_states)
            except OSError as exc:  # a process limit met outside tierkv's own I/O (a lazy import, a thread): named
                advice = None if isinstance(exc, TierKVError) else limit_advice(exc)
                if advice is None:
                    raise
                raise DiskTierError(exc.errno, f"a step of layer {layer_idx} failed and was not taken: {advice}") \
                    from exc

    def __iter__(self) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]:
        """Each layer's ``(keys, values, sliding window)`` as ``DynamicCache`` iterates them: the K/V read from every
        tier into new host tensors (for inspection: it costs their bytes), the window a tensor or None."""
        for layer in self.layers:
            window = getattr(layer, "sliding_window", None)
            yield (getattr(layer, "keys", None), getattr(layer, "values", None),
                   None if window is None else torch.tensor(window, dtype=torch.long))

    @torch.compiler.disable(reason=_NOT_COMPILED)
    def get_seq_length(self, layer_idx: int = 0) -> int:
        with self.using:
            if self.forward.unsettled is not None:  # generate() asks before its first update: finish the rollback
                self.forward.settle(self.holding, self.runtime)
            layers = self.layers  # a layer that keeps nothing answers for the first that holds: the sequence's length
            if isinstance(layer_idx, int) and 0 <= layer_idx < len(layers) and \
                    isinstance(layers[layer_idx], DummyLayer):
                layer_idx = next((i for i, layer in enumerate(layers) if not isinstance(layer, DummyLayer)), layer_idx)
            return super().get_seq_length(layer_idx)

    @torch.compiler.disable(reason=_NOT_COMPILED)
    def get_query_offset(self, layer_idx: int = 0) -> int:
        """The cache length a forward's mask starts from: asked as the forward begins, before its first update (a
        model's own attention asks ``get_seq_length`` at every layer, so that cannot tell; :meth:`Forward.begin`)."""
        self.forward.announced = True
        offset = super().get_query_offset(layer_idx)
        self.note_sized()
        return offset

    def note_sized(self) -> None:
        """A forward sizes its mask from the cache as it is now (its positions were taken just before): first it gives
        way to another thread's save or executor switch that holds or asks for the turn (the mask and the attention
        must be the same kind), then it counts as begun, and its first update checks that no other thread changed the
        cache in between (:meth:`_check_sized`)."""
        with self.using:
            if (self.using.holder is not None or self.using.asking) and not self.forward.sized_here():
                self._give_way()
            self.forward.sized = (threading.get_ident(), self.edits)

    def _give_way(self) -> None:
        """Under the guard, as a forward begins while another thread's save or executor switch holds or asks for the
        turn: wait for it (a forward this thread left half done goes first: only its next forward can take it back)."""
        self.using.wait_turn(starting=not self.forward.stopped_here(self.uses_per_forward()))

    def _check_sized(self) -> None:
        """A forward's first update: refused where another thread edited the cache after this forward sized its mask
        (:meth:`note_sized`; every edit, a loaded prefix and a forward's start count in ``edits``)."""
        sized, self.forward.sized = self.forward.sized, None
        if sized is not None and sized[0] == threading.get_ident() and sized[1] != self.edits:
            raise changed_since_sized()

    @property
    def records_past(self) -> bool:
        """Whether sliding-window layers keep their whole past: after ``activate_past_recording()`` (until a crop),
        or always in a cache built without ``config=`` (its layers know no window)."""
        return self.runtime.num_layers is None or any(
            isinstance(layer, TieredLayer) and layer.is_sliding and layer.record_past for layer in self.layers)

    @property
    def is_initialized(self) -> bool:
        """Whether the cache holds tokens, as ``DynamicCache`` answers it after a forward: PaliGemma, Molmo2 and
        HRM read it to tell a prefill from a later step (their layers update no transformers-side state)."""
        return self.get_seq_length() > 0

    # ------------------------------------------------------------- recurrent state (docs: tierkv.hf.state)
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self.enter(self._state_layer(layer_idx), "get_conv", state_idx)
        return super().get_conv_state(layer_idx, state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          **kwargs: Any) -> torch.Tensor:
        self.enter(self._state_layer(layer_idx), "update_conv", state_idx)
        return super().update_conv_state(conv_states, layer_idx, state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self.enter(self._state_layer(layer_idx), "get_recurrent", state_idx)
        return super().get_recurrent_state(layer_idx, state_idx)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor:
        self.enter(self._state_layer(layer_idx), "update_recurrent", state_idx)
        return super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)

    def increase_count(self, layer_idx: int, state_idx: int) -> None:
        self.enter(self._state_layer(layer_idx), "increase_count", state_idx)
        super().increase_count(layer_idx, state_idx)

    def update_indexer(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedLayerError(not_held("an indexer's keys (sparse attention's own cache)"))

    def _state_layer(self, layer_idx: int) -> StateLayer:
        layer = self.layers[layer_idx] if isinstance(layer_idx, int) and 0 <= layer_idx < len(self.layers) else None
        if isinstance(layer, StateLayer):
            return layer
        if not sizing.HOLDS_STATE:
            raise UnsupportedLayerError(not_held("convolution or recurrent state (Mamba, linear attention)"))
        raise UnsupportedLayerError(
            f"the model asks layer {layer_idx} for convolution or recurrent state (Mamba, linear attention), which "
            f"this cache did not build it to hold: TieredCache learns each layer's kind from the model's config. "
            f"Build it with TieredCache(config=model.config, ...), as DynamicCache needs for this model.")

    def enter(self, layer: TieredLayer | StateLayer, call: str, state_idx: int = 0) -> None:
        """A layer of a cache with recurrent state is used: the first use of a forward begins it (the layers that
        hold state are touched in the model's own code, not only through ``update``), and a layer's first use
        within a forward copies its state aside for the rollback."""
        with self.using:
            forward = self.forward
            if forward.thread != threading.get_ident():
                forward.claim(self.uses_per_forward())
            if forward.unsettled is not None:
                forward.settle(self.holding, self.runtime)
            if forward.cut is not None:
                forward.refuse_cut(beginning=(layer.position, call, state_idx) == forward.cut[1])
            sized_here = forward.sized_here()
            if forward.sized is not None and not self.closed and forward.begins(layer.position, call, state_idx):
                self._check_sized()
            if forward.entered(layer.position, call, state_idx):
                if (self.using.holder is not None or self.using.asking) and not sized_here:  # (as in update)
                    self._give_way()
                self.begin_forward()
            if isinstance(layer, StateLayer) and layer.touch(forward.number):
                forward.layers_updated += 1
            elif not isinstance(layer, StateLayer) and forward.last_update == -1:  # a forward's first K/V update
                self._leave_skipped_state(layer.position)

    def uses_per_forward(self) -> int | None:
        """The layer updates and first uses of a layer's state that a complete forward makes (None: not known
        before one, without a config)."""
        layers = self.runtime.num_layers
        return None if layers is None else layers + sum(isinstance(layer, StateLayer) for layer in self.layers)

    @property
    def kv_layers(self) -> list[TieredLayer]:
        """The layers that hold K/V, in store order."""
        return [layer for layer in self.layers if isinstance(layer, TieredLayer)] if self.mixed else self.layers

    @property
    def holding(self) -> list[Any]:
        """The layers that hold K/V or state, in the model's order (the others, MoE or MLP blocks, hold nothing)."""
        return [layer for layer in self.layers if not isinstance(layer, DummyLayer)] if self.mixed else self.layers

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """Nothing to move: the executors read ahead themselves (``prefetch_depth``); transformers' version needs the
        stream of its own offloading, which this cache never turns on (``offload`` is its layers' no-op)."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(self._row_indices(beam_idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        sizing.check_count(repeats, name="batch_repeat_interleave's repeats")
        self._select_rows([i for i in range(self.batch_size) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(self._row_indices(indices))

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop (``tokens_to_remove`` < 0), refused before any layer changes where a layer cannot
        go back that far (a sliding window that dropped the tokens, recurrent state: ``check_crop``)."""
        tokens_to_remove = sizing.check_count(tokens_to_remove, name="crop's tokens_to_remove (negative: crop(-3))",
                                              minimum=None)
        with self.using:
            if self.closed:
                raise closed_error()
            self.using.wait_turn()
            if tokens_to_remove > 0 and CROP_KEEPS_LENGTH:  # transformers 5.0's crop(max_length): keep that many
                tokens_to_remove = min(0, tokens_to_remove - self.get_seq_length())
            target = self.get_seq_length() + tokens_to_remove  # counted from layer 0's tokens, as transformers does
            asked, stopped = tokens_to_remove, self.settle_stopped()
            if stopped and tokens_to_remove < 0:  # a stopped forward's tokens went: to target, if any
                tokens_to_remove = min(0, target - self.get_seq_length())
            try:
                for layer in self.holding:
                    layer.check_crop(tokens_to_remove)
            except TierKVError as error:
                if stopped:  # its numbers count from the rolled-back length: say why they differ from the ask
                    error.args = (f"crop({asked}): the previous forward had stopped part-way, and its tokens were "
                                  f"taken back first (the cache holds {self.get_seq_length()} now, {-tokens_to_remove} "
                                  f"more to crop); {error}",)
                raise
            self.edits += 1
            super().crop(tokens_to_remove)
            if not any(layer.furthest() for layer in self.holding):
                self.forward.reset()  # empty again, as after reset(): its next forward is a first one

    def reset(self) -> None:
        """Empty the cache for an unrelated prompt. From another thread while that thread's forward is half done: the
        rest of that forward is refused (:meth:`Forward.cut_off`), so it neither attends nor writes the emptied cache
        (crops and batch edits are refused there instead: they would roll back a forward still running)."""
        with self.using:
            self.using.wait_turn()
            self.forward.cut_off(self.uses_per_forward())
            self.edits += 1
            if self.session is not None:
                self.session.collect(self)
                self.session.reset()
            if self.runtime.store is not None:
                for executor in self.runtime.executors.values():
                    executor.reset()
                self.runtime.store.reset()
            for layer in self.layers:
                layer.reset()
            self.forward.reset()
            self.history = None

    # ----------------------------------------------------------------------------------- tierkv API
    @property
    def store(self) -> KVStore | None:
        return self.runtime.store

    @property
    def executors(self) -> dict[str, PipelinedExecutor]:
        """The executors built so far, by registered name (:data:`tierkv.attention.base.EXECUTORS`)."""
        return self.runtime.executors

    @property
    def executor(self) -> ExactGather:
        """The exact-gather executor (the default path); it exists once the first update built the store."""
        return self.runtime.exact

    def stats(self) -> dict[str, Any]:
        """Occupancy and traffic; see docs/architecture.md ("Statistics") for every key. Safe from any thread
        (a metrics scrape): taken under the cache's lock, between two layer-steps."""
        with self.using:
            remote = self.session.remote if self.session is not None else None
            stats = self.runtime.stats(self.get_seq_length(),
                                       remote.stats() if remote is not None else self.remote_closed)
            stats["state_bytes"] = sum(layer.state_bytes() for layer in self.layers if isinstance(layer, StateLayer))
            return stats

    def load_prefix(self, model: torch.nn.Module, input_ids: torch.Tensor | Sequence[int],
                    attention_mask: torch.Tensor | None = None) -> int:
        """Load the longest persisted prefix of ``input_ids`` ``[B, T]`` into this empty cache and remember the
        ids, so the sequence's own full blocks are persisted in turn (needs ``persist=True``). Returns the
        tokens the cache now holds; ``model.generate(input_ids, cache=cache)`` then computes only the rest —
        always at least the last token. Blocks match only for the same model weights and config, dtype,
        device type, attention implementation and ``block_tokens``.

        On a cache that already holds a conversation, it records the ids of the next turn (they must start
        with the ones it holds: pass the previous ids, the generated tokens, then the new ones), loads nothing
        and returns the tokens held. A conversation loaded from a file (:meth:`load`) stays private: nothing
        of it, nor what is computed on top of it, is persisted.

        ``attention_mask``: the one the forward gets (a padded batch): only tokens before the first masked one
        are loaded or persisted; a forward whose mask masks loaded tokens is refused (:mod:`tierkv.hf.session`).
        """
        with self.using:
            if self.closed:
                raise closed_error()
            if self.session is None:
                raise InvalidConfigError("load_prefix needs persistent or remote blocks: remote='redis://...', or "
                                         "TieredCache(disk_dir='/path/on/nvme', persist=True).")
            self.edits += 1  # (another thread's forward that sized its mask before it is refused: _check_sized)
            return self.session.load(self, model, input_ids, attention_mask)

    def flush(self) -> None:
        """Persist the full blocks with known ids now and wait until they are written (``persist=True``;
        also done on ``close()``). From any thread: the blocks are exported under the cache's lock, a batch at a
        time, and the writer is waited for outside it, so a decoding thread goes on meanwhile."""
        while True:
            with self.using:
                session = self.session
                if session is None or self.closed:
                    return
                queued = session.collect(self, wait=False)
            session.flush()
            if queued:
                return

    def encoder_decoder(self) -> TieredEncoderDecoderCache:
        """This cache as an encoder-decoder model's (T5, BART, Whisper) self-attention cache, the cross-attention
        K/V in a ``DynamicCache``: ``model.generate(..., cache=cache.encoder_decoder())`` (``past_key_values=`` before
        transformers 5.24). Unlike transformers' ``EncoderDecoderCache(cache, DynamicCache())`` it takes the crops and
        batch edits of assisted decoding and contrastive search (:mod:`tierkv.hf.encoder_decoder`)."""
        return TieredEncoderDecoderCache(self, DynamicCache())

    def save(self, path: str | os.PathLike, model: torch.nn.Module | None = None) -> None:
        """Write this conversation (every layer's K/V, the token ids it knows, per-layer state) to ``path``, so
        :meth:`load` resumes it without prefill. Atomic: a crash while saving leaves the previous file.
        ``model``: recorded by fingerprint, so that loading with another model is refused."""
        conversation.save(self, path, model)

    async def asave(self, path: str | os.PathLike, model: torch.nn.Module | None = None) -> None:
        """:meth:`save` for asyncio servers: the file I/O does not block the event loop; the K/V is copied out
        of the tiers on the loop's thread, one chunk (``CHUNK_BYTES``) at a time."""
        await conversation.asave(self, path, model)

    @classmethod
    def load(cls, path: str | os.PathLike, model: torch.nn.Module | None = None,
             device: str | torch.device | None = None, **options: Any) -> TieredCache:
        """A cache holding the conversation saved at ``path``: ``model.generate(ids, cache=cache)`` continues
        it with no prefill. ``model`` is required: the file is refused unless it was saved from that model and fits
        its config (a file is untrusted input). ``options`` are :class:`TieredCache` arguments (budgets,
        ``disk_dir`` ...); ``device`` defaults to ``model``'s. Every record is verified (IntegrityError). The
        conversation is private: it is never written to the persistent or remote store."""
        return conversation.load(cls, path, model, device, options)

    @classmethod
    async def aload(cls, path: str | os.PathLike, model: torch.nn.Module | None = None,
                    device: str | torch.device | None = None, **options: Any) -> TieredCache:
        """:meth:`load` for asyncio servers (the file is read with aiofiles)."""
        return await conversation.aload(cls, path, model, device, options)

    def save_trace(self, path: str | os.PathLike) -> None:
        """Write the timeline trace (``TieredCache(trace=True)``) as Chrome trace JSON (chrome://tracing,
        https://ui.perfetto.dev): mover copies/reads per link, synchronous reads, prefetch waits, compute."""
        if self.trace is None:
            raise InvalidConfigError("no trace was recorded; create the cache with TieredCache(trace=True) "
                                     "or set TIERKV_TRACE=path.")
        self.trace.save(checked_trace_path(path, f"save_trace({os.fspath(path)!r})"))

    def close(self) -> None:
        """Release every tier and delete the disk tier's files; persisted blocks (``persist=True``) stay, the
        last ones written first. Idempotent; a failure while cleaning up is logged, never raised (a file that
        cannot be removed is retried at exit, or by the next cache that opens its directory). A cache dropped
        without ``close()`` is closed when it is garbage-collected. In a forked child it only marks the cache
        closed: what it would release is the parent's (:mod:`tierkv.forks`)."""
        if self.using.owner.inherited:
            self.closed = True
            return
        with self.using, deferred_interrupts():  # a Ctrl-C waits for the cleanup it would cut in half, then comes
            session = self.session
            try:
                if session is not None:
                    try:
                        if not self.closed:
                            session.collect(self)
                    finally:  # a Ctrl-C in collect still closes the session (its threads, its scratch area)
                        self.session = None
                        session.close()
                    if session.remote is not None:
                        self.remote_closed = session.remote.stats()  # its writes drained: the final figures
            finally:  # and the tiers: a second close() has nothing left to do
                self._finalizer()
                self.closed = True

    def __enter__(self) -> TieredCache:
        return self

    def copy_refusal(self) -> Exception:
        return InvalidConfigError(_NOT_COPIED)

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -------------------------------------------------------------------------- layers and forwards
    def begin_layer(self, index: int, key_states: torch.Tensor, forward: bool = True) -> KVStore:
        """A layer's update (``forward``) or import begins: the store, built on the first K/V's device. Layer 0's
        update begins a forward (with recurrent state, the forward's first use of any layer does: :meth:`enter`)."""
        if self.closed:
            raise closed_error()
        store = self.runtime.open_store(key_states)
        if forward and index == 0 and not self.stateful:
            self.begin_forward()
        return store

    def refuse_repeated(self, layer: TieredLayer) -> None:
        """``layer`` (a K/V layer after the first) was the last one updated and is updated again within one forward:
        an encoder-decoder model given this cache alone, whose self- and cross-attention both update it (which
        mixed the encoder's K/V into every layer so far). Refused (:meth:`_take_back_refused`)."""
        outcome = self._take_back_refused()
        raise InvalidConfigError(
            f"layer {layer.position} was updated twice in one forward, as an encoder-decoder model (T5, BART, "
            "Whisper) updates each decoder layer given one cache for both its self- and cross-attention; tierkv "
            "holds the self-attention K/V: pass cache.encoder_decoder() (EncoderDecoderCache(cache, DynamicCache())). "
            f"{outcome}")

    def refuse_uneven(self, layer: TieredLayer, tokens: int) -> None:
        """``layer`` appends ``tokens`` in a forward whose first K/V layer appended another count: a layer that
        caches other K/V than the step's own (Mllama's cross-attention keeps the image's, and reads it back on
        later steps without an update). Refused (:meth:`_take_back_refused`)."""
        first = self.forward.tokens
        skipped = [other.position for other in self.kv_layers if other.position < layer.position
                   and not TieredLayer.get_seq_length(other)]
        outcome = self._take_back_refused()
        if skipped and self.runtime.num_layers is None:
            raise InvalidConfigError(
                f"this model never updated the cache's layer {skipped[0]} while it updates layer {layer.position}: not "
                "every model layer is an attention layer that uses the cache (a hybrid such as RecurrentGemma), which "
                f"a cache built without config= cannot tell. Build it with TieredCache(config=model.config, ...). "
                f"{outcome}")
        raise InvalidConfigError(
            f"layer {layer.position} cached {tokens} tokens in a forward whose first layer cached {first}: it keeps "
            "other K/V than the step's own, as a decoder's cross-attention layers keep an image's (Mllama) and read "
            "it back later without updating the cache; TieredCache holds each step's self-attention K/V only. Use "
            f"transformers' DynamicCache for this model. {outcome}")

    def _take_back_refused(self) -> str:
        """Undo what a forward refused at a layer took: an encoder-decoder's second update of layer 0 began it (the
        layers hold its encoder's K/V, none of it the sequence's): the cache is emptied; else the layers that took
        its step give it back, every token accepted before it staying. What happened, for the refusal's message."""
        if self.forward.may_repeat:
            self.reset()
            return "This cache was emptied."
        return self._take_back_part() or "Nothing changed."

    def _take_back_part(self, beyond: bool = False) -> str:
        """A forward refused part-way: the layers that took its step give it back; what happened, for the refusal's
        message ("": nothing). A complete forward keeps its tokens (the refused call took nothing), unless the call
        continues it (``beyond``: a layer past every layer, as a model with more layers than the config's updates
        next)."""
        forward = self.forward
        if not (forward.taken_in_part(self.holding, self.uses_per_forward()) or beyond and forward.layers_updated):
            return ""
        first = self.kv_layers
        self.roll_back(first[0].length_before if first else 0)
        return f"The layers that took this forward's step gave it back: the cache holds {self.get_seq_length()} tokens."

    def _leave_skipped_state(self, position: int) -> None:
        """A K/V update at model layer ``position`` in a forward that did not touch the state of a layer before it:
        the model keeps its recurrent layers' state in its own modules (RecurrentGemma), though its config lists
        them as linear-attention layers. A model runs its layers in order and its recurrent layers one code, so
        every layer that keeps state alone becomes an empty one, which a forward does not count."""
        number = self.forward.number
        if not any(type(other) is StateLayer and other.position < position and other.saved_in != number
                   for other in self.layers):
            return
        self.layers[:] = cast(list, [DummyLayer() if type(other) is StateLayer else other for other in self.layers])
        self.state_in_model = True

    def begin_forward(self) -> None:
        """A forward begins: the previous one is complete (its full blocks are persisted), or it stopped part-way
        and its layers are rolled back (:meth:`Forward.begin`)."""
        if self.closed:
            raise closed_error()
        self.edits += 1
        self.fully_masked.forget()
        if self.unentered is not None and self.unentered.made_here():
            engagement, self.unentered = self.unentered, None
            engagement.refuse()
        self.forward.begin(self.holding, self.runtime, self.uses_per_forward())
        if self.session is not None:
            self.session.began(self.get_seq_length())
            self.session.collect(self, wait=False)  # never waits for a slow store: persistence lags instead

    def settle_stopped(self) -> bool:
        """Before an edit between forwards: a forward that stopped part-way is rolled back first
        (:meth:`Forward.settle_stopped`); whether it was."""
        return self.forward.settle_stopped(self.holding, self.runtime, self.uses_per_forward())

    def roll_back(self, length: int) -> None:
        """A forward failed (or was refused) at some layer: every layer gives back what it took, to ``length``."""
        drop_hand_over(self)
        self.forward.roll_back(self.holding, self.runtime, length)

    def ensure_layers(self, count: int) -> None:
        while len(self.layers) < count:
            self.layers.append(TieredLayer(self, len(self.layers)))

    def _layers_of(self, config: PreTrainedConfig) -> list[Any]:
        """One layer per model layer, of its kind: K/V in the tiers (numbered in store order), recurrent state on
        the device, both, or nothing."""
        layers: list[Any] = []
        held = 0  # layers that hold K/V so far: the store's layer index
        for position, kind in enumerate(sizing.layer_kinds(config)):
            if kind is None:
                layers.append(DummyLayer())
            elif not kind.kv:
                layers.append(StateLayer(self, position, kind.states))
            else:
                layers.append(HybridLayer(self, position, held, kind.window, kind.states) if kind.states
                              else TieredLayer(self, held, kind.window, position))
                held += 1
        self.runtime.num_layers = held  # the layer count is known before the first pass
        return layers

    def set_layers(self, windows: list[int | None]) -> None:
        """Layers of these sliding windows (None: full attention), as a saved conversation had them."""
        self.layers = [TieredLayer(self, i, window) for i, window in enumerate(windows)]
        self.runtime.num_layers = len(windows)

    @property
    def batch_size(self) -> int:
        store = self.runtime.store
        rows = [store.batch_size(layer) for layer in store.layouts] if store is not None else []
        rows += [state.shape[0] for layer in self.layers if isinstance(layer, StateLayer)
                 for state in (*layer.conv_states.values(), *layer.recurrent_states.values()) if state is not None]
        return max(rows, default=0)

    def _add_layers(self, layer_idx: int) -> None:
        """Layers up to ``layer_idx`` (an int >= 0: :func:`_checked_update`; a model seen without ``config=``);
        refused beyond the config's count."""
        if self.runtime.num_layers is not None:
            raise InvalidConfigError(
                f"layer_idx {layer_idx} is beyond the {len(self.layers)} layers of the config this cache was built "
                "with; pass the config of the model that uses the cache (config=model.config), or build the cache "
                "without config=."
            )
        if layer_idx >= MAX_LAYERS:
            raise InvalidConfigError(
                f"layer_idx {layer_idx} is beyond the {MAX_LAYERS:,} layers a TieredCache holds (no model has as many: "
                "a model's layer index, from 0, is expected); nothing changed.")
        self.ensure_layers(layer_idx + 1)

    def _row_indices(self, indices: object) -> list[int]:
        """The rows ``indices`` names, as transformers' caches take them: a 1-D tensor or list of row numbers
        (negative ones count from the end) or a boolean mask with one entry per row; anything else is refused
        before a row changes (a 2-D index would select K/V and recurrent state apart)."""
        try:
            index: torch.Tensor | None = torch.as_tensor(indices)
        except (TypeError, ValueError, RuntimeError):
            index = None
        batch = self.batch_size
        if index is not None and index.dtype == torch.bool:
            if index.dim() != 1 or (batch and index.numel() != batch):
                raise InvalidConfigError(f"a boolean row mask needs one entry per row of the batch ({batch}), got "
                                         f"shape {tuple(index.shape)}; nothing changed.")
            index = index.nonzero().flatten()
        if index is None or index.dim() != 1 or index.is_floating_point() or index.is_complex():
            given = type(indices).__name__ if index is None else f"{index.dtype} of shape {tuple(index.shape)}"
            raise InvalidConfigError(f"batch rows are chosen by a 1-D tensor of row numbers or a boolean mask, got "
                                     f"{given} (e.g. cache.batch_select_indices(torch.tensor([0, 2]))); nothing "
                                     "changed.")
        rows = index.tolist()
        if batch:
            wrong = [row for row in rows if not -batch <= row < batch]
            if wrong:
                raise IndexError(f"row {wrong[0]} is out of range for a batch of {batch} rows; nothing changed.")
            rows = [row % batch for row in rows]
        return rows

    def _select_rows(self, indices: Sequence[int]) -> None:
        rows = torch.tensor(list(indices), dtype=torch.long)
        with self.using:
            if self.closed:
                raise closed_error()
            self.using.wait_turn()
            self.settle_stopped()
            self.edits += 1
            for layer in self.layers:
                if isinstance(layer, StateLayer):
                    layer.select_rows(rows)
            if self.runtime.store is None:
                return
            self.runtime.invalidate()
            self.runtime.store.select_rows(list(indices))
            if self.session is not None:
                self.session.select_rows(indices)
