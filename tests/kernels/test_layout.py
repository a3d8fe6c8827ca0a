"""The tinygemm layout is measured on this host; these pin what the measurement must find.

This project's machines are AVX2 or AVX-512, and ARM boards next (docs/FACTS.md). The AVX2 pins run everywhere torch
can dispatch AVX2 kernels: on an AVX-512 host they run again in a child pytest under ATEN_CPU_CAPABILITY=avx2, which
makes torch pack exactly as on an AVX2 box (that child is what the test asserts on, not a skip). The ARM pins run on
aarch64 (scripts/test-arm runs them under qemu, on a NEON core and on a 256-bit SVE core). What a test expects
follows from torch's own dispatch (torch.backends.cpu.get_cpu_capability()) and platform.machine(), never from
/proc/cpuinfo, which qemu-user shows from the host.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from edge.catalog.shape_rules import PACK_N_MULTIPLE
from kernels.ops.layout import (
    LayoutError,
    TinygemmLayout,
    expected_block,
    host_layout,
    measure_layout,
    pack_codes,
    unpack_codes,
)

CAPABILITY = torch.backends.cpu.get_cpu_capability()
MACHINE = platform.machine()
# weight_to_int4pack_kernel: AVX2 and AVX-512 pair channel d with d + B/2; every other build (x86's scalar DEFAULT,
# aarch64's NEON and SVE) pairs neighbours 2d, 2d + 1.
EXPECTED_NIBBLES = "halves" if CAPABILITY in ("AVX2", "AVX512") else "pairs"


def avx2_dispatch(test):
    """Run `test` where torch dispatches AVX2 kernels: here if it already does, else in a child pytest with
    ATEN_CPU_CAPABILITY=avx2 (any AVX-512 CPU runs AVX2 code); skipped only off x86."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        if CAPABILITY == "AVX2":
            return test(*args, **kwargs)
        if CAPABILITY != "AVX512":
            pytest.skip(f"AVX2 dispatch needs an x86 CPU with AVX2; torch dispatches {CAPABILITY} here")
        node = f"{__file__}::{test.__name__}"
        env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
                              capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
        assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:]

    return wrapper


def torch_pack(codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


@avx2_dispatch
def test_this_avx2_host_packs_in_blocks_of_32_channels():
    layout = measure_layout()
    assert (layout.block, layout.nibbles) == (32, "halves")


@pytest.mark.skipif(
    expected_block(MACHINE, CAPABILITY) is None, reason=f"no expected block known for {CAPABILITY} on {MACHINE}"
)
def test_measured_layout_agrees_with_torch_cpu_capability():
    """32 under AVX2, 64 under AVX-512; on aarch64 16 with NEON (DEFAULT), 32 with SVE256, in "pairs" order."""
    layout = measure_layout()
    assert (layout.block, layout.nibbles) == (expected_block(MACHINE, CAPABILITY), EXPECTED_NIBBLES)


@avx2_dispatch
def test_torch_still_packs_the_documented_avx2_bytes():
    """[N/32][K][16 bytes]; byte d of a run holds channel d (low nibble) and d+16 (high). Fails if torch changes."""
    n, k = 64, 8
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    packed = torch_pack(codes).flatten()
    expected = [
        int(codes[nb * 32 + d, kk]) | int(codes[nb * 32 + d + 16, kk]) << 4
        for nb in range(n // 32)
        for kk in range(k)
        for d in range(16)
    ]
    assert packed.tolist() == expected


@avx2_dispatch
def test_known_byte_positions_of_an_index_pattern():
    n, k = 64, 8
    channel = torch.arange(n).unsqueeze(1).expand(n, k)
    packed = torch_pack(channel % 16).flatten()  # low hex digit of the channel
    packed_high = torch_pack(channel // 16).flatten()  # high hex digit
    def channels_at(byte: int) -> tuple[int, int]:
        low = int(packed[byte] & 0xF) + 16 * int(packed_high[byte] & 0xF)
        high = int(packed[byte] >> 4) + 16 * int(packed_high[byte] >> 4)
        return low, high
    assert channels_at(0) == (0, 16)  # block 0, k 0, byte 0
    assert channels_at(15) == (15, 31)  # block 0, k 0, last byte of the run
    assert channels_at(16) == (0, 16)  # block 0, k 1 starts a new run of the same channels
    assert channels_at(8 * 16 + 5) == (37, 53)  # block 1, k 0, byte 5


@pytest.mark.skipif(MACHINE != "aarch64", reason=f"ARM's layout; this host is {MACHINE}")
def test_torch_packs_the_documented_arm_bytes():
    """[N/B][K][B/2 bytes], byte d of a run holds channel 2d (low nibble) and 2d+1 (high); B = 16 on NEON, 32 under
    SVE256. Fails if torch changes either."""
    block = expected_block(MACHINE, CAPABILITY)
    n, k = 64, 8
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    packed = torch_pack(codes).flatten()
    expected = [
        int(codes[nb * block + 2 * d, kk]) | int(codes[nb * block + 2 * d + 1, kk]) << 4
        for nb in range(n // block)
        for kk in range(k)
        for d in range(block // 2)
    ]
    assert packed.tolist() == expected


def test_a_ragged_probe_fits_no_model_and_says_so():
    """48 channels: a block and a half where the block is 32 (AVX2, SVE256), one narrower block under AVX-512."""
    if host_layout().block == PACK_N_MULTIPLE:
        pytest.skip(f"every N torch packs (a multiple of {PACK_N_MULTIPLE}) tiles this host's block: none is ragged")
    with pytest.raises(LayoutError, match="fits no known model"):
        measure_layout(n=48)


def test_a_single_block_probe_is_not_enough_to_establish_a_block():
    with pytest.raises(LayoutError):
        measure_layout(n=16)


def test_host_layout_is_measured_once_and_cached():
    assert host_layout() is host_layout()
    assert host_layout() == measure_layout()


def test_the_layout_model_reproduces_torch_bytes_on_this_host():
    # 2048 + 64 rows tile every block the project meets (32 on AVX2, 64 on AVX-512, 16 on NEON, 32 with SVE256)
    codes = torch.randint(0, 16, (2048 + 64, 576), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    assert torch.equal(pack_codes(codes, host_layout()), torch_pack(codes))


@avx2_dispatch
def test_the_layout_model_reproduces_torch_bytes_under_avx2_dispatch():
    codes = torch.randint(0, 16, (2048 + 32, 576), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    assert torch.equal(pack_codes(codes, host_layout()), torch_pack(codes))


def test_the_layout_model_refuses_a_ragged_last_block():
    """A last block narrower than the host's is packed in another order (module docstring of kernels/ops/layout.py):
    the model refuses it rather than mis-describing it; callers keep such layers row-major."""
    codes = torch.zeros(2048 + host_layout().block // 2, 64, dtype=torch.uint8)
    with pytest.raises(AssertionError, match="does not tile"):
        pack_codes(codes, host_layout())


@pytest.mark.parametrize(("block", "nibbles"), [(32, "halves"), (64, "halves"), (32, "pairs"), (16, "pairs")])
def test_unpack_codes_inverts_pack_codes(block, nibbles):
    layout = TinygemmLayout(block, nibbles, "model", "model")
    codes = torch.randint(0, 16, (192, 576), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    assert torch.equal(unpack_codes(pack_codes(codes, layout), layout), codes)


def test_the_64_block_model_pairs_channel_d_with_d_plus_32():
    layout = TinygemmLayout(64, "halves", "model", "AVX512")
    codes = torch.zeros(64, 2, dtype=torch.uint8)
    codes[5, 1], codes[37, 1] = 3, 9
    assert pack_codes(codes, layout).flatten()[32 + 5] == 3 | 9 << 4  # k=1 run starts at byte 32


def test_cli_prints_the_json_the_planner_probe_caches():
    result = subprocess.run(
        [sys.executable, "-m", "kernels.ops.layout", "--json"], capture_output=True, text=True, check=True, timeout=120
    )
    report = json.loads(result.stdout)
    assert set(report) == {"block", "torch_version", "cpu_capability", "layout"}
    assert report["block"] == host_layout().block
    assert report["cpu_capability"] == CAPABILITY
    assert report["torch_version"] == torch.__version__


SCALAR_DISPATCH_CHECK = """
import json, torch
from kernels.ops.layout import measure_layout, pack_codes
layout = measure_layout()
codes = torch.randint(0, 16, (96, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
torch_bytes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
print(json.dumps({**layout.to_json(), "model_matches": bool(torch.equal(pack_codes(codes, layout), torch_bytes))}))
"""


@pytest.mark.skipif(
    CAPABILITY == "DEFAULT" or expected_block(MACHINE, "DEFAULT") is None,
    reason=f"needs a dispatch level above DEFAULT with a known DEFAULT block; this host is {CAPABILITY} on {MACHINE}",
)
def test_layout_follows_torch_dispatch_not_cpu_flags():
    """ATEN_CPU_CAPABILITY=default on the same CPU makes torch pack in the scalar "pairs" order, 32 channels on x86
    and NEON's 16 on an SVE core; we measure it."""
    result = subprocess.run(
        [sys.executable, "-c", SCALAR_DISPATCH_CHECK],
        capture_output=True, text=True, check=True, timeout=120, env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
    )
    report = json.loads(result.stdout)
    expected = ("DEFAULT", expected_block(MACHINE, "DEFAULT"), "pairs")
    assert (report["cpu_capability"], report["block"], report["layout"]) == expected
    assert report["model_matches"]
