"""edge-select: how should a model run on this CPU (or on a described device)?

Probes the host (or reads --device), reads the model's shapes, and prints a Plan: the weight path and layout,
the memory ledger (resident and load-time peak against the budget), the reasons with their measurements,
the vLLM configuration, and the alternatives with why not.

Exit codes: 0 a plan that fits; 3 nothing fits the budget (the closest option is printed with what would make
it fit); 2 bad input.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from edge.errors import InputError
from edge.measure.quality import DEFAULT_MAX_KLD
from edge.plan.schema import LAYOUTS, PRIORITIES, SERVING_MODES, WEIGHT_PATHS, Plan, format_bytes

EXIT_OK, EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT = 0, 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-select", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--priority", choices=PRIORITIES, default="speed",
                        help="fidelity never quantizes activations; speed takes the fastest measured path")
    parser.add_argument("--model", metavar="DIR|FILE.gguf|ORG/NAME",
                        help="a Hugging Face model directory or its config.json, a .gguf file, or a repo id in the "
                             "local Hugging Face cache (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--memory-budget", metavar="SIZE",
                        help="e.g. 3GiB or 512MiB (default: the memory the probe finds available)")
    parser.add_argument("--max-model-len", type=int, metavar="TOKENS")
    parser.add_argument("--max-num-seqs", type=int, metavar="N")
    parser.add_argument("--device", metavar="FILE",
                        help="plan for a described device: a JSON profile or inventory, a saved /proc/cpuinfo, "
                             "`lscpu -J` output, or node-feature-discovery labels as JSON (the format is detected)")
    parser.add_argument("--path", choices=WEIGHT_PATHS, help="pin the weight path")
    parser.add_argument("--layout", choices=LAYOUTS, help="pin the w4a16-tinygemm layout")
    parser.add_argument("--serving-mode", choices=SERVING_MODES,
                        help="how many processes vLLM runs as (default: the plan's choice by cores: one-process on "
                             "a box of 1-2 cores, else two-process)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="the one- or two-process engine's compute threads (default: the calibration's "
                             "choice, else every core but one)")
    parser.add_argument("--speculative", metavar="off|ngram|auto",
                        help="draft tokens for vLLM to verify a step: ngram drafts from the request's own text; auto "
                             "drafts where a measurement on this CPU class says it pays (default: off)")
    parser.add_argument("--force", action="store_true", help="run a pinned path that a gate refuses")
    parser.add_argument("--max-kld", type=float, default=DEFAULT_MAX_KLD, metavar="NATS",
                        help="speed trades quality only within this measured mean KL divergence per token "
                             f"(default {DEFAULT_MAX_KLD}: just above llama.cpp's plain 4-bit formats); "
                             "measurements are edge-eval's records in the cache directory")
    parser.add_argument("--evaluate", action="store_true",
                        help="first measure the plan (and a runner-up with other weights) with edge-eval: converts "
                             "and scores on this CPU, minutes; needs torch. The plan then quotes the measurement")
    parser.add_argument("--calibration", metavar="FILE",
                        help="rank from this calibration record (edge-calibrate's JSON) instead of looking one up; "
                             "by default a record of this CPU in the cache directory is used when there is one")
    parser.add_argument("--calibrate", action="store_true",
                        help="first time the candidate kernels on this CPU at the model's shapes (edge-calibrate, "
                             "about a minute; needs torch), then plan from those times")
    parser.add_argument("--json", action="store_true", help="print the Plan as JSON")
    return parser  # fmt: skip


def _device(path: str | None):
    if path is None:
        from edge.device.probe import probe

        return probe()
    from edge.device.describe import load_device_file

    return load_device_file(path)


def _model(path: str | None):
    from edge.model.reader import default_model, read_model

    return default_model() if path is None else read_model(path)


def plan_from_args(args: argparse.Namespace) -> Plan:
    from edge.device.calibration import load_file
    from edge.device.describe import parse_size
    from edge.plan.inputs import gather

    budget = parse_size(args.memory_budget, "--memory-budget") if args.memory_budget else None
    device, model = _device(args.device), _model(args.model)
    # --calibration FILE as given; otherwise the newest cached record of this CPU (edge-calibrate's, or one a fleet
    # planner stored there), preferring one that timed this model
    inputs = gather(device, model, calibration=load_file(args.calibration) if args.calibration else None)
    return inputs.plan(
        priority=args.priority, budget_bytes=budget, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, path=args.path, layout=args.layout, force=args.force, max_kld=args.max_kld,
        serving_mode=args.serving_mode, threads=args.threads, speculative=args.speculative,
    )  # fmt: skip


def calibrate(args: argparse.Namespace) -> None:
    """edge-calibrate in a child process (edge/ never imports torch); its record lands in the cache."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise InputError("--calibrate", True, "torch installed (the project's vllm extra): edge-calibrate runs kernels")
    if args.device is not None:
        raise InputError("--calibrate", args.device, "no --device: a calibration times this host's CPU")
    command = [sys.executable, "-m", "kernels.calibrate.calibrate", "--json"]
    command += ["--model", args.model] if args.model else []
    print("edge-select: timing the kernels on this CPU (edge-calibrate)", file=sys.stderr)
    _run(command, "edge-calibrate", "--calibrate")


def _quality(plan: Plan) -> str:
    quality = plan.quality
    if quality is None or quality.record is None:
        return f"{quality.status if quality else 'unmeasured'}: {quality.note if quality else ''}"
    r = quality.record
    return (f"mean KLD {r.kld_mean:.4f} +- {r.kld_mean_se:.4f}, top-1 {r.top1_agreement:.1%} +- "
            f"{r.top1_agreement_se:.1%}, perplexity ratio {r.ppl_ratio:.3f}, confident flips "
            f"{r.confident_flip_rate:.2%} ({quality.note})")  # fmt: skip


def _timed(plan: Plan) -> str:
    ref = plan.calibration
    if ref is None:
        return "no calibration of this CPU: ranked from the facts table (edge-select --calibrate times it)"
    return (f"kernels timed on {ref.cpu_model}, {ref.measured_at[:10]}, {ref.threads} thread"
            f"{'s' if ref.threads != 1 else ''}" + (f", {ref.model}'s shapes" if ref.model else "")
            + f" (calibration {ref.key})")  # fmt: skip


def _gib(n: int | None) -> str:
    return "unknown" if n is None else format_bytes(n)


def _held(memory) -> str:
    """The resident items by what they are, largest first, the file-backed ones marked: where the memory goes."""
    held: dict[str, list[int]] = {}  # label -> [anonymous, file-backed]
    for item in memory.items:
        if item.phase == "resident":
            label = "weights" if item.layer else item.kind.replace("-", " ")
            held.setdefault(label, [0, 0])[item.backing == "file"] += item.bytes
    parts = sorted(held.items(), key=lambda kv: -sum(kv[1]))
    return ", ".join(f"{label} {_gib(anon + file)}" + (" mapped" if file and not anon else f" ({_gib(file)} mapped)"
                                                       if file else "") for label, (anon, file) in parts)  # fmt: skip


def _refused(plan: Plan) -> list[str]:
    """One line per path the device cannot run, naming its layouts: "w4a16-tinygemm (direct, dual): why"."""
    by_path: dict[str, dict[str, list[str]]] = {}  # path -> why_not -> layouts, in the plan's order
    for alt in plan.alternatives:
        if alt.status == "incompatible":
            layouts = by_path.setdefault(alt.path, {}).setdefault(alt.why_not, [])
            if alt.layout:
                layouts.append(alt.layout)
    lines = []
    for path, refusals in by_path.items():
        if len(refusals) == 1:  # the usual case: every layout refused for the same reason
            [(why, layouts)] = refusals.items()
            named = f" ({', '.join(layouts)})" if layouts else ""
            lines.append(f"{path}{named}: {why}")
        else:
            lines.append(f"{path}: " + "; ".join(f"{', '.join(layouts)}: {why}" for why, layouts in refusals.items()))
    return lines


def render(plan: Plan) -> str:
    """The short human summary: chosen path, memory line, top reasons, runner-up, warnings."""
    device, memory = plan.device, plan.memory
    where = device.name or ("this host" if device.described_by == "probe" else "the described device")
    isa = ", ".join(device.isa.value or []) or "unknown ISA"
    layout = f"  layout {plan.layout}" if plan.layout else ""
    group = f"  group {plan.group_size}" if plan.group_size else ""
    fits = "fits" if memory.fits else "DOES NOT FIT"
    lines = [
        f"{plan.model.name} on {where}: {device.cpu_model.value or 'unknown CPU'} "
        f"[{device.isa_class}: {isa}], {device.compute_cores or '?'} cores, {_gib(device.usable_memory_bytes)} usable",
        f"  path      {plan.path}{layout}{group}  (priority {plan.priority})",
        f"  verified  {'yes' if plan.verified else 'no'}: {plan.verified_detail}",
        f"  quality   {_quality(plan)}",
        f"  timed     {_timed(plan)}",
        f"  memory    resident {_gib(memory.resident_bytes)}, load peak {_gib(memory.peak_bytes)}, "
        f"budget {_gib(memory.budget_bytes)}: {fits}",
        f"  held      {_held(memory)} (mapped: from a file, page cache the system can share and evict)",
    ]  # fmt: skip
    if plan.vllm is not None:
        env = " ".join(f"{k}={v}" for k, v in sorted(plan.vllm.env.items()))
        lines.append(f"  vllm      {env} {shlex.join(plan.vllm.command('MODEL_DIR'))}")  # the JSON arg quoted
    if (spec := plan.speculative) is not None and plan.vllm is not None:
        drafted = (f"{spec.method}, {spec.num_speculative_tokens} drafted tokens a step" if spec.method != "off"
                   else "off")  # fmt: skip
        lines.append(f"  drafting  {drafted}: {spec.reasons[0].text if spec.reasons else ''}")
    if plan.export is not None:  # PLAN.json: this plan, saved with --json
        e = plan.export
        lines.append(f"  export    {e.command_line()}  ({e.runtime} {e.format}, {e.weight_bits}-bit weights per "
                     f"{e.weight_block}, bundle ~{_gib(e.bundle_bytes)}; PLAN.json is this plan, --json)")  # fmt: skip
    lines.append("  why")
    lines += [f"    - {r.text}" + (f" [{r.value:g} {r.unit}, {r.source}]" if isinstance(r.value, float) else "")
              for r in plan.reasons[:5]]  # fmt: skip
    runner_up = next((a for a in plan.alternatives if a.status != "incompatible"), None)
    if runner_up is not None:
        label = runner_up.path + (f"/{runner_up.layout}" if runner_up.layout else "")
        hint = f" (hint: {runner_up.hint})" if runner_up.hint else ""
        lines.append(f"  runner-up {label}: {runner_up.status}, {runner_up.why_not}{hint}")
    lines += [f"  not here  {refused}" for refused in _refused(plan)]
    lines += [f"  warning   {w}" for w in plan.warnings]
    if not memory.fits:
        hints = [f"{a.path}{'/' + a.layout if a.layout else ''} with {a.hint}" for a in plan.alternatives if a.hint]
        lines.append("  to fit    " + ("; ".join(hints) if hints else "a larger --memory-budget"))
    return "\n".join(lines)


def evaluate(args: argparse.Namespace, plan: Plan) -> None:
    """edge-eval the plan and the first runnable alternative whose weights differ (a child process: edge/ never
    imports torch); the records land in the cache, where the next plan_from_args reads them."""
    import importlib.util
    import tempfile
    from pathlib import Path

    from edge.catalog.weight_paths import PATHS
    from edge.measure.quality import quality_key

    if importlib.util.find_spec("torch") is None:
        raise InputError("--evaluate", True, "torch installed (the project's vllm extra): edge-eval runs the kernels")
    from edge.model.reader import is_gguf, resolve_model

    if args.model is not None and not (resolve_model(args.model).is_dir() or is_gguf(resolve_model(args.model))):
        raise InputError("--model", args.model, "a model directory with weights, or a .gguf, when --evaluate is given")
    source = str(resolve_model(args.model)) if args.model else _run(
        [sys.executable, "-m", "kernels.source.default_model", "default"], "edge-model default")
    plans, seen = [plan], [quality_key(plan.path, plan.quantization_config)]
    for alt in plan.alternatives:
        if len(plans) > 1 or alt.status != "runnable" or not PATHS[alt.path].quantizes_weights:
            continue
        other = plan_from_args(argparse.Namespace(**{**vars(args), "path": alt.path, "layout": alt.layout}))
        if quality_key(other.path, other.quantization_config) not in seen:  # layouts share weights: one is enough
            plans.append(other)
    for candidate in plans:
        if candidate.quantization_config is None:
            continue  # bf16 is the reference
        with tempfile.NamedTemporaryFile("w", suffix=".plan.json", delete=False) as f:
            f.write(candidate.model_dump_json())
        try:
            print(f"edge-select: evaluating {candidate.path}/{candidate.layout} (edge-eval)", file=sys.stderr)
            _run([sys.executable, "-m", "kernels.evaluate.evaluate", source, "--plan", f.name, "--json", "--quiet"],
                 "edge-eval")
        finally:
            Path(f.name).unlink(missing_ok=True)


def _run(command: list[str], what: str, option: str = "--evaluate") -> str:
    import subprocess

    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise InputError(option, what, f"a successful run ({last})")
    return done.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.calibrate:
            calibrate(args)
        plan = plan_from_args(args)
        if args.evaluate:
            evaluate(args, plan)
            plan = plan_from_args(args)
    except InputError as error:
        print(f"edge-select: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        print(plan.model_dump_json(indent=2) if args.json else render(plan), flush=True)
    except BrokenPipeError:  # `edge-select | head`: the reader left; that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK if plan.memory.fits else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())
