"""Real vLLM (eager) serves the default model's `cpu_int4` conversion with the AVX2 int4 decode kernels selected
(`decode_kernel: avx2`, int16 activations, and `avx2-w4a8`, int8), and greedy-generates what the same weights
generate through tinygemm (int8: the first token of most prompts; its quality is edge-eval's to measure).

One subprocess (this file run as a script) starts vLLM three times, one engine at a time: the direct conversion
with tinygemm for decode rows, then the same conversion with each AVX2 decode kernel. max_num_seqs=1 so every
decode step is one row; prompts wider than avx2.avx2_int4_decode_rows (4) take tinygemm in all three.
The int16 kernel rounds activations below bf16's own rounding and sums in another order
(integers per group, scale and zero once per group), so a near-tied logit may flip late in a sequence: the test
asks for the same first generated tokens.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colors are",
    "The largest planet in our solar system is",
]
NEW_TOKENS = 8
FIRST_TOKENS = 3  # generated tokens that must agree on every prompt


def checkpoints(cache: Path) -> dict[str, Path]:
    from kernels.convert.convert import convert
    from kernels.source.default_model import ensure_default_model
    from kernels.vllm_plugin.cpu_int4 import quantization_config

    bf16 = ensure_default_model()
    models = {}
    for kernel in ("tinygemm", "avx2", "avx2-w4a8"):
        qconfig = quantization_config("direct", group_size=64, quantize_embedding=True, decode_kernel=kernel)
        models[kernel] = convert(bf16, cache / f"smollm2-direct-{kernel}", qconfig, path="w4a16-tinygemm")
    return models


def generate_all(models: dict[str, str], out: Path) -> None:
    from vllm import LLM, SamplingParams

    results: dict[str, dict] = {}
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for label, model in models.items():
        start = time.monotonic()
        llm = LLM(model=model, max_model_len=256, kv_cache_memory_bytes=32 << 20, max_num_seqs=1,
                  enforce_eager=True, seed=0)  # fmt: skip
        ready = time.monotonic()
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        results[label] = {
            "quantization": llm.llm_engine.vllm_config.model_config.quantization,
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "text": [o.outputs[0].text for o in outputs],
            "start_s": round(ready - start, 1),
            "generate_s": round(time.monotonic() - ready, 1),
        }
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        out.write_text(json.dumps(results, indent=1))


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    cache = Path(os.environ.get("EDGE_SELECT_CACHE_DIR", Path.home() / ".cache/edge-select")) / "test-checkpoints"
    models = {label: str(path) for label, path in checkpoints(cache).items()}
    out = cache / "avx2_serve_slow_results.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path_factory.mktemp("vllm-cache"))}
    proc = subprocess.run([sys.executable, __file__, str(out), json.dumps(models)], env=env, capture_output=True,
                          text=True, timeout=2400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    print(json.dumps(results))
    return results


pytestmark = pytest.mark.slow


def test_all_load_as_cpu_int4(served):
    assert {served[kernel]["quantization"] for kernel in ("tinygemm", "avx2", "avx2-w4a8")} == {"cpu_int4"}


def test_the_avx2_decode_kernel_generates_tinygemms_first_greedy_tokens(served):
    for ours, theirs in zip(served["avx2"]["tokens"], served["tinygemm"]["tokens"], strict=True):
        assert ours[:FIRST_TOKENS] == theirs[:FIRST_TOKENS], (served["avx2"]["text"], served["tinygemm"]["text"])


def test_they_still_answer_paris(served):
    assert served["avx2"]["text"][0].startswith(" Paris")
    assert served["avx2-w4a8"]["text"][0].startswith(" Paris")


def test_int8_activations_keep_the_first_token_of_most_prompts(served):
    pairs = zip(served["avx2-w4a8"]["tokens"], served["tinygemm"]["tokens"], strict=True)
    assert sum(ours[0] == theirs[0] for ours, theirs in pairs) >= len(PROMPTS) - 1, served["avx2-w4a8"]["text"]


if __name__ == "__main__":
    generate_all(json.loads(sys.argv[2]), Path(sys.argv[1]))
