"""Fixtures shared by the whole suite: the real default model, loaded once per session."""

from __future__ import annotations

import os

import pytest

# Nothing may download at run time; make Hugging Face libraries fail loudly instead of trying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def checkpoint():
    from shared.model.checkpoint import load_checkpoint

    return load_checkpoint()
