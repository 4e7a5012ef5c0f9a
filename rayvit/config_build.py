"""Building a config section from YAML values and ``--set`` strings: the generic type checker, and the
forms a config comes in (a YAML file's mapping, ``section.key=value`` overrides, renamed keys).

Every field's type annotation says what it takes (``Literal[...]`` lists the allowed values), so one
checker covers every field and an error can always say what is allowed. A value given as text on the
command line is read as the field's type; a single value for a list field is a list of one.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import types
import typing
import warnings
from typing import Any, Iterable, Literal, Union

import yaml

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


def read_yaml(path: str | os.PathLike, shipped: Iterable[str] = ()) -> dict[str, Any]:
    """The mapping of sections a YAML config file holds; ``shipped``: the names the error offers instead."""
    if not os.path.isfile(path):
        offer = f" (nor is it one of the configs rayvit ships: {', '.join(shipped)})" if shipped else ""
        raise ConfigError(f"config file not found: {path}{offer}")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return data


# Keys that moved: old name -> new name. An old name still works, with a warning naming the new one.
RENAMED_KEYS = {"train.compile": "model.compile"}


def _renamed(key: str) -> str:
    new = RENAMED_KEYS.get(key)
    if new is None:
        return key
    warnings.warn(f"{key} is now {new} (torch.compile is applied per strategy, decided with the model); "
                  f"read as {new}: write {new} instead", FutureWarning, stacklevel=4)
    return new


def with_overrides(data: dict[str, Any], overrides: Iterable[str] | dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(data)
    # Renamed keys in the base data first, so that an override of either name still wins over the file.
    for old in RENAMED_KEYS:
        section, _, name = old.partition(".")
        if isinstance(data.get(section), dict) and name in data[section]:
            new_section, _, new_name = _renamed(old).partition(".")
            value = data[section].pop(name)
            if not isinstance(data.get(new_section), dict):
                data[new_section] = {}
            data[new_section][new_name] = value
    for key, value in _parse_overrides(overrides):
        key = _renamed(key)
        section, _, name = key.partition(".")
        if not name:
            raise ConfigError(f"override {key!r} must look like section.key=value")
        if section not in data or data[section] is None:
            data[section] = {}
        if not isinstance(data[section], dict):
            raise ConfigError(f"section {section!r} must be a mapping")
        data[section][name] = value
    return data


def _parse_overrides(overrides: Iterable[str] | dict[str, Any]) -> list[tuple[str, Any]]:
    if isinstance(overrides, dict):
        return list(overrides.items())
    pairs = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        pairs.append((key.strip(), _parse_scalar(raw.strip())))
    return pairs


def _parse_scalar(raw: str) -> Any:
    """CLI values: YAML scalars/lists (``[2, 2]``), or a comma list (``ddp,fsdp``)."""
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and "," in value:
        return [_parse_scalar(part.strip()) for part in value.split(",")]
    return value
