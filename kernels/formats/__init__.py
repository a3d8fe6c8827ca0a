"""The weight formats' torch halves, one module per format of edge.formats: its converter step (`convert`, and
`from_source` for a GGUF tensor whose own codes it keeps) and the calibration timers of the kernels reading it
(`TIMERS`, by kernel name: edge-calibrate's child builds each kernel's weights with them)."""

from __future__ import annotations

from types import ModuleType

from edge.catalog.kernel_registry import KERNELS
from edge.formats import kernel_layout_format
from kernels.formats import bf16, gptq, int8, tinygemm
from kernels.formats.common import Builder

MODULES: dict[str, ModuleType] = {module.FORMAT.name: module for module in (bf16, tinygemm, gptq, int8)}


def torch_half(format_name: str) -> ModuleType:
    """The module of a format's torch half (edge.formats' names: bf16, tinygemm, gptq, int8)."""
    return MODULES[format_name]


def timer(kernel: str) -> Builder:
    """The builder of a kernel's weights: the timer its format's module keeps for it."""
    return torch_half(kernel_layout_format(KERNELS[kernel].weight_format).name).TIMERS[kernel]


def timed_kernels() -> list[str]:
    return [name for module in MODULES.values() for name in module.TIMERS]
