"""Real vLLM on the default model's speed-plan conversion (`avx2-w4a8`): the plugin's C++ attention
(kernels/vllm_plugin/attention.cpp) and its lean Python methods generate vLLM's own attention's greedy text token for
token, eager and compiled as the plan compiles (Inductor's C++ wrapper) against vLLM as shipped compiled with its
Python wrapper; the int4 linears called by their index in the layer table (kernels/vllm_plugin/layer_table.py)
generate what the same graph with their tensors as arguments generates; and the int8 kernel's decode layout
(kernels.ops.avx2_int4.decode_layout) generates the row-major layout's first tokens.

One subprocess per variant (the plugin installs once per process), each stepping the engine core inside it
(VLLM_ENABLE_V1_MULTIPROCESSING=0, as the plan's one-process mode serves): every request is queued before the first
step, so every run batches alike. With vLLM's separate engine-core process the requests reach the core at times of
their own, the first steps batch them differently, and the same configuration generated either of two texts for one
prompt from run to run here. The attention ways call the same kernels with the same arguments, and both compiled
variants run the same Inductor kernels, so every token must agree; the decode layout sums the same integers in
another fp32 order, so a near-tied logit may flip late in a sequence, as tests/kernels/test_avx2_serve_slow.py
allows for its kernels.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from edge.plan.engine_config import COMPILATION_CONFIG, COMPILE_ENV

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colors are",
    "The largest planet in our solar system is",
]
NEW_TOKENS = 24
FIRST_TOKENS = 3
EAGER = {"enforce_eager": True}
# label -> (environment, LLM keywords); COMPILED is the plan's compilation config (edge.plan.engine_config)
# vLLM's attention kernel under the plugin's op everywhere (EDGE_LEAN_ATTENTION=0), so the plugin's plumbing is
# compared token for token with vLLM's; "compiled-lean" runs the plugin's lean decode kernel, a different summation
# whose greedy text may part from vLLM's at a near tie (it did at token 8 of one prompt, eager, on a Zen 5)
VLLM_KERNEL = {"EDGE_LEAN_ATTENTION": "0"}
VARIANTS = {
    "plugin": ({**VLLM_KERNEL}, EAGER),
    "python-attention": ({"EDGE_SELECT_ATTENTION": "python"}, EAGER),
    "vllm-attention": ({"EDGE_SELECT_ATTENTION": "vllm"}, EAGER),
    "row-major": ({"EDGE_AVX2_DECODE_LAYOUT": "row-major", **VLLM_KERNEL}, EAGER),
    "compiled": ({**COMPILE_ENV, **VLLM_KERNEL}, {"compilation_config": COMPILATION_CONFIG}),
    "compiled-as-shipped": ({"EDGE_SELECT_ATTENTION": "vllm"}, {}),
    "compiled-without-table": ({**COMPILE_ENV, "EDGE_LAYER_TABLE": "0", **VLLM_KERNEL},
                               {"compilation_config": COMPILATION_CONFIG}),
    "compiled-lean": ({**COMPILE_ENV}, {"compilation_config": COMPILATION_CONFIG}),
}
INT4_LINEARS = 4 * 30  # qkv, o, gate_up and down in each of the default model's 30 layers

pytestmark = pytest.mark.slow


def generate(model: str, out: Path, keywords: dict) -> None:
    import torch
    from vllm import LLM, SamplingParams

    from kernels.ops import avx2_int4
    from kernels.vllm_plugin import attention, attention_cpp

    llm = LLM(model=model, max_model_len=256, kv_cache_memory_bytes=32 << 20, max_num_seqs=4, seed=0, **keywords)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)  # fmt: skip
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    out.write_text(json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "text": [o.outputs[0].text for o in outputs],
        "lean_attention": getattr(CPUAttentionBackendImpl.forward, attention._MARK, False),
        "layout": os.environ.get(avx2_int4.LAYOUT_ENV, "decode"),
        "cpp_layers": len(attention_cpp._Layers.names),
        "cpp_calls": torch.ops.edge_attn.calls() if hasattr(torch.ops.edge_attn, "calls") else [0, 0, 0],
        "table_layers": torch.ops.edge_avx2.layer_count(),
    }))  # fmt: skip
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    from kernels.convert.convert import convert
    from kernels.source.default_model import ensure_default_model
    from kernels.vllm_plugin.cpu_int4 import quantization_config

    cache = Path(os.environ.get("EDGE_SELECT_CACHE_DIR", Path.home() / ".cache/edge-select")) / "test-checkpoints"
    qconfig = quantization_config("direct", group_size=32, quantize_embedding=True, decode_kernel="avx2-w4a8")
    model = convert(ensure_default_model(), cache / "smollm2-direct-g32-avx2-w4a8", qconfig, path="w4a16-tinygemm")
    vllm_cache = tmp_path_factory.mktemp("vllm-cache")
    results = {}
    for label, (extra, keywords) in VARIANTS.items():
        out = tmp_path_factory.mktemp(label) / "out.json"
        env = {**os.environ, "VLLM_CACHE_ROOT": str(vllm_cache), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **extra}
        proc = subprocess.run([sys.executable, __file__, str(model), str(out), json.dumps(keywords)], env=env,
                              capture_output=True, text=True, timeout=1200)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[label] = json.loads(out.read_text())
    print(json.dumps(results))
    return results


def test_each_variant_ran_what_it_names(served):
    lean = {label for label in VARIANTS if served[label]["lean_attention"]}
    assert lean == {"plugin", "python-attention", "row-major", "compiled", "compiled-without-table", "compiled-lean"}
    assert [label for label in VARIANTS if served[label]["layout"] == "row-major"] == ["row-major"]
    # the default model's 30 layers took the C++ op ...
    for label in ("plugin", "row-major", "compiled", "compiled-without-table", "compiled-lean"):
        assert served[label]["cpp_layers"] == 30
        direct, fallen_back, lean_kernel = served[label]["cpp_calls"]
        # ... and every step's forward called it: 30 layers x (one prompt step + NEW_TOKENS - 1 decode steps) at
        # least; vLLM's dummy and warm-up runs fell back to vLLM's ops
        assert direct >= 30 * NEW_TOKENS and direct % 30 == 0, served[label]["cpp_calls"]
        # compiled-lean's decode steps took the lean kernel where vLLM's cache has the "vec" layout (x86 without
        # AMX); the others none
        import torch

        vec_layout = platform.machine() == "x86_64" and not torch.cpu._is_amx_tile_supported()
        leaned = label == "compiled-lean" and vec_layout
        assert lean_kernel % 30 == 0 and (lean_kernel >= 30 * (NEW_TOKENS - 1)) == leaned, served[label]
    for label in ("python-attention", "vllm-attention", "compiled-as-shipped"):
        assert served[label]["cpp_calls"] == [0, 0, 0]
    # every int4 linear was called by its index in the layer table (kernels/vllm_plugin/layer_table.py) but where
    # EDGE_LAYER_TABLE=0
    assert {label: served[label]["table_layers"] for label in VARIANTS} == {
        label: 0 if label == "compiled-without-table" else INT4_LINEARS for label in VARIANTS}


@pytest.mark.parametrize("mine, theirs", [("plugin", "vllm-attention"), ("python-attention", "vllm-attention"),
                                          ("compiled", "compiled-as-shipped"),
                                          ("compiled", "compiled-without-table")])  # fmt: skip
def test_the_plugins_attention_and_layer_table_generate_vllms_greedy_text_token_for_token(served, mine, theirs):
    assert served[mine]["tokens"] == served[theirs]["tokens"], (served[mine]["text"], served[theirs]["text"])


def test_the_lean_attention_kernel_generates_vllms_kernels_first_tokens_and_paris(served):
    lean, vllm_kernel = served["compiled-lean"], served["compiled"]
    for ours, theirs in zip(lean["tokens"], vllm_kernel["tokens"], strict=True):
        assert ours[:FIRST_TOKENS] == theirs[:FIRST_TOKENS], (lean["text"], vllm_kernel["text"])
    assert served["compiled-lean"]["text"][0].startswith(" Paris")


def test_the_decode_layout_generates_the_row_major_layouts_first_tokens_and_paris(served):
    for ours, theirs in zip(served["plugin"]["tokens"], served["row-major"]["tokens"], strict=True):
        assert ours[:FIRST_TOKENS] == theirs[:FIRST_TOKENS], (served["plugin"]["text"], served["row-major"]["text"])
    assert served["plugin"]["text"][0].startswith(" Paris")


if __name__ == "__main__":  # vLLM may re-import the main module in a process it spawns
    generate(sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]))
