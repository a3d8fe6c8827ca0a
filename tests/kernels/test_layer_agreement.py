"""The planner's ledger, the converter and the vLLM `cpu_int4` method agree on which weights are quantized.

For every fixture model (and one built to have a layer tinygemm cannot pack), the plan's per-layer list
(edge.catalog.quantized_layers through the planner), the converter's per-tensor decisions
(kernels.convert.convert.decide on the model's real tensor names and shapes) and the method vLLM gets for each real vLLM
layer (built on the meta device: no weights allocated) must say the same for every layer. A module that decided on its
own would fail here on the first model where its rule differs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.model_executor.layers.linear import (  # noqa: E402
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding  # noqa: E402

from edge.device.profile import DeviceProfile  # noqa: E402
from edge.model.reader import read_model_config  # noqa: E402
from edge.plan.planner import make_plan  # noqa: E402
from kernels.convert.convert import Source, decide  # noqa: E402
from kernels.vllm_plugin.cpu_int4 import (  # noqa: E402
    CpuInt4Config,
    CpuInt4EmbeddingMethod,
    CpuInt4LinearMethod,
    CpuInt8EmbeddingMethod,
    CpuInt8LinearMethod,
    host_params,
)

pytestmark = pytest.mark.usefixtures("single_rank_vllm")

CONFIGS = Path(__file__).parents[1] / "edge" / "data" / "configs"
FIXTURES = sorted(p.stem for p in CONFIGS.glob("*.json"))
# A Llama whose k/v projections have N = 1 kv head x 40 = 40 channels: tinygemm packs N in 16s, so k_proj and
# v_proj stay bf16 and, fused with them in vLLM's qkv_proj, q_proj too.
NARROW_KV = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 320, "intermediate_size": 640,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 40,
    "vocab_size": 4096, "tie_word_embeddings": True, "max_position_embeddings": 2048,
}  # fmt: skip


def this_host_plan(model, priority: str = "speed"):
    """A w4a16 plan for `model` with this host's kernel values (the block the engine will check)."""
    host = host_params()
    isa = ["avx2", "fma"] + (["avx512f", "avx512bw"] if host.block == 64 else [])
    device = DeviceProfile.model_validate({
        "described_by": "json", "arch": {"value": "x86_64"}, "isa": {"value": isa},
        "memory_total_bytes": {"value": 64 * 2**30}, "memory_available_bytes": {"value": 64 * 2**30},
        "runtime": {"tinygemm_block": {"value": host.block, "source": "torch"}},
    })  # fmt: skip
    return make_plan(device, model, path="w4a16-tinygemm", layout="direct", priority=priority)


def checkpoint_shapes(model) -> dict[str, tuple[list[int], str]]:
    """Tensor name -> (shape, dtype) as a Hugging Face checkpoint of this model names them."""
    shapes = {"model.embed_tokens.weight": ([model.vocab_size, model.hidden_size], "BF16")}
    for layer in range(model.num_layers):
        for lin in model.linears:
            if lin.name == "lm_head":
                continue
            group = "self_attn" if lin.name in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj") else "mlp"
            shapes[f"model.layers.{layer}.{group}.{lin.name}.weight"] = ([lin.n, lin.k], "BF16")
    if not model.tie_word_embeddings:
        shapes["lm_head.weight"] = ([model.vocab_size, model.hidden_size], "BF16")
    return shapes


def converter_formats(model, qconfig) -> dict[str, set[str]]:
    """Kind of weight -> the formats the converter chose for its tensors (one format when it agrees with itself)."""
    config = {"tie_word_embeddings": model.tie_word_embeddings}
    source = Source(Path("/nonexistent"), config, {}, checkpoint_shapes(model))
    decisions = decide(source, qconfig, "w4a16-tinygemm")
    formats: dict[str, set[str]] = {}
    for name in source.shapes:
        kind = name.removesuffix(".weight").rsplit(".", 1)[-1]
        fmt = "int4" if name in decisions.quantize else "int8" if name in decisions.int8 else "bf16"
        formats.setdefault(kind, set()).add(fmt)
    if model.tie_word_embeddings:  # the head is the embedding
        formats["lm_head"] = formats["embed_tokens"]
    return formats


def vllm_formats(model, qconfig) -> dict[str, str]:
    """Kind of weight -> what the cpu_int4 method gives vLLM's own layer for it (fused layers credited to every
    checkpoint weight they load)."""
    config = CpuInt4Config.from_config(qconfig)
    config.maybe_update_config("model", hf_config=type("Hf", (), {"tie_word_embeddings": model.tie_word_embeddings}))
    shapes = {lin.name: lin for lin in model.linears}
    heads, kv_heads, head_dim, hidden = model.num_heads, model.num_kv_heads, model.head_dim, model.hidden_size
    formats = {}

    def record(kinds, method):
        int4 = isinstance(method, CpuInt4LinearMethod | CpuInt4EmbeddingMethod)
        int8 = isinstance(method, CpuInt8LinearMethod | CpuInt8EmbeddingMethod)
        for kind in kinds:
            formats[kind] = "int4" if int4 else "int8" if int8 else "bf16"

    with torch.device("meta"):
        attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
        qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=False, disable_tp=True)
        record(["q_proj", "k_proj", "v_proj", "qkv_proj"], config.get_quant_method(qkv, f"{attn}.qkv_proj"))
        o = RowParallelLinear(heads * head_dim, hidden, bias=False, disable_tp=True)
        record(["o_proj"], config.get_quant_method(o, f"{attn}.o_proj"))
        inter = (shapes.get("gate_proj") or shapes["gate_up_proj"]).n // (1 if "gate_proj" in shapes else 2)
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, disable_tp=True)
        record(["gate_proj", "up_proj", "gate_up_proj"], config.get_quant_method(gate_up, f"{mlp}.gate_up_proj"))
        down = RowParallelLinear(inter, hidden, bias=False, disable_tp=True)
        record(["down_proj"], config.get_quant_method(down, f"{mlp}.down_proj"))
        embedding = VocabParallelEmbedding(model.vocab_size, hidden, disable_tp=True)
        record(["embed_tokens"], config.get_quant_method(embedding, "model.embed_tokens"))
        head = ParallelLMHead(model.vocab_size, hidden, disable_tp=True)
        record(["lm_head"], config.get_quant_method(head, "lm_head"))
    return formats


@pytest.mark.parametrize("priority", ["speed", "fidelity"])  # int8 head vs bf16 head and int8 q/k/v
@pytest.mark.parametrize("config", [*FIXTURES, "narrow-kv"])
def test_plan_converter_and_vllm_method_quantize_the_same_layers(config, priority):
    raw = NARROW_KV if config == "narrow-kv" else json.loads((CONFIGS / f"{config}.json").read_text())
    model = read_model_config(raw, config)
    plan = this_host_plan(model, priority)
    planned = {layer.name: layer.format for layer in plan.layers}
    converted = converter_formats(model, plan.quantization_config)
    served = vllm_formats(model, plan.quantization_config)
    for kind, fmt in planned.items():
        assert converted.get(kind, {fmt}) == {fmt}, (kind, fmt, converted.get(kind))
        if kind in served:
            assert served[kind] == fmt, (kind, fmt, served[kind])
    weights = ("int4-weights", "int8-weights", "bf16-weights")
    ledger = {item.layer: item.kind for item in plan.memory.items if item.kind in weights}
    for kind, fmt in planned.items():
        if kind in ledger:
            assert ledger[kind] == f"{fmt}-weights", (kind, fmt, ledger[kind])


def test_the_narrow_model_really_keeps_its_fused_attention_bf16():
    """The agreement above is not vacuous: this model's plan keeps q/k/v bf16 and quantizes the rest."""
    plan = this_host_plan(read_model_config(NARROW_KV, "narrow-kv"))
    formats = {layer.name: layer.format for layer in plan.layers}
    assert formats["q_proj"] == formats["k_proj"] == formats["v_proj"] == "bf16"
    assert formats["o_proj"] == formats["down_proj"] == "int4"
    assert formats["embed_tokens"] == formats["lm_head"] == "int8"
    assert "fused with k_proj" in next(layer.why for layer in plan.layers if layer.name == "q_proj")


def test_plan_converter_and_vllm_method_agree_layer_by_layer_on_a_mixed_grid_gguf(tmp_path):
    """A GGUF whose kinds are split by format across layers (tests/kernels/test_mixed_grid.py): the plan's parts,
    the converter's decision for each tensor and the method vLLM gets for each layer's own (fused) module agree
    for every layer, and the 8-bit ones are the file's wide tensors and their vLLM siblings."""
    pytest.importorskip("gguf")
    from edge.model.reader import read_model
    from tests.kernels.test_mixed_grid import LAYERS, expected_int8, mixed_gguf

    model = read_model(mixed_gguf(tmp_path))
    plan = this_host_plan(model)
    planned = {}
    for layer in plan.layers:
        for index in layer.indices if layer.indices is not None else range(layer.count):
            planned[layer.name, index] = layer.format
    # the decisions do not depend on where the 4-bit codes come from (a bare checkpoint has no GGUF to copy from)
    qconfig = {**plan.quantization_config, "codes_from_source": False}
    source = Source(Path("/nonexistent"), {"tie_word_embeddings": False}, {}, checkpoint_shapes(model))
    decisions = decide(source, qconfig, "w4a16-tinygemm")
    assert set(decisions.int8) - {"model.embed_tokens.weight", "lm_head.weight"} == expected_int8()
    config = CpuInt4Config.from_config(plan.quantization_config)
    config.maybe_update_config("model", hf_config=type("Hf", (), {"tie_word_embeddings": False}))
    heads, kv_heads, head_dim, hidden = model.num_heads, model.num_kv_heads, model.head_dim, model.hidden_size
    inter = model.intermediate_size
    with torch.device("meta"):
        modules = {
            "self_attn.qkv_proj": (QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=False, disable_tp=True),
                                   ("q_proj", "k_proj", "v_proj")),
            "self_attn.o_proj": (RowParallelLinear(heads * head_dim, hidden, bias=False, disable_tp=True), ("o_proj",)),
            "mlp.gate_up_proj": (MergedColumnParallelLinear(hidden, [inter, inter], bias=False, disable_tp=True),
                                 ("gate_proj", "up_proj")),
            "mlp.down_proj": (RowParallelLinear(inter, hidden, bias=False, disable_tp=True), ("down_proj",)),
        }  # fmt: skip
        for index in range(LAYERS):
            for module, (layer, kinds) in modules.items():
                method = config.get_quant_method(layer, f"model.layers.{index}.{module}")
                served = "int8" if isinstance(method, CpuInt8LinearMethod) else "int4"
                assert isinstance(method, CpuInt8LinearMethod | CpuInt4LinearMethod), (index, module, method)
                for kind in kinds:
                    name = f"model.layers.{index}.{module.split('.')[0]}.{kind}.weight"
                    converted = "int8" if name in decisions.int8 else "int4" if name in decisions.quantize else "bf16"
                    assert planned[kind, index] == converted == served, (name, planned[kind, index], converted, served)
