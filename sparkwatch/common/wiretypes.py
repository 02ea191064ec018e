"""Typed values to and from plain JSON: the one converter for everything that crosses between sparkwatch's processes
(channel messages, the guard's config on its memfd).

`from_json(T, value)` rebuilds a value of type T from what `json.loads` gave, strictly: an int field takes an int
(never a bool or a string), a float field an int or a float, a dataclass a JSON object with exactly its required
fields, a `dict[int, V]` the string keys JSON makes of ints. Anything else raises `WireError`, so a malformed or
foreign message is refused whole, never half-applied. `to_json` is the inverse.

Supported types: None, bool, int, float, str, Path, StrEnum subclasses, `X | None`, `tuple[T, ...]`, `tuple[A, B]`,
`list[T]`, `dict[K, V]` / `Mapping[K, V]` (K str or int), `Any` (taken as is), and dataclasses of these.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class WireError(ValueError):
    """A JSON value that is not of the type it must be; the message names the field."""


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def from_json(tp: Any, value: Any, where: str = "value") -> Any:
    """`value` (from json.loads) as a `tp`. Raises WireError naming the offending field."""
    if tp is Any:
        return value
    if tp is type(None):
        if value is not None:
            raise WireError(f"{where}: expected null")
        return None
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return _optional(tp, value, where)
    if origin in (tuple, list):
        return _sequence(tp, origin, value, where)
    if origin in (dict, Mapping) or tp is dict:
        return _mapping(tp, value, where)
    if isinstance(tp, type):
        if dataclasses.is_dataclass(tp):
            return _dataclass(tp, value, where)
        if issubclass(tp, enum.Enum):
            try:
                return tp(value)
            except ValueError:
                raise WireError(f"{where}: {value!r} is not a {tp.__name__}") from None
        if tp in _SCALARS:
            return _SCALARS[tp](value, where)
    raise WireError(f"{where}: type {tp!r} is not supported on the wire")


def _optional(tp: Any, value: Any, where: str) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    inner = [a for a in args if a is not type(None)]
    if len(inner) != 1:
        raise WireError(f"{where}: unions other than X | None are not supported")
    return from_json(inner[0], value, where)


def _sequence(tp: Any, origin: Any, value: Any, where: str) -> Any:
    if not isinstance(value, list):
        raise WireError(f"{where}: expected a list")
    args = typing.get_args(tp)
    if origin is list or (len(args) == 2 and args[1] is Ellipsis):
        items = [from_json(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    else:
        if len(value) != len(args):
            raise WireError(f"{where}: expected {len(args)} items")
        items = [from_json(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))]
    return items if origin is list else tuple(items)


def _mapping(tp: Any, value: Any, where: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise WireError(f"{where}: expected an object")
    key_tp, val_tp = typing.get_args(tp) or (str, Any)
    out: dict[Any, Any] = {}
    for k, v in value.items():
        if key_tp is int:
            if not (isinstance(k, str) and k.lstrip("-").isdigit()):
                raise WireError(f"{where}: key {k!r} is not an integer")
            out[int(k)] = from_json(val_tp, v, f"{where}[{k!r}]")
        else:
            out[k] = from_json(val_tp, v, f"{where}[{k!r}]")
    return out


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise WireError(f"{where}: expected true or false")
    return value


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{where}: expected an integer")
    return value


def _float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WireError(f"{where}: expected a number")
    try:
        return float(value)
    except OverflowError:  # an int past a float's range (10**400): refused like any other bad value
        raise WireError(f"{where}: number too large") from None


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise WireError(f"{where}: expected a string")
    return value


def _path(value: Any, where: str) -> Path:
    if not isinstance(value, str):
        raise WireError(f"{where}: expected a path")
    return Path(value)


_SCALARS: dict[type, Callable[[Any, str], Any]] = {bool: _bool, int: _int, float: _float, str: _str, Path: _path}


def _dataclass(cls: type[T], value: Any, where: str) -> T:
    if not isinstance(value, dict):
        raise WireError(f"{where}: expected an object")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # cls is a dataclass (checked by the caller)
        if not f.init:
            continue
        if f.name in value:
            kwargs[f.name] = from_json(hints[f.name], value[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise WireError(f"{where}.{f.name}: missing")
    return cls(**kwargs)


def to_json(value: Any) -> Any:
    """A typed value as plain JSON types (dict keys as strings, tuples as lists, paths as strings)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, frozenset, set)):
        return [to_json(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
