"""A GGUF whose kinds of weight are not on one grid, as llama.cpp's Q4_K_M mixes them: the plan keeps the file's own
grid tensor by tensor, and the converter writes what the plan says.

The file is generated (benchmarks/make_random_gguf.py: gguf-py's GGUFWriter; gguf-py's own quantizer for Q4_0, Q5_0
and Q8_0, valid random blocks for Q4_K and Q6_K) with one kind mixed each way: attn_v at Q6_K on three of its six
layers (llama-quant.cpp's use_more_bits gives Q4_K_M's attn_v Q6_K on about half of them), ffn_gate at Q8_0 but on
one layer Q4_0, ffn_down Q4_0 but on one layer Q5_0. What each tensor should become is written out here from that
table and the rules the plan states (wider than 4 bits: int8 per group, 16 here since the file holds Q6_K, with the
file's own codes where its grid is symmetric, Q8_0, Q5_0 and Q6_K; on a 4-bit group-32 grid: the file's codes;
vLLM loads q/k/v into one qkv_proj and gate/up into one gate_up_proj, which take the widest format of their layer),
and what the converter wrote is checked against gguf-py's own dequantization of the file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from benchmarks.make_random_gguf import Dims, architecture_shapes, encoded, write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
DATA = Path(__file__).parents[1] / "edge" / "data"
LAYERS = 6
DIMS = Dims(layers=LAYERS, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=49152, context=2048)
# The file's type per layer for the mixed kinds; every other linear is Q4_K, the embedding and the head Q6_K.
MIXED = {
    "attn_v": ("Q6_K", "Q4_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"),
    "ffn_gate": ("Q8_0", "Q8_0", "Q8_0", "Q4_0", "Q8_0", "Q8_0"),
    "ffn_down": ("Q4_0", "Q4_0", "Q5_0", "Q4_0", "Q4_K", "Q4_0"),
}
WIDER_THAN_4_BITS = ("Q5_0", "Q6_K", "Q8_0")  # of the types above
INT8_GROUP = 16  # Q6_K's sub-blocks: the 8-bit set's group wherever the file holds one of its weights in Q6_K
# llama.cpp's tensor names as Hugging Face's (convert_hf_to_gguf.py's tensor map, as transformers reads it back)
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}  # fmt: skip
SIBLINGS = {"attn_v": ("attn_q", "attn_k"), "ffn_gate": ("ffn_up",)}  # fused with them in vLLM, per layer


def file_type(name: str) -> str:
    """The type this test gives a GGUF tensor (blk.N.<kind>.weight, token_embd.weight, output.weight)."""
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in MIXED:
        return MIXED[parts[2]][int(parts[1])]
    return "Q6_K" if name in ("token_embd.weight", "output.weight") else "Q4_K"


def hf_name(name: str) -> str:
    parts = name.split(".")
    return f"model.layers.{parts[1]}.{HF_NAMES[parts[2]]}.weight"


def expected_int8() -> set[str]:
    """The decoder weights the plan should keep at 8 bits: the file's wide ones and, in their layer, their vLLM
    siblings."""
    wide = set()
    for kind, types in MIXED.items():
        for layer, type_name in enumerate(types):
            if type_name in WIDER_THAN_4_BITS:
                wide |= {f"blk.{layer}.{name}.weight" for name in (kind, *SIBLINGS.get(kind, ()))}
    return {hf_name(name) for name in wide}


def linears() -> list[str]:
    return [name for name, (_, role) in architecture_shapes("llama", DIMS).items()
            if role == "matrix" and name.startswith("blk.")]  # fmt: skip


def mixed_gguf(directory: Path, tokenizer: Path | None = None) -> Path:
    """The mixed file, a llama of LAYERS layers; `tokenizer`: a GGUF whose tokenizer is copied (to convert it)."""
    rng = np.random.default_rng(11)
    tensors = {}
    for name, (shape, role) in architecture_shapes("llama", DIMS).items():
        if role == "matrix":
            tensors[name] = (encoded(Q[file_type(name)], rng, *shape), Q[file_type(name)])
        elif role == "rope":  # llama's rope_freqs, all 1: no RoPE scaling
            tensors[name] = (np.ones(shape, np.float32), Q.F32)
        else:
            tensors[name] = (rng.standard_normal(shape).astype(np.float32) * 0.1 + (role == "norm"), Q.F32)
    directory.mkdir(parents=True, exist_ok=True)
    return write_gguf(directory / "mixed-q4km.gguf", "llama", tensors, DIMS, tokenizer_from=tokenizer)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, tokenizer_source):
    """(the file, its w4a16 speed plan on the AVX2 host's recorded cpuinfo)."""
    from edge.device.describe import load_device_file
    from edge.model.reader import read_model
    from edge.plan.planner import make_plan

    path = mixed_gguf(tmp_path_factory.mktemp("mixed"), tokenizer_source)
    plan = make_plan(load_device_file(str(DATA / "cpuinfo_host_epyc_avx2.txt")), read_model(path),
                     path="w4a16-tinygemm")  # fmt: skip
    return path, plan


def test_the_plans_8_bit_set_names_the_files_wide_tensors_and_their_fused_siblings(mixed):
    _, plan = mixed
    assert plan.group_size == 32 and plan.quantization_config["codes_from_source"] is True
    named = {entry + ".weight" for entry in plan.quantization_config["int8"]}
    assert named - {"embed_tokens.weight", "lm_head.weight"} == expected_int8()
    assert {"embed_tokens", "lm_head"} <= set(plan.quantization_config["int8"])  # the speed plan's 8-bit set


def test_the_plans_layers_and_ledger_count_each_tensor_in_its_format(mixed):
    """Per kind, what the file held and what it became, per format; the ledger's bytes are each tensor's in its
    format: int8 [N, K] + a float32 scale per 16 weights, int4 [N, K/2] + bf16 scales and zeros per 32 weights."""
    _, plan = mixed
    assert plan.quantization_config["int8_group_size"] == INT8_GROUP
    shapes = architecture_shapes("llama", DIMS)
    expected: dict[tuple[str, str], list] = {}  # (kind, format) -> [layers, {type: count}, bytes]
    for name in linears():
        kind = HF_NAMES[name.split(".")[2]].split(".")[1]
        (n, k), _ = shapes[name]
        int8 = hf_name(name) in expected_int8()
        fmt = "int8" if int8 else "int4"
        entry = expected.setdefault((kind, fmt), [0, {}, 0])
        entry[0] += 1
        entry[1][file_type(name)] = entry[1].get(file_type(name), 0) + 1
        entry[2] += n * k + 4 * n * (k // INT8_GROUP) if int8 else n * k // 2 + 2 * 2 * n * (k // 32)
    planned: dict[tuple[str, str], list] = {}
    for layer in plan.layers:
        if layer.name in ("embed_tokens", "lm_head"):
            continue
        entry = planned.setdefault((layer.name, layer.format), [0, {}, 0])
        entry[0] += layer.count
        for type_name, count in layer.source.items():
            entry[1][type_name] = entry[1].get(type_name, 0) + count
    for item in plan.memory.items:
        if item.kind in ("int4-weights", "int8-weights") and item.layer not in ("embed_tokens", "lm_head"):
            planned[item.layer, item.kind.removesuffix("-weights")][2] += item.bytes
    assert planned == expected
    assert planned["v_proj", "int8"][:2] == [3, {"Q6_K": 3}] and planned["v_proj", "int4"][:2] == [3, {"Q4_K": 3}]


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The ulp of bf16 values, as float32: keep the exponent bits (2^e), times 2^-7 (bf16 has 7 fraction bits)."""
    return (x.view(torch.int16) & 0x7F80).view(torch.bfloat16).float() * 2.0**-7


def _files_weights(path: Path) -> dict[str, torch.Tensor]:
    """gguf-py's own dequantization of every linear, float32 [N, K], q and k rows as transformers reads them back
    (llama.cpp's converter permuted them: transformers' LlamaTensorProcessor undoes it)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": DIMS.heads, "num_key_value_heads": DIMS.kv_heads})
    weights = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.name in linears():
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            weights[hf_name(t.name)] = torch.from_numpy(processor.process(values, t.name).weights.copy())
    return weights


def test_the_converter_writes_int8_for_the_wide_tensors_and_the_files_own_codes_for_the_rest(mixed, tmp_path):
    """int8 ones: per group of 16, the file's values exactly where its grid is symmetric (Q8_0, Q5_0, Q6_K), within
    half a step of them where not (a Q4_K widened to its fused sibling's int8); 4-bit ones: the file's codes, so that
    (q - 8) * scale + zero is gguf-py's value up to the bf16 rounding of scale and zero (a re-rounding would be
    off by up to half a step, 2^7 times that)."""
    from safetensors.torch import load_file

    from kernels.convert.convert import convert
    from kernels.ops.int4 import dequantize, unpack_nibbles
    from kernels.ops.int8 import dequantize_int8

    path, plan = mixed
    dst = convert(path, tmp_path / "dst", plan.quantization_config, path=plan.path, log=lambda message: None)
    summary = json.loads((dst / "edge-convert.json").read_text())["summary"]
    every = {hf_name(name) for name in linears()}
    assert set(summary["int8"]) - {"model.embed_tokens.weight", "lm_head.weight"} == expected_int8()
    exact_int8 = {hf_name(name) for name in linears() if file_type(name) in WIDER_THAN_4_BITS}
    assert set(summary["codes_from_source"]) == every - expected_int8()
    assert set(summary["int8_codes_from_source"]) == exact_int8 | {"model.embed_tokens.weight", "lm_head.weight"}
    written = {}
    for file in sorted(dst.glob("*.safetensors")):
        written |= load_file(file)
    for name, reference in _files_weights(path).items():
        prefix = name.removesuffix(".weight")
        qweight, scales = written[f"{prefix}.qweight"], written[f"{prefix}.scales"]
        if name in expected_int8():
            assert qweight.dtype == torch.int8 and scales.shape == (qweight.shape[0], qweight.shape[1] // INT8_GROUP)
            ours = dequantize_int8(qweight, scales, torch.float32)
            if name in exact_int8:
                assert torch.equal(ours, reference), name
            else:
                step = scales.repeat_interleave(INT8_GROUP, dim=1)
                # half a step, and float32's rounding of code x scale
                assert ((ours - reference).abs() <= step * 0.5 + 2.0**-22 * reference.abs()).all(), name
            continue
        assert qweight.dtype == torch.uint8, name
        zeros = written[f"{prefix}.zeros"]
        ours = dequantize(qweight, scales, zeros, 32, torch.float32)
        n = reference.shape[0]
        centred = (unpack_nibbles(qweight).float() - 8).abs().view(n, -1, 32)  # [N, K/32, 32]
        bound = centred * (_ulp(scales) / 2).unsqueeze(-1) + (_ulp(zeros) / 2).unsqueeze(-1)
        bound = bound.view(n, -1) + 2.0**-20 * (ours.abs() + reference.abs() + 1e-30)
        assert ((ours - reference).abs() <= bound).all(), name
