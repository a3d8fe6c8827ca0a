"""Building a C++ extension of this project's with the host's compiler, once, cached (torch.utils.cpp_extension).

Used by the AVX2 int4 kernels (kernels/ops/avx2_int4.py) and the plugin's C++ attention
(kernels/vllm_plugin/attention.py). Builds land under `edge.paths.cache_dir() / "torch_extensions" / NAME`;
torch's builder rebuilds when the source or the flags change.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from edge.paths import cache_dir


def compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++")


def ninja_on_path(what: str) -> str | None:
    """Why torch's extension builder cannot find ninja to build `what`, or None. The `ninja` package (a dependency)
    puts its binary in the venv's bin/, which is on PATH only in an activated venv: `.venv/bin/edge-serve` run
    directly on a box without a system ninja would fail the build, so its folder joins this process's PATH."""
    if shutil.which("ninja"):
        return None
    try:
        import ninja
    except ImportError:
        return f"no ninja on PATH to build {what} (pip install ninja)"
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    return None if shutil.which("ninja") else f"no ninja binary in {ninja.BIN_DIR} to build {what}"


def build(name: str, source: Path, what: str, cflags: list[str], ldflags: list[str] | None = None) -> str | None:
    """Build (or load the cached build of) `source` as the extension `name`, which registers its ops on load;
    None when loaded, else why not (no compiler, no ninja, a failed build)."""
    if compiler() is None:
        return f"no C++ compiler (c++ or g++) on PATH to build {what}"
    reason = ninja_on_path(what)
    if reason:
        return reason
    from torch.utils import cpp_extension

    build_dir = cache_dir() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(name=name, sources=[str(source)], extra_cflags=cflags, extra_ldflags=ldflags or [],
                           build_directory=str(build_dir), is_python_module=False, verbose=False)  # fmt: skip
    except (RuntimeError, OSError, ImportError) as error:  # a compiler or ninja failure, a missing header
        return f"building {what} failed ({type(error).__name__}: {str(error)[-500:]})"
    return None
