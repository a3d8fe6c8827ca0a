"""What the formats' torch halves share: the calibration timers' weights (one layer in a kernel's format, ready to
run) and vLLM's op wrappers, which a timer of vLLM's kernels needs loaded."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

Run = Callable[[torch.Tensor], torch.Tensor]  # x bf16 [M, K] -> y [M, N]


@dataclass
class Weights:
    """One layer's weights in a kernel's format."""

    reference: torch.Tensor  # fp32 [N, K]: the weights the stored format stands for
    nbytes: int  # bytes of one copy: what a decode call streams from memory
    copy: Callable[[], Run]  # a fresh copy at other addresses, ready to run


Builder = Callable[[torch.Tensor, int], Weights]  # fp32 weights [N, K] and a group size -> Weights


class Absent(Exception):
    """The loaded library has no such op."""


def native_library() -> str | None:
    """The file name stem of vLLM's native library mapped into this process (_C, _C_AVX512, _C_AVX2), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if "/vllm/_C" in path and path.endswith(".so"):
            return Path(path).name.split(".")[0]
    return None


def vllm_ops(*names: str):
    """vLLM's op wrappers, after vLLM loaded its native library; Absent naming the library and the missing op."""
    try:
        from vllm import _custom_ops as ops
    except ImportError as err:
        raise Absent(f"vLLM is not importable ({err})") from None
    library = native_library() or "vLLM's native library"
    for name in names:
        if not hasattr(torch.ops._C, name):
            raise Absent(f"{library} registers no {name}")
    return ops


def avx2_ops():
    """This project's AVX2 kernels (built on first use); Absent without a compiler or AVX2/FMA."""
    from kernels.ops import avx2_int4

    reason = avx2_int4.load()
    if reason:
        raise Absent(reason)
    return avx2_int4
