"""Suite-wide: a cache directory of the run's own, unless the caller (CI, a developer) chose one, and edge-serve
planning from a cached calibration record without timing one at start.

The probe caches the measured tinygemm layout there and the kernels cache the default model; keeping a run's
cache out of the user's home means a test never passes on what an earlier run left behind.
"""

import os
import tempfile

import pytest

os.environ.setdefault("EDGE_SELECT_CACHE_DIR", tempfile.mkdtemp(prefix="edge-select-test-cache-"))
# edge-serve times this host's kernels (1-2 minutes) on its first start without a calibration record
# (server.settings.Settings.calibration): no test pays for that by surprise. The tests of that start set `auto`
# themselves (tests/server/test_calibrations.py, with a stand-in calibrator), and the image test's container, whose
# environment is the image's own, runs it for real.
os.environ.setdefault("EDGE_CALIBRATION", "cached")


def pytest_report_header(config):
    """First lines of every run: which CPU class it ran on, so a CI log says where its results come from."""
    import platform

    import torch

    from edge.device.probe import probe

    host = probe(measure_layout=False)
    aten = os.environ.get("ATEN_CPU_CAPABILITY")
    # under qemu-user (scripts/test-arm) /proc/cpuinfo is the host's: the machine and torch's own dispatch say more
    return [
        f"host: {host.cpu_model.value} ({host.vendor.value}), {platform.machine()}, ISA class {host.isa_class}, "
        f"{host.compute_cores} cores, features {', '.join(host.isa.value or [])}",
        f"torch dispatch: {torch.backends.cpu.get_cpu_capability()} (the probe's rule: "
        f"{host.runtime.torch_cpu_capability.value})"
        + (f" (ATEN_CPU_CAPABILITY={aten})" if aten else "")
        + f"; vLLM library {host.runtime.vllm_native_library.value}",
    ]


# The slow tests `scripts/test` runs by default (`-m "not slow or core"`): one per real component a user meets, so
# CI fits its time on the slowest host (issue 20: the whole slow tier took 55 min on the Zen 3). `scripts/test --all`
# runs every slow test. Each entry: the test's node id, and what real component it alone covers in the default run.
CORE_SLOW = {
    "tests/deploy/test_image_slow.py::test_the_image_serves_a_completion_through_its_entrypoint":
        "the container image: built with buildah on a local Debian, its entrypoint serves a completion",
    "tests/server/test_real_vllm.py::test_real_vllm_serves_through_the_wrapper_and_comes_back_after_being_killed":
        "deploy/edge-up with the real vLLM on this host's plan: /v1, /status, /metrics, a killed engine restarted",
    "tests/kernels/test_export_slow.py::test_the_bundle_meets_the_quality_targets":
        "edge-export: the ONNX bundle built and scored in ONNX Runtime",
    "tests/kernels/test_export_slow.py::test_the_bundle_loads_and_generates_like_the_source":
        "edge-export: the bundle generates like its source",
    "tests/kernels/test_export_slow.py::test_onnxruntime_genai_loads_the_bundle_and_answers_paris":
        "edge-export: ONNX Runtime GenAI (the phone apps' loader) opens the bundle and answers Paris",
    "tests/server/test_calibrations_postgres.py": "the calibration store on a real PostgreSQL server",
    "tests/kernels/test_default_model.py::test_the_built_model_answers_paris":
        "edge-model: the embedded default model built from its GGUF",
    "tests/kernels/test_convert.py::test_the_default_model_converted_to_cpu_int4_still_answers_paris":
        "edge-convert on the real default model",
    "tests/kernels/test_convert_gguf.py::test_a_gguf_of_each_family_converts_to_what_transformers_reads_from_the_file":
        "edge-convert on a GGUF of each family (llama, qwen2, qwen3, gemma2, gemma3, phi3) against transformers",
    "tests/server/test_real_vllm.py::test_edge_up_serves_a_gguf_file_with_its_own_chat_template":
        "deploy/edge-up --model FILE.gguf with the real vLLM: the file converted, served, its chat template used",
    "tests/kernels/test_evaluate.py::test_default_model_quality_under_this_hosts_plan_is_in_a_sane_range":
        "edge-eval on the real default model under this host's plan",
    "tests/kernels/test_decode_plugin_slow.py":
        "the real vLLM engine: the plugin's C++ and Python attention generate vLLM's own greedy text, eager and "
        "compiled with the plan's C++ wrapper; the int8 kernel's decode layout the row-major layout's first tokens",
    "tests/kernels/test_q4k_serve_slow.py":
        "the real vLLM engine serving a GGUF's Q4_K tensors as the file's own blocks (quantization_config.q4k)",
    "tests/kernels/test_w4a8_blocks_serve_slow.py":
        "the real vLLM engine serving a w4a8-gptq plan whose 8-bit set keeps a GGUF's Q6_K and Q5_0 blocks",
    "tests/kernels/test_speculative_slow.py":
        "the real vLLM engine with n-gram drafting: the undrafted plan's greedy text, token for token, on the plan's "
        "threads, drafting only while one sequence decodes",
    "tests/server/test_memory_budget_slow.py":
        "deploy/edge-up --memory-budget 1GiB with the real vLLM: a later start stays under it through a full context",
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `core` must be on the items when "not slow or core" is read
def pytest_collection_modifyitems(config, items):
    """Mark the CORE_SLOW tests `core`. An entry whose file was collected but which names no test there fails the
    run: a renamed test would otherwise silently leave the default run."""
    seen, files = set(), {item.nodeid.split("::")[0] for item in items}
    for item in items:
        for name in CORE_SLOW:
            if item.nodeid == name or item.nodeid.startswith(name + "::") or item.nodeid.startswith(name + "["):
                item.add_marker(pytest.mark.core)
                seen.add(name)
    missing = sorted(name for name in set(CORE_SLOW) - seen if name.split("::")[0] in files)
    if missing:
        raise pytest.UsageError(f"tests/conftest.py CORE_SLOW names tests that do not exist: {missing}")
