"""The planner, specified on real devices and real model shapes."""

from __future__ import annotations

import pytest

from edge.errors import InputError
from edge.measure.kernel_params import for_device
from edge.measure.quality import QualityRecord, quality_key
from edge.measure.rank import RankInput, rank, speed_options
from edge.model.reader import read_model
from edge.plan.gates import all_gates
from edge.plan.planner import PlanRefused, make_plan
from edge.plan.schema import SERVING_MODES, Plan
from tests.edge.conftest import DATA


def _rank_input(device, model) -> RankInput:
    groups = {path: gate.group_size for path, gate in all_gates(device, model).items()}
    return RankInput(isa_class=device.isa_class, model=model, groups=groups, kernel=for_device(device),
                     native_bf16=device.has("avx512_bf16") or device.has_amx)  # fmt: skip


def _alternative(plan: Plan, path: str, layout: str | None = None):
    return next(a for a in plan.alternatives if a.path == path and (layout is None or a.layout == layout))


def test_avx2_host_never_gets_w4a8(avx2_host, smollm2):
    for priority in ("speed", "fidelity"):
        plan = make_plan(avx2_host, smollm2, priority=priority)
        assert plan.path != "w4a8-gptq"
        w4a8 = _alternative(plan, "w4a8-gptq")
        assert w4a8.status == "incompatible"
        assert "AMX" in w4a8.why_not


def test_avx2_speed_picks_the_cheapest_measured_option_that_fits(avx2_host, smollm2):
    plan = make_plan(avx2_host, smollm2, priority="speed")
    fastest = speed_options(_rank_input(avx2_host, smollm2))[0]
    assert (plan.path, plan.layout) == (fastest.path, fastest.layout)
    assert plan.memory.fits
    assert any(r.fact and r.fact.startswith("avx2.") for r in plan.reasons)


def test_amx_speed_without_quality_records_takes_w4a8_through_the_plugins_cpu_w4a8(sapphire_rapids, smollm2):
    plan = make_plan(sapphire_rapids, smollm2, priority="speed")
    assert plan.path == "w4a8-gptq"
    assert plan.vllm.args[plan.vllm.args.index("--quantization") + 1] == "cpu_w4a8"
    assert "VLLM_CPU_INT4_W4A8" not in plan.vllm.env
    qc = plan.quantization_config
    assert qc["quant_method"] == "cpu_w4a8" and qc["sym"] is True and qc["desc_act"] is False
    assert qc["int8"] == ["embed_tokens", "lm_head"]
    assert plan.group_size in (64, 32)  # K=576 rules out 128
    assert any("never run on AMX" in w and "unverified" in w for w in plan.warnings)


def test_amx_w4a8_takes_the_weights_a_cpu_w4a8_record_measured_elsewhere(sapphire_rapids, zen5, smollm2):
    """The same config on AMX as on the AVX-512 host, so the record of one is the record of the other: the default
    model's shipped cpu_w4a8 record (mean KLD 0.40, measured on the Zen 5) keeps the AMX speed plan on w4a16."""
    from edge.measure.quality import quality_key, shipped_records

    amx, avx512 = (make_plan(d, smollm2, path="w4a8-gptq") for d in (sapphire_rapids, zen5))
    def weights(config: dict) -> dict:  # the dequant threshold only moves time (timed per host)
        return {k: v for k, v in config.items() if k != "dequant_threshold"}

    assert weights(amx.quantization_config) == weights(avx512.quantization_config)
    assert quality_key(amx.path, amx.quantization_config) == quality_key(avx512.path, avx512.quantization_config)
    plan = make_plan(sapphire_rapids, smollm2, priority="speed", quality=shipped_records())
    assert plan.path == "w4a16-tinygemm"
    assert "exceeds the speed priority's quality floor" in _alternative(plan, "w4a8-gptq").why_not


def test_amx_fidelity_never_quantizes_activations(sapphire_rapids, smollm2):
    plan = make_plan(sapphire_rapids, smollm2, priority="fidelity")
    assert plan.path == "bf16"
    w4a8 = _alternative(plan, "w4a8-gptq")
    assert w4a8.status == "runnable"
    assert "activations" in w4a8.why_not


def test_w4a8_needs_vllm_full_native_library(ice_lake, smollm2):
    plan = make_plan(ice_lake, smollm2, priority="speed")
    assert plan.path != "w4a8-gptq"
    assert "AMX" in _alternative(plan, "w4a8-gptq").why_not


def test_memory_budget_picks_the_most_faithful_option_that_fits(sapphire_rapids, llama_1b):
    """For a budget equal to each option's own peak, the plan is the first option in fidelity order that fits."""
    order = [(o.path, o.layout) for o in rank(_rank_input(sapphire_rapids, llama_1b), "fidelity")
             if o.path != "w4a8-gptq"]  # fmt: skip
    peaks = {
        (path, layout): make_plan(sapphire_rapids, llama_1b, priority="fidelity", path=path,
                                  layout=layout).memory.peak_bytes
        for path, layout in order
    }
    assert order[0] == ("bf16", None)
    for budget in sorted(set(peaks.values())):
        expected = next(option for option in order if peaks[option] <= budget)
        plan = make_plan(sapphire_rapids, llama_1b, priority="fidelity", budget_bytes=budget)
        assert (plan.path, plan.layout) == expected
        assert plan.memory.fits


def test_nothing_fits_gives_the_closest_option_and_what_would_make_it_fit(avx2_host, llama_1b):
    plan = make_plan(avx2_host, llama_1b, budget_bytes=64 * 2**20)
    assert not plan.memory.fits
    runnable = [a.peak_bytes for a in plan.alternatives if a.status != "incompatible"]
    smallest = min([plan.memory.peak_bytes, *runnable])
    assert plan.memory.peak_bytes == smallest
    assert all(a.hint for a in plan.alternatives if a.status in ("does-not-fit", "fits-with-hint"))
    assert any("nothing fits" in w for w in plan.warnings)


def test_a_shorter_context_is_offered_when_it_would_make_an_option_fit(sapphire_rapids, llama_1b):
    # 65536 tokens: a KV cache (2 GiB) larger than loading's copy of the embedding, so the context decides the peak
    full = make_plan(sapphire_rapids, llama_1b, priority="fidelity", path="bf16", max_model_len=65536)
    short = make_plan(sapphire_rapids, llama_1b, priority="fidelity", path="bf16", max_model_len=512)
    budget = (full.memory.peak_bytes + short.memory.peak_bytes) // 2
    plan = make_plan(sapphire_rapids, llama_1b, priority="fidelity", budget_bytes=budget, max_model_len=65536)
    bf16 = _alternative(plan, "bf16")
    assert bf16.status == "fits-with-hint"
    fitting_len = int(bf16.hint.split()[-1])
    assert make_plan(sapphire_rapids, llama_1b, priority="fidelity", path="bf16", budget_bytes=budget,
                     max_model_len=fitting_len).memory.fits
    assert not make_plan(sapphire_rapids, llama_1b, priority="fidelity", path="bf16", budget_bytes=budget,
                         max_model_len=fitting_len + 1).memory.fits


def test_a_pinned_path_the_device_cannot_run_is_refused_with_the_gate_reason(avx2_host, smollm2):
    with pytest.raises(PlanRefused) as refused:
        make_plan(avx2_host, smollm2, path="w4a8-gptq")
    assert refused.value.field == "path"
    assert "AMX" in str(refused.value)


def test_force_runs_a_refused_pin_and_says_so(avx2_host, smollm2):
    plan = make_plan(avx2_host, smollm2, path="w4a8-gptq", force=True)
    assert plan.path == "w4a8-gptq" and plan.forced and plan.pinned


def test_a_pinned_layout_implies_w4a16(avx2_host, smollm2):
    plan = make_plan(avx2_host, smollm2, layout="direct")
    assert (plan.path, plan.layout) == ("w4a16-tinygemm", "direct")
    assert plan.quantization_config["direct_dequant"] is True
    assert plan.quantization_config["prefill_dequant"] is True


def test_direct_and_dual_plans_compile_into_different_caches(avx2_host, smollm2):
    direct = make_plan(avx2_host, smollm2, layout="direct")
    dual = make_plan(avx2_host, smollm2, layout="dual")
    assert direct.vllm.env["VLLM_CACHE_ROOT"] != dual.vllm.env["VLLM_CACHE_ROOT"]
    assert direct.quantization_config != dual.quantization_config


def test_a_phone_gets_an_export_and_no_engine(phone, smollm2):
    plan = make_plan(phone, smollm2)
    assert plan.path == "export-only"
    assert plan.vllm is None
    assert all(a.status == "incompatible" for a in plan.alternatives)


def test_tied_embedding_and_head_are_in_the_8_bit_set_for_w4a16(avx2_host, smollm2):
    plan = make_plan(avx2_host, smollm2, layout="kernel-only")
    assert smollm2.tie_word_embeddings
    assert plan.quantization_config["int8"] == ["embed_tokens", "lm_head"]
    assert {layer.name: layer.format for layer in plan.layers}["lm_head"] == "int8"
    assert plan.quantization_config["group_size"] == 32  # the default model's own Q4_1 grid
    assert plan.quantization_config["codes_from_source"] is True


def record(model, key, kld: float) -> QualityRecord:
    return QualityRecord(model=model.name, key=key, kld_mean=kld, kld_mean_se=kld / 20, top1_agreement=0.9,
                         top1_agreement_se=0.003, ppl_ratio=1.02, ppl_ratio_se=0.004, confident_flip_rate=0.01,
                         confident_flip_rate_se=0.001, tokens=16384, cpu="test CPU")  # fmt: skip


def test_a_measurement_reports_the_plans_quality(avx2_host, smollm2):
    unmeasured = make_plan(avx2_host, smollm2)
    assert unmeasured.quality.status == "unmeasured" and "nearest reference" in unmeasured.quality.note
    key = quality_key(unmeasured.path, unmeasured.quantization_config)
    measured = make_plan(avx2_host, smollm2, quality=[record(smollm2, key, 0.004)])
    assert measured.path == unmeasured.path
    assert measured.quality.status == "measured" and measured.quality.record.kld_mean == 0.004
    assert any("measured quality: mean KLD 0.0040" in reason.text for reason in measured.reasons)


def test_a_measured_kld_over_the_floor_changes_the_speed_choice(avx2_host, smollm2):
    """Speed trades quality only within --max-kld: a 4-bit path measured worse is not chosen, and says why."""
    fast = make_plan(avx2_host, smollm2)
    assert fast.path == "w4a16-tinygemm"
    lossy = record(smollm2, quality_key(fast.path, fast.quantization_config), 0.3)
    plan = make_plan(avx2_host, smollm2, quality=[lossy])
    assert plan.path != "w4a16-tinygemm"
    why = next(alt.why_not for alt in plan.alternatives if alt.path == "w4a16-tinygemm")
    assert "exceeds the speed priority's quality floor --max-kld 0.08" in why
    assert make_plan(avx2_host, smollm2, quality=[lossy], max_kld=0.5).path == "w4a16-tinygemm"


def test_a_record_of_another_configuration_does_not_match(avx2_host, smollm2):
    plan = make_plan(avx2_host, smollm2)
    other = record(smollm2, quality_key(plan.path, {**plan.quantization_config, "group_size": 64}), 0.3)
    assert make_plan(avx2_host, smollm2, quality=[other]).quality.status == "unmeasured"


def test_small_boxes_give_vllm_every_core_in_three_process_mode(avx2_host, smollm2):
    """vLLM's mp executor reserves a core for its front end unless told not to; two-process mode sets the
    engine's threads itself (test_the_plan_serves_in_two_processes_with_the_engines_own_thread_binding)."""
    plan = make_plan(avx2_host, smollm2, path="bf16", serving_mode="three-process")
    assert avx2_host.compute_cores <= 4
    assert plan.vllm.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_kv_cache_is_sized_exactly_for_the_context(avx2_host, smollm2):
    plan = make_plan(avx2_host, smollm2, max_model_len=1024, max_num_seqs=2)
    kv = int(plan.vllm.args[plan.vllm.args.index("--kv-cache-memory-bytes") + 1])
    # 2 (K, V) x 30 layers x 3 kv heads x 64 head_dim x (1024 tokens shared + 2 seqs x a 128-token block) x 2 bytes
    assert kv == 2 * 30 * 3 * 64 * (1024 + 2 * 128) * 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"priority": "fast"}, "priority"), ({"max_model_len": 10**6}, "max_model_len"),
     ({"max_num_seqs": 0}, "max_num_seqs"), ({"budget_bytes": -1}, "memory_budget"),
     ({"path": "bf16", "layout": "direct"}, "layout")],
)  # fmt: skip
def test_bad_input_names_the_field(avx2_host, smollm2, kwargs, field):
    with pytest.raises(InputError) as error:
        make_plan(avx2_host, smollm2, **kwargs)
    assert error.value.field == field


def test_the_plan_round_trips_through_json(sapphire_rapids, smollm2):
    plan = make_plan(sapphire_rapids, smollm2)
    assert Plan.model_validate_json(plan.model_dump_json()) == plan


def test_planning_is_pure(avx2_host, smollm2):
    assert make_plan(avx2_host, smollm2) == make_plan(avx2_host, smollm2)


def test_memory_items_add_up(avx2_host, smollm2):
    plan = make_plan(avx2_host, smollm2)
    resident = sum(i.bytes for i in plan.memory.items if i.phase == "resident")
    assert plan.memory.resident_bytes == resident > 0
    assert plan.memory.peak_bytes >= plan.memory.resident_bytes


def test_verified_only_where_measured_on_the_isa_class(graviton, smollm2, avx2_host):
    arm = make_plan(graviton, smollm2)
    assert not arm.verified
    assert any("extrapolated" in w for w in arm.warnings)
    assert make_plan(avx2_host, smollm2, path="bf16").verified


def test_fidelity_on_4_bits_keeps_qkv_at_8_bits_for_a_plain_bf16_source(avx2_host, llama_1b):
    """Measured: q/k/v are the most sensitive weights at 4 bits (edge.catalog.quantized_layers.SENSITIVE_SET)."""
    plain = llama_1b
    formats = {layer.name: layer.format for layer in make_plan(avx2_host, plain, priority="fidelity",
                                                                path="w4a16-tinygemm").layers}  # fmt: skip
    assert formats["q_proj"] == formats["k_proj"] == formats["v_proj"] == "int8"
    assert formats["lm_head"] == formats["embed_tokens"] == "bf16" and formats["down_proj"] == "int4"
    speed = {layer.name: layer.format for layer in make_plan(avx2_host, plain, path="w4a16-tinygemm").layers}
    assert speed["q_proj"] == "int4" and speed["lm_head"] == "int8"


def test_a_source_on_its_own_grid_keeps_every_linear_at_4_bits_even_for_fidelity(avx2_host, smollm2):
    formats = {layer.name: layer.format for layer in make_plan(avx2_host, smollm2, priority="fidelity",
                                                                path="w4a16-tinygemm").layers}  # fmt: skip
    assert formats["q_proj"] == "int4" and formats["lm_head"] == "bf16"


def test_an_avx512_bf16_host_is_ranked_on_its_own_measurements(zen5, smollm2):
    """Facts table: W4A8 (vLLM's int4_scaled_mm_cpu through cpu_w4a8) is fastest there, but the default model's
    shipped quality record (mean KLD 0.40) is over the speed floor, so the plan is w4a16 direct; without quality
    records it is W4A8."""
    from edge.measure.quality import shipped_records

    assert make_plan(zen5, smollm2).path == "w4a8-gptq"
    plan = make_plan(zen5, smollm2, quality=shipped_records())
    assert (plan.path, plan.layout) == ("w4a16-tinygemm", "direct")
    w4a8 = next(a for a in plan.alternatives if a.path == "w4a8-gptq")
    assert "exceeds the speed priority's quality floor" in w4a8.why_not
    assert not any("extrapolated" in w for w in plan.warnings)
    assert {r.fact for r in plan.reasons if r.fact} >= {"avx512.1t.gemm.m1.int4_ms", "avx512.1t.dequant_bf16.m512_ms"}
    config = plan.quantization_config
    assert (config["prefill_dtype"], config["tinygemm_block"], config["dequant_threshold"]) == ("bfloat16", 64, 128)


def test_an_avx512_host_without_bf16_is_ranked_on_avx2s_fp32_numbers_and_says_so(ice_lake, smollm2):
    plan = make_plan(ice_lake, smollm2)
    assert any("extrapolated" in w for w in plan.warnings)
    assert plan.quantization_config["prefill_dtype"] == "float32"


# --- W4A8 gates: from the op vLLM's library registers, not the brand (issue 11) ------------------------------


def _w4a8_record(device, status: str, reason: str | None = None):
    """A calibration record of `device` in which vLLM's W4A8 kernel has the given status."""
    from edge.device.calibration import CalibrationRecord, KernelResult, KernelTime

    times = [KernelTime(n=576, k=1536, m=1, ms=0.012)] if status == "ok" else []
    return CalibrationRecord(
        cpu_model=device.cpu_model.value, isa_flags=device.isa.value, isa_class=device.isa_class, cores=2, threads=1,
        native_library="_C", group_size=64, measured_at="2026-11-30T00:00:00+00:00",
        kernels=[KernelResult(kernel="vllm-w4a8", status=status, reason=reason, times=times)],
    )  # fmt: skip


def test_w4a8_runs_on_avx512_bf16_vnni_without_amx_derived_from_its_flags(zen5, smollm2):
    gate = all_gates(zen5, smollm2)["w4a8-gptq"]
    assert gate.runnable and gate.group_size == 64
    assert "derived from ISA flags; no calibration record confirms the op runs" in gate.notes


def test_w4a8_on_a_host_without_amx_is_served_by_the_plugins_method(zen5, smollm2):
    plan = make_plan(zen5, smollm2, path="w4a8-gptq")
    assert plan.quantization_config["quant_method"] == "cpu_w4a8"
    assert plan.quantization_config["int8"] == ["embed_tokens", "lm_head"]
    assert plan.vllm.args[plan.vllm.args.index("--quantization") + 1] == "cpu_w4a8"
    assert "VLLM_CPU_INT4_W4A8" not in plan.vllm.env  # vLLM's own GPTQ switch; cpu_w4a8 does not read it
    assert not plan.forced


def test_w4a8_fidelity_on_a_host_without_amx_still_never_quantizes_activations(zen5, smollm2):
    plan = make_plan(zen5, smollm2, priority="fidelity")
    assert plan.path != "w4a8-gptq"
    w4a8 = _alternative(plan, "w4a8-gptq")
    assert w4a8.status == "runnable" and "activations" in w4a8.why_not


def test_w4a8_is_refused_on_avx2_naming_the_library_without_the_op(avx2_host, smollm2):
    refusals = " ".join(all_gates(avx2_host, smollm2)["w4a8-gptq"].refusals)
    assert "_C_AVX2" in refusals and "int4_scaled_mm_cpu" in refusals


def test_w4a8_is_refused_on_avx512_without_bf16_naming_the_library_without_the_op(ice_lake, smollm2):
    assert ice_lake.has("avx512f") and not ice_lake.has("avx512_bf16")
    refusals = " ".join(all_gates(ice_lake, smollm2)["w4a8-gptq"].refusals)
    assert "AVX512-BF16" in refusals and "_C_AVX512" in refusals


def test_a_calibration_record_that_ran_the_op_confirms_w4a8(zen5, smollm2):
    gate = all_gates(zen5, smollm2, _w4a8_record(zen5, "ok"))["w4a8-gptq"]
    assert gate.runnable and not any("derived from ISA flags" in note for note in gate.notes)


@pytest.mark.parametrize("status", ["absent", "crashed", "failed"])
def test_a_calibration_record_that_could_not_run_the_op_refuses_w4a8_with_its_reason(zen5, smollm2, status):
    reason = "_C registers no int4_scaled_mm_cpu" if status == "absent" else "killed by SIGILL"
    gate = all_gates(zen5, smollm2, _w4a8_record(zen5, status, reason))["w4a8-gptq"]
    assert not gate.runnable
    assert status in gate.refusals[0] and reason in gate.refusals[0]




@pytest.mark.parametrize(("config", "block"), [
    ("phi-3-mini-4k-instruct.json", "16"),  # a model-level sliding_window 2047: every layer slides
    ("gemma-2-2b.json", None),  # alternating sliding and full layers
    ("llama-3.2-1b.json", None),
])  # fmt: skip
def test_a_model_whose_every_layer_slides_starts_vllm_at_block_size_16(zen5, config, block):
    """vLLM 0.28's CPU attention fails such a model's first request at a KV block of 32 or more (docs/FACTS.md)."""
    plan = make_plan(zen5, read_model(DATA / "configs" / config))
    args = plan.vllm.args
    assert (args[args.index("--block-size") + 1] if "--block-size" in args else None) == block
    assert any("--block-size 16" in r.text for r in plan.reasons) == (block is not None)


@pytest.mark.parametrize("config", ["gemma-2-2b.json", "gemma-2b.json"])
@pytest.mark.parametrize("path", ["w4a16-tinygemm", "w4a8-gptq"])
def test_gemma_and_gemma_2_keep_the_embedding_and_head_bf16_which_vllms_classes_cannot_load_quantized(zen5, config,
                                                                                                     path):
    plan = make_plan(zen5, read_model(DATA / "configs" / config), priority="speed", path=path)
    formats = {layer.name: layer.format for layer in plan.layers}
    assert formats["embed_tokens"] == formats["lm_head"] == "bf16" and formats["q_proj"] == "int4"
    # the converter and the vLLM method read the same: a tied head in `ignore` keeps its embedding bf16
    assert not plan.quantization_config.get("int8") and "lm_head" in plan.quantization_config["ignore"]


def test_gemma_3_takes_the_8_bit_embedding_and_head(zen5):
    from edge.model.reader import read_model_config

    model = read_model_config({"model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048,
                              "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
                              "head_dim": 256, "vocab_size": 262144, "tie_word_embeddings": True},
                              "gemma-3-270m")  # fmt: skip
    plan = make_plan(zen5, model, priority="speed", path="w4a16-tinygemm")
    assert {layer.name: layer.format for layer in plan.layers}["embed_tokens"] == "int8"


def test_a_gemma_3_record_an_older_edge_eval_measured_is_read_as_none(zen5):
    """Issue 40: before revision 2 edge-eval's Gemma 3 candidate lost its embedding scale and measured a good
    4-bit plan as broken (KLD 12.55); such a record, still in a user's cache, must not refuse the path."""
    from edge.measure.quality import EVALUATOR_REVISION, STALE_BELOW
    from edge.model.reader import read_model_config

    model = read_model_config({"model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048,
                              "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
                              "head_dim": 256, "vocab_size": 262144, "tie_word_embeddings": True},
                              "gemma-3-270m")  # fmt: skip
    assert STALE_BELOW[model.architecture] == EVALUATOR_REVISION
    plan = make_plan(zen5, model, priority="speed", path="w4a16-tinygemm")
    key = quality_key(plan.path, plan.quantization_config)
    stale = record(model, key, 12.55)  # no evaluator field: written before revision 2
    assert stale.evaluator < EVALUATOR_REVISION
    assert make_plan(zen5, model, priority="speed", path="w4a16-tinygemm", quality=[stale]).quality.status == (
        "unmeasured"
    )
    current = stale.model_copy(update={"evaluator": EVALUATOR_REVISION, "kld_mean": 0.005})
    measured = make_plan(zen5, model, priority="speed", path="w4a16-tinygemm", quality=[stale, current])
    assert measured.quality.status == "measured" and measured.quality.record.kld_mean == 0.005


def test_an_older_edge_evals_record_of_an_architecture_it_measured_right_still_counts(avx2_host, smollm2):
    plan = make_plan(avx2_host, smollm2)
    older = record(smollm2, quality_key(plan.path, plan.quantization_config), 0.004)
    assert older.evaluator == 1
    assert make_plan(avx2_host, smollm2, quality=[older]).quality.status == "measured"


# --- serving mode (issue 23) ------------------------------------------------------------------------------------


def test_a_two_core_box_serves_in_one_process_and_says_what_that_measured(zen5, smollm2):
    """On a 1-2 core box the engine core is a thread of vLLM's API server (kernels/vllm_plugin/engine_thread.py):
    one Python process with torch and vLLM, on one compute thread, and no OpenMP binding."""
    plan = make_plan(zen5, smollm2)
    assert zen5.compute_cores == 2 and plan.vllm.mode == "one-process"
    env = plan.vllm.env
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["EDGE_ENGINE_CORE_START"] == "thread"
    assert env["OMP_NUM_THREADS"] == "1" and "OMP_PROC_BIND" not in env and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in env
    why = [r for r in plan.reasons if r.fact == "avx512.one_process.rss_settled_ratio"]
    assert len(why) == 1 and f"measured {why[0].value:.0%} of two-process's settled RssAnon" in why[0].text


def test_a_bigger_box_serves_in_two_processes_with_the_engines_own_thread_binding(ice_lake, smollm2):
    """The engine core runs the worker itself (vLLM's uni executor), so the plan gives it the thread count vLLM
    would give a worker process, one core left to the API server and the wrapper, and no OpenMP binding (which the
    API server, whose environment the engine core inherits, would take too)."""
    plan = make_plan(ice_lake, smollm2)
    assert plan.vllm.mode == "two-process"
    env = plan.vllm.env
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "OMP_PROC_BIND" not in env
    assert env["OMP_NUM_THREADS"] == str(max(1, ice_lake.compute_cores - 1))
    assert env["EDGE_ENGINE_CORE_START"] == "fork"  # the core inherits the API server's imports
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in env  # only vLLM's mp executor reads it
    assert any(r.fact == "avx512.one_process.rss_settled_ratio" and "two-process" in r.text for r in plan.reasons)


def test_two_threads_asked_on_a_two_core_box_serve_in_two_processes(zen5, smollm2):
    """One-process on 2 threads served 0.44x the decode of one thread; two-process lost 9 %."""
    plan = make_plan(zen5, smollm2, threads=2)
    assert plan.vllm.mode == "two-process" and plan.vllm.env["OMP_NUM_THREADS"] == "2"
    assert not any("one-process" in w for w in plan.warnings)
    asked = make_plan(zen5, smollm2, threads=2, serving_mode="one-process")  # asked for both: served, with a warning
    assert asked.vllm.mode == "one-process" and asked.vllm.env["OMP_NUM_THREADS"] == "2"
    assert any("0.44x" in w for w in asked.warnings)
    assert any(r.source == "asked" and "one-process" in r.text for r in asked.reasons)


def test_an_engine_of_more_than_one_thread_starts_its_core_by_fork_too(ice_lake, smollm2):
    """The plugin keeps the API server on one OpenMP thread and gives the forked core its threads back
    (kernels/vllm_plugin/engine_start.py; libgomp's pool does not survive a fork), so bigger boxes keep the faster
    start as well."""
    env = make_plan(ice_lake, smollm2).vllm.env
    assert int(env["OMP_NUM_THREADS"]) == ice_lake.compute_cores - 1 > 1
    assert env["EDGE_ENGINE_CORE_START"] == "fork"


def test_threads_asked_for_are_the_engines_and_the_plan_says_so(ice_lake, smollm2):
    plan = make_plan(ice_lake, smollm2, threads=3)
    assert plan.vllm.env["OMP_NUM_THREADS"] == "3" and plan.vllm.env["EDGE_ENGINE_CORE_START"] == "fork"
    assert any(r.unit == "threads" and r.value == 3 and r.source == "asked" for r in plan.reasons)
    assert plan.quantization_config == make_plan(ice_lake, smollm2).quantization_config  # no weights change


def test_one_engine_thread_on_a_two_core_box_cites_what_a_second_one_measured_served(zen5, smollm2):
    assert zen5.compute_cores == 2
    plan = make_plan(zen5, smollm2)
    assert plan.vllm.env["OMP_NUM_THREADS"] == "1"
    served = [r for r in plan.reasons if r.fact == "avx512.one_process.second_thread.decode_ratio"]
    assert len(served) == 1 and "--threads 2 --serving-mode two-process" in served[0].text
    two = make_plan(zen5, smollm2, serving_mode="two-process")
    assert [r.fact for r in two.reasons if r.fact and "second_thread" in r.fact] == [
        "avx512.two_process.second_thread.decode_ratio"]
    asked = make_plan(zen5, smollm2, threads=2)  # asked for two: the measurement against it is not quoted
    assert not any(r.fact and "second_thread" in r.fact for r in asked.reasons)


@pytest.mark.parametrize(("threads", "mode", "expected"), [
    (0, None, "a positive number"), (True, None, "a positive number"), (10**6, None, "compute cores"),
    (2, "three-process", "three-process"),
])  # fmt: skip
def test_a_thread_count_the_engine_cannot_take_is_refused_naming_it(ice_lake, smollm2, threads, mode, expected):
    with pytest.raises(InputError, match=expected) as refused:
        make_plan(ice_lake, smollm2, threads=threads, serving_mode=mode)
    assert refused.value.field == "threads" and refused.value.value == threads


def test_three_process_mode_is_vllms_own_cpu_default(zen5, smollm2):
    plan = make_plan(zen5, smollm2, serving_mode="three-process")
    assert plan.vllm.mode == "three-process"
    assert not {"VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_PROC_BIND", "OMP_NUM_THREADS", "EDGE_ENGINE_CORE_START"} & set(
        plan.vllm.env
    )
    assert plan.vllm.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"  # a small box gives the worker every core


def test_the_serving_mode_changes_no_weights(zen5, smollm2):
    one, two, three = (make_plan(zen5, smollm2, serving_mode=m) for m in SERVING_MODES)
    assert one.quantization_config == two.quantization_config == three.quantization_config
    assert one.vllm.args == two.vllm.args == three.vllm.args
    assert one.vllm.env["VLLM_CACHE_ROOT"] == two.vllm.env["VLLM_CACHE_ROOT"] == three.vllm.env["VLLM_CACHE_ROOT"]


def test_a_class_without_its_own_baseline_for_the_mode_takes_the_mode_measured_elsewhere(avx2_host, smollm2):
    """The AVX2 host has only a three-process baseline (measured there on bf16). Its one-process engine is charged
    the one-process figure of the AVX-512 host, not that: the mode moves the baseline by half a GB a process, the
    ISA barely. That figure was measured on a quantized plan, so a bf16 plan books that class's repack retention."""
    from edge.facts import fact

    def items(mode, path=None):
        plan = make_plan(avx2_host, smollm2, serving_mode=mode, path=path)
        return {item.kind: item.bytes for item in plan.memory.items}

    assert items("one-process")["engine-baseline"] == fact("avx512.vllm_engine_baseline_bytes.one-process").value
    assert items("three-process")["engine-baseline"] == fact("any.vllm_engine_baseline_bytes").value
    assert "repack-retention" in items("one-process", "bf16")
    assert "repack-retention" not in items("three-process", "bf16")  # its baseline was measured on bf16


def _w4a8_record_of(zen5, model, kld: float) -> QualityRecord:
    plan = make_plan(zen5, model, path="w4a8-gptq")
    return record(model, quality_key(plan.path, plan.quantization_config), kld)


def test_a_model_without_records_is_not_served_w4a8_when_w4a8_missed_the_floor_on_every_model_measured(zen5,
                                                                                                      smollm2):
    """A user's GGUF has no edge-eval record; W4A8 measured 0.40-0.63 mean KLD on every model tried (the default
    model's Q4_K_M requantization: 0.45, docs/reports/2026-12-01-gguf-models.md), so speed keeps bf16
    activations, and says why."""
    other = read_model(DATA / "configs" / "qwen2.5-0.5b-instruct.json")
    assert make_plan(zen5, other).path == "w4a8-gptq"  # no records at all: the fastest path
    plan = make_plan(zen5, other, quality=[_w4a8_record_of(zen5, smollm2, 0.40)])
    assert plan.path == "w4a16-tinygemm"
    why = _alternative(plan, "w4a8-gptq").why_not
    assert "on every model measured" in why and smollm2.name in why and "0.4000" in why


def test_one_record_of_w4a8_within_the_floor_lets_an_unmeasured_model_take_it(zen5, smollm2):
    other = read_model(DATA / "configs" / "qwen2.5-0.5b-instruct.json")
    records = [_w4a8_record_of(zen5, smollm2, 0.40), _w4a8_record_of(zen5, read_model(DATA / "configs" /
                                                                                    "llama-3.2-1b.json"), 0.05)]
    assert make_plan(zen5, other, quality=records).path == "w4a8-gptq"


def _smollm2_q4_k_m() -> tuple[dict, list[int]]:
    """The header of llama.cpp's Q4_K_M of the default model, as JSON: its rows are 576 wide, not a multiple of 256,
    so llama-quant.cpp falls back to Q5_0 for every linear but the 1536-wide ffn_down (166 Q5_0, 16 Q4_K, 14 Q6_K,
    15 Q8_0; docs/reports/2026-12-01-gguf-models.md). attn_v and ffn_down take more bits (Q6_K, or Q8_0 where
    Q6_K falls back) on use_more_bits' layers (returned): the first and last eighth, and every third between."""
    layers = 30
    more_bits = [i for i in range(layers) if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2]
    shapes = {"attn_q": [576, 576], "attn_k": [192, 576], "attn_v": [192, 576], "attn_output": [576, 576],
              "ffn_gate": [1536, 576], "ffn_up": [1536, 576], "ffn_down": [576, 1536]}  # fmt: skip

    def held(name: str, i: int) -> str:
        if name == "ffn_down":
            return "Q6_K" if i in more_bits else "Q4_K"
        return "Q8_0" if name == "attn_v" and i in more_bits else "Q5_0"

    meta = {"general.architecture": "llama", "llama.block_count": layers, "llama.context_length": 8192,
            "llama.embedding_length": 576, "llama.feed_forward_length": 1536, "llama.attention.head_count": 9,
            "llama.attention.head_count_kv": 3, "llama.rope.dimension_count": 64,
            "tokenizer.ggml.tokens": 49152}  # fmt: skip
    tensors = [{"name": "token_embd.weight", "type": "Q8_0", "shape": [49152, 576]}] + [
        {"name": f"blk.{i}.{name}.weight", "type": held(name, i), "shape": shape}
        for i in range(layers) for name, shape in shapes.items()]  # fmt: skip
    return {"metadata": meta, "tensors": tensors}, more_bits


def test_a_q4_k_m_whose_rows_fall_back_keeps_its_q4_k_codes_and_takes_the_rest_at_8_bits(zen5):
    """Re-rounding this file's Q5_0 linears to 4 bits measured mean KLD 0.235 against the file, and with those
    int8 but down_proj's Q4_K rows re-rounded at group 64, 0.063, where llama.cpp serving the file measured 0.0044
    (docs/reports/2026-12-01-gguf-models.md): the plan keeps the file's own mixed grid, group 32 where it is Q4_K."""
    from edge.model.gguf_metadata import header_from_json
    from edge.model.reader import read_gguf_header

    body, more_bits = _smollm2_q4_k_m()
    plan = make_plan(zen5, read_gguf_header(header_from_json(body), "smollm2-Q4_K_M"), path="w4a16-tinygemm")
    assert plan.group_size == 32 and plan.quantization_config["codes_from_source"] is True
    down = [f"model.layers.{i}.mlp.down_proj" for i in more_bits]
    wide_kinds = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]  # Q5_0 or Q8_0 in every layer
    assert sorted(plan.quantization_config["int8"]) == sorted(["embed_tokens", "lm_head", *wide_kinds, *down])
    parts = {(layer.name, layer.format): (layer.count, layer.source) for layer in plan.layers}
    assert parts["down_proj", "int8"] == (14, {"Q6_K": 14}) and parts["down_proj", "int4"] == (16, {"Q4_K": 16})
    assert parts["v_proj", "int8"] == (30, {"Q5_0": 16, "Q8_0": 14}) and ("v_proj", "int4") not in parts
    assert next(layer.why for layer in plan.layers if layer.name == "down_proj" and layer.format == "int4") == (
        "quantized: the file's codes copied (16)")  # fmt: skip


def test_the_ledgers_engine_baseline_follows_the_serving_mode(zen5, smollm2):
    """Measured per mode on the AVX-512 host: each mode carries one Python process with torch and vLLM fewer."""
    def baseline(mode):
        plan = make_plan(zen5, smollm2, serving_mode=mode)
        return next(item.bytes for item in plan.memory.items if item.kind == "engine-baseline")

    from edge.facts import fact

    for mode in ("one-process", "two-process", "three-process"):
        assert baseline(mode) == fact(f"avx512.vllm_engine_baseline_bytes.{mode}").value
    assert baseline("one-process") < baseline("two-process") < baseline("three-process")


def test_a_plan_counts_a_tokenizer_in_each_process_that_loads_one(avx2_host, smollm2):
    from edge.facts import fact

    per_token = int(fact("any.tokenizer_bytes_per_vocab_token").value)
    for mode, copies in (("one-process", 1), ("two-process", 2), ("three-process", 2)):
        plan = make_plan(avx2_host, smollm2, serving_mode=mode)
        item = next(i for i in plan.memory.items if i.kind == "tokenizer")
        assert item.bytes == copies * smollm2.vocab_size * per_token, mode
