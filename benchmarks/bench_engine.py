"""vLLM engine benchmark: bf16 vs cpu_int4 direct / dual / kernel-only (vs W4A8 where the host runs it), side by
side, interleaved passes; optionally the decode kernels of cpu_int4 direct side by side and llama.cpp on the same
model's GGUF.

    .venv/bin/python -m benchmarks.bench_engine --models default,random-1b --passes 2
    .venv/bin/python -m benchmarks.bench_engine --models default \
        --variants direct-tinygemm,direct-avx2,direct-avx2-w4a8,llama.cpp --passes 2

VARIANT+1proc (e.g. direct-avx2-w4a8+1proc): that variant's checkpoint with the engine core and worker in the
measuring process (VLLM_ENABLE_V1_MULTIPROCESSING=0), as llama-cpp-python runs; plain variants run vLLM's three
processes (front end, engine core, worker: how `vllm serve` runs on CPU), which hand every decode step on.

direct-tinygemm / direct-avx2 / direct-avx2-w4a8: the speed plan's direct checkpoint with quantization_config's
decode_kernel set to tinygemm, the AVX2 int16-activation kernel or the int8-activation one (kernels/ops/avx2_int4.cpp);
direct-int8-channel: the same with its 8-bit set per channel (no int8_group_size), against `direct`'s per group.
llama.cpp: benchmarks/llama_cpp_decode.py at the same thread count on the default model's Q4_1 GGUF (the source
the default model is built from), measured as the engine is: decode after a 6-token prompt, a 512-token prefill,
best of 2; it needs the separate llama-cpp-python venv that module names (skipped with the reason without it).

Each (model, variant, pass) is one fresh child process (`--child`) that starts vLLM (compiled, not eager),
measures, and prints one JSON line; this driver (no torch import) samples RssAnon summed over the child's
process tree every 0.25 s through the whole run. Pass 1 starts every variant against an empty
VLLM_CACHE_ROOT (cold: compile), pass 2+ against the cache pass 1 filled (warm); variants are interleaved
within a pass so background load hits all of them alike.

Measured per run:
    start_s      LLM() construction (load + compile or cache load + warmup), and import_s before it
    decode       tok/s of one sequence: (65-token generate - 1-token generate) / 64, best of 2
    prefill      tok/s of one 512-token prompt (max_tokens=1, prefix caching off), best of 2
    rss peak     max RssAnon over the tree, start to exit
    rss settled  RssAnon after the engine is ready and idle (median of samples over 3 s; benchmarks/rss.py)
    tokens       greedy tokens of the decode run that match bf16's before the first divergence (the prompt is 6
                 arbitrary token ids: a smoke check of the compiled path, not a fidelity measure)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from benchmarks.rss import TreeSampler

CACHE = Path(os.environ.get("EDGE_SELECT_CACHE_DIR", Path.home() / ".cache/edge-select"))
VARIANTS = ("bf16", "direct", "dual", "kernel-only", "w4a8")
W4A8 = "w4a8"  # the w4a8-gptq plan for this host: the plugin's cpu_w4a8 without AMX, vLLM's gptq with it
# vLLM's log lines that say what happened to the compile cache (compilation/decorators.py).
AOT_MARKERS = {
    "saved AOT compiled function": "compiled",
    "Compiling model again due to a load failure": "recompiled (load failed)",
    "Directly load AOT compilation": "loaded",
}
# bf16 with kernels/vllm_plugin/compile_cache.py's fix switched off: the same cache, so pass 2 compares warm starts.
NOFIX = "bf16-nofix"
# The direct checkpoint with each decode kernel (edge.catalog.kernel_registry.DECODE_KERNELS), and with the 8-bit set
# per channel instead of the plan's per group (int8_group_size, a GGUF-built model's): quantization_config edits, a
# None value dropping the key (a tinygemm checkpoint names no decode_kernel).
DECODE_VARIANTS = {"direct-tinygemm": {"decode_kernel": None}, "direct-avx2": {"decode_kernel": "avx2"},
                   "direct-avx2-w4a8": {"decode_kernel": "avx2-w4a8"},
                   "direct-int8-channel": {"int8_group_size": None}}  # fmt: skip
LLAMA = "llama.cpp"
# Any vLLM variant with this suffix: the same checkpoint, with the engine core and its worker in the LLM's own
# process (VLLM_ENABLE_V1_MULTIPROCESSING=0), as llama-cpp-python runs; without it vLLM runs a front end, an
# engine core and a worker process that hand each step on (the only way `vllm serve` runs on CPU).
ONE_PROCESS = "+1proc"
KV_BYTES = 128 << 20
PREFILL_TOKENS = 512
DECODE_TOKENS = 64


# --- driver side (no torch) ---------------------------------------------------------------------------------


def run_child(model: str, variant: str, cache_root: Path, log: Path) -> dict:
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache_root)}
    if variant.endswith(ONE_PROCESS):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if variant == NOFIX:
        env["EDGE_SELECT_COMPILE_CACHE_FIX"] = "0"
    with open(log, "a") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_engine", "--child", model],
            env=env, stdout=subprocess.PIPE, stderr=log_file, text=True,
        )  # fmt: skip
        sampler = TreeSampler(proc.pid, interval_s=0.25).start()
        result: dict = {}
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                if not line.startswith('{"event"'):  # vLLM logs to stdout too
                    log_file.write(line)
                    for marker, status in AOT_MARKERS.items():
                        if marker in line and not result.get("aot", "").startswith("recompiled"):
                            result["aot"] = status  # a failed load then saves anew: keep "recompiled"
                    continue
                event = json.loads(line)
                event["t"] = time.monotonic()
                result.setdefault("events", []).append(event)
            proc.wait()
        finally:  # never leave an engine running behind a crashed driver
            if proc.poll() is None:
                proc.kill()
            sampler.stop()
    result["returncode"] = proc.returncode
    events = {e["event"]: e for e in result.get("events", [])}
    result.update(events.get("done", {}))
    result["rss_peak"] = sampler.peak_bytes
    if "ready" in events and "idle_end" in events:
        lo, hi = events["ready"]["t"], events["idle_end"]["t"]
        idle = [s for t, s in sampler.samples if lo <= t <= hi]
        result["rss_settled"] = int(statistics.median(idle)) if idle else None
    return result


def prepare(models: list[str], variants: list[str] | None = None) -> dict[tuple[str, str], str]:
    """Model dirs per (model, variant): bf16 sources and their cpu_int4 conversions (cached); only the variants
    asked for (None: all)."""

    def wanted(variant: str) -> bool:
        return variants is None or variant in variants or variant + ONE_PROCESS in variants

    from edge.device.probe import probe
    from edge.model.reader import read_model
    from edge.plan.planner import make_plan
    from kernels.convert.convert import convert

    sources: dict[str, Path] = {}
    for name in models:
        if name == "default":
            from kernels.source.default_model import ensure_default_model

            sources[name] = ensure_default_model()
        elif name == "random-1b":
            target = CACHE / "bench" / "random-llama-1b"
            if not (target / "config.json").exists():
                from benchmarks.make_random_llama import PRESETS, write

                write(target, PRESETS["1b"])
            sources[name] = target
        else:
            sources[name] = Path(name)
    dirs: dict[tuple[str, str], str] = {}
    for name, src in sources.items():
        dirs[(name, "bf16")] = dirs[(name, NOFIX)] = str(src)
        device, shape = probe(), read_model(src)
        for layout in (v for v in VARIANTS[1:4] if wanted(v)):
            # what a speed plan for this host writes for that layout (group, source codes, 8-bit set, kernel values)
            qconfig = make_plan(device, shape, path="w4a16-tinygemm", layout=layout).quantization_config
            dst = CACHE / "bench" / f"{src.name}-{layout}"
            dirs[(name, layout)] = str(convert(src, dst, qconfig, path="w4a16-tinygemm", force=True))
        direct = make_plan(device, shape, path="w4a16-tinygemm", layout="direct").quantization_config
        for variant, edits in ((v, e) for v, e in DECODE_VARIANTS.items() if wanted(v)):
            qconfig = {key: value for key, value in direct.items() if key not in edits}
            qconfig.update({key: value for key, value in edits.items() if value is not None})
            dst = CACHE / "bench" / f"{src.name}-{variant}"
            dirs[(name, variant)] = str(convert(src, dst, qconfig, path="w4a16-tinygemm", force=True))
        if name == "default" and wanted(LLAMA):
            from kernels.source.default_model import source_gguf

            dirs[(name, LLAMA)] = str(source_gguf())
        w4a8 = make_plan(device, shape, path="w4a8-gptq", force=True)
        if not w4a8.forced and wanted(W4A8):  # forced: the gate refuses W4A8 here (AVX2: no int4_scaled_mm_cpu)
            dst = CACHE / "bench" / f"{src.name}-{W4A8}"
            dirs[(name, W4A8)] = str(convert(src, dst, w4a8.quantization_config, path="w4a8-gptq", force=True))
        for (model, variant), directory in list(dirs.items()):
            if model == name and variant != LLAMA:
                dirs[(name, variant + ONE_PROCESS)] = directory
    return dirs


def weights_bytes(model_dir: str) -> int:
    path = Path(model_dir)
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.glob("*.safetensors"))


def run_llama(gguf: str) -> dict:
    """llama.cpp on the GGUF, measured as the engine child measures vLLM (see the module docstring)."""
    from benchmarks.llama_cpp_decode import DEFAULT_PYTHON, LlamaCppMissing, measure

    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        decode = measure(str(DEFAULT_PYTHON), Path(gguf), threads, 6, DECODE_TOKENS, 2)
        prefill = measure(str(DEFAULT_PYTHON), Path(gguf), threads, PREFILL_TOKENS, 1, 2)
    except LlamaCppMissing as missing:
        return {"returncode": 1, "error": str(missing)}
    best = [max(p[phase] for p in run["runs"]) for run, phase in ((decode, "decode_tok_s"),
                                                                   (prefill, "prefill_tok_s"))]  # fmt: skip
    return {"returncode": 0, "decode": best[0], "prefill": best[1], "threads": threads,
            "system_info": decode.get("system_info"), "rss_peak": 0}  # fmt: skip


# --- child side (starts vLLM) -------------------------------------------------------------------------------


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def child(model: str) -> None:
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams

    t1 = time.monotonic()
    llm = LLM(
        model=model, skip_tokenizer_init=True, max_model_len=1024, kv_cache_memory_bytes=KV_BYTES,
        max_num_seqs=4, enable_prefix_caching=False, seed=0,
    )  # fmt: skip
    t2 = time.monotonic()
    emit("ready")
    time.sleep(3.0)
    emit("idle_end")
    vocab = llm.llm_engine.vllm_config.model_config.hf_config.vocab_size

    def timed(prompt: list[int], tokens: int) -> tuple[float, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
        start = time.monotonic()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.monotonic() - start, list(out[0].outputs[0].token_ids)

    short = [1, 415, 5565, 302, 4843, 349]  # a fixed 6-token prompt
    decode, prefill = [], []
    tokens: list[int] = []
    for rep in range(2):
        one, _ = timed(short, 1)
        many, tokens = timed(short, DECODE_TOKENS + 1)
        decode.append(DECODE_TOKENS / (many - one))
        prompt = [(7919 * (i + 1) * (rep + 3)) % (vocab - 10) + 5 for i in range(PREFILL_TOKENS)]
        seconds, _ = timed(prompt, 1)
        prefill.append(PREFILL_TOKENS / seconds)
    quant = llm.llm_engine.vllm_config.model_config.quantization
    emit("done", import_s=round(t1 - t0, 1), start_s=round(t2 - t1, 1), decode=max(decode),
         prefill=max(prefill), quantization=quant, greedy=tokens)  # fmt: skip
    llm.llm_engine.engine_core.shutdown()


# --- report --------------------------------------------------------------------------------------------------


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def report(results: list[dict], dirs: dict, models: list[str], header: str) -> str:
    lines = [header, ""]
    for name in models:
        lines += [f"## {name}", "",
                  "| variant | weights MB | decode tok/s | prefill@512 tok/s | start cold s | start warm s "
                  f"| RssAnon peak MB | RssAnon settled MB | tokens = bf16 (of {DECODE_TOKENS + 1}) "
                  "| compile cache by pass |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        bf16_greedy = next((r.get("greedy") for r in results if r["model"] == name and r["variant"] == "bf16"), None)
        asked = {r["variant"] for r in results if r["model"] == name}
        order = [v + suffix for v in (*VARIANTS, NOFIX, *DECODE_VARIANTS) for suffix in ("", ONE_PROCESS)] + [LLAMA]
        for variant in (v for v in order if v in asked):
            runs = [r for r in results if r["model"] == name and r["variant"] == variant and r["returncode"] == 0]
            if not runs and variant.removesuffix(ONE_PROCESS) in (NOFIX, W4A8, *DECODE_VARIANTS, LLAMA):
                continue
            if not runs:
                lines.append(f"| {variant} | | (no successful run) | | | | | | | |")
                continue
            # bf16-nofix always finds the cache bf16 just filled: every one of its starts is a warm start.
            cold = [r.get("start_s") for r in runs if r["pass"] == 1 and variant != NOFIX]
            warm = [r.get("start_s") for r in runs if r["pass"] > 1 or variant == NOFIX]
            greedy = runs[-1].get("greedy") or []
            same = 0
            for a, b in zip(greedy, bf16_greedy or [], strict=False):
                if a != b:
                    break
                same += 1

            def fmt(value, digits=1):
                return "" if value is None else f"{value:.{digits}f}"

            lines.append(
                f"| {variant} | {weights_bytes(dirs[(name, variant)]) / 1e6:.0f} "
                f"| {fmt(median([r['decode'] for r in runs]))} | {fmt(median([r['prefill'] for r in runs]), 0)} "
                f"| {fmt(median(cold))} | {fmt(median(warm))} "
                f"| {fmt(median([r['rss_peak'] / 2**20 for r in runs if r.get('rss_peak')]), 0)} "
                f"| {fmt(median([r['rss_settled'] / 2**20 for r in runs if r.get('rss_settled')]), 0)} "
                f"| {same if bf16_greedy else ''} | {', '.join(r.get('aot', '?') for r in runs)} |"
            )
        lines.append("")
        bf16 = [r for r in results if r["model"] == name and r["variant"] == "bf16" and r.get("rss_settled")]
        if bf16:
            settled = median([r["rss_settled"] for r in bf16])
            weights = weights_bytes(dirs[(name, "bf16")])
            lines += [f"Engine baseline ({name}, bf16): settled RssAnon {settled / 2**20:.0f} MiB - weights "
                      f"{weights / 2**20:.0f} MiB - KV cache {KV_BYTES / 2**20:.0f} MiB = "
                      f"{(settled - weights - KV_BYTES) / 2**20:.0f} MiB", ""]  # fmt: skip
    return "\n".join(lines)


def write_report(stamps: list[str], work: Path, out: Path) -> None:
    """One report from the raw results of one or more runs (e.g. models benchmarked by parallel drivers)."""
    results = [r for stamp in stamps for r in json.loads((work / f"{stamp}.json").read_text())]
    models = list(dict.fromkeys(r["model"] for r in results))
    dirs: dict[tuple[str, str], str] = {}
    for name in models:
        dirs.update(prepare([name], list({r["variant"] for r in results if r["model"] == name})))
    raws = ", ".join(str(work / f"{stamp}.json") for stamp in stamps)
    header = f"# Engine benchmark, {date.today()}\n\nvLLM 0.28 CPU, {host()}, vLLM runs 1 thread. Raw results: {raws}."
    out.write_text(report(results, dirs, models, header))


def host() -> str:
    """This host as the probe sees it: CPU model, ISA class, cores (every published number names its CPU)."""
    from edge.device.probe import probe

    device = probe(measure_layout=False)
    return f"{device.cpu_model.value} ({device.isa_class}, {device.compute_cores} cores)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--models", default="default,random-1b", help="comma list: default, random-1b, or dirs")
    # int4 first: a broken method shows in minutes; bf16-nofix right after bf16, whose cache it then finds.
    parser.add_argument("--variants", default=",".join((*VARIANTS[1:], VARIANTS[0], NOFIX)))
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--work", type=Path, default=CACHE / "bench" / "runs")
    parser.add_argument("--report", type=Path, default=Path(f"docs/reports/{date.today()}-engine.md"))
    parser.add_argument("--resume", metavar="STAMP", help="continue run STAMP: its caches and results; skip done runs")
    parser.add_argument("--report-only", metavar="STAMP,...", help="write the report from finished runs and exit")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    if args.report_only:
        write_report(args.report_only.split(","), args.work, args.report)
        return
    models = args.models.split(",")
    variants = args.variants.split(",")
    dirs: dict[tuple[str, str], str] = {}
    args.work.mkdir(parents=True, exist_ok=True)
    stamp = args.resume or time.strftime("%Y%m%d-%H%M%S")
    raw = args.work / f"{stamp}.json"
    results: list[dict] = json.loads(raw.read_text()) if args.resume else []
    done = {(r["model"], r["variant"], r["pass"]) for r in results if r.get("returncode") == 0}
    report_models = list(dict.fromkeys([*(r["model"] for r in results), *models]))
    for earlier in set(report_models) - set(models):
        dirs.update(prepare([earlier], variants))  # already converted: the converter only checks its manifest
    for name in models:
        dirs.update(prepare([name], variants))  # per model: the first model's runs need not wait for the next one's
        cache_root = args.work / f"{stamp}-{name}-vllm-cache"  # one per model, empty at pass 1
        for pass_ in range(1, args.passes + 1):
            for variant in variants:
                if variant == NOFIX and name != "default" or (name, variant, pass_) in done:
                    continue  # the fix is measured on the default model only (engine starts are minutes each)
                if (name, variant) not in dirs:
                    print(f"{variant}: not runnable on this host (its gate refuses it), skipped", file=sys.stderr)
                    continue
                print(f"[{time.strftime('%H:%M:%S')}] {name} {variant} pass {pass_}", file=sys.stderr, flush=True)
                if variant == LLAMA:
                    result = run_llama(dirs[(name, variant)])
                else:
                    result = run_child(dirs[(name, variant)], variant, cache_root, args.work / f"{stamp}.log")
                result.update(model=name, variant=variant, **{"pass": pass_})
                result.pop("events", None)
                results.append(result)
                raw.write_text(json.dumps(results, indent=1))
                args.report.parent.mkdir(parents=True, exist_ok=True)
                header = (f"# Engine benchmark, {date.today()}\n\nvLLM 0.28 CPU, {host()}, vLLM runs 1 thread. Raw "
                          f"results: {raw}. Command: `{' '.join(sys.argv)}`")  # fmt: skip
                args.report.write_text(report(results, dirs, report_models, header))


if __name__ == "__main__":
    main()
