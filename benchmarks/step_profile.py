"""Where one served decode step goes: the weight kernels against everything else (issue 42 part 2).

    .venv/bin/python -m benchmarks.step_profile [--model DIR|FILE.gguf] [--priority speed|fidelity]
        [--variants plain,+edge-attn] [--rounds 5] [--steps 96] [--json OUT]

Plans as `edge-serve` does (server.cli.prepare: this host's calibration record, the plan's conversion), then runs a
child per variant: vLLM's engine core in the child's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the plan's
thread count and environment, compiled as served), one greedy request of a 6-token prompt driven step by step
through `LLMEngine.step()`. The children start once and idle side by side; rounds alternate between them (each
round: `--steps` decode steps timed in every child, in turn), so both see the same VM.

Per decode step (the prompt's step is left out), timers around vLLM's own methods, inclusive:

    step         EngineCore.step: what one token costs the engine, scheduler to output
    schedule     Scheduler.schedule
    prepare      the runner's _update_states + _prepare_inputs (input ids, positions, attention metadata)
    forward      the runner's _model_forward: the compiled graph with its weight kernels and attention
    attention    CPUAttentionBackendImpl.forward and do_kv_cache_update, the Python around vLLM's C++ too
    logits       LogitsProcessor.forward: the head's GEMM and the logits' gather
    sample       the runner's _sample
    update       Scheduler.update_from_output and the runner's _bookkeeping_sync

and in `--profile-steps` further steps under torch.profiler (kept apart: it slows the Python it records), the self
CPU time per step of the weight ops (every op whose name is in WEIGHT_OPS), the attention's and the KV write's C++.
`outside kernels` = step - weight ops: the issue's "time outside the weight kernels" (target <= 1.5 ms on the
default model). Medians over rounds of each round's median; ratios of a variant to the first, per round.

Variants: `plain` serves as edge-serve does; `plain+NAME` adds the environment in VARIANT_ENV[NAME] and the engine
arguments in VARIANT_KWARGS[NAME] (a lever to compare): +row-major (EDGE_AVX2_DECODE_LAYOUT=row-major, the decode
kernel on the checkpoint's own layout), +python-attention (EDGE_SELECT_ATTENTION=python: vLLM's attention ops with
the plugin's lean methods instead of its C++ op), +vllm-attention (EDGE_SELECT_ATTENTION=vllm, vLLM's attention as
shipped), +python-wrapper (no compilation config: Inductor's Python wrapper instead of the plan's C++ one), +no-table
(EDGE_LAYER_TABLE=0: the int4 linears' tensors as the compiled graph's arguments instead of an index a layer).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 415, 5565, 302, 4843, 349]  # a fixed 6-token prompt
PARTS = ("step", "schedule", "prepare", "forward", "attention", "logits", "sample", "update")
# torch.profiler op names counted as weight kernels: the plugin's ops and the ATen GEMMs the bf16 and tinygemm paths
# call (a name matches when it starts with one of these)
WEIGHT_OPS = ("edge_avx2::", "vllm::cpu_int4_linear", "vllm::cpu_int8_linear", "vllm::cpu_w4a8_linear",
              "aten::_weight_int4pack_mm", "aten::_weight_int8pack_mm", "aten::mm", "aten::addmm", "aten::linear",
              "_C::int4_scaled_mm_cpu", "_C::cpu_gemm_wna16", "_C::onednn_mm", "_C::weight_packed_linear")  # fmt: skip
ATTENTION_OPS = ("_C::cpu_attention_with_kv_cache",)
KV_WRITE_OPS = ("_C::cpu_attn_reshape_and_cache",)
VARIANT_ENV: dict[str, dict[str, str]] = {
    # the int8-activation decode kernel on the checkpoint's row-major tensors instead of the decode layout
    # (kernels.ops.avx2_int4.decode_layout)
    "row-major": {"EDGE_AVX2_DECODE_LAYOUT": "row-major"},
    # vLLM's own CPU attention methods instead of the plugin's (kernels/vllm_plugin/attention.py)
    "vllm-attention": {"EDGE_SELECT_ATTENTION": "vllm"},
    # the lean Python attention methods and vLLM's attention ops instead of the plugin's C++ attention op
    "python-attention": {"EDGE_SELECT_ATTENTION": "python"},
    # the compiled graph with Inductor's Python wrapper instead of the plan's C++ wrapper (VARIANT_KWARGS)
    "python-wrapper": {},
    # nothing changed: the same engine in another process (what the order of the children alone does)
    "again": {},
    # the decode kernels' weights where vLLM loaded them, not in huge-page slabs (kernels/ops/huge_pages.py)
    "no-huge-pages": {"EDGE_HUGE_PAGES": "0"},
    # the int4 linears called with their tensors as the graph's arguments, not by index
    # (kernels/vllm_plugin/layer_table.py)
    "no-table": {"EDGE_LAYER_TABLE": "0"},
    # vLLM's CPU attention splitting a decode row's keys into chunks it merges after (VLLM_CPU_ATTN_SPLIT_KV=1, as
    # vLLM ships it) or one pass over them (=0, the plan's: edge.plan.engine_config ATTENTION_ENV)
    "split-kv": {"VLLM_CPU_ATTN_SPLIT_KV": "1"},
    "no-split-kv": {"VLLM_CPU_ATTN_SPLIT_KV": "0"},
    # decode rows on vLLM's attention kernel instead of the plugin's lean one (kernels/vllm_plugin/attention.cpp)
    "no-lean": {"EDGE_LEAN_ATTENTION": "0"},
    # the model's parameters and buffers not held from C++ through the compiled graph
    # (kernels/vllm_plugin/attention_cpp.py hold_model): the graph then takes the GIL to release them
    "no-hold-inputs": {"EDGE_HOLD_GRAPH_INPUTS": "0"},
}
# variants that change the engine's arguments: the plan's compilation config without Inductor's C++ wrapper
VARIANT_KWARGS: dict[str, dict] = {"python-wrapper": {"compilation_config": {}}}


# --- child: one engine, steps on command -----------------------------------------------------------------------


class Timers:
    """Inclusive seconds per part of the current step, by wrapping methods of vLLM's classes."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}

    def wrap(self, cls: type, name: str, part: str) -> None:
        original = getattr(cls, name)
        current = self.current

        @functools.wraps(original)  # keeps the plugin's marks, so its install() does not wrap the timer again
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                current[part] = current.get(part, 0.0) + time.perf_counter() - start

        setattr(cls, name, timed)


def install_timers() -> Timers:
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    timers = Timers()
    timers.wrap(EngineCore, "step", "step")
    timers.wrap(Scheduler, "schedule", "schedule")
    timers.wrap(Scheduler, "update_from_output", "update")
    timers.wrap(GPUModelRunner, "_update_states", "prepare")
    timers.wrap(GPUModelRunner, "_prepare_inputs", "prepare")
    timers.wrap(GPUModelRunner, "_model_forward", "forward")
    timers.wrap(GPUModelRunner, "_sample", "sample")
    timers.wrap(GPUModelRunner, "_bookkeeping_sync", "update")
    timers.wrap(LogitsProcessor, "forward", "logits")
    # the attention impl's methods are looked up per call (vLLM's custom ops call layer.impl.forward): wrapping the
    # class reaches them from inside the compiled graph; the plugin's replacements first (as the engine would)
    from kernels.vllm_plugin import attention

    attention.install()
    timers.wrap(CPUAttentionBackendImpl, "forward", "attention")
    timers.wrap(CPUAttentionBackendImpl, "do_kv_cache_update", "attention")
    return timers


def op_kind(name: str) -> str | None:
    if name.startswith(WEIGHT_OPS):
        return "weight_ops"
    if name.startswith(ATTENTION_OPS):
        return "attention_cpp"
    if name.startswith(KV_WRITE_OPS):
        return "kv_write_cpp"
    return None


def child(model: str, llm_kwargs: dict) -> None:
    import torch
    from vllm import LLM, SamplingParams

    timers = install_timers()
    llm = LLM(model=model, skip_tokenizer_init=True, seed=0, **llm_kwargs)
    engine = llm.llm_engine
    print(json.dumps({"event": "ready", "threads": torch.get_num_threads()}), flush=True)
    for request, line in enumerate(sys.stdin):
        command = json.loads(line)
        steps, profile = command["steps"], command.get("profile", 0)
        params = SamplingParams(temperature=0.0, max_tokens=steps + profile + 2, ignore_eos=True, detokenize=False)
        engine.add_request(str(request), {"prompt_token_ids": PROMPT}, params)
        records = []
        engine.step()  # the prompt
        for _ in range(steps):
            timers.current.clear()
            engine.step()
            records.append(dict(timers.current))
        ops: dict[str, float] = {}
        if profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(profile):
                    engine.step()
            for event in prof.key_averages():
                kind = op_kind(event.key)
                if kind:
                    ops[kind] = ops.get(kind, 0.0) + event.self_cpu_time_total / 1e6 / profile
                    ops.setdefault("by_op", {})[event.key] = event.self_cpu_time_total / 1e6 / profile
        while engine.has_unfinished_requests():
            engine.step()
        print(json.dumps({"event": "round", "steps": records, "ops": ops}), flush=True)


# --- driver ----------------------------------------------------------------------------------------------------


def plan_and_model(args: argparse.Namespace):
    from server.cli import parser, prepare

    argv = ["--priority", args.priority] + (["--model", str(args.model)] if args.model else [])
    prepared = prepare(parser().parse_args(argv), calibration="auto")
    return prepared.plan, prepared.serve_dir


def llm_kwargs(plan) -> dict:
    """The plan's `vllm serve` flags as LLM() keywords (only those the plan sets)."""
    args = plan.vllm.args
    flags = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    kwargs = {"dtype": flags.get("--dtype", "auto"), "max_model_len": int(flags.get("--max-model-len", 2048)),
              "max_num_seqs": int(flags.get("--max-num-seqs", 4))}  # fmt: skip
    if "--kv-cache-memory-bytes" in flags:
        kwargs["kv_cache_memory_bytes"] = int(flags["--kv-cache-memory-bytes"])
    if "--quantization" in flags:
        kwargs["quantization"] = flags["--quantization"]
    if "--compilation-config" in flags:
        kwargs["compilation_config"] = json.loads(flags["--compilation-config"])
    if "--speculative-config" in flags:
        kwargs["speculative_config"] = json.loads(flags["--speculative-config"])
    return kwargs


def variant_kwargs(kwargs: dict, variant: str) -> dict:
    out = dict(kwargs)
    for part in variant.split("+")[1:]:
        out.update(VARIANT_KWARGS.get(part, {}))
    return out


def child_env(plan, variant: str) -> dict[str, str]:
    env = {**os.environ, **plan.vllm.env}
    env.pop("EDGE_ENGINE_CORE_START", None)  # the API server's thread; here the LLM's own process steps the core
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for part in variant.split("+")[1:]:
        env.update(VARIANT_ENV[part])
    env["VLLM_CACHE_ROOT"] = os.path.expanduser(env.get("VLLM_CACHE_ROOT", "~/.cache/vllm"))
    return env


def start(model: Path, kwargs: dict, env: dict, log) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.step_profile", "--child", str(model), "--child-kwargs", json.dumps(kwargs)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
    )  # fmt: skip
    return proc


def read_event(proc: subprocess.Popen, log) -> dict:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith('{"event"'):
            return json.loads(line)
        log.write(line)
    raise RuntimeError(f"the engine child exited ({proc.wait()}); its log: {log.name}")


def part_medians(records: list[dict]) -> dict[str, float]:
    return {part: statistics.median(r.get(part, 0.0) for r in records) * 1e3 for part in PARTS}


def summarize(rounds: dict[str, list[dict]], variants: list[str]) -> dict:
    out: dict = {}
    for variant in variants:
        per_round = [part_medians(r["steps"]) for r in rounds[variant]]
        parts = {p: statistics.median(r[p] for r in per_round) for p in PARTS}
        ops = [r["ops"] for r in rounds[variant] if r["ops"]]
        kernels = {k: statistics.median(o.get(k, 0.0) for o in ops) * 1e3
                   for k in ("weight_ops", "attention_cpp", "kv_write_cpp")} if ops else {}  # fmt: skip
        entry = {"ms": parts, "cpp_ms": kernels, "round_step_ms": [r["step"] for r in per_round]}
        if kernels:
            entry["outside_kernels_ms"] = parts["step"] - kernels["weight_ops"]
        if ops:
            by_op: dict[str, list[float]] = {}
            for o in ops:
                for name, seconds in o.get("by_op", {}).items():
                    by_op.setdefault(name, []).append(seconds * 1e3)
            entry["weight_ops_ms"] = {name: statistics.median(v) for name, v in sorted(by_op.items())}
        out[variant] = entry
    base = out[variants[0]]["round_step_ms"]
    for variant in variants[1:]:
        ratios = [b / v for b, v in zip(base, out[variant]["round_step_ms"], strict=True)]
        out[variant]["speed_vs_first"] = statistics.median(ratios)
    return out


def table(summary: dict, variants: list[str]) -> str:
    head = ["variant", *PARTS, "weight ops", "attn C++", "kv C++", "outside kernels", "speed vs first"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant in variants:
        entry = summary[variant]
        cpp = entry["cpp_ms"]
        cells = [variant, *(f"{entry['ms'][p]:.3f}" for p in PARTS),
                 *(f"{cpp[k]:.3f}" if cpp else "-" for k in ("weight_ops", "attention_cpp", "kv_write_cpp")),
                 f"{entry['outside_kernels_ms']:.3f}" if "outside_kernels_ms" in entry else "-",
                 f"{entry['speed_vs_first']:.3f}" if "speed_vs_first" in entry else "1"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_rounds(model: Path, kwargs: dict, plan, started: list[str], count: int, args: argparse.Namespace,
               rounds: dict[str, list[dict]], log) -> None:  # fmt: skip
    """Start one child per variant in the order given, run `count` rounds (each round's order alternating), stop
    them."""
    procs: dict[str, subprocess.Popen] = {}
    try:
        for variant in started:  # one at a time: two compiling at once would time each other's start
            procs[variant] = start(model, variant_kwargs(kwargs, variant), child_env(plan, variant), log)
            read_event(procs[variant], log)
        for index in range(count):
            order = started if index % 2 == 0 else started[::-1]
            for variant in order:
                proc = procs[variant]
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"steps": args.steps, "profile": args.profile_steps}) + "\n")
                proc.stdin.flush()
                rounds[variant].append(read_event(proc, log))
    finally:
        for proc in procs.values():
            if proc.stdin:
                proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--child-kwargs", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help="edge-serve's --model (default: the embedded model)")
    parser.add_argument("--priority", choices=("speed", "fidelity"), default="speed")
    parser.add_argument("--variants", default="plain", help=f"comma list of plain[+{'|+'.join(VARIANT_ENV)}]")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--starts", type=int, help="times the children start, each time in another order, the "
                        "rounds shared between them (default: one start per variant, each first once)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=96, help="timed decode steps per round and variant")
    parser.add_argument("--profile-steps", type=int, default=32, help="profiled steps per round (0: none)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--log", type=Path, default=ROOT / ".cache" / "step_profile.log")
    args = parser.parse_args()
    if args.child:
        child(args.child, json.loads(args.child_kwargs))
        return
    variants = args.variants.split(",")
    for variant in variants:
        unknown = [p for p in variant.split("+")[1:] if p not in VARIANT_ENV]
        if variant.split("+")[0] != "plain" or unknown:
            parser.error(f"--variants: expected plain[+{'|+'.join(VARIANT_ENV)}], got {variant!r}")
    args.starts = max(1, min(args.starts or len(variants), args.rounds))
    from edge.device.cpuinfo import host_model_name

    plan, model = plan_and_model(args)
    kwargs = llm_kwargs(plan)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list[dict]] = {v: [] for v in variants}
    with open(args.log, "a") as log:
        for start_index in range(args.starts):
            # each start brings the children up in another order: the first one started steps slower here, the
            # same engine 1.08-1.10x slower than a second copy of itself (2026-12-06, AMD EPYC Zen 4)
            shift = start_index % len(variants)
            started = variants[shift:] + variants[:shift]
            share = args.rounds // args.starts + (start_index < args.rounds % args.starts)
            run_rounds(model, kwargs, plan, started, share, args, rounds, log)
    summary = summarize(rounds, variants)
    header = (f"{host_model_name()}, {os.cpu_count()} cores; plan {plan.path}/{plan.layout or '-'} "
              f"{plan.vllm.env.get('OMP_NUM_THREADS', '')} thread(s); model {model}")  # fmt: skip
    print(header)
    print(f"ms per decode step, medians of {args.rounds} rounds x {args.steps} steps, children started "
          f"{args.starts} times in rotated order (C++ columns: "
          f"{args.profile_steps} profiled steps a round)")
    print(table(summary, variants))
    for variant in variants:
        print(f"{variant} weight ops, ms a step: " + ", ".join(
            f"{name} {ms:.3f}" for name, ms in summary[variant].get("weight_ops_ms", {}).items()))
    if args.json:
        args.json.write_text(json.dumps({"host": header, "args": vars(args) | {"json": str(args.json),
                                         "log": str(args.log), "model": str(args.model)},
                                         "summary": summary, "rounds": rounds}, indent=1, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
