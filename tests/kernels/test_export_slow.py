"""The phone flow end to end on the default model: edge-select on an Android description names the export command;
running it builds a bundle that ONNX Runtime loads and generates with, within the quality targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnxruntime  # noqa: E402,F401  (scripts/test installs the export extra: missing means broken set-up)
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ANDROID = REPO / "tests" / "edge" / "data" / "inventory_phone_tensor_g2.json"


@pytest.fixture(scope="module")
def phone_bundle(tmp_path_factory) -> tuple[Path, dict]:
    work = tmp_path_factory.mktemp("phone")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    plan = subprocess.run([sys.executable, "-m", "edge.cli", "--device", str(ANDROID), "--json"], cwd=REPO,
                          env=env, capture_output=True, text=True, check=True).stdout  # fmt: skip
    (work / "PLAN.json").write_text(plan)
    command = json.loads(plan)["export"]["command"]
    assert command[0] == "edge-export" and command[-2:] == ["--plan", "PLAN.json"]
    # the plan's own command, run as a module (the console script needs a reinstall after pyproject changes)
    args = [command[1], str(work / command[2]), "--plan", str(work / "PLAN.json")]
    subprocess.run([sys.executable, "-m", "kernels.export.export", *args], cwd=REPO, env=env, check=True, timeout=900)
    out = work / command[2]
    return out, json.loads((out / "manifest.json").read_text())


def test_the_bundle_meets_the_quality_targets(phone_bundle):
    _, manifest = phone_bundle
    quality = manifest["verification"]["quality"]
    assert quality["metrics"]["top1_agreement"]["value"] >= 0.97  # measured 0.9749 on 4096 tokens
    assert quality["metrics"]["mean_kld"]["value"] <= 0.01  # measured 0.00165
    assert quality["passes"]


def test_the_bundle_records_its_plan_runtime_and_files(phone_bundle):
    out, manifest = phone_bundle
    assert manifest["plan"]["path"] == "export-only" and manifest["plan"]["export"]["runtime"] == "onnxruntime"
    assert manifest["runtime"]["name"] == "onnxruntime"
    assert {"model.onnx", "tokenizer.json", "generation_config.json"} <= set(manifest["files"])
    size = sum(entry["size"] for entry in manifest["files"].values())
    assert abs(size - manifest["plan"]["export"]["bundle_bytes"]) < 0.05 * size  # the ledger's expectation


def test_the_bundle_loads_and_generates_like_the_source(phone_bundle):
    from transformers import AutoTokenizer

    from kernels.export.export_verify import GraphModel

    out, manifest = phone_bundle
    tokenizer = AutoTokenizer.from_pretrained(out)  # the bundle's own tokenizer files
    ids = tokenizer("The capital of France is")["input_ids"]
    text = tokenizer.decode(GraphModel(out / "model.onnx").generate(ids, 4))
    assert text.startswith(" Paris")
    assert manifest["verification"]["greedy"]["first_token"] >= 0.9  # measured 1.0 (10 prompts)


def test_onnxruntime_genai_loads_the_bundle_and_answers_paris(phone_bundle):
    """The bundle as a phone app opens it: onnxruntime_genai's Model reads genai_config.json, its Tokenizer the
    bundle's tokenizer files, its Generator decodes greedily on its own KV cache."""
    from kernels.export import genai

    out, manifest = phone_bundle
    [row] = genai.generate(out, ["The capital of France is"], 4)
    assert row["text"].startswith(" Paris"), row
    through = manifest["verification"]["onnxruntime_genai"]
    assert through["tokenizer_agrees"] == 1.0  # its tokenizer gives transformers' prompt ids on every prompt
    assert through["equal_to_graph"] >= 0.9  # its generator gives the graph's own tokens (measured 1.0)
