"""What the engine process holds after each phase of its start (issue 44): one JSON line a phase to EDGE_MEMORY_TRACE.

Each line: the phase, this process's RssAnon and RssFile (/proc/self/status), and glibc's own account of its heap
(mallinfo2): bytes in use, bytes free in its arenas (the allocator's retention; pages a trim gave back still count
as free there, so RssAnon says what is held) and bytes in mmapped blocks. The phases are
vLLM 0.28's CPU worker's own steps, wrapped where they run:

    imports      vLLM's CPU worker imported: torch, vLLM and (one-process) its API server
    load         CPUModelRunner.load_model: the weights as loaded and repacked
    warm-up      CPUModelRunner.warming_up_model: the compiled model loaded (or compiled) and a dummy run
    kv-cache     Worker.initialize_from_config: the KV cache allocated
    ready        CPUWorker.compile_or_warm_up_model: the last step before the engine serves

benchmarks/engine_memory.py reads the file; the difference between two lines is what that phase added. Off unless
the variable is set, so a served engine pays nothing.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kernels.vllm_plugin import on_import
from kernels.vllm_plugin.heap_trim import glibc

ENV = "EDGE_MEMORY_TRACE"
_MARK = "_edge_select_memory_trace"


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (malloc.h, glibc >= 2.33): every field a size_t."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def heap_bytes() -> dict[str, int]:
    """glibc's heap: `in_use` (allocated from its arenas), `kept` (freed, held by the arenas: the allocator's
    retention), `mmapped` (blocks above the mmap threshold, returned to the system when freed); {} without glibc."""
    fn = glibc("mallinfo2", _MallInfo2)
    if fn is None:
        return {}
    info = fn()
    return {"in_use": info.uordblks, "kept": info.fordblks, "mmapped": info.hblkhd}


def status_bytes() -> dict[str, int]:
    """RssAnon and RssFile of this process, in bytes."""
    wanted = {"RssAnon:": "rss_anon", "RssFile:": "rss_file"}
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        fields = line.split()
        if fields and fields[0] in wanted:
            out[wanted[fields[0]]] = int(fields[1]) * 1024
    return out


def mapping_bytes() -> dict[str, int]:
    """Anonymous bytes by where they live (/proc/self/smaps): glibc's main `heap` (brk), `anon_maps` (every other
    anonymous mapping: thread arenas, large blocks, torch's big tensors, thread stacks) and `file` mappings' anonymous
    pages (relocations and writes to mapped libraries: copy-on-write)."""
    out = {"heap": 0, "anon_maps": 0, "file": 0}
    where = "anon_maps"
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            name = fields[5] if len(fields) > 5 else ""
            where = "heap" if name == "[heap]" else "file" if name.startswith("/") else "anon_maps"
        elif fields[0] == "Anonymous:":
            out[where] += int(fields[1]) * 1024
    return out


def module_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every CPU tensor the model's modules hold: parameters, buffers and plain tensor attributes
    (as the quantization methods keep their packed weights), and tensors in a dict attribute. A tensor held under two
    names comes twice. Shared with kernels/vllm_plugin/mapped_weights.py."""
    import torch

    for module_name, module in model.named_modules():
        for attr, value in vars(module).items():
            for key, tensor in value.items() if isinstance(value, dict) else [(attr, value)]:
                if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                    yield (f"{module_name}.{key}" if module_name else str(key)), tensor


def model_bytes(model: Any) -> dict[str, int]:
    """The bytes of every tensor the model's modules hold (module_tensors), each storage counted once, by dtype."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for _, tensor in module_tensors(model):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        key = str(tensor.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + storage.nbytes()
    return out


def record(phase: str, **extra: Any) -> None:
    """Append `phase`'s line to EDGE_MEMORY_TRACE; nothing when it is unset."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = {
        "phase": phase,
        "t": time.time(),
        "pid": os.getpid(),
        **status_bytes(),
        "heap": heap_bytes(),
        "maps": mapping_bytes(),
        **extra,
    }
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")


def _after(method: Any, phase: str) -> Any:
    @functools.wraps(method)
    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        model = getattr(self, "model", None)
        record(phase, **({"model": model_bytes(model)} if phase == "load" and model is not None else {}))
        return result

    setattr(traced, _MARK, method)
    return traced


def _patch(cpu_worker: Any) -> None:
    from vllm.v1.worker import cpu_model_runner

    runner, worker = cpu_model_runner.CPUModelRunner, cpu_worker.CPUWorker
    if getattr(runner.load_model, _MARK, None):
        return
    record("imports")
    runner.load_model = _after(runner.load_model, "load")
    runner.warming_up_model = _after(runner.warming_up_model, "warm-up")
    worker.initialize_from_config = _after(worker.initialize_from_config, "kv-cache")
    worker.compile_or_warm_up_model = _after(worker.compile_or_warm_up_model, "ready")


def install() -> bool:
    """Record the start's phases, in the process that imports the CPU worker, when EDGE_MEMORY_TRACE names a file."""
    if not os.environ.get(ENV):
        return False
    on_import.when_imported("vllm.v1.worker.cpu_worker", _patch)
    return True
