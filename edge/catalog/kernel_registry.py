"""The candidate linear kernels, as data: one spec per kernel, the one place a kernel's name and facts are written.

A spec says what the kernel serves (a path's layouts, for batches of a role), the op and library it needs, its
weight format, the bits it rounds activations to, whether that changes the numbers (`lossy`: quality records are
then keyed on it), which ISA classes run it, the facts-table times that stand in for a calibration record, and,
for a decode kernel, the `decode_kernel` value of quantization_config that selects it (edge.measure.kernel_params) with
the kernel that then runs the 8-bit set's decode rows.

Everything that lists kernels derives from this table: the cost model (edge.measure.cost), the ranking's facts-table
record (edge.measure.rank), the quality key (edge.measure.quality), the kernel parameters (edge.measure.kernel_params),
`edge-calibrate` (kernels.calibrate.calibrate, whose timers build each kernel's weights in its format: the format's
torch half in kernels.formats holds one per entry, and a test checks they name the same kernels) and the plugin
(kernels.vllm_plugin.cpu_int4, kernels.ops.int4_ops). A kernel's `weight_format` is one of the layouts a format of
edge.formats stores. Adding a kernel is an entry here, its implementation, its timer and its tests.

Roles, by the rows M of one call:
    all       the kernel runs every batch the path sends it
    decode    the path sends it batches below the dequant threshold (one row per sequence when decoding)
    prefill   the path sends it batches from the threshold up (a prompt)
A kernel that serves no plan path is timed for the record all the same: it is what the paths are compared to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from edge.catalog.weight_paths import METHODS, Layout, WeightPath
from edge.facts import fact

Role = Literal["all", "decode", "prefill"]
WeightFormat = Literal["bf16", "int4-tinygemm", "int4-rowmajor", "int4-gptq", "int8-channel"]
Library = Literal["torch", "vllm"]


@dataclass(frozen=True)
class Serves:
    path: WeightPath
    layouts: tuple[Layout, ...] | None  # None: a path without layouts
    role: Role


@dataclass(frozen=True)
class FactTime:
    """A facts-table time that stands in for the kernel's calibration: `<isa class>.<suffix>` at N x K, M rows."""

    n: int
    k: int
    m: int
    suffix: str


@dataclass(frozen=True)
class DecodeChoice:
    """The kernel runs a w4a16 layer's decode rows where quantization_config's `decode_kernel` names it."""

    name: str  # the decode_kernel value
    label: str  # in a plan's reasons
    eight_bit: str  # the kernel that then runs the 8-bit set's decode rows
    max_rows_fact: str | None = None  # batches of up to that many rows take it (None: every batch tinygemm takes)
    # Without a calibration record: the decode kernel a device at this torch CPU capability gets (faster there),
    # and, for a lossy one, where the speed priority tries it (where a quality record allows).
    default_at: tuple[str, ...] = ()
    offered_at: tuple[str, ...] = ()


@dataclass(frozen=True)
class KernelSpec:
    name: str
    description: str
    op: str  # the native op, as torch.ops spells it
    library: Library  # torch's own ops, or the native library vLLM loads on the host (_C, _C_AVX512, _C_AVX2)
    weight_format: WeightFormat
    activation_bits: int | None  # what it rounds activations to (16, 8); None: bf16 or fp32 as they come
    lossy: bool  # its arithmetic changes the numbers beyond the weights' own rounding (int8 activations)
    isa_classes: tuple[str, ...]  # the ISA classes that run it (edge.device.profile.DeviceProfile.isa_class)
    serves: tuple[Serves, ...] = ()
    facts: tuple[FactTime, ...] = ()
    decode: DecodeChoice | None = None
    k_multiple: int | None = None  # K must be a multiple of this (activations rounded in groups along K)

    @property
    def quantizes_activations(self) -> bool:
        return self.activation_bits is not None and self.activation_bits <= 8


_W4A16 = "w4a16-tinygemm"
_X86 = ("amx", "avx512", "avx2")
_AVX2_ROWS = "avx2.avx2_int4_decode_rows"  # the measured crossover with tinygemm under AVX2 dispatch (facts)


def _times(*points: tuple[int, int, int, str]) -> tuple[FactTime, ...]:
    return tuple(FactTime(*point) for point in points)


KERNELS: dict[str, KernelSpec] = {
    spec.name: spec
    for spec in (
        KernelSpec("bf16", "bf16 GEMM against bf16 weights (oneDNN)", "aten::linear", "torch", "bf16", None, False,
                   _X86 + ("arm",), (Serves("bf16", None, "all"),),
                   _times((4096, 4096, 1, "1t.gemm.m1.bf16_ms"), (4096, 4096, 512, "1t.gemm.m512.bf16_ms"))),
        KernelSpec("tinygemm", "PyTorch's int4 kernel on the host's tinygemm layout",
                   "aten::_weight_int4pack_mm_for_cpu", "torch", "int4-tinygemm", None, False, _X86 + ("arm",),
                   (Serves(_W4A16, ("kernel-only",), "all"), Serves(_W4A16, ("direct", "dual"), "decode")),
                   _times((4096, 4096, 1, "1t.gemm.m1.int4_ms"), (4096, 4096, 512, "1t.gemm.m512.int4_ms")),
                   DecodeChoice("tinygemm", "tinygemm", "int8")),
        KernelSpec("dequant-bf16", "dequantize the int4 weight to bf16, then a bf16 GEMM",
                   "aten::_weight_int4pack_mm_for_cpu + aten::mm", "torch", "int4-tinygemm", None, False,
                   _X86 + ("arm",), (Serves(_W4A16, ("direct", "dual"), "prefill"),),
                   _times((4096, 4096, 512, "1t.dequant_bf16.m512_ms"))),
        KernelSpec("dequant-fp32", "dequantize the int4 weight to fp32, then an fp32 GEMM",
                   "aten::_weight_int4pack_mm_for_cpu + aten::mm", "torch", "int4-tinygemm", None, False,
                   _X86 + ("arm",), (Serves(_W4A16, ("direct", "dual"), "prefill"),),
                   _times((4096, 4096, 512, "1t.dequant_fp32.m512_ms"))),
        # Serves no layout by itself: a plan picks it for decode rows with quantization_config's decode_kernel
        # (edge.measure.kernel_params): under AVX2 dispatch (torch's AVX2 tinygemm is 2-4x slower, docs/reports) or
        # where a calibration record timed it faster than tinygemm at 1 row. Its int16 activations give tinygemm's
        # numbers (edge-eval: KLD difference < 0.001, docs/reports/2026-11-30-avx2-kernel.md): not lossy.
        KernelSpec("avx2-int4", "this project's AVX2 int4 GEMV on the row-major copy, activations rounded to int16 "
                   "per group (kernels/ops/avx2_int4.cpp)", "edge_avx2::w4a16_linear", "torch", "int4-rowmajor", 16,
                   False, _X86,
                   facts=_times((4096, 4096, 1, "1t.gemm.m1.avx2_int16_ms"),
                                (4096, 4096, 4, "1t.gemm.m4.avx2_int16_ms")),
                   decode=DecodeChoice("avx2", "the AVX2 int4 kernel", "avx2-int8", _AVX2_ROWS, default_at=("AVX2",))),
        # int8 activations: faster still, chosen for speed only where an edge-eval record shows the floor holds.
        KernelSpec("avx2-w4a8", "this project's AVX2 int4 GEMV on the row-major copy, interleaved by 8 output channels "
                   "at load (kernels/ops/avx2_int4.py decode_layout), activations quantized to int8 per group "
                   "(kernels/ops/avx2_int4.cpp)", "edge_avx2::w4a8_linear", "torch", "int4-rowmajor", 8, True,
                   _X86,
                   facts=_times((4096, 4096, 1, "1t.gemm.m1.avx2_int8_ms"), (4096, 4096, 4, "1t.gemm.m4.avx2_int8_ms")),
                   decode=DecodeChoice("avx2-w4a8", "the AVX2 int8-activation kernel", "avx2-int8", _AVX2_ROWS,
                                       offered_at=("AVX2",))),
        KernelSpec("int8", "int8 weights per output channel, bf16 activations (the 8-bit set: head, embedding)",
                   "aten::_weight_int8pack_mm", "torch", "int8-channel", None, False, _X86 + ("arm",),
                   facts=_times((49152, 576, 1, "1t.int8.m1_ms"))),
        # The 8-bit set's decode rows where decode_kernel names an AVX2 kernel (its DecodeChoice.eight_bit), and
        # every batch below the dequant threshold of a set stored per group (GROUPED_INT8_KERNEL): the same loop
        # with one more multiply per group of 32 (or two at 16), timed per channel (kernels.calibrate) and
        # measured against it in benchmarks/avx2_gemv.py.
        KernelSpec("avx2-int8", "this project's AVX2 GEMV for the 8-bit set's int8 weights, per channel or per "
                   "group of 16 or 32, activations rounded to int16 per group of 32 (kernels/ops/avx2_int4.cpp)",
                   "edge_avx2::w8a16_linear", "torch", "int8-channel", 16, False, _X86,
                   facts=_times((49152, 576, 1, "1t.int8.avx2_m1_ms")), k_multiple=32),
        KernelSpec("vllm-wna16", "vLLM's GPTQ/AWQ kernel (what a GPTQ checkpoint gets without W4A8)",
                   "_C::cpu_gemm_wna16", "vllm", "int4-gptq", None, False, _X86),
        KernelSpec("vllm-w4a8", "vLLM's int4 x int8 kernel (activations quantized to int8 per row)",
                   "_C::int4_scaled_mm_cpu", "vllm", "int4-gptq", 8, True, ("amx", "avx512"),
                   (Serves("w4a8-gptq", None, "all"),),
                   _times((4096, 4096, 1, "1t.gemm.m1.w4a8_ms"), (4096, 4096, 512, "1t.gemm.m512.w4a8_ms"))),
        # ARM's: vLLM's aarch64 `_C` has no int4_scaled_mm_cpu, so w4a8-gptq's checkpoint runs on KleidiAI there
        # (kernels/ops/kleidiai.py: group 32, activations rounded to int8 per row). No facts-table times: nothing has
        # timed it on ARM hardware (an ARM box's calibration record does).
        KernelSpec("kleidiai-w4a8", "KleidiAI's int4 x int8 kernels through torch's _dyn_quant_matmul_4bit "
                   "(activations quantized to int8 per row; symmetric int4 per group of 32)",
                   "aten::_dyn_quant_matmul_4bit", "torch", "int4-gptq", 8, True, ("arm",),
                   (Serves("w4a8-gptq", None, "all"),), k_multiple=32),
        KernelSpec("onednn-int8", "oneDNN int8 x int8 GEMM (W8A8, dynamic per-token activation scales)",
                   "_C::onednn_scaled_mm", "vllm", "int8-channel", 8, True, _X86),
    )
}  # fmt: skip

# Which kernel runs a layer stored in this format when the path's own 4-bit kernel does not
# (edge.catalog.quantized_layers: the 8-bit set is int8 per channel, layers kept in bf16 run the bf16 GEMM).
FORMAT_KERNEL: dict[str, str] = {"int8": "int8", "bf16": "bf16"}
# ... and for its batches from the dequant threshold, where the format's layers dequantize to bf16 and run the bf16
# GEMM (kernels.ops.int4_ops.int8_linear_impl): timed as the int4 dequantize + bf16 kernel, the same GEMM after a
# dequantize of the same [N, K] (PyTorch's int8 kernel, timed at every M, is never what runs there).
WIDE_BATCH_KERNEL: dict[str, str] = {"int8": "dequant-bf16"}
PREFILL_KERNELS: dict[str, str] = {"bfloat16": "dequant-bf16", "float32": "dequant-fp32"}  # by prefill_dtype


def kernels_for(path: WeightPath, layout: Layout | None, role: Role, isa_class: str | None = None) -> list[str]:
    """The kernels that run a path's 4-bit (or bf16) layers for batches of this role (on this ISA class, when given)."""
    return [spec.name for spec in KERNELS.values() for s in spec.serves
            if s.path == path and (s.layouts is None or layout in s.layouts) and s.role in (role, "all")
            and (isa_class is None or isa_class in spec.isa_classes)]  # fmt: skip


# --- decode kernels (quantization_config's decode_kernel) -----------------------------------------------------------

DECODE_KERNELS: dict[str, KernelSpec] = {spec.decode.name: spec for spec in KERNELS.values() if spec.decode}
DEFAULT_DECODE_KERNEL = "tinygemm"  # what a w4a16 checkpoint without decode_kernel runs


def decode_kernel(name: str) -> KernelSpec:
    """The kernel a decode_kernel value selects."""
    return DECODE_KERNELS[name]


def decode_rows(name: str) -> int | None:
    """Batches of up to this many rows take the decode kernel instead of tinygemm; None: it is tinygemm."""
    choice = DECODE_KERNELS[name].decode
    return int(fact(choice.max_rows_fact).value) if choice.max_rows_fact else None


# The decode_kernel values whose arithmetic changes the numbers: quality records are keyed on them.
LOSSY_DECODE_KERNELS: tuple[str, ...] = tuple(name for name, spec in DECODE_KERNELS.items() if spec.lossy)


# Decode kernels that come with kernels reading a GGUF's own blocks (edge.catalog.quantized_layers.OWN_BLOCK_TYPES:
# kernels/ops/q4k.py, q6k.py, g32.py; int8 activations, the decode layout of 8 channels; torch.ops.edge_avx2.q4k_linear,
# blocks_linear), so a plan on one keeps them for the weights the file holds so (rules_for's own_blocks): Q4_K at 4.5
# bits where the int4 grid holds 5, Q6_K at 6.5625, Q8_0 at 8.5 and Q5_0 at 5.5 where the 8-bit set holds 10, the
# file's scales unrounded.
# A path whose 4-bit layers quantize activations to int8 (W4A8: MethodSpec.int8_activations) runs its 8-bit set on
# those kernels too, whatever its w4a16 decode kernel: they quantize no more than the path itself does.
# EDGE_OWN_BLOCKS=0 plans the grids for them instead (benchmarks compare the two: bench_serve's +grid).
OWN_BLOCK_DECODE_KERNELS: tuple[str, ...] = ("avx2-w4a8",)
OWN_BLOCKS_ENV = "EDGE_OWN_BLOCKS"


def reads_own_blocks(decode: str, path: str | None = None) -> bool:
    """Whether a plan on this path whose decode rows run on this decode kernel keeps a GGUF's own blocks
    (OWN_BLOCK_TYPES; edge.catalog.quantized_layers.rules_for says which of them the path's methods keep)."""
    w4a8 = path is not None and any(m.int8_activations for m in METHODS.values() if m.path == path)
    return (decode in OWN_BLOCK_DECODE_KERNELS or w4a8) and os.environ.get(OWN_BLOCKS_ENV) != "0"


def default_decode_kernel(capability: str | None, isa_class: str) -> str:
    """The decode kernel a device of this ISA class at this torch CPU capability gets without a calibration
    record: one whose spec runs on the class (`isa_classes`) and defaults at the capability."""
    return next((name for name, spec in DECODE_KERNELS.items()
                 if isa_class in spec.isa_classes and capability in spec.decode.default_at), DEFAULT_DECODE_KERNEL)


def offered_lossy_decode_kernel(capability: str | None, isa_class: str) -> str | None:
    """The lossy decode kernel the speed priority tries on such a device without a calibration record."""
    return next((name for name, spec in DECODE_KERNELS.items()
                 if isa_class in spec.isa_classes and capability in spec.decode.offered_at), None)


# The kernel an 8-bit set stored per group (int8_group_size) runs below the dequant threshold: PyTorch's int8 GEMM
# takes one scale per channel only.
GROUPED_INT8_KERNEL = "avx2-int8"


def runs_grouped_int8(isa_class: str) -> bool:
    """Whether a device of this class runs a per-group 8-bit set's narrow batches on a kernel (elsewhere each
    such batch would dequantize the whole weight, the head included, every decode step)."""
    return isa_class in KERNELS[GROUPED_INT8_KERNEL].isa_classes


def grouped_int8_kernel(k: int) -> str:
    """The kernel a per-group int8 layer's narrow batches run at this K: the AVX2 one where K suits it; else the
    layer dequantizes, counted at PyTorch's int8 kernel's times (no faster)."""
    multiple = KERNELS[GROUPED_INT8_KERNEL].k_multiple
    return GROUPED_INT8_KERNEL if multiple is None or k % multiple == 0 else FORMAT_KERNEL["int8"]


def eight_bit_kernel(decode: str, k: int) -> str:
    """The kernel that runs an 8-bit-set layer's decode rows with this decode kernel, at this K."""
    name = DECODE_KERNELS[decode].decode.eight_bit
    multiple = KERNELS[name].k_multiple
    return name if multiple is None or k % multiple == 0 else FORMAT_KERNEL["int8"]
