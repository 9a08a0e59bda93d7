"""Chunked pipeline parallelism inside the engine (issue 22): engines that each own a range of the real model's
layers compute one long prompt chunk by chunk, the residual stream of each chunk passed from stage to stage. The
first token, and the answer a decode engine continues from KV gathered from every stage, must equal one engine doing
everything; a stage holds only its layers' weights and KV, and fails cleanly what it cannot compute."""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import LLMEngine, PrefilledRequest, RequestOutput
from shared.engine.kv.prefix_load import PrefixLoad, PrefixSource
from shared.engine.kv.store import PromptKv, PromptLayerKv
from shared.engine.sequence import FinishReason
from shared.model.cpu_linear import PackedLinear
from shared.model.stages import LayerRange, split_layers
from shared.wire.protocol import SamplingParams

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
CHUNK = 192  # the token budget of a step: a prompt of ~1,100 tokens takes six chunks through each stage


def _prompt(engine: LLMEngine, words: str = "harvest moon") -> list[int]:
    text = f"Under the {words}, the villagers tell the old story of the rabbit who pounds rice cakes. " * 55
    return engine.tokenizer.encode(text)


class Pipeline:
    """Stage engines driven in turn, as the prefill instances of a group would be: each step of a stage hands the
    rows it computed to the next; every stage reads its layers' KV of a finished prompt as it lands."""

    def __init__(self, stages: list[LLMEngine], sources: dict[int, PrefixSource] | None = None) -> None:
        self.stages = stages
        self.sources = sources or {}  # a later stage's (by index) load of the prefix the first stage reused
        self.kv: dict[str, dict[int, PromptLayerKv]] = {}  # request -> global layer -> KV
        self.num_steps = [0] * len(stages)

    def run(self, request_id: str, prompt: list[int]) -> RequestOutput:
        """The prompt through every stage; the last stage's output with the first token (or the first failure)."""
        self.kv[request_id] = {}
        self.stages[0].add_request(request_id, prompt, GREEDY)
        while True:
            for index, engine in enumerate(self.stages):
                if not engine.has_unfinished():
                    continue
                self.num_steps[index] += 1
                for out in engine.step(self._reader(engine, index)):
                    if out.finish_reason == FinishReason.ERROR or index == len(self.stages) - 1:
                        return out
                    following = self.stages[index + 1]
                    if out.request_id not in following._seqs:  # its first rows: the stage after starts it
                        following.add_stage_request(request_id, prompt, GREEDY, out.num_cached_tokens,
                                                    self.sources.get(index + 1))
                    assert out.stage_rows is not None
                    following.add_stage_input(request_id, out.stage_rows)

    def _reader(self, engine: LLMEngine, index: int):  # noqa: ANN202
        stage = engine.config.stage
        assert stage is not None

        def on_layer(layer_idx: int, seqs: list) -> None:  # noqa: ANN001
            for seq in seqs:
                self.kv[seq.request_id][stage.start + layer_idx] = engine.read_prompt_kv(seq.request_id, layer_idx)

        return on_layer

    def prompt_kv(self, request_id: str) -> PromptKv:
        layers = self.kv[request_id]
        return PromptKv.of_layers([layers[i] for i in range(len(layers))])


def _stages(make_engine, ranges: list[LayerRange]) -> list[LLMEngine]:
    return [make_engine(stage=r, max_num_batched_tokens=CHUNK) for r in ranges]


def _decode_rest(decode: LLMEngine, request_id: str, prompt: list[int], first: RequestOutput, kv: PromptKv,
                 num_cached: int = 0) -> list[int]:
    decode.add_prefilled(PrefilledRequest(request_id, prompt, first.new_token_ids[0], len(first.new_text), GREEDY,
                                          kv, num_cached))
    tokens = list(first.new_token_ids)
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("num_stages", [2, 3])
def test_stages_prefill_what_one_engine_does(make_engine, num_stages: int) -> None:
    whole = make_engine(max_num_batched_tokens=CHUNK)
    prompt = _prompt(whole)
    assert len(prompt) > 5 * CHUNK
    (expected,) = whole.generate([prompt], GREEDY)
    pipeline = Pipeline(_stages(make_engine, split_layers(whole.model_config.num_layers, num_stages)))
    first = pipeline.run("r1", prompt)
    assert first.finish_reason is None and first.new_token_ids == expected.token_ids[:1]
    # every stage ran the prompt in chunks (the first six of them, the later ones as rows arrived)
    assert min(pipeline.num_steps) >= -(-len(prompt) // CHUNK)
    kv = pipeline.prompt_kv("r1")
    assert len(kv.layers) == whole.model_config.num_layers
    tokens = _decode_rest(make_engine(), "r1", prompt, first, kv)
    assert tokens == expected.token_ids


def test_stages_of_whole_engines_share_their_weights(make_engine) -> None:
    """A prefill instance of a group keeps its whole model for short prompts; its stage of long ones runs on the
    same weights, with a KV pool of its own."""
    whole = make_engine(max_num_batched_tokens=CHUNK)
    prompt = _prompt(whole)
    (expected,) = whole.generate([prompt], GREEDY)
    ranges = split_layers(whole.model_config.num_layers, 2)
    hosts = [make_engine(max_num_batched_tokens=CHUNK) for _ in ranges]
    stages = [host.stage_engine(r, 32 << 20) for host, r in zip(hosts, ranges, strict=True)]
    for host, stage in zip(hosts, stages, strict=True):
        shared = {id(p) for p in host.runner.model.parameters()}
        assert all(id(p) in shared for p in stage.runner.model.parameters())
        assert stage.store.num_layers == len(stage.config.stage) and stage.block_manager is not host.block_manager
    pipeline = Pipeline(stages)
    first = pipeline.run("r1", prompt)
    tokens = _decode_rest(make_engine(), "r1", prompt, first, pipeline.prompt_kv("r1"))
    assert tokens == expected.token_ids
    assert hosts[0].generate([prompt], GREEDY)[0].token_ids == expected.token_ids  # the host still runs whole
    with pytest.raises(ValueError, match="of a whole-model engine, not of a stage"):
        stages[0].stage_engine(ranges[0], 16 << 20)


def test_stage_holds_only_its_layers(make_engine) -> None:
    whole = make_engine()
    first, last = (make_engine(stage=r) for r in split_layers(whole.model_config.num_layers, 2))
    def count(engine: LLMEngine) -> int:  # weights, packed matmuls included
        model = engine.runner.model
        packed = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, PackedLinear))
        return packed + sum(p.numel() for p in model.parameters())

    # every layer's weights in one stage, the tied embedding in both (and the last's packed LM head)
    embedding = whole.model_config.vocab_size * whole.model_config.hidden_size
    assert count(first) + count(last) == count(whole) + embedding
    assert first.store.num_layers + last.store.num_layers == whole.store.num_layers
    assert not hasattr(first.runner.model, "lm_head") and len(first.runner.model.layers) == len(first.config.stage)


def test_stages_reuse_a_prefix_each_for_its_layers(make_engine) -> None:
    """The second prompt shares the first's leading blocks: the first stage reuses them, and so does the second,
    for its own layers; the answer is still one engine's."""
    whole = make_engine(max_num_batched_tokens=CHUNK)
    prompt = _prompt(whole)
    other = prompt[: len(prompt) // 2] + _prompt(whole, "autumn sky")[: len(prompt) // 2]
    (expected,) = whole.generate([other], GREEDY)
    pipeline = Pipeline(_stages(make_engine, split_layers(whole.model_config.num_layers, 2)))
    pipeline.run("r1", prompt)
    first = pipeline.run("r2", other)
    assert first.num_cached_tokens >= len(prompt) // 2 - 16
    tokens = _decode_rest(make_engine(), "r2", other, first, pipeline.prompt_kv("r2"))
    assert tokens == expected.token_ids


def test_a_stage_without_the_reused_prefix_fails_the_request(make_engine) -> None:
    warm, cold = (make_engine(stage=r, max_num_batched_tokens=CHUNK) for r in split_layers(30, 2))
    prompt = _prompt(warm)
    Pipeline([warm, make_engine(stage=cold.config.stage, max_num_batched_tokens=CHUNK)]).run("r1", prompt)
    out = Pipeline([warm, cold]).run("r2", prompt)  # warm reuses the prompt's blocks; cold never saw them
    assert out.finish_reason == FinishReason.ERROR and "this stage holds 0 of the" in out.error
    assert "its prefix cache and the cache-store" in out.error
    assert not cold.has_unfinished() and not warm.has_unfinished()


def test_a_stage_loads_the_reused_prefix_its_cache_lacks_and_answers_as_one_engine(make_engine) -> None:
    """The first stage reuses a prefix its cache holds; the later stage, whose cache never saw it, loads its layers
    of those blocks (here another engine's of the same stage, as the cache-store would give them) and the prompt
    decodes as one engine's."""
    whole = make_engine(max_num_batched_tokens=CHUNK)
    prompt = _prompt(whole)
    (expected,) = whole.generate([prompt], GREEDY)
    ranges = split_layers(30, 2)
    warm, sibling, cold = (make_engine(stage=r, max_num_batched_tokens=CHUNK) for r in (ranges[0], *ranges[1:] * 2))
    first = Pipeline([warm, sibling]).run("r1", prompt)
    assert first.finish_reason != FinishReason.ERROR
    num_reused = warm.block_manager.num_reusable_tokens(prompt)
    payloads = sibling.export_block_payloads("r1", 0, num_reused // sibling.config.block_size)
    sibling.abort("r1")

    def start(first_block: int, block_ids: list[int]) -> PrefixLoad:
        load = PrefixLoad(cold.store, block_ids, first_block=first_block)
        for i in range(len(block_ids)):
            load.write(i, payloads[first_block + i])
        return load

    pipeline = Pipeline([warm, cold], {1: PrefixSource(num_reused, start)})
    out = pipeline.run("r2", prompt)
    assert out.finish_reason != FinishReason.ERROR and out.num_cached_tokens == num_reused > 0
    assert _decode_rest(make_engine(), "r2", prompt, out, pipeline.prompt_kv("r2")) == expected.token_ids


def test_stage_requests_are_checked(make_engine) -> None:
    first, last = (make_engine(stage=r) for r in split_layers(30, 2))
    prompt = _prompt(first)[:100]
    params = GREEDY
    with pytest.raises(ValueError, match="only a pipeline stage after the first"):
        first.add_stage_request("a", prompt, params, 0)
    with pytest.raises(ValueError, match="stage input from token 100"):
        last.add_stage_request("a", prompt, params, 100)
    assert not last.has_unfinished()
    last.add_stage_request("b", prompt, params, 0)
    with pytest.raises(ValueError, match="hidden size"):
        last.add_stage_input("b", torch.zeros(4, 7))
    with pytest.raises(ValueError, match="beyond|up to"):
        last.add_stage_input("b", torch.zeros(101, last.model_config.hidden_size))
    with pytest.raises(ValueError, match="a stage of a 31-layer model"):
        make_engine(stage=LayerRange(0, 2, 31))
