"""C libraries built on the host on first use (the CPU kernels, the MKL vendor shim): their sources, cache
directory and compiler, and an atomic build that concurrent processes can race."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile


def read_source(name: str) -> str:
    """The text of the C source `name` shipped beside this module (package data of mindrl.kernels)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name), encoding="utf-8") as f:
        return f.read()


def cache_dir() -> str:
    """MINDRL_CACHE_DIR, else $XDG_CACHE_HOME/mindrl, else ~/.cache/mindrl."""
    if os.environ.get("MINDRL_CACHE_DIR"):
        return os.environ["MINDRL_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mindrl")


def c_compiler() -> str | None:
    """The host's C compiler: $CC, else cc, else gcc (None where there is none)."""
    return shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")


def compile_library(compiler: str, source: str, path: str, flags: list[str], libs: list[str] = ()) -> None:
    """Compile `source` (C) into the shared library `path`: `compiler flags -shared -fPIC -o out src libs`. Built in
    a temporary folder beside `path` and moved into place atomically, so concurrent builders all leave one complete
    file and nothing else. Raises OSError or subprocess.CalledProcessError (with the compiler's stderr)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        src, out = os.path.join(tmp, "lib.c"), os.path.join(tmp, os.path.basename(path))
        with open(src, "w") as f:
            f.write(source)
        cmd = [compiler, *flags, "-shared", "-fPIC", "-o", out, src, *libs]
        subprocess.run(cmd, check=True, capture_output=True)
        os.replace(out, path)


def failure_detail(e: BaseException) -> str:
    """The end of a failed build's stderr, for the warning that reports it."""
    return (getattr(e, "stderr", None) or b"").decode(errors="replace")[-800:]
