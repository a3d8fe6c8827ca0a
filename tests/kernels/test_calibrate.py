"""edge-calibrate: every registry kernel has a timer, children that die or hang are recorded not raised, a small
real calibration yields a valid record, and records are written atomically."""

import os

import pytest
import torch

from edge.catalog.kernel_registry import KERNELS
from edge.device.calibration import CalibrationRecord
from edge.model.reader import default_model
from kernels.calibrate import calibrate as cal
from kernels.calibrate.calibration_timers import TEST_CRASH_HOOK, TIMERS, check

SMALL = [(128, 256)]  # [N, K]: a multiple of every kernel's N and K constraints at group 32
ROWS = [1, 16]


def w4a8_registered() -> bool:
    """What the loaded vLLM library registers on this host (_C: yes; _C_AVX2: no)."""
    import vllm._custom_ops  # noqa: F401  (loads the library vLLM picks for this CPU)

    return hasattr(torch.ops._C, "int4_scaled_mm_cpu")


@pytest.fixture(scope="module")
def record() -> CalibrationRecord:
    lines: list[str] = []
    return cal.calibrate(default_model(), 1, kernels=["tinygemm", "bf16", "vllm-w4a8"], shapes=SMALL, rows=ROWS,
                         quick=True, progress=lines.append)  # fmt: skip


def test_timers_name_exactly_the_registry_kernels():
    assert set(TIMERS) == set(KERNELS)


def test_a_child_killed_by_sigill_is_recorded_as_crashed(monkeypatch):
    monkeypatch.setenv(TEST_CRASH_HOOK, "int8")
    result = cal.time_in_child("int8", SMALL, [1], 32, 1)
    assert (result.kernel, result.status, result.reason, result.times) == ("int8", "crashed", "killed by SIGILL", [])


def test_a_child_past_its_time_is_recorded_as_failed():
    result = cal.time_in_child("bf16", SMALL, [1], 32, 1, timeout_s=0.05)
    assert result.status == "failed"
    assert "timed out" in result.reason


def test_a_kernel_computing_wrong_numbers_fails_the_check():
    x = torch.randn(4, 256).to(torch.bfloat16)
    reference = torch.randn(128, 256)
    assert check((x.float() @ reference.t()).to(torch.bfloat16), x, reference, 0.01) is None
    wrong = check(torch.zeros(4, 128, dtype=torch.bfloat16), x, reference, 0.01)
    assert wrong is not None and "relative error 1" in wrong


def test_a_small_calibration_validates_and_times_every_shape_and_row(record):
    again = CalibrationRecord.model_validate_json(record.model_dump_json())
    assert again == record
    assert record.model == default_model().name and record.threads == 1 and record.group_size == 32
    for name in ("tinygemm", "bf16"):
        result = record.timed(name)
        assert result is not None, record.kernel(name)
        assert {(t.n, t.k, t.m) for t in result.times} == {(n, k, m) for n, k in SMALL for m in ROWS}
        assert all(t.calls >= 5 for t in result.times)
    assert record.read_bandwidth_gb_s and record.llc_bytes and record.native_library


def test_w4a8_is_timed_exactly_when_the_loaded_library_registers_its_op(record):
    result = record.kernel("vllm-w4a8")
    if w4a8_registered():
        assert result.status == "ok", result.reason
    else:
        assert result.status == "absent"
        assert f"{record.native_library} registers no" in result.reason


def test_thread_scaling_times_a_decode_step_at_one_thread_and_at_all_cores(record):
    if record.cores > cal.SCALING_MAX_CORES:
        pytest.skip(f"{record.cores} cores: thread scaling is measured on boxes of up to {cal.SCALING_MAX_CORES}")
    steps = {(t.kernel, t.threads) for t in record.thread_scaling}
    assert steps == {(k, n) for k in cal.SCALING_KERNELS for n in {1, record.cores}}


def test_the_record_is_written_atomically(record, tmp_path, monkeypatch):
    path = cal.write_record(record, tmp_path / "record.json")
    assert CalibrationRecord.model_validate_json(path.read_text()) == record
    before = path.read_text()

    def interrupted(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(OSError):
        cal.write_record(record.model_copy(update={"threads": 2}), path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


@pytest.mark.parametrize(("argv", "field"), [(["--model", "/no/such/model"], "--model"),
                                             (["--threads", "0"], "--threads"),
                                             (["--kernels", "tinygemm,fastest"], "--kernels")])  # fmt: skip
def test_bad_input_exits_2_naming_the_option(argv, field, capsys):
    assert cal.main(argv) == cal.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err
