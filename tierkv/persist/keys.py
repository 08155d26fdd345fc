"""Content addresses of full KV blocks: a model fingerprint, a namespace, and a hash chain over token ids.

A block's K/V is a function of the model, how it computes (dtype, device type, attention implementation),
the block geometry and *every* token up to the block's end — not of the block's own tokens alone. So a
block's key chains over its whole prefix (vLLM's ``hash_block_tokens(parent_hash, token_ids, extra_keys)``)::

    root    = H(namespace fields)                      # model fingerprint, layers, kv heads, head dim, ...
    key[0]  = H(root,       ids[0 : bt])
    key[i]  = H(key[i - 1], ids[i * bt : (i + 1) * bt])

Two prompts share ``key[0..k]`` exactly when they share their first ``(k + 1) * bt`` tokens *and* the
namespace; a different model, layout or dtype has another root, so none of its keys can match.

Interface (also used by the remote tier)::

    ns = Namespace.of_model(model, block_tokens=256)  # or Namespace(fingerprint=..., layers=..., ...)
    keys = block_keys(ns.root, ids, 256)             # one hex key per *full* block of ids (a 1-D int sequence)
    model_fingerprint(model)                          # hex digest of config + every parameter's bytes + adapters

Keys are 32 hex characters (BLAKE2b, 128 bits): cryptographic, so two different prefixes cannot be made to
collide on purpose, and short enough for file names and Redis keys. The fingerprint hashes *every byte* of
every parameter and buffer (xxh3-128; a model that differs in one weight element, e.g. a fine-tune of one
layer, has another fingerprint and never reuses this one's blocks), which adapters the model applies now (LoRA,
peft's prompt learning on or off: an adapter's weights are parameters whether it is active or not), and the
qualified names of the user's forward hooks on it (:func:`user_hooks`; a hook of the same name that computes
something else cannot be told apart). That costs one pass over the weights (measured in docs/reliability.md),
so the tensor digests are kept per model object and reused while each tensor is the same storage at the same
version (``tensor._version``, which every in-place operation and ``load_state_dict`` bump) and a few elements of
each are the bytes they were (:func:`weights_sample`: a write through ``tensor.data`` bumps no version); one that
changes no sampled element is not seen — pass ``cached=False`` after one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from tierkv.errors import InvalidConfigError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig

KEY_BYTES = 16  # 128-bit keys, written as 32 hex characters
HASH_CHUNK_BYTES = 64 << 20  # an accelerator's tensor crosses to the host for hashing in pieces of this size
FORMAT = "tierkv-kv/1"  # part of every root: a change of the block format changes every key
# config entries that name where a model came from or how it was loaded, not what it computes
_CONFIG_NOISE = ("_name_or_path", "transformers_version", "_attn_implementation_autoset", "_commit_hash")


def _digest(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))  # length-prefixed: no two part lists hash the same bytes
        h.update(part)
    return h.hexdigest()


_TENSOR_DIGESTS: weakref.WeakKeyDictionary[Any, tuple[tuple, torch.Tensor, bytes]] = weakref.WeakKeyDictionary()
"""model -> (what its tensors were when hashed: name, storage, version, shape, dtype, device; a few elements of
each, :func:`weights_sample`; their digest)."""
LIBRARIES = ("torch", "transformers", "tierkv")
"""Packages whose forward hooks compute nothing of their own (transformers' output capturing, tierkv's checks)."""


def model_fingerprint(model: torch.nn.Module, cached: bool = True) -> str:
    """Hex digest of what makes ``model`` compute what it does: its config (without its path and the
    transformers version), for every parameter and buffer its name, shape, dtype and all of its bytes, which
    adapters its adapter layers apply (:func:`adapter_state`) and the user's forward hooks on it
    (:func:`user_hooks`; both absent from a model without them). The tensors' digest is computed once per model
    object and reused while no tensor was replaced or changed in place and their sampled elements are the same
    (``cached=False`` hashes them again: after a write through ``.data`` the sample may miss)."""
    import torch

    config = getattr(model, "config", None)
    described = config.to_dict() if config is not None else {"class": type(model).__qualname__}
    for key in _CONFIG_NOISE:
        described.pop(key, None)
    adapters = adapter_state(model)
    if adapters:
        described["tierkv_adapters"] = adapters
    hooks = user_hooks(model)
    if hooks:
        described["tierkv_hooks"] = hooks
    tensors = [(name, tensor.detach()) for name, tensor in [*model.named_parameters(), *model.named_buffers()]]
    state, sample = _state(tensors), weights_sample(model)
    known = _TENSOR_DIGESTS.get(model) if cached else None
    if known is None or known[0] != state or not torch.equal(known[1], sample):
        known = _TENSOR_DIGESTS[model] = (state, sample, _tensors_digest(tensors))
    return _digest(json.dumps(described, sort_keys=True, default=str).encode(), known[2])


def tensor_state(model: torch.nn.Module) -> tuple:
    """What ``model``'s parameters and buffers are now, cheaply (no byte read): name, storage, offset, version
    (in-place writes count, ``load_state_dict`` among them), shape, dtype, device; and the adapters it applies
    (:func:`adapter_state`). Equal states: equal weights."""
    tensors = [(name, tensor.detach()) for name, tensor in [*model.named_parameters(), *model.named_buffers()]]
    return (*_state(tensors), tuple(map(tuple, adapter_state(model))))


def adapter_state(model: torch.nn.Module) -> list[list]:
    """For each adapter layer of ``model`` (peft's LoRA and kin: a module whose ``active_adapters`` is a list of
    names and ``disable_adapters`` a bool), its name, the adapters it applies, whether they are turned off, the ones
    merged into its weights, and the active ones' scales; for each peft model with prompt learning active
    (:func:`prompt_learning`), that. Switching adapters or turning them off changes what the model computes without
    changing a parameter: K/V stored under one adapter is not another's."""
    state: list[list] = []
    for name, module in model.named_modules():
        prompt = prompt_learning(module)
        if prompt is not None:
            state.append([name, *prompt])
        disabled = getattr(module, "disable_adapters", None)
        active = getattr(module, "active_adapters", None) if isinstance(disabled, bool) else None
        if isinstance(active, str):
            active = [active]
        if not isinstance(active, (list, tuple)):
            continue
        scaling = getattr(module, "scaling", None)
        scales = sorted((str(k), float(v)) for k, v in scaling.items() if k in active) \
            if isinstance(scaling, dict) else []  # fmt: skip
        state.append([name, [str(a) for a in active], disabled, [str(m) for m in getattr(module, "merged_adapters",
                                                                                         ())], scales])  # fmt: skip
    return state


def prompt_learning(module: torch.nn.Module) -> list | None:
    """For a peft model whose active adapter is prompt learning (prompt tuning's virtual tokens before the ids,
    prefix tuning's learned K/V in front of the cache): that adapter's name, kind and virtual token count, and
    whether it is turned off (``disable_adapter()``); None for any other module."""
    disabled = vars(module).get("_adapters_disabled")  # an instance attribute: no module's __getattr__ is asked
    configs = getattr(module, "peft_config", None) if isinstance(disabled, bool) else None
    if not isinstance(configs, dict):
        return None
    active = getattr(module, "active_adapter", None)
    config = configs.get(active) if isinstance(active, str) else None
    if not getattr(config, "is_prompt_learning", False):
        return None
    return ["prompt learning", active, str(getattr(config, "peft_type", "")),
            int(getattr(config, "num_virtual_tokens", 0) or 0), disabled]


def user_hooks(model: torch.nn.Module) -> list[str]:
    """The forward hooks and pre-hooks (with keywords or not) on ``model`` and its submodules, and torch's global
    module hooks, whose function (inside a ``functools.partial``, of a bound method) is defined outside
    :data:`LIBRARIES`: ``"<module path>: <module>.<qualified name>"`` each. Such a hook may change what a forward
    computes (a steering vector, rewritten inputs) while every parameter stays the same."""
    found = [f"(global): {name}" for hooks in global_hooks() for name in map(hook_name, hooks.values())
             if name is not None]
    for path, module in model.named_modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            if hooks:
                found += [f"{path or '(model)'}: {name}" for name in map(hook_name, hooks.values())
                          if name is not None]
    return found


def global_hooks() -> tuple[dict, dict]:
    """torch's global forward pre-hooks and forward hooks (``register_module_forward_pre_hook`` and kin)."""
    from torch.nn.modules import module

    return module._global_forward_pre_hooks, module._global_forward_hooks


def hook_name(hook: Any) -> str | None:
    """A forward hook's function's qualified name, with its module; None where :data:`LIBRARIES` define it."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    function = getattr(hook, "__func__", hook)  # a bound method's function
    if not hasattr(function, "__qualname__"):
        function = type(function)  # a callable object: its class
    where = str(getattr(function, "__module__", None) or "")
    if where.split(".", 1)[0] in LIBRARIES:
        return None
    return f"{where}.{function.__qualname__}"


def weights_sample(model: torch.nn.Module, per_tensor: int = 8) -> torch.Tensor:
    """The bytes of a few elements of every parameter and buffer (up to ``per_tensor``, spread over each), on the
    host: what :func:`tensor_state` cannot see — a write through ``.data``, which torch does not count (an
    optimizer's or an EMA's update) — changes them, and reading them costs a few milliseconds."""
    import torch

    pieces = []
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            flat = tensor.detach().reshape(-1)
            if flat.numel():
                index = torch.linspace(0, flat.numel() - 1, min(per_tensor, flat.numel()), device=flat.device)
                pieces.append(flat[index.long()].contiguous().view(torch.uint8).reshape(-1).cpu())
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)


def _state(tensors: list[tuple[str, torch.Tensor]]) -> tuple:
    return tuple((name, t.untyped_storage().data_ptr(), t.storage_offset(), t._version, tuple(t.shape), t.dtype,
                  t.device) for name, t in tensors)


def _tensors_digest(tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """xxh3-128 over each tensor's name, shape, dtype and bytes (length-prefixed, in order)."""
    import torch

    h = xxhash.xxh3_128()
    with torch.no_grad():
        for name, tensor in tensors:
            described = f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode()
            h.update(len(described).to_bytes(8, "little") + described)
            flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor.reshape(-1)
            h.update(flat.numel().to_bytes(8, "little"))
            step = HASH_CHUNK_BYTES if flat.device.type != "cpu" else max(flat.numel(), 1)
            for start in range(0, flat.numel(), step):  # bounded host copies of an accelerator's tensor
                piece = flat[start : start + step].cpu().contiguous()
                h.update(piece.numpy().data)
    return h.digest()


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything besides the token ids that decides a block's bytes; its :attr:`root` starts every chain.

    ``dtype`` is the K/V dtype's name (``"float32"``, ``"bfloat16"``); ``device_type`` is ``"cpu"``/``"cuda"``
    (kernels differ in the last bits); ``attention`` is the model's attention implementation (``"sdpa"``,
    ``"eager"`` ...: the K/V of layer 1 and up depend on layer 0's attention output, bit for bit; inside
    ``cache.streaming/split(model)`` the one they switched from, which they compute within rounding).
    ``shapes``: each layer's ``(KV heads, head dim)`` where the layers' differ (Gemma 4: its full-attention
    layers' heads are wider than its sliding ones'), ``()`` where every layer's is ``(kv_heads, head_dim)``; a
    block of such a model holds every layer's ``[2, H_kv, block_tokens, D]`` one after the other (the largest
    ``kv_heads`` and ``head_dim`` stand in the two fields then).
    """

    fingerprint: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    device_type: str
    attention: str
    shapes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:  # JSON gives lists: one form, hashable and comparable
        object.__setattr__(self, "shapes", tuple((int(heads), int(dim)) for heads, dim in self.shapes))

    @property
    def root(self) -> str:
        return _digest(FORMAT.encode(), json.dumps(self.to_dict(), sort_keys=True).encode())

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The K/V of one block of every layer: ``[layers, 2, kv_heads, block_tokens, head_dim]``, or where the
        layers' shapes differ the elements of every layer's ``[2, H_kv, block_tokens, D]`` in a row."""
        if self.shapes:
            return (sum(self.layer_elements(layer) for layer in range(self.layers)),)
        return (self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim)

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """``(KV heads, head dim)`` of ``layer``."""
        return self.shapes[layer] if self.shapes else (self.kv_heads, self.head_dim)

    def layer_elements(self, layer: int) -> int:
        """The K/V elements of one block of ``layer``."""
        heads, dim = self.layer_shape(layer)
        return 2 * heads * self.block_tokens * dim

    @classmethod
    def of_model(cls, model: torch.nn.Module, block_tokens: int, fingerprint: str | None = None,
                 attention: str | None = None, shapes: Sequence[tuple[int, int]] = ()) -> Namespace:
        """The namespace of a transformers decoder (geometry from its text config, dtype and device from its
        parameters); ``fingerprint`` defaults to :func:`model_fingerprint`, ``attention`` to the config's
        implementation. ``shapes``: each layer's ``(KV heads, head dim)`` as its cache stores them, where the
        caller knows them (else the text config's global fields, which describe a model whose layers all cache one
        shape of its K/V heads)."""
        config: PreTrainedConfig | None = getattr(model, "config", None)
        if config is None:
            raise InvalidConfigError(f"{type(model).__qualname__} has no .config: persisted prefixes need a "
                                     "transformers model (its config gives the K/V geometry); pass one.")
        text = config.get_text_config(decoder=True)
        parameter = next(model.parameters())
        layers = int(text.num_hidden_layers)
        per_layer = layer_shapes(shapes, layers)
        if per_layer:
            kv_heads, head_dim = max(heads for heads, _ in per_layer), max(dim for _, dim in per_layer)
        elif shapes:  # one shape, as stored (latent attention stores other heads than its config's K/V heads)
            kv_heads, head_dim = shapes[0]
        else:
            # a heterogeneous config (transformers' per_layer_config) refuses its global per-layer fields
            configs = text.per_layer_config if getattr(text, "is_heterogeneous", False) else [text]
            found = sorted({(getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads,
                             getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads)
                            for layer in configs})  # fmt: skip
            if len(found) > 1:  # the caller did not say how the layers store them
                raise mixed_geometry_error(found)
            kv_heads, head_dim = found[0]
        return cls(fingerprint=fingerprint or model_fingerprint(model), layers=layers, kv_heads=int(kv_heads),
                   head_dim=int(head_dim), dtype=str(kv_dtype(model)).removeprefix("torch."),
                   block_tokens=int(block_tokens), device_type=parameter.device.type,
                   attention=attention or str(config._attn_implementation), shapes=per_layer)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values; ``shapes`` only where the layers' differ (so a namespace of one shape, and
        its root, are what they were before the field existed)."""
        fields = asdict(self)
        shapes = fields.pop("shapes")
        return {**fields, "shapes": [list(shape) for shape in shapes]} if shapes else fields


def layer_shapes(shapes: Sequence[tuple[int, int]], layers: int) -> tuple[tuple[int, int], ...]:
    """A namespace's ``shapes`` for a model of ``layers`` layers whose K/V-holding layers store ``shapes``: ``()``
    where they are one shape; refused (:func:`mixed_geometry_error`) where they differ and some layers hold no
    K/V of their own."""
    if len(set(shapes)) < 2:
        return ()
    if len(shapes) != layers:  # some layers attend an earlier layer's K/V
        raise mixed_geometry_error(sorted(set(shapes)))
    return tuple((int(heads), int(dim)) for heads, dim in shapes)


def mixed_geometry_error(shapes: Sequence[tuple[int, int]]) -> InvalidConfigError:
    """Why a model whose layers cache K/V of several ``(KV heads, head dim)`` shapes, some layers none of their
    own, has no prefix store."""
    listed = ", ".join(f"{heads} x {dim}" for heads, dim in shapes)
    return InvalidConfigError(
        f"persist= and remote= store a block of every layer's K/V, but this model's layers cache K/V of "
        f"{len(shapes)} shapes (KV heads x head dim: {listed}) and some layers hold none of their own (they attend "
        "an earlier layer's). Build the cache without persist= / remote= for this model (cache.save / "
        "TieredCache.load keep its conversations).")


def kv_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of a decoder's K/V: its first floating-point parameter's (a quantized model's packed integer
    weights are not what its attention computes in)."""
    parameters = list(model.parameters())
    return next((p.dtype for p in parameters if p.is_floating_point()), parameters[0].dtype)


def block_keys(root: str, ids: Sequence[int] | np.ndarray, block_tokens: int) -> list[str]:
    """Keys of the *full* blocks of one sequence's token ``ids`` (a partial last block has no key):
    ``key[i] = H(key[i-1], ids of block i)`` with ``key[-1] = root``."""
    tokens = np.ascontiguousarray(np.asarray(ids, dtype="<i8").reshape(-1))
    keys, parent = [], root
    for i in range(len(tokens) // block_tokens):
        parent = _digest(parent.encode(), tokens[i * block_tokens : (i + 1) * block_tokens].tobytes())
        keys.append(parent)
    return keys
