"""One plan, whoever asks: on this host and the same model, edge-select, POST /plan, edge-serve's dry run and
edge-convert without --plan gather the same inputs (edge.plan.inputs) and give the same plan. The inputs are
what a box has: the quality records the package ships and a calibration record of this CPU in the cache. The host
is probed once for all four: its available memory moves between two probes, and the plan's budget with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from edge import cli as edge_select
from edge.device.probe import probe
from kernels.convert.convert import plan_for_this_host
from server import cli as edge_serve
from server.app import create_app
from server.settings import Settings
from tests.server.test_calibrations import cache, cache_record, host_record  # noqa: F401  (cache: a fixture)


@pytest.fixture
def one_probe(monkeypatch):
    """This host, probed once: every entry point's probe() returns it."""
    here = probe()
    monkeypatch.setattr("edge.device.probe.probe", lambda **_: here)
    monkeypatch.setattr(edge_serve, "probe", lambda **_: here)
    return here


def plans(model_dir: Path) -> dict[str, dict]:
    """The plan each entry point makes for this host and the model in model_dir, as JSON."""
    select = edge_select.plan_from_args(edge_select.build_parser().parse_args(["--model", str(model_dir)]))
    dry_run, _ = edge_serve.plan_for_serving(edge_serve.parser().parse_args(["--model", str(model_dir), "--dry-run"]))
    config = json.loads((model_dir / "config.json").read_text())
    from edge.device.probe import probe as probed  # the probe every entry point calls

    body = {"device": {"profile": json.loads(probed().model_dump_json())},
            "model": {"name": model_dir.name, "config": config}}  # fmt: skip
    with TestClient(create_app(Settings())) as client:
        response = client.post("/plan", json=body)
    assert response.status_code == 200, response.text
    return {
        "edge-select": json.loads(select.model_dump_json()),
        "POST /plan": response.json(),
        "edge-serve --dry-run": json.loads(dry_run.model_dump_json()),
        "edge-convert": json.loads(plan_for_this_host(model_dir).model_dump_json()),
    }


def test_every_entry_point_plans_this_host_alike(cache, one_probe, model_dir):  # noqa: F811
    record = host_record()
    cache_record(cache, record)
    made = plans(model_dir)
    assert made["edge-select"]["calibration"]["digest"] == record.digest  # the cached record was read
    differ = {name: sorted(k for k in plan if plan[k] != made["edge-select"][k]) for name, plan in made.items()}
    assert differ == dict.fromkeys(made, [])


def test_without_a_calibration_record_every_entry_point_plans_from_the_facts_table(cache, one_probe,  # noqa: F811
                                                                                   model_dir):
    made = plans(model_dir)
    assert made["edge-select"]["calibration"] is None
    assert all(plan == made["edge-select"] for plan in made.values())
