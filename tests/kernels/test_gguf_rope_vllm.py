"""The RoPE scaling edge-select writes from a GGUF, read by vLLM itself: the engine's rotary table for a Llama 3
file (rope_freqs.weight) is the one llama.cpp runs, base frequencies over the file's divisors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from transformers import LlamaConfig  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402

from edge.model.gguf_metadata import hf_config, read_header  # noqa: E402
from tests.edge.test_gguf_rope import LLAMA3_CASES, _base_inv_freq, _llama3_divisors, _write  # noqa: E402

POSITIONS = 4096


@pytest.mark.parametrize("case", LLAMA3_CASES)
def test_vllm_builds_the_files_llama3_rotary_table_from_the_written_config(tmp_path, case):
    theta, head_dim, scaling = LLAMA3_CASES[case]
    divisors = _llama3_divisors(theta, head_dim, scaling)
    path = _write(tmp_path / "llama3.gguf", "llama", {"rope_freqs.weight": divisors}, theta=theta, head_dim=head_dim,
                  context=131072)  # fmt: skip
    config = LlamaConfig(**hf_config(read_header(path)))  # what vLLM's config loader builds from config.json
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(head_dim, POSITIONS, True, config.rope_parameters, torch.float32)
    assert type(rope).__name__ == "Llama3RotaryEmbedding"
    angles = torch.outer(torch.arange(POSITIONS, dtype=torch.float32),
                         _base_inv_freq(theta, head_dim) / torch.from_numpy(divisors))  # fmt: skip
    # [positions, head_dim]: cos halves then sin halves, as vLLM lays out its cache
    torch.testing.assert_close(rope.cos_sin_cache.float(), torch.cat([angles.cos(), angles.sin()], -1),
                               rtol=0, atol=1e-5)  # fmt: skip
