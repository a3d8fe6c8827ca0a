"""`cpu_int4` layers as plain nn.Modules, for edge-eval: the engine's ops outside the engine.

Each module holds what kernels.vllm_plugin.cpu_int4 keeps on a vLLM layer after loading (the tinygemm buffer from
kernels.ops.tinygemm.to_tinygemm, plus the row-major tensors only where its mode reads them) and calls the body of
the op vLLM runs: kernels.ops.int4_ops.int4_linear_impl / embedding_impl for int4 layers, int8_linear_impl /
int8_embedding_impl for the 8-bit set (kernels/ops/int8.py: qweight int8 [N, K], scales [N] or [N, K/g]). The
settings come from the checkpoint's quantization_config through the engine's own parser
(CpuInt4Config.from_config: the same defaults for missing fields, the same refusal of a checkpoint planned for
another tinygemm block), so the modules run the branch the engine runs for the same number of rows, in the same
prefill dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edge.catalog.kernel_registry import DEFAULT_DECODE_KERNEL
from edge.catalog.quantized_layers import OWN_BLOCK_TYPES, matches
from edge.errors import InputError
from edge.model.gguf_metadata import GGML_BLOCKS
from kernels.ops import avx2_int4, q4k
from kernels.ops.int4_ops import (
    DIRECT,
    DUAL,
    KERNEL_ONLY,
    MODES,
    blocks_decode_layout_,
    blocks_linear_impl,
    embedding_impl,
    int4_linear_impl,
    int8_embedding_impl,
    int8_linear_impl,
)
from kernels.ops.layout import host_layout
from kernels.ops.tinygemm import tiles, to_tinygemm
from kernels.scoring.eval_modules import prefix_of, replace_embedding, replace_module, submodule

__all__ = ["BlocksLinear", "Int4Embedding", "Int4Linear", "Int4Settings", "Int8Embedding", "Int8Linear", "blocks_type",
           "install_cpu_int4"]


@dataclass(frozen=True)
class Int4Settings:
    group: int
    mode: int  # for a layer whose N tiles the host block; DIRECT falls back to DUAL per layer
    dequant_threshold: int
    fp32_prefill: bool
    # decode_kernel "avx2"/"avx2-w4a8": every row runs that AVX2 kernel (its activation bits), so each scored
    # position is computed as a decoded token is; None: tinygemm and the dequantize branch, as configured.
    avx2_bits: int | None = None
    # the 8-bit set's batches of up to this many rows run the AVX2 int8 kernel, as the engine's
    # (kernels.vllm_plugin.cpu_int4.int8_rows: a per-group set's below the threshold); 0: never
    int8_rows: int = 0


def engine_settings(qconfig: dict[str, Any]) -> Int4Settings:
    """What the engine makes of this quantization_config on this host (InputError when it would refuse it)."""
    from kernels.vllm_plugin.cpu_int4 import CpuInt4Config  # imports vLLM's layer classes

    config = CpuInt4Config.from_config(qconfig)
    if config.decode_kernel != DEFAULT_DECODE_KERNEL and not config.avx2_rows:
        raise InputError("quantization_config.decode_kernel", config.decode_kernel,
                         f"a decode kernel that runs here ({avx2_int4.load()})")  # fmt: skip
    return Int4Settings(config.group_size, config.mode, config.dequant_threshold, config.prefill_dtype == "float32",
                        config.avx2_bits if config.avx2_rows else None, config.int8_rows)  # fmt: skip


class Int4Linear(nn.Module):
    """y = x @ w.T (+ bias) through kernels.ops.int4_ops.int4_linear_impl; weights from the row-major checkpoint."""

    def __init__(
        self,
        qweight: torch.Tensor,  # [N, K/2] uint8
        scales: torch.Tensor,  # [N, K/g] bf16
        zeros: torch.Tensor,  # [N, K/g] bf16
        settings: Int4Settings,
        *,
        mode: int | None = None,
        bias: torch.Tensor | None = None,
        meta: torch.Tensor | None = None,  # [N, K/256 * 16] uint8: a GGUF's own Q4_K blocks (scales, zeros their grid)
    ) -> None:
        super().__init__()
        n, group = qweight.shape[0], settings.group
        mode = settings.mode if mode is None else mode
        if meta is not None:  # as kernels.vllm_plugin.cpu_int4.CpuQ4kLinearMethod: no bf16 grid kept for dual
            mode = DIRECT if mode != KERNEL_ONLY and tiles(n, host_layout()) else KERNEL_ONLY
        elif mode == DIRECT and not tiles(n, host_layout()):
            # as kernels.vllm_plugin.cpu_int4._repack: the direct dequantizer cannot read a narrower last block
            mode = DUAL
        packed, scales_and_zeros = to_tinygemm(qweight, scales, zeros, group)
        self.register_buffer("packed", packed)  # [N, K/2] uint8, host layout
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [K/g, N, 2] bf16
        keep = mode == DUAL or settings.avx2_bits is not None  # the engine drops it elsewhere
        if meta is not None and settings.avx2_bits is not None:  # the blocks in the decode layout, meta as `scales`
            (qweight, scales), zeros = q4k.decode_layout(qweight, meta), torch.empty(0, dtype=torch.bfloat16)
        elif mode != DUAL and settings.avx2_bits is not None:  # as the engine (kernels.vllm_plugin.cpu_int4._repack)
            qweight, scales, zeros = avx2_int4.decode_layout(qweight, scales, zeros, settings.avx2_bits)
        self.register_buffer("qweight", qweight if keep else torch.empty(0, dtype=torch.uint8))
        self.register_buffer("scales", scales if keep else torch.empty(0, dtype=torch.bfloat16))
        self.register_buffer("zeros", zeros if keep else torch.empty(0, dtype=torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.group, self.mode, self.settings = group, mode, settings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        settings = self.settings
        if settings.avx2_bits is not None and self.qweight.numel():
            x = x.to(torch.bfloat16)
            if self.scales.dtype == torch.uint8:  # Q4_K blocks
                y = q4k.linear(x, self.qweight, self.scales)
            else:
                y = avx2_int4.linear(x, self.qweight, self.scales, self.zeros, self.group, settings.avx2_bits)
            return y if self.bias is None else y + self.bias
        y = int4_linear_impl(x, self.packed, self.scales_and_zeros, self.qweight, self.scales, self.zeros, self.group,
                         self.mode, settings.dequant_threshold, fp32_prefill=settings.fp32_prefill)  # fmt: skip
        return y if self.bias is None else y + self.bias


class Int4Embedding(nn.Module):
    """ids -> rows through kernels.ops.int4_ops.embedding_impl (dequantizes only the gathered rows)."""

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, settings: Int4Settings
    ) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # [V, H/2] uint8
        self.register_buffer("scales", scales)  # [V, H/g] bf16
        self.register_buffer("zeros", zeros)  # [V, H/g] bf16
        self.group = settings.group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding_impl(ids, self.qweight, self.scales, self.zeros, self.group)


class Int8Linear(nn.Module):
    """y = x @ w.T (+ bias) through kernels.ops.int4_ops.int8_linear_impl; the checkpoint layout is the kernel's."""

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, settings: Int4Settings, *, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # [N, K] int8
        self.register_buffer("scales", scales)  # [N] bf16 or [N, K/g] float32
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.dequant_threshold = settings.dequant_threshold
        self.avx2 = settings.avx2_bits is not None  # every row on the AVX2 int8 kernel, as Int4Linear's
        self.int8_rows = settings.int8_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.avx2 and self.qweight.shape[1] % avx2_int4.INT8_K_MULTIPLE == 0:
            y = avx2_int4.int8_linear(x.to(torch.bfloat16), self.qweight, self.scales)
            return y if self.bias is None else y + self.bias
        y = int8_linear_impl(x, self.qweight, self.scales, self.dequant_threshold, self.int8_rows)
        return y if self.bias is None else y + self.bias


class BlocksLinear(nn.Module):
    """y = x @ w.T (+ bias) through kernels.ops.int4_ops.blocks_linear_impl on a GGUF's own Q6_K, Q8_0 or Q5_0 blocks
    (quantization_config.q6k, q8_0, q5_0), rearranged as the engine rearranges them; every row on the kernel when
    the settings say so (as Int8Linear's), else as the engine: the 8-bit set's rows on it, wider batches
    dequantized."""

    def __init__(self, blocks: torch.Tensor, type_name: str, settings: Int4Settings, *,
                 bias: torch.Tensor | None = None) -> None:  # fmt: skip
        super().__init__()
        self.register_buffer("blocks", blocks_decode_layout_(type_name, blocks.clone()))  # [N/8, K/block, 8 x bytes]
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.dequant_threshold = settings.dequant_threshold
        self.rows = 1 << 30 if settings.avx2_bits is not None else settings.int8_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = blocks_linear_impl(x, self.blocks, self.dequant_threshold, self.rows)
        return y if self.bias is None else y + self.bias


class Int8Embedding(nn.Module):
    """ids -> rows through kernels.ops.int4_ops.int8_embedding_impl (dequantizes only the gathered rows)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # [V, H] int8
        self.register_buffer("scales", scales)  # [V] bf16 or [V, H/g] float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return int8_embedding_impl(ids, self.qweight, self.scales)


def describe(
    qconfig: dict[str, Any], settings: Int4Settings, int4: list[str], int8: list[str], tied_head: str | None
) -> dict:
    """What runs, for the report."""
    dtype = "fp32" if settings.fp32_prefill else "bf16"
    wide = f"dequantize + {dtype} GEMM" if settings.mode != KERNEL_ONLY else "tinygemm"
    narrow = "tinygemm (_weight_int4pack_mm_for_cpu)"
    if settings.avx2_bits is not None:  # every row, as each decoded token is computed
        wide = narrow = (f"the AVX2 decode kernel, int{settings.avx2_bits} activations (edge_avx2), every row "
                         "(each position computed as a decoded token is)")  # fmt: skip
    return {
        "kernel": "kernels.ops.int4_ops.int4_linear_impl / embedding_impl (the bodies of vLLM's cpu_int4 ops)"
        + (", int8_linear_impl / int8_embedding_impl for the 8-bit set" if int8 else ""),
        "layout": MODES[settings.mode],
        "group_size": settings.group,
        "dequant_threshold": settings.dequant_threshold,
        "rows_at_or_above_threshold": wide,
        "rows_below_threshold": narrow,
        "tinygemm_block": host_layout().block,
        "int4_layers": len(int4),
        "int8_layers": int8,
        "tied_head": tied_head,
        "quantization_config": qconfig,
    }


def install_cpu_int4(
    model: nn.Module, quantized: dict[str, dict[str, torch.Tensor]], qconfig: dict[str, Any], tied: bool
) -> dict[str, Any]:
    """Each quantized layer becomes an int4 module, or an int8 one (the 8-bit set) when its qweight is int8."""
    settings = engine_settings(qconfig)
    embedding_prefix = prefix_of(model, model.get_input_embeddings())
    head_prefix = prefix_of(model, model.get_output_embeddings())
    int4, int8, tied_head = [], [], None
    for prefix, parts in quantized.items():
        module = submodule(model, prefix)
        bias = getattr(module, "bias", None)  # an embedding has none
        eight_bit = parts.get("qweight") is not None and parts["qweight"].dtype == torch.int8
        _check_parts(prefix, parts, module, settings.group, eight_bit, qconfig)
        if eight_bit:
            int8.append(prefix)
            weights = (parts["qweight"], parts["scales"])
            embedding, linear = Int8Embedding(*weights), Int8Linear(*weights, settings, bias=bias)
        elif "blocks" in parts:  # a GGUF's own Q6_K, Q8_0 or Q5_0 blocks: a linear or an untied head
            int8.append(prefix)
            replace_module(model, prefix, BlocksLinear(parts["blocks"], blocks_type(prefix, qconfig), settings,
                                                       bias=bias))  # fmt: skip
            continue
        elif "meta" in parts:  # a GGUF's own Q4_K blocks (quantization_config.q4k): a linear, never the embedding
            int4.append(prefix)
            scales, zeros = q4k.int4_grid(parts["meta"])
            replace_module(model, prefix, Int4Linear(parts["qweight"], scales, zeros, settings, bias=bias,
                                                     meta=parts["meta"]))  # fmt: skip
            continue
        else:
            int4.append(prefix)
            weights = (parts["qweight"], parts["scales"], parts["zeros"], settings)
            embedding, linear = Int4Embedding(*weights), Int4Linear(*weights, bias=bias)
        if prefix != embedding_prefix:
            replace_module(model, prefix, linear)
            continue
        replace_embedding(model, prefix, embedding)
        if tied:  # the head reuses the embedding's tensors; int4 in dual mode (kernels.vllm_plugin.cpu_int4)
            head = Int8Linear(*weights, settings) if eight_bit else Int4Linear(*weights, mode=DUAL)
            replace_module(model, head_prefix, head)
            tied_head = "int8, the embedding's tensors" if eight_bit else "int4 dual mode, the embedding's tensors"
    return describe(qconfig, settings, sorted(int4), sorted(int8), tied_head)


def blocks_type(prefix: str, qconfig: dict[str, Any]) -> str:
    """The GGML type whose blocks the checkpoint holds for an 8-bit-set weight: the key of quantization_config that
    names it (q6k, q8_0, q5_0)."""
    for type_name, own in OWN_BLOCK_TYPES.items():
        if own.format == "int8" and matches(prefix, qconfig.get(own.key) or ()):
            return type_name
    keys = ", ".join(own.key for own in OWN_BLOCK_TYPES.values() if own.format == "int8")
    raise InputError(f"{prefix}.blocks", "present", f"a weight named in quantization_config's {keys}")


def _check_parts(prefix: str, parts: dict[str, torch.Tensor], module: nn.Module, group: int, eight_bit: bool,
                 qconfig: dict[str, Any]) -> None:  # fmt: skip
    if "blocks" in parts:  # a type's blocks: [N, K/block * block bytes]
        type_name = blocks_type(prefix, qconfig)
        weights, nbytes = GGML_BLOCKS[type_name]
        n, k = (module.out_features, module.in_features) if isinstance(module, nn.Linear) else (0, 0)
        if tuple(parts["blocks"].shape) != (n, k // weights * nbytes) or parts["blocks"].dtype != torch.uint8:
            raise InputError(f"{prefix}.blocks", f"{parts['blocks'].dtype} {list(parts['blocks'].shape)}",
                             f"uint8 [{n}, {k // weights * nbytes}]: {type_name} blocks of a linear [N, K] = "
                             f"[{n}, {k}]")  # fmt: skip
        return
    blocks = "meta" in parts
    needed = ("qweight", "scales") if eight_bit else ("qweight", "meta") if blocks else ("qweight", "scales", "zeros")
    missing = [s for s in needed if s not in parts]
    if missing:
        raise InputError(f"{prefix}.{missing[0]}", "missing", f"{', '.join(needed)} for each cpu_int4 layer")
    if isinstance(module, nn.Embedding):
        n, k = module.weight.shape  # [V, H]
    elif isinstance(module, nn.Linear):
        n, k = module.out_features, module.in_features
    else:
        raise InputError(f"{prefix}.qweight", type(module).__name__, "a linear or embedding layer of the source")
    if eight_bit:
        from kernels.ops.int8 import check_params

        expected = {"qweight": ((n, k), torch.int8)}
        check_params(parts["qweight"], parts["scales"], prefix)  # [N] or [N, K/g]
    elif blocks:
        expected = {"qweight": ((n, k // 2), torch.uint8), "meta": ((n, k // 256 * 16), torch.uint8)}
    else:
        expected = {"qweight": ((n, k // 2), torch.uint8), "scales": ((n, k // group), None),
                    "zeros": ((n, k // group), None)}  # fmt: skip
    for suffix, (shape, dtype) in expected.items():
        tensor = parts[suffix]
        if tuple(tensor.shape) != shape or (dtype is not None and tensor.dtype != dtype):
            raise InputError(f"{prefix}.{suffix}", f"{tensor.dtype} {list(tensor.shape)}",
                             f"{list(shape)} for the source's [N, K] = [{n}, {k}], group_size {group}")  # fmt: skip
