"""vLLM general plugin (entry point `vllm.general_plugins: cpu_int4 = kernels.vllm_plugin.plugin:register`).

vLLM calls `register()` in every process it starts (front end, engine core, spawned workers), possibly more
than once; everything here is idempotent.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    """Register the `cpu_int4` and `cpu_w4a8` quantization methods and their ops; fix the CPU compile cache; the
    sampler's and the CPU attention's leaner Python (sampling.py, attention.py); the weights mapped from a file once
    loaded (mapped_weights.py); one tokenizer copy in the renderer's pool up front (tokenizer_pool.py)."""
    from kernels.vllm_plugin import compile_cache

    compile_cache.install()
    compile_cache.install_factors_fix()
    from kernels.vllm_plugin import engine_start

    engine_start.install()
    from kernels.vllm_plugin import engine_thread

    if engine_thread.install():  # one-process: this process loads the compiled model, and never forks
        compile_cache.prefetch_keys()
        from kernels.vllm_plugin import warmup

        warmup.install()
    from kernels.vllm_plugin import sampling

    sampling.install()
    from kernels.vllm_plugin import attention

    attention.install()
    # Importing registers: @register_quantization_config("cpu_int4") and the torch.ops.vllm.cpu_int4_* ops.
    import kernels.vllm_plugin.cpu_int4  # noqa: F401
    import kernels.vllm_plugin.cpu_w4a8  # noqa: F401  (@register_quantization_config("cpu_w4a8"), torch.ops.vllm.cpu_w4a8_linear)
    from kernels.vllm_plugin import heap_trim, mapped_weights, memory_trace, tokenizer_pool

    tokenizer_pool.install()
    from kernels.vllm_plugin import drafting

    drafting.install()
    mapped_weights.install()
    heap_trim.install()
    memory_trace.install()  # after warmup's and heap_trim's patches: it records what they leave
