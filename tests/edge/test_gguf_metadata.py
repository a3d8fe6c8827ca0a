"""A GGUF header as the model's config (edge.model.gguf_metadata), the model reader's other inputs (a .gguf file, a repo
id in the local Hugging Face cache, a Gemma 3 config without `architectures`), checked against the real default
model's GGUF and its real config.json, and against transformers' own GGUF loader where it is installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge.errors import InputError
from edge.model.gguf_metadata import header_from_json, hf_config, read_header, source_grid, tensor_types
from edge.model.reader import default_model, read_model, read_model_config, resolve_model


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


# Qwen3-0.6B's linears as a GGUF names them (blk.N.<name>.weight), [N, K] in Hugging Face orientation, and the
# Hugging Face names of the same weights (llama.cpp's convert_hf_to_gguf.py tensor map)
QWEN3_LINEARS = {"attn_q": [2048, 1024], "attn_k": [1024, 1024], "attn_v": [1024, 1024], "attn_output": [1024, 2048],
                 "ffn_gate": [3072, 1024], "ffn_up": [3072, 1024], "ffn_down": [1024, 3072]}  # fmt: skip
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}  # fmt: skip


def _mixed_header(layers: int, types: dict[str, list[str]], default: str = "Q4_K") -> dict:
    """A Qwen3-0.6B-shaped header as JSON: each linear `default` but where `types` gives its kind's type per
    layer; the embedding Q6_K (tied, as Qwen3's are), as llama.cpp's Q4_K_M holds it."""
    body = _json_header("qwen3", **{"qwen3.attention.key_length": 128})
    body["metadata"]["qwen3.block_count"] = layers
    body["tensors"] = [{"name": "token_embd.weight", "type": "Q6_K", "shape": [151936, 1024]}] + [
        {"name": f"blk.{i}.{name}.weight", "type": types.get(name, [default] * layers)[i], "shape": shape}
        for i in range(layers) for name, shape in QWEN3_LINEARS.items()
    ]  # fmt: skip
    return body


def _mixed_plan(body: dict, priority: str = "speed"):
    from edge.device.describe import load_device_file
    from edge.model.reader import read_gguf_header
    from edge.plan.planner import make_plan

    device = load_device_file(str(Path(__file__).parent / "data" / "cpuinfo_host_epyc_avx2.txt"))
    model = read_gguf_header(header_from_json(body), "qwen3-q4km")
    return make_plan(device, model, priority=priority, path="w4a16-tinygemm")


def _int4_bytes(n: int, k: int) -> int:
    return n * k // 2 + 2 * 2 * n * (k // 32)  # codes [N, K/2] uint8 + bf16 scales and zeros [N, K/32] each


def _int8_bytes(n: int, k: int) -> int:
    return n * k + 4 * n * (k // 16)  # codes [N, K] int8 + a float32 scale per 16 (the file holds Q6_K)


def test_the_file_says_which_layers_of_a_kind_hold_which_type():
    from edge.model.gguf_metadata import source_layers, source_types

    header = header_from_json(_mixed_header(4, {"attn_v": ["Q6_K", "Q4_K", "Q4_K", "Q4_K"]}))
    assert source_types(header)["v_proj"] == {"Q4_K": 3, "Q6_K": 1}
    assert source_types(header)["lm_head"] == {"Q6_K": 1}  # tied: the embedding
    assert source_layers(header) == {"v_proj": {"Q4_K": [1, 2, 3], "Q6_K": [0]}}  # the kinds held in one type: absent


@pytest.mark.parametrize("index", ["x", "4", "-1"])
def test_a_layer_index_that_is_no_layer_of_the_model_is_refused_naming_the_tensor(index):
    body = _mixed_header(4, {})
    body["tensors"].append({"name": f"blk.{index}.attn_v.weight", "type": "Q4_K", "shape": [1024, 1024]})
    with pytest.raises(InputError) as refused:
        from edge.model.reader import read_gguf_header

        read_gguf_header(header_from_json(body), "odd")
    assert refused.value.field == f"gguf tensor blk.{index}.attn_v.weight"


def test_the_grid_is_the_4_bit_tensors_when_the_rest_are_wider():
    """llama.cpp's Q4_K_M of a model whose rows are not multiples of 256 holds most linears at Q5_0 and the 1536-wide
    ffn_down at Q4_K (docs/reports/2026-12-01-gguf-models.md): the Q4_K ones keep their codes at group 32, the
    wider ones go to 8 bits. A file of 8-bit linears has no 4-bit grid; nor one of mostly float linears."""
    wide = {name: ["Q5_0"] * 4 for name in QWEN3_LINEARS if name != "ffn_down"}
    assert source_grid(header_from_json(_mixed_header(4, wide))) == 32
    assert source_grid(header_from_json(_mixed_header(4, {}, default="Q8_0"))) is None
    assert source_grid(header_from_json(_mixed_header(4, {"ffn_down": ["Q4_K"] * 4}, default="F16"))) is None


def test_the_plan_keeps_the_files_own_grid_tensor_by_tensor():
    """A Q4_K_M-like file: v_proj at Q6_K on layers 0 and 3, Q4_K between; ffn_gate the other way round, Q8_0 but
    on layer 2, Q4_0. The speed plan (w4a16 at the file's group 32) takes each tensor in its own format, a 4-bit
    one with the file's codes, a wider one int8, and vLLM's fused siblings (q/k with v, up with gate) the widest
    of their layer; the plan's layers and ledger count each part in its format."""
    types = {"attn_v": ["Q6_K", "Q4_K", "Q4_K", "Q6_K"], "ffn_gate": ["Q8_0", "Q8_0", "Q4_0", "Q8_0"]}
    plan = _mixed_plan(_mixed_header(4, types))
    assert plan.group_size == 32 and plan.quantization_config["codes_from_source"] is True
    # written out from `types`: the wide tensors and their fused siblings, per layer
    eight_bit = {(name, i) for name in ("attn_q", "attn_k", "attn_v") for i in (0, 3)}
    eight_bit |= {(name, i) for name in ("ffn_gate", "ffn_up") for i in (0, 1, 3)}
    assert set(plan.quantization_config["int8"]) == {"embed_tokens", "lm_head"} | {
        f"model.layers.{i}.{HF_NAMES[name]}" for name, i in eight_bit}  # fmt: skip
    parts = {(layer.name, layer.format): layer for layer in plan.layers}
    assert {key: (part.count, part.indices, part.source) for key, part in parts.items()} == {
        ("embed_tokens", "int8"): (1, None, {"Q6_K": 1}), ("lm_head", "int8"): (1, None, {"Q6_K": 1}),
        ("q_proj", "int8"): (2, [0, 3], {"Q4_K": 2}), ("q_proj", "int4"): (2, [1, 2], {"Q4_K": 2}),
        ("k_proj", "int8"): (2, [0, 3], {"Q4_K": 2}), ("k_proj", "int4"): (2, [1, 2], {"Q4_K": 2}),
        ("v_proj", "int8"): (2, [0, 3], {"Q6_K": 2}), ("v_proj", "int4"): (2, [1, 2], {"Q4_K": 2}),
        ("o_proj", "int4"): (4, None, {"Q4_K": 4}), ("down_proj", "int4"): (4, None, {"Q4_K": 4}),
        ("gate_proj", "int8"): (3, [0, 1, 3], {"Q8_0": 3}), ("gate_proj", "int4"): (1, [2], {"Q4_0": 1}),
        ("up_proj", "int8"): (3, [0, 1, 3], {"Q4_K": 3}), ("up_proj", "int4"): (1, [2], {"Q4_K": 1}),
    }  # fmt: skip
    assert parts["v_proj", "int4"].why == "quantized: the file's codes copied (2)"
    assert parts["v_proj", "int8"].why.endswith("the file's codes copied (Q6_K x2)")
    assert parts["q_proj", "int8"].why.endswith("re-rounded per group of 16 from Q4_K x2")
    assert plan.quantization_config["int8_group_size"] == 16  # the file holds Q6_K: its sub-blocks of 16
    ledger: dict[tuple[str, str], int] = {}
    for item in plan.memory.items:
        if item.kind in ("int4-weights", "int8-weights"):
            key = (item.layer, item.kind.removesuffix("-weights"))
            ledger[key] = ledger.get(key, 0) + item.bytes
    for gguf_name, (n, k) in QWEN3_LINEARS.items():
        name = HF_NAMES[gguf_name].split(".")[1]
        for fmt, size in (("int8", _int8_bytes(n, k)), ("int4", _int4_bytes(n, k))):
            layers = sum(((gguf_name, i) in eight_bit) == (fmt == "int8") for i in range(4))
            assert ledger.get((name, fmt), 0) == layers * size, (name, fmt)


def test_a_fidelity_plan_keeps_q_k_v_at_8_bits_where_the_file_has_no_4_bit_codes_for_them():
    """Fidelity keeps SENSITIVE_SET at 8 bits, but for the tensors whose codes come from the file's own grid: the Q4_K
    ones keep them, a wider one is int8 anyway, and an F16 one (no codes to keep) goes to 8 bits with its siblings."""
    types = {"attn_v": ["Q6_K", "Q4_K", "Q4_K", "Q4_K"], "attn_q": ["Q4_K", "Q4_K", "F16", "Q4_K"]}
    plan = _mixed_plan(_mixed_header(4, types), priority="fidelity")
    formats: dict[tuple[str, str], list[int]] = {}  # a kind may be int8 for two reasons: two parts
    for layer in plan.layers:
        formats[layer.name, layer.format] = sorted(formats.get((layer.name, layer.format), []) + (layer.indices or []))
    for name in ("q_proj", "k_proj", "v_proj"):
        assert (formats[name, "int8"], formats[name, "int4"]) == ([0, 2], [1, 3]), name
    assert ("o_proj", "int4") in formats and ("o_proj", "int8") not in formats
    assert ("embed_tokens", "bf16") in formats  # HEAD_FORMAT["fidelity"], as for any source


def test_the_8_bit_set_is_per_group_only_where_the_weights_come_from_a_gguf_and_a_kernel_runs_it():
    """A model read from a GGUF (the default model's edge-source.json; a file) keeps the file's 8-bit grids, one
    scale per 32 weights (the default model's embedding is Q8_0); a Hugging Face checkpoint has no grid to keep
    and stays per channel, as does an ARM board, where no kernel runs per-group int8 (each decode step would
    dequantize the head)."""
    from edge.device.describe import load_device_file
    from edge.plan.planner import make_plan

    data = Path(__file__).parent / "data"
    zen5 = load_device_file(str(data / "cpuinfo_epyc_zen5_avx512.txt"))
    graviton = load_device_file(str(data / "cpuinfo_graviton3.txt"))
    speed = make_plan(zen5, default_model(), priority="speed", path="w4a16-tinygemm")
    assert speed.quantization_config["int8_group_size"] == 32
    assert {layer.name: layer.group for layer in speed.layers if layer.format == "int8"} == {
        "embed_tokens": 32, "lm_head": 32}  # fmt: skip
    hf = make_plan(zen5, read_model(data / "configs" / "smollm2-135m-instruct.json"), path="w4a16-tinygemm")
    assert "int8" in hf.quantization_config and "int8_group_size" not in hf.quantization_config
    arm = make_plan(graviton, default_model(), priority="speed", path="w4a16-tinygemm")
    assert "int8_group_size" not in arm.quantization_config


def test_reading_a_header_leaves_mistral_common_unimported():
    """edge-serve's wrapper reads a GGUF's header to plan and then serves: gguf-py's package would import
    mistral_common where it is installed (30 MiB it never uses; edge.model.gguf_metadata.import_gguf). A fresh
    process reads the default model's header without it, and can still import it afterwards."""
    import subprocess
    import sys

    path = default_gguf()
    pytest.importorskip("mistral_common")
    code = ("import sys; from edge.model.gguf_metadata import read_header; "
            f"header = read_header({str(path)!r}); "
            "print(header.architecture, 'mistral_common' in sys.modules); "
            "import mistral_common.tokens.tokenizers.mistral; print('importable')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["llama", "False", "importable"]


def test_the_default_ggufs_lean_read_is_gguf_pys():
    """The planner's read (no gguf-py reader: edge.model.gguf_metadata._read_lean) of the default model's file."""
    lean, full = read_header(default_gguf()), read_header(default_gguf(), keep_reader=True)
    assert lean.reader is None and list(lean.metadata.items()) == list(full.metadata.items())
    assert lean.tensors == full.tensors and lean.metadata["tokenizer.ggml.tokens"] == 49152
