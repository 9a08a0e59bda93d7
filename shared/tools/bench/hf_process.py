"""Runs the transformers baseline in a process of its own, so neither engine's memory state slows the other.

Measured here: with transformers' model and caches in the same process, tsukimi's batch-32 bf16 decode ran at
323 tok/s instead of 500. The worker loads the model once and answers `measure` calls one at a time.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from shared.tools.bench.hf_baseline import HFResult, load_transformers_model, measure_transformers

# The worker process's model; set once by `_load` when the worker starts (one model per worker process).
_worker_model: Any = None


def _load(gguf_path: str, dtype: torch.dtype, num_threads: int) -> None:
    global _worker_model
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    _worker_model = load_transformers_model(Path(gguf_path), dtype)


def _measure(batch_size: int, prompt_len: int, gen_len: int, seed: int) -> HFResult:
    return measure_transformers(_worker_model, batch_size, prompt_len, gen_len, seed=seed)


class TransformersProcess:
    """`with TransformersProcess(path, dtype, threads) as hf: hf.measure(...)`; the model loads in the worker on
    entry, which computes on `num_threads` torch threads (0: torch's choice), as the engine it is compared with."""

    def __init__(self, gguf_path: Path, dtype: torch.dtype, num_threads: int = 0) -> None:
        context = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(
            1, mp_context=context, initializer=_load, initargs=(str(gguf_path), dtype, num_threads)
        )

    def __enter__(self) -> TransformersProcess:
        self._pool.submit(int).result()  # wait for the worker to start and load the model
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._pool.shutdown(cancel_futures=True)

    def measure(self, batch_size: int, prompt_len: int, gen_len: int, seed: int) -> HFResult:
        """One `measure_transformers` run in the worker (see there for what is timed)."""
        return self._pool.submit(_measure, batch_size, prompt_len, gen_len, seed).result()
