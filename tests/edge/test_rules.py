"""edge.catalog.shape_rules: the quantization and sizing rules, on real model shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.catalog import shape_rules as rules
from edge.errors import InputError
from edge.model.reader import default_model, read_model
from edge.model.shapes import LinearShape

CONFIGS = Path(__file__).parent / "data" / "configs"


def lin(n: int, k: int) -> LinearShape:
    return LinearShape(name=f"{n}x{k}", n=n, k=k, count=1)


def test_smollm2_k_576_rules_out_group_128_and_takes_64():
    assert 576 % 128 != 0
    assert rules.pick_group_size(read_model(CONFIGS / "smollm2-135m-instruct.json")) == 64


def test_a_source_on_a_4_bit_grid_keeps_its_grid():
    """The default model is built from a Q4_1 GGUF (blocks of 32): its plan keeps group 32 rather than 64."""
    assert default_model().source_grid == 32
    assert rules.pick_group_size(default_model()) == 32


def test_a_source_grid_that_does_not_divide_every_k_falls_back_to_the_largest_that_does():
    model = read_model(CONFIGS / "smollm2-135m-instruct.json").model_copy(update={"source_grid": 256})
    assert rules.pick_group_size(model) == 64


def test_the_model_reader_takes_the_source_grid_from_edge_source_json(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "smollm2-135m-instruct.json").read_text())
    assert read_model(tmp_path).source_grid is None
    (tmp_path / "edge-source.json").write_text('{"format": "gguf", "q4_group": 32}')
    assert read_model(tmp_path).source_grid == 32
    (tmp_path / "edge-source.json").write_text('{"format": "gguf", "q4_group": "32"}')
    with pytest.raises(InputError, match="q4_group"):
        read_model(tmp_path)


def test_llama_3_2_1b_takes_group_128():
    assert rules.pick_group_size(read_model(CONFIGS / "llama-3.2-1b.json")) == 128


def test_no_group_size_when_a_k_fits_none():
    model = default_model()
    odd = model.model_copy(update={"linears": [*model.linears, lin(64, 48)]})
    assert rules.pick_group_size(odd) is None


@pytest.mark.parametrize(
    ("n", "k", "group", "expected"),
    [
        (576, 576, 64, True),
        (48, 64, 64, True),  # N=48 packs (measured: torch packs N=16 and 48)
        (40, 64, 64, False),  # torch: "expect N to be dividable by 16"
        (576, 576, 128, False),  # K not a multiple of the group
    ],
)
def test_packable_needs_n_multiple_of_16_and_whole_groups(n, k, group, expected):
    assert rules.packable(lin(n, k), group) is expected


@pytest.mark.parametrize("block", [32, 64])
def test_n_48_does_not_tile_either_host_block(block):
    assert not rules.tiles_block(lin(48, 64), block)


@pytest.mark.parametrize(("n", "block", "expected"), [(96, 32, True), (96, 64, False), (49152, 64, True)])
def test_tiles_block_is_whole_n_blocks(n, block, expected):
    assert rules.tiles_block(lin(n, 576), block) is expected


def test_smollm2_is_gptq_compatible_at_64_but_not_128():
    model = default_model()
    assert all(rules.gptq_compatible(x, 64) for x in model.linears)
    assert not all(rules.gptq_compatible(x, 128) for x in model.linears)


@pytest.mark.parametrize(
    ("n", "k", "group", "expected"),
    [
        (48, 576, 64, False),  # N not a multiple of 32
        (576, 48, 32, False),  # K not a multiple of 32
        (576, 576, -1, True),  # one group per row
        (576, 576, 16, False),  # vLLM CPU GPTQ groups are -1, 32, 64, 128
    ],
)
def test_gptq_compatible_follows_vllm_cpu_limits(n, k, group, expected):
    assert rules.gptq_compatible(lin(n, k), group) is expected


def test_streams_share_one_context_with_a_block_each_to_spare():
    # 2 (K, V) x 30 layers x 3 kv heads x 64 head_dim x 2 B x (2048 shared + 4 streams x a 128-token block)
    assert rules.kv_cache_bytes(default_model(), 2048, 4) == 2 * 30 * 3 * 64 * 2 * (2048 + 4 * 128)


def test_one_stream_holds_the_whole_context():
    assert rules.kv_tokens_per_layer(default_model(), 2048, 1) == [2048 + 128] * 30


def test_kv_cache_bytes_scales_with_dtype_bytes():
    model = default_model()
    assert rules.kv_cache_bytes(model, 1024, 1, dtype_bytes=4) == 2 * rules.kv_cache_bytes(model, 1024, 1)


def test_gemma2_sliding_layers_hold_each_streams_window():
    model = read_model(CONFIGS / "gemma-2-2b.json")
    per_token_layer = 2 * 4 * 256 * 2
    assert rules.kv_cache_bytes(model, 8192, 2) == per_token_layer * (13 * (8192 + 256) + 13 * (2 * 4096 + 256))


def test_gemma2_window_longer_than_the_context_costs_the_context():
    model = read_model(CONFIGS / "gemma-2-2b.json")
    assert rules.kv_cache_bytes(model, 2048, 2) == 2 * 4 * 256 * 2 * 13 * ((2048 + 256) + (2 * 2048 + 256))


def test_phi3_every_layer_holds_its_2047_token_window_in_16_token_blocks():
    model = read_model(CONFIGS / "phi-3-mini-4k-instruct.json")
    assert rules.kv_block_tokens(model) == 16
    assert rules.kv_cache_bytes(model, 4096, 1) == 2 * 32 * 96 * 2 * 32 * (2047 + 16)
