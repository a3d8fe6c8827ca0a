"""Fleet calibration records: POST/GET /calibrations on SQLite, /plan ranking from the record of the device's CPU,
and `edge-serve --report-to` posting this box's record to a real server on loopback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from edge.device.calibration import MAX_KERNELS, CalibrationRecord, KernelResult, KernelTime, record_path
from edge.device.cpuinfo import parse_cpuinfo
from edge.device.probe import probe
from edge.device.profile import DeviceProfile
from edge.model.reader import default_model
from server import cli
from server.app import create_app
from server.calibrations import KEEP_PER_KEY, CalibrationStore
from server.settings import Settings
from tests.server.conftest import uvicorn_on_loopback

DATA = Path(__file__).parents[1] / "edge" / "data"
ZEN5_CPUINFO = (DATA / "cpuinfo_epyc_zen5_avx512.txt").read_text()  # "AMD EPYC", AVX-512 with avx512_bf16
SPR_CPUINFO = (DATA / "cpuinfo_spr_8480c.txt").read_text()  # "Intel(R) Xeon(R) Platinum 8480C", AMX
AVX2_EPYC_CPUINFO = (DATA / "cpuinfo_host_epyc_avx2.txt").read_text()  # also "AMD EPYC", but AVX2 only
SMOLLM2 = default_model().name
# SmolLM2-135M's linear shapes (N, K): q/o 576x576, gate/up 1536x576, down 576x1536.
SHAPES = [(576, 576), (1536, 576), (576, 1536)]


def kernel_times(per_mac_ns: float) -> list[KernelTime]:
    """Decode (M=1) and prefill (M=512) times that grow with the shape, as measured times do."""
    return [KernelTime(n=n, k=k, m=m, ms=per_mac_ns * n * k * (1 if m == 1 else 40) / 1e6, calls=20)
            for n, k in SHAPES for m in (1, 512)]  # fmt: skip


def record_for(device: DeviceProfile, *, measured_at: str, isa_class: str, **fields) -> CalibrationRecord:
    """A calibration record as edge-calibrate writes it, taken on the CPU `device` describes."""
    values = dict(
        cpu_model=device.cpu_model.value, isa_flags=device.isa.value, isa_class=isa_class, cores=2, threads=2,
        torch_version="2.13.0+cpu", vllm_version="0.28.0", native_library="_C", torch_capability="AVX512",
        group_size=64, model=SMOLLM2, llc_bytes=32 << 20, read_bandwidth_gb_s=21.5,
        kernels=[KernelResult(kernel="bf16", status="ok", times=kernel_times(0.9)),
                 KernelResult(kernel="tinygemm", status="ok", times=kernel_times(0.35)),
                 KernelResult(kernel="dequant-bf16", status="ok", times=kernel_times(0.5)),
                 KernelResult(kernel="vllm-w4a8", status="absent", reason="_C registers no int4_scaled_mm_cpu")],
        measured_at=measured_at, duration_s=41.0,
    )  # fmt: skip
    values.update(fields)
    return CalibrationRecord(**values)


ZEN5 = record_for(parse_cpuinfo(ZEN5_CPUINFO), measured_at="2026-11-20T10:00:00+00:00", isa_class="avx512")
SPR = record_for(parse_cpuinfo(SPR_CPUINFO), measured_at="2026-11-21T09:30:00+00:00", isa_class="amx",
                 native_library="_C", torch_capability="AVX512")  # fmt: skip


def body(record: CalibrationRecord) -> dict:
    return json.loads(record.model_dump_json())


def cpuinfo_plan(client: TestClient, cpuinfo: str) -> dict:
    response = client.post("/plan", json={"device": {"cpuinfo": cpuinfo}})
    assert response.status_code == 200, response.text
    return response.json()


def names(record: CalibrationRecord) -> dict:
    """What a plan's `calibration` says about the record it ranked from."""
    return {"key": record.key, "digest": record.digest}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    """A cache directory of this test's own (the default SQLite store and edge-calibrate's records live there);
    the suite's measured tinygemm layout is copied in so that probing this host does not measure it again."""
    suite_cache = Path(os.environ.get("EDGE_SELECT_CACHE_DIR", Path.home() / ".cache" / "edge-select"))
    mine = tmp_path / "cache"
    mine.mkdir()
    if (suite_cache / "tinygemm_layout.json").is_file():
        shutil.copy(suite_cache / "tinygemm_layout.json", mine / "tinygemm_layout.json")
    monkeypatch.setenv("EDGE_SELECT_CACHE_DIR", str(mine))
    return mine


@pytest.fixture
def client(cache: Path) -> TestClient:
    with TestClient(create_app(Settings())) as client:
        yield client


def stored_digests(client: TestClient, **params) -> list[str]:
    response = client.get("/calibrations", params=params)
    assert response.status_code == 200, response.text
    return [summary["digest"] for summary in response.json()]


# --- the store ---------------------------------------------------------------------------------------------------


def test_the_default_store_is_sqlite_in_the_cache_directory_created_on_first_use(cache):
    with TestClient(create_app(Settings())) as client:
        assert not (cache / "calibrations.sqlite").exists()  # nothing needed it yet (server/store.py)
        assert client.get("/calibrations").json() == []
        assert (cache / "calibrations.sqlite").is_file()


def test_a_database_url_that_is_neither_postgresql_nor_sqlite_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="calibration_db"):
        CalibrationStore("mysql://fleet:secret@db/fleet")


def test_a_refused_database_url_does_not_echo_its_password():
    with pytest.raises(ValueError) as refused:
        CalibrationStore("mysql://fleet:secret@db/fleet")
    assert "secret" not in str(refused.value)


# --- POST /calibrations ------------------------------------------------------------------------------------------


def test_a_new_record_is_201_with_its_key_and_digest(client):
    response = client.post("/calibrations", json=body(ZEN5))
    assert response.status_code == 201
    assert response.json() == {"key": ZEN5.key, "digest": ZEN5.digest, "created": True}


def test_the_same_record_posted_again_is_200_and_stored_once(client):
    assert client.post("/calibrations", json=body(ZEN5)).status_code == 201
    again = client.post("/calibrations", json=body(ZEN5))
    assert again.status_code == 200
    assert again.json() == {"key": ZEN5.key, "digest": ZEN5.digest, "created": False}
    assert stored_digests(client) == [ZEN5.digest]


def test_a_record_with_zero_cores_is_422_naming_the_field_and_the_value(client):
    response = client.post("/calibrations", json={**body(ZEN5), "cores": 0})
    assert response.status_code == 422
    error = response.json()["detail"][0]
    assert error["loc"] == ["body", "cores"] and error["field"] == "calibration.cores"
    assert error["msg"].startswith("calibration.cores: expected") and error["msg"].endswith("got 0")


def test_a_record_with_an_unknown_isa_flag_is_422_naming_the_flag(client):
    response = client.post("/calibrations", json={**body(ZEN5), "isa_flags": ["avx2", "avx9000"]})
    assert response.status_code == 422
    error = response.json()["detail"][0]
    assert error["field"] == "calibration.isa_flags" and "avx9000" in error["msg"]


def test_a_kernel_result_with_an_unknown_status_is_422_located_inside_the_list(client):
    kernels = [{"kernel": "tinygemm", "status": "fast"}]
    response = client.post("/calibrations", json={**body(ZEN5), "kernels": kernels})
    assert response.status_code == 422
    error = response.json()["detail"][0]
    assert error["loc"] == ["body", "kernels", 0, "status"] and "'fast'" in error["msg"]


def test_a_malformed_record_is_not_stored(client):
    client.post("/calibrations", json={**body(ZEN5), "cores": 0})
    assert stored_digests(client) == []


@pytest.fixture
def guarded(cache: Path) -> TestClient:
    with TestClient(create_app(Settings(api_token="s3cret"))) as client:
        yield client


def test_posting_a_record_needs_the_token_when_one_is_configured(guarded):
    assert guarded.post("/calibrations", json=body(ZEN5)).status_code == 401
    wrong = guarded.post("/calibrations", json=body(ZEN5), headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    right = guarded.post("/calibrations", json=body(ZEN5), headers={"Authorization": "Bearer s3cret"})
    assert right.status_code == 201


def test_listing_records_needs_the_token_when_one_is_configured(guarded):
    assert guarded.get("/calibrations").status_code == 401
    assert guarded.get("/calibrations", headers={"Authorization": "Bearer s3cret"}).status_code == 200


# --- GET /calibrations -------------------------------------------------------------------------------------------


def test_the_list_summarizes_every_record_newest_measurement_first(client):
    client.post("/calibrations", json=body(ZEN5))
    client.post("/calibrations", json=body(SPR))
    summaries = client.get("/calibrations").json()
    assert [s["digest"] for s in summaries] == [SPR.digest, ZEN5.digest]
    spr = summaries[0]
    assert {k: spr[k] for k in ("key", "cpu_model", "isa_flags", "model", "measured_at")} == {
        "key": SPR.key, "cpu_model": "Intel(R) Xeon(R) Platinum 8480C", "isa_flags": SPR.isa_flags,
        "model": SMOLLM2, "measured_at": SPR.measured_at,
    }  # fmt: skip
    assert "kernels" not in spr and spr["received_at"]


def test_the_list_filters_by_cpu_model(client):
    client.post("/calibrations", json=body(ZEN5))
    client.post("/calibrations", json=body(SPR))
    assert stored_digests(client, cpu_model="AMD EPYC") == [ZEN5.digest]
    assert stored_digests(client, cpu_model="Intel(R) Xeon(R) Platinum 8480C") == [SPR.digest]
    assert stored_digests(client, cpu_model="Ampere Altra") == []


def test_both_endpoints_are_in_the_openapi_schema(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert set(paths["/calibrations"]) == {"get", "post"}
    assert {"200", "201", "422"} <= set(paths["/calibrations"]["post"]["responses"])


# --- plans rank from the record of the device's CPU --------------------------------------------------------------


def test_a_plan_for_a_device_of_the_recorded_cpu_names_the_posted_record(client):
    client.post("/calibrations", json=body(ZEN5))
    assert cpuinfo_plan(client, ZEN5_CPUINFO)["calibration"] == {
        **names(ZEN5), "cpu_model": "AMD EPYC", "measured_at": ZEN5.measured_at, "model": SMOLLM2, "threads": 2,
    }  # fmt: skip


def test_a_plan_for_another_cpu_keeps_the_facts_tables_answer(client):
    client.post("/calibrations", json=body(ZEN5))
    assert cpuinfo_plan(client, SPR_CPUINFO)["calibration"] is None


def test_the_same_cpu_model_string_with_other_isa_flags_is_another_cpu(client):
    client.post("/calibrations", json=body(ZEN5))  # "AMD EPYC" with AVX-512; the AVX2 EPYC is not that CPU
    assert cpuinfo_plan(client, AVX2_EPYC_CPUINFO)["calibration"] is None


def test_a_plan_before_any_record_is_posted_has_no_calibration(client):
    assert cpuinfo_plan(client, ZEN5_CPUINFO)["calibration"] is None


def test_a_batch_plans_each_device_from_its_own_cpus_record(client):
    client.post("/calibrations", json=body(ZEN5))
    client.post("/calibrations", json=body(SPR))
    devices = [{"cpuinfo": ZEN5_CPUINFO}, {"cpuinfo": AVX2_EPYC_CPUINFO}, {"cpuinfo": SPR_CPUINFO}]
    results = client.post("/plan/batch", json={"devices": devices}).json()["results"]
    calibrations = [item["plan"]["calibration"] for item in results]
    assert [c and c["digest"] for c in calibrations] == [ZEN5.digest, None, SPR.digest]


def test_a_batch_keeps_a_bad_devices_error_in_its_place(client):
    client.post("/calibrations", json=body(ZEN5))
    devices = [{"cpuinfo": "no cpu here"}, {"cpuinfo": ZEN5_CPUINFO}]
    response = client.post("/plan/batch", json={"devices": devices}).json()
    assert [item["index"] for item in response["results"]] == [0, 1]
    assert response["results"][0]["error"]["field"] == "cpuinfo" and response["failed"] == 1
    assert response["results"][1]["plan"]["calibration"]["digest"] == ZEN5.digest


def test_the_newer_of_two_records_of_one_cpu_is_used(client):
    newer = ZEN5.model_copy(update={"measured_at": "2026-11-28T08:00:00+00:00"})
    client.post("/calibrations", json=body(newer))
    client.post("/calibrations", json=body(ZEN5))
    assert cpuinfo_plan(client, ZEN5_CPUINFO)["calibration"]["digest"] == newer.digest


def test_a_record_this_host_cached_is_used_without_being_posted(client, cache):
    path = record_path(ZEN5, cache / "calibration")
    path.parent.mkdir(parents=True)
    path.write_text(ZEN5.model_dump_json())
    assert cpuinfo_plan(client, ZEN5_CPUINFO)["calibration"]["digest"] == ZEN5.digest


def host_record(**fields) -> CalibrationRecord:
    """A record of this host's own CPU (as edge-calibrate would write here), for GET /plan and --report-to."""
    here = probe()
    assert here.cpu_model.value, "the probe names this host's CPU model"
    runtime = here.runtime
    # Every runtime fact the probe states, so the record matches this host whatever torch dispatches to here
    # (AVX2 on a Zen 3, AVX512 on a Zen 5; edge.device.calibration.matches compares each one the device states).
    values = dict(measured_at="2026-11-29T12:00:00+00:00", torch_version=runtime.torch_version.value,
                  vllm_version=runtime.vllm_version.value, native_library=runtime.vllm_native_library.value,
                  torch_capability=runtime.torch_cpu_capability.value)
    return record_for(here, isa_class=here.isa_class, **{**values, **fields})  # fmt: skip


def test_get_plan_for_this_host_ranks_from_a_stored_record_of_its_cpu(client):
    record = host_record()
    client.post("/calibrations", json=body(record))
    assert client.get("/plan").json()["calibration"]["digest"] == record.digest


# --- edge-serve --report-to --------------------------------------------------------------------------------------


def cache_record(cache: Path, record: CalibrationRecord) -> Path:
    path = record_path(record, cache / "calibration")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(record.model_dump_json())
    return path


@pytest.fixture
def served(monkeypatch) -> dict:
    """edge-serve's planner, not served: main() returns once it would start serving."""
    seen: dict = {}
    monkeypatch.setattr(cli, "serve_app", lambda settings, app: seen.update(app=app))
    return seen


@pytest.fixture
def fleet(tmp_path: Path) -> str:
    """A fleet planner on loopback (real uvicorn, its own SQLite store, a token); yields its URL."""
    settings = Settings(api_token="fleet-token", calibration_db=f"sqlite:///{tmp_path / 'fleet.sqlite'}")
    with uvicorn_on_loopback(create_app(settings)) as url:
        yield url


def fleet_digests(url: str) -> list[str]:
    response = httpx.get(f"{url}/calibrations", headers={"Authorization": "Bearer fleet-token"})
    assert response.status_code == 200, response.text
    return [summary["digest"] for summary in response.json()]


def report(url: str, *flags: str) -> int:
    return cli.main(["--plan-only", "--report-to", url, *flags])


def test_report_to_posts_this_hosts_cached_record_then_serves(cache, served, fleet, capsys):
    record = host_record()
    cache_record(cache, record)
    assert report(fleet, "--report-token", "fleet-token") == 0
    out = capsys.readouterr().out
    assert f"calibration {record.digest} ({record.cpu_model}, 2026-11-29) reported to {fleet}/calibrations: " \
           "stored (201)" in out  # fmt: skip
    assert fleet_digests(fleet) == [record.digest]
    assert "app" in served


def test_reporting_again_says_the_record_was_already_stored(cache, served, fleet, capsys):
    cache_record(cache, host_record())
    report(fleet, "--report-token", "fleet-token")
    report(fleet, "--report-token", "fleet-token")
    assert capsys.readouterr().out.count("already stored (200)") == 1
    assert len(fleet_digests(fleet)) == 1


def test_the_report_token_comes_from_edge_report_token_when_not_given(cache, served, fleet, capsys, monkeypatch):
    cache_record(cache, host_record())
    monkeypatch.setenv("EDGE_REPORT_TOKEN", "fleet-token")
    assert report(fleet) == 0
    assert "stored (201)" in capsys.readouterr().out


def test_a_refused_token_is_a_warning_and_the_box_still_serves(cache, served, fleet, capsys):
    cache_record(cache, host_record())
    assert report(fleet, "--report-token", "wrong") == 0
    err = capsys.readouterr().err
    assert err.startswith("edge-serve: warning: calibration ") and "not reported" in err and "401" in err
    assert "app" in served and fleet_digests(fleet) == []


def test_an_unreachable_fleet_planner_is_a_warning_and_the_box_still_serves(cache, served, capsys):
    cache_record(cache, host_record())
    closed = f"http://127.0.0.1:{cli.free_loopback_port()}"
    assert report(closed) == 0
    err = capsys.readouterr().err
    assert "edge-serve: warning:" in err and f"not reported to {closed}/calibrations: ConnectError" in err
    assert "app" in served


def stand_in_calibrator(record: CalibrationRecord, tmp_path: Path, *, prints: bool = True) -> list[str]:
    """Instead of `python -m kernels.calibrate.calibrate --json`: caches the record (and prints it, as --json does)."""
    source = tmp_path / "measured.json"
    source.write_text(record.model_dump_json())
    script = ("import os, pathlib, shutil, sys; from edge.device.calibration import load_file, record_path;"
              "r = load_file(pathlib.Path(sys.argv[1])); p = record_path(r); p.parent.mkdir(parents=True, "
              "exist_ok=True); shutil.copy(sys.argv[1], p); print('timing kernels...', file=sys.stderr);"
              + ("print(r.model_dump_json())" if prints else "print('done')"))  # fmt: skip
    return [sys.executable, "-c", script, str(source)]


def test_a_host_without_a_record_is_calibrated_before_reporting(cache, served, fleet, capsys, monkeypatch, tmp_path):
    record = host_record()
    monkeypatch.setattr(cli, "calibrator", lambda: stand_in_calibrator(record, tmp_path))
    assert report(fleet, "--report-token", "fleet-token") == 0
    assert "calibrating this host" in capsys.readouterr().out
    assert fleet_digests(fleet) == [record.digest]


def test_calibrate_measures_afresh_even_with_a_cached_record(cache, served, fleet, monkeypatch, tmp_path):
    cache_record(cache, host_record())
    fresh = host_record(measured_at="2026-11-30T07:00:00+00:00", threads=1)
    monkeypatch.setattr(cli, "calibrator", lambda: stand_in_calibrator(fresh, tmp_path))
    assert report(fleet, "--report-token", "fleet-token", "--calibrate") == 0
    assert fleet_digests(fleet) == [fresh.digest]


def test_a_calibrator_that_only_caches_its_record_is_read_from_the_cache(cache, monkeypatch, tmp_path):
    record = host_record()
    assert cli.calibrate_here(stand_in_calibrator(record, tmp_path, prints=False)) == record


def test_a_failed_calibration_is_a_warning_and_nothing_is_reported(cache, served, fleet, capsys, monkeypatch):
    monkeypatch.setattr(cli, "calibrator", lambda: [sys.executable, "-c", "raise SystemExit(3)"])
    assert report(fleet, "--report-token", "fleet-token") == 0
    err = capsys.readouterr().err
    assert "edge-serve: warning: no calibration record for this host" in err and "exited 3" in err
    assert "app" in served and fleet_digests(fleet) == []


def test_a_bad_calibration_db_url_exits_2_naming_the_setting(cache, served, capsys):
    assert cli.main(["--plan-only", "--calibration-db", "mysql://fleet@db/fleet"]) == 2
    assert "calibration_db" in capsys.readouterr().err and "app" not in served


def test_calibration_db_is_the_store_the_served_app_uses(cache, served, tmp_path):
    url = f"sqlite:///{tmp_path / 'chosen.sqlite'}"
    assert cli.main(["--plan-only", "--calibration-db", url]) == 0
    assert served["app"].state.calibrations.describe() == url


def test_a_posted_record_changes_the_answer_for_its_cpu_and_only_for_its_cpu(client):
    """A Zen 5 whose record has tinygemm and its dequantize path 5x slower than bf16: that CPU gets bf16, where the
    facts table gives it w4a16; the AVX2 EPYC (same model string, other flags) keeps the table's answer."""
    before = cpuinfo_plan(client, ZEN5_CPUINFO)
    avx2_before = cpuinfo_plan(client, AVX2_EPYC_CPUINFO)
    assert before["path"] == "w4a16-tinygemm"
    slow_int4 = ZEN5.model_copy(update={"kernels": [
        KernelResult(kernel="bf16", status="ok", times=kernel_times(0.2)),
        KernelResult(kernel="tinygemm", status="ok", times=kernel_times(1.0)),
        KernelResult(kernel="dequant-bf16", status="ok", times=kernel_times(1.0)),
        KernelResult(kernel="dequant-fp32", status="ok", times=kernel_times(2.0)),
        KernelResult(kernel="int8", status="ok", times=kernel_times(1.0)),
        KernelResult(kernel="vllm-w4a8", status="absent", reason="test record: not timed"),
    ]})  # fmt: skip
    assert client.post("/calibrations", json=body(slow_int4)).status_code == 201
    after = cpuinfo_plan(client, ZEN5_CPUINFO)
    assert after["path"] == "bf16" and after["calibration"]["digest"] == slow_int4.digest
    avx2_after = cpuinfo_plan(client, AVX2_EPYC_CPUINFO)
    assert (avx2_after["path"], avx2_after["layout"], avx2_after["calibration"]) == (
        avx2_before["path"], avx2_before["layout"], None)


# --- records you can trust: real timestamps, bounded size, attributed, capped per key, paged, removable --------


def with_token_role(app, role: str):
    """The app behind a stand-in for the bearer-token middleware that names the token's role in the scope's state."""

    async def tagged(scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})["token_role"] = role
        await app(scope, receive, send)

    return tagged


@pytest.fixture
def reporter(cache: Path) -> TestClient:
    """Requests made with the report token (what boxes post with), to an app whose store is `cache`'s."""
    with TestClient(with_token_role(create_app(Settings()), "report")) as client:
        yield client


def post_raw(client: TestClient, body: dict):
    return client.post("/calibrations", content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def refused_field(response) -> tuple[list, str]:
    assert response.status_code == 422, response.text
    error = response.json()["detail"][0]
    return error["loc"], error["field"]


@pytest.mark.parametrize("measured_at", ["9999", "9999-12-31T00:00:00+00:00", "yesterday", ""])
def test_a_forged_or_future_dated_record_is_422_naming_measured_at(client, measured_at):
    response = client.post("/calibrations", json={**body(ZEN5), "measured_at": measured_at})
    assert refused_field(response) == (["body", "measured_at"], "calibration.measured_at")
    assert stored_digests(client) == []


def test_a_record_within_ten_minutes_of_clock_skew_is_stored(client):
    soon = (datetime.now(UTC) + timedelta(minutes=5)).isoformat(timespec="seconds")
    assert client.post("/calibrations", json={**body(ZEN5), "measured_at": soon}).status_code == 201


def test_a_record_of_more_kernels_than_the_cap_is_422_naming_kernels(client):
    kernels = [body(ZEN5)["kernels"][0]] * (MAX_KERNELS + 1)
    assert refused_field(client.post("/calibrations", json={**body(ZEN5), "kernels": kernels}))[1] == \
        "calibration.kernels"  # fmt: skip


def test_a_kernel_with_more_times_than_the_cap_is_422_naming_its_times(client):
    kernels = [{"kernel": "tinygemm", "status": "ok", "times": [{"n": 16, "k": 32, "m": 1, "ms": 0.1}] * 4097}]
    loc, field = refused_field(client.post("/calibrations", json={**body(ZEN5), "kernels": kernels}))
    assert loc == ["body", "kernels", 0, "times"] and field == "calibration.kernels.0.times"


def test_a_cpu_model_of_a_thousand_characters_is_422_naming_it(client):
    response = client.post("/calibrations", json={**body(ZEN5), "cpu_model": "A" * 1000})
    assert refused_field(response) == (["body", "cpu_model"], "calibration.cpu_model")


@pytest.mark.parametrize("ms", [float("nan"), float("inf"), 1e400], ids=["nan", "inf", "1e400"])
def test_a_kernel_time_that_is_not_finite_is_422_naming_it(client, ms):
    record = body(ZEN5)
    record["kernels"][0]["times"][0]["ms"] = ms
    assert refused_field(post_raw(client, record)) == (["body", "kernels", 0, "times", 0, "ms"],
                                                       "calibration.kernels.0.times.0.ms")  # fmt: skip


def test_a_record_names_the_api_token_as_its_poster_when_the_middleware_names_none(client):
    client.post("/calibrations", json=body(ZEN5))
    assert [s["posted_by"] for s in client.get("/calibrations").json()] == ["api"]


def test_a_record_posted_with_the_report_token_says_so(reporter):
    assert reporter.post("/calibrations", json=body(ZEN5)).status_code == 201
    assert [s["posted_by"] for s in reporter.get("/calibrations").json()] == ["report"]


def test_the_api_token_removes_a_record_by_its_digest(client):
    client.post("/calibrations", json=body(ZEN5))
    client.post("/calibrations", json=body(SPR))
    assert client.delete(f"/calibrations/{ZEN5.digest}").status_code == 204
    assert stored_digests(client) == [SPR.digest]
    assert cpuinfo_plan(client, ZEN5_CPUINFO)["calibration"] is None


def test_the_report_token_cannot_remove_a_record(reporter):
    reporter.post("/calibrations", json=body(ZEN5))
    response = reporter.delete(f"/calibrations/{ZEN5.digest}")
    assert response.status_code == 403 and "API token" in response.json()["detail"]
    assert stored_digests(reporter) == [ZEN5.digest]


def test_removing_a_record_that_is_not_stored_is_404(client):
    assert client.delete(f"/calibrations/{ZEN5.digest}").status_code == 404


def test_removing_by_something_that_is_no_digest_is_422(client):
    assert client.delete("/calibrations/not-a-digest").status_code == 422


def dated(record: CalibrationRecord, day: int) -> CalibrationRecord:
    return record.model_copy(update={"measured_at": f"2026-11-{day:02d}T10:00:00+00:00"})


def test_only_the_newest_records_of_a_key_are_kept(client):
    records = [dated(ZEN5, day) for day in range(1, KEEP_PER_KEY + 3)]
    for record in records:
        assert client.post("/calibrations", json=body(record)).status_code == 201
    newest = sorted(records, key=lambda r: r.measured_at, reverse=True)[:KEEP_PER_KEY]
    assert stored_digests(client) == [r.digest for r in newest]


def test_a_record_older_than_the_newest_its_key_keeps_is_not_kept(client):
    for day in range(10, 10 + KEEP_PER_KEY):
        client.post("/calibrations", json=body(dated(ZEN5, day)))
    old = dated(ZEN5, 1)
    response = client.post("/calibrations", json=body(old))
    assert response.status_code == 200 and response.json()["created"] is False
    assert old.digest not in stored_digests(client)


def test_the_cap_is_per_key_so_another_cpus_records_stay(client):
    client.post("/calibrations", json=body(SPR))
    for day in range(1, KEEP_PER_KEY + 3):
        client.post("/calibrations", json=body(dated(ZEN5, day)))
    assert SPR.digest in stored_digests(client)


def test_the_list_pages_with_limit_and_offset(client):
    records = [dated(ZEN5, day) for day in range(1, 6)]
    for record in records:
        client.post("/calibrations", json=body(record))
    everything = stored_digests(client)
    assert stored_digests(client, limit=2) == everything[:2]
    assert stored_digests(client, limit=2, offset=2) == everything[2:4]
    assert stored_digests(client, offset=5) == []


@pytest.mark.parametrize("params", [{"limit": 1001}, {"limit": 0}, {"offset": -1}])
def test_a_page_past_the_limits_is_422(client, params):
    assert client.get("/calibrations", params=params).status_code == 422


OLD_TABLE = ("CREATE TABLE calibrations (digest VARCHAR(64) PRIMARY KEY, key VARCHAR(64) NOT NULL, cpu_model TEXT "
             "NOT NULL, isa_flags JSON NOT NULL, model TEXT, measured_at VARCHAR(64) NOT NULL, received_at DATETIME "
             "NOT NULL, record TEXT NOT NULL)")  # fmt: skip


def test_a_store_created_before_records_named_their_poster_gains_the_column(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    engine = sa.create_engine(url)
    with engine.begin() as connection:  # the table as it was: no posted_by
        connection.execute(sa.text(OLD_TABLE))
        connection.execute(sa.text("INSERT INTO calibrations VALUES (:digest, :key, 'Intel(R) Xeon(R) Platinum "
                                   "8480C', '[]', NULL, :at, '2026-11-21 09:30:00', :record)"),  # fmt: skip
                           {"digest": SPR.digest, "key": SPR.key, "at": SPR.measured_at,
                            "record": SPR.model_dump_json()})  # fmt: skip
    engine.dispose()
    store = CalibrationStore(url)
    assert store.add(ZEN5, posted_by="report") is True
    assert {s.digest: s.posted_by for s in store.summaries()} == {ZEN5.digest: "report", SPR.digest: None}
    store.close()


def test_sqlalchemy_is_imported_only_when_the_store_is_first_used(tmp_path):
    """An edge box's wrapper that never serves /calibrations or /plan does without SQLAlchemy (server/store.py):
    edge-serve's CLI and the app import nothing of it until a request needs the store."""
    code = (
        "import sys\n"
        "from fastapi.testclient import TestClient\n"
        "import server.cli\n"
        "from server.app import create_app\n"
        "from server.settings import Settings\n"
        "with TestClient(create_app(Settings())) as client:\n"
        "    healthy = client.get('/healthz').status_code\n"
        "    before = 'sqlalchemy' in sys.modules\n"
        "    listed = client.get('/calibrations').status_code\n"
        "    print(healthy, before, listed, 'sqlalchemy' in sys.modules)\n"
    )
    env = {**os.environ, "EDGE_SELECT_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          cwd=Path(__file__).parents[2], check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["200", "False", "200", "True"]
