"""The HTTP checks of `make compose-test` against the containers' gateway on 127.0.0.1: wait for /health, the
end-to-end API checks, and requests that must succeed after a decode container is stopped.

Standard library only (any python3 runs it). It starts and stops nothing; run.sh owns the containers.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import Any

MODEL = "SmolLM2-135M-Instruct"
# About 600 tokens: several 64-token blocks that the repeat finds cached (on its prefill instance or the cache-store).
LONG_PROMPT = "Summarise these notes in one line.\n" + "\n".join(
    f"Note {i}: the {w} team moved the {w} service to rack {i} and measured {i * 7} ms at the {w} gateway."
    for i, w in enumerate(["red", "blue", "green", "amber", "violet", "teal", "ochre", "slate"] * 2)
)


AUTH: dict[str, str] = {}  # the Authorization header of every API request (--api-key)


class CheckFailed(AssertionError):
    """A check that did not hold; the message says what came back."""


def request(url: str, body: object | None = None, headers: dict[str, str] | None = None,
            timeout_s: float = 120) -> tuple[int, dict[str, str], bytes]:
    """GET (no body) or POST JSON (`bytes` sent as they are); (status, headers, body), errors included."""
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data,
                                 headers={"Content-Type": "application/json", **AUTH, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def check(condition: bool, what: str, got: object) -> None:
    if not condition:
        raise CheckFailed(f"{what}; got {got!r}"[:2000])


def chat(content: str, **extra: object) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def wait_health(base: str, prefill: int, decode: int, timeout_s: float) -> None:
    """Until GET /health answers 200 with exactly `prefill` prefill and `decode` decode instances alive."""
    deadline, last = time.monotonic() + timeout_s, "no answer yet"
    while time.monotonic() < deadline:
        try:
            status, _, body = request(base + "/health", timeout_s=3)
            last = f"{status} {body.decode(errors='replace')}"
            counts = json.loads(body)
            if status == 200 and (counts.get("prefill"), counts.get("decode")) == (prefill, decode):
                print(f"  /health: {body.decode()}")
                return
        except (OSError, ValueError) as exc:
            last = repr(exc)
        time.sleep(1)
    raise CheckFailed(f"/health did not show {prefill} prefill and {decode} decode within {timeout_s:.0f} s; "
                      f"last: {last!r}")


def check_chat(base: str) -> None:
    status, headers, raw = request(base + "/v1/chat/completions", chat("Say hello.", max_tokens=8),
                                   {"X-Request-Id": "compose-test-chat"})
    check(status == 200, "chat: status 200", (status, raw[:300]))
    body = json.loads(raw)
    check(headers.get("X-Request-Id") == "compose-test-chat", "chat: X-Request-Id echoed", headers)
    check(body["object"] == "chat.completion" and body["model"] == MODEL, "chat: object and model", body)
    check(bool(body["choices"][0]["message"]["content"]), "chat: some content", body)
    usage = body["usage"]
    check(0 < usage["completion_tokens"] <= 8, "chat: 1..8 completion tokens", usage)
    check(usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], "chat: usage adds up", usage)
    print(f"  chat: {body['choices'][0]['message']['content']!r} {usage}")


def check_streaming(base: str) -> None:
    body = chat("Count to five.", max_tokens=10, stream=True, stream_options={"include_usage": True})
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **AUTH})
    with urllib.request.urlopen(req, timeout=120) as response:
        check(response.headers["Content-Type"].startswith("text/event-stream"), "stream: SSE", dict(response.headers))
        payloads = [line[6:].strip() for line in (raw.decode() for raw in response) if line.startswith("data: ")]
    check(payloads[-1] == "[DONE]", "stream: ends with [DONE]", payloads[-3:])
    chunks = [json.loads(p) for p in payloads[:-1]]
    check(chunks[0]["choices"][0]["delta"].get("role") == "assistant", "stream: first delta is the role", chunks[0])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    usage = chunks[-1].get("usage") or {}
    check(chunks[-1]["choices"] == [] and usage.get("completion_tokens", 0) >= 1, "stream: a usage chunk", chunks[-1])
    print(f"  stream: {len(chunks)} chunks, {text!r}, usage {usage}")


def check_cached_tokens(base: str) -> None:
    """The same long prompt again is served from cached blocks (tries three times: blocks reach the cache-store
    off the critical path, and the repeat may go to the other prefill instance)."""
    body = chat(LONG_PROMPT, max_tokens=4)
    status, _, raw = request(base + "/v1/chat/completions", body)
    check(status == 200, "cached: first request 200", (status, raw[:300]))
    prompt_tokens = json.loads(raw)["usage"]["prompt_tokens"]
    check(prompt_tokens >= 256, "cached: a prompt of several blocks", prompt_tokens)
    cached = []
    for _ in range(3):
        time.sleep(2)
        status, _, raw = request(base + "/v1/chat/completions", body)
        check(status == 200, "cached: repeat 200", (status, raw[:300]))
        cached.append(json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"])
        if cached[-1] > prompt_tokens // 2:
            print(f"  cached: {prompt_tokens} prompt tokens, the repeat had {cached[-1]} cached")
            return
    raise CheckFailed(f"cached: no repeat of the {prompt_tokens}-token prompt had half of it cached: {cached}")


def check_bad_requests(base: str) -> None:
    for body, param in [(b"{not json", None), ({"model": MODEL, "messages": []}, "messages"),
                        (chat("hi", max_tokens=0), "max_tokens")]:
        status, _, raw = request(base + "/v1/chat/completions", body)
        check(status == 400, f"bad request {body!r}: status 400", (status, raw[:300]))
        error = json.loads(raw)["error"]
        check(bool(error["message"]) and (param is None or error.get("param") == param),
              f"bad request {body!r}: an OpenAI error object", error)
    status, _, raw = request(base + "/v1/chat/completions", {**chat("hi"), "model": "no-such-model"})
    check(status == 404, "unknown model: 404", (status, raw[:300]))
    if AUTH:
        status, _, raw = request(base + "/v1/chat/completions", chat("hi"), {"Authorization": "Bearer wrong"})
        check(status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key", "a wrong key: 401", raw[:300])
    print("  bad requests: 400 with an error object (404 for an unknown model, 401 for a wrong key)")


def nats_refuses_anonymous(port: int) -> None:
    """The stack's NATS turns away a client without credentials (the protocol by hand: INFO, CONNECT, -ERR)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        info = sock.recv(4096)
        check(info.startswith(b"INFO ") and b'"auth_required":true' in info, "nats: INFO says auth_required", info)
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
        answer = sock.recv(4096)
    check(b"Authorization Violation" in answer, "nats: an anonymous CONNECT is refused", answer)
    print("  nats: anonymous clients refused (Authorization Violation)")


def serve(base: str, num_requests: int, id_prefix: str) -> None:
    """`num_requests` chats, one at a time, each must succeed; their X-Request-Ids are `<id_prefix>-<i>`."""
    for i in range(num_requests):
        status, _, raw = request(base + "/v1/chat/completions", chat(f"Name a colour ({i}).", max_tokens=6),
                                 {"X-Request-Id": f"{id_prefix}-{i}"})
        check(status == 200, f"request {id_prefix}-{i}: status 200", (status, raw[:300]))
    print(f"  {num_requests} requests {id_prefix}-0..{num_requests - 1}: all 200")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:18000")
    parser.add_argument("--api-key", help="send it as 'Authorization: Bearer <key>'")
    commands = parser.add_subparsers(dest="command", required=True)
    wait = commands.add_parser("wait-health", help="wait for /health with these instance counts")
    wait.add_argument("--prefill", type=int, required=True)
    wait.add_argument("--decode", type=int, required=True)
    wait.add_argument("--timeout", type=float, required=True, help="seconds")
    commands.add_parser("e2e", help="chat, streaming, cached tokens, bad requests")
    nats = commands.add_parser("nats-auth", help="NATS refuses a client without credentials")
    nats.add_argument("--port", type=int, required=True)
    many = commands.add_parser("serve", help="requests that must all succeed")
    many.add_argument("--requests", type=int, default=4)
    many.add_argument("--id-prefix", required=True)
    args = parser.parse_args(argv)
    base = args.url.rstrip("/")
    if args.api_key:
        AUTH["Authorization"] = f"Bearer {args.api_key}"
    if not base.startswith(("http://127.0.0.1:", "http://localhost:")):
        parser.error("test traffic goes to loopback only: --url http://127.0.0.1:PORT")
    try:
        if args.command == "wait-health":
            wait_health(base, args.prefill, args.decode, args.timeout)
        elif args.command == "nats-auth":
            nats_refuses_anonymous(args.port)
        elif args.command == "e2e":
            for run_check in (check_chat, check_streaming, check_cached_tokens, check_bad_requests):
                run_check(base)
        else:
            serve(base, args.requests, args.id_prefix)
    except (CheckFailed, OSError, ValueError, KeyError) as exc:
        print(f"FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
