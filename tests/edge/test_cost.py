"""The cost model (edge.measure.cost), the kernel registry and calibration records, against hand-computed cases.

`data/calibration_epyc_avx2.json` holds the AVX2 host's measured GEMM medians (benchmarks/dequant_paths.py's
table, 2026-11-29: 2-core AMD EPYC, AVX2 only, torch 2.13.0, 1 thread, the mean of two runs) as a record.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from edge.catalog.kernel_registry import KERNELS, kernels_for
from edge.catalog.quantized_layers import model_layers, rules_for
from edge.device.calibration import (
    CalibrationRecord,
    KernelResult,
    KernelTime,
    best_match,
    load_records,
    parse,
    record_path,
)
from edge.errors import InputError
from edge.measure.cost import (
    NEW_TOKENS,
    EngineLinear,
    Unmeasured,
    engine_linears,
    faster_prefill,
    measured_threshold,
    request_cost,
)
from edge.plan.planner import make_plan

DATA = Path(__file__).parent / "data"


def _record(kernels: dict[str, dict[tuple[int, int, int], float]], **fields) -> CalibrationRecord:
    results = [KernelResult(kernel=name, status="ok", times=[KernelTime(n=n, k=k, m=m, ms=ms)
                                                             for (n, k, m), ms in times.items()])
               for name, times in kernels.items()]  # fmt: skip
    base = dict(cpu_model="Test CPU", isa_flags=["avx2", "fma"], isa_class="avx2", cores=2, threads=1,
                group_size=64, measured_at="2026-11-30T00:00:00+00:00", kernels=results)  # fmt: skip
    return CalibrationRecord(**{**base, **fields})


@pytest.fixture
def avx2_record() -> CalibrationRecord:
    return CalibrationRecord.model_validate_json((DATA / "calibration_epyc_avx2.json").read_text())


def test_every_registered_kernel_serves_or_is_a_comparison_and_names_its_op():
    for spec in KERNELS.values():
        assert spec.op and spec.library in ("torch", "vllm")
    assert kernels_for("w4a16-tinygemm", "direct", "decode") == ["tinygemm"]
    assert set(kernels_for("w4a16-tinygemm", "dual", "prefill")) == {"dequant-bf16", "dequant-fp32"}
    assert kernels_for("w4a16-tinygemm", "kernel-only", "prefill") == ["tinygemm"]
    assert kernels_for("w4a8-gptq", None, "decode") == ["vllm-w4a8", "kleidiai-w4a8"]
    assert kernels_for("w4a8-gptq", None, "decode", "arm") == ["kleidiai-w4a8"]
    assert kernels_for("w4a8-gptq", None, "decode", "avx512") == ["vllm-w4a8"]
    assert KERNELS["vllm-w4a8"].quantizes_activations and not KERNELS["tinygemm"].quantizes_activations


def test_vllm_fuses_qkv_and_gate_up_and_the_embedding_is_no_gemm(smollm2):
    linears = engine_linears(model_layers(smollm2, rules_for(smollm2, "w4a16-tinygemm", 32, "speed")))
    by_name = {lin.name: lin for lin in linears}
    assert set(by_name) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert (by_name["qkv_proj"].n, by_name["qkv_proj"].k) == (576 + 192 + 192, 576)
    assert (by_name["gate_up_proj"].n, by_name["gate_up_proj"].count) == (2 * 1536, 30)
    assert by_name["lm_head"].format == "int8" and by_name["lm_head"].logits


def test_bf16_request_cost_by_hand():
    """One 100x200 layer x2 and a head: prefill 512 rows through the layers, one row through the head; then 128
    steps of one row each."""
    record = _record({"bf16": {(100, 200, 1): 0.5, (100, 200, 512): 40.0, (1000, 200, 1): 3.0}})
    linears = [EngineLinear("o_proj", 100, 200, 2, "bf16"), EngineLinear("lm_head", 1000, 200, 1, "bf16")]
    cost = request_cost(record, linears, "bf16", None, dequant_threshold=128, prefill_dtype="bfloat16")
    assert cost.prefill_ms == pytest.approx(2 * 40.0 + 3.0)
    assert cost.decode_step_ms == pytest.approx(2 * 0.5 + 3.0)
    assert cost.ms == pytest.approx(83.0 + NEW_TOKENS * 4.0)
    assert cost.kernels == {"bf16": pytest.approx(cost.ms)}


def test_direct_layout_switches_kernels_at_the_threshold_and_batches_share_a_step():
    record = _record({
        "tinygemm": {(100, 200, 1): 0.2, (100, 200, 4): 0.6, (100, 200, 512): 90.0},
        "dequant-bf16": {(100, 200, 512): 30.0},
        "int8": {(1000, 200, 1): 1.0, (1000, 200, 4): 2.0},
    })  # fmt: skip
    linears = [EngineLinear("o_proj", 100, 200, 3, "int4"), EngineLinear("lm_head", 1000, 200, 1, "int8")]
    direct = request_cost(record, linears, "w4a16-tinygemm", "direct", dequant_threshold=128,
                          prefill_dtype="bfloat16")  # fmt: skip
    assert direct.prefill_ms == pytest.approx(3 * 30.0 + 1.0)
    assert direct.decode_step_ms == pytest.approx(3 * 0.2 + 1.0)
    kernel_only = request_cost(record, linears, "w4a16-tinygemm", "kernel-only", dequant_threshold=128,
                               prefill_dtype="bfloat16")  # fmt: skip
    assert kernel_only.prefill_ms == pytest.approx(3 * 90.0 + 1.0)
    batched = request_cost(record, linears, "w4a16-tinygemm", "direct", dequant_threshold=128,
                           prefill_dtype="bfloat16", batch=4)  # fmt: skip
    assert batched.decode_step_ms == pytest.approx((3 * 0.6 + 2.0) / 4)
    assert sum(batched.kernels.values()) == pytest.approx(batched.ms)


def test_an_int8_layer_dequantizes_a_prompt_and_a_per_group_one_decodes_on_the_avx2_kernel():
    """kernels.ops.int4_ops.int8_linear_impl: from the dequant threshold an int8 layer dequantizes and runs bf16
    (counted at the dequantize + bf16 kernel's times, not PyTorch's int8 kernel's scaled to 512 rows); below it a
    per-group one runs the AVX2 int8 kernel, a per-channel one PyTorch's (with tinygemm decode)."""
    record = _record({
        "tinygemm": {(100, 256, 1): 0.2},
        "dequant-bf16": {(100, 256, 512): 30.0},
        "int8": {(100, 256, 1): 1.0},
        "avx2-int8": {(100, 256, 1): 0.4},
    })  # fmt: skip
    for group, decode_kernel in ((None, "int8"), (32, "avx2-int8")):
        linears = [EngineLinear("v_proj", 100, 256, 2, "int8", group)]
        cost = request_cost(record, linears, "w4a16-tinygemm", "direct", dequant_threshold=128,
                            prefill_dtype="bfloat16")  # fmt: skip
        assert cost.prefill_ms == pytest.approx(2 * 30.0)
        assert cost.decode_step_ms == pytest.approx(2 * (1.0 if group is None else 0.4)), decode_kernel
        assert set(cost.kernels) == {"dequant-bf16", decode_kernel}


def test_an_8_bit_layer_kept_as_the_files_blocks_decodes_at_the_grid_kernels_time_for_its_bytes():
    """A Q6_K down_proj [N=256, K=512] on the 8-bit set's grid per 16 reads K (1 + 4/16) bytes a row; as the file's
    blocks 210 per 256 weights: its decode rows cost the grid kernel's time x 210/256 / 1.25 = 0.656; a prompt
    dequantizes either way, at the same time."""
    record = _record({"dequant-bf16": {(256, 512, 512): 30.0}, "avx2-int8": {(256, 512, 1): 0.4}})
    grid, blocks = (EngineLinear("down_proj", 256, 512, 2, "int8", 16, kind) for kind in (None, "Q6_K"))
    assert blocks.blocks_share() == pytest.approx(210 / 256 / 1.25) and grid.blocks_share() == 1.0
    costs = [request_cost(record, [lin], "w4a8-gptq", None, dequant_threshold=128, prefill_dtype="bfloat16")
             for lin in (grid, blocks)]  # fmt: skip
    assert costs[0].decode_step_ms == pytest.approx(2 * 0.4)
    assert costs[1].decode_step_ms == pytest.approx(2 * 0.4 * 210 / 256 / 1.25)
    assert costs[0].prefill_ms == costs[1].prefill_ms == pytest.approx(2 * 30.0)
    assert any("Q6_K blocks counted at avx2-int8's times for their bytes" in s for s in costs[1].substituted)


def test_the_cost_models_gemms_keep_the_8_bit_sets_blocks_apart_and_price_a_q4_k_decode_copy_as_its_grid():
    from edge.catalog.quantized_layers import LayerDecision

    def part(name, fmt, blocks, count, n=256, k=512):
        return LayerDecision(name=name, format=fmt, why="", n=n, k=k, count=count, blocks=blocks)

    layers = [part("down_proj", "int8", "Q6_K", 3), part("down_proj", "int8", None, 1),
              part("down_proj", "int4", "Q4_K", 2), part("lm_head", "int8", "Q6_K", 1, n=1024)]  # fmt: skip
    got = {(lin.name, lin.format, lin.blocks): lin.count for lin in engine_linears(layers)}
    assert got == {("down_proj", "int8", "Q6_K"): 3, ("down_proj", "int8", None): 1, ("down_proj", "int4", None): 2,
                   ("lm_head", "int8", "Q6_K"): 1}  # fmt: skip


def test_times_between_measured_rows_are_interpolated_and_other_shapes_scaled_by_weight_count():
    record = _record({"bf16": {(100, 200, 1): 1.0, (100, 200, 17): 9.0}})
    at_9 = request_cost(record, [EngineLinear("lm_head", 100, 200, 1, "bf16")], "bf16", None, batch=9,
                        dequant_threshold=128, prefill_dtype="bfloat16")  # fmt: skip
    assert at_9.decode_step_ms == pytest.approx(5.0 / 9)
    scaled = request_cost(record, [EngineLinear("lm_head", 200, 200, 1, "bf16")], "bf16", None,
                          dequant_threshold=128, prefill_dtype="bfloat16")  # fmt: skip
    assert scaled.decode_step_ms == pytest.approx(2.0)
    assert scaled.scaled_shapes == ["200x200 from 100x200 (2x its weights)"]


def test_a_prompt_at_an_untimed_shape_is_priced_from_a_shape_timed_at_a_prompts_rows():
    """The head is timed at decode rows only (HEAD_MAX_ROWS): a 512-row price stretched from its 16 rows would
    count a dequantizing kernel's fixed cost 32 times over (issue 48: a ~1B's gate_up_proj priced from SmolLM2's
    head put direct's prefill at 54 s). A smaller shape timed at 512 rows prices it instead, by weight count."""
    record = _record({"dequant-bf16": {(1000, 1000, 1): 10.0, (1000, 1000, 16): 10.5, (100, 1000, 1): 1.0,
                                       (100, 1000, 512): 4.0},
                      "tinygemm": {(1000, 1000, 1): 0.1}})  # the decode steps' kernel  # fmt: skip
    cost = request_cost(record, [EngineLinear("gate_up_proj", 2000, 1000, 1, "int4")], "w4a16-tinygemm", "direct",
                        dequant_threshold=128, prefill_dtype="bfloat16")  # fmt: skip
    assert cost.kernels["dequant-bf16"] == pytest.approx(4.0 * 20)  # 20x the weights of the shape timed at 512 rows
    assert "2000x1000 from 100x1000 (20x its weights)" in cost.scaled_shapes


@pytest.mark.parametrize("held", [(4096, 4096), (49152, 576)])
def test_a_big_shape_held_out_of_a_real_record_is_priced_within_a_third_at_decode_rows(held):
    """The Zen 5 record (the default model's shapes and the 4096x4096 reference), each of its two big shapes left
    out in turn and priced from the rest, against its own measured times: every kernel, every decode row count
    (a decode step's cost is its bytes, which grow with the weight count). Measured: 0.75x-1.33x."""
    record = CalibrationRecord.model_validate_json((DATA / "calibration_epyc_zen5.json").read_text())
    from edge.measure.cost import KernelTimes

    ratios = {}
    for result in record.kernels:
        if result.status != "ok":
            continue
        rest = KernelTimes(result.model_copy(update={"times": [t for t in result.times if (t.n, t.k) != held]}))
        for t in result.times:
            if (t.n, t.k) == held and t.m <= 16:
                ratios[(result.kernel, t.m)] = rest.ms(t.n, t.k, t.m) / t.ms
    assert len(ratios) >= 20
    assert all(1 / 1.4 < r < 1.4 for r in ratios.values()), ratios


def test_an_option_whose_kernel_was_not_timed_is_unmeasured():
    record = _record({"bf16": {(100, 200, 1): 1.0}})
    record.kernels.append(KernelResult(kernel="vllm-w4a8", status="absent", reason="_C_AVX2 has no such op"))
    with pytest.raises(Unmeasured, match="absent: _C_AVX2 has no such op"):
        request_cost(record, [EngineLinear("o_proj", 100, 200, 1, "int4")], "w4a8-gptq", None,
                     dequant_threshold=128, prefill_dtype="bfloat16")  # fmt: skip


def test_threshold_is_the_crossover_from_which_dequantize_keeps_winning():
    record = _record({
        "tinygemm": {(100, 200, 1): 1.0, (100, 200, 16): 10.0, (100, 200, 128): 80.0, (100, 200, 512): 300.0},
        "dequant-fp32": {(100, 200, 1): 5.0, (100, 200, 16): 9.0, (100, 200, 128): 90.0, (100, 200, 512): 100.0},
    })  # fmt: skip
    # wins at 16, loses at 128 (by 10 ms), wins at 512 (by 200 ms): linear in between, they cross at
    # 128 + 384 * 10 / 210 = 146.3 rows
    assert measured_threshold(record, [(100, 200)], "dequant-fp32") == 147
    assert measured_threshold(record, [(100, 200)], "dequant-bf16") is None  # not timed


def test_the_avx2_record_measures_fp32_prefill_faster_and_its_own_crossover(avx2_record, smollm2):
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    assert faster_prefill(avx2_record, shapes) == "float32"  # no native bf16 dot product on AVX2
    assert measured_threshold(avx2_record, shapes, "dequant-fp32") == 99  # between its 64 and 128 rows


def test_a_record_validates_its_flags_and_parse_names_the_field():
    with pytest.raises(ValidationError):
        _record({}, isa_flags=["avx9000"])
    with pytest.raises(InputError, match="calibration.cores"):
        parse({**json.loads(_record({}).model_dump_json()), "cores": 0})


def test_records_match_a_device_by_cpu_model_and_flags(avx2_record, avx2_host, zen5, tmp_path):
    assert best_match([avx2_record], avx2_host) is avx2_record
    assert best_match([avx2_record], zen5) is None  # "AMD EPYC" too, but AVX-512 flags
    path = record_path(avx2_record, tmp_path)
    path.write_text(avx2_record.model_dump_json())
    (tmp_path / "junk.json").write_text("{not json")
    assert load_records(tmp_path) == [avx2_record]


def test_a_plan_from_a_record_cites_it_and_takes_its_threshold(avx2_record, avx2_host, smollm2):
    plan = make_plan(avx2_host, smollm2, calibration=avx2_record)
    assert plan.calibration is not None and plan.calibration.key == avx2_record.key
    assert not any("extrapolated" in w for w in plan.warnings)
    assert plan.verified and "kernels timed on this CPU" in plan.verified_detail
    assert (plan.path, plan.layout) == ("w4a16-tinygemm", "direct")
    qc = plan.quantization_config
    assert (qc["prefill_dtype"], qc["dequant_threshold"]) == ("float32", 99)
    assert any(r.source and "calibration of this CPU" in r.source and "ms per request" in r.text
               for r in plan.reasons)  # fmt: skip
    bf16 = next(a for a in plan.alternatives if a.path == "bf16")
    assert "ranked below" in bf16.why_not and "ms per request" in bf16.why_not


def test_without_a_record_the_plan_says_it_used_the_facts_table(avx2_host, smollm2):
    plan = make_plan(avx2_host, smollm2)
    assert plan.calibration is None
    assert any(r.source and r.source.startswith("facts table") for r in plan.reasons)



@pytest.fixture
def zen5_record() -> CalibrationRecord:
    """edge-calibrate on the Zen 5 host (AVX-512, AVX512-BF16, no AMX), default model, 1 thread, 2026-11-30."""
    return CalibrationRecord.model_validate_json((DATA / "calibration_epyc_zen5.json").read_text())


def test_avx2_and_avx512_records_measure_different_thresholds_and_dtypes_and_the_plan_takes_each(
        avx2_record, zen5_record, avx2_host, zen5, smollm2):  # fmt: skip
    w4a16 = {"path": "w4a16-tinygemm", "layout": "direct"}
    avx2 = make_plan(avx2_host, smollm2, calibration=avx2_record, **w4a16).quantization_config
    avx512 = make_plan(zen5, smollm2, calibration=zen5_record, **w4a16).quantization_config
    assert (avx2["prefill_dtype"], avx512["prefill_dtype"]) == ("float32", "bfloat16")
    assert avx2["dequant_threshold"] != avx512["dequant_threshold"]
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    assert avx2["dequant_threshold"] == measured_threshold(avx2_record, shapes, "dequant-fp32")
    assert avx512["dequant_threshold"] == measured_threshold(zen5_record, shapes, "dequant-bf16")


def test_the_zen5_record_has_vllms_w4a8_kernel_running_faster_than_tinygemm_at_decode(zen5_record):
    w4a8, tinygemm = zen5_record.timed("vllm-w4a8"), zen5_record.timed("tinygemm")
    assert w4a8 is not None and tinygemm is not None
    assert w4a8.at(4096, 4096)[1] < tinygemm.at(4096, 4096)[1]


def test_the_avx2_record_has_no_w4a8_kernel_and_no_plan_ranks_it(avx2_record, avx2_host, smollm2):
    assert avx2_record.kernel("vllm-w4a8").status == "absent"
    plan = make_plan(avx2_host, smollm2, calibration=avx2_record)
    assert plan.path != "w4a8-gptq"


def test_a_records_thread_scaling_keeps_one_thread_unless_all_cores_pay_for_the_front_ends_core(zen5_record):
    from edge.device.calibration import ThreadTime
    from edge.measure.cost import thread_choice

    assert thread_choice(zen5_record, "tinygemm", 2).threads == 1  # 2 threads were slower on the shared box
    fast = zen5_record.model_copy(update={"thread_scaling": [ThreadTime(threads=1, kernel="tinygemm", ms=4.0),
                                                             ThreadTime(threads=4, kernel="tinygemm", ms=1.5)]})
    assert thread_choice(fast, "tinygemm", 4).threads == 4  # 2.67x beats the 4/3 a front-end core costs
    assert thread_choice(fast, "tinygemm", 2) is not None
    slow = fast.model_copy(update={"thread_scaling": [ThreadTime(threads=1, kernel="tinygemm", ms=4.0),
                                                      ThreadTime(threads=2, kernel="tinygemm", ms=2.5)]})
    assert thread_choice(slow, "tinygemm", 2).threads == 1  # 1.6x < 2x on a 2-core box
