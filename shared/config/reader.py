"""Reading `TSUKIMI_*` values: typed access with errors that name the variable (`Reader`), secrets from a variable or
its file, NATS credentials, the default instance id, and the rule that keeps the API off the network without keys.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
from collections.abc import Mapping
from pathlib import Path

from shared.env_vars import ENV_VARS
from shared.wire.nats_auth import NatsCredentials, inbox_prefix


class ConfigError(ValueError):
    """An environment variable holds a value that cannot be used; the message names it."""


def is_loopback(host: str) -> bool:
    """`host` (a listen address) reaches this machine only: 127.0.0.0/8, ::1 or localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to may be public


def check_http_exposure(host: str, api_keys_file: str, insecure: bool) -> None:
    """Refuse to serve the API beyond loopback without API keys, unless told to.

    Raises:
        ConfigError: a non-loopback `host`, no `api_keys_file` and not `insecure`; the message says what to do.
    """
    if not (is_loopback(host) or api_keys_file or insecure):
        raise ConfigError(
            f"the gateway would listen on {host} without API keys: anyone who reaches it could use it and read its "
            "answers. Create keys (tsukimi keys add NAME --file keys.json; TSUKIMI_API_KEYS_FILE=keys.json), listen "
            "on 127.0.0.1, or accept it with TSUKIMI_INSECURE_HTTP=on (tsukimi up --insecure)")


def secret(get: Reader, name: str) -> str:
    """A secret from variable `name`, or from the file `name`_FILE names (not both)."""
    value, path = get.text(name), get.text(f"{name}_FILE")
    if value and path:
        raise ConfigError(f"set {name} or {name}_FILE, not both")
    if not path:
        return value
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{name}_FILE={path}: {exc.strerror}") from None


def nats_credentials(get: Reader, role: str) -> NatsCredentials:
    """TSUKIMI_NATS_* as credentials: the password from the variable or its file, the user the role unless set."""
    password = secret(get, "TSUKIMI_NATS_PASSWORD")
    user = get.text("TSUKIMI_NATS_USER") or (role if password else "")
    if password and not user:
        raise ConfigError("TSUKIMI_NATS_PASSWORD needs a user: set TSUKIMI_NATS_USER")
    files = {name: get.text(f"TSUKIMI_NATS_TLS_{name}_FILE") for name in ("CA", "CERT", "KEY")}
    if bool(files["CERT"]) != bool(files["KEY"]):
        raise ConfigError("TSUKIMI_NATS_TLS_CERT_FILE and TSUKIMI_NATS_TLS_KEY_FILE go together")
    for name, file in files.items():
        if file and not Path(file).is_file():
            raise ConfigError(f"TSUKIMI_NATS_TLS_{name}_FILE={file}: no such file")
    return NatsCredentials(user, password, inbox_prefix(role), files["CA"], files["CERT"], files["KEY"])


def default_instance_id(role: str) -> str:
    """`<role>-<host>-<pid>-<4 random hex>`: unique even where containers share a hostname and each is PID 1."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:32]
    return f"{role}-{host}-{os.getpid()}-{secrets.token_hex(2)}"


class Reader:
    """Typed access to the variables (a missing one takes its `ENV_VARS` default), with errors that name it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = env

    def text(self, name: str) -> str:
        return self._env.get(name, ENV_VARS[name].default).strip()

    def is_set(self, name: str) -> bool:
        """Whether the environment gives `name` a value (not its default)."""
        return bool(self._env.get(name, "").strip())

    def integer(self, name: str, minimum: int) -> int:
        raw = self.text(name)
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
        if value < minimum:
            raise ConfigError(f"{name} must be at least {minimum}, got {value}")
        return value

    def integer_or_auto(self, name: str, minimum: int) -> int:
        """An integer of at least `minimum`, or "auto" as 0."""
        raw = self.text(name)
        if raw.lower() == "auto":
            return 0
        try:
            return self.integer(name, minimum)
        except ConfigError:
            raise ConfigError(f"{name} must be auto or an integer of at least {minimum}, got {raw!r}") from None

    def number(self, name: str, minimum: float) -> float:
        raw = self.text(name)
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {raw!r}") from None
        if not value >= minimum:
            raise ConfigError(f"{name} must be at least {minimum}, got {value}")
        return value

    def choice(self, name: str, choices: tuple[str, ...]) -> str:
        raw = self.text(name).lower()
        if raw not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
        return raw

    def switch(self, name: str) -> bool:
        raw = self.text(name).lower()
        if raw not in ("on", "off", "1", "0", "true", "false"):
            raise ConfigError(f"{name} must be on or off, got {raw!r}")
        return raw in ("on", "1", "true")

    def subject_token(self, name: str) -> str:
        """A value used inside NATS subjects: letters, digits, '-' and '_' only."""
        raw = self.text(name)
        if any(not (c.isascii() and (c.isalnum() or c in "-_")) for c in raw):
            raise ConfigError(f"{name} may hold only letters, digits, '-' and '_', got {raw!r}")
        return raw
