"""What a client gets over HTTP: edge-serve against llama.cpp's own OpenAI server, same model, same threads, both
streaming through their API, interleaved (issue 23).

    .venv/bin/python -m benchmarks.bench_serve
        [--variants edge:one-process,edge:two-process,edge:three-process,llama:Q4_0,llama:Q4_1]
        [--passes 2] [--model DIR|FILE.gguf] [--gguf-q4_1 FILE] [--gguf-q4_0 FILE] [--threads N] [--json OUT]
        [--sampling greedy|llama-defaults|top-p] [--together]

Variants:
    edge:MODE     `edge-serve --priority speed --serving-mode MODE` on the default model (or --model): the plan's
                  path and kernels, vLLM in `one-process` mode (the engine core a thread of the API server),
                  `two-process` (API server + engine core running its worker) or `three-process` (API server,
                  engine core, worker: vLLM's own CPU default); `edge:MODE@N` on N engine threads
    llama:TYPE    llama-cpp-python's server (`python -m llama_cpp.server`, the separate venv of
                  benchmarks/gguf_fidelity.py, built for this host's SIMD) on the default model's GGUF of that type:
                  Q4_1 is the file the default model is built from; Q4_0 is what llama.cpp repacks for AVX2/AVX-512
                  (its fastest 4-bit format here), made from it by llama.cpp's own quantizer (--make-q4_0)
    llama:file    the same server on the very file edge-serve serves (--model FILE.gguf)
    ...@N         either kind on N compute threads (edge:two-process@2, llama:Q4_0@2): thread counts compared in
                  one interleaved run
    edge:MODE+vllm-sampler  the same with vLLM's CPU sampler as shipped (EDGE_SELECT_SAMPLER=vllm), against the
                  plugin's (kernels/vllm_plugin/sampling.py); it matters only with a --sampling other than greedy
    edge:MODE+no-early  the same without the early engine (EDGE_EARLY_ENGINE=0: vLLM imported after the plan)
    edge:MODE+prefetch-l1  the same with the AVX2 kernels' old prefetch hint (EDGE_AVX2_PREFETCH=l1: the rows ahead
                  into L1 instead of L2, kernels/ops/avx2_int4.cpp's prefetch_row)
    edge:MODE+row-major  the same with the int8-activation decode kernel on the checkpoint's row-major tensors
                  (EDGE_AVX2_DECODE_LAYOUT=row-major) instead of its decode layout (kernels.ops.avx2_int4.decode_layout)
    edge:MODE+vllm-attention  the same with vLLM's own CPU attention methods (EDGE_SELECT_ATTENTION=vllm) instead of
                  the plugin's (kernels/vllm_plugin/attention.py)
    edge:MODE+no-huge-pages  the same with the decode kernels' weights where vLLM loaded them (EDGE_HUGE_PAGES=0)
                  instead of in slabs advised for transparent huge pages (kernels/ops/huge_pages.py)
    edge:MODE+grid  the same with a GGUF's Q4_K, Q6_K, Q8_0 and Q5_0 tensors on the grids for decode too, not the
                  file's own blocks (EDGE_OWN_BLOCKS=0: the plan leaves out quantization_config.q4k, q6k, q8_0, q5_0)
    edge:MODE+no-table  the same with the int4 linears' tensors passed to the compiled graph on every call
                  (EDGE_LAYER_TABLE=0) instead of an index a layer into a table the extension holds
                  (kernels/vllm_plugin/layer_table.py)
    edge:MODE+two-copies  the same with a tinygemm buffer beside each int4 layer's decode copy
                  (EDGE_DECODE_COPY_ONLY=0), as before 2026-12-06, instead of the decode copy alone
                  (edge.formats.tinygemm decode_copy_only)
    edge:MODE+no-trim  the same without returning the start's freed heap pages (EDGE_HEAP_TRIM=0,
                  kernels/vllm_plugin/heap_trim.py)
    edge:MODE+no-idle-trim  the same without the heap trim when the one-process engine has idled 2 s after serving
                  (EDGE_IDLE_TRIM=0, kernels/vllm_plugin/heap_trim.py IdleTrim)
    edge:MODE+no-map  the same with the weights held as the engine loaded them (EDGE_MAPPED_WEIGHTS=0), instead of
                  mapped from an image file in the cache (kernels/vllm_plugin/mapped_weights.py)
    edge:MODE+no-premap  the same loading as vLLM does into memory of its own, then mapping the weights
                  (EDGE_PREMAP=0), instead of loading into the last image's pages, or the checkpoint's on a first
                  start (kernels/vllm_plugin/mapped_weights.py premap)
    edge:MODE+no-hold  the same with each step's outputs handed to the event loop as the step ends
                  (EDGE_HOLD_OUTPUTS=0), instead of when the next step's forward starts (one-process serving,
                  kernels/vllm_plugin/engine_thread.py): the event loop's work on them then takes the GIL while the
                  engine schedules and prepares the next step
    edge:MODE+no-lean  the same with decode rows on vLLM's CPU attention kernel (EDGE_LEAN_ATTENTION=0) instead of
                  the plugin's lean one (kernels/vllm_plugin/attention.cpp lean_attention)
    edge:MODE+no-hold-inputs  the same without the model's parameters and buffers held from C++
                  (EDGE_HOLD_GRAPH_INPUTS=0): the compiled graph then takes the GIL ~64 times a step to release them,
                  and in one-process serving waits for it while the event loop streams (attention_cpp.hold_model)
    edge:MODE+vllm-tokenizer-pool  the same with vLLM's tokenizer copies as it ships them: its renderer's pool
                  filled with 2 deep copies up front (EDGE_TOKENIZER_COPIES=2), and each copy of the cached tokenizer
                  building its cache again (EDGE_TOKENIZER_SHALLOW_COPY=0), instead of one copy sharing the cache
                  (kernels/vllm_plugin/tokenizer_pool.py)
    edge:MODE+w4a16, edge:MODE+w4a8  the same with the weight path pinned (--path w4a16-tinygemm, --path w4a8-gptq):
                  another path beside the plan's own, e.g. the file's own blocks on a host whose speed plan is W4A8
    edge:MODE+uncalibrated  the same planned from the facts table, whatever calibration record is cached
                  (EDGE_CALIBRATION=off): what a box served before edge-serve timed its kernels on first start

    edge:MODE+ngram  the same planned with n-gram drafting (--speculative ngram: vLLM's n-gram proposer, its drafts
                  checked in one verify pass, edge.plan.speculative)
    llama:TYPE+lookup  llama.cpp's own drafting for the same file: llama-cpp-python's server with its prompt-lookup
                  draft model (--draft_model prompt-lookup-decoding, its default of 10 tokens predicted)

--workloads open,summarize,edit (with --rounds): the paired decode rounds run each workload's prompt in turn, fixed in
benchmarks/workloads/: `open` (today's prose opening, the answer free), `summarize` (a given passage, then a summary
that quotes it), `edit` (a given function, then the same function with a variable renamed). Each workload gets its
own paired table; an edge variant that drafts adds its acceptance rate over the workload's rounds (drafted tokens
the model confirmed, from /status's drafting counters).

--sampling greedy (the default) streams with temperature 0. --sampling llama-defaults sends every server the sampling
llama.cpp's server applies to a request that names none (llama-cpp-python 0.3.36: temperature 0.8, top-k 40, top-p
0.95, min-p 0.05, repeat penalty 1.1), each under its own parameter names: what a client moving from llama.cpp gets.
--sampling top-p sends temperature 0.8 and top-p 0.95 alone (llama.cpp's top-k, min-p and repeat penalty switched
off), as an OpenAI-API client does.

Each (pass, variant) starts its server fresh (with --together: each variant's server starts once, they idle side by
side, and the passes alternate between them, which keeps start-up noise out of a close A/B), times launch-to-ready
(`warm_start_s`: the environment, the conversion and vLLM's compile cache exist after the first pass), warms it with
one request, then measures through the OpenAI API:

    decode       one stream of /v1/completions (greedy, 128 tokens): tokens after the first over the time from the
                 first streamed token to the last, i.e. the steady decode rate a reader sees; the median of 3
                 streams run one after another, each prompt its own
    ttft         time to the first streamed token of those requests (a 6-token prompt), their median
    prefill      one 512-token prompt, max_tokens 1, not streamed: prompt_tokens / wall time; each prompt starts
                 with a number of its own so that neither server's prefix cache reuses an earlier one
    streams4     4 concurrent streams of 128 tokens: total streamed tokens / wall time of the batch
    bytes        what one decode step reads: the served checkpoint's tensors (edge-serve's /status model_dir) or
                 the GGUF's (llama.cpp), less an untied input embedding (a step reads one row of it); `of read
                 bound` = bytes x decode tok/s / this host's read bandwidth at the variant's thread count
                 (benchmarks/read_bandwidth.py, timed before any server starts; --no-bound skips it)
    rss          RssAnon summed over the server's whole process tree (benchmarks/rss.py), sampled every 0.25 s:
                 `settled` is the median over 3 s of idle after the warm-up, `peak` the maximum from launch to stop;
                 RssFile apart (mapped files: the libraries, and the weights where the engine maps them)

Both servers get the same thread count unless a variant names its own: --threads N where given (edge-serve's
--threads, for one- and two-process variants), else the first edge variant's, what its plan starts vLLM with (read from
/status: OMP_NUM_THREADS, else every core, as vLLM binds its worker on a box where the plan reserves none), passed
to llama.cpp as n_threads and n_threads_batch. The table reports medians over passes and each variant's ratio to
the best llama.cpp variant.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from benchmarks.llama_cpp_decode import PROSE  # plain English prose (public domain)
from benchmarks.rss import TreeSampler
from edge.device.cpuinfo import host_model_name

ROOT = Path(__file__).resolve().parents[1]
LLAMA_PYTHON = ROOT / ".cache" / "llama-native" / "bin" / "python"
DECODE_TOKENS = 128
# One stream's rate moved by a third between back-to-back runs on a shared 2-core VM (86.7 then 118.1 tok/s, the
# same server and plan, 2026-12-02); each pass takes the median of this many, one after another.
DECODE_STREAMS = 3
PREFILL_TOKENS = 512
STREAMS = 4
# edge:MODE+MODIFIER: the engine's environment for each (the plugin's off switches)
# edge:MODE+NAME: the variant's edge-serve with this environment (vLLM's own sampler; no early engine)
EDGE_MODIFIERS = {"vllm-sampler": {"EDGE_SELECT_SAMPLER": "vllm"}, "no-early": {"EDGE_EARLY_ENGINE": "0"},
                  "uncalibrated": {"EDGE_CALIBRATION": "off"}, "prefetch-l1": {"EDGE_AVX2_PREFETCH": "l1"},
                  "row-major": {"EDGE_AVX2_DECODE_LAYOUT": "row-major"},
                  "vllm-attention": {"EDGE_SELECT_ATTENTION": "vllm"}, "no-huge-pages": {"EDGE_HUGE_PAGES": "0"},
                  "grid": {"EDGE_OWN_BLOCKS": "0"}, "no-table": {"EDGE_LAYER_TABLE": "0"},
                  "two-copies": {"EDGE_DECODE_COPY_ONLY": "0"}, "no-trim": {"EDGE_HEAP_TRIM": "0"},
                  "no-map": {"EDGE_MAPPED_WEIGHTS": "0"}, "no-idle-trim": {"EDGE_IDLE_TRIM": "0"},
                  "no-premap": {"EDGE_PREMAP": "0"}, "no-hold": {"EDGE_HOLD_OUTPUTS": "0"},
                  "no-lean": {"EDGE_LEAN_ATTENTION": "0"}, "no-hold-inputs": {"EDGE_HOLD_GRAPH_INPUTS": "0"},
                  "vllm-tokenizer-pool": {"EDGE_TOKENIZER_COPIES": "2", "EDGE_TOKENIZER_SHALLOW_COPY": "0"}}
# edge:MODE+NAME: the variant's edge-serve with these arguments (a pinned weight path beside the plan's own)
EDGE_ARG_MODIFIERS = {"w4a16": ("--path", "w4a16-tinygemm"), "w4a8": ("--path", "w4a8-gptq"),
                      "ngram": ("--speculative", "ngram")}  # fmt: skip
# llama:TYPE+NAME: llama.cpp's server with these arguments
LLAMA_ARG_MODIFIERS = {"lookup": ("--draft_model", "prompt-lookup-decoding")}
WORKLOADS_DIR = Path(__file__).with_name("workloads")
WORKLOADS = ("open", "summarize", "edit")


def workload_prompt(name: str) -> str:
    """The workload's fixed prompt (benchmarks/workloads/NAME.txt), without its file's final newline."""
    return (WORKLOADS_DIR / f"{name}.txt").read_text().removesuffix("\n")


SHORT_PROMPT = workload_prompt("open")
GREEDY = {"temperature": 0}
# llama-cpp-python 0.3.36's server defaults (llama_cpp/server/types.py), under each server's own parameter names
LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
REPEAT_PENALTY = 1.1
# An OpenAI-API client that sets only temperature and top_p (no top-k, no min-p: nothing narrows the vocabulary first)
TOP_P = {"temperature": 0.8, "top_p": 0.95, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0}
SAMPLINGS = {
    "greedy": {"edge": GREEDY, "llama": GREEDY},
    "top-p": {"edge": {"temperature": 0.8, "top_p": 0.95}, "llama": TOP_P},
    "llama-defaults": {"edge": {**LLAMA_DEFAULTS, "repetition_penalty": REPEAT_PENALTY},
                       "llama": {**LLAMA_DEFAULTS, "repeat_penalty": REPEAT_PENALTY}},
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One server process (its own session, so its whole tree stops together) and its RssAnon sampler."""

    def __init__(self, argv: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.started = time.monotonic()
        with log.open("ab") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                         start_new_session=True)  # fmt: skip
        self.sampler = TreeSampler(self.proc.pid, interval_s=0.25).start()

    def wait_ready(self, path: str, timeout_s: float = 1800) -> float:
        while time.monotonic() - self.started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"not ready in {timeout_s} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.sampler.stop()


def stream(url: str, model: str, prompt: str, tokens: int, sampling: dict | None = None) -> dict:
    """One streamed completion: time to first token, token arrival times. A server that drafts sends several tokens
    in one event, so the count is the usage it reports at the end (stream_options.include_usage, which vLLM's
    server honours); a server that reports none (llama-cpp-python's, one event a token) counts its events. The rate
    counts the tokens after the first event's one over the time from the first event to the last."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, **(sampling or GREEDY), "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    times, usage = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter() - start)
            usage = chunk.get("usage") or usage
    count = usage["completion_tokens"] if usage else len(times)
    return {"ttft_s": times[0] if times else None, "tokens": count,
            "decode_tok_s": (count - 1) / (times[-1] - times[0]) if len(times) > 2 else None}  # fmt: skip


def prefill(url: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    wall = time.perf_counter() - start
    response.raise_for_status()
    n = response.json()["usage"]["prompt_tokens"]
    return {"prompt_tokens": n, "wall_s": wall, "tok_s": n / wall}


def concurrent(url: str, model: str, streams: int, tokens: int, sampling: dict | None = None) -> dict:
    results: list[dict] = [{}] * streams
    go = threading.Barrier(streams)

    def one(i: int) -> None:
        go.wait()
        results[i] = stream(url, model, f"{i}. {SHORT_PROMPT}", tokens, sampling)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    total = sum(r.get("tokens", 0) for r in results)
    return {"streams": streams, "tokens": total, "wall_s": wall, "tok_s": total / wall}


def long_prompt(tokenizer, seed: int, tokens: int = PREFILL_TOKENS) -> str:
    """About `tokens` tokens of prose, starting with `seed` (no shared prefix across calls)."""
    text = f"{seed}. "
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += PROSE
    ids = tokenizer(text)["input_ids"][: tokens - 2]
    return tokenizer.decode(ids)


def measure(server: Server, model: str, tokenizer, seed: int, sampling: dict | None = None) -> dict:
    stream(server.url, model, SHORT_PROMPT, 8, sampling)  # warm-up
    idle_from = time.monotonic()
    time.sleep(3)
    settled = server.sampler.settled_bytes(idle_from)
    settled_file = server.sampler.settled_file_bytes(idle_from)
    ones = [stream(server.url, model, f"{seed}.{i} {SHORT_PROMPT}", DECODE_TOKENS, sampling)
            for i in range(DECODE_STREAMS)]
    one = {key: statistics.median(v) if (v := [o[key] for o in ones if o[key] is not None]) else None
           for key in ("decode_tok_s", "ttft_s", "tokens")}  # fmt: skip
    fills = [prefill(server.url, model, long_prompt(tokenizer, seed * 10 + i)) for i in range(2)]
    many = concurrent(server.url, model, STREAMS, DECODE_TOKENS, sampling)
    return {"decode_tok_s": one["decode_tok_s"], "decode_tokens": one["tokens"], "ttft_s": one["ttft_s"],
            "decode_tok_s_each": [o["decode_tok_s"] for o in ones],
            "prefill_tok_s": max(f["tok_s"] for f in fills), "prefill_prompt_tokens": fills[0]["prompt_tokens"],
            "streams4_tok_s": many["tok_s"], "streams4_tokens": many["tokens"],
            "rss_settled_mib": settled / 2**20, "rss_file_settled_mib": settled_file / 2**20}  # fmt: skip


def decode_rounds(servers: dict[str, tuple], rounds: int, samplings: dict[str, dict | None],
                  per: dict[str, list[float]], first: int = 0, prompt: str = SHORT_PROMPT,
                  drafting: dict[str, list[dict]] | None = None) -> None:  # fmt: skip
    """Paired decode: `rounds` rounds of one stream per server, the order rotated each round, so a VM whose speed
    drifts over minutes slows both sides of a pair alike; each variant's tok/s appended to `per` (rounds numbered
    from `first`). `drafting`: an edge variant's drafting counters (/status) before and after each of its streams."""
    names = list(servers)
    for r in range(first, first + rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            server, model, kind = servers[name]
            before = drafting_counters(server) if drafting is not None and kind == "edge" else None
            result = stream(server.url, model, f"r{r} {prompt}", DECODE_TOKENS, samplings[kind])
            per.setdefault(name, []).append(result["decode_tok_s"])
            if before is not None and (after := drafting_counters(server)) is not None:
                drafting.setdefault(name, []).append({k: after[k] - before[k] for k in after})
        print(json.dumps({"round": r + 1, **{n: round(v[-1], 1) for n, v in per.items()}}), file=sys.stderr,
              flush=True)  # fmt: skip


DRAFT_COUNTERS = ("drafts", "drafted_tokens", "accepted_tokens")  # /status drafting's counters


def drafting_counters(server: Server) -> dict[str, float] | None:
    """edge-serve's drafting counters now (/status drafting), or None where its plan drafts nothing."""
    found = httpx.get(f"{server.url}/status", timeout=30).json().get("drafting")
    return None if found is None else {k: found[k] for k in DRAFT_COUNTERS}


def acceptance(deltas: list[dict]) -> dict[str, float]:
    """Drafted tokens confirmed over a workload's rounds, and tokens a verified step produced."""
    drafts, drafted, accepted = (sum(d[k] for d in deltas) for k in DRAFT_COUNTERS)
    return {"drafts": drafts, "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tokens_per_step": 1 + accepted / drafts if drafts else 1.0}  # fmt: skip


def paired_summary(per: dict[str, list[float]], names: list[str]) -> dict:
    """Each variant's median tok/s over the rounds, and per other variant the median and quartiles of its
    per-round ratio to the first variant."""
    base = names[0]
    out = {"rounds": len(per[base]), "decode_tok_s": {n: statistics.median(per[n]) for n in names}, "each": per,
           "ratio_to": base, "ratios": {}}  # fmt: skip
    for name in names[1:]:
        ratios = [a / b for a, b in zip(per[name], per[base], strict=True)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        out["ratios"][name] = {"median": q[1], "q1": q[0], "q3": q[2]}
    return out


def rounds_table(result: dict) -> str:
    base = result["ratio_to"]
    lines = [f"Paired decode, {result['rounds']} rounds (order rotated), ratio to {base}:", "",
             "| variant | decode tok/s (median) | ratio (median) | ratio q1-q3 |", "|---|---|---|---|"]  # fmt: skip
    for name, rate in result["decode_tok_s"].items():
        r = result["ratios"].get(name)
        ratio = f"{r['median']:.3f} | {r['q1']:.3f}-{r['q3']:.3f}" if r else "1 | -"
        lines.append(f"| {name} | {rate:.1f} | {ratio} |")
    return "\n".join(lines)


def edge_argv(mode: str, args: argparse.Namespace, *extra: str, threads: int | None = None) -> list[str]:
    """edge-serve's command line for a variant: the speed plan in `mode`, --model and --path when `args` has them."""
    argv = [str(ROOT / ".venv" / "bin" / "edge-serve"), "--priority", "speed", "--serving-mode", mode,
            "--max-model-len", "2048", *extra]  # fmt: skip
    if args.model:
        argv += ["--model", str(args.model)]
    if getattr(args, "path", None):
        argv += ["--path", args.path]
    if getattr(args, "max_kld", None) is not None:
        argv += ["--max-kld", str(args.max_kld)]
    if (threads := threads or getattr(args, "threads", None)) and mode != "three-process":
        argv += ["--threads", str(threads)]
    return argv


def edge_server(mode: str, args: argparse.Namespace, log: Path, threads: int | None = None,
                env: dict[str, str] | None = None, extra: Sequence[str] = ()) -> tuple[Server, str, int]:  # fmt: skip
    port = free_port()
    argv = edge_argv(mode, args, "--port", str(port), *extra, threads=threads)
    server = Server(argv, dict(os.environ) | (env or {}), port, log)
    server.ready_s = server.wait_ready("/readyz")
    status = httpx.get(f"{server.url}/status", timeout=30).json()
    engine_env = status["plan"]["vllm"]["env"]
    # three-process on a small box: vLLM binds its worker to every core the plan leaves unreserved (all of them)
    threads = int(engine_env.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    server.detail = {"path": status["plan"]["path"], "layout": status["plan"].get("layout"),
                     "mode": status["plan"]["vllm"].get("mode"), "threads": threads,
                     "decode_bytes": checkpoint_decode_bytes(Path(status["model_dir"]))}  # fmt: skip
    return server, model, threads


def llama_server(python: Path, gguf: Path, threads: int, log: Path,
                 extra: Sequence[str] = ()) -> tuple[Server, str]:  # fmt: skip
    port = free_port()
    argv = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048",
            "--n_batch", "512", "--model_alias", gguf.stem, *extra]  # fmt: skip
    server = Server(argv, dict(os.environ), port, log)
    server.ready_s = server.wait_ready("/v1/models")
    server.detail = {"gguf": gguf.name, "threads": threads, "decode_bytes": gguf_decode_bytes(gguf)}
    return server, gguf.stem


def make_q4_0(python: Path, src: Path, dst: Path) -> Path:
    from benchmarks.gguf_fidelity import main as fidelity

    fidelity(["--quantize", str(src), str(dst), "--type", "Q4_0", "--llama-python", str(python)])
    return dst


# bytes of one element per safetensors dtype string
SAFETENSORS_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}


def checkpoint_decode_bytes(model_dir: Path) -> int:
    """Bytes one decode step reads of the checkpoint edge-serve serves: every tensor (the decode kernels read the
    converted row-major copies as stored, and a tied embedding is the head), less an untied input embedding, of which
    a step reads one row."""
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                part = tensors.get_slice(name)
                sizes[name] = math.prod(part.get_shape()) * SAFETENSORS_BYTES[part.get_dtype()]
    untied = any("lm_head" in name for name in sizes)
    return sum(size for name, size in sizes.items() if not (untied and "embed_tokens" in name))


def gguf_decode_bytes(gguf: Path) -> int:
    """The same for a GGUF llama.cpp serves: its tensors, less token_embd where an output tensor is its own."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    untied = "output.weight" in sizes
    return sum(size for name, size in sizes.items() if not (untied and name == "token_embd.weight"))


def read_bound() -> dict[int, float]:
    """This host's read bandwidth in GB/s by thread count (1 and every core), the fastest load width, measured once
    before any server starts (benchmarks/read_bandwidth.py, 3 interleaved rounds over 1 GiB)."""
    from benchmarks.read_bandwidth import measure as measure_bandwidth

    best = measure_bandwidth(3, 1024)["best"]
    return {int(threads): b["gb_s"] for threads, b in best.items()}


def summarize(rows: list[dict], bound: dict[int, float] | None = None) -> dict[str, dict]:
    keys = ("decode_tok_s", "ttft_s", "prefill_tok_s", "streams4_tok_s", "rss_settled_mib", "rss_peak_mib",
            "rss_file_settled_mib", "warm_start_s")  # fmt: skip
    out: dict[str, dict] = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        out[variant] = {k: statistics.median(r[k] for r in mine) for k in keys if all(r.get(k) is not None
                                                                                      for r in mine)}  # fmt: skip
        out[variant]["passes"] = len(mine)
        out[variant]["detail"] = detail = mine[-1]["detail"]
        decode_bytes = detail.get("decode_bytes")
        if decode_bytes and "decode_tok_s" in out[variant]:
            out[variant]["decode_gb_s"] = rate = decode_bytes * out[variant]["decode_tok_s"] / 1e9
            threads = detail.get("threads") or 1
            if bound:  # measured at 1 thread and at every core: the count at or below the variant's
                at = max((t for t in bound if t <= threads), default=min(bound))
                out[variant]["read_bound_gb_s"] = bound[at]
                out[variant]["of_bound"] = rate / bound[at]
    for v in out:  # each against the best llama.cpp variant of its own thread count
        threads = out[v]["detail"].get("threads")
        llama = [w for w in out if w.startswith("llama:") and out[w]["detail"].get("threads") == threads]
        if not llama:
            continue
        best = max(llama, key=lambda w: out[w].get("decode_tok_s", 0))
        for k in ("decode_tok_s", "prefill_tok_s", "streams4_tok_s"):
            if k in out[v] and k in out[best]:
                out[v][f"{k}_vs_{best}"] = out[v][k] / out[best][k]
    return out


def table(summary: dict[str, dict]) -> str:
    lines = ["| variant | decode tok/s | MB a token | of read bound | TTFT ms | prefill@512 tok/s | 4 streams tok/s "
             "| RssAnon settled MiB | RssAnon peak MiB | RssFile settled MiB | start s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for variant, s in summary.items():
        def f(key: str, scale: float = 1.0, digits: int = 1, s: dict = s) -> str:
            return f"{s[key] * scale:.{digits}f}" if key in s else "-"

        mb = f"{s['detail']['decode_bytes'] / 1e6:.1f}" if s["detail"].get("decode_bytes") else "-"
        share = f"{s['of_bound']:.0%}" if "of_bound" in s else "-"
        lines.append(f"| {variant} | {f('decode_tok_s')} | {mb} | {share} | {f('ttft_s', 1000, 0)} "
                     f"| {f('prefill_tok_s', digits=0)} "
                     f"| {f('streams4_tok_s')} | {f('rss_settled_mib', digits=0)} | {f('rss_peak_mib', digits=0)} "
                     f"| {f('rss_file_settled_mib', digits=0)} | {f('warm_start_s')} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants",
                        default="edge:one-process,edge:two-process,edge:three-process,llama:Q4_0,llama:Q4_1")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--model", type=Path, help="edge-serve's --model (default: the embedded model)")
    parser.add_argument("--gguf-q4_1", type=Path, help="llama:Q4_1's file (default: the default model's own)")
    parser.add_argument("--gguf-q4_0", type=Path, help="llama:Q4_0's file (default: made from the Q4_1 one)")
    parser.add_argument("--threads", type=int, help="both servers' compute threads (default: the edge plan's)")
    parser.add_argument("--max-kld", type=float, help="edge-serve's --max-kld (a model whose measured quality with "
                        "int8 activations is over the default floor still decodes on them)")
    parser.add_argument("--llama-python", type=Path, default=LLAMA_PYTHON)
    parser.add_argument("--together", action="store_true",
                        help="start every variant's server once, idle side by side, and alternate their measurements "
                             "through the passes: no start between them (memory for all at once; start s is the one "
                             "start's)")
    parser.add_argument("--sampling", choices=sorted(SAMPLINGS), default="greedy",
                        help="greedy; llama.cpp server's default sampling; or temperature and top-p alone")
    parser.add_argument("--rounds", type=int, default=0,
                        help="with --together, after the passes: this many rounds of one decode stream per server, "
                             "order rotated, each variant's ratio to the first per round (medians, quartiles)")
    parser.add_argument("--workloads", default="open",
                        help=f"with --rounds: comma list of {', '.join(WORKLOADS)} (benchmarks/workloads/), each "
                             "workload's rounds paired and reported apart")
    parser.add_argument("--starts", type=int,
                        help="with --together: start the servers this many times, each time in another order, the "
                             "passes and rounds shared between the starts (default: one start per variant)")
    parser.add_argument("--no-bound", dest="bound", action="store_false",
                        help="skip timing the read bound before the servers start (then no `of read bound`)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--log", type=Path, default=ROOT / ".cache" / "bench_serve.log")
    args = parser.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    from kernels.source.default_model import ensure_default_model, source_gguf

    q4_1 = args.gguf_q4_1 or source_gguf()
    q4_0 = args.gguf_q4_0 or ROOT / ".cache" / f"{q4_1.stem.replace('Q4_1', 'Q4_0')}.gguf"
    variants = args.variants.split(",")
    kinds = {v.partition("@")[0] for v in variants}
    if "llama:file" in kinds and (args.model is None or args.model.suffix != ".gguf"):
        parser.error("llama:file serves --model's file: pass --model FILE.gguf")
    if "llama:Q4_0" in kinds and not q4_0.exists():
        make_q4_0(args.llama_python, q4_1, q4_0)
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model(), local_files_only=True)
    threads = args.threads
    rows: list[dict] = []
    args.log.parent.mkdir(parents=True, exist_ok=True)
    servers: dict[str, tuple] = {}  # --together: every variant's server, kept up through all passes
    paired: dict = {}
    workloads = args.workloads.split(",")
    if unknown := [w for w in workloads if w not in WORKLOADS]:
        parser.error(f"--workloads: unknown {unknown} (of {', '.join(WORKLOADS)})")
    per_workload: dict[str, dict[str, list[float]]] = {w: {} for w in workloads}
    drafted: dict[str, dict[str, list[dict]]] = {w: {} for w in workloads}
    if args.rounds and not args.together:
        parser.error("--rounds alternates servers that are up side by side: add --together")

    def start(variant: str) -> tuple:
        nonlocal threads
        kind, what = variant.split(":", 1)
        what, _, own = what.partition("@")
        what, _, modifier = what.partition("+")
        own, _, modifier = own.partition("+") if own else ("", "", modifier)
        edge_ok = kind == "edge" and modifier in (*EDGE_MODIFIERS, *EDGE_ARG_MODIFIERS)
        if modifier and not edge_ok and not (kind == "llama" and modifier in LLAMA_ARG_MODIFIERS):
            parser.error(f"--variants: unknown modifier +{modifier} in {variant!r} "
                         f"(edge:MODE+{'|'.join([*EDGE_MODIFIERS, *EDGE_ARG_MODIFIERS])}, "
                         f"llama:TYPE+{'|'.join(LLAMA_ARG_MODIFIERS)})")  # fmt: skip
        if kind == "edge":
            env = EDGE_MODIFIERS.get(modifier, {})
            server, model, threads_here = edge_server(what, args, args.log, int(own) if own else None, env,
                                                      EDGE_ARG_MODIFIERS.get(modifier, ()))  # fmt: skip
            threads = threads or threads_here
        else:
            gguf = {"Q4_0": q4_0, "Q4_1": q4_1, "file": args.model}[what]
            server, model = llama_server(args.llama_python, gguf, int(own) if own else threads or 1, args.log,
                                         LLAMA_ARG_MODIFIERS.get(modifier, ()))  # fmt: skip
        return server, model, kind

    bound = read_bound() if args.bound else {}
    starts = max(1, args.starts or (len(variants) if args.together else 1))
    for start_index in range(starts):
        # --together: each start brings the servers up in another order and takes its share of the passes and
        # rounds. The first engine started stepped 1.08-1.10x slower than a second copy of itself started after it
        # (benchmarks/step_profile.py, 2026-12-06, AMD EPYC Zen 4), so one start order would favour the later ones.
        shift = start_index % len(variants)
        started = variants[shift:] + variants[:shift]
        try:
            if args.together:
                for variant in started:
                    print(f"starting {variant}", file=sys.stderr, flush=True)
                    servers[variant] = start(variant)
            for p in range(start_index, args.passes, starts):
                for variant in variants:
                    print(f"pass {p + 1}: {variant}", file=sys.stderr, flush=True)
                    server, model, kind = servers.get(variant) or start(variant)
                    try:
                        row = measure(server, model, tokenizer, p * 100 + len(rows), SAMPLINGS[args.sampling][kind])
                    finally:
                        if variant not in servers:
                            server.stop()
                    rows.append({"variant": variant, "pass": p + 1, "warm_start_s": server.ready_s,
                                 "rss_peak_mib": server.sampler.peak_bytes / 2**20, "detail": server.detail, **row})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            if args.rounds:
                share = args.rounds // starts + (start_index < args.rounds % starts)
                for workload in workloads:
                    print(f"workload {workload}", file=sys.stderr, flush=True)
                    decode_rounds({v: servers[v] for v in variants}, share, SAMPLINGS[args.sampling],
                                  per_workload[workload], first=len(per_workload[workload].get(variants[0], [])),
                                  prompt=workload_prompt(workload), drafting=drafted[workload])  # fmt: skip
        finally:
            for server, _, _ in servers.values():
                server.stop()
            servers.clear()
    paired = {w: {**paired_summary(per, variants),
                  "acceptance": {v: acceptance(d) for v, d in drafted[w].items()}}
              for w, per in per_workload.items() if per}  # fmt: skip
    summary = summarize(rows, bound)
    cpu = host_model_name() or "unknown"
    print(f"{cpu}, {os.cpu_count()} cores, {threads} thread(s), {args.passes} passes (medians), "
          f"sampling {args.sampling}\n")
    print(table(summary))
    for workload, result in paired.items():
        print(f"\nWorkload {workload}. " + rounds_table(result))
        for name, a in result["acceptance"].items():
            print(f"{name}: {a['acceptance_rate']:.1%} of {a['drafted_tokens']:.0f} drafted tokens accepted, "
                  f"{a['tokens_per_step']:.2f} tokens a verified step")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "threads": threads, "sampling": args.sampling, "rows": rows,
                                         "summary": summary, "paired": paired, "read_bound_gb_s": bound}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
