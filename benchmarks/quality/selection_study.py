"""Which blocks should a sparse decode step read? Selection rules compared on the saved prompts of a quality run.

The sparse executor's quality depends only on *which* blocks each layer attends. This study replays that choice
outside the store, over the saved full-attention KV of ``tierkv eval --stage reference`` (a ``DynamicCache``
per prompt, decoded exactly as ``tierkv eval --stage measure`` does), with an attention function that masks
each decode step to the chosen blocks — so rules that the executor cannot run (the *oracle*, which ranks
blocks by the true attention mass it would have to read every key to know) can be measured beside it::

    python benchmarks/quality/selection_study.py --reference RUN/smollm2 --prompts needle/2048,fidelity/2048 \
        --rules quest,mixed,oracle --budget 0.1

Rules (the budget counts attended blocks per layer, sinks and the recent window included, as in the executor):

    quest            Quest's bound q⁺·max + q⁻·min, a softmax over blocks per query head, the max over heads
    mixed            the same on (bound + mean-key logit) / 2 — the executor's rule (tierkv.attention.sparse)
    per-head         each KV head its own top blocks by the mixed estimate, the union read, each head masked
                     to its own
    per-head-union   the same, every head attending the whole union
    oracle           the true attention mass of each block (max over query heads), one selection per layer
    oracle-per-head  the true mass, each KV head its own top blocks — as if a read could fetch single heads

``blocks read`` is the fraction of the layer's blocks read (the union over heads). Timings mean nothing here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import safetensors.torch
import torch
from transformers import AttentionInterface

from tierkv import models
from tierkv.attention.sparse import SparseBudget
from tierkv.quality.harness import decode_saved, load_reference, logprob_path
from tierkv.quality.metrics import Agreement, compare
from tierkv.quality.tasks import answer_matches

RULES = ("quest", "mixed", "per-head", "per-head-union", "oracle", "oracle-per-head")


class Study:
    """One rule's settings and the blocks it read; ``attend`` is the registered attention function."""

    def __init__(self, rule: str, budget: SparseBudget, block_tokens: int, layers: int) -> None:
        self.rule, self.budget, self.bt, self.layers = rule, budget, block_tokens, layers
        self.read = self.total = 0

    def allowed(self, layer: int, q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """Which keys each KV head attends, ``[H_kv, T]``, for ``q`` ``[H_kv, G, D]`` over ``k`` ``[H_kv, T, D]``
        (None: all), with the executor's budget arithmetic (:class:`tierkv.attention.sparse.SparseBudget`)."""
        heads, length, dim = k.shape
        bt, budget = self.bt, self.budget
        blocks = -(-length // bt)
        total = blocks if layer < budget.dense_layers else budget.budget_blocks(length, blocks, bt, self.layers)
        lo, hi = -(-budget.sinks // bt), min(blocks - 1, max(0, length - budget.recent) // bt)
        top = total - lo - (blocks - hi)
        self.total += blocks
        if top >= hi - lo:
            self.read += blocks
            return None
        keys = k[:, lo * bt : hi * bt].reshape(heads, hi - lo, bt, dim)  # [H_kv, C, bt, D]
        if self.rule.startswith("oracle"):
            mass = torch.softmax(torch.einsum("hgd,htd->hgt", q, k) * scaling, -1)[:, :, lo * bt : hi * bt]
            score = mass.reshape(heads, -1, hi - lo, bt).sum(-1).transpose(1, 2)  # [H_kv, C, G]
        else:
            bound = torch.einsum("hgd,hcd->hcg", q.clamp_min(0), keys.amax(2)) + \
                torch.einsum("hgd,hcd->hcg", q.clamp_max(0), keys.amin(2))  # [H_kv, C, G]
            if self.rule != "quest":
                bound = (bound + torch.einsum("hgd,hcd->hcg", q, keys.mean(2))) / 2
            score = torch.softmax(bound * scaling, dim=1)
        chosen = torch.zeros(heads, blocks, dtype=torch.bool)
        chosen[:, :lo] = chosen[:, hi:] = True
        if top > 0 and self.rule.endswith(("per-head", "per-head-union")):
            own = torch.zeros(heads, hi - lo, dtype=torch.bool)
            own.scatter_(1, score.amax(2).topk(top, dim=1).indices, True)
            chosen[:, lo:hi] = own.any(0) if self.rule == "per-head-union" else own
        elif top > 0:
            chosen[:, lo + score.amax(2).amax(0).topk(top).indices] = True
        self.read += int(chosen.sum()) / heads if self.rule == "oracle-per-head" else int(chosen.any(0).sum())
        return chosen.repeat_interleave(bt, 1)[:, :length]

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        """Decode-step attention ``[1, H_q, 1, D]`` over ``[1, H_kv, T, D]``, masked to the chosen keys."""
        heads, groups = key.shape[1], query.shape[1] // key.shape[1]
        q = query[0, :, 0].view(heads, groups, -1).float()  # [H_kv, G, D]
        k, v = key[0].float(), value[0].float()  # [H_kv, T, D]
        scores = torch.einsum("hgd,htd->hgt", q, k) * scaling
        allowed = self.allowed(module.layer_idx, q, k, scaling)
        if allowed is not None:
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        out = torch.einsum("hgt,htd->hgd", torch.softmax(scores, -1), v).reshape(1, -1, 1, q.shape[-1])
        return out.transpose(1, 2).to(query.dtype), None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True, help="a folder of tierkv eval --stage reference")
    parser.add_argument("--prompts", default="", help="prompt key prefixes, comma-separated (default: all)")
    parser.add_argument("--rules", default="quest,mixed,oracle", help=f"comma-separated of {', '.join(RULES)}")
    parser.add_argument("--budget", type=float, default=0.1, help="attended fraction of the context")
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--sinks", type=int, default=16)
    parser.add_argument("--recent", type=int, default=16)
    parser.add_argument("--dense-layers", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = models.load(json.loads((args.reference / "reference.json").read_text()).get("model", "demo"))
    prompts = [p for p in load_reference(args.reference)[0]
               if not args.prompts or p.key.startswith(tuple(args.prompts.split(",")))]
    for rule in args.rules.split(","):
        if rule not in RULES:
            raise SystemExit(f"--rules: {rule!r} is not one of {', '.join(RULES)}")
        budget = SparseBudget(args.budget, args.sinks, args.recent, args.dense_layers)
        study = Study(rule, budget, args.block_tokens, model.config.num_hidden_layers)
        AttentionInterface.register("selection_study", study.attend)
        model.set_attn_implementation("selection_study")
        started, correct, needles, fidelity = time.perf_counter(), 0, 0, {}
        for prompt in prompts:
            generated, logits = decode_saved(model, args.reference, prompt)
            if prompt.task == "fidelity":
                reference = safetensors.torch.load_file(str(logprob_path(args.reference, prompt)))["logprobs"]
                fidelity[prompt.length] = fidelity.get(prompt.length, Agreement()) + compare(reference, logits)
            else:
                needles += 1
                correct += answer_matches(prompt.answer, tokenizer.decode(generated, skip_special_tokens=True))
        cells = [f"needles {correct}/{needles}"] if needles else []
        cells += [f"fidelity {n}: top-1 {a.top1:.1%}, KL {a.kl_mean:.3f}" for n, a in sorted(fidelity.items())]
        print(f"{rule:16s} budget {args.budget:g}, blocks read {study.read / max(study.total, 1):.1%}: "
              f"{'; '.join(cells)} ({time.perf_counter() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
