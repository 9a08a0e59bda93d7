"""Disaggregation inside the engine: prefill on one engine, stream each layer's KV out, continue decoding on another;
and a prefix loaded from outside is used and then reused. The answer must equal one engine doing everything."""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import EngineFull, LLMEngine, PrefilledRequest
from shared.engine.kv.prefix_load import PrefixLoad, PrefixSource
from shared.engine.kv.store import PromptKv, PromptLayerKv
from shared.wire.payload import SizeOnly
from shared.wire.protocol import SamplingParams

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)


def _prompt(engine: LLMEngine) -> list[int]:
    return engine.tokenizer.encode("The moon festival is celebrated in autumn, when families gather to " * 3)


def _prefill(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams = GREEDY
) -> tuple[PromptKv, int, str, list[int]]:
    """Run the prompt, capturing each layer's KV as the hook announces it; returns (kv, first token, text, order)."""
    layers: dict[int, PromptLayerKv] = {}
    order: list[int] = []

    def on_layer(layer_idx: int, seqs: list) -> None:  # noqa: ANN001
        assert [s.request_id for s in seqs] == [request_id]
        order.append(layer_idx)
        layers[layer_idx] = engine.read_prompt_kv(request_id, layer_idx)

    engine.add_request(request_id, prompt, params)
    outputs = engine.step(on_layer)
    (out,) = outputs
    engine.abort(request_id)
    kv = PromptKv.of_layers([layers[i] for i in range(len(layers))])
    return kv, out.new_token_ids[0], out.new_text, order


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefill_here_decode_there_equals_one_engine(make_engine, params: SamplingParams) -> None:
    """Seeded sampling too: a draw depends on the seed and the token's position alone, so decode continues the
    sequence one engine would have drawn, with the very parameters prefill had."""
    prefill, decode, whole = make_engine(), make_engine(), make_engine()
    prompt = _prompt(prefill)
    (expected,) = whole.generate([prompt], params)
    kv, first, text, order = _prefill(prefill, "r1", prompt, params)
    assert order == list(range(prefill.model_config.num_layers))  # every layer, in order, during the pass
    decode.add_prefilled(PrefilledRequest("r1", prompt, first, len(text), params, kv))
    tokens, pieces = [first], [text]
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.new_token_ids
            pieces.append(out.new_text)
    assert tokens == expected.token_ids
    assert "".join(pieces) == expected.text


def test_add_prefilled_checks_shape_and_room(make_engine) -> None:
    decode = make_engine(max_num_seqs=1)
    prompt = _prompt(decode)
    cfg, fmt = decode.model_config, decode.block_format
    full, rest = divmod(len(prompt), fmt.block_size)
    tail = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, rest, cfg.head_dim)
    good = PromptKv([bytes(fmt.blocks_bytes(full))] * cfg.num_layers, tail, len(prompt))
    with pytest.raises(ValueError, match="does not hold"):
        decode.add_prefilled(PrefilledRequest("bad", prompt, 1, 0, GREEDY, PromptKv(good.layers, tail[:, :, :, 1:],
                                                                                      len(prompt))))
    with pytest.raises(ValueError, match="sizes alone"):
        sizes = PromptKv([SizeOnly(fmt.blocks_bytes(full))] * cfg.num_layers, tail, len(prompt))
        decode.add_prefilled(PrefilledRequest("sizes", prompt, 1, 0, GREEDY, sizes))
    with pytest.raises(ValueError, match="tokens for a prompt of"):
        decode.add_prefilled(PrefilledRequest("short", prompt[:-1], 1, 0, GREEDY, good))
    decode.add_prefilled(PrefilledRequest("a", prompt, 1, 0, GREEDY, good))
    with pytest.raises(EngineFull):
        decode.add_prefilled(PrefilledRequest("b", prompt, 1, 0, GREEDY, good))


def test_a_loaded_prefix_is_used_then_reused_and_gives_the_same_answer(make_engine) -> None:
    source, target, whole = make_engine(), make_engine(), make_engine()
    prompt = _prompt(source)
    (expected,) = whole.generate([prompt], GREEDY)
    source.add_request("s", prompt, GREEDY)
    source.step()
    num_usable = (len(prompt) - 1) // source.config.block_size  # the last token is always computed
    payloads = source.export_block_payloads("s", 0, num_usable)
    source.abort("s")

    def start(first_block: int, block_ids: list[int]) -> PrefixLoad:  # everything at once
        load = PrefixLoad(target.store, block_ids)
        for i in range(len(block_ids)):
            load.write(i, payloads[first_block + i])
        return load

    num_loaded = num_usable * source.config.block_size
    target.add_request("t", prompt, GREEDY, PrefixSource(num_loaded, start))
    tokens, num_cached = [], 0
    while target.has_unfinished():
        for out in target.step():
            tokens += out.new_token_ids
            num_cached = out.num_cached_tokens
    assert tokens == expected.token_ids and num_cached == num_loaded > 0
    (again,) = target.generate([prompt], GREEDY)  # now from the local prefix cache
    assert again.num_cached_tokens == num_loaded and again.token_ids == expected.token_ids
