"""Read a device someone wrote down, and tell the four device formats apart.

A hand-written description or an inventory's record (every key optional):

    {"name": "gw-17", "arch": "x86_64", "isa": ["avx2", "fma"], "cores": 4, "memory": "8GiB",
     "os": "linux", "device_class": "cpu", "torch_version": "2.13.0+cpu", "tinygemm_block": 32}

`memory` takes a size ("8GiB", "512MiB", "8G": see edge.sizes) and `memory_bytes` an integer; give one.
`cores` is the physical cores the engine may use. `sve_vector_bits` (128, 256, 512) is an ARM core's SVE length
where its name does not say it (edge.device.profile.ARM_SVE_BITS). ISA names are /proc/cpuinfo's spelling
(edge.device.profile ISA_FEATURES); NFD's spelling (AVX512BF16, FMA3) is accepted too. A full DeviceProfile JSON
(what `/probe` and `edge-select --json` print, recognised by its `described_by` key) is taken as it is.

Inventories carry more than the planner reads, under their own names. Read as well:
`flags`/`cpu_flags` (every CPU flag, a list or a space-separated string: the ISA features among them are kept),
`memory_total_bytes` (= `memory_bytes`), `mem_total` (= `memory`), `hostname` (= `name`), `architecture`
(= `arch`), `model_name` (= `cpu_model`), `soc` (the CPU model when none is given; a phone SoC makes the device a
phone), `npu` (noted: vLLM has no NPU backend). Any other key is ignored and named in the device's `notes`, which
a plan repeats as a warning; a wrong value of a key that is read stays an error naming it.

`load_device(text)` accepts any of: that JSON, NFD node labels as JSON (edge.device.nfd), `lscpu -J` output
(edge.device.lscpu), or /proc/cpuinfo text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from edge.bounds import check_finite_numbers
from edge.device.cpuinfo import PHONE_SOC_WORDS, parse_cpuinfo
from edge.device.lscpu import looks_like_lscpu, parse_lscpu
from edge.device.nfd import NFD_ISA, looks_like_nfd, parse_nfd_labels
from edge.device.profile import ISA_FEATURES, DeviceProfile, Fact
from edge.errors import InputError
from edge.sizes import parse_size

__all__ = ["load_device", "parse_device_json", "parse_size"]

ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "x64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
DEVICE_CLASSES = ("cpu", "phone")
DESCRIPTION_KEYS = (
    "name", "arch", "isa", "cores", "logical_cpus", "memory", "memory_bytes", "memory_available", "os",
    "device_class", "vendor", "cpu_model", "numa_nodes", "torch_version", "torch_cpu_capability",
    "vllm_version", "vllm_native_library", "tinygemm_block", "sve_vector_bits",
)  # fmt: skip
# An inventory's name for a key -> the description's own key (or the lenient `flags`).
ALIASES = {
    "cpu_flags": "flags", "memory_total_bytes": "memory_bytes", "mem_total": "memory", "hostname": "name",
    "architecture": "arch", "model_name": "cpu_model",
}  # fmt: skip
READ_KEYS = (*DESCRIPTION_KEYS, "flags", "soc", "npu")
# Keys that say the same thing in two ways: giving both is an error naming them.
SAME_FACT = (("isa", "flags"), ("memory", "memory_bytes"))
MAX_NAMED_KEYS = 12  # an inventory may carry dozens: the note names this many
ACCEPTED_FORMATS = (
    "a device description: a JSON object (a device description, a DeviceProfile, node-feature-discovery "
    "labels, or `lscpu -J` output) or the text of /proc/cpuinfo"
)


def _described(value: Any, key: str) -> Fact:
    return Fact(value=value, source="description", detail=f"`{key}` in the description")


def _string(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise InputError(key, value, "a non-empty string")
    return value


def _count(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise InputError(key, value, "a positive integer")
    return value


def _isa(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise InputError("isa", value, "a list of ISA feature names")
    by_lower = {f: f for f in ISA_FEATURES} | {k.lower(): v for k, v in NFD_ISA.items()}
    present = set()
    for item in value:
        feature = by_lower.get(item.strip().lower()) if isinstance(item, str) else None
        if feature is None:
            raise InputError("isa", item, f"one of {', '.join(ISA_FEATURES)}")
        present.add(feature)
    return [f for f in ISA_FEATURES if f in present]


def _flags(value: Any) -> list[str]:
    """The ISA features among an inventory's CPU flags (all of them, in any case or NFD spelling)."""
    if isinstance(value, str):
        value = value.split()
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise InputError("flags", value, "the CPU's flags: a list of strings or a space-separated string")
    by_lower = {f: f for f in ISA_FEATURES} | {k.lower(): v for k, v in NFD_ISA.items()}
    present = {by_lower[item.lower()] for item in value if item.lower() in by_lower}
    return [f for f in ISA_FEATURES if f in present]


def _read_keys(obj: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """(the read keys under their own names, own name -> the name the description used, notes)."""
    read: dict[str, Any] = {}
    written: dict[str, str] = {}
    ignored: list[str] = []
    for key, value in obj.items():
        own = ALIASES.get(key, key)
        if own not in READ_KEYS:
            ignored.append(str(key))
            continue
        if own in written:
            raise InputError(key, value, f"either `{written[own]}` or `{key}`, not both")
        read[own], written[own] = value, key
    for first, second in SAME_FACT:
        if first in read and second in read:
            both = f"either `{written[first]}` or `{written[second]}`, not both"
            raise InputError(written[first], read[first], both)
    notes = []
    if ignored:
        named = ", ".join(ignored[:MAX_NAMED_KEYS]) + (f" and {len(ignored) - MAX_NAMED_KEYS} more"
                                                       if len(ignored) > MAX_NAMED_KEYS else "")  # fmt: skip
        notes.append(f"device description: {len(ignored)} key{'s' if len(ignored) > 1 else ''} the planner does "
                     f"not read, ignored: {named}")  # fmt: skip
    npu = read.get("npu")
    if npu not in (None, False, "", "none"):
        notes.append(f"device description: npu {npu!r} noted but not used (vLLM has no NPU backend; the plan is "
                     "for the CPU, or an export for a phone)")  # fmt: skip
    return read, written, notes


def _memory(obj: dict[str, Any]) -> int | None:
    if "memory_bytes" in obj:
        if isinstance(obj["memory_bytes"], bool) or not isinstance(obj["memory_bytes"], int):
            raise InputError("memory_bytes", obj["memory_bytes"], "a non-negative integer of bytes")
        return parse_size(obj["memory_bytes"], "memory_bytes")
    return parse_size(obj["memory"], "memory") if "memory" in obj else None


def _tinygemm_block(value: Any) -> int | None:
    # 32 on AVX2, 64 on AVX-512 (docs/FACTS.md); any power of two a future vector width could give is accepted.
    if value is not None and (isinstance(value, bool) or value not in (16, 32, 64, 128, 256)):
        raise InputError("tinygemm_block", value, "a power of two from 16 to 256 (32 on AVX2, 64 on AVX-512)")
    return value


def _sve_vector_bits(value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or value not in (128, 256, 512, 1024, 2048)):
        raise InputError("sve_vector_bits", value, "an SVE vector length in bits: 128, 256, 512, 1024 or 2048")
    return value


def _full_profile(obj: dict[str, Any]) -> DeviceProfile:
    try:
        profile = DeviceProfile.model_validate(obj)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "device"
        raise InputError(field, first.get("input"), first["msg"].lower()) from None
    for feature in profile.isa.value or []:
        if feature not in ISA_FEATURES:
            raise InputError("isa.value", feature, f"one of {', '.join(ISA_FEATURES)}")
    return profile


def parse_device_json(obj: dict[str, Any]) -> DeviceProfile:
    """A DeviceProfile from a hand-written description or a full DeviceProfile JSON; described_by="json"."""
    if not isinstance(obj, dict):
        raise InputError("device", obj, "a JSON object")
    if "described_by" in obj:
        return _full_profile(obj)
    read, written, notes = _read_keys(obj)
    try:
        return _described_profile(read, written, notes)
    except InputError as error:  # name the key as the description wrote it (`mem_total`, not `memory`)
        if error.field in written and written[error.field] != error.field:
            raise InputError(written[error.field], error.value, error.expected) from None
        raise


def _described_profile(obj: dict[str, Any], written: dict[str, str], notes: list[str]) -> DeviceProfile:
    arch = obj.get("arch")
    if arch is not None and (not isinstance(arch, str) or arch.lower() not in ARCHES):
        raise InputError("arch", arch, "x86_64 or aarch64 (amd64 and arm64 are accepted)")
    os_name = _string(obj, "os")
    soc = _string(obj, "soc")
    device_class = obj.get("device_class")
    if device_class is not None and device_class not in DEVICE_CLASSES:
        raise InputError("device_class", device_class, "cpu or phone")
    class_key = "device_class"
    if device_class is None and soc is not None and any(word in soc.lower() for word in PHONE_SOC_WORDS):
        device_class, class_key = "phone", "soc"
    if device_class is None and os_name is not None:
        device_class, class_key = ("phone" if os_name.lower() == "android" else "cpu"), "os"
    memory = _memory(obj)
    available = parse_size(obj["memory_available"], "memory_available") if "memory_available" in obj else None
    isa = _isa(obj["isa"]) if "isa" in obj else _flags(obj["flags"]) if "flags" in obj else None
    cores, logical, numa = _count(obj, "cores"), _count(obj, "logical_cpus"), _count(obj, "numa_nodes")
    block = _tinygemm_block(obj.get("tinygemm_block"))
    sve = _sve_vector_bits(obj.get("sve_vector_bits"))
    strings = {
        key: _string(obj, key)
        for key in (
            "name",
            "vendor",
            "cpu_model",
            "torch_version",
            "torch_cpu_capability",
            "vllm_version",
            "vllm_native_library",
        )
    }

    def fact(value: Any, key: str) -> Fact:
        key = written.get(key, key)
        return _described(value, key) if value is not None else Fact(detail=f"no `{key}` in the description")

    runtime = {
        "torch_version": fact(strings["torch_version"], "torch_version"),
        "torch_cpu_capability": fact(strings["torch_cpu_capability"], "torch_cpu_capability"),
        "vllm_version": fact(strings["vllm_version"], "vllm_version"),
        "vllm_native_library": fact(strings["vllm_native_library"], "vllm_native_library"),
        "tinygemm_block": fact(block, "tinygemm_block"),
    }
    return DeviceProfile(
        described_by="json",
        name=strings["name"],
        os=fact(os_name.lower() if os_name else None, "os"),
        device_class=fact(device_class, class_key),
        arch=fact(ARCHES[arch.lower()] if arch else None, "arch"),
        vendor=fact(strings["vendor"], "vendor"),
        cpu_model=fact(strings["cpu_model"], "cpu_model") if strings["cpu_model"] or not soc else fact(soc, "soc"),
        isa=fact(isa, "flags" if "flags" in obj else "isa"),
        sve_vector_bits=fact(sve, "sve_vector_bits"),
        logical_cpus=fact(logical, "logical_cpus"),
        physical_cores=fact(cores, "cores"),
        numa_nodes=fact(numa, "numa_nodes"),
        memory_total_bytes=fact(memory, "memory" if "memory" in obj else "memory_bytes"),
        memory_available_bytes=fact(available, "memory_available"),
        runtime=runtime,
        notes=notes,
    )


def _looks_like_cpuinfo(text: str) -> bool:
    keys = {line.split(":", 1)[0].strip() for line in text.splitlines() if ":" in line}
    return "processor" in keys and bool(keys & {"flags", "Features", "vendor_id", "CPU implementer"})


def load_device(data: str | bytes) -> DeviceProfile:
    """Any accepted device format, told apart by content: JSON (lscpu, NFD labels, description) or cpuinfo."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError("device", data[:60], ACCEPTED_FORMATS) from None
    if not isinstance(data, str) or "\x00" in data:
        raise InputError("device", data, ACCEPTED_FORMATS)
    text = data.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as error:
            raise InputError("device", text, f"valid JSON ({error.msg} at line {error.lineno})") from None
        check_finite_numbers(obj, "device")  # Python's json reads NaN, Infinity and 1e400 (inf)
        if looks_like_lscpu(obj):
            return parse_lscpu(obj)
        return parse_nfd_labels(obj) if looks_like_nfd(obj) else parse_device_json(obj)
    if _looks_like_cpuinfo(text):
        return parse_cpuinfo(text)
    raise InputError("device", text, ACCEPTED_FORMATS)


def load_device_file(path: str, field: str = "--device") -> DeviceProfile:
    """A device description read from a file (`edge-select --device`, `edge-serve --device`)."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise InputError(field, path, f"a readable file ({error.strerror})") from None
    return load_device(data)
