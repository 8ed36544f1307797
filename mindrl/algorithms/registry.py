"""Name -> function registries so configs select algorithms by string.
Unknown names fail with the known names and the closest matches."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
    """A named table of functions, filled by the `register(name)` decorator."""

    def __init__(self, kind: str, config_key: str):
        self.kind = kind
        self.config_key = config_key
        self._table: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            if name in self._table and self._table[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered to {self._table[name].__qualname__}")
            self._table[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> Callable:
        if not isinstance(name, str) or name not in self._table:
            raise ValueError(unknown_name_message(self.kind, self.config_key, name, self._table))
        return self._table[name]

    def names(self) -> list[str]:
        return sorted(self._table)


def unknown_name_message(kind: str, config_key: str, name: object, known: object) -> str:
    known_names = sorted(known)
    close = difflib.get_close_matches(str(name), known_names, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    return f"unknown {kind} {name!r} (from {config_key}); known: {', '.join(known_names)}{hint}"
