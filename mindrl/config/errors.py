"""Config problems: `ConfigError` and the collector that gathers every problem of one load, so a user sees
all of them at once, each naming the key, the file it came from and, for typos, the close matches."""

from __future__ import annotations

import contextlib
import contextvars
import difflib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Issue:
    """One problem: `key` is the dotted path as written (e.g. "rl_config.epochs"), `source` the file (or the
    command-line override) it came from."""

    key: str
    message: str
    source: str = ""

    def __str__(self) -> str:
        where = f" [{self.source}]" if self.source else ""
        return f"{self.key}: {self.message}{where}"


class ConfigError(ValueError):
    """The config cannot be used. `issues` lists every problem found; the message shows them all."""

    def __init__(self, issues: Iterable[Issue] | str, config: str = "") -> None:
        if isinstance(issues, str):
            issues = [Issue("config", issues, config)]
        self.issues: list[Issue] = list(issues)
        self.config = config
        super().__init__(self._format())

    def _format(self) -> str:
        if len(self.issues) == 1:
            return str(self.issues[0])
        head = f"{len(self.issues)} problems in config {self.config!r}:" if self.config else "config problems:"
        return "\n".join([head, *(f"  - {i}" for i in self.issues)])


def close_matches(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Known names that look like `name` (difflib, cutoff 0.6), best first."""
    return difflib.get_close_matches(name, sorted(set(candidates)), n=n, cutoff=0.6)


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """'; did you mean 'a' or 'b'?' or '' (for appending to an 'unknown ...' message)."""
    matches = close_matches(name, candidates)
    if not matches:
        return ""
    return "; did you mean " + " or ".join(repr(m) for m in matches) + "?"


@dataclass
class Collector:
    """Gathers issues and ignored keys during one load.

    provenance maps an effective key path to (the path as written, the file it came from), so that a value
    inherited from another section (megatron_training.lr used by actor_config) is reported where it was written.
    """

    default_source: str = ""
    provenance: dict[str, tuple[str, str]] = field(default_factory=dict)
    issues: list[Issue] = field(default_factory=list)
    ignored: dict[str, str] = field(default_factory=dict)
    """Ignored key path -> why it has no effect (insertion-ordered, each key once)."""
    bad_keys: set[str] = field(default_factory=set)
    """Keys with a type/value problem: cross-section checks that read them are skipped (no follow-on noise)."""
    notes: list[str] = field(default_factory=list)
    """Warnings worth a log line (a legal config that behaves differently from what it may suggest)."""
    prefix: str = ""

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)

    def where(self, key: str) -> tuple[str, str]:
        written, source = self.provenance.get(key, (key, ""))
        if not source:
            # a nested key (a.b.c) inherits its section's provenance
            parts = key.split(".")
            for i in range(len(parts) - 1, 0, -1):
                parent = ".".join(parts[:i])
                if parent in self.provenance:
                    p_written, source = self.provenance[parent]
                    written = p_written + key[len(parent) :] if written == key else written
                    break
        return written, source or self.default_source

    def add(self, key: str, message: str) -> None:
        """Record a problem with `key` (a path relative to the current prefix, or absolute if it has a dot
        and starts with a known section)."""
        path = self.qualify(key)
        written, source = self.where(path)
        if written != path:
            message = f"{message} (the value comes from {written}, used for {path})"
            path = written
        self.bad_keys.add(self.qualify(key))
        issue = Issue(path, message, source)
        if issue not in self.issues:
            self.issues.append(issue)

    def ignore(self, key: str, reason: str) -> None:
        self.ignored.setdefault(self.qualify(key), reason)

    def qualify(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix and not key.startswith(self.prefix + ".") else key

    def is_bad(self, *keys: str) -> bool:
        return any(self.qualify(k) in self.bad_keys or k in self.bad_keys for k in keys)

    @contextlib.contextmanager
    def scope(self, prefix: str) -> Iterator[Collector]:
        old = self.prefix
        self.prefix = prefix
        try:
            yield self
        finally:
            self.prefix = old

    def raise_if_any(self, config: str = "") -> None:
        if self.issues:
            raise ConfigError(self.issues, config)


_CURRENT: contextvars.ContextVar[Collector | None] = contextvars.ContextVar("mindrl_config_collector", default=None)


def current_collector() -> Collector | None:
    """The collector of the load in progress, or None (sections constructed directly raise at once)."""
    return _CURRENT.get()


@contextlib.contextmanager
def collecting(collector: Collector) -> Iterator[Collector]:
    """Within the block, sections report problems to `collector` instead of raising."""
    token = _CURRENT.set(collector)
    try:
        yield collector
    finally:
        _CURRENT.reset(token)
