"""One tokenizer copy in vLLM's renderer pool up front, not `renderer_num_workers + 1` (issue 44).

vLLM 0.28's HfRenderer makes its tokenizer thread-safe by routing each call through a pool of deep copies
(`vllm/tokenizers/hf.py maybe_make_thread_pool`, called from `vllm/renderers/hf.py HfRenderer.__init__` with
`renderer_num_workers + 1` copies: 2 by default). A borrower that finds the pool empty deep-copies one more and
returns it to the pool (`_borrow_from_pool`), so the pool already grows to however many threads use it at once.
Filling it up front only buys the second copy before anything needs it. With a text model one renderer thread
tokenizes (`renderer_num_workers` 1; `--renderer-num-workers 0` is refused); a second copy appears the first time
another thread borrows while it does.

Each copy is the whole tokenizer: in a bare process (RssAnon after malloc_trim, Zen 5, 2026-12-06) the renderer's
two copies held 54 MiB on the default model's 49152-token vocabulary and 278 MiB on a Gemma 3-shaped 262144.

EDGE_TOKENIZER_COPIES=N fills the pool with N copies instead (vLLM's own count when N is larger than it; 0 copies
nothing until the first call). Unset, 1.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType
from typing import Any

from kernels.vllm_plugin import on_import

ENV = "EDGE_TOKENIZER_COPIES"
DEFAULT_COPIES = 1
logger = logging.getLogger("vllm.edge_select.tokenizer_pool")
_MARK = "_edge_select_tokenizer_pool"


def copies_up_front() -> int:
    """The copies the pool starts with: EDGE_TOKENIZER_COPIES, or DEFAULT_COPIES (with a warning naming the value)
    where it is not a whole number of 0 or more."""
    value = os.environ.get(ENV)
    if value is None:
        return DEFAULT_COPIES
    if value.strip().isdigit():
        return int(value)
    logger.warning("%s=%r is not a whole number of tokenizer copies (0 or more): using %d", ENV, value, DEFAULT_COPIES)
    return DEFAULT_COPIES


def _fewer(make_pool: Any, up_front: int) -> Any:
    @functools.wraps(make_pool)
    def maybe_make_thread_pool(tokenizer: Any, copies: int = 1) -> Any:
        return make_pool(tokenizer, min(copies, up_front))

    setattr(maybe_make_thread_pool, _MARK, make_pool)
    return maybe_make_thread_pool


def _patch(renderers_hf: ModuleType) -> None:
    make_pool = renderers_hf.maybe_make_thread_pool
    if not getattr(make_pool, _MARK, None):
        renderers_hf.maybe_make_thread_pool = _fewer(make_pool, copies_up_front())


def install() -> None:
    """Fill the renderer's tokenizer pool with copies_up_front() copies, in the process that imports the renderer."""
    on_import.when_imported("vllm.renderers.hf", _patch)
