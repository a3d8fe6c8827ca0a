"""AVX2 int4 decode kernels: torch.ops.edge_avx2.w4a16_linear and w4a8_linear, built from kernels/ops/avx2_int4.cpp.

    linear(x [..., K], qweight uint8 [N, K/2], scales bf16 [N, K/g], zeros bf16 [N, K/g], group, act_bits) -> [..., N]

read the checkpoint's row-major nibbles as they are (kernels/ops/int4.py). The activations are quantized once per call,
per row and group, to integers (act_bits 16: int16, w4a16; 8: int8, w4a8, llama.cpp's Q8 activations); each group's
integer dot product with the codes meets the group's scale and zero once (y = s a sum q xq + (z - 8 s) a sum xq,
a = max|x_g| / QMAX), in fp32; the result has x's dtype. The int16 rounding (<= max|x_g| / 65534 an element) is
below bf16's own rounding of the group's largest element; the int8 rounding is not, and edge-eval measures it.
Meant for a few rows (decode): a block of 2 rows decodes each code once.

The extension is compiled with the host's C++ compiler the first time it is needed (`torch.utils.cpp_extension.load`,
~15-40 s) and cached under `edge.paths.cache_dir() / "torch_extensions"`; its ISA flags are only -mavx2 -mfma
-mf16c (x86-64-v3), so one build runs on every AVX2 CPU. `available()` says whether it can run here and why not:
no compiler, a CPU without AVX2/FMA, or a failed build. Callers fall back to tinygemm then.
"""

from __future__ import annotations

import logging
import os
from functools import cache, lru_cache
from pathlib import Path

import torch

from edge.catalog.kernel_registry import KERNELS
from edge.formats.tinygemm import TINYGEMM
from kernels.ops import extension
from kernels.ops.int4 import apply_scales, unpack_nibbles

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("avx2_int4.cpp")
# w8a16_linear rounds activations to int16 in groups of this many along K: layers whose K it divides take it.
INT8_K_MULTIPLE: int = KERNELS["avx2-int8"].k_multiple
EXTENSION = "edge_avx2_int4"
OP_NAMESPACE = "edge_avx2"
GROUP_SIZES = (32, 64, 128)
# activation bits -> the op, from the registry's AVX2 int4 kernels (edge_avx2::w4a16_linear, edge_avx2::w4a8_linear)
ACT_BITS = {spec.activation_bits: spec.op.split("::")[1] for spec in TINYGEMM.row_major_kernels()}
REQUIRED_FLAGS = ("avx2", "fma", "f16c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # -fopenmp: at::parallel_for's OpenMP backend
LDFLAGS = ["-fopenmp"]  # resolves to the libgomp.so.1 torch has already loaded


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


WHAT = "the AVX2 int4 kernel"


def _compiler() -> str | None:
    return extension.compiler()


def ninja_on_path() -> str | None:
    return extension.ninja_on_path(WHAT)


def missing_prerequisite(cpu_flags: set[str], compiler: str | None) -> str | None:
    """Why the kernel cannot be built or run on a CPU with these flags and this compiler; None when it can."""
    missing = [flag for flag in REQUIRED_FLAGS if flag not in cpu_flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)} (the AVX2 int4 kernel needs AVX2, FMA and F16C)"
    if compiler is None:
        return "no C++ compiler (c++ or g++) on PATH to build the AVX2 int4 kernel; install g++ or use tinygemm"
    return None


@lru_cache(maxsize=1)
def load() -> str | None:
    """Build (or load the cached build of) the extension and register its op; None when it runs here, else why not."""
    if hasattr(torch.ops, OP_NAMESPACE) and hasattr(getattr(torch.ops, OP_NAMESPACE), "int4_linear"):
        return None
    reason = missing_prerequisite(_cpu_flags(), _compiler()) or extension.build(EXTENSION, SOURCE, WHAT, CFLAGS,
                                                                                  LDFLAGS)  # fmt: skip
    if reason:
        return reason
    _register_fake()
    return None


def available() -> bool:
    reason = load()
    if reason:
        log.warning("AVX2 int4 kernel unavailable: %s; falling back to tinygemm", reason)
    return reason is None


def _register_fake() -> None:
    def _fake(x, qweight, scales, zeros, group):
        return x.new_empty((*x.shape[:-1], out_features(qweight)))

    for op in ACT_BITS.values():
        torch.library.register_fake(f"{OP_NAMESPACE}::{op}")(_fake)

    @torch.library.register_fake(f"{OP_NAMESPACE}::w8a16_linear")
    def _fake_int8(x, qweight, scales):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake(f"{OP_NAMESPACE}::q4k_linear")
    def _fake_q4k(x, qweight, meta):
        return x.new_empty((*x.shape[:-1], out_features(qweight)))

    @torch.library.register_fake(f"{OP_NAMESPACE}::q6k_linear")
    def _fake_q6k(x, blocks):
        return x.new_empty((*x.shape[:-1], blocks.shape[0] * X8_CHANNELS))

    @torch.library.register_fake(f"{OP_NAMESPACE}::g32_linear")
    def _fake_g32(x, blocks, bits):
        return x.new_empty((*x.shape[:-1], blocks.shape[0] * X8_CHANNELS))

    @torch.library.register_fake(f"{OP_NAMESPACE}::blocks_dequantize")
    def _fake_dequantize(blocks):
        weights = 256 if blocks.shape[-1] == 1680 else 32
        return blocks.new_empty((blocks.shape[0] * X8_CHANNELS, blocks.shape[1] * weights), dtype=torch.bfloat16)

    @torch.library.register_fake(f"{OP_NAMESPACE}::int4_dequantize")
    def _fake_int4_dequantize(qweight, scales, zeros, group, fp32):
        return qweight.new_empty((qweight.shape[0] * X8_CHANNELS, qweight.shape[1] * 8),
                                 dtype=torch.float32 if fp32 else torch.bfloat16)  # fmt: skip

    @torch.library.register_fake(f"{OP_NAMESPACE}::q4k_dequantize")
    def _fake_q4k_dequantize(qweight, meta, fp32):
        return qweight.new_empty((qweight.shape[0] * X8_CHANNELS, qweight.shape[1] * 8),
                                 dtype=torch.float32 if fp32 else torch.bfloat16)  # fmt: skip

    @torch.library.register_fake(f"{OP_NAMESPACE}::blocks_linear")
    def _fake_blocks(x, blocks, dequant_threshold, avx2_rows):
        return x.new_empty((*x.shape[:-1], blocks.shape[0] * X8_CHANNELS), dtype=torch.bfloat16)

    @torch.library.register_fake(f"{OP_NAMESPACE}::int8_embedding")
    def _fake_int8_embedding(ids, qweight, scales):
        return qweight.new_empty((*ids.shape, qweight.shape[1]), dtype=torch.bfloat16)

    @torch.library.register_fake(f"{OP_NAMESPACE}::int8_linear")
    def _fake_int8_front(x, qweight, scales, dequant_threshold, avx2_rows):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]), dtype=torch.bfloat16)

    @torch.library.register_fake(f"{OP_NAMESPACE}::int4_linear")
    def _fake_layer(x, packed, scales_and_zeros, *rest):
        return x.new_empty((*x.shape[:-1], scales_and_zeros.shape[1]), dtype=torch.bfloat16)


@cache
def op(name: str) -> torch._ops.OpOverload:
    """The loaded op's overload (w4a16_linear, w4a8_linear, w8a16_linear or q4k_linear), looked up once: the decode step
    calls it ~120 times, and torch.ops' attribute lookups cost about as much as a 576x576 GEMV's arithmetic."""
    reason = load()
    if reason:
        raise RuntimeError(reason)
    return getattr(getattr(torch.ops, OP_NAMESPACE), name).default


def linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, act_bits: int = 16
) -> torch.Tensor:
    """y = x @ w.T for the int4 weights, row-major or in decode_layout's layout, activations rounded to act_bits
    (16 or 8) per group; x [..., K] any float dtype -> [..., N] in x's dtype."""
    return op(ACT_BITS[act_bits])(x, qweight, scales, zeros, group)


# Output channels a block of the decode layout interleaves: one 256-bit vector of int32 sums, a channel a lane.
X8_CHANNELS = 8
# EDGE_AVX2_DECODE_LAYOUT=row-major keeps the checkpoint's row-major tensors for every kernel (benchmarks compare the
# two in one run); it changes no compiled graph, only the tensors the op is handed.
LAYOUT_ENV = "EDGE_AVX2_DECODE_LAYOUT"
ROW_MAJOR = "row-major"


def takes_decode_layout(n: int, act_bits: int) -> bool:
    """Whether the kernel for act_bits reads an [N, K] weight in decode_layout's interleaved layout: the int8-activation
    kernel (w4a8_linear) does, for N a multiple of 8; the int16 one reads the row-major tensors."""
    return act_bits == 8 and n % X8_CHANNELS == 0


def decode_layout(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, act_bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tensors the act_bits kernel reads best: row-major qweight uint8 [N, K/2] (byte j: k=2j low nibble, 2j+1
    high), scales and zeros bf16 [N, K/g], interleaved by 8 output channels where takes_decode_layout says so:
    qweight [N/8, K/8, 32] (per block b and 8 weights 8j..8j+7, 4 bytes a channel, byte t holding k=8j+t low and
    8j+4+t high), scales and zeros [N/8, K/g, 8]; the same bytes. Else (or with EDGE_AVX2_DECODE_LAYOUT=row-major)
    the tensors as they are. New tensors; decode_layout_ converts in place.

    Why: one 32-byte load then feeds vpdpbusd lanes that are 8 channels, so a group's 8 scales are one vector and no
    horizontal sums remain (avx2_int4.cpp block8_a8); measured against the row-major kernel by
    benchmarks/avx2_gemv.py and benchmarks/step_profile.py."""
    if not _wants_decode_layout(qweight, act_bits):
        return qweight, scales, zeros
    return decode_layout_(qweight.clone(), scales.clone(), zeros.clone(), act_bits)


def decode_layout_(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, act_bits: int, chunk_rows: int = 512
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """decode_layout in the tensors' own storage (contiguous ones), chunk_rows output channels at a time: block b's
    bytes are rows 8b..8b+7's, so each chunk is rewritten where it lies. What a load holds beyond the layer is one
    chunk's temporaries, ~2 B x chunk_rows x K by count of the tensors made below (not measured), within the
    tinygemm repack's 4 B x repack_chunk_rows x K that the plan's ledger counts (edge.formats.tinygemm
    load_transients). Returns views of the same storage."""
    if not _wants_decode_layout(qweight, act_bits):
        return qweight, scales, zeros
    assert qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous(), "in place needs contiguous"
    n, k = qweight.shape[0], qweight.shape[1] * 2
    step = max(X8_CHANNELS, chunk_rows - chunk_rows % X8_CHANNELS)
    for r0 in range(0, n, step):
        rows = min(step, n - r0)
        blocks = rows // X8_CHANNELS
        qweight[r0 : r0 + rows].view(-1).copy_(interleaved_codes(qweight[r0 : r0 + rows]).view(-1))
        for grid in (scales, zeros):  # [rows, G] -> [b, G, 8]
            part = grid[r0 : r0 + rows]
            moved = part.view(blocks, X8_CHANNELS, -1).permute(0, 2, 1).clone(memory_format=torch.contiguous_format)
            part.view(-1).copy_(moved.view(-1))  # a fresh buffer: a permuted view may alias the part it came from
    groups = scales.shape[1]
    return (qweight.view(n // X8_CHANNELS, k // 8, 32), scales.view(n // X8_CHANNELS, groups, X8_CHANNELS),
            zeros.view(n // X8_CHANNELS, groups, X8_CHANNELS))  # fmt: skip


def interleaved_codes(qweight: torch.Tensor) -> torch.Tensor:
    """Row-major codes uint8 [N, K/2] (N a multiple of 8) -> the decode layout's [N/8, K/8, 32], a new tensor."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    codes = unpack_nibbles(qweight).view(n // X8_CHANNELS, X8_CHANNELS, k // 8, 2, 4)  # [b, c, j, half, t]
    packed = codes[:, :, :, 0, :] | (codes[:, :, :, 1, :] << 4)  # [b, c, j, t]
    return packed.permute(0, 2, 1, 3).reshape(n // X8_CHANNELS, k // 8, 32)  # [b, j, c, t]


def row_major(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """decode_layout undone: codes uint8 [N, K] (unpacked, one a byte) and scales, zeros [N, K/g]; row-major tensors
    come back as codes and their own grids. New tensors."""
    if qweight.dim() != 3:
        return unpack_nibbles(qweight), scales, zeros
    grids = (g.permute(0, 2, 1).reshape(qweight.shape[0] * X8_CHANNELS, -1) for g in (scales, zeros))  # [N, K/g]
    return (decoded_codes(qweight), *grids)


def decoded_codes(qweight: torch.Tensor) -> torch.Tensor:
    """The decode layout's codes [N/8, K/8, 32] -> uint8 [N, K], one code a byte (interleaved_codes undone)."""
    blocks, k = qweight.shape[0], qweight.shape[1] * 8
    packed = qweight.view(blocks, k // 8, X8_CHANNELS, 4).permute(0, 2, 1, 3)  # [b, c, j, t]
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=3)  # [b, c, j, half, t]: k = 8j + 4 half + t
    return codes.reshape(blocks * X8_CHANNELS, k)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:  # fmt: skip
    """w [N, K] in dtype (bf16 or fp32) from int4 weights row-major or in decode_layout's layout, (q - 8) * scale +
    zero rounded once, as kernels.ops.int4.dequantize gives for the row-major tensors, bit for bit. The decode layout
    dequantizes in C++ where the extension loads (a layer that keeps no tinygemm buffer does this for every batch
    wider than the decode kernel's rows)."""
    if qweight.dim() == 3 and load() is None:
        return op("int4_dequantize")(qweight, scales, zeros, group, dtype == torch.float32)
    codes, row_scales, row_zeros = row_major(qweight, scales, zeros)
    return apply_scales(codes, row_scales, row_zeros, group, dtype)


def _wants_decode_layout(qweight: torch.Tensor, act_bits: int) -> bool:
    return takes_decode_layout(qweight.shape[0], act_bits) and os.environ.get(LAYOUT_ENV) != ROW_MAJOR


def out_features(qweight: torch.Tensor) -> int:
    """N of an int4 weight in either layout: row-major [N, K/2] or decode_layout's [N/8, K/8, 32]."""
    return qweight.shape[0] * X8_CHANNELS if qweight.dim() == 3 else qweight.shape[0]


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y = x @ (qweight * scales[:, None]).T for the 8-bit set's layers (kernels/ops/int8.py: int8 [N, K], bf16 [N],
    K a multiple of 32), activations rounded to int16 per group of 32; [..., K] -> [..., N] in x's dtype."""
    return op("w8a16_linear")(x, qweight, scales)
