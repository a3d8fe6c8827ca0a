"""The `cpu_int4` forward as opaque torch ops: torch.ops.vllm.cpu_int4_linear and .cpu_int4_embedding, and the
8-bit set's .cpu_int8_linear and .cpu_int8_embedding.

vLLM compiles the model with Dynamo. Inside these ops the path depends on the number of rows (tinygemm
below `dequant_threshold`, a dequantize + GEMM above it); traced, that branch would specialise the graph on
the batch size. Registered as custom ops with fake impls (vllm.utils.torch_utils.direct_register_custom_op),
Dynamo sees one node per layer and the choice is made at run time.

Modes (per layer, chosen at load time by kernels.vllm_plugin.cpu_int4):
    KERNEL_ONLY  tinygemm for every batch, no copy (`prefill_dequant: false`)
    DUAL         wide batches dequantize the row-major copy qweight (`direct_dequant: false`, and any layer
                 whose N does not tile the host block)
    DIRECT       wide batches dequantize straight from the tinygemm buffer (`direct_dequant: true`); with an AVX2
                 decode kernel there is no tinygemm buffer (an empty `packed`) and every batch wider than the
                 kernel's rows dequantizes the decode copy
"""

from __future__ import annotations

import torch

from kernels.ops import avx2_int4, g32, q4k, q6k
from kernels.ops.int4 import apply_scales, dequantize, unpack_nibbles
from kernels.ops.int8 import dequantize_int8
from kernels.ops.layout import host_layout
from kernels.ops.tinygemm import dequantize_tinygemm, linear

KERNEL_ONLY = 0
DUAL = 1
DIRECT = 2
MODES = {KERNEL_ONLY: "kernel-only", DUAL: "dual", DIRECT: "direct"}


def int4_linear_impl(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    mode: int,
    dequant_threshold: int,
    fp32_prefill: bool = False,
    avx2_rows: int = 0,
    avx2_bits: int = 16,
) -> torch.Tensor:
    """x [..., K] -> [..., N] bf16. packed uint8 [N, K/2] (host layout), scales_and_zeros bf16 [K/g, N, 2];
    qweight uint8 [N, K/2] row-major + scales, zeros [N, K/g] in DUAL mode or with avx2_rows > 0, else empty.

    fp32_prefill: the wide-batch GEMM runs in fp32 instead of bf16 (the plan's prefill_dtype,
    edge.measure.kernel_params; a keyword with a default so the op's schema stays readable).
    avx2_rows: batches of up to this many rows run the AVX2 int4 kernel on the row-major copy
    (quantization_config's decode_kernel "avx2" or "avx2-w4a8", kernels/ops/avx2_int4.py); 0: never.
    avx2_bits: that kernel's activations, 16 (int16) or 8 (int8). A layer of a GGUF's own Q4_K blocks
    (kernels/ops/q4k.py) passes their meta uint8 [N/8, K/256, 128] as `scales` and runs q4k_linear there instead."""
    n = scales_and_zeros.shape[1]
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()  # [M, K]
    rows = x2.shape[0]
    if rows == 0:
        return x.new_empty((*x.shape[:-1], n), dtype=torch.bfloat16)
    # the decode copy alone (kernels/vllm_plugin/cpu_int4.py decode_copy_only): the batches tinygemm would take go to
    # the decode kernel, faster than tinygemm at every width below the threshold (N x K 576x1536, 16 rows: 0.18 against
    # 0.34 ms, at 91: 1.01 against 1.92; Zen 4, 2026-12-06, docs/reports/2026-12-06-engine-memory.md)
    kernel_rows = max(avx2_rows, dequant_threshold - 1) if packed.numel() == 0 and avx2_rows else avx2_rows
    if rows <= kernel_rows and scales.dtype == torch.uint8:  # a GGUF's own Q4_K blocks: scales is their meta
        y = q4k.linear(x2, qweight, scales)  # [M, N] bf16
    elif rows <= kernel_rows:
        y = avx2_int4.linear(x2, qweight, scales, zeros, group, avx2_bits)  # [M, N] bf16; loads the op here
    elif packed.numel() == 0:  # the decode copy alone, a batch at the threshold or wider: dequantized
        dtype = torch.float32 if fp32_prefill else torch.bfloat16
        if scales.dtype == torch.uint8:  # a GGUF's own Q4_K blocks: `scales` is their meta
            w = q4k.dequantize_any(qweight, scales, dtype)  # [N, K]
        else:
            w = avx2_int4.dequantize(qweight, scales, zeros, group, dtype)  # [N, K]
        y = torch.mm(x2.to(dtype), w.t()).to(torch.bfloat16)  # [M, N]
    elif mode == KERNEL_ONLY or rows < dequant_threshold:
        y = linear(x2, packed, scales_and_zeros, group)  # [M, N]
    else:
        dtype = torch.float32 if fp32_prefill else torch.bfloat16
        if mode == DUAL:
            w = dequantize(qweight, scales, zeros, group, dtype)  # [N, K]
        else:
            w = dequantize_tinygemm(packed, scales_and_zeros, group, host_layout(), dtype)  # [N, K]
        y = torch.mm(x2.to(dtype), w.t()).to(torch.bfloat16)  # [M, N]
    return y.view(*x.shape[:-1], n)


def _linear_fake(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    mode: int,
    dequant_threshold: int,
    fp32_prefill: bool = False,
    avx2_rows: int = 0,
    avx2_bits: int = 16,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], scales_and_zeros.shape[1]), dtype=torch.bfloat16)


def embedding_impl(
    ids: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """ids [...] -> [..., H] bf16: gather the row-major rows (qweight [V, H/2], scales, zeros [V, H/g]) and
    dequantize only those."""
    flat = ids.reshape(-1)  # [T]
    codes = unpack_nibbles(qweight.index_select(0, flat))  # [T, H]
    rows = apply_scales(codes, scales.index_select(0, flat), zeros.index_select(0, flat), group, torch.bfloat16)
    return rows.view(*ids.shape, rows.shape[-1])


def _embedding_fake(
    ids: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    return qweight.new_empty((*ids.shape, qweight.shape[1] * 2), dtype=torch.bfloat16)


def int8_linear_impl(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, dequant_threshold: int, avx2_rows: int = 0
) -> torch.Tensor:
    """x [..., K] -> [..., N] bf16 for an int8 layer (kernels/ops/int8.py): qweight int8 [N, K], scales bf16 [N]
    (per channel) or float32 [N, K/g] (per group). Per channel, narrow batches run PyTorch's int8 weight-only GEMM;
    from dequant_threshold rows, and for per-group scales (which PyTorch's kernel cannot take) every batch the AVX2
    kernel does not, dequantize and run bf16.
    avx2_rows: batches of up to this many rows (K a multiple of avx2_int4.INT8_K_MULTIPLE) run the AVX2 int8 kernel
    (int16 activations, kernels/ops/avx2_int4.py), which takes either form; 0: never (the plugin's configs choose:
    kernels.vllm_plugin.cpu_int4.PluginConfig.int8_rows)."""
    n = qweight.shape[0]
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()  # [M, K]
    if x2.shape[0] <= avx2_rows and x2.shape[1] % avx2_int4.INT8_K_MULTIPLE == 0:
        y = avx2_int4.int8_linear(x2, qweight, scales)  # [M, N] bf16
    elif x2.shape[0] < dequant_threshold and scales.dim() == 1:
        # torch 2.13's AVX-512 kernel crashes (SIGSEGV) on int8 weights not 64-byte aligned, as tensors read
        # straight from a safetensors file are (8-byte); vLLM's own parameters are aligned, so this never copies there.
        if qweight.data_ptr() % 64:
            qweight = qweight.clone()
        y = torch.ops.aten._weight_int8pack_mm(x2, qweight, scales)  # [M, N]
    else:
        y = torch.mm(x2, dequantize_int8(qweight, scales).t())
    return y.view(*x.shape[:-1], n)


def _int8_linear_fake(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, dequant_threshold: int, avx2_rows: int = 0
):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]), dtype=torch.bfloat16)


def _blocks_ops(blocks: torch.Tensor):
    """The module of kernels/ops whose decode layout `blocks` is in: q6k ([N/8, K/256, 1680]) or g32 ([N/8, K/32,
    272 or 176])."""
    return q6k if blocks.shape[-1] == q6k.X8_BLOCK_BYTES else g32


def blocks_decode_layout_(type_name: str, raw: torch.Tensor, chunk_rows: int = 512) -> torch.Tensor:
    """An 8-bit-set weight's file blocks as converted (uint8 [N, K/block * block bytes]) rearranged in place into its
    type's decode layout (kernels/ops/q6k.py for Q6_K, g32.py for Q8_0 and Q5_0), what blocks_linear_impl reads."""
    if type_name == "Q6_K":
        return q6k.decode_layout_(raw, chunk_rows)
    return g32.decode_layout_(type_name, raw, chunk_rows)


def blocks_linear_impl(
    x: torch.Tensor, blocks: torch.Tensor, dequant_threshold: int, avx2_rows: int = 0
) -> torch.Tensor:
    """x [..., K] -> [..., N] bf16 for an 8-bit-set layer kept as a GGUF's own Q6_K, Q8_0 or Q5_0 blocks in their
    decode layout (kernels/ops/q6k.py, g32.py): batches of up to avx2_rows rows (below dequant_threshold, as the
    8-bit set's own) run the type's kernel (int8 activations per group of 32); wider ones dequantize to bf16 (the
    C++ op where the AVX2 build loads: 12-40x the Python one, kernels/ops/avx2_int4.cpp blocks_dequantize) and run
    the GEMM."""
    ops = _blocks_ops(blocks)
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()  # [M, K]
    if x2.shape[0] <= avx2_rows:
        y = ops.linear(x2, blocks)  # [M, N] bf16
    else:
        dequantize = avx2_int4.op("blocks_dequantize") if avx2_int4.load() is None else ops.dequantize_x8
        y = torch.mm(x2, dequantize(blocks).t())
    return y.view(*x.shape[:-1], blocks.shape[0] * ops.X8)


def _blocks_linear_fake(x: torch.Tensor, blocks: torch.Tensor, dequant_threshold: int, avx2_rows: int = 0):
    return x.new_empty((*x.shape[:-1], blocks.shape[0] * q6k.X8), dtype=torch.bfloat16)


def int8_embedding_impl(ids: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """ids [...] -> [..., H] bf16: gather the int8 rows and their scales ([N] or [N, K/g]), dequantize only those."""
    flat = ids.reshape(-1)  # [T]
    rows = dequantize_int8(qweight.index_select(0, flat), scales.index_select(0, flat))  # [T, H]
    return rows.view(*ids.shape, rows.shape[-1])


def _int8_embedding_fake(ids: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return qweight.new_empty((*ids.shape, qweight.shape[1]), dtype=torch.bfloat16)


def _register() -> None:
    # This module is imported once per process (the plugin imports it in every vLLM process); defining an op
    # twice would raise, so the import is the guard.
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op("cpu_int4_linear", int4_linear_impl, fake_impl=_linear_fake)
    direct_register_custom_op("cpu_int4_embedding", embedding_impl, fake_impl=_embedding_fake)
    direct_register_custom_op("cpu_int8_linear", int8_linear_impl, fake_impl=_int8_linear_fake)
    direct_register_custom_op("cpu_int8_embedding", int8_embedding_impl, fake_impl=_int8_embedding_fake)
    direct_register_custom_op("cpu_blocks_linear", blocks_linear_impl, fake_impl=_blocks_linear_fake)


_register()


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    mode: int,
    dequant_threshold: int,
    fp32_prefill: bool = False,
    avx2_rows: int = 0,
    avx2_bits: int = 16,
) -> torch.Tensor:
    """The registered op (what Dynamo records), typed for callers. With avx2_rows (the layer's config loaded the
    AVX2 kernels), the C++ op edge_avx2::int4_linear stands in front of it: decode rows never enter Python."""
    op = torch.ops.edge_avx2.int4_linear if avx2_rows else torch.ops.vllm.cpu_int4_linear
    return op(
        x, packed, scales_and_zeros, qweight, scales, zeros, group, mode, dequant_threshold, fp32_prefill, avx2_rows,
        avx2_bits,
    )


def int4_embedding(
    ids: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    return torch.ops.vllm.cpu_int4_embedding(ids, qweight, scales, zeros, group)


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, dequant_threshold: int, avx2_rows: int = 0
) -> torch.Tensor:
    """The registered op for an 8-bit-set layer or head; with avx2_rows, the C++ op edge_avx2::int8_linear stands in
    front of it, as int4_linear's: decode rows never enter Python."""
    op = torch.ops.edge_avx2.int8_linear if avx2_rows else torch.ops.vllm.cpu_int8_linear
    return op(x, qweight, scales, dequant_threshold, avx2_rows)


def blocks_linear(x: torch.Tensor, blocks: torch.Tensor, dequant_threshold: int, avx2_rows: int = 0) -> torch.Tensor:
    """The registered op for a layer of a GGUF's own 8-bit-set blocks; with avx2_rows, the C++ op
    edge_avx2::blocks_linear stands in front of it, as int4_linear's: decode rows never enter Python."""
    op = torch.ops.edge_avx2.blocks_linear if avx2_rows else torch.ops.vllm.cpu_blocks_linear
    return op(x, blocks, dequant_threshold, avx2_rows)


def int8_embedding(ids: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, cpp: bool = False) -> torch.Tensor:
    """The 8-bit set's embedding lookup; cpp (the AVX2 extension is loaded): edge_avx2::int8_embedding, the same values
    without a call back into Python from the compiled graph."""
    op = torch.ops.edge_avx2.int8_embedding if cpp else torch.ops.vllm.cpu_int8_embedding
    return op(ids, qweight, scales)
