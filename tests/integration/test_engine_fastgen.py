"""The engine with FastGen, on the real model: at T = 1 it answers exactly as the full cache does; below 1 its decode
is the quality harness's FastGen token for token (lanes against masks), it holds fewer blocks than the full cache and
gives them all back; under a pool too small for everyone it preempts and still completes, and lanes that outgrow the
whole pool end their request with "length"; a codec without lane records is refused (kvquant:
`test_engine_fastgen_codec`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shared.engine.engine import LLMEngine
from shared.engine.sequence import FinishReason
from shared.fastgen.kept import FastGenRule
from shared.fastgen.policies import FastGenSettings
from shared.fastgen.profile import LayerProfile, profile_layer
from shared.fastgen.token_classes import TokenClasses
from shared.model.llama import RotaryEmbedding, build_model
from shared.tools.eval.fastgen_attention import DecodeAttention, PrefillAttention
from shared.tools.eval.fastgen_codecs import ServedKv
from shared.wire.protocol import SamplingParams

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
TEXT = Path(__file__).parents[2] / "README.md"  # English prose that travels with the repository


def _prompt(engine: LLMEngine, num_tokens: int = 300) -> list[int]:
    with open(TEXT, encoding="utf-8") as f:
        return engine.tokenizer.encode(f.read(20_000))[:num_tokens]


def _fastgen(make_engine, threshold: float, **settings: object) -> LLMEngine:
    return make_engine(kv_policy="fastgen", fastgen=FastGenSettings(threshold=threshold, profile_rows=128), **settings)


def _held_blocks(engine: LLMEngine) -> int:
    manager = engine.block_manager
    return manager.num_blocks - manager.num_free_blocks


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], list[int]]:
    """The tokens, and the blocks held after each step (prefix-cache blocks nobody holds are not counted)."""
    engine.add_request("r", prompt, params)
    tokens, held = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
        held.append(_held_blocks(engine))
    engine.block_manager.check_invariants()
    return tokens, held


def test_at_threshold_one_fastgen_answers_as_the_full_cache(make_engine) -> None:
    full, fastgen = make_engine(), _fastgen(make_engine, 1.0)
    prompt = _prompt(full)
    expected, _ = _run(full, prompt)
    tokens, _ = _run(fastgen, prompt)
    assert tokens == expected
    assert fastgen.fastgen is not None and not fastgen.fastgen.sequences  # released at the end


def test_below_one_it_holds_fewer_blocks_and_gives_them_back(make_engine) -> None:
    full, fastgen = make_engine(), _fastgen(make_engine, 0.9)
    prompt = _prompt(full)
    _, full_held = _run(full, prompt)
    fastgen.add_request("r", prompt, GREEDY)
    fastgen.step()  # the prompt: profiled, then moved to lanes
    assert fastgen.fastgen is not None
    saved = fastgen.fastgen.bytes_saved("r")
    held = fastgen.fastgen.bytes_held("r")
    assert saved > 0.1 * (saved + held)
    lanes_held = []
    while fastgen.has_unfinished():
        fastgen.step()
        lanes_held.append(_held_blocks(fastgen))
    assert max(lanes_held[:-1]) < min(full_held[:-1])  # every decode step: fewer blocks than the full cache's
    assert lanes_held[-1] == 0 and fastgen.fastgen.lanes.num_blocks_held == 0
    fastgen.block_manager.check_invariants()


def harness_predictions(
    checkpoint, prompt: list[int], generated: list[int], settings: FastGenSettings,
    served: Callable[[RotaryEmbedding], ServedKv] | None = None,
) -> tuple[list[int], list[LayerProfile]]:
    """The quality harness's FastGen (its K/V as `served` makes them, if given) over `prompt` then `generated` fed a
    token at a time: its greedy prediction after the prompt and after each generated token but the last, and the
    prompt's profile."""
    ids = torch.tensor(prompt + generated)
    config = checkpoint.config
    classes = TokenClasses.from_tokenizer(checkpoint.tokenizer, config.vocab_size).of(ids)
    prompt_classes = (classes[0][: len(prompt)], classes[1][: len(prompt)])
    model = build_model(config, checkpoint.state_dict, torch.float32, torch.device("cpu"))
    profiles: list[LayerProfile] = []
    prefill = PrefillAttention(settings.profile_rows, lambda layer, probs: profiles.append(
        profile_layer(probs, prompt_classes, config.num_kv_heads, settings)))
    with torch.inference_mode():
        hidden = model(ids[: len(prompt)], torch.arange(len(prompt)), prefill)
        predicted = [int(model.compute_logits(hidden[-1:]).argmax())]
        rules = [[FastGenRule(p.policies, classes, settings) for p in profiles]]
        coded = [] if served is None else [served(model.rotary)]
        ctx = DecodeAttention(prefill, [p.scores for p in profiles], rules, len(ids), coded)
        for _ in generated[:-1]:
            position = ctx.start_step()
            hidden = model(ids[position : position + 1], torch.tensor([position]), ctx)
            predicted.append(int(model.compute_logits(hidden).argmax()))
    assert any(int(policy) != settings.full for layer in profiles for policy in layer.policies)  # something evicts
    return predicted, profiles


def test_the_engine_decodes_as_the_quality_harness(make_engine, checkpoint) -> None:
    """The lanes (entries in any order, moved on eviction) against the harness's masks over a dense cache."""
    settings = FastGenSettings(threshold=0.9, profile_rows=128)
    engine = make_engine(kv_policy="fastgen", fastgen=settings)
    prompt = _prompt(engine)
    generated, _ = _run(engine, prompt)
    assert harness_predictions(checkpoint, prompt, generated, settings)[0] == generated


def test_a_pool_too_small_for_everyone_preempts_and_completes(make_engine) -> None:
    fastgen = _fastgen(make_engine, 0.9, kv_cache_bytes=8 << 20, max_num_seqs=4)  # 11 blocks of 16 tokens
    prompts = [_prompt(fastgen, 60 + 7 * i) for i in range(4)]
    done = fastgen.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert [len(c.token_ids) for c in done] == [40] * 4
    assert _held_blocks(fastgen) == 0 and fastgen.fastgen is not None and fastgen.fastgen.lanes.num_blocks_held == 0
    fastgen.block_manager.check_invariants()


def test_lanes_that_outgrow_the_whole_pool_end_the_request_with_length(make_engine) -> None:
    fastgen = _fastgen(make_engine, 1.0, kv_cache_bytes=8 << 20)  # keeps every token; 11 blocks of 16 tokens
    ended = fastgen.generate([_prompt(fastgen, 60)], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    assert ended[0].finish_reason is FinishReason.LENGTH and 60 < 60 + len(ended[0].token_ids) <= 11 * 16 + 1
    assert _held_blocks(fastgen) == 0 and fastgen.fastgen is not None and fastgen.fastgen.lanes.num_blocks_held == 0
    fastgen.block_manager.check_invariants()


def test_fastgen_over_a_codec_without_lane_records_is_refused(make_engine) -> None:
    with pytest.raises(ValueError, match="raw pool or a kvquant codec, not kivi-4"):
        make_engine(kv_policy="fastgen", kv_codec="kivi-4")
