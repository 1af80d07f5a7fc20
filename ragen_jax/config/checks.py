"""The one family of config validators every section uses: keys, ints, numbers, choices.

Each raises ``ValueError`` with the key as the user writes it and the value, then what is allowed
(``trainer.save_every=0: save_every must be an int >= 1``); ``resolve`` turns it into a ``ConfigError``.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, ClassVar, Mapping


def check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_keys(section: str, values: Mapping[str, Any], allowed) -> None:
    """Raise ``ValueError`` naming the first key of ``values`` not in ``allowed`` (with a close match)."""
    allowed = list(allowed)
    for key in values:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean {section}.{close[0]}?" if close else ""
            raise ValueError(f"unknown key {section}.{key}; allowed: {', '.join(allowed)}{hint}")


def check_int(section: str, name: str, value: Any, minimum: int) -> None:
    """``section.name`` is an int (not a bool) ``>= minimum``."""
    check(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
          f"{section}.{name}={value!r}: {name} must be an int >= {minimum}")


def check_number(section: str, name: str, value: Any, minimum: float = 0.0, maximum: float | None = None, *,
                 strict: bool = False, what: str = "") -> None:
    """``section.name`` is a number (not a bool) ``>= minimum`` (``>`` when ``strict``), ``<= maximum``;
    ``what`` explains the special values (`` (0 = never)``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > minimum if strict else value >= minimum) and (maximum is None or value <= maximum)
    bound = f"in [{minimum}, {maximum}]" if maximum is not None else f"{'>' if strict else '>='} {minimum}"
    check(ok, f"{section}.{name}={value!r}: {name} must be a number {bound}{what}")


def check_choice(key: str, value: Any, allowed) -> None:
    """``value`` is one of ``allowed``."""
    check(value in allowed, f"{key}={value!r} is not valid; allowed: {', '.join(map(str, allowed))}")


def section_from_dict(cls, section: str, values: Any):
    """``cls(**values)`` for a config section, with a clear error for keys the dataclass lacks."""
    if hasattr(values, "to_dict"):  # ml_collections.ConfigDict
        values = values.to_dict()
    if not isinstance(values, Mapping):
        raise ValueError(f"config.{section} must be a mapping of keys to values, got {type(values).__name__}.")
    check_keys(section, values, [f.name for f in dataclasses.fields(cls)])
    return cls(**dict(values))


def field_defaults(cls) -> dict[str, Any]:
    """A config dataclass's keys at their defaults (fields without one are left out)."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
    return values


class Section:
    """Base of every config section's frozen dataclass: ``KEY`` is the section's name in the config
    (``"starpo"``), ``from_dict`` builds it from a mapping (a ``ConfigDict`` included) with the
    unknown-key check of ``section_from_dict``; the dataclass's ``__post_init__`` checks the values."""

    KEY: ClassVar[str]

    @classmethod
    def from_dict(cls, values: Any):
        return section_from_dict(cls, cls.KEY, values)
