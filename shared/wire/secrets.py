"""A deployment's secrets: one NATS password per role, and the key that prefill instances sign the cache-store's KV
blocks with. Made by `tsukimi secrets` (or fresh for every `tsukimi up`), kept in a `VAR=value` file that docker
compose reads as `.env`. Nothing here logs or prints a secret; `repr` shows none.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared.wire.protocol import Role

ROLES: tuple[str, ...] = tuple(role.value for role in Role)
SECRET_BYTES = 32  # of randomness per generated secret (43 URL-safe characters)
MIN_SECRET_LEN = 16
_SECRET_CHARS = re.compile(r"[A-Za-z0-9_-]+\Z")  # safe inside the server's quoted strings and compose's ${...}
BLOCK_KEY_VARIABLE = "CACHE_BLOCK_KEY"


class SecretsError(ValueError):
    """Secrets (or TLS files) that cannot be used; the message says which and how to make them."""


def password_variable(role: str) -> str:
    """The variable that holds a role's NATS password in a secrets file (and compose's `.env`)."""
    return f"NATS_PASSWORD_{role.upper().replace('-', '_')}"


@dataclass(frozen=True)
class Secrets:
    """One NATS password per role and the cache-store's block key ("" where it is not needed: the NATS server's).

    Raises:
        SecretsError: a role without a password, or a secret too short or with characters other than letters,
            digits, '-' and '_'.
    """

    passwords: Mapping[str, str] = field(repr=False)
    block_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        for role in ROLES:
            check_secret(password_variable(role), self.passwords.get(role, ""))
        if self.block_key:
            check_secret(BLOCK_KEY_VARIABLE, self.block_key)

    @classmethod
    def generate(cls) -> Secrets:
        return cls({role: secrets.token_urlsafe(SECRET_BYTES) for role in ROLES}, secrets.token_urlsafe(SECRET_BYTES))

    @classmethod
    def from_env(cls, env: Mapping[str, str], source: str = "the environment", with_block_key: bool = True) -> Secrets:
        """From `NATS_PASSWORD_<ROLE>` variables and, `with_block_key`, `CACHE_BLOCK_KEY`.

        Raises:
            SecretsError: one missing or unusable; the message names `source` and how to make them.
        """
        try:
            passwords = {role: env.get(password_variable(role), "").strip() for role in ROLES}
            block_key = env.get(BLOCK_KEY_VARIABLE, "").strip() if with_block_key else ""
            if with_block_key and not block_key:
                raise SecretsError(f"{BLOCK_KEY_VARIABLE} is not set")
            return cls(passwords, block_key)
        except SecretsError as exc:
            raise SecretsError(f"{source}: {exc} (make them all with `tsukimi secrets -o FILE`)") from None

    @classmethod
    def read(cls, path: Path, with_block_key: bool = True) -> Secrets:
        """A secrets file (`VAR=value` lines, `#` comments), as `tsukimi secrets` writes it."""
        try:
            text = path.read_text()
        except OSError as exc:
            raise SecretsError(f"cannot read the secrets file {path}: {exc.strerror}") from None
        return cls.from_env(parse_env_file(text), str(path), with_block_key)

    def env_text(self) -> str:
        """The secrets as a file that `read` (and docker compose, as `.env`) reads."""
        lines = ["# tsukimi's secrets (tsukimi secrets): a NATS password per role, the cache-store's block key.",
                 "# Keep this file private."]
        lines += [f"{password_variable(role)}={self.passwords[role]}" for role in ROLES]
        lines.append(f"{BLOCK_KEY_VARIABLE}={self.block_key}")
        return "\n".join(lines) + "\n"


def check_secret(name: str, value: str) -> None:
    if not value:
        raise SecretsError(f"{name} is not set")
    if len(value) < MIN_SECRET_LEN or not _SECRET_CHARS.match(value):
        raise SecretsError(f"{name} must be at least {MIN_SECRET_LEN} letters, digits, '-' or '_'")


def parse_env_file(text: str) -> dict[str, str]:
    """`NAME=value` lines (blank lines and `#` comments skipped; no quoting, no expansion)."""
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            name, _, value = line.partition("=")
            env[name.strip()] = value.strip()
    return env


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (created with mode 0600, never readable in between)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with open(path, "x", opener=lambda name, flags: os.open(name, flags, 0o600)) as out:
        out.write(text)
