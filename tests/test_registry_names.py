"""Kernels are data (edge/kernel_registry.py): no module names a kernel but the registry, the kernel's own
implementation and the timers (kernels/calibrate/calibration_timers.py, one per entry). Everything else asks the
registry, so a new kernel is one entry, its implementation file, its timer and its tests."""

from __future__ import annotations

import ast
from pathlib import Path

from edge.kernel_registry import DECODE_KERNELS, KERNELS

REPO = Path(__file__).parents[1]
# Where a kernel's name may be written: the spec, and the files of the kernels themselves (the timers included).
SPEC = "edge/kernel_registry.py"
OWN_FILES = {
    "kernels/calibrate/calibration_timers.py": set(KERNELS),
    "kernels/ops/avx2_int4.py": {"avx2-int4", "avx2-w4a8", "avx2-int8"},
}
# Names that are also ordinary words of the project (an ISA class, a dtype, PyTorch's kernel) are left out:
# only the names no other concept spells are checked.
DISTINCT = {name for name in set(KERNELS) | set(DECODE_KERNELS) if "-" in name}


def named_kernels(path: Path) -> set[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in DISTINCT}  # fmt: skip


def test_the_checked_names_include_every_avx2_and_vllm_kernel():
    assert {"avx2-int4", "avx2-w4a8", "avx2-int8", "vllm-w4a8", "vllm-wna16", "dequant-bf16"} <= DISTINCT


def test_no_module_outside_the_registry_and_the_kernels_own_files_names_a_kernel():
    found = []
    for room in ("edge", "kernels", "server"):
        for path in sorted((REPO / room).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel == SPEC:
                continue
            allowed = OWN_FILES.get(rel, set())
            found += [f"{rel}:{line} names {name}" for line, name in sorted(named_kernels(path)) if name not in allowed]
    assert found == []


def test_every_kernel_has_a_timer_and_every_timer_a_kernel():
    from kernels.calibrate.calibration_timers import TIMERS

    assert sorted(TIMERS) == sorted(KERNELS)


def test_every_decode_kernel_names_an_eight_bit_kernel_in_the_registry():
    assert all(spec.decode.eight_bit in KERNELS for spec in DECODE_KERNELS.values())


def test_every_facts_stand_in_of_a_kernel_is_a_key_of_the_facts_table_for_some_class():
    from edge.facts import FACTS

    missing = [f"{name}: {point.suffix}" for name, spec in KERNELS.items() for point in spec.facts
               if not any(key.endswith("." + point.suffix) for key in FACTS)]  # fmt: skip
    assert missing == []
