"""The model against Hugging Face transformers loading the same GGUF: prefill logits and greedy continuations."""

from __future__ import annotations

import pytest
import torch

from shared.model.llama import DenseCausalAttention
from shared.wire.protocol import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
]


def test_prefill_logits_match_transformers(checkpoint, engine, hf_model):
    text = "Mooncake serves Kimi with a KVCache-centric architecture. " * 6
    ids = checkpoint.tokenizer.encode(text)
    with torch.inference_mode():
        ours = engine.runner.model.compute_logits(
            engine.runner.model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention())
        )
        theirs = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, atol=2e-3, rtol=1e-3), (ours - theirs).abs().max()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_matches_transformers(checkpoint, engine, hf_model, prompt):
    """The paged engine (not the dense path) generates exactly transformers' 32 greedy tokens.

    Both sides forbid end-of-sequence for all 32 tokens (`min_new_tokens` there, `min_tokens` here).
    """
    ids = checkpoint.tokenizer.encode(prompt)
    with torch.inference_mode():
        hf_out = hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32, min_new_tokens=32, do_sample=False,
        )[0, len(ids):].tolist()
    params = SamplingParams(max_tokens=32, temperature=0.0, min_tokens=32)
    [ours] = engine.generate([ids], params)
    assert ours.token_ids == hf_out
    assert ours.text == checkpoint.tokenizer.decode(hf_out)
