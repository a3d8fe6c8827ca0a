"""Real devices (saved /proc/cpuinfo of real CPUs) and real model shapes for the planner's specifications."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.device.cpuinfo import parse_cpuinfo
from edge.device.profile import DeviceProfile
from edge.model.reader import default_model, read_model
from edge.model.shapes import ModelShape

DATA = Path(__file__).parent / "data"
GIB = 2**30


def cpuinfo_device(name: str, memory_gib: int = 64) -> DeviceProfile:
    """A saved cpuinfo with a meminfo of the given size (the saved texts carry no memory of their own)."""
    meminfo = f"MemTotal: {memory_gib * 2**20} kB\nMemAvailable: {memory_gib * 2**20} kB\n"
    return parse_cpuinfo((DATA / f"cpuinfo_{name}.txt").read_text(), meminfo, name=name)


@pytest.fixture
def sapphire_rapids() -> DeviceProfile:
    return cpuinfo_device("spr_8480c")


@pytest.fixture
def zen5() -> DeviceProfile:
    """This project's AVX-512 machine (AMD EPYC Zen 5: avx512_bf16, avx512_vnni, no AMX), its /proc/cpuinfo saved."""
    return cpuinfo_device("epyc_zen5_avx512")


@pytest.fixture
def ice_lake() -> DeviceProfile:
    return cpuinfo_device("icelake_8375c")


@pytest.fixture
def avx2_host() -> DeviceProfile:
    return cpuinfo_device("host_epyc_avx2", memory_gib=24)


@pytest.fixture
def graviton() -> DeviceProfile:
    return cpuinfo_device("graviton3")


@pytest.fixture
def phone() -> DeviceProfile:
    return cpuinfo_device("android_sm8150", memory_gib=8)


@pytest.fixture
def smollm2() -> ModelShape:
    return default_model()


@pytest.fixture
def llama_1b() -> ModelShape:
    return read_model(DATA / "configs" / "llama-3.2-1b.json")
