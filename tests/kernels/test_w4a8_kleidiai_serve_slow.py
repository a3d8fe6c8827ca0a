"""Real vLLM runs the plugin's cpu_w4a8 layers on ARM's kernel (issue 43): a Pi 5's plan pinned to w4a8-gptq
(KleidiAI through torch's _dyn_quant ops, group 32, float16) must load and generate in the real engine.

No vLLM engine runs under emulation and this host is x86, so it stands in: EDGE_W4A8_KERNEL=kleidiai takes the ARM
branch of the method (kernels/vllm_plugin/cpu_w4a8.py) on torch's reference code for the same ops, which checks the
method in the engine (loading, packing, the op in vLLM's compiled graph, float16), never KleidiAI itself; the kernel's
own accuracy under emulation is tests/kernels/test_arm_int4.py's. Compared with vLLM's int4_scaled_mm_cpu on the same
checkpoint where this host's `_C` has it: both round activations to int8 per row (KleidiAI asymmetrically), and on this
model W4A8 keeps only 67.5 % of the source's top-1 tokens (edge-eval, mean KLD 0.39), so the two kernels' texts part
early (here at the second token of one prompt, 2026-12-06): they must agree on each prompt's first token, and the
ARM branch eager and compiled on the first two.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

PROMPTS = ["The capital of France is", "Water boils at a temperature of", "The three primary colors are"]
NEW_TOKENS = 16
FIRST_TOKENS = 2
DATA = Path(__file__).parents[1] / "edge" / "data"

pytestmark = pytest.mark.slow


def generate(model: str, out: Path, dtype: str, compiled: bool) -> None:
    import torch
    from vllm import LLM, SamplingParams

    from edge.plan.engine_config import COMPILATION_CONFIG

    keywords = {"compilation_config": COMPILATION_CONFIG} if compiled else {"enforce_eager": True}
    llm = LLM(model=model, dtype=dtype, max_model_len=256, kv_cache_memory_bytes=32 << 20, max_num_seqs=4, seed=0,
              **keywords)  # fmt: skip
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)  # fmt: skip
    layers = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.named_modules()
    kleidiai = sum(1 for _, module in layers if isinstance(getattr(module, "kleidiai_packed", None), torch.Tensor))
    out.write_text(json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "text": [o.outputs[0].text for o in outputs],
        "dtype": str(llm.llm_engine.model_config.dtype),
        "kleidiai_layers": kleidiai,
    }))  # fmt: skip
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    from edge.device.describe import load_device_file
    from edge.measure.quality import shipped_records
    from edge.model.reader import default_model
    from edge.plan.planner import make_plan
    from kernels.convert.convert import convert
    from kernels.source.default_model import ensure_default_model
    from kernels.vllm_plugin.cpu_w4a8 import op_available
    from tests.kernels.conftest import engine_child  # the parent's: the engine child never imports it

    plan = make_plan(load_device_file(str(DATA / "cpuinfo_rpi5.txt")), default_model(), priority="speed",
                     path="w4a8-gptq", quality=shipped_records())  # fmt: skip
    args = plan.vllm.args
    assert args[args.index("--dtype") + 1] == "float16" and plan.quantization_config["group_size"] == 32
    cache = Path(os.environ.get("EDGE_SELECT_CACHE_DIR", Path.home() / ".cache/edge-select")) / "test-checkpoints"
    model = convert(ensure_default_model(), cache / "smollm2-pi5-w4a8", plan.quantization_config, path=plan.path)
    variants = {"kleidiai-float16": ("kleidiai", "float16", False), "kleidiai-compiled": ("kleidiai", "bfloat16", True)}
    if op_available():
        variants["vllm-w4a8"] = ("int4_scaled_mm_cpu", "bfloat16", False)
    results = {}
    for label, (kernel, dtype, compiled) in variants.items():
        out = tmp_path_factory.mktemp(label) / "out.json"
        env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path_factory.mktemp("vllm-cache")),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "EDGE_W4A8_KERNEL": kernel}  # fmt: skip
        results[label] = engine_child(__file__, out, [str(model), str(out), dtype, str(compiled)], env)
    print(json.dumps(results))
    return results


def test_the_int4_layers_ran_on_the_arm_kernel_in_float16(served):
    assert served["kleidiai-float16"]["dtype"] == "torch.float16"
    # the default model's 30 layers: q/k/v, o, gate/up and down each one linear (vLLM fuses q/k/v and gate/up)
    assert served["kleidiai-float16"]["kleidiai_layers"] == 30 * 4
    assert served["kleidiai-compiled"]["kleidiai_layers"] == 30 * 4


def test_the_arm_kernel_answers_and_agrees_with_itself_compiled(served):
    for label in ("kleidiai-float16", "kleidiai-compiled"):
        assert served[label]["text"][0].startswith(" Paris"), served[label]["text"]
    pairs = zip(served["kleidiai-float16"]["tokens"], served["kleidiai-compiled"]["tokens"], strict=True)
    for eager, compiled in pairs:
        assert eager[:FIRST_TOKENS] == compiled[:FIRST_TOKENS]


def test_the_arm_kernel_agrees_with_vllms_w4a8_kernel(served):
    if "vllm-w4a8" not in served:
        pytest.skip("this host's vLLM library has no int4_scaled_mm_cpu (AVX2 or AVX-512 without BF16)")
    for ours, theirs in zip(served["kleidiai-float16"]["tokens"], served["vllm-w4a8"]["tokens"], strict=True):
        assert ours[0] == theirs[0], (served["kleidiai-float16"]["text"],
                                                              served["vllm-w4a8"]["text"])  # fmt: skip


if __name__ == "__main__":  # vLLM may re-import the main module in a process it spawns
    generate(sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "True")
