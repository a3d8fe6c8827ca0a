"""Calibration records: what timing the candidate kernels (edge.catalog.kernel_registry) on one device produced.

`edge-calibrate` (kernels.calibrate.calibrate) writes them; the planner's cost model (edge.measure.cost) reads them;
fleet planners store them (`POST /calibrations`). Pure: pydantic models, matching, and reading record files; no torch.

A record is keyed by what invalidates it: the CPU (model string and ISA flags), torch's and vLLM's versions and
the native library vLLM loads. Bump CALIBRATION_SCHEMA on any change an older reader would misread.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from edge.bounds import MAX_BYTES, MAX_CPUS, MAX_TENSOR_DIM
from edge.device.profile import ISA_FEATURES, DeviceProfile

CALIBRATION_SCHEMA = "1"
KernelStatus = Literal["ok", "absent", "crashed", "failed"]
# What one record may hold: a calibration times ~10 kernels at a model's ~8 shapes and ~6 row counts, and a
# thread sweep of a few counts; the caps sit well past that, so that no posted record costs more than a real one.
MAX_KERNELS = 64
MAX_TIMES = 4096  # per kernel
MAX_THREAD_TIMES = 256
MAX_NAME_CHARS = 256  # a CPU model, a model or a kernel name, a version
MAX_REASON_CHARS = 2048
MAX_MS = 1e7  # ~3 hours for one call: a longer one is no measurement
# A record measured "in the future" by more than a box's clock can drift is forged or from a broken clock: it
# would outrank every honest record of its CPU (the newest wins).
MAX_CLOCK_SKEW = timedelta(minutes=10)
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


class _Bounded(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)


class KernelTime(_Bounded):
    """Median milliseconds of one call of a kernel on an [M, K] x [K, N] problem."""

    n: int = Field(gt=0, le=MAX_TENSOR_DIM)
    k: int = Field(gt=0, le=MAX_TENSOR_DIM)
    m: int = Field(gt=0, le=MAX_TENSOR_DIM)
    ms: float = Field(gt=0, le=MAX_MS)
    calls: int = Field(default=1, gt=0, le=1 << 32)  # how many timed calls the median is of


class KernelResult(_Bounded):
    kernel: Name  # a name in edge.catalog.kernel_registry.KERNELS
    status: KernelStatus  # ok: timed; absent: the host's library has no such op; crashed: the child died
    reason: str | None = Field(default=None, max_length=MAX_REASON_CHARS)  # why not ok ("killed by SIGILL", ...)
    times: list[KernelTime] = Field(default=[], max_length=MAX_TIMES)

    def at(self, n: int, k: int) -> dict[int, float]:
        """{m: ms} measured at exactly this shape."""
        return {t.m: t.ms for t in self.times if t.n == n and t.k == k}


class ThreadTime(_Bounded):
    """One decode step of the calibrated shapes (M=1, every shape once) with this many threads."""

    threads: int = Field(gt=0, le=MAX_CPUS)
    kernel: Name
    ms: float = Field(gt=0, le=MAX_MS)


class CalibrationRecord(_Bounded):
    schema_version: Literal["1"] = CALIBRATION_SCHEMA
    cpu_model: Name = Field(min_length=1)
    isa_flags: list[Name] = Field(max_length=4 * len(ISA_FEATURES))  # of edge.device.profile.ISA_FEATURES
    isa_class: Name
    cores: int = Field(gt=0, le=MAX_CPUS)  # cores the calibration could use
    threads: int = Field(gt=0, le=MAX_CPUS)  # threads every kernel time was measured with (vLLM's serving count)
    torch_version: Name | None = None
    vllm_version: Name | None = None
    native_library: Name | None = None  # "_C", "_C_AVX512", "_C_AVX2": what vLLM loads on this CPU
    torch_capability: Name | None = None  # torch.backends.cpu.get_cpu_capability()
    group_size: int = Field(gt=0, le=MAX_TENSOR_DIM)  # of the int4 weights timed
    model: Name | None = None  # whose linear shapes were timed
    llc_bytes: int | None = Field(default=None, gt=0, le=MAX_BYTES)  # last-level cache (decode weights rotate
    # through a buffer larger than it)
    read_bandwidth_gb_s: float | None = Field(default=None, gt=0, le=1e6)
    thread_scaling: list[ThreadTime] = Field(default=[], max_length=MAX_THREAD_TIMES)
    kernels: list[KernelResult] = Field(max_length=MAX_KERNELS)
    measured_at: str = Field(max_length=64)  # ISO 8601; naive means UTC
    duration_s: float | None = Field(default=None, ge=0, le=1e7)

    @field_validator("isa_flags")
    @classmethod
    def _known_flags(cls, flags: list[str]) -> list[str]:
        unknown = sorted(set(flags) - set(ISA_FEATURES))
        if unknown:
            raise ValueError(f"expected ISA flags from {', '.join(ISA_FEATURES)}, got {', '.join(unknown)}")
        return sorted(set(flags))

    @field_validator("measured_at")
    @classmethod
    def _iso_timestamp(cls, text: str) -> str:
        measured_time(text)
        return text

    @property
    def measured_time(self) -> datetime:
        """measured_at as an aware datetime (naive: UTC), for ordering records whatever offset they were written in."""
        return measured_time(self.measured_at)

    @property
    def key(self) -> str:
        """Same CPU, same torch (and CPU capability), same vLLM and native library: same key (a newer record
    replaces it)."""
        return record_key(self.cpu_model, self.isa_flags, self.torch_version, self.vllm_version, self.native_library,
                          self.torch_capability)

    @property
    def digest(self) -> str:
        """Identifies this exact record (posting it twice stores it once)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    def kernel(self, name: str) -> KernelResult | None:
        return next((k for k in self.kernels if k.kernel == name), None)

    def timed(self, name: str) -> KernelResult | None:
        result = self.kernel(name)
        return result if result is not None and result.status == "ok" and result.times else None

    def describe(self) -> str:
        """One line for reasons and logs: which CPU, when, with what."""
        return (f"calibrated on {self.cpu_model}, {self.measured_at[:10]}, {self.threads} thread"
                f"{'s' if self.threads != 1 else ''}, torch {self.torch_version}, vLLM {self.vllm_version} "
                f"({self.native_library})")  # fmt: skip


def measured_time(text: str) -> datetime:
    """An ISO 8601 timestamp ("2026-11-20T10:00:00+00:00"; naive means UTC); ValueError naming the format otherwise."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"expected an ISO 8601 timestamp such as 2026-11-20T10:00:00+00:00, got {text!r}") from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when


def record_key(cpu_model: str, isa_flags: Iterable[str], torch_version: str | None, vllm_version: str | None,
               native_library: str | None, torch_capability: str | None = None) -> str:  # fmt: skip
    """torch_capability too: the same CPU told ATEN_CPU_CAPABILITY=avx2 runs other kernels (and block)."""
    blob = [cpu_model.strip(), sorted(set(isa_flags)), torch_version, vllm_version, native_library]
    blob = json.dumps(blob + ([torch_capability] if torch_capability else []))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def matches(record: CalibrationRecord, device: DeviceProfile) -> bool:
    """The record was taken on this kind of CPU: the same model string and the same ISA flags. Versions are
    compared only where the device states them (a remote description rarely does)."""
    if device.cpu_model.value is None or record.cpu_model.strip() != device.cpu_model.value.strip():
        return False
    if sorted(set(device.isa.value or [])) != record.isa_flags:
        return False
    runtime = device.runtime
    for stated, recorded in ((runtime.torch_version.value, record.torch_version),
                             (runtime.vllm_version.value, record.vllm_version),
                             (runtime.vllm_native_library.value, record.native_library),
                             (runtime.torch_cpu_capability.value, record.torch_capability)):  # fmt: skip
        if stated is not None and recorded is not None and stated != recorded:
            return False
    return True


def best_match(records: Iterable[CalibrationRecord], device: DeviceProfile,
               model: str | None = None) -> CalibrationRecord | None:  # fmt: skip
    """The newest matching record, preferring one that timed this model's own shapes."""
    found = [r for r in records if matches(r, device)]
    if not found:
        return None
    return max(found, key=lambda r: (model is not None and r.model == model, r.measured_time))


def parse(data: object, field: str = "calibration", now: datetime | None = None) -> CalibrationRecord:
    """A record from JSON-decoded data, measured no later than `now` (default: the clock) plus MAX_CLOCK_SKEW;
    InputError naming the field and the value otherwise."""
    from edge.errors import InputError

    try:
        record = CalibrationRecord.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or field
        message = first["msg"][0].lower() + first["msg"][1:]
        value = None if first["type"] == "missing" else first.get("input")
        raise InputError(f"{field}.{where}" if where != field else field, value,
                         f"a valid record field ({message})") from None  # fmt: skip
    latest = (now or datetime.now(UTC)) + MAX_CLOCK_SKEW
    if record.measured_time > latest:
        raise InputError(f"{field}.measured_at", record.measured_at,
                         f"a time no later than {latest.isoformat(timespec='seconds')} (now, plus "
                         f"{MAX_CLOCK_SKEW.seconds // 60} minutes of clock skew)")  # fmt: skip
    return record


def load_file(path: Path) -> CalibrationRecord:
    from edge.errors import InputError

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise InputError("calibration", str(path), f"a readable calibration record (JSON): {err}") from None
    return parse(data)


def load_records(directory: Path) -> list[CalibrationRecord]:
    """Every readable record in `directory`; anything else is skipped (a cache is never an error)."""
    records = []
    for file in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            records.append(CalibrationRecord.model_validate_json(file.read_text()))
        except (OSError, ValueError, ValidationError):
            continue
    return records


def cache_directory() -> Path:
    from edge.paths import cache_dir

    return cache_dir() / "calibration"


def cached_records() -> list[CalibrationRecord]:
    """edge-calibrate's records for this host and others, from the cache directory; none is fine."""
    return load_records(cache_directory())


def record_path(record: CalibrationRecord, directory: Path | None = None) -> Path:
    """Where a record lives in the cache: one file per key and model (a recalibration replaces it)."""
    model = (record.model or "any").replace("/", "_")
    return (directory or cache_directory()) / f"{record.key}-{model}.json"
