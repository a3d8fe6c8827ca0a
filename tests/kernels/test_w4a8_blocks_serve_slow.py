"""Real vLLM serving a w4a8-gptq plan whose 8-bit set keeps a GGUF's own blocks (quantization_config.q6k, q5_0):
test_mixed_grid's generated Q4_K_M-like llama, planned for this host's w4a8-gptq, converted twice: as planned (its
Q6_K head and its Q5_0 down_proj as the file's blocks) and with those keys left out (the 8-bit set's grids, as
EDGE_OWN_BLOCKS=0 plans it). The engine must load the blocks into those layers and no other, through the plugin's
cpu_w4a8 method beside vLLM's int4 x int8 kernel, and generate what the grids generate where their choice is not a
near-tie: the blocks hold the file's codes and scales, the grids the same codes on int8 per 16, and the blocks'
kernels round activations to int8 per 32 where the grid's kernel rounds them to int16 (test_q4k_serve_slow's margin).

On a host whose vLLM has no int4 x int8 kernel (AVX2 only) the plan is refused, and the test asserts that instead.
One subprocess per checkpoint (the plugin installs once per process), as test_q4k_serve_slow runs them.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.kernels import test_q4k_serve_slow as q4k_serve
from tests.kernels.conftest import engine_child

pytestmark = pytest.mark.slow

BLOCK_KEYS = ("q6k", "q8_0", "q5_0")


def _plan(tmp_path_factory, tokenizer_source):
    from edge.device.probe import probe
    from edge.model.reader import read_model
    from edge.plan.planner import PlanRefused, make_plan
    from tests.kernels.test_mixed_grid import mixed_gguf

    path = mixed_gguf(tmp_path_factory.mktemp("mixed"), tokenizer_source)
    try:
        return path, make_plan(probe(), read_model(path), path="w4a8-gptq"), None
    except PlanRefused as refused:
        return path, None, refused


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_source) -> dict:
    from kernels.convert.convert import convert
    from kernels.vllm_plugin.cpu_w4a8 import op_available

    path, plan, refused = _plan(tmp_path_factory, tokenizer_source)
    if plan is None:
        assert not op_available(), f"refused where vLLM's int4 x int8 kernel runs: {refused}"
        return {"refused": str(refused)}
    blocks = plan.quantization_config
    grid = {key: value for key, value in blocks.items() if key not in BLOCK_KEYS}
    results: dict = {"named": sorted(name for key in BLOCK_KEYS for name in blocks.get(key, []))}
    for label, qconfig in {"blocks": blocks, "grid": grid}.items():
        directory = tmp_path_factory.mktemp(label)
        checkpoint = convert(path, directory / "model", qconfig, path=plan.path, log=lambda message: None)
        out = directory / "out.json"
        env = {**os.environ, "VLLM_CACHE_ROOT": str(directory / "vllm"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        results[label] = engine_child(q4k_serve.__file__, out, [str(checkpoint), str(out)], env, timeout=1200)
    print(json.dumps(results))
    return results


def test_the_plan_keeps_the_files_8_bit_blocks_and_the_engine_loads_them_there_only(served):
    if "refused" in served:
        assert "int4_scaled_mm_cpu" in served["refused"], served["refused"]
        return
    # the mixed file's Q6_K head and Q5_0 down_proj (test_q4k_serve_slow's), whatever the 4-bit grid
    assert served["named"] == sorted(["lm_head", q4k_serve.Q5_0_DOWN]), served["named"]
    assert sorted(served["blocks"]["block_layers"]) == served["named"]
    assert served["grid"]["block_layers"] == []


def test_the_blocks_generate_the_grids_tokens_wherever_the_grid_is_not_near_a_tie(served):
    if "refused" in served:
        assert "int4_scaled_mm_cpu" in served["refused"], served["refused"]
        return
    compared = 0
    for ours, theirs, top2 in zip(served["blocks"]["tokens"], served["grid"]["tokens"], served["grid"]["top2"],
                                  strict=True):  # fmt: skip
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if top2[step][0] - top2[step][1] < q4k_serve.MARGIN:
                break  # a near-tie: the sequences may part here
            assert a == b, (step, ours, theirs, top2)
            compared += 1
    assert compared >= len(q4k_serve.PROMPTS)
