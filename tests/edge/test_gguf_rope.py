"""A GGUF's RoPE scaling in the config edge-select writes from its header (edge.model.gguf_metadata.hf_config), checked
against transformers' own RoPE functions: Llama 3's rope_freqs.weight, Phi-3's LongRoPE factors, the linear and
YaRN metadata keys. The files are tiny (one layer) but carry the real models' rotary shapes and frequencies."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from edge.errors import InputError
from edge.model.gguf_metadata import header_from_json, hf_config, read_header
from edge.model.reader import read_model_config

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen2Config  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

VOCAB = 16
HEADS = 2


def _write(path: Path, arch: str, tensors: dict[str, np.ndarray], *, theta: float, head_dim: int, context: int,
           metadata: dict[str, float | int] | None = None) -> Path:  # fmt: skip
    """A one-layer `arch` file as llama.cpp's converter writes its header, with `tensors` (F32) beside an
    embedding; `metadata`: {arch}.<key> -> value, ints as uint32, floats as float32."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(context)
    writer.add_embedding_length(HEADS * head_dim)
    writer.add_feed_forward_length(4 * head_dim)
    writer.add_block_count(1)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    for key, value in (metadata or {}).items():
        (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, HEADS * head_dim), np.float32))
    for name, values in tensors.items():
        writer.add_tensor(name, np.asarray(values, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_config(theta: float, head_dim: int, rope_parameters: dict) -> LlamaConfig:
    rope = {"rope_theta": theta, **rope_parameters}
    return LlamaConfig(hidden_size=HEADS * head_dim, num_attention_heads=HEADS, head_dim=head_dim,
                       max_position_embeddings=131072, rope_parameters=rope)  # fmt: skip


def _base_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """transformers' unscaled frequencies, float32 [head_dim / 2]."""
    return LlamaRotaryEmbedding.compute_default_rope_parameters(_llama_config(theta, head_dim, {}))[0]


def _llama3_divisors(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """What rope_freqs.weight holds for Llama 3 `scaling`: the base frequencies over transformers' llama3 ones."""
    config = _llama_config(theta, head_dim, {"rope_type": "llama3", **scaling})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, None)
    return (_base_inv_freq(theta, head_dim) / scaled).numpy().astype(np.float32)


LLAMA3_CASES = {  # theta, head_dim, rope_scaling of the HF config
    "llama-3.1-8b": (500000.0, 128, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}),
    "llama-3.2-1b": (500000.0, 64, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}),
    "other-context": (10000.0, 64, {"factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                                    "original_max_position_embeddings": 4096}),
}  # fmt: skip


@pytest.mark.parametrize("case", LLAMA3_CASES)
def test_llama3_rope_freqs_become_the_rope_parameters_that_give_the_same_frequencies(tmp_path, case):
    """The config's llama3 rope_parameters, through transformers' llama3 function, give the frequencies llama.cpp
    runs (base / rope_freqs) to float32 precision; the file cannot say the original context (only low/L and high/L
    reach the frequencies), so a 4096 one comes back as 8192 with both factors doubled."""
    theta, head_dim, scaling = LLAMA3_CASES[case]
    divisors = _llama3_divisors(theta, head_dim, scaling)
    assert divisors.max() > 1.0 and (divisors == 1.0).any()  # all three parts of the curve are in the file
    path = _write(tmp_path / "llama3.gguf", "llama", {"rope_freqs.weight": divisors}, theta=theta, head_dim=head_dim,
                  context=131072)  # fmt: skip
    config = hf_config(read_header(path))
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == theta
    theirs, attention = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**config), None)
    expected = _base_inv_freq(theta, head_dim) / torch.from_numpy(divisors)
    torch.testing.assert_close(theirs, expected, rtol=2**-20, atol=0)
    assert attention == 1.0
    scale = rope["original_max_position_embeddings"] / scaling["original_max_position_embeddings"]
    assert rope["factor"] == scaling["factor"]
    assert rope["low_freq_factor"] == pytest.approx(scaling["low_freq_factor"] * scale, rel=1e-6)
    assert rope["high_freq_factor"] == pytest.approx(scaling["high_freq_factor"] * scale, rel=1e-6)


def test_the_original_context_in_the_file_is_kept(tmp_path):
    theta, head_dim, scaling = LLAMA3_CASES["other-context"]
    path = _write(tmp_path / "llama3.gguf", "llama", {"rope_freqs.weight": _llama3_divisors(theta, head_dim, scaling)},
                  theta=theta, head_dim=head_dim, context=131072,
                  metadata={"rope.scaling.original_context_length": 4096})  # fmt: skip
    rope = hf_config(read_header(path))["rope_parameters"]
    assert rope["original_max_position_embeddings"] == 4096
    assert (rope["low_freq_factor"], rope["high_freq_factor"]) == pytest.approx((2.0, 8.0), rel=1e-6)


def _corrupt(theta: float, head_dim: int, scaling: dict) -> dict[str, np.ndarray]:
    """rope_freqs that are not of llama3 form: random, one divisor of a real curve off by 1e-4, below 1."""
    real = _llama3_divisors(theta, head_dim, scaling)
    nudged = real.copy()
    band = np.flatnonzero((real > 1) & (real < real.max()))
    nudged[band[1]] *= 1 + 1e-4
    return {"random": np.random.default_rng(0).uniform(1, 4, head_dim // 2), "nudged": nudged,
            "below one": np.where(real == 1.0, 0.5, real)}  # fmt: skip


@pytest.mark.parametrize("kind", ["random", "nudged", "below one", "too short"])
def test_rope_freqs_not_of_llama3_form_are_refused_naming_the_tensor(tmp_path, kind):
    theta, head_dim, scaling = LLAMA3_CASES["llama-3.1-8b"]
    corrupt = _corrupt(theta, head_dim, scaling) | {"too short": _llama3_divisors(theta, head_dim, scaling)[:-1]}
    path = _write(tmp_path / "bad.gguf", "llama", {"rope_freqs.weight": corrupt[kind]}, theta=theta, head_dim=head_dim,
                  context=131072)  # fmt: skip
    with pytest.raises(InputError) as refused:
        hf_config(read_header(path))
    assert refused.value.field == "rope_freqs.weight"


def test_a_file_without_rope_scaling_keeps_its_config(tmp_path):
    """No rope tensors, or divisors all 1: the config is the one without any, transformers' default RoPE."""
    plain = hf_config(read_header(_write(tmp_path / "plain.gguf", "llama", {}, theta=1e4, head_dim=64, context=4096)))
    ones = _write(tmp_path / "ones.gguf", "llama", {"rope_freqs.weight": np.ones(32)}, theta=1e4, head_dim=64,
                  context=4096)  # fmt: skip
    assert "rope_parameters" not in plain and plain["rope_theta"] == 1e4
    assert hf_config(read_header(ones)) == plain


def test_a_json_header_listing_rope_freqs_plans_without_its_data():
    """POST /plan's header has no tensor data: the divisors change no shape, so the plan is made without them."""
    body = {"metadata": {"general.architecture": "llama", "llama.block_count": 16, "llama.embedding_length": 2048,
                         "llama.attention.head_count": 32, "llama.attention.head_count_kv": 8,
                         "llama.feed_forward_length": 8192, "llama.rope.freq_base": 500000.0,
                         "llama.context_length": 131072, "tokenizer.ggml.tokens": 128256},
            "tensors": [{"name": "rope_freqs.weight", "type": "F32", "shape": [32]}]}  # fmt: skip
    config = hf_config(header_from_json(body))
    assert "rope_parameters" not in config
    assert read_model_config(config, "llama-3.2-1b").head_dim == 64


# Phi-3-mini-128k's shape: head 96, 4096 tokens trained, 131072 served; factors as its config lists them
PHI3_HEAD, PHI3_CONTEXT, PHI3_ORIGINAL = 96, 131072, 4096
PHI3_LONG = [round(1.0 + 0.01 * i * i, 2) for i in range(PHI3_HEAD // 2)]
PHI3_SHORT = [round(1.0 + 0.002 * i, 3) for i in range(PHI3_HEAD // 2)]


def _phi3(tmp_path: Path, attn_factor: float) -> dict:
    tensors = {"rope_factors_long.weight": np.array(PHI3_LONG), "rope_factors_short.weight": np.array(PHI3_SHORT)}
    path = _write(tmp_path / "phi3.gguf", "phi3", tensors, theta=10000.0, head_dim=PHI3_HEAD, context=PHI3_CONTEXT,
                  metadata={"rope.scaling.original_context_length": PHI3_ORIGINAL,
                            "rope.scaling.attn_factor": attn_factor})  # fmt: skip
    return hf_config(read_header(path))


def _longrope(config: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    return ROPE_INIT_FUNCTIONS["longrope"](Phi3Config(**config), None, seq_len)


def test_phi3_longrope_factors_and_original_context_reach_transformers(tmp_path):
    """transformers' Phi3Config takes the config; its longrope function gives the file's frequencies, base /
    long factor past the original context and base / short factor within it, and llama.cpp's attn_factor."""
    scale = PHI3_CONTEXT / PHI3_ORIGINAL
    attn_factor = math.sqrt(1 + math.log(scale) / math.log(PHI3_ORIGINAL))  # llama.cpp's converter, for longrope
    config = _phi3(tmp_path, attn_factor)
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == PHI3_ORIGINAL
    assert config["original_max_position_embeddings"] == PHI3_ORIGINAL
    assert rope["long_factor"] == PHI3_LONG and rope["short_factor"] == PHI3_SHORT  # the decimals the config had
    assert "attention_factor" not in rope  # the one transformers and vLLM compute
    base = _base_inv_freq(10000.0, PHI3_HEAD)
    for seq_len, factors in ((PHI3_CONTEXT, PHI3_LONG), (None, PHI3_SHORT)):
        inv_freq, attention = _longrope(config, seq_len)
        torch.testing.assert_close(inv_freq, base / torch.tensor(factors, dtype=torch.float32), rtol=2**-20, atol=0)
        assert attention == pytest.approx(attn_factor, rel=1e-6)


def test_a_phi3_attn_factor_of_its_own_is_written(tmp_path):
    config = _phi3(tmp_path, 1.25)
    assert _longrope(config, PHI3_CONTEXT)[1] == pytest.approx(1.25)
    assert config["rope_parameters"]["short_mscale"] == config["rope_parameters"]["long_mscale"] == 1.25  # vLLM's


def test_one_longrope_factor_tensor_without_the_other_is_refused(tmp_path):
    path = _write(tmp_path / "phi3.gguf", "phi3", {"rope_factors_long.weight": np.array(PHI3_LONG)}, theta=1e4,
                  head_dim=PHI3_HEAD, context=PHI3_CONTEXT)  # fmt: skip
    with pytest.raises(InputError) as refused:
        hf_config(read_header(path))
    assert refused.value.field == "rope_factors_short.weight"


def _json(arch: str, **metadata) -> dict:
    meta = {"general.architecture": arch, f"{arch}.block_count": 2, f"{arch}.embedding_length": 1024,
            f"{arch}.attention.head_count": 16, f"{arch}.attention.head_count_kv": 8,
            f"{arch}.feed_forward_length": 3072, f"{arch}.context_length": 32768, f"{arch}.rope.freq_base": 1e6,
            "tokenizer.ggml.tokens": 151936, **metadata}  # fmt: skip
    return {"metadata": meta}


def test_qwen2_yarn_metadata_becomes_transformers_yarn():
    body = _json("qwen2", **{"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
                             "qwen2.rope.scaling.original_context_length": 32768})  # fmt: skip
    config = Qwen2Config(**hf_config(header_from_json(body)))
    assert config.rope_parameters == {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                      "original_max_position_embeddings": 32768}  # fmt: skip
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    assert inv_freq.shape == (32,) and attention == pytest.approx(0.1 * math.log(4.0) + 1)  # YaRN's mscale


def test_gemma3_linear_scaling_applies_to_its_global_layers_only():
    body = _json("gemma3", **{"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0,
                              "gemma3.attention.key_length": 256})  # fmt: skip
    config = Gemma3TextConfig(**hf_config(header_from_json(body)))
    assert config.rope_parameters["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    assert config.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}


def test_phi3_partial_rotary_reaches_the_planner():
    """Phi-4-mini rotates 96 of each head's 128 dimensions (rope.dimension_count)."""
    body = _json("phi3", **{"phi3.embedding_length": 3072, "phi3.attention.head_count": 24,
                            "phi3.rope.dimension_count": 96})  # fmt: skip
    assert read_model_config(hf_config(header_from_json(body)), "phi-4-mini").rotary_dim == 96


@pytest.mark.parametrize(("key", "value"), [("qwen2.rope.scaling.type", "ntk"), ("qwen2.rope.scaling.factor", "4")])
def test_bad_rope_scaling_metadata_names_its_key(key, value):
    body = _json("qwen2", **{"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0, key: value})
    with pytest.raises(InputError) as refused:
        hf_config(header_from_json(body))
    assert refused.value.field == key


def test_the_lean_header_read_is_gguf_pys_field_for_field(tmp_path):
    """read_header without gguf-py's reader (edge.model.gguf_metadata._read_lean, what the planner uses) gives what
    gguf-py's parse gives: metadata in its order, the tensor table and the RoPE tensors' values (the Llama 3 and
    Phi-3 files here, whose factors are float32 values that print short)."""
    theta, head_dim, scaling = LLAMA3_CASES[next(iter(LLAMA3_CASES))]
    divisors = _llama3_divisors(theta, head_dim, scaling)
    llama3 = _write(tmp_path / "llama3.gguf", "llama", {"rope_freqs.weight": divisors}, theta=theta,
                    head_dim=head_dim, context=131072)  # fmt: skip
    tensors = {"rope_factors_long.weight": np.array(PHI3_LONG), "rope_factors_short.weight": np.array(PHI3_SHORT)}
    phi3 = _write(tmp_path / "phi3.gguf", "phi3", tensors, theta=10000.0, head_dim=PHI3_HEAD, context=PHI3_CONTEXT,
                  metadata={"rope.scaling.original_context_length": PHI3_ORIGINAL})  # fmt: skip
    for path in (llama3, phi3):
        lean, full = read_header(path), read_header(path, keep_reader=True)
        assert lean.reader is None and full.reader is not None
        assert list(lean.metadata.items()) == list(full.metadata.items())
        assert lean.tensors == full.tensors and lean.rope_data == full.rope_data and lean.rope_data


def test_a_gguf_cut_short_is_refused_by_name(tmp_path):
    path = _write(tmp_path / "plain.gguf", "llama", {}, theta=1e4, head_dim=64, context=4096)
    data = path.read_bytes()
    for cut in (8, 30, len(data) // 2):
        path.write_bytes(data[:cut])
        with pytest.raises(InputError) as refused:
            read_header(path)
        assert refused.value.field == "model" and "plain.gguf" in str(refused.value)
