"""edge.model.reader: real config.json files in, every linear's (N, K) out."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from edge.errors import InputError
from edge.model.reader import DEFAULT_MODEL_NAME, default_model, read_model, read_model_config

CONFIGS = Path(__file__).parent / "data" / "configs"


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def linears(shape) -> dict[str, tuple[int, int, int]]:
    return {lin.name: (lin.n, lin.k, lin.count) for lin in shape.linears}


def test_default_model_is_smollm2_135m_instruct_with_its_published_shapes():
    model = default_model()
    assert model.name == DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct-bf16"
    assert (model.architecture, model.model_type) == ("LlamaForCausalLM", "llama")
    assert (model.hidden_size, model.intermediate_size, model.num_layers) == (576, 1536, 30)
    assert (model.num_heads, model.num_kv_heads, model.head_dim, model.rotary_dim) == (9, 3, 64, 64)
    assert (model.vocab_size, model.tie_word_embeddings, model.max_position_embeddings) == (49152, True, 8192)
    assert model.torch_dtype == "bfloat16"
    assert model.layer_types is None and model.sliding_window is None


def test_default_model_lists_every_linear_with_n_k_as_the_checkpoint_holds_them():
    # LlamaForCausalLM printout of SmolLM2-135M: q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536.
    assert linears(default_model()) == {
        "q_proj": (576, 576, 30),
        "k_proj": (192, 576, 30),
        "v_proj": (192, 576, 30),
        "o_proj": (576, 576, 30),
        "gate_proj": (1536, 576, 30),
        "up_proj": (1536, 576, 30),
        "down_proj": (576, 1536, 30),
        "lm_head": (49152, 576, 1),
    }


def test_packaged_config_is_the_real_one_with_rope_theta_and_dtype():
    text = resources.files("edge").joinpath("data/smollm2-135m-instruct.json").read_text()
    packaged = json.loads(text)
    assert packaged["rope_theta"] == 100000
    assert packaged["torch_dtype"] == "bfloat16"
    assert packaged["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize(
    ("fixture", "architecture", "layers", "heads", "kv_heads", "head_dim", "vocab", "tied"),
    [
        ("smollm2-135m-instruct", "LlamaForCausalLM", 30, 9, 3, 64, 49152, True),
        ("llama-3.2-1b", "LlamaForCausalLM", 16, 32, 8, 64, 128256, True),
        ("mistral-7b-v0.3", "MistralForCausalLM", 32, 32, 8, 128, 32768, False),
        ("qwen2.5-0.5b-instruct", "Qwen2ForCausalLM", 24, 14, 2, 64, 151936, True),
        ("qwen3-0.6b", "Qwen3ForCausalLM", 28, 16, 8, 128, 151936, True),
        ("gemma-2b", "GemmaForCausalLM", 18, 8, 1, 256, 256000, True),
        ("gemma-2-2b", "Gemma2ForCausalLM", 26, 8, 4, 256, 256000, True),
        ("phi-3-mini-4k-instruct", "Phi3ForCausalLM", 32, 32, 32, 96, 32064, False),
    ],
)
def test_each_architecture_reads_with_its_counts(
    fixture, architecture, layers, heads, kv_heads, head_dim, vocab, tied
):
    model = read_model(CONFIGS / f"{fixture}.json")
    assert model.name == fixture
    assert model.architecture == architecture
    assert (model.num_layers, model.num_heads, model.num_kv_heads) == (layers, heads, kv_heads)
    assert (model.head_dim, model.vocab_size, model.tie_word_embeddings) == (head_dim, vocab, tied)
    assert all(lin.count == layers for lin in model.linears if lin.name != "lm_head")
    assert linears(model)["lm_head"] == (vocab, model.hidden_size, 1)


def test_qwen3_takes_its_explicit_head_dim_not_hidden_over_heads():
    model = read_model(CONFIGS / "qwen3-0.6b.json")
    assert model.hidden_size == 1024 and model.head_dim == 128  # 1024 / 16 heads would be 64
    shapes = linears(model)
    assert shapes["q_proj"] == (16 * 128, 1024, 28)
    assert shapes["k_proj"] == (8 * 128, 1024, 28)
    assert shapes["o_proj"] == (1024, 16 * 128, 28)


def test_mistral_without_head_dim_derives_it_from_hidden_over_heads():
    assert read_model(CONFIGS / "mistral-7b-v0.3.json").head_dim == 4096 // 32


def test_gemma2_alternates_sliding_and_global_layers_starting_with_sliding():
    model = read_model(CONFIGS / "gemma-2-2b.json")
    assert model.sliding_window == 4096
    assert model.layer_types is not None and len(model.layer_types) == 26
    assert model.layer_types[:4] == [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ]
    assert model.layer_types.count("sliding_attention") == 13


def test_gemma_ties_embeddings_when_the_config_does_not_say():
    raw = config("gemma-2b")
    assert "tie_word_embeddings" not in raw
    assert read_model_config(raw, "gemma-2b").tie_word_embeddings is True


def test_llama_does_not_tie_embeddings_when_the_config_does_not_say():
    raw = config("smollm2-135m-instruct")
    del raw["tie_word_embeddings"]
    assert read_model_config(raw, "x").tie_word_embeddings is False


def test_qwen2_with_sliding_disabled_has_full_attention_everywhere():
    model = read_model(CONFIGS / "qwen2.5-0.5b-instruct.json")
    assert model.layer_types is None and model.sliding_window is None


def test_qwen2_with_sliding_enabled_slides_from_max_window_layers_on():
    raw = config("qwen2.5-0.5b-instruct") | {"use_sliding_window": True}
    model = read_model_config(raw, "qwen2.5-sliding")
    assert model.sliding_window == 32768
    assert model.layer_types == ["full_attention"] * 21 + ["sliding_attention"] * 3


def test_mistral_without_a_window_has_full_attention_everywhere():
    assert read_model(CONFIGS / "mistral-7b-v0.3.json").layer_types is None


def test_phi3_lists_fused_qkv_and_gate_up_as_vllm_loads_them():
    shapes = linears(read_model(CONFIGS / "phi-3-mini-4k-instruct.json"))
    assert shapes == {
        "qkv_proj": ((32 + 2 * 32) * 96, 3072, 32),
        "o_proj": (3072, 3072, 32),
        "gate_up_proj": (2 * 8192, 3072, 32),
        "down_proj": (3072, 8192, 32),
        "lm_head": (32064, 3072, 1),
    }


def test_phi3_model_level_sliding_window_applies_to_every_layer():
    model = read_model(CONFIGS / "phi-3-mini-4k-instruct.json")
    assert model.sliding_window == 2047
    assert model.layer_types == ["sliding_attention"] * 32


def test_partial_rotary_factor_shrinks_rotary_dim():
    raw = config("phi-3-mini-4k-instruct") | {"partial_rotary_factor": 0.5}
    assert read_model_config(raw, "phi-partial").rotary_dim == 48


def test_read_model_accepts_a_model_directory_and_names_it_after_the_directory(tmp_path):
    model_dir = tmp_path / "SmolLM2-135M-Instruct"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config("smollm2-135m-instruct")))
    model = read_model(model_dir)
    assert model.name == "SmolLM2-135M-Instruct"
    assert model.hidden_size == 576


def test_text_config_nesting_reads_the_language_model():
    wrapped = {
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": config("smollm2-135m-instruct"),
    }
    model = read_model_config(wrapped, "vlm")
    assert model.architecture == "LlamaForCausalLM"
    assert model.hidden_size == 576


def test_missing_field_error_names_the_field_and_the_value():
    raw = config("smollm2-135m-instruct")
    del raw["num_attention_heads"]
    with pytest.raises(InputError) as err:
        read_model_config(raw, "x")
    assert str(err.value) == "config.json: num_attention_heads: expected a positive integer, got None"


@pytest.mark.parametrize("bad", ["576", 0, -1, 57.6, True])
def test_ill_typed_field_error_names_the_field(bad):
    raw = config("smollm2-135m-instruct") | {"hidden_size": bad}
    with pytest.raises(InputError) as err:
        read_model_config(raw, "x")
    assert err.value.field == "config.json: hidden_size"
    assert err.value.value == bad


def test_nested_field_error_names_the_text_config_path():
    inner = config("smollm2-135m-instruct")
    del inner["vocab_size"]
    with pytest.raises(InputError) as err:
        read_model_config({"architectures": ["LlavaForConditionalGeneration"], "text_config": inner}, "vlm")
    assert err.value.field == "config.json: text_config.vocab_size"


def test_unknown_architecture_is_refused_naming_it():
    raw = config("smollm2-135m-instruct") | {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(InputError) as err:
        read_model_config(raw, "gpt2")
    assert err.value.field == "config.json: architectures"
    assert err.value.value == ["GPT2LMHeadModel"]


def test_missing_path_is_refused(tmp_path):
    with pytest.raises(InputError) as err:
        read_model(tmp_path / "nowhere")
    assert err.value.field == "model"


def test_invalid_json_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="readable JSON"):
        read_model(tmp_path)


def test_edge_modules_import_without_torch_or_vllm():
    code = (
        "import sys, edge.model.reader, edge.catalog.shape_rules, edge.measure.ledger; "
        "bad = [m for m in ('torch', 'vllm', 'fastapi', 'server', 'kernels') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
