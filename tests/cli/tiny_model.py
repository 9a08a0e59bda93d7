"""A random-weight model of a given (tiny) shape, for harness tests that need a real forward pass but not real text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shared.model.checkpoint import Checkpoint, expected_shapes
from shared.model.config import LlamaConfig


def tiny_checkpoint(config: LlamaConfig, seed: int = 0) -> Checkpoint:
    """Weights drawn from N(0, 0.2^2) by `seed`, norms at 1; no tokenizer (the harnesses are given token ids)."""
    g = torch.Generator().manual_seed(seed)
    state_dict = {name: torch.randn(shape, generator=g) * 0.2 for name, shape in expected_shapes(config).items()}
    for name in state_dict:
        if name.endswith("norm.weight"):
            state_dict[name] = torch.ones_like(state_dict[name])
    no_tokenizer: Any = None
    return Checkpoint(config, state_dict, no_tokenizer, fingerprint="0" * 16, path=Path("tiny"))
