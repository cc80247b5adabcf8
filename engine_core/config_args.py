"""Config dataclasses filled from YAML `args:`: the two checks every engine config needs.

YAML hands over whatever it parsed, and Ray Serve passes `args:` through untouched, so an engine config built from
it must refuse unknown keys (a misspelled key would otherwise be silently ignored) and wrong scalar types ("8" for
an int, 1 for a bool). Ints are accepted for floats. Used by `sammie.engine.EngineConfig` and
`qwen_engine.engine.QwenEngineConfig`.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

C = TypeVar("C")


def from_args(cls: type[C], args: Mapping[str, Any] | None) -> C:
    """`cls(**args)` after refusing keys that are not fields of `cls`, listing the valid ones."""
    args = dict(args or {})
    valid = [f.name for f in fields(cls)]
    unknown = sorted(set(args) - set(valid))
    if unknown:
        raise ValueError(f"unknown {cls.__name__} key(s) {unknown}; valid keys: {valid}")
    return cls(**args)


def check_field_types(cfg: Any) -> None:
    """Raise ValueError naming the first field whose value does not match its annotation (scalars, `X | None`,
    and bare container types such as `tuple`)."""
    hints = typing.get_type_hints(type(cfg))
    for f in fields(cfg):
        value, allowed = getattr(cfg, f.name), typing.get_args(hints[f.name]) or (hints[f.name],)
        if value is None and type(None) in allowed:
            continue
        ok = any(
            (t is float and isinstance(value, (int, float)) and not isinstance(value, bool))
            or (t is int and isinstance(value, int) and not isinstance(value, bool))
            or (t not in (int, float) and t is not type(None) and isinstance(value, t))
            for t in allowed
        )
        if not ok:
            names = " | ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{type(cfg).__name__}.{f.name} must be {names}, got {value!r}")
