"""A GGUF header as the model's config (edge.gguf_metadata), the model reader's other inputs (a .gguf file, a repo
id in the local Hugging Face cache, a Gemma 3 config without `architectures`), checked against the real default
model's GGUF and its real config.json, and against transformers' own GGUF loader where it is installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge.errors import InputError
from edge.gguf_metadata import header_from_json, hf_config, read_header, source_grid, tensor_types
from edge.model_reader import default_model, read_model, read_model_config, resolve_model


def default_gguf():
    pytest.importorskip("gguf")
    from kernels.source.default_model import source_gguf

    try:
        return source_gguf()
    except InputError as missing:  # the data package is installed by scripts/setup
        pytest.skip(f"the default model's GGUF is not installed: {missing}")


def test_the_default_models_gguf_reads_as_its_real_config():
    """Every shape the planner uses, from the header alone, equals the shapes read from the config.json that
    transformers wrote for the same model (edge/data/smollm2-135m-instruct.json)."""
    path = default_gguf()
    from_gguf = read_model(path).model_dump()
    from_config = default_model().model_dump()
    assert from_gguf.pop("name") == path.stem
    from_config.pop("name")
    types = from_gguf.pop("source_types")
    assert from_config.pop("source_types") is None
    assert types["q_proj"] == {"Q4_1": 30} and types["embed_tokens"] == types["lm_head"] == {"Q8_0": 1}
    assert from_gguf == from_config  # the source grid included: its linears are Q4_1 (group 32)


def test_the_default_gguf_header_counts_its_types():
    header = read_header(default_gguf())
    assert tensor_types(header) == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert header.metadata["tokenizer.ggml.tokens"] == 49152  # an array is its length
    assert source_grid(header) == 32


def test_the_config_matches_transformers_own_reading_of_the_file():
    pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_gguf()
    theirs = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    ours = hf_config(read_header(path))
    shared = sorted(set(ours) & set(theirs) - {"architectures", "torch_dtype", "dtype"})
    assert len(shared) >= 10, shared
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}


def _json_header(arch: str, **extra) -> dict:
    meta = {
        "general.architecture": arch,
        f"{arch}.block_count": 4,
        f"{arch}.context_length": 32768,
        f"{arch}.embedding_length": 1024,
        f"{arch}.feed_forward_length": 3072,
        f"{arch}.attention.head_count": 16,
        f"{arch}.attention.head_count_kv": 8,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 1e6,
        "tokenizer.ggml.tokens": 151936,
        **extra,
    }
    tensors = [{"name": "token_embd.weight", "type": "Q6_K", "shape": [151936, 1024]},
               {"name": "blk.0.attn_q.weight", "type": "Q4_K", "shape": [2048, 1024]}]  # fmt: skip
    return {"metadata": meta, "tensors": tensors}


def test_a_qwen3_header_sent_as_json_gives_its_shapes():
    """Qwen3 has head_dim 128 with hidden 1024 and 16 heads: the key length (or q's rows) says so."""
    body = _json_header("qwen3", **{"qwen3.attention.key_length": 128})
    model = read_model_config(hf_config(header_from_json(body)), "qwen3-tiny")
    assert (model.architecture, model.head_dim, model.vocab_size) == ("Qwen3ForCausalLM", 128, 151936)
    assert model.tie_word_embeddings  # no output.weight
    q = next(lin for lin in model.linears if lin.name == "q_proj")
    assert (q.n, q.k) == (16 * 128, 1024)
    body = _json_header("qwen3")  # no key_length: q's rows give it
    assert read_model_config(hf_config(header_from_json(body)), "q").head_dim == 128


def test_a_gemma3_header_gives_the_sliding_pattern_and_head_dim():
    body = _json_header("gemma3", **{"gemma3.attention.key_length": 256, "gemma3.attention.sliding_window": 512})
    body["metadata"]["gemma3.block_count"] = 12
    model = read_model_config(hf_config(header_from_json(body)), "gemma3-tiny")
    assert model.model_type == "gemma3_text" and model.head_dim == 256 and model.sliding_window == 512
    assert [i for i, t in enumerate(model.layer_types) if t == "full_attention"] == [5, 11]  # every 6th


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"metadata": {"general.architecture": "mamba"}}, "general.architecture"),
        ({"metadata": {"general.architecture": "llama"}}, "llama.block_count"),
        ({"metadata": []}, "gguf.metadata"),
        ({"metadata": {}, "tensors": [{"name": "x", "type": "F32", "shape": [0]}]}, "gguf.tensors[0]"),
    ],
)
def test_a_bad_header_names_its_field(body, field):
    with pytest.raises(InputError) as refused:
        hf_config(header_from_json(body))
    assert refused.value.field == field


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    pytest.importorskip("gguf")
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(InputError) as refused:
        read_model(bad)
    assert refused.value.field == "model" and "model.gguf" in str(refused.value)


def test_a_gemma3_text_config_without_architectures_is_read():
    """As transformers writes it from a Gemma 3 GGUF: model_type gemma3_text, no architectures, defaults omitted."""
    config = {"model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048,
              "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
              "max_position_embeddings": 32768, "sliding_window": 512}  # fmt: skip
    model = read_model_config(config, "gemma-3-270m")
    assert model.architecture == "Gemma3ForCausalLM"
    assert (model.head_dim, model.vocab_size, model.tie_word_embeddings) == (256, 262208, True)
    assert model.layer_types.count("full_attention") == 3  # layers 5, 11, 17


def test_a_gemma3_wrapper_config_reads_its_text_model():
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                              "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4}}  # fmt: skip
    model = read_model_config(config, "gemma-3-4b")
    assert model.architecture == "Gemma3ForCausalLM" and model.max_position_embeddings == 131072


def _hf_cache(root, repo: str, files: dict[str, str]):
    snapshot = root / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    (root / "hub" / f"models--{repo.replace('/', '--')}" / "refs").mkdir()
    (root / "hub" / f"models--{repo.replace('/', '--')}" / "refs" / "main").write_text("abc123")
    return snapshot


def test_a_repo_id_resolves_to_its_snapshot_in_the_local_cache(tmp_path, monkeypatch):
    from importlib import resources

    config = resources.files("edge").joinpath("data/smollm2-135m-instruct.json").read_text()
    snapshot = _hf_cache(tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct", {"config.json": config})
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == snapshot
    assert read_model("HuggingFaceTB/SmolLM2-135M-Instruct").hidden_size == json.loads(config)["hidden_size"]


def test_a_repo_id_not_in_the_cache_is_refused_without_downloading(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError) as refused:
        read_model("someone/not-here")
    assert refused.value.field == "model" and "nothing is downloaded" in str(refused.value)


def test_the_plans_layers_say_what_the_file_holds_and_what_each_kind_becomes():
    """A Q4_K_M-like file: v_proj at Q6_K on a few layers, the rest Q4_K, the embedding Q6_K. The speed plan
    (w4a16 at the file's group 32) says per kind what the file had, and which tensors keep their codes."""
    from edge.describe import load_device_file
    from edge.gguf_metadata import source_types
    from edge.planner import make_plan

    layers = 4
    body = _json_header("qwen3", **{"qwen3.attention.key_length": 128})
    body["metadata"]["qwen3.block_count"] = layers
    shapes = {"attn_q": [2048, 1024], "attn_k": [1024, 1024], "attn_v": [1024, 1024], "attn_output": [1024, 2048],
              "ffn_gate": [3072, 1024], "ffn_up": [3072, 1024], "ffn_down": [1024, 3072]}  # fmt: skip
    body["tensors"] = [{"name": "token_embd.weight", "type": "Q6_K", "shape": [151936, 1024]}] + [
        {"name": f"blk.{i}.{kind}.weight", "type": "Q6_K" if kind == "attn_v" and i < 1 else "Q4_K", "shape": shape}
        for i in range(layers) for kind, shape in shapes.items()
    ]  # fmt: skip
    header = header_from_json(body)
    assert source_types(header)["v_proj"] == {"Q4_K": 3, "Q6_K": 1}
    assert source_types(header)["lm_head"] == {"Q6_K": 1}  # tied: the embedding
    model = read_model_config(hf_config(header), "qwen3-q4km").model_copy(
        update={"source_grid": source_grid(header), "source_types": source_types(header)})
    device = load_device_file(str(Path(__file__).parent / "data" / "cpuinfo_host_epyc_avx2.txt"))
    plan = make_plan(device, model, priority="speed", path="w4a16-tinygemm")
    by_name = {layer.name: layer for layer in plan.layers}
    assert plan.group_size == 32 and plan.quantization_config["codes_from_source"] is True
    assert by_name["v_proj"].source == {"Q4_K": 3, "Q6_K": 1}
    assert by_name["v_proj"].why == "quantized: the file's codes copied (3), re-rounded from Q6_K x1"
    assert by_name["q_proj"].why == "quantized: the file's codes copied (4)"
    assert by_name["embed_tokens"].source == {"Q6_K": 1} and by_name["embed_tokens"].format == "int8"
