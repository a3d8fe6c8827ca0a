"""A weight format is one object (edge.formats, its torch half in kernels.formats): what it owns is asked of it,
and no code outside those modules branches on a format's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from edge.catalog.kernel_registry import KERNELS
from edge.catalog.weight_paths import PATHS
from edge.errors import InputError
from edge.formats import FORMATS, format_of, kernel_layout_format
from edge.formats.gptq import GPTQ
from edge.formats.int8 import INT8
from edge.formats.tinygemm import TINYGEMM
from edge.model.shapes import LinearShape

REPO = Path(__file__).parents[2]
FORMAT_MODULES = ("edge/formats", "kernels/formats")


def _names_weight_format(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "weight_format") or (
        isinstance(node, ast.Name) and node.id == "weight_format"
    )


def weight_format_comparisons(path: Path) -> list[int]:
    """Lines where `weight_format` (an attribute or a variable) is compared with anything."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(_names_weight_format(side) for side in [node.left, *node.comparators])]  # fmt: skip


def test_the_comparison_finder_finds_one(tmp_path):
    probe = tmp_path / "branches.py"
    probe.write_text('if spec.weight_format == "tinygemm":\n    pass\nok = weight_format in ("a",)\n')
    assert weight_format_comparisons(probe) == [1, 3]


def test_no_code_outside_the_format_modules_compares_weight_format():
    found = [f"{path.relative_to(REPO)}:{line}"
             for room in ("edge", "kernels", "server", "benchmarks") for path in sorted((REPO / room).rglob("*.py"))
             if not str(path.relative_to(REPO)).startswith(FORMAT_MODULES)
             for line in weight_format_comparisons(path)]  # fmt: skip
    assert found == []


def test_every_path_stores_its_weights_in_a_format():
    assert {spec.weight_format for spec in PATHS.values()} <= set(FORMATS)
    assert format_of("w4a16-tinygemm") is TINYGEMM and format_of("w4a8-gptq") is GPTQ


def test_every_kernel_reads_a_layout_one_format_stores():
    for spec in KERNELS.values():
        assert spec.weight_format in kernel_layout_format(spec.weight_format).kernel_layouts, spec.name


def test_tinygemm_bytes_are_codes_plus_bf16_scales_and_zeros():
    lin = LinearShape(name="q_proj", n=4096, k=4096, count=2)
    # [N, K/2] uint8 codes + 2 x bf16 [N, K/64] scales and zeros, for 2 layers
    assert TINYGEMM.bytes(lin, 64) == 2 * (4096 * 2048 + 2 * 2 * 4096 * 64)
    assert TINYGEMM.bytes(lin, 64) / (2 * 4096 * 4096) == TINYGEMM.derived_bytes


def test_int8_bytes_per_channel_and_per_group():
    lin = LinearShape(name="lm_head", n=49152, k=576, count=1)
    assert INT8.bytes(lin) == 49152 * 576 + 2 * 49152  # one bf16 scale per channel
    assert INT8.bytes(lin, 32) == 49152 * 576 + 4 * 49152 * 18  # a float32 scale per group of 32


@pytest.mark.parametrize("fmt, good, bad", [(TINYGEMM, 128, 48), (GPTQ, -1, 256)])
def test_a_method_config_names_the_field_and_the_group_sizes_it_takes(fmt, good, bad):
    fmt.check_method_config(group_size=good, dequant_threshold=None, int8_group_size=None)
    with pytest.raises(InputError) as refused:
        fmt.check_method_config(group_size=bad, dequant_threshold=None, int8_group_size=None)
    assert refused.value.field == "group_size" and str(fmt.group_sizes) in str(refused.value)
    with pytest.raises(InputError, match="int8_group_size"):
        fmt.check_method_config(group_size=good, dequant_threshold=None, int8_group_size=8)
    with pytest.raises(InputError, match="dequant_threshold"):
        fmt.check_method_config(group_size=good, dequant_threshold=0, int8_group_size=None)


def test_the_converter_request_check_names_the_quantization_config_field():
    with pytest.raises(InputError) as refused:
        TINYGEMM.check_request("w4a16-tinygemm", {"quant_method": "cpu_int4", "group_size": 48}, ["cpu_int4"])
    assert refused.value.field == "quantization_config.group_size"
    with pytest.raises(InputError, match="none for path bf16"):
        FORMATS["bf16"].check_request("bf16", {"group_size": 64}, [])


def test_a_format_says_which_shapes_its_layouts_cannot_hold():
    assert TINYGEMM.cannot_hold("int4-tinygemm", 4100, 4096, 64)  # N not in 16s
    assert TINYGEMM.cannot_hold("int4-rowmajor", 4100, 4096, 64) is None  # the row-major copy takes any N
    assert GPTQ.cannot_hold("int4-gptq", 4096, 4096, 64) is None and GPTQ.cannot_hold("int4-gptq", 4096, 4100, 4)
