"""A GGUF's Q4_K tensors kept as the file's own blocks (quantization_config.q4k) where the plan decodes on the
int8-activation kernel: the plan names them (and only where every weight vLLM fuses into the layer is Q4_K), the
ledger counts them at the file's 144 bytes per 256 weights, the converter writes the file's bytes, and the vLLM
method and edge-eval's module run them.

The file is test_mixed_grid's generated Q4_K_M-like llama (attn_v Q6_K on layers 0, 4, 5; ffn_gate Q8_0 but Q4_0 on
layer 3; ffn_down Q4_0 but Q5_0 on layer 2 and Q4_K on layer 4; every other linear Q4_K). What the plan should keep
as blocks is written out here from that table: q, k and v where v is Q4_K (layers 1-3), o on every layer, down on
layer 4; never up, whose layer-3 sibling gate is Q4_0 (one vLLM layer, one kind of decode copy) and which is int8
with its Q8_0 gate elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from edge.errors import InputError  # noqa: E402
from kernels.ops import avx2_int4, q4k  # noqa: E402
from tests.kernels.test_mixed_grid import DATA, hf_name, linears, mixed_gguf  # noqa: E402

EXPECTED_BLOCKS = {
    *(f"model.layers.{i}.self_attn.{p}" for i in (1, 2, 3) for p in ("q_proj", "k_proj", "v_proj")),
    *(f"model.layers.{i}.self_attn.o_proj" for i in range(6)),
    "model.layers.4.mlp.down_proj",
}
needs_kernel = pytest.mark.skipif(avx2_int4.load() is not None, reason=f"AVX2 kernels: {avx2_int4.load()}")


def _record(plan, decode_kernel: str):
    """An edge-eval record of this model with int8 activations, as the planner looks it up (values made up: the
    planner only needs one within --max-kld)."""
    from edge.measure.quality import QualityRecord, quality_key

    qconfig = {**plan.quantization_config, "decode_kernel": decode_kernel}
    return QualityRecord(model=plan.model.name, key=quality_key(plan.path, qconfig), kld_mean=0.01, kld_mean_se=0.001,
                         top1_agreement=0.95, top1_agreement_se=0.01, ppl_ratio=1.01, ppl_ratio_se=0.001,
                         confident_flip_rate=0.01, confident_flip_rate_se=0.001, tokens=1024, evaluator=2)  # fmt: skip


@pytest.fixture(scope="module")
def plans(tmp_path_factory, tokenizer_source):
    """(the file, its speed plan on the AVX2 host as is, the same with a record that lets it decode on int8
    activations)."""
    from edge.device.describe import load_device_file
    from edge.model.reader import read_model
    from edge.plan.planner import make_plan

    path = mixed_gguf(tmp_path_factory.mktemp("mixed"), tokenizer_source)
    device, model = load_device_file(str(DATA / "cpuinfo_host_epyc_avx2.txt")), read_model(path)
    plain = make_plan(device, model, path="w4a16-tinygemm")
    lossy = make_plan(device, model, path="w4a16-tinygemm", quality=[_record(plain, "avx2-w4a8")])
    return path, plain, lossy


def test_only_a_plan_on_the_int8_activation_kernel_keeps_the_blocks_and_names_them_as_the_table_says(plans):
    _, plain, lossy = plans
    assert plain.quantization_config.get("decode_kernel") == "avx2" and "q4k" not in plain.quantization_config
    assert lossy.quantization_config["decode_kernel"] == "avx2-w4a8"
    named = lossy.quantization_config["q4k"]
    expanded = {f"model.layers.{i}.self_attn.o_proj" for i in range(6)} if "o_proj" in named else set()
    assert {entry for entry in named if entry != "o_proj"} | expanded == EXPECTED_BLOCKS
    assert not set(named) & set(lossy.quantization_config["int8"])
    for layer in lossy.layers:  # the plan's layers say the same, part by part
        if layer.blocks == "Q4_K":
            assert layer.format == "int4" and layer.source == {"Q4_K": layer.count}


def test_the_ledger_counts_the_blocks_at_the_files_bytes(plans):
    path, plain, lossy = plans
    shapes = {hf_name(t.name).removesuffix(".weight"): tuple(int(d) for d in reversed(t.shape))
              for t in gguf.GGUFReader(path).tensors if t.name in linears()}  # fmt: skip
    file_bytes = sum(shapes[p][0] * shapes[p][1] // 256 * 144 for p in EXPECTED_BLOCKS)
    grid_bytes = sum(shapes[p][0] * (shapes[p][1] // 2 + 2 * 2 * shapes[p][1] // 32) for p in EXPECTED_BLOCKS)
    blocks = [item for item in lossy.memory.items if item.name.endswith("Q4_K blocks (decode copy)")]
    assert sum(item.bytes for item in blocks) == file_bytes
    def copy(item) -> bool:  # a decode copy: beside a tinygemm buffer, or the only copy (edge.formats.tinygemm)
        return item.kind == "row-major-copy" or "decode copy" in item.name

    def copies(plan) -> int:
        return sum(i.bytes for i in plan.memory.items if copy(i))

    rest = {p.memory.resident_bytes - sum(i.bytes for i in p.memory.items if i.phase == "resident" and (copy(i)
                                          or i.layer in ("lm_head", "down_proj"))) for p in (plain, lossy)}  # fmt: skip
    # everything but the decode copies, the head (its Q6_K blocks, below) and down_proj (layer 2's Q5_0 blocks) is
    # the same
    assert len(rest) == 1
    assert copies(plain) - copies(lossy) == grid_bytes - file_bytes > 0


@pytest.fixture(scope="module")
def converted(plans, tmp_path_factory) -> tuple:
    """(the converted directory, its tensors by name): the file converted once by the plan with blocks."""
    from safetensors.torch import load_file

    from kernels.convert.convert import convert

    path, _, lossy = plans
    dst = convert(path, tmp_path_factory.mktemp("converted") / "dst", lossy.quantization_config, path=lossy.path,
                  log=lambda message: None)  # fmt: skip
    written = {}
    for file in sorted(dst.glob("*.safetensors")):
        written |= load_file(file)
    return dst, written


def test_the_converter_writes_the_files_own_blocks_and_the_grid_for_the_rest(plans, converted):
    from tests.kernels.test_mixed_grid import _files_weights

    path, _, lossy = plans
    dst, written = converted
    reference = _files_weights(path)
    raw = {hf_name(t.name).removesuffix(".weight"): t for t in gguf.GGUFReader(path).tensors if t.name in linears()}
    for prefix in EXPECTED_BLOCKS:
        assert f"{prefix}.scales" not in written and f"{prefix}.zeros" not in written, prefix
        qweight, meta = written[f"{prefix}.qweight"], written[f"{prefix}.meta"]
        # exactly gguf-py's values, bit for bit (the grid's bf16 scales would not be)
        assert torch.equal(q4k.dequantize(qweight, meta), reference[f"{prefix}.weight"]), prefix
        n = qweight.shape[0]
        assert qweight.nbytes + meta.nbytes == np.asarray(raw[prefix].data).nbytes == n * qweight.shape[1] // 128 * 144
    for name in linears():  # every other 4-bit tensor keeps the grid
        prefix = hf_name(name).removesuffix(".weight")
        if f"{prefix}.blocks" in written:  # the 8-bit set's own blocks: layer 2's Q5_0 down_proj, unfused
            assert prefix == "model.layers.2.mlp.down_proj" and lossy.quantization_config["q5_0"] == [prefix]
            file_bytes = torch.from_numpy(np.array(raw[prefix].data).reshape(written[f"{prefix}.blocks"].shape))
            assert torch.equal(written[f"{prefix}.blocks"], file_bytes)
            continue
        if prefix not in EXPECTED_BLOCKS and written[f"{prefix}.qweight"].dtype == torch.uint8:
            assert f"{prefix}.zeros" in written and f"{prefix}.meta" not in written, prefix
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert config["q4k"] == lossy.quantization_config["q4k"]


def test_the_converter_refuses_blocks_the_file_does_not_hold_as_q4_k(plans, tmp_path):
    from kernels.convert.convert import convert

    path, _, lossy = plans
    named = [*lossy.quantization_config["q4k"], "model.layers.0.mlp.down_proj"]  # held as Q4_0
    qconfig = {**lossy.quantization_config, "q4k": named}
    with pytest.raises(InputError, match=r"quantization_config\.q4k.*model\.layers\.0\.mlp\.down_proj.*Q4_0"):
        convert(path, tmp_path / "dst", qconfig, path=lossy.path, log=lambda message: None)
    assert not (tmp_path / "dst").exists()


def _blocks(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from tests.kernels.test_q4k import random_blocks

    return q4k.from_blocks(random_blocks(n, k, seed))


@needs_kernel
def test_edge_evals_module_decodes_on_the_blocks_and_prefills_on_their_grid():
    from kernels.ops.int4_ops import DIRECT
    from kernels.scoring.eval_cpu_int4 import Int4Linear, Int4Settings

    qweight, meta = _blocks(64, 512, seed=1)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    decode = Int4Linear(qweight, *q4k.int4_grid(meta), Int4Settings(32, DIRECT, 2, False, avx2_bits=8), meta=meta)
    assert decode.scales.dtype == torch.uint8  # the blocks in the decode layout
    assert torch.equal(decode(x), q4k.linear(x, *q4k.decode_layout(qweight, meta)))
    prefill = Int4Linear(qweight, *q4k.int4_grid(meta), Int4Settings(32, DIRECT, 2, False), meta=meta)
    reference = x.float() @ q4k.dequantize(qweight, meta).t()
    assert ((prefill(x).float() - reference).norm() / reference.norm()) < 0.02  # bf16 grid and bf16 GEMM


def test_edge_own_blocks_0_plans_the_grid_instead(plans, monkeypatch):
    from edge.device.describe import load_device_file
    from edge.model.reader import read_model
    from edge.plan.planner import make_plan

    path, plain, lossy = plans
    monkeypatch.setenv("EDGE_OWN_BLOCKS", "0")
    grid = make_plan(load_device_file(str(DATA / "cpuinfo_host_epyc_avx2.txt")), read_model(path),
                     path="w4a16-tinygemm", quality=[_record(plain, "avx2-w4a8")])  # fmt: skip
    assert grid.quantization_config["decode_kernel"] == "avx2-w4a8" and "q4k" not in grid.quantization_config
    from edge.catalog.quantized_layers import OWN_BLOCK_TYPES

    keys = {own.key for own in OWN_BLOCK_TYPES.values()}
    assert grid.quantization_config == {k: v for k, v in lossy.quantization_config.items() if k not in keys}


# --- the 8-bit set's Q6_K weights as the file's own blocks (quantization_config.q6k, kernels/ops/q6k.py) ---


def test_the_plan_keeps_the_untied_q6_k_head_as_blocks_and_a_q6_k_v_fused_with_int8_siblings_on_the_grid(plans):
    _, plain, lossy = plans
    assert "q6k" not in plain.quantization_config
    assert lossy.quantization_config["q6k"] == ["lm_head"]  # v_proj's Q6_K layers sit in qkv_proj with int8 q, k
    head = next(layer for layer in lossy.layers if layer.name == "lm_head")
    assert head.format == "int8" and head.blocks == "Q6_K"
    item = next(i for i in lossy.memory.items if i.layer == "lm_head" and i.kind == "int8-weights")
    assert item.bytes == head.n * head.k // 256 * 210  # the file's bytes, where the 8-bit set's are n k (1 + 4/16)
    plain_head = next(i for i in plain.memory.items if i.layer == "lm_head" and i.kind == "int8-weights")
    assert plain_head.bytes == head.n * head.k + 4 * head.n * head.k // 16


def test_the_rules_keep_an_unfused_q6_k_weight_and_drop_blocks_a_fused_sibling_does_not_share():
    from edge.catalog.quantized_layers import QuantRules

    rules = QuantRules(path="w4a16-tinygemm", group_size=32, int8=("down_proj", "v_proj", "q_proj", "k_proj"),
                       int8_group=16, blocks=(("Q6_K", ("down_proj", "v_proj")),), quant_method="cpu_int4")  # fmt: skip
    assert rules.weight("model.layers.0.mlp.down_proj", 2048, 5632).blocks == "Q6_K"
    assert rules.weight("model.layers.0.mlp.down_proj", 2048, 5600).blocks is None  # K not in whole blocks
    shapes = {f"model.layers.0.self_attn.{p}": (n, 2048) for p, n in (("q_proj", 2048), ("k_proj", 256),
                                                                      ("v_proj", 256))}  # fmt: skip
    decided = rules.weights(shapes)
    assert {d.format for d in decided.values()} == {"int8"} and not any(d.blocks for d in decided.values())
    assert "one layer keeps one kind of decode copy" in decided["model.layers.0.self_attn.v_proj"].why


def test_the_converter_writes_the_heads_own_q6_k_blocks(plans, converted):
    path, _, _ = plans
    _, written = converted
    assert "lm_head.qweight" not in written and "lm_head.scales" not in written
    output = next(t for t in gguf.GGUFReader(path).tensors if t.name == "output.weight")
    raw = np.asarray(output.data).reshape(written["lm_head.blocks"].shape)
    assert torch.equal(written["lm_head.blocks"], torch.from_numpy(raw.copy()))  # the file's bytes, row by row


@needs_kernel
def test_edge_evals_module_runs_q6_k_blocks_as_the_engine_does():
    from kernels.ops import q6k
    from kernels.ops.int4_ops import DIRECT
    from kernels.scoring.eval_cpu_int4 import BlocksLinear, Int4Settings
    from tests.kernels.test_q6k import random_blocks

    blocks = random_blocks(64, 512, seed=5)
    raw = torch.from_numpy(blocks.reshape(64, -1).copy())
    w = q6k.dequantize(*q6k.from_blocks(blocks))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    decode = BlocksLinear(raw, "Q6_K", Int4Settings(32, DIRECT, 2, False, avx2_bits=8))
    assert torch.equal(decode(x), q6k.linear(x, q6k.decode_layout(*q6k.from_blocks(blocks))))
    wide = BlocksLinear(raw, "Q6_K", Int4Settings(32, DIRECT, 2, False, int8_rows=1))  # 3 rows: dequantized, bf16 GEMM
    assert torch.equal(wide(x), torch.mm(x, w.to(torch.bfloat16).t()))
    assert torch.equal(raw, torch.from_numpy(blocks.reshape(64, -1)))  # the checkpoint's tensor left as it was


# --- the 8-bit set's Q8_0 and Q5_0 weights as the file's own blocks (quantization_config.q8_0, q5_0; ops/g32.py)


def g32_rules(**blocks):
    from edge.catalog.quantized_layers import QuantRules

    return QuantRules(path="w4a16-tinygemm", group_size=32, int8=("q_proj", "k_proj", "v_proj", "o_proj"),
                      int8_group=32, blocks=tuple(blocks.items()), quant_method="cpu_int4")  # fmt: skip


QKV = {f"model.layers.0.self_attn.{p}": (n, 576) for p, n in (("q_proj", 576), ("k_proj", 192), ("v_proj", 192))}


def test_q5_0_weights_fused_with_q8_0_ones_take_q8_0_blocks_and_say_why():
    decided = g32_rules(Q5_0=("q_proj", "k_proj", "o_proj"), Q8_0=("v_proj",)).weights(QKV)
    assert {d.blocks for d in decided.values()} == {"Q8_0"}
    assert "the file's Q5_0 written as Q8_0 blocks, unrounded" in decided["model.layers.0.self_attn.q_proj"].why
    assert decided["model.layers.0.self_attn.v_proj"].why.endswith("(quantization_config.q8_0)")
    o_proj = g32_rules(Q5_0=("o_proj",)).weight("model.layers.0.self_attn.o_proj", 576, 576)
    assert o_proj.blocks == "Q5_0" and o_proj.format == "int8"  # unfused: the file's own type
    assert g32_rules(Q5_0=("o_proj",)).weight("model.layers.0.self_attn.o_proj", 576, 560).blocks is None  # K


def test_blocks_a_type_cannot_hold_unrounded_leave_the_fused_layer_on_the_grid():
    plain = g32_rules(Q5_0=("q_proj", "k_proj")).weights(QKV)  # v_proj plain int8
    assert not any(d.blocks for d in plain.values())
    assert "one layer keeps one kind of decode copy" in plain["model.layers.0.self_attn.q_proj"].why
    mixed = g32_rules(Q6_K=("v_proj",), Q8_0=("q_proj", "k_proj")).weights(QKV)  # no type holds the other
    assert not any(d.blocks for d in mixed.values())


def test_the_converter_writes_a_q5_0_tensor_as_q8_0_blocks_of_the_same_weights():
    from kernels.formats.int8 import from_source_blocks
    from kernels.ops import g32
    from kernels.source.gguf_source import GgufModel, GgufTensor
    from tests.kernels.test_g32 import gguf_weights, random_blocks

    blocks = random_blocks("Q5_0", 16, 576, seed=7)
    tensor = GgufTensor("w.weight", "w.weight", "Q5_0", (16, 576), None, blocks.reshape(16, -1))
    grid = GgufModel(Path("random.gguf"), "llama", 1, 1, {"w.weight": tensor}, ())
    own = from_source_blocks("w", grid, "w.weight", "Q5_0")["w.blocks"]
    assert torch.equal(own, torch.from_numpy(blocks.reshape(16, -1)))
    widened = from_source_blocks("w", grid, "w.weight", "Q8_0")["w.blocks"]
    assert widened.shape == (16, 18 * 34)
    assert torch.equal(gguf_weights("Q8_0", widened.numpy().reshape(16, 18, 34)), gguf_weights("Q5_0", blocks))
    assert torch.equal(g32.dequantize(*g32.from_blocks("Q8_0", widened.numpy().reshape(16, 18, 34))),
                       gguf_weights("Q5_0", blocks))  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0"])
def test_edge_evals_module_runs_q8_0_and_q5_0_blocks_as_the_engine_does(type_name):
    from kernels.ops import g32
    from kernels.ops.int4_ops import DIRECT
    from kernels.scoring.eval_cpu_int4 import BlocksLinear, Int4Settings, blocks_type
    from tests.kernels.test_g32 import random_blocks

    blocks = random_blocks(type_name, 64, 576, seed=5)
    raw = torch.from_numpy(blocks.reshape(64, -1).copy())
    w = g32.dequantize(*g32.from_blocks(type_name, blocks))
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    decode = BlocksLinear(raw, type_name, Int4Settings(32, DIRECT, 2, False, avx2_bits=8))
    assert torch.equal(decode(x), g32.linear(x, g32.decode_layout(type_name, *g32.from_blocks(type_name, blocks))))
    wide = BlocksLinear(raw, type_name, Int4Settings(32, DIRECT, 2, False, int8_rows=1))  # 3 rows: bf16 GEMM
    assert torch.equal(wide(x), torch.mm(x, w.to(torch.bfloat16).t()))
    qconfig = {"q5_0": ["o_proj"], "q8_0": ["model.layers.1.self_attn.v_proj"]}
    assert blocks_type("model.layers.0.self_attn.o_proj", qconfig) == "Q5_0"
    assert blocks_type("model.layers.1.self_attn.v_proj", qconfig) == "Q8_0"
    with pytest.raises(InputError, match=r"model\.layers\.0\.self_attn\.v_proj\.blocks"):
        blocks_type("model.layers.0.self_attn.v_proj", qconfig)


# --- W4A8 (cpu_w4a8): the 8-bit set keeps the file's own blocks whatever the 4-bit grid ---


@pytest.fixture(scope="module")
def w4a8_plans(plans):
    """(the file's w4a8-gptq speed plan on a described AVX-512 VNNI box (no AMX: the plugin's cpu_w4a8), the same with
    EDGE_OWN_BLOCKS=0)."""
    from edge.device.describe import load_device_file
    from edge.model.reader import read_model
    from edge.plan.planner import make_plan

    path = plans[0]
    device, model = load_device_file(str(DATA / "cpuinfo_epyc_zen4_avx512.txt")), read_model(path)
    blocks = make_plan(device, model, path="w4a8-gptq")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDGE_OWN_BLOCKS", "0")
        grid = make_plan(device, model, path="w4a8-gptq")
    return blocks, grid


def test_a_w4a8_plan_keeps_the_8_bit_sets_q6_k_and_q5_0_blocks_never_q4_k(w4a8_plans):
    blocks, grid = w4a8_plans
    qconfig = blocks.quantization_config
    assert qconfig["quant_method"] == "cpu_w4a8" and qconfig["group_size"] != 32  # the 4-bit grid is re-rounded
    assert qconfig["q6k"] == ["lm_head"] and qconfig["q5_0"] == ["model.layers.2.mlp.down_proj"]
    assert "q4k" not in qconfig
    keys = ("q6k", "q8_0", "q5_0")
    assert grid.quantization_config == {k: v for k, v in qconfig.items() if k not in keys}


def test_a_w4a8_plans_ledger_counts_the_8_bit_blocks_at_the_files_bytes(w4a8_plans):
    blocks, grid = w4a8_plans
    head = next(layer for layer in blocks.layers if layer.name == "lm_head")
    assert head.format == "int8" and head.blocks == "Q6_K"
    item = next(i for i in blocks.memory.items if i.layer == "lm_head" and i.kind == "int8-weights")
    assert item.bytes == head.n * head.k // 256 * 210
    grid_head = next(i for i in grid.memory.items if i.layer == "lm_head" and i.kind == "int8-weights")
    assert grid_head.bytes == head.n * head.k + 4 * head.n * head.k // 16
    down = next(i for i in blocks.memory.items if i.name == "down_proj Q5_0 blocks (8-bit set)")
    assert down.bytes == 256 * 512 // 32 * 22  # one layer's [256 x 512] as Q5_0: 22 B a block of 32
    assert blocks.memory.resident_bytes < grid.memory.resident_bytes


def test_cpu_w4a8_reads_the_blocks_keys_and_refuses_q4_k():
    from edge.errors import InputError
    from kernels.vllm_plugin.cpu_w4a8 import CpuW4A8Config, quantization_config

    qconfig = quantization_config(group_size=128, int8_group_size=16, own_blocks={"q6k": ["lm_head"]})
    config = CpuW4A8Config.from_config(qconfig)
    assert config.own_blocks == {"q6k": ["lm_head"]} and config.to_dict() == qconfig
    assert config.rules.weight("lm_head", 49152, 2048).blocks == "Q6_K"  # K in whole blocks of 256
    assert config._methods()["embedding"]["Q6_K"](config).blocks == "Q6_K"
    with pytest.raises(InputError, match="quantization_config.q4k"):
        CpuW4A8Config.from_config({**qconfig, "q4k": ["model.layers.0.self_attn.o_proj"]})


def test_only_w4a8_and_the_int8_activation_kernel_read_own_blocks(monkeypatch):
    from edge.catalog.kernel_registry import reads_own_blocks

    assert reads_own_blocks("avx2-w4a8") and reads_own_blocks("tinygemm", "w4a8-gptq")
    assert not reads_own_blocks("avx2") and not reads_own_blocks("avx2", "w4a16-tinygemm")
    monkeypatch.setenv("EDGE_OWN_BLOCKS", "0")
    assert not reads_own_blocks("tinygemm", "w4a8-gptq") and not reads_own_blocks("avx2-w4a8")
