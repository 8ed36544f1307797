"""The driver's HF tokenizer, loaded through the class its tokenizer_config.json names: AutoTokenizer's choice without
AutoTokenizer's import of transformers' model classes (docs/performance.md, "Memory footprint")."""

from __future__ import annotations

import json
import os
from typing import Any


def named_tokenizer_class(path: str) -> type | None:
    """The tokenizer class `path`/tokenizer_config.json names (``tokenizer_class``, or without its "Fast" suffix, as
    transformers 5 names its classes), as transformers exports it; None when the file names none, names one that
    transformers does not export, or maps the tokenizer to remote code (``auto_map``)."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if not isinstance(name, str) or not name or "auto_map" in config:
        return None
    import transformers  # lazy: only the named class's module is imported

    for candidate in dict.fromkeys((name, name.removesuffix("Fast"))):
        try:
            cls = getattr(transformers, candidate)
        except (AttributeError, ImportError):
            continue
        if isinstance(cls, type) and hasattr(cls, "from_pretrained"):
            return cls
    return None


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the HF dir `path`. By the class tokenizer_config.json names when transformers has it (the class
    AutoTokenizer resolves for the same file: tests/data/test_tokenizer.py), so the process never imports
    transformers' auto model classes, which pull in torch._dynamo and sympy (~0.18 GiB); AutoTokenizer otherwise."""
    cls = named_tokenizer_class(path)
    if cls is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return cls.from_pretrained(path)
