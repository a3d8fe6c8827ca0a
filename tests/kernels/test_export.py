"""edge-export: the phone bundle (an ONNX graph with int8 weights and its KV cache as inputs/outputs), run here in
ONNX Runtime's CPU provider. The fast tests use a tiny random Llama; the slow one the default model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime  # noqa: E402,F401  (scripts/test installs the export extra: missing means broken set-up)
import pytest
import torch

from edge.errors import InputError  # noqa: E402
from kernels.export.export import GRAPH, MANIFEST, export  # noqa: E402
from kernels.export.export_verify import GraphModel  # noqa: E402
from kernels.source.checkpoint import read_manifest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.make_random_llama import LlamaShape, write  # noqa: E402

TINY = LlamaShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, vocab=512, tied=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("tiny") / "tiny-llama", TINY)


@pytest.fixture(scope="module")
def bundle(tiny, tmp_path_factory) -> Path:
    return export(tiny, tmp_path_factory.mktemp("out") / "bundle", verify=False, log=lambda message: None)


def source_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from kernels.scoring.eval_model import load_source

    with torch.inference_mode():
        return load_source(model_dir).float()(input_ids=ids, use_cache=False).logits[0]  # [S, V]


def test_the_bundle_holds_graph_configs_and_a_manifest_of_every_file(bundle):
    manifest, problem = read_manifest(bundle, MANIFEST, deep=True)
    assert problem is None
    assert {GRAPH, "config.json"} <= set(manifest["files"])
    assert manifest["runtime"]["name"] == "onnxruntime" and manifest["runtime"]["opset"] == 21
    assert manifest["graph"]["linears_int8"] == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    assert set(manifest["source"]["sha256"]) == {"config.json", "model-00001.safetensors"}


def test_the_graphs_weights_are_int8_per_block_of_each_output_channel(bundle):
    import onnx

    graph = onnx.load(str(bundle / GRAPH)).graph
    weights = {t.name: t for t in graph.initializer}
    dq = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 15
    assert all(weights[n.input[0]].data_type == onnx.TensorProto.INT8 for n in dq)
    blocks = {a.name: a.i for a in dq[0].attribute}
    assert blocks == {"axis": 0, "block_size": 64}
    float_matrices = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2
                      and t.dims[0] * t.dims[1] >= 128 * 128}  # fmt: skip
    assert float_matrices == {"cos", "sin"}  # the RoPE tables; norms are vectors


def test_graph_logits_match_the_source_within_8_bit_rounding(tiny, bundle):
    ids = torch.randint(0, TINY.vocab, (1, 12), generator=torch.Generator().manual_seed(1))
    expected = source_logits(tiny, ids)
    got = torch.from_numpy(GraphModel(bundle / GRAPH, threads=1).run(ids.numpy(), 0, None)[0][0])
    error = (got - expected).norm() / expected.norm()
    assert error < 0.02, error  # 8-bit weights


def test_decoding_on_the_cache_gives_the_logits_of_a_full_prefill(bundle):
    model = GraphModel(bundle / GRAPH, threads=1)
    ids = np.array([[5, 17, 99, 3, 250, 42]], np.int64)
    full, _ = model.run(ids, 0, None)
    _, past = model.run(ids[:, :5], 0, None)
    step, presents = model.run(ids[:, 5:], 5, past)
    assert presents[0].shape == (1, TINY.kv_heads, 6, TINY.hidden // TINY.heads)
    np.testing.assert_allclose(step[0, 0], full[0, 5], atol=1e-4)


def test_an_up_to_date_bundle_is_left_alone(tiny, bundle):
    before = (bundle / MANIFEST).stat().st_mtime_ns
    messages = []
    assert export(tiny, bundle, verify=False, log=messages.append) == bundle
    assert "up to date" in messages[0] and (bundle / MANIFEST).stat().st_mtime_ns == before


def test_another_export_into_the_same_out_needs_force(tiny, bundle):
    with pytest.raises(InputError, match="--force"):
        export(tiny, bundle, verify=True, log=lambda message: None)  # other settings: verification


def test_a_plan_that_is_not_export_only_is_refused(tiny, tmp_path):
    from edge.model_reader import read_model
    from edge.planner import make_plan
    from tests.edge.conftest import cpuinfo_device

    plan = make_plan(cpuinfo_device("host_epyc_avx2", memory_gib=24), read_model(tiny))
    with pytest.raises(InputError, match="export-only"):
        export(tiny, tmp_path / "out", plan, verify=False)


def test_a_missing_model_is_named(tmp_path):
    with pytest.raises(InputError, match="MODEL"):
        export(tmp_path / "nothing", tmp_path / "out", verify=False)


def test_nothing_is_left_beside_out(bundle):
    assert not [p for p in bundle.parent.iterdir() if p.name.startswith(f".{bundle.name}.tmp-")]
    assert json.loads((bundle / MANIFEST).read_text())["settings"]["verified_tokens"] is None


def test_export_takes_a_gguf_as_its_bf16_dequantization(tmp_path, monkeypatch):
    """edge-export MODEL.gguf: the file dequantized to bf16 by edge-convert (its own process: the converter sits
    above the exporter), into the cache's converted/, config and tokenizer from the file."""
    from kernels.export.export import resolve_model
    from kernels.source.default_model import source_gguf
    from tests.kernels.test_convert_gguf import tiny_gguf

    monkeypatch.setenv("EDGE_SELECT_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tiny_gguf(tmp_path / "src", "llama", source_gguf())
    model_dir = resolve_model(str(gguf))
    assert model_dir.parent == tmp_path / "cache" / "converted"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (model_dir / "tokenizer.json").is_file() and list(model_dir.glob("*.safetensors"))


def test_export_names_a_model_it_cannot_read():
    from kernels.export.export import resolve_model

    with pytest.raises(InputError, match="MODEL"):
        resolve_model("/nonexistent/model")
