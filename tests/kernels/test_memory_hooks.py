"""The engine's memory hooks on their own: the on-import patch, the heap trim, the phase trace's lines."""

from __future__ import annotations

import json
import sys

import pytest

from kernels.vllm_plugin import heap_trim, memory_trace, on_import


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("edge_probe_mod")]:
        del sys.modules[name]


def test_a_patch_waits_for_its_module_and_runs_once(module_dir):
    (module_dir / "edge_probe_mod_a.py").write_text("VALUE = 1\n")
    seen = []
    on_import.when_imported("edge_probe_mod_a", lambda m: seen.append(m.VALUE))
    assert seen == []
    import edge_probe_mod_a  # noqa: F401

    assert seen == [1]
    del sys.modules["edge_probe_mod_a"]
    import edge_probe_mod_a  # noqa: F401, F811

    assert seen == [1]


def test_a_patch_for_an_imported_module_runs_now(module_dir):
    (module_dir / "edge_probe_mod_b.py").write_text("VALUE = 2\n")
    import edge_probe_mod_b  # noqa: F401

    seen = []
    on_import.when_imported("edge_probe_mod_b", lambda m: seen.append(m.VALUE))
    assert seen == [2]


def test_patches_run_in_the_order_they_were_asked_for(module_dir):
    (module_dir / "edge_probe_mod_c.py").write_text("order = []\n")
    on_import.when_imported("edge_probe_mod_c", lambda m: m.order.append("first"))
    on_import.when_imported("edge_probe_mod_c", lambda m: m.order.append("second"))
    import edge_probe_mod_c

    assert edge_probe_mod_c.order == ["first", "second"]


@pytest.mark.skipif(heap_trim._malloc_trim() is None, reason="this C library has no malloc_trim (not glibc)")
def test_trimming_returns_freed_heap_pages():
    # 64 MiB in 8 KiB blocks: below the mmap threshold, so they live in the heap; freeing all but the last keeps
    # the heap's top in place, so only a trim (not glibc's automatic top release) can give the pages back
    blocks = [bytearray(8192) for _ in range(8192)]
    keep = blocks[-1]
    del blocks
    before = memory_trace.status_bytes()["rss_anon"]
    assert heap_trim.trim()
    after = memory_trace.status_bytes()["rss_anon"]
    assert keep
    assert after < before - 32 * 2**20, (before, after)


def test_heap_trim_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(heap_trim.ENV, "0")
    assert heap_trim.install() is False


def test_a_trace_line_names_the_phase_and_this_process_memory(tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(memory_trace.ENV, str(path))
    memory_trace.record("load", model={"int8": 5})
    memory_trace.record("ready")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["phase"] for line in lines] == ["load", "ready"]
    assert lines[0]["model"] == {"int8": 5}
    for line in lines:
        assert line["rss_anon"] > 0 and line["rss_file"] > 0
        assert set(line["maps"]) == {"heap", "anon_maps", "file"}
        assert sum(line["maps"].values()) <= line["rss_anon"] * 1.05 + 2**20


def test_no_trace_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(memory_trace.ENV, raising=False)
    memory_trace.record("load")
    assert memory_trace.install() is False


def test_model_bytes_counts_each_storage_once_by_dtype():
    torch = pytest.importorskip("torch")
    module = torch.nn.Linear(4, 8, bias=False).to(torch.bfloat16)
    module.packed = torch.zeros(16, dtype=torch.uint8)
    module.alias = module.packed[:8]
    assert memory_trace.model_bytes(module) == {"bfloat16": 64, "uint8": 16}


def test_the_idle_trim_waits_for_work_then_for_idle(monkeypatch):
    monkeypatch.delenv(heap_trim.ENV, raising=False)
    monkeypatch.delenv(heap_trim.IDLE_ENV, raising=False)
    idle = heap_trim.IdleTrim(idle_s=0.5)
    assert idle.enabled is (heap_trim._malloc_trim() is not None)
    assert idle.timeout() is None  # nothing served yet: nothing to give back, wait without a limit
    idle.worked()
    assert idle.timeout() == (0.5 if idle.enabled else None)
    idle.trim()
    assert idle.timeout() is None and idle.trims == 1  # once per idle spell


@pytest.mark.parametrize("env", [heap_trim.ENV, heap_trim.IDLE_ENV])
def test_the_idle_trim_can_be_turned_off(monkeypatch, env):
    monkeypatch.setenv(env, "0")
    idle = heap_trim.IdleTrim()
    idle.worked()
    assert idle.timeout() is None


@pytest.mark.skipif(heap_trim._malloc_trim() is None, reason="this C library has no malloc_trim (not glibc)")
def test_the_engine_thread_trims_once_while_it_waits_after_serving():
    """ThreadEngineClient._wait_for_input on a queue: an input that arrives after the idle time is still returned,
    and the heap was trimmed once meanwhile; with nothing served before, nothing is trimmed."""
    import queue
    import threading
    import types

    from kernels.vllm_plugin.engine_thread import ThreadEngineClient

    for served, trims in ((True, 1), (False, 0)):
        inputs = queue.Queue()
        idle = heap_trim.IdleTrim(idle_s=0.05, enabled=True)
        if served:
            idle.worked()
        threading.Timer(0.3, inputs.put, args=("request",)).start()
        assert ThreadEngineClient._wait_for_input(types.SimpleNamespace(_inputs=inputs), idle) == "request"
        assert idle.trims == trims
