"""vLLM 0.28's CPU attention without Python in the step (issue 42 part 2: the step's own cost).

Every decode step calls vLLM's attention twice per layer (60 calls for the default model): its custom ops
`unified_kv_cache_update` and `unified_attention_with_output`, which are Python, look up the forward context, the
layer and its metadata, and call `CPUAttentionBackendImpl.do_kv_cache_update` and `.forward`, which re-derive the
cache's key and value views and reach vLLM's C++ kernels through its wrappers. Compiled with Inductor's C++
wrapper (the plan's compilation config, edge.plan.engine_config), those Python calls are all that still holds the
GIL in a forward.

Three ways, chosen by EDGE_SELECT_ATTENTION (the benchmarks compare them):
- `cpp` (the default): `Attention.forward` calls torch.ops.edge_attn.attention (attention.cpp), which writes the
  cache and attends with vLLM's two C++ kernels and the same arguments. Per step, the runner's `_model_forward`
  first hands it each metadata group's tensors (`push`, one call per group) and clears them after; the layer's
  cache views and constants are handed over once (and again when its cache changes). Layers that are not plain
  decoder self-attention on this backend keep vLLM's forward at construction; a call outside `_model_forward`
  (vLLM's warm-up and profile runs) or without metadata for every layer goes to vLLM's own Python ops
  (`edge_attn::vllm_attention`), as does everything when the extension cannot be built here.
- `python`: vLLM's ops, with `CPUAttentionBackendImpl.forward` and `.do_kv_cache_update` replaced by leaner ones:
  the two views kept per layer (keyed by the cache's address, shape and strides), cuts only when padding exists,
  the ops' `.default` overloads called with the same arguments in the same order. The `cpp` way's fallback uses
  them too.
- `vllm`: vLLM's methods as shipped.

Each way calls the same kernels on the same tensors, so the same results (tests/kernels/test_attention_plugin.py
checks them against vLLM's own methods on a real cache; tests/kernels/test_decode_plugin_slow.py the engine's greedy
text). Encoder attention (its own cache path), fused output quantization and warm-up calls without metadata go to
vLLM's methods as they were.
"""

from __future__ import annotations

import os
from typing import Any

import torch

ENV = "EDGE_SELECT_ATTENTION"
CPP, PYTHON, VLLM = "cpp", "python", "vllm"
MODES = (CPP, PYTHON, VLLM)
_MARK = "_edge_select_lean_attention"
_VIEWS = "_edge_select_cache_views"


def cache_views(impl: Any, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves of a layer's cache [blocks, kv_heads, block_size, 2 * head_size], as vLLM's
    methods derive them, made once per cache storage (address, shape, strides) and kept on the impl."""
    where = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride())
    kept = impl.__dict__.get(_VIEWS)
    if kept is not None and kept[0] == where:
        return kept[1], kept[2]
    num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
    key_cache, value_cache = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)
    impl.__dict__[_VIEWS] = (where, key_cache, value_cache)
    return key_cache, value_cache


def mode() -> str:
    """EDGE_SELECT_ATTENTION, `cpp` when unset."""
    value = os.environ.get(ENV) or CPP
    if value not in MODES:
        raise ValueError(f"{ENV}: expected one of {', '.join(MODES)}, got {value!r}")
    return value


def install() -> bool:
    """Replace CPUAttentionBackendImpl.forward and .do_kv_cache_update once per process, and in the `cpp` way
    Attention.forward too (attention_cpp.install); True if the methods are in place."""
    if mode() == VLLM:
        return False
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    if getattr(CPUAttentionBackendImpl.forward, _MARK, False):
        return True
    vllm_forward = CPUAttentionBackendImpl.forward
    vllm_update = CPUAttentionBackendImpl.do_kv_cache_update
    encoder = (AttentionType.ENCODER_ONLY, AttentionType.ENCODER)
    attention = torch.ops._C.cpu_attention_with_kv_cache.default
    reshape_and_cache = torch.ops._C.cpu_attn_reshape_and_cache.default

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):  # fmt: skip
        if attn_metadata is None or output_scale is not None or output_block_scale is not None or (
            self.attn_type in encoder
        ):
            return vllm_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                output_block_scale)  # fmt: skip
        key_cache, value_cache = cache_views(self, kv_cache)
        n = attn_metadata.num_actual_tokens
        attention(
            query if query.shape[0] == n else query[:n], key_cache, value_cache,
            output if output.shape[0] == n else output[:n], attn_metadata.query_start_loc, attn_metadata.seq_lens,
            self.scale, attn_metadata.causal, self.alibi_slopes, self.sliding_window, attn_metadata.block_table,
            self.logits_soft_cap, attn_metadata.scheduler_metadata, self.sinks, attn_metadata.dynamic_causal,
            layer._k_scale_float, layer._v_scale_float, self.kv_cache_dtype,
        )  # fmt: skip
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if self.attn_type in encoder:
            return vllm_update(self, layer, key, value, kv_cache, slot_mapping)
        key_cache, value_cache = cache_views(self, kv_cache)
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, self.isa, layer._k_scale_float,
                          layer._v_scale_float, self.kv_cache_dtype)  # fmt: skip
        return None

    for function in (forward, do_kv_cache_update):
        setattr(function, _MARK, True)
    forward.vllm_method = vllm_forward  # type: ignore[attr-defined]
    do_kv_cache_update.vllm_method = vllm_update  # type: ignore[attr-defined]
    CPUAttentionBackendImpl.forward = forward
    CPUAttentionBackendImpl.do_kv_cache_update = do_kv_cache_update
    if mode() == CPP:
        from kernels.vllm_plugin import attention_cpp

        attention_cpp.install()
    return True
