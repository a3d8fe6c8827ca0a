"""edge-serve: plan for this box, convert the model when the plan needs it, then serve it behind the API.

  edge-serve [--model DIR|FILE.gguf|ORG/NAME] [--priority fidelity|speed] [--host 127.0.0.1] [--port 8080]
             [--memory-budget SIZE] [--max-model-len N] [--force] [--calibration-db URL] [--served-model-name NAME]
             [--calibrate] [--report-to URL [--report-token-file FILE]]

Without --model it serves the embedded default model (the directory `edge-model default` prints). A converted
checkpoint goes to $EDGE_SELECT_CACHE_DIR/converted/<model>-<hash of quantization_config> and is reused by
edge-convert when up to date. Prints the chosen path, layout, the top reasons and the URL, then serves until
interrupted. Clients name the model by its directory's name (SmolLM2-135M-Instruct-bf16 for the default model),
or --served-model-name; its full path is accepted too. Other settings come from EDGE_* environment variables
(server/settings.py), e.g. EDGE_API_TOKEN. An address other than loopback (--host 0.0.0.0) is refused (exit 2)
unless EDGE_API_TOKEN is set: nothing is served without a token where others can reach it.

The plan ranks from this host's calibration record (what `edge-calibrate` cached); where none is cached for this
CPU, edge-serve times the kernels first (1-2 minutes, once: the record is cached), since the plan's decode kernel
rests on them; EDGE_CALIBRATION=cached plans from the facts table instead, and =off always does. --calibrate
measures a fresh record first. --report-to URL posts that record to a fleet planner's /calibrations (calibrating
first when this host has none), so that its /plan for boxes of this CPU ranks from it; a failed report is a
warning, and the box serves anyway. The report token comes from EDGE_REPORT_TOKEN or --report-token-file (a
command line is visible to every user of the box); a plain http:// URL to another host would carry it in clear,
and is refused (exit 2): use https://.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from edge.device.calibration import CalibrationRecord, best_match, parse
from edge.device.calibration import cached_records as cached_calibrations
from edge.device.describe import load_device_file, parse_size
from edge.device.probe import probe
from edge.errors import InputError
from edge.measure.quality import DEFAULT_MAX_KLD
from edge.model.reader import is_gguf, read_model, resolve_model
from edge.paths import converted_dir
from edge.plan.inputs import PlanInputs, gather
from edge.plan.schema import LAYOUTS, PRIORITIES, SERVING_MODES, WEIGHT_PATHS, Plan
from server.app import create_app, weight_path
from server.settings import CalibrationMode, Settings, exposure_problem, is_loopback, load_settings
from server.supervisor.command import EngineRefused, plan_refusal, short_model_name
from server.supervisor.early import EarlyEngine
from server.supervisor.supervisor import EngineSupervisor

TOP_REASONS = 3
REPORT_TIMEOUT_S = 30.0


def tool(script: str, module: str) -> list[str]:
    """A console script of this environment, or its module run by this interpreter when not installed."""
    installed = Path(sys.executable).parent / script
    return [str(installed)] if installed.exists() else [sys.executable, "-m", module]


def default_model_dir(command: Sequence[str] | None = None) -> Path:
    """The embedded default model's directory: what `edge-model default` prints (built on first use)."""
    command = list(command or [*tool("edge-model", "kernels.source.default_model"), "default"])
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise InputError("--model", None, f"a model directory; `edge-model default` failed: {done.stderr.strip()}")
    return Path(done.stdout.strip().splitlines()[-1])


def convert(
    plan: Plan,
    model_dir: Path,
    command: Sequence[str] | None = None,
    before_converting: Callable[[], None] = lambda: None,
) -> Path:
    """Run `edge-convert SRC DST --plan PLAN.json`; it skips a conversion that is already up to date.
    before_converting() runs first when there is no conversion to reuse (edge-convert's own check finds a stale
    one out later)."""
    dst = converted_dir(model_dir, plan.quantization_config)
    if not dst.exists():
        before_converting()
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".plan.json", dir=dst.parent, delete=False) as f:
        f.write(plan.model_dump_json())
    try:
        # --force: DST is this cache's own conversion for this exact config, so one that fails its checksums (a
        # corrupted file, a half-deleted folder) is rebuilt, never served and never a reason to stop
        argv = [*(command or tool("edge-convert", "kernels.convert.convert")), str(model_dir), str(dst),
                "--plan", f.name, "--force"]
        print(f"converting {model_dir} -> {dst} ({plan.path})", flush=True)
        done = subprocess.run(argv, check=False)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        raise InputError("--model", str(model_dir), f"a model edge-convert can convert (exit {done.returncode})")
    return dst


@dataclass
class Prepared:
    plan: Plan
    source_dir: Path
    serve_dir: Path  # the source itself for bf16, else the converted checkpoint


class ExportOnly(Exception):
    """An export-only plan (a phone): nothing to serve here; its deliverable is edge-export's bundle."""

    def __init__(self, plan: Plan, source: Path, device: str | None) -> None:
        self.plan, self.source, self.device = plan, source, device
        super().__init__(self.message())

    def message(self) -> str:
        select = ["edge-select", *(["--device", self.device] if self.device else []), "--json"]
        export = self.plan.export.command_line(str(self.source)) if self.plan.export else "edge-export MODEL OUT"
        return (f"edge-serve: this plan is {self.plan.path} (a phone: vLLM has no backend for it), nothing to serve; "
                f"build its bundle instead:\n  {' '.join(select)} > PLAN.json\n  {export}")  # fmt: skip


def plan_for_serving(
    args: argparse.Namespace,
    *,
    calibration: CalibrationMode = "cached",
    before_timing: Callable[[], None] = lambda: None,
) -> tuple[Plan, Path]:
    """The plan edge-serve serves (its --dry-run prints it) and the model it is for. `calibration`
    (Settings.calibration): `auto` times this host's kernels when no record of its CPU is cached and the plan is
    for this host, calling before_timing() first; the plan is made once before that, and a plan that will be
    refused (over its budget) times nothing; `off` plans without a calibration record."""
    source = resolve_model(args.model) if args.model else default_model_dir()
    budget = parse_size(args.memory_budget, "--memory-budget") if args.memory_budget else None
    # A described device (the DaemonSet passes its node's NFD labels) plans for that; otherwise probe this host.
    device = load_device_file(args.device) if args.device else probe()
    inputs = gather(device, read_model(source), calibrations=[] if calibration == "off" else None)

    def plan_from(inputs: PlanInputs) -> Plan:
        return inputs.plan(
            priority=args.priority,
            budget_bytes=budget,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            path=args.path,
            layout=args.layout,
            force=args.force,
            serving_mode=getattr(args, "serving_mode", None),
            threads=getattr(args, "threads", None),
            speculative=getattr(args, "speculative", None),
            max_kld=DEFAULT_MAX_KLD if getattr(args, "max_kld", None) is None else args.max_kld,
        )

    plan = plan_from(inputs)
    served = plan_refusal(plan, force=args.force) is None
    if inputs.calibration is None and calibration == "auto" and not args.device and served:
        before_timing()
        record = calibrate_on_start()
        if record is not None:
            plan = plan_from(inputs.with_calibration(record))
    return plan, source


def prepare(
    args: argparse.Namespace,
    *,
    converter: Sequence[str] | None = None,
    before_converting: Callable[[], None] = lambda: None,
    calibration: CalibrationMode = "cached",
    before_timing: Callable[[], None] = lambda: None,
) -> Prepared:
    """Probe, read the model, plan (plan_for_serving), convert when the plan needs it (calling
    before_converting() first when there is no conversion to reuse)."""
    plan, source = plan_for_serving(args, calibration=calibration, before_timing=before_timing)
    if plan.vllm is None:
        raise ExportOnly(plan, source, args.device)
    if args.device:
        check_block_here(plan, args.device)
    # a GGUF is always converted: vLLM's CPU backend does not load GGUF files (vLLM issues #7291, #8500)
    needs_conversion = plan.quantization_config is not None or is_gguf(source)
    serve_dir = convert(plan, source, converter, before_converting) if needs_conversion else source
    return Prepared(plan=plan, source_dir=source, serve_dir=serve_dir)


def check_block_here(plan: Plan, device_file: str) -> None:
    """A plan for a described device serves on this host only if this host's torch packs tinygemm the same way:
    the engine refuses a checkpoint planned for another block (kernels/vllm_plugin/cpu_int4.py), and a supervisor would
    restart that refusal forever. Refused here instead, before anything starts."""
    planned = (plan.quantization_config or {}).get("tinygemm_block")
    here = probe().runtime.tinygemm_block
    if planned is not None and here.value is not None and here.value != planned:
        raise InputError(
            "--device", device_file,
            f"a description of this host for a {plan.path} plan: it plans tinygemm blocks of {planned} channels, "
            f"this host's torch packs {here.value} ({here.detail}); drop --device to plan for this host",
        )  # fmt: skip


class CalibrationFailed(RuntimeError):
    """No calibration record for this host: edge-calibrate failed or wrote none."""


def calibrator() -> list[str]:
    """edge-calibrate, as a child process: this process never imports torch."""
    return [*tool("edge-calibrate", "kernels.calibrate.calibrate"), "--json"]


def calibrate_here(command: Sequence[str] | None = None) -> CalibrationRecord:
    """Time the kernels on this host now; edge-calibrate caches the record and prints it (--json)."""
    argv = list(command or calibrator())
    print(f"calibrating this host: {' '.join(argv)}", flush=True)
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)  # its progress goes to stderr
    if done.returncode != 0:
        raise CalibrationFailed(f"{' '.join(argv)} exited {done.returncode}")
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    for text in (done.stdout, *lines[-1:]):
        try:
            return parse(json.loads(text))
        except ValueError:
            continue
    record = best_match(cached_calibrations(), probe())
    if record is None:
        raise CalibrationFailed(f"{' '.join(argv)} printed no calibration record and cached none for this host")
    return record


def calibrate_on_start(command: Sequence[str] | None = None) -> CalibrationRecord | None:
    """This host's first calibration, before its first plan is served (Settings.calibration `auto`); None, with a
    warning, when it fails: the plan then ranks from the facts table, as before."""
    print("edge-serve: no calibration record for this CPU: timing its kernels once, the plan's decode kernel rests "
          "on them (1-2 minutes; EDGE_CALIBRATION=cached skips this)", flush=True)  # fmt: skip
    try:
        return calibrate_here(command)
    except CalibrationFailed as error:
        print(f"edge-serve: warning: {error}; planning from the facts table", file=sys.stderr, flush=True)
        return None


def host_calibration(*, fresh: bool = False, command: Sequence[str] | None = None) -> CalibrationRecord:
    """This host's calibration record: the newest edge-calibrate cached for this CPU, or a fresh one when there
    is none (or `fresh`)."""
    if not fresh:
        record = best_match(cached_calibrations(), probe())
        if record is not None:
            return record
    return calibrate_here(command)


def report_calibration(record: CalibrationRecord, url: str, token: str | None) -> tuple[bool, str]:
    """POST the record to URL/calibrations; whether it is stored there, and the line that says so."""
    target = f"{url.rstrip('/')}/calibrations"
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    what = f"calibration {record.digest} ({record.cpu_model}, {record.measured_at[:10]})"
    try:
        response = httpx.post(target, content=record.model_dump_json(), headers=headers, timeout=REPORT_TIMEOUT_S)
    except httpx.HTTPError as error:
        return False, f"{what} not reported to {target}: {error.__class__.__name__}: {error}"
    if response.status_code in (200, 201):
        stored = "stored" if response.status_code == 201 else "already stored"
        return True, f"{what} reported to {target}: {stored} ({response.status_code})"
    return False, f"{what} not reported to {target}: {response.status_code} {response.text[:200]}"


def report_token(args: argparse.Namespace, settings: Settings) -> str | None:
    """The token --report-to sends: --report-token-file's first line, else --report-token, else
    EDGE_REPORT_TOKEN."""
    if args.report_token_file:
        try:
            with open(args.report_token_file, encoding="utf-8") as f:
                token = f.readline().strip()
        except OSError as error:
            expected = f"a readable file ({error.strerror})"
            raise InputError("--report-token-file", args.report_token_file, expected) from None
        if not token:
            raise InputError("--report-token-file", args.report_token_file, "a file whose first line is the token")
        return token
    return args.report_token or settings.report_token


def check_report_to(url: str, token: str | None) -> None:
    """A token goes to another host only over TLS: http:// is allowed to loopback alone."""
    target = httpx.URL(url)
    if target.scheme not in ("http", "https") or not target.host:
        raise InputError("--report-to", url, "an http:// or https:// URL of a fleet planner")
    if token and target.scheme == "http" and not is_loopback(target.host):
        raise InputError(
            "--report-to", url, "an https:// URL: over http:// to another host the report token would travel in clear"
        )


def report_and_calibrate(args: argparse.Namespace, settings: Settings, token: str | None) -> None:
    """--calibrate and --report-to, before anything is planned or served; failures are warnings."""
    if not (args.calibrate or args.report_to):
        return
    try:
        record = host_calibration(fresh=args.calibrate)
    except CalibrationFailed as error:
        print(f"edge-serve: warning: no calibration record for this host ({error}); nothing reported",
              file=sys.stderr, flush=True)  # fmt: skip
        return
    if args.report_to:
        ok, line = report_calibration(record, args.report_to, token)
        print(line if ok else f"edge-serve: warning: {line}", file=sys.stdout if ok else sys.stderr, flush=True)



def summary(prepared: Prepared, url: str, served_model_name: str | None = None) -> str:
    plan = prepared.plan
    name = served_model_name or short_model_name(plan, str(prepared.serve_dir))
    lines = [f"path      {weight_path(plan)}" + ("" if plan.verified else "  (not measured on this ISA class)")]
    lines += [f"model     {name}  ({prepared.serve_dir})"]
    lines += [f"memory    peak {plan.memory.peak_bytes / 2**30:.2f} GiB, budget "
              + (f"{plan.memory.budget_bytes / 2**30:.2f} GiB" if plan.memory.budget_bytes else "none")]  # fmt: skip
    lines += [f"why       {reason.text}" for reason in plan.reasons[:TOP_REASONS]]
    lines += [f"url       {url}/v1  (OpenAI API; {url}/status says what runs)"]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edge-serve", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", metavar="DIR|FILE.gguf|ORG/NAME",
                   help="a Hugging Face model directory, a .gguf file, or a repo id in the local Hugging Face cache "
                        "(default: the embedded model)")
    p.add_argument("--priority", choices=PRIORITIES, default="speed")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1, or EDGE_HOST)")
    p.add_argument("--port", type=int, default=None, help="port to bind (default 8080, or EDGE_PORT)")
    p.add_argument("--memory-budget", metavar="SIZE", help="e.g. 3GiB (default: the box's usable memory)")
    p.add_argument("--max-model-len", type=int, metavar="TOKENS")
    p.add_argument("--max-num-seqs", type=int, metavar="N")
    p.add_argument("--device", metavar="FILE", help="plan for this device description (JSON, cpuinfo or NFD labels) "
                   "instead of probing, e.g. the node labels a Kubernetes init container wrote")
    p.add_argument("--path", choices=WEIGHT_PATHS, help="pin the weight path")
    p.add_argument("--layout", choices=LAYOUTS, help="pin the w4a16-tinygemm layout")
    p.add_argument("--serving-mode", choices=SERVING_MODES,
                   help="vLLM as one process (the engine core a thread of the API server), two (API server, engine "
                        "core running its worker) or three (vLLM's CPU default, a worker process of its own); default: "
                        "the plan's choice by cores")
    p.add_argument("--threads", type=int, metavar="N", help="the one- or two-process engine's "
                   "compute threads (default: the calibration's choice, else every core but one)")
    p.add_argument("--speculative", metavar="off|ngram|auto",
                   help="draft tokens for vLLM to verify a step: ngram drafts from the request's own text; auto drafts "
                        "where a measurement on this CPU class says it pays (default: off)")
    p.add_argument("--force", action="store_true", help="start a plan over its memory budget or a refused pin")
    p.add_argument("--max-kld", type=float, metavar="NATS",
                   help=f"speed trades quality only within this measured mean KL divergence per token (default "
                        f"{DEFAULT_MAX_KLD}, as edge-select's)")
    p.add_argument("--dry-run", action="store_true", help="plan and convert, print, do not serve")
    p.add_argument("--plan-only", action="store_true",
                   help="serve only the planner (/plan, /probe, /status) for fleet tooling: no model, no engine")
    p.add_argument("--calibration-db", metavar="URL", help="keep /calibrations in this PostgreSQL database, shared "
                   "by replicas (default: SQLite in the cache directory, or EDGE_CALIBRATION_DB)")
    p.add_argument("--calibrate", action="store_true",
                   help="time the kernels on this host first (edge-calibrate), even when a record is cached")
    p.add_argument("--report-to", metavar="URL", help="post this host's calibration record to URL/calibrations "
                   "(a fleet planner: edge-serve --plan-only), calibrating first when there is none")
    p.add_argument("--report-token-file", metavar="FILE",
                   help="a file whose first line is the bearer token of the server reported to (default: "
                        "EDGE_REPORT_TOKEN)")
    p.add_argument("--report-token", metavar="TOKEN",
                   help="the token itself: visible to every user of the box (ps), prefer the two above")
    p.add_argument("--served-model-name", metavar="NAME", help="the model's name in the OpenAI API (default: its "
                   "directory's name, or EDGE_SERVED_MODEL_NAME); the full path is accepted too")
    return p


def main(argv: list[str] | None = None, early: EarlyEngine | None = None) -> int:
    """edge-serve; `early`: the engine server/edge_serve.py started before this module was imported (killed
    here unless the supervisor takes it)."""
    try:
        return run(argv, early)
    finally:
        if early is not None:
            early.discard()  # unless the supervisor took it


def run(argv: list[str] | None, early: EarlyEngine | None) -> int:
    args = parser().parse_args(argv)
    given = (("host", args.host), ("port", args.port), ("calibration_db", args.calibration_db),
             ("served_model_name", args.served_model_name))  # fmt: skip
    try:
        settings = load_settings(**{k: v for k, v in given if v is not None})
    except InputError as error:
        print(f"edge-serve: {error}", file=sys.stderr)
        return 2
    url = f"http://{settings.host}:{settings.port}"
    refused = exposure_problem(settings)
    if refused:
        print(f"edge-serve: {refused}", file=sys.stderr)
        return 2
    try:
        if settings.calibration_db:  # SQLAlchemy only where a database is named (server/store.py)
            from server.calibrations import database_url

            database_url(settings.calibration_db)
        token = report_token(args, settings)
        if args.report_to:
            check_report_to(args.report_to, token)
    except InputError as error:
        print(f"edge-serve: {error}", file=sys.stderr)
        return 2
    if args.calibrate and settings.calibration == "off":
        print("edge-serve: EDGE_CALIBRATION='off': plans from the facts table, so --calibrate would time kernels "
              "no plan uses; drop one of them", file=sys.stderr)  # fmt: skip
        return 2
    report_and_calibrate(args, settings, token)
    if args.report_token:
        print("edge-serve: warning: --report-token is visible to every user of this box (ps); set "
              "EDGE_REPORT_TOKEN or use --report-token-file instead", file=sys.stderr, flush=True)  # fmt: skip
    if args.plan_only:
        if early is not None:
            early.discard()  # no engine here
        print(f"planner   {url}/plan  (POST a device and a model; {url}/docs describes every field)", flush=True)
        serve_app(settings, create_app(settings))
        return 0
    return plan_and_serve(args, settings, url, early)


def plan_and_serve(args: argparse.Namespace, settings: Settings, url: str, early: EarlyEngine | None) -> int:
    try:
        discard = early.discard if early is not None else lambda: None
        # an idle import beside the timed kernels would share the box's memory bandwidth with them
        prepared = prepare(args, before_converting=discard, before_timing=discard,
                           calibration="cached" if args.dry_run else settings.calibration)  # fmt: skip
    except ExportOnly as only:
        print(only.message(), flush=True)
        return 0
    except InputError as error:
        print(f"edge-serve: {error}", file=sys.stderr)
        return 2
    print(summary(prepared, url, settings.served_model_name), flush=True)
    release_planning_heap()
    if args.dry_run:
        if settings.calibration == "auto" and prepared.plan.calibration is None and not args.device:
            print("timed     no calibration record for this CPU: serving times its kernels first, and may plan "
                  "another decode kernel", flush=True)  # fmt: skip
        return 0
    try:
        supervisor = EngineSupervisor.for_plan(
            prepared.plan,
            str(prepared.serve_dir),  # the engine listens on a fresh Unix socket for each start
            settings=settings,
            force=args.force,
            early=early,
        )
    except EngineRefused as error:
        print(f"edge-serve: {error}", file=sys.stderr)
        return 2
    serve(settings, supervisor, prepared)
    return 0


def release_planning_heap() -> bool:
    """Give back to the system what planning freed, before the wrapper serves for as long as the box runs: a GGUF
    header's parse (an object for each vocabulary token) left ~33 MiB free in glibc's heap on a 262144-token
    vocabulary (Zen 5, 2026-12-07), which glibc keeps (kernels/vllm_plugin/heap_trim.py says why). False without
    glibc's malloc_trim."""
    import ctypes  # noqa: PLC0415
    import gc  # noqa: PLC0415

    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    gc.collect()
    malloc_trim(0)
    return True


def free_loopback_port() -> int:
    """A loopback port free now, by binding port 0 and releasing it (the engine needs none: it listens on a Unix
    socket)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(settings: Settings, supervisor: EngineSupervisor, prepared: Prepared) -> None:
    serve_app(settings, create_app(settings, supervisor=supervisor, plan=prepared.plan,
                                   model_dir=str(prepared.serve_dir)))


def serve_app(settings: Settings, app) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll and proxied request
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        limit_concurrency=settings.limit_concurrency,  # past it, 503: a flood costs its senders, not the box
        timeout_keep_alive=settings.timeout_keep_alive_s,
    )


if __name__ == "__main__":  # without the early engine: server/edge_serve.py is edge-serve's entry point
    sys.exit(main())
