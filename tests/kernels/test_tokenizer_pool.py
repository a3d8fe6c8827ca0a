"""kernels/vllm_plugin/tokenizer_pool.py against vLLM 0.28's own pool (vllm/tokenizers/hf.py maybe_make_thread_pool),
with a real Hugging Face fast tokenizer built here: how many deep copies it makes up front, that it still copies one
more for a borrower that finds the pool empty, and that the pooled tokenizer encodes as the plain one does."""

from __future__ import annotations

import copy
import importlib
import logging
import types

import pytest

pytest.importorskip("vllm")

from kernels.vllm_plugin import tokenizer_pool  # noqa: E402


def fast_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]
    inner = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>")


@pytest.fixture
def deep_copies(monkeypatch):
    """Counts the deep copies vLLM's pool makes (its module's `copy.deepcopy`)."""
    hf = importlib.import_module("vllm.tokenizers.hf")
    made = []

    def deepcopy(obj, memo=None):
        made.append(obj)
        return copy.deepcopy(obj, memo)

    monkeypatch.setattr(hf, "copy", types.SimpleNamespace(copy=copy.copy, deepcopy=deepcopy))
    return made


@pytest.fixture
def renderers_hf(monkeypatch):
    """vllm.renderers.hf with the plugin's patch applied, restored afterwards."""
    module = importlib.import_module("vllm.renderers.hf")
    monkeypatch.setattr(module, "maybe_make_thread_pool", module.maybe_make_thread_pool)
    original = getattr(module.maybe_make_thread_pool, tokenizer_pool._MARK, module.maybe_make_thread_pool)
    monkeypatch.setattr(module, "maybe_make_thread_pool", original)
    return module


def _pool_queue(tokenizer):
    """The pool's queue.Queue, found through the closures of the pooled class's encode (vLLM 0.28 keeps it there)."""
    import queue

    seen, todo = set(), [type(tokenizer).encode]
    while todo:
        fn = todo.pop()
        for cell in getattr(fn, "__closure__", None) or ():
            value = cell.cell_contents
            if isinstance(value, queue.Queue):
                return value
            if callable(value) and id(value) not in seen:
                seen.add(id(value))
                todo.append(getattr(value, "__wrapped__", value))
    raise AssertionError("vLLM's tokenizer pool keeps no queue in encode's closures")


def test_the_renderer_pool_starts_with_one_copy_and_grows_when_a_borrower_finds_it_empty(
        renderers_hf, deep_copies, monkeypatch):  # fmt: skip
    monkeypatch.delenv(tokenizer_pool.ENV, raising=False)
    plain = fast_tokenizer()
    expected = plain.encode("the quick brown fox jumps over the lazy dog")
    tokenizer_pool._patch(renderers_hf)
    pooled = renderers_hf.maybe_make_thread_pool(fast_tokenizer(), 2)  # HfRenderer's renderer_num_workers + 1
    assert len(deep_copies) == tokenizer_pool.DEFAULT_COPIES == 1
    assert pooled.encode("the quick brown fox jumps over the lazy dog") == expected
    assert len(deep_copies) == 1  # the copy up front served it

    queue = _pool_queue(pooled)
    held = queue.get_nowait()  # another thread holds the one copy
    assert pooled.encode("the lazy dog") == plain.encode("the lazy dog")
    assert len(deep_copies) == 2  # vLLM copied one more rather than share it
    assert queue.qsize() == 1
    queue.put(held)


def test_the_patch_applies_once(renderers_hf, deep_copies, monkeypatch):
    monkeypatch.delenv(tokenizer_pool.ENV, raising=False)
    tokenizer_pool._patch(renderers_hf)
    patched = renderers_hf.maybe_make_thread_pool
    tokenizer_pool._patch(renderers_hf)
    assert renderers_hf.maybe_make_thread_pool is patched
    renderers_hf.maybe_make_thread_pool(fast_tokenizer(), 2)
    assert len(deep_copies) == 1


@pytest.mark.parametrize(("value", "up_front"), [("2", 2), ("5", 2), ("0", 0)])
def test_the_variable_sets_the_copies_up_to_vllms_own_count(renderers_hf, deep_copies, monkeypatch, value, up_front):
    monkeypatch.setenv(tokenizer_pool.ENV, value)
    tokenizer_pool._patch(renderers_hf)
    pooled = renderers_hf.maybe_make_thread_pool(fast_tokenizer(), 2)
    assert len(deep_copies) == up_front
    assert pooled.encode("the dog") == fast_tokenizer().encode("the dog")


@pytest.mark.parametrize("value", ["two", "-1", "1.5", ""])
def test_a_bad_value_keeps_the_default_and_says_so(monkeypatch, caplog, value):
    monkeypatch.setenv(tokenizer_pool.ENV, value)
    with caplog.at_level(logging.WARNING, logger=tokenizer_pool.logger.name):
        assert tokenizer_pool.copies_up_front() == tokenizer_pool.DEFAULT_COPIES
    assert f"{tokenizer_pool.ENV}={value!r}" in caplog.text


@pytest.fixture
def tokenizers_hf(monkeypatch):
    """vllm.tokenizers.hf with get_cached_tokenizer as vLLM ships it, restored afterwards."""
    module = importlib.import_module("vllm.tokenizers.hf")
    original = getattr(module.get_cached_tokenizer, tokenizer_pool._MARK, module.get_cached_tokenizer)
    monkeypatch.setattr(module, "get_cached_tokenizer", original)
    return module


def test_vllms_copies_of_a_cached_tokenizer_rebuild_its_vocabulary(tokenizers_hf):
    """What the patch is for: copy.copy and copy.deepcopy go through the cached class's __reduce__
    (get_cached_tokenizer again, on the original or its deep copy)."""
    cached = tokenizers_hf.get_cached_tokenizer(fast_tokenizer())
    assert copy.copy(cached).get_vocab() is not cached.get_vocab()
    assert copy.deepcopy(cached).get_vocab() is not cached.get_vocab()


def test_a_shallow_copy_shares_the_cache_and_pickling_and_deep_copies_are_as_before(tokenizers_hf):
    import pickle

    tokenizer_pool._patch_cache(tokenizers_hf)
    cached = tokenizers_hf.get_cached_tokenizer(fast_tokenizer())
    shallow = copy.copy(cached)
    assert type(shallow) is type(cached) and shallow is not cached
    assert shallow.get_vocab() is cached.get_vocab()  # one vocabulary dict, not a second
    assert shallow._tokenizer is cached._tokenizer  # a shallow copy, as vLLM's was
    text = "the quick brown fox jumps over the lazy dog"
    assert shallow.encode(text) == cached.encode(text) == fast_tokenizer().encode(text)
    assert shallow.all_special_ids == cached.all_special_ids and len(shallow) == len(cached)
    deep = copy.deepcopy(cached)
    assert type(deep) is type(cached) and deep.get_vocab() is cached.get_vocab()  # the read-only cache, shared
    assert deep._tokenizer is not cached._tokenizer and deep.encode(text) == cached.encode(text)  # the state, not
    deep._tokenizer.enable_truncation(2)  # what vLLM's pool copies guard against: one thread's settings, another's
    assert len(deep._tokenizer.encode(text).ids) == 2 and len(cached._tokenizer.encode(text).ids) == 9
    unpickled = pickle.loads(pickle.dumps(cached))
    assert unpickled.encode(text) == cached.encode(text)


def test_a_pooled_tokenizers_copy_is_still_a_pool_of_its_own(tokenizers_hf, renderers_hf, deep_copies, monkeypatch):
    monkeypatch.delenv(tokenizer_pool.ENV, raising=False)
    tokenizer_pool._patch_cache(tokenizers_hf)
    tokenizer_pool._patch(renderers_hf)
    cached = tokenizers_hf.get_cached_tokenizer(fast_tokenizer())
    pooled = renderers_hf.maybe_make_thread_pool(copy.copy(cached), 2)  # as HfRenderer.__init__ calls it
    assert len(deep_copies) == 1
    for again in (copy.copy(pooled), copy.deepcopy(pooled)):
        assert _pool_queue(again) is not _pool_queue(pooled)  # vLLM's TokenizerPool.__reduce__: a new pool
        assert again.encode("the lazy dog") == cached.encode("the lazy dog")
    assert type(cached).__copy__ is tokenizer_pool._shallow_copy  # the cached class keeps the shared copies
    assert type(cached).__deepcopy__ is tokenizer_pool._deep_copy
