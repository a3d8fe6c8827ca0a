"""What the converter writes (quantization_config) and how vLLM is started (args, env) for a chosen option."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from edge.catalog import shape_rules as rules
from edge.catalog.kernel_registry import DEFAULT_DECODE_KERNEL
from edge.catalog.quantized_layers import LayerDecision, eight_bit_group_size, eight_bit_set, kept_bf16, own_block_sets
from edge.catalog.shape_rules import copied_grid
from edge.catalog.weight_paths import METHODS, PATHS, quant_method
from edge.device.profile import DeviceProfile
from edge.measure.kernel_params import KernelParams, float_dtype
from edge.model.shapes import ModelShape
from edge.plan.schema import Layout, ServingMode, VllmConfig, WeightPath
from edge.plan.speculative import Speculative

# vLLM reserves one core for its front end on x86 by default (docs/FACTS.md: on a 2-core box it then runs one
# compute thread). On boxes this small, the GEMMs get every core instead.
SMALL_BOX_CORES = 4


def quantization_config(
    model: ModelShape,
    path: WeightPath,
    layout: Layout | None,
    group_size: int | None,
    layers: list[LayerDecision],
    kernel: KernelParams,
    *,
    amx: bool = True,
) -> dict[str, Any] | None:
    """What the converter writes into config.json and the engine reads back: the plan's decisions, never
    recomputed downstream (the layers from edge.catalog.quantized_layers, the kernel values from
    edge.measure.kernel_params).

    amx: whether the device has AMX tiles, which decides who serves w4a8-gptq (edge.catalog.weight_paths.quant_method):
    vLLM's own GPTQ method there, the plugin's cpu_w4a8 elsewhere; the layers must come from rules_for with the
    same flag."""
    method = quant_method(path, amx=amx)
    if method is None:
        return None
    assert group_size is not None
    return METHOD_CONFIGS[method](model, layout, group_size, layers, kernel)


def _cpu_int4(
    model: ModelShape, layout: Layout | None, group_size: int, layers: list[LayerDecision], kernel: KernelParams
) -> dict[str, Any]:
    assert layout is not None
    return {
        "quant_method": "cpu_int4",
        "bits": 4,
        "group_size": group_size,
        # Part of the checkpoint's config so it reaches vLLM's compile-cache key (docs/FACTS.md: an env-var
        # toggle against a warm cache loaded the wrong graph).
        "direct_dequant": layout == "direct",
        "prefill_dequant": layout != "kernel-only",
        "dequant_threshold": kernel.dequant_threshold,
        "prefill_dtype": kernel.prefill_dtype,
        # The engine refuses to load a checkpoint planned for another block (kernels/vllm_plugin/cpu_int4.py): the
        # ledger's direct/dual accounting rests on it.
        "tinygemm_block": kernel.block,
        "repack_chunk_rows": kernel.repack_chunk_rows,
        # only where a record timed the AVX2 kernel faster: a tinygemm plan's config stays as it was
        **({"decode_kernel": kernel.decode_kernel} if kernel.decode_kernel != DEFAULT_DECODE_KERNEL else {}),
        "quantize_embedding": model.tie_word_embeddings,
        # the converter takes the 4-bit codes from the source's own grid (edge-source.json), not re-rounding
        "codes_from_source": model.source_grid == group_size,
        # weights not on a source grid: the scale-and-minimum search (kernels/ops/asym_search.py), measured to
        # cut the squared error 26 % at group 64 on the default model's weights (docs/reports/)
        "rounding": "search",
        "int8": eight_bit_set(layers),
        **_int8_group(layers),
        # the int4 weights whose decode copy keeps the file's own Q4_K blocks (only where the decode kernel reads them)
        # and the 8-bit set's weights kept as the file's own Q6_K, Q8_0 or Q5_0 blocks
        **own_block_sets(layers),
        "ignore": kept_bf16(layers),
    }


def _int8_group(layers: list[LayerDecision]) -> dict[str, int]:
    """The 8-bit set's group where it is per group (a GGUF's own grid: edge.catalog.quantized_layers.eight_bit_group); a
    per-channel set writes nothing, so its config, compile-cache key and quality records stay as they were."""
    group = eight_bit_group_size(layers)
    return {"int8_group_size": group} if group else {}


# W4A8 from a float source solved by GPTQ after activation smoothing (kernels/convert/gptq_pass.py), asymmetric group 32
# where the kernel takes a zero point per group. Measured on the default model through int4_scaled_mm_cpu (edge-eval,
# AMD EPYC Zen 5; docs/reports/2026-12-07-w4a8-gptq.md): KLD 0.394 rounded to nearest (symmetric, group 64) -> 0.064;
# GPTQ, 4096 tokens: no smoothing 0.098, alpha 0.3 0.092, 0.4 0.073, 0.5 0.070, 0.6 0.067, 0.7 0.072; 64 windows
# instead of 16 gained 0.002 for 4x the time. Not planned yet (a conversion written with it: edge-convert --plan with
# these keys, benchmarks/w4a8_gptq.py): its held-out score, the conversion's memory in the ledger and the families
# smoothing cannot fold into come first (docs/reports/2026-12-07-w4a8-gptq.md, "Not reached").
W4A8_ROUNDING = {"rounding": "gptq", "smoothing": 0.6, "calibration_windows": 16}
W4A8_SOLVED_GROUP = 32  # group 32 measured 0.064 where group 64 measured 0.085 (same report)


def _cpu_w4a8(
    model: ModelShape, layout: Layout | None, group_size: int, layers: list[LayerDecision], kernel: KernelParams
) -> dict[str, Any]:
    return {
        "quant_method": "cpu_w4a8",
        "bits": 4,
        "group_size": group_size,
        "sym": True,  # int4_scaled_mm_cpu with the zero point pinned at 8, as vLLM runs GPTQ (uint4b8)
        "desc_act": False,
        "checkpoint_format": "gptq",  # the linears' tensors are the GPTQ export's (kernels/ops/gptq.py)
        # a Q4_0 source's codes go to the GPTQ tensors unchanged (its grid is uint4b8's); written only then, so
        # other checkpoints' configs and quality records stay as they were
        **({"codes_from_source": True} if copied_grid(model, METHODS["cpu_w4a8"].source_codes) == group_size else {}),
        # the 8-bit set's GEMM switches to dequantize + bf16 from this many rows (kernels/ops/int4_ops.py)
        "dequant_threshold": kernel.dequant_threshold,
        "int8": eight_bit_set(layers),
        **_int8_group(layers),
        # the 8-bit set's weights kept as the file's own Q6_K, Q8_0 or Q5_0 blocks (never Q4_K: the 4-bit layers are
        # vLLM's GPTQ layout)
        **own_block_sets(layers),
        "ignore": kept_bf16(layers),
    }


def _gptq(
    model: ModelShape, layout: Layout | None, group_size: int, layers: list[LayerDecision], kernel: KernelParams
) -> dict[str, Any]:
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "sym": True,  # vLLM's W4A8 kernel pins the zero point at 8 (uint4b8)
        "desc_act": False,  # act-order (g_idx) sends vLLM to cpu_gemm_wna16 instead of W4A8
        "lm_head": True,  # an unquantized head costs more per step than the 4-bit saving (docs/FACTS.md)
        "checkpoint_format": "gptq",
    }


# Each checkpoint method's quantization_config (edge.catalog.weight_paths.METHODS names them).
METHOD_CONFIGS = {"cpu_int4": _cpu_int4, "cpu_w4a8": _cpu_w4a8, "gptq": _gptq}
# What vLLM's environment needs for a method: its own GPTQ method takes W4A8 only with this (and AMX tiles).
METHOD_ENV: dict[str, dict[str, str]] = {"gptq": {"VLLM_CPU_INT4_W4A8": "1"}}


# vLLM's CPU platform compiles the model once with Inductor (DYNAMO_TRACE_ONCE). With Inductor's C++ wrapper the
# compiled graph runs as one C++ function that releases the GIL, instead of ~700 lines of Python a step calling
# ~150 fused kernels and 120 weight ops through Python: a decode step of the default model's speed plan took 0.91x
# the time (8.27 -> 7.52 ms, benchmarks/step_profile.py, 2026-12-06, AMD EPYC Zen 4). Building the wrapper apart
# from the kernels (its own -O1 compile, the kernels' -O3) took a cold start's compile from 191 to 78 s there at
# the same step time (7.60 against 7.52 ms). The compile cache keeps it for every later start.
COMPILATION_CONFIG = {"inductor_compile_config": {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}}
# vLLM 0.28 on torch >= 2.11 passes attention layer names to its ops as a `LayerName` opaque object, which the C++
# wrapper cannot hand back to a Python op ("arg type PyObject is not yet supported by custom_op_wrapper", seen
# 2026-12-02); as strings it can. The plugin's C++ attention leaves no such op in a plain decoder's graph, but a layer
# it does not take (kernels/vllm_plugin/attention_cpp.py eligible) keeps vLLM's.
COMPILE_ENV = {"VLLM_USE_LAYERNAME": "0"}
# vLLM's CPU attention splits a decode row's keys into chunks and merges their partial softmaxes after
# (VLLM_CPU_ATTN_SPLIT_KV, on as shipped), but attends a row of a multi-row query in one pass. So a drafted token
# checked in a verify pass got other logits than the same token decoded alone: log-probabilities differed by up to
# 0.14 and the greedy text of a summary left the undrafted one at token 106; with one pass for every row they were
# bit-identical over 128 tokens (AMD EPYC Zen 5, default model, docs/reports/2026-12-07-speculative.md). The
# plan keeps one pass whether it drafts or not, so that turning drafting on or off never changes greedy text. A
# decode step took 4.693 against 4.649 ms (1.009x), within the run's noise (benchmarks/step_profile.py
# plain+split-kv, plain+no-split-kv, 6 rounds of 96 steps, same host).
ATTENTION_ENV = {"VLLM_CPU_ATTN_SPLIT_KV": "0"}




# Where none is asked for, the serving mode follows the device's cores (serving_mode_for):
#   one-process on a box of at most ONE_PROCESS_MAX_CORES: the engine core is a thread of the API server's process
#     (kernels/vllm_plugin/engine_thread.py): one Python process with torch and vLLM instead of two, measured on
#     the default model by benchmarks/bench_serve.py with the same decode and a third less RssAnon (facts
#     avx512.one_process.*). On such a box there is no core to give the API server of its own anyway.
#   two-process above it: vLLM 0.28's CPU platform turns its `uni` executor into `mp` ("OMP requires the MP
#     executor", platforms/cpu.py) unless VLLM_ENABLE_V1_MULTIPROCESSING=0, and then the engine core waits on a
#     worker process through the shared-memory broadcast, spinning a core of its own. The CPU backend runs without
#     async scheduling, so the engine core has nothing else to do meanwhile: a plan of one engine (no tensor
#     parallelism, which no plan uses) loses nothing by running the worker in the engine core. With cores to spare
#     the API server keeps its own process and GIL: one-process is not measured on more than 2 cores.
# three-process (vLLM's own layout) is there when asked for.
ONE_PROCESS_MAX_CORES = 2
DEFAULT_SERVING_MODE: ServingMode = "two-process"  # a device whose cores are unknown


def serving_mode_for(device: DeviceProfile, threads: int | None = None) -> ServingMode:
    """The serving mode of a plan that asks for none (edge.plan.schema.ServingMode); `threads`: the engine threads asked
    for. One-process computes on one thread: its event loop shares the process with the engine's OpenMP team, and a
    second thread cut its served decode to 0.44x (fact avx512.one_process.second_thread.decode_ratio), where
    two-process lost 9 %."""
    cores = device.compute_cores
    if cores is not None and cores <= ONE_PROCESS_MAX_CORES and (threads or 1) == 1:
        return "one-process"
    return DEFAULT_SERVING_MODE


# vLLM binds OpenMP only for a worker process it spawns (utils/ompmultiprocessing.py sets OMP_NUM_THREADS and
# OMP_PROC_BIND/OMP_PLACES in that process's environment, all cores less the reserved ones). An engine core running
# the worker itself inherits the API server's environment, so the plan sets its thread count (OMP_NUM_THREADS)
# and no binding: OMP_PROC_BIND there would pin the API server's thread to the engine's first core as well.
SERVING_MODE_ENV: dict[ServingMode, dict[str, str]] = {
    "one-process": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "EDGE_ENGINE_CORE_START": "thread"},
    "two-process": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    "three-process": {},
}
# A two-process engine starts its core by fork, not the spawn vLLM's CPU platform forces
# (kernels/vllm_plugin/engine_start.py): the core inherits the API server's imports, 8-12 s off a warm start here.
# libgomp's thread pool does not survive a fork (seen 2026-12-02, AMD EPYC Zen 5, OMP_NUM_THREADS=2: the forked core
# hung for good in its first parallel region), so for an engine of more than one thread the plugin keeps the API
# server on one thread and gives the forked core its OMP_NUM_THREADS back.
FORK_START_ENV = {"EDGE_ENGINE_CORE_START": "fork"}


def engine_threads(cores: int | None) -> int:
    """The compute threads of a two-process engine without a calibration's choice: every core but one, which the
    API server, the wrapper and the engine core's own scheduling share (vLLM's mp mode reserves one the same way
    on bigger boxes); one on a one- or two-core box."""
    return max(1, (cores or 1) - 1)


def attention_block_size(model: ModelShape) -> int | None:
    """The KV block size vLLM must be started with for this model (edge.catalog.shape_rules.kv_block_tokens), or None
    for its default."""
    block = rules.kv_block_tokens(model)
    return None if block == rules.CPU_KV_BLOCK_TOKENS else block


def _cache_key(model: ModelShape, path: WeightPath, qconfig: dict[str, Any] | None) -> str:
    blob = json.dumps({"model": model.name, "path": path, "quantization_config": qconfig}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def vllm_config(
    device: DeviceProfile,
    model: ModelShape,
    path: WeightPath,
    qconfig: dict[str, Any] | None,
    *,
    max_model_len: int,
    max_num_seqs: int,
    kv_cache_bytes: int,
    mode: ServingMode | None = None,
    speculative: Speculative | None = None,
) -> VllmConfig | None:
    """mode: the serving mode asked for (edge-select/edge-serve --serving-mode), else serving_mode_for(device).
    speculative: the plan's drafting (edge.plan.speculative): vLLM's speculative_config and the engine's environment
    for it; None or off for none."""
    if not PATHS[path].served_by_vllm:
        return None
    args = [
        "--dtype", float_dtype(device),
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        # Exact bytes; VLLM_CPU_KVCACHE_SPACE only takes whole GiB, and without either vLLM's CPU worker
        # reserves 92% of the node's memory.
        "--kv-cache-memory-bytes", str(kv_cache_bytes),
        "--compilation-config", json.dumps(COMPILATION_CONFIG, separators=(",", ":")),
    ]  # fmt: skip
    if (block := attention_block_size(model)) is not None:
        args += ["--block-size", str(block)]
    drafting = speculative.vllm_config() if speculative is not None else None
    if drafting is not None:
        args += ["--speculative-config", json.dumps(drafting, separators=(",", ":"))]
    if PATHS[path].quantizes_weights:
        assert qconfig is not None
        args += ["--quantization", qconfig["quant_method"]]  # cpu_int4, gptq or cpu_w4a8: the checkpoint's method
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
        # Plans that build different graphs get different compile caches (docs/FACTS.md, compile-cache key).
        "VLLM_CACHE_ROOT": f"~/.cache/edge-select/vllm/{_cache_key(model, path, qconfig)}",
        **COMPILE_ENV,
        **ATTENTION_ENV,
        **(speculative.engine_env() if speculative is not None else {}),
    }
    cores = device.compute_cores
    if cores is not None and cores <= SMALL_BOX_CORES:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    if qconfig is not None:
        env |= METHOD_ENV.get(qconfig["quant_method"], {})
    mode = mode or serving_mode_for(device)
    env |= SERVING_MODE_ENV[mode]
    if mode != "three-process":
        threads = engine_threads(cores)
        env["OMP_NUM_THREADS"] = str(threads)
        if mode == "two-process":
            env |= FORK_START_ENV
        env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)  # read only by vLLM's mp executor
    return VllmConfig(args=args, env=env, mode=mode)
