"""Real vLLM serving a GGUF's Q4_K tensors, its Q6_K head and its Q5_0 down_proj as the file's own blocks
(quantization_config.q4k, q6k, q5_0): test_mixed_grid's generated Q4_K_M-like llama, converted by this host's plan
for it on the int8-activation kernel twice, with the blocks test_q4k_blocks expects the plan to name and on the
grids. The engine must load the blocks into those layers (and no other), decode on them, and generate what the
grids generate where their choice is not a near-tie: the blocks hold the same codes, their scales the file's where
the grids round them (bf16 for the int4 grid), and the head and the Q5_0 down_proj run int8 activations where the
8-bit set's kernel runs int16, so a token whose top two log-probabilities lie within MARGIN may flip, and nothing
else may.

One subprocess per checkpoint (the plugin installs once per process), the engine core stepped inside it
(VLLM_ENABLE_V1_MULTIPROCESSING=0, as the plan's one-process mode serves), eager.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROMPTS = ["The capital of France is", "Water boils at a temperature of", "The three primary colors are",
           "My favourite book is"]  # fmt: skip
NEW_TOKENS = 8
MARGIN = 0.05  # nats between the grid's top two choices below which the blocks may choose the other
# vLLM layers the plan keeps as blocks (test_q4k_blocks: Q4_K, fused: qkv_proj of layers 1-3, o_proj of all 6,
# down_proj of layer 4; Q5_0: down_proj of layer 2; Q6_K: the untied head)
BLOCK_LAYERS = 3 + 6 + 1 + 1 + 1
Q5_0_DOWN = "model.layers.2.mlp.down_proj"

pytestmark = pytest.mark.slow


def generate(model: str, out: Path) -> None:
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, max_model_len=256, kv_cache_memory_bytes=32 << 20, max_num_seqs=4, seed=0,
              enforce_eager=True)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)

    def blocks(model: torch.nn.Module) -> list[str]:
        from kernels.vllm_plugin.cpu_int4 import CpuQ4kLinearMethod, _BlocksWeights

        def kept(module: torch.nn.Module) -> bool:  # in the decode layout
            method = getattr(module, "quant_method", None)
            if isinstance(method, CpuQ4kLinearMethod):
                return module.scales.dtype == torch.uint8
            return isinstance(method, _BlocksWeights) and module.blocks.dim() == 3

        return [name for name, module in model.named_modules() if kept(module)]

    out.write_text(json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "top2": [[sorted((p.logprob for p in step.values()), reverse=True)[:2] for step in o.outputs[0].logprobs]
                 for o in outputs],
        "block_layers": llm.apply_model(blocks)[0],
    }))  # fmt: skip
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_source) -> dict:
    from edge.device.probe import probe
    from edge.model.reader import read_model
    from edge.plan.planner import make_plan
    from kernels.convert.convert import convert
    from tests.kernels.test_mixed_grid import mixed_gguf
    from tests.kernels.test_q4k_blocks import EXPECTED_BLOCKS

    path = mixed_gguf(tmp_path_factory.mktemp("mixed"), tokenizer_source)
    plan = make_plan(probe(), read_model(path), path="w4a16-tinygemm")  # this host's block and 8-bit set
    grid = {**plan.quantization_config, "decode_kernel": "avx2-w4a8"}
    plans = {"blocks": {**grid, "q4k": sorted(EXPECTED_BLOCKS), "q6k": ["lm_head"], "q5_0": [Q5_0_DOWN]},
             "grid": grid}  # fmt: skip
    results = {}
    for label, qconfig in plans.items():
        directory = tmp_path_factory.mktemp(label)
        checkpoint = convert(path, directory / "model", qconfig, path=plan.path, log=lambda message: None)
        out = directory / "out.json"
        env = {**os.environ, "VLLM_CACHE_ROOT": str(directory / "vllm"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        proc = subprocess.run([sys.executable, __file__, str(checkpoint), str(out)], env=env, capture_output=True,
                              text=True, timeout=1200)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[label] = json.loads(out.read_text())
    print(json.dumps(results))
    return results


def test_the_engine_keeps_the_blocks_in_the_layers_the_plan_names_and_no_other(served):
    from kernels.ops import avx2_int4

    # without the AVX2 kernel: only the 8-bit set's blocks (the head, the Q5_0 down_proj), dequantized for every batch
    expected = BLOCK_LAYERS if avx2_int4.load() is None else 2
    assert len(served["blocks"]["block_layers"]) == expected, served["blocks"]["block_layers"]
    assert Q5_0_DOWN in served["blocks"]["block_layers"]
    assert served["blocks"]["block_layers"][-1] == "lm_head"
    assert served["grid"]["block_layers"] == []


def test_the_blocks_generate_the_grids_tokens_wherever_the_grid_is_not_near_a_tie(served):
    compared = 0
    for ours, theirs, top2 in zip(served["blocks"]["tokens"], served["grid"]["tokens"], served["grid"]["top2"],
                                  strict=True):  # fmt: skip
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if top2[step][0] - top2[step][1] < MARGIN:
                break  # a near-tie: the sequences may part here, and what follows differs in its context
            assert a == b, (step, ours, theirs, top2)
            compared += 1
    assert compared >= len(PROMPTS)  # at least a token a prompt on average was decided, not all near-ties


if __name__ == "__main__":  # vLLM may re-import the main module in a process it spawns
    generate(sys.argv[1], Path(sys.argv[2]))
