"""Fidelity figures summed over runs and prompts, checked against the same sums done by hand.

``Agreement + Agreement`` keeps the worst step's KL (a max, not a sum), and the report's fidelity cell weighs each
prompt's top-1 and mean KL by its number of compared steps, so the table gives the per-step figures of all the
steps together, whatever the prompts' lengths.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tierkv.quality import report
from tierkv.quality.metrics import compare


def _kl(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))


def test_adding_agreements_keeps_the_largest_step_kl_and_sums_the_rest():
    p1, q1 = [0.7, 0.2, 0.1], [0.1, 0.6, 0.3]
    p2, q2 = [0.6, 0.3, 0.1], [0.5, 0.3, 0.2]
    first = compare(torch.tensor([p1]).log(), torch.tensor([q1]).log())
    second = compare(torch.tensor([p2, p2]).log(), torch.tensor([q2, q2]).log())
    total = first + second
    kls = [_kl(p1, q1), _kl(p2, q2), _kl(p2, q2)]
    assert total.steps == 3 and total.top1_agree == 2  # step of the first run disagrees (0 vs 1)
    assert total.kl_max == pytest.approx(max(kls), rel=1e-6)
    assert total.kl_mean == pytest.approx(sum(kls) / 3, rel=1e-6)
    assert (second + first).kl_max == pytest.approx(max(kls), rel=1e-6)


def test_report_weighs_each_fidelity_prompt_by_its_steps(tmp_path):
    """Two fidelity prompts of one length: 4 steps all agreeing with KL 0.1 each, 12 steps with a quarter agreeing
    and KL 0.5 each. Over the 16 steps: top-1 (4 + 3) / 16, mean KL (0.4 + 6.0) / 16."""
    prompts = [{"task": "fidelity", "length": 512, "depth": None, "sample": s, "answer": None} for s in (0, 1)]
    (tmp_path / "reference.json").write_text(json.dumps({"prompts": prompts, "results": []}))
    records = [
        {"prompt": "fidelity/512/#0", "task": "fidelity", "length": 512, "depth": None, "sample": 0,
         "method": "sparse@0.1", "budget": 0.1,
         "agreement": {"steps": 4, "top1": 1.0, "kl_mean": 0.1, "kl_max": 0.1}},
        {"prompt": "fidelity/512/#1", "task": "fidelity", "length": 512, "depth": None, "sample": 1,
         "method": "sparse@0.1", "budget": 0.1,
         "agreement": {"steps": 12, "top1": 0.25, "kl_mean": 0.5, "kl_max": 0.9}},
    ]
    (tmp_path / "tierkv.json").write_text(json.dumps({"results": records}))
    table = report.aggregate(report.load_results(tmp_path))
    cell = table[("fidelity", "sparse@0.1", 512)]
    assert cell["steps"] == 16 and cell["n"] == 2
    assert cell["top1"] == pytest.approx(7 / 16)
    assert cell["kl_mean"] == pytest.approx((4 * 0.1 + 12 * 0.5) / 16)
    assert "| tierkv sparse 10% | 43.8% / 0.400 |" in report.markdown(report.load_results(tmp_path))
