"""edge-convert on a GGUF, per family: a tiny model of each architecture written as llama.cpp writes it (Q4_K
linears with a Q6_K and a Q5_0 among them, a Q6_K embedding and head, F32 norms, the default model's real
tokenizer), planned by the real planner from the file's header, converted straight from the file, then run in
transformers from what the converter wrote (its config.json, its weights dequantized) against transformers' own
GGUF loader on the same file (the file's weights dequantized, float32): the same logits up to the bf16 rounding of
the 4-bit scales and the int8 embedding and head the plan asks for.

This checks, per family, what no unit test of one piece can: the config the header becomes (edge.model.gguf_metadata),
the tensor names and row orders (kernels.source.gguf_source), the 4-bit codes copied and the wider types at 8 bits,
Gemma's norm offset, and the plan's layer rules, against the library vLLM's model code mirrors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.make_random_gguf import Dims, architecture_shapes, encoded, write_gguf
from tests.kernels.dequantized import dequantized_model

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.slow  # about 25 s a family here: transformers loads each file twice
Q = gguf.GGMLQuantizationType
DATA = Path(__file__).parents[1] / "edge" / "data"
FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
VOCAB = 49152  # the default model's tokenizer, copied into every file
DIMS = Dims(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=VOCAB, context=2048)
# Qwen3 at head_dim 128, as every Qwen3 has: transformers 5.24's GGUF loader drops the file's key length for qwen3
# (GGUF_CONFIG_MAPPING maps it to nothing) and takes Qwen3Config's default 128, so the reference loads only then.
FAMILY_DIMS = {"qwen3": Dims(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=128, intermediate=512, vocab=VOCAB,
                             context=2048)}


def _types(name: str, mixed: bool) -> Q:
    """Q4_K linears, the embedding and head at Q6_K (as Q4_K_M files hold them); `mixed` adds llama.cpp's
    fallbacks: one attn_v at Q6_K and one ffn_down at Q5_0, which a plan keeps at 8 bits."""
    if name in ("token_embd.weight", "output.weight") or (mixed and name == "blk.0.attn_v.weight"):
        return Q.Q6_K
    return Q.Q5_0 if mixed and name == "blk.1.ffn_down.weight" else Q.Q4_K


def tiny_gguf(directory: Path, arch: str, tokenizer: Path, *, mixed: bool = False) -> Path:
    rng = np.random.default_rng(7)
    tensors = {}
    dims = FAMILY_DIMS.get(arch, DIMS)
    for name, (shape, role) in architecture_shapes(arch, dims).items():
        if role == "matrix":
            tensors[name] = (encoded(_types(name, mixed), rng, *shape), _types(name, mixed))
        elif role == "rope":  # no scaling: transformers' GGUF loader reads no RoPE tensors, so its reference has none
            tensors[name] = (np.ones(shape, np.float32), Q.F32)
        else:
            values = rng.standard_normal(shape).astype(np.float32) * 0.1 + (1.0 if role == "norm" else 0.0)
            tensors[name] = (values, Q.F32)
    directory.mkdir(parents=True, exist_ok=True)
    return write_gguf(directory / f"tiny-{arch}.gguf", arch, tensors, dims, tokenizer_from=tokenizer)


def _reference(path: Path):
    """transformers' own reading of the file: its weights dequantized, in float32."""
    import transformers
    from transformers import AutoModelForCausalLM

    extra = {}
    if hasattr(transformers, "GgufConfig"):
        extra["quantization_config"] = transformers.GgufConfig(gguf_file=path.name, dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                local_files_only=True, **extra).eval()  # fmt: skip


def _ours(dst: Path):
    """What the converter wrote, as transformers runs it: its config.json (no quantization_config), its int4 and
    int8 tensors dequantized to float32."""
    return dequantized_model(dst, dst.parent / "plain")


def _convert(path: Path, dst: Path) -> Path:
    from edge.device.describe import load_device_file
    from edge.model.reader import read_model
    from edge.plan.planner import make_plan
    from kernels.convert.convert import convert

    plan = make_plan(load_device_file(str(DATA / "cpuinfo_host_epyc_avx2.txt")), read_model(path),
                     path="w4a16-tinygemm")  # fmt: skip
    assert plan.quantization_config["codes_from_source"] is True and plan.group_size == 32
    return convert(path, dst, plan.quantization_config, path=plan.path, log=lambda message: None)


def _relative_errors(theirs, ours) -> dict[str, float]:
    mine = ours.state_dict()
    return {name: ((t.float() - mine[name].float()).norm() / t.float().norm()).item()
            for name, t in theirs.state_dict().items()}  # fmt: skip


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_gguf_of_each_family_converts_to_what_transformers_reads_from_the_file(arch, tmp_path, tokenizer_source):
    path = tiny_gguf(tmp_path / "src", arch, tokenizer_source)
    dst = _convert(path, tmp_path / "dst")
    summary = json.loads((dst / "edge-convert.json").read_text())["summary"]
    linears = [t for t in architecture_shapes(arch, FAMILY_DIMS.get(arch, DIMS)) if t.startswith("blk.")
               and t.endswith(".weight") and "norm" not in t]  # fmt: skip
    assert len(summary["codes_from_source"]) == len(linears)  # every Q4_K linear keeps the file's codes
    assert set(summary["int8"]) == set(summary["int8_codes_from_source"])  # the Q6_K embedding: its codes, per 16
    reference, ours = _reference(path), _ours(dst)
    errors = _relative_errors(reference, ours)
    # the copied codes: only the bf16 rounding of scale and zero; the int8 embedding and head from Q6_K: ~6e-3;
    # norms and biases: their rounding to bf16 (at most 2^-9 of each value)
    assert max(errors.values()) < 1e-2, sorted(errors.items(), key=lambda item: -item[1])[:3]
    assert all(errors[name] <= 2**-9 for name in errors if "norm" in name or name.endswith(".bias"))

    ids = torch.from_numpy(np.random.default_rng(3).integers(0, VOCAB, (1, 24)))
    with torch.no_grad():
        theirs = torch.log_softmax(reference(ids).logits[0].float(), -1)
        mine = torch.log_softmax(ours(ids).logits[0].float(), -1)
    kld = (theirs.exp() * (theirs - mine)).sum(-1)
    print(f"{arch}: mean KLD {kld.mean():.2e} (max {kld.max():.2e}) over {ids.shape[1]} positions; "
          f"largest weight error {max(errors.values()):.2e}")  # fmt: skip
    assert kld.mean() < 1e-3  # measured 2e-5 to 1.3e-4 (Zen 5, 2026-12-01)
    assert (dst / "tokenizer.json").is_file() and (dst / "chat_template.jinja").is_file()


def test_the_tensors_wider_than_4_bits_go_to_the_8_bit_set_and_said_so(tmp_path, tokenizer_source):
    """A Q4_K_M's fallbacks (an attn_v at Q6_K, an ffn_down at Q5_0) under a group-32 plan: int8 per channel from the
    file's float values, with attn_v's vLLM siblings (q/k of that layer, loaded into one qkv_proj); every other Q4_K
    tensor's codes copied as before (the plan's layers say which)."""
    from edge.model.reader import read_model
    from edge.plan.planner import make_plan

    path = tiny_gguf(tmp_path / "src", "llama", tokenizer_source, mixed=True)
    dst = _convert(path, tmp_path / "dst")
    summary = json.loads((dst / "edge-convert.json").read_text())["summary"]
    wide = {"model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.down_proj.weight"}
    siblings = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}
    assert wide | siblings <= set(summary["int8"]) and not (wide | siblings) & set(summary["codes_from_source"])
    errors = _relative_errors(_reference(path), _ours(dst))
    # the copied codes: the bf16 rounding of scale and zero; int8 per channel: 6e-3 of the Q6_K and Q4_K tensors,
    # 1.3e-2 of the Q5_0 one (weight-like values with a few 4x outliers, which widen a row's step; Zen 5, 2026-12-01)
    assert all(errors[name] < 1e-2 for name in errors if name not in wide | siblings), errors
    assert all(errors[name] < 2e-2 for name in wide | siblings), {name: errors[name] for name in wide | siblings}
    from edge.device.describe import load_device_file

    plan = make_plan(load_device_file(str(DATA / "cpuinfo_host_epyc_avx2.txt")), read_model(path),
                     path="w4a16-tinygemm")  # fmt: skip
    layers = {(layer.name, layer.format): layer for layer in plan.layers}
    # Q6_K's and Q5_0's grids are int8 grids the 8-bit kernel runs (group 16 and 32): the plan copies their codes
    # (edge.model.gguf_metadata.INT8_GRIDS)
    assert layers["v_proj", "int8"].why.endswith("the file's codes copied (Q6_K x1)")
    assert layers["v_proj", "int8"].indices == [0]
    assert layers["down_proj", "int8"].why.endswith("the file's codes copied (Q5_0 x1)")
    assert layers["down_proj", "int4"].why == "quantized: the file's codes copied (1)"


def test_edge_select_evaluate_scores_a_gguf_against_the_files_own_weights(tmp_path, tokenizer_source, monkeypatch):
    """edge-select --model FILE.gguf --evaluate: edge-eval converts the file by the plan and scores it against
    the file's own weights (dequantized to bf16, as the default model's source is its GGUF's); the record carries
    the file's name, so the next plan for that file quotes it."""
    from tests.kernels.test_evaluate import plan_then_evaluate

    monkeypatch.setenv("EDGE_SELECT_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_gguf(tmp_path / "src", "llama", tokenizer_source)
    record = plan_then_evaluate(path)
    assert record["model"] == path.stem and 0 < record["kld_mean"] < 0.05, record


def test_an_up_to_date_check_on_a_gguf_parses_no_header(tmp_path, tokenizer_source, monkeypatch):
    """Every edge-serve start runs the check beside the engine's own start: a 262144-token vocabulary's header
    took gguf-py 12 s and 800 MiB to parse (kernels/convert/convert.py source_files)."""
    from kernels.convert import convert as convert_module

    path = tiny_gguf(tmp_path / "src", "llama", tokenizer_source)
    dst = _convert(path, tmp_path / "dst")

    def no_parse(src):
        raise AssertionError(f"the header of {src} was parsed")

    monkeypatch.setattr(convert_module, "read_source", no_parse)
    assert _convert(path, dst) == dst  # up to date: returned before reading the source
    path.touch()  # a new time, the same bytes: settled by the sha256, still without the header
    assert _convert(path, dst) == dst
    path.write_bytes(path.read_bytes() + b"\0")  # other bytes: converted again, which reads it
    with pytest.raises(AssertionError, match="was parsed"):
        _convert(path, dst)
