"""Read a device from Kubernetes node-feature-discovery (NFD) labels.

Accepted shapes (all JSON objects):
- a bare label map: {"feature.node.kubernetes.io/cpu-cpuid.AVX2": "true", "kubernetes.io/arch": "amd64", ...}
- {"labels": {...}, "capacity": {"cpu": "8", "memory": "32Gi"}, "allocatable": {...}} (capacity optional)
- a Node object as `kubectl get node NAME -o json` prints it: {"metadata": {"labels": ...}, "status": {...}}

Label names are NFD's (docs/usage/features.md and source/cpu/ of kubernetes-sigs/node-feature-discovery):
x86 flags come from klauspost/cpuid (FMA3, AVX512BF16, AMXTILE, ...); arm64 flags from AT_HWCAP/AT_HWCAP2
(ASIMD, ASIMDDP, SVE, SVE2, I8MM, BF16, SME). NFD's default config does not label F16C (it is on the worker's
attribute blacklist), so a node's f16c is unknown, not absent, unless the label is there.
Keys outside feature.node.kubernetes.io/ and kubernetes.io/{arch,os,hostname} are ignored.
"""

from __future__ import annotations

from typing import Any

from edge.bounds import MAX_CPUS, MAX_LABEL_KEY_CHARS, MAX_LABEL_VALUE_CHARS, MAX_LABELS
from edge.device.profile import ISA_FEATURES, DeviceProfile, Fact
from edge.errors import InputError
from edge.sizes import parse_size

NFD_PREFIX = "feature.node.kubernetes.io/"
CPUID = "cpu-cpuid."

# NFD cpuid flag -> edge.device.profile ISA vocabulary.
NFD_ISA = {
    "AMXTILE": "amx_tile", "AMXBF16": "amx_bf16", "AMXINT8": "amx_int8",
    "AVX512F": "avx512f", "AVX512BW": "avx512bw", "AVX512VNNI": "avx512_vnni", "AVX512BF16": "avx512_bf16",
    "AVX512FP16": "avx512_fp16", "AVXVNNI": "avx_vnni", "AVX2": "avx2", "FMA3": "fma", "F16C": "f16c",
    "ASIMD": "asimd", "ASIMDDP": "asimddp", "ASIMDHP": "asimdhp", "FPHP": "fphp", "SVE": "sve", "SVE2": "sve2",
    "I8MM": "i8mm", "BF16": "bf16", "SME": "sme",
}  # fmt: skip
assert set(NFD_ISA.values()) == set(ISA_FEATURES)
# cpuid labels whose value is an attribute, not "true".
CPUID_ATTRIBUTES = {"AVX10_VERSION"}
# Labels NFD sets to "true" or "false".
BOOLEAN_LABELS = {"cpu-hardware_multithreading", "memory-numa"}
K8S_ARCH = {"amd64": "x86_64", "arm64": "aarch64"}


def _unwrap(obj: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], str | None]:
    """(labels, capacity, allocatable, node name) from any of the accepted shapes."""
    if isinstance(obj.get("metadata"), dict):
        metadata, status = obj["metadata"], _object(obj, "status", "status")
        return (
            _object(metadata, "labels", "metadata.labels"),
            _object(status, "capacity", "status.capacity"),
            _object(status, "allocatable", "status.allocatable"),
            _name(metadata, "metadata.name"),
        )
    if isinstance(obj.get("labels"), dict):
        capacity, allocatable = _object(obj, "capacity", "capacity"), _object(obj, "allocatable", "allocatable")
        return obj["labels"], capacity, allocatable, _name(obj, "name")
    return obj, {}, {}, None


def _object(obj: dict[str, Any], key: str, field: str) -> dict[str, Any]:
    value = obj.get(key) or {}
    if not isinstance(value, dict):
        raise InputError(field, value, "a JSON object")
    return value


def _name(obj: dict[str, Any], field: str) -> str | None:
    value = obj.get("name")
    if value is not None and not isinstance(value, str):
        raise InputError(field, value, "a string")
    return value


def _check_label_map(labels: dict[str, Any]) -> None:
    """Kubernetes' own limits on a label map (edge.bounds), so that no map costs more than a real node's."""
    if len(labels) > MAX_LABELS:
        raise InputError("labels", f"{len(labels)} labels", f"at most {MAX_LABELS} labels")
    for key, value in labels.items():
        if not isinstance(key, str) or len(key) > MAX_LABEL_KEY_CHARS:
            raise InputError("labels", key, f"label names of at most {MAX_LABEL_KEY_CHARS} characters")
        if not isinstance(value, str) or len(value) > MAX_LABEL_VALUE_CHARS:
            raise InputError(key, value, f"a label value string of at most {MAX_LABEL_VALUE_CHARS} characters")


def looks_like_nfd(obj: Any) -> bool:
    """True when a JSON object carries NFD labels in any accepted shape."""
    if not isinstance(obj, dict):
        return False
    try:
        labels = _unwrap(obj)[0]
    except InputError:  # e.g. a description with a `metadata` key of its own
        return False
    return isinstance(labels, dict) and any(isinstance(k, str) and k.startswith(NFD_PREFIX) for k in labels)


def _check_value(key: str, feature: str, value: Any) -> None:
    if not isinstance(value, str):
        raise InputError(key, value, "a label value string")
    if feature.startswith(CPUID) and feature[len(CPUID) :] not in CPUID_ATTRIBUTES and value != "true":
        raise InputError(key, value, 'NFD cpuid flag labels to be "true" (absent flags have no label)')
    if feature in BOOLEAN_LABELS and value not in ("true", "false"):
        raise InputError(key, value, '"true" or "false"')


def _cpus(capacity: dict[str, Any]) -> int | None:
    value = capacity.get("cpu")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int) or (isinstance(value, str) and len(value) > 16):
        raise InputError("capacity.cpu", value, 'a CPU count like "8" or "8000m"')
    try:
        cpus = value if isinstance(value, int) else int(value[:-1]) // 1000 if value.endswith("m") else int(value)
    except ValueError:
        raise InputError("capacity.cpu", value, 'a CPU count like "8" or "8000m"') from None
    if not 0 < cpus <= MAX_CPUS:
        raise InputError("capacity.cpu", value, f"a positive CPU count of at most {MAX_CPUS}")
    return cpus


def parse_nfd_labels(labels: dict[str, Any], name: str | None = None) -> DeviceProfile:
    """A DeviceProfile from NFD labels (any shape in the module docstring); described_by="nfd"."""
    if not isinstance(labels, dict):
        raise InputError("labels", labels, "a JSON object of node-feature-discovery labels")
    label_map, capacity, allocatable, node_name = _unwrap(labels)
    _check_label_map(label_map)
    features: dict[str, str] = {}
    for key, value in label_map.items():
        if isinstance(key, str) and key.startswith(NFD_PREFIX):
            feature = key[len(NFD_PREFIX) :]
            _check_value(key, feature, value)
            features[feature] = value
    if not features:
        raise InputError("labels", labels, f"node-feature-discovery labels ({NFD_PREFIX}...)")

    flags = {f[len(CPUID) :] for f in features if f.startswith(CPUID)}
    present = {NFD_ISA[flag] for flag in flags if flag in NFD_ISA}
    isa = [feature for feature in ISA_FEATURES if feature in present]
    arch_label = label_map.get("kubernetes.io/arch") or label_map.get("beta.kubernetes.io/arch")
    arch: Fact[str] = Fact(detail="no kubernetes.io/arch label")
    if arch_label:
        arch = Fact(
            value=K8S_ARCH.get(arch_label, arch_label),
            source="nfd",
            detail=f"kubernetes.io/arch {arch_label}",
        )
    os_label = label_map.get("kubernetes.io/os")
    cpus = _cpus(capacity)
    smt = features.get("cpu-hardware_multithreading")
    physical: Fact[int] = Fact(detail="no capacity.cpu")
    if cpus and smt == "false":
        physical = Fact(value=cpus, source="nfd", detail="capacity.cpu, cpu-hardware_multithreading=false")
    elif cpus and smt == "true":
        # x86 SMT is 2-way on every Intel and AMD part this planner meets.
        physical = Fact(
            value=max(1, cpus // 2),
            source="derived",
            detail="capacity.cpu / 2: cpu-hardware_multithreading=true (2-way SMT)",
        )
    numa = features.get("memory-numa")
    numa_nodes: Fact[int] = Fact()
    if numa == "false":
        numa_nodes = Fact(value=1, source="nfd", detail="memory-numa=false")
    elif numa == "true":
        numa_nodes = Fact(detail="memory-numa=true: more than one node, count not labelled")
    vendor = features.get("cpu-model.vendor_id")
    total = available = Fact()
    if capacity.get("memory") is not None:
        total = Fact(
            value=parse_size(capacity["memory"], "capacity.memory"), source="nfd", detail="capacity.memory"
        )
    if allocatable.get("memory") is not None:
        available = Fact(
            value=parse_size(allocatable["memory"], "allocatable.memory"),
            source="nfd",
            detail="allocatable.memory (what pods may request)",
        )
    isa_detail = f"{len(flags)} cpu-cpuid labels"
    if arch.value == "x86_64" and "F16C" not in flags:
        isa_detail += "; NFD's default config does not label F16C, so f16c is unknown"
    hypervisor: Fact[bool] = Fact()
    if arch.value == "x86_64" and flags:
        hypervisor = Fact(value="HYPERVISOR" in flags, source="nfd", detail="cpu-cpuid.HYPERVISOR")
    return DeviceProfile(
        described_by="nfd",
        name=name or node_name or label_map.get("kubernetes.io/hostname"),
        os=Fact(value=os_label, source="nfd", detail="kubernetes.io/os") if os_label else Fact(),
        # Kubernetes nodes that run NFD are servers, never phones.
        device_class=Fact(value="cpu", source="derived", detail="a Kubernetes node"),
        arch=arch,
        vendor=Fact(value=vendor, source="nfd", detail="cpu-model.vendor_id") if vendor else Fact(),
        isa=Fact(value=isa, source="nfd", detail=isa_detail),
        hypervisor=hypervisor,
        logical_cpus=Fact(value=cpus, source="nfd", detail="capacity.cpu") if cpus else Fact(),
        physical_cores=physical,
        numa_nodes=numa_nodes,
        memory_total_bytes=total,
        memory_available_bytes=available,
    )
