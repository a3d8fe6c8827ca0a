"""Gates: can a weight path run on this device for this model at all? Each refusal carries its reason.

Pure functions of the DeviceProfile and ModelShape; no ranking here (edge.rank) and no memory (edge.ledger).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge import rules
from edge.device import DeviceProfile
from edge.plan import WeightPath
from edge.shapes import ModelShape


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


def gate_export_only(device: DeviceProfile) -> Gate:
    gate = Gate("export-only")
    if not device.is_phone:
        gate.refusals.append("export-only is for phones and NPU devices; this device runs vLLM's CPU backend")
    return gate


def _phone_refusal(device: DeviceProfile) -> str | None:
    if device.is_phone:
        return "vLLM has no phone/NPU backend: the deliverable on a phone is an exported graph (docs/FACTS.md)"
    return None


def gate_bf16(device: DeviceProfile) -> Gate:
    gate = Gate("bf16")
    if refusal := _phone_refusal(device):
        gate.refusals.append(refusal)
    return gate


def gate_w4a16(device: DeviceProfile, model: ModelShape) -> Gate:
    gate = Gate("w4a16-tinygemm")
    if refusal := _phone_refusal(device):
        gate.refusals.append(refusal)
    group = rules.pick_group_size(model)
    if group is None:
        ks = sorted({lin.k for lin in model.linears})
        gate.refusals.append(f"no group size of {rules.GROUP_SIZES} divides every K ({ks})")
    gate.group_size = group
    if device.arch.value == "aarch64" or device.isa_class == "arm":
        gate.notes.append("PyTorch's CPU tinygemm kernel on ARM has not been run by this project (unverified)")
    return gate


def gate_w4a8(device: DeviceProfile, model: ModelShape) -> Gate:
    """W4A8 = vLLM's int4_scaled_mm_cpu: AMX tiles, bf16 activations, vLLM's full `_C` library (docs/FACTS.md)."""
    gate = Gate("w4a8-gptq")
    if refusal := _phone_refusal(device):
        gate.refusals.append(refusal)
    if not device.has_amx:
        gate.refusals.append(
            "W4A8 runs only through vLLM's AMX kernel int4_scaled_mm_cpu; this CPU has no AMX tiles"
            + (" (and vLLM's AVX2 build has no 4-bit GEMM at all)" if device.isa_class == "avx2" else "")
        )
    native = device.runtime.vllm_native_library.value
    if native is not None and native != "_C":
        gate.refusals.append(f"vLLM loads {native} on this CPU; only _C has int4_scaled_mm_cpu")
    elif native is None and not (device.has("avx512f") and device.has("avx512_bf16")):
        gate.refusals.append("vLLM's _C library needs AVX-512 with AVX512-BF16; this CPU lacks them")
    group = rules.pick_gptq_group_size(model)
    if group is None:
        bad = [f"{lin.name} {lin.n}x{lin.k}" for lin in model.linears if not rules.gptq_compatible(lin, 32)]
        gate.refusals.append(f"vLLM's CPU GPTQ needs N and K multiples of 32 and a group dividing K: {bad}")
    gate.group_size = group
    if gate.runnable:
        gate.notes.append(
            "the reference study measured W4A8 on AMX; this project's GPTQ export has only been loaded "
            "through vLLM's weight loader on an AVX2 host, never run on AMX (unverified end to end)"
        )
    return gate


def all_gates(device: DeviceProfile, model: ModelShape) -> dict[WeightPath, Gate]:
    return {
        "w4a8-gptq": gate_w4a8(device, model),
        "w4a16-tinygemm": gate_w4a16(device, model),
        "bf16": gate_bf16(device),
        "export-only": gate_export_only(device),
    }
