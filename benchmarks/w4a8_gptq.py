"""W4A8 on the default model, rounded to nearest against GPTQ with activation smoothing (issue 47): quality through
vLLM's int4 x int8 kernel (edge-eval), conversion time and peak memory, each variant converted and measured in turn.

    .venv/bin/python -m benchmarks.w4a8_gptq [--tokens 16384] [--variants nearest,gptq] [--alphas 0.5,none]
        [--held-out FILE] [--json OUT]

Variants, all on the w4a8-gptq path this host plans (`edge-select --path w4a8-gptq`), differing only in how the
4-bit linears are rounded:
    nearest        what the plan writes: symmetric, group 64, scales searched per group, no calibration
    gptq           edge.plan.engine_config.W4A8_ROUNDING: GPTQ after smoothing at alpha 0.6, asymmetric group 32,
                   16 calibration windows
    gptq@A         the same at smoothing alpha A (--alphas); gptq@none without smoothing

Each is converted by `edge-convert` into a temporary directory while benchmarks/rss.py samples the process tree's
RssAnon (peak reported), then scored by `edge-eval` (the default text, Opticks; --held-out FILE scores `nearest` and
`gptq` on another text too: prose the calibration never saw, in another domain). The calibration windows are the
default text's last ones and edge-eval scores its first ones, so the default-text score is held out as well.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.host import cpu_model_name
from benchmarks.rss import run_sampled
from edge.plan.engine_config import W4A8_ROUNDING, W4A8_SOLVED_GROUP

MIB = 1 << 20
BIN = Path(sys.executable).parent
ROUNDING_KEYS = ("rounding", "smoothing", "calibration_windows")


def plan_json() -> dict:
    out = subprocess.run([str(BIN / "edge-select"), "--path", "w4a8-gptq", "--json"], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return json.loads(out)


def variant_plan(plan: dict, name: str) -> dict:
    """The plan with its quantization_config's rounding changed as the variant says (module docstring)."""
    plan = json.loads(json.dumps(plan))
    qconfig = plan["quantization_config"]
    if name == "nearest":
        for key in ROUNDING_KEYS:
            qconfig.pop(key, None)
        qconfig.update(group_size=64, sym=True, checkpoint_format="gptq")
    elif name == "gptq" or name.startswith("gptq@"):
        qconfig.update(group_size=W4A8_SOLVED_GROUP, sym=False, checkpoint_format="gptq_v2", **W4A8_ROUNDING)
        alpha = name.split("@", 1)[1] if "@" in name else None
        if alpha == "none":
            qconfig.pop("smoothing")
        elif alpha is not None:
            qconfig["smoothing"] = float(alpha)
    else:
        raise SystemExit(f"unknown variant {name!r}")
    return plan


def convert(source: Path, plan: dict, work: Path) -> dict:
    (work / "plan.json").write_text(json.dumps(plan))
    dst = work / "converted"
    run = run_sampled([str(BIN / "edge-convert"), str(source), str(dst), "--plan", str(work / "plan.json")])
    if run.returncode != 0:
        raise SystemExit(f"edge-convert failed:\n{run.output[-3000:]}")
    return {"dir": dst, "wall_s": round(run.wall_s, 1), "peak_rss_anon_mib": round(run.sampler.peak_bytes / MIB)}


def evaluate(source: Path, candidate: Path, tokens: int, text: Path | None) -> dict:
    argv = [str(BIN / "edge-eval"), str(source), str(candidate), "--tokens", str(tokens), "--json", "--quiet",
            "--no-cache"] + (["--text", str(text)] if text else [])  # fmt: skip
    report = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
    metrics = report["metrics"]
    return {name: {"value": round(metrics[name]["value"], 5), "se": round(metrics[name]["se"], 5)}
            for name in ("mean_kld", "top1_agreement", "ppl_ratio", "confident_flip_rate")}  # fmt: skip


def row(name: str, result: dict, which: str = "default") -> str:
    m = result[which]
    return (f"| {name} | {m['mean_kld']['value']:.4f} ± {m['mean_kld']['se']:.4f} | "
            f"{100 * m['top1_agreement']['value']:.1f} ± {100 * m['top1_agreement']['se']:.1f} % | "
            f"{m['ppl_ratio']['value']:.3f} | {100 * m['confident_flip_rate']['value']:.2f} % | "
            f"{result['wall_s']:.0f} s | {result['peak_rss_anon_mib']} MiB |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--variants", default="nearest,gptq", help="comma-separated (module docstring)")
    parser.add_argument("--alphas", default="", help="extra smoothing strengths, comma-separated (none: no smoothing)")
    parser.add_argument("--held-out", type=Path, help="a second text, scored for nearest and gptq")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from kernels.source.default_model import ensure_default_model

    source = ensure_default_model(log=lambda message: None)
    plan = plan_json()
    variants = [v for v in args.variants.split(",") if v] + [f"gptq@{a}" for a in args.alphas.split(",") if a]
    results: dict[str, dict] = {}
    for name in variants:
        work = Path(tempfile.mkdtemp(prefix="w4a8-gptq-"))
        try:
            converted = convert(source, variant_plan(plan, name), work)
            result = {key: value for key, value in converted.items() if key != "dir"}
            result["default"] = evaluate(source, converted["dir"], args.tokens, None)
            if args.held_out and name in ("nearest", "gptq"):
                result["held_out"] = evaluate(source, converted["dir"], args.tokens, args.held_out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        results[name] = result
        print(json.dumps({name: result}), flush=True)
    out = {"cpu": cpu_model_name(), "tokens": args.tokens, "held_out": str(args.held_out) if args.held_out else None,
           "quantization_config": plan["quantization_config"], "variants": results}  # fmt: skip
    print(f"\n{out['cpu']}, the default model, {args.tokens} scored tokens (edge-eval through int4_scaled_mm_cpu)\n")
    print("| variant | mean KLD | top-1 | PPL ratio | confident flips | conversion | conversion peak RssAnon |")
    print("|---|---|---|---|---|---|---|")
    for name, result in results.items():
        print(row(name, result))
    if args.held_out:
        print(f"\nheld out ({args.held_out.name}):\n")
        for name in ("nearest", "gptq"):
            if name in results:
                print(row(name, results[name], "held_out"))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
