"""kernels/vllm_plugin/layer_table.py: linear layers (int4, int8, a GGUF's blocks) called by an index into a table the
C++ extension holds, not with their tensors. The real engine (its compiled graph, the same greedy text with and
without the table) is tests/kernels/test_decode_plugin_slow.py."""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.linear import ReplicatedLinear  # noqa: E402

from kernels.ops import avx2_int4  # noqa: E402
from kernels.ops.int4 import quantize_packed  # noqa: E402
from kernels.ops.int4_ops import int4_linear  # noqa: E402
from kernels.vllm_plugin import layer_table  # noqa: E402
from kernels.vllm_plugin.cpu_int4 import CpuInt4Config, host_params  # noqa: E402

HIDDEN, INTERMEDIATE = 576, 1536

pytestmark = [pytest.mark.usefixtures("single_rank_vllm"),
              pytest.mark.skipif(avx2_int4.load() is not None, reason="the AVX2 extension does not build here")]


def config(decode_kernel: str = "avx2-w4a8") -> CpuInt4Config:
    host = host_params()
    return CpuInt4Config.from_config({
        "quant_method": "cpu_int4", "bits": 4, "group_size": 32, "dequant_threshold": 2,
        "prefill_dtype": host.prefill_dtype, "tinygemm_block": host.block, "repack_chunk_rows": host.repack_chunk_rows,
        "quantize_embedding": True, "int8": [], "ignore": [], "direct_dequant": True, "prefill_dequant": True,
        "decode_kernel": decode_kernel,
    })  # fmt: skip


def loaded_layer(n: int, k: int, seed: int, cfg: CpuInt4Config) -> ReplicatedLinear:
    layer = ReplicatedLinear(k, n, bias=False, quant_config=cfg, prefix=f"model.layers.{seed}.mlp.down_proj",
                             disable_tp=True)  # fmt: skip
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    for name, tensor in zip(("qweight", "scales", "zeros"), quantize_packed(w, 32), strict=True):
        getattr(layer, name).weight_loader(getattr(layer, name), tensor)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def with_tensors(layer: ReplicatedLinear, cfg: CpuInt4Config, x: torch.Tensor) -> torch.Tensor:
    return int4_linear(x, layer.tinygemm_packed, layer.tinygemm_sz, layer.qweight, layer.scales, layer.zeros,
                       cfg.group_size, layer.int4_mode, cfg.dequant_threshold, cfg.prefill_dtype == "float32",
                       cfg.avx2_rows, cfg.avx2_bits)  # fmt: skip


@pytest.mark.parametrize("rows", [1, 3, 64])  # decode rows in C++, and a batch the Python op takes
def test_a_layer_called_by_its_index_gives_what_its_tensors_give_bit_for_bit(rows):
    cfg = config()
    with set_current_vllm_config(VllmConfig()):
        down = loaded_layer(HIDDEN, INTERMEDIATE, 0, cfg)
        up = loaded_layer(INTERMEDIATE, HIDDEN, 1, cfg)
    assert (layer_table.index_of(down), layer_table.index_of(up)) == (0, 1)  # in the order they finished loading
    x = torch.randn(rows, INTERMEDIATE, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y = down.quant_method.apply(down, x)
    assert y.shape == (rows, HIDDEN) and torch.equal(y, with_tensors(down, cfg, x))
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert torch.equal(up.quant_method.apply(up, x), with_tensors(up, cfg, x))


def test_a_new_engine_starts_the_table_over():
    cfg = config()
    with set_current_vllm_config(VllmConfig()):
        loaded_layer(HIDDEN, INTERMEDIATE, 0, cfg)
        loaded_layer(HIDDEN, INTERMEDIATE, 1, cfg)
    assert torch.ops.edge_avx2.layer_count() == 2
    with set_current_vllm_config(VllmConfig()):  # another engine: another static forward context
        layer = loaded_layer(HIDDEN, INTERMEDIATE, 2, cfg)
    assert layer_table.index_of(layer) == 0 and torch.ops.edge_avx2.layer_count() == 1


def eight_bit_layer(kind: str, seed: int) -> ReplicatedLinear:
    """An 8-bit-set down_proj: int8 per group of 32, or a GGUF's Q8_0 blocks."""
    extra = {"int8": ["down_proj"], "int8_group_size": 32, **({"q8_0": ["down_proj"]} if kind == "Q8_0" else {})}
    cfg = CpuInt4Config.from_config({**config().to_dict(), **extra})
    layer = ReplicatedLinear(INTERMEDIATE, HIDDEN, bias=False, quant_config=cfg, prefix="model.layers.0.mlp.down_proj",
                             disable_tp=True)  # fmt: skip
    if kind == "Q8_0":
        from tests.kernels.test_g32 import random_blocks

        raw = torch.from_numpy(random_blocks("Q8_0", HIDDEN, INTERMEDIATE, seed).reshape(HIDDEN, -1))
        layer.blocks.weight_loader(layer.blocks, raw)
    else:
        from kernels.ops.int8 import quantize_int8

        w = torch.randn(HIDDEN, INTERMEDIATE, generator=torch.Generator().manual_seed(seed)) * 0.02
        for name, tensor in zip(("qweight", "scales"), quantize_int8(w, group=32), strict=True):
            getattr(layer, name).weight_loader(getattr(layer, name), tensor)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("kind", ["int8", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 64])
def test_an_8_bit_set_layer_called_by_its_index_gives_what_its_tensors_give_bit_for_bit(kind, rows, monkeypatch):
    x = torch.randn(rows, INTERMEDIATE, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    with set_current_vllm_config(VllmConfig()):
        tabled = eight_bit_layer(kind, 9)
    monkeypatch.setenv(layer_table.ENV, "0")
    with set_current_vllm_config(VllmConfig()):
        own = eight_bit_layer(kind, 9)
    assert layer_table.index_of(tabled) == 0 and layer_table.index_of(own) is None
    y = tabled.quant_method.apply(tabled, x)
    assert y.shape == (rows, HIDDEN) and torch.equal(y, own.quant_method.apply(own, x))


def test_with_the_table_off_a_layer_keeps_its_tensors_as_arguments(monkeypatch):
    monkeypatch.setenv(layer_table.ENV, "0")
    cfg = config()
    with set_current_vllm_config(VllmConfig()):
        layer = loaded_layer(HIDDEN, INTERMEDIATE, 0, cfg)
    assert layer_table.index_of(layer) is None
    x = torch.randn(1, INTERMEDIATE, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert torch.equal(layer.quant_method.apply(layer, x), with_tensors(layer, cfg, x))


def test_an_index_never_set_or_a_wrong_width_is_an_error_naming_it():
    with set_current_vllm_config(VllmConfig()):
        loaded_layer(HIDDEN, INTERMEDIATE, 0, config())
    with pytest.raises(RuntimeError, match="layer 7 was never set"):
        layer_table.linear(torch.zeros(1, INTERMEDIATE, dtype=torch.bfloat16), 7)
    with pytest.raises(RuntimeError, match=r"x: expected \[\.\.\., 1536\] for layer 0"):
        layer_table.linear(torch.zeros(1, HIDDEN, dtype=torch.bfloat16), 0)


def test_the_compile_cache_tells_graphs_with_and_without_the_table_apart(monkeypatch):
    from kernels.vllm_plugin import compile_cache

    on = compile_cache.plugin_factors()
    monkeypatch.setenv(layer_table.ENV, "0")
    assert compile_cache.plugin_factors() != on
