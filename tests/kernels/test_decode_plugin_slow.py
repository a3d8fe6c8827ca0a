"""Real vLLM (eager) on the default model's speed-plan conversion (`avx2-w4a8`): the plugin's CPU attention methods
(kernels/vllm_plugin/attention.py) generate vLLM's own methods' greedy text token for token, and the int8 kernel's
decode layout (kernels.ops.avx2_int4.decode_layout) generates the row-major layout's first tokens.

One subprocess per variant (the plugin installs once per process): the plugin as shipped, EDGE_SELECT_ATTENTION=vllm,
and EDGE_AVX2_DECODE_LAYOUT=row-major, each stepping the engine core inside it (VLLM_ENABLE_V1_MULTIPROCESSING=0,
as the plan's one-process mode serves): every request is queued before the first step, so every run batches alike.
With vLLM's separate engine-core process the requests reach the core at times of their own, the first steps batch
them differently, and the same configuration generated either of two texts for one prompt from run to run here.
The attention replacements call the same kernels with the same arguments, so
every token must agree; the decode layout sums the same integers in another fp32 order, so a near-tied logit may
flip late in a sequence, as tests/kernels/test_avx2_serve_slow.py allows for its kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colors are",
    "The largest planet in our solar system is",
]
NEW_TOKENS = 24
FIRST_TOKENS = 3
VARIANTS = {"plugin": {}, "vllm-attention": {"EDGE_SELECT_ATTENTION": "vllm"},
            "row-major": {"EDGE_AVX2_DECODE_LAYOUT": "row-major"}}  # fmt: skip

pytestmark = pytest.mark.slow


def generate(model: str, out: Path) -> None:
    from vllm import LLM, SamplingParams

    from kernels.ops import avx2_int4
    from kernels.vllm_plugin import attention

    llm = LLM(model=model, max_model_len=256, kv_cache_memory_bytes=32 << 20, max_num_seqs=4, enforce_eager=True,
              seed=0)  # fmt: skip
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)  # fmt: skip
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    out.write_text(json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "text": [o.outputs[0].text for o in outputs],
        "lean_attention": getattr(CPUAttentionBackendImpl.forward, attention._MARK, False),
        "layout": os.environ.get(avx2_int4.LAYOUT_ENV, "decode"),
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
    for label, extra in VARIANTS.items():
        out = tmp_path_factory.mktemp(label) / "out.json"
        env = {**os.environ, "VLLM_CACHE_ROOT": str(vllm_cache), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **extra}
        proc = subprocess.run([sys.executable, __file__, str(model), str(out)], env=env, capture_output=True,
                              text=True, timeout=1200)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[label] = json.loads(out.read_text())
    print(json.dumps(results))
    return results


def test_each_variant_ran_what_it_names(served):
    assert served["plugin"]["lean_attention"] and served["row-major"]["lean_attention"]
    assert not served["vllm-attention"]["lean_attention"]
    assert [served[v]["layout"] for v in VARIANTS] == ["decode", "decode", "row-major"]


def test_the_plugins_attention_generates_vllms_greedy_text_token_for_token(served):
    assert served["plugin"]["tokens"] == served["vllm-attention"]["tokens"], (served["plugin"]["text"],
                                                                              served["vllm-attention"]["text"])


def test_the_decode_layout_generates_the_row_major_layouts_first_tokens_and_paris(served):
    for ours, theirs in zip(served["plugin"]["tokens"], served["row-major"]["tokens"], strict=True):
        assert ours[:FIRST_TOKENS] == theirs[:FIRST_TOKENS], (served["plugin"]["text"], served["row-major"]["text"])
    assert served["plugin"]["text"][0].startswith(" Paris")


if __name__ == "__main__":  # vLLM may re-import the main module in a process it spawns
    generate(sys.argv[1], Path(sys.argv[2]))
