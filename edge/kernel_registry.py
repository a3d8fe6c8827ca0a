"""The candidate linear kernels, as data: what each serves, the op and library it needs, its weight format.

`edge/` reads this table (the cost model, the gates' wording, `edge-calibrate --list`); `kernels.calibrate` holds
one timing function per entry (a test checks the two name the same kernels). Adding a kernel means adding an entry
here and a timer there.

Roles, by the rows M of one call:
    all       the kernel runs every batch the path sends it
    decode    the path sends it batches below the dequant threshold (one row per sequence when decoding)
    prefill   the path sends it batches from the threshold up (a prompt)
A kernel that serves no plan path is timed for the record all the same: it is what the paths are compared to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from edge.plan import Layout, WeightPath

Role = Literal["all", "decode", "prefill"]
WeightFormat = Literal["bf16", "int4-tinygemm", "int4-rowmajor", "int4-gptq", "int8-channel"]
Library = Literal["torch", "vllm"]


@dataclass(frozen=True)
class Serves:
    path: WeightPath
    layouts: tuple[Layout, ...] | None  # None: a path without layouts
    role: Role


@dataclass(frozen=True)
class KernelSpec:
    name: str
    description: str
    op: str  # the native op, as torch.ops spells it
    library: Library  # torch's own ops, or the native library vLLM loads on the host (_C, _C_AVX512, _C_AVX2)
    weight_format: WeightFormat
    quantizes_activations: bool
    serves: tuple[Serves, ...] = ()


_W4A16 = "w4a16-tinygemm"

KERNELS: dict[str, KernelSpec] = {
    spec.name: spec
    for spec in (
        KernelSpec("bf16", "bf16 GEMM against bf16 weights (oneDNN)", "aten::linear", "torch", "bf16", False,
                   (Serves("bf16", None, "all"),)),
        KernelSpec("tinygemm", "PyTorch's int4 kernel on the host's tinygemm layout",
                   "aten::_weight_int4pack_mm_for_cpu", "torch", "int4-tinygemm", False,
                   (Serves(_W4A16, ("kernel-only",), "all"), Serves(_W4A16, ("direct", "dual"), "decode"))),
        KernelSpec("dequant-bf16", "dequantize the int4 weight to bf16, then a bf16 GEMM",
                   "aten::_weight_int4pack_mm_for_cpu + aten::mm", "torch", "int4-tinygemm", False,
                   (Serves(_W4A16, ("direct", "dual"), "prefill"),)),
        KernelSpec("dequant-fp32", "dequantize the int4 weight to fp32, then an fp32 GEMM",
                   "aten::_weight_int4pack_mm_for_cpu + aten::mm", "torch", "int4-tinygemm", False,
                   (Serves(_W4A16, ("direct", "dual"), "prefill"),)),
        # Serves no layout by itself: a plan picks it for decode rows with quantization_config's decode_kernel
        # (edge.kernel_params), where a record timed it faster than tinygemm at 1 row.
        KernelSpec("avx2-int4", "this project's AVX2 int4 GEMV on the row-major copy, activations rounded to int16 "
                   "per group (kernels/avx2_int4.cpp)", "edge_avx2::w4a16_linear", "torch", "int4-rowmajor", False),
        KernelSpec("avx2-w4a8", "this project's AVX2 int4 GEMV on the row-major copy, activations quantized to int8 "
                   "per group (kernels/avx2_int4.cpp)", "edge_avx2::w4a8_linear", "torch", "int4-rowmajor", True),
        KernelSpec("int8", "int8 weights per output channel, bf16 activations (the 8-bit set: head, embedding)",
                   "aten::_weight_int8pack_mm", "torch", "int8-channel", False),
        # The 8-bit set's decode rows where decode_kernel names an AVX2 kernel (edge.kernel_params).
        KernelSpec("avx2-int8", "this project's AVX2 GEMV for the 8-bit set's int8 weights per channel, activations "
                   "rounded to int16 per group of 32 (kernels/avx2_int4.cpp)", "edge_avx2::w8a16_linear", "torch",
                   "int8-channel", False),
        KernelSpec("vllm-wna16", "vLLM's GPTQ/AWQ kernel (what a GPTQ checkpoint gets without W4A8)",
                   "_C::cpu_gemm_wna16", "vllm", "int4-gptq", False),
        KernelSpec("vllm-w4a8", "vLLM's int4 x int8 kernel (activations quantized to int8 per row)",
                   "_C::int4_scaled_mm_cpu", "vllm", "int4-gptq", True,
                   (Serves("w4a8-gptq", None, "all"),)),
        KernelSpec("onednn-int8", "oneDNN int8 x int8 GEMM (W8A8, dynamic per-token activation scales)",
                   "_C::onednn_scaled_mm", "vllm", "int8-channel", True),
    )
}  # fmt: skip

# Which kernel runs a layer stored in this format when the path's own 4-bit kernel does not (edge.quantized_layers:
# the 8-bit set is int8 per channel, layers kept in bf16 run the bf16 GEMM).
FORMAT_KERNEL: dict[str, str] = {"int8": "int8", "bf16": "bf16"}
PREFILL_KERNELS: dict[str, str] = {"bfloat16": "dequant-bf16", "float32": "dequant-fp32"}  # by prefill_dtype


def kernels_for(path: WeightPath, layout: Layout | None, role: Role) -> list[str]:
    """The kernels that run a path's 4-bit (or bf16) layers for batches of this role."""
    return [spec.name for spec in KERNELS.values() for s in spec.serves
            if s.path == path and (s.layouts is None or layout in s.layouts) and s.role in (role, "all")]  # fmt: skip
