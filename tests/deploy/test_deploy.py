"""The deploy files, checked here as far as this machine can: syntax, and that their parts fit each other."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from edge.device.describe import load_device, parse_size

DEPLOY = Path(__file__).parents[2] / "deploy"


def _daemonset() -> dict:
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "daemonset.yaml").read_text()))
    return next(d for d in docs if d["kind"] == "DaemonSet")


def test_the_daemonset_plans_from_the_file_its_init_container_writes():
    spec = _daemonset()["spec"]["template"]["spec"]
    node_labels = next(c for c in spec["initContainers"] if c["name"] == "node-labels")
    written = node_labels["args"][0].split(">")[-1].strip()
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


def _pod() -> dict:
    return _daemonset()["spec"]["template"]["spec"]


def test_no_container_of_the_daemonset_can_gain_privileges_or_write_its_image():
    pod = _pod()
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    for container in [*pod["initContainers"], *pod["containers"]]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]
        assert set(context["capabilities"].get("add", [])) <= {"CHOWN"}, container["name"]
    root = [c["name"] for c in pod["initContainers"] if c["securityContext"].get("runAsUser") == 0]
    assert root == ["cache-owner"] and pod["initContainers"][0]["command"][0] == "chown"


def test_only_the_init_container_that_reads_the_node_holds_a_service_account_token():
    def mounts_token(container: dict) -> bool:
        return any(m["name"] == "kube-api-access" for m in container.get("volumeMounts", []))

    pod = _pod()
    assert [c["name"] for c in [*pod["initContainers"], *pod["containers"]] if mounts_token(c)] == ["node-labels"]


def test_every_image_is_pinned_to_a_version():
    pod = _pod()
    for container in [*pod["initContainers"], *pod["containers"]]:
        name, _, tag = container["image"].rpartition(":")
        assert name and tag and tag != "latest", container["image"]


def test_the_server_has_a_startup_probe_so_liveness_waits_for_the_conversion():
    container = _pod()["containers"][0]
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/healthz"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800  # the systemd unit's TimeoutStartSec


def test_the_image_serves_as_the_user_the_daemonset_runs_as():
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users == ["10001:10001"]
    assert lines.index(next(line for line in lines if line.startswith("USER "))) < lines.index(
        next(line for line in lines if line.startswith("ENTRYPOINT"))
    )


def _unit() -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in (DEPLOY / "edge-select.service").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            keys.setdefault(key, []).append(value)
    return keys


def test_the_systemd_unit_runs_as_its_own_user_and_writes_only_its_own_directories():
    unit = _unit()
    assert unit["User"] == ["edge-select"] and unit["NoNewPrivileges"] == ["yes"]
    assert unit["ProtectSystem"] == ["strict"] and unit["PrivateTmp"] == ["yes"]
    assert unit["CapabilityBoundingSet"] == [""] and unit["AmbientCapabilities"] == [""]
    assert unit["ReadWritePaths"] == ["/var/cache/edge-select /var/lib/edge-select /run/edge-select"]
    assert unit["RuntimeDirectoryMode"] == ["0700"] and "EDGE_RUN_DIR=/run/edge-select" in unit["Environment"]


def test_the_systemd_units_exposure_is_ok(tmp_path):
    """systemd-analyze security rates the unit's sandboxing from 0 (locked down) to 10 (none); 'OK' is up to 4."""
    unit = (DEPLOY / "edge-select.service").read_text().replace("/opt/edge-select", str(DEPLOY.parent))
    path = tmp_path / "edge-select.service"
    path.write_text(unit)
    done = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    level = float(done.stdout.split("Overall exposure level for edge-select.service:")[1].split()[0])
    assert level <= 2.0, done.stdout[-2000:]
