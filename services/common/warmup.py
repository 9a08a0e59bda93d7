"""Before an instance serves, it times a few engine steps of its own: its first heartbeat then carries them, and the
scheduler's cost models start from this machine's speed instead of a prior. A burst that arrives before any real
step would otherwise be admitted, or refused, on a guess (the prior is one CPU core's; machines differ by 2x).

Runs on the engine thread; the warm-up requests leave no sequence behind (their blocks may stay cached).
"""

from __future__ import annotations

import time

from shared.engine.engine import LLMEngine, StepStats
from shared.wire.protocol import SamplingParams

PROMPT_LENGTHS = (16, 32, 64, 128, 192, 256, 384, 512, 768)  # one prefill step each; the first also warms caches
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)  # a few pure decode steps at each size
DECODE_PROMPT_LEN = 16
DECODE_STEPS = 3
FIRST_TOKEN_ID = 1000  # ordinary tokens, clear of every control token


def _prompt(length: int, salt: int) -> list[int]:
    return [FIRST_TOKEN_ID + (i * 7919 + salt) % 30_000 for i in range(length)]


def time_prefill_steps(engine: LLMEngine) -> list[StepStats]:
    """One prompt per length, each in a step of its own; the first step (cold caches) is not kept."""
    stats = []
    # One salt per length, all distinct: prompts of equal salt share their first tokens, and a longer one would then
    # reuse a shorter one's cached blocks and time fewer tokens than its length.
    first_salt = (time.time_ns() % 997) * len(PROMPT_LENGTHS)
    for index, length in enumerate(PROMPT_LENGTHS):
        if length >= min(engine.model_config.max_position, engine.config.max_num_batched_tokens):
            break
        request_id = f"warmup-prefill-{length}"
        engine.add_request(request_id, _prompt(length, first_salt + index), SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()
        if engine.last_step is not None:
            stats.append(engine.last_step)
    return stats[1:]


def time_decode_steps(engine: LLMEngine) -> list[list[float]]:
    """`[batch size, context tokens, seconds]` of pure decode steps at each batch size the engine can run."""
    samples: list[list[float]] = []
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)
    for batch in DECODE_BATCHES:
        if batch > engine.runner.max_num_seqs:
            break
        for i in range(batch):
            engine.add_request(f"warmup-decode-{batch}-{i}", _prompt(DECODE_PROMPT_LEN, batch * 31 + i), params)
        while engine.has_unfinished():
            running = engine.scheduler.running
            is_pure_decode = not engine.scheduler.waiting and all(s.num_uncomputed_tokens == 1 for s in running)
            size, context = len(running), sum(s.num_tokens for s in running)
            started = time.perf_counter()
            engine.step()
            if is_pure_decode and size:
                samples.append([float(size), float(context), time.perf_counter() - started])
    return samples
