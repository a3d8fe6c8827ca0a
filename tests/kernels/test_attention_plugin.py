"""The plugin's CPU attention methods (kernels/vllm_plugin/attention.py) against vLLM 0.28's own, on a real paged
cache and vLLM's own C++ kernels: the default model's head shapes (9 query heads, 3 KV heads, head_dim 64), one
prompt's prefill and then decode steps, the cache written by the KV update and read back by the attention. Both
methods run on copies of the same state; every output and the whole cache must be equal bit for bit."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends import cpu_attn  # noqa: E402

from kernels.vllm_plugin import attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS = 9, 3, 64, 32, 8


@pytest.fixture(scope="module")
def methods():
    """(vLLM's forward, vLLM's update, the plugin's forward, the plugin's update)."""
    assert attention.install()
    impl = cpu_attn.CPUAttentionBackendImpl
    return impl.forward.vllm_method, impl.do_kv_cache_update.vllm_method, impl.forward, impl.do_kv_cache_update


def _impl():
    isa = cpu_attn._get_attn_isa(torch.bfloat16, BLOCK, HEAD_DIM, "auto")
    return SimpleNamespace(attn_type=AttentionType.DECODER, scale=HEAD_DIM**-0.5, alibi_slopes=None, sliding_window=-1,
                           logits_soft_cap=0, sinks=None, kv_cache_dtype="auto", isa=isa)  # fmt: skip


def _metadata(isa: str, start: int, tokens: int, padded: int) -> SimpleNamespace:
    """One request whose tokens [start, start + tokens) run now; `padded` rows in the batch tensors."""
    query_start_loc = torch.tensor([0, tokens], dtype=torch.int32)
    seq_lens = torch.tensor([start + tokens], dtype=torch.int32)
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=seq_lens,
        dtype=torch.bfloat16, query_start_loc=query_start_loc, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False,
    )  # fmt: skip
    slots = torch.full((padded,), -1, dtype=torch.int64)
    slots[:tokens] = torch.arange(start, start + tokens) + BLOCK  # the request's blocks are 1, 2, ...
    return SimpleNamespace(num_actual_tokens=tokens, query_start_loc=query_start_loc, seq_lens=seq_lens,
                           block_table=torch.arange(1, BLOCKS, dtype=torch.int32)[None, :], causal=True,
                           scheduler_metadata=scheduler, dynamic_causal=None, slot_mapping=slots)  # fmt: skip


def _qkv(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's query, key and value: `rows` rows of random bf16, the same for every method given the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(rows, h, HEAD_DIM, generator=generator).to(torch.bfloat16)
                 for h in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip


def _run(forward, update, steps):
    impl = _impl()
    layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)
    cache = torch.zeros(BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
    outputs = []
    for start, tokens, padded, seed in steps:
        q, k, v = _qkv(padded, seed)
        meta = _metadata(impl.isa, start, tokens, padded)
        update(impl, layer, k[:tokens], v[:tokens], cache, meta.slot_mapping[:tokens])
        out = torch.zeros(padded, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        forward(impl, layer, q, k, v, cache, meta, out)
        outputs.append(out[:tokens].clone())
    return outputs, cache


# a 20-token prompt in a batch padded to 24 rows, then 40 decode steps (the second block fills; a padded one too)
STEPS = [(0, 20, 24, 0)] + [(20 + i, 1, 2 if i % 7 == 0 else 1, i + 1) for i in range(40)]


def test_the_plugins_methods_give_vllms_outputs_and_cache_bit_for_bit(methods):
    vllm_forward, vllm_update, lean_forward, lean_update = methods
    expected, expected_cache = _run(vllm_forward, vllm_update, STEPS)
    got, cache = _run(lean_forward, lean_update, STEPS)
    assert expected_cache.abs().sum() > 0 and all(o.abs().sum() > 0 for o in expected)  # the kernels ran
    assert torch.equal(cache, expected_cache)
    for i, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(mine, theirs), f"step {i}"


def test_the_cache_views_are_kept_per_cache_tensor():
    impl = SimpleNamespace()
    cache = torch.zeros(BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM)
    key, value = attention.cache_views(impl, cache)
    assert key.shape == value.shape == (BLOCKS, KV_HEADS, BLOCK, HEAD_DIM)
    assert attention.cache_views(impl, cache)[0] is key  # kept
    other = torch.zeros_like(cache)
    assert attention.cache_views(impl, other)[0].data_ptr() == other.data_ptr()  # a new cache, new views


def test_warm_up_calls_and_encoder_attention_go_to_vllms_methods(methods):
    _, _, lean_forward, lean_update = methods
    out = torch.ones(1)
    # no metadata (vLLM's warm-up): vLLM's forward returns the output untouched
    assert lean_forward(_impl(), None, None, None, None, None, None, out) is out
    encoder = _impl()
    encoder.attn_type = AttentionType.ENCODER_ONLY
    assert lean_update(encoder, None, None, None, None, None) is None  # vLLM's: an encoder writes no cache here


def test_edge_select_attention_vllm_leaves_vllms_methods(monkeypatch):
    monkeypatch.setenv(attention.ENV, attention.VLLM)
    assert attention.install() is False
