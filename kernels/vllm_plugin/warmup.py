"""A warm start's warm-up: a small dummy batch when the compiled model comes from vLLM's cache, the full one otherwise.

vLLM 0.28's CPU runner warms up (`CPUModelRunner.warming_up_model`, called by `CPUWorker.determine_available_memory`)
with `profile_run`: one dummy forward at `max_num_tokens` (2048 for the OpenAI server on CPU) and a dummy sampler
run. On a cold start that forward is where the model is compiled, for the generic shape, and the size it compiles at
is the size Inductor's heuristics see. On a warm start the compiled model is loaded from disk in the first forward
(`_try_load_aot_compiled_fn`), and the 2048-token forward only computes: ~0.9 s of a 14 s warm start of the default
model on 2 Zen 5 cores (the engine log: "Initial profiling/warmup run took 0.85-1.07 s"). The KV cache's size is the
plan's (`--kv-cache-memory-bytes`), so nothing is measured from that run on CPU.

This warm-up first runs a batch of `SMALL_BATCH_TOKENS` tokens as a probe: if the first forward loads the compiled
model from disk, the probe is the warm-up (the loaded model runs, the sampler runs) and the full-size forward is
skipped. If it does not (a cold cache, a load failure, a source change), the probe stops before Dynamo starts and
vLLM's own warm-up runs at full size, exactly as shipped. So a cold start compiles as before; only a warm one is
shorter. Its first 2048-token prompt then allocates its activations when it arrives instead of at start.

Installed only in one-process mode (kernels/vllm_plugin/plugin.py), where this process runs the model and imports
vLLM's CPU runner anyway; an API server in front of another process would import it (0.24 s) only to patch it.

EDGE_SELECT_WARMUP=full leaves vLLM's warm-up as shipped.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from vllm.logger import init_logger

logger = init_logger("vllm.edge_select.warmup")

_MARK = "_edge_select_warmup"
SMALL_BATCH_TOKENS = 16
_probe = threading.local()


class _NotOnDisk(Exception):
    """The probe's first forward found no loadable compiled model: vLLM's full warm-up compiles instead."""


def _wrap_loader(load: Any) -> Any:
    def _try_load_aot_compiled_fn(model: Any, aot_compilation_path: str) -> Any:
        loaded = load(model, aot_compilation_path)
        if getattr(_probe, "active", False):
            _probe.loaded = loaded is not None
            if loaded is None:
                raise _NotOnDisk(aot_compilation_path)
        return loaded

    setattr(_try_load_aot_compiled_fn, _MARK, load)
    return _try_load_aot_compiled_fn


def small_warm_up(runner: Any, compilation_settings: Any) -> bool:
    """Warm `runner` up with a small dummy batch if its compiled model loads from disk in that batch's forward;
    False, with nothing run past the load attempt, if it does not."""
    tokens = min(SMALL_BATCH_TOKENS, runner.max_num_tokens)
    _probe.active, _probe.loaded = True, False
    try:
        with compilation_settings(runner.vllm_config):
            _, last_hidden_states = runner._dummy_run(tokens, is_profile=True)
            _probe.active = False
            runner._dummy_sampler_run(last_hidden_states)
    except _NotOnDisk:
        return False
    finally:
        _probe.active = False
    if _probe.loaded:
        logger.info("warm-up: the compiled model came from the cache; warmed up on %d tokens, not %d",
                    tokens, runner.max_num_tokens)
    return True


def install() -> bool:
    """Route vLLM's CPU warm-up through `small_warm_up` first, once per process; True if it is (now) in place."""
    if os.environ.get("EDGE_SELECT_WARMUP", "small") == "full":
        return False
    from vllm import envs
    from vllm.compilation import decorators
    from vllm.config import CompilationMode
    from vllm.v1.worker import cpu_model_runner

    if not envs.VLLM_USE_AOT_COMPILE or envs.VLLM_DISABLE_COMPILE_CACHE:
        return False  # no load from disk to probe for: the first forward compiles
    runner_cls = cpu_model_runner.CPUModelRunner
    if getattr(runner_cls.warming_up_model, _MARK, None):
        return True
    original = runner_cls.warming_up_model
    compilation_settings = cpu_model_runner._set_global_compilation_settings

    def warming_up_model(self: Any) -> None:
        if self.vllm_config.compilation_config.mode == CompilationMode.NONE or not small_warm_up(
                self, compilation_settings):
            original(self)

    setattr(warming_up_model, _MARK, original)
    decorators._try_load_aot_compiled_fn = _wrap_loader(decorators._try_load_aot_compiled_fn)
    runner_cls.warming_up_model = warming_up_model
    return True
