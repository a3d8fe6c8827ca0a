"""edge-select as a person runs it: the installed console script, real process, real host."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edge.plan.schema import Plan

DATA = Path(__file__).parent / "data"


@pytest.fixture(autouse=True)
def no_quality_records(tmp_path, monkeypatch):
    """A cache of the test's own: the plans below are specified without edge-eval records (the quality
    records' effect on a plan is specified in test_planner.py and test_quality_cli below)."""
    monkeypatch.setenv("EDGE_SELECT_CACHE_DIR", str(tmp_path / "cache"))


def edge_select(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("edge-select", path=str(Path(sys.executable).parent))
    assert exe, "the edge-select console script is installed with the project"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


def test_json_plan_on_this_host_shows_avx2_and_no_w4a8():
    result = edge_select("--json")
    assert result.returncode == 0, result.stderr
    plan = Plan.model_validate_json(result.stdout)
    assert plan.device.described_by == "probe"
    assert plan.device.has("avx2") and not plan.device.has_amx
    assert plan.path != "w4a8-gptq"
    assert plan.memory.resident_bytes > 0 and len(plan.memory.items) >= 5
    assert all(item.bytes >= 0 and item.detail for item in plan.memory.items)


def test_human_summary_names_path_memory_and_runner_up():
    result = edge_select("--priority", "fidelity")
    assert result.returncode == 0, result.stderr
    assert "path" in result.stdout and "resident" in result.stdout and "runner-up" in result.stdout


def test_a_model_no_record_covers_keeps_bf16_activations_for_speed_on_amx():
    """No edge-eval record covers this model; W4A8 is the fastest on AMX by the reference study, but its shipped
    records (the default model: mean KLD 0.39-0.40) are over --max-kld, so speed serves W4A16, says its quality is
    unmeasured, and W4A8's alternative says why."""
    result = edge_select("--device", str(DATA / "cpuinfo_spr_8480c.txt"), "--json", "--memory-budget", "16GiB",
                         "--model", str(DATA / "configs" / "llama-3.2-1b.json"))  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["path"] == "w4a16-tinygemm" and plan["quality"]["status"] == "unmeasured"
    w4a8 = next(alt for alt in plan["alternatives"] if alt["path"] == "w4a8-gptq")
    assert "on every model measured" in w4a8["why_not"]


def test_an_unmeasured_path_never_beats_a_measured_one_for_speed():
    """The default model's shipped records measure W4A16 within --max-kld and W4A8 (cpu_w4a8, which AMX hosts
    run too) above it, so although W4A8 is faster on AMX it ranks after, and its alternative says why."""
    result = edge_select("--device", str(DATA / "cpuinfo_spr_8480c.txt"), "--json", "--memory-budget", "16GiB")
    assert result.returncode == 0, result.stderr
    plan = Plan.model_validate_json(result.stdout)
    assert plan.path == "w4a16-tinygemm" and plan.quality.status == "measured"
    w4a8 = next(alt for alt in plan.alternatives if alt.path == "w4a8-gptq")
    assert w4a8.status == "runnable" and "measured mean KLD" in w4a8.why_not and "--max-kld" in w4a8.why_not


@pytest.mark.parametrize(
    ("args", "named"),
    [(["--memory-budget", "lots"], "--memory-budget"), (["--device", "/nonexistent"], "--device"),
     (["--model", "/nonexistent"], "model"), (["--max-model-len", "999999"], "max_model_len"),
     (["--path", "w4a8-gptq", "--device", str(DATA / "cpuinfo_host_epyc_avx2.txt")], "path"),
     (["--threads", "0"], "threads"), (["--threads", "2", "--serving-mode", "three-process"], "threads")],
)  # fmt: skip
def test_bad_input_exits_2_naming_the_field_without_a_traceback(args, named):
    result = edge_select(*args)
    assert result.returncode == 2
    assert named in result.stderr
    assert "Traceback" not in result.stderr


def test_a_gguf_file_is_planned_from_its_header_as_its_model_directory_is(tmp_path):
    """`--model X.gguf`: the plan for the default model's own GGUF is the plan for a directory of the same name
    holding the model's real config.json and a group-32 source record: the header gives the same shapes and grid."""
    from importlib import resources

    from kernels.source.default_model import source_gguf

    gguf = source_gguf()
    directory = tmp_path / gguf.stem
    directory.mkdir()
    config = resources.files("edge").joinpath("data/smollm2-135m-instruct.json").read_text()
    (directory / "config.json").write_text(config)
    (directory / "edge-source.json").write_text(json.dumps({"format": "gguf", "q4_group": 32}))
    from_file = edge_select("--model", str(gguf), "--json")
    from_directory = edge_select("--model", str(directory), "--json")
    assert from_file.returncode == 0, from_file.stderr
    plan, reference = Plan.model_validate_json(from_file.stdout), Plan.model_validate_json(from_directory.stdout)
    assert plan.model.model_copy(update={"source_types": None}) == reference.model and plan.model.source_grid == 32
    assert plan.model.source_types["q_proj"] == {"Q4_1": 30}  # what the file holds, which a directory cannot say
    assert (plan.path, plan.layout, plan.quantization_config) == (
        reference.path, reference.layout, reference.quantization_config)


def test_a_file_that_is_not_a_gguf_exits_2_naming_it(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00 truncated")
    result = edge_select("--model", str(bad))
    assert result.returncode == 2 and "broken.gguf" in result.stderr and "Traceback" not in result.stderr


def test_nothing_fits_exits_3_and_says_what_would(tmp_path):
    result = edge_select("--memory-budget", "8MiB")
    assert result.returncode == 3, result.stderr
    assert "DOES NOT FIT" in result.stdout and "to fit" in result.stdout


def test_default_path_imports_neither_torch_nor_vllm():
    code = (
        "import sys, io, contextlib\n"
        "from edge.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['--json'])\n"
        "print(sorted(m for m in ('torch', 'vllm', 'fastapi', 'kernels', 'server') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "device", [[], ["--device", str(DATA / "cpuinfo_host_epyc_avx2.txt")]], ids=["this-host", "zen3-avx2-cpuinfo"]
)
def test_a_quality_record_in_the_cache_reaches_the_plan(tmp_path, device):
    """edge-eval writes records under the cache's quality/ (kernels/evaluate/evaluate.py); edge-select reads them. A
    record over the floor moves the plan off the measured configuration: to another path or layout, or, on an AVX2 CPU,
    to another decode kernel (`avx2-w4a8` -> `avx2`), whichever this device's ranking offers next."""
    from edge.measure.quality import QualityRecord, quality_key

    plan = Plan.model_validate_json(edge_select("--json", *device).stdout)
    record = QualityRecord(
        model=plan.model.name, key=quality_key(plan.path, plan.quantization_config), kld_mean=0.25, kld_mean_se=0.01,
        top1_agreement=0.7, top1_agreement_se=0.01, ppl_ratio=1.3, ppl_ratio_se=0.01, confident_flip_rate=0.02,
        confident_flip_rate_se=0.002, tokens=16384,
    )
    quality = tmp_path / "cache" / "quality"
    quality.mkdir(parents=True)
    (quality / "one.json").write_text(json.dumps({"record": record.model_dump()}))
    (quality / "not-a-record.json").write_text("{}")
    measured = Plan.model_validate_json(
        edge_select("--json", "--max-kld", "0.5", "--path", plan.path, *device).stdout)
    assert measured.quality.status == "measured" and measured.quality.record.kld_mean == 0.25
    floored = Plan.model_validate_json(edge_select("--json", *device).stdout)  # 0.25 > the default floor of 0.08
    assert quality_key(floored.path, floored.quantization_config) != record.key
    assert floored.quality.record is None or floored.quality.record.kld_mean <= 0.08


@pytest.mark.slow  # a full calibration: 140 s on the Zen 5's 2 cores
def test_calibrate_then_plan_cites_this_hosts_own_kernel_times():
    """edge-select --calibrate times the kernels here (a minute of CPU), then ranks from them."""
    result = edge_select("--calibrate", "--json")
    assert result.returncode == 0, result.stderr
    plan = Plan.model_validate_json(result.stdout)
    assert plan.calibration is not None and plan.calibration.model == plan.model.name
    assert not any("extrapolated" in w for w in plan.warnings)
    assert any(r.source and r.source.startswith("calibration of this CPU") for r in plan.reasons)
    again = Plan.model_validate_json(edge_select("--json").stdout)  # the record stays in the cache
    assert again.calibration == plan.calibration
