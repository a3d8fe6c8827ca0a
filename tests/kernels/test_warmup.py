"""The warm-up probe (kernels/vllm_plugin/warmup.py) against a stand-in runner, named as such: the real one needs an
engine (the core real-vLLM test starts one cold and restarts it warm)."""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("vllm")

from vllm.compilation import decorators  # noqa: E402

from kernels.vllm_plugin import warmup  # noqa: E402


class StandInRunner:
    """Records the dummy runs; its forward asks the (wrapped) AOT loader as vLLM's compiled model's first call does."""

    def __init__(self, on_disk: bool, max_num_tokens: int = 2048) -> None:
        self.on_disk, self.max_num_tokens, self.vllm_config = on_disk, max_num_tokens, object()
        self.forwards: list[int] = []
        self.sampler_runs = 0

    def _dummy_run(self, tokens: int, is_profile: bool = False):
        loader = warmup._wrap_loader(lambda model, path: object() if self.on_disk else None)
        loader(self, "/cache/model")  # raises _NotOnDisk under the probe when nothing loads
        self.forwards.append(tokens)
        return None, f"hidden[{tokens}]"

    def _dummy_sampler_run(self, hidden) -> None:
        self.sampler_runs += 1


@contextlib.contextmanager
def no_settings(config):
    yield


def test_a_cached_model_warms_up_on_a_small_batch():
    runner = StandInRunner(on_disk=True)
    assert warmup.small_warm_up(runner, no_settings)
    assert runner.forwards == [warmup.SMALL_BATCH_TOKENS] and runner.sampler_runs == 1


def test_without_a_cached_model_the_probe_stops_before_any_forward():
    runner = StandInRunner(on_disk=False)
    assert not warmup.small_warm_up(runner, no_settings)
    assert runner.forwards == [] and runner.sampler_runs == 0
    # outside the probe the loader answers as vLLM's: None, and the caller compiles
    assert warmup._wrap_loader(lambda model, path: None)(runner, "/cache/model") is None


def test_the_probe_never_exceeds_the_engines_batch():
    runner = StandInRunner(on_disk=True, max_num_tokens=8)
    assert warmup.small_warm_up(runner, no_settings) and runner.forwards == [8]


def test_install_wraps_vllms_warm_up_and_loader_once(monkeypatch):
    from vllm.v1.worker import cpu_model_runner

    monkeypatch.setattr(cpu_model_runner.CPUModelRunner, "warming_up_model",
                        cpu_model_runner.CPUModelRunner.warming_up_model)
    monkeypatch.setattr(decorators, "_try_load_aot_compiled_fn", decorators._try_load_aot_compiled_fn)
    original_loader = decorators._try_load_aot_compiled_fn
    assert warmup.install() and warmup.install()
    assert getattr(decorators._try_load_aot_compiled_fn, warmup._MARK) is original_loader
    assert getattr(cpu_model_runner.CPUModelRunner.warming_up_model, warmup._MARK)


def test_install_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("EDGE_SELECT_WARMUP", "full")
    assert not warmup.install()
