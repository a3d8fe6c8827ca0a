"""edge-eval SOURCE CANDIDATE [--text FILE] [--tokens N] [--json]: how far a converted checkpoint's predictions
are from its bf16 source, on English prose.

CANDIDATE is a directory edge-convert wrote (bf16, w4a16-tinygemm `cpu_int4`, or w4a8-gptq) or any bf16
checkpoint of the same shapes; SOURCE is the bf16 model it came from. Both run as plain PyTorch on this CPU, the
candidate through the kernels the engine serves it with (kernels/scoring/eval_model.py), over chunks of the text
(kernels/scoring/eval_text.py; default: Newton's Opticks, public domain, shipped in a package vLLM already installs).
Reported, each with its standard error (kernels/scoring/quality_metrics.py):

    mean KLD            KL(source || candidate) per scored token, nats
    KLD p99             99th percentile of the per-token KLD
    top-1 agreement     fraction of positions where both models' most likely token is the same
    perplexity ratio    candidate perplexity / source perplexity on the same tokens
    confident flips     positions where the source's top-1 has p > 0.5 and the candidate's top-1 differs,
                        as a fraction of all scored tokens (and how many positions were confident)

--decode-kernel avx2|avx2-w4a8|tinygemm runs a `cpu_int4` candidate with that decode kernel instead of the one its
quantization_config names (the same weights): every row then goes through the AVX2 kernel, so each scored
position is computed as a decoded token is, and the record's key says which kernel (int8 activations change
the numbers; the speed plan reads that record before it decodes with them).

Results are cached under $EDGE_SELECT_CACHE_DIR/quality/, keyed by the source and candidate files, the
candidate's quantization_config, the text, the token count and chunk length (and the torch build, the CPU
capability torch dispatches to and this project's kernel code, which decide the arithmetic); a repeated run
answers from the cache and says so. A report on the default text carries a `record` (edge.measure.quality.QualityRecord)
that the planner reads to weigh quality.

Exit codes: 0 measured (or cached), 2 bad input (the message names the field and the value).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from edge.catalog.weight_paths import path_of_method
from edge.errors import InputError
from kernels.scoring import eval_text
from kernels.scoring.eval_cache import cache_key, load_cached, store
from kernels.scoring.eval_config import check_same_shapes, quant_method, read_config

HARNESS_VERSION = "1"
DEFAULT_TOKENS = 16384
DEFAULT_CHUNK = 512


@dataclass
class QualityReport:
    source: str
    candidate: str
    quant_method: str  # bf16, cpu_int4 or gptq
    kernel: dict[str, Any]
    text: dict[str, Any]
    chunk_len: int
    chunks: int
    tokens_requested: int
    tokens_scored: int
    metrics: dict[str, Any]
    wall_s: float
    threads: int
    host: dict[str, Any]
    key: str
    cached: bool = False
    measured_at: str | None = None  # UTC, ISO 8601
    record: dict[str, Any] | None = None  # edge.measure.quality.QualityRecord for the planner (default text only)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> QualityReport:
        known = {f.name for f in fields(cls)}  # a field dropped since the report was cached is ignored
        return cls(**{name: value for name, value in data.items() if name in known})


def evaluate(
    source_dir: Path | str,
    candidate: Path | str,
    text: Path | str | None = None,
    *,
    tokens: int = DEFAULT_TOKENS,
    chunk_len: int = DEFAULT_CHUNK,
    threads: int | None = None,
    progress: bool = True,
    use_cache: bool = True,
    decode_kernel: str | None = None,
) -> QualityReport:
    """Score CANDIDATE against SOURCE on `text` (None: the default prose); InputError on bad input.
    decode_kernel: run a cpu_int4 candidate with this decode kernel (module docstring)."""
    source_label = str(Path(source_dir).resolve())
    source_dir, candidate = gguf_reference(Path(source_dir)).resolve(), Path(candidate).resolve()
    source_config = read_config(source_dir, "SOURCE")
    candidate_config = read_config(candidate, "CANDIDATE")
    method = quant_method(candidate_config)
    if decode_kernel is not None:
        candidate_config = _with_decode_kernel(candidate_config, method, decode_kernel)
    check_same_shapes(source_config, candidate_config)
    eval_text.check_request(tokens, chunk_len, source_config.get("max_position_embeddings"))
    threads = (os.cpu_count() or 1) if threads is None else threads
    if threads < 1:
        raise InputError("--threads", threads, "a thread count >= 1")
    body = eval_text.read_text(None if text is None else Path(text))
    key = cache_key(source_dir, candidate, candidate_config.get("quantization_config"), body.sha256, tokens,
                    chunk_len, HARNESS_VERSION)  # fmt: skip
    # Records compare configurations, so only measurements on the one default text become records.
    recorded = text is None
    qconfig = candidate_config.get("quantization_config")
    if use_cache and (cached := load_cached(key)) is not None:
        report = QualityReport.from_json(cached)
        if recorded and report.record is None:  # cached before reports carried one
            report.record = quality_record(report, qconfig)
            store(key, report.to_json())
        report.cached = True
        return report
    report = _measure(source_dir, candidate, method, body, tokens, chunk_len, threads, progress, key, qconfig)
    report.source = source_label  # the user's SOURCE: a GGUF's records carry its name, as its plans do
    report.record = quality_record(report, qconfig) if recorded else None
    store(key, report.to_json())
    return report


def _with_decode_kernel(config: dict[str, Any], method: str, decode_kernel: str) -> dict[str, Any]:
    from edge.catalog.kernel_registry import DECODE_KERNELS, DEFAULT_DECODE_KERNEL

    if decode_kernel not in DECODE_KERNELS:
        raise InputError("--decode-kernel", decode_kernel, f"one of {', '.join(DECODE_KERNELS)}")
    if method != "cpu_int4":
        raise InputError("--decode-kernel", decode_kernel, f"a cpu_int4 candidate (this one is {method})")
    qconfig = {**config["quantization_config"], "decode_kernel": decode_kernel}
    if decode_kernel == DEFAULT_DECODE_KERNEL:
        del qconfig["decode_kernel"]  # the default, as edge.plan.engine_config writes it
    return {**config, "quantization_config": qconfig}


def quality_record(report: QualityReport, qconfig: dict[str, Any] | None) -> dict[str, Any]:
    """The report as an edge.measure.quality.QualityRecord: the source's directory name (a GGUF's file name without
    .gguf) is the model's name, as edge.model.reader names the model; the key is quality_key(path, config)."""
    from edge.measure.quality import EVALUATOR_REVISION, QualityRecord, quality_key

    m = report.metrics
    source = Path(report.source)
    record = QualityRecord(
        model=source.stem if source.suffix == ".gguf" else source.name,
        key=quality_key(path_of_method(report.quant_method), qconfig),
        kld_mean=m["mean_kld"]["value"], kld_mean_se=m["mean_kld"]["se"], kld_p99=m["p99_kld"]["value"],
        top1_agreement=m["top1_agreement"]["value"], top1_agreement_se=m["top1_agreement"]["se"],
        ppl_ratio=m["ppl_ratio"]["value"], ppl_ratio_se=m["ppl_ratio"]["se"],
        confident_flip_rate=m["confident_flip_rate"]["value"], confident_flip_rate_se=m["confident_flip_rate"]["se"],
        tokens=report.tokens_scored, cpu=report.host.get("cpu"), arch=report.host.get("arch"),
        measured_at=report.measured_at,
        evaluator=EVALUATOR_REVISION,
    )  # fmt: skip
    return record.model_dump(exclude={"report"})


def _measure(
    source_dir: Path,
    candidate_dir: Path,
    method: str,
    body: eval_text.Text,
    tokens: int,
    chunk_len: int,
    threads: int,
    progress: bool,
    key: str,
    qconfig: dict[str, Any] | None = None,
) -> QualityReport:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoTokenizer

    from kernels.scoring.eval_model import load_candidate, load_source
    from kernels.scoring.eval_score import score
    from kernels.scoring.quality_metrics import summarize

    start = time.monotonic()
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(source_dir, local_files_only=True)
    ids, bos = eval_text.tokenize(tokenizer, body.content)
    windows = eval_text.make_windows(ids, tokens, chunk_len, bos, text=body.path.name)  # [C, L+1]
    source = load_source(source_dir)
    candidate = load_candidate(candidate_dir, source_dir, qconfig)
    stats = score(source, candidate.model, windows, progress=progress)
    wall = time.monotonic() - start
    return QualityReport(
        source=str(source_dir),
        candidate=str(candidate_dir),
        quant_method=method,
        kernel=candidate.kernel,
        text={**body.describe(), "tokens_in_text": len(ids)},
        chunk_len=chunk_len,
        chunks=windows.shape[0],
        tokens_requested=tokens,
        tokens_scored=len(stats),
        metrics=summarize(stats),
        wall_s=round(wall, 1),
        threads=threads,
        host=_host(),
        key=key,
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )


def _host() -> dict[str, Any]:
    import torch
    import transformers

    cpu = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "arch": {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower()),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def format_report(report: QualityReport) -> str:
    """The short table for people."""
    m = report.metrics

    def pm(entry: dict[str, float], scale: float = 1.0, digits: int = 4) -> str:
        return f"{entry['value'] * scale:.{digits}f} ± {entry['se'] * scale:.{digits}f}"

    among = m["flip_rate_among_confident"]
    when = "cached result" if report.cached else "measured"
    k = report.kernel
    lines = [
        f"candidate   {report.candidate}",
        f"source      {report.source}",
        f"kernel      {report.quant_method}: {k.get('kernel')}",
    ]
    if report.quant_method == "cpu_int4":
        wide = report.chunk_len >= k["dequant_threshold"]
        lines.append(f"            {k['layout']}, group {k['group_size']}, dequant_threshold {k['dequant_threshold']}: "
                     f"{report.chunk_len}-row chunks run "
                     f"{k['rows_at_or_above_threshold'] if wide else k['rows_below_threshold']}")  # fmt: skip
    lines += [
        f"text        {report.text['title']} (sha256 {report.text['sha256'][:12]}), "
        f"{report.chunks} chunks x {report.chunk_len} tokens, {report.tokens_scored} scored",
        f"mean KLD    {pm(m['mean_kld'], digits=5)}",
        f"KLD p99     {pm(m['p99_kld'])}",
        f"top-1       {pm(m['top1_agreement'], 100, 2)} %",
        f"PPL ratio   {pm(m['ppl_ratio'])}  (source {m['source_ppl']['value']:.3f}, "
        f"candidate {m['candidate_ppl']['value']:.3f})",
        f"conf. flips {pm(m['confident_flip_rate'], 100, 2)} % of scored tokens; "
        f"{m['confident_flips']} of {m['confident_positions']} confident positions"
        + (f" ({among * 100:.1f} %)" if among is not None else ""),
        f"wall        {report.wall_s:.1f} s, {report.threads} threads ({when}; key {report.key[:12]})",
    ]
    return "\n".join(lines)


def gguf_reference(source: Path) -> Path:
    """The reference a candidate is scored against: SOURCE itself, or for a GGUF its weights dequantized from the
    file to bf16 (edge-convert's bf16 path, into the cache's converted/), as the default model's bf16 directory is
    its GGUF's weights dequantized."""
    from edge.model.reader import is_gguf

    if not is_gguf(source):
        return source
    from edge.paths import converted_dir
    from kernels.convert.convert import convert

    return convert(source, converted_dir(source.resolve(), None), None, path="bf16", log=lambda message: None)


def apply_plan(source: Path, plan_file: Path) -> Path:
    """The checkpoint a plan makes of SOURCE: converted by kernels.convert.convert into the cache's converted/ (the
    place edge-serve uses, edge.paths.converted_dir), or SOURCE itself for a bf16 plan."""
    from edge.paths import converted_dir
    from edge.plan.plan_file import load_plan
    from kernels.convert.convert import convert

    plan = load_plan(plan_file)
    if plan.quantization_config is None:
        if plan.path != "bf16":
            expected = f"a plan edge-eval can apply (path {plan.path} builds no checkpoint)"
            raise InputError("--plan", str(plan_file), expected)
        return Path(source)
    dst = converted_dir(Path(source).resolve(), plan.quantization_config)
    return convert(source, dst, plan.quantization_config, path=plan.path, log=lambda message: None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="edge-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", metavar="SOURCE", type=Path,
                        help="the source model: its bf16 directory, or a .gguf (scored against its own weights)")
    parser.add_argument("candidate", metavar="CANDIDATE", type=Path, nargs="?",
                        help="the converted checkpoint directory (or --plan)")
    parser.add_argument("--plan", type=Path, help="a Plan JSON (edge-select --json): convert SOURCE by it (into the "
                        "cache's converted/, as edge-serve does; skipped when up to date) and evaluate that")
    parser.add_argument("--text", type=Path, help="a UTF-8 text file (default: the packaged Opticks text)")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="tokens to score (default %(default)s)")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="chunk length (default %(default)s)")
    parser.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    parser.add_argument("--decode-kernel", metavar="KERNEL",
                        help="run a cpu_int4 candidate with this decode kernel (avx2, avx2-w4a8, tinygemm) on every "
                        "row instead of the one its quantization_config names")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--no-cache", action="store_true", help="measure even when a cached result exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        # stdout carries the report only: vLLM (imported with the int4 ops) logs to stdout by default
        with contextlib.redirect_stdout(sys.stderr):
            candidate = apply_plan(args.source, args.plan) if args.plan else args.candidate
            if candidate is None:
                raise InputError("CANDIDATE", None, "a converted checkpoint directory, or --plan PLAN.json")
            report = evaluate(args.source, candidate, args.text, tokens=args.tokens, chunk_len=args.chunk,
                              threads=args.threads, progress=not args.quiet, use_cache=not args.no_cache,
                              decode_kernel=args.decode_kernel)  # fmt: skip
    except InputError as error:
        print(f"edge-eval: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json()) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
