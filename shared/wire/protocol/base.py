"""The message base, the registry of message kinds, and the wire encoding (msgpack `[kind, version, fields]`);
nothing else in tsukimi calls msgpack. The messages themselves are in `messages.py`.
"""

from __future__ import annotations

import dataclasses
import types
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
_CHECKS: dict[str, typing.Callable[[Any], None]] = {}  # kind -> its invariants (`checks.py`)
M = TypeVar("M", bound=type[Message])


def message(kind: str) -> typing.Callable[[M], M]:
    def register(cls: M) -> M:
        if kind in _REGISTRY:
            raise TypeError(f"message kind {kind!r} registered twice")
        cls.KIND = kind
        _REGISTRY[kind] = cls
        return cls

    return register


def invariants(cls: type[Message]) -> typing.Callable[[typing.Callable[[Any], None]], typing.Callable[[Any], None]]:
    """Register the checks every decoded message of `cls` must pass (they raise ProtocolError)."""

    def register(check: typing.Callable[[Any], None]) -> typing.Callable[[Any], None]:
        _CHECKS[cls.KIND] = check
        return check

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
        ProtocolError: not msgpack, an unknown kind, a newer version, missing/unknown fields, a field of the wrong
            type, a value no sender makes (a negative count, an id that is not a subject token, ...; `checks.py`),
            or not `expected`.
    """
    try:
        kind, version, fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"not a tsukimi message: {exc}") from None
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {str(kind)[:40]!r}")
    if type(version) is not int:
        raise ProtocolError(f"{kind}: version {str(version)[:20]!r} is not an integer")
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
    hints = _field_hints(cls)
    unknown = set(fields) - set(hints)
    if unknown:
        raise ProtocolError(f"{cls.KIND}: unknown field(s) {sorted(map(str, unknown))}")
    kwargs = {name: _checked(cls, name, value, hints[name]) for name, value in fields.items()}
    try:
        msg = cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a missing field, or a value its class refuses on construction
        raise ProtocolError(f"{cls.KIND}: {exc}") from None
    check = _CHECKS.get(cls.KIND)
    if check is not None:
        check(msg)
    return msg


_HINTS: dict[str, dict[str, Any]] = {}  # kind -> each field's resolved annotation


def _field_hints(cls: type[Message]) -> dict[str, Any]:
    """Each dataclass field's resolved annotation (resolved once per class: decoding is on every hot path)."""
    hints = _HINTS.get(cls.KIND)
    if hints is None:
        resolved = typing.get_type_hints(cls)
        hints = _HINTS[cls.KIND] = {f.name: resolved[f.name] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return hints


def _checked(cls: type[Message], name: str, value: Any, hint: Any) -> Any:
    """`value` as field `name` of `cls` holds it (an int where a float is declared becomes a float).

    Raises:
        ProtocolError: the value is not of the declared type (bool is not an int, a list must hold the declared type).
    """
    if isinstance(hint, type) and issubclass(hint, Message):
        return _from_wire(hint, value)
    if not _fits(value, hint):
        raise ProtocolError(f"{cls.KIND}: field {name!r} must be {_type_name(hint)}, got {type(value).__name__}")
    return float(value) if hint is float else value


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            return False
        if item is int:  # token ids and block hashes: the long lists, checked without a call per element
            return all(type(v) is int for v in value)
        return all(_fits(v, item) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return type(value) in (float, int)
    if hint in (int, str, bytes, bool):
        return type(value) is hint
    raise TypeError(f"no wire check for the annotation {hint!r}")  # a message declared a type this module lacks


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
