"""The sim engine: the real LLMEngine over a runner that sleeps the profile's predicted step time (on a fake clock here)
and samples one fixed word; its KV store holds sizes alone: its prompt KV, blocks and prefix loads travel as sizes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import shared.sim.engine as sim_engine
from shared.config import ConfigError, load_settings
from shared.engine.batching import ScheduledChunk, StepPlan
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine, PrefilledRequest, RequestOutput
from shared.engine.kv.prefix_load import PrefixLoad, PrefixSource
from shared.engine.kv.store import PromptKv, PromptLayerKv
from shared.engine.sequence import FinishReason, Sequence
from shared.kvcompress.registry import codec_block_bytes
from shared.model.checkpoint import Checkpoint
from shared.model.config import LlamaConfig
from shared.sim.cost import StepWork, step_time
from shared.sim.engine import (
    BACK_TO_BACK_S,
    SIM_WORD,
    SimRunner,
    build_sim_engine,
    sim_checkpoint,
)
from shared.sim.manifest import sim_model_name
from shared.sim.profiles import SIM_ENV_DEFAULTS, GpuSpec, SimProfile, get_profile
from shared.wire.handoff.prompt import KvAssembly, assemble_prompt, chunk_prompt_layer, num_prompt_chunks
from shared.wire.payload import SizeOnly
from shared.wire.protocol import KvChunk, SamplingParams, attention_work, decode, encode

PROFILE = get_profile("llama3-70b-8xa800")
CFG = PROFILE.model  # 80 layers, 8 kv heads, head dim 128
BLOCK = 512
CHUNK = 1024
TINY = SimProfile(
    "tiny",
    LlamaConfig(vocab_size=1000, hidden_size=100, intermediate_size=300, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=25, rope_theta=1e4, rms_norm_eps=1e-5, max_position=4096, tie_word_embeddings=False),
    GpuSpec("tiny", peak_flops=1e9, memory_bandwidth=1e8, memory_bytes=1e7, link_bandwidth=1e5, source="test"),
    num_gpus=2,
)


class FakeTime:
    """Stands in for the `time` module inside shared.sim.engine: a sleep moves the clock on, nothing waits."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTime]:
    fake = FakeTime()
    monkeypatch.setattr(sim_engine, "time", fake)
    yield fake


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    return sim_checkpoint(PROFILE)


def make_engine(checkpoint: Checkpoint, max_num_batched_tokens: int = CHUNK) -> LLMEngine:
    config = EngineConfig(block_size=BLOCK, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8)
    token_id = checkpoint.tokenizer.encode(SIM_WORD)[0]
    return LLMEngine(checkpoint, config, runner=SimRunner(PROFILE, config, token_id))


def runner_of(engine: LLMEngine) -> SimRunner:
    assert isinstance(engine.runner, SimRunner)
    return engine.runner


def prompt(num_tokens: int, start: int = 100) -> list[int]:
    return list(range(start, start + num_tokens))


def prefill_work(num_new: int, num_before: int, completes: bool) -> StepWork:
    return StepWork(num_new, int(completes), num_new * num_before + num_new * (num_new + 1) // 2, num_before + num_new)


def test_generate_gives_max_tokens_of_the_sim_word(clock: FakeTime) -> None:
    engine = build_sim_engine("llama3-70b-8xa800", EngineConfig(block_size=BLOCK))
    (token_id,) = engine.tokenizer.encode(SIM_WORD)
    long, short = engine.generate([prompt(600), prompt(7, start=5)], SamplingParams(max_tokens=5))
    for done in (long, short):
        assert done.token_ids == [token_id] * 5
        assert done.text == SIM_WORD * 5 and done.finish_reason == FinishReason.LENGTH
    assert (long.num_prompt_tokens, short.num_prompt_tokens) == (600, 7)
    (one,) = engine.generate([prompt(3)], SamplingParams(max_tokens=1))
    assert one.text == SIM_WORD and one.token_ids == [token_id]
    assert clock.sleeps  # it slept on the fake clock, never for real


def test_sim_names_and_unknown_profiles() -> None:
    assert sim_model_name(PROFILE) == "llama3-70b-8xa800-sim"
    assert sim_checkpoint(PROFILE).fingerprint == sim_checkpoint(PROFILE).fingerprint
    assert sim_checkpoint(PROFILE).fingerprint != sim_checkpoint(get_profile("llama2-70b-8xa800")).fingerprint
    with pytest.raises(ValueError, match="unknown sim profile"):
        build_sim_engine("llama9-1t", EngineConfig(block_size=BLOCK))
    with pytest.raises(ValueError, match="room for 1 KV blocks"):
        SimRunner(TINY, EngineConfig(block_size=32768), token_id=7)  # 42797 tokens of KV fit


def test_each_step_sleeps_the_predicted_time_of_its_work(clock: FakeTime, checkpoint: Checkpoint) -> None:
    engine = make_engine(checkpoint)
    runner = runner_of(engine)
    engine.add_request("r1", prompt(1500), SamplingParams(max_tokens=3))
    expected = [
        prefill_work(CHUNK, 0, completes=False),  # first chunk: nothing sampled
        prefill_work(1500 - CHUNK, CHUNK, completes=True),  # the rest of the prompt, then the first token
        StepWork(1, 1, 1501, 1501),  # a decode step reads the whole context
    ]
    for work in expected:
        before = clock.now
        engine.step()
        assert runner.last_step_s == step_time(PROFILE, work).total
        assert clock.now - before == pytest.approx(runner.last_step_s)  # no host time between steps here
        assert engine.last_step is not None
        assert (engine.last_step.num_new_tokens, engine.last_step.attention_work) == (
            work.num_new_tokens, work.attention_work)


def test_a_chunked_prompt_reports_what_is_computed_and_its_chunks_add_up_to_its_attention_work(
        clock: FakeTime, checkpoint: Checkpoint) -> None:
    engine = make_engine(checkpoint)
    engine.add_request("r1", prompt(1500), SamplingParams(max_tokens=1))
    assert (engine.num_computed_tokens("r1"), engine.num_computed_tokens("other")) == (0, 0)
    engine.step()
    assert engine.num_computed_tokens("r1") == CHUNK  # what a prefill instance's heartbeat subtracts
    first = engine.last_step
    engine.step()
    assert first is not None and engine.last_step is not None
    assert first.attention_work + engine.last_step.attention_work == attention_work(1500, 0)
    assert first.attention_work == attention_work(CHUNK, 0)


def test_back_to_back_steps_count_the_host_s_time(clock: FakeTime, checkpoint: Checkpoint) -> None:
    engine = make_engine(checkpoint)
    runner = runner_of(engine)
    engine.add_request("r1", prompt(100), SamplingParams(max_tokens=10))
    engine.step()  # prefill
    decode_s = step_time(PROFILE, StepWork(1, 1, 101, 101)).total
    assert decode_s > 0.01
    clock.now += 0.01  # the host delivered tokens for 10 ms: the next step sleeps only the rest
    engine.step()
    assert runner.last_step_s == decode_s and clock.sleeps[-1] == pytest.approx(decode_s - 0.01)
    clock.now += BACK_TO_BACK_S + 1.0  # idle in between: a fresh step sleeps its whole time
    engine.step()
    assert clock.sleeps[-1] == pytest.approx(step_time(PROFILE, StepWork(1, 1, 102, 102)).total)
    num_sleeps = len(clock.sleeps)
    clock.now += min(BACK_TO_BACK_S * 0.99, 2 * decode_s)  # a host slower than the step: no sleep at all
    engine.step()
    assert len(clock.sleeps) == num_sleeps


def test_a_late_wake_delays_the_tokens_passing_on_not_the_next_step(clock: FakeTime, checkpoint: Checkpoint) -> None:
    engine = make_engine(checkpoint)
    runner = runner_of(engine)
    engine.add_request("r1", prompt(100), SamplingParams(max_tokens=10))
    engine.step()  # prefill
    engine.step()
    made = runner.tokens_ready_at
    assert made == clock.now  # on time: the tokens are there when the sleep ends
    clock.now += 0.004  # this host woke 4 ms late from that sleep
    engine.step()
    assert runner.tokens_ready_at == pytest.approx(made + runner.last_step_s)  # the modelled GPU did not wait
    assert clock.sleeps[-1] == pytest.approx(runner.last_step_s - 0.004)
    clock.now += 2 * runner.last_step_s  # a host slower than a whole step: the step ends when handed over
    handed_over = clock.now
    engine.step()
    assert runner.tokens_ready_at == handed_over


def test_a_repeated_prefix_comes_from_the_prefix_cache(clock: FakeTime, checkpoint: Checkpoint) -> None:
    engine = make_engine(checkpoint, max_num_batched_tokens=2048)
    runner = runner_of(engine)
    shared_prefix = prompt(2 * BLOCK)
    (first,) = engine.generate([shared_prefix + prompt(40, start=1)], SamplingParams(max_tokens=2))
    assert first.num_cached_tokens == 0
    engine.add_request("r2", shared_prefix + prompt(30, start=7), SamplingParams(max_tokens=2))
    (out,) = engine.step()
    assert out.num_cached_tokens == 1024
    assert runner.last_step_s == step_time(PROFILE, prefill_work(30, 1024, completes=True)).total


def test_the_store_holds_sizes_and_prompt_kv_is_read_layer_by_layer(clock: FakeTime, checkpoint: Checkpoint) -> None:
    engine = make_engine(checkpoint)
    store = engine.store
    num_blocks = PROFILE.kv_capacity_tokens // BLOCK
    assert store.block_footprint == 80 * 2 * 8 * BLOCK * 128 * 2  # bf16 K and V of the simulated model
    assert engine.block_manager.num_blocks == store.num_blocks == num_blocks
    engine.add_request("r1", prompt(700), SamplingParams(max_tokens=4))
    seen: list[tuple[int, list[str], PromptLayerKv]] = []

    def on_layer(layer_idx: int, seqs: list[Sequence]) -> None:
        seen.append((layer_idx, [s.request_id for s in seqs], engine.read_prompt_kv("r1", layer_idx)))

    engine.step(on_layer)
    assert [layer for layer, _, _ in seen] == list(range(CFG.num_layers))
    assert all(ids == ["r1"] for _, ids, _ in seen)
    full, rest = divmod(700, BLOCK)
    for _, _, kv in seen:
        assert kv.blocks == SizeOnly(full * 2 * 8 * BLOCK * 128 * 2) and kv.num_tokens == 700
        assert kv.tail.is_meta and kv.tail.dtype == torch.bfloat16 and tuple(kv.tail.shape) == (2, 8, rest, 128)
    per_layer = runner_of(engine).last_step_s / CFG.num_layers
    assert clock.sleeps[-CFG.num_layers:] == pytest.approx([per_layer] * CFG.num_layers)  # paced layer by layer
    engine.step(on_layer)  # a decode step streams nothing
    assert len(seen) == CFG.num_layers


def test_the_runner_calls_layer_hooks_in_order_and_a_wait_delays_later_layers(clock: FakeTime) -> None:
    runner = SimRunner(TINY, EngineConfig(block_size=16), token_id=7)
    seq = Sequence("r1", list(range(20)), 20, SamplingParams())
    events: list[tuple[str, int]] = []

    def before(layer_idx: int) -> None:
        events.append(("before", layer_idx))
        if layer_idx == 1:
            clock.now += 5.0  # waiting for loaded prefix KV

    start = clock.now
    sampled = runner.execute(StepPlan([ScheduledChunk(seq, 20)], []), {"r1": [0, 1]},
                             after_layer=lambda i: events.append(("after", i)), before_layer=before)
    assert sampled == {"r1": 7}
    assert events == [("before", 0), ("after", 0), ("before", 1), ("after", 1)]
    assert runner.last_step_s == step_time(TINY, prefill_work(20, 0, completes=True)).total
    assert clock.now - start == pytest.approx(5.0 + runner.last_step_s)  # layer 1 runs after the wait, in full
    partial = runner.execute(StepPlan([ScheduledChunk(seq, 10)], []), {"r1": [0]})
    assert partial == {} and runner.last_step_s == step_time(TINY, prefill_work(10, 0, completes=False)).total


def test_the_host_s_time_in_layer_hooks_overlaps_the_modelled_layers(clock: FakeTime) -> None:
    runner = SimRunner(TINY, EngineConfig(block_size=16), token_id=7)
    seq = Sequence("r1", list(range(20)), 20, SamplingParams())
    modelled = step_time(TINY, prefill_work(20, 0, completes=True)).total
    host_s = modelled / TINY.model.num_layers / 2  # sending each layer's KV takes half a layer's time

    def send_layer(layer_idx: int) -> None:
        clock.now += host_s

    start = clock.now
    runner.execute(StepPlan([ScheduledChunk(seq, 20)], []), {"r1": [0, 1]}, after_layer=send_layer,
                   before_layer=lambda i: None)
    # the last layer's send comes after the step's modelled end; the earlier ones hide under the next layer
    assert clock.now - start == pytest.approx(modelled + host_s)


def test_prompt_kv_travels_as_sizes_from_a_prefill_engine_to_a_decode_engine(
    clock: FakeTime, checkpoint: Checkpoint
) -> None:
    prefill, decode_engine = make_engine(checkpoint), make_engine(checkpoint)
    ids = prompt(600)
    prefill.add_request("r1", ids, SamplingParams(max_tokens=3))
    fmt = prefill.block_format
    total = num_prompt_chunks(CFG.num_layers, len(ids), fmt, 1 << 20)
    chunks: list[KvChunk] = []

    def on_layer(layer_idx: int, seqs: list[Sequence]) -> None:
        kv = prefill.read_prompt_kv("r1", layer_idx)
        chunks.extend(chunk_prompt_layer("r1", layer_idx, kv.blocks, kv.tail, kv.num_tokens, fmt, len(chunks), total,
                                         max_chunk_bytes=1 << 20))

    (first,) = prefill.step(on_layer)
    assert total == len(chunks) == CFG.num_layers and all(c.data == b"" for c in chunks)
    assembly = KvAssembly("r1", total)
    for chunk in chunks:
        assembly.add(decode(encode(chunk), KvChunk))
    kv = PromptKv(*assemble_prompt(assembly, CFG.num_layers, 8, 128, decode_engine.block_format))
    assert kv.tail.is_meta and tuple(kv.tail.shape) == (80, 2, 8, 600 % BLOCK, 128) and kv.num_tokens == 600
    assert kv.layers == [SizeOnly(600 // BLOCK * 2 * 8 * BLOCK * 128 * 2)] * 80
    decode_engine.add_prefilled(PrefilledRequest(
        "r1", ids, first.new_token_ids[0], len(first.new_text), SamplingParams(max_tokens=3), kv))
    outputs: list[RequestOutput] = []
    while decode_engine.has_unfinished():
        outputs += decode_engine.step()
    assert "".join(o.new_text for o in outputs) == SIM_WORD * 2
    assert outputs[-1].finish_reason == FinishReason.LENGTH and outputs[-1].num_output_tokens == 3
    assert runner_of(decode_engine).last_step_s == step_time(PROFILE, StepWork(1, 1, 602, 602)).total


def test_prefilled_kv_of_the_wrong_shape_is_refused(checkpoint: Checkpoint) -> None:
    engine = make_engine(checkpoint)
    fmt, full = engine.block_format, 600 // BLOCK
    tail = torch.empty(80, 2, 8, 600 % BLOCK, 128, dtype=torch.bfloat16, device="meta")
    short = PromptKv([SizeOnly(fmt.blocks_bytes(full) - 1)] * 80, tail, 600)
    with pytest.raises(ValueError, match="does not hold 600 tokens"):
        engine.add_prefilled(PrefilledRequest("r1", prompt(600), 895, 0, SamplingParams(), short))


def test_blocks_export_as_sizes_and_load_back_as_a_prefix(clock: FakeTime, checkpoint: Checkpoint) -> None:
    source, engine = make_engine(checkpoint), make_engine(checkpoint)
    ids = prompt(2 * BLOCK + 76)
    source.add_request("r0", ids, SamplingParams(max_tokens=2))
    source.step()
    block_bytes = source.export_block_payloads("r0", 0, 2)
    assert block_bytes == [SizeOnly(PROFILE.kv_bytes_per_token * BLOCK)] * 2
    loads: list[PrefixLoad] = []

    def start(first_block: int, block_ids: list[int]) -> PrefixLoad:
        assert first_block == 0 and len(block_ids) == 2
        load = PrefixLoad(engine.store, block_ids)
        for i, data in enumerate(block_bytes):
            assert load.write(i, data)
        loads.append(load)
        return load

    engine.add_request("r1", ids, SamplingParams(max_tokens=2), prefix_source=PrefixSource(2 * BLOCK, start))
    (out,) = engine.step()
    assert loads[0].is_complete and out.num_cached_tokens == 2 * BLOCK
    assert runner_of(engine).last_step_s == step_time(PROFILE, prefill_work(76, 2 * BLOCK, completes=True)).total


def test_a_sized_codec_shrinks_blocks_in_the_pool_and_on_the_wire_not_the_gpu_s_capacity(
    clock: FakeTime, checkpoint: Checkpoint
) -> None:
    config = EngineConfig(block_size=BLOCK, max_num_batched_tokens=CHUNK, max_num_seqs=8)
    token_id = checkpoint.tokenizer.encode(SIM_WORD)[0]
    raw, packed = SimRunner(PROFILE, config, token_id), SimRunner(PROFILE, config, token_id, sized_codec="kvquant-3")
    assert packed.store.num_blocks == raw.store.num_blocks  # HBM holds the dtype's KV either way
    layer = codec_block_bytes("kvquant-3", 8, BLOCK, 128)
    assert packed.store.block_footprint == 80 * layer
    assert 4.5 < raw.store.block_footprint / packed.store.block_footprint < 5.5  # 3-bit codes + per-block metadata
    assert packed.store.block_payload(0, starts_sequence=False) == SizeOnly(80 * layer)
    assert codec_block_bytes("fp16", 8, BLOCK, 128) == 2 * 8 * BLOCK * 128 * 2
    with pytest.raises(ValueError, match="unknown KV codec"):
        codec_block_bytes("zip", 8, BLOCK, 128)


def test_the_sized_codec_is_a_setting_of_the_sim() -> None:
    env = {"TSUKIMI_ENGINE": "sim", **SIM_ENV_DEFAULTS}
    assert load_settings("decode", env).sim_kv_codec == "none"
    assert load_settings("prefill", env | {"TSUKIMI_SIM_KV_CODEC": "kvquant-3"}).sim_kv_codec == "kvquant-3"
    with pytest.raises(ConfigError, match="TSUKIMI_SIM_KV_CODEC"):
        load_settings("prefill", env | {"TSUKIMI_SIM_KV_CODEC": "zip"})


@pytest.mark.parametrize("codec", ["none", "kvquant-3"])
def test_the_gateway_hashes_blocks_as_the_sim_engine_does_whatever_its_sized_codec(codec: str) -> None:
    """The scheduler's index and the pool key blocks by the gateway's hashes and hear of them by the engine's: one
    namespace, or the Conductor is blind to every cached block."""
    from services.gateway.__main__ import model_info
    from services.gateway.prompt import PromptBuilder

    env = {"TSUKIMI_ENGINE": "sim", **SIM_ENV_DEFAULTS, "TSUKIMI_SIM_KV_CODEC": codec}
    gateway = PromptBuilder(model_info(load_settings("gateway", env)), BLOCK)
    engine_settings = load_settings("prefill", env)
    engine = build_sim_engine(PROFILE.name, engine_settings.engine, sized_codec=engine_settings.sim_kv_codec)
    assert gateway.namespace == engine.block_manager.namespace


def test_a_baseline_can_turn_the_local_prefix_cache_off(clock: FakeTime) -> None:
    env = {"TSUKIMI_ENGINE": "sim", **SIM_ENV_DEFAULTS}
    assert load_settings("decode", env).engine.enable_prefix_caching
    config = load_settings("decode", env | {"TSUKIMI_PREFIX_CACHING": "off"}).engine
    engine = build_sim_engine(PROFILE.name, config)
    shared_prefix = prompt(2 * BLOCK)
    for start in (1, 7):
        (out,) = engine.generate([shared_prefix + prompt(40, start=start)], SamplingParams(max_tokens=2))
        assert out.num_cached_tokens == 0  # the second prompt's first two blocks are computed again


def test_a_sim_instance_can_hold_more_kv_than_its_gpus() -> None:
    env = {"TSUKIMI_ENGINE": "sim", **SIM_ENV_DEFAULTS}
    settings = load_settings("prefill", env)
    assert settings.sim_kv_tokens == 0
    default = build_sim_engine(PROFILE.name, settings.engine)
    assert default.block_manager.num_blocks == PROFILE.kv_capacity_tokens // settings.engine.block_size
    grown = load_settings("prefill", env | {"TSUKIMI_SIM_KV_TOKENS": "3000000"})
    engine = build_sim_engine(PROFILE.name, grown.engine, kv_tokens=grown.sim_kv_tokens)
    assert engine.block_manager.num_blocks == 3_000_000 // settings.engine.block_size
    with pytest.raises(ConfigError, match="TSUKIMI_SIM_KV_TOKENS"):
        load_settings("prefill", env | {"TSUKIMI_SIM_KV_TOKENS": "-1"})
