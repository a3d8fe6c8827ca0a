"""The `export` section of an export-only plan: what `edge-export` builds for a phone, and the command to build it.

The runtime is ONNX Runtime (README, "Phones"): its exporter side (onnx, onnxruntime's quantization tools) installs
beside the serving environment's torch 2.13.0+cpu without changing it, the bundle is one standard ONNX graph
(opset 21, QDQ weights) meant for its mobile packages (Android/iOS) and its QNN execution provider (Snapdragon
NPU), and its CPU provider runs the same graph here for verification. No phone was available: that a phone loads
it (and QNN takes blocked int8 scales) is not verified. ExecuTorch (`.pte`, XNNPACK
and Qualcomm QNN backends) is the alternative a plan can name: its 1.5.1 wheel also resolves against torch 2.13 but
pulls ~20 more packages (coremltools, torchao, scikit-learn, pandas) into the environment.
"""

from __future__ import annotations

import shlex
from typing import Literal

from pydantic import BaseModel

from edge.formats.base import (
    FP32,
    Layers,
    MemoryItem,
    WeightFormat,
    embedding,
    head,
    layer_linears,
    mib,
    resident,
    times,
)
from edge.model.shapes import ModelShape

RUNTIME = "onnxruntime"
FORMAT = "onnx-qdq"  # an ONNX graph whose weights are int8 with DequantizeLinear (opset 21, blocked)
WEIGHT_BITS = 8
WEIGHT_BLOCK = 64  # inputs per scale, within each output channel
DEVICE_ACTIVATIONS = "float16"  # on the phone's provider; edge-export builds the graph so by default with a plan
ALTERNATIVE = "executorch"
# Beside the weights: RoPE tables (2 MiB: 4096 rows x 64 x cos/sin float32), tokenizer files (3.4 MiB for SmolLM2),
# configs and the manifest
BUNDLE_OVERHEAD_BYTES = 6 << 20


class ExportSection(BaseModel):
    """How the phone deliverable is built; `command` is what edge-serve prints for a phone plan."""

    runtime: Literal["onnxruntime", "executorch"] = RUNTIME
    format: str = FORMAT
    weight_bits: int = WEIGHT_BITS
    weight_block: int = WEIGHT_BLOCK
    activations: str = DEVICE_ACTIVATIONS
    kv_cache: str = "graph inputs/outputs past_key_values.{i}.key|value -> present.{i}.key|value"
    command: list[str]
    bundle_bytes: int  # expected: the ledger's export weights + BUNDLE_OVERHEAD_BYTES
    alternative: str = ALTERNATIVE

    def command_line(self, model_dir: str | None = None) -> str:
        """The command as one shell line; `model_dir` replaces the model's name with where it is."""
        command = list(self.command)
        if model_dir is not None:
            command[1] = model_dir
        return shlex.join(command)


def export_section(model_name: str, weight_bytes: int) -> ExportSection:
    """The section of an export-only plan for the model `model_name` (a directory's name, as edge.model.reader
    names it) whose ledger books `weight_bytes` of exported weights; PLAN.json is the plan saved by the caller."""
    command = ["edge-export", model_name, f"{model_name}-{FORMAT}", "--plan", "PLAN.json"]
    return ExportSection(command=command, bundle_bytes=weight_bytes + BUNDLE_OVERHEAD_BYTES)


class Export(WeightFormat):
    """The exported graph's weights (kernels/export/export_graph.py, what edge-export writes): no engine reads them,
    so a plan of this format has no KV cache and no engine items."""

    name = "export"
    runs_in_engine = False

    def weight_items(self, model: ModelShape, layers: Layers, layout: str | None, group: int | None, *,
                     block: int, decode_kernel: str) -> list[MemoryItem]:  # fmt: skip
        """w8a16 (docs/FACTS.md: "calibrated w8a16 was the only scheme correct on device"): 1 byte per weight plus,
        per block of WEIGHT_BLOCK inputs of each output channel, a float32 scale and an int8 zero point. The graph
        stores the head even when it is tied to the embedding (the head is a MatMul, the embedding a Gather)."""
        items = []
        for lin in [embedding(model), *layer_linears(model), head(model)]:
            blocks = -(-lin.k // WEIGHT_BLOCK)
            size = lin.count * (lin.n * lin.k + lin.n * blocks * (FP32 + 1))
            detail = (f"{times(lin)}({lin.n} x {lin.k} x 1 B + {lin.n} x {blocks} blocks x 5 B scale and zero "
                      f"point) = {mib(size)}")  # fmt: skip
            items.append(resident("export-weights", f"{lin.name} w8a16 (exported graph)", size, detail,
                                  layer=lin.name))  # fmt: skip
        return items


EXPORT = Export()
