"""Decode step of models whose layers keep recurrent state, against ``DynamicCache``.

    pytest benchmarks/test_hybrid_step.py --benchmark-enable -s -p no:cacheprovider

Two tiny hybrids (fp32, 16-token blocks): Qwen3-Next's pattern (three gated-delta-net layers, then one of
attention; 2 KV heads x 16) and Falcon-H1's (attention and Mamba side by side in each of 4 layers; 2 KV heads x
16), prefilled alike at 1K, 4K and 8K tokens, and the first again with the state of Qwen3-Next-80B's layers (2
MiB a row); three caches side by side, interleaved rounds of decode steps,
medians: ``DynamicCache(config=)``, (a) a ``TieredCache`` with every block on the device tier, (b) one whose
device budget is ``TieredCache.min_device_bytes`` (the rest on the host tier). Besides what an attention-only
model's step costs, each step copies every state layer's state aside for the rollback (``tierkv.hf.state``).
Target, as for attention-only models (``test_scale.py``): (a) and (b) <= 1.5 x ``DynamicCache``. Ratios are
printed always and asserted only with ``--benchmark-enable``; one torch thread (the mover gets the other core).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from rich.table import Table
from test_scale import ROUNDS, STEPS, WARMUP, _interleaved, _show, _steps
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.hf.sizing import HOLDS_STATE

pytestmark = pytest.mark.skipif(not HOLDS_STATE, reason="this transformers' cache holds no recurrent state")

CONTEXTS = (1024, 4096, 8192)
BLOCK = 16
CHUNK = 1024
RATIO_TARGET = 1.5
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=16384, tie_word_embeddings=False)
MODELS = {
    "qwen3_next": dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16),
}
# Qwen3-Next-80B's gated-delta-net state per layer (16 key heads and 32 value heads of 128: 2 MiB fp32 a row),
# on the same tiny model: the state copy's cost where the state is as large as a real model's
STATE_80B = ("qwen3_next", dict(MODELS["qwen3_next"], linear_num_key_heads=16, linear_num_value_heads=32,
                                linear_key_head_dim=128, linear_value_head_dim=128))
CASES = {"qwen3_next": ("qwen3_next", MODELS["qwen3_next"]), "falcon_h1": ("falcon_h1", MODELS["falcon_h1"]),
         "qwen3_next, Qwen3-Next-80B's state": STATE_80B}


def _model(case: str) -> transformers.PreTrainedModel:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model_type, extra = CASES[case]
    config = transformers.AutoConfig.for_model(model_type, **SMALL, **extra)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def _prefill(model: transformers.PreTrainedModel, caches: list, context: int) -> None:
    """The same prompt into every cache, ``CHUNK`` tokens a forward."""
    ids = torch.randint(2, 256, (1, context), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for start in range(0, context, CHUNK):
            for cache in caches:
                model(input_ids=ids[:, start:start + CHUNK], past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("case", list(CASES))
def test_a_hybrid_decode_step_against_dynamic_cache(benchmark, capsys, case: str) -> None:
    model = _model(case)
    config, token = model.config, torch.tensor([[7]])
    table = Table(title=f"{case} (tiny, 4 layers) decode step vs DynamicCache, {BLOCK}-token blocks "
                        "(median of interleaved rounds)")
    for column in ("context", "DynamicCache", "(a) all device", "ratio (a)", "(b) device at min", "ratio (b)",
                   "state bytes"):
        table.add_column(column, justify="right")
    ratios: dict[int, tuple[float, float]] = {}
    for context in CONTEXTS:
        decoded = WARMUP + ROUNDS * STEPS + 8  # test_scale's rounds
        minimum = TieredCache.min_device_bytes(config, context + decoded, block_tokens=BLOCK)
        caches = {"dynamic": DynamicCache(config=config),
                  "a": TieredCache(gpu_gb="4GB", cpu_gb="64MB", block_tokens=BLOCK, config=config),
                  "b": TieredCache(gpu_gb=f"{minimum}B", cpu_gb="4GB", block_tokens=BLOCK, config=config)}
        try:
            _prefill(model, list(caches.values()), context)
            medians = _interleaved({name: _steps(model, cache, token) for name, cache in caches.items()})
            placed = caches["b"].stats()["blocks"]
            assert caches["a"].stats()["blocks"]["host"] == 0 and placed["host"] > placed["device"]
            state = caches["a"].stats()["state_bytes"]
        finally:
            caches["a"].close()
            caches["b"].close()
        ratios[context] = (medians["a"] / medians["dynamic"], medians["b"] / medians["dynamic"])
        table.add_row(f"{context:,}", f"{medians['dynamic'] * 1e3:.2f} ms", f"{medians['a'] * 1e3:.2f} ms",
                      f"{ratios[context][0]:.2f}x", f"{medians['b'] * 1e3:.2f} ms", f"{ratios[context][1]:.2f}x",
                      f"{state:,}")
    _show(capsys, table)
    benchmark.extra_info.update(ratios={str(k): v for k, v in ratios.items()})
    benchmark.pedantic(lambda: None, rounds=1)
    if not benchmark.disabled:
        worst = max(max(pair) for pair in ratios.values())
        assert worst <= RATIO_TARGET, f"a step costs {worst:.2f} x DynamicCache (target <= {RATIO_TARGET})"
