"""edge.measure.ledger: an itemized memory estimate whose numbers come from shapes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from edge.catalog import shape_rules as rules
from edge.catalog.quantized_layers import QuantRules, rules_for
from edge.formats.gptq import GPTQ
from edge.measure.kernel_params import KernelParams
from edge.measure.ledger import estimate
from edge.model.reader import default_model, read_model
from edge.model.shapes import LinearShape, ModelShape

CONFIGS = Path(__file__).parent / "data" / "configs"
BASELINE = 500 * 2**20
AVX2_BLOCK = 32


def kernel(block=AVX2_BLOCK, threshold=2, dtype="float32", chunk=512) -> KernelParams:
    return KernelParams(block=block, dequant_threshold=threshold, prefill_dtype=dtype, repack_chunk_rows=chunk)


def int4_head(model, group=64) -> QuantRules:
    """Rules without the 8-bit set: the head (and a tied embedding) at 4 bits, as a hand-written config may say."""
    return replace(rules_for(model, "w4a16-tinygemm", group), int8=())


def ledger(
    model, path, layout=None, group=None, *, max_model_len=2048, seqs=1, block=AVX2_BLOCK, budget=None, quant=None,
    **params,
):
    return estimate(
        model,
        path,
        layout,
        group,
        max_model_len=max_model_len,
        max_num_seqs=seqs,
        kernel=kernel(block, **params),
        budget_bytes=budget,
        engine_baseline_bytes=BASELINE,
        quant=quant,
    )


def by_kind(led) -> dict:
    """(kind, layer) -> item: what the ledger's stable fields say, not its display names."""
    return {(item.kind, item.layer): item for item in led.items}


def layers_of(led, kind: str) -> set[str]:
    return {item.layer for item in led.items if item.kind == kind}


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
def test_resident_items_sum_to_resident_and_peak_is_loading_or_serving_whichever_holds_more(fixture, path, layout):
    model = read_model(CONFIGS / f"{fixture}.json")
    led = ledger(model, path, layout, rules.pick_group_size(model) or 32)
    assert led.resident_bytes == sum(i.bytes for i in led.items if i.phase == "resident")
    run = max([i.bytes for i in led.items if i.phase == "run-transient"], default=0)
    load = max([i.bytes for i in led.items if i.phase == "load-transient"], default=0)
    after_load = sum(i.bytes for i in led.items if i.kind in ("kv-cache", "prefill-activations"))
    assert led.peak_bytes == max(led.resident_bytes + run, led.resident_bytes - after_load + load)
    assert len({i.name for i in led.items}) == len(led.items)  # every item named once
    assert len(by_kind(led)) == len(led.items)  # and every (kind, layer) once
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
    return layers_of(led, "row-major-copy")


@pytest.mark.parametrize(("block", "untiled"), [(32, {"n48_proj"}), (64, {"n48_proj", "n96_proj"})])
def test_direct_keeps_a_row_major_copy_only_for_layers_whose_n_does_not_tile_the_block(block, untiled):
    led = ledger(synthetic(48, 64, 96), "w4a16-tinygemm", "direct", 64, block=block)
    assert row_major_copies(led) == untiled


def test_dual_keeps_a_row_major_copy_of_every_int4_layer():
    led = ledger(synthetic(48, 64, 96), "w4a16-tinygemm", "dual", 64)
    assert row_major_copies(led) == {"n48_proj", "n64_proj", "n96_proj"}  # the head is int8: nothing to repack
    model = synthetic(48, 64, 96)
    with_int4_head = ledger(model, "w4a16-tinygemm", "dual", 64, quant=int4_head(model))
    assert row_major_copies(with_int4_head) == {"n48_proj", "n64_proj", "n96_proj", "lm_head"}


def test_the_plans_8_bit_set_stores_a_tied_embedding_once_as_int8_codes_and_group_scales():
    """The default model comes from a GGUF (its Q8_0 embedding): a float32 scale per 32 weights, as the file's."""
    items = by_kind(ledger(default_model(), "w4a16-tinygemm", "direct", 64))
    assert items["int8-weights", "embed_tokens"].bytes == 49152 * 576 + 4 * 49152 * 576 // 32
    assert not {("int4-weights", "lm_head"), ("lookup-copy", "embed_tokens"), ("int8-weights", "lm_head")} & set(items)


def test_an_untied_head_in_the_8_bit_set_is_int8_beside_an_int8_embedding():
    model = read_model(CONFIGS / "mistral-7b-v0.3.json")
    items = by_kind(ledger(model, "w4a16-tinygemm", "direct", 128))
    one = 32768 * 4096 + 2 * 32768
    assert items["int8-weights", "lm_head"].bytes == items["int8-weights", "embed_tokens"].bytes == one


def test_kernel_only_keeps_no_row_major_copy():
    assert row_major_copies(ledger(synthetic(48, 64, 96), "w4a16-tinygemm", "kernel-only", 64)) == set()


def test_a_row_major_copy_costs_what_its_tinygemm_buffer_costs():
    items = by_kind(ledger(synthetic(48), "w4a16-tinygemm", "direct", 64))
    # 2 layers x (48 x 64 / 2 B codes + 2 x 2 B x 48 x 64/64 scales and zeros)
    copy, buffer = items["row-major-copy", "n48_proj"], items["int4-weights", "n48_proj"]
    assert copy.bytes == buffer.bytes == 2 * (1536 + 192)


def test_a_layer_that_cannot_pack_stays_bf16():
    items = by_kind(ledger(synthetic(40, 64), "w4a16-tinygemm", "direct", 64))
    assert items["bf16-weights", "n40_proj"].bytes == 2 * 40 * 64 * 2
    assert "N=40" in items["bf16-weights", "n40_proj"].detail
    assert ("int4-weights", "n40_proj") not in items


def test_tied_embedding_on_tinygemm_keeps_the_head_and_a_row_major_lookup_copy():
    model = default_model()
    items = by_kind(ledger(model, "w4a16-tinygemm", "kernel-only", 64, quant=int4_head(model)))
    # 49152 x 576 / 2 B codes + 2 x 2 B x 49152 x 576/64 scales and zeros
    one_copy = 49152 * 576 // 2 + 4 * 49152 * 9
    assert items["int4-weights", "lm_head"].bytes == one_copy
    assert items["lookup-copy", "embed_tokens"].bytes == one_copy
    assert ("bf16-weights", "embed_tokens") not in items


def test_rope_avoidable_bytes_is_what_capping_at_max_model_len_saves():
    model = default_model()
    rope = by_kind(ledger(model, "bf16", max_model_len=2048))["rope", None]
    row_bytes = model.rotary_dim * 2  # cos half + sin half, bf16
    assert rope.bytes == 8192 * row_bytes
    assert rope.avoidable_bytes == (8192 - 2048) * row_bytes


def test_rope_has_nothing_to_avoid_at_full_context():
    assert (
        by_kind(ledger(default_model(), "bf16", max_model_len=8192))["rope", None].avoidable_bytes
        == 0
    )


def test_w4a8_keeps_a_tied_head_as_its_8_bit_embedding_with_no_untie_cost():
    """cpu_w4a8 (every host's W4A8, AMX included) runs the head from the int8 embedding it is tied to."""
    items = by_kind(ledger(default_model(), "w4a8-gptq", group=64))
    assert items["int8-weights", "embed_tokens"].bytes == 49152 * 576 + 4 * 49152 * 576 // 32  # codes + group scales
    assert ("int4-weights", "lm_head") not in items and not layers_of(ledger(default_model(), "w4a8-gptq", group=64),
                                                                       "untie-cost")  # fmt: skip


def test_w4a8_on_an_untied_model_holds_the_head_at_8_bits():
    model = read_model(CONFIGS / "mistral-7b-v0.3.json")
    items = by_kind(ledger(model, "w4a8-gptq", group=128))
    assert ("int8-weights", "embed_tokens") in items and ("int8-weights", "lm_head") in items
    assert not layers_of(ledger(model, "w4a8-gptq", group=128), "untie-cost")


def test_gptq_layer_bytes_are_qweight_scales_and_qzeros():
    items = by_kind(ledger(default_model(), "w4a8-gptq", group=64))
    # 30 x (576 x 576 / 2 B qweight + 2 B x 576 x 9 scales + 4 B x 72 x 9 qzeros)
    assert items["int4-weights", "q_proj"].bytes == 30 * (576 * 576 // 2 + 2 * 576 * 9 + 4 * 72 * 9)


def test_w4a8_loads_with_its_conversion_chunk_not_a_bf16_copy():
    """The plugin converts each 4-bit layer for vLLM's W4A8 kernel a chunk of output channels at a time
    (edge.formats.gptq convert_chunk_channels, which kernels/vllm_plugin/cpu_w4a8.py reads): down_proj's K=1536 is
    the widest K of the default model's 4-bit layers."""
    items = by_kind(ledger(default_model(), "w4a8-gptq", group=64))
    chunk = GPTQ.convert_chunk_channels
    assert items["repack-transient", None].bytes == 2 * 4 * min(chunk, 576) * 1536
    assert ("load-copy", None) not in items


def test_bf16_tied_model_stores_the_embedding_once():
    items = by_kind(ledger(default_model(), "bf16"))
    assert items["bf16-weights", "embed_tokens"].bytes == 49152 * 576 * 2
    assert ("bf16-weights", "lm_head") not in items


def test_bf16_untied_model_stores_the_head_apart():
    items = by_kind(ledger(read_model(CONFIGS / "mistral-7b-v0.3.json"), "bf16"))
    assert items["bf16-weights", "lm_head"].bytes == 32768 * 4096 * 2


def test_export_only_has_no_engine_or_kv_items():
    led = ledger(default_model(), "export-only")
    assert not {"kv-cache", "engine-baseline", "rope"} & {item.kind for item in led.items}
    assert by_kind(led)["export-weights", "embed_tokens"].bytes == 49152 * 576 + 49152 * 9 * 5  # 9 blocks of 64


def test_kv_item_is_the_rule_and_engine_items_are_the_inputs():
    model = default_model()
    items = by_kind(ledger(model, "bf16", max_model_len=2048, seqs=4))
    assert items["kv-cache", None].bytes == rules.kv_cache_bytes(model, 2048, 4)
    assert items["engine-baseline", None].bytes == BASELINE


@pytest.mark.parametrize(("rows", "widest"), [(512, 512 * 1536), (2048, 2048 * 576)])
def test_repack_transient_is_the_kernels_chunk_of_int32_codes(rows, widest):
    """512 rows (this host's chunk): down_proj's 512 x 1536 is the widest chunk; 2048 (AMX): an int4 head's."""
    model = default_model()
    items = by_kind(ledger(model, "w4a16-tinygemm", "direct", 64, chunk=rows, quant=int4_head(model)))
    assert items["repack-transient", None].bytes == 4 * widest
    # edge-convert quantizes in its own process before the engine starts: no bf16 copy on top of the engine's bytes
    assert ("load-copy", None) not in items


def test_fits_compares_peak_with_the_budget():
    model = default_model()
    peak = ledger(model, "bf16").peak_bytes
    assert ledger(model, "bf16", budget=None).fits
    assert ledger(model, "bf16", budget=peak).fits
    assert not ledger(model, "bf16", budget=peak - 1).fits


WORKING_SET = "dequant-working-set"


def working_set(led) -> int | None:
    return next((item.bytes for item in led.items if item.kind == WORKING_SET), None)


def test_kernel_only_untied_never_dequantizes_int4():
    model = synthetic(64, 96)
    assert working_set(ledger(model, "w4a16-tinygemm", "kernel-only", 64, seqs=8, quant=int4_head(model))) is None


def test_an_int8_head_dequantizes_to_bf16_once_enough_sequences_decode_even_in_kernel_only():
    led = ledger(synthetic(64, 96), "w4a16-tinygemm", "kernel-only", 64, seqs=8)
    assert working_set(led) == 256 * 64 * (4 + 2)


@pytest.mark.parametrize(("dtype", "per_weight"), [("float32", 1 + 4), ("bfloat16", 1 + 4 + 2)])
def test_direct_dequantizes_its_widest_layer_as_codes_plus_the_prefill_dtype(dtype, per_weight):
    """The ledger reads the prefill dtype the plan gives the kernel, not the block (AVX-512 without BF16 has
    block 64 and still dequantizes to fp32)."""
    for block in (32, 64):
        led = ledger(synthetic(64, 512), "w4a16-tinygemm", "direct", 64, seqs=1, block=block, dtype=dtype)
        assert working_set(led) == 512 * 64 * per_weight


def test_no_working_set_when_no_batch_reaches_the_threshold():
    led = ledger(synthetic(64, 512), "w4a16-tinygemm", "direct", 64, max_model_len=512, seqs=4, threshold=1024)
    assert working_set(led) is None


def test_a_tied_head_dequantizes_even_in_kernel_only_once_enough_sequences_decode():
    model = default_model()
    led = ledger(model, "w4a16-tinygemm", "kernel-only", 64, seqs=4, block=64, dtype="bfloat16", quant=int4_head(model))
    assert working_set(led) == 49152 * 576 * (1 + 4 + 2)


def test_repack_retention_counts_the_bf16_linears_glibc_keeps_and_nothing_else():
    """With a class's share (edge.plan.planner.bf16_repack_retention), a bf16 plan books that share of its bf16 linears
    of at most 32 MiB a tensor (glibc's largest mmap threshold: a bigger block is unmapped when freed); the
    embedding (a lookup, not repacked) and a quantized plan's int4/int8 weights are not counted; share 0 books none."""
    from edge.measure.ledger import MMAP_THRESHOLD_MAX

    small, big = default_model(), read_model(CONFIGS / "mistral-7b-v0.3.json")

    def retention(model, path, share, layout=None, group=None):
        led = estimate(model, path, layout, group, max_model_len=2048, max_num_seqs=1, kernel=kernel(),
                       budget_bytes=None, engine_baseline_bytes=BASELINE, bf16_repack_retention=share)  # fmt: skip
        items = [i for i in led.items if i.kind == "repack-retention"]
        linears = [i for i in led.items if i.kind == "bf16-weights" and i.layer not in (None, "embed_tokens")]
        return sum(i.bytes for i in items), sum(i.bytes for i in linears), led

    got, linears, _ = retention(small, "bf16", 0.72)
    assert linears > 0 and got == round(0.72 * linears)  # SmolLM2's linears are all under 32 MiB a tensor
    assert retention(small, "bf16", 0.0)[0] == 0
    quantized, _, led = retention(small, "w4a16-tinygemm", 0.72, "direct", 32)
    kept = sum(i.bytes for i in led.items if i.kind == "bf16-weights" and i.layer != "embed_tokens")
    assert quantized == round(0.72 * kept)  # only what it keeps in bf16, none of its int4/int8 weights
    big_got, big_linears, _ = retention(big, "bf16", 0.72)
    assert big_linears > 10 * 2**30
    small_tensors = sum(2 * lin.n * lin.k * lin.count for lin in big.linears if 2 * lin.n * lin.k <= MMAP_THRESHOLD_MAX)
    assert big_got == round(0.72 * small_tensors) < 0.72 * big_linears


def test_the_tokenizer_item_is_each_loading_process_times_the_vocabulary():
    model = default_model()
    one, two = (estimate(model, "bf16", None, None, max_model_len=2048, max_num_seqs=1, kernel=kernel(),
                         budget_bytes=None, engine_baseline_bytes=BASELINE, tokenizers=copies,
                         tokenizer_bytes_per_token=2000) for copies in (1, 2))  # fmt: skip
    assert by_kind(one)["tokenizer", None].bytes == 49152 * 2000
    assert by_kind(two)["tokenizer", None].bytes == 2 * 49152 * 2000
    assert two.resident_bytes - one.resident_bytes == 49152 * 2000


def test_prefill_activations_follow_the_widths_of_a_full_batch():
    """The default model: 2048 tokens x (3 x 1536 + 4 x 576 + (9 + 2 x 3) x 64) x 2 B."""
    items = by_kind(ledger(default_model(), "bf16"))
    assert items["prefill-activations", None].bytes == 2048 * (3 * 1536 + 4 * 576 + 15 * 64) * 2
    wider = read_model(CONFIGS / "gemma-2-2b.json")
    assert by_kind(ledger(wider, "bf16"))["prefill-activations", None].bytes > items["prefill-activations", None].bytes


def test_the_weights_the_engine_maps_are_file_backed_and_the_rest_anonymous():
    led = ledger(default_model(), "w4a16-tinygemm", "direct", 32)
    file = {(i.kind, i.layer) for i in led.items if i.backing == "file"}
    assert {("int4-weights", "q_proj"), ("int8-weights", "embed_tokens"), ("norms", None), ("rope", None)} <= file
    assert not {"kv-cache", "tokenizer", "engine-baseline", "prefill-activations"} & {kind for kind, _ in file}
    assert led.file_backed_bytes == sum(i.bytes for i in led.items if i.backing == "file" and i.phase == "resident")
    assert all(i.phase == "resident" for i in led.items if i.backing == "file")


def test_mapping_moves_bytes_to_the_page_cache_without_changing_the_totals():
    model = default_model()
    mapped = ledger(model, "w4a16-tinygemm", "direct", 32)
    held = estimate(model, "w4a16-tinygemm", "direct", 32, max_model_len=2048, max_num_seqs=1, kernel=kernel(),
                    budget_bytes=None, engine_baseline_bytes=BASELINE, mapped_weights=False)  # fmt: skip
    assert held.file_backed_bytes == 0 and mapped.file_backed_bytes > 0
    assert (held.resident_bytes, held.peak_bytes) == (mapped.resident_bytes, mapped.peak_bytes)  # loaded anonymous


def test_bf16_linears_stay_anonymous_since_vllm_repacks_them_but_the_embedding_is_mapped():
    items = by_kind(ledger(read_model(CONFIGS / "mistral-7b-v0.3.json"), "bf16"))
    assert items["bf16-weights", "q_proj"].backing == "anonymous"
    assert items["bf16-weights", "lm_head"].backing == "anonymous"
    assert items["bf16-weights", "embed_tokens"].backing == "file"


def test_export_only_maps_nothing():
    assert ledger(default_model(), "export-only").file_backed_bytes == 0


@pytest.mark.parametrize("fixture", MODELS)
def test_an_engine_that_trims_when_idle_holds_prefill_activations_only_while_serving(fixture):
    """idle_trim (the one-process engine): a full prefill batch's activations leave the resident set, and the serving
    moment holds them on top of its largest other run transient; the loading moment is unchanged."""
    model = read_model(CONFIGS / f"{fixture}.json")
    group = rules.pick_group_size(model) or 32

    def led(idle_trim):
        return estimate(model, "w4a16-tinygemm", "direct", group, max_model_len=2048, max_num_seqs=1,
                        kernel=kernel(AVX2_BLOCK), budget_bytes=None, engine_baseline_bytes=BASELINE,
                        idle_trim=idle_trim)  # fmt: skip

    held, trimmed = led(False), led(True)
    activations = by_kind(held)["prefill-activations", None]
    assert activations.phase == "resident" and by_kind(trimmed)["prefill-activations", None].phase == "run-transient"
    assert trimmed.resident_bytes == held.resident_bytes - activations.bytes
    others = max(i.bytes for i in trimmed.items if i.phase == "run-transient" and i.kind != "prefill-activations")
    load = max(i.bytes for i in held.items if i.phase == "load-transient")
    loading = held.resident_bytes - activations.bytes - by_kind(held)["kv-cache", None].bytes + load
    assert held.peak_bytes == max(held.resident_bytes + others, loading)
    assert trimmed.peak_bytes == max(trimmed.resident_bytes + activations.bytes + others, loading)


def test_the_kv_cache_and_prefill_activations_are_not_held_while_the_weights_load():
    # bf16 Llama 3.2 1B: loading copies its 501 MiB embedding once, more than the KV cache and activations it does
    # not hold yet; serving dequantizes nothing
    led = ledger(read_model(CONFIGS / "llama-3.2-1b.json"), "bf16", max_model_len=512, seqs=1)
    items = by_kind(led)
    later = items["kv-cache", None].bytes + items["prefill-activations", None].bytes
    load = max(i.bytes for i in led.items if i.phase == "load-transient")
    assert not [i for i in led.items if i.phase == "run-transient"]
    assert led.peak_bytes == led.resident_bytes - later + load < led.resident_bytes + load
