"""Run an exported graph (kernels/export/export_graph.py) in ONNX Runtime's CPU provider and measure it against its
source.

    quality     edge-eval's numbers (kernels.scoring.eval_score.score over kernels.scoring.eval_text's chunks,
                summarized by kernels.scoring.quality_metrics) with the graph's logits as the candidate and the source
                as reference
    greedy      greedy continuations of the slow tests' prompts, graph (with its KV cache) vs source
    genai       the same continuations through onnxruntime_genai's tokenizer and generator, vs the graph's
    speed       prefill and decode tokens/s of the graph here: a sanity figure for this x86 host, not a phone's
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

# tests/kernels/test_serve_slow.py's prompts: the greedy comparison uses the same ones.
PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
    "The opposite of hot is",
    "Photosynthesis is the process by which",
    "1, 2, 3, 4, 5,",
]
NEW_TOKENS = 16


class GraphModel:
    """The graph behind the call edge-eval makes of a model: model(input_ids=, use_cache=, logits_to_keep=)."""

    def __init__(self, graph: Path, threads: int | None = None, session_config: dict[str, str] | None = None) -> None:
        import onnxruntime as ort

        from kernels.export.genai import SESSION_CONFIG

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        # The bundle's own session options (genai_config.json carries them to an app): the weights' DequantizeLinear
        # folded into float initializers at load, so the linears run with float activations
        for key, value in (SESSION_CONFIG if session_config is None else session_config).items():
            options.add_session_config_entry(key, value)
        self.session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        pasts = [i for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        self.past_names = [i.name for i in pasts]
        self.kv_heads, self.head_dim = pasts[0].shape[1], pasts[0].shape[3]
        self.kv_dtype = np.float16 if pasts[0].type == "tensor(float16)" else np.float32

    def run(self, ids: np.ndarray, start: int, past: list[np.ndarray] | None) -> tuple[np.ndarray, list[np.ndarray]]:
        """ids int64 [1, S] at positions start.. -> (logits float32 [1, S, V], presents)."""
        if past is None:
            past = [np.zeros((1, self.kv_heads, 0, self.head_dim), self.kv_dtype)] * len(self.past_names)
        positions = np.arange(start, start + ids.shape[1], dtype=np.int64)[None]
        feeds = {"input_ids": ids, "position_ids": positions, **dict(zip(self.past_names, past, strict=True))}
        logits, *presents = self.session.run(None, feeds)
        return logits, presents

    def __call__(self, input_ids: torch.Tensor, use_cache: bool = False, logits_to_keep: int = 0) -> Any:
        logits, _ = self.run(input_ids.numpy(), 0, None)
        return SimpleNamespace(logits=torch.from_numpy(logits[:, -logits_to_keep:]))

    def generate(self, ids: list[int], new_tokens: int) -> list[int]:
        """Greedy: one prefill run, then one run per token on the KV cache."""
        logits, past = self.run(np.array([ids], np.int64), 0, None)
        out = [int(logits[0, -1].argmax())]
        while len(out) < new_tokens:
            logits, past = self.run(np.array([[out[-1]]], np.int64), len(ids) + len(out) - 1, past)
            out.append(int(logits[0, -1].argmax()))
        return out


def quality(source_dir: Path, graph: Path, tokens: int, chunk_len: int, threads: int | None = None,
            reference: str = "float32", session_config: dict[str, str] | None = None) -> dict[str, Any]:
    """edge-eval's metrics of the graph against the source on the default text. The reference runs the source's
    bf16 weights in `reference` arithmetic: float32 by default, the graph's own, so the numbers are the 8-bit
    weights' loss alone; "bfloat16" is edge-eval's reference (bf16 rounding of every activation adds its own)."""
    from transformers import AutoTokenizer

    from kernels.scoring import eval_text
    from kernels.scoring.eval_model import load_source
    from kernels.scoring.eval_score import score
    from kernels.scoring.quality_metrics import summarize

    body = eval_text.read_text(None)
    tokenizer = AutoTokenizer.from_pretrained(source_dir, local_files_only=True)
    ids, bos = eval_text.tokenize(tokenizer, body.content)
    windows = eval_text.make_windows(ids, tokens, chunk_len, bos, text=body.path.name)  # [C, L+1]
    start = time.monotonic()
    source = load_source(source_dir).to(getattr(torch, reference))
    stats = score(source, GraphModel(graph, threads, session_config), windows, progress=False)
    return {"reference": f"source weights in {reference} arithmetic (transformers, torch CPU)",
            "text": body.describe(), "chunk_len": chunk_len, "chunks": windows.shape[0], "metrics": summarize(stats),
            "wall_s": round(time.monotonic() - start, 1)}  # fmt: skip


def greedy(source_dir: Path, graph: Path, threads: int | None = None, reference: str = "float32") -> dict[str, Any]:
    """Greedy continuations of PROMPTS by the graph and by the source (in `reference` arithmetic, as quality())."""
    from transformers import AutoTokenizer

    from kernels.scoring.eval_model import load_source

    tokenizer = AutoTokenizer.from_pretrained(source_dir, local_files_only=True)
    source, model = load_source(source_dir).to(getattr(torch, reference)), GraphModel(graph, threads)
    rows = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            ref = source.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False)[0, len(ids) :].tolist()
        got = model.generate(ids, NEW_TOKENS)
        prefix = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), NEW_TOKENS)
        rows.append({"prompt": prompt, "source": tokenizer.decode(ref), "graph": tokenizer.decode(got),
                     "matching_prefix": prefix, "prompt_ids": ids, "graph_ids": got})  # fmt: skip
    return {
        "reference": f"source weights in {reference} arithmetic",
        "new_tokens": NEW_TOKENS,
        "exact": sum(r["matching_prefix"] == NEW_TOKENS for r in rows) / len(rows),
        "first_token": sum(r["matching_prefix"] > 0 for r in rows) / len(rows),
        "prompts": rows,
    }


def genai_greedy(bundle: Path, greedy_result: dict[str, Any]) -> dict[str, Any]:
    """The prompts of `greedy_result` (greedy()'s) through onnxruntime_genai (kernels/export/genai.py): its tokenizer
    must give the prompt ids transformers' gave, and its generator, on its own KV cache, the graph's continuation."""
    from kernels.export import genai

    rows = greedy_result["prompts"]
    got = genai.generate(bundle, [r["prompt"] for r in rows], greedy_result["new_tokens"])
    out = [{"prompt": r["prompt"], "text": g["text"], "same_prompt_ids": g["prompt_ids"] == r["prompt_ids"],
            "equal_to_graph": g["ids"] == r["graph_ids"]} for r, g in zip(rows, got, strict=True)]  # fmt: skip
    return {
        "runtime": "onnxruntime_genai Model/Tokenizer/Generator, greedy",
        "tokenizer_agrees": sum(r["same_prompt_ids"] for r in out) / len(out),
        "equal_to_graph": sum(r["equal_to_graph"] for r in out) / len(out),
        "prompts": out,
    }


def float16_fallbacks(graph: Path) -> list[str]:
    """The op types ONNX Runtime's CPU provider runs in float32 in a float16 graph: those it has no float16 kernel
    for, around which its InsertCastTransformer inserts Casts (read off the optimized graph). Such ops compute in
    float32 on float16-rounded inputs and round their outputs back: float16 storage, float32 arithmetic."""
    import tempfile

    import onnx
    import onnxruntime as ort

    from kernels.export.genai import SESSION_CONFIG

    with tempfile.TemporaryDirectory(prefix="edge-export-fp16-") as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        options.log_severity_level = 3
        for key, value in SESSION_CONFIG.items():
            options.add_session_config_entry(key, value)
        ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        nodes = onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node
    to_float = {n.output[0] for n in nodes if n.op_type == "Cast" and n.name.startswith("InsertedPrecisionFreeCast")
                and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT for a in n.attribute)}  # fmt: skip
    return sorted({n.op_type for n in nodes if n.op_type != "Cast" and to_float.intersection(n.input)})


def speed(graph: Path, threads: int | None = None, prompt_len: int = 256, new_tokens: int = 64,
          session_config: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Tokens/s of one prefill of `prompt_len` tokens and of `new_tokens` single-token steps on its cache."""
    model = GraphModel(graph, threads, session_config)
    ids = np.arange(100, 100 + prompt_len, dtype=np.int64)[None]
    model.run(ids[:, :8], 0, None)  # warm-up
    start = time.perf_counter()
    _, past = model.run(ids, 0, None)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for step in range(new_tokens):
        _, past = model.run(np.array([[7]], np.int64), prompt_len + step, past)
    decode = time.perf_counter() - start
    return {"threads": model.session.get_session_options().intra_op_num_threads, "prompt_tokens": prompt_len,
            "prefill_tok_s": round(prompt_len / prefill, 1), "decode_tok_s": round(new_tokens / decode, 1)}  # fmt: skip
