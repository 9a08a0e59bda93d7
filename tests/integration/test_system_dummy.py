"""The whole system over a model of random weights (`TSUKIMI_MODEL=dummy:tiny`, what `tsukimi up --model dummy:NAME`
sets): every service takes it, the API serves it under that name, and a streamed answer goes through prefill's
hand-off to decode and back, as with real weights."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from system_fixture import System, start_system, stop_system


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    running = start_system(tmp_path_factory.mktemp("dummy"), {"TSUKIMI_MODEL": "dummy:tiny"})
    yield running
    stop_system(running)


def test_a_dummy_model_is_served_under_its_name(system: System) -> None:
    status, body = system.get("/v1/models")
    assert status == 200 and '"id": "dummy:tiny"' in body
    status, _, answer = system.post("/v1/completions", {"model": "dummy:tiny", "prompt": "one two three " * 40,
                                                         "max_tokens": 12, "ignore_eos": True, "temperature": 0})
    assert status == 200, answer
    assert answer["model"] == "dummy:tiny" and answer["usage"]["completion_tokens"] == 12
    assert answer["choices"][0]["finish_reason"] == "length"


def test_a_real_models_name_is_refused(system: System) -> None:
    status, _, answer = system.post("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "hi",
                                                         "max_tokens": 2})
    assert status == 404 and "dummy:tiny" in str(answer)


