"""benchmarks/bench_serve.py's bytes a decode step reads and its share of the read bound (issue 42 part 1): from a
converted checkpoint's tensors and from a GGUF's, a tied embedding counted once as the head, an untied one left out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from benchmarks import bench_serve


def test_a_checkpoint_counts_every_tensor_and_a_tied_embedding_as_the_head(tmp_path):
    tensors = {"model.embed_tokens.qweight": torch.zeros(64, 32, dtype=torch.int8),  # 2048 bytes
               "model.embed_tokens.scales": torch.zeros(64, 1, dtype=torch.float32),  # 256
               "model.layers.0.mlp.down_proj.qweight": torch.zeros(32, 16, dtype=torch.uint8),  # 512
               "model.layers.0.mlp.down_proj.scales": torch.zeros(32, 1, dtype=torch.bfloat16),  # 64
               "model.norm.weight": torch.zeros(32, dtype=torch.bfloat16)}  # 64  # fmt: skip
    save_file(tensors, tmp_path / "model.safetensors")
    assert bench_serve.checkpoint_decode_bytes(tmp_path) == 2048 + 256 + 512 + 64 + 64


def test_an_untied_checkpoint_leaves_out_the_input_embedding(tmp_path):
    tensors = {"model.embed_tokens.weight": torch.zeros(64, 32, dtype=torch.bfloat16),  # one row a step
               "lm_head.weight": torch.zeros(64, 32, dtype=torch.bfloat16),  # 4096
               "model.norm.weight": torch.zeros(32, dtype=torch.float32)}  # 128  # fmt: skip
    save_file(tensors, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"model.layers.0.x": torch.zeros(10, dtype=torch.int64)}, tmp_path / "model-00002-of-00002.safetensors")
    assert bench_serve.checkpoint_decode_bytes(tmp_path) == 4096 + 128 + 80


@pytest.mark.parametrize("untied", [False, True])
def test_a_gguf_counts_its_tensors_and_the_output_once(tmp_path, untied):
    from gguf import GGUFWriter

    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))  # 8192 bytes
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((32, 16), dtype=np.float16))  # 1024
    if untied:
        writer.add_tensor("output.weight", np.zeros((64, 32), dtype=np.float16))  # 4096
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert bench_serve.gguf_decode_bytes(path) == (1024 + 4096 if untied else 8192 + 1024)


def test_the_summary_gives_each_variants_rate_and_share_of_the_bound_at_its_thread_count():
    rows = [{"variant": "edge:one-process", "decode_tok_s": 100.0, "detail": {"threads": 1, "decode_bytes": 98e6}},
            {"variant": "llama:Q4_0@2", "decode_tok_s": 120.0, "detail": {"threads": 2, "decode_bytes": 90e6}},
            {"variant": "llama:Q4_0@4", "decode_tok_s": 130.0, "detail": {"threads": 4, "decode_bytes": 90e6}}]
    summary = bench_serve.summarize(rows, {1: 31.4, 2: 34.3})
    assert summary["edge:one-process"]["decode_gb_s"] == pytest.approx(9.8)
    assert summary["edge:one-process"]["of_bound"] == pytest.approx(9.8 / 31.4)
    assert summary["llama:Q4_0@2"]["of_bound"] == pytest.approx(10.8 / 34.3)
    assert summary["llama:Q4_0@4"]["read_bound_gb_s"] == 34.3  # measured at every core (2): the bound of 4 threads
    assert "31%" in bench_serve.table(summary) and "98.0" in bench_serve.table(summary)
    assert "of_bound" not in bench_serve.summarize(rows)["edge:one-process"]  # no bound measured: no share
