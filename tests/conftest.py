"""Suite-wide: a cache directory of the run's own, unless the caller (CI, a developer) chose one.

The probe caches the measured tinygemm layout there and the kernels cache the default model; keeping a run's
cache out of the user's home means a test never passes on what an earlier run left behind.
"""

import os
import tempfile

os.environ.setdefault("EDGE_SELECT_CACHE_DIR", tempfile.mkdtemp(prefix="edge-select-test-cache-"))


def pytest_report_header(config):
    """First lines of every run: which CPU class it ran on, so a CI log says where its results come from."""
    from edge.probe import probe

    host = probe(measure_layout=False)
    aten = os.environ.get("ATEN_CPU_CAPABILITY")
    return [
        f"host: {host.cpu_model.value} ({host.vendor.value}), ISA class {host.isa_class}, "
        f"{host.compute_cores} cores, features {', '.join(host.isa.value or [])}",
        f"torch dispatch: {host.runtime.torch_cpu_capability.value}"
        + (f" (ATEN_CPU_CAPABILITY={aten})" if aten else "")
        + f"; vLLM library {host.runtime.vllm_native_library.value}",
    ]
