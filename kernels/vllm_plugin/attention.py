"""vLLM 0.28's CPU attention with less Python per layer and step (issue 42 part 2: the step's own cost).

Every decode step calls `CPUAttentionBackendImpl.do_kv_cache_update` and `.forward` once per layer (60 calls for
the default model). Each call re-derives the key and value cache views from the layer's cache tensor (`size`,
`view`, `chunk`), slices the query and the output even when nothing is cut, and reaches the C++ op through
`vllm._custom_ops`' wrapper and torch's op packet, which resolves the overload per call. The replacements here keep
the two views per layer (keyed by the cache's address, shape and strides, so a new or moved cache makes new views),
cut only when padding exists, and call the ops' `.default` overloads with the same arguments in the same order: the
same kernels on the same tensors, so the same results (tests/kernels/test_attention_plugin.py checks both against
vLLM's own methods on a real cache; tests/kernels/test_decode_plugin_slow.py the engine's greedy text).

Encoder attention (its own cache path), fused output quantization and warm-up calls without metadata go to vLLM's
methods as they were. EDGE_SELECT_ATTENTION=vllm leaves vLLM's methods in place (benchmarks compare the two).
"""

from __future__ import annotations

import os
from typing import Any

import torch

ENV = "EDGE_SELECT_ATTENTION"
VLLM = "vllm"
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


def install() -> bool:
    """Replace CPUAttentionBackendImpl.forward and .do_kv_cache_update once per process; True if in place."""
    if os.environ.get(ENV) == VLLM:
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
    return True
