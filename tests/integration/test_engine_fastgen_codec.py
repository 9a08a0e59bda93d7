"""FastGen over kvquant-4 in the engine, on the real model: the lanes hold kvquant records (74 bytes an entry against
512 for fp32 K/V), every decode step holds fewer blocks than the kvquant-4 full cache and all come back; its decode is
the quality harness's FastGen over kvquant-4 token for token (records, ring and sink against `ServedKv`); a pool
smaller than the batch's KV completes every request."""

from __future__ import annotations

import pytest

from shared.engine.engine import LLMEngine
from shared.engine.kv.fastgen.lane_store import CodedLaneStore
from shared.fastgen.policies import FastGenSettings
from shared.tools.eval.fastgen_codecs import ServedKv, build_kv_serving
from shared.wire.protocol import SamplingParams
from tests.integration.test_engine_fastgen import GREEDY, _held_blocks, _prompt, _run, harness_predictions

pytestmark = pytest.mark.slow
CODEC = "kvquant-4"


def _fastgen(make_engine, threshold: float, **settings: object) -> LLMEngine:
    settings = {"kv_codec": CODEC, **settings}
    return make_engine(kv_policy="fastgen", fastgen=FastGenSettings(threshold, profile_rows=128), **settings)


def test_lanes_over_kvquant_hold_records_and_fewer_blocks(make_engine) -> None:
    full, fastgen = make_engine(kv_codec=CODEC), _fastgen(make_engine, 0.9)
    assert fastgen.fastgen is not None and isinstance(fastgen.fastgen.store, CodedLaneStore)
    raw = _fastgen(make_engine, 0.9, kv_codec="none")
    assert raw.fastgen is not None
    assert fastgen.fastgen.entry_bytes == 74 and raw.fastgen.entry_bytes == 2 * 64 * 4
    prompt = _prompt(full)
    _, full_held = _run(full, prompt)
    fastgen.add_request("r", prompt, GREEDY)
    fastgen.step()  # the prompt: profiled, then moved to lanes (its blocks and its tail freed)
    sparse = fastgen.fastgen.sequences["r"]
    assert fastgen.fastgen.bytes_held("r") == sparse.num_entries * 74
    saved = fastgen.fastgen.bytes_saved("r")
    assert saved > 0.1 * (saved + fastgen.fastgen.bytes_held("r"))
    lanes_held = []
    while fastgen.has_unfinished():
        fastgen.step()
        lanes_held.append(_held_blocks(fastgen))
    assert max(lanes_held[:-1]) < min(full_held[:-1])
    assert lanes_held[-1] == 0 and fastgen.fastgen.lanes.num_blocks_held == 0
    fastgen.block_manager.check_invariants()


def test_the_engine_decodes_as_the_quality_harness_over_kvquant(make_engine, checkpoint) -> None:
    """Lanes of records with a ring of the newest block_size positions, against the harness's `ServedKv` over a dense
    cache; the prompt is one chunk, so both profile it on the same attention."""
    settings, block_size = FastGenSettings(threshold=0.9, profile_rows=128), 16
    engine = make_engine(kv_policy="fastgen", kv_codec=CODEC, fastgen=settings, block_size=block_size)
    prompt = _prompt(engine)
    generated, _ = _run(engine, prompt)
    serving = build_kv_serving(CODEC, checkpoint.config, block_size=block_size)
    predicted, _ = harness_predictions(
        checkpoint, prompt, generated, settings, lambda rotary: ServedKv(serving, rotary, 0, lanes=True)
    )
    assert predicted == generated


def test_a_pool_smaller_than_the_batch_completes_everyone(make_engine) -> None:
    fastgen = _fastgen(make_engine, 0.9, kv_cache_bytes=2 << 20, max_num_seqs=4)  # 10 blocks: 160 tokens of full KV
    prompts = [_prompt(fastgen, 40 + 7 * i) for i in range(4)]  # 40-61 tokens, 24 more each: 302 tokens in all
    done = fastgen.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert [len(c.token_ids) for c in done] == [24] * 4
    assert _held_blocks(fastgen) == 0 and fastgen.fastgen is not None and fastgen.fastgen.lanes.num_blocks_held == 0
    fastgen.block_manager.check_invariants()
