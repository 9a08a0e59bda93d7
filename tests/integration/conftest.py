"""Integration fixtures: engines over the real model, and the Hugging Face oracle."""

from __future__ import annotations

import pytest

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine


@pytest.fixture(scope="session")
def make_engine(checkpoint):
    """Build an engine over the session's checkpoint with small-pool defaults that tests override."""

    def build(**settings: object) -> LLMEngine:
        defaults: dict[str, object] = dict(device="cpu", dtype="fp32", kv_cache_bytes=64 << 20, block_size=16)
        defaults.update(settings)
        return LLMEngine(checkpoint, EngineConfig(**defaults))  # type: ignore[arg-type]

    return build


@pytest.fixture(scope="session")
def engine(make_engine) -> LLMEngine:
    return make_engine()


@pytest.fixture(scope="session")
def hf_model(checkpoint):
    """transformers' own loading of the same GGUF: the independent oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(checkpoint.path.parent), gguf_file=checkpoint.path.name, dtype=torch.float32
    )
    return model.eval()
