"""Sizes and checks from a model config: the device budget a context needs, KV bytes, and argument checks.

What :class:`~tierkv.hf.cache.TieredCache` needs to know about a transformers config (its layer types and
windows, KV layout) and the checks it runs when it is built, so a mistake is reported at construction, not at
the first ``generate``. The staging arithmetic itself is :mod:`tierkv.staging` (shared with the planner).
"""

from __future__ import annotations

import functools
import importlib
import math
import operator
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache

from tierkv import accel
from tierkv import staging as sizes
from tierkv.attention.streaming import DEFAULT_CHUNK_TOKENS
from tierkv.errors import InvalidConfigError
from tierkv.layout import BlockLayout
from tierkv.ram import memory_filesystem
from tierkv.units import MAX_CHUNK_TOKENS, format_bytes

if TYPE_CHECKING:
    from tierkv.attention.sparse import SparseBudget

try:  # transformers >= 5.x (after 5.0): how its caches read layer types from a config
    from transformers.cache_utils import get_layer_types_and_kwargs
except ImportError:  # 5.0: DynamicCache inlines the same rule (see _layer_types_of_config)
    get_layer_types_and_kwargs = None  # type: ignore[assignment]
try:  # recurrent state held by cache layers (earlier releases' hybrid models bring their own cache)
    from transformers.cache_utils import LinearAttentionLayer
except ImportError:
    LinearAttentionLayer = None  # type: ignore[assignment,misc]
# and read through the cache's methods (5.17's models reach into the layers' tensors, which no rollback could see)
HOLDS_STATE = LinearAttentionLayer is not None and all(
    hasattr(Cache, name) for name in ("get_conv_state", "get_recurrent_state", "increase_count"))

DEFAULT_BLOCK_TOKENS = 256
DEFAULT_DISK_FRACTION = 0.9  # of free space under disk_dir, when disk_gb is None
SLIDING_TYPES = ("sliding_attention", "chunked_attention")
STATE_TYPES = ("linear_attention", "conv")  # recurrent or convolution state only, no K/V
BOTH_TYPES = ("hybrid", "hybrid_sliding")  # state and K/V in one layer


# ------------------------------------------------------------------------------------------ device budgets
def _zero_without_kv(size: Callable[..., int]) -> Callable[..., int]:
    """A model none of whose layers holds K/V (Mamba: recurrent state only) needs no device bytes for it."""
    @functools.wraps(size)
    def sized(config: PreTrainedConfig, *args: Any, **kwargs: Any) -> int:
        check_model_config(config)
        return size(config, *args, **kwargs) if layer_windows(config) else 0
    return sized


@_zero_without_kv
def min_device_bytes(config: PreTrainedConfig, context: int, batch: int = 1,
                     block_tokens: int = DEFAULT_BLOCK_TOKENS, prefetch_depth: int = 1,
                     dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> int:
    """Smallest ``gpu_gb`` (in bytes) that decodes ``context`` tokens reading ``prefetch_depth`` layers ahead:
    staging for the largest layer (``prefetch_depth + 1`` buffers of one layer's full K/V, with 25% growth
    headroom, and one more for each layer whose K/V later layers reuse: :func:`kv_producers`), one tail block per
    (row, layer), and on CUDA (``device``; default: CUDA if available) the two landing buffers. A cache built with
    ``prefetch_depth=0`` (no layer read ahead: slower) needs ``prefetch_depth=0``'s number. Bytes, not GB: pass
    it on as ``gpu_gb=f"{n}B"``."""
    context, batch, block_tokens, prefetch_depth = check_sizing(
        config, dtype, device, context=context, batch=batch, block_tokens=block_tokens, prefetch_depth=prefetch_depth)
    layout = layout_of_config(config, block_tokens, dtype)
    buffers = prefetch_depth + len(kv_producers(config))  # + 1: gather_staging_bytes counts the attended one
    staging = sizes.gather_staging_bytes(batch, context, layout.token_bytes, block_tokens, buffers)
    tails = sizes.open_tail_bytes(len(layer_windows(config)), batch, layout.slot_bytes)
    return device_minimum(staging, tails, layout.slot_bytes, device)


@_zero_without_kv
def min_streaming_device_bytes(config: PreTrainedConfig, batch: int = 1, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                               chunk_tokens: int = DEFAULT_CHUNK_TOKENS, dtype: torch.dtype | None = None,
                               device: str | torch.device | None = None) -> int:
    """Smallest ``gpu_gb`` (bytes) for ``cache.streaming``: two chunk buffers plus the open tail blocks (and
    the landing buffers on CUDA) — independent of the context length. Bytes, not GB: pass it on as
    ``gpu_gb=f"{n}B"``."""
    batch, block_tokens, chunk_tokens = check_sizing(config, dtype, device, batch=batch, block_tokens=block_tokens,
                                                     chunk_tokens=chunk_tokens)
    _refuse_two_widths(config, "streaming")
    layout = layout_of_config(config, block_tokens, dtype)
    staging = sizes.streaming_staging_bytes(batch, chunk_tokens, layout.token_bytes, block_tokens)
    tails = sizes.open_tail_bytes(len(layer_windows(config)), batch, layout.slot_bytes)
    return device_minimum(staging, tails, layout.slot_bytes, device)


@_zero_without_kv
def min_split_device_bytes(config: PreTrainedConfig, batch: int = 1, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                           chunk_tokens: int = DEFAULT_CHUNK_TOKENS, dtype: torch.dtype | None = None,
                           device: str | torch.device | None = None) -> int:
    """Smallest ``gpu_gb`` (bytes) for ``cache.split``: exact decoding that attends every tier's blocks where they
    live needs on the device only the open tail blocks (and on CUDA the query, the host part's (out, lse), the
    device share's bounded scratch and the landing buffers); the prefill streams in ``chunk_tokens`` chunks
    (two chunk buffers). Independent of the context (:func:`tierkv.staging.split_device_minimum`). Bytes, not
    GB: pass it on as ``gpu_gb=f"{n}B"``."""
    batch, block_tokens, chunk_tokens = check_sizing(config, dtype, device, batch=batch, block_tokens=block_tokens,
                                                     chunk_tokens=chunk_tokens)
    _refuse_two_widths(config, "split")
    layout = layout_of_config(config, block_tokens, dtype)
    text = config.get_text_config(decoder=True)
    accelerated = accel.backend(device_of(device)).streams
    return sizes.split_device_minimum(len(layer_windows(config)), batch, text.num_attention_heads, layout.kv_heads,
                                      layout.head_dim, layout.dtype.itemsize, block_tokens, chunk_tokens,
                                      accelerated)


def kv_bytes_per_token(config: PreTrainedConfig, dtype: torch.dtype | None = None) -> int:
    """K and V bytes of one token across all layers that hold KV (every one counted, as full attention)."""
    check_sizing(config, dtype)
    return sum(layout.token_bytes for layout in layer_layouts(config, 1, dtype))


def kv_bytes_held(config: PreTrainedConfig, tokens: int, dtype: torch.dtype | None = None) -> int:
    """K and V bytes the cache holds after ``tokens`` tokens: a sliding-window layer keeps only its window
    (Gemma 3 270M at 16K: 15 of its 18 layers hold 512 tokens), so this is what the tiers must hold."""
    (tokens,) = check_sizing(config, dtype, tokens=tokens)
    return sum(layout.token_bytes * (min(tokens, window) if window else tokens)
               for layout, window in zip(layer_layouts(config, 1, dtype), layer_windows(config), strict=True))


@_zero_without_kv
def min_sparse_device_bytes(config: PreTrainedConfig, context: int, tokens: int | float = 0.1, batch: int = 1,
                            block_tokens: int = DEFAULT_BLOCK_TOKENS, page_tokens: int | None = None,
                            rest_bits: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                            dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                            record_past: bool = False) -> int:
    """Smallest ``gpu_gb`` (bytes) for ``cache.sparse(model, tokens=tokens)`` up to ``context`` tokens: the prefill's
    two streaming chunks, one layer's selection, a column of blocks to summarise, the summaries and rest copy of
    every full block (their tables grow in 25% steps, at least 8 rows a layer) and the open tails (and on CUDA the
    landing buffers). ``rest_bits``: None for ``cache.sparse``'s default. ``record_past``: sliding-window layers
    keep their whole past (after ``cache.activate_past_recording()``, until the next crop), summarised as full
    layers'. Bytes, not GB: pass it on as ``gpu_gb=f"{n}B"``."""
    (chunk_tokens,) = check_sizing(config, dtype, device, chunk_tokens=chunk_tokens)  # the others: sparse_table_bytes
    _refuse_two_widths(config, "sparse")
    tables = sparse_table_bytes(config, context, tokens, batch, block_tokens, page_tokens, rest_bits, dtype,
                                record_past)
    budget = _sparse_budget(config, tokens, rest_bits, page_tokens)
    layout = layout_of_config(config, block_tokens, dtype)
    selection = math.ceil(batch * (budget.budget_tokens(context) + block_tokens) * layout.token_bytes * sizes.GROWTH)
    backfill = batch * layout.slot_bytes  # a column of blocks full before the summaries began, read to summarise
    staging = sizes.streaming_staging_bytes(batch, chunk_tokens, layout.token_bytes, block_tokens) + selection \
        + backfill
    tails = sizes.open_tail_bytes(len(layer_windows(config)), batch, layout.slot_bytes)
    return device_minimum(staging + tables, tails, layout.slot_bytes, device)


def sparse_table_bytes(config: PreTrainedConfig, context: int, tokens: int | float = 0.1, batch: int = 1,
                       block_tokens: int = DEFAULT_BLOCK_TOKENS, page_tokens: int | None = None,
                       rest_bits: int | None = None, dtype: torch.dtype | None = None,
                       record_past: bool = False) -> int:
    """Device bytes of the key summaries and rest copy that ``cache.sparse(model, tokens=tokens)`` holds up to
    ``context`` tokens (:mod:`tierkv.store.summaries`): a table per layer with a row per full block it holds (a
    sliding-window layer: its window and the block it is filling; with ``record_past``, everything), grown in 25%
    steps, at least 8 rows. The part
    of :func:`min_sparse_device_bytes` that grows with the context; ``stats()["sparse"]`` reports what is held
    (``summaries_device_bytes`` + ``rest_copy_device_bytes``)."""
    context, batch, block_tokens = check_sizing(config, dtype, context=context, batch=batch, block_tokens=block_tokens)
    if not isinstance(record_past, bool):
        raise InvalidConfigError(f"record_past must be True or False, got {record_past!r}.")
    budget = _sparse_budget(config, tokens, rest_bits, page_tokens)
    pages = block_tokens // budget.page_size(block_tokens)

    def row(layout: BlockLayout) -> int:
        elem = layout.dtype.itemsize
        return layout.kv_heads * layout.head_dim * sizes.summary_element_size(elem) * 4 * pages \
            + sizes.rest_copy_bytes(block_tokens * layout.token_bytes, budget.rest_bits, elem, layout.head_dim)

    held = [min(context, window + block_tokens) if window and not record_past else context
            for window in layer_windows(config)]
    return sum(sizes.summary_table_rows(batch, n, block_tokens) * row(layout)
               for n, layout in zip(held, layer_layouts(config, block_tokens, dtype), strict=True))


def rest_bits_for(config: PreTrainedConfig | None, rest_bits: int | None) -> int:
    """The rest copy's bits for ``cache.sparse(model, rest_bits=)``: ``rest_bits``, refused where it does not pack
    every layer's head dim into whole bytes; None: :data:`~tierkv.staging.DEFAULT_REST_BITS`, or 8 bits where
    the default does not pack (an odd head dim)."""
    from tierkv.staging import DEFAULT_REST_BITS

    if rest_bits is not None and (isinstance(rest_bits, bool) or not isinstance(rest_bits, int)
                                  or rest_bits not in sizes.REST_BITS):
        raise InvalidConfigError(f"sparse rest_bits={rest_bits!r}: give one of {', '.join(map(str, sizes.REST_BITS))} "
                                 "(0: the blocks not read are not attended), or None for the default.")
    dims = sorted({layout.head_dim for layout in layer_layouts(config, 1, None)}) if config is not None else []
    bits = DEFAULT_REST_BITS if rest_bits is None else rest_bits
    odd = [dim for dim in dims if dim * bits % 8]
    if odd and rest_bits is None:
        return 8
    if odd:
        raise InvalidConfigError(
            f"sparse rest_bits={rest_bits} packs {8 // bits} codes a byte, which does not divide this model's head "
            f"dim {odd[0]}: use rest_bits=8 (or 0: no rest copy), or leave rest_bits unset.")
    return bits


def _sparse_budget(config: PreTrainedConfig, tokens: int | float, rest_bits: int | None,
                   page_tokens: int | None) -> SparseBudget:
    """``cache.sparse``'s budget for these arguments (``rest_bits`` None: its default for ``config``)."""
    from tierkv.attention.sparse import SparseBudget

    return SparseBudget(tokens, rest_bits=rest_bits_for(config, rest_bits), page_tokens=page_tokens)


@_zero_without_kv
def rest_copy_bytes(config: PreTrainedConfig, tokens: int, rest_bits: int | None,
                    dtype: torch.dtype | None = None) -> int:
    """Device bytes of the ``rest_bits`` copy that ``cache.sparse(..., rest_bits=)`` keeps of ``tokens``
    tokens' K/V (every layer): to add to ``gpu_gb`` besides the key summaries. ``rest_bits``: one that
    ``cache.sparse`` takes (None: its default for ``config``)."""
    (tokens,) = check_sizing(config, dtype, tokens=tokens)
    bits = rest_bits_for(config, rest_bits)
    layout = layout_of_config(config, 1, dtype)
    kv_bytes = kv_bytes_per_token(config, dtype) * tokens
    return sizes.rest_copy_bytes(kv_bytes, bits, layout.dtype.itemsize, layout.head_dim)


def _refuse_two_widths(config: PreTrainedConfig, executor: str) -> None:
    """Refuse sizing ``cache.<executor>`` for a model whose layers cache keys and values of two head dims: the
    executor attends K/V of one (:meth:`TieredLayer.update` refuses the model), so no budget would run it."""
    widths = next(filter(None, (kv_widths(layer, sliding) for _, layer, sliding in _kv_layers(config))), None)
    if widths is not None:
        raise InvalidConfigError(
            f"this model caches keys of {widths[0]} and values of {widths[1]} dims; cache.{executor} attends "
            "stored K/V of one head dim, so it cannot run this model at any budget. Decode it with exact gather "
            "(no executor block) and size that with TieredCache.min_device_bytes.")


def device_minimum(staging: int, tails: int, slot_bytes: int, device: str | torch.device | None) -> int:
    """The smallest budget for ``staging`` beside ``tails`` (:func:`tierkv.staging.device_minimum`), plus on CUDA
    (``device``; None: CUDA if available) the two landing buffers (:func:`tierkv.staging.landed_device_minimum`)."""
    if not accel.backend(device_of(device)).streams:  # CUDA (or its stand-in): landing buffers too
        return sizes.device_minimum(staging, tails)
    return sizes.landed_device_minimum(staging, tails, slot_bytes)


# ---------------------------------------------------------------------------------------- config reading
def layout_of_config(config: PreTrainedConfig, block_tokens: int, dtype: torch.dtype | None) -> BlockLayout:
    """The largest layer's block layout (staging holds any layer's K/V)."""
    return max(layer_layouts(config, block_tokens, dtype), key=lambda layout: layout.token_bytes)


def layer_layouts(config: PreTrainedConfig, block_tokens: int, dtype: torch.dtype | None) -> list[BlockLayout]:
    """The block layout of each layer that holds KV. A heterogeneous config (transformers' ``per_layer_config``:
    Gemma 4's full-attention layers have wider heads than its sliding ones) gives each layer its own, as do the
    sliding layers of a config with ``swa_*`` fields (Inkling) or whose attention keeps other KV heads (MiMo)."""
    text = config.get_text_config(decoder=True)
    dtype = check_dtype(dtype) or check_dtype(getattr(text, "dtype", None), name="config.dtype") or torch.float32
    layers = _kv_layers(config)
    heads = _attention_kv_heads(text) if len({sliding for _, _, sliding in layers}) > 1 else {}
    shapes = [_stored_shape(layer, sliding, heads.get(i)) for i, layer, sliding in layers]
    layouts = {shape: BlockLayout(*shape, block_tokens, dtype) for shape in set(shapes)}
    return [layouts[shape] for shape in shapes]


def kv_shapes(config: PreTrainedConfig) -> list[tuple[int, int]]:
    """``(KV heads, head dim)`` of each layer that holds K/V, as the cache stores them (:func:`layer_layouts`)."""
    return [(layout.kv_heads, layout.head_dim) for layout in layer_layouts(config, 1, None)]


def _kv_layers(config: PreTrainedConfig) -> list[tuple[int, Any, bool]]:
    """Each layer that holds K/V: its index, its config (a heterogeneous config's ``per_layer_config``, else the
    text config) and whether it is a sliding-window one."""
    text = config.get_text_config(decoder=True)
    per_layer = getattr(text, "is_heterogeneous", False)
    return [(i, text.per_layer_config[i] if per_layer else text, kind.window is not None)
            for i, kind in enumerate(layer_kinds(config)) if kind is not None and kind.kv]


def _stored_shape(config: Any, sliding: bool = False, kv_heads: int | None = None) -> tuple[int, int]:
    """(KV heads, head dim) of what a layer of ``config`` stores (``sliding``: a sliding-window layer, which
    ``swa_*`` fields size where given; ``kv_heads``: its attention module's count, where read). Multi-head
    latent attention (``kv_lora_rank``) caches, where the installed transformers expands its K/V after the cache
    (``expand_kv``), its latent and its rotary key as one head of ``kv_lora_rank`` and ``qk_rope_head_dim`` dims,
    else the expanded keys and values per head; keys and values of two widths are stored at the wider
    (:meth:`TieredLayer.update`)."""
    widths = kv_widths(config, sliding)
    if kv_heads is None:
        kv_heads = 1 if getattr(config, "kv_lora_rank", None) and _expands_after_cache(config.model_type) \
            else _field(config, sliding, "num_key_value_heads") or _query_heads(config, sliding)
    return kv_heads, max(widths) if widths is not None else _key_width(config, sliding)


def layer_kv_widths(config: PreTrainedConfig) -> dict[int, tuple[int, int] | None]:
    """:func:`kv_widths` of each layer that holds K/V, by layer index: from its own config where the config is
    heterogeneous (Gemma 4: the global fields are ambiguous there), a sliding layer's from its ``swa_`` fields."""
    return {i: kv_widths(layer, sliding) for i, layer, sliding in _kv_layers(config)}


def kv_widths(config: Any, sliding: bool = False) -> tuple[int, int] | None:
    """The head dims of the keys and the values a layer of ``config`` caches (``sliding``: a sliding-window one)
    where they differ, else None: multi-head latent attention (:func:`_stored_shape`), or values of their own
    ``v_head_dim`` (MiMo-V2-Flash; ``swa_v_head_dim`` for sliding layers)."""
    if getattr(config, "kv_lora_rank", None):
        if _expands_after_cache(config.model_type):
            return config.kv_lora_rank, config.qk_rope_head_dim
        return config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    keys = _key_width(config, sliding)
    values = _field(config, sliding, "v_head_dim") or keys
    return None if values == keys else (keys, values)


def _key_width(config: Any, sliding: bool) -> int:
    """The head dim of the keys of a layer of ``config`` (``sliding``: a sliding-window one)."""
    return (_field(config, sliding, "head_dim")
            or getattr(config, "dim_head", None)  # CPM-Ant spells it dim_head
            or config.hidden_size // _query_heads(config, sliding))


def _query_heads(config: Any, sliding: bool) -> int:
    """The attention heads of a layer of ``config``; a config that names none (RWKV's, xLSTM's) is refused."""
    heads = _field(config, sliding, "num_attention_heads")
    if not isinstance(heads, int):
        raise InvalidConfigError(
            f"this {config.model_type!r} config names no attention heads (num_attention_heads), so the K/V its "
            "layers would cache cannot be sized. A model that keeps no K/V in the cache (RWKV and xLSTM keep "
            "their own state) needs no TieredCache budget: use transformers' default cache for it; for one that "
            "does, give its config num_attention_heads, num_key_value_heads and head_dim.")
    return heads


def _field(config: Any, sliding: bool, name: str) -> Any:
    """``config``'s ``name``, or for a sliding-window layer its ``swa_`` variant where the config gives one."""
    return (sliding and getattr(config, f"swa_{name}", None)) or getattr(config, name, None)


def _attention_kv_heads(config: PreTrainedConfig) -> dict[int, int]:
    """The KV head count of each layer's attention module, by layer index, where the model sets its own per layer
    type beyond its config (MiMo-V2-Flash's sliding layers double ``num_key_value_heads``): read from the modules
    the installed transformers builds for ``config`` on the meta device (no memory), each naming its count
    (``num_key_value_heads``) or its query heads per KV head (``num_key_value_groups``). Empty where the model
    cannot be built so (its config's fields size it)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - not a causal LM of this release, or one that needs more: the config's fields
        return {}
    heads: dict[int, int] = {}
    for module in model.modules():
        index, kv, groups = (getattr(module, name, None)
                             for name in ("layer_idx", "num_key_value_heads", "num_key_value_groups"))
        if not isinstance(index, int) or not hasattr(module, "head_dim"):
            continue
        if isinstance(kv, int):
            heads[index] = kv
        elif isinstance(groups, int) and groups > 0:
            queries = getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None) \
                or getattr(getattr(module, "config", None), "num_attention_heads", None)
            if isinstance(queries, int):
                heads[index] = queries // groups
    return heads


@functools.cache  # per model type, for the installed transformers: sizing asks it per layer
def _expands_after_cache(model_type: str) -> bool:
    """Whether the installed transformers' attention of ``model_type`` caches the latent and expands it after (in
    the modeling code its causal LM lives in: Sarvam-MLA's is DeepSeek-V3's)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lm = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""), None)
    try:
        module = importlib.import_module(causal_lm.__module__ if isinstance(causal_lm, type)
                                         else f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:  # not a model of this release: the expanded form, the larger, sizes no budget too small
        return False
    return any(callable(getattr(kind, "expand_kv", None)) for kind in vars(module).values() if isinstance(kind, type))


def layer_types(config: PreTrainedConfig) -> tuple[list[str], list[dict[str, Any]]]:
    """Per-layer attention types and kwargs from transformers, across its 5.x releases: some return one
    kwargs dict per layer, others (5.17) one dict of per-layer lists or shared values; 5.0 has no such
    function (its DynamicCache's rule is replayed)."""
    if get_layer_types_and_kwargs is None:
        kinds, kwargs = _layer_types_of_config(config)
    else:
        kinds, kwargs = get_layer_types_and_kwargs(config)
    kinds = list(kinds) if kinds else ["full_attention"] * config.num_hidden_layers
    if isinstance(kwargs, dict):
        def value(item: Any, i: int) -> Any:
            return item[i] if isinstance(item, (list, tuple)) else item

        kwargs = [{key: value(item, i) for key, item in kwargs.items()} for i in range(len(kinds))]
    kwargs = list(kwargs) if kwargs else [{} for _ in kinds]
    shared = _kv_shared_layers(config)
    if shared and kinds[-shared:] == ["dummy"] * shared:  # layers that reuse earlier layers' K/V hold no cache
        kinds, kwargs = kinds[:-shared], kwargs[:-shared]
    if "sliding_window" not in {key for kw in kwargs for key in kw} and getattr(config, "sliding_window", None):
        kwargs = [{**kw, "sliding_window": config.sliding_window} for kw in kwargs]
    return kinds, kwargs


@dataclass(frozen=True)
class LayerKind:
    """What one model layer keeps in its cache: attention K/V (with its sliding window, None: full), recurrent
    state (``states``: its count of convolution states, each with a recurrent one where the model makes it), or
    both (Falcon-H1's parallel blocks)."""

    kv: bool
    window: int | None = None
    states: int = 0


_ENCODER_NAME = re.compile(r"vision|visual|audio|speech|image|video|encoder", re.IGNORECASE)


def _is_an_encoder(config: PreTrainedConfig) -> bool:
    """Whether ``config`` is a multimodal model's vision or audio tower's (SigLIP, CLIP, a Whisper-style audio
    encoder): no vocabulary, and a class or model type that says so. Every decoder has a vocabulary."""
    if getattr(config, "vocab_size", None) is not None:
        return False
    return bool(_ENCODER_NAME.search(f"{type(config).__name__} {getattr(config, 'model_type', '')}"))


def layer_kinds(config: PreTrainedConfig) -> list[LayerKind | None]:
    """Each model layer's cache (None: a layer that keeps nothing, an MoE or MLP block); other kinds are refused.
    Recurrent state (Mamba, gated delta nets, short convolutions) needs :data:`HOLDS_STATE`."""
    text = config.get_text_config(decoder=True)
    if not isinstance(getattr(text, "num_hidden_layers", None), int):
        raise InvalidConfigError(
            f"this {type(text).__name__} names no decoder layers (num_hidden_layers): it is not the config of a "
            "model that decodes with a K/V cache (a vision or audio encoder's?); pass the language model's config "
            "(model.config of the model given the cache).")
    if _is_an_encoder(text):
        raise InvalidConfigError(
            f"this {type(text).__name__} is the config of a vision or audio encoder (it has layers but no "
            "vocabulary: it reads pixels or sound, not tokens), which keeps nothing in a K/V cache; sized or decoded "
            "with it, the cache would take the encoder's layers for the language model's. Pass the model's own "
            "config (config=model.config), or its text model's: model.config.text_config or "
            "model.config.get_text_config().")
    crossing = getattr(text, "cross_attention_layers", None)
    if crossing:
        raise InvalidConfigError(
            f"this model's layers {list(crossing)[:16]} attend over an image's K/V kept in the cache (cross-attention, "
            "as Mllama's), which they read back on later steps without updating it; TieredCache holds each step's "
            "self-attention K/V only. To run it, use transformers' DynamicCache.")
    kinds, kwargs = layer_types(text)
    known = {"full_attention", *SLIDING_TYPES, *(("dummy",) + STATE_TYPES + BOTH_TYPES if HOLDS_STATE else ())}
    unsupported = sorted(set(kinds) - known)
    if unsupported:
        state = set(unsupported) & {*STATE_TYPES, *BOTH_TYPES}
        fix = ("install a transformers release whose cache holds recurrent state by layer (5.25 does: pip install -U "
               "transformers), or use transformers' DynamicCache" if len(state) == len(unsupported)
               else "use transformers' DynamicCache for this architecture")
        raise InvalidConfigError(
            f"this model has {', '.join(unsupported)} layers; TieredCache holds full and sliding-window attention K/V "
            f"and, with a recent transformers, linear-attention and convolution state. To run it, {fix}.")
    result: list[LayerKind | None] = []
    for kind, kw in zip(kinds, kwargs):
        window = kw.get("sliding_window") if kind in (*SLIDING_TYPES, "hybrid_sliding") else None
        states = kw.get("number_of_states", 1) if kind in (*STATE_TYPES, *BOTH_TYPES) else 0
        result.append(None if kind == "dummy" else
                      LayerKind(kind not in STATE_TYPES, window, states))
    return result


def layer_windows(config: PreTrainedConfig) -> list[int | None]:
    """The sliding window (None: full attention) of each layer that holds K/V, in order."""
    return [kind.window for kind in layer_kinds(config) if kind is not None and kind.kv]


def kv_producers(config: PreTrainedConfig) -> list[int]:
    """The layers whose K/V later layers of the same forward attend again: the last
    ``num_kv_shared_layers`` layers of Gemma 3n and Gemma 4 hold no cache and reuse the K/V that the last unshared
    layer of their attention type got from the cache's update, so what those updates return must stay valid until
    the forward ends (exact gather keeps their staging buffers: :func:`min_device_bytes` counts them)."""
    text = config.get_text_config(decoder=True)
    shared = _kv_shared_layers(text)
    if not shared or shared >= text.num_hidden_layers:
        return []
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    unshared = list(kinds[: text.num_hidden_layers - shared])
    return sorted(len(unshared) - 1 - unshared[::-1].index(kind) for kind in set(unshared))


def _kv_shared_layers(config: PreTrainedConfig) -> int:
    shared = getattr(config, "num_kv_shared_layers", None)
    return shared if isinstance(shared, int) and not isinstance(shared, bool) and shared > 0 else 0


def _layer_types_of_config(config: PreTrainedConfig) -> tuple[list[str], dict[str, Any]]:
    """transformers 5.0's ``DynamicCache(config=...)`` rule: ``layer_types``, else all sliding when the config
    has a window (or a chunk size), else all full; shared KV layers (Gemma3n) hold no cache."""
    window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        kind = "sliding_attention" if window is not None else "full_attention"
        kinds = [kind] * config.num_hidden_layers
    shared = _kv_shared_layers(config)
    if shared:
        kinds = kinds[:-shared]
    return list(kinds), ({"sliding_window": window} if window is not None else {})


# ------------------------------------------------------------------------------------------------ checks


def check_arguments(block_tokens: object, prefetch_depth: object, config: object, disk_dir: object, disk_gb: object,
                    disk_engine: object, persist: object, persist_gb: object, remote: object) -> None:
    """The checks of ``TieredCache(...)``'s arguments that need no machine (:func:`check_budgets_fit_machine`
    checks the budgets)."""
    if not isinstance(block_tokens, int) or isinstance(block_tokens, bool) or block_tokens <= 0:
        raise InvalidConfigError(f"block_tokens must be a positive int (e.g. 256), got {block_tokens!r}.")
    if prefetch_depth != "auto" and (isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int)
                                     or prefetch_depth < 0):
        raise InvalidConfigError(f"prefetch_depth must be an int >= 0 or 'auto', got {prefetch_depth!r}.")
    if isinstance(prefetch_depth, int) and prefetch_depth > sizes.MAX_PREFETCH_DEPTH:
        raise InvalidConfigError(f"prefetch_depth={prefetch_depth} reads that many layers ahead, each in a staging "
                                 f"buffer of a whole layer; give at most {sizes.MAX_PREFETCH_DEPTH} (1, the default, "
                                 "overlaps a layer's read with the one computing; 'auto' picks from a profile).")
    if config is not None:
        check_model_config(config)
    if isinstance(disk_dir, (str, os.PathLike)) and not os.fspath(disk_dir).strip():
        raise InvalidConfigError(f"disk_dir={os.fspath(disk_dir)!r} is an empty path (an unset variable?): give "
                                 "the directory of the disk tier, e.g. disk_dir='/path/on/nvme', or leave disk_dir "
                                 "out for no disk tier.")
    if disk_dir is None and (disk_gb is not None or disk_engine is not None):
        what = "disk_gb" if disk_gb is not None else "disk_engine"
        raise InvalidConfigError(f"{what} was given without disk_dir; pass disk_dir='/path/on/nvme' to enable "
                                 f"the disk tier, or drop {what}.")
    if not isinstance(persist, bool):
        raise InvalidConfigError(f"persist must be True or False, got {persist!r}.")
    if (persist or persist_gb is not None) and (disk_dir is None or not persist):
        raise InvalidConfigError("persist=True keeps blocks in disk_dir and persist_gb caps them; pass both "
                                 "disk_dir='/path/on/nvme' and persist=True (persist_gb is optional).")
    if remote is not None and not isinstance(remote, str):
        raise InvalidConfigError(f"remote must be a Redis URL such as 'redis://host:6379/0', got a "
                                 f"{type(remote).__name__}.")
    if disk_dir is not None:
        check_disk_engine(disk_engine)  # type: ignore[arg-type]


def check_model_config(config: object, *, name: str = "config") -> None:
    """Refuse anything but a transformers config, naming the usual slip (the model instead of ``model.config``)."""
    if isinstance(config, PreTrainedConfig):
        return
    if isinstance(getattr(config, "config", None), PreTrainedConfig):
        raise InvalidConfigError(
            f"{name}= got a {type(config).__name__} (a model); pass its config: {name}=model.config."
        )
    raise InvalidConfigError(
        f"{name}= must be a transformers PreTrainedConfig (e.g. model.config or AutoConfig.from_pretrained(path)), "
        f"not {type(config).__name__}."
    )


def check_count(value: object, *, name: str, minimum: int | None = 1) -> int:
    """``value`` as an int >= ``minimum`` (None: any): an int or numpy's or torch's integer scalar (what
    ``get_seq_length()`` may return); a bool or a float is refused (``batch=True`` is a slip, not 1)."""
    try:
        count = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        count = None
    if count is None or minimum is not None and count < minimum:
        bound = "" if minimum is None else f" >= {minimum}"
        raise InvalidConfigError(f"{name} must be an int{bound}, got {value!r}.")
    return count


_MAY_BE_ZERO = frozenset({"prefetch_depth", "tokens"})  # counts of the sizing helpers where 0 means something


def check_sizing(config: object, dtype: object = None, device: object = None, **counts: object) -> tuple[int, ...]:
    """What every public sizing helper checks before it sizes anything, so a slip is an InvalidConfigError that
    names the argument, never a wrong number or an error from inside torch: ``config`` a transformers config,
    ``dtype`` and ``device`` ones torch takes, and each count an int (``chunk_tokens`` up to
    :data:`~tierkv.units.MAX_CHUNK_TOKENS`; ``prefetch_depth`` and ``tokens`` >= 0, the others >= 1). Returns the
    counts as ints, in the order given."""
    check_model_config(config)
    checked = tuple(check_chunk_tokens(value) if name == "chunk_tokens" else
                    check_count(value, name=name, minimum=0 if name in _MAY_BE_ZERO else 1)
                    for name, value in counts.items())
    check_dtype(dtype)
    device_of(device)
    return checked


def check_chunk_tokens(value: object) -> int:
    """``chunk_tokens`` (``cache.streaming/split/sparse`` and their sizing) as an int from 1 to
    :data:`~tierkv.units.MAX_CHUNK_TOKENS`: a chunk is two device buffers of that many tokens whatever the context,
    so a longer one only asks for a budget no machine has."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidConfigError(f"chunk_tokens must be an int >= 1 (tokens per streaming chunk), got {value!r}; "
                                 f"give e.g. {DEFAULT_CHUNK_TOKENS} (the default).")
    if value > MAX_CHUNK_TOKENS:
        raise InvalidConfigError(f"chunk_tokens={value:,} is more than {MAX_CHUNK_TOKENS:,} tokens, longer than any "
                                 "model's context: each of the two chunk buffers on the device holds that many tokens "
                                 f"whatever the context; give e.g. {DEFAULT_CHUNK_TOKENS} (the default).")
    return value


def check_dtype(dtype: object, *, name: str = "dtype") -> torch.dtype | None:
    """``dtype`` as a torch dtype (None stays None): a ``torch.dtype`` or its name, ``"bfloat16"`` or
    ``"torch.bfloat16"`` (configs spell it so)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    named = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if isinstance(named, torch.dtype):
        return named
    raise InvalidConfigError(f"{name}={dtype!r} is not a torch dtype; give the K/V's dtype, e.g. torch.bfloat16, "
                             "torch.float16 or 'float32' (None: the config's).")


def device_of(device: object) -> torch.device:
    """``device`` (a ``torch.device``, or a name: ``"cuda"``, ``"cuda:1"``, ``"cpu"``) as a torch device; None: CUDA
    where it is available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError:
            pass
    raise InvalidConfigError(f"device={device!r} is not a torch device; give e.g. 'cuda', 'cuda:0' or 'cpu' (None: "
                             "CUDA where it is available).")


def check_disk_engine(engine: str | None) -> None:
    """Refuse an unknown or unloadable forced disk engine (``engine=`` or ``TIERKV_DISK_ENGINE``) up front:
    a typo such as ``"io_uring"`` would otherwise fail at the first write to the disk tier, mid-prefill."""
    from tierkv import settings
    from tierkv.io.base import EngineUnavailableError
    from tierkv.io.select import ENGINES, load_engine

    if engine is None:
        name, source = settings.get("disk_engine"), settings.source("disk_engine")
    elif isinstance(engine, str) and engine in ("auto", *ENGINES):
        name, source = engine, f"disk_engine={engine!r}"
    else:
        raise InvalidConfigError(
            f"disk_engine={engine!r} is not a disk engine; choose one of {', '.join(ENGINES)}, or 'auto' (None)."
        )
    if name == "auto":
        return
    try:
        load_engine(name)
    except EngineUnavailableError as exc:
        fix = "unset TIERKV_DISK_ENGINE (or set it to auto)" if source.startswith("TIERKV_") else \
            "use disk_engine='auto'"
        raise InvalidConfigError(
            f"disk engine {name!r} ({source}) cannot load here: {exc.reason}; {fix} to pick one that does."
        ) from exc


BYTES_AS_GB = 10**15
"""A budget from a bare number of a million GB or more: surely a byte count passed where GB are expected."""


def check_budgets_fit_machine(gpu: int | None, cpu: int | None, disk: int | None,
                              disk_dir: str | os.PathLike[str] | None, *, persist: int | None = None) -> None:
    """Refuse a budget larger than this machine could ever provide (bytes; None = not given), and a disk budget
    larger than the free space under ``disk_dir`` (it would end in ENOSPC mid-generation) — with ``persist``
    (``persist_gb``'s bytes), the disk budget and what the persistent store may still add, together.

    The usual cause is a byte count passed where GB are expected (``gpu_gb=TieredCache.min_device_bytes(...)``
    is a petabyte budget); the message says how to pass bytes.
    """
    budgets = {"gpu_gb": gpu, "cpu_gb": cpu}
    memory_backed = memory_filesystem(disk_dir) if disk_dir is not None else None
    if any(v is not None for v in budgets.values()) or memory_backed:
        memory, where = machine_memory()
        for name, nbytes in budgets.items():
            if nbytes is not None and nbytes > memory:
                fix = (f"a bare number counts GB, so pass a byte count as a string (e.g. {name}=f\"{{n}}B\")"
                       if nbytes >= BYTES_AS_GB else "give a size that fits")
                gb = f"{nbytes / 1e9:,.2f}".rstrip("0").rstrip(".") if nbytes < 10**24 else f"{nbytes / 1e9:.3g}"
                raise InvalidConfigError(f"{name} is {gb} GB ({format_bytes(nbytes)}) but this "
                                         f"machine has {where}; {fix}.")
        in_ram = {"cpu_gb": cpu} if torch.cuda.is_available() else dict(budgets)  # no GPU: the device tier is RAM
        if memory_backed and disk_dir is not None:  # its files are RAM too
            in_ram["disk_gb"] = disk if disk is not None else int(_disk_usage(disk_dir)[1] * DEFAULT_DISK_FRACTION)
        given = {name: nbytes for name, nbytes in in_ram.items() if nbytes is not None}
        if len(given) > 1 and sum(given.values()) > memory:
            parts = " and ".join(f"{name} ({format_bytes(nbytes)})" for name, nbytes in given.items())
            if memory_backed:
                why = f"disk_dir is on {memory_backed}, whose files are RAM" + ("" if disk is not None else
                                                                               ", and disk_gb defaults to 90% of it")
                fix = "give budgets that fit together (disk_gb too), or a disk_dir on a disk"
            else:
                why, fix = "without a GPU the device tier is RAM too", "give budgets that fit together"
            raise InvalidConfigError(f"{parts} together take {format_bytes(sum(given.values()))} of RAM ({why}), "
                                     f"but this machine has {where}; {fix}.")
    if disk is not None and disk_dir is not None:
        total, free = _disk_usage(disk_dir)
        if total == 0:  # a filesystem that reports no size (ramfs, some FUSE and network ones): disk_gb is the bound
            return
        if disk > total:
            raise InvalidConfigError(
                f"disk_gb is {format_bytes(disk)} but the filesystem under {os.fspath(disk_dir)!r} holds "
                f"{format_bytes(total)}; give a size that fits, or leave disk_gb unset (90% of its free space)."
            )
        if disk > free:  # it would run out of space mid-generation (ENOSPC), long after this call
            raise InvalidConfigError(
                f"disk_gb is {format_bytes(disk)} but only {format_bytes(free)} are free on the filesystem "
                f"under {os.fspath(disk_dir)!r} (of {format_bytes(total)}); free some space, give a smaller "
                "disk_gb, or leave it unset (90% of the free space)."
            )
        if persist is not None:
            check_persist_fits(disk, persist, disk_dir, free)


def check_persist_fits(disk: int, persist: int, disk_dir: str | os.PathLike[str], free: int) -> None:
    """Refuse ``disk_gb`` (``disk`` bytes) and ``persist_gb`` (``persist``) that together exceed the ``free`` bytes
    under ``disk_dir``, where the disk tier and the persistent store share its filesystem: persisted blocks would
    take the room the disk tier counts on. Only the part of ``persist`` the store does not hold yet counts (what it
    lists is already on disk)."""
    from tierkv.persist.blockfile import DIRECTORY_NAME, listed_bytes

    store = os.path.join(os.fspath(disk_dir), DIRECTORY_NAME)
    if os.path.isdir(store) and os.stat(store).st_dev != os.stat(disk_dir).st_dev:
        return  # the persistent store is another filesystem mounted there
    more = max(0, persist - listed_bytes(disk_dir))
    fitting = max(0, free - disk) + persist - more  # the persist_gb that would fit beside disk_gb
    if disk + more > free:
        raise InvalidConfigError(
            f"disk_gb ({format_bytes(disk)}) and persist_gb ({format_bytes(persist)}, {format_bytes(more)} of it not "
            f"yet on disk) share the filesystem under {os.fspath(disk_dir)!r}, where only {format_bytes(free)} are "
            f"free: persisted blocks would take the room the disk tier needs (ENOSPC mid-generation). Give them at "
            f"most {format_bytes(free)} together (e.g. lower persist_gb to {format_bytes(fitting)}), "
            "or free some space."
        )


def host_memory() -> tuple[int, int]:
    """The RAM this process may use: ``(total, available)`` bytes, the host's bounded by its cgroup's limit (a
    container's: :mod:`tierkv.ram`); a process out of file descriptors cannot read them (/proc/meminfo): a
    TierKVError that says so."""
    return _usable_memory()[:2]


def _usable_memory() -> tuple[int, int, bool]:
    from tierkv.errors import TierKVError
    from tierkv.ram import usable_memory
    from tierkv.tiers.disk import limit_advice

    try:
        return usable_memory()
    except OSError as exc:
        raise TierKVError(f"tierkv could not read this host's memory size: {limit_advice(exc) or exc}") from exc


def machine_memory() -> tuple[int, str]:
    """The largest memory one tier could use here, and how to say it: RAM (as a cgroup limits it), or the largest
    GPU if bigger."""
    ram, _, limited = _usable_memory()
    where = f"{format_bytes(ram)} of RAM" + (" (the memory limit of this process's cgroup)" if limited else "")
    if torch.cuda.is_available():
        gpu = max(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        where += f" and a {format_bytes(gpu)} GPU"
        return max(ram, gpu), where
    return ram, where + " and no GPU"


def _disk_usage(directory: str | os.PathLike[str]) -> tuple[int, int]:
    """(total, free) bytes of the filesystem that holds ``directory`` (or its nearest existing parent)."""
    path = os.path.abspath(os.fspath(directory))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    usage = shutil.disk_usage(path)
    return usage.total, usage.free
