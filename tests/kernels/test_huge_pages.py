"""kernels/ops/huge_pages.py: the decode kernels' weights carved out of slabs advised for transparent huge pages."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from kernels.ops import huge_pages
from kernels.ops.huge_pages import ALIGN, Arena


def _in_slab(arena: Arena, t: torch.Tensor) -> bool:
    return any(buf.data_ptr() <= t.data_ptr() < buf.data_ptr() + buf.numel() for _, buf in arena.slabs)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_tensors_are_carved_in_order_aligned_and_apart():
    arena = Arena(slab_bytes=1 << 20)
    codes = arena.empty((96, 288), torch.uint8)  # a [N/8, K/8 * 4]-sized block of codes
    scales = arena.empty((96, 18), torch.bfloat16)
    assert codes.shape == (96, 288) and codes.dtype == torch.uint8 and codes.is_contiguous()
    assert scales.shape == (96, 18) and scales.dtype == torch.bfloat16 and scales.is_contiguous()
    assert _in_slab(arena, codes) and _in_slab(arena, scales) and len(arena.slabs) == 1
    assert codes.data_ptr() % ALIGN == 0 and scales.data_ptr() % ALIGN == 0
    assert scales.data_ptr() >= codes.data_ptr() + codes.numel()  # no overlap
    codes.fill_(7)
    scales.fill_(1.5)
    assert int(codes.sum()) == 7 * codes.numel() and float(scales.float().sum()) == 1.5 * scales.numel()


def test_a_tensor_larger_than_a_slab_gets_a_slab_of_its_own_and_the_next_a_fresh_one():
    arena = Arena(slab_bytes=1 << 16)
    big = arena.empty((1 << 17,), torch.uint8)
    small = arena.empty((10,), torch.uint8)
    assert len(arena.slabs) == 2 and _in_slab(arena, big) and _in_slab(arena, small)
    assert big.numel() == 1 << 17


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                    reason="MADV_HUGEPAGE needs a Linux kernel built with transparent huge pages")  # fmt: skip
def test_the_slabs_ask_for_huge_pages():
    arena = Arena()
    t = arena.empty((4096,), torch.uint8)
    assert "hg" in _vm_flags(t.data_ptr())  # MADV_HUGEPAGE is set on the slab's mapping
    # the flag is the slab's own: a plain mapping of the same size lacks it (malloc'd memory is no control, numpy
    # advises large arrays MADV_HUGEPAGE and glibc may later hand that heap range to anyone)
    plain = mmap.mmap(-1, huge_pages.SLAB_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    assert "hg" not in _vm_flags(torch.frombuffer(plain, dtype=torch.uint8).data_ptr())


def test_edge_huge_pages_0_gives_torch_empty(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    t = huge_pages.empty(4, 8, dtype=torch.int8)
    assert t.shape == (4, 8) and (huge_pages._PROCESS_ARENA is None or not _in_slab(huge_pages._PROCESS_ARENA, t))
    monkeypatch.delenv(huge_pages.ENV)
    t = huge_pages.empty(4, 8, dtype=torch.int8)
    assert t.shape == (4, 8) and _in_slab(huge_pages._PROCESS_ARENA, t)


def _slab_mapped(address: int) -> bool:
    return any(lo <= address < hi for lo, hi in (
        (int(a, 16), int(b, 16)) for a, b in (line.split()[0].split("-") for line in
                                              Path("/proc/self/maps").read_text().splitlines())))  # fmt: skip


def test_a_forgotten_slab_is_unmapped_once_the_last_tensor_carved_from_it_is_gone():
    arena = Arena(slab_bytes=1 << 20)
    a, b = arena.empty((1000,), torch.uint8), arena.empty((1000,), torch.uint8)
    start = a.data_ptr()
    assert arena.forget(start) and not arena.slabs and arena.current is None
    assert not arena.forget(start)  # nothing left to forget
    c = arena.empty((10,), torch.uint8)  # carved from a new slab, not the forgotten one
    assert not (start <= c.data_ptr() < start + (1 << 20))
    del a
    assert _slab_mapped(start)  # b still reads the slab
    with torch.no_grad():
        b.set_(torch.zeros(1000, dtype=torch.uint8))  # b now elsewhere: the last reference to the slab is gone
    assert not _slab_mapped(start)
