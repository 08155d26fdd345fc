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
    mixed            the same on (bound + mean-key logit) / 2 — the executor's rule (tierkv.attention.sparse);
                     --mix w weighs the bound w and the mean 1 - w
    gauss            q·mean + scaling/2 · Σ q_d² var_d: the log-mean-exp of a block whose logits are Gaussian
                     with the keys' per-channel variance (mean and variance summaries)
    gauss-bound      the same, never above Quest's bound
    submeans         --parts mean keys per block (equal slices), the block's mass their masses' sum
                     (log-sum-exp), mixed with the bound by --mix like ``mixed``
    union            the top blocks of the bound's list and of the mean logit's, taken in turn
    lowrank          every token's key in a rank-r basis of the layer's keys (principal directions at the
                     first decode step; Loki / ShadowKV), its approximate attention mass summed per block
    per-head         each KV head its own top blocks by the mixed estimate, the union read, each head masked
                     to its own
    per-head-union   the same, every head attending the whole union
    oracle           the true attention mass of each block (max over query heads), one selection per layer
    oracle-per-head  the true mass, each KV head its own top blocks — as if a read could fetch single heads
    oracle-top-p     adaptive budget: per layer-step, the fewest best blocks (true mass) whose mass with the
                     sinks' and recent window's covers --top-p of every query head (--cover min) or of their
                     mean (--cover mean); --account caps the total at what the fixed budget would read
    mixed-top-p      the same with the mixed estimate's softmax shares for the mass
    oracle-output    each block ranked by how far leaving it out moves each head's output, ‖Σ p·(v − out)‖
                     over its tokens (needs every key and value; max over heads); -rel: relative to ‖out‖

--agg mean scores a block by its mean share over query heads instead of the largest. --pair-bound bounds each
RoPE channel pair (d, d + D/2) by the lesser of the box bound and |q_pair| · max |k_pair| (rotated keys fill a
disc, not a box). --residual mean / gauss attends, besides the chosen keys, one stand-in per unchosen full block
(its mean key with the logit bias log(block tokens), gauss: plus the Gaussian spread; its mean value): an
estimate of the mass a selection leaves out; --residual quant attends every unchosen key and value from a
--bits-bit copy instead (keys per channel over their block, values per token over --quant-group channels: the
executor's ``rest_bits``). --block-tokens 1 with the oracle is per-token selection. --sticky
(with --sticky-share s) raises a block's score to the share some query head gave it at the layer's previous
step where that share is at least s (the executor's ``sticky_share``). --oracle-layers 7,17 uses the oracle in
those layers and the rule in the others: which layer's choice decides an answer.

``blocks read`` is the fraction of the layer's blocks read (the union over heads). Timings mean nothing here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AttentionInterface

from tierkv import models
from tierkv.attention.sparse import SparseBudget
from tierkv.quality.harness import decode_saved
from tierkv.quality.metrics import Agreement, compare
from tierkv.quality.run_folder import load_logprobs, load_reference, logprob_path, read_reference
from tierkv.quality.tasks import answer_matches

RULES = ("quest", "mixed", "gauss", "gauss-bound", "per-head", "per-head-union", "oracle", "oracle-per-head",
         "oracle-top-p", "mixed-top-p", "lowrank", "submeans", "union", "oracle-output", "oracle-output-rel")


class Study:
    """One rule's settings and the blocks it read; ``attend`` is the registered attention function."""

    def __init__(self, rule: str, budget: SparseBudget, block_tokens: int, layers: int, top_p: float = 0.9,
                 cap: float = 1.0, cover: str = "min", account: bool = False) -> None:
        self.rule, self.budget, self.bt, self.layers = rule, budget, block_tokens, layers
        self.top_p, self.cap, self.cover, self.account = top_p, cap, cover, account
        self.mix, self.agg, self.residual, self.pair_bound = 0.5, "max", "none", False
        self.sticky, self.seen = False, {}  # sticky: layer -> each block's measured share at its last step
        self.sticky_share = 0.0  # sticky: only shares at least this high count
        self.base_rule, self.oracle_layers = rule, frozenset()
        self.rank, self.bases, self.parts = 8, {}, 2
        self.bits, self.quant_group = 2, 32  # --residual quant
        self.read = self.total = 0
        self.credit = 0  # blocks the budget allowed but top-p did not read (account mode), per prompt
        self.per_layer: dict[int, list[int]] = {}  # layer -> [read, total]

    def allowed(self, layer: int, q: torch.Tensor, k: torch.Tensor, scaling: float,
                v: torch.Tensor | None = None) -> torch.Tensor | None:
        """Which keys each KV head attends, ``[H_kv, T]``, for ``q`` ``[H_kv, G, D]`` over ``k`` ``[H_kv, T, D]``
        (None: all), with the executor's budget arithmetic (:class:`tierkv.attention.sparse.SparseBudget`)."""
        if self.oracle_layers:  # the oracle in these layers, the rule in the others: which layer's choice matters
            self.rule = "oracle" if layer in self.oracle_layers else self.base_rule
        heads, length, dim = k.shape
        bt, budget = self.bt, self.budget
        blocks = -(-length // bt)
        total = blocks if layer < budget.dense_layers else budget.budget_blocks(length, blocks, bt, self.layers)
        lo, hi = -(-budget.sinks // bt), min(blocks - 1, max(0, length - budget.recent) // bt)
        top = total - lo - (blocks - hi)
        self.total += blocks
        entry = self.per_layer.setdefault(layer, [0, 0])
        entry[1] += blocks
        if top >= hi - lo:
            self.read += blocks
            entry[0] += blocks
            return None
        keys = k[:, lo * bt : hi * bt].reshape(heads, hi - lo, bt, dim)  # [H_kv, C, bt, D]
        if self.rule.endswith("top-p"):
            top = self._top_p(q, k, scaling, lo, hi, blocks, top)
        if self.rule.startswith("oracle") or self.rule == "lowrank":
            approx = k if self.rule != "lowrank" else self.projected(layer, k)
            mass = torch.softmax(torch.einsum("hgd,htd->hgt", q, approx) * scaling, -1)[:, :, lo * bt : hi * bt]
            score = mass.reshape(heads, -1, hi - lo, bt).sum(-1).transpose(1, 2)  # [H_kv, C, G]
            if self.rule.startswith("oracle-output"):  # what leaving the block out would move the output by
                weights = torch.softmax(torch.einsum("hgd,htd->hgt", q, k) * scaling, -1)
                out = torch.einsum("hgt,htd->hgd", weights, v)  # [H, G, D]
                part = torch.einsum("hgcb,hcbd->hgcd", weights[:, :, lo * bt : hi * bt].unflatten(-1, (-1, bt)),
                                    v[:, lo * bt : hi * bt].unflatten(1, (-1, bt)))  # [H, G, C, D]
                shift = (part - score.transpose(1, 2)[..., None] * out[:, :, None]).norm(dim=-1)  # [H, G, C]
                if self.rule == "oracle-output-rel":
                    shift = shift / out.norm(dim=-1, keepdim=True).clamp_min(1e-6)
                score = shift.transpose(1, 2)
        else:
            score = torch.softmax(self.estimate(q, keys, scaling) * scaling, dim=1)
        chosen = torch.zeros(heads, blocks, dtype=torch.bool)
        chosen[:, :lo] = chosen[:, hi:] = True
        if top > 0 and self.rule.endswith(("per-head", "per-head-union")):
            own = torch.zeros(heads, hi - lo, dtype=torch.bool)
            own.scatter_(1, score.amax(2).topk(top, dim=1).indices, True)
            chosen[:, lo:hi] = own.any(0) if self.rule == "per-head-union" else own
        elif top > 0 and self.rule == "union":  # the best of the bound's list and of the mean's, in turn
            rank = [torch.softmax(e * scaling, dim=1).amax(2).amax(0).argsort(descending=True).argsort()
                    for e in self.estimate(q, keys, scaling, parts=True)]
            key = torch.minimum(rank[0], rank[1]) * 2 + (rank[1] < rank[0])  # ties: the bound's first
            chosen[:, lo + (-key).topk(top).indices] = True
        elif top > 0:
            agg = score.amax(2).amax(0) if self.agg == "max" else score.mean(dim=(0, 2))
            seen = self.seen.get(layer)
            if self.sticky and seen is not None:  # a block's share measured when it was last attended counts too
                seen = torch.nn.functional.pad(seen, (0, blocks - seen.numel()))[lo:hi]
                agg = torch.maximum(agg, torch.where(seen >= self.sticky_share, seen, 0.0))
            chosen[:, lo + agg.topk(top).indices] = True
        read = int(chosen.sum()) / heads if self.rule == "oracle-per-head" else int(chosen.any(0).sum())
        self.read += read
        entry[0] += read
        return chosen.repeat_interleave(bt, 1)[:, :length]

    def projected(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """``k`` ``[H_kv, T, D]`` as a rank-``rank`` approximation around the keys' mean, in a per-layer basis
        (principal directions of the layer's keys at its first decode step of the prompt; Loki / ShadowKV):
        ``rank`` numbers per token and head instead of ``D``."""
        if layer not in self.bases:
            mean = k.mean(1, keepdim=True)
            basis = torch.linalg.svd(k - mean, full_matrices=False).Vh[:, : self.rank]  # [H, r, D]
            self.bases[layer] = (mean, basis)
        mean, basis = self.bases[layer]
        return mean + torch.einsum("htr,hrd->htd", torch.einsum("htd,hrd->htr", k - mean, basis), basis)

    def estimate(self, q: torch.Tensor, keys: torch.Tensor, scaling: float, parts: bool = False):
        """The rule's estimate of each block's logit ``[H_kv, C, G]`` from ``keys`` ``[H_kv, C, bt, D]``:
        ``quest`` the bound; ``mixed`` (bound + mean-key logit) / 2 with weight ``mix`` on the bound;
        ``gauss`` the log-mean-exp of a block whose logits are Gaussian with the keys' per-channel variance,
        q·m + scaling/2 · Σ q_d² σ_d²; ``gauss-bound`` that, never above the bound."""
        bound = torch.einsum("hgd,hcd->hcg", q.clamp_min(0), keys.amax(2)) + \
            torch.einsum("hgd,hcd->hcg", q.clamp_max(0), keys.amin(2))  # [H_kv, C, G]
        if self.pair_bound:  # per RoPE channel pair (d, d + D/2): the box's bound or |q_pair| · max |k_pair|
            half = keys.shape[-1] // 2
            box = q.clamp_min(0)[:, None] * keys.amax(2)[:, :, None] \
                + q.clamp_max(0)[:, None] * keys.amin(2)[:, :, None]  # [H_kv, C, G, D]
            box = box[..., :half] + box[..., half:]
            qn = torch.hypot(q[..., :half], q[..., half:])  # [H_kv, G, D/2]
            kn = torch.hypot(keys[..., :half], keys[..., half:]).amax(2)  # [H_kv, C, D/2]
            bound = torch.minimum(box, qn[:, None] * kn[:, :, None]).sum(-1)
        mean = torch.einsum("hgd,hcd->hcg", q, keys.mean(2))
        if parts:
            return bound, mean
        if self.rule == "quest":
            return bound
        if self.rule.startswith("gauss"):
            spread = torch.einsum("hgd,hcd->hcg", q * q, keys.var(2, correction=0)) * (scaling / 2)
            return torch.minimum(mean + spread, bound) if self.rule == "gauss-bound" else mean + spread
        if self.rule == "submeans":  # the block's mass as the sum of its parts' (mean-key) masses
            parts = keys.unflatten(2, (self.parts, -1)).mean(3)  # [H_kv, C, parts, D]
            mean = torch.logsumexp(torch.einsum("hgd,hcpd->hcgp", q, parts) * scaling, -1) / scaling
        return self.mix * bound + (1 - self.mix) * mean

    def _top_p(self, q, k, scaling, lo, hi, blocks, nominal):
        """Top-p: the fewest candidate blocks (best first) whose mass, with the sinks' and recent blocks', covers
        ``top_p`` of every query head's (``cover`` min) or of the heads' mean (``cover`` mean) attention.
        The oracle uses the true mass; ``mixed`` a softmax of the mixed estimate over the full blocks (the open
        tail has no summary). Clamped to ``cap`` of the candidates; with ``account``, to the nominal count plus
        the blocks earlier layer-steps of the prompt left unread (so the mean never exceeds the budget)."""
        heads, length, dim = k.shape
        bt = self.bt
        if self.rule.startswith("oracle"):
            mass = torch.softmax(torch.einsum("hgd,htd->hgt", q, k) * scaling, -1)  # [H, G, T]
            mass = torch.nn.functional.pad(mass, (0, blocks * bt - length)).reshape(heads, -1, blocks, bt).sum(-1)
        else:
            full = length // bt
            keys = k[:, : full * bt].reshape(heads, full, bt, dim)
            est = (torch.einsum("hgd,hcd->hgc", q.clamp_min(0), keys.amax(2))
                   + torch.einsum("hgd,hcd->hgc", q.clamp_max(0), keys.amin(2))
                   + torch.einsum("hgd,hcd->hgc", q, keys.mean(2))) / 2
            mass = torch.nn.functional.pad(torch.softmax(est * scaling, -1), (0, blocks - full))  # [H, G, blocks]
        fixed = mass[:, :, :lo].sum(-1) + mass[:, :, hi:].sum(-1)  # [H, G]
        cand = mass[:, :, lo:hi]
        order = cand.amax(dim=(0, 1)).argsort(descending=True)
        cum = fixed[:, :, None] + cand[:, :, order].cumsum(-1)  # [H, G, C]
        cover = cum.flatten(0, 1).amin(0) if self.cover == "min" else cum.flatten(0, 1).mean(0)
        reached = (cover >= self.top_p).nonzero()
        want = int(reached[0]) + 1 if reached.numel() else hi - lo
        want = min(want, max(1, int(self.cap * (hi - lo))))
        if self.account:
            want = min(want, nominal + self.credit)
            self.credit += nominal - want
        return max(want, 0)

    def with_residual(self, q, k, v, scores, allowed, scaling):
        """Attention over the chosen keys plus one stand-in per unchosen full block: its mean key with the
        logit bias log(block tokens) (``gauss``: plus the Gaussian spread of the block's logits) and its mean
        value — an estimate of the mass a block selection leaves out, instead of none."""
        heads, length, dim = k.shape
        full = length // self.bt
        keys = k[:, : full * self.bt].reshape(heads, full, self.bt, dim)
        values = v[:, : full * self.bt].reshape(heads, full, self.bt, dim)
        logit = torch.einsum("hgd,hcd->hgc", q, keys.mean(2)) * scaling + torch.log(torch.tensor(float(self.bt)))
        if self.residual == "gauss":
            logit = logit + torch.einsum("hgd,hcd->hgc", q * q, keys.var(2, correction=0)) * (scaling**2 / 2)
        unchosen = ~allowed[:, : full * self.bt : self.bt]  # [H_kv, C]
        logit = logit.masked_fill(~unchosen[:, None], float("-inf"))
        weights = torch.softmax(torch.cat([scores, logit], -1), -1)
        return (torch.einsum("hgt,htd->hgd", weights[..., :length], v)
                + torch.einsum("hgc,hcd->hgd", weights[..., length:], values.mean(2)))

    def quantized_rest(self, q, k, v, scores, allowed, scaling):
        """Attention over every key: the chosen exactly, the others from a ``bits``-bit copy (keys per channel
        over each block, from the block's min and max; values per token over ``quant_group`` channels)."""
        heads, length, dim = k.shape
        full = length // self.bt * self.bt
        levels = 2**self.bits - 1

        def roundtrip(x, axis):
            lo, hi = x.amin(axis, keepdim=True), x.amax(axis, keepdim=True)
            step = ((hi - lo) / levels).clamp_min(1e-8)
            return ((x - lo) / step).round().clamp(0, levels) * step + lo

        kq, vq = k.clone(), v.clone()
        kq[:, :full] = roundtrip(k[:, :full].unflatten(1, (-1, self.bt)), 2).flatten(1, 2)
        g = self.quant_group
        vq[:, :full] = roundtrip(v[:, :full].unflatten(-1, (-1, g)), -1).flatten(-2)
        rest = torch.einsum("hgd,htd->hgt", q, kq) * scaling
        exact = allowed[:, None].expand_as(rest).clone()
        exact[..., full:] = True  # the open tail is always read
        logits = torch.where(exact, scores, rest)
        weights = torch.softmax(logits, -1)
        return torch.einsum("hgt,htd->hgd", weights * exact, v) + torch.einsum("hgt,htd->hgd", weights * ~exact, vq)

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        """Decode-step attention ``[1, H_q, 1, D]`` over ``[1, H_kv, T, D]``, masked to the chosen keys."""
        heads, groups = key.shape[1], query.shape[1] // key.shape[1]
        q = query[0, :, 0].view(heads, groups, -1).float()  # [H_kv, G, D]
        k, v = key[0].float(), value[0].float()  # [H_kv, T, D]
        scores = torch.einsum("hgd,htd->hgt", q, k) * scaling
        allowed = self.allowed(module.layer_idx, q, k, scaling, v)
        if allowed is None:
            out = torch.einsum("hgt,htd->hgd", torch.softmax(scores, -1), v)
        else:
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
            if self.residual == "none":
                weights = torch.softmax(scores, -1)
                out = torch.einsum("hgt,htd->hgd", weights, v)
                if self.sticky:  # each block's largest share over the query heads, this step
                    length = weights.shape[-1]
                    padded = torch.nn.functional.pad(weights, (0, -length % self.bt))
                    self.seen[module.layer_idx] = padded.unflatten(-1, (-1, self.bt)).sum(-1).amax(dim=(0, 1))
            else:
                rest = self.quantized_rest if self.residual == "quant" else self.with_residual
                out = rest(q, k, v, scores, allowed, scaling)
        out = out.reshape(1, -1, 1, q.shape[-1])
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
    parser.add_argument("--top-p", type=float, default=0.9, help="top-p rules: attention mass to cover")
    parser.add_argument("--cap", type=float, default=1.0, help="top-p rules: at most this share of candidates")
    parser.add_argument("--cover", choices=("min", "mean"), default="min", help="top-p: every head, or their mean")
    parser.add_argument("--account", action="store_true",
                        help="top-p: never read more in total than the fixed budget would (unread blocks carry on)")
    parser.add_argument("--mix", type=float, default=0.5, help="mixed: the bound's weight (the mean's: 1 - it)")
    parser.add_argument("--agg", choices=("max", "mean"), default="max",
                        help="a block's score over query heads: the largest share, or the mean share")
    parser.add_argument("--parts", type=int, default=2, help="submeans: mean keys per block (of equal slices)")
    parser.add_argument("--rank", type=int, default=8, help="lowrank: numbers kept per token and KV head")
    parser.add_argument("--residual", choices=("none", "mean", "gauss", "quant"), default="none",
                        help="estimate the unchosen blocks' share from their mean key and value (gauss: + spread)")
    parser.add_argument("--bits", type=int, default=2, help="--residual quant: bits per key and value")
    parser.add_argument("--quant-group", type=int, default=32, help="--residual quant: channels per value scale")
    parser.add_argument("--pair-bound", action="store_true",
                        help="bound each RoPE channel pair by the lesser of the box and |q| · max |k| (+D/2 values)")
    parser.add_argument("--sticky", action="store_true",
                        help="a block's score is at least the share it got when it was last attended (the step before)")
    parser.add_argument("--sticky-share", type=float, default=0.0, help="sticky: the least share that counts")
    parser.add_argument("--oracle-layers", default="", help="comma-separated layers that use the oracle instead")
    parser.add_argument("--per-layer", action="store_true", help="print each layer's read fraction")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = read_reference(args.reference)  # a link, a huge or damaged file: refused, naming the fix
    model, tokenizer = models.load(data.get("model", "demo"))
    prompts = [p for p in load_reference(args.reference, data)[0]
               if not args.prompts or p.key.startswith(tuple(args.prompts.split(",")))]
    for rule in args.rules.split(","):
        if rule not in RULES:
            raise SystemExit(f"--rules: {rule!r} is not one of {', '.join(RULES)}")
        budget = SparseBudget(args.budget, args.sinks, args.recent, args.dense_layers)
        study = Study(rule, budget, args.block_tokens, model.config.num_hidden_layers, args.top_p, args.cap,
                      args.cover, args.account)
        study.mix, study.agg, study.rank, study.parts = args.mix, args.agg, args.rank, args.parts
        study.residual, study.pair_bound, study.sticky = args.residual, args.pair_bound, args.sticky
        study.sticky_share = args.sticky_share
        study.bits, study.quant_group = args.bits, args.quant_group
        study.oracle_layers = frozenset(int(n) for n in args.oracle_layers.split(",") if n)
        AttentionInterface.register("selection_study", study.attend)
        model.set_attn_implementation("selection_study")
        started, correct, needles, fidelity = time.perf_counter(), 0, 0, {}
        for prompt in prompts:
            study.credit, study.bases, study.seen = 0, {}, {}
            generated, logits = decode_saved(model, args.reference, prompt)
            if prompt.task == "fidelity":
                reference = load_logprobs(logprob_path(args.reference, prompt), prompt, model.config.vocab_size)
                fidelity[prompt.length] = fidelity.get(prompt.length, Agreement()) + compare(reference, logits)
            else:
                needles += 1
                correct += answer_matches(prompt.answer, tokenizer.decode(generated, skip_special_tokens=True))
        cells = [f"needles {correct}/{needles}"] if needles else []
        cells += [f"fidelity {n}: top-1 {a.top1:.1%}, KL {a.kl_mean:.3f}" for n, a in sorted(fidelity.items())]
        rule += f" mix={args.mix:g}" if rule in ("mixed", "submeans") and args.mix != 0.5 else ""
        rule += f" parts={args.parts}" if rule.startswith("submeans") else ""
        rule += f" agg={args.agg}" if args.agg != "max" else ""
        rule += f" rank={args.rank}" if rule == "lowrank" else ""
        rule += f" residual={args.residual}" if args.residual != "none" else ""
        rule += " pair-bound" if args.pair_bound else ""
        rule += f" sticky>={args.sticky_share:g}" if args.sticky else ""
        rule += f" oracle in layers {args.oracle_layers}" if args.oracle_layers else ""
        if rule.endswith("top-p"):
            rule = f"{rule} p={args.top_p:g} {args.cover} cap={args.cap:g}{' account' if args.account else ''}"
        print(f"{rule:16s} budget {args.budget:g}, blocks read {study.read / max(study.total, 1):.1%}: "
              f"{'; '.join(cells)} ({time.perf_counter() - started:.0f} s)", flush=True)
        if args.per_layer:
            print("  per layer:", " ".join(f"{r / t:.2f}" for _, (r, t) in sorted(study.per_layer.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
