"""The plan's memory ledger against what edge-serve's engine holds, per serving mode (issue 23, item 6).

    .venv/bin/python -m benchmarks.ledger_vs_rss [--modes one-process,two-process,three-process] [--passes 1]
        [--model DIR] [--path PATH] [--cold] [--json OUT]

For each (pass, mode), interleaved: `edge-serve --priority speed --serving-mode MODE` (bench_serve's launcher)
starts fresh; RssAnon is sampled every 0.25 s over its whole process tree from launch to stop (benchmarks/rss.py),
and over the tree less the wrapper's own process, which is what the ledger predicts (the engine: vLLM's
processes and the watchdog). Once ready, the KV cache is filled the way the ledger sizes it: max_num_seqs
concurrent requests whose prompts and outputs together reach max_model_len. Then 5 s of idle give the settled
figure. Compared with the plan's own ledger as /status reports it: resident against settled, load-time peak
against the peak. A conversion the plan needs is run before the timed starts (`edge-serve --dry-run`), so the
peak is the engine's load, not the converter's.

Each row also gives the engine baseline this run implies: the engine's settled RssAnon less every other resident
item of the ledger (what benchmarks/engine_baseline.py measures on the bf16 path, for the facts table). `--cold`
removes the plan's vLLM compile cache before each mode's first pass, so that pass compiles (a box's first start)
and the later ones load the cache (every start after it); the summary gives the difference, which the compiling
process keeps for its lifetime.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from benchmarks.bench_serve import ROOT, edge_argv, edge_server, long_prompt
from edge.paths import resolve

MIB = 2**20


def fill_kv(url: str, model: str, tokenizer, seqs: int, max_model_len: int, seed: int) -> int:
    """`seqs` concurrent completions, each a prompt of about max_model_len - 64 tokens plus 48 generated."""
    prompts = [long_prompt(tokenizer, seed * 100 + i, max_model_len - 64) for i in range(seqs)]
    done = [0] * seqs

    def one(i: int) -> None:
        body = {"model": model, "prompt": prompts[i], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
        response.raise_for_status()
        done[i] = response.json()["usage"]["total_tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(seqs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done)


def compile_cache(mode: str, args: argparse.Namespace) -> Path:
    """The plan's vLLM cache root (VLLM_CACHE_ROOT: its compile cache lives there)."""
    argv = [str(ROOT / ".venv" / "bin" / "edge-select"), *edge_argv(mode, args)[1:], "--json"]
    plan = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    return Path(resolve(plan["vllm"]["env"]["VLLM_CACHE_ROOT"]))


def one_pass(mode: str, args: argparse.Namespace, tokenizer, seed: int, log: Path) -> dict:
    server, model, _ = edge_server(mode, args, log)
    try:
        plan = httpx.get(f"{server.url}/status", timeout=30).json()["plan"]
        args_ = plan["vllm"]["args"]
        seqs, max_len = (int(args_[args_.index(flag) + 1]) for flag in ("--max-num-seqs", "--max-model-len"))
        tokens = fill_kv(server.url, model, tokenizer, seqs, max_len, seed)
        idle_from = time.monotonic()
        time.sleep(5)
    finally:
        server.stop()
    engine = server.sampler.below_root()
    measured = {"peak": engine.peak_bytes, "settled": engine.settled_bytes(idle_from)}
    ledger = {"peak": plan["memory"]["peak_bytes"], "settled": plan["memory"]["resident_bytes"]}
    baseline = sum(i["bytes"] for i in plan["memory"]["items"] if i["kind"] == "engine-baseline")
    return {
        "mode": mode, "path": plan["path"], "layout": plan.get("layout"), "tokens_in_kv": tokens,
        "ready_s": server.ready_s,
        **{f"engine_{k}_mib": v / MIB for k, v in measured.items()},
        **{f"ledger_{k}_mib": v / MIB for k, v in ledger.items()},
        **{f"ledger_over_{k}": ledger[k] / measured[k] - 1 for k in measured},
        "implied_baseline_bytes": measured["settled"] - (ledger["settled"] - baseline),
        "tree_settled_mib": server.sampler.settled_bytes(idle_from) / MIB,
        "wrapper_settled_mib": (server.sampler.settled_bytes(idle_from) - measured["settled"]) / MIB,
        "items_mib": {item["kind"] + (f":{item['layer']}" if item.get("layer") else ""): item["bytes"] / MIB
                      for item in plan["memory"]["items"]},  # fmt: skip
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="one-process,two-process,three-process")
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--model", type=Path, help="default: the embedded default model")
    parser.add_argument("--path", help="edge-serve's --path (default: the plan's)")
    parser.add_argument("--cold", action="store_true", help="each mode's first pass without the compile cache")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    log = ROOT / ".cache" / "ledger_vs_rss.log"
    for mode in modes:  # convert first, so that no timed start includes the converter's peak
        subprocess.run(edge_argv(mode, args, "--dry-run"), check=True, stdout=subprocess.DEVNULL)
    status_model = args.model
    if status_model is None:
        from kernels.source.default_model import ensure_default_model

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
    print("| mode | ledger resident MiB | engine settled MiB | ledger over | ledger peak MiB | engine peak MiB | "
          "ledger over | wrapper MiB |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode and not r["cold"]] or [r for r in rows if r["mode"] == mode]

        def med(key: str, mine: list[dict] = mine) -> float:
            return statistics.median(r[key] for r in mine)

        print(f"| {mode} | {med('ledger_settled_mib'):.0f} | {med('engine_settled_mib'):.0f} | "
              f"{100 * med('ledger_over_settled'):+.1f} % | {med('ledger_peak_mib'):.0f} | "
              f"{med('engine_peak_mib'):.0f} | {100 * med('ledger_over_peak'):+.1f} % | "
              f"{med('wrapper_settled_mib'):.0f} |")  # fmt: skip
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
