"""The whole system with FastGen over kvquant-4 (`TSUKIMI_KV_POLICY=fastgen`, `TSUKIMI_KV_CODEC=kvquant-4`, T = 0.9;
real processes, real NATS): a long prompt's kvquant blocks and its profile travel from prefill to decode, whose lanes
hold kvquant records, and decode answers exactly as one such engine does with the same prompt; the usage reports the
bytes the lanes did not hold."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.engine.engine import LLMEngine
from shared.engine.sampling import SamplingParams
from tests.integration.system_fixture import System, start_system, stop_system
from tests.integration.test_system_fastgen import SETTINGS, _complete, _text

pytestmark = pytest.mark.slow
CODEC = "kvquant-4"
RECORD_TOKEN_BYTES = 30 * 3 * 74  # one token's lane records over SmolLM2's 30 layers and 3 KV heads


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    running = start_system(tmp_path_factory.mktemp("fastgen-codec-system"), {
        "TSUKIMI_KV_POLICY": "fastgen", "TSUKIMI_KV_CODEC": CODEC, "TSUKIMI_FASTGEN_T": str(SETTINGS.threshold),
        "TSUKIMI_FASTGEN_PROFILE_ROWS": str(SETTINGS.profile_rows),
    })
    yield running
    code, _ = stop_system(running)
    assert code == 0, running.stdout_path.read_text()


def test_a_long_prompt_decodes_as_one_fastgen_kvquant_engine(system: System, make_engine) -> None:
    prompt = _text(2500)  # about 550 tokens: prefilled on a prefill instance, its blocks and profile sent to decode
    answer = _complete(system, prompt, 16)
    engine: LLMEngine = make_engine(kv_policy="fastgen", kv_codec=CODEC, fastgen=SETTINGS, block_size=64)
    expected = engine.generate([engine.tokenizer.encode(prompt)], SamplingParams(max_tokens=16, temperature=0.0))
    assert answer["choices"][0]["text"] == expected[0].text
    usage = answer["usage"]
    assert usage["prompt_tokens"] > 400 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    full_bytes = (usage["prompt_tokens"] + usage["completion_tokens"] - 1) * RECORD_TOKEN_BYTES
    assert 0.1 * full_bytes < usage["kv_bytes_saved"] < full_bytes
