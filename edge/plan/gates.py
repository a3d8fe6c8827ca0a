"""Gates: can a weight path run on this device for this model at all? Each refusal carries its reason.

Pure functions of the DeviceProfile and ModelShape (and, for kernels it timed, the device's calibration record);
no ranking here (edge.measure.rank) and no memory (edge.measure.ledger).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from edge.catalog import shape_rules as rules
from edge.catalog.kernel_registry import kernels_for
from edge.catalog.weight_paths import PATHS, the_path
from edge.device.calibration import CalibrationRecord, KernelResult
from edge.device.profile import DeviceProfile
from edge.model.shapes import ModelShape
from edge.plan.schema import WeightPath


@dataclass
class Gate:
    """The verdict for one weight path: runnable or not, and why; the group size it would use."""

    path: WeightPath
    refusals: list[str] = field(default_factory=list)
    group_size: int | None = None
    notes: list[str] = field(default_factory=list)  # runnable, but worth saying (unverified, extrapolated)

    @property
    def runnable(self) -> bool:
        return not self.refusals


def _gated(gate_fn: Callable[..., Gate]) -> WeightPath:
    """The path whose spec names this gate (edge.catalog.weight_paths)."""
    return the_path(gate=gate_fn.__name__)


def gate_export_only(device: DeviceProfile, model: ModelShape | None = None,
                     calibration: CalibrationRecord | None = None) -> Gate:
    gate = Gate(_gated(gate_export_only))
    if device.is_phone:
        return gate
    if (why := _vllm_refusal(device)) is not None:
        # an ARM board vLLM's build cannot run on (a Pi 4): the exported graph runs on ONNX Runtime, whose aarch64
        # build needs no more than ARMv8.0
        gate.notes.append(f"{why}: the exported bundle runs on ONNX Runtime instead (not run on ARM here: unverified)")
        return gate
    gate.refusals.append(f"{gate.path} is for phones and NPU devices; this device runs vLLM's CPU backend")
    return gate


# vLLM's aarch64 native library is compiled with -march=armv8.2-a+bf16+dotprod+fp16 (vLLM's cmake/cpu_extension.cmake,
# the branch a build machine with BF16 takes; the PyPI wheel holds BF16 instructions, docs/FACTS.md). A core without
# the dot product or FP16 arithmetic (the Cortex-A72 of a Pi 4, the A53 of a Pi 3) may meet an illegal instruction
# anywhere in it; one without BF16 is served in float16 (edge.measure.kernel_params.float_dtype).
ARM_VLLM_FEATURES = ("asimddp", "asimdhp")


def _vllm_refusal(device: DeviceProfile) -> str | None:
    """Why vLLM's CPU backend cannot run on the device at all, or None."""
    if device.is_phone:
        return "vLLM has no phone/NPU backend: the deliverable on a phone is an exported graph (docs/FACTS.md)"
    if device.is_arm and device.isa.known:
        missing = [feature for feature in ARM_VLLM_FEATURES if not device.has(feature)]
        if missing:
            return (f"vLLM's aarch64 build is compiled for armv8.2-a with the dot product and FP16 arithmetic (vLLM's "
                    f"cmake/cpu_extension.cmake); this core lacks {' and '.join(missing)}, so its native library "
                    "would stop on an illegal instruction")  # fmt: skip
    return None


# What an ARM plan rests on, said in every one (issue 43): the emulated checks and what no hardware has confirmed.
ARM_UNVERIFIED = (
    "ARM: torch's tinygemm block, rounding and the 4-bit kernels are verified under qemu-user emulation of a "
    "Cortex-A76 and a 256-bit SVE core (scripts/test-arm); vLLM's engine, its speed and this plan's memory have "
    "never run on ARM hardware here (unverified)"
)


def gate_bf16(device: DeviceProfile, model: ModelShape | None = None,
              calibration: CalibrationRecord | None = None) -> Gate:
    gate = Gate(_gated(gate_bf16))
    if refusal := _vllm_refusal(device):
        gate.refusals.append(refusal)
    if device.is_arm:
        gate.notes.append(ARM_UNVERIFIED)
    return gate


def gate_w4a16(device: DeviceProfile, model: ModelShape, calibration: CalibrationRecord | None = None) -> Gate:
    gate = Gate(_gated(gate_w4a16))
    if refusal := _vllm_refusal(device):
        gate.refusals.append(refusal)
    group = rules.pick_group_size(model)
    if group is None:
        ks = sorted({lin.k for lin in model.linears})
        gate.refusals.append(f"no group size of {rules.GROUP_SIZES} divides every K ({ks})")
    gate.group_size = group
    if device.is_arm:
        gate.notes.append(ARM_UNVERIFIED)
        if device.has("sve") and not device.sve_bits.known:
            gate.notes.append(
                f"{device.sve_bits.detail}: the plan takes torch's NEON dispatch (tinygemm block 16); a 256-bit SVE "
                "core (Neoverse V1, Graviton3) packs 32 and the engine refuses this checkpoint there: give the "
                "description `sve_vector_bits`, or plan on the box")  # fmt: skip
    return gate


# vLLM's W4A8 kernel (docs/FACTS.md): int4_scaled_mm_cpu lives in `_C`, the library vLLM loads where AVX-512 comes
# with AVX512-BF16, and is built for AVX512-BF16 + AVX512-VNNI; `_C_AVX512` and `_C_AVX2` have no such op.
W4A8_OP = "int4_scaled_mm_cpu"
# its edge.catalog.kernel_registry entry, as records name it
W4A8_KERNEL = kernels_for(the_path(gate="gate_w4a8"), None, "all", "avx512")[0]
# ... and on ARM, where the same checkpoint runs on KleidiAI (kernels/ops/kleidiai.py) at group 32 alone
ARM_W4A8_KERNEL = kernels_for(the_path(gate="gate_w4a8"), None, "all", "arm")[0]
ARM_W4A8_GROUP = rules.KLEIDIAI_GROUP
DERIVED_NOTE = "derived from ISA flags; no calibration record confirms the op runs"


def gate_w4a8(device: DeviceProfile, model: ModelShape, calibration: CalibrationRecord | None = None) -> Gate:
    """W4A8 = vLLM's int4_scaled_mm_cpu with int8 activations: runnable where the native library vLLM loads
    registers the op. `calibration` (this device's record, edge.device.calibration.best_match) settles it when it timed
    the op (ok) or found it missing or crashing; without one the ISA flags and the known library decide, and the
    gate says so. Every host runs it through the plugin's cpu_w4a8 (AMX ones too: edge.catalog.weight_paths)."""
    gate = Gate(_gated(gate_w4a8))
    if refusal := _vllm_refusal(device):
        gate.refusals.append(refusal)
    if device.is_arm:
        return _gate_w4a8_arm(gate, model, calibration)
    result = _calibrated(gate, calibration, W4A8_KERNEL, W4A8_OP)
    if result is None:
        gate.refusals += _w4a8_isa_refusals(device)
    capability = device.runtime.torch_cpu_capability.value
    if capability is not None and capability != "AVX512" and not device.has_amx:
        # ATEN_CPU_CAPABILITY/ONEDNN_MAX_CPU_ISA held to AVX2 on an AVX-512 CPU: the op's oneDNN int8 brgemm then
        # fails from 16 rows ("I8 Brgemm is only supported ... amx", edge-calibrate on the Zen 5 host, 2026-11-30)
        gate.refusals.append(f"torch runs its {capability} kernels here (ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA "
                             f"set), under which {W4A8_OP} fails from 16 rows")  # fmt: skip
    group = rules.pick_gptq_group_size(model)
    if group is None:
        bad = [f"{lin.name} {lin.n}x{lin.k}" for lin in model.linears if not rules.gptq_compatible(lin, 32)]
        gate.refusals.append(f"vLLM's CPU GPTQ needs N and K multiples of 32 and a group dividing K: {bad}")
    gate.group_size = group
    if gate.runnable and result is None:
        gate.notes.append(DERIVED_NOTE)
    if gate.runnable and device.has_amx:
        gate.notes.append(
            f"the reference study measured W4A8 on AMX through vLLM's own GPTQ method; the plugin's cpu_w4a8 "
            f"calls the same {W4A8_OP} with an 8-bit head and embedding, but has never run on AMX here "
            "(unverified end to end)"
        )
    return gate


def _calibrated(gate: Gate, calibration: CalibrationRecord | None, kernel: str, op: str) -> KernelResult | None:
    """The record's result for `kernel`, when it timed it; a refusal on `gate` when it found it absent or failing."""
    result = calibration.kernel(kernel) if calibration is not None else None
    if result is not None and result.status != "ok":
        why = f": {result.reason}" if result.reason else ""
        gate.refusals.append(f"the calibration record found {op} {result.status} on this CPU{why} "
                             f"({calibration.describe()})")  # fmt: skip
    return result


def _gate_w4a8_arm(gate: Gate, model: ModelShape, calibration: CalibrationRecord | None) -> Gate:
    """W4A8 on ARM: KleidiAI through torch (every aarch64 torch from 2.6 has it), symmetric int4 per group of 32."""
    result = _calibrated(gate, calibration, ARM_W4A8_KERNEL, ARM_W4A8_KERNEL)
    bad = [f"{lin.name} {lin.n}x{lin.k}" for lin in model.linears if not rules.gptq_compatible(lin, ARM_W4A8_GROUP)]
    if bad:
        gate.refusals.append(f"KleidiAI's int4 kernels take group {ARM_W4A8_GROUP}, and vLLM's GPTQ layers N and K "
                             f"multiples of 32: {bad}")  # fmt: skip
    gate.group_size = ARM_W4A8_GROUP
    if gate.runnable:
        gate.notes.append(ARM_UNVERIFIED)
        if result is None:
            gate.notes.append(f"{ARM_W4A8_KERNEL}: torch's KleidiAI ops, checked against float32 under emulation "
                              "(tests/kernels/test_arm_int4.py); no calibration record has timed them on this CPU")
    return gate


def _w4a8_isa_refusals(device: DeviceProfile) -> list[str]:
    """Why the device's vLLM library has no int4_scaled_mm_cpu, judged from its flags and its known library."""
    native = device.runtime.vllm_native_library.value
    if native is not None and native != "_C":
        return [f"vLLM loads {native} on this CPU; only _C has {W4A8_OP} (W4A8 needs AVX-512 with AVX512-BF16 "
                "and AVX512-VNNI, or AMX)"]  # fmt: skip
    if device.has_amx:
        return []
    if not device.has("avx512f"):
        return [f"vLLM's AVX2 build (_C_AVX2) has no 4-bit GEMM at all, so no {W4A8_OP}; W4A8 needs AVX-512 with "
                "AVX512-BF16 and AVX512-VNNI, or AMX tiles"]  # fmt: skip
    if not device.has("avx512_bf16"):
        return [f"AVX-512 without AVX512-BF16: vLLM loads _C_AVX512, which has no {W4A8_OP} (W4A8 needs "
                "AVX512-BF16 and AVX512-VNNI, or AMX tiles)"]  # fmt: skip
    if not device.has("avx512_vnni"):
        return [f"{W4A8_OP} is built for AVX512-VNNI, which this CPU lacks (and it has no AMX tiles)"]
    return []


def all_gates(
    device: DeviceProfile, model: ModelShape, calibration: CalibrationRecord | None = None
) -> dict[WeightPath, Gate]:
    """Every path's gate, as its spec names it (edge.catalog.weight_paths), in the spec's order."""
    return {name: GATES[spec.gate](device, model, calibration) for name, spec in PATHS.items()}  # type: ignore[misc]


GATES: dict[str, Callable[..., Gate]] = {fn.__name__: fn for fn in (gate_w4a8, gate_w4a16, gate_bf16, gate_export_only)}
