"""An AVX2 + FMA int4 decode kernel: torch.ops.edge_avx2.w4a16_linear, built from kernels/avx2_int4.cpp.

    linear(x [..., K], qweight uint8 [N, K/2], scales bf16 [N, K/g], zeros bf16 [N, K/g], group) -> [..., N]

reads the checkpoint's row-major nibbles as they are (kernels/int4.py) and applies each group's scale and zero once
per group (y = s * sum q x + (z - 8 s) * sum x), in fp32; the result has x's dtype. Meant for a few rows
(decode, M <= ~16): it decodes the weights once per block of 4 rows.

The extension is compiled with the host's C++ compiler the first time it is needed (`torch.utils.cpp_extension.load`,
~40 s here) and cached under `edge.paths.cache_dir() / "torch_extensions"`; its ISA flags are only -mavx2 -mfma
-mf16c (x86-64-v3), so one build runs on every AVX2 CPU. `available()` says whether it can run here and why not:
no compiler, a CPU without AVX2/FMA, or a failed build. Callers fall back to tinygemm then.
"""

from __future__ import annotations

import logging
import shutil
from functools import lru_cache
from pathlib import Path

import torch

from edge.paths import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("avx2_int4.cpp")
EXTENSION = "edge_avx2_int4"
OP_NAMESPACE = "edge_avx2"
GROUP_SIZES = (32, 64, 128)
REQUIRED_FLAGS = ("avx2", "fma", "f16c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # -fopenmp: at::parallel_for's OpenMP backend
LDFLAGS = ["-fopenmp"]  # resolves to the libgomp.so.1 torch has already loaded


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++")


def missing_prerequisite(cpu_flags: set[str], compiler: str | None) -> str | None:
    """Why the kernel cannot be built or run on a CPU with these flags and this compiler; None when it can."""
    missing = [flag for flag in REQUIRED_FLAGS if flag not in cpu_flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)} (the AVX2 int4 kernel needs AVX2, FMA and F16C)"
    if compiler is None:
        return "no C++ compiler (c++ or g++) on PATH to build the AVX2 int4 kernel; install g++ or use tinygemm"
    return None


@lru_cache(maxsize=1)
def load() -> str | None:
    """Build (or load the cached build of) the extension and register its op; None when it runs here, else why not."""
    if hasattr(torch.ops, OP_NAMESPACE) and hasattr(getattr(torch.ops, OP_NAMESPACE), "w4a16_linear"):
        return None
    reason = missing_prerequisite(_cpu_flags(), _compiler())
    if reason:
        return reason
    from torch.utils import cpp_extension

    build_dir = cache_dir() / "torch_extensions" / EXTENSION
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name=EXTENSION,
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as error:  # a compiler or ninja failure, a missing header
        return f"building the AVX2 int4 kernel failed ({type(error).__name__}: {str(error)[-500:]})"
    _register_fake()
    return None


def available() -> bool:
    reason = load()
    if reason:
        log.warning("AVX2 int4 kernel unavailable: %s; falling back to tinygemm", reason)
    return reason is None


def _register_fake() -> None:
    @torch.library.register_fake(f"{OP_NAMESPACE}::w4a16_linear")
    def _fake(x, qweight, scales, zeros, group):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """y = x @ w.T for the row-major int4 weights; x [..., K] any float dtype -> [..., N] in x's dtype."""
    reason = load()
    if reason:
        raise RuntimeError(reason)
    return torch.ops.edge_avx2.w4a16_linear(x, qweight, scales, zeros, group)
