"""What every benchmark report names: the host's CPU."""

from __future__ import annotations

from pathlib import Path


def cpu_model_name() -> str:
    """/proc/cpuinfo's first `model name` ("AMD EPYC" on this project's VMs), or "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
