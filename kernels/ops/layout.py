"""The tinygemm weight layout of this host, measured rather than assumed.

`_convert_weight_to_int4pack_for_cpu(codes int32 [N, K], 1)` returns uint8 [N, K/2] whose bytes are really
[N/B][K][B/2]: output channels in blocks of B, each block stored k-major, two channels per byte. B and which two
channels share a byte depend on the CPU capability PyTorch dispatched to (B = 4 x the float vector width:
64 on AVX-512, 32 on AVX2, 16 on ARM NEON, 32 with ARM's 256-bit SVE; reading an AVX2 buffer as 64 returns wrong
weights, docs/FACTS.md). So we pack an index pattern, read back where every (n, k) landed, and fit that against the
known models:

    "halves": byte d of a run holds channel d (low nibble) and channel d + B/2 (high)   (AVX2, AVX-512)
    "pairs":  byte d of a run holds channel 2d (low nibble) and channel 2d + 1 (high)   (scalar builds, ARM)

A last block narrower than B (N not a multiple of B) is packed in "pairs" order whatever the host
(weight_to_int4pack_kernel's `nb_size < BLOCK_N` branch), so a mixed buffer fits no model: callers keep such
layers row-major (`kernels.ops.tinygemm.tiles`). Anything that fits no model raises LayoutError; we never guess.

    python -m kernels.ops.layout --json   ->  {"block": 32, "torch_version": ..., "cpu_capability": ..., "layout": ...}
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache

import torch

NIBBLE_ORDERS = ("halves", "pairs")
CANDIDATE_BLOCKS = (16, 32, 64, 128)  # the kernel launches n-blocks of 16, 32, 48 or 64 channels
# The probe: 256 channels hold >= 2 whole blocks of every candidate, so a block size is seen repeating, not
# inferred from one block; 32 inputs keep it to 4 packs of 8192 codes (~1 ms).
PROBE_N = 256
PROBE_K = 32


def expected_block(machine: str, capability: str) -> int | None:
    """What PyTorch's source leads us to expect on this machine (platform.machine()) at this capability: 4 x
    Vectorized<float>::size(), the planner's fallback (edge.formats.tinygemm.derived_block). The measurement, not
    this rule, is authoritative."""
    from edge.formats.tinygemm import derived_block

    return derived_block(capability, "aarch64" if machine.lower() in ("aarch64", "arm64") else None)


class LayoutError(RuntimeError):
    """torch packed the probe in a way that fits no known layout model."""


@dataclass(frozen=True)
class TinygemmLayout:
    block: int  # B: output channels per block; the buffer is [N/B][K][B/2 bytes]
    nibbles: str  # "halves" or "pairs" (see module docstring)
    torch_version: str
    cpu_capability: str

    def describe(self) -> str:
        half = self.block // 2
        if self.nibbles == "halves":
            pair = f"channel d (low nibble), d+{half} (high)"
        else:
            pair = "channel 2d (low nibble), 2d+1 (high)"
        return f"[N/{self.block}][K][{half} bytes], byte d: {pair}"

    def to_json(self) -> dict:
        return {
            "block": self.block,
            "torch_version": self.torch_version,
            "cpu_capability": self.cpu_capability,
            "layout": self.nibbles,
        }


def measure_layout(n: int = PROBE_N, k: int = PROBE_K) -> TinygemmLayout:
    """Pack an index pattern with torch and fit the result; raise LayoutError if no model fits."""
    landed = _where_each_code_landed(n, k)  # [N*K/2, 2]
    for block in CANDIDATE_BLOCKS:
        if n % block or n // block < 2:
            continue
        for nibbles in NIBBLE_ORDERS:
            if torch.equal(landed, _model_sources(n, k, block, nibbles)):
                return TinygemmLayout(block, nibbles, torch.__version__, _capability())
    raise LayoutError(
        f"torch {torch.__version__} ({_capability()}) packed a {n}x{k} index pattern in a layout that fits "
        f"no known model (blocks {CANDIDATE_BLOCKS} x nibble orders {NIBBLE_ORDERS}); first bytes hold "
        f"(n, k) = {[(int(s) // k, int(s) % k) for s in landed[:4].flatten()]}"
    )


@lru_cache(maxsize=1)
def host_layout() -> TinygemmLayout:
    """This process's layout, measured once."""
    return measure_layout()


def pack_codes(codes: torch.Tensor, layout: TinygemmLayout) -> torch.Tensor:
    """Lay codes uint8 [N, K] out as `layout` describes -> uint8 [N, K/2]. N must be a multiple of the block.

    A model of torch's packer, for a host we are not on (tests build an AVX-512 buffer this way on AVX2).
    """
    n, k = codes.shape
    block, half = layout.block, layout.block // 2
    assert n % block == 0, f"N={n} does not tile block {block}"
    runs = codes.view(n // block, block, k).transpose(1, 2)  # [N/B, K, B]
    if layout.nibbles == "halves":
        low, high = runs[..., :half], runs[..., half:]
    else:
        low, high = runs[..., 0::2], runs[..., 1::2]
    return (low | (high << 4)).reshape(n, k // 2)  # [N/B, K, B/2] -> [N, K/2]


def unpack_codes(packed: torch.Tensor, layout: TinygemmLayout) -> torch.Tensor:
    """Read codes uint8 [N, K] back out of a buffer [N, K/2] in `layout`; the inverse of pack_codes.

    Transposes the packed bytes (half the data of transposing codes), then each byte row feeds two channel
    rows: 0.48 vs 0.91 ms at 1536x576, 7.1 vs 19.6 ms at 4096x4096, against unpacking first and transposing
    the codes (1 thread, thread CPU time, median of 7 interleaved runs, this host, 2026-11-29).
    """
    n, k = packed.shape[0], packed.shape[1] * 2
    block, half = layout.block, layout.block // 2
    assert n % block == 0, f"N={n} does not tile block {block}"
    rows = packed.view(n // block, k, half).transpose(1, 2).contiguous()  # [N/B, B/2, K]: byte d of each run
    codes = torch.empty(n // block, block, k, dtype=torch.uint8)
    if layout.nibbles == "halves":  # byte d -> channels d and d + B/2
        low, high = codes[:, :half], codes[:, half:]
    else:  # byte d -> channels 2d and 2d + 1
        low, high = codes[:, 0::2], codes[:, 1::2]
    torch.bitwise_and(rows, 0xF, out=low)
    torch.bitwise_right_shift(rows, 4, out=high)
    return codes.view(n, k)


def _where_each_code_landed(n: int, k: int) -> torch.Tensor:
    """For every nibble of torch's packed [N, K/2] buffer, the flat source index n*K + k it holds -> [N*K/2, 2].

    A code has 4 bits, so the index is written one hex digit per pack and reassembled.
    """
    flat = torch.arange(n * k, dtype=torch.int64).view(n, k)
    landed = torch.zeros(n * k // 2, 2, dtype=torch.int64)
    for digit in range(math.ceil(math.log(n * k, 16))):
        codes = ((flat >> (4 * digit)) & 0xF).to(torch.int32)  # [N, K]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).flatten()  # [N*K/2] uint8
        nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).to(torch.int64)  # [N*K/2, 2]
        landed += nibbles << (4 * digit)
    return landed


def _model_sources(n: int, k: int, block: int, nibbles: str) -> torch.Tensor:
    """Where a model says each nibble's code comes from: flat index n*K + k per (byte, low/high) -> [N*K/2, 2]."""
    half = block // 2
    byte = torch.arange(n * k // 2, dtype=torch.int64)
    n_block, within = byte // (k * half), byte % (k * half)
    k_index, d = within // half, within % half
    low_channel = d if nibbles == "halves" else 2 * d
    high_channel = d + half if nibbles == "halves" else 2 * d + 1
    channel = torch.stack((low_channel, high_channel), dim=-1)  # [N*K/2, 2]
    return (n_block.unsqueeze(-1) * block + channel) * k + k_index.unsqueeze(-1)


def _capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def main(argv: list[str] | None = None) -> int:
    """Print this host's tinygemm layout (exit 1 with the reason if it fits no known model)."""
    parser = argparse.ArgumentParser(prog="python -m kernels.ops.layout", description=main.__doc__)
    parser.add_argument("--json", action="store_true", help="one JSON object, for the planner's probe")
    args = parser.parse_args(argv)
    try:
        layout = measure_layout()
    except LayoutError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(layout.to_json()))
    else:
        print(f"tinygemm layout on {layout.cpu_capability}, torch {layout.torch_version}: {layout.describe()}")
        print(json.dumps(asdict(layout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
