"""The tinygemm format's torch half (edge.formats.tinygemm): its converter step (the checkpoint stores the
row-major codes, the loader packs them for the host) and the timers of the kernels reading it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from edge.catalog.kernel_registry import KERNELS
from edge.formats.tinygemm import TINYGEMM
from kernels.formats.common import Builder, Run, Weights, avx2_ops
from kernels.ops.int4 import dequantize, quantize_packed
from kernels.ops.layout import host_layout
from kernels.ops.tinygemm import dequantize_tinygemm, tiles, to_tinygemm
from kernels.ops.tinygemm import linear as tinygemm_linear

FORMAT = TINYGEMM


def convert(
    prefix: str, chunks: Sequence[torch.Tensor], qconfig: dict[str, Any], *, name: str
) -> dict[str, torch.Tensor]:
    """A weight the plan quantizes, from its output-channel chunks: min/max round-to-nearest, or the scale search
    (kernels/ops/asym_search.py) where quantization_config's `rounding` says "search"."""
    search = qconfig.get("rounding") == "search"
    parts = [quantize_packed(rows, qconfig["group_size"], name=name, search=search) for rows in chunks]
    return {
        f"{prefix}.qweight": torch.cat([p[0] for p in parts]),  # [N, K/2] uint8
        f"{prefix}.scales": torch.cat([p[1] for p in parts]),  # [N, K/g] bf16
        f"{prefix}.zeros": torch.cat([p[2] for p in parts]),  # [N, K/g] bf16
    }


def from_source(prefix: str, grid, name: str) -> dict[str, torch.Tensor]:
    """A GGUF tensor on a 4-bit group-32 grid: the source's own codes, scales and zeros."""
    from kernels.source.gguf_source import cpu_int4_tensors

    qweight, scales, zeros = cpu_int4_tensors(grid, name)
    return {f"{prefix}.qweight": qweight, f"{prefix}.scales": scales, f"{prefix}.zeros": zeros}


def from_source_blocks(prefix: str, grid, name: str) -> dict[str, torch.Tensor]:
    """A GGUF Q4_K tensor as its own blocks (kernels/ops/q4k.py): the codes as from_source writes them, and the
    file's 16 scale bytes a block in place of the bf16 scales and zeros: 144 bytes per 256 weights, the file's."""
    from kernels.source.gguf_source import q4k_tensors

    qweight, meta = q4k_tensors(grid, name)
    return {f"{prefix}.qweight": qweight, f"{prefix}.meta": meta}


def _int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    qweight, scales, zeros = quantize_packed(w, group)  # [N, K/2] uint8, [N, K/g] bf16 x2
    packed, scales_and_zeros = to_tinygemm(qweight, scales, zeros, group)  # [N, K/2] host layout, [K/g, N, 2]
    return qweight, scales, zeros, packed, scales_and_zeros


def _tinygemm(w: torch.Tensor, group: int) -> Weights:
    qweight, scales, zeros, packed, scales_and_zeros = _int4(w, group)

    def copy() -> Run:
        held, held_sz = packed.clone(), scales_and_zeros.clone()
        return lambda x: tinygemm_linear(x, held, held_sz, group)

    reference = dequantize(qweight, scales, zeros, group, torch.float32)
    return Weights(reference, packed.nbytes + scales_and_zeros.nbytes, copy)


def _avx2_kernel(act_bits: int) -> Callable[[torch.Tensor, int], Weights]:
    """An AVX2 int4 kernel on the row-major checkpoint tensors, activations rounded to act_bits (built on first
    use; absent without a compiler or AVX2/FMA)."""

    def build(w: torch.Tensor, group: int) -> Weights:
        avx2_int4 = avx2_ops()
        qweight, scales, zeros = quantize_packed(w, group)  # [N, K/2] uint8, [N, K/g] bf16 x2
        served = avx2_int4.decode_layout(qweight, scales, zeros, act_bits)  # the layout the engine serves it from

        def copy() -> Run:
            held = [t.clone() for t in served]
            return lambda x: avx2_int4.linear(x, *held, group, act_bits)

        reference = dequantize(qweight, scales, zeros, group, torch.float32)
        return Weights(reference, qweight.nbytes + scales.nbytes + zeros.nbytes, copy)

    return build


def _dequantized_gemm(dtype: torch.dtype) -> Callable[[torch.Tensor, int], Weights]:
    """The wide-batch branch of kernels.ops.int4_ops.int4_linear_impl: dequantize to `dtype`, GEMM, back to bf16;
    straight from the tinygemm buffer when N tiles the host block (DIRECT), else from the row-major copy (DUAL)."""

    def build(w: torch.Tensor, group: int) -> Weights:
        qweight, scales, zeros, packed, scales_and_zeros = _int4(w, group)
        layout = host_layout()
        direct = tiles(w.shape[0], layout)
        held = (packed, scales_and_zeros) if direct else (qweight, scales, zeros)

        def copy() -> Run:
            mine = [t.clone() for t in held]
            if direct:
                return lambda x: torch.mm(x.to(dtype), dequantize_tinygemm(*mine, group, layout, dtype).t()).to(
                    torch.bfloat16
                )
            return lambda x: torch.mm(x.to(dtype), dequantize(*mine, group, dtype).t()).to(torch.bfloat16)

        reference = dequantize(qweight, scales, zeros, group, torch.float32)
        return Weights(reference, sum(t.nbytes for t in held), copy)

    return build


TIMERS: dict[str, Builder] = {
    "tinygemm": _tinygemm,
    "avx2-int4": _avx2_kernel(KERNELS["avx2-int4"].activation_bits),
    "avx2-w4a8": _avx2_kernel(KERNELS["avx2-w4a8"].activation_bits),
    "dequant-bf16": _dequantized_gemm(torch.bfloat16),
    "dequant-fp32": _dequantized_gemm(torch.float32),
}
