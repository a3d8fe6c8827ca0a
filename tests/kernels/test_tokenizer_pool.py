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
