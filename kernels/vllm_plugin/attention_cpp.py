"""The `cpp` way of kernels/vllm_plugin/attention.py: vLLM's decoder attention as one C++ op a layer, no Python.

    Attention.forward -> torch.ops.edge_attn.attention(query, key, value, output, index)      (attention.cpp)
    GPUModelRunner._model_forward: push(forward context) ... the model ... end_step()

`index` is the layer's position in vLLM's static forward context, fixed when the layer is built, so a graph
compiled once (the compile cache) names the same layers on every start. `push` hands attention.cpp what vLLM's
Python ops would look up on every call: each metadata group's batch tensors once per step, and each layer's cache
views and constants when they change (set_layer). Without a push (vLLM's dummy and warm-up runs, a step without
metadata for every layer) the op calls vLLM's own Python ops (`vllm_attention` below).

A step whose sequences have at most 8 query rows each (decode, a drafted verify pass) is attended by attention.cpp's
own lean kernel where the layer allows it (vLLM's "vec" cache layout, bf16, no alibi, sinks, soft-cap or window):
vLLM's kernel costs ~8 us a layer for one short decode row. EDGE_LEAN_ATTENTION=0 keeps vLLM's kernel for every row.

The same _model_forward holds the compiled graph's inputs from C++ (hold_model, steady_input), so the graph, which
runs without the GIL, never takes it to hand a PyObject back mid-forward (EDGE_HOLD_GRAPH_INPUTS=0 turns that off).
"""

from __future__ import annotations

import logging
import os
import weakref
from functools import cache
from pathlib import Path
from typing import Any

import torch

from kernels.ops import extension

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attention.cpp")
EXTENSION = "edge_attention"
WHAT = "the plugin's C++ attention"
CFLAGS = ["-O3"]
LEAN_ENV = "EDGE_LEAN_ATTENTION"  # "0": decode rows on vLLM's attention kernel too (attention.cpp lean_attention)
HOLD_ENV = "EDGE_HOLD_GRAPH_INPUTS"  # "0": the model's tensors not held from C++ (hold_model), for comparisons
INDEX = "_edge_select_attention_index"  # the attribute on an Attention layer that takes the op
_MARK = "_edge_select_attention_cpp"


class _Layers:
    """The layers built to take the op, for the forward context they were built in (one engine a process; a new
    context, as a test's next engine, starts over)."""

    context: dict | None = None
    names: dict[int, str] = {}
    handed: dict[int, tuple[int, torch.Tensor]] = {}  # index -> (group, cache) last given to set_layer
    held_model: int | None = None  # id() of the model whose parameters and buffers attention.cpp holds
    steady: dict[tuple, torch.Tensor] = {}  # steady_input's views, held from C++ too


@cache
def load() -> str | None:
    """Build (or load the cached build of) attention.cpp and register the Python halves of its ops; None when
    loaded, else why not."""
    if not hasattr(torch.ops.edge_attn, "attention"):
        reason = extension.build(EXTENSION, SOURCE, WHAT, CFLAGS)
        if reason:
            return reason
    torch.library.register_fake("edge_attn::attention")(_fake)
    torch.library.register_fake("edge_attn::vllm_attention")(_fake)
    torch.library.impl("edge_attn::vllm_attention", "CPU")(vllm_attention)
    torch.ops.edge_attn.set_lean(os.environ.get(LEAN_ENV, "1") != "0")
    return None


def _fake(query, key, value, output, index) -> None:
    return None


def vllm_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                   index: int) -> None:  # fmt: skip
    """What Attention.forward would have called for this layer: vLLM's KV update and attention ops' Python."""
    from vllm.model_executor.layers.attention import attention as vllm_attention_module

    name = _Layers.names[index]
    dummy = vllm_attention_module.unified_kv_cache_update(key, value, name)
    vllm_attention_module.unified_attention_with_output(query, key, value, output, name, kv_cache_dummy_dep=dummy)


def eligible(layer: Any) -> bool:
    """A plain decoder self-attention layer on vLLM's CPU backend, writing its own cache, unquantized queries."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    return (
        type(layer) is Attention
        and type(layer.impl) is CPUAttentionBackendImpl
        and layer.impl.attn_type == AttentionType.DECODER
        and layer.kv_sharing_target_layer_name is None
        and layer.query_quant is None
        and not layer.attn_backend.forward_includes_kv_cache_update
    )


def _number(layer: Any) -> None:
    """Give a just-built eligible layer its index in the static forward context it registered in."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or not eligible(layer):
        return
    context = config.compilation_config.static_forward_context
    if context is not _Layers.context:
        _Layers.context, _Layers.names, _Layers.handed = context, {}, {}
        torch.ops.edge_attn.forget()
    index = list(context).index(layer.layer_name)
    setattr(layer, INDEX, index)
    _Layers.names[index] = layer.layer_name


def push(context: Any) -> bool:
    """Hand attention.cpp this step's metadata, one set_step per group of layers sharing it, and any layer's cache
    it has not seen; False (nothing handed) when a layer lacks CPU metadata or a cache: the op falls back."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    metadata, slots = context.attn_metadata, context.slot_mapping
    if not _Layers.names or not isinstance(metadata, dict) or not isinstance(slots, dict):
        return False
    groups: dict[tuple[int, int], tuple[int, Any, torch.Tensor]] = {}
    layers = []
    for index, name in _Layers.names.items():
        meta, slot, layer = metadata.get(name), slots.get(name), context.no_compile_layers.get(name)
        cache_ = getattr(layer, "kv_cache", None)
        if not isinstance(meta, CPUAttentionMetadata) or slot is None or not isinstance(cache_, torch.Tensor):
            return False
        if cache_.dim() != 4 or meta.scheduler_metadata is None:
            return False
        group = groups.setdefault((id(meta), id(slot)), (len(groups), meta, slot))[0]
        layers.append((index, group, layer, cache_))
    ops = torch.ops.edge_attn
    for group, meta, slot in groups.values():
        ops.set_step(group, meta.num_actual_tokens, meta.causal, meta.query_start_loc, meta.seq_lens,
                     meta.block_table, meta.scheduler_metadata, slot, meta.dynamic_causal)  # fmt: skip
    for index, group, layer, cache_ in layers:
        handed = _Layers.handed.get(index)
        if handed is None or handed[0] != group or handed[1] is not cache_:
            impl = layer.impl
            ops.set_layer(index, group, cache_, impl.scale, impl.alibi_slopes, impl.sliding_window,
                          impl.logits_soft_cap, impl.sinks, layer._k_scale_float, layer._v_scale_float,
                          impl.kv_cache_dtype, impl.isa)  # fmt: skip
            _Layers.handed[index] = (group, cache_)
    return True


def hold_model(model: torch.nn.Module) -> int:
    """Hold a C++ reference to each of the model's parameters and buffers (attention.cpp `hold_tensors`), once per
    model: then the compiled graph, which runs without the GIL, never releases the last C++ reference to one of its
    inputs, and so never takes the GIL in the middle of a forward to hand a PyObject back. Returns how many are
    held (0: this model's already were). A new model (a test's next engine) replaces the last one's."""
    if _Layers.held_model == id(model) or not isinstance(model, torch.nn.Module) or os.environ.get(HOLD_ENV) == "0":
        return 0
    _release(_Layers.held_model)
    tensors = [*model.parameters(), *model.buffers()]
    _Layers.held_model = id(model)
    # an engine shut down gives its weights back with its model; nothing to give back as the interpreter exits
    weakref.finalize(model, _release, id(model)).atexit = False
    return torch.ops.edge_attn.hold_tensors(tensors)


def _release(model_id: int | None) -> None:
    """Drop what attention.cpp holds for the model of this id(), if it is still the one held."""
    if model_id is not None and _Layers.held_model == model_id:
        torch.ops.edge_attn.release_tensors()
        _Layers.held_model, _Layers.steady = None, {}


STEADY_VIEWS = 64  # steady_input keeps at most this many views (a decode step's few shapes, not every prompt's)


def steady_input(tensor: Any) -> Any:
    """The same view of the same memory as `tensor` (vLLM slices its persistent input buffers anew each step, so each
    step's input_ids and positions are new tensors Python alone owns), but one kept from step to step and held from
    C++ (hold_model's reason): the compiled graph then releases no last C++ reference to it. Anything not a tensor,
    or past STEADY_VIEWS kept, is returned as it is."""
    if _Layers.held_model is None or not isinstance(tensor, torch.Tensor):
        return tensor
    key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
           tensor.dtype)  # fmt: skip
    kept = _Layers.steady.get(key)
    if kept is None:
        if len(_Layers.steady) >= STEADY_VIEWS:
            return tensor
        kept = tensor.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
        torch.ops.edge_attn.hold_tensors([kept])
        _Layers.steady[key] = kept
    return kept


def install() -> bool:
    """Patch Attention.__init__ and .forward and GPUModelRunner._model_forward once per process; False (vLLM's
    ops kept, the reason logged) when the extension cannot be built here."""
    reason = load()
    if reason:
        log.warning("C++ attention unavailable: %s; vLLM's attention ops stay", reason)
        return False
    from vllm import forward_context
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(Attention.forward, _MARK, False):
        return True
    vllm_init, vllm_forward, vllm_model_forward = Attention.__init__, Attention.forward, GPUModelRunner._model_forward

    def __init__(self, *args, **kwargs):
        vllm_init(self, *args, **kwargs)
        _number(self)

    def forward(self, query, key, value, output_shape=None, output_dtype=None):
        index = getattr(self, INDEX, None)
        if index is None or output_shape is not None or key is None or value is None:
            return vllm_forward(self, query, key, value, output_shape, output_dtype)
        output = torch.empty((query.shape[0], self.num_heads * self.head_size_v), dtype=output_dtype or query.dtype,
                             device=query.device)  # fmt: skip
        torch.ops.edge_attn.attention(
            query.view(-1, self.num_heads, self.head_size), key.view(-1, self.num_kv_heads, self.head_size),
            value.view(-1, self.num_kv_heads, self.head_size_v), output.view(-1, self.num_heads, self.head_size_v),
            index,
        )  # fmt: skip
        return output

    def _model_forward(self, *args, **kwargs):
        hold_model(self.model)
        for name in ("input_ids", "positions"):
            if name in kwargs:
                kwargs[name] = steady_input(kwargs[name])
        pushed = forward_context.is_forward_context_available() and push(forward_context.get_forward_context())
        try:
            return vllm_model_forward(self, *args, **kwargs)
        finally:
            if pushed:
                torch.ops.edge_attn.end_step()

    for function in (__init__, forward, _model_forward):
        setattr(function, _MARK, True)
    Attention.__init__, Attention.forward, GPUModelRunner._model_forward = __init__, forward, _model_forward
    return True
