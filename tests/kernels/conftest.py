"""Kernel test setup: without CUDA, Triton kernels run on CPU tensors through Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

IS_INTERPRETED = not torch.cuda.is_available()
# triton reads TRITON_INTERPRET when it is imported (its own helpers are jitted then). The kernels import it
# on their first launch, after this line, unless something collected earlier (torch._dynamo, pulled in by
# transformers) already imported it; then the interpreter cannot run and the Triton tests say so.
_IS_SET_TOO_LATE = os.environ.get("TRITON_INTERPRET") != "1" and "triton" in sys.modules
_IS_IMPORTED_TOO_EARLY = IS_INTERPRETED and _IS_SET_TOO_LATE
if IS_INTERPRETED:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def triton_ready() -> None:
    """Fail with the reason when triton is missing or was imported before TRITON_INTERPRET=1 was set."""
    if importlib.util.find_spec("triton") is None:
        pytest.fail("the triton package is not installed: `make test` installs it with the test extras")
    if _IS_IMPORTED_TOO_EARLY:
        message = "triton was imported before TRITON_INTERPRET=1 was set: set it in tests/conftest.py"
        pytest.fail(message, pytrace=False)
