"""The weight paths, as data: one spec per path, the one place a path's name, layouts and methods are written.

Everything that lists paths asks this table: the Plan's types and choices (edge.plan), the ranking and the
fidelity order (edge.rank), which paths quantize (edge.quantized_layers), the vLLM method a checkpoint names
(edge.quantized_layers, edge.engine_config) and, the other way, the path a checkpoint's `quant_method` belongs to
(kernels.evaluate.evaluate's quality records). The kernels each path runs are edge.kernel_registry's `serves`.

    w4a16-tinygemm  4-bit weights, bf16 activations: the plugin's `cpu_int4` method, in a layout
    w4a8-gptq       4-bit GPTQ weights, int8 activations: vLLM's own `gptq` where AMX tiles are (its W4A8 kernel
                    turns on only there, vllm/model_executor/kernels/linear/mixed_precision/cpu.py), the plugin's
                    `cpu_w4a8` elsewhere (kernels/vllm_plugin/cpu_w4a8.py calls the same op)
    bf16            the source's bf16 weights, served as they are
    export-only     a bundle for a phone runtime (kernels/export/export.py): nothing vLLM serves
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

WeightPath = Literal["w4a8-gptq", "w4a16-tinygemm", "bf16", "export-only"]
Layout = Literal["direct", "dual", "kernel-only"]


@dataclass(frozen=True)
class PathSpec:
    name: WeightPath
    layouts: tuple[Layout, ...]  # equal cost ranks them in this order (the leanest first); () without layouts
    quantizes_weights: bool  # to 4 bits (the layer rules of edge.quantized_layers apply)
    quantizes_activations: bool  # to 8 bits: never chosen for fidelity (docs/FACTS.md: agents lost completion)
    # Fidelity: bf16 is the reference; W4A16 keeps bf16 activations (+12.5 % perplexity on the reference model);
    # W4A8 quantizes activations (+27.2 %) and comes last.
    fidelity_rank: int
    methods: dict[bool, str] | None  # the checkpoint's quant_method, by: the device has AMX tiles; None: no checkpoint
    served_by_vllm: bool = True


PATHS: dict[str, PathSpec] = {
    spec.name: spec
    for spec in (
        PathSpec("w4a8-gptq", (), True, True, 9, {True: "gptq", False: "cpu_w4a8"}),
        PathSpec("w4a16-tinygemm", ("direct", "dual", "kernel-only"), True, False, 1,
                 {True: "cpu_int4", False: "cpu_int4"}),
        PathSpec("bf16", (), False, False, 0, None),
        PathSpec("export-only", (), False, False, 2, None, served_by_vllm=False),
    )
}  # fmt: skip

WEIGHT_PATHS: tuple[WeightPath, ...] = tuple(PATHS)  # type: ignore[assignment]
LAYOUTS: tuple[Layout, ...] = tuple(dict.fromkeys(layout for spec in PATHS.values() for layout in spec.layouts))
QUANTIZED_PATHS: tuple[WeightPath, ...] = tuple(name for name, spec in PATHS.items() if spec.quantizes_weights)
# The plugin's methods (kernels/vllm plugin) run the 8-bit set (int8 head and embedding); vLLM's own gptq does not.
EIGHT_BIT_METHODS = ("cpu_int4", "cpu_w4a8")


def quant_method(path: str, *, amx: bool) -> str | None:
    """The vLLM quantization method a checkpoint of this path names on such a device; None: no checkpoint."""
    methods = PATHS[path].methods
    return methods[amx] if methods else None


def quant_methods(path: str) -> list[str]:
    """Every method a checkpoint of this path may name, whatever the device."""
    return sorted(set(PATHS[path].methods.values())) if PATHS[path].methods else []


def path_of_method(method: str) -> WeightPath:
    """The path whose checkpoints carry this quant_method ("bf16" for a checkpoint without one)."""
    found = [name for name, spec in PATHS.items() if spec.methods and method in spec.methods.values()]
    assert len(found) <= 1, f"{method} belongs to one path, got {found}"
    return found[0] if found else "bf16"


def fidelity_rank(path: str) -> int:
    return PATHS[path].fidelity_rank
