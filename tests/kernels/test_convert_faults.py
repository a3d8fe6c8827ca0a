"""Conversion faults: a corrupted weight file in a converted checkpoint is detected and rebuilt, never served; a
disk that fills during a conversion leaves the previous conversion intact and says so."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from kernels.convert import convert as converter
from kernels.convert.convert import MANIFEST, convert, main
from kernels.source.checkpoint import read_manifest, sha256_file
from tests.kernels.test_convert import W4A16, _write_llama

SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture
def converted(tmp_path: Path) -> tuple[Path, Path]:
    src = _write_llama(tmp_path / "src", **SMALL)
    return src, convert(src, tmp_path / "dst", W4A16, path="w4a16-tinygemm")


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))  # same size: only a checksum can tell


def test_a_flipped_byte_in_a_weight_file_is_detected_and_the_cli_refuses_to_call_it_up_to_date(converted, capsys):
    src, dst = converted
    weights = sorted(dst.glob("*.safetensors"))[0]
    _flip_a_byte(weights)
    assert main([str(src), str(dst), "--plan", _plan_file(dst)]) == 2
    assert f"{weights.name} sha256 differs" in capsys.readouterr().err


def test_edge_serves_forced_conversion_rebuilds_a_corrupted_checkpoint(converted):
    src, dst = converted
    weights = sorted(dst.glob("*.safetensors"))[0]
    good = sha256_file(weights)
    _flip_a_byte(weights)
    logged: list[str] = []
    convert(src, dst, W4A16, path="w4a16-tinygemm", force=True, log=logged.append)
    assert sha256_file(weights) == good
    assert any("sha256 differs" in line for line in logged)
    assert read_manifest(dst, MANIFEST, deep=True)[1] is None


def test_a_full_disk_during_conversion_leaves_the_previous_conversion_intact(converted, monkeypatch, capsys):
    src, dst = converted
    before = {p.name: sha256_file(p) for p in dst.iterdir()}

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(converter, "write_manifest", no_space)  # the last write of a conversion
    plan = _plan_file(dst, other_group=True)  # another config, so the conversion really runs
    assert main([str(src), str(dst), "--plan", plan, "--force"]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "unchanged" in err and "Traceback" not in err
    assert {p.name: sha256_file(p) for p in dst.iterdir()} == before
    assert not list(dst.parent.glob(f".{dst.name}.tmp-*"))  # no half-written temp directory left behind


def _plan_file(dst: Path, other_group: bool = False) -> str:
    """A plan JSON whose quantization_config is W4A16 (or, with other_group, group 32), as edge-convert reads."""
    from edge.model.reader import read_model
    from edge.plan.planner import make_plan

    plan = make_plan(_any_device(), read_model(dst.parent / "src"), path="w4a16-tinygemm", layout="direct")
    qconfig = {**W4A16, "group_size": 32} if other_group else W4A16
    file = dst.parent / ("other.plan.json" if other_group else "same.plan.json")
    file.write_text(plan.model_copy(update={"quantization_config": qconfig}).model_dump_json())
    return str(file)


def _any_device():
    from edge.device.cpuinfo import parse_cpuinfo

    data = Path(__file__).parents[1] / "edge" / "data" / "cpuinfo_epyc_zen5_avx512.txt"
    return parse_cpuinfo(data.read_text())
