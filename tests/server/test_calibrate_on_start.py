"""edge-serve's first start on a CPU it has no calibration record of times the kernels before it plans
(Settings.calibration `auto`), with a stand-in calibrator that caches and prints a record of this host as
edge-calibrate does; `cached` and `off` never time, and nothing is timed for a plan refused, a dry run or a
described device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from edge.errors import InputError
from server import cli
from tests.server.test_calibrations import cache_record, host_record, stand_in_calibrator

ZEN5_CPUINFO = Path(__file__).parents[1] / "edge" / "data" / "cpuinfo_epyc_zen5_avx512.txt"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    """A cache of this test's own: no calibration record unless the test writes one."""
    mine = tmp_path / "cache"
    mine.mkdir()
    monkeypatch.setenv("EDGE_SELECT_CACHE_DIR", str(mine))
    return mine


@pytest.fixture
def calibrator(monkeypatch, tmp_path: Path) -> dict:
    """The stand-in edge-calibrate: `calls` counts the starts that timed, `record` is what it measures."""
    seen = {"calls": 0, "record": host_record(measured_at="2026-12-03T09:00:00+00:00")}

    def command() -> list[str]:
        seen["calls"] += 1
        return stand_in_calibrator(seen["record"], tmp_path)

    monkeypatch.setattr(cli, "calibrator", command)
    return seen


def args(*argv: str):
    return cli.parser().parse_args(list(argv))


def bf16(model_dir: Path, *more: str):
    return args("--model", str(model_dir), "--path", "bf16", *more)  # bf16: nothing to convert


def test_auto_times_the_kernels_when_none_are_cached_then_plans_from_them(model_dir, cache, calibrator, capsys):
    cached_when_called: list[list[Path]] = []

    def before_timing() -> None:  # e.g. the early engine discarded: before the timing starts
        cached_when_called.append(sorted((cache / "calibration").glob("*.json")))

    prepared = cli.prepare(bf16(model_dir), calibration="auto", before_timing=before_timing)
    assert calibrator["calls"] == 1 and cached_when_called == [[]]
    assert prepared.plan.calibration is not None and prepared.plan.calibration.digest == calibrator["record"].digest
    assert "no calibration record for this CPU: timing its kernels once" in capsys.readouterr().out
    # the next start finds the record the first one cached, and times nothing
    again = cli.prepare(bf16(model_dir), calibration="auto", before_timing=lambda: pytest.fail("timed again"))
    assert calibrator["calls"] == 1 and again.plan.calibration == prepared.plan.calibration


def test_auto_uses_a_cached_record_of_this_cpu_without_timing(model_dir, cache, calibrator):
    record = host_record()
    cache_record(cache, record)
    prepared = cli.prepare(bf16(model_dir), calibration="auto", before_timing=lambda: pytest.fail("timed"))
    assert calibrator["calls"] == 0 and prepared.plan.calibration.digest == record.digest


def test_cached_never_times_and_plans_from_the_facts_table_without_a_record(model_dir, cache, calibrator):
    prepared = cli.prepare(bf16(model_dir), calibration="cached")
    assert calibrator["calls"] == 0 and prepared.plan.calibration is None


def test_off_plans_from_the_facts_table_whatever_is_cached(model_dir, cache, calibrator):
    cache_record(cache, host_record())
    assert cli.prepare(bf16(model_dir), calibration="cached").plan.calibration is not None
    prepared = cli.prepare(bf16(model_dir), calibration="off")
    assert calibrator["calls"] == 0 and prepared.plan.calibration is None


def test_a_described_device_is_never_timed_here(model_dir, cache, calibrator):
    prepared = cli.prepare(bf16(model_dir, "--device", str(ZEN5_CPUINFO)), calibration="auto")
    assert calibrator["calls"] == 0 and prepared.plan.calibration is None


def test_a_plan_refused_is_refused_before_anything_is_timed(model_dir, cache, calibrator, monkeypatch, capsys):
    monkeypatch.setenv("EDGE_CALIBRATION", "auto")
    assert cli.main(["--model", str(model_dir), "--path", "bf16", "--memory-budget", "64MiB"]) == 2
    assert "over the memory budget" in capsys.readouterr().err and calibrator["calls"] == 0


def test_a_bad_model_is_refused_before_anything_is_timed(tmp_path, cache, calibrator):
    with pytest.raises(InputError, match="a model directory holding config.json"):
        cli.prepare(args("--model", str(tmp_path / "nothing-here")), calibration="auto")
    assert calibrator["calls"] == 0


def test_a_failed_calibration_is_a_warning_and_the_facts_table_plans(model_dir, cache, monkeypatch, capsys):
    monkeypatch.setattr(cli, "calibrator", lambda: [sys.executable, "-c", "raise SystemExit(3)"])
    prepared = cli.prepare(bf16(model_dir), calibration="auto")
    assert prepared.plan.calibration is None and prepared.plan.vllm is not None
    err = capsys.readouterr().err
    assert "edge-serve: warning:" in err and "exited 3" in err and "planning from the facts table" in err


def test_a_dry_run_times_nothing_and_says_serving_would(model_dir, cache, calibrator, monkeypatch, capsys):
    monkeypatch.setenv("EDGE_CALIBRATION", "auto")
    assert cli.main(["--model", str(model_dir), "--path", "bf16", "--dry-run"]) == 0
    assert calibrator["calls"] == 0
    assert "no calibration record for this CPU: serving times its kernels first" in capsys.readouterr().out


def test_calibrate_with_calibration_off_exits_2_naming_the_setting(model_dir, cache, calibrator, monkeypatch,
                                                                    capsys):  # fmt: skip
    monkeypatch.setenv("EDGE_CALIBRATION", "off")
    assert cli.main(["--model", str(model_dir), "--calibrate", "--dry-run"]) == 2
    assert "EDGE_CALIBRATION='off'" in capsys.readouterr().err and calibrator["calls"] == 0


@pytest.mark.parametrize(("variable", "value", "shown"), [
    ("EDGE_CALIBRATION", "sometimes", "EDGE_CALIBRATION: expected 'auto', 'cached' or 'off', got 'sometimes'"),
    ("EDGE_PORT", "eighty", "EDGE_PORT: expected a valid integer"),
])  # fmt: skip
def test_a_bad_setting_exits_2_naming_the_variable_and_value(model_dir, monkeypatch, capsys, variable, value, shown):
    monkeypatch.setenv(variable, value)
    assert cli.main(["--model", str(model_dir), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"edge-serve: {shown}") and "Traceback" not in err


def test_a_bad_flag_value_is_named_as_the_flag(model_dir, capsys):
    assert cli.main(["--model", str(model_dir), "--port", "99999", "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith("edge-serve: --port: expected less than or equal to 65535, got 99999")
