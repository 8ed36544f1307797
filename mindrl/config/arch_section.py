"""The architecture of an offline (DPO) config: the model file `megatron_training.model` names, from the defaults list
or <config_dir>/model/NAME.yaml, with the architecture keys written in megatron_training over it (MindSpeed's merge)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mindrl.config.errors import Collector
from mindrl.config.loader import _ModelFiles
from mindrl.config.megatron import MEGATRON_IGNORED, MEGATRON_UNSUPPORTED, megatron_key_kind
from mindrl.config.model import ModelArchConfig
from mindrl.config.section import check_neutral


def split_arch_keys(section: Mapping, schema: type) -> tuple[dict, dict]:
    """(the section without its architecture keys, those keys): a key the schema does not know that names a
    field of the model file (qk_layernorm, norm_epsilon, ...) describes the architecture."""
    own, arch = {}, {}
    known = set(schema.field_names()) | set(schema.IGNORED) | set(schema.UNSUPPORTED)
    for key, value in section.items():
        k = str(key).replace("-", "_")
        (arch if k not in known and megatron_key_kind(k) == "arch" else own)[key] = value
    return own, arch


def read_arch(
    name: str, composed: Any, arch_keys: Mapping, config_dir: str, col: Collector, source: str
) -> ModelArchConfig | None:
    """The architecture `name` describes (None without a name: the run builds what `load` holds, and only the plan
    needs one), every key of its model file sorted as mindrl-train sorts it."""
    if not name:
        for key in arch_keys:
            col.ignore(
                f"megatron_training.{key}", "no megatron_training.model names an architecture for it to describe"
            )
        return None
    files = _ModelFiles(composed, config_dir, col, source)
    data = files.get(name, "megatron_training.model")
    if data is None:
        return None
    prefix = f"model.{name}"
    values: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key).replace("-", "_")
        path, kind = f"{prefix}.{key}", megatron_key_kind(key)
        if kind == "arch":
            ModelArchConfig.classify(key, value, col, path)  # lists the architecture's ignored fields
            ok, converted = ModelArchConfig.check_value(key, value, col, path)
            if ok:
                values[key] = converted
        elif kind == "ignored":
            col.ignore(path, MEGATRON_IGNORED[key])
        elif kind == "unsupported":
            check_neutral(value, MEGATRON_UNSUPPORTED[key], col, path)
        else:
            where = "put it in megatron_training" if kind != "unknown" else "unknown key"
            col.add(path, f"is not an architecture key of a model file ({where})")
    for key, value in arch_keys.items():
        key = str(key).replace("-", "_")
        ModelArchConfig.classify(key, value, col, f"megatron_training.{key}")
        ok, converted = ModelArchConfig.check_value(key, value, col, f"megatron_training.{key}")
        if ok:
            values[key] = converted  # megatron_training's value wins, as in MindSpeed's merge
    with col.scope(prefix):
        return ModelArchConfig(name=name, **values)
