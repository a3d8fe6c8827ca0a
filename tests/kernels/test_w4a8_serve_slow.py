"""Real vLLM serves the default model through the plugin's `cpu_w4a8` method, and it agrees with bf16.

As tests/kernels/test_serve_slow.py does for cpu_int4 (and with its prompts and its generator, run as a child
process): vLLM starts twice in a row, bf16 then the cpu_w4a8 conversion (GPTQ symmetric group 64 for the
linears, int8 embedding and head), greedy-generates 16 tokens for each prompt, and the tests compare the token
ids. `enforce_eager=True`: these tests are about numerics and loading; the compiled path runs in
benchmarks/bench_engine.py. Skipped, with this host's own reason, where vLLM's library has no int4_scaled_mm_cpu.

Measured here (AMD EPYC Zen 5, avx512_bf16/avx512_vnni, no AMX, 2026-11-30, 10 prompts x 16 tokens): first token
0.7, mean agreeing prefix 0.163, exact 1/10; " Paris, the capital of France." on prompt 0 (bf16: " Paris."). The
first tokens that differ: "Water boils at", "The largest planet", "The opposite of hot is". This is the GPTQ
weights' rounding (symmetric, group 64, re-rounded from the source's asymmetric group-32 grid: edge-eval mean KLD
0.397, of which the int8 activations add ~0.03 over the same weights dequantized), not the kernel; cpu_int4 on
the source's own grid measured first token 0.9 (tests/kernels/test_serve_slow.py). Engine starts (eager) 13-18 s.

W4A8 solved by GPTQ after activation smoothing (asymmetric group 32, edge.plan.engine_config.W4A8_ROUNDING;
edge-eval KLD 0.064) is served beside it (2026-12-07, same host): first token 0.7, mean agreeing prefix 0.263, exact
2/10. It misses " Paris" on prompt 0 (" 1400."), as the same checkpoint does outside the engine (HF modules with the
same op), so that prompt is asserted for the rounded-to-nearest one only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edge.plan.engine_config import W4A8_ROUNDING, W4A8_SOLVED_GROUP
from tests.kernels import test_serve_slow as serve

pytestmark = pytest.mark.slow
# Floors under the measurement (module docstring), leaving room for two more flips on 10 prompts.
FIRST_TOKEN_FLOOR = 0.5  # measured 0.7
ROW_AGREEMENT_FLOOR = 0.1  # measured 0.163


def _skip_reason() -> str | None:
    from edge.device.probe import probe
    from edge.model.reader import default_model
    from edge.plan.gates import gate_w4a8
    from kernels.vllm_plugin.cpu_w4a8 import op_available

    if op_available():
        return None
    refusals = gate_w4a8(probe(measure_layout=False), default_model()).refusals
    return f"vLLM's library on this host has no int4_scaled_mm_cpu: {'; '.join(refusals)}"


def checkpoints(cache: Path) -> dict[str, str]:
    """bf16 default model and its cpu_w4a8 conversion (cached: the converter skips an up-to-date DST)."""
    from kernels.convert.convert import convert
    from kernels.source.default_model import ensure_default_model
    from kernels.vllm_plugin.cpu_w4a8 import quantization_config

    bf16 = ensure_default_model()
    w4a8 = convert(bf16, cache / "smollm2-cpu-w4a8", quantization_config(group_size=64), path="w4a8-gptq")
    # GPTQ after smoothing, asymmetric group 32 (edge.plan.engine_config.W4A8_ROUNDING; not planned yet)
    solved = convert(bf16, cache / "smollm2-cpu-w4a8-gptq",
                     quantization_config(group_size=W4A8_SOLVED_GROUP, sym=False, rounding=W4A8_ROUNDING),
                     path="w4a8-gptq")  # fmt: skip
    return {"bf16": str(bf16), "cpu_w4a8": str(w4a8), "cpu_w4a8_gptq": str(solved)}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    cache = Path(os.environ.get("EDGE_SELECT_CACHE_DIR", Path.home() / ".cache/edge-select")) / "test-checkpoints"
    models = checkpoints(cache)
    out = cache / "w4a8_serve_slow_results.json"  # kept for the report; pytest rotates its own tmp dirs away
    out.unlink(missing_ok=True)
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path_factory.mktemp("vllm-cache"))}
    proc = subprocess.run([sys.executable, serve.__file__, str(out), json.dumps(models)], env=env,
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    for label in ("cpu_w4a8", "cpu_w4a8_gptq"):
        results[label]["agreement"] = serve.agreement(results[label]["tokens"], results["bf16"]["tokens"])
    print(json.dumps({k: {"agreement": v.get("agreement"), "start_s": v["start_s"]} for k, v in results.items()}))
    return results


def test_plugin_registers_cpu_w4a8_in_a_fresh_vllm_process():
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins(); "
        "from vllm.model_executor.layers.quantization import get_quantization_config; "
        "print(get_quantization_config('cpu_w4a8').__name__)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "CpuW4A8Config"


def test_vllm_loads_the_checkpoint_as_cpu_w4a8(served):
    assert served["cpu_w4a8"]["quantization"] == "cpu_w4a8"


def test_w4a8_answers_paris(served):
    assert serve.PROMPTS[0] == "The capital of France is"
    assert served["cpu_w4a8"]["text"][0].startswith(" Paris")


def test_w4a8_greedy_tokens_agree_with_bf16(served):
    score = served["cpu_w4a8"]["agreement"]
    assert score["first"] >= FIRST_TOKEN_FLOOR, score
    assert score["prefix"] >= ROW_AGREEMENT_FLOOR, score


def test_the_gptq_checkpoint_loads_as_cpu_w4a8_with_its_zeros(served):
    """The asymmetric (gptq_v2) checkpoint: the engine reads its qzeros into the kernel's zero points."""
    assert served["cpu_w4a8_gptq"]["quantization"] == "cpu_w4a8"


def test_gptq_agrees_with_bf16_at_least_as_well_as_rounding_to_nearest(served):
    solved, nearest = served["cpu_w4a8_gptq"]["agreement"], served["cpu_w4a8"]["agreement"]
    assert solved["first"] >= FIRST_TOKEN_FLOOR, solved
    assert solved["prefix"] >= nearest["prefix"], (solved, nearest)
