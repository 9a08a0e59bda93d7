"""The message base, the registry of message kinds, and the wire encoding (msgpack `[kind, version, fields]`);
nothing else in tsukimi calls msgpack. The messages themselves are in `messages.py`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar, TypeVar

import msgpack

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """Bytes that are not a message this version understands."""


class Message:
    """Base of every wire message; subclasses are frozen dataclasses registered with `@message("kind")`."""

    KIND: ClassVar[str] = ""
    VERSION: ClassVar[int] = PROTOCOL_VERSION


_REGISTRY: dict[str, type[Message]] = {}
M = TypeVar("M", bound=type[Message])


def message(kind: str) -> typing.Callable[[M], M]:
    def register(cls: M) -> M:
        if kind in _REGISTRY:
            raise TypeError(f"message kind {kind!r} registered twice")
        cls.KIND = kind
        _REGISTRY[kind] = cls
        return cls

    return register


def message_types() -> list[type[Message]]:
    """Every registered message class (for round-trip tests and docs)."""
    return list(_REGISTRY.values())




def encode(msg: Message) -> bytes:
    """The message as msgpack bytes."""
    return msgpack.packb([msg.KIND, msg.VERSION, _to_wire(msg)], use_bin_type=True)


T = TypeVar("T", bound=Message)


def decode(data: bytes, expected: type[T] | None = None) -> Any:
    """Parse bytes made by `encode`.

    Args:
        data: the NATS payload.
        expected: when given, the message must be of this type.
    Raises:
        ProtocolError: not msgpack, an unknown kind, a newer version, missing/unknown fields, or not `expected`.
    """
    try:
        kind, version, fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"not a tsukimi message: {exc}") from None
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    if version > cls.VERSION:
        raise ProtocolError(f"{kind} version {version} is newer than this service understands ({cls.VERSION})")
    if expected is not None and cls is not expected:
        raise ProtocolError(f"expected {expected.KIND}, got {kind}")
    return _from_wire(cls, fields)


def _to_wire(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(msg):  # type: ignore[arg-type]
        value = getattr(msg, f.name)
        out[f.name] = _to_wire(value) if isinstance(value, Message) else value
    return out


def _from_wire(cls: type[Message], fields: Any) -> Message:
    if not isinstance(fields, dict):
        raise ProtocolError(f"{cls.KIND}: fields must be a map")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(fields) - names
    if unknown:
        raise ProtocolError(f"{cls.KIND}: unknown field(s) {sorted(unknown)}")
    kwargs = {}
    for name, value in fields.items():
        hint = hints[name]
        if isinstance(hint, type) and issubclass(hint, Message):
            value = _from_wire(hint, value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ProtocolError(f"{cls.KIND}: {exc}") from None


