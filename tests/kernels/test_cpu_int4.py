"""The `cpu_int4` vLLM method without an engine: config, method choice, load -> repack -> apply.

Real SmolLM2-135M shapes: hidden 576, intermediate 1536, vocab 49152 (tied). Quality is SNR against
x @ dequantize(checkpoint).T in fp32; 40 dB is bf16-rounding territory (bf16 alone gives ~50 dB).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.model_executor.layers.linear import (  # noqa: E402
    MergedColumnParallelLinear,
    ReplicatedLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: E402
    ParallelLMHead,
    VocabParallelEmbedding,
)

from edge.errors import InputError  # noqa: E402
from kernels.ops.int4 import dequantize, quantize_packed  # noqa: E402
from kernels.ops.int4_ops import DIRECT, DUAL, KERNEL_ONLY  # noqa: E402
from kernels.ops.int8 import dequantize_int8, quantize_int8  # noqa: E402
from kernels.vllm_plugin.cpu_int4 import (  # noqa: E402
    CpuInt4Config,
    CpuInt4EmbeddingMethod,
    CpuInt4LinearMethod,
    CpuInt8EmbeddingMethod,
    CpuInt8LinearMethod,
    host_params,
)

GROUP = 64
HIDDEN, INTERMEDIATE, VOCAB = 576, 1536, 49152
LAYOUTS = {
    "dual": {"direct_dequant": False, "prefill_dequant": True},
    "direct": {"direct_dequant": True, "prefill_dequant": True},
    "kernel-only": {"direct_dequant": False, "prefill_dequant": False},
}


pytestmark = pytest.mark.usefixtures("single_rank_vllm")


def quant_config(layout: str = "direct", **overrides) -> dict:
    host = host_params()
    return {
        "quant_method": "cpu_int4",
        "bits": 4,
        "group_size": GROUP,
        "dequant_threshold": 2,
        "prefill_dtype": host.prefill_dtype,
        "tinygemm_block": host.block,
        "repack_chunk_rows": host.repack_chunk_rows,
        "quantize_embedding": True,
        "int8": [],
        "ignore": [],
        **LAYOUTS[layout],
        **overrides,
    }


def snr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    noise = (actual.float() - reference.float()).pow(2).sum()
    return float(10 * torch.log10(reference.float().pow(2).sum() / noise))


def checkpoint(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    return quantize_packed(w, GROUP)


def load(layer: torch.nn.Module, tensors: tuple[torch.Tensor, ...], shard=None) -> None:
    for name, tensor in zip(("qweight", "scales", "zeros"), tensors, strict=True):
        param = getattr(layer, name)
        if shard is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard)


def reference(x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    return x.float() @ dequantize(*tensors, GROUP, torch.float32).T


# --- config -------------------------------------------------------------------------------------------------


def test_config_round_trips_the_checkpoint_quantization_config():
    raw = quant_config("direct", dequant_threshold=8, ignore=["model.layers.0.mlp.down_proj"])
    assert CpuInt4Config.from_config(raw).to_dict() == raw


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_config_names_its_layout(layout):
    assert CpuInt4Config.from_config(quant_config(layout)).layout == layout


@pytest.mark.parametrize("field", ["dequant_threshold", "prefill_dtype", "tinygemm_block", "repack_chunk_rows"])
def test_config_without_a_kernel_parameter_takes_the_host_value(field):
    raw = quant_config()
    del raw[field]
    host = host_params()
    expected = {"dequant_threshold": host.dequant_threshold, "prefill_dtype": host.prefill_dtype,
                "tinygemm_block": host.block, "repack_chunk_rows": host.repack_chunk_rows}  # fmt: skip
    assert CpuInt4Config.from_config(raw).to_dict()[field] == expected[field]


def test_a_checkpoint_planned_for_another_tinygemm_block_is_refused_naming_both_blocks():
    other = 96 - host_params().block  # 32 <-> 64
    with pytest.raises(InputError) as error:
        CpuInt4Config.from_config(quant_config(tinygemm_block=other))
    message = str(error.value)
    assert message.startswith("quantization_config.tinygemm_block: expected this host's block")
    assert f"block, {host_params().block} (" in message and message.endswith(f"got {other}")


@pytest.mark.parametrize(
    ("field", "value"),
    [("bits", 8), ("group_size", 100), ("quant_method", "gptq"), ("dequant_threshold", 0), ("prefill_dtype", "fp8"),
     ("repack_chunk_rows", 100)],
)
def test_config_rejects_a_bad_field_by_name(field, value):
    with pytest.raises(InputError) as error:
        CpuInt4Config.from_config(quant_config(**{field: value}))
    assert field in str(error.value)


def test_method_is_registered_with_vllm():
    from vllm.model_executor.layers.quantization import get_quantization_config

    assert get_quantization_config("cpu_int4") is CpuInt4Config


# --- method choice ------------------------------------------------------------------------------------------


def test_linear_layer_gets_the_int4_method():
    config = CpuInt4Config.from_config(quant_config())
    layer = ReplicatedLinear(
        INTERMEDIATE,
        HIDDEN,
        bias=False,
        quant_config=config,
        prefix="model.layers.0.mlp.down_proj",
        disable_tp=True,
    )
    assert isinstance(layer.quant_method, CpuInt4LinearMethod)
    assert layer.qweight.shape == (HIDDEN, INTERMEDIATE // 2)
    assert layer.scales.shape == (HIDDEN, INTERMEDIATE // GROUP)


def test_ignored_linear_layer_stays_unquantized():
    config = CpuInt4Config.from_config(quant_config(ignore=["model.layers.0.mlp.down_proj"]))
    layer = ReplicatedLinear(
        INTERMEDIATE,
        HIDDEN,
        bias=False,
        quant_config=config,
        prefix="model.layers.0.mlp.down_proj",
        disable_tp=True,
    )
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)


def test_linear_layer_whose_n_cannot_pack_stays_unquantized():
    # The converter keeps N % 16 != 0 layers in bf16; the method must expect a bf16 weight for them.
    config = CpuInt4Config.from_config(quant_config())
    layer = ReplicatedLinear(
        HIDDEN, 40, bias=False, quant_config=config, prefix="model.layers.0.mlp.odd", disable_tp=True
    )
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)


@pytest.mark.parametrize("ignore", [["up_proj"], ["model.layers.0.mlp.gate_proj"], ["model.layers.*.mlp.*"]])
def test_fused_layer_is_ignored_when_any_checkpoint_shard_is(ignore):
    # The converter keeps fused siblings together: ignoring up_proj leaves gate_proj bf16 too.
    config = CpuInt4Config.from_config(quant_config())
    layer = MergedColumnParallelLinear(
        HIDDEN,
        [INTERMEDIATE, INTERMEDIATE],
        bias=False,
        quant_config=config,
        prefix="model.layers.0.mlp.gate_up_proj",
        disable_tp=True,
    )
    ignoring = CpuInt4Config.from_config(quant_config(ignore=ignore))
    assert isinstance(ignoring.get_quant_method(layer, "model.layers.0.mlp.gate_up_proj"), UnquantizedLinearMethod)
    assert isinstance(ignoring.get_quant_method(layer, "model.layers.1.self_attn.qkv_proj"), CpuInt4LinearMethod)


def test_embedding_is_quantized_only_when_configured():
    on = CpuInt4Config.from_config(quant_config(quantize_embedding=True))
    off = CpuInt4Config.from_config(quant_config(quantize_embedding=False))
    embedding = VocabParallelEmbedding(VOCAB, HIDDEN, quant_config=on, prefix="model.embed_tokens", disable_tp=True)
    assert isinstance(embedding.quant_method, CpuInt4EmbeddingMethod)
    assert off.get_quant_method(embedding, "model.embed_tokens") is None


def test_tied_head_follows_the_embedding_untied_head_follows_ignore():
    tied = CpuInt4Config.from_config(quant_config(quantize_embedding=False))
    tied.tied_embeddings = True
    head = ParallelLMHead(VOCAB, HIDDEN, quant_config=None, prefix="lm_head", disable_tp=True)
    assert tied.get_quant_method(head, "lm_head") is None
    untied = CpuInt4Config.from_config(quant_config(quantize_embedding=False))
    assert isinstance(untied.get_quant_method(head, "lm_head"), CpuInt4EmbeddingMethod)
    ignored = CpuInt4Config.from_config(quant_config(quantize_embedding=False, ignore=["lm_head"]))
    assert ignored.get_quant_method(head, "lm_head") is None


def test_tied_embedding_stays_bf16_when_the_head_is_ignored():
    config = CpuInt4Config.from_config(quant_config(quantize_embedding=True, ignore=["lm_head"]))
    config.tied_embeddings = True
    embedding = VocabParallelEmbedding(VOCAB, HIDDEN, quant_config=None, prefix="", disable_tp=True)
    assert config.get_quant_method(embedding, "") is None


# --- load, repack, apply ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rows", [1, 64])
def test_down_proj_576x1536_matches_dequantized_reference(layout, rows):
    config = CpuInt4Config.from_config(quant_config(layout))
    layer = ReplicatedLinear(
        INTERMEDIATE,
        HIDDEN,
        bias=False,
        quant_config=config,
        prefix="model.layers.0.mlp.down_proj",
        disable_tp=True,
    )
    tensors = checkpoint(HIDDEN, INTERMEDIATE)
    load(layer, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(rows, INTERMEDIATE, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = layer.quant_method.apply(layer, x)
    assert y.shape == (rows, HIDDEN) and y.dtype == torch.bfloat16
    assert snr_db(y, reference(x, *tensors)) > 40


@pytest.mark.parametrize(
    ("layout", "mode", "keeps_copy"),
    [("dual", DUAL, True), ("direct", DIRECT, False), ("kernel-only", KERNEL_ONLY, False)],
)
def test_repack_keeps_the_row_major_copy_only_for_dual(layout, mode, keeps_copy):
    config = CpuInt4Config.from_config(quant_config(layout))
    layer = ReplicatedLinear(
        INTERMEDIATE,
        HIDDEN,
        bias=False,
        quant_config=config,
        prefix="model.layers.0.mlp.down_proj",
        disable_tp=True,
    )
    load(layer, checkpoint(HIDDEN, INTERMEDIATE))
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.int4_mode == mode
    assert (layer.qweight.numel() > 0) == keeps_copy
    assert layer.tinygemm_packed.shape == (HIDDEN, INTERMEDIATE // 2)
    assert layer.tinygemm_sz.shape == (INTERMEDIATE // GROUP, HIDDEN, 2)


def test_direct_layer_whose_n_does_not_tile_the_block_falls_back_to_dual():
    # N=48 packs (48 % 16 == 0) but does not tile a 32/64-channel block: the direct reader would mis-read it.
    config = CpuInt4Config.from_config(quant_config("direct"))
    layer = ReplicatedLinear(
        HIDDEN, 48, bias=False, quant_config=config, prefix="model.layers.0.narrow", disable_tp=True
    )
    tensors = checkpoint(48, HIDDEN)
    load(layer, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.int4_mode == DUAL
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert snr_db(layer.quant_method.apply(layer, x), reference(x, *tensors)) > 40


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fused_gate_up_loads_each_shard_into_its_rows(layout):
    config = CpuInt4Config.from_config(quant_config(layout))
    layer = MergedColumnParallelLinear(
        HIDDEN,
        [INTERMEDIATE, INTERMEDIATE],
        bias=False,
        quant_config=config,
        prefix="model.layers.0.mlp.gate_up_proj",
        disable_tp=True,
    )
    gate, up = checkpoint(INTERMEDIATE, HIDDEN, seed=3), checkpoint(INTERMEDIATE, HIDDEN, seed=4)
    load(layer, gate, shard=0)
    load(layer, up, shard=1)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    expected = torch.cat((reference(x, *gate), reference(x, *up)), dim=1)  # [64, 2 * 1536]
    assert snr_db(layer.quant_method.apply(layer, x), expected) > 40


def test_linear_adds_bias():
    config = CpuInt4Config.from_config(quant_config())
    layer = ReplicatedLinear(
        HIDDEN,
        HIDDEN,
        bias=True,
        quant_config=config,
        prefix="model.layers.0.self_attn.o_proj",
        disable_tp=True,
    )
    tensors = checkpoint(HIDDEN, HIDDEN)
    load(layer, tensors)
    layer.bias.data.copy_(torch.linspace(-1, 1, HIDDEN))
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    y = layer(x)[0]
    assert snr_db(y, reference(x, *tensors) + layer.bias.detach().float()) > 40


def tied_pair(layout: str) -> tuple[VocabParallelEmbedding, ParallelLMHead, tuple[torch.Tensor, ...]]:
    config = CpuInt4Config.from_config(quant_config(layout, quantize_embedding=True))
    config.tied_embeddings = True
    embedding = VocabParallelEmbedding(VOCAB, HIDDEN, quant_config=config, prefix="model.embed_tokens", disable_tp=True)
    head = ParallelLMHead(VOCAB, HIDDEN, quant_config=config, prefix="lm_head", disable_tp=True)
    head = head.tie_weights(embedding)
    tensors = checkpoint(VOCAB, HIDDEN, seed=7)
    load(embedding, tensors)
    for module in (embedding, head):  # vLLM's order: model.embed_tokens comes before lm_head
        module.quant_method.process_weights_after_loading(module)
    return embedding, head, tensors


def test_quantized_embedding_lookup_dequantizes_the_gathered_rows():
    embedding, _, tensors = tied_pair("direct")
    ids = torch.tensor([0, 5, 49151, 5])
    expected = dequantize(*tensors, GROUP)[ids]  # [4, 576]
    assert torch.equal(embedding(ids), expected)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tied_head_runs_tinygemm_on_the_shared_weights(layout):
    embedding, head, tensors = tied_pair(layout)
    assert head.qweight is embedding.qweight  # one row-major copy, shared
    assert head.int4_mode == DUAL  # the lookup keeps the copy anyway
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    logits = head.quant_method.apply(head, x)
    assert logits.shape == (1, VOCAB)
    assert snr_db(logits, reference(x, *tensors)) > 40


# --- the 8-bit set ------------------------------------------------------------------------------------------


def int8_tied_pair(seqs_threshold: int = 2):
    config = CpuInt4Config.from_config(quant_config(int8=["embed_tokens", "lm_head"], dequant_threshold=seqs_threshold))
    config.tied_embeddings = True
    embedding = VocabParallelEmbedding(VOCAB, HIDDEN, quant_config=config, prefix="model.embed_tokens", disable_tp=True)
    head = ParallelLMHead(VOCAB, HIDDEN, quant_config=config, prefix="lm_head", disable_tp=True)
    head = head.tie_weights(embedding)
    w = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(9)) * 0.02
    qweight, scales = quantize_int8(w)
    for name, tensor in (("qweight", qweight), ("scales", scales)):
        getattr(embedding, name).weight_loader(getattr(embedding, name), tensor)
    for module in (embedding, head):
        module.quant_method.process_weights_after_loading(module)
    return embedding, head, qweight, scales


def test_the_8_bit_set_gives_the_embedding_and_the_tied_head_one_int8_copy():
    embedding, head, qweight, scales = int8_tied_pair()
    assert isinstance(embedding.quant_method, CpuInt8EmbeddingMethod)
    assert head.qweight is embedding.qweight and head.qweight.dtype == torch.int8  # [V, H], shared
    ids = torch.tensor([0, 5, 49151, 5])
    assert torch.equal(embedding(ids), dequantize_int8(qweight, scales)[ids])


@pytest.mark.parametrize("rows", [1, 4])  # int8 GEMM below the threshold (4), dequantize + bf16 GEMM at it
def test_int8_head_matches_the_dequantized_reference(rows):
    _, head, qweight, scales = int8_tied_pair(seqs_threshold=4)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    logits = head.quant_method.apply(head, x)
    assert logits.shape == (rows, VOCAB)
    assert snr_db(logits, x.float() @ dequantize_int8(qweight, scales, torch.float32).T) > 40


def test_a_linear_in_the_8_bit_set_gets_the_int8_method_and_its_fused_siblings_follow():
    config = CpuInt4Config.from_config(quant_config(int8=["model.layers.0.mlp.up_proj"]))
    layer = MergedColumnParallelLinear(
        HIDDEN, [INTERMEDIATE] * 2, bias=False, quant_config=config, prefix="model.layers.0.mlp.gate_up_proj",
        disable_tp=True,
    )  # fmt: skip
    assert isinstance(layer.quant_method, CpuInt8LinearMethod)  # gate_proj widened to int8 with up_proj
    assert "up_proj" in config._linear_decision(layer, "model.layers.0.mlp.gate_up_proj").why


# --- compile cache fix --------------------------------------------------------------------------------------


def test_compile_cache_fix_gives_a_plain_compiled_function_a_noop_finalize_loading():
    from types import SimpleNamespace

    from kernels.vllm_plugin.compile_cache import attach_finalize_loading

    def compiled_fn(*args):  # what vLLM 0.28's CPU AOT artifact holds: a plain function
        return args

    loaded = SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=compiled_fn))
    assert attach_finalize_loading(loaded)
    assert loaded._artifacts.compiled_fn.finalize_loading(object()) is None


def test_compile_cache_fix_leaves_vllms_own_finalize_loading_alone():
    from types import SimpleNamespace

    from kernels.vllm_plugin.compile_cache import attach_finalize_loading

    def finalize_loading(vllm_config):
        return "vllm's"

    compiled_fn = SimpleNamespace(finalize_loading=finalize_loading)
    assert not attach_finalize_loading(SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=compiled_fn)))
    assert compiled_fn.finalize_loading(None) == "vllm's"


def test_compile_cache_fix_is_needed_by_this_vllm_and_installs_once(monkeypatch):
    import kernels.vllm_plugin.compile_cache as compile_cache

    assert compile_cache.needed()  # vLLM 0.28's _try_load_aot_compiled_fn calls finalize_loading
    original = torch.compiler.load_compiled_function
    monkeypatch.setattr(torch.compiler, "load_compiled_function", original)
    assert compile_cache.install() and compile_cache.install()
    patched = torch.compiler.load_compiled_function
    assert getattr(patched, "_edge_select_finalize_fix", False)
    assert patched.__wrapped__ in (original, getattr(original, "__wrapped__", None))


def test_compile_cache_fix_can_be_switched_off(monkeypatch):
    import kernels.vllm_plugin.compile_cache as compile_cache

    monkeypatch.setenv("EDGE_SELECT_COMPILE_CACHE_FIX", "0")
    assert not compile_cache.install()


def test_the_engines_fresh_api_key_is_not_a_compile_cache_factor(monkeypatch):
    """Each engine start gets a random VLLM_API_KEY (server/supervisor/supervisor.py); vLLM 0.28 hashes it into the
    compile cache's key unless the plugin drops it, and every start then recompiled."""
    from vllm import envs

    from kernels.vllm_plugin.compile_cache import install_factors_fix

    assert install_factors_fix() and install_factors_fix()  # idempotent
    monkeypatch.setenv("VLLM_API_KEY", "one")
    first = envs.compile_factors()
    monkeypatch.setenv("VLLM_API_KEY", "another")
    assert "VLLM_API_KEY" not in first and envs.compile_factors() == first
    monkeypatch.setenv("VLLM_FLOAT32_MATMUL_PRECISION", "medium")  # a factor that is not dropped still counts
    assert envs.compile_factors()["VLLM_FLOAT32_MATMUL_PRECISION"] != first["VLLM_FLOAT32_MATMUL_PRECISION"]


def test_prefetched_inductor_keys_are_the_keys_torch_computes():
    """compile_cache.prefetch_keys starts torch_key and triton_key in torch's background pool; what the engine then
    reads is what torch computes itself (a fresh process, so neither was cached before)."""
    import subprocess
    import sys

    code = """
from torch._inductor import codecache
from kernels.vllm_plugin.compile_cache import prefetch_keys
print(prefetch_keys())
prefetched = (codecache.torch_key(), codecache.triton_key())
codecache.torch_key.clear(); codecache.triton_key.clear()
print(prefetched == (codecache.torch_key(), codecache.triton_key()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2], check=True).stdout.split("\n")
    assert out[:2] == ["['torch_key', 'triton_key']", "True"], out


# --- a GGUF's own Q4_K blocks (quantization_config.q4k, kernels/ops/q4k.py) ------------------------------------------


def q4k_config(layout: str = "direct", q4k: tuple[str, ...] = ("o_proj", "gate_proj", "up_proj")) -> dict:
    return quant_config(layout, group_size=32, decode_kernel="avx2-w4a8", q4k=list(q4k))


def q4k_blocks(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.ops import q4k
    from tests.kernels.test_q4k import random_blocks

    return q4k.from_blocks(random_blocks(n, k, seed))


def load_blocks(layer: torch.nn.Module, tensors: tuple[torch.Tensor, torch.Tensor], shard=None) -> None:
    for name, tensor in zip(("qweight", "meta"), tensors, strict=True):
        param = getattr(layer, name)
        param.weight_loader(param, tensor, *(() if shard is None else (shard,)))


def test_the_config_refuses_blocks_for_a_kernel_that_does_not_read_them():
    assert CpuInt4Config.from_config(q4k_config()).to_dict()["q4k"] == ["o_proj", "gate_proj", "up_proj"]
    with pytest.raises(InputError, match=r"quantization_config\.q4k.*unless decode_kernel reads a GGUF.s own"):
        CpuInt4Config.from_config({**q4k_config(), "decode_kernel": "avx2"})


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_layer_of_q4_k_blocks_decodes_on_them_and_prefills_on_them_or_their_grid(layout):
    from kernels.ops import q4k
    from kernels.vllm_plugin.cpu_int4 import CpuQ4kLinearMethod

    config = CpuInt4Config.from_config(q4k_config(layout))
    layer = ReplicatedLinear(HIDDEN * 4, HIDDEN, bias=False, quant_config=config,
                             prefix="model.layers.0.self_attn.o_proj", disable_tp=True)  # fmt: skip
    assert isinstance(layer.quant_method, CpuQ4kLinearMethod)
    blocks = q4k_blocks(HIDDEN, HIDDEN * 4, seed=8)
    load_blocks(layer, blocks)
    layer.quant_method.process_weights_after_loading(layer)
    assert not hasattr(layer, "meta") and layer.zeros.numel() == 0
    assert layer.int4_mode == (KERNEL_ONLY if layout == "kernel-only" else DIRECT)  # no bf16 grid kept for dual
    reference = lambda x: x.float() @ q4k.dequantize(*blocks).t()  # noqa: E731
    wide = torch.randn(64, HIDDEN * 4, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    assert snr_db(layer.quant_method.apply(layer, wide), reference(wide)) > 35  # dequantized, or tinygemm's grid
    one = wide[:1]
    if config.avx2_rows and layout == "direct":  # the blocks alone: wide batches dequantize them
        assert layer.tinygemm_packed.numel() == 0
        dtype = torch.float32 if config.prefill_dtype == "float32" else torch.bfloat16
        expected = torch.mm(wide.to(dtype), q4k.dequantize(*blocks).to(dtype).t()).to(torch.bfloat16)
        assert torch.equal(layer.quant_method.apply(layer, wide), expected)
    elif config.avx2_rows:
        assert layer.tinygemm_packed.shape == (HIDDEN, HIDDEN * 2)
    if config.avx2_rows:  # the blocks in the decode layout, read by q4k_linear
        assert layer.scales.dtype == torch.uint8 and layer.qweight.dim() == 3
        assert torch.equal(layer.quant_method.apply(layer, one), q4k.linear(one, *q4k.decode_layout(*blocks)))
    else:  # no AVX2 kernel here: tinygemm for every row, no decode copy
        assert layer.qweight.numel() == 0
    assert snr_db(layer.quant_method.apply(layer, one), reference(one)) > 30


def test_a_fused_layer_of_q4_k_blocks_loads_each_shard_into_its_rows():
    from kernels.ops import q4k

    config = CpuInt4Config.from_config(q4k_config())
    layer = MergedColumnParallelLinear(HIDDEN * 4, [INTERMEDIATE, INTERMEDIATE], bias=False, quant_config=config,
                                       prefix="model.layers.0.mlp.gate_up_proj", disable_tp=True)  # fmt: skip
    gate, up = q4k_blocks(INTERMEDIATE, HIDDEN * 4, seed=10), q4k_blocks(INTERMEDIATE, HIDDEN * 4, seed=11)
    load_blocks(layer, gate, shard=0)
    load_blocks(layer, up, shard=1)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(1, HIDDEN * 4, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    expected = torch.cat([x.float() @ q4k.dequantize(*gate).t(), x.float() @ q4k.dequantize(*up).t()], dim=1)
    assert snr_db(layer.quant_method.apply(layer, x), expected) > 30


def test_a_fused_layer_with_one_shard_off_the_blocks_keeps_the_grid():
    config = CpuInt4Config.from_config(q4k_config(q4k=("gate_proj",)))  # up_proj is not named
    layer = MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE, INTERMEDIATE], bias=False, quant_config=config,
                                       prefix="model.layers.0.mlp.gate_up_proj", disable_tp=True)  # fmt: skip
    assert type(layer.quant_method) is CpuInt4LinearMethod and hasattr(layer, "scales")


# --- the 8-bit set's weights as a GGUF's own Q6_K blocks (quantization_config.q6k, kernels/ops/q6k.py) -------------


def q6k_config(**overrides) -> dict:
    return quant_config("direct", **{"group_size": 32, "decode_kernel": "avx2-w4a8", "int8": ["down_proj", "lm_head"],
                                     "int8_group_size": 16, "q6k": ["down_proj", "lm_head"], **overrides})


def q6k_raw(n: int, k: int, seed: int) -> torch.Tensor:
    from tests.kernels.test_q6k import random_blocks

    return torch.from_numpy(random_blocks(n, k, seed).reshape(n, -1))


def test_a_q6_k_linear_decodes_on_its_blocks_and_dequantizes_wide_batches():
    from kernels.ops import q6k
    from kernels.vllm_plugin.cpu_int4 import CpuBlocksLinearMethod

    config = CpuInt4Config.from_config(q6k_config())
    assert config.to_dict()["q6k"] == ["down_proj", "lm_head"]
    layer = ReplicatedLinear(HIDDEN * 4, HIDDEN, bias=False, quant_config=config,
                             prefix="model.layers.0.mlp.down_proj", disable_tp=True)  # fmt: skip
    assert isinstance(layer.quant_method, CpuBlocksLinearMethod) and layer.quant_method.blocks == "Q6_K"
    raw = q6k_raw(HIDDEN, HIDDEN * 4, seed=13)
    layer.blocks.weight_loader(layer.blocks, raw)
    layer.quant_method.process_weights_after_loading(layer)
    codes = q6k.from_blocks(raw.numpy().reshape(HIDDEN, -1, 210))
    assert torch.equal(layer.blocks, q6k.decode_layout(*codes))
    w = q6k.dequantize(*codes)
    x = torch.randn(64, HIDDEN * 4, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    assert snr_db(layer.quant_method.apply(layer, x), x.float() @ w.t()) > 35  # 64 rows: dequantized, bf16 GEMM
    one = x[:1]
    if config.int8_rows:  # the 8-bit set's rows on the AVX2 kernels: q6k_linear
        assert torch.equal(layer.quant_method.apply(layer, one), q6k.linear(one, layer.blocks))
    assert snr_db(layer.quant_method.apply(layer, one), one.float() @ w.t()) > 30


def test_an_untied_q6_k_head_runs_its_blocks():
    from kernels.ops import q6k
    from kernels.vllm_plugin.cpu_int4 import CpuBlocksHeadMethod

    config = CpuInt4Config.from_config(q6k_config())
    head = ParallelLMHead(VOCAB // 16, HIDDEN * 4, quant_config=config, prefix="lm_head", disable_tp=True)
    assert isinstance(head.quant_method, CpuBlocksHeadMethod) and head.quant_method.blocks == "Q6_K"
    raw = q6k_raw(VOCAB // 16, HIDDEN * 4, seed=15)
    head.blocks.weight_loader(head.blocks, raw)
    head.quant_method.process_weights_after_loading(head)
    w = q6k.dequantize(*q6k.from_blocks(raw.numpy().reshape(VOCAB // 16, -1, 210)))
    x = torch.randn(1, HIDDEN * 4, generator=torch.Generator().manual_seed(16)).to(torch.bfloat16)
    assert snr_db(head.quant_method.apply(head, x), x.float() @ w.t()) > 30


def test_the_config_refuses_q6_k_blocks_for_a_kernel_that_does_not_read_them():
    with pytest.raises(InputError, match=r"quantization_config\.q6k.*reads a GGUF's own blocks"):
        CpuInt4Config.from_config(q6k_config(decode_kernel="avx2"))


# --- the 8-bit set's weights as a GGUF's own Q8_0 and Q5_0 blocks (quantization_config.q8_0, q5_0; kernels/ops/g32.py)


def g32_raw(type_name: str, n: int, k: int, seed: int) -> torch.Tensor:
    from tests.kernels.test_g32 import random_blocks

    return torch.from_numpy(random_blocks(type_name, n, k, seed).reshape(n, -1))


@pytest.mark.parametrize("type_name, key", [("Q5_0", "q5_0"), ("Q8_0", "q8_0")])
def test_a_fused_layer_of_q8_0_or_q5_0_blocks_loads_each_shard_and_decodes_on_its_blocks(type_name, key):
    """gate_up_proj's shards load as byte rows of one `blocks` tensor; decode rows run the C++ front
    (edge_avx2::blocks_linear: the type's kernel), wider batches the dequantized GEMM."""
    from kernels.ops import g32
    from kernels.vllm_plugin.cpu_int4 import CpuBlocksLinearMethod

    config = CpuInt4Config.from_config(quant_config("direct", group_size=32, decode_kernel="avx2-w4a8",
                                                    int8=["gate_proj", "up_proj"], int8_group_size=32,
                                                    **{key: ["gate_proj", "up_proj"]}))  # fmt: skip
    assert config.to_dict()[key] == ["gate_proj", "up_proj"]
    layer = MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE, INTERMEDIATE], bias=False, quant_config=config,
                                       prefix="model.layers.0.mlp.gate_up_proj", disable_tp=True)  # fmt: skip
    assert isinstance(layer.quant_method, CpuBlocksLinearMethod) and layer.quant_method.blocks == type_name
    gate, up = g32_raw(type_name, INTERMEDIATE, HIDDEN, seed=21), g32_raw(type_name, INTERMEDIATE, HIDDEN, seed=22)
    layer.blocks.weight_loader(layer.blocks, gate, 0)
    layer.blocks.weight_loader(layer.blocks, up, 1)
    layer.quant_method.process_weights_after_loading(layer)
    size = g32.kind(type_name).bytes
    codes = g32.from_blocks(type_name, torch.cat([gate, up]).numpy().reshape(2 * INTERMEDIATE, -1, size))
    assert torch.equal(layer.blocks, g32.decode_layout(type_name, *codes))
    w = g32.dequantize(*codes)
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(23)).to(torch.bfloat16)
    assert snr_db(layer.quant_method.apply(layer, x), x.float() @ w.t()) > 35  # 64 rows: dequantized, bf16 GEMM
    one = x[:1]
    if config.int8_rows:  # the 8-bit set's rows on the AVX2 kernels
        assert torch.equal(layer.quant_method.apply(layer, one), g32.linear(one, layer.blocks))
    assert snr_db(layer.quant_method.apply(layer, one), one.float() @ w.t()) > 30


def test_the_config_refuses_an_own_block_key_it_does_not_know_and_blocks_for_the_int16_kernel():
    with pytest.raises(InputError, match=r"quantization_config\.q5_0.*reads a GGUF's own blocks"):
        CpuInt4Config.from_config(quant_config("direct", decode_kernel="avx2", int8=["o_proj"], q5_0=["o_proj"]))
    with pytest.raises(InputError, match=r"quantization_config: expected one of .*got .q4_0."):
        CpuInt4Config(own_blocks={"q4_0": ["o_proj"]}, decode_kernel="avx2-w4a8")


# --- the direct layout with an AVX2 decode kernel: the decode copy alone (edge.formats.tinygemm decode_copy_only) -----


@pytest.mark.parametrize("decode_kernel", ["avx2-w4a8", "avx2"])
def test_a_direct_layer_with_an_avx2_decode_kernel_keeps_its_weights_once(decode_kernel):
    """Batches below the dequant threshold run the decode kernel (tinygemm's, before); wider ones dequantize the
    decode copy, as the plan's prefill dtype, and run the GEMM."""
    from kernels.ops import avx2_int4

    config = CpuInt4Config.from_config(quant_config("direct", group_size=32, decode_kernel=decode_kernel,
                                                    dequant_threshold=64))  # fmt: skip
    if not config.avx2_rows:
        pytest.skip("the AVX2 extension does not build on this host: the layer keeps tinygemm, as before")
    layer = MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, bias=False, quant_config=config,
                                       disable_tp=True)  # fmt: skip
    gate, up = (quantize_packed(torch.randn(INTERMEDIATE, HIDDEN, generator=torch.Generator().manual_seed(s)) * 0.02,
                                32) for s in (1, 2))  # fmt: skip
    load(layer, gate, 0)
    load(layer, up, 1)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.tinygemm_packed.numel() == 0 and layer.tinygemm_sz.numel() == 0
    tensors = [torch.cat(parts) for parts in zip(gate, up, strict=True)]
    dtype = torch.float32 if config.prefill_dtype == "float32" else torch.bfloat16
    w = dequantize(*tensors, 32, dtype)  # [2 x 1536, 576], as the plan's prefill dtype
    for rows in (config.avx2_rows + 1, 63):  # past the decode rows, below the threshold: the decode kernel
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        kernel = avx2_int4.linear(x, layer.qweight, layer.scales, layer.zeros, 32, config.avx2_bits)
        assert torch.equal(layer.quant_method.apply(layer, x), kernel), rows
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(64)).to(torch.bfloat16)
    assert torch.equal(layer.quant_method.apply(layer, x), torch.mm(x.to(dtype), w.t()).to(torch.bfloat16))


def test_a_dual_layer_keeps_its_tinygemm_buffer_beside_the_decode_copy():
    config = CpuInt4Config.from_config(quant_config("dual", group_size=32, decode_kernel="avx2-w4a8"))
    layer = ReplicatedLinear(HIDDEN, HIDDEN, bias=False, quant_config=config, disable_tp=True)
    load(layer, quantize_packed(torch.randn(HIDDEN, HIDDEN) * 0.02, 32))
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.tinygemm_packed.shape == (HIDDEN, HIDDEN // 2)
