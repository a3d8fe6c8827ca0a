"""Kernels are data (edge/catalog/kernel_registry.py): no module names a kernel but the registry, the kernel's own
implementation and its timer (in the torch half of the format it reads, kernels/formats/, one per entry; the
timing child kernels/calibrate/calibration_timers.py names the torch ops each needs). Everything else asks the
registry, so a new kernel is one entry, its implementation file, its timer and its tests."""

from __future__ import annotations

import ast
from pathlib import Path

from edge.catalog.kernel_registry import DECODE_KERNELS, KERNELS
from edge.catalog.weight_paths import METHODS, PATHS, QUANTIZED_PATHS, WEIGHT_PATHS, quant_method, quant_methods
from kernels.formats import MODULES

REPO = Path(__file__).parents[1]
# Where a kernel's name may be written: the spec, and the files of the kernels themselves (the timers included).
SPEC = "edge/catalog/kernel_registry.py"
OWN_FILES = {
    "kernels/calibrate/calibration_timers.py": set(KERNELS),
    "kernels/ops/avx2_int4.py": {"avx2-int4", "avx2-w4a8", "avx2-int8"},
    **{f"kernels/formats/{module.__name__.rsplit('.', 1)[1]}.py": set(module.TIMERS) for module in MODULES.values()},
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


# Paths are data too (edge/catalog/weight_paths.py): a module branches on a spec's values (its weight format, whether it
# quantizes, whether vLLM serves it), never on a path's name, so a new path is one entry. Its own files may name
# it: the phone bundle's exporter names the plan it takes.
# The kernel registry is the other spec: a kernel's entry names the paths it serves.
PATH_SPECS = {"edge/catalog/weight_paths.py", "edge/catalog/kernel_registry.py"}
PATH_OWN_FILES = {"kernels/export/export.py": {"export-only"}}
DISTINCT_PATHS = {name for name in WEIGHT_PATHS if "-" in name}


def named(path: Path, names: set[str]) -> set[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names}  # fmt: skip


def test_the_checked_path_names_are_every_path_but_the_dtype():
    assert set(WEIGHT_PATHS) - {"bf16"} == DISTINCT_PATHS


def test_no_module_outside_the_path_specs_and_the_paths_own_files_names_a_path():
    found = []
    for room in ("edge", "kernels", "server"):
        for path in sorted((REPO / room).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in PATH_SPECS:
                continue
            allowed = PATH_OWN_FILES.get(rel, set())
            found += [f"{rel}:{line} names {name}" for line, name in sorted(named(path, DISTINCT_PATHS))
                      if name not in allowed]  # fmt: skip
    assert found == []


def test_every_spec_names_a_gate_and_every_method_a_config_and_an_installer():
    from edge.plan.engine_config import METHOD_CONFIGS
    from edge.plan.gates import GATES
    from kernels.scoring.eval_model import INSTALLERS

    assert sorted(spec.gate for spec in PATHS.values()) == sorted(GATES)
    assert sorted(METHOD_CONFIGS) == sorted(METHODS) == sorted(INSTALLERS)
    assert all(METHODS[method].path == name for name, spec in PATHS.items() for method in quant_methods(name))


def test_a_paths_config_names_its_own_method_on_either_kind_of_host():
    """What edge.plan.engine_config writes is the method edge.catalog.weight_paths names for the device (AMX or not)."""
    from edge.catalog.quantized_layers import model_layers, rules_for
    from edge.catalog.shape_rules import pick_gptq_group_size, pick_group_size
    from edge.measure.kernel_params import KernelParams
    from edge.model.reader import default_model
    from edge.plan.engine_config import quantization_config

    model = default_model()
    for name in QUANTIZED_PATHS:
        spec = PATHS[name]
        group = pick_group_size(model) if spec.weight_format == "tinygemm" else pick_gptq_group_size(model)
        for amx in (True, False):
            layers = model_layers(model, rules_for(model, name, group, amx=amx))
            layout = spec.layouts[0] if spec.layouts else None
            kernel = KernelParams(block=32, dequant_threshold=16, prefill_dtype="bfloat16", repack_chunk_rows=4096)
            config = quantization_config(model, name, layout, group, layers, kernel, amx=amx)
            assert config["quant_method"] == quant_method(name, amx=amx)


def test_a_decode_kernel_is_offered_only_on_the_isa_classes_its_spec_names():
    from edge.catalog.kernel_registry import default_decode_kernel, offered_lossy_decode_kernel

    x86 = {name for name, spec in DECODE_KERNELS.items() if "avx2" in spec.isa_classes}
    assert default_decode_kernel("AVX2", "avx2") in x86 - {"tinygemm"}  # this project's AVX2 kernel
    assert default_decode_kernel("AVX2", "arm") == "tinygemm"  # no spec of an AVX2 kernel names ARM
    assert offered_lossy_decode_kernel("AVX2", "avx2") is not None
    assert offered_lossy_decode_kernel("AVX2", "arm") is None
