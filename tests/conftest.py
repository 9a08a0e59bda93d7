"""Fixtures shared by the whole suite: the real default model, loaded once per session."""

from __future__ import annotations

import os

import pytest
import torch

# Nothing may download at run time; make Hugging Face libraries fail loudly instead of trying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without CUDA, Triton kernels can only run in Triton's interpreter, which must be chosen before anything
# (torch._dynamo via transformers, for one) imports triton; tests/kernels/conftest.py checks it took effect.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def checkpoint():
    from shared.model.checkpoint import load_checkpoint

    return load_checkpoint()
