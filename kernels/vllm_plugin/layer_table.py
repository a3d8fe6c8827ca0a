"""The plugin's linear layers by index: a compiled decode graph calls `edge_avx2::layer_linear(x, index)`, not
`edge_avx2::int4_linear(x, packed, scales_and_zeros, qweight, scales, zeros, ...)` (or the int8 and blocks ops with
their tensors).

Inductor's C++ wrapper takes every tensor a graph reads as an argument on every call: Dynamo's bytecode fetches each
one from its module, AOTAutograd's and Inductor's Python wrappers pass the list on, and the wrapper allocates a handle
for each. On the default model that was 668 tensors, 600 of them the int4 linears' five each, and ~0.8 ms of Python
before the graph started (8.5 ms a step; docs/reports/2026-12-06-layer-table.md). Here a layer hands its tensors,
once loaded, to a table in kernels/ops/avx2_int4.cpp, and the graph passes an int that Dynamo bakes in as a constant.
The table's op runs the same C++ front the layer's own op does (decode rows in C++, wider batches through the Python
op), with the same tensors: the same numbers.

The index is the layer's place in the order vLLM's loader finishes layers (`process_weights_after_loading`, module
order), the same on every start, so a graph from the compile cache names the same layers. One engine a process, as
for the attention op (attention_cpp.py): a new engine's first layer (a new static forward context) starts the table
over. Outside an engine (no current vLLM config: edge-eval's layers, the kernels' tests), and with
EDGE_LAYER_TABLE=0, layers call their ops with their tensors as before. Heads are left out: vLLM calls them outside
the compiled graph.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from kernels.ops.q6k import X8  # the decode layouts' channels a block (q6k's and g32's alike)

ENV = "EDGE_LAYER_TABLE"
INDEX = "_edge_select_table_index"  # the attribute on a layer the table holds


class _Table:
    context: dict | None = None
    out_features: dict[int, int] = {}


def enabled() -> bool:
    """Whether loaded linear layers go into the table (the compile cache hashes this: compile_cache.plugin_factors)."""
    return os.environ.get(ENV, "1") != "0"


def add_int4(layer: torch.nn.Module, config: Any) -> None:
    """Hand a loaded int4 layer's final tensors and its op's arguments to the table (int4_ops.int4_linear's)."""
    if (index := _next_index()) is None:
        return
    n, k = layer.tinygemm_sz.shape[1], layer.tinygemm_packed.shape[1] * 2  # [K/g, N, 2], [N, K/2]
    torch.ops.edge_avx2.set_int4_layer(
        index, layer.tinygemm_packed, layer.tinygemm_sz, layer.qweight, layer.scales, layer.zeros,
        config.group_size, layer.int4_mode, config.dequant_threshold, config.prefill_dtype == "float32",
        config.avx2_rows, config.avx2_bits, k,
    )  # fmt: skip
    _taken(layer, index, n)


def add_int8(layer: torch.nn.Module, config: Any) -> None:
    """An 8-bit-set linear (int8 [N, K] and its scales; int4_ops.int8_linear's arguments)."""
    if (index := _next_index()) is None:
        return
    torch.ops.edge_avx2.set_int8_layer(index, layer.qweight, layer.scales, config.dequant_threshold, config.int8_rows)
    _taken(layer, index, layer.qweight.shape[0])


def add_blocks(layer: torch.nn.Module, config: Any) -> None:
    """An 8-bit-set linear kept as a GGUF's own blocks, in their decode layout [N/8, K/block, bytes]
    (int4_ops.blocks_linear's)."""
    if (index := _next_index()) is None:
        return
    torch.ops.edge_avx2.set_blocks_layer(index, layer.blocks, config.dequant_threshold, config.int8_rows)
    _taken(layer, index, layer.blocks.shape[0] * X8)


def _next_index() -> int | None:
    """The index the next layer to finish loading gets; None where layers keep their tensors (no engine is loading,
    the table is off, or the AVX2 extension is not built here)."""
    from vllm.config import get_current_vllm_config_or_none

    from kernels.ops import avx2_int4

    vllm_config = get_current_vllm_config_or_none()
    if not enabled() or vllm_config is None or avx2_int4.load() is not None:
        return None
    _register_fake()
    context = vllm_config.compilation_config.static_forward_context
    if context is not _Table.context:
        _Table.context, _Table.out_features = context, {}
        torch.ops.edge_avx2.forget_layers()
    return len(_Table.out_features)


def _taken(layer: torch.nn.Module, index: int, n: int) -> None:
    _Table.out_features[index] = n
    setattr(layer, INDEX, index)


def index_of(layer: torch.nn.Module) -> int | None:
    return getattr(layer, INDEX, None)


def linear(x: torch.Tensor, index: int) -> torch.Tensor:
    """x [T, K] -> [T, N] bf16 through the table's layer `index` (its own op's rules)."""
    return torch.ops.edge_avx2.layer_linear(x, index)


@functools.cache
def _register_fake() -> None:
    @torch.library.register_fake("edge_avx2::layer_linear")
    def _fake(x: torch.Tensor, index: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], _Table.out_features[index]), dtype=torch.bfloat16)
