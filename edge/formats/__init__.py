"""The weight formats, one object each (edge.formats.base says what a format owns); their torch halves, the
converter steps and the calibration timers' weights, are kernels/formats."""

from __future__ import annotations

from edge.catalog.weight_paths import PATHS
from edge.formats.base import WeightFormat
from edge.formats.bf16 import BF16_FORMAT
from edge.formats.export import EXPORT
from edge.formats.gptq import GPTQ
from edge.formats.int8 import INT8
from edge.formats.tinygemm import TINYGEMM

FORMATS: dict[str, WeightFormat] = {fmt.name: fmt for fmt in (BF16_FORMAT, TINYGEMM, GPTQ, INT8, EXPORT)}


def format_of(path: str) -> WeightFormat:
    """The format a path stores its weights in (edge.catalog.weight_paths' `weight_format`)."""
    return FORMATS[PATHS[path].weight_format]


def kernel_layout_format(layout: str) -> WeightFormat:
    """The format that stores a kernel's weight layout (edge.catalog.kernel_registry's `weight_format`)."""
    (fmt,) = [fmt for fmt in FORMATS.values() if layout in fmt.kernel_layouts]
    return fmt
