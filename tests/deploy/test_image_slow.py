"""deploy/Dockerfile, built for real and run: it serves a completion.

No container registry is reachable from these machines, so the base image is a Debian bookworm (python3 3.11,
the project's requires-python) that debootstrap makes from Debian's package mirror; buildah (vfs storage, chroot
isolation: no daemon, no user namespaces) builds the Dockerfile on it and runs the image's own entrypoint. Where
pip's configuration on this machine offers the CPU torch wheel from a local folder (PyTorch's CPU index may be
unreachable), that folder is handed to the build as a read-only volume and PIP_FIND_LINKS build argument, and
the CA bundle pip trusts here (a TLS-intercepting egress) as PIP_CERT, as the Dockerfile documents.
scripts/setup installs buildah and debootstrap on Debian as root.

The base's tarball and buildah's storage stay in the cache directory, so a second run skips the bootstrap; the
image itself is built anew on every run and removed afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
SUITE = "bookworm"
BASE_IMAGE = f"localhost/edge-debian:{SUITE}"
IMAGE = "localhost/edge-select:test"
STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
READY_TIMEOUT_S = 1200  # first start in the image: probe, calibrate, plan, convert, vLLM's compile warm-up, 2 cores

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (shutil.which("buildah") and shutil.which("debootstrap") and os.geteuid() == 0),
        reason="needs root with buildah and debootstrap (scripts/setup installs them on Debian)",
    ),
]


def _cache() -> Path:
    path = Path(os.environ.get("EDGE_SELECT_CACHE_DIR", Path.home() / ".cache" / "edge-select")) / "image"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _buildah(*args: str, **kwargs) -> subprocess.CompletedProcess:
    storage = _cache() / "storage"
    command = ["buildah", "--root", str(storage / "root"), "--runroot", str(storage / "run"),
               "--storage-driver", "vfs", *args]  # fmt: skip
    return subprocess.run(
        command, check=kwargs.pop("check", True), text=True, capture_output=kwargs.pop("capture", True), **kwargs
    )


def _debian_base() -> str:
    """A minimal Debian made by debootstrap, imported into buildah's storage as BASE_IMAGE (once)."""
    tarball = _cache() / f"debian-{SUITE}-minbase.tar"
    if not tarball.exists():
        root = _cache() / f"debootstrap-{SUITE}"
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(["debootstrap", "--variant=minbase", SUITE, str(root)], check=True, capture_output=True)
        partial = tarball.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(root), "-cf", str(partial), "."], check=True)
        partial.rename(tarball)
        shutil.rmtree(root)
    images = _buildah("images", "--format", "{{.Name}}:{{.Tag}}").stdout.split()
    if BASE_IMAGE not in images:
        container = _buildah("from", "scratch").stdout.strip()
        _buildah("add", container, str(tarball), "/")
        _buildah("config", "--cmd", "/bin/bash", "--env", f"PATH={STANDARD_PATH}", container)
        _buildah("commit", "--rm", container, BASE_IMAGE)
    return BASE_IMAGE


def _local_wheel_folder() -> Path | None:
    """The folder pip's configuration takes the CPU torch wheel from, when it is a local one."""
    env = {**os.environ, "EDGE_VENV": sys.prefix}
    done = subprocess.run([str(REPO / "scripts" / "setup"), "--torch-source"], env=env, capture_output=True,
                          text=True, check=False)  # fmt: skip
    url = done.stdout.strip().rsplit(" ", 1)[-1]
    if done.returncode != 0 or not url.startswith("file://"):
        return None
    return Path(urllib.request.url2pathname(url.removeprefix("file://"))).parent


def _pip_cert() -> Path | None:
    """The CA bundle pip is configured to trust here (a TLS-intercepting egress proxy's CA), if any."""
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".cert"):
            return Path(value.strip().strip("'"))
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, data: dict | None = None, timeout: float = 10) -> tuple[int, dict]:
    body = json.dumps(data).encode() if data is not None else None
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except OSError:
        return 0, {}


def _processes_in(rootfs: str) -> list[int]:
    """The processes whose root directory is the container's root file system (chroot isolation)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "root") == rootfs:
                    pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def image():
    """Builds deploy/Dockerfile on the local Debian base; prints how long each part took."""
    started = time.monotonic()
    base = _debian_base()
    based = time.monotonic()
    args = ["bud", "--isolation", "chroot", "--layers=false", "-f", "deploy/Dockerfile", "--build-arg",
            f"BASE={base}", "-t", IMAGE]  # fmt: skip
    wheels = _local_wheel_folder()
    if wheels is not None:
        args += ["-v", f"{wheels}:/opt/edge-wheels:ro", "--build-arg", "PIP_FIND_LINKS=/opt/edge-wheels"]
    cert = _pip_cert()
    if cert is not None:
        args += ["-v", f"{cert}:/etc/build-ca.crt:ro", "--build-arg", "PIP_CERT=/etc/build-ca.crt"]
    log = _cache() / "build.log"
    with log.open("w") as out:
        try:
            _buildah(*args, ".", cwd=REPO, capture=False, stdout=out, stderr=subprocess.STDOUT)
        except subprocess.CalledProcessError:
            pytest.fail(f"buildah bud failed; the end of {log}:\n" + "\n".join(log.read_text().splitlines()[-30:]))
    built = time.monotonic()
    print(f"\nimage: Debian base {based - started:.0f} s, build {built - based:.0f} s "
          f"(torch wheel from {wheels or 'the configured sources'})")  # fmt: skip
    yield IMAGE
    _buildah("rmi", "-f", IMAGE, check=False)


@pytest.fixture
def container(image):
    """A working container of the image, its root file system mounted; removed afterwards."""
    name = _buildah("from", image).stdout.strip()
    try:
        yield name, _buildah("mount", name).stdout.strip()
    finally:
        _buildah("rm", name, check=False)


def _stop(server: subprocess.Popen, rootfs: str) -> None:
    """SIGTERM to the wrapper's group, then SIGKILL to whatever still runs inside the container's root."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=60)
    for pid in _processes_in(rootfs):  # found by their root directory, never by name
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_the_image_serves_a_completion_through_its_entrypoint(image, container):
    name, rootfs = container
    config = json.loads(_buildah("inspect", "--type", "image", image).stdout)["OCIv1"]["config"]
    port = _free_port()
    storage = _cache() / "storage"
    # The image's own entrypoint; the later --host/--port win (argparse keeps the last), so it binds loopback.
    command = ["buildah", "--root", str(storage / "root"), "--runroot", str(storage / "run"), "--storage-driver",
               "vfs", "run", "--isolation", "chroot", name, "--", *config["Entrypoint"], "--host", "127.0.0.1",
               "--port", str(port)]  # fmt: skip
    log = _cache() / "run.log"
    started = time.monotonic()
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and server.poll() is None and _get(f"{base}/readyz")[0] != 200:
            time.sleep(5)
        ready = time.monotonic()
        assert _get(f"{base}/readyz")[0] == 200, "not ready; the end of the log:\n" + log.read_text()[-3000:]
        status, models = _get(f"{base}/v1/models")
        assert status == 200, models
        request = {"model": models["data"][0]["id"], "prompt": "The capital of France is", "max_tokens": 4,
                   "temperature": 0}  # fmt: skip
        status, completion = _get(f"{base}/v1/completions", request, timeout=120)
        assert status == 200, completion
        text = completion["choices"][0]["text"]
        print(f"\nimage: ready {ready - started:.0f} s after start; completion {text!r}")
        assert "Paris" in text
        # A first start with no calibration record times this host's kernels (the image's environment leaves
        # EDGE_CALIBRATION at its default, auto), and the plan it serves ranks from that record.
        assert "timing its kernels once" in log.read_text()
        status, state = _get(f"{base}/status")
        assert status == 200 and state["plan"]["calibration"] is not None, state
    finally:
        _stop(server, rootfs)
