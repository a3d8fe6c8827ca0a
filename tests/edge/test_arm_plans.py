"""Plans for ARM devices (issue 43): the tinygemm block follows torch's dispatch on the core, the float dtype is one the
core runs, the layout is the one the measured classes support, x86 quality records stay on x86, and every plan says
what no ARM hardware has confirmed.

The fixtures: a Raspberry Pi 4 and a Graviton3 /proc/cpuinfo as read from the boxes; a Raspberry Pi 5 (Cortex-A76)
and a Neoverse-N1 cpuinfo written from the cores' documented features (cpuinfo_rpi5.txt, cpuinfo_neoverse_n1.txt);
an RK3588 and a Graviton3 `lscpu -J`; a Graviton3 as node-feature-discovery labels. What the emulated kernels
accept is tested under qemu by scripts/test-arm (tests/kernels/test_layout.py, test_tinygemm.py, test_arm_int4.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge.device.describe import load_device, load_device_file
from edge.errors import InputError
from edge.measure import kernel_params
from edge.measure.quality import shipped_records
from edge.model.reader import default_model
from edge.plan.gates import ARM_UNVERIFIED
from edge.plan.planner import PlanRefused, make_plan

DATA = Path(__file__).parent / "data"

# fixture -> (tinygemm block, vLLM dtype): 16 where torch dispatches NEON (DEFAULT), 32 under SVE256; float16 on a
# core without BF16, bfloat16 with it
ARM_DEVICES = {
    "cpuinfo_rpi5.txt": (16, "float16"),
    "lscpu_rk3588_util_linux_2_38.json": (16, "float16"),
    "cpuinfo_neoverse_n1.txt": (16, "float16"),
    "cpuinfo_graviton3.txt": (32, "bfloat16"),
    "lscpu_graviton3_util_linux_2_38_tty.json": (32, "bfloat16"),
}


def _plan(device, priority="speed", **options):
    return make_plan(device, default_model(), priority=priority, quality=shipped_records(), **options)


def _dtype(plan) -> str:
    args = plan.vllm.args
    return args[args.index("--dtype") + 1]


@pytest.mark.parametrize("fixture", sorted(ARM_DEVICES))
def test_an_arm_plan_takes_the_block_and_dtype_its_cores_run(fixture):
    block, dtype = ARM_DEVICES[fixture]
    device = load_device_file(str(DATA / fixture))
    plan = _plan(device)
    assert plan.path == "w4a16-tinygemm"
    assert plan.quantization_config["tinygemm_block"] == block
    assert _dtype(plan) == dtype
    assert kernel_params.float_dtype(device) == dtype
    # nothing measured the layouts here: direct, the layout every measured class supports, not the leanest
    assert plan.layout == "direct"
    assert any("layouts decode alike" in r.text for r in plan.reasons)
    assert ARM_UNVERIFIED in plan.warnings
    fidelity = _plan(device, "fidelity")
    assert _dtype(fidelity) == dtype
    assert ARM_UNVERIFIED in fidelity.warnings


@pytest.mark.parametrize("fixture", sorted(ARM_DEVICES))
def test_x86_quality_records_do_not_speak_for_an_arm_plan(fixture):
    """The shipped records were measured on x86; the same plan on an x86 box quotes one."""
    plan = _plan(load_device_file(str(DATA / fixture)))
    assert plan.quality.status != "measured"
    x86 = _plan(load_device_file(str(DATA / "cpuinfo_epyc_zen4_avx512.txt")), path="w4a16-tinygemm")
    assert x86.quality.status == "measured"
    assert all((r.arch or "x86_64") == "x86_64" for r in shipped_records())


def test_sve_length_comes_from_the_core_a_description_or_stays_unknown():
    graviton3 = load_device_file(str(DATA / "cpuinfo_graviton3.txt"))
    assert graviton3.sve_bits.value == 256 and graviton3.sve_bits.source == "derived"
    assert kernel_params.device_capability(graviton3) == "SVE256"
    n1 = load_device_file(str(DATA / "cpuinfo_neoverse_n1.txt"))
    assert n1.sve_bits.value is None and kernel_params.device_capability(n1) == "DEFAULT"
    # NFD labels name SVE but no core: the plan takes NEON's block and says why it may be wrong
    nfd = load_device_file(str(DATA / "nfd_graviton3.json"))
    assert nfd.sve_bits.value is None
    plan = _plan(nfd)
    assert plan.quantization_config["tinygemm_block"] == 16
    assert any("SVE of unknown length" in w and "sve_vector_bits" in w for w in plan.warnings)
    described = load_device(json.dumps({"arch": "aarch64", "isa": ["asimd", "asimddp", "asimdhp", "sve", "bf16"],
                                        "sve_vector_bits": 256, "cores": 4, "memory": "16GiB"}))  # fmt: skip
    assert _plan(described).quantization_config["tinygemm_block"] == 32
    assert not any("SVE of unknown length" in w for w in _plan(described).warnings)
    graviton4 = load_device(json.dumps({"arch": "aarch64", "cpu_model": "Neoverse-V2", "cores": 4,
                                        "isa": ["asimd", "asimddp", "asimdhp", "sve", "sve2", "bf16"]}))  # fmt: skip
    assert graviton4.sve_bits.value == 128
    assert _plan(graviton4).quantization_config["tinygemm_block"] == 16


def test_a_bad_sve_length_is_refused_naming_the_field():
    with pytest.raises(InputError) as refused:
        load_device(json.dumps({"arch": "aarch64", "sve_vector_bits": 200}))
    assert refused.value.field == "sve_vector_bits"


def test_a_core_vllm_was_not_built_for_gets_the_exported_bundle_or_a_clear_refusal():
    """vLLM's aarch64 build needs the dot product and FP16 arithmetic, which a Pi 4's Cortex-A72 lacks."""
    pi4 = load_device_file(str(DATA / "cpuinfo_rpi4.txt"))
    plan = _plan(pi4)
    assert plan.path == "export-only"
    assert any("asimddp and asimdhp" in w and "ONNX Runtime" in w for w in plan.warnings)
    refusals = {alt.path: alt.why_not for alt in plan.alternatives}
    assert "illegal instruction" in refusals["bf16"]
    with pytest.raises(PlanRefused) as refused:
        _plan(pi4, path="bf16")
    assert "asimddp" in str(refusals["bf16"]) and refused.value.field == "path"


def test_x86_plans_keep_bf16_and_their_own_block():
    for fixture, block in (("cpuinfo_epyc_zen4_avx512.txt", 64), ("cpuinfo_host_epyc_avx2.txt", 32)):
        device = load_device_file(str(DATA / fixture))
        plan = _plan(device, path="w4a16-tinygemm")
        assert _dtype(plan) == "bfloat16"
        assert plan.quantization_config["tinygemm_block"] == block
        assert ARM_UNVERIFIED not in plan.warnings


@pytest.mark.parametrize("fixture", sorted(ARM_DEVICES))
def test_w4a8_runs_on_arms_own_kernel_at_group_32(fixture):
    """vLLM's aarch64 build has no int4_scaled_mm_cpu; the plugin's cpu_w4a8 runs KleidiAI there (group 32). For
    speed it stays behind W4A16 on this model: its x86 record is far over the floor, and the weights are the same."""
    device = load_device_file(str(DATA / fixture))
    pinned = _plan(device, path="w4a8-gptq")
    assert pinned.quantization_config["quant_method"] == "cpu_w4a8"
    assert pinned.quantization_config["group_size"] == 32
    assert _dtype(pinned) == ARM_DEVICES[fixture][1]
    assert any("kleidiai-w4a8" in w for w in pinned.warnings) and ARM_UNVERIFIED in pinned.warnings
    assert pinned.quality.status != "measured"
    chosen = _plan(device)
    w4a8 = next(alt for alt in chosen.alternatives if alt.path == "w4a8-gptq")
    assert w4a8.status == "runnable" and "over --max-kld" in w4a8.why_not
