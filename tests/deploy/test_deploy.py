"""The deploy files, checked here as far as this machine can: syntax, and that their parts fit each other."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from edge.describe import load_device, parse_size

DEPLOY = Path(__file__).parents[2] / "deploy"


def _daemonset() -> dict:
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "daemonset.yaml").read_text()))
    return next(d for d in docs if d["kind"] == "DaemonSet")


def test_the_daemonset_plans_from_the_file_its_init_container_writes():
    spec = _daemonset()["spec"]["template"]["spec"]
    written = spec["initContainers"][0]["args"][0].split(">")[-1].strip()
    args = spec["containers"][0]["args"]
    assert args[args.index("--device") + 1] == written


def test_the_node_description_the_init_container_writes_is_read_as_nfd_labels():
    """kubectl's jsonpath prints the label and capacity maps as JSON; the planner reads that shape."""
    node = {
        "labels": {"kubernetes.io/arch": "amd64", "feature.node.kubernetes.io/cpu-cpuid.AVX2": "true",
                   "feature.node.kubernetes.io/cpu-cpuid.AMXTILE": "true",
                   "feature.node.kubernetes.io/cpu-cpuid.AMXBF16": "true"},
        "capacity": {"cpu": "16", "memory": "65536Mi"},
    }  # fmt: skip
    device = load_device(json.dumps(node))
    assert device.described_by == "nfd" and device.has_amx
    assert device.memory_total_bytes.value == 65536 * 2**20


def test_the_memory_limit_the_downward_api_passes_is_a_valid_budget():
    assert parse_size("8589934592", "--memory-budget") == 8 * 2**30


def test_the_systemd_unit_verifies(tmp_path):
    unit = (DEPLOY / "edge-select.service").read_text().replace("/opt/edge-select", str(DEPLOY.parent))
    path = tmp_path / "edge-select.service"
    path.write_text(unit)
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert result.returncode == 0 and "edge-select.service" not in result.stderr, result.stderr


def test_edge_up_is_valid_bash():
    subprocess.run(["bash", "-n", str(DEPLOY / "edge-up")], check=True)


def _entrypoint() -> list[str]:
    line = next(line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("ENTRYPOINT"))
    return json.loads(line.removeprefix("ENTRYPOINT"))


def test_the_image_refuses_to_serve_on_0_0_0_0_without_a_token(monkeypatch, capsys):
    """What the image's entrypoint runs (edge-up's edge-serve, with its flags), refused before anything is planned
    or served when the container has no EDGE_API_TOKEN."""
    from server import cli

    entrypoint = _entrypoint()
    assert entrypoint[0].endswith("/deploy/edge-up") and entrypoint[entrypoint.index("--host") + 1] == "0.0.0.0"
    monkeypatch.delenv("EDGE_API_TOKEN", raising=False)
    monkeypatch.setattr(cli, "prepare", lambda *a, **k: pytest.fail("refused before the model is read"))
    assert cli.main(["--priority", "speed", *entrypoint[1:]]) == 2
    assert "'0.0.0.0' (EDGE_HOST) is not a loopback address and EDGE_API_TOKEN is not set" in capsys.readouterr().err


def test_the_daemonset_takes_its_tokens_from_a_secret():
    env = {item["name"]: item for item in _daemonset()["spec"]["template"]["spec"]["containers"][0]["env"]}
    api = env["EDGE_API_TOKEN"]["valueFrom"]["secretKeyRef"]
    report = env["EDGE_REPORT_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert api["name"] == report["name"] and api["key"] != report["key"]
    assert not api.get("optional") and "value" not in env["EDGE_API_TOKEN"]
