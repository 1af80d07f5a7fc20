"""A tiny name → function registry, so configs are validated against what actually exists.

Every algorithmic choice of the StarPO step (advantage estimator, policy loss, KL estimator, loss
aggregation, SNR filter strategy, group score, ...) lives in one ``Registry``. A config string is
resolved with ``REGISTRY.get(name)``; an unknown name raises ``ValueError`` naming the registry, the
bad key and every allowed value, so a typo fails at config time instead of deep inside ``jit``.

    ADVANTAGE_ESTIMATORS = Registry("advantage estimator")

    @ADVANTAGE_ESTIMATORS.register("gae")
    def gae(...): ...

    fn = ADVANTAGE_ESTIMATORS.get(config.adv_estimator)
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects (usually pure functions); insertion order is kept for ``names()``."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, *aliases: str) -> Callable[[T], T]:
        """Decorator registering ``fn`` under ``name`` (and optional aliases); returns ``fn`` unchanged."""

        def decorator(obj: T) -> T:
            for key in (name, *aliases):
                self.add(key, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        """Registers ``obj`` under ``name``; a duplicate name is an error (two things, one name)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}.")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered; pick another name.")
        self._entries[name] = obj

    def get(self, name: str) -> T:
        """Returns the object registered as ``name``; raises ``ValueError`` listing allowed names."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"Unknown {self.kind} {name!r}. Allowed values: {', '.join(map(repr, self.names()))}."
            ) from None

    def validate(self, name: str) -> str:
        """Returns ``name`` if registered, else raises the same ``ValueError`` as ``get``."""
        self.get(name)
        return name

    def remove(self, name: str) -> T:
        """Unregisters ``name`` and returns its object (a test that registers its own entry cleans up)."""
        self.get(name)
        return self._entries.pop(name)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
