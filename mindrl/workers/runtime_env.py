"""The environment variables every Ray worker gets, lowest first: platform defaults < configs/envs/runtime_env.yaml (or
$MINDRL_RUNTIME_ENV) < the driver's environment < the explicit runtime_env < REQUIRED."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from mindrl.config.loader import default_config_dir

ENV_VAR = "MINDRL_RUNTIME_ENV"  # path of the YAML file; "" disables the file
# Values the workers cannot run without: the rollout engine's core lives in the worker process (no subprocess).
REQUIRED = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RuntimeEnvError(ValueError):
    """A malformed runtime env file; the message names the file and the key."""


@dataclass
class RuntimeEnv:
    """The merged runtime_env for ray.init and where its variables came from (for the log line)."""

    runtime_env: dict[str, Any]
    path: str | None  # the file read, None if none
    from_file: list[str] = field(default_factory=list)
    from_environ: list[str] = field(default_factory=list)  # default or file keys the user's environment replaced
    from_platform: list[str] = field(default_factory=list)  # the platform's defaults that were kept

    def describe(self) -> str:
        src = f"{len(self.from_file)} from {self.path}" if self.path else "no file"
        if self.from_platform:
            src += f", platform defaults {', '.join(self.from_platform)}"
        over = f", {len(self.from_environ)} taken from this environment ({', '.join(self.from_environ)})"
        return (
            f"Ray runtime env: {len(self.runtime_env['env_vars'])} variables ({src}{over if self.from_environ else ''})"
        )


def default_path() -> str:
    """The shipped configs/envs/runtime_env.yaml."""
    return os.path.join(default_config_dir(), "envs", "runtime_env.yaml")


def read_env_file(path: str) -> dict[str, str]:
    """`env_vars: {NAME: scalar}` from `path`, values as strings; RuntimeEnvError naming the file and key else."""
    import yaml

    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise RuntimeEnvError(f"runtime env file {path} ({ENV_VAR}): cannot read it: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise RuntimeEnvError(f"runtime env file {path}: not valid YAML: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RuntimeEnvError(f"runtime env file {path}: expected a mapping with 'env_vars', got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k != "env_vars")
    if unknown:
        raise RuntimeEnvError(
            f"runtime env file {path}: unsupported key(s) {unknown}: only 'env_vars' (NAME: value) is read"
        )
    env = raw.get("env_vars") or {}
    if not isinstance(env, dict):
        raise RuntimeEnvError(f"runtime env file {path}: 'env_vars' must be a mapping NAME: value, got {env!r}")
    out: dict[str, str] = {}
    for key, value in env.items():
        if not isinstance(key, str) or not _NAME.match(key):
            raise RuntimeEnvError(f"runtime env file {path}: env_vars.{key}: not a valid environment variable name")
        if value is None or isinstance(value, (dict, list)):
            raise RuntimeEnvError(
                f"runtime env file {path}: env_vars.{key}: the value must be a string or number, got {value!r}"
            )
        # YAML reads true/1.0 as bool/float; the environment holds what the user wrote, lower-case for booleans.
        out[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def build_runtime_env(
    explicit: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    path: str | None = None,
    defaults: dict[str, str] | None = None,
) -> RuntimeEnv:
    """Merge `defaults` (default: this platform's `worker_env`), the file (`path`, i.e. rl_config.runtime_env_path;
    else MINDRL_RUNTIME_ENV; else `default_path()`), `environ` (default os.environ) for the defaults' and the file's
    keys, `explicit` (a ray runtime_env dict; its other keys pass through) and REQUIRED."""
    environ = dict(os.environ) if environ is None else environ
    if path is None:
        path = environ.get(ENV_VAR)
    if path is None:
        path = default_path()
        if not os.path.isfile(path):  # an installed package without the repo's configs/: nothing to read
            path = None
    elif path == "":
        path = None
    file_vars = read_env_file(path) if path else {}
    for key, need in REQUIRED.items():
        if key in file_vars and file_vars[key] != need:
            raise RuntimeEnvError(
                f"runtime env file {path}: env_vars.{key}={file_vars[key]!r}: mindrl requires {need!r} "
                "(the rollout engine runs inside each worker process); remove the key"
            )
    if defaults is None:
        from mindrl.kernels import current_kernels

        defaults = current_kernels().worker_env
    merged = {**defaults, **file_vars}
    from_environ = sorted(k for k in merged if k in environ and environ[k] != merged[k])
    merged.update({k: environ[k] for k in from_environ})
    explicit = dict(explicit or {})
    explicit_vars = {str(k): str(v) for k, v in (explicit.pop("env_vars", None) or {}).items()}
    merged.update(explicit_vars)
    merged.update(REQUIRED)
    kept = sorted(k for k in defaults if not (k in file_vars or k in environ or k in explicit_vars))
    return RuntimeEnv({**explicit, "env_vars": merged}, path, sorted(file_vars), from_environ, kept)
