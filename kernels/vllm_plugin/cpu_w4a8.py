"""The `cpu_w4a8` vLLM quantization method: vLLM's own int4 x int8 kernel on CPUs without AMX.

vLLM 0.28 runs a GPTQ checkpoint through `int4_scaled_mm_cpu` (4-bit weights, activations quantized to int8 per
row) only where `torch.cpu._is_amx_tile_supported()` (vllm/model_executor/kernels/linear/mixed_precision/cpu.py);
elsewhere it sends it to `cpu_gemm_wna16`. The op itself lives in the `_C` library vLLM loads on every CPU with
AVX-512 and AVX512-BF16, and it runs there without AMX: on an AMD EPYC Zen 5 (avx512_bf16, avx512_vnni, no AMX),
4096x4096 group 64, 1 thread, M=1, it took 0.19 ms against tinygemm's 0.44 and bf16's 1.68, relative error 0.009
against the dequantized weights (docs/FACTS.md). This method calls it for every batch size, without touching
vLLM's global AMX check (other paths read it and would execute AMX instructions).

Reads the symmetric GPTQ checkpoint kernels/convert/convert.py writes for `w4a8-gptq` (kernels/ops/gptq.py: per linear
`<prefix>.qweight` int32 [K/8, N] packed along K, `.scales` bf16 [K/g, N], `.qzeros` int32 [K/g, N/8], w =
(q - 8) * scale) and converts it once at load exactly as vLLM's `_process_gptq_weights_w4a8` does: codes
repacked along N in AWQ's order, a zero point of 8 for every group (the checkpoint's qzeros are not read), then
`convert_weight_packed_scale_zp` into the op's blocked layout (32 output channels a block). The 8-bit set
(`int8`: the embedding and the head) runs kernels.vllm_plugin.cpu_int4's int8 methods, and its weights a GGUF holds as
Q6_K, Q8_0 or Q5_0 that method's blocks methods (`q6k`, `q8_0`, `q5_0`: the file's own blocks, int8 activations per
32); which weights are int4, int8 or bf16 is asked of edge.catalog.quantized_layers, as the plan's ledger and the
converter ask it. Every field comes from the checkpoint's `quantization_config`, which vLLM hashes into its
compile-cache key.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.layers.quantization import register_quantization_config

from edge.catalog.quantized_layers import EIGHT_BIT_SET
from edge.catalog.shape_rules import GPTQ_PARTITION_MULTIPLE
from edge.catalog.weight_paths import METHODS
from edge.errors import InputError
from edge.formats.gptq import GPTQ
from kernels.vllm_plugin.cpu_int4 import (
    EIGHT_BIT_BLOCKS,
    CpuInt8EmbeddingMethod,
    CpuInt8LinearMethod,
    PluginConfig,
    PluginWeights,
    eight_bit_block_methods,
    empty_param,
    host_params,
    int8_group_entry,
    int8_rows,
    own_block_entries,
    weight_param,
)

NAME = "cpu_w4a8"
PACK = 8  # 4-bit codes per int32
FAKE_ZERO = -2004318072  # 0x88888888: zero point 8 in every nibble (uint4b8), as vLLM allocates for symmetric GPTQ
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # vLLM repacks GPTQ codes into AWQ's nibble order before converting
ASYM_FORMAT = "gptq_v2"  # qzeros hold each group's zero as it is (an asymmetric checkpoint)
# quantization_config keys that say how the converter rounded (kernels/convert/gptq_pass.py), carried as they are
ROUNDING_KEYS = ("rounding", "smoothing", "calibration_windows")


# Which kernel runs the int4 layers: vLLM's int4_scaled_mm_cpu on x86, KleidiAI through torch's _dyn_quant ops on
# aarch64 (kernels/ops/kleidiai.py; vLLM's aarch64 `_C` has no int4_scaled_mm_cpu). EDGE_W4A8_KERNEL=kleidiai runs the
# latter on x86 through torch's reference code for the same ops: a stand-in that checks this method in the real
# engine, never KleidiAI itself (tests/kernels/test_w4a8_kleidiai_serve_slow.py).
KERNEL_ENV = "EDGE_W4A8_KERNEL"
KERNELS = ("int4_scaled_mm_cpu", "kleidiai")


def kernel() -> str:
    """The kernel this host's cpu_w4a8 layers run (KERNELS)."""
    import os
    import platform

    asked = os.environ.get(KERNEL_ENV, "")
    if asked:
        if asked not in KERNELS:
            raise InputError(KERNEL_ENV, asked, f"one of {', '.join(KERNELS)}")
        return asked
    return "kleidiai" if platform.machine().lower() in ("aarch64", "arm64") else "int4_scaled_mm_cpu"


def op_available() -> bool:
    """Whether the native library vLLM loaded on this CPU registers the W4A8 op and its weight converter."""
    import vllm._custom_ops  # noqa: F401  (loads _C, _C_AVX512 or _C_AVX2 by the CPU flags)

    return hasattr(torch.ops._C, "int4_scaled_mm_cpu") and hasattr(torch.ops._C, "convert_weight_packed_scale_zp")


def to_w4a8(qweight: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """GPTQ qweight int32 [K/8, N], scales [K/g, N] and, asymmetric, zeros int32 [K/g, N] (0..15; None: 8, as
    vLLM runs symmetric GPTQ) -> the op's (weight uint8 [N/32, K/g, ...], zeros int8 [N/32, K/g, 32], scales fp32
    [N/32, K/g, 32]), converted in slices of output channels (blocks never span them, so the result equals a
    whole-matrix conversion) to bound the int32 transient. The zeros go where vLLM's AWQ path puts its zero points:
    the kernel takes them as they are (asymmetric W4A8 needs nothing new in it)."""
    from vllm import _custom_ops as ops

    step = GPTQ.convert_chunk_channels  # the ledger books this chunk's transient (edge.formats.gptq)
    parts = [_convert(qweight[:, i : i + step], scales[:, i : i + step],
                      None if zeros is None else zeros[:, i : i + step], ops)
             for i in range(0, qweight.shape[1], step)]  # fmt: skip
    return tuple(torch.cat(tensors) for tensors in zip(*parts, strict=True))  # type: ignore[return-value]


def _convert(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             ops: Any) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """vLLM's _process_gptq_weights_w4a8 for one slice of output channels (its AWQ zero points where given)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    codes = unpack_quantized_values_into_int32(qweight.contiguous(), scalar_types.uint4b8, 0)  # [K, n] int32 0..15
    packed = _awq_packed(codes)  # [K, n/8]
    if zeros is None:
        packed_zeros = torch.full((scales.shape[0], codes.shape[1] // PACK), FAKE_ZERO, dtype=torch.int32)
    else:
        packed_zeros = _awq_packed(zeros)  # [K/g, n/8]
    return ops.convert_weight_packed_scale_zp(packed, packed_zeros, scales.contiguous(), ops.CPUQuantAlgo.AWQ)


def _awq_packed(values: torch.Tensor) -> torch.Tensor:
    """int32 values 0..15 [R, n] -> int32 [R, n/8], eight to a word along N in AWQ's nibble order: vLLM's GPTQ-to-AWQ
    repack, for the codes and the zero points alike."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import pack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    rows, n = values.shape
    ordered = values.reshape(rows, n // PACK, PACK)[:, :, AWQ_ORDER].reshape(rows, n)
    return pack_quantized_values_into_int32(ordered.contiguous(), scalar_types.uint4b8, 1).contiguous()


def w4a8_linear_impl(
    x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] -> [..., N] bf16 through int4_scaled_mm_cpu (it quantizes each row of x to int8 itself);
    weight, zeros, scales as to_w4a8 returns them, bias fp32 [N] (the op's dtype) or None."""
    n = scales.shape[0] * scales.shape[-1]
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()  # [M, K]
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], n), dtype=torch.bfloat16)
    y = torch.ops._C.int4_scaled_mm_cpu(x2, weight, zeros, scales, None if bias is None else bias.float())  # [M, N]
    return y.view(*x.shape[:-1], n)


def _linear_fake(
    x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], scales.shape[0] * scales.shape[-1]), dtype=torch.bfloat16)


def kleidiai_linear_impl(
    x: torch.Tensor, packed: torch.Tensor, k: int, n: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype through KleidiAI (kernels/ops/kleidiai.py)."""
    from kernels.ops import kleidiai

    if x.numel() == 0:
        return x.new_empty((*x.shape[:-1], n))
    y = kleidiai.linear(x, packed, k, n)
    return y if bias is None else y + bias.to(y.dtype)


def _kleidiai_fake(x: torch.Tensor, packed: torch.Tensor, k: int, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


def _register() -> None:
    # One op node per layer for Dynamo (as kernels.ops.int4_ops does); the module is imported once per process.
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op("cpu_w4a8_linear", w4a8_linear_impl, fake_impl=_linear_fake)
    direct_register_custom_op("cpu_w4a8_kleidiai", kleidiai_linear_impl, fake_impl=_kleidiai_fake)


_register()


def w4a8_linear(
    x: torch.Tensor, weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The registered op (what Dynamo records), typed for callers."""
    return torch.ops.vllm.cpu_w4a8_linear(x, weight, zeros, scales, bias)


def quantization_config(
    *, group_size: int = 64, int8: list[str] | tuple[str, ...] = EIGHT_BIT_SET,
    ignore: list[str] | None = None, dequant_threshold: int | None = None, int8_group_size: int | None = None,
    own_blocks: dict[str, list[str]] | None = None, sym: bool = True, rounding: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The `quantization_config` a plan writes for w4a8-gptq (edge.plan.engine_config), for tests and
    benchmarks; `int8=()` leaves the embedding and the head bf16; `own_blocks`: the 8-bit set's weights kept as a
    GGUF's own blocks, by key (q6k, q8_0, q5_0); `rounding`: the converter's GPTQ settings (ROUNDING_KEYS)."""
    return {
        "quant_method": NAME,
        "bits": 4,
        "group_size": group_size,
        "sym": sym,
        "desc_act": False,
        "checkpoint_format": "gptq" if sym else ASYM_FORMAT,
        **(rounding or {}),
        "dequant_threshold": host_params().dequant_threshold if dequant_threshold is None else dequant_threshold,
        "int8": list(int8),
        **int8_group_entry(int8_group_size),
        **{key: list(names) for key, names in (own_blocks or {}).items() if names},
        "ignore": list(ignore or []),
    }


@register_quantization_config(NAME)
class CpuW4A8Config(PluginConfig):
    """Symmetric 4-bit GPTQ weights, int8 activations, through vLLM's int4_scaled_mm_cpu on any x86 host with `_C`,
    and through KleidiAI on aarch64 (group 32), where a model may run in float16 (kernel_params.float_dtype)."""

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16] if kernel() == "kleidiai" else [torch.bfloat16]

    def __init__(
        self,
        group_size: int = 64,
        *,
        dequant_threshold: int | None = None,
        int8: list[str] | None = None,
        ignore: list[str] | None = None,
        int8_group_size: int | None = None,
        own_blocks: dict[str, list[str]] | None = None,
    ) -> None:
        super().__init__()
        GPTQ.check_method_config(group_size=group_size, dequant_threshold=dequant_threshold,
                                 int8_group_size=int8_group_size)  # fmt: skip
        self.group_size = group_size
        # the 8-bit set's switch from PyTorch's int8 GEMM to dequantize + bf16 (kernels.ops.int4_ops.cpu_int8_linear)
        self.dequant_threshold = host_params().dequant_threshold if dequant_threshold is None else dequant_threshold
        self.int8 = list(int8 or [])
        self.ignore = list(ignore or [])
        self.int8_group_size = int8_group_size
        self.int8_rows = int8_rows(int8_group_size, self.dequant_threshold)  # no AVX2 decode kernel here
        # the 8-bit set's weights kept as a GGUF's own blocks, by quantization_config key (q6k, q8_0, q5_0); never
        # q4k: the 4-bit layers are GPTQ tensors
        self.own_blocks = {key: list(names) for key, names in (own_blocks or {}).items() if names}
        for key, names in self.own_blocks.items():
            if key not in EIGHT_BIT_BLOCKS.values():
                raise InputError(f"quantization_config.{key}", names[:3],
                                 f"absent: {NAME} keeps a GGUF's own blocks for the 8-bit set only "
                                 f"({', '.join(EIGHT_BIT_BLOCKS.values())})")  # fmt: skip
        self.repack_chunk_rows = host_params().repack_chunk_rows  # the blocks' decode layout, rearranged in chunks
        self.tied_embeddings = False  # set from the HF config in maybe_update_config
        self.sym = True  # from_config: false for an asymmetric (gptq_v2) checkpoint
        self.rounding: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"CpuW4A8Config(group_size={self.group_size}, int8={self.int8}, ignore={self.ignore})"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuW4A8Config:
        wanted = {"quant_method": NAME, "bits": 4, "desc_act": False}
        for key, value in wanted.items():
            if config.get(key, value) != value:
                raise InputError(f"quantization_config.{key}", config.get(key), repr(value))
        sym = config.get("sym", True)
        if sym not in (True, False):
            raise InputError("quantization_config.sym", sym, "true or false")
        # an asymmetric checkpoint stores its zeros as they are (kernels/ops/gptq.py gptq_from_solved)
        checkpoint_format = config.get("checkpoint_format", "gptq" if sym else ASYM_FORMAT)
        if checkpoint_format != ("gptq" if sym else ASYM_FORMAT):
            raise InputError("quantization_config.checkpoint_format", checkpoint_format,
                             repr("gptq" if sym else ASYM_FORMAT) + f" with sym {str(sym).lower()}")  # fmt: skip
        if not sym and kernel() == "kleidiai":
            raise InputError("quantization_config.sym", False,
                             "true on this host: KleidiAI's int4 kernels take no zero points")  # fmt: skip
        made = cls(
            group_size=int(config.get("group_size", 64)),
            dequant_threshold=config.get("dequant_threshold"),
            int8=list(config.get("int8", [])),
            ignore=list(config.get("ignore", [])),
            int8_group_size=config.get("int8_group_size"),
            own_blocks=own_block_entries(config),
        )
        made.sym = sym
        # how the converter rounded (kernels/convert/gptq_pass.py); the engine reads the tensors either way
        made.rounding = {key: config[key] for key in ROUNDING_KEYS if key in config}
        return made

    def to_dict(self) -> dict[str, Any]:
        return quantization_config(group_size=self.group_size, int8=self.int8, ignore=self.ignore,
                                   dequant_threshold=self.dequant_threshold,
                                   int8_group_size=self.int8_group_size, own_blocks=self.own_blocks,
                                   sym=self.sym, rounding=self.rounding)  # fmt: skip

    def get_name(self) -> str:
        return NAME

    PATH = METHODS[NAME].path  # the path whose checkpoints name this method (edge.catalog.weight_paths)

    def _methods(self) -> dict[str, dict[str, type]]:
        # the embedding and the head stay int8 or bf16 (edge.catalog.quantized_layers: never 4-bit on this path); the
        # 8-bit set's weights a GGUF holds as Q6_K, Q8_0 or Q5_0 may keep the file's blocks (an untied head too)
        blocks = eight_bit_block_methods()
        return {"linear": {"int4": CpuW4A8LinearMethod, "int8": CpuInt8LinearMethod, **blocks["linear"]},
                "embedding": {"int8": CpuInt8EmbeddingMethod, **blocks["embedding"]}}  # fmt: skip


class CpuW4A8LinearMethod(PluginWeights, LinearMethodBase):
    """A linear layer (also fused QKV / gate_up: shards stack along N, dim 1 of the GPTQ tensors)."""

    def register(self, layer: torch.nn.Module, n: int, k: int, extra_weight_attrs: dict[str, Any]) -> None:
        """Register the checkpoint's GPTQ tensors for a [N, K] weight, as vLLM's AutoGPTQ method lays them out."""
        group = k if self.config.group_size == -1 else self.config.group_size
        if k % GPTQ_PARTITION_MULTIPLE or k % group:
            raise InputError("input_size", k, f"a multiple of {GPTQ_PARTITION_MULTIPLE} and of group_size {group}")
        if n % GPTQ_PARTITION_MULTIPLE:
            raise InputError("output_size", n, f"a multiple of {GPTQ_PARTITION_MULTIPLE}")
        attrs = {"input_dim": 0, "output_dim": 1, **extra_weight_attrs}
        qweight = torch.empty(k // PACK, n, dtype=torch.int32)  # [K/8, N]
        layer.register_parameter("qweight", weight_param(qweight, packed_dim=0, packed_factor=PACK, **attrs))
        layer.register_parameter("scales", weight_param(torch.empty(k // group, n, dtype=torch.bfloat16), **attrs))
        # a symmetric checkpoint's are read by GPTQ tools, not here (the zero point is 8); an asymmetric one's are
        qzeros = torch.empty(k // group, n // PACK, dtype=torch.int32)  # [K/g, N/8]
        layer.register_parameter("qzeros", weight_param(qzeros, packed_dim=1, packed_factor=PACK, **attrs))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if kernel() == "kleidiai":
            self._to_kleidiai(layer)
            return
        if not op_available():
            raise InputError(
                "quantization_config.quant_method", NAME,
                "a host whose vLLM library registers int4_scaled_mm_cpu (_C: AVX-512 with AVX512-BF16 and "
                "AVX512-VNNI); this one lacks it: plan and convert on this host (edge-serve does)",
            )  # fmt: skip
        from kernels.ops.gptq import zeros_of

        asym_zeros = None if self.config.sym else zeros_of(layer.qzeros.data)  # [K/g, N]
        weight, zeros, scales = to_w4a8(layer.qweight.data, layer.scales.data, asym_zeros)
        layer.register_parameter("w4a8_weight", Parameter(weight, requires_grad=False))  # [N/32, K/g, ...] uint8
        layer.register_parameter("w4a8_zeros", Parameter(zeros, requires_grad=False))  # [N/32, K/g, 32] int8
        layer.register_parameter("w4a8_scales", Parameter(scales, requires_grad=False))  # [N/32, K/g, 32] fp32
        layer.qweight, layer.qzeros = empty_param(torch.int32), empty_param(torch.int32)
        layer.scales = empty_param(torch.bfloat16)
        if getattr(layer, "bias", None) is not None:
            layer.bias.data = layer.bias.data.float()  # the op adds an fp32 bias, as vLLM's W4A8 path converts it

    def _to_kleidiai(self, layer: torch.nn.Module) -> None:
        """The GPTQ tensors packed once for KleidiAI (group 32: edge.plan.gates plans no other group on ARM)."""
        from kernels.ops import kleidiai

        k, n = layer.qweight.shape[0] * PACK, layer.qweight.shape[1]
        kleidiai.check(n, k, self.config.group_size, name="quantization_config.group_size")
        packed = kleidiai.pack(*kleidiai.from_gptq(layer.qweight.data, layer.scales.data))
        layer.register_parameter("kleidiai_packed", Parameter(packed, requires_grad=False))
        layer.kleidiai_k, layer.kleidiai_n = k, n
        layer.qweight, layer.qzeros = empty_param(torch.int32), empty_param(torch.int32)
        layer.scales = empty_param(torch.bfloat16)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if hasattr(layer, "kleidiai_packed"):
            return torch.ops.vllm.cpu_w4a8_kleidiai(x, layer.kleidiai_packed, layer.kleidiai_k, layer.kleidiai_n, bias)
        return w4a8_linear(x, layer.w4a8_weight, layer.w4a8_zeros, layer.w4a8_scales, bias)
