"""How close an approximate attention's next-token distributions are to full attention's.

Per decode step, from the two logit rows over the vocabulary: whether the top-1 tokens agree, and the KL
divergence KL(full || method) in nats — how much probability mass the approximation moves. Both are
independent of any task: a method can keep a needle's answer and still change what the model would say
next elsewhere, and these catch that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Agreement:
    """Per-step comparison of a method against full attention, summed so runs can be added up."""

    steps: int = 0
    top1_agree: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0

    @property
    def top1(self) -> float:
        return self.top1_agree / self.steps if self.steps else float("nan")

    @property
    def kl_mean(self) -> float:
        return self.kl_sum / self.steps if self.steps else float("nan")

    def __add__(self, other: Agreement) -> Agreement:
        return Agreement(self.steps + other.steps, self.top1_agree + other.top1_agree,
                         self.kl_sum + other.kl_sum, max(self.kl_max, other.kl_max))

    def to_dict(self) -> dict[str, float]:
        return {"steps": self.steps, "top1": self.top1, "kl_mean": self.kl_mean, "kl_max": self.kl_max}


def compare(reference_logprobs: torch.Tensor, logits: torch.Tensor) -> Agreement:
    """Compare ``logits`` ``[S, V]`` of a method with full attention's log-probabilities ``[S, V]``.

    KL(full || method) per step = sum_v p_full(v) * (log p_full(v) - log p_method(v)), in float64 so that
    near-identical distributions give near-zero (not negative) values.
    """
    if reference_logprobs.shape != logits.shape:
        raise ValueError(f"shapes differ: reference {tuple(reference_logprobs.shape)}, method {tuple(logits.shape)}")
    ref = reference_logprobs.double()
    own = torch.log_softmax(logits.double(), dim=-1)
    kl = (ref.exp() * (ref - own)).sum(-1).clamp_min(0.0)  # [S]
    agree = int((ref.argmax(-1) == own.argmax(-1)).sum())
    return Agreement(int(ref.shape[0]), agree, float(kl.sum()), float(kl.max()) if kl.numel() else 0.0)
