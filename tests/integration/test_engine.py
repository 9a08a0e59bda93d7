"""The engine on the real model: batching, chunked prefill, prefix reuse, preemption (and a request that outgrows the
whole pool), sampling, stops, cancel."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_build import cpu_has_avx512_bf16
from shared.engine.sequence import FinishReason
from shared.wire.protocol import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
BF16_LOGIT_TOLERANCE = 1.0  # logits of bf16 engines on other kernels differ by this much at most (measured: 0.375)
STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his father had "
    "taught him, and lit the great lamp that warned ships away from the rocks. "
)


def _alone(engine, ids, params=GREEDY):
    [completion] = engine.generate([ids], params)
    return completion


@pytest.mark.parametrize(
    "texts",
    [("Hello, my name is", STORY, "1, 2, 3, 4,"), tuple(f"Story {i}: {STORY}" for i in range(3))],
    ids=["unlike-lengths", "alike-lengths"],  # alike lengths take the padded batched prefill attention
)
def test_batched_requests_match_each_alone(checkpoint, engine, texts):
    prompts = [checkpoint.tokenizer.encode(t) for t in texts]
    alone = [_alone(engine, p).token_ids for p in prompts]
    together = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    assert together == alone


def test_requests_join_and_leave_between_steps(checkpoint, engine):
    first, second = checkpoint.tokenizer.encode(STORY), checkpoint.tokenizer.encode("The weather today is")
    expected_first, expected_second = _alone(engine, first).token_ids, _alone(engine, second).token_ids
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine.add_request("first", first, params)
    tokens: dict[str, list[int]] = {"first": [], "second": []}
    for _ in range(5):
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert 0 < len(tokens["first"]) < 16  # the first request is mid-generation when the second joins
    engine.add_request("second", second, params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert tokens == {"first": expected_first, "second": expected_second}


def test_chunked_prefill_matches_single_pass(checkpoint, engine, make_engine):
    ids = checkpoint.tokenizer.encode(STORY * 3)
    chunked = make_engine(max_num_batched_tokens=24)
    assert _alone(chunked, ids).token_ids == _alone(engine, ids).token_ids


def test_prefix_reuse_computes_only_new_tokens_and_matches(checkpoint, make_engine):
    prefix = checkpoint.tokenizer.encode(STORY * 2)
    first = prefix + checkpoint.tokenizer.encode(" Question: who climbed the stairs?")
    second = prefix + checkpoint.tokenizer.encode(" Question: what did the lamp warn?")
    cached_engine, cold_engine = make_engine(), make_engine(enable_prefix_caching=False)
    _alone(cached_engine, first)
    reused = _alone(cached_engine, second)
    cold = _alone(cold_engine, second)
    block = 16
    assert reused.num_cached_tokens == (len(prefix) // block) * block > 0
    assert cold.num_cached_tokens == 0
    assert reused.token_ids == cold.token_ids


def test_preemption_under_a_tiny_pool_keeps_outputs(checkpoint, engine, make_engine):
    prompts = [checkpoint.tokenizer.encode(f"{i}: {STORY}") for i in range(4)]
    expected = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    blocks_per_seq = -(-(len(prompts[0]) + 16) // 16)
    bytes_per_block = engine.store.block_footprint
    tiny = make_engine(kv_cache_bytes=bytes_per_block * (blocks_per_seq * 2 + 1))
    assert [c.token_ids for c in tiny.generate(prompts, GREEDY)] == expected
    assert tiny.block_manager.num_free_blocks == tiny.block_manager.num_blocks


def test_a_request_that_outgrows_the_whole_pool_ends_with_length_and_the_engine_serves_on(checkpoint, engine,
                                                                                         make_engine):
    ids = checkpoint.tokenizer.encode(STORY)
    bytes_per_block = engine.store.block_footprint
    blocks = -(-(len(ids) + 1) // 16) + 1  # the prompt and one more block of output, no more
    tiny = make_engine(kv_cache_bytes=bytes_per_block * blocks)
    long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    ended = _alone(tiny, ids, long)
    # Every token but the last sampled one has its KV in the pool, which is full.
    assert ended.finish_reason is FinishReason.LENGTH and len(ids) + len(ended.token_ids) == blocks * 16 + 1
    assert ended.token_ids == _alone(engine, ids, long).token_ids[: len(ended.token_ids)]
    assert tiny.block_manager.num_free_blocks == tiny.block_manager.num_blocks and not tiny.has_unfinished()
    assert _alone(tiny, ids).token_ids == _alone(engine, ids).token_ids  # it serves on


def test_same_seed_same_output_other_seed_differs(checkpoint, engine):
    ids = checkpoint.tokenizer.encode("Write a short poem about the moon:")
    sampled = [SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=s) for s in (7, 7, 8)]
    a, b, c = (_alone(engine, ids, p).token_ids for p in sampled)
    assert a == b
    assert a != c


def test_a_seeded_answer_moved_mid_way_goes_on_as_it_would_have(checkpoint, engine):
    """Placed again after 5 tokens (they end its prompt, `output_offset` 5), a seeded request draws what it would
    have drawn in one piece."""
    ids = checkpoint.tokenizer.encode("Write a short poem about the moon:")
    whole = _alone(engine, ids, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=7)).token_ids
    rest = SamplingParams(max_tokens=11, temperature=1.0, top_p=0.95, seed=7, output_offset=5)
    assert _alone(engine, [*ids, *whole[:5]], rest).token_ids == whole[5:]
    restarted = SamplingParams(max_tokens=11, temperature=1.0, top_p=0.95, seed=7)  # drawing from position 0 again
    assert _alone(engine, [*ids, *whole[:5]], restarted).token_ids != whole[5:]


def test_stop_string_truncates_text(checkpoint, engine):
    ids = checkpoint.tokenizer.encode(STORY)
    full = _alone(engine, ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)).text
    words = full.split()
    stop = words[len(words) // 2]
    stopped = _alone(engine, ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,)))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.text == full[: full.index(stop)]


def test_eos_ends_a_chat_answer_and_ignore_eos_does_not(checkpoint, engine):
    ids = checkpoint.tokenizer.encode_chat([{"role": "user", "content": "Reply with one word: hello."}])
    answer = _alone(engine, ids, SamplingParams(max_tokens=64, temperature=0.0))
    assert answer.finish_reason is FinishReason.STOP
    assert len(answer.token_ids) < 64
    assert not set(answer.token_ids) & set(checkpoint.tokenizer.eos_token_ids)
    forced = _alone(engine, ids, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    assert forced.finish_reason is FinishReason.LENGTH and len(forced.token_ids) == 64


def test_max_tokens_gives_exactly_that_many(checkpoint, engine):
    out = _alone(engine, checkpoint.tokenizer.encode(STORY), SamplingParams(max_tokens=5, temperature=0.0))
    assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 5


def test_abort_frees_blocks_and_others_continue(checkpoint, engine):
    ids = checkpoint.tokenizer.encode(STORY)
    expected = _alone(engine, ids).token_ids
    engine.add_request("doomed", ids, GREEDY)
    engine.add_request("kept", ids, GREEDY)
    kept = [t for out in engine.step() if out.request_id == "kept" for t in out.new_token_ids]
    aborted = engine.abort("doomed")
    assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
    assert engine.abort("doomed") is None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "kept"
            kept.extend(out.new_token_ids)
    assert kept == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bad_requests_are_refused(checkpoint, engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="context"):
        engine.add_request("long", [1] * checkpoint.config.max_position, GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_a_prompt_larger_than_the_whole_pool_is_refused_not_queued_forever(make_engine) -> None:
    small = make_engine(kv_cache_bytes=4 << 20)  # a handful of 16-token blocks
    capacity = small.block_manager.num_blocks * 16
    with pytest.raises(ValueError, match=f"holds {small.block_manager.num_blocks}"):
        small.add_request("huge", [1] * capacity, GREEDY)  # its first generated token would need one more block
    assert not small.has_unfinished()
    small.add_request("fits", [1] * (capacity - 1), SamplingParams(max_tokens=1, temperature=0.0))
    assert [out.request_id for out in small.step()] == ["fits"]


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the C++ kernels' bf16 paths need AVX512-BF16")
def test_the_cpu_kernels_compute_in_bf16_what_the_references_compute(checkpoint, make_engine):
    """bf16 on the C++ kernels (layer ops, prompts' attention over their own k, v, decode attention) against the same
    engine on the PyTorch references: the prompts' next-token logits agree within bf16's rounding, and the greedy
    continuations are the same up to a near-tie: where they part, the token the kernels chose is within that rounding
    of the best one for the references, given the same text before it (as vLLM's `check_logprobs_close` allows)."""
    prompts = [checkpoint.tokenizer.encode(f"Story {i}: {STORY}") for i in range(3)]  # alike: one attention call
    engines = {kernels: make_engine(dtype="bf16", kernels=kernels) for kernels in ("cpu", "torch")}

    def logits_and_tokens(kernels: str, texts: list[list[int]], max_tokens: int
                          ) -> tuple[list[torch.Tensor], list[list[int]]]:
        model, logits = engines[kernels].runner.model, []
        compute_logits = model.compute_logits
        model.compute_logits = lambda hidden: logits.append(compute_logits(hidden).float()) or logits[-1]
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            return logits, [c.token_ids for c in engines[kernels].generate(texts, params)]
        finally:
            model.compute_logits = compute_logits

    (ours, *_), our_tokens = logits_and_tokens("cpu", prompts, 8)
    (reference, *_), reference_tokens = logits_and_tokens("torch", prompts, 8)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    assert (ours - reference).abs().max() < BF16_LOGIT_TOLERANCE, (ours - reference).abs().max()  # measured: 0.375
    for prompt, mine, theirs in zip(prompts, our_tokens, reference_tokens, strict=True):
        parted = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
        if parted is None:
            continue
        (logits, *_), _ = logits_and_tokens("torch", [prompt + mine[:parted]], 1)
        gap = float(logits[0].max() - logits[0, mine[parted]])
        assert gap < BF16_LOGIT_TOLERANCE, f"the kernels chose token {mine[parted]} at step {parted}, {gap:.3f} " \
                                           "below the references' best"
