"""KV geometry and size of the models the planner knows, from presets or a Hugging Face ``config.json``.

Plain numbers, no torch and no transformers import: ``tierkv plan`` has to answer in a fraction of a second
on any machine. The presets copy the fields of the models' published ``config.json`` files.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tierkv.errors import InvalidConfigError
from tierkv.inputs import printable, read_json

DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


MAX_LAYERS = 512
"""The most layers a model may have: four times the deepest published decoders' (~130). The auto prefetch depth
search re-plans every depth up to the layer count, so the planner's work grows with its square."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the planner needs of a decoder: KV geometry, plus the sizes that set its compute per token.

    ``sliding_layers`` of the ``layers`` attend only to the last ``sliding_window`` tokens (Gemma2/3,
    Mistral v0.1), so they hold at most that many tokens of KV whatever the context. ``intermediate_size`` is the
    MLP width a token passes through: in a mixture of experts, the experts it takes (their weights are what a
    decode step reads). ``other_layers`` hold no K/V (a hybrid's Mamba or linear-attention layers, MoE or MLP
    blocks): ``layers`` counts only those with K/V, and each of them carries an equal share of the others' weights
    (their recurrent state, constant in the context, is not planned). ``max_positions``: the context the model
    was trained for (``max_position_embeddings``; None when unknown), past which ``tierkv plan`` notes that the
    plan prices bytes, not answers.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    attention_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    sliding_layers: int = 0
    sliding_window: int | None = None
    other_layers: int = 0
    max_positions: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "layers",
            "kv_heads",
            "head_dim",
            "dtype_bytes",
            "attention_heads",
            "hidden_size",
            "vocab_size",
        ):
            if getattr(self, name) <= 0:
                raise InvalidConfigError(
                    f"model {self.name!r}: {name}={getattr(self, name)} must be positive."
                )
        if self.layers + self.other_layers > MAX_LAYERS:
            raise InvalidConfigError(f"model {self.name!r}: {self.layers + self.other_layers} layers is more than "
                                     f"the planner's {MAX_LAYERS}; give the model's real layer count.")
        if not 0 <= self.sliding_layers <= self.layers:
            raise InvalidConfigError(f"model {self.name!r}: sliding_layers must be in [0, {self.layers}].")
        if self.sliding_layers and not (self.sliding_window and self.sliding_window > 0):
            raise InvalidConfigError(f"model {self.name!r}: sliding layers need a positive sliding_window.")

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer: ``2 * kv_heads * head_dim * dtype_bytes``."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers (Llama-3-8B: 131072 = 128 KiB); sliding layers included."""
        return self.layers * self.kv_bytes_per_token_per_layer

    def tokens_held(self, layer: int, context: int) -> int:
        """Tokens of KV that ``layer`` holds while decoding at ``context``: the sliding layers come first in this
        count. The prefill holds more: :meth:`prefill_kv_bytes`."""
        if layer < self.sliding_layers and self.sliding_window is not None:
            return min(context, self.sliding_window)
        return context

    def kv_bytes(self, context: int, batch: int = 1) -> int:
        """Total KV bytes of ``batch`` sequences of ``context`` tokens."""
        tokens = sum(self.tokens_held(layer, context) for layer in range(self.layers))
        return batch * tokens * self.kv_bytes_per_token_per_layer

    def prefill_kv_bytes(self, context: int, batch: int = 1) -> int:
        """KV bytes the tiers hold at the end of a one-shot prefill of ``context`` tokens: every layer keeps the
        whole prompt until the first decode step (a sliding layer drops the blocks that left its window only once
        the step after them is committed, as a rollback may still need them: :mod:`tierkv.hf.layer`)."""
        return batch * context * self.kv_bytes_per_token

    @property
    def params_per_layer(self) -> int:
        """Weights of one decoder layer: Q/K/V/O projections and a gated (3-matrix) MLP; norms neglected (with
        ``other_layers``, their share too)."""
        q_out = self.attention_heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        attention = self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size
        return (attention + 3 * self.hidden_size * self.intermediate_size) * (self.layers + self.other_layers) \
            // self.layers

    @property
    def params_outside_layers(self) -> int:
        """Embedding and LM head (one matrix when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def params(self) -> int:
        return self.layers * self.params_per_layer + self.params_outside_layers


MODEL_PRESETS: dict[str, ModelSpec] = {
    # meta-llama/Meta-Llama-3-8B config.json
    "llama-3-8b": ModelSpec("llama-3-8b", 32, 8, 128, 2, 32, 4096, 14336, 128256, max_positions=8192),
    # meta-llama/Meta-Llama-3-70B config.json
    "llama-3-70b": ModelSpec("llama-3-70b", 80, 8, 128, 2, 64, 8192, 28672, 128256, max_positions=8192),
    # mistralai/Mistral-7B-v0.3 config.json (sliding_window null; v0.1 had a 4096-token window)
    "mistral-7b": ModelSpec("mistral-7b", 32, 8, 128, 2, 32, 4096, 14336, 32768, max_positions=32768),
    # Qwen/Qwen2.5-7B config.json (use_sliding_window false)
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 28, 4, 128, 2, 28, 3584, 18944, 152064, max_positions=131072),
    # The two models tierkv.models runs on CPU hosts (float32, as tierkv.models dequantises them):
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json
    "smollm2-135m": ModelSpec("smollm2-135m", 30, 3, 64, 4, 9, 576, 1536, 49152, tie_word_embeddings=True,
                              max_positions=8192),
    # google/gemma-3-270m config.json: 15 of 18 layers slide over 512 tokens
    "gemma3-270m": ModelSpec("gemma3-270m", 18, 1, 256, 4, 4, 640, 2048, 262144, tie_word_embeddings=True,
                             sliding_layers=15, sliding_window=512, max_positions=32768),
}


def _sliding_layers(cfg: dict, layers: int, path: str) -> tuple[int, int | None]:
    """How many layers use a sliding window, following transformers' own defaults per model family."""
    if not cfg.get("sliding_window"):
        return 0, None
    window = _count(cfg, "sliding_window", path)
    if cfg.get("layer_types"):
        return sum(t in ("sliding_attention", "hybrid_sliding") for t in cfg["layer_types"]), window
    model_type = str(cfg.get("model_type", ""))
    if model_type == "gemma2":  # alternating: even layers slide (Gemma2Config default)
        return (layers + 1) // 2, window
    if model_type.startswith("gemma3"):  # every `sliding_window_pattern`-th layer is global
        pattern = _count(cfg, "sliding_window_pattern", path, default=6)
        return sum((i + 1) % pattern != 0 for i in range(layers)), window
    if "use_sliding_window" in cfg:  # Qwen2 family: only layers >= max_window_layers, and only when enabled
        if not cfg["use_sliding_window"]:
            return 0, None
        return max(0, layers - _count(cfg, "max_window_layers", path, default=layers, minimum=0)), window
    return layers, window  # Mistral v0.1 style: a window on every layer


MAX_COUNT = 2**31
"""The largest count a config field may hold (heads, widths, vocabulary): far past any model's, and small enough
that the planner's products of them stay finite floats."""


def _count(cfg: dict, key: str, path: str, *, default: int | None = None, minimum: int = 1,
           maximum: int = MAX_COUNT) -> int:
    """``cfg[key]`` as an int in ``[minimum, maximum]`` (an integral number, or its digits in a string), or
    ``default`` where it is absent or null; refused in one line that names the file and the field otherwise."""
    value = cfg.get(key)
    if value is None and default is not None:
        return default
    if value is None and key not in cfg:
        raise InvalidConfigError(
            f"model config {path!r} lacks {key!r}; a decoder config.json needs num_hidden_layers, "
            "num_attention_heads, hidden_size and vocab_size."
        )
    number = value if type(value) is int else (
        int(value) if isinstance(value, float) and value.is_integer()
        else int(value) if isinstance(value, str) and value.strip().isdecimal() else None)
    if number is None or not minimum <= number <= maximum:
        raise InvalidConfigError(f"model config {path!r}: {key}={_shown(value)} must be an integer from {minimum} "
                                 f"to {maximum:,}; correct it to the model's own value (its published config.json).")
    return number


_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token", "moe_topk")


def _shown(value: object) -> str:
    """A config value as its JSON, cut to 40 characters (a hostile one can be thousands)."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _positive(cfg: dict, *keys: str) -> int:
    """The first of ``keys`` that ``cfg`` holds as a positive int; 0 if none does (absent, null, or not a count up
    to :data:`MAX_COUNT`)."""
    return next((cfg[k] for k in keys if type(cfg.get(k)) is int and 0 < cfg[k] <= MAX_COUNT), 0)


def _active_mlp_width(cfg: dict, dense: int) -> int:
    """The MLP width one token's decode passes through: ``dense`` (``intermediate_size``), or in a mixture of
    experts the routed experts' widths (``moe_intermediate_size``, else ``dense``) times the experts a token takes,
    plus the shared experts' (Qwen-MoE's ``shared_expert_intermediate_size``, DeepSeek-style ``n_shared_experts``).
    Dense first layers of some MoE families are priced as MoE ones."""
    per_token = _positive(cfg, *_EXPERTS_PER_TOKEN)
    if _positive(cfg, *_EXPERTS) <= 1 or not per_token:
        return dense
    expert = _positive(cfg, "moe_intermediate_size") or dense
    shared = _positive(cfg, "shared_expert_intermediate_size") or expert * _positive(cfg, "n_shared_experts")
    return expert * per_token + shared


def model_from_config(path: str | os.PathLike[str]) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (or a directory holding one) into a :class:`ModelSpec`.

    Uses ``num_hidden_layers``, ``num_key_value_heads`` (default: ``num_attention_heads``), ``head_dim``
    (default ``hidden_size // num_attention_heads``), ``torch_dtype``/``dtype`` (default bfloat16), the
    sliding-window fields and, for a mixture of experts, the active experts' MLP width (:func:`_active_mlp_width`).
    Multimodal configs are read through their ``text_config``.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    cfg = read_json(path, "model config", f"give a preset ({', '.join(MODEL_PRESETS)}) or the path of a "
                    "Hugging Face config.json")
    if not isinstance(cfg, dict):
        raise InvalidConfigError(f"model config {path!r} must hold a JSON object.")
    cfg = cfg.get("text_config") or cfg
    if not isinstance(cfg, dict):
        raise InvalidConfigError(f"model config {path!r}: text_config must be a JSON object (the language model's "
                                 "config).")
    if "kv_lora_rank" in cfg:
        raise InvalidConfigError(
            f"model config {path!r} uses multi-head latent attention (kv_lora_rank). TieredCache decodes such "
            "models (exact gather, the latent and rotary key stored at one head dim), but the planner does not "
            "model their step: transformers expands every cached token's latent again each step, compute that "
            "grows with the context. Plan with a config of plain K/V heads of the same bytes per token."
        )
    total = _count(cfg, "num_hidden_layers", path, maximum=MAX_LAYERS)
    heads = _count(cfg, "num_attention_heads", path)
    hidden = _count(cfg, "hidden_size", path)
    vocab = _count(cfg, "vocab_size", path)
    kv_heads = _count(cfg, "num_key_value_heads", path, default=heads)
    if heads % kv_heads:
        raise InvalidConfigError(f"model config {path!r}: num_key_value_heads={kv_heads} must divide "
                                 f"num_attention_heads={heads} (each KV head serves a group of query heads); correct "
                                 "it to the model's own value.")
    if cfg.get("head_dim") is None and hidden % heads:
        raise InvalidConfigError(f"model config {path!r}: hidden_size={hidden} is not a multiple of "
                                 f"num_attention_heads={heads}, and head_dim is not given; add the model's head_dim.")
    head_dim = _count(cfg, "head_dim", path, default=hidden // heads)
    intermediate = _active_mlp_width(cfg, _count(cfg, "intermediate_size", path, default=4 * hidden))
    kinds = _layer_kinds(cfg, total, path)
    layers = sum(kind in _KV_KINDS for kind in kinds)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise InvalidConfigError(
            f"model config {path!r}: dtype {dtype!r} unknown; known: {', '.join(DTYPE_BYTES)}."
        )
    sliding, window = _sliding_layers(cfg, layers, path)
    folder, file = os.path.split(os.path.abspath(path))
    return ModelSpec(
        name=printable(cfg.get("_name_or_path") or cfg.get("model_type")  # the plan's title: no terminal escapes
                       or (os.path.basename(folder) if file == "config.json" else file))[:200],
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype_bytes=DTYPE_BYTES[dtype],
        attention_heads=heads,
        hidden_size=hidden,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_layers=sliding,
        sliding_window=window,
        other_layers=total - layers,
        max_positions=_positive(cfg, "max_position_embeddings") or None,
    )


_KV_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "attention", "hybrid", "hybrid_sliding")
_OTHER_KINDS = ("linear_attention", "conv", "mamba", "moe", "mlp", "dummy")
_PATTERN = {"*": "attention", "M": "mamba", "-": "mlp", "E": "moe"}  # Nemotron-H's hybrid_override_pattern


def _layer_kinds(cfg: dict, layers: int, path: str) -> list[str]:
    """Each layer's kind, from the fields hybrid families spell it in (``layer_types``, ``layers_block_type``,
    Jamba's attention period, Bamba's attention indices, Nemotron-H's pattern); all attention without them."""
    key = "layer_types" if cfg.get("layer_types") else "layers_block_type"
    kinds = cfg.get(key)
    if kinds is not None and not isinstance(kinds, list):
        raise InvalidConfigError(f"model config {path!r}: {key}={_shown(kinds)} must be a list of layer kinds, one per "
                                 "layer (e.g. [\"full_attention\", ...]); correct it to the model's own value.")
    if kinds is None and isinstance(cfg.get("hybrid_override_pattern"), str):
        kinds = [_PATTERN.get(symbol, symbol) for symbol in cfg["hybrid_override_pattern"]]
    elif kinds is None and isinstance(cfg.get("attn_layer_indices"), list):
        kinds = ["attention" if i in cfg["attn_layer_indices"] else "mamba" for i in range(layers)]
    elif kinds is None and type(cfg.get("attn_layer_period")) is int and cfg["attn_layer_period"] > 0:
        period, offset = cfg["attn_layer_period"], cfg.get("attn_layer_offset", 0)
        kinds = ["attention" if i % period == offset else "mamba" for i in range(layers)]
    kinds = [str(kind) for kind in kinds] if isinstance(kinds, list) else ["full_attention"] * layers
    unknown = sorted(set(kinds) - {*_KV_KINDS, *_OTHER_KINDS})
    if len(kinds) != layers or unknown or not any(kind in _KV_KINDS for kind in kinds):
        why = (f"{len(kinds)} layer kinds for {layers} layers" if len(kinds) != layers else
               f"{', '.join(map(_shown, unknown[:5]))} layers, whose cache the planner does not model" if unknown else
               "no attention layer: nothing of it is K/V for tierkv to place")  # fmt: skip
        raise InvalidConfigError(f"model config {path!r} has {why}. Plan with a config of its attention layers.")
    return kinds


MODEL_ALIASES: dict[str, str] = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}
"""The names ``tierkv demo`` and ``tierkv eval`` take (:mod:`tierkv.models`) for the presets of the same models."""

DEMO_MODEL = "demo"
"""The shipped demo model, planned from its own ``config.json`` (:data:`DEMO_CONFIG`)."""

DEMO_CONFIG = Path(__file__).parent / "demo" / "weights" / "config.json"


def model_names() -> list[str]:
    """Every name :func:`resolve_model` takes: the presets, their short names and the demo model."""
    return [*MODEL_PRESETS, *MODEL_ALIASES, DEMO_MODEL]


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name (``llama-3-8b``), a name ``tierkv demo`` takes (``smollm2``, ``gemma3``, ``demo``), or the
    path of a ``config.json`` / model directory."""
    name = MODEL_ALIASES.get(name_or_path, name_or_path)  # a name first, as tierkv demo and eval read it: a
    if name in MODEL_PRESETS:  # folder of that name is given as a path (./gemma3)
        return MODEL_PRESETS[name]
    if name == DEMO_MODEL:
        return dataclasses.replace(model_from_config(DEMO_CONFIG), name=DEMO_MODEL)
    if os.path.exists(name_or_path) or name_or_path.endswith(".json"):
        return model_from_config(name_or_path)
    typed = name_or_path.strip().lower()
    close = [known for known in model_names() if typed and known.startswith(typed)][:1] \
        or difflib.get_close_matches(typed, model_names(), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? Otherwise give" if close else "give"
    raise InvalidConfigError(
        f"unknown model {name_or_path!r}; {hint} a model name ({', '.join(model_names())}) or the path "
        "of a Hugging Face config.json."
    )
