"""`load_config`: compose a MindSpeed-RL-style YAML with hydra, apply `key=value` overrides, sort every key into its
typed section and validate the run once (per role: model file < megatron_training < actor_config/critic_config)."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mindrl.config.errors import Collector, ConfigError, Issue, collecting, did_you_mean
from mindrl.config.generate import GenerateConfig
from mindrl.config.megatron import (
    MEGATRON_IGNORED,
    MEGATRON_UNSUPPORTED,
    MegatronTrainingConfig,
    RoleConfig,
    megatron_key_kind,
    megatron_keys,
)
from mindrl.config.model import ModelArchConfig
from mindrl.config.profiler import ProfilerConfig
from mindrl.config.rl import RLSectionConfig
from mindrl.config.root import ForwardRoleConfig, RLConfig
from mindrl.config.section import Section, check_neutral, field_types, section_type

logger = logging.getLogger("mindrl.config")

MEGATRON_SECTIONS = ("megatron_training", "actor_config", "critic_config", "reward_config")
SECTIONS: dict[str, type[Section]] = {
    "rl_config": RLSectionConfig,
    "generate_config": GenerateConfig,
    "profiler_config": ProfilerConfig,
}
IGNORED_SECTIONS = {"msprobe_config": "MindStudio msprobe data dumps (Ascend)"}
FORBIDDEN_SECTIONS = ("ref_config",)
TOP_LEVEL = {*MEGATRON_SECTIONS, *SECTIONS, "model", *IGNORED_SECTIONS, *FORBIDDEN_SECTIONS}


def default_config_dir() -> str:
    """The repo's configs/ (next to the mindrl package), else ./configs."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    candidate = os.path.join(repo, "configs")
    return candidate if os.path.isdir(candidate) else os.path.abspath("configs")


def load_config(
    config_name: str,
    config_path: str | None = None,
    overrides: Sequence[str] = (),
    checks: Sequence[Callable[[RLConfig, Collector], None]] = (),
) -> RLConfig:
    """Load, merge and validate a config; raise one ConfigError listing every problem.

    config_name: NAME of <config_path>/NAME.yaml (".yaml" optional), or a path to a YAML file.
    config_path: the folder of configs, with model files in <config_path>/model/NAME.yaml; None: the repo's
        configs/ directory. A MindSpeed-RL configs/ folder loads unchanged.
    overrides: hydra-style "rl_config.epochs=2", "+rl_config.use_kl_in_reward=true", "~key". A plain override of
        a schema key the YAML leaves out is added (no "+" needed); an unknown key is an error.
    checks: further checks of the built config that report to the same collector, so one ConfigError lists
        their problems with the rest (mindrl.preflight's checks of checkpoints, dataset, tokenizer and env file).
    """
    config_dir, name = _locate(config_name, config_path)
    source = os.path.join(config_dir, name + ".yaml")
    raw, provenance, issues = _compose(config_dir, name, list(overrides), source)
    col = Collector(default_source=source, provenance=provenance, issues=issues)
    with collecting(col):
        cfg = _build(raw, col, config_dir, name, source)
        for check in checks:
            check(cfg, col)
    col.raise_if_any(name)
    cfg.ignored_keys = list(col.ignored)
    if cfg.ignored_keys:
        logger.warning(
            "%s: %d MindSpeed-RL keys have no effect in mindrl and are ignored (see docs/config.md): %s",
            source, len(cfg.ignored_keys), ", ".join(cfg.ignored_keys),
        )  # fmt: skip
    for note in col.notes:
        logger.warning("%s: %s", source, note)
    return cfg


# ---------------------------------------------------------------------------------------------- locate
def config_stage(config_name: str, config_path: str | None = None, overrides: Sequence[str] = ()) -> str | None:
    """`megatron_training.stage` as the YAML file (or a `megatron_training.stage=...` override) writes it, before any
    schema is chosen: 'dpo' selects mindrl-train-dpo's (`mindrl.config.dpo`). None when the file cannot be read (the
    loader then reports why)."""
    from omegaconf import OmegaConf
    from yaml import YAMLError

    for text in reversed(list(overrides)):
        key, _, value = text.lstrip("+").partition("=")
        if key == "megatron_training.stage":
            return value.strip("'\"")
    try:
        config_dir, name = _locate(config_name, config_path)
        raw = OmegaConf.to_container(OmegaConf.load(os.path.join(config_dir, name + ".yaml")))
    except (ConfigError, OSError, ValueError, YAMLError):  # the loader reports it with its own message
        return None
    section = raw.get("megatron_training") if isinstance(raw, dict) else None
    stage = section.get("stage") if isinstance(section, dict) else None
    return stage if isinstance(stage, str) else None


def _locate(config_name: str, config_path: str | None) -> tuple[str, str]:
    name = config_name
    if config_path is None and (os.sep in name or name.endswith((".yaml", ".yml"))) and os.path.isfile(name):
        config_path, name = os.path.dirname(os.path.abspath(name)) or ".", os.path.basename(name)
    for ext in (".yaml", ".yml"):
        name = name.removesuffix(ext)
    config_dir = os.path.abspath(config_path) if config_path is not None else default_config_dir()
    if not os.path.isdir(config_dir):
        raise ConfigError([Issue("config_path", f"config directory {config_dir!r} does not exist", config_dir)])
    if not os.path.isfile(os.path.join(config_dir, name + ".yaml")):
        available = sorted(f[:-5] for f in os.listdir(config_dir) if f.endswith(".yaml"))
        hint = did_you_mean(name, available) or (f"; available: {', '.join(available)}" if available else "")
        raise ConfigError([Issue("config_name", f"no config {name!r} in {config_dir}{hint}", config_dir)])
    return config_dir, name


# ---------------------------------------------------------------------------------------------- compose
@dataclass
class _Override:
    text: str
    key: str
    kind: str  # "", "+", "++", "~"


def _parse_overrides(overrides: list[str]) -> list[_Override]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out, issues = [], []
    for text in overrides:
        try:
            (ov,) = parser.parse_overrides([text])
        except HydraException as e:
            issues.append(
                Issue(text.split("=", 1)[0].lstrip("+~"), f"bad override {text!r}: {e}".strip(), "command line")
            )
            continue
        kind = {OverrideType.ADD: "+", OverrideType.FORCE_ADD: "++", OverrideType.DEL: "~"}.get(ov.type, "")
        out.append(_Override(text, ov.key_or_group, kind))
    if issues:
        raise ConfigError(issues)
    return out


def _schema_children(path: list[str]) -> set[str] | None:
    """Keys the schema accepts under `path` (e.g. ["rl_config", "actor_resource"]); None: anything goes."""
    if not path:
        return set(TOP_LEVEL)
    head, rest = path[0], path[1:]
    if head in MEGATRON_SECTIONS:
        return megatron_keys() if not rest else None
    if head == "model":
        return None if not rest else (megatron_keys() if len(rest) == 1 else None)
    cls: Any = SECTIONS.get(head)
    if cls is None:
        return None
    for part in rest:
        if part not in cls.field_names():
            return None
        cls = section_type(field_types(cls)[part])
        if cls is None:
            return None
    return cls.known_keys()


def _compose(config_dir: str, name: str, overrides: list[str], source: str) -> tuple[dict, dict, list[Issue]]:
    """(the composed config as a plain dict, provenance of override keys, unknown override keys). Overrides of
    unknown keys are left out so that the rest of the config is still checked."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf import OmegaConf

    parsed = _parse_overrides(overrides)
    provenance: dict[str, tuple[str, str]] = {}
    issues: list[Issue] = []
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with warnings.catch_warnings():
        # MindSpeed-RL's configs have no `_self_` in their defaults list; hydra then (rightly) lets the
        # primary config override its defaults, which is what we want, so its warning is noise.
        warnings.filterwarnings("ignore", message=".*_self_.*")
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            try:
                base = compose(config_name=name)
            except MissingConfigException as e:
                raise ConfigError([Issue("defaults", _missing_model_message(e, config_dir), source)], name) from None
            except HydraException as e:
                raise ConfigError([Issue("defaults", f"cannot compose the config: {e}", source)], name) from None
            if not parsed:
                return _plain(base), provenance, issues
            fixed = []
            for ov in parsed:
                where = f"override {ov.text!r}"
                provenance[ov.key] = (ov.key, where)
                is_group = os.path.isdir(os.path.join(config_dir, ov.key.split("@")[0]))
                if ov.kind or is_group or OmegaConf.select(base, ov.key, default=_MISSING) is not _MISSING:
                    fixed.append(ov.text)
                    continue
                parts = ov.key.split(".")
                allowed = _schema_children(parts[:-1])
                if allowed is None or parts[-1] in allowed:
                    fixed.append("++" + ov.text)  # a schema key the YAML leaves out: add it
                else:
                    issues.append(Issue(ov.key, "unknown key" + did_you_mean(parts[-1], allowed), where))
            try:
                cfg = compose(config_name=name, overrides=fixed)
            except MissingConfigException as e:
                raise ConfigError(
                    [Issue("defaults", _missing_model_message(e, config_dir), "command line")], name
                ) from None
            except HydraException as e:
                raise ConfigError([Issue("overrides", f"{e}".strip(), "command line")], name) from None
    return _plain(cfg), provenance, issues


_MISSING = object()


def _plain(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(raw, dict)
    raw.pop("hydra", None)
    return raw


def _missing_model_message(e: Exception, config_dir: str) -> str:
    model_dir = os.path.join(config_dir, "model")
    names = sorted(f[:-5] for f in os.listdir(model_dir) if f.endswith(".yaml")) if os.path.isdir(model_dir) else []
    first = str(e).splitlines()[0]
    return f"{first}; model files in {model_dir}: {', '.join(names) or 'none'}"


# ---------------------------------------------------------------------------------------------- build
def _build(raw: dict, col: Collector, config_dir: str, name: str, source: str) -> RLConfig:
    for key, value in raw.items():
        if key in IGNORED_SECTIONS:
            col.ignore(key, IGNORED_SECTIONS[key])
        elif key in FORBIDDEN_SECTIONS:
            col.add(key, "must not be set: in integrated mode the reference shares actor_config "
                    "(MindSpeed-RL's rule too); with use_integrated_worker: false mindrl's reference still takes "
                    "actor_config's layout, on rl_config.reference_resource")  # fmt: skip
        elif key not in TOP_LEVEL:
            col.add(key, "unknown section" + did_you_mean(str(key), TOP_LEVEL))
        elif key != "model" and value is not None and not isinstance(value, Mapping):
            col.add(key, f"expected a mapping of keys, got {value!r}")
    section = {k: (raw.get(k) if isinstance(raw.get(k), Mapping) else {}) for k in (*MEGATRON_SECTIONS, *SECTIONS)}
    rl = RLSectionConfig.from_dict(section["rl_config"], "rl_config", col)
    gen = GenerateConfig.from_dict(section["generate_config"], "generate_config", col)
    prof = ProfilerConfig.from_dict(section["profiler_config"], "profiler_config", col)

    critic_raw: Mapping | None = raw.get("critic_config") if isinstance(raw.get("critic_config"), Mapping) else None
    if critic_raw is not None and not rl.needs_critic:
        col.ignore("critic_config", f"adv_estimator {rl.adv_estimator} uses no critic")
        critic_raw = None
    if critic_raw is None and rl.critic_resource is not None:
        col.ignore("rl_config.critic_resource", "there is no critic")

    reward_raw: Mapping | None = raw.get("reward_config") if isinstance(raw.get("reward_config"), Mapping) else None

    models = _ModelFiles(raw.get("model"), config_dir, col, source)
    merger = _Megatron(col, models)
    merger.classify("megatron_training", section["megatron_training"], source)
    merger.classify("actor_config", section["actor_config"], source)
    if critic_raw is not None:
        merger.classify("critic_config", critic_raw, source)
    if reward_raw is not None:
        merger.classify("reward_config", reward_raw, source)

    mt, actor, arch = merger.build("actor_config")
    assert mt is not None and arch is not None
    critic = critic_arch = None
    if critic_raw is not None:
        _, critic, critic_arch = merger.build("critic_config", actor_globals=merger.last_globals)
    reward = reward_arch = None
    if reward_raw is not None:
        _, reward, reward_arch = merger.build("reward_config", actor_globals=merger.last_globals)
    with col.scope(""):
        return RLConfig(
            megatron_training=mt,
            actor_config=actor,
            critic_config=critic,
            rl_config=rl,
            generate_config=gen,
            profiler_config=prof,
            model=arch,
            critic_model=critic_arch,
            reward_config=reward,
            reward_model=reward_arch,
            source=source,
            config_name=name,
        )


class _ModelFiles:
    """The model files hydra composed (`model: {NAME: {...}}`), plus <config_dir>/model/NAME.yaml on demand."""

    def __init__(self, composed: Any, config_dir: str, col: Collector, source: str) -> None:
        self.col, self.config_dir, self.source = col, config_dir, source
        self.models: dict[str, Mapping] = {}
        if composed is not None and not isinstance(composed, Mapping):
            col.add("model", f"expected model files ({{NAME: {{...}}}}) from the defaults list, got {composed!r}")
        elif composed:
            for key, value in composed.items():
                if isinstance(value, Mapping):
                    self.models[str(key)] = value

    def file(self, name: str) -> str:
        path = os.path.join(self.config_dir, "model", f"{name}.yaml")
        return path if os.path.isfile(path) else f"the model files in the defaults list of {self.source}"

    def get(self, name: str, key: str) -> Mapping | None:
        if name in self.models:
            return self.models[name]
        path = os.path.join(self.config_dir, "model", f"{name}.yaml")
        if os.path.isfile(path):  # named by a role but not in the defaults list: MindSpeed-RL needs it there
            from omegaconf import OmegaConf

            loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
            if isinstance(loaded, Mapping) and isinstance(loaded.get(name), Mapping):
                self.models[name] = loaded[name]
                return self.models[name]
            self.col.add(key, f"{path} must have one top-level key {name!r} holding the architecture")
            return None
        known = sorted(set(self.models) | set(_model_files(self.config_dir)))
        self.col.add(key, f"no model {name!r}: not in the defaults list nor {path}"
                     + (did_you_mean(name, known) or (f"; known: {', '.join(known)}" if known else "")))  # fmt: skip
        return None


def _model_files(config_dir: str) -> list[str]:
    d = os.path.join(config_dir, "model")
    return [f[:-5] for f in os.listdir(d) if f.endswith(".yaml")] if os.path.isdir(d) else []


@dataclass
class _Value:
    value: Any
    path: str  # as written
    source: str


class _Megatron:
    """Classifies the megatron keyspace of each layer once, then merges per role (MindSpeed-RL's rule)."""

    def __init__(self, col: Collector, models: _ModelFiles) -> None:
        self.col, self.models = col, models
        self.layers: dict[str, dict[str, tuple[str, _Value]]] = {}
        self.last_globals: dict[str, _Value] = {}

    def classify(self, prefix: str, data: Mapping, source: str) -> None:
        if prefix in self.layers:
            return
        owners = {"global": MegatronTrainingConfig, "role": RoleConfig, "arch": ModelArchConfig}
        out: dict[str, tuple[str, _Value]] = {}
        for key, value in data.items():
            key = str(key).replace("-", "_")  # MindSpeed-RL accepts dashed names too
            path = f"{prefix}.{key}"
            self.col.provenance.setdefault(path, (path, source))  # overrides keep theirs
            kind = megatron_key_kind(key)
            if kind == "unknown":
                self.col.add(path, "unknown key" + did_you_mean(key, megatron_keys()))
            elif kind == "ignored":
                self.col.ignore(path, MEGATRON_IGNORED[key])
            elif kind == "unsupported":
                check_neutral(value, MEGATRON_UNSUPPORTED[key], self.col, path)
            else:
                if kind == "shared":
                    owner = MegatronTrainingConfig if prefix == "megatron_training" else RoleConfig
                else:
                    owner = owners[kind]
                owner.classify(key, value, self.col, path)  # records ignored_field keys
                ok, converted = owner.check_value(key, value, self.col, path)
                if ok:
                    out[key] = (kind, _Value(converted, path, self.col.provenance[path][1]))
        self.layers[prefix] = out

    def build(
        self, role: str, actor_globals: dict[str, _Value] | None = None
    ) -> tuple[MegatronTrainingConfig | None, RoleConfig, ModelArchConfig | None]:
        """(globals, role, architecture) of `role`; globals only for the actor (the critic's must agree)."""
        col = self.col
        mt_layer, role_layer = self.layers.get("megatron_training", {}), self.layers.get(role, {})
        name_v = (role_layer.get("model") or mt_layer.get("model") or (None, None))[1]
        arch_layer: dict[str, tuple[str, _Value]] = {}
        name = name_v.value if name_v is not None else None
        if name is None:
            col.add(f"{role}.model", "is required: name the model file (configs/model/NAME.yaml) here or in "
                    "megatron_training.model")  # fmt: skip
        else:
            model_prefix = f"model.{name}"
            if model_prefix not in self.layers:
                data = self.models.get(name, name_v.path)
                if data is not None:
                    self.classify(model_prefix, data, self.models.file(name))
            arch_layer = self.layers.get(model_prefix, {})
        merged: dict[str, dict[str, _Value]] = {"global": {}, "role": {}, "arch": {}}
        for layer in (arch_layer, mt_layer, role_layer):  # later layers win
            for key, (kind, v) in layer.items():
                if kind == "shared":  # the role's value; megatron_training keeps its own
                    merged["role"][key] = v
                    if layer is not role_layer:
                        merged["global"][key] = v
                else:
                    merged[kind][key] = v
        prov = col.provenance
        for key, v in merged["role"].items():
            prov.setdefault(v.path, (v.path, v.source))
            prov[f"{role}.{key}"] = (v.path, v.source)
        if actor_globals is None:
            for key, v in merged["global"].items():
                prov.setdefault(v.path, (v.path, v.source))
                prov[f"megatron_training.{key}"] = (v.path, v.source)
        for key, v in merged["arch"].items():
            prov.setdefault(v.path, (v.path, v.source))
            prov[f"model.{name}.{key}"] = (v.path, v.source)
        if actor_globals is not None:  # the critic / reward model read the actor's batches: no disagreement on globals
            for key, (kind, v) in role_layer.items():
                if kind == "global" and key in actor_globals and actor_globals[key].value != v.value:
                    a = actor_globals[key]
                    col.add(v.path, f"{v.value!r} differs from {a.path}={a.value!r}; {role} shares the actor's "
                            f"batches and data, so remove it from {role}")  # fmt: skip
        mt = None
        if actor_globals is None:
            self.last_globals = merged["global"]
            kwargs = {k: v.value for k, v in merged["global"].items()}
            with col.scope("megatron_training"):
                mt = MegatronTrainingConfig(**kwargs)
        with col.scope(role):
            role_cls = ForwardRoleConfig if role == "reward_config" else RoleConfig
            rc = role_cls(**{k: v.value for k, v in merged["role"].items()})
        arch = None
        if name is not None:
            with col.scope(f"model.{name}"):
                arch = ModelArchConfig(name=name, **{k: v.value for k, v in merged["arch"].items()})
        elif role == "actor_config":
            # placeholder so checking can go on; the missing name is reported and the arch checks skip it
            with col.scope("model"):
                arch = ModelArchConfig(num_layers=1, hidden_size=1, num_attention_heads=1, swiglu=True,
                                       normalization="RMSNorm", position_embedding_type="rope",
                                       disable_bias_linear=True)  # fmt: skip
        return mt, rc, arch
