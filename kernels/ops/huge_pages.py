"""Weights in memory the kernel may back with 2 MiB pages (transparent huge pages, `madvise` mode).

A decode step streams every weight once. With 4 KiB pages that is a TLB miss every 4 KiB, and in a VM each miss walks
two page tables. On the Zen 4 VM the default model's step took 0.90x the time with the decode kernels' weights here,
the int8 head 0.81x and the int4 linears 0.86x (docs/reports/2026-12-06-cpp-step.md). Most distributions set THP to
`madvise`, where only memory that asks gets huge pages, and a layer's tensors (0.3-0.9 MB here) each sit in a small
mapping of their own where no 2 MiB page fits.

`empty(*shape, dtype=)` carves a tensor out of a slab: an anonymous mapping of SLAB_BYTES or more, advised
MADV_HUGEPAGE before anything touches it, carved in order (64-byte aligned). The plugin registers the tensors its
decode kernels keep reading this way, so vLLM's loader writes them there: no copy, no load transient. Slab tails no
tensor took stay untouched (with THP, at most a 2 MiB page of one is backed). With THP `never` the slabs are plain
memory. EDGE_HUGE_PAGES=0 gives torch.empty instead (the benchmarks compare both).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os

import torch

SLAB_BYTES = 64 << 20
ALIGN = 64
ENV = "EDGE_HUGE_PAGES"


class Arena:
    """Slabs carved in order. The arena holds each slab until `forget` lets it go; a slab's memory is returned once
    no tensor carved from it is left either (the tensors hold their slab)."""

    def __init__(self, slab_bytes: int = SLAB_BYTES) -> None:
        self.slab_bytes = slab_bytes
        self.slabs: list[tuple[mmap.mmap, torch.Tensor]] = []
        self.current: torch.Tensor | None = None  # the slab being carved
        self.used = 0

    def _room(self, nbytes: int) -> torch.Tensor:
        if self.current is None or self.used + nbytes > self.current.numel():
            size = max(self.slab_bytes, nbytes)
            slab = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                # EINVAL from a kernel built without THP: the slab stays plain memory
                with contextlib.suppress(OSError):
                    slab.madvise(mmap.MADV_HUGEPAGE)
            self.current = torch.frombuffer(slab, dtype=torch.uint8)
            self.slabs.append((slab, self.current))
            self.used = 0
        return self.current

    def forget(self, address: int) -> bool:
        """Let go of the slab holding `address` (True if one does): nothing is carved from it again, and its memory
        goes back to the system when the last tensor carved from it is freed. Safe whatever still reads it."""
        for i, (_, buf) in enumerate(self.slabs):
            if buf.data_ptr() <= address < buf.data_ptr() + buf.numel():
                if buf is self.current:
                    self.current = None
                del self.slabs[i]
                return True
        return False

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous tensor in the arena (zeros where the slab is fresh)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        buf = self._room(nbytes)
        # On the slab's storage, not a view of the slab tensor: a view keeps its base (the whole slab) alive for
        # its lifetime, even once set_ has pointed it elsewhere (kernels/vllm_plugin/mapped_weights.py)
        out = torch.empty(0, dtype=dtype).set_(buf.untyped_storage(), self.used // itemsize, shape)
        self.used += -(-nbytes // ALIGN) * ALIGN
        return out


_PROCESS_ARENA: Arena | None = None


def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(*shape, dtype=dtype) in this process's arena, or torch.empty itself with EDGE_HUGE_PAGES=0."""
    global _PROCESS_ARENA
    if os.environ.get(ENV) == "0":
        return torch.empty(*shape, dtype=dtype)
    if _PROCESS_ARENA is None:
        _PROCESS_ARENA = Arena()
    return _PROCESS_ARENA.empty(shape, dtype)


def forget(address: int) -> bool:
    """Let go of the process arena's slab holding `address` (Arena.forget); False where none does."""
    return _PROCESS_ARENA is not None and _PROCESS_ARENA.forget(address)
