"""The plan's memory ledger against what edge-serve's engine holds, per serving mode, and where it goes (issues 23, 44).

    .venv/bin/python -m benchmarks.ledger_vs_rss [--modes one-process,two-process,three-process] [--passes 1]
        [--model DIR|GGUF] [--path PATH] [--variant-env K=V,...] [--cold] [--json OUT]

For each (pass, mode), interleaved: `edge-serve --priority speed --serving-mode MODE` (bench_serve's launcher)
starts fresh; RssAnon is sampled every 0.25 s over its whole process tree from launch to stop (benchmarks/rss.py),
and over the tree less the wrapper's own process, which is what the ledger predicts (the engine: vLLM's
processes and the watchdog). Once ready, the plan's context is filled (one prompt of about max_model_len - 64 tokens
and 48 generated: the KV pool is one context the streams share, edge.catalog.shape_rules.kv_tokens_per_layer), then
max_num_seqs concurrent streams of 128 tokens. Then 5 s of idle give the settled figure. Compared with the plan's own
ledger as /status reports it: resident less its file-backed items (the weights the engine maps,
kernels/vllm_plugin/mapped_weights.py) against settled RssAnon; the peak against the engine's peak of RssAnon plus
the RssFile it gained after loading its libraries (total_peak_bytes: the weights are anonymous while they load and
mapped once loaded, and the ledger's peak counts both); the file-backed items against what the engine's RssFile
grew by when it mapped them (`mapped_file_mib`). A conversion the plan needs is run before the timed starts
(`edge-serve --dry-run`), so the peak is the engine's load, not the converter's.

Where it goes: the engine process writes its RssAnon after each phase of its start (EDGE_MEMORY_TRACE,
kernels/vllm_plugin/memory_trace.py): imports, load (the weights as loaded and repacked), warm-up (the compiled
model loaded or compiled, and a dummy run), kv-cache, ready (after the heap trim). The rows add what the API server
held more by the time it answered /readyz, what serving the workload left (activations, logits and sampler buffers,
the allocator's retention), and the wrapper's and the watchdog's own processes.

Each row also gives the engine baseline this run implies: the engine's settled RssAnon less every other resident
item of the ledger (what benchmarks/engine_baseline.py measures on the bf16 path, for the facts table). `--cold`
removes the plan's vLLM compile cache before each mode's first pass, so that pass compiles (a box's first start)
and the later ones load the cache (every start after it); the summary gives the difference, which the compiling
process keeps for its lifetime. `--variant-env` starts every server with these variables too (the plugin's off
switches: EDGE_HEAP_TRIM=0, EDGE_DECODE_COPY_ONLY=0).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from benchmarks.bench_serve import ROOT, concurrent, edge_argv, edge_server, long_prompt
from benchmarks.rss import TreeSampler, process_tree, rss_anon_bytes, tree_rss_anon_bytes
from edge.paths import resolve

MIB = 2**20
trace_env = "EDGE_MEMORY_TRACE"  # kernels/vllm_plugin/memory_trace.py ENV (imported there, not here: no vLLM here)


def _env_pairs(text: str) -> dict[str, str]:
    pairs = dict(pair.split("=", 1) for pair in text.split(",") if pair)
    if not all(k.startswith(("EDGE_", "MALLOC_")) for k in pairs):  # the plugin's switches, glibc's malloc tunables
        raise argparse.ArgumentTypeError(f"expected EDGE_ or MALLOC_ variables, got {text!r}")
    return pairs


def fill_context(url: str, model: str, tokenizer, max_model_len: int, seed: int) -> int:
    """One completion whose prompt (about max_model_len - 64 tokens) and 48 generated tokens fill the context. The
    prompt is sized with `tokenizer`; where the served model's own tokenizer makes more tokens of it (a GGUF's, which
    vLLM reads from the file) and the server refuses it (400), it is shortened by a fifth and sent again."""
    target = max_model_len - 64
    for _ in range(5):
        body = {"model": model, "prompt": long_prompt(tokenizer, seed, target), "max_tokens": 48, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
        if response.status_code != 400:
            break
        target = target * 4 // 5
    response.raise_for_status()
    return response.json()["usage"]["total_tokens"]


def rss_anon_mib(pid: int) -> float:
    return rss_anon_bytes(pid) / MIB


def total_peak_bytes(engine: TreeSampler, libraries: int | None = None) -> int:
    """The engine's peak of RssAnon plus its RssFile beyond its libraries: the weights it maps
    (kernels/vllm_plugin/mapped_weights.py), what the ledger's peak counts. `libraries`: RssFile once ready less the
    weights' image (from its EDGE_MEMORY_TRACE); without it, RssFile at the moment RssAnon peaked, which holds only
    the libraries where that peak came while the weights were still anonymous (before they were mapped)."""
    if not engine.samples:
        return 0
    if libraries is None:
        peak_at = max(range(len(engine.samples)), key=lambda i: engine.samples[i][1])
        libraries = engine.file_samples[peak_at][1]
    return max(a + f for (_, a), (_, f) in zip(engine.samples, engine.file_samples, strict=True)) - libraries


def phases(trace: Path, key: str = "rss_anon") -> dict[str, float]:
    """The engine process's RssAnon (or `key`: rss_file) after each start phase (MiB), from its EDGE_MEMORY_TRACE
    lines."""
    lines = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
    return {line["phase"]: line[key] / MIB for line in lines if key in line}


def peak_phase(trace: Path, engine: TreeSampler, wall_offset: float) -> str | None:
    """The start phase the engine's RssAnon peak came in: the first EDGE_MEMORY_TRACE line written after it (the
    phase it peaked during), "serving" after the last, None without samples. `wall_offset` is time.time() less
    time.monotonic() (the trace's clock against the sampler's)."""
    if not engine.samples or not trace.exists():
        return None
    at = max(engine.samples, key=lambda s: s[1])[0] + wall_offset
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    return next((line["phase"] for line in lines if line["t"] >= at), "serving")


def compile_cache(mode: str, args: argparse.Namespace) -> Path:
    """The plan's vLLM cache root (VLLM_CACHE_ROOT: its compile cache lives there)."""
    argv = [str(ROOT / ".venv" / "bin" / "edge-select"), *edge_argv(mode, args)[1:], "--json"]
    plan = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    return Path(resolve(plan["vllm"]["env"]["VLLM_CACHE_ROOT"]))


def one_pass(mode: str, args: argparse.Namespace, tokenizer, seed: int, log: Path) -> dict:
    trace = Path(tempfile.mkstemp(prefix="edge-memory-trace-", suffix=".jsonl")[1])
    trace.unlink()
    server, model, _ = edge_server(mode, args, log, env={**args.variant_env, trace_env: str(trace)})
    try:
        tree = process_tree(server.proc.pid)
        engine_pid = max(tree, key=rss_anon_bytes)  # the process that holds the model (one-process: the API server)
        at_ready = {"engine": rss_anon_mib(engine_pid), "tree": tree_rss_anon_bytes(server.proc.pid) / MIB}
        plan = httpx.get(f"{server.url}/status", timeout=30).json()["plan"]
        args_ = plan["vllm"]["args"]
        seqs, max_len = (int(args_[args_.index(flag) + 1]) for flag in ("--max-num-seqs", "--max-model-len"))
        marks = [time.monotonic()]
        tokens = fill_context(server.url, model, tokenizer, max_len, seed)
        marks.append(time.monotonic())
        concurrent(server.url, model, seqs, 128)
        idle_from = time.monotonic()
        marks.append(idle_from)
        time.sleep(5)
        settled = {"engine": rss_anon_mib(engine_pid), "wrapper": rss_anon_mib(server.proc.pid)}
        settled["others"] = tree_rss_anon_bytes(server.proc.pid) / MIB - settled["engine"] - settled["wrapper"]
    finally:
        server.stop()
    engine = server.sampler.below_root()
    steps, file_steps = phases(trace), phases(trace, "rss_file")
    # the libraries' share of RssFile once ready: all of it but the weights' image (code loaded after the imports,
    # Inductor's compiled graph among it, is a library too; the ledger counts only the weights)
    image_bytes = phases(trace, "mapped_bytes").get("mapped", 0.0) * MIB
    libraries = round(file_steps["ready"] * MIB - image_bytes) if "ready" in file_steps else None
    measured = {"peak": total_peak_bytes(engine, libraries), "settled": engine.settled_bytes(idle_from)}
    file_backed = plan["memory"].get("file_backed_bytes", 0)  # RssFile once mapped: the ledger's anonymous part
    ledger = {"peak": plan["memory"]["peak_bytes"], "settled": plan["memory"]["resident_bytes"] - file_backed}
    baseline = sum(i["bytes"] for i in plan["memory"]["items"] if i["kind"] == "engine-baseline")
    peaked_in = peak_phase(trace, engine, time.time() - time.monotonic())
    trace.unlink(missing_ok=True)
    breakdown = _breakdown(steps, at_ready["engine"], settled)
    return {
        "mode": mode, "path": plan["path"], "layout": plan.get("layout"), "tokens_in_kv": tokens,
        "ready_s": server.ready_s, "env": args.variant_env,
        **{f"engine_{k}_mib": v / MIB for k, v in measured.items()},
        **{f"ledger_{k}_mib": v / MIB for k, v in ledger.items()},
        **{f"ledger_over_{k}": ledger[k] / measured[k] - 1 for k in measured},
        "implied_baseline_bytes": measured["settled"] - (ledger["settled"] - baseline),
        "tree_settled_mib": server.sampler.settled_bytes(idle_from) / MIB,
        "tree_peak_mib": server.sampler.peak_bytes / MIB,
        "engine_anon_peak_mib": engine.peak_bytes / MIB,
        "tree_file_settled_mib": server.sampler.settled_file_bytes(idle_from) / MIB,
        "engine_file_settled_mib": engine.settled_file_bytes(idle_from) / MIB,
        "engine_file_peak_mib": engine.peak_file_bytes / MIB,
        "wrapper_settled_mib": (server.sampler.settled_bytes(idle_from) - measured["settled"]) / MIB,
        "ledger_file_backed_mib": file_backed / MIB,
        "mapped_file_mib": file_steps["mapped"] - file_steps["imports"] if "mapped" in file_steps else None,
        "phases_mib": steps, "phases_file_mib": file_steps,
        "at_ready_mib": at_ready, "settled_by_process_mib": settled, "breakdown_mib": breakdown,
        "engine_peak_phase": peaked_in,
        "engine_peak_s": max(engine.samples, key=lambda s: s[1])[0] - engine.samples[0][0] if engine.samples else None,
        "tree_peak_at": server.sampler.describe_peak(),  # which processes held the tree's highest sample
        "workload_peak_mib": {part: engine.peak_between(start, end) / MIB  # which part of the workload peaked
                              for part, start, end in zip(("full-context", "streams"), marks, marks[1:], strict=False)},
        "items_mib": {item["kind"] + (f":{item['layer']}" if item.get("layer") else ""): item["bytes"] / MIB
                      for item in plan["memory"]["items"]},  # fmt: skip
    }


def _breakdown(steps: dict[str, float], engine_at_ready: float, settled: dict[str, float]) -> dict[str, float]:
    """What each piece adds (MiB): the engine's start phases as differences of its trace, then the API server's
    start after the engine's, the workload's leftovers, and the other processes."""
    out, before = {}, 0.0
    for phase in ("imports", "load", "warm-up", "kv-cache", "ready"):
        if phase in steps:
            out[phase] = steps[phase] - before
            before = steps[phase]
    if steps:
        out["api-start"] = engine_at_ready - before
    out["workload"] = settled["engine"] - engine_at_ready
    out["wrapper"] = settled["wrapper"]
    out["watchdog-and-others"] = settled["others"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="one-process,two-process,three-process")
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--model", type=Path, help="default: the embedded default model")
    parser.add_argument("--path", help="edge-serve's --path (default: the plan's)")
    parser.add_argument("--cold", action="store_true", help="each mode's first pass without the compile cache")
    parser.add_argument("--variant-env", type=_env_pairs, default={},
                        help="K=V[,K=V...]: every server's extra environment (the plugin's off switches)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    log = ROOT / ".cache" / "ledger_vs_rss.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    for mode in modes:  # convert first, so that no timed start includes the converter's peak
        subprocess.run(edge_argv(mode, args, "--dry-run"), check=True, stdout=subprocess.DEVNULL)
    status_model = args.model
    if status_model is None or status_model.is_file():  # a GGUF: prompts are sized with the default model's
        from kernels.source.default_model import ensure_default_model  # tokenizer, as bench_serve sizes them

        status_model = Path(ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(status_model)
    rows = []
    for p in range(args.passes):
        for i, mode in enumerate(modes):
            if args.cold and p == 0:
                shutil.rmtree(compile_cache(mode, args), ignore_errors=True)
            row = one_pass(mode, args, tokenizer, p * 10 + i, log)
            rows.append({"pass": p + 1, "cold": args.cold and p == 0, **row})
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "items_mib"}))
    print("| mode | ledger anonymous MiB | engine RssAnon settled MiB | ledger over | ledger peak MiB "
          "| engine peak MiB | ledger over | wrapper MiB |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode and not r["cold"]] or [r for r in rows if r["mode"] == mode]

        def med(key: str, mine: list[dict] = mine) -> float:
            return statistics.median(r[key] for r in mine)

        print(f"| {mode} | {med('ledger_settled_mib'):.0f} | {med('engine_settled_mib'):.0f} | "
              f"{100 * med('ledger_over_settled'):+.1f} % | {med('ledger_peak_mib'):.0f} | "
              f"{med('engine_peak_mib'):.0f} | {100 * med('ledger_over_peak'):+.1f} % | "
              f"{med('wrapper_settled_mib'):.0f} |")  # fmt: skip
    pieces = list(dict.fromkeys(k for r in rows for k in r["breakdown_mib"]))
    print("\n| mode | " + " | ".join(pieces) + " | tree settled | tree peak | tree RssFile settled |")
    print("|---" * (len(pieces) + 4) + "|")
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode and not r["cold"]] or [r for r in rows if r["mode"] == mode]
        cells = [f"{statistics.median(r['breakdown_mib'].get(p, 0.0) for r in mine):.0f}" for p in pieces]
        print(f"| {mode} | " + " | ".join(cells) + f" | {statistics.median(r['tree_settled_mib'] for r in mine):.0f} "
              f"| {statistics.median(r['tree_peak_mib'] for r in mine):.0f} "
              f"| {statistics.median(r['tree_file_settled_mib'] for r in mine):.0f} |")
    for mode in modes:
        cold = [r["engine_settled_mib"] for r in rows if r["mode"] == mode and r["cold"]]
        warm = [r for r in rows if r["mode"] == mode and not r["cold"]]
        implied = statistics.median(r["implied_baseline_bytes"] for r in warm or rows)
        line = f"{mode}: implied engine baseline {implied:.0f} B"
        if cold and warm:
            more = cold[0] - statistics.median(r["engine_settled_mib"] for r in warm)
            line += f"; a compiling start holds {more:.0f} MiB more"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
