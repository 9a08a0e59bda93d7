"""The gateway's OpenAPI document held to the running system: schemathesis generates valid and invalid requests from
`GET /openapi.json` and sends them to `tsukimi up --engine sim` (the real gateway, scheduler and instances; no model
runs) with an API key; no answer may be a 5xx or stray from the document (status, content type, headers, schema)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from shared.tools.cli.main import main as tsukimi_main
from shared.tools.nats_server import free_port

STARTUP_S = 120.0
MAX_TOKENS = 8  # each generated completion streams at most this many simulated tokens: the run stays short
INT64_MAX = (1 << 63) - 1  # the schemas' maximum of the token counts
INTEGER_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "top_k", "seed", "n", "prompt")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection, ignored_auth]
# (method, path, generation mode, examples). schemathesis' own pytest plugin needs pytest < 9.2 (`Node._nodeid`), so
# its Hypothesis strategies are drawn here directly. Negative data only where there is input to spoil.
RUNS = [
    ("POST", "/v1/chat/completions", GenerationMode.POSITIVE, 150),
    ("POST", "/v1/chat/completions", GenerationMode.NEGATIVE, 150),
    ("POST", "/v1/completions", GenerationMode.POSITIVE, 100),
    ("POST", "/v1/completions", GenerationMode.NEGATIVE, 100),
    ("GET", "/v1/models", GenerationMode.POSITIVE, 3),
    ("GET", "/v1/models/{model}", GenerationMode.POSITIVE, 20),
    ("GET", "/health", GenerationMode.POSITIVE, 3),
    ("GET", "/live", GenerationMode.POSITIVE, 3),
    ("GET", "/metrics", GenerationMode.POSITIVE, 3),
    ("GET", "/openapi.json", GenerationMode.POSITIVE, 3),
]


@dataclass
class SimSystem:
    process: subprocess.Popen[bytes]
    base_url: str
    stdout_path: Path
    key: str

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.base_url + path, timeout=10) as response:
            return response.status, response.read().decode()


def _new_key(path: Path) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert tsukimi_main(["keys", "add", "schemathesis", "--file", str(path)]) == 0
    return out.getvalue().strip()


def _start_sim(tmp: Path, keys_file: Path, key: str) -> SimSystem:
    """`tsukimi up --engine sim` with its own nats-server, up once it says so (its /health answered 200)."""
    port = free_port()
    stdout_path = tmp / "up.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TSUKIMI_")}
    # function, not overload: no generated request may be turned away for a predicted SLO miss
    env |= {"TSUKIMI_API_KEYS_FILE": str(keys_file), "TSUKIMI_SLO_TTFT_MS": "600000", "TSUKIMI_SLO_TBT_MS": "600000"}
    cmd = [sys.executable, "-m", "shared", "up", "--engine", "sim", "--port", str(port), "--log-dir", str(tmp / "logs")]
    with open(stdout_path, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    system = SimSystem(process, f"http://127.0.0.1:{port}", stdout_path, key)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tsukimi up exited with {process.returncode}: {stdout_path.read_text()}")
        if "tsukimi is up" in stdout_path.read_text():
            return system
        time.sleep(0.5)
    _stop(system)
    raise RuntimeError(f"tsukimi up --engine sim was not up after {STARTUP_S} s: {stdout_path.read_text()}")


def _stop(system: SimSystem) -> int | None:
    """SIGINT, as Ctrl-C would; the exit code (None: it had to be killed)."""
    system.process.send_signal(signal.SIGINT)
    try:
        return system.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        system.process.kill()
        system.process.wait()
        return None


@pytest.fixture(scope="module")
def sim_system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimSystem]:
    tmp = tmp_path_factory.mktemp("openapi")
    keys_file = tmp / "keys.json"
    system = _start_sim(tmp, keys_file, _new_key(keys_file))
    yield system
    assert _stop(system) == 0, system.stdout_path.read_text()


@pytest.fixture(scope="module")
def api_schema(sim_system: SimSystem) -> Any:
    return schemathesis.openapi.from_url(sim_system.base_url + "/openapi.json")


@pytest.mark.parametrize(("method", "path", "mode", "num_examples"), RUNS)
def test_the_gateway_answers_as_its_openapi_document_says(
    sim_system: SimSystem, api_schema: Any, method: str, path: str, mode: GenerationMode, num_examples: int
) -> None:
    strategy = api_schema[path][method].as_strategy(generation_mode=mode)
    document = json.loads(sim_system.get("/openapi.json")[1])
    headers = {"Authorization": f"Bearer {sim_system.key}"}

    @settings(max_examples=num_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(case=strategy, stream=st.booleans())
    def check(case: Any, stream: bool) -> None:
        _bound_generation(case, stream if mode is GenerationMode.POSITIVE else None)
        response = case.call_and_validate(headers=headers, checks=CHECKS, timeout=60)
        _check_stream(response, document, path)

    check()


def test_the_document_is_what_the_gateway_serves(sim_system: SimSystem) -> None:
    status, text = sim_system.get("/openapi.json")
    document = json.loads(text)
    assert status == 200 and document["openapi"] == "3.1.0"
    assert document["components"]["securitySchemes"] == {"apiKey": {"type": "http", "scheme": "bearer"}}
    model = document["components"]["schemas"]["CreateChatCompletionRequest"]["properties"]["model"]["enum"][0]
    assert model.endswith("-sim")


def _check_stream(response: Any, document: dict[str, Any], path: str) -> None:
    """Every server-sent event's JSON against the chunk schemas (schemathesis checks only the events' framing)."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return
    chunk = "ChatCompletionChunk" if path == "/v1/chat/completions" else "CompletionChunk"
    refs = [{"$ref": f"#/components/schemas/{name}"} for name in (chunk, "Error")]
    validator = jsonschema_rs.Draft202012Validator({"anyOf": refs, "components": document["components"]})
    events = [event for event in response.content.decode().split("\n\n") if event]
    assert events[-1] == "data: [DONE]", events[-3:]
    for event in events[:-1]:
        validator.validate(json.loads(event.removeprefix("data: ")))


def _bound_generation(case: Any, stream: bool | None) -> None:
    """At most MAX_TOKENS per completion (the sim streams every token it may); only valid values are lowered. Valid
    bodies (`stream` given) stream half the time, as the generator rarely sets the optional field itself, and their
    integers are written as integers: JSON Schema's "integer" includes 2.0, which the gateway refuses (400), as
    OpenAI does."""
    body = case.body
    if case.method != "POST" or not isinstance(body, dict):
        return
    if stream is not None:
        body["stream"] = stream
        for name in INTEGER_FIELDS:
            if name in body:
                body[name] = _as_integers(body[name])
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(name)  # beyond the schema's maximum it is the invalid part of a negative case: kept
        if isinstance(value, int) and not isinstance(value, bool) and MAX_TOKENS < value <= INT64_MAX:
            body[name] = MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS


def _as_integers(value: Any) -> Any:
    """2.0 -> 2, in lists too (token ids)."""
    if isinstance(value, list):
        return [_as_integers(item) for item in value]
    return int(value) if isinstance(value, float) and value.is_integer() else value
