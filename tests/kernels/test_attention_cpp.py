"""The plugin's C++ attention op (kernels/vllm_plugin/attention.cpp, the `cpp` way of attention.py) against vLLM
0.28's own methods, on a real paged cache and vLLM's own C++ kernels, stepped as the engine steps it: the layer
handed over once, each step's metadata pushed before the call and cleared after. The default model's head shapes;
a prompt's prefill in a padded batch, then decode steps. Outputs and the whole cache must equal vLLM's bit for bit.
Outside a step the op must call vLLM's own Python ops for the layer, by its name."""

import pytest
import torch

pytest.importorskip("vllm")

from kernels.vllm_plugin import attention_cpp  # noqa: E402
from tests.kernels.test_attention_plugin import (  # noqa: E402
    BLOCK,
    BLOCKS,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    STEPS,
    _impl,
    _metadata,
    _qkv,
    _run,
)

REASON = attention_cpp.load()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"C++ attention not built here: {REASON}")
LAYER = 5  # an index as the static forward context gives it: not the first


def _run_cpp(steps, group=0):
    ops = torch.ops.edge_attn
    impl = _impl()
    cache = torch.zeros(BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
    ops.forget()
    ops.set_layer(LAYER, group, cache, impl.scale, None, -1, 0.0, None, 1.0, 1.0, "auto", impl.isa)
    outputs = []
    for start, tokens, padded, seed in steps:
        q, k, v = _qkv(padded, seed)
        meta = _metadata(impl.isa, start, tokens, padded)
        out = torch.zeros(padded, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        ops.set_step(group, tokens, True, meta.query_start_loc, meta.seq_lens, meta.block_table,
                     meta.scheduler_metadata, meta.slot_mapping, None)  # fmt: skip
        assert ops.ready_group(LAYER) == group
        ops.attention(q, k, v, out, LAYER)  # the whole padded batch, as the compiled graph passes it
        ops.end_step()
        outputs.append(out[:tokens].clone())
    return outputs, cache


def test_the_op_gives_vllms_outputs_and_cache_bit_for_bit():
    from vllm.v1.attention.backends import cpu_attn

    impl = cpu_attn.CPUAttentionBackendImpl
    vllm_forward = getattr(impl.forward, "vllm_method", impl.forward)
    vllm_update = getattr(impl.do_kv_cache_update, "vllm_method", impl.do_kv_cache_update)
    expected, expected_cache = _run(vllm_forward, vllm_update, STEPS)
    got, cache = _run_cpp(STEPS, group=1)
    assert expected_cache.abs().sum() > 0 and all(o.abs().sum() > 0 for o in expected)  # the kernels ran
    assert torch.equal(cache, expected_cache)
    for i, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(mine, theirs), f"step {i}"
    assert torch.ops.edge_attn.calls() == [len(STEPS), 0]  # every call took the C++ way


def test_a_layer_is_ready_only_inside_a_step_it_was_handed():
    ops = torch.ops.edge_attn
    ops.forget()
    assert ops.ready_group(LAYER) == -1
    cache = torch.zeros(BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
    ops.set_layer(LAYER, 0, cache, 1.0, None, -1, 0.0, None, 1.0, 1.0, "auto", _impl().isa)
    assert ops.ready_group(LAYER) == -1  # no step yet
    meta = _metadata(_impl().isa, 0, 1, 1)
    ops.set_step(0, 1, True, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.scheduler_metadata,
                 meta.slot_mapping, None)  # fmt: skip
    assert ops.ready_group(LAYER) == 0 and ops.ready_group(LAYER + 1) == -1
    ops.end_step()
    assert ops.ready_group(LAYER) == -1
    ops.forget()


def test_outside_a_step_the_op_calls_vllms_ops_for_the_layer_by_name(monkeypatch):
    from vllm.model_executor.layers.attention import attention as vllm_attention

    calls = []

    def update_stand_in(key, value, name):  # stand-in for vLLM's op: records the call
        calls.append(("update", name, key.shape))
        return key.new_empty(0)

    def attention_stand_in(query, key, value, output, name, kv_cache_dummy_dep=None):  # stand-in, records
        calls.append(("attention", name, query.shape))
        output.fill_(1)

    monkeypatch.setattr(vllm_attention, "unified_kv_cache_update", update_stand_in)
    monkeypatch.setattr(vllm_attention, "unified_attention_with_output", attention_stand_in)
    monkeypatch.setitem(attention_cpp._Layers.names, LAYER, "model.layers.5.self_attn.attn")
    torch.ops.edge_attn.forget()
    q, out = torch.zeros(2, HEADS, HEAD_DIM), torch.zeros(2, HEADS, HEAD_DIM)
    k = v = torch.zeros(2, KV_HEADS, HEAD_DIM)
    torch.ops.edge_attn.attention(q, k, v, out, LAYER)
    name = "model.layers.5.self_attn.attn"
    assert calls == [("update", name, k.shape), ("attention", name, q.shape)]
    assert torch.ops.edge_attn.calls() == [0, 1]
    assert torch.equal(out, torch.ones_like(out))

