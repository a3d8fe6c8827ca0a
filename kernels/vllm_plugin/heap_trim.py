"""Give the engine's start-up garbage back to the system once the engine is ready (issue 44).

Loading frees what it built on the way (the checkpoint's tensors once repacked, each layer's repack chunks, the
warm-up's activations), and glibc keeps freed blocks in its arenas: a block freed from an mmap raises the dynamic
mmap threshold (malloc(3) M_MMAP_THRESHOLD), so the next ones of that size come from the arenas and stay there when
freed. On the default model's speed plan glibc held 42-49 MiB free at the end of the start (mallinfo2, in
kernels/vllm_plugin/memory_trace.py's lines), and trimming gave back 21-23 MiB of RssAnon (86-92 MiB on a Gemma
3-shaped GGUF; benchmarks/ledger_vs_rss.py, Zen 4, 2026-12-06). `malloc_trim(0)` returns every free page of
every arena (glibc >= 2.8 releases the middle of an arena too, with MADV_DONTNEED), once, after
`CPUWorker.compile_or_warm_up_model`, the worker's last step before it serves. A step later allocates what it needs
again; nothing is trimmed while serving.

Serving leaves the same kind of garbage: each step's logits, sampler and activation buffers, freed into the arenas of
the threads that made them (the engine's, the event loop's, the renderer's). After a full context and 4 streams the
one-process engine held 21-43 MiB more on the default model, 28-155 on a Gemma 3-shaped vocabulary and 117-164 on a
~1B (benchmarks/ledger_vs_rss.py's `workload`, Zen 5, 2026-12-07), and kept it for as long as the box sat idle. So the
one-process engine's thread trims once more whenever it has had nothing to do for IDLE_TRIM_S after serving
(`IdleTrim`, kernels/vllm_plugin/engine_thread.py): never during a burst, and never twice in one idle spell. The next
request faults back in what it needs.

Loading does the same within itself: a layer's repack (the W4A8 conversion's int32 codes, a blocks layer's decode
layout) frees its chunks into the heap, and the next layer's chunks do not always fit where they went, so the
heap grew by what every layer left: on a Gemma 3-shaped GGUF's W4A8 plan the load peaked 240 MiB above what it
peaked with glibc's mmap threshold held at 128 KiB (1042 against 801 MiB RssAnon; Zen 5, 2026-12-07). So during the
load the heap is trimmed after each module's `process_weights_after_loading` (`malloc_trim(0)` alone, without a
garbage collection: tensors are freed when their last reference goes), where vLLM releases a GPU's cached memory
(`release_device_memory_under_pressure`, which does nothing on a CPU). The thresholds themselves are left alone: a
fixed one would change how a serving step's buffers come and go.

EDGE_HEAP_TRIM=0 leaves the heap as it is (benchmarks compare the two); EDGE_IDLE_TRIM=0 keeps the trim after the
start and drops the idle one.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os
from typing import Any

from kernels.vllm_plugin import on_import

ENV = "EDGE_HEAP_TRIM"
IDLE_ENV = "EDGE_IDLE_TRIM"
IDLE_TRIM_S = 2.0  # idle this long after serving before the heap is trimmed: longer than a client's gap in a burst
logger = logging.getLogger("vllm.edge_select.heap_trim")
_MARK = "_edge_select_heap_trim"


@functools.cache
def glibc(name: str, restype: Any, *argtypes: Any) -> Any:
    """The C library's function `name` with its types set, or None where it has none (musl; mallinfo2 before glibc
    2.33). Shared with kernels/vllm_plugin/memory_trace.py."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def _malloc_trim() -> Any:
    return glibc("malloc_trim", ctypes.c_int, ctypes.c_size_t)


def trim() -> bool:
    """Collect Python's garbage, then return glibc's free pages to the system; False without glibc."""
    fn = _malloc_trim()
    if fn is None:
        return False
    gc.collect()
    fn(0)
    return True


def release_freed() -> bool:
    """`malloc_trim(0)` alone, without a garbage collection (tensors are freed when their last reference goes), unless
    EDGE_HEAP_TRIM=0; False where it did nothing. For the load's steps that free what they replaced: a module's
    repack, the weights mapped in place of their copies (kernels/vllm_plugin/mapped_weights.py swap_in)."""
    fn = _malloc_trim()
    if fn is None or os.environ.get(ENV, "1") == "0":
        return False
    fn(0)
    return True


def _per_module(release: Any) -> Any:
    @functools.wraps(release)
    def release_device_memory_under_pressure(device: Any) -> bool:
        released = release(device)
        if getattr(device, "type", None) == "cpu":
            return release_freed() or released
        return released

    setattr(release_device_memory_under_pressure, _MARK, release)
    return release_device_memory_under_pressure


def trim_if_enabled() -> bool:
    """trim() unless EDGE_HEAP_TRIM=0: after the weights are mapped (kernels/vllm_plugin/mapped_weights.py), their
    loaded and converted copies have just been freed into the heap."""
    return os.environ.get(ENV, "1") != "0" and trim()


class IdleTrim:
    """When to trim while serving: `worked()` after each step; `timeout()` tells the waiting loop how long to wait
    for the next input before `trim()` is worth it (None: wait without a limit, nothing to give back)."""

    def __init__(self, idle_s: float = IDLE_TRIM_S, enabled: bool | None = None) -> None:
        if enabled is None:
            enabled = os.environ.get(ENV, "1") != "0" and os.environ.get(IDLE_ENV, "1") != "0"
        self.idle_s = idle_s
        self.enabled = enabled and _malloc_trim() is not None
        self.dirty = False
        self.trims = 0

    def worked(self) -> None:
        self.dirty = True

    def timeout(self) -> float | None:
        return self.idle_s if self.enabled and self.dirty else None

    def trim(self) -> None:
        trim()
        self.dirty = False
        self.trims += 1


def _after_start(method: Any) -> Any:
    @functools.wraps(method)
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if not trim():
            logger.info("heap trim: this C library has no malloc_trim; the start's freed memory stays in its heap")
        return result

    setattr(compile_or_warm_up_model, _MARK, method)
    return compile_or_warm_up_model


def _patch(cpu_worker: Any) -> None:
    from vllm.model_executor.model_loader import utils as loader_utils

    worker = cpu_worker.CPUWorker
    if not getattr(worker.compile_or_warm_up_model, _MARK, None):
        worker.compile_or_warm_up_model = _after_start(worker.compile_or_warm_up_model)
    if not getattr(loader_utils.release_device_memory_under_pressure, _MARK, None):
        loader_utils.release_device_memory_under_pressure = _per_module(
            loader_utils.release_device_memory_under_pressure
        )


def install() -> bool:
    """Trim the heap after each module's repack while loading and after the CPU worker's start, in the process that
    imports the worker; False when turned off."""
    if os.environ.get(ENV, "1") == "0":
        return False
    on_import.when_imported("vllm.v1.worker.cpu_worker", _patch)
    return True
