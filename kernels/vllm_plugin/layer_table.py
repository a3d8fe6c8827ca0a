"""cpu_int4 layers by index: a compiled decode graph calls `edge_avx2::int4_layer_linear(x, index)`, not
`edge_avx2::int4_linear(x, packed, scales_and_zeros, qweight, scales, zeros, ...)`.

Inductor's C++ wrapper takes every tensor a graph reads as an argument on every call: Dynamo's bytecode fetches each
one from its module, AOTAutograd's and Inductor's Python wrappers pass the list on, and the wrapper allocates a handle
for each. On the default model that was 668 tensors, 600 of them the int4 linears' five each, and ~0.8 ms of Python
before the graph started (8.5 ms a step; docs/reports/2026-12-06-layer-table.md). Here a layer hands its tensors,
once loaded, to a table in kernels/ops/avx2_int4.cpp, and the graph passes an int that Dynamo bakes in as a constant.

The index is the layer's place in the order vLLM's loader finishes layers (`process_weights_after_loading`, module
order), the same on every start, so a graph from the compile cache names the same layers. One engine a process, as
for the attention op (attention_cpp.py): a new engine's first layer (a new static forward context) starts the table
over. Outside an engine (no current vLLM config: edge-eval's layers, the kernels' tests), and with
EDGE_LAYER_TABLE=0, layers call the op with their tensors as before.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)

ENV = "EDGE_LAYER_TABLE"
INDEX = "_edge_select_int4_index"  # the attribute on a layer the table holds


class _Table:
    context: dict | None = None
    out_features: dict[int, int] = {}


def enabled() -> bool:
    """Whether loaded int4 layers go into the table (the compile cache hashes this: compile_cache.plugin_factors)."""
    return os.environ.get(ENV, "1") != "0"


def add(layer: torch.nn.Module, config: Any) -> None:
    """Hand a loaded int4 layer's final tensors and its op arguments to the table and give the layer its index; the
    layer is left as it was where no engine is loading or the AVX2 extension is not built here."""
    from vllm.config import get_current_vllm_config_or_none

    from kernels.ops import avx2_int4

    vllm_config = get_current_vllm_config_or_none()
    if not enabled() or vllm_config is None or avx2_int4.load() is not None:
        return
    _register_fake()
    context = vllm_config.compilation_config.static_forward_context
    if context is not _Table.context:
        _Table.context, _Table.out_features = context, {}
        torch.ops.edge_avx2.forget_int4_layers()
    index = len(_Table.out_features)
    n, k = layer.tinygemm_sz.shape[1], layer.tinygemm_packed.shape[1] * 2  # [K/g, N, 2], [N, K/2]
    torch.ops.edge_avx2.set_int4_layer(
        index, layer.tinygemm_packed, layer.tinygemm_sz, layer.qweight, layer.scales, layer.zeros,
        config.group_size, layer.int4_mode, config.dequant_threshold, config.prefill_dtype == "float32",
        config.avx2_rows, config.avx2_bits, k,
    )  # fmt: skip
    _Table.out_features[index] = n
    setattr(layer, INDEX, index)


def index_of(layer: torch.nn.Module) -> int | None:
    return getattr(layer, INDEX, None)


def linear(x: torch.Tensor, index: int) -> torch.Tensor:
    """x [T, K] -> [T, N] bf16 through the table's layer `index` (edge_avx2::int4_linear's rules)."""
    return torch.ops.edge_avx2.int4_layer_linear(x, index)


_fake_registered = False


def _register_fake() -> None:
    global _fake_registered
    if _fake_registered:
        return

    @torch.library.register_fake("edge_avx2::int4_layer_linear")
    def _fake(x: torch.Tensor, index: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], _Table.out_features[index]), dtype=torch.bfloat16)

    _fake_registered = True
