"""Writing model directories safely: a streaming sharded safetensors writer and a self-checking manifest.

Streaming: safetensors puts a JSON header (every tensor's dtype, shape, byte range) before the data, and
`safetensors.torch.save_file` wants every tensor of a file in memory at once. Here each tensor's bytes go to a
per-shard data file as they are produced; `finish()` writes the real files as header + a streamed copy of the
data, so memory holds one tensor at a time, whatever the shard size (at the price of one extra disk copy).

Manifest: `write_manifest` records every file's size and sha256 plus a checksum of the manifest itself; it is
written last, so a directory whose manifest checks out is complete. `check_manifest` is cheap by default
(sizes + the manifest's own checksum) and re-hashes every file when asked.

torch is imported only by the writer: `edge-model default` checks a cached directory's manifest without it
(importing torch takes ~1.5 s, README.md "Layout").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.errors import InputError

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_COPY_CHUNK = 16 << 20
_HASH_CHUNK = 1 << 20


class ShardedWriter:
    """Add tensors one at a time; shards close when the next tensor group would pass `shard_bytes`.

    Output as transformers writes it: one `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards
    plus `model.safetensors.index.json` when more than one shard was needed.
    """

    def __init__(self, directory: Path, shard_bytes: int) -> None:
        assert shard_bytes > 0
        assert sys.byteorder == "little", "safetensors is little-endian; tensors are written in host order"
        self.directory = directory
        self.shard_bytes = shard_bytes
        self.bytes_written = 0
        self._shards: list[dict[str, Any]] = []  # {"data": Path, "header": {name: entry}, "size": int}
        self._names: set[str] = set()

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write a group of tensors (e.g. one layer's qweight, scales, zeros) into the same shard."""
        import torch

        group_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        current = self._shards[-1]["size"] if self._shards else None
        if current is None or (current and current + group_bytes > self.shard_bytes):
            self._open_shard()
        shard = self._shards[-1]
        with shard["data"].open("ab") as data:
            for name, tensor in tensors.items():
                assert name not in self._names, f"tensor {name} written twice"
                self._names.add(name)
                flat = tensor.detach().cpu().contiguous().reshape(-1)
                raw = flat.view(torch.uint8).numpy()  # host byte order: little-endian, as safetensors
                begin = shard["size"]
                data.write(memoryview(raw))
                shard["size"] += raw.nbytes
                shard["header"][name] = {
                    "dtype": safetensors_dtype(tensor.dtype),
                    "shape": list(tensor.shape),
                    "data_offsets": [begin, shard["size"]],
                }
        self.bytes_written += group_bytes

    def finish(self) -> list[str]:
        """Write the safetensors files (and the index when sharded); return their names."""
        count = len(self._shards)
        names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        if count <= 1:
            names = [SINGLE_FILE]
        if not self._shards:
            self._open_shard()
        weight_map = {}
        for name, shard in zip(names, self._shards, strict=True):
            _write_safetensors(self.directory / name, shard["header"], shard["data"])
            shard["data"].unlink()
            weight_map.update(dict.fromkeys(shard["header"], name))
        if count > 1:
            index = {
                "metadata": {"total_size": self.bytes_written},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            names.append(INDEX_FILE)
        return names

    def _open_shard(self) -> None:
        data = self.directory / f".shard-{len(self._shards):05d}.data"
        data.write_bytes(b"")
        self._shards.append({"data": data, "header": {}, "size": 0})


def safetensors_dtype(dtype: torch.dtype) -> str:
    import torch

    names = {
        torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
        torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
        torch.bool: "BOOL",
    }  # fmt: skip
    return names[dtype]


def _write_safetensors(path: Path, header: dict[str, Any], data: Path) -> None:
    blob = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned, as safetensors' own writer does
    with path.open("wb") as out, data.open("rb") as src:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        shutil.copyfileobj(src, out, _COPY_CHUNK)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: Path, name: str, body: dict[str, Any]) -> None:
    """Write `name` holding `body` plus size and sha256 of every other file in `directory`; call it last."""
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != name
    }
    full = {**body, "files": files}
    text = json.dumps({**full, "manifest_sha256": _checksum(full)}, indent=2, sort_keys=True)
    (directory / name).write_text(text + "\n")


def read_manifest(
    directory: Path, name: str, *, deep: bool = False
) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) when `directory` is complete and intact, else (None, why not).

    Cheap by default: the manifest's own checksum and every file's size; `deep` re-hashes every file.
    """
    try:
        manifest = json.loads((directory / name).read_text())
    except FileNotFoundError:
        return None, f"no {name}"
    except (OSError, ValueError) as error:
        return None, f"{name} unreadable: {error}"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None, f"{name} malformed"
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    if manifest.get("manifest_sha256") != _checksum(body):
        return None, f"{name} checksum mismatch"
    for file, entry in manifest["files"].items():
        path = directory / file
        if not path.is_file():
            return None, f"{file} missing"
        if path.stat().st_size != entry["size"]:
            return None, f"{file} is {path.stat().st_size} bytes, {name} says {entry['size']}"
        if deep and sha256_file(path) != entry["sha256"]:
            return None, f"{file} sha256 differs from {name}"
    return manifest, None


def make_readable(directory: Path) -> None:
    """mkdtemp makes 0700 and safetensors files may be 0600; the engine may run as another user."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o755 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o644 & ~umask)


def packaged_file(dist: str, file: str, install_command: str) -> Path:
    """A data file shipped inside an installed distribution, found through its file list (nothing imported):
    the default model's GGUF, edge-eval's default text."""
    import importlib.metadata

    try:
        distribution = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise InputError(dist, "not installed", f"the package installed: {install_command}") from None
    path = Path(str(distribution.locate_file(file)))
    if not path.is_file():
        raise InputError(file, str(path), f"the file of {dist}; reinstall: {install_command}")
    return path
