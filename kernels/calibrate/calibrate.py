"""edge-calibrate: time every candidate linear kernel on this CPU and write a calibration record.

Each kernel of edge.catalog.kernel_registry runs in a child process of its own (kernels.calibrate.calibration_timers),
one at a time: a kernel that dies (an illegal instruction: SIGILL) is recorded as crashed and the others still run; one
that runs past its time is recorded as failed; one whose op the loaded library lacks, as absent. The shapes are
every GEMM vLLM runs for the model (the head only at M <= 16: it sees one row per sequence) plus a 4096x4096
reference, at M = 1, 4, 16, 128, 512 rows, with the model's int4 group size, at --threads Torch threads (vLLM
serves with one here). Also measured: the read bandwidth, and on boxes of up to 4 cores how one decode step of
tinygemm and bf16 scales from 1 thread to all cores.

The record (edge.device.calibration.CalibrationRecord) lands in $EDGE_SELECT_CACHE_DIR/calibration/, where edge-select
reads it, and in --out if given. About a minute and a half for the default model on a 2-core box.

Exit codes: 0 calibrated; 2 bad input (the message names the option and the value).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from edge.catalog.kernel_registry import KERNELS
from edge.catalog.quantized_layers import model_layers, rules_for
from edge.catalog.shape_rules import pick_group_size
from edge.catalog.weight_paths import the_path
from edge.device.calibration import CalibrationRecord, KernelResult, ThreadTime, best_match, cached_records, record_path
from edge.device.profile import DeviceProfile
from edge.errors import InputError
from edge.formats.tinygemm import TINYGEMM
from edge.measure.cost import CALIBRATION_ROWS, calibration_shapes
from edge.model.shapes import ModelShape

EXIT_OK, EXIT_BAD_INPUT = 0, 2
REFERENCE_SHAPE = (4096, 4096)  # timed for every model, so records of different models compare and scale
HEAD_MAX_ROWS = 16  # vLLM computes logits for sampled positions only: the head sees M <= max_num_seqs
QUICK_ROWS = (1, 16, 128)
SECONDS_PER_POINT = {False: 0.1, True: 0.02}  # by --quick
SCALING_MAX_CORES = 4  # thread scaling is measured on boxes this small, where 1 thread vs all is the question
SCALING_KERNELS = ("tinygemm", "bf16")
CHILD = [sys.executable, "-m", "kernels.calibrate.calibration_timers"]

Progress = Callable[[str], None]


def _stderr(line: str) -> None:
    print(f"edge-calibrate: {line}", file=sys.stderr, flush=True)


def model_shapes(model: ModelShape, group: int) -> list[tuple[int, int]]:
    """[N, K] of every GEMM vLLM runs for the model on the tinygemm-format path (edge.measure.cost's
    calibration_shapes)."""
    path = the_path(weight_format=TINYGEMM.name)
    return calibration_shapes(model_layers(model, rules_for(model, path, group, "speed")))


def group_size(model: ModelShape) -> int:
    group = pick_group_size(model)
    if group is None:
        raise InputError("--model", model.name, "linears whose K a group size of 32, 64 or 128 divides")
    return group


# --- children --------------------------------------------------------------------------------------------------


def _run_child(args: list[str], timeout_s: float) -> tuple[dict | None, str, str | None]:
    """(the child's JSON object, status, reason): status "crashed" when a signal killed it, "failed" when it
    timed out, exited non-zero or printed no JSON."""
    try:
        done = subprocess.run([*CHILD, *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return None, "failed", f"timed out after {timeout_s:.0f} s"
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        return None, "crashed", f"killed by {name}"
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    if done.returncode != 0:
        return None, "failed", f"exited with status {done.returncode}: {last}"
    try:
        return json.loads(done.stdout.strip().splitlines()[-1]), "ok", None
    except (IndexError, ValueError):
        return None, "failed", f"printed no result: {last}"


def _shape_list(shapes: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{n}x{k}" for n, k in shapes)


def time_in_child(kernel: str, shapes: Sequence[tuple[int, int]], rows: Sequence[int], group: int, threads: int, *,
                  narrow_shapes: Sequence[tuple[int, int]] = (), llc_bytes: int | None = None,
                  seconds_per_point: float = SECONDS_PER_POINT[False],
                  timeout_s: float | None = None) -> KernelResult:  # fmt: skip
    """One kernel timed in a child process of its own; whatever happens to the child, a KernelResult."""
    args = [kernel, "--shapes", _shape_list(shapes), "--rows", ",".join(map(str, rows)), "--group", str(group),
            "--threads", str(threads), "--seconds-per-point", str(seconds_per_point)]  # fmt: skip
    if narrow_shapes:
        args += ["--narrow-shapes", _shape_list(narrow_shapes)]
    if llc_bytes:
        args += ["--llc", str(llc_bytes)]
    data, status, reason = _run_child(args, timeout_s or 60 + 40 * len(shapes))
    if data is None:
        return KernelResult(kernel=kernel, status=status, reason=reason)
    try:
        return KernelResult.model_validate(data)
    except ValueError as err:
        return KernelResult(kernel=kernel, status="failed", reason=f"unreadable result: {err}")


def host_facts(threads: int, timeout_s: float = 120) -> dict:
    """Versions, native library, torch's CPU capability, LLC and read bandwidth, as a child measures them;
    {} when the child fails (the record then says less)."""
    data, _, _ = _run_child(["host", "--threads", str(threads)], timeout_s)
    return data or {}


# --- the record ------------------------------------------------------------------------------------------------


def _decode_step_ms(result: KernelResult | None, shapes: Sequence[tuple[int, int]]) -> float | None:
    """One decode step: every shape once at M=1; None unless all were timed."""
    if result is None or result.status != "ok":
        return None
    times = [result.at(n, k).get(1) for n, k in shapes]
    return sum(times) if all(t is not None for t in times) else None


def thread_scaling(shapes: Sequence[tuple[int, int]], group: int, cores: int, threads: int,
                   measured: dict[str, KernelResult], llc_bytes: int | None, progress: Progress,
                   ) -> list[ThreadTime]:  # fmt: skip
    """A decode step of SCALING_KERNELS at 1 thread and at all cores (the serving count's step is reused).

    One thread is timed in the thread's CPU time, more in wall time: on cores other processes keep busy, every
    call of a multi-threaded op waits for its slowest thread (tinygemm's step went from 0.6 to 40 ms at 2 threads
    while another job ran on this 2-core box, 2026-11-30), and that is what serving on such a box would see."""
    out = []
    for kernel in SCALING_KERNELS:
        steps = {}
        for count in sorted({1, cores}):
            ms = _decode_step_ms(measured.get(kernel), shapes) if count == threads else None
            if ms is None:
                start = time.monotonic()
                result = time_in_child(kernel, shapes, [1], group, count, llc_bytes=llc_bytes)
                progress(f"{kernel:<13} {result.status:<7} {time.monotonic() - start:5.1f} s (decode step at {count} "
                         f"thread{'s' if count != 1 else ''})")  # fmt: skip
                ms = _decode_step_ms(result, shapes)
            if ms is not None:
                steps[count] = ms
                out.append(ThreadTime(threads=count, kernel=kernel, ms=ms))
        if len(steps) == 2 and steps[cores] > steps[1]:
            load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
            progress(f"warning: {kernel}'s decode step is slower at {cores} threads ({steps[cores]:.2f} ms) than at "
                     f"1 ({steps[1]:.2f} ms): other processes are using the cores (load average {load})")  # fmt: skip
    return out


def calibrate(model: ModelShape, threads: int = 1, *, device: DeviceProfile | None = None,
              kernels: Sequence[str] | None = None, shapes: Sequence[tuple[int, int]] | None = None,
              rows: Sequence[int] | None = None, quick: bool = False, scaling: bool = True,
              progress: Progress = _stderr, timeout_s: float | None = None) -> CalibrationRecord:  # fmt: skip
    """Time `kernels` (default: all of edge.catalog.kernel_registry) on this host for `model`'s shapes.

    shapes/rows replace the model's shapes (and the reference) and CALIBRATION_ROWS, e.g. for a quick check;
    scaling=False skips the thread-scaling children."""
    if threads < 1:
        raise InputError("--threads", threads, "a positive number of threads")
    unknown = sorted(set(kernels or ()) - set(KERNELS))
    if unknown:
        raise InputError("--kernels", unknown[0], f"kernel names from {', '.join(KERNELS)}")
    started = time.monotonic()
    if device is None:
        from edge.device.probe import probe

        device = probe(measure_layout=False)
    group = group_size(model)
    decode_shapes = model_shapes(model, group) if shapes is None else list(shapes)
    narrow = [s for s in decode_shapes if s[0] == model.vocab_size] if shapes is None else []
    timed_shapes = decode_shapes + ([REFERENCE_SHAPE] if shapes is None and REFERENCE_SHAPE not in decode_shapes
                                    else [])  # fmt: skip
    timed_rows = list(rows or (QUICK_ROWS if quick else CALIBRATION_ROWS))
    if any(m < 1 for m in timed_rows):
        raise InputError("rows", timed_rows, "positive row counts")
    cores = device.compute_cores or os.cpu_count() or 1

    start = time.monotonic()
    host = host_facts(threads)
    llc = host.get("llc_bytes")
    progress(
        f"{'host':<13} {'ok' if host else 'failed':<7} {time.monotonic() - start:5.1f} s (read bandwidth "
        f"{host.get('read_bandwidth_gb_s')} GB/s, vLLM library {host.get('native_library')})"
    )
    results: dict[str, KernelResult] = {}
    for kernel in kernels or KERNELS:
        start = time.monotonic()
        results[kernel] = time_in_child(kernel, timed_shapes, timed_rows, group, threads, narrow_shapes=narrow,
                                        llc_bytes=llc, seconds_per_point=SECONDS_PER_POINT[quick],
                                        timeout_s=timeout_s)  # fmt: skip
        result = results[kernel]
        why = f" ({result.reason})" if result.reason else ""
        progress(f"{kernel:<13} {result.status:<7} {time.monotonic() - start:5.1f} s{why}")
    scaled = []
    if scaling and cores <= SCALING_MAX_CORES:
        scaled = thread_scaling(decode_shapes, group, cores, threads, results, llc, progress)

    runtime = device.runtime
    native = host.get("native_library") or runtime.vllm_native_library.value
    if runtime.vllm_native_library.value and native != runtime.vllm_native_library.value:
        progress(f"warning: vLLM loaded {native}, the probe expected {runtime.vllm_native_library.value}")
    return CalibrationRecord(
        cpu_model=device.cpu_model.value or "unknown CPU",
        isa_flags=device.isa.value or [],
        isa_class=device.isa_class,
        cores=cores,
        threads=threads,
        # the probe's versions: edge.device.calibration.matches compares them with the probe's on the next plan
        torch_version=runtime.torch_version.value or host.get("torch_version"),
        vllm_version=runtime.vllm_version.value or host.get("vllm_version"),
        native_library=native,
        torch_capability=host.get("torch_capability"),
        group_size=group,
        model=model.name,
        llc_bytes=llc,
        read_bandwidth_gb_s=host.get("read_bandwidth_gb_s"),
        thread_scaling=scaled,
        kernels=list(results.values()),
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        duration_s=round(time.monotonic() - started, 1),
    )


def write_record(record: CalibrationRecord, path: Path) -> Path:
    """Write atomically: a temporary file in the same directory, then a rename; never a partial file at path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = record.model_dump_json(indent=2) + "\n"
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def save(record: CalibrationRecord, out: Path | None = None) -> Path:
    """Into the cache (where edge-select reads records) and to `out` if given; the cache path."""
    if out is not None:
        write_record(record, out)
    return write_record(record, record_path(record))


def host_record(model_name: str | None = None, *, threads: int | None = None,
                device: DeviceProfile | None = None) -> CalibrationRecord | None:  # fmt: skip
    """The newest cached record taken on this kind of host (preferring one of `model_name`'s shapes, and only
    records at `threads` when given); None when there is none."""
    if device is None:
        from edge.device.probe import probe

        device = probe(measure_layout=False)
    records = [r for r in cached_records() if threads is None or r.threads == threads]
    return best_match(records, device, model_name)


def cached_or_calibrate(model: ModelShape | None = None, threads: int = 1, *, quick: bool = False,
                        device: DeviceProfile | None = None, progress: Progress = _stderr
                        ) -> CalibrationRecord:  # fmt: skip
    """This host's record for `model` (default: the embedded default model) at `threads`: from the cache when
    one was taken of this model's shapes, else calibrated now (minutes) and saved."""
    from edge.device.probe import probe
    from edge.model.reader import default_model

    model = model or default_model()
    device = device or probe(measure_layout=False)
    found = host_record(model.name, threads=threads, device=device)
    if found is not None and found.model == model.name:
        return found
    record = calibrate(model, threads, device=device, quick=quick, progress=progress)
    save(record)
    return record


# --- output ----------------------------------------------------------------------------------------------------


def render(record: CalibrationRecord) -> str:
    """A table of median ms per call: kernel x shape (N x K) x M, then what was not timed and why."""
    rows = sorted({t.m for k in record.kernels for t in k.times})
    lines = [
        f"{record.model} on {record.cpu_model} [{record.isa_class}], {record.threads} thread"
        f"{'s' if record.threads != 1 else ''}, int4 group {record.group_size}, torch {record.torch_version} "
        f"({record.torch_capability}), vLLM {record.vllm_version} ({record.native_library})",
        f"read bandwidth {record.read_bandwidth_gb_s} GB/s, last-level cache "
        f"{(record.llc_bytes or 0) >> 20} MiB, {record.duration_s} s",
        f"{'kernel':<13} {'N x K':>11} " + " ".join(f"{'M=' + str(m):>9}" for m in rows) + "   (median ms per call)",
    ]  # fmt: skip
    for result in record.kernels:
        if result.status != "ok":
            lines.append(f"{result.kernel:<13} {result.status}: {result.reason}")
            continue
        for n, k in sorted({(t.n, t.k) for t in result.times}, key=lambda s: s[0] * s[1]):
            at = result.at(n, k)
            cells = " ".join(f"{at[m]:>9.3f}" if m in at else f"{'-':>9}" for m in rows)
            lines.append(f"{result.kernel:<13} {f'{n}x{k}':>11} {cells}")
    if record.thread_scaling:
        steps = ", ".join(f"{t.kernel} {t.threads}t {t.ms:.2f} ms" for t in record.thread_scaling)
        lines.append(f"decode step (M=1, every model shape once): {steps}")
    return "\n".join(lines)


def list_kernels() -> str:
    return "\n".join(f"{s.name:<13} {s.library:<6} {s.op:<44} {s.weight_format:<14} {s.description}"
                     for s in KERNELS.values())  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-calibrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default="default",
        metavar="DIR|default",
        help="a local Hugging Face model directory or its config.json (default: the embedded model)",
    )
    parser.add_argument("--threads", type=int, default=1, help="Torch threads, as vLLM will serve (default 1)")
    parser.add_argument("--kernels", metavar="NAME,...", help="only these kernels (default: every registry kernel)")
    parser.add_argument("--out", type=Path, metavar="FILE", help="also write the record here")
    parser.add_argument("--json", action="store_true", help="print the record as JSON instead of the table")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"M = {', '.join(map(str, QUICK_ROWS))} only, shorter timing: about half the time",
    )
    parser.add_argument("--list", action="store_true", help="list the candidate kernels and exit")
    return parser  # fmt: skip


def _model(value: str) -> ModelShape:
    from edge.model.reader import default_model, read_model

    if value == "default":
        return default_model()
    if not Path(value).exists():
        raise InputError("--model", value, "a model directory holding config.json, a config.json, or 'default'")
    return read_model(value)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        print(list_kernels())
        return EXIT_OK
    try:
        if args.threads < 1:
            raise InputError("--threads", args.threads, "a positive number of threads")
        if args.out is not None and not args.out.parent.is_dir():
            raise InputError("--out", str(args.out), "a file in an existing directory")
        kernels = [k for k in args.kernels.split(",") if k] if args.kernels else None
        record = calibrate(_model(args.model), args.threads, kernels=kernels, quick=args.quick)
    except InputError as error:
        print(f"edge-calibrate: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    path = save(record, args.out)
    _stderr(f"record written to {path}" + (f" and {args.out}" if args.out else ""))
    print(record.model_dump_json(indent=2) if args.json else render(record), flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
