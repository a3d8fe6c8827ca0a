"""The source's bf16 weights, served as they are (the bf16 path): 2 bytes a weight, no quantization_config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from edge.errors import InputError
from edge.formats.base import (
    Layers,
    MemoryItem,
    WeightFormat,
    bf16_bytes,
    bf16_detail,
    embedding,
    head,
    layer_linears,
    resident,
)
from edge.model.shapes import LinearShape, ModelShape


class Bf16(WeightFormat):
    name = "bf16"
    kernel_layouts = ("bf16",)
    derived_bytes = 2.0
    # vLLM 0.28 packs each bf16 linear for oneDNN or its sgl kernel (model_executor/layers/utils.py
    # dispatch_cpu_unquantized_gemm): memory the engine holds outside any module's tensors, so not mapped
    linears_mapped = False

    def bytes(self, lin: LinearShape, group: int | None = None) -> int:
        return bf16_bytes(lin)

    def weight_items(self, model: ModelShape, layers: Layers, layout: str | None, group: int | None, *,
                     block: int, decode_kernel: str) -> list[MemoryItem]:  # fmt: skip
        emb = embedding(model)
        tied = " (tied: the head reads this same tensor)" if model.tie_word_embeddings else ""
        items = [resident("bf16-weights", "embedding (bf16)", bf16_bytes(emb), bf16_detail(emb) + tied,
                          layer=emb.name)]  # fmt: skip
        linears = layer_linears(model) + ([] if model.tie_word_embeddings else [head(model)])
        items += [resident("bf16-weights", f"{lin.name} (bf16)", bf16_bytes(lin), bf16_detail(lin), layer=lin.name)
                  for lin in linears]  # fmt: skip
        return items

    def check_request(self, path: str, qconfig: Any, methods: Sequence[str]) -> None:
        if qconfig is not None:
            raise InputError("quantization_config", qconfig, f"none for path {path}")


BF16_FORMAT = Bf16()
