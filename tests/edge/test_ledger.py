"""edge.ledger: an itemized memory estimate whose numbers come from shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge import rules
from edge.facts import fact
from edge.ledger import estimate
from edge.model_reader import default_model, read_model
from edge.shapes import LinearShape, ModelShape

CONFIGS = Path(__file__).parent / "data" / "configs"
BASELINE = 500 * 2**20
AVX2_BLOCK = 32


def ledger(
    model, path, layout=None, group=None, *, max_model_len=2048, seqs=1, block=AVX2_BLOCK, budget=None
):
    return estimate(
        model,
        path,
        layout,
        group,
        max_model_len=max_model_len,
        max_num_seqs=seqs,
        tinygemm_block=block,
        budget_bytes=budget,
        engine_baseline_bytes=BASELINE,
    )


def by_name(led) -> dict:
    return {item.name: item for item in led.items}


PATHS = [
    ("bf16", None),
    ("w4a16-tinygemm", "dual"),
    ("w4a16-tinygemm", "direct"),
    ("w4a16-tinygemm", "kernel-only"),
    ("w4a8-gptq", None),
    ("export-only", None),
]
MODELS = ["smollm2-135m-instruct", "llama-3.2-1b", "gemma-2-2b", "phi-3-mini-4k-instruct", "qwen3-0.6b"]


@pytest.mark.parametrize("fixture", MODELS)
@pytest.mark.parametrize(("path", "layout"), PATHS)
def test_resident_items_sum_to_resident_and_peak_adds_the_largest_transient(fixture, path, layout):
    model = read_model(CONFIGS / f"{fixture}.json")
    led = ledger(model, path, layout, rules.pick_group_size(model) or 32)
    assert led.resident_bytes == sum(i.bytes for i in led.items if i.phase == "resident")
    transients = [i.bytes for i in led.items if i.phase != "resident"]
    assert led.peak_bytes == led.resident_bytes + max(transients, default=0)
    assert len({i.name for i in led.items}) == len(led.items)  # every item named once
    assert all(i.bytes >= 0 and i.detail for i in led.items)


@pytest.mark.parametrize("fixture", ["smollm2-135m-instruct", "llama-3.2-1b"])
def test_direct_is_smaller_than_dual_which_is_smaller_than_bf16(fixture):
    model = read_model(CONFIGS / f"{fixture}.json")
    group = rules.pick_group_size(model)
    direct = ledger(model, "w4a16-tinygemm", "direct", group).resident_bytes
    dual = ledger(model, "w4a16-tinygemm", "dual", group).resident_bytes
    bf16 = ledger(model, "bf16").resident_bytes
    assert direct < dual < bf16


def synthetic(*ns: int) -> ModelShape:
    """A small untied model whose per-layer linears have the given N (K = 64), head 256 x 64."""
    linears = [LinearShape(name=f"n{n}_proj", n=n, k=64, count=2) for n in ns]
    return ModelShape(
        name="synthetic",
        architecture="LlamaForCausalLM",
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        vocab_size=256,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        rotary_dim=32,
        linears=[*linears, LinearShape(name="lm_head", n=256, k=64, count=1)],
    )


def row_major_copies(led) -> set[str]:
    return {i.name.removesuffix(" row-major copy") for i in led.items if i.name.endswith("row-major copy")}


@pytest.mark.parametrize(("block", "untiled"), [(32, {"n48_proj"}), (64, {"n48_proj", "n96_proj"})])
def test_direct_keeps_a_row_major_copy_only_for_layers_whose_n_does_not_tile_the_block(block, untiled):
    led = ledger(synthetic(48, 64, 96), "w4a16-tinygemm", "direct", 64, block=block)
    assert row_major_copies(led) == untiled


def test_dual_keeps_a_row_major_copy_of_every_quantized_layer():
    led = ledger(synthetic(48, 64, 96), "w4a16-tinygemm", "dual", 64)
    assert row_major_copies(led) == {"n48_proj", "n64_proj", "n96_proj", "lm_head"}


def test_kernel_only_keeps_no_row_major_copy():
    assert row_major_copies(ledger(synthetic(48, 64, 96), "w4a16-tinygemm", "kernel-only", 64)) == set()


def test_a_row_major_copy_costs_what_its_tinygemm_buffer_costs():
    items = by_name(ledger(synthetic(48), "w4a16-tinygemm", "direct", 64))
    # 2 layers x (48 x 64 / 2 B codes + 2 x 2 B x 48 x 64/64 scales and zeros)
    assert items["n48_proj row-major copy"].bytes == items["n48_proj int4 tinygemm"].bytes == 2 * (1536 + 192)


def test_a_layer_that_cannot_pack_stays_bf16():
    items = by_name(ledger(synthetic(40, 64), "w4a16-tinygemm", "direct", 64))
    assert items["n40_proj kept bf16"].bytes == 2 * 40 * 64 * 2
    assert "n40_proj int4 tinygemm" not in items


def test_tied_embedding_on_tinygemm_keeps_the_head_and_a_row_major_lookup_copy():
    model = default_model()
    items = by_name(ledger(model, "w4a16-tinygemm", "kernel-only", 64))
    # 49152 x 576 / 2 B codes + 2 x 2 B x 49152 x 576/64 scales and zeros
    one_copy = 49152 * 576 // 2 + 4 * 49152 * 9
    assert items["lm_head (tied embedding) int4 tinygemm"].bytes == one_copy
    assert items["tied embedding row-major int4 copy (lookups)"].bytes == one_copy
    assert "embedding (bf16)" not in items


def test_rope_avoidable_bytes_is_what_capping_at_max_model_len_saves():
    model = default_model()
    rope = by_name(ledger(model, "bf16", max_model_len=2048))["RoPE cos/sin table"]
    row_bytes = model.rotary_dim * 2  # cos half + sin half, bf16
    assert rope.bytes == 8192 * row_bytes
    assert rope.avoidable_bytes == (8192 - 2048) * row_bytes


def test_rope_has_nothing_to_avoid_at_full_context():
    assert (
        by_name(ledger(default_model(), "bf16", max_model_len=8192))["RoPE cos/sin table"].avoidable_bytes
        == 0
    )


def test_gptq_untie_cost_equals_vocab_times_hidden_in_bf16():
    items = by_name(ledger(default_model(), "w4a8-gptq", group=64))
    assert items["embedding kept bf16 (cost of untying the head)"].bytes == 49152 * 576 * 2
    assert "lm_head GPTQ int4" in items


def test_gptq_on_an_untied_model_names_no_untie_cost():
    model = read_model(CONFIGS / "mistral-7b-v0.3.json")
    names = by_name(ledger(model, "w4a8-gptq", group=128))
    assert "embedding (bf16)" in names
    assert not any("untying" in name for name in names)


def test_gptq_layer_bytes_are_qweight_scales_and_qzeros():
    items = by_name(ledger(default_model(), "w4a8-gptq", group=64))
    # 30 x (576 x 576 / 2 B qweight + 2 B x 576 x 9 scales + 4 B x 72 x 9 qzeros)
    assert items["q_proj GPTQ int4"].bytes == 30 * (576 * 576 // 2 + 2 * 576 * 9 + 4 * 72 * 9)


def test_bf16_tied_model_stores_the_embedding_once():
    items = by_name(ledger(default_model(), "bf16"))
    assert items["embedding (bf16)"].bytes == 49152 * 576 * 2
    assert "lm_head (bf16)" not in items


def test_bf16_untied_model_stores_the_head_apart():
    items = by_name(ledger(read_model(CONFIGS / "mistral-7b-v0.3.json"), "bf16"))
    assert items["lm_head (bf16)"].bytes == 32768 * 4096 * 2


def test_export_only_has_no_engine_or_kv_items():
    names = by_name(ledger(default_model(), "export-only"))
    assert not {"KV cache", "engine baseline", "allocator retention", "RoPE cos/sin table"} & set(names)
    assert names["embedding w8a16 (exported graph)"].bytes == 49152 * 576 + 2 * 49152


def test_kv_item_is_the_rule_and_engine_items_are_the_inputs():
    model = default_model()
    items = by_name(ledger(model, "bf16", max_model_len=2048, seqs=4))
    assert items["KV cache"].bytes == rules.kv_cache_bytes(model, 2048, 4)
    assert items["engine baseline"].bytes == BASELINE
    assert items["allocator retention"].bytes == fact("any.allocator_retention_bytes").value


def test_repack_transient_is_a_chunk_of_int32_codes():
    items = by_name(ledger(default_model(), "w4a16-tinygemm", "direct", 64))
    rows = int(fact("any.repack_chunk_rows").value)
    assert items["repack transient (int32 codes)"].bytes == 4 * rows * 576  # head: 49152 rows > chunk
    assert items["bf16 source tensor being converted"].bytes == 49152 * 576 * 2


def test_fits_compares_peak_with_the_budget():
    model = default_model()
    peak = ledger(model, "bf16").peak_bytes
    assert ledger(model, "bf16", budget=None).fits
    assert ledger(model, "bf16", budget=peak).fits
    assert not ledger(model, "bf16", budget=peak - 1).fits


WORKING_SET = "prefill dequantize working set"


def test_kernel_only_untied_never_dequantizes():
    names = by_name(ledger(synthetic(64, 96), "w4a16-tinygemm", "kernel-only", 64, seqs=8))
    assert WORKING_SET not in names


def test_direct_dequantizes_its_widest_layer_as_codes_plus_fp32_on_the_avx2_block():
    led = ledger(synthetic(64, 512), "w4a16-tinygemm", "direct", 64, seqs=1, block=32)
    assert by_name(led)[WORKING_SET].bytes == 512 * 64 * (1 + 4)


def test_no_working_set_when_no_batch_reaches_the_threshold():
    led = estimate(
        synthetic(64, 512),
        "w4a16-tinygemm",
        "direct",
        64,
        max_model_len=512,
        max_num_seqs=4,
        tinygemm_block=32,
        budget_bytes=None,
        engine_baseline_bytes=BASELINE,
        dequant_threshold=1024,
    )
    assert WORKING_SET not in by_name(led)


def test_a_tied_head_dequantizes_even_in_kernel_only_once_enough_sequences_decode():
    led = ledger(default_model(), "w4a16-tinygemm", "kernel-only", 64, seqs=4, block=64)
    assert by_name(led)[WORKING_SET].bytes == 49152 * 576 * (1 + 4 + 2)
