"""Field specs and value checks behind engine/config/sections.py.

A key's bounds live in its dataclass field `metadata` (built by `ranged` / `one_of`) and one
generic checker enforces them, so adding a key never means adding another if-branch.
Standard library only, like config.py.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

_META_KEY = "tokenloom_bounds"


class ConfigError(ValueError):
    """Bad configuration. The message names the key, env var or file and says what is allowed.

    `key` is the dotted key ("kv_cache.block_size") when the error is about one key, else None.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True, slots=True)
class Bounds:
    """Allowed values of one key: a numeric range [lo, hi] / (lo, hi], or a set of choices."""

    lo: int | float | None = None
    hi: int | float | None = None
    lo_open: bool = False
    choices: tuple[str, ...] = ()


def ranged(default: int | float, lo: int | float, hi: int | float, *, lo_open: bool = False) -> Any:
    """A numeric field limited to [lo, hi], or (lo, hi] when lo_open."""
    return dataclasses.field(default=default, metadata={_META_KEY: Bounds(lo, hi, lo_open)})


def one_of(default: str, *choices: str) -> Any:
    """A string field limited to `choices`."""
    return dataclasses.field(default=default, metadata={_META_KEY: Bounds(choices=choices)})


def _kind(tp: Any) -> str:
    """Map an annotation to the kinds this config supports: int, float, bool, str, strs."""
    if tp in (int, float, bool, str):
        return tp.__name__
    if typing.get_origin(tp) in (list, tuple) and typing.get_args(tp)[:1] == (str,):
        return "strs"
    raise TypeError(f"config fields must be int, float, bool, str or list[str], not {tp!r}")


@cache
def field_specs(cls: type) -> dict[str, tuple[str, Bounds]]:
    """{key: (kind, bounds)} for a section dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: (_kind(hints[f.name]), f.metadata.get(_META_KEY, Bounds())) for f in dataclasses.fields(cls)}


def show(value: Any) -> str:
    """Render a value the way it would be written in TOML, for error messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def describe(kind: str, bounds: Bounds) -> str:
    """What the key allows, e.g. 'an integer in [1, 256]' or 'one of: auto, cpu, cuda'."""
    if bounds.choices:
        return "one of: " + ", ".join(bounds.choices)
    noun = {
        "int": "an integer",
        "float": "a number",
        "bool": "true or false",
        "str": "a string",
        "strs": "a list of strings",
    }[kind]
    if bounds.lo is None:
        return noun
    return f"{noun} in {'(' if bounds.lo_open else '['}{bounds.lo}, {bounds.hi}]"


def _has_kind(kind: str, value: Any) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):  # bool is an int subclass; `port = true` is a mistake
        return False
    if kind == "int":
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, (int, float))
    if kind == "str":
        return isinstance(value, str)
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


def _in_range(value: float, b: Bounds) -> bool:
    lo, hi = b.lo, b.hi
    if lo is None or hi is None:  # ranged() always sets both; comparing with None was a TypeError too
        raise TypeError(f"bounds {b!r} have no numeric range")
    # Written so NaN fails every comparison and is rejected.
    above_lo = lo < value if b.lo_open else lo <= value
    return above_lo and value <= hi


def check_value(qualname: str, kind: str, bounds: Bounds, value: Any) -> Any:
    """Return `value` normalised (int -> float, list -> tuple) or raise ConfigError naming the key."""
    allowed = describe(kind, bounds)
    if not _has_kind(kind, value):
        raise ConfigError(f"config: {qualname} = {show(value)} has the wrong type: must be {allowed}", qualname)
    if kind == "float":
        value = float(value)
    elif kind == "strs":
        value = tuple(value)  # tuples keep the frozen config hashable and immutable
    if bounds.choices and value not in bounds.choices:
        raise ConfigError(f"config: {qualname} = {show(value)} is not {allowed}", qualname)
    if bounds.lo is not None and not _in_range(value, bounds):
        raise ConfigError(f"config: {qualname} = {show(value)} is out of range: must be {allowed}", qualname)
    return value


def check_section(obj: Any, section: str) -> None:
    """Validate every field of a frozen section dataclass in place (called from __post_init__)."""
    cls: type = type(obj)
    for key, (kind, bounds) in field_specs(cls).items():
        value = check_value(f"{section}.{key}", kind, bounds, getattr(obj, key))
        object.__setattr__(obj, key, value)  # frozen: normalising needs the low-level setter
