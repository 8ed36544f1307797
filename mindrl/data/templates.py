"""Chat templates by name (`prompt_type`), loaded from configs/model/templates.json: each turns (system, user prompt[,
assistant response]) into the exact text the model was tuned on."""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

# The repo's templates file; an installed (editable) mindrl finds it next to the package.
DEFAULT_TEMPLATES_PATH = str(Path(__file__).resolve().parents[2] / "configs" / "model" / "templates.json")
_SLOTS = ("prefix", "system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    """One chat format. Slots hold literal text with {content}, {bos_token} and {eos_token} placeholders."""

    name: str
    user: str
    system: str = ""
    prefix: str = ""
    assistant: str = "{content}"
    default_system: str = ""
    stop_words: tuple[str, ...] = field(default_factory=tuple)
    description: str = ""
    thought_words: tuple[str, ...] = field(default_factory=tuple)
    """A reasoning model's (open, close) thought markers (Qwen3: <think>, </think>), or () for none. With them the
    template works as MindSpeed-RL's ReasoningTemplate with thinking off (what its prompt and SFT handlers use):
    thoughts are removed from responses, and a prompt whose response has no thought ends with an empty one."""

    def render_prompt(
        self, prompt: str, system: str = "", bos_token: str = "", eos_token: str = "", response: str = ""
    ) -> str:
        """The prompt text up to where the model starts answering. An empty `system` means the default; `response`
        (the row's reference answer or SFT target) matters only to a reasoning template (`thought_words`)."""
        system = system or self.default_system
        text = fill_slot(self.prefix, "", bos_token, eos_token)
        if system:
            text += fill_slot(self.system, system, bos_token, eos_token)
        text += fill_slot(self.user, prompt, bos_token, eos_token)
        if self.thought_words and not any(w in self.remove_thought(response) for w in self.thought_words):
            text += self.empty_thought
        return text

    def render_response(self, response: str, bos_token: str = "", eos_token: str = "") -> str:
        """The assistant turn that follows `render_prompt`, end-of-turn marker included (and any thought removed,
        for a reasoning template)."""
        return fill_slot(self.assistant, self.remove_thought(response), bos_token, eos_token)

    @property
    def empty_thought(self) -> str:
        """The thought a reasoning template opens the answer with when thinking is off ('' without thought words)."""
        return f"{self.thought_words[0]}\n\n{self.thought_words[1]}\n\n" if self.thought_words else ""

    def remove_thought(self, text: str) -> str:
        """`text` without its complete thoughts (open ... close) and the newlines that then lead it."""
        if not self.thought_words:
            return text
        pattern = re.escape(self.thought_words[0]) + ".*?" + re.escape(self.thought_words[1])
        return re.sub(pattern, "", text, flags=re.DOTALL).lstrip("\n")


def fill_slot(slot: str, content: str, bos_token: str, eos_token: str) -> str:
    """A template slot with its placeholders filled."""
    # str.replace rather than str.format: templates and prompts are full of literal braces (\boxed{}).
    # Content goes in last so that a prompt containing "{eos_token}" stays literal text.
    return slot.replace("{bos_token}", bos_token).replace("{eos_token}", eos_token).replace("{content}", content)


class UnknownTemplateError(ValueError):
    pass


@lru_cache(maxsize=8)
def load_templates(path: str = DEFAULT_TEMPLATES_PATH) -> dict[str, ChatTemplate]:
    """Parse a templates file: a JSON object {name: {slot: text, ...}}; keys starting with '_' are comments."""
    with open(path, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from e
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e.reason})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object mapping template names to templates")
    known = {f for f in ChatTemplate.__dataclass_fields__ if f != "name"}
    out: dict[str, ChatTemplate] = {}
    for name, spec in raw.items():
        if name.startswith("_"):
            continue
        if not isinstance(spec, dict) or "user" not in spec:
            raise ValueError(f"{path}: template '{name}' must be an object with at least a 'user' slot")
        extra = sorted(set(spec) - known)
        if extra:
            raise ValueError(f"{path}: template '{name}' has unknown field(s) {extra}; known: {sorted(known)}")
        for key, value in spec.items():
            if key == "stop_words":
                ok, want = isinstance(value, list) and all(isinstance(w, str) for w in value), "a list of strings"
            elif key == "thought_words":
                ok = isinstance(value, list) and len(value) == 2 and all(isinstance(w, str) and w for w in value)
                want = "a list of two non-empty strings (open, close)"
            else:
                ok, want = isinstance(value, str), "a string"
            if not ok:
                raise ValueError(f"{path}: template '{name}' field '{key}' must be {want}, got {value!r}")
        for slot in _SLOTS:
            if slot in spec and slot != "prefix" and slot != "assistant" and "{content}" not in spec[slot]:
                raise ValueError(f"{path}: template '{name}' slot '{slot}' lacks the {{content}} placeholder")
        spec = dict(spec)
        spec["stop_words"] = tuple(spec.get("stop_words", ()))
        spec["thought_words"] = tuple(spec.get("thought_words", ()))
        out[name] = ChatTemplate(name=name, **spec)
    return out


def get_template(name: str, path: str | None = None) -> ChatTemplate:
    """The template called `name`; an unknown name lists the known ones and the close matches."""
    path = path or DEFAULT_TEMPLATES_PATH
    if not os.path.isfile(path):
        raise FileNotFoundError(f"templates file not found: {path}")
    templates = load_templates(path)
    if name not in templates:
        close = difflib.get_close_matches(name, templates, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownTemplateError(
            f"unknown prompt_type '{name}' (templates file {path}).{hint} Known: {', '.join(sorted(templates))}"
        )
    return templates[name]
