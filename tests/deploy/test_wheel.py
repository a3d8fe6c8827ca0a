"""The wheel: what `pip install .` puts into an environment carries every non-Python file the packages read at run
time (the AVX2 kernel's C++ source, the embedded data), and the AVX2 kernel builds from the installed copy and runs.

Once per module: the wheel is built from a copy of this checkout (pip builds in the source tree, and a build/ left
there by an earlier build would carry stale files into the wheel; the checkout itself stays untouched), with the
running interpreter's setuptools, then installed non-editable with --no-deps into a fresh venv. That venv reaches
torch and the other dependencies through a .pth file naming the running interpreter's site-packages: a path listed
in a .pth joins sys.path, but the .pth files inside it are not processed, so this project's editable install there
(its __editable__ finder) stays off and `edge`, `kernels` and `server` can only come from the wheel. The probe runs
in that venv's python from a folder outside the checkout, with a cache directory of its own, so the kernel really
is compiled, from the .cpp the wheel installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy

REPO = Path(__file__).parents[2]
PACKAGES = ("edge", "kernels", "server")
KERNEL_SOURCE = "kernels/ops/avx2_int4.cpp"
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc",
                                    ".pytest_cache", ".ruff_cache", ".cache")  # fmt: skip
N, K, GROUP, ROWS = 64, 256, 32, 3

# Run by the fresh venv's python with the arguments N K GROUP ROWS; prints one JSON line. The tolerance is
# tests/kernels/test_avx2_int4.py's: the activations' rounding (half a step of max|x_g| / QMAX per group) plus 1e-5
# of sum |w x| for fp32 ordering.
PROBE = """
import json, sys
import torch
import edge, kernels.ops.avx2_int4 as avx2
from edge.model.reader import default_model
from edge.measure.quality import shipped_records
from edge.paths import cache_dir
from kernels.ops.int4 import dequantize, quantize_packed

n, k, group, m = map(int, sys.argv[1:])
report = {
    "files": {"edge": edge.__file__, "kernels.ops.avx2_int4": avx2.__file__, "torch": torch.__file__},
    "finders": [finder.__module__ for finder in sys.meta_path],
    "sys_path": sys.path,
    "data": {"default_model": default_model().name, "shipped_records": len(shipped_records())},
    "prerequisite": avx2.missing_prerequisite(avx2._cpu_flags(), avx2._compiler()),
    "load": avx2.load(),
    "cache_dir": str(cache_dir()),
}
if report["load"] is None:
    qweight, scales, zeros = quantize_packed(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    w = dequantize(qweight, scales, zeros, group, torch.float32)
    reference = x @ w.t()
    for act_bits, qmax in ((16, 32767), (8, 127)):
        half_step = x.abs().reshape(m, k // group, group).amax(-1) / qmax / 2
        bound = half_step @ w.abs().reshape(n, k // group, group).sum(-1).t() + 1e-5 * (x.abs() @ w.abs().t()) + 1e-6
        y = avx2.linear(x, qweight, scales, zeros, group, act_bits)
        report[f"w4a{act_bits}"] = {
            "shape": list(y.shape), "dtype": str(y.dtype),
            "within_bound": bool(((y - reference).abs() <= bound).all()),
            "max_error": (y - reference).abs().max().item(), "max_bound": bound.max().item(),
        }
print(json.dumps(report))
"""


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, **kwargs)
    assert done.returncode == 0, f"{argv} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from a copy of this checkout, with the running interpreter's setuptools."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"),
          str(source)])  # fmt: skip
    (built,) = (root / "dist").glob("edge_select-*.whl")
    return built


@pytest.fixture(scope="module")
def source_data_files(wheel) -> set[str]:
    """Every non-Python file under the packages' folders of the copy the wheel was built from."""
    source = wheel.parents[1] / "source"
    return {
        path.relative_to(source).as_posix()
        for package in PACKAGES
        for path in (source / package).rglob("*")
        if path.is_file() and path.suffix != ".py"
    }


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (non-editable, --no-deps) and the running interpreter's
    site-packages, the one holding torch, on its path through a .pth file; its root."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)])
    python = root / "bin" / "python"
    # installed before the .pth exists, so pip sees only the fresh venv (and never this environment's editable install)
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
          str(wheel)])  # fmt: skip
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    torch_site = Path(importlib.util.find_spec("torch").origin).parents[1]
    (Path(purelib) / "edge-select-test-deps.pth").write_text(f"{torch_site}\n")
    return root


@pytest.fixture(scope="module")
def probe(venv, tmp_path_factory) -> dict:
    """The PROBE's report, run by the venv's python outside the checkout with fresh extension caches."""
    work = tmp_path_factory.mktemp("probe")
    (work / "probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env |= {
        "EDGE_SELECT_CACHE_DIR": str(work / "cache"),
        "TORCH_EXTENSIONS_DIR": str(work / "torch_extensions"),
        "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
    }
    done = _run([str(venv / "bin" / "python"), "probe.py", *map(str, (N, K, GROUP, ROWS))], cwd=work, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _needs_kernel(probe: dict) -> None:
    """Skip, with load()'s reason, where this host cannot build or run the kernel (no AVX2/FMA/F16C, no compiler)."""
    if probe["prerequisite"] is not None:
        pytest.skip(f"AVX2 int4 kernel unavailable here: {probe['load']}")


def test_the_wheel_carries_the_kernels_cpp_source_and_every_data_file_of_the_packages(wheel, source_data_files):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert KERNEL_SOURCE in source_data_files and "edge/data/quality_default_model.json" in source_data_files
    assert source_data_files - names == set()


def test_the_venv_imports_the_installed_packages_not_the_checkout_nor_its_editable_install(venv, probe):
    for module in ("edge", "kernels.ops.avx2_int4"):
        assert Path(probe["files"][module]).is_relative_to(venv), (module, probe["files"][module])
    assert not any(finder.startswith("__editable__") for finder in probe["finders"]), probe["finders"]
    assert not any(Path(entry).resolve() == REPO.resolve() for entry in probe["sys_path"] if entry)
    assert Path(probe["files"]["torch"]).parents[1] == Path(importlib.util.find_spec("torch").origin).parents[1]


def test_the_installed_packages_read_their_data_files(probe):
    assert probe["data"]["default_model"] and probe["data"]["shipped_records"] > 0


def test_the_kernel_builds_from_the_installed_cpp_into_the_fresh_cache(venv, probe):
    _needs_kernel(probe)
    assert probe["load"] is None
    build = Path(probe["cache_dir"]) / "torch_extensions" / "edge_avx2_int4"
    assert list(build.glob("*.so")), sorted(p.name for p in build.iterdir())
    sources = [line for line in (build / "build.ninja").read_text().splitlines() if "avx2_int4.cpp" in line]
    assert sources and all(str(venv) in line for line in sources), sources


@pytest.mark.parametrize("act_bits", [16, 8])
def test_the_installed_kernel_matches_dequantize_then_matmul(probe, act_bits):
    _needs_kernel(probe)
    assert probe["load"] is None, probe["load"]
    result = probe[f"w4a{act_bits}"]
    assert result["shape"] == [ROWS, N] and result["dtype"] == "torch.float32"
    assert result["within_bound"], result
