"""No log line carries a credential: passwords and tokens in URLs, and every secret a process registered, are masked
in structlog's lines and in the stdlib loggers' (nats, aiohttp)."""

from __future__ import annotations

import json
import logging

import pytest
import structlog

from shared.wire.log import MASK, configure_logging, get_logger, keep_secret, redact, redact_url


@pytest.mark.parametrize(("text", "shown"), [
    ("nats://gw:s3cr3t@host:4222", "nats://gw:***@host:4222"),
    ("nats://a:b@h1:1,tls://c:d@h2:2", "nats://a:***@h1:1,tls://c:***@h2:2"),
    ("nats://t0ken@host", "nats://***@host"),
    ("connecting to nats://u:p@10.0.0.1:4222 failed", "connecting to nats://u:***@10.0.0.1:4222 failed"),
    ("nats://plain:4222", "nats://plain:4222"),
    ("https://user@example.org/x", "https://user@example.org/x"),  # a user name alone is no secret
])
def test_url_passwords_and_nats_tokens_are_masked(text: str, shown: str) -> None:
    assert redact_url(text) == shown


def test_registered_secrets_are_masked_in_every_line(capsys: pytest.CaptureFixture[str]) -> None:
    secret = "the-block-key-0123456789abcdef"
    keep_secret(secret)
    keep_secret("short")  # too short to mask without masking ordinary words
    configure_logging("test", "test-0", "info", "json")
    try:
        get_logger("t").warning("oops", detail=f"key={secret}", url="nats://gw:hunter22@h:1")
        logging.getLogger("nats.aio.client").warning("reconnect to nats://x:%s@h failed, key %s", "pw123456", secret)
    finally:
        structlog.reset_defaults()
    err = capsys.readouterr().err
    line = json.loads(err.splitlines()[0])
    assert line["detail"] == f"key={MASK}" and line["url"] == "nats://gw:***@h:1"
    assert secret not in err and "hunter22" not in err and "pw123456" not in err
    assert redact("short words stay") == "short words stay"
