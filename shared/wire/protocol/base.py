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


def unchecked_fields(data: bytes) -> dict[Any, Any] | None:
    """The fields of an encoded message as they came, nothing checked (for sizing what passes, never for acting on
    it: that is `decode`'s); None for bytes that are not a message's shape."""
    try:
        _, _, fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    return fields if isinstance(fields, dict) else None


def _to_wire(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _field_names(type(msg)):
        value = getattr(msg, name)
        out[name] = _to_wire(value) if isinstance(value, Message) else value
    return out


_NAMES: dict[type[Message], tuple[str, ...]] = {}


def _field_names(cls: type[Message]) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    return names


def _from_wire(cls: type[Message], fields: Any) -> Message:
    if not isinstance(fields, dict):
        raise ProtocolError(f"{cls.KIND}: fields must be a map")
    spec = _field_specs(cls)
    if not fields.keys() <= spec.keys():
        raise ProtocolError(f"{cls.KIND}: unknown field(s) {sorted(map(str, set(fields) - set(spec)))}")
    kwargs: dict[str, Any] = {}
    for name, value in fields.items():
        field = spec[name]
        if field.message is not None:
            kwargs[name] = _from_wire(field.message, value)
        elif not field.fits(value):
            raise ProtocolError(f"{cls.KIND}: field {name!r} must be {field.type_name}, got {type(value).__name__}")
        else:
            kwargs[name] = float(value) if field.is_float else value
    try:
        msg = cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a missing field, or a value its class refuses on construction
        raise ProtocolError(f"{cls.KIND}: {exc}") from None
    check = _CHECKS.get(cls.KIND)
    if check is not None:
        check(msg)
    return msg


@dataclasses.dataclass(frozen=True)
class _FieldSpec:
    """How one field of a message is checked on decode (made once per class: decoding is on every hot path)."""

    fits: typing.Callable[[Any], bool]  # the value is of the declared type (bool is not an int, lists hold it)
    type_name: str
    is_float: bool = False  # an int where a float is declared becomes a float
    message: type[Message] | None = None  # a nested message, decoded as one


_SPECS: dict[str, dict[str, _FieldSpec]] = {}  # kind -> each field's spec


def _field_specs(cls: type[Message]) -> dict[str, _FieldSpec]:
    specs = _SPECS.get(cls.KIND)
    if specs is None:
        resolved = typing.get_type_hints(cls)
        specs = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            hint = resolved[f.name]
            nested = hint if isinstance(hint, type) and issubclass(hint, Message) else None
            fits = _always if nested is not None else _fitter(hint)
            specs[f.name] = _FieldSpec(fits, _type_name(hint), hint is float, nested)
        _SPECS[cls.KIND] = specs
    return specs


_INT_ONLY = frozenset((int,))  # bool is a subclass of int, and not an int here


def _always(value: Any) -> bool:
    return True


def _fitter(hint: Any) -> typing.Callable[[Any], bool]:
    """A check of a value against the annotation `hint`.

    Raises:
        TypeError: an annotation this module has no wire check for (a message declared a type it lacks).
    """
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [_fitter(option) for option in typing.get_args(hint)]
        return lambda value: any(fits(value) for fits in options)
    if origin is list:
        (item,) = typing.get_args(hint)
        if item is int:  # token ids and block hashes: the long lists, checked without Python code per element
            return lambda value: isinstance(value, list) and set(map(type, value)) <= _INT_ONLY
        fits_item = _fitter(item)
        return lambda value: isinstance(value, list) and all(fits_item(v) for v in value)
    if hint is type(None):
        return lambda value: value is None
    if hint is float:
        return lambda value: type(value) in (float, int)
    if hint in (int, str, bytes, bool):
        return lambda value: type(value) is hint
    raise TypeError(f"no wire check for the annotation {hint!r}")


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
