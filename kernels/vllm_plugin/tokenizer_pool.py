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

A shallow copy that shares the cached vocabulary. vLLM's cached tokenizer (`get_cached_tokenizer`) keeps the
vocabulary dict, the special tokens and the lengths in a class made for it, and defines `__reduce__` as "call
get_cached_tokenizer on the original again", for pickling. `copy.copy` falls back to `__reduce__` where a class has
no `__copy__`, so each shallow copy rebuilt the whole cache: `get_vocab()` again, a dict of every vocabulary token.
HfRenderer makes two such copies (its own, and the pool's `og_tokenizer`), and `copy.deepcopy`, which the pool's
copies are, goes the same way: the original deep-copied, then its cache built again. The plugin gives each cached
tokenizer's class a `__copy__` and a `__deepcopy__` that copy the instance's attributes (deeply for the second: the
Rust tokenizer is copied, through its own pickling, as before) and keep its class, so every copy shares the one
read-only cache. Pickling still goes through `__reduce__`. The pool's own subclass gets both set to None, so copying
a pooled tokenizer builds a new pool, as in vLLM. EDGE_TOKENIZER_SHALLOW_COPY=0 leaves vLLM's copies as they are.

In a bare process (the renderer started on the served checkpoint, RssAnon after malloc_trim, Zen 5, 2026-12-07)
the renderer with one pool copy held 181 MiB on the Gemma 3-shaped vocabulary and 35 on the default model's where
each copy rebuilt the cache; 84 and 12 where the shallow and the deep copies share it
(docs/reports/2026-12-07-tokenizer-pool.md).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from types import ModuleType
from typing import Any

from kernels.vllm_plugin import on_import

ENV = "EDGE_TOKENIZER_COPIES"
SHALLOW_ENV = "EDGE_TOKENIZER_SHALLOW_COPY"
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


def _shallow_copy(self: Any) -> Any:
    """copy.copy of a cached tokenizer: an instance of the same class (so the same cached vocabulary), its attributes
    copied as copy.copy copies any plain object's."""
    new = object.__new__(type(self))
    new.__dict__.update(self.__dict__)
    return new


def _deep_copy(self: Any, memo: dict[int, Any]) -> Any:
    """copy.deepcopy of a cached tokenizer: its attributes deep-copied (the Rust tokenizer among them), its class, and
    so its read-only cache, shared."""
    new = object.__new__(type(self))
    memo[id(self)] = new
    new.__dict__.update(copy.deepcopy(self.__dict__, memo))
    return new


_SHARING = {"__copy__": _shallow_copy, "__deepcopy__": _deep_copy}


def _sharing_copies(get_cached: Any) -> Any:
    @functools.wraps(get_cached)
    def get_cached_tokenizer(tokenizer: Any) -> Any:
        cached = get_cached(tokenizer)
        for name, method in _SHARING.items():
            if name not in type(cached).__dict__:
                setattr(type(cached), name, method)
        return cached

    setattr(get_cached_tokenizer, _MARK, get_cached)
    return get_cached_tokenizer


def _fewer(make_pool: Any, up_front: int) -> Any:
    @functools.wraps(make_pool)
    def maybe_make_thread_pool(tokenizer: Any, copies: int = 1) -> Any:
        pooled = make_pool(tokenizer, min(copies, up_front))
        for name, method in _SHARING.items():
            if getattr(type(pooled), name, None) is method:  # inherited from the cached tokenizer's class
                setattr(type(pooled), name, None)  # a pooled tokenizer's copy: a new pool (its __reduce__), as vLLM
        return pooled

    setattr(maybe_make_thread_pool, _MARK, make_pool)
    return maybe_make_thread_pool


def _patch(renderers_hf: ModuleType) -> None:
    make_pool = renderers_hf.maybe_make_thread_pool
    if not getattr(make_pool, _MARK, None):
        renderers_hf.maybe_make_thread_pool = _fewer(make_pool, copies_up_front())


def _patch_cache(tokenizers_hf: ModuleType) -> None:
    get_cached = tokenizers_hf.get_cached_tokenizer
    if not getattr(get_cached, _MARK, None):
        tokenizers_hf.get_cached_tokenizer = _sharing_copies(get_cached)


def install() -> None:
    """Fill the renderer's tokenizer pool with copies_up_front() copies, in the process that imports the renderer;
    and, unless EDGE_TOKENIZER_SHALLOW_COPY=0, let a cached tokenizer's shallow copy share its cache."""
    if os.environ.get(SHALLOW_ENV, "1") != "0":
        on_import.when_imported("vllm.tokenizers.hf", _patch_cache)
    on_import.when_imported("vllm.renderers.hf", _patch)
