"""The engine with a KV codec, on the real model: the fp16 codec answers as the raw pool does; a kvquant pool holds
several times the blocks; a prompt prefilled on one codec engine and shipped as packed chunks (the wire format)
decodes on another exactly as one engine would; a prefix loaded from block payloads (the cache-store format) gives
the answer of a prefix-cache hit; tails come back when requests finish, and preemption under a tiny pool still
completes."""

from __future__ import annotations

import pytest

from shared.engine.engine import LLMEngine, PrefilledRequest
from shared.engine.kv.prefix_load import PrefixLoad, PrefixSource
from shared.engine.kv.store import PromptKv, PromptLayerKv
from shared.wire.handoff.prompt import KvAssembly, assemble_prompt, chunk_prompt_layer, num_prompt_chunks
from shared.wire.protocol import SamplingParams

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
CODEC = "kvquant-4"


def _prompt(engine: LLMEngine, repeat: int = 3) -> list[int]:
    return engine.tokenizer.encode("The moon festival is celebrated in autumn, when families gather to " * repeat)


def _run(engine: LLMEngine, request_id: str, prompt: list[int], source: PrefixSource | None = None) -> list[int]:
    engine.add_request(request_id, prompt, GREEDY, source)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_the_fp16_codec_answers_as_the_raw_pool(make_engine) -> None:
    raw, fp16 = make_engine(), make_engine(kv_codec="fp16", max_num_seqs=4)
    prompts = [_prompt(raw), _prompt(raw, 1)]
    expected = [c.token_ids for c in raw.generate(prompts, GREEDY)]
    assert [c.token_ids for c in fp16.generate(prompts, GREEDY)] == expected
    pool = fp16.store.pool
    assert len(pool._free_tails) == pool.num_tails  # every tail came back


def test_a_kvquant_pool_holds_several_times_the_blocks(make_engine) -> None:
    """fp32 engines (this CPU has no fp16 matmuls): 8x the fp32 bytes per block is 4x an fp16 pool's."""
    raw = make_engine(kv_cache_bytes=256 << 20, block_size=64)
    quant = make_engine(kv_cache_bytes=256 << 20, block_size=64, kv_codec="kvquant-3", max_num_seqs=8)
    assert raw.store.pool.block_footprint >= 8 * quant.store.pool.block_footprint  # about 9x: 32 bits against 3.4
    assert quant.store.pool.num_blocks >= 7.5 * raw.store.pool.num_blocks  # the tails of 8 sequences take 9%
    assert quant.config.kv_format.startswith("kvquant-3:") and raw.config.kv_format == "fp32"


def test_packed_prompt_kv_over_the_wire_decodes_as_one_engine(make_engine) -> None:
    whole, prefill, decode = (make_engine(kv_codec=CODEC, max_num_seqs=4) for _ in range(3))
    prompt = _prompt(whole)
    expected = whole.generate([prompt], GREEDY)[0].token_ids
    fmt = prefill.block_format
    assert len(prompt) % fmt.block_size  # a partial last block travels too
    layers: dict[int, PromptLayerKv] = {}

    def on_layer(layer_idx: int, seqs: list) -> None:  # noqa: ANN001
        layers[layer_idx] = prefill.read_prompt_kv("r", layer_idx)

    prefill.add_request("r", prompt, GREEDY)
    (first,) = prefill.step(on_layer)
    prefill.abort("r")
    num_layers = prefill.model_config.num_layers
    total = num_prompt_chunks(num_layers, len(prompt), fmt, max_chunk_bytes=3 * fmt.block_bytes)
    assembly = KvAssembly("r", total)
    for layer in range(num_layers):
        kv_layer = layers[layer]
        for chunk in chunk_prompt_layer("r", layer, kv_layer.blocks, kv_layer.tail, kv_layer.num_tokens, fmt,
                                        layer * total // num_layers, total, 3 * fmt.block_bytes):
            assembly.add(chunk)
    cfg = decode.model_config
    kv = PromptKv(*assemble_prompt(assembly, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, fmt))
    decode.add_prefilled(PrefilledRequest("r", prompt, first.new_token_ids[0], len(first.new_text), GREEDY, kv))
    tokens = list(first.new_token_ids)
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.new_token_ids
    assert tokens == expected


def test_a_prefix_loaded_from_block_payloads_gives_the_same_answer(make_engine) -> None:
    source, target, whole = (make_engine(kv_codec=CODEC, max_num_seqs=4) for _ in range(3))
    prompt = _prompt(source)
    # The reference is a prefix-cache hit on one engine: the prompt's rest then attends to the cached blocks decoded,
    # as it does to loaded ones (a fresh prefill attends to its whole prompt in full precision, a different answer).
    whole.generate([prompt], GREEDY)
    (hit,) = whole.generate([prompt], GREEDY)
    num_usable = (len(prompt) - 1) // source.config.block_size
    assert hit.num_cached_tokens == num_usable * source.config.block_size
    expected = hit.token_ids
    source.add_request("s", prompt, GREEDY)
    source.step()
    payloads = source.export_block_payloads("s", 0, num_usable)
    source.abort("s")
    assert len(payloads[0]) > len(payloads[1])  # the sequence's first block carries the sink

    def start(first_block: int, block_ids: list[int]) -> PrefixLoad:
        load = PrefixLoad(target.store, block_ids, first_block=first_block)
        for i in range(len(block_ids)):
            assert load.write(i, payloads[first_block + i])
        return load

    num_loaded = num_usable * source.config.block_size
    assert _run(target, "t", prompt, PrefixSource(num_loaded, start)) == expected


def test_preemption_in_a_small_codec_pool_completes(make_engine) -> None:
    engine = make_engine(kv_codec=CODEC, max_num_seqs=3, kv_cache_bytes=10 << 20)
    pool, size = engine.store.pool, engine.config.block_size
    assert engine.runner.max_num_seqs == pool.num_tails == 3
    # Each sequence needs half the pool: one runs alone, three at once do not fit, so some are preempted.
    length = pool.num_blocks // 2 * size
    words = _prompt(engine, 40)
    prompts = [words[i : i + length - 40] for i in range(3)]
    completions = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert [len(c.token_ids) for c in completions] == [40, 40, 40]
    assert len(pool._free_tails) == pool.num_tails


def test_a_small_budget_caps_the_batch_at_the_tails_it_can_hold(make_engine) -> None:
    engine = make_engine(kv_codec=CODEC, max_num_seqs=64, kv_cache_bytes=8 << 20)
    pool = engine.store.pool
    assert engine.runner.max_num_seqs == pool.num_tails < 64
    assert pool.tails.numel() * pool.tails.element_size() <= (8 << 20) // 4
