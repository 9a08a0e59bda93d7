"""The prediction sums both eval commands report: perplexity of the true tokens, KL(reference || variant) and top-1
agreement, checked against hand-computed values on tiny vocabularies."""

from __future__ import annotations

import math

import pytest
import torch

from shared.tools.eval.agreement import Agreement, perplexity


def test_a_variant_equal_to_its_reference_agrees_fully() -> None:
    log_probs = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0], [0.0, 3.0, 0.0]]), dim=-1)
    figures = Agreement()
    figures.add(log_probs, log_probs, torch.tensor([0, 2]))
    assert figures.mean_kl == pytest.approx(0.0, abs=1e-7) and figures.top1_agreement == 1.0
    expected_nll = -(float(log_probs[0, 0]) + float(log_probs[1, 2]))
    assert figures.ppl == pytest.approx(math.exp(expected_nll / 2))


def test_kl_and_agreement_sum_over_windows() -> None:
    reference = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    variant = torch.log(torch.tensor([[0.25, 0.75], [0.6, 0.4]]))
    figures = Agreement()
    figures.add(variant[:1], reference[:1], torch.tensor([0]))
    figures.add(variant[1:], reference[1:], torch.tensor([1]))
    kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75) + 0.9 * math.log(0.9 / 0.6) + 0.1 * math.log(0.1 / 0.4)
    assert figures.mean_kl == pytest.approx(kl / 2, rel=1e-5)
    assert figures.num_predictions == 2 and figures.top1_agreement == 0.5  # row 0: argmax 1 against the tie's 0
    assert figures.ppl == pytest.approx(perplexity(-(math.log(0.25) + math.log(0.4)), 2), rel=1e-6)
