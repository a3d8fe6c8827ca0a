"""The engine's weights mapped from a file, not held as anonymous memory (issue 44).

Once vLLM's CPU model runner has loaded and repacked the model, every tensor the model's modules hold is written,
byte for byte, to an image under the cache directory (`mapped/<key>.bin`), and each tensor is pointed at its bytes
in a private mapping of that image (`Tensor.set_`: the same tensor object, so vLLM's modules and the C++ layer table
see it). The repacked copies are then freed, slab by slab (kernels/ops/huge_pages.py `forget`). What the engine holds
of its weights is then page cache: RssFile, not RssAnon. It is shared with any other engine on the same image,
evictable under memory pressure, and still there for the next start. The mapping is advised MADV_HUGEPAGE: on a
kernel whose file system gives the page cache large folios (ext4 on Linux 6.18 here), the weights are read through
2 MiB mappings as they were from the anonymous huge-page slabs (FilePmdMapped in /proc/self/smaps).

The image is never trusted: a start compares it with what it has just loaded, and an image that differs in one byte
(or in its index) is replaced by a new one, written to a temporary file and renamed into place. An image is never
written in place, since a private mapping sees the file's pages it has not copied. The mapping is private and
writable, so a module that writes into a weight gets its own copy of that page and the file never changes.

Where the image cannot be written (a read-only cache, a full disk), the engine keeps its anonymous copies and logs
why. EDGE_MAPPED_WEIGHTS=0 keeps them too (benchmarks compare the two).

A start that finds the last image of the same model and configuration loads into it (`premap`): before vLLM's loader
writes the checkpoint, each parameter the image holds under its name, dtype and shape is pointed at its bytes there,
and a copy the loader makes into one of them is skipped where the bytes are already equal (`SkipEqualCopies`). Such
a parameter never becomes anonymous memory: the load-time peak no longer holds the whole model anonymously before
it is mapped (the Gemma 3-shaped model's 360 MiB embedding). A copy that differs is made, into a private copy of
the page, and the comparison after loading replaces the image as before. A first start, with no image yet, loads as
vLLM does. (Loading into the checkpoint's own file on a first start was tried: a GGUF's 8-bit blocks, which their
method rearranges in place, left that mapping alive after the weights moved to the image, with their rewritten
pages as 169 MiB of RssAnon on a ~1B; not kept.) EDGE_PREMAP=0 loads as vLLM does.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kernels.ops import huge_pages
from kernels.vllm_plugin import heap_trim, memory_trace, on_import
from kernels.vllm_plugin.memory_trace import module_tensors

ENV = "EDGE_MAPPED_WEIGHTS"
PREMAP_ENV = "EDGE_PREMAP"
MAGIC = b"EDGEMAP1"
DATA_ALIGN = 4096  # the data starts on a page
TENSOR_ALIGN = 64  # each tensor on a cache line (and on any dtype's size)
# swap_in trims the heap after moving this many bytes: the copies it frees (below glibc's mmap threshold) stayed in
# the heap while the image's pages came in, so the ~1B's weights were held twice, RssAnon + RssFile 2111 MiB at the
# load's peak (benchmarks/ledger_vs_rss.py, AMD EPYC Zen 5, 2026-12-07)
SWAP_TRIM_BYTES = 64 << 20
KEEP_IMAGES = 4  # images kept in the cache, the most recently used: a box switching plans or models keeps its last
logger = logging.getLogger("vllm.edge_select.mapped_weights")
_MARK = "_edge_select_mapped_weights"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@dataclass(frozen=True)
class Entry:
    """One tensor's place in the image: the first name it was found under, its dtype and shape, its byte offset."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def model_tensors(model: torch.nn.Module, own: tuple[int, int] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the model's modules hold (parameters, buffers, plain attributes, as the quantization methods keep
    their packed weights) that can be mapped: on the CPU, contiguous, not empty, not already in a file mapping other
    than the one at `own` (the address range of the image the load wrote into, `premap`). Each tensor object once, in
    address order. A tensor that overlaps another's bytes without being the same region is left out (a view into a
    weight: mapping one would leave the other on the old memory)."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in module_tensors(model):
        if id(tensor) not in found and tensor.is_contiguous() and tensor.numel() > 0 and not tensor.requires_grad:
            found[id(tensor)] = (name, tensor)
    file_backed = [r for r in _file_mapped_ranges() if own is None or not own[0] <= r[0] < own[1]]
    out, end, last = [], 0, None
    for name, tensor in sorted(found.values(), key=lambda nt: (nt[1].data_ptr(), -_nbytes(nt[1]))):
        start = tensor.data_ptr()
        region = (start, _nbytes(tensor))
        if any(lo <= start < hi for lo, hi in file_backed):
            continue
        if start < end and region != last:
            continue  # overlaps an earlier tensor's bytes, not the same region
        out.append((name, tensor))
        end, last = max(end, start + region[1]), region
    return out


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _file_mapped_ranges() -> list[tuple[int, int]]:
    """This process's mappings of files (/proc/self/maps: a path after the inode)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)  # [nbytes] uint8, the same memory


def index(tensors: list[tuple[str, torch.Tensor]]) -> list[Entry]:
    """The image's index: each region once, under the first of its tensors' names (a second tensor on the same bytes
    shares its entry), in name order: the same on every start, wherever the allocator put the tensors."""
    names: dict[tuple[int, int], tuple[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        region = (tensor.data_ptr(), _nbytes(tensor))
        names[region] = min(names.get(region, (name, tensor)), (name, tensor), key=lambda nt: nt[0])
    entries, offset = [], 0
    for name, tensor in sorted(names.values(), key=lambda nt: nt[0]):
        nbytes = _nbytes(tensor)
        entries.append(Entry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // TENSOR_ALIGN) * TENSOR_ALIGN
    return entries


def _entry_tensors(tensors: list[tuple[str, torch.Tensor]], entries: list[Entry]) -> list[torch.Tensor]:
    """The tensor each entry was made from, in the entries' order."""
    by_name = dict(tensors)
    return [by_name[entry.name] for entry in entries]


def _header(entries: list[Entry]) -> bytes:
    return json.dumps([[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in entries]).encode()


def _data_start(header: bytes) -> int:
    return -(-(len(MAGIC) + 8 + len(header)) // DATA_ALIGN) * DATA_ALIGN


def write_image(path: Path, tensors: list[tuple[str, torch.Tensor]], entries: list[Entry]) -> None:
    """Write the image beside `path` and rename it into place once complete and on disk: a reader sees the old image
    or the whole new one. The bytes are written from the tensors' own memory, no copy."""
    header = _header(entries)
    start = _data_start(header)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for entry, tensor in zip(entries, _entry_tensors(tensors, entries), strict=True):
                out.seek(start + entry.offset)
                out.write(memoryview(_bytes_of(tensor).numpy()))
            size = start + (entries[-1].offset + entries[-1].nbytes if entries else 0)
            out.truncate(size)
            out.flush()
            os.fsync(out.fileno())
            # Drop the written pages from the page cache (clean once synced): the write path left them in folios of
            # every size, and a mapping can map only whole 2 MiB folios with one PMD. Read back through the
            # mapping's readahead, all but the tail came back as 2 MiB folios (FilePmdMapped 94 of 95 MiB on the
            # default model, 24 MiB before; Zen 5, Linux 6.18, ext4): without them decode ran 10 % slower, as
            # with 4 KiB anonymous pages (benchmarks/bench_serve.py edge:one-process against +no-map, 2026-12-06).
            os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_index(view: memoryview) -> tuple[list[Entry], int] | None:
    """The index and the data's start of a mapped image; None where it is not one."""
    if len(view) < len(MAGIC) + 8 or bytes(view[: len(MAGIC)]) != MAGIC:
        return None
    (size,) = struct.unpack("<Q", view[len(MAGIC) : len(MAGIC) + 8])
    header = bytes(view[len(MAGIC) + 8 : len(MAGIC) + 8 + size])
    try:
        rows = json.loads(header)
        return [Entry(n, d, tuple(s), o, b) for n, d, s, o, b in rows], _data_start(header)
    except (ValueError, TypeError):
        return None


class Image:
    """A private, writable, huge-page-advised mapping of an image file, and its bytes as one uint8 tensor."""

    def __init__(self, path: Path) -> None:
        self.bytes, self.index = torch.empty(0, dtype=torch.uint8), None
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:  # not an image (mmap maps no empty file)
                return
            self.map = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # EINVAL from a kernel without THP: 4 KiB mappings
                self.map.madvise(mmap.MADV_HUGEPAGE)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)  # holds the mapping as long as a view of it lives
        self.index = read_index(memoryview(self.map))

    def view(self, start: int, entry: Entry) -> torch.Tensor:
        at = start + entry.offset
        return self.bytes[at : at + entry.nbytes].view(getattr(torch, entry.dtype)).view(entry.shape)


def swap_in(image: Image, tensors: list[tuple[str, torch.Tensor]], entries: list[Entry]) -> bool:
    """Point each tensor at its bytes in the image, in address order, each compared first, and let the arena's slabs
    go as they empty. False at the first region that differs, leaving the rest where they were: the tensors moved
    so far read the same values from the image. One at a time, so the weights are never held twice: comparing the
    whole image first held the ~1B's 918 MiB as anonymous memory and as page cache at once (RssAnon + RssFile
    2252 MiB at its peak against 1591 after it, benchmarks/ledger_vs_rss.py, Zen 5, 2026-12-06)."""
    if image.index is None or image.index[0] != entries:
        return False
    start = image.index[1]
    if len(image.bytes) < start + entries[-1].offset + entries[-1].nbytes:  # cut short: a copy or a disk went wrong
        return False
    by_region = {(t.data_ptr(), _nbytes(t)): e for t, e in zip(_entry_tensors(tensors, entries), entries, strict=True)}
    checked: set[int] = set()
    freed = 0  # bytes moved since the heap was last trimmed
    with torch.no_grad():
        for _, tensor in tensors:
            old = tensor.data_ptr()
            entry = by_region[(old, _nbytes(tensor))]
            view = image.view(start, entry)
            if entry.offset not in checked:
                if not torch.equal(_bytes_of(view), _bytes_of(tensor)):
                    return False
                checked.add(entry.offset)
            tensor.set_(view)
            huge_pages.forget(old)
            freed += entry.nbytes
            if freed >= SWAP_TRIM_BYTES:  # glibc keeps freed blocks below its mmap threshold: give them back as we go
                heap_trim.release_freed()
                freed = 0
    return True


def pmd_mapped_bytes(path: Path) -> int:
    """The bytes of `path` this process maps with 2 MiB page-table entries (FilePmdMapped, /proc/self/smaps)."""
    total, inside, name = 0, False, str(path)
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) > 5 and fields[5] == name
        elif inside and fields[0] == "FilePmdMapped:":
            total += int(fields[1]) * 1024
    return total


HUGE_PAGE = 2 << 20
LOW_COVERAGE = 0.9  # below this share of an image in 2 MiB pages, its cached pages are dropped and read again


def huge_page_share(path: Path) -> float:
    """The share of `path` the page cache holds in 2 MiB folios, probed by a throwaway mapping touched once every
    2 MiB (a touch maps a whole 2 MiB folio with one entry, and a smaller folio without): reads a page a folio."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HUGE_PAGE:
            return 1.0
        probe = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    try:
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                probe.madvise(mmap.MADV_HUGEPAGE)
        for offset in range(0, size - HUGE_PAGE + 1, HUGE_PAGE):
            probe[offset]
        return pmd_mapped_bytes(path) / (size // HUGE_PAGE * HUGE_PAGE)
    finally:
        probe.close()


def refresh_page_cache(path: Path) -> bool:
    """Drop `path`'s cached pages where they are mostly in small folios (True if it did): the next faults read it
    back through readahead in 2 MiB folios. Reused images mapped 80-95 % in 2 MiB pages after other runs had pressed
    on the page cache (a fresh one 99 %), and 4 KiB pages cost decode 10 % (docs/reports/2026-12-06-mapped-weights.md).
    Pages another process maps stay: DONTNEED drops only unmapped clean pages. Costs a read of the file."""
    if huge_page_share(path) >= LOW_COVERAGE:
        return False
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return True


def prune(folder: Path, keep: int) -> list[Path]:
    """Remove all but the `keep` most recently used images (and temporary files a killed writer left, older than a
    day); what was removed. An engine that still maps a removed image keeps reading it: the file lives on until
    unmapped."""
    images = sorted(folder.glob("*.bin"), key=lambda p: p.stat().st_mtime, reverse=True)
    stale = [p for p in folder.glob("*.tmp") if p.stat().st_mtime < time.time() - 86400]
    gone = images[keep:] + stale
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


def _identity_key(identity: str) -> str:
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def image_path(identity: str, entries: list[Entry], cache: Path) -> Path:
    """The image's file: one per model and configuration (`identity`, the name's first part) and index."""
    key = hashlib.sha256(identity.encode() + _header(entries)).hexdigest()[:16]
    return cache / "mapped" / f"{_identity_key(identity)}-{key}.bin"


def last_image(identity: str, cache: Path) -> Path | None:
    """The most recently used image of this model and configuration, whatever its index; None if there is none."""
    images = sorted((cache / "mapped").glob(f"{_identity_key(identity)}-*.bin"), key=lambda p: p.stat().st_mtime)
    return images[-1] if images else None


class Premapped:
    """The parameters a load writes into an image's private mapping (`premap`), and what the load did to them."""

    def __init__(self, image: Image, params: list[tuple[str, torch.Tensor, Entry]]) -> None:
        self.image: Image | None = image  # held until map_model has moved every tensor off it
        self.range = (image.bytes.data_ptr(), image.bytes.data_ptr() + image.bytes.numel())
        self.params = sorted(params, key=lambda p: p[1].data_ptr())
        self._starts = [t.data_ptr() for _, t, _ in self.params]
        self.covered = [0] * len(self.params)  # bytes the load copied into each, or found equal
        self.skipped = self.written = 0

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for _, _, entry in self.params)

    def owner(self, address: int) -> int | None:
        """The index of the parameter holding `address`, or None."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and address < self._starts[i] + self.params[i][2].nbytes:
            return i
        return None

    def uncovered(self) -> list[str]:
        """The parameters the load wrote fewer bytes into than they hold: they read the image's bytes there."""
        return [name for (name, _, entry), done in zip(self.params, self.covered, strict=True) if done < entry.nbytes]

    def release(self) -> None:
        """Let go of the image's mapping once no tensor reads it (map_model has moved them): the pages a differing
        copy wrote privately go with it."""
        self.image, self.params, self._starts = None, [], []

    def summary(self) -> dict[str, Any]:
        return {"premapped_bytes": self.nbytes, "premapped_params": len(self.params), "copies_skipped_bytes":
                self.skipped, "copies_written_bytes": self.written, "uncovered": self.uncovered()}  # fmt: skip


class SkipEqualCopies(TorchFunctionMode):
    """While a load runs: a `Tensor.copy_` into a premapped parameter whose bytes already equal the source's returns
    without writing (a write, even of the same bytes, would copy the page out of the file into anonymous memory).
    Any other copy, and every other op, runs as it would."""

    def __init__(self, premapped: Premapped) -> None:
        super().__init__()
        self.premapped = premapped

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            dst, src = args[0], args[1]
            i = self.premapped.owner(dst.data_ptr())
            if i is not None and src.device.type == "cpu":
                nbytes = dst.numel() * dst.element_size()
                self.premapped.covered[i] += nbytes
                if dst.dtype == src.dtype and dst.shape == src.shape and torch.equal(dst, src):
                    self.premapped.skipped += nbytes
                    return dst
                self.premapped.written += nbytes
        return func(*args, **kwargs)


def premap(model: torch.nn.Module, image: Image) -> Premapped:
    """Point each of `model`'s parameters that `image` holds under one of its names, with its dtype and shape, at
    those bytes, before anything is loaded into them. Only parameters: vLLM's loader writes every one from the
    checkpoint, so none keeps a value from before the load; buffers and other tensors are left alone."""
    if image.index is None:
        return Premapped(image, [])
    entries, start = image.index
    if len(image.bytes) < start + max((e.offset + e.nbytes for e in entries), default=0):
        return Premapped(image, [])  # cut short: map_model writes a new image
    by_name = {entry.name: entry for entry in entries}
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in module_tensors(model):
        if isinstance(tensor, torch.nn.Parameter):
            names.setdefault(id(tensor), []).append(name)
            tensors[id(tensor)] = tensor
    params = []
    with torch.no_grad():
        for key, tensor in tensors.items():
            entry = next((by_name[n] for n in sorted(names[key]) if n in by_name), None)
            if (entry is None or not tensor.is_contiguous() or entry.shape != tuple(tensor.shape)
                    or entry.dtype != str(tensor.dtype).removeprefix("torch.")):  # fmt: skip
                continue
            old = tensor.data_ptr()
            tensor.set_(image.view(start, entry))
            huge_pages.forget(old)  # nothing was written there: the slab goes once its other tensors do
            params.append((entry.name, tensor, entry))
    return Premapped(image, params)


def map_model(model: torch.nn.Module, identity: str, cache: Path, premapped: Premapped | None = None) -> dict[str, Any]:
    """Map `model`'s tensors from their image (written first where missing or different); what was done. Tensors the
    load wrote into an image's mapping (`premapped`) are moved like the rest, onto a new mapping of the image: the
    pages a differing copy wrote privately go with the old one."""
    tensors = model_tensors(model, premapped.range if premapped else None)
    entries = index(tensors)
    if not entries:
        return {"mapped_bytes": 0, "tensors": 0, "image": None, "written": False}
    path = image_path(identity, entries, cache)
    written = refreshed = False
    if path.exists():
        refreshed = refresh_page_cache(path)
    if not (path.exists() and swap_in(Image(path), tensors, entries)):
        # Missing, or it differs from the first region that does on: a new image from the tensors as they are now
        # (those already moved read their own values from the old image, which stays mapped while they do)
        write_image(path, tensors, entries)
        written = True
        assert swap_in(Image(path), tensors, entries), f"{path}: the image just written differs from the model"
        prune(path.parent, KEEP_IMAGES)
    else:
        os.utime(path)  # used now: pruning keeps the most recently used
    if premapped is not None:
        premapped.release()
    return {"mapped_bytes": sum(e.nbytes for e in entries), "tensors": len(tensors), "image": str(path),
            "written": written, "refreshed": refreshed, "huge_mapped_bytes": pmd_mapped_bytes(path)}  # fmt: skip


def premap_enabled() -> bool:
    return os.environ.get(PREMAP_ENV, "1") != "0"


def _identity(model: Any) -> str:
    """What the image depends on besides its index: the model and its quantization (vLLM's ModelConfig). A setting
    that changes the loaded tensors changes the index, and one that changes only their bytes is caught by the
    comparison."""
    quant_dict = getattr(model.hf_config, "quantization_config", None)  # the checkpoint's, as the plan wrote it
    return json.dumps(
        [str(model.model), str(getattr(model, "revision", None)), str(model.dtype), quant_dict], default=str
    )


_PREMAPPED: dict[int, Premapped] = {}  # id(model) -> what its load wrote into, until map_model takes it


def load_source(identity: str, cache: Path) -> tuple[Path, Image] | None:
    """What a start loads into (`premap`): the last image of this model and configuration, for the parameters it holds
    as loaded; None on a first start, or where premapping is off."""
    path = last_image(identity, cache) if premap_enabled() else None
    if path is None:
        return None
    refresh_page_cache(path)  # before mapping it: pages this process maps stay as they are
    return path, Image(path)


def _into_last_image(method: Any) -> Any:
    @functools.wraps(method)
    def load_weights(self: Any, model: torch.nn.Module, model_config: Any, *args: Any, **kwargs: Any) -> Any:
        from edge.paths import cache_dir

        source = load_source(_identity(model_config), cache_dir())
        if source is None:
            return method(self, model, model_config, *args, **kwargs)
        path, image = source
        premapped = premap(model, image)
        with SkipEqualCopies(premapped):
            result = method(self, model, model_config, *args, **kwargs)
        _PREMAPPED[id(model)] = premapped
        done = premapped.summary()
        if done["uncovered"]:
            logger.warning("mapped weights: the load wrote only part of %s; they read the image's bytes there",
                           done["uncovered"])  # fmt: skip
        logger.info("mapped weights: loaded into %s: %.1f MiB premapped, %.1f MiB found equal, %.1f MiB copied",
                    path, done["premapped_bytes"] / 2**20, done["copies_skipped_bytes"] / 2**20,
                    done["copies_written_bytes"] / 2**20)  # fmt: skip
        memory_trace.record("premapped", image=str(path), **done)
        return result

    setattr(load_weights, _MARK, method)
    return load_weights


def _after_load(method: Any) -> Any:
    @functools.wraps(method)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        from edge.paths import cache_dir

        premapped = _PREMAPPED.pop(id(self.model), None)
        try:
            done = map_model(self.model, _identity(self.vllm_config.model_config), cache_dir(), premapped)
        except OSError as error:
            logger.warning("mapped weights: the weights stay in anonymous memory: %s", error)
            return result
        heap_trim.trim_if_enabled()  # the copies the mapping replaced went into the heap
        how = "written" if done["written"] else "reused, read again" if done["refreshed"] else "reused"
        logger.info("mapped weights: %d tensors, %.1f MiB from %s (%s), %.1f MiB of it in 2 MiB pages", done["tensors"],
                    done["mapped_bytes"] / 2**20, done["image"], how, done["huge_mapped_bytes"] / 2**20)  # fmt: skip
        memory_trace.record("mapped", **done)
        return result

    setattr(load_model, _MARK, method)
    return load_model


def _patch(cpu_worker: Any) -> None:
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.v1.worker import cpu_model_runner

    runner = cpu_model_runner.CPUModelRunner
    if not getattr(runner.load_model, _MARK, None):
        runner.load_model = _after_load(runner.load_model)
    if not getattr(DefaultModelLoader.load_weights, _MARK, None):
        DefaultModelLoader.load_weights = _into_last_image(DefaultModelLoader.load_weights)


def install() -> bool:
    """Map the weights once loaded, and load into the last image where there is one, in the process that imports the
    CPU worker; False when turned off."""
    if not enabled():
        return False
    on_import.when_imported("vllm.v1.worker.cpu_worker", _patch)
    return True
