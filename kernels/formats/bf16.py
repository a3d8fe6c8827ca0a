"""The bf16 format's torch half (edge.formats.bf16): a source tensor as it is served, and its GEMM's timer."""

from __future__ import annotations

import torch

from edge.formats.bf16 import BF16_FORMAT
from kernels.formats.common import Builder, Run, Weights

FORMAT = BF16_FORMAT


def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A weight no rule quantizes: bf16, without a copy when it already is (a bit-exact passthrough)."""
    return {name: tensor.to(torch.bfloat16)}


def _bf16(w: torch.Tensor, group: int) -> Weights:
    weight = w.to(torch.bfloat16)  # [N, K]

    def copy() -> Run:
        held = weight.clone()
        return lambda x: torch.nn.functional.linear(x, held)

    return Weights(weight.float(), weight.nbytes, copy)


TIMERS: dict[str, Builder] = {"bf16": _bf16}
