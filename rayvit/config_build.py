"""Building a config section from YAML values and ``--set`` strings: the generic type checker.

Every field's type annotation says what it takes (``Literal[...]`` lists the allowed values), so one
checker covers every field and an error can always say what is allowed. A value given as text on the
command line is read as the field's type; a single value for a list field is a list of one.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

from rayvit.errors import ConfigError


def build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = prefix.rstrip(".") or "config"
        raise ConfigError(f"unknown key {prefix + unknown[0]!r} in {where}; allowed: {', '.join(fields)}")
    return cls(**{name: _coerce(value, hints[name], prefix + name) for name, value in data.items()})


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key + ".")
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None or value in ("", "none", "None", "null"):
            return None
        return _coerce(value, inner[0], key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, args))}")
        return value
    if origin is list:
        values = value if isinstance(value, list) else [value]     # `--set key=2` for a list of one
        return [_coerce(v, args[0] if args else Any, f"{key}[{i}]") for i, v in enumerate(values)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return {str(k): (_coerce(v, args[1], f"{key}.{k}") if args else v) for k, v in value.items()}
    return _SCALARS.get(tp, lambda v, k: v)(value, key)


def _to_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    raise ConfigError(f"{key}={value!r} must be a boolean (true/false)")


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{key}={value!r} must be an integer")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} must be an integer") from None


def _to_float(value: Any, key: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r} must be a number") from None


def _to_str(value: Any, key: str) -> str:
    if isinstance(value, (dict, list)):
        raise ConfigError(f"{key}={value!r} must be a string")
    return str(value)


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}
