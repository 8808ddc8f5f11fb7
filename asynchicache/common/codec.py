"""The one codec for every message that crosses a process: typed dataclasses over msgpack.

Both protocols use it: the HTTP server and the engine (engine.protocol), the engine
and the cache service (storage.messages, storage.admin_messages). A `Codec` is built
once per protocol from its message types; it resolves every field's annotation when
it is built, never per message.

Wire format: a message is a msgpack map `{"__t": type name, field: value, ...}` in
field order (nested messages the same way), tuples as arrays, bytes as bin; the tag
key is the protocol's choice (KV events use vLLM's "type").

`decode` is driven by the types: each field is checked against (and shaped as) its
annotation, so a malformed or hostile frame is a clean `ValueError` (naming the field)
and never a half-built message that fails later, deep in the engine or the service.
Unknown fields are ignored (an older reader keeps working); a missing field takes its
default, or is an error when it has none. A float field accepts an int (msgpack keeps
0 an int) and decodes it as a float; an int field refuses a bool.

This module imports nothing of asynchicache, so every layer may use it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import Any

import msgpack

TAG = "__t"

Decoder = Callable[[Any], Any]
_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


def unpack_foreign(data: bytes) -> Any:
    """Plain msgpack of a format another project defines (vLLM's KV events,
    kv_events/wire.py, which checks the shapes): the same safe settings as `Codec.decode`
    (no hooks, no extension types, str keys); ValueError on anything malformed."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except ValueError:
        raise
    except Exception as exc:  # msgpack's ExtraData, FormatError, StackError, ...
        raise ValueError(f"not msgpack: {exc}") from exc


class Codec:
    """`encode` / `decode` for one protocol's message types (and the dataclasses they nest)."""

    def __init__(self, name: str, messages: Iterable[type], tag: str = TAG) -> None:
        self.name = name  # "engine", "storage": in every error message
        self.tag = tag  # the key naming a map's type (KV events use vLLM's "type")
        self.messages: MappingProxyType[str, type] = MappingProxyType(
            {cls.__name__: cls for cls in messages}
        )
        self._fields: dict[type, tuple[tuple[str, Decoder, bool], ...]] = {}
        self._names: dict[type, tuple[str, ...]] = {}
        for cls in self.messages.values():
            self._dataclass(cls)

    # -- encode -------------------------------------------------------------

    def encode(self, msg: Any) -> bytes:
        """`msg` as bytes; TypeError for anything but this protocol's messages."""
        if type(msg).__name__ not in self.messages:
            raise TypeError(f"not a {self.name} message: {type(msg).__name__}")
        packed: bytes = msgpack.packb(self._plain(msg), use_bin_type=True)
        return packed

    def _plain(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _SCALARS:
            return obj
        names = self._names.get(kind)
        if names is not None:
            body = {self.tag: kind.__name__}
            for name in names:
                body[name] = self._plain(getattr(obj, name))
            return body
        if isinstance(obj, list | tuple):
            if all(type(x) is int for x in obj):  # token ids: no element needs converting
                return list(obj)
            return [self._plain(x) for x in obj]
        if isinstance(obj, dict):
            return {k: self._plain(v) for k, v in obj.items()}
        if dataclasses.is_dataclass(obj):
            raise TypeError(f"{kind.__name__} is not part of the {self.name} protocol")
        return obj

    # -- decode -------------------------------------------------------------

    def decode(self, data: bytes) -> Any:
        """One message from `data`; raises ValueError (only) on anything malformed."""
        try:
            plain = msgpack.unpackb(data, raw=False, strict_map_key=True)
            cls = self.messages.get(str(plain.get(self.tag))) if isinstance(plain, dict) else None
            if cls is None:
                raise ValueError("not a typed message")
            return self._dataclass(cls)(plain)
        except ValueError as exc:
            raise ValueError(f"malformed {self.name} message: {exc}") from exc
        except Exception as exc:  # msgpack raises a zoo of types on garbage; all mean malformed
            raise ValueError(f"malformed {self.name} message: {type(exc).__name__}: {exc}") from exc

    def _compile(self, hint: Any) -> Decoder:
        """The decoder of values annotated `hint` (built once per field)."""
        if hint is Any:
            return _as_is
        origin = typing.get_origin(hint)
        if origin in (types.UnionType, typing.Union):
            return self._union(typing.get_args(hint))
        if origin is tuple:
            return self._tuple(typing.get_args(hint))
        if origin is dict:
            key, value = (self._compile(h) for h in typing.get_args(hint))
            return lambda v: {key(k): value(x) for k, x in _expect(v, dict).items()}
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            return self._dataclass(hint)
        if hint in _SCALARS:
            return _scalar(hint)
        raise TypeError(f"the {self.name} codec cannot carry {hint!r}")

    def _dataclass(self, cls: type) -> Decoder:
        if cls not in self._names:
            self._names[cls] = ()  # registered first: a type that nests itself terminates
            hints = typing.get_type_hints(cls)
            fields = dataclasses.fields(cls)
            self._names[cls] = tuple(f.name for f in fields)
            self._fields[cls] = tuple(
                (f.name, self._compile(hints[f.name]), _required(f)) for f in fields
            )
        return lambda value: self._build(cls, value)

    def _build(self, cls: type, value: Any) -> Any:
        obj = _expect(value, dict)
        if obj.get(self.tag) != cls.__name__:
            raise ValueError(f"expected {cls.__name__}, got {obj.get(self.tag)!r}")
        kwargs = {}
        for name, decode, required in self._fields[cls]:
            if name in obj:
                try:
                    kwargs[name] = decode(obj[name])
                except ValueError as exc:
                    raise ValueError(f"{cls.__name__}.{name} mistyped: {exc}") from exc
            elif required:
                raise ValueError(f"{cls.__name__}.{name} missing")
        return cls(**kwargs)

    def _union(self, options: tuple[Any, ...]) -> Decoder:
        nullable = type(None) in options
        classes = {
            o.__name__: self._dataclass(o)
            for o in options
            if isinstance(o, type) and dataclasses.is_dataclass(o)
        }
        others = [self._compile(o) for o in options if o is not type(None)]

        def decode(value: Any) -> Any:
            if value is None and nullable:
                return None
            if classes:  # a union of messages (events): the value names its type
                tag = value.get(self.tag) if isinstance(value, dict) else None
                if tag not in classes:
                    raise ValueError(f"expected one of {sorted(classes)}, got {tag!r}")
                return classes[tag](value)
            for option in others[:-1]:
                try:
                    return option(value)
                except ValueError:
                    continue
            return others[-1](value)

        return decode

    def _tuple(self, args: tuple[Any, ...]) -> Decoder:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"the {self.name} codec carries tuple[X, ...] only, not {args}")
        if args[0] is int:
            return _int_tuple
        item = self._compile(args[0])
        return lambda v: tuple(item(x) for x in _expect(v, list))


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _as_is(value: Any) -> Any:
    return value


def _int_tuple(value: Any) -> tuple[int, ...]:
    # Token ids, thousands of them: one pass, no call per element (`type is int` refuses bools).
    if type(value) is list and all(type(v) is int for v in value):
        return tuple(value)
    raise ValueError("expected a list of ints")


def _scalar(hint: type) -> Decoder:
    def decode(value: Any) -> Any:
        if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if hint is int and isinstance(value, bool):
            raise ValueError("expected int, got bool")
        if isinstance(value, hint):
            return value
        raise ValueError(f"expected {hint.__name__}, got {type(value).__name__}")

    return decode


def _expect(value: Any, kind: type) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value
