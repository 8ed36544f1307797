"""The base of every config section: a dataclass whose field types are checked on construction, whose `validate` rejects
bad combinations, and whose `from_dict` sorts a YAML mapping into known, ignored, unsupported and unknown keys."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Union

from mindrl.config.errors import Collector, current_collector, did_you_mean


def ignored_field(default: Any, reason: str) -> Any:
    """A field kept for MindSpeed-RL compatibility whose value has no effect in mindrl: writing it in a YAML
    lists it among the ignored keys (with `reason` in the docs), but it stays readable as an attribute."""
    return dataclasses.field(default=default, metadata={"ignored": reason})


# ------------------------------------------------------------------------------------------------ types
def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        parts = [_describe(a) for a in args if a is not type(None)]
        text = " or ".join(parts)
        return text + " or null" if type(None) in args else text
    if origin is list:
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    if origin is dict:
        return "a mapping"
    if isinstance(hint, type) and issubclass(hint, Section):
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def coerce(value: Any, hint: Any) -> tuple[bool, Any]:
    """(ok, value converted to `hint`). Ints are accepted for floats; bools are never numbers; nothing is
    parsed from strings (a quoted "2" for an int is a mistake worth reporting)."""
    if hint is Any:
        return True, value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None:
            return type(None) in args, None
        for arg in args:
            if arg is type(None):
                continue
            ok, converted = coerce(value, arg)
            if ok:
                return True, converted
        return False, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if hint is str:
        return isinstance(value, str), value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return False, value
        out = []
        for item in value:
            ok, converted = coerce(item, args[0] if args else Any)
            if not ok:
                return False, value
            out.append(converted)
        return True, out
    if origin is dict:
        if not isinstance(value, Mapping):
            return False, value
        out_d = {}
        for k, v in value.items():
            ok_k, k2 = coerce(k, args[0] if args else Any)
            ok_v, v2 = coerce(v, args[1] if args else Any)
            if not (ok_k and ok_v):
                return False, value
            out_d[k2] = v2
        return True, out_d
    if isinstance(hint, type) and issubclass(hint, Section):
        return isinstance(value, (hint, Mapping)), value
    return isinstance(value, hint) if isinstance(hint, type) else True, value


def _same(value: Any, neutral: Any) -> bool:
    """YAML equality without Python's True == 1 (a neutral `false` is not matched by `0`, nor the reverse)."""
    if neutral is None or value is None:
        return value is neutral
    if isinstance(neutral, bool) or isinstance(value, bool):
        return type(value) is type(neutral) and value == neutral
    return value == neutral


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def section_type(hint: Any) -> type[Section] | None:
    """The Section class inside `hint` (X or X | None), if any."""
    for arg in (hint, *typing.get_args(hint)):
        if isinstance(arg, type) and issubclass(arg, Section):
            return arg
    return None


def check_neutral(value: Any, rule: tuple[tuple[Any, ...], str], col: Collector, path: str) -> bool:
    """An UNSUPPORTED key: with a neutral value it is listed as ignored (True); any other value is reported."""
    neutral, what = rule
    if any(_same(value, n) for n in neutral):
        col.ignore(path, f"{what} is not supported; its neutral value is accepted")
        return True
    allowed = " or ".join("null" if n is None else repr(n) for n in neutral)
    col.add(path, f"{value!r} is not supported by mindrl ({what}); remove it or set it to {allowed}")
    return False


# ------------------------------------------------------------------------------------------------ base
class Section:
    """Mixin for config dataclasses. Subclasses are `@dataclass`es that set:

    SECTION: the key path of the section (e.g. "rl_config"), used in messages when built directly.
    IGNORED: MindSpeed-RL keys accepted with any value and reported as having no effect, key -> reason.
    UNSUPPORTED: MindSpeed-RL keys accepted only with a neutral value, key -> (neutral values, what the key
        would turn on); any other value is an error rather than a silently different run.
    """

    SECTION: ClassVar[str] = ""
    IGNORED: ClassVar[Mapping[str, str]] = {}
    UNSUPPORTED: ClassVar[Mapping[str, tuple[tuple[Any, ...], str]]] = {}

    def __post_init__(self) -> None:
        col = current_collector()
        own = col is None
        if col is None:
            col = Collector()
        with col.scope(col.prefix or self.SECTION):
            self._check_types(col)
            self.validate(col)
        if own:
            col.raise_if_any()

    # -- hooks ----------------------------------------------------------------------------------------
    def validate(self, col: Collector) -> None:
        """Report bad values and combinations with `col.add(key, message)`; override in subclasses."""

    @classmethod
    def normalize(cls, key: str, value: Any) -> Any:
        """Convert accepted shorthand before type checking (e.g. one name for a list of names)."""
        return value

    # -- helpers --------------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]

    @classmethod
    def known_keys(cls) -> set[str]:
        return set(cls.field_names()) | set(cls.IGNORED) | set(cls.UNSUPPORTED)

    def _check_types(self, col: Collector) -> None:
        hints = field_types(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if not f.init:
                continue
            value = self.normalize(f.name, getattr(self, f.name))
            hint = hints[f.name]
            ok, converted = coerce(value, hint)
            if not ok:
                col.add(f.name, f"expected {_describe(hint)}, got {_show(value)}")
                converted = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            sub = section_type(hint)
            if sub is not None and isinstance(converted, Mapping):
                with col.scope(f"{col.prefix}.{f.name}" if col.prefix else f.name):
                    converted = sub.from_dict(converted, col.prefix, col)
            object.__setattr__(self, f.name, converted)

    @classmethod
    def check_value(cls, key: str, value: Any, col: Collector, path: str) -> tuple[bool, Any]:
        """Type-check one YAML value for field `key`; report under `path` (the key as written)."""
        hint = field_types(cls)[key]
        value = cls.normalize(key, value)
        ok, converted = coerce(value, hint)
        if not ok:
            col.add(path, f"expected {_describe(hint)}, got {_show(value)}")
        return ok, converted

    @classmethod
    def classify(cls, key: str, value: Any, col: Collector, path: str) -> str:
        """'field', 'ignored', 'unsupported' (neutral value: also ignored), 'bad' (reported) or 'unknown'."""
        if key in cls.field_names():
            f = next(f for f in dataclasses.fields(cls) if f.name == key)  # type: ignore[arg-type]
            if "ignored" in f.metadata:
                col.ignore(path, f.metadata["ignored"])
            return "field"
        if key in cls.IGNORED:
            col.ignore(path, cls.IGNORED[key])
            return "ignored"
        if key in cls.UNSUPPORTED:
            return "unsupported" if check_neutral(value, cls.UNSUPPORTED[key], col, path) else "bad"
        return "unknown"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, prefix: str, col: Collector) -> Any:
        """Build the section from a YAML mapping, reporting unknown keys (with close matches), type errors and
        unsupported values to `col`; a bad value falls back to the field's default so checking can go on."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            col.add(prefix, f"expected a mapping of keys, got {_show(data)}")
            data = {}
        kwargs: dict[str, Any] = {}
        hints = field_types(cls)
        for key, value in data.items():
            key = str(key).replace("-", "_")  # MindSpeed-RL accepts dashed names too
            path = f"{prefix}.{key}"
            kind = cls.classify(key, value, col, path)
            if kind == "unknown":
                col.add(path, "unknown key" + did_you_mean(key, cls.known_keys()))
            elif kind == "field":
                sub = section_type(hints[key])
                if sub is not None and isinstance(value, Mapping):
                    kwargs[key] = sub.from_dict(value, path, col)
                    continue
                if sub is not None and value is None and sub is hints[key]:
                    continue  # an empty section (`integrated_mode_config:`) means its defaults
                ok, converted = cls.check_value(key, value, col, path)
                if ok:
                    kwargs[key] = converted
        with col.scope(prefix):
            return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of the fields (for logging)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]
