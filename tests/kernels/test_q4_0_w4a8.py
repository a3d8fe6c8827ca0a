"""A Q4_0 GGUF under the W4A8 path: Q4_0's w = d * (q - 8) is GPTQ's uint4b8 (code q, zero 8, scale d), so the plan
keeps the file's group 32 and the converter copies its codes into cpu_w4a8's GPTQ tensors; the one loss is d's
rounding to bf16 (the scale dtype the W4A8 kernel reads), at most 2^-8 of it, times |q - 8| <= 8. A Q4_1 or Q4_K
tensor (a minimum per group) has no such image and is re-rounded, and a file mostly on those keeps GPTQ's own
group choice."""

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
DIMS = Dims(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=49152, context=2048)


def q4_0_gguf(directory: Path, tokenizer: Path | None, linear: Q = Q.Q4_0) -> Path:
    """A 2-layer llama: `linear` linears, a Q8_0 embedding (tied head), F32 norms."""
    rng = np.random.default_rng(3)
    tensors = {}
    for name, (shape, role) in architecture_shapes("llama", DIMS).items():
        if role == "matrix":
            kind = Q.Q8_0 if name == "token_embd.weight" else linear
            tensors[name] = (encoded(kind, rng, *shape), kind)
        elif role == "rope":
            tensors[name] = (np.ones(shape, np.float32), Q.F32)
        else:
            tensors[name] = (rng.standard_normal(shape).astype(np.float32) * 0.1 + (role == "norm"), Q.F32)
    directory.mkdir(parents=True, exist_ok=True)
    return write_gguf(directory / f"tiny-{linear.name}.gguf", "llama", tensors, DIMS, tokenizer_from=tokenizer)


def _w4a8_plan(path: Path):
    from edge.device.describe import load_device_file
    from edge.model.reader import read_model
    from edge.plan.planner import make_plan

    zen5 = load_device_file(str(DATA / "cpuinfo_epyc_zen5_avx512.txt"))  # no AMX: the plugin's cpu_w4a8
    return make_plan(zen5, read_model(path), path="w4a8-gptq")


def test_a_q4_0_file_keeps_its_group_and_codes_under_w4a8(tmp_path):
    plan = _w4a8_plan(q4_0_gguf(tmp_path, None))
    config = plan.quantization_config
    assert config["quant_method"] == "cpu_w4a8" and plan.group_size == 32 and config["codes_from_source"] is True
    assert {layer.why for layer in plan.layers if layer.format == "int4"} == {"quantized: the file's codes copied (2)"}


def test_a_q4_1_file_has_no_codes_for_w4a8_to_copy(tmp_path):
    plan = _w4a8_plan(q4_0_gguf(tmp_path, None, Q.Q4_1))
    assert "codes_from_source" not in plan.quantization_config and plan.group_size == 128  # GPTQ's largest


def test_the_converter_copies_q4_0_codes_into_gptq_tensors(tmp_path, tokenizer_source):
    from safetensors.torch import load_file
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from kernels.convert.convert import convert
    from kernels.ops.gptq import dequantize_gptq

    path = q4_0_gguf(tmp_path / "src", tokenizer_source)
    plan = _w4a8_plan(path)
    dst = convert(path, tmp_path / "dst", plan.quantization_config, path=plan.path, log=lambda message: None)
    summary = json.loads((dst / "edge-convert.json").read_text())["summary"]
    written = {}
    for file in sorted(dst.glob("*.safetensors")):
        written |= load_file(file)
    processor = LlamaTensorProcessor(config={"num_attention_heads": DIMS.heads, "num_key_value_heads": DIMS.kv_heads})
    linears = 0
    for t in gguf.GGUFReader(path).tensors:
        if not t.name.startswith("blk.") or len(t.shape) != 2:
            continue
        summary_name = next(name for name in summary["codes_from_source"] if _same(name, t.name))
        prefix = summary_name.removesuffix(".weight")
        reference = torch.from_numpy(processor.process(gguf.quants.dequantize(t.data, t.tensor_type), t.name)
                                     .weights.copy())  # fmt: skip
        tensors = {key: value for key, value in written.items() if key.startswith(prefix + ".")}
        ours = dequantize_gptq(tensors, 32, prefix=prefix)  # [N, K] float32
        d = tensors[f"{prefix}.scales"].float().t().repeat_interleave(32, dim=1)  # [N, K] the stored bf16 d
        codes = (ours / d).round()  # q - 8, exactly: a code times a bf16 scale is exact in float32
        assert torch.equal(codes * d, ours) and codes.abs().max() <= 8, summary_name
        # against the file: only d's rounding to bf16, |q - 8| <= 8 of its half ulp
        assert ((ours - reference).abs() <= codes.abs() * d.abs() * 2.0**-8 + 1e-9).all(), summary_name
        linears += 1
    assert linears == 2 * 7


def _same(hf_name: str, gguf_name: str) -> bool:
    kinds = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
             "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}  # fmt: skip
    _, layer, kind, _ = gguf_name.split(".")
    return hf_name.startswith(f"model.layers.{layer}.") and hf_name.endswith(f".{kinds[kind]}.weight")
