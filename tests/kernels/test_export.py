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
    from edge.model.reader import read_model
    from edge.plan.planner import make_plan
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


# --- every family the planner serves, on tiny random checkpoints written by transformers itself ---------------------

COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
# Windows of 5 on 14-token prompts bind, so the graph's window masks are checked, not just present.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 48, "tie_word_embeddings": False}),  # q/k norms
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 32}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 32, "sliding_window": 5, "query_pre_attn_scalar": 24,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),  # fmt: skip
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 32, "sliding_window": 5,
                    "query_pre_attn_scalar": 24, "rope_local_base_freq": 10000.0,
                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}),  # fmt: skip
}


def family_checkpoint(directory: Path, family: str) -> Path:
    """A tiny random checkpoint of `family` (bf16 safetensors + config.json) saved by transformers; norms and biases
    random too, so Gemma's (1 + w) and Qwen2's biases change the logits."""
    import transformers

    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**COMMON, **extra))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                parameter.normal_(0, 0.3)
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, family_checkpoint(tmp_path_factory.mktemp(request.param) / request.param, request.param)


@pytest.mark.parametrize("activations", ["float32", "float16"])
def test_each_familys_graph_computes_what_transformers_computes(family, activations, tmp_path):
    """The float graph (before its linears go to 8 bits) against transformers' own forward on the same weights,
    the embedding rounded as the graph holds it: float32 agrees to rounding, float16 to float16's."""
    from kernels.export import export_graph
    from kernels.scoring.eval_model import load_source

    name, directory = family
    source = load_source(directory).float()
    with torch.no_grad():
        codes, scales = export_graph.int8_blocks(source.model.embed_tokens.weight)
        source.model.embed_tokens.weight.copy_((codes.float() * scales).flatten(1))
    ids = torch.randint(0, 512, (1, 14), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = source(input_ids=ids, use_cache=False).logits[0]
    shape = export_graph.export_float(source, tmp_path / "float.onnx", activations)
    assert shape["family"] == name and shape["activations"] == activations
    windowed = sum(t == "sliding_attention" for t in FAMILIES[name][2].get("layer_types", []))
    assert shape["windowed_layers"] == (3 if name == "mistral" else windowed)
    got = torch.from_numpy(GraphModel(tmp_path / "float.onnx", 1, session_config={}).run(ids.numpy(), 0, None)[0][0])
    error = float((got - expected).norm() / expected.norm())
    assert error < (1e-4 if activations == "float32" else 3e-3), error  # measured <= 3.5e-5 and <= 8.3e-4


def test_each_familys_bundle_decodes_on_its_cache_as_it_prefills(family, tmp_path):
    name, directory = family
    out = export(directory, tmp_path / "bundle", verify=False, activations="float16", log=lambda message: None)
    manifest, problem = read_manifest(out, MANIFEST, deep=True)
    assert problem is None and manifest["graph"]["family"] == name and manifest["graph"]["activations"] == "float16"
    model = GraphModel(out / GRAPH, threads=1)
    ids = np.random.default_rng(2).integers(0, 512, (1, 12))
    full, _ = model.run(ids, 0, None)
    _, past = model.run(ids[:, :8], 0, None)
    for i in range(8, 12):  # past the window of 5: the cache's old positions must be masked, not dropped
        step, past = model.run(ids[:, i : i + 1], i, past)
        np.testing.assert_allclose(step[0, 0], full[0, i], atol=2e-2, rtol=0)
    genai_config = json.loads((out / "genai_config.json").read_text())
    assert genai_config["model"]["type"] == name and genai_config["model"]["decoder"]["num_hidden_layers"] == 3
    assert genai_greedy(out, [5, 17, 99, 3], 6) == model.generate([5, 17, 99, 3], 6)  # ONNX Runtime GenAI takes it


def genai_greedy(bundle: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """onnxruntime_genai's own Model and Generator fed ids (a tiny bundle has no tokenizer files)."""
    import onnxruntime_genai as og

    from kernels.export.genai import greedy_ids

    return greedy_ids(og.Model(str(bundle)), prompt, new_tokens)


def test_a_family_the_exporter_does_not_build_is_named(tmp_path):
    directory = tmp_path / "phi"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}))
    with pytest.raises(InputError, match="model_type.*phi3"):
        export(directory, tmp_path / "out", verify=False)


def test_a_rope_whose_table_depends_on_the_length_is_named(tiny, tmp_path):
    import shutil

    directory = tmp_path / "dynamic"
    shutil.copytree(tiny, directory)
    config = json.loads((directory / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="rope_scaling.rope_type.*dynamic"):
        export(directory, tmp_path / "out", verify=False)


def test_bad_activations_are_named(tiny, tmp_path):
    with pytest.raises(InputError, match="--activations.*bfloat16"):
        export(tiny, tmp_path / "out", verify=False, activations="bfloat16")


def test_genai_config_names_the_graphs_inputs_outputs_and_cache(bundle):
    """genai_config.json against the graph itself: every name it gives is an input or output of model.onnx, the
    cache's shape is the graph's, and the session options are the ones the verification ran with."""
    from kernels.export.genai import SESSION_CONFIG

    config = json.loads((bundle / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    session = GraphModel(bundle / decoder["filename"], threads=1).session
    inputs, outputs = {i.name for i in session.get_inputs()}, {o.name for o in session.get_outputs()}
    layers = decoder["num_hidden_layers"]
    names = decoder["inputs"]
    assert {names["input_ids"], names["position_ids"]} <= inputs and decoder["outputs"]["logits"] in outputs
    for i in range(layers):
        assert {names["past_key_names"] % i, names["past_value_names"] % i} <= inputs
        assert {decoder["outputs"]["present_key_names"] % i, decoder["outputs"]["present_value_names"] % i} <= outputs
    past = next(i for i in session.get_inputs() if i.name == names["past_key_names"] % 0)
    assert (decoder["num_key_value_heads"], decoder["head_size"]) == (past.shape[1], past.shape[3])
    assert layers == TINY.layers and config["model"]["vocab_size"] == TINY.vocab
    assert SESSION_CONFIG.items() <= decoder["session_options"].items()
    assert config["search"]["past_present_share_buffer"] is False  # the graph concatenates its cache
    assert config["search"]["max_length"] == config["model"]["context_length"] <= TINY.max_position_embeddings


def test_onnxruntime_genai_loads_the_bundle_and_generates_what_the_graph_does(bundle):
    """onnxruntime_genai's own Model and Generator on the tiny bundle (its Tokenizer needs tokenizer files, which
    the tiny model lacks: the GGUF test and the slow test cover it), fed ids: its greedy tokens are the graph's."""
    assert genai_greedy(bundle, [5, 17, 99, 3], 6) == GraphModel(bundle / GRAPH, threads=1).generate([5, 17, 99, 3], 6)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_gguf_of_another_family_exports_and_onnxruntime_genai_runs_it(arch, tmp_path, monkeypatch):
    """A user's GGUF of Qwen3 or Gemma 3 (a tiny one, with the default model's tokenizer inside): edge-export
    dequantizes it, builds the family's graph and genai_config.json, and onnxruntime_genai's own tokenizer and
    generator produce the graph's greedy tokens from a text prompt."""
    from kernels.export import genai
    from kernels.source.default_model import source_gguf
    from tests.kernels.test_convert_gguf import tiny_gguf

    monkeypatch.setenv("EDGE_SELECT_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tiny_gguf(tmp_path / "src", arch, source_gguf())
    out = export(gguf, tmp_path / "bundle", verify=False, log=lambda message: None)
    manifest, problem = read_manifest(out, MANIFEST, deep=True)
    family = {"qwen3": "qwen3", "gemma3": "gemma3_text"}[arch]
    assert problem is None and manifest["graph"]["family"] == family
    assert {"genai_config.json", "tokenizer.json"} <= set(manifest["files"])
    [row] = genai.generate(out, ["The capital of France is"], 5)
    assert row["ids"] == GraphModel(out / GRAPH, threads=1).generate(row["prompt_ids"], 5)
