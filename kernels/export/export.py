"""edge-export MODEL OUT [--plan PLAN.json]: the phone deliverable of an export-only plan, built and verified here.

MODEL is a Hugging Face checkpoint directory (bf16 safetensors) of a family the exporter builds (Llama, Mistral,
Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 text: kernels/export/export_graph.py FAMILIES), a .gguf of one (dequantized
to bf16 by edge-convert first, into the cache's converted/), a repo id in the local Hugging Face cache, or `default`
(or the default model's name, as an export-only plan's command names it) for the embedded SmolLM2-135M-Instruct
(`edge-model default`). OUT becomes a bundle for ONNX Runtime (edge/export_plan.py says why that runtime):

    model.onnx              the decoder with its KV cache as inputs/outputs (kernels/export/export_graph.py): weights
                            int8, one scale per 64 inputs of each output channel (QDQ); activations float16 (what
                            a phone's provider runs: the plan's) or float32 (--activations; the default without a
                            plan)
    genai_config.json       what ONNX Runtime GenAI (the phone apps' loader) needs to open the bundle with its
                            Model/Tokenizer/Generator API (kernels/export/genai.py)
    tokenizer.json, tokenizer_config.json, chat_template.jinja, special_tokens_map.json (those MODEL has)
    config.json, generation_config.json
    manifest.json           written last: source model sha256s, the plan's export section, runtime and versions,
                            opset, the weight format, every file's size and sha256, and the verification below

Verification (skipped with --no-verify), in ONNX Runtime's CPU provider (kernels/export/export_verify.py): edge-eval's
metrics (mean KLD, top-1 agreement, perplexity ratio, ...) of the graph's logits against the source on the
default text, greedy continuations of the slow tests' prompts against the source's, the same continuations through
onnxruntime_genai's own tokenizer and generator (which must equal the graph's: the bundle loads as an app loads it),
and tokens/s here (a sanity figure for this x86 host, not a phone's). Targets: top-1 >= 97 %, mean KLD <= 0.01;
`quality.passes` records it.

The bundle is built in a temp dir beside OUT and renamed into place; an OUT whose manifest matches the source
files and settings is left alone ("up to date"); any other existing OUT needs --force.
Exit codes: 0 built (or up to date), 2 bad input (the message names the field and the value).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from edge.device.cpuinfo import host_model_name
from edge.errors import InputError
from edge.formats.export import FORMAT, RUNTIME, WEIGHT_BITS, WEIGHT_BLOCK
from kernels.source.checkpoint import make_readable, read_manifest, sha256_file, write_manifest

EXPORTER_VERSION = "2"  # 2: genai_config.json, the families, float16 activations
MANIFEST = "manifest.json"
GRAPH = "model.onnx"
BUNDLE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                "config.json", "generation_config.json")  # fmt: skip
DEFAULT_TOKENS = 4096  # 8 chunks of 512: the whole export stays within ~5 min on 2 cores
CHUNK = 512
MIN_TOP1, MAX_KLD = 0.97, 0.01  # the targets for 8-bit weights (llama.cpp Q8_0: 97.7 %, 0.0014)


def resolve_model(model: str) -> Path:
    """MODEL as a directory; `default` or the default model's name builds/finds the embedded model; a Hugging Face
    repo id is its snapshot in the local cache; a .gguf is its bf16 dequantization, which edge-convert writes
    into the cache's converted/ (reused while up to date), as edge-serve and edge-eval make it."""
    from edge.model.reader import is_gguf
    from edge.model.reader import resolve_model as resolve_source
    from kernels.source.default_model import MODEL_NAME, ensure_default_model

    if model in ("default", MODEL_NAME) and not Path(model).is_dir():
        return ensure_default_model()
    path = resolve_source(model)
    if is_gguf(path):
        return _bf16_of_gguf(path.resolve())
    if not (path / "config.json").is_file():
        raise InputError("MODEL", model, "a model directory with config.json, a .gguf, a repo id in the local "
                         "Hugging Face cache, or `default`")  # fmt: skip
    return path.resolve()


def _bf16_of_gguf(gguf: Path) -> Path:
    """edge-convert GGUF DST (bf16) in its own process: the converter sits above the exporter in kernels/."""
    import subprocess

    from edge.paths import converted_dir

    def run(*argv: str) -> str:
        done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True)
        if done.returncode != 0:
            raise InputError("MODEL", str(gguf), f"a GGUF edge-convert reads ({done.stderr.strip()[-500:]})")
        return done.stdout

    dst = converted_dir(gguf, None)
    with tempfile.TemporaryDirectory(prefix="edge-export-") as tmp:
        plan = Path(tmp) / "bf16-plan.json"  # without a plan edge-convert plans for this host, not bf16
        plan.write_text(run("edge.cli", "--model", str(gguf), "--path", "bf16", "--json"))
        run("kernels.convert.convert", str(gguf), str(dst), "--plan", str(plan))
    return dst


def check_family(src: Path) -> str:
    """The source's model_type, when the exporter builds its family; otherwise InputError naming it."""
    import json

    from kernels.export.export_graph import FAMILIES, SEQUENCE_DEPENDENT_ROPE

    try:
        config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise InputError("MODEL config.json", str(src / "config.json"), f"a readable JSON file ({error})") from None
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise InputError("MODEL model_type", str(model_type), f"a family edge-export builds: {', '.join(FAMILIES)}")
    for key in ("rope_parameters", "rope_scaling"):  # one dict, or one per layer type (Gemma 3)
        rope = config.get(key) or {}
        for params in [rope] if "rope_type" in rope or "type" in rope else list(rope.values()):
            kind = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
            if kind in SEQUENCE_DEPENDENT_ROPE:
                raise InputError(f"MODEL {key}.rope_type", kind, "a RoPE whose table does not depend on the "
                                 "sequence's length: the graph holds one fixed table")  # fmt: skip
    return model_type


def source_sha256(src: Path) -> dict[str, str]:
    files = sorted([*src.glob("*.safetensors"), src / "config.json"])
    return {p.name: sha256_file(p) for p in files}


def settings(plan: Any, verify: bool, tokens: int, activations: str) -> dict[str, Any]:
    """What the bundle depends on besides the source files: a change in any of these rebuilds it."""
    from kernels.export.export_graph import OPSET, QDQ_OPSET, ROPE_ROWS

    return {"exporter_version": EXPORTER_VERSION, "format": FORMAT, "weight_bits": WEIGHT_BITS,
            "weight_block": WEIGHT_BLOCK, "opset": QDQ_OPSET, "export_opset": OPSET, "rope_rows": ROPE_ROWS,
            "activations": activations, "verified_tokens": tokens if verify else None,
            "plan_export": plan.export.model_dump() if plan is not None and plan.export else None}  # fmt: skip


def up_to_date(out: Path, sha: dict[str, str], wanted: dict[str, Any]) -> tuple[bool, str]:
    manifest, problem = read_manifest(out, MANIFEST)
    if manifest is None:
        return False, problem or "no manifest"
    if manifest.get("settings") != wanted:
        return False, "it was exported with other settings"
    if (manifest.get("source") or {}).get("sha256") != sha:
        return False, "it was exported from different source files"
    return True, "up to date"


def export(model: str | Path, out: Path, plan: Any = None, *, verify: bool = True, tokens: int = DEFAULT_TOKENS,
           force: bool = False, threads: int | None = None, activations: str | None = None,
           log=None) -> Path:  # fmt: skip
    """Build the bundle for MODEL at OUT (module docstring); returns OUT. Bad input raises InputError first.
    `activations` defaults to what the plan's export section names (float16: a phone provider's), else float32."""
    log = log or (lambda message: print(message, file=sys.stderr))
    if plan is not None and plan.path != "export-only":
        raise InputError("--plan path", plan.path, "an export-only plan (edge-select --device <a phone>)")
    from kernels.export.export_graph import ACTIVATIONS

    field = "--activations"
    if activations is None:
        field, activations = "--plan export.activations", plan.export.activations if plan and plan.export else "float32"
    if activations not in ACTIVATIONS:
        raise InputError(field, activations, f"one of {', '.join(ACTIVATIONS)}")
    from kernels.scoring.eval_text import check_request

    if verify:
        check_request(tokens, CHUNK, None)
    src = resolve_model(str(model))
    check_family(src)
    out = Path(out).resolve()
    if out == src or src in out.parents:
        raise InputError("OUT", str(out), "a directory outside MODEL")
    sha, wanted = source_sha256(src), settings(plan, verify, tokens, activations)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        fresh, why = up_to_date(out, sha, wanted)
        if fresh:
            log(f"{out} is up to date; nothing to do")
            return out
        if not force:
            raise InputError("OUT", str(out), f"a new directory, or --force to replace it ({why})")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        body = _build(src, tmp, plan, threads, log, verify, tokens, activations)
        write_manifest(tmp, MANIFEST, {**body, "settings": wanted, "source": {"path": str(src), "sha256": sha}})
        make_readable(tmp)
        if out.exists():  # --force: move the old bundle aside (atomic rename); removed with the temp dirs
            os.replace(out, Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent)) / "old")
        os.replace(tmp, out)
    finally:
        for leftover in out.parent.glob(f".{out.name}.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    return out


def _build(src: Path, tmp: Path, plan: Any, threads: int | None, log, verify: bool, tokens: int,
           activations: str) -> dict[str, Any]:  # fmt: skip
    os.environ["HF_HUB_OFFLINE"] = "1"
    import onnx
    import onnxruntime
    import torch

    from kernels.export import export_graph, genai
    from kernels.scoring.eval_model import load_source

    start = time.monotonic()
    if threads:
        torch.set_num_threads(threads)
    float_graph = tmp / ".float.onnx"
    with torch.inference_mode():
        shape = export_graph.export_float(load_source(src).float(), float_graph, activations)
    linears = export_graph.quantize_qdq(float_graph, tmp / GRAPH)
    float_graph.unlink()
    for name in BUNDLE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    genai.write_genai_config(tmp, src, GRAPH, shape)
    log(f"exported {GRAPH} ({shape['family']}, {activations} activations): {linears} linears at {WEIGHT_BITS} bits, "
        f"{(tmp / GRAPH).stat().st_size / 2**20:.1f} MiB in {time.monotonic() - start:.0f} s")  # fmt: skip
    body = {
        "format": FORMAT,
        "runtime": {"name": RUNTIME, "version": onnxruntime.__version__, "onnx": onnx.__version__,
                    "opset": export_graph.QDQ_OPSET, "providers_verified": ["CPUExecutionProvider"]},  # fmt: skip
        "graph": {"file": GRAPH, **shape, "linears_int8": linears, "weight_bits": WEIGHT_BITS,
                  "weight_block": WEIGHT_BLOCK, "batch": 1, "genai_config": genai.CONFIG,
                  "inputs": "input_ids, position_ids, past_key_values.{i}.key|value [1, kv_heads, past, head_dim]",
                  "outputs": "logits, present.{i}.key|value"},  # fmt: skip
        "plan": plan.model_dump(mode="json") if plan is not None else None,
        "built_s": round(time.monotonic() - start, 1),
    }
    if verify:
        body["verification"] = _verify(src, tmp, tokens, threads, log, activations)
    return body


def _verify(src: Path, bundle: Path, tokens: int, threads: int | None, log, activations: str) -> dict[str, Any]:
    from kernels.export import export_verify

    graph = bundle / GRAPH
    quality = export_verify.quality(src, graph, tokens, CHUNK, threads)
    m = quality["metrics"]
    top1, kld = m["top1_agreement"]["value"], m["mean_kld"]["value"]
    quality["passes"] = top1 >= MIN_TOP1 and kld <= MAX_KLD
    quality["targets"] = {"top1_agreement_min": MIN_TOP1, "mean_kld_max": MAX_KLD}
    greedy = export_verify.greedy(src, graph, threads)
    through_genai = export_verify.genai_greedy(bundle, greedy)
    speed = export_verify.speed(graph, threads)
    log(f"verified: mean KLD {kld:.5f}, top-1 {top1 * 100:.2f} %, PPL ratio {m['ppl_ratio']['value']:.4f} on "
        f"{m['tokens']} tokens ({'passes' if quality['passes'] else 'FAILS'} >= {MIN_TOP1:.0%} / <= {MAX_KLD}); "
        f"greedy {greedy['exact']:.0%} of prompts exact over {greedy['new_tokens']} tokens; onnxruntime-genai "
        f"{through_genai['equal_to_graph']:.0%} equal to the graph's; "
        f"{speed['prefill_tok_s']} prefill / {speed['decode_tok_s']} decode tok/s here ({speed['threads']} threads)")
    body = {"quality": quality, "greedy": greedy, "onnxruntime_genai": through_genai, "speed": speed,
            "cpu": host_model_name()}  # fmt: skip
    if activations == "float16":
        body["cpu_provider_float32_ops"] = export_verify.float16_fallbacks(graph)
    return body


def main(argv: list[str] | None = None) -> int:
    from edge.plan.plan_file import load_plan

    parser = argparse.ArgumentParser(
        prog="edge-export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", metavar="MODEL",
                        help="model directory, .gguf, repo id in the local Hugging Face cache, or `default`")
    parser.add_argument("out", metavar="OUT", type=Path, help="where the bundle goes")
    parser.add_argument("--plan", type=Path, help="an export-only Plan JSON (edge-select --device PHONE --json)")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="tokens to score (default %(default)s)")
    parser.add_argument("--no-verify", action="store_true", help="skip the quality, greedy and speed checks")
    parser.add_argument("--threads", type=int, help="torch and ONNX Runtime threads (default: all cores)")
    parser.add_argument("--force", action="store_true", help="replace an OUT holding another export")
    parser.add_argument("--activations", help="the graph's activations: float32 or float16 (a phone provider's); "
                        "default: what --plan names (float16), else float32")
    args = parser.parse_args(argv)
    try:
        plan = load_plan(args.plan) if args.plan else None
        out = export(args.model, args.out, plan, verify=not args.no_verify, tokens=args.tokens, force=args.force,
                     threads=args.threads, activations=args.activations)  # fmt: skip
    except InputError as error:
        print(f"edge-export: {error}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
