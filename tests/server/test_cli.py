"""edge-serve's steps before serving: find the model, plan, convert when needed, print what it chose."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from edge.errors import InputError
from server import cli

# A stand-in for edge-convert: records what it was given, as edge-convert's caller sees it.
FAKE_CONVERTER = """
import json, pathlib, sys
src, dst, flag, plan = sys.argv[1:5]
out = pathlib.Path(dst); out.mkdir(parents=True, exist_ok=True)
(out / "seen.json").write_text(json.dumps({"src": src, "flag": flag, "plan": json.loads(open(plan).read())}))
"""


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("EDGE_SELECT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def args(*argv: str):
    return cli.parser().parse_args(list(argv))


def test_converted_dir_is_keyed_by_model_and_quantization_config(cache):
    a = cli.converted_dir(Path("/m/SmolLM2"), {"bits": 4, "group_size": 64})
    assert a == cli.converted_dir(Path("/m/SmolLM2"), {"group_size": 64, "bits": 4})
    assert a != cli.converted_dir(Path("/m/SmolLM2"), {"bits": 4, "group_size": 32})
    assert a.parent == cache / "converted" and a.name.startswith("SmolLM2-")


def test_default_model_dir_is_the_last_line_edge_model_prints():
    command = [sys.executable, "-c", "print('building...'); print('/cache/models/SmolLM2-bf16')"]
    assert cli.default_model_dir(command) == Path("/cache/models/SmolLM2-bf16")


def test_failing_edge_model_is_an_input_error():
    with pytest.raises(InputError, match="edge-model default"):
        cli.default_model_dir([sys.executable, "-c", "raise SystemExit(1)"])


def test_bf16_plan_serves_the_model_directory_unconverted(model_dir):
    prepared = cli.prepare(args("--model", str(model_dir), "--path", "bf16"))
    assert prepared.plan.path == "bf16" and prepared.serve_dir == model_dir


def test_quantized_plan_is_converted_by_edge_convert_with_the_plan(model_dir, cache):
    converter = [sys.executable, "-c", FAKE_CONVERTER]
    prepared = cli.prepare(args("--model", str(model_dir), "--path", "w4a16-tinygemm"), converter=converter)
    seen = json.loads((prepared.serve_dir / "seen.json").read_text())
    assert prepared.serve_dir == cli.converted_dir(model_dir, prepared.plan.quantization_config)
    assert seen["src"] == str(model_dir) and seen["flag"] == "--plan"
    assert seen["plan"] == json.loads(prepared.plan.model_dump_json())
    assert list((cache / "converted").glob("*.plan.json")) == []  # the plan file is not left behind


def test_failed_conversion_is_an_input_error(model_dir):
    converter = [sys.executable, "-c", "raise SystemExit(2)"]
    with pytest.raises(InputError, match="exit 2"):
        cli.prepare(args("--model", str(model_dir), "--path", "w4a16-tinygemm"), converter=converter)


def test_dry_run_prints_path_reasons_and_url(model_dir, capsys):
    assert cli.main(["--model", str(model_dir), "--path", "bf16", "--port", "8099", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "path      bf16" in out and "http://127.0.0.1:8099/v1" in out
    assert out.count("why       ") >= 1


def test_unreadable_memory_budget_exits_2_naming_the_flag(model_dir, capsys):
    assert cli.main(["--model", str(model_dir), "--memory-budget", "lots", "--dry-run"]) == 2
    assert "--memory-budget" in capsys.readouterr().err


def test_plan_over_its_memory_budget_is_refused_before_serving(model_dir, capsys):
    assert cli.main(["--model", str(model_dir), "--path", "bf16", "--memory-budget", "64MiB"]) == 2
    assert "over the memory budget" in capsys.readouterr().err


def test_a_described_device_is_planned_for_instead_of_this_host(model_dir):
    """The DaemonSet passes its node's NFD labels: an AMX node is planned as one, whatever host runs the test."""
    labels = Path(__file__).parents[1] / "edge" / "data" / "nfd_spr_node.json"
    prepared = cli.prepare(args("--model", str(model_dir), "--device", str(labels), "--path", "bf16"))
    assert prepared.plan.device.described_by == "nfd"
    assert prepared.plan.device.has_amx


def test_a_described_device_whose_tinygemm_block_differs_from_this_hosts_is_refused_before_serving(
    model_dir, tmp_path, capsys
):
    """An AVX2 description served on an AVX-512 host (or the reverse) would load a checkpoint the engine must
    refuse, in a restart loop; edge-serve exits 2 first, naming both blocks."""
    from edge.device.probe import probe

    here = probe().runtime.tinygemm_block.value
    other = {32: 64, 64: 32}[here]
    isa = ["avx2", "fma"] + (["avx512f", "avx512bw"] if other == 64 else [])
    device = tmp_path / "device.json"
    device.write_text(json.dumps({"arch": "x86_64", "isa": isa, "memory": "16GiB"}))
    argv = ["--model", str(model_dir), "--device", str(device), "--path", "w4a16-tinygemm", "--dry-run"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"blocks of {other} channels" in err and f"packs {here}" in err


def test_plan_only_serves_the_planner_without_a_model_or_engine(monkeypatch):
    served = {}
    monkeypatch.setattr(cli, "serve_app", lambda settings, app: served.update(app=app))
    monkeypatch.setattr(cli, "prepare", lambda *a, **k: pytest.fail("plan-only must not read or convert a model"))
    assert cli.main(["--plan-only", "--port", "8098"]) == 0
    paths = {route.path for route in served["app"].routes}
    assert {"/plan", "/plan/batch", "/probe", "/status"} <= paths


def test_uvicorn_serves_with_a_bound_on_concurrent_connections_and_keep_alive(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli.uvicorn, "run", lambda app, **kwargs: seen.update(kwargs))
    cli.serve_app(cli.Settings(limit_concurrency=7, timeout_keep_alive_s=3), object())
    assert seen["limit_concurrency"] == 7 and seen["timeout_keep_alive"] == 3


def test_the_planning_heap_is_given_back_where_glibc_can():
    import platform

    assert cli.release_planning_heap() is (platform.libc_ver()[0] == "glibc")
