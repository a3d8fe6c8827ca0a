"""Read a device from `lscpu -J` (util-linux), the summary people collect by hand.

The JSON is {"lscpu": [{"field": "Architecture:", "data": "x86_64"}, ...]}. util-linux 2.37 and later nest
entries under "children" when the output is a terminal (`Vendor ID` > `Model name` > `Flags`, `Caches (sum of
all)` > `L1d`) and print them flat when piped; older releases always print them flat. Both shapes read the same.
A big.LITTLE CPU gets one `Model name` entry per core type, each followed by its own topology and `Flags`.

Read: Architecture, CPU(s), Vendor ID, Model name, Thread(s) per core, Core(s) per socket or per cluster,
Socket(s) or Cluster(s), Flags (x86 flags and ARM features alike, /proc/cpuinfo's spelling), NUMA node(s),
Hypervisor vendor. lscpu says nothing of memory: a plan for an lscpu device has no known budget unless given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from edge.bounds import MAX_CPUS, MAX_LINE_CHARS, MAX_LSCPU_ENTRIES, MAX_NUMBER, small_int
from edge.device.cpuinfo import parse_meminfo
from edge.device.profile import ARM_FEATURES, ISA_FEATURES, X86_FEATURES, DeviceProfile, Fact
from edge.errors import InputError

LSCPU_EXPECTED = 'the JSON of `lscpu -J`: {"lscpu": [{"field": "Architecture:", "data": "x86_64"}, ...]}'
ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
MAX_DEPTH = 8  # lscpu nests three levels (Vendor ID > Model name > Flags); deeper is not lscpu's
X86_VENDORS = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD", "HygonGenuine": "Hygon"}
# Fields that describe one core type; a new `Model name` starts the next one.
CORE_TYPE_FIELDS = {
    "Model", "CPU family", "Thread(s) per core", "Core(s) per socket", "Core(s) per cluster", "Socket(s)",
    "Cluster(s)", "Stepping", "Flags", "BogoMIPS", "CPU max MHz", "CPU min MHz", "CPU MHz",
}  # fmt: skip


@dataclass
class CoreType:
    """One `Model name` entry and the fields that follow it."""

    model: str | None
    fields: dict[str, str] = field(default_factory=dict)

    def number(self, *keys: str) -> int | None:
        for key in keys:
            value = small_int(self.fields.get(key, ""))
            if value:
                return value
        return None

    @property
    def cores(self) -> int | None:
        per = self.number("Core(s) per socket", "Core(s) per cluster")
        groups = self.number("Socket(s)", "Cluster(s)") or 1  # ARM prints "Socket(s): -"
        return per * groups if per else None


def looks_like_lscpu(obj: Any) -> bool:
    """True for a JSON object whose `lscpu` key holds the entry list `lscpu -J` prints."""
    return isinstance(obj, dict) and isinstance(obj.get("lscpu"), list)


def _entries(items: Any, path: str = "lscpu", depth: int = 0, flat: list | None = None) -> list[tuple[str, str]]:
    """(field without its colon, data) in document order, children after their parent."""
    flat = [] if flat is None else flat
    if not isinstance(items, list):
        raise InputError(path, items, "a list of {field, data} entries")
    if depth > MAX_DEPTH:
        raise InputError(path, "...", f"children nested at most {MAX_DEPTH} deep")
    for index, item in enumerate(items):
        where = f"{path}[{index}]"
        if len(flat) >= MAX_LSCPU_ENTRIES:
            raise InputError(where, "...", f"at most {MAX_LSCPU_ENTRIES} entries, children included")
        if not isinstance(item, dict) or not isinstance(item.get("field"), str):
            raise InputError(where, item, 'an entry {"field": "Name:", "data": ...}')
        flat.append((_text(f"{where}.field", item["field"]).strip().removesuffix(":"), _data(where, item.get("data"))))
        if "children" in item:
            _entries(item["children"], f"{where}.children", depth + 1, flat)
    return flat


def _text(field: str, text: str) -> str:
    if len(text) > MAX_LINE_CHARS:
        raise InputError(field, text, f"at most {MAX_LINE_CHARS} characters")
    return text


def _data(where: str, data: Any) -> str:
    """An entry's data as text; numbers must be finite and of a size str() can print."""
    if data is None:
        return ""
    if isinstance(data, str):
        return _text(f"{where}.data", data).strip()
    if isinstance(data, bool) or not isinstance(data, int | float):
        raise InputError(f"{where}.data", data, "a string, a number or null")
    if (isinstance(data, float) and not math.isfinite(data)) or abs(data) > MAX_NUMBER:
        raise InputError(f"{where}.data", data, "a finite number of magnitude at most 2**63")
    return str(data)


def _split(entries: list[tuple[str, str]]) -> tuple[dict[str, str], list[CoreType]]:
    """Machine-wide fields, and the core types with their own fields."""
    machine: dict[str, str] = {}
    types: list[CoreType] = []
    for key, value in entries:
        if key == "Model name" and types and types[-1].model is None:
            types[-1].model = value or None  # util-linux before 2.37 prints the topology before the model name
        elif key == "Model name":
            types.append(CoreType(value or None))
        elif key in CORE_TYPE_FIELDS:
            if not types:
                types.append(CoreType(None))  # a field before any `Model name` (old x86 order): one core type
            types[-1].fields.setdefault(key, value)
        else:
            machine.setdefault(key, value)
    return machine, types


def _arch(machine: dict[str, str], features: set[str]) -> Fact[str]:
    given = machine.get("Architecture", "")
    if given.lower() in ARCHES:
        return Fact(value=ARCHES[given.lower()], source="lscpu", detail=f"Architecture {given}")
    if given:
        return Fact(value=given, source="lscpu", detail=f"Architecture {given}: not one the planner serves")
    if "asimd" in features:
        return Fact(value="aarch64", source="lscpu", detail="no Architecture; ARM features (asimd) in Flags")
    return Fact(detail="no Architecture entry")


def _common_flags(types: list[CoreType]) -> tuple[set[str], int]:
    """The flags every core type lists (a kernel may run on any of them), and how many core types list flags."""
    flag_sets = [set(t.fields["Flags"].split()) for t in types if t.fields.get("Flags")]
    return (set.intersection(*flag_sets) if flag_sets else set()), len(flag_sets)


def _isa(common: set[str], listed: int, arch: str | None) -> Fact[list[str]]:
    if not listed:
        return Fact(detail="no Flags entry")
    vocabulary = X86_FEATURES if arch == "x86_64" else ARM_FEATURES if arch == "aarch64" else ISA_FEATURES
    present = [f for f in ISA_FEATURES if f in vocabulary and f in common]
    return Fact(
        value=present, source="lscpu", detail="Flags" + (f" common to all {listed} core types" if listed > 1 else "")
    )


def _count(machine: dict[str, str], key: str) -> int | None:
    return small_int(machine.get(key, ""), MAX_CPUS)


def _physical_cores(types: list[CoreType], logical: int | None) -> Fact[int]:
    counts = [t.cores for t in types]
    if types and all(counts):
        total = sum(c for c in counts if c)
        return Fact(value=total, source="lscpu", detail="Core(s) per socket (or cluster) x Socket(s) (or Cluster(s))"
                    + (f", summed over {len(types)} core types" if len(types) > 1 else ""))  # fmt: skip
    threads = next((t.number("Thread(s) per core") for t in types if t.number("Thread(s) per core")), None)
    if logical and threads:
        return Fact(value=max(1, logical // threads), source="derived", detail="CPU(s) / Thread(s) per core")
    return Fact(detail="no core topology in the lscpu output")


def parse_lscpu(obj: dict[str, Any], name: str | None = None, meminfo: str | None = None) -> DeviceProfile:
    """A DeviceProfile from the JSON object `lscpu -J` prints (and /proc/meminfo text when given, since lscpu
    says nothing of memory); described_by="lscpu". Keys beside `lscpu` are named in the device's notes."""
    if not looks_like_lscpu(obj):
        raise InputError("lscpu", obj, LSCPU_EXPECTED)
    machine, types = _split(_entries(obj["lscpu"]))
    if not types and not machine.get("Architecture"):
        raise InputError("lscpu", obj["lscpu"], "entries with at least Architecture or Model name and Flags")
    common, listed = _common_flags(types)
    arch = _arch(machine, common)
    isa = _isa(common, listed, arch.value)
    vendor_id = machine.get("Vendor ID")
    models = [t.model for t in types if t.model]
    logical = _count(machine, "CPU(s)")
    numa = _count(machine, "NUMA node(s)")
    hypervisor: Fact[bool] = Fact(detail="lscpu names no hypervisor and lists no flags")
    if machine.get("Hypervisor vendor"):
        hypervisor = Fact(value=True, source="lscpu", detail=f"Hypervisor vendor {machine['Hypervisor vendor']}")
    elif arch.value == "x86_64" and listed:
        hypervisor = Fact(value="hypervisor" in common, source="lscpu", detail="x86 `hypervisor` flag")
    profile = DeviceProfile(
        described_by="lscpu",
        name=name,
        # lscpu is util-linux's: a Linux machine; phones are not inventoried with it.
        os=Fact(value="linux", source="derived", detail="lscpu is Linux's util-linux"),
        device_class=Fact(value="cpu", source="derived", detail="an lscpu summary (Linux, not a phone)"),
        arch=arch,
        vendor=Fact(value=X86_VENDORS.get(vendor_id, vendor_id), source="lscpu", detail=f"Vendor ID {vendor_id}")
        if vendor_id
        else Fact(detail="no Vendor ID entry"),
        cpu_model=Fact(value=" + ".join(models), source="lscpu", detail="Model name")
        if models
        else Fact(detail="no Model name entry"),
        isa=isa,
        hypervisor=hypervisor,
        logical_cpus=Fact(value=logical, source="lscpu", detail="CPU(s)") if logical else Fact(),
        physical_cores=_physical_cores(types, logical),
        numa_nodes=Fact(value=numa, source="lscpu", detail="NUMA node(s)") if numa else Fact(),
        notes=[f"lscpu description: key {key!r} beside `lscpu` ignored" for key in obj if key != "lscpu"],
    )
    if meminfo is None:
        return profile
    memory = parse_meminfo(meminfo)
    available: Fact[int] = Fact(detail="no MemAvailable line")
    if memory.available_bytes is not None:
        available = Fact(value=memory.available_bytes, source="meminfo", detail="MemAvailable")
    return profile.model_copy(update={
        "memory_total_bytes": Fact(value=memory.total_bytes, source="meminfo", detail="MemTotal"),
        "memory_available_bytes": available,
    })  # fmt: skip
