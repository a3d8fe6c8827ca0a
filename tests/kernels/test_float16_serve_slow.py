"""Real vLLM serves an ARM plan's configuration in float16 (issue 43): a Raspberry Pi 5's plan (Cortex-A76: FP16
arithmetic, no BF16) runs the engine with `--dtype float16`, and the plugin's cpu_int4 layers must load and generate in
it. No vLLM engine runs under emulation, so this host stands in for the Pi: the plan's quantization_config, with this
host's own tinygemm block and prefill parameters (the plugin refuses a checkpoint packed for another block), converted
from the default model and generated greedily in float16 and in bfloat16 by vLLM's offline engine, eager, one
subprocess each.

float16 keeps 3 more mantissa bits than bf16 in everything vLLM computes outside the plugin's ops (norms, attention,
the residual stream), so the texts may part late at a near tie; the first tokens must agree and both answer Paris.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

PROMPTS = ["The capital of France is", "Water boils at a temperature of", "The three primary colors are"]
NEW_TOKENS = 16
FIRST_TOKENS = 3
DATA = Path(__file__).parents[1] / "edge" / "data"

pytestmark = pytest.mark.slow


def generate(model: str, out: Path, dtype: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=256, kv_cache_memory_bytes=32 << 20, max_num_seqs=4, seed=0,
              enforce_eager=True)  # fmt: skip
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)  # fmt: skip
    out.write_text(json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "text": [o.outputs[0].text for o in outputs],
        "dtype": str(llm.llm_engine.model_config.dtype),
    }))  # fmt: skip
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def pi5_plan():
    from edge.device.describe import load_device_file
    from edge.measure.quality import shipped_records
    from edge.model.reader import default_model
    from edge.plan.planner import make_plan

    return make_plan(load_device_file(str(DATA / "cpuinfo_rpi5.txt")), default_model(), priority="speed",
                     quality=shipped_records())  # fmt: skip


@pytest.fixture(scope="module")
def served(pi5_plan, tmp_path_factory) -> dict:
    from kernels.convert.convert import convert
    from kernels.source.default_model import ensure_default_model
    from kernels.vllm_plugin.cpu_int4 import host_params
    from tests.kernels.conftest import engine_child  # the parent's: the engine child never imports it

    args = pi5_plan.vllm.args
    assert args[args.index("--dtype") + 1] == "float16"
    host = host_params()
    qconfig = {**pi5_plan.quantization_config, "tinygemm_block": host.block, "prefill_dtype": host.prefill_dtype,
               "dequant_threshold": host.dequant_threshold, "repack_chunk_rows": host.repack_chunk_rows}  # fmt: skip
    cache = Path(os.environ.get("EDGE_SELECT_CACHE_DIR", Path.home() / ".cache/edge-select")) / "test-checkpoints"
    model = convert(ensure_default_model(), cache / "smollm2-pi5-plan-on-host", qconfig, path=pi5_plan.path)
    vllm_cache = tmp_path_factory.mktemp("vllm-cache")
    results = {}
    for dtype in ("float16", "bfloat16"):
        out = tmp_path_factory.mktemp(dtype) / "out.json"
        env = {**os.environ, "VLLM_CACHE_ROOT": str(vllm_cache), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        results[dtype] = engine_child(__file__, out, [str(model), str(out), dtype], env)
    print(json.dumps(results))
    return results


def test_the_engine_ran_the_plans_dtype(served):
    assert served["float16"]["dtype"] == "torch.float16"
    assert served["bfloat16"]["dtype"] == "torch.bfloat16"


def test_float16_generates_bf16s_first_tokens_and_paris(served):
    for half, bf16 in zip(served["float16"]["tokens"], served["bfloat16"]["tokens"], strict=True):
        assert half[:FIRST_TOKENS] == bf16[:FIRST_TOKENS], (served["float16"]["text"], served["bfloat16"]["text"])
    assert served["float16"]["text"][0].startswith(" Paris")


if __name__ == "__main__":  # vLLM may re-import the main module in a process it spawns
    generate(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
