"""The whole system with FastGen over kvquant-4 (`TSUKIMI_KV_POLICY=fastgen`, `TSUKIMI_KV_CODEC=kvquant-4`, T = 0.9;
real processes, real NATS): a long prompt's kvquant blocks and its profile travel from prefill to decode, whose lanes
hold kvquant records, and decode answers exactly as one such engine does with the same prompt; the usage reports the
bytes the lanes did not hold."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.system_fixture import System, start_system, stop_system
from tests.integration.test_system_fastgen import SETTINGS, assert_a_long_prompt_decodes_as_one_engine

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
    assert_a_long_prompt_decodes_as_one_engine(system, make_engine, RECORD_TOKEN_BYTES, kv_codec=CODEC)
