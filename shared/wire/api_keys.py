"""The gateway's API key file: named keys, stored as SHA-256 hashes, with limits.

The file is JSON: `{"version": 1, "keys": [{"name", "sha256", "requests_per_minute", "tokens_per_minute",
"max_concurrent"}]}`, a limit null when there is none. The gateway checks keys and enforces limits
(services/gateway/auth.py, limits.py), `tsukimi keys` (shared/tools/cli/keys.py) edits the file; this module owns
only the format, reading and writing it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
KEY_PREFIX = "tsk-"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


class ApiKeysError(ValueError):
    """An API key file that cannot be used; the message names it and what is wrong."""


def hash_key(key: str) -> str:
    """The hex SHA-256 of a key. Keys are 256 random bits, so a plain hash suffices: no salt, no slow hash."""
    # surrogateescape: aiohttp hands over non-UTF-8 header bytes as surrogates; they hash, never raise
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """One named key: its hash and its limits (None: unlimited)."""

    name: str
    sha256: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True)
class ApiKeys:
    """The keys of one file."""

    keys: tuple[ApiKey, ...]

    def find(self, key: str) -> ApiKey | None:
        """The key whose hash matches; compares with every stored hash in constant time (no early exit)."""
        digest = hash_key(key)
        found = None
        for candidate in self.keys:
            if hmac.compare_digest(digest, candidate.sha256):
                found = candidate
        return found


def load_api_keys(path: str | Path) -> ApiKeys:
    """Read and check a key file.

    Raises:
        ApiKeysError: the file is missing or unreadable, not this format, or holds no key.
    """
    keys = read_api_keys(Path(path))
    if not keys.keys:
        raise ApiKeysError(f"API key file {path} holds no key: every request would get 401 (tsukimi keys add)")
    return keys


def read_api_keys(path: Path) -> ApiKeys:
    """The file's keys, any number (`load_api_keys` also wants one). Raises ApiKeysError."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ApiKeysError(f"cannot read the API key file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ApiKeysError(f"the API key file {path} is not JSON: {exc}") from None
    if not isinstance(document, dict) or document.get("version") != FORMAT_VERSION:
        raise ApiKeysError(f"the API key file {path} must be an object with \"version\": {FORMAT_VERSION}")
    entries = document.get("keys")
    if not isinstance(entries, list):
        raise ApiKeysError(f"the API key file {path} must hold a \"keys\" list")
    keys = tuple(_parse_entry(entry, path, i) for i, entry in enumerate(entries))
    names = [k.name for k in keys]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ApiKeysError(f"the API key file {path} names {', '.join(duplicates)} more than once")
    return ApiKeys(keys)


def _parse_entry(entry: Any, path: Path, i: int) -> ApiKey:
    where = f"{path}: keys[{i}]"
    if not isinstance(entry, dict):
        raise ApiKeysError(f"{where} must be an object")
    name, digest = entry.get("name"), entry.get("sha256")
    if not isinstance(name, str) or not NAME.match(name):
        raise ApiKeysError(f"{where}.name must be 1-64 letters, digits, '.', '_' or '-', got {name!r}")
    if not isinstance(digest, str) or not _SHA256.match(digest):
        raise ApiKeysError(f"{where}.sha256 must be 64 lowercase hex digits (the hash, never the key)")
    limits = {}
    for field in _LIMITS:
        value = entry.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ApiKeysError(f"{where}.{field} must be a positive integer or null, got {value!r}")
        limits[field] = value
    return ApiKey(name, digest, **limits)


def write_api_keys(path: Path, keys: ApiKeys) -> None:
    """Replace the file atomically; 0644, as it holds only hashes and a container's user must read it."""
    document = {"version": FORMAT_VERSION, "keys": [asdict(k) for k in keys.keys]}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(json.dumps(document, indent=2) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


