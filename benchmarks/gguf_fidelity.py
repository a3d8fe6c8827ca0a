"""Fidelity to a GGUF file: what edge-select serves from it against what llama.cpp runs from it, on the same text,
scored against the same reference (issue 22, item 5).

    python -m benchmarks.gguf_fidelity FILE.gguf [FILE.gguf ...] [--tokens 4096] [--chunk 512] [--threads 2]
        [--llama-python .cache/llama-native/bin/python] [--priorities speed,fidelity] [--json OUT.json]
    python -m benchmarks.gguf_fidelity --quantize SRC.gguf DST.gguf --type Q4_K_M   # llama.cpp's own quantizer
    python -m benchmarks.gguf_fidelity --make-float OUT.gguf [--shape gemma3]      # a generated F16 model (below)

The reference is the file's own weights, every tensor dequantized by gguf-py (`gguf.quants.dequantize`, through
kernels.source.gguf_source.dequantized) to float32 and run in float32 by transformers' module for the file's
architecture (its config and tokenizer from the file, as edge-convert's bf16 path writes them). Each candidate
sees the same token windows (kernels.scoring.eval_text: consecutive chunks of `--chunk` tokens of the default
prose, the second half of each scored), as token ids, so tokenization cannot differ:

    edge-select <priority>  the plan edge-select makes for this host at that priority (`edge-select --model FILE
                            --priority P --json`), converted by edge-convert (the cache's converted/), run by
                            edge-eval's candidate loader: the kernels the engine runs (kernels.scoring.eval_model)
    llama.cpp               llama-cpp-python (a separate venv; its own build of llama.cpp) loading FILE itself,
                            every position's logits (`logits_all`), one window per eval from a cleared KV cache,
                            in the child process this file runs as under `--llama-python` (`--child-logits`)

Metrics per candidate (kernels.scoring.quality_metrics.summarize): mean KLD(reference || candidate), top-1
agreement, perplexity ratio with standard errors. The llama.cpp build's system info (which SIMD it uses) is
reported, since llama.cpp's activations go through its own 8-bit quantization (Q8_0 / Q8_K) where its dot products
need them.

`--make-float` writes a generated Llama whose hidden (1024) and intermediate (2816) widths are multiples of 256,
F16 matrices and F32 norms, the default model's tokenizer copied in, and no rope_freqs tensor (llama.cpp would
apply one; transformers' Llama config does not): the input for llama.cpp's quantizer, so the Q4_K_M it makes holds
real Q4_K and Q6_K tensors. `--shape gemma3` writes a Gemma 3 at 1B's widths (hidden 1152, which no K-quant row
takes, so llama.cpp's Q4_K_M falls back to its other types as for the real file), its 262144-row embedding (the
tokenizer padded with unused tokens) and sliding window, and 6 of its 26 layers. Their weights are random, so their
next-token distributions are not a language model's;
the default model's file and a Q4_K_M llama.cpp makes from it (requantized from its Q4_1) are the real-model rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LLAMA_PYTHON = ROOT / ".cache" / "llama-native" / "bin" / "python"
LLAMA_BUILD_HINT = (
    "python3.11 -m venv .cache/llama-native && CMAKE_ARGS='-DGGML_NATIVE=ON -DGGML_BLAS=OFF' "
    ".cache/llama-native/bin/pip install 'llama-cpp-python[server]==0.3.36' --no-cache-dir  (~10 min on 2 cores)"
)
SEED = 1234


# --- child side: runs under the llama.cpp venv's python; imports only the standard library, numpy and llama_cpp --


def child_logits(gguf: str, windows_file: str, out_dir: str, keep: int, threads: int) -> dict:
    """Logits [keep, V] float32 of the last `keep` positions of each window (minus its final token) -> out_dir/i.npy."""
    import llama_cpp
    import numpy as np

    windows = json.loads(Path(windows_file).read_text())
    length = len(windows[0]) - 1
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=length, n_batch=length, n_ubatch=length, logits_all=True,
                          n_threads=threads, n_threads_batch=threads, seed=SEED, verbose=False)  # fmt: skip
    start = time.monotonic()
    for i, window in enumerate(windows):
        llm.reset()
        llm.eval(window[:length])
        np.save(Path(out_dir) / f"{i}.npy", np.asarray(llm.scores[length - keep : length], dtype=np.float32))
    return {
        "llama_cpp": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(),
        "threads": threads,
        "wall_s": round(time.monotonic() - start, 1),
    }


def child_quantize(src: str, dst: str, kind: str, threads: int) -> dict:
    """llama.cpp's own quantizer (llama_model_quantize), allowed to requantize an already quantized file."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize = True
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({src}, {kind}) returned {rc}")
    return {"llama_cpp": llama_cpp.__version__, "type": kind, "out": dst}


# --- driver side (the project venv) ---------------------------------------------------------------------------


def _child(python: Path, args: list[str], timeout_s: float = 3600) -> dict:
    if not python.exists():
        raise SystemExit(f"{python}: no such interpreter. llama-cpp-python goes in its own venv:\n{LLAMA_BUILD_HINT}")
    done = subprocess.run([str(python), str(Path(__file__).resolve()), *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def reference_model(gguf: Path, reference_dir: Path):
    """transformers' module for the file's architecture in float32, every parameter the file's own tensor
    dequantized to float32 (a tied head shares the embedding, as in the file)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kernels.source.gguf_source import dequantized, read_gguf

    model = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32, local_files_only=True).eval()
    source = read_gguf(gguf)
    used = set()
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head is not listed apart
            if name not in source.tensors:
                raise SystemExit(f"{gguf.name}: no tensor for {name}")
            param.copy_(dequantized(source, name, torch.float32))
            used.add(name)
    left = set(source.tensors) - used
    if left:
        raise SystemExit(f"{gguf.name}: tensors the model does not take: {sorted(left)[:5]}")
    return model


def plan_candidate(gguf: Path, priority: str) -> tuple[dict, Path]:
    """(the plan edge-select makes for this host, the checkpoint it serves: edge-convert's output, or for a bf16
    plan of a GGUF its bf16 dequantization, which is what edge-serve converts it to). `priority` may pin a path:
    "speed:w4a16-tinygemm" is `--priority speed --path w4a16-tinygemm`."""
    from kernels.evaluate.evaluate import apply_plan, gguf_reference

    priority, _, path = priority.partition(":")
    pin = ["--path", path] if path else []
    done = subprocess.run([sys.executable, "-m", "edge.cli", "--model", str(gguf), "--priority", priority, *pin,
                           "--json"], capture_output=True, text=True, check=True, cwd=ROOT)  # fmt: skip
    plan = json.loads(done.stdout)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(done.stdout)
    try:
        checkpoint = apply_plan(gguf, Path(f.name))
    finally:
        os.unlink(f.name)
    return plan, gguf_reference(checkpoint) if checkpoint == gguf else checkpoint


def score_file(gguf: Path, args: argparse.Namespace) -> dict:
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from kernels.evaluate.evaluate import gguf_reference
    from kernels.scoring import eval_text
    from kernels.scoring.eval_model import load_candidate
    from kernels.scoring.eval_score import scored_logits
    from kernels.scoring.quality_metrics import TokenStats, summarize, token_stats

    torch.set_num_threads(args.threads)
    reference_dir = gguf_reference(gguf)
    tokenizer = AutoTokenizer.from_pretrained(reference_dir, local_files_only=True)
    body = eval_text.read_text(None)
    ids, bos = eval_text.tokenize(tokenizer, body.content)
    windows = eval_text.make_windows(ids, args.tokens, args.chunk, bos, text=body.path.name)  # [C, L+1]
    length = windows.shape[1] - 1
    first = length // 2
    keep = length - first

    with tempfile.TemporaryDirectory(prefix="gguf-fidelity-") as tmp:
        windows_file = Path(tmp) / "windows.json"
        windows_file.write_text(json.dumps(windows.tolist()))
        llama = _child(args.llama_python, ["--child-logits", str(gguf), str(windows_file), tmp, str(keep),
                                           str(args.threads)])  # fmt: skip
        candidates: dict[str, torch.nn.Module] = {}
        plans: dict[str, dict] = {}
        for priority in args.priorities:
            plan, checkpoint = plan_candidate(gguf, priority)
            label = f"edge-select {priority}: {plan['path']}" + (f"/{plan['layout']}" if plan.get("layout") else "")
            label += " (pinned)" if ":" in priority else ""
            plans[label] = {"path": plan["path"], "layout": plan.get("layout"), "checkpoint": str(checkpoint),
                            "quantization_config": plan.get("quantization_config")}  # fmt: skip
            candidates[label] = load_candidate(checkpoint, reference_dir).model
        reference = reference_model(gguf, reference_dir)
        parts: dict[str, list] = {label: [] for label in [*candidates, "llama.cpp"]}
        with torch.inference_mode():
            for i, window in enumerate(windows):
                inputs, targets = window[:-1].unsqueeze(0), window[first + 1 :]
                ref = scored_logits(reference, inputs, keep)  # [keep, V] fp32
                for label, model in candidates.items():
                    parts[label].append(token_stats(ref, scored_logits(model, inputs, keep), targets))
                theirs = torch.from_numpy(np.load(Path(tmp) / f"{i}.npy"))
                parts["llama.cpp"].append(token_stats(ref, theirs, targets))
    from edge.model.gguf_metadata import read_header, tensor_types

    return {
        "file": str(gguf),
        "types": tensor_types(read_header(gguf)),
        "tokens": args.tokens,
        "chunk": args.chunk,
        "chunks": int(windows.shape[0]),
        "text": body.describe(),
        "plans": plans,
        "llama_cpp": llama,
        "metrics": {label: summarize(TokenStats.cat(stats)) for label, stats in parts.items()},
    }


def _float_shapes():
    from benchmarks import make_random_gguf as mk

    return {  # --make-float's architectures: (gguf arch, dims)
        "llama": ("llama", mk.Dims(layers=8, hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816,
                                   vocab=49152, context=2048)),
        # Gemma 3 1B's widths, vocabulary (262144) and sliding window (512), 6 of its 26 layers (one full-attention
        # layer in its pattern of 6); the default model's tokenizer padded to the vocabulary
        "gemma3": ("gemma3", mk.Dims(layers=6, hidden=1152, heads=4, kv_heads=1, head_dim=256, intermediate=6912,
                                     vocab=262144, context=32768, sliding_window=512)),
    }  # fmt: skip


def make_float(out: Path, shape: str = "llama") -> Path:
    """The generated model of the module docstring, F16 matrices, for llama.cpp's quantizer."""
    import numpy as np

    from benchmarks import make_random_gguf as mk
    from kernels.source.default_model import source_gguf

    arch, dims = _float_shapes()[shape]
    rng = np.random.default_rng(SEED)
    tensors = {}
    for name, (shape_, role) in mk.architecture_shapes(arch, dims).items():
        if role == "matrix":
            tensors[name] = (mk.weights(rng, *shape_).astype(np.float16), mk.Q.F16)
        elif role == "norm":  # Gemma's hold 1 + w, as llama.cpp writes them: the same values either way
            tensors[name] = ((1.0 + 0.1 * rng.standard_normal(shape_)).astype(np.float32), mk.Q.F32)
        # rope factors: left out (module docstring)
    return mk.write_gguf(out, arch, tensors, dims, tokenizer_from=source_gguf())


def _row(label: str, m: dict) -> str:
    def pm(entry: dict, scale: float = 1.0, digits: int = 4) -> str:
        return f"{entry['value'] * scale:.{digits}f} ± {entry['se'] * scale:.{digits}f}"

    return (f"| {label} | {pm(m['mean_kld'], digits=5)} | {pm(m['top1_agreement'], 100, 2)} % | "
            f"{pm(m['ppl_ratio'])} |")  # fmt: skip


def format_result(result: dict) -> str:
    types = ", ".join(f"{k} {v}" for k, v in sorted(result["types"].items()))
    lines = [f"### {Path(result['file']).name} ({types})", "",
             f"{result['tokens']} tokens scored, {result['chunks']} chunks of {result['chunk']}; llama.cpp "
             f"{result['llama_cpp']['llama_cpp']}: {result['llama_cpp']['system_info'].strip()}", "",
             "| candidate | mean KLD | top-1 agreement | perplexity ratio |", "|---|---|---|---|"]  # fmt: skip
    lines += [_row(label, m) for label, m in result["metrics"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child-logits":
        print(json.dumps(child_logits(argv[1], argv[2], argv[3], int(argv[4]), int(argv[5]))))
        return 0
    if argv and argv[0] == "--child-quantize":
        print(json.dumps(child_quantize(argv[1], argv[2], argv[3], int(argv[4]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", nargs="*", type=Path)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--llama-python", type=Path, default=DEFAULT_LLAMA_PYTHON)
    parser.add_argument("--priorities", type=lambda s: s.split(","), default=["speed", "fidelity"])
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--quantize", nargs=2, type=Path, metavar=("SRC", "DST"))
    parser.add_argument("--type", default="Q4_K_M", help="llama.cpp's ftype for --quantize (default %(default)s)")
    parser.add_argument("--make-float", type=Path, metavar="OUT")
    parser.add_argument("--shape", choices=("llama", "gemma3"), default="llama", help="--make-float's model")
    args = parser.parse_args(argv)
    if args.make_float:
        print(make_float(args.make_float, args.shape))
        return 0
    if args.quantize:
        src, dst = (p.resolve() for p in args.quantize)
        print(json.dumps(_child(args.llama_python, ["--child-quantize", str(src), str(dst), args.type,
                                                    str(args.threads)])))  # fmt: skip
        return 0
    if not args.gguf:
        parser.error("give a GGUF file, or --quantize / --make-float")
    os.environ["HF_HUB_OFFLINE"] = "1"
    args.llama_python = args.llama_python.absolute()  # not resolve(): a venv's python is a symlink out of it
    results = []
    for gguf in args.gguf:
        result = score_file(gguf.resolve(), args)
        results.append(result)
        print(format_result(result), flush=True)
        print()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
