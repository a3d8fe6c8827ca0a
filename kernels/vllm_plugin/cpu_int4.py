"""The `cpu_int4` vLLM quantization method: W4A16 group-wise int4 through PyTorch's CPU tinygemm kernel.

Reads the row-major checkpoint written by kernels/convert/convert.py (per quantized layer `<prefix>.qweight` uint8
[N, K/2], `<prefix>.scales`, `<prefix>.zeros` bf16 [N, K/g]; w = (q - 8) * scale + zero) and repacks it at
load time into this host's tinygemm buffer (kernels/ops/tinygemm.py). Every field below comes from the
checkpoint's `quantization_config`, which vLLM hashes into its compile-cache key with the HF config; the
direct and dual paths build different graphs, so the choice must live there, not in an env var
(docs/FACTS.md: an env-var toggle against a warm cache loaded the wrong graph).

Layouts:
    dual         direct_dequant false, prefill_dequant true: tinygemm buffer + row-major copy for prefill
    direct       direct_dequant true,  prefill_dequant true: tinygemm buffer only; prefill dequantizes from it
                 (a layer whose N does not tile the host block keeps the row-major copy: dual for that layer)
    kernel-only  prefill_dequant false: tinygemm for every batch, no copy

The 8-bit set (`int8`: the embedding and the head in every plan, kernels/ops/int8.py) loads `<prefix>.qweight` int8
[N, K] and `.scales`: bf16 [N] (PyTorch's int8 weight-only GEMM), or with `int8_group_size` g float32 [N, K/g] (a
GGUF's own 8-bit grids, on the AVX2 int8 kernel; PyTorch's takes one scale per channel only). Which weights are
int4, int8 or bf16 is asked of edge.catalog.quantized_layers, as the plan's ledger and the converter ask it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.utils import set_weight_attrs

from edge.catalog.kernel_registry import (
    DECODE_KERNELS,
    DEFAULT_DECODE_KERNEL,
    OWN_BLOCK_DECODE_KERNELS,
    decode_rows,
)
from edge.catalog.quantized_layers import EIGHT_BIT_SET, OWN_BLOCK_TYPES, SHARDS, Decision, QuantRules
from edge.catalog.shape_rules import PACK_N_MULTIPLE
from edge.catalog.weight_paths import METHODS
from edge.errors import InputError
from edge.formats.tinygemm import TINYGEMM
from edge.measure import kernel_params
from edge.model.gguf_metadata import GGML_BLOCKS
from kernels.ops import huge_pages
from kernels.ops.int4_ops import (
    DIRECT,
    DUAL,
    KERNEL_ONLY,
    MODES,
    blocks_decode_layout_,
    blocks_linear,
    int4_embedding,
    int4_linear,
    int8_embedding,
    int8_linear,
)
from kernels.ops.int8 import check_group as check_int8_group
from kernels.ops.layout import host_layout
from kernels.ops.tinygemm import tiles, to_tinygemm
from kernels.vllm_plugin import layer_table

NAME = "cpu_int4"
DECODE_COPY_ONLY_ENV = "EDGE_DECODE_COPY_ONLY"
BLOCK_KEYS = tuple(own.key for own in OWN_BLOCK_TYPES.values())  # quantization_config's q4k, q6k, q8_0, q5_0


# The three layouts as checkpoint quantization_config fields (module docstring).
LAYOUTS: dict[str, dict[str, bool]] = {
    "dual": {"direct_dequant": False, "prefill_dequant": True},
    "direct": {"direct_dequant": True, "prefill_dequant": True},
    "kernel-only": {"direct_dequant": False, "prefill_dequant": False},
}


def host_params() -> kernel_params.KernelParams:
    """edge.measure.kernel_params' answer for the torch running here (used where a checkpoint does not say)."""
    amx = torch.cpu._is_amx_tile_supported()
    return kernel_params.params(
        capability=torch.backends.cpu.get_cpu_capability(),
        amx=amx,
        native_bf16=amx or torch.cpu._is_avx512_bf16_supported(),
        block=host_layout().block,
    )


def quantization_config(
    layout: str,
    *,
    group_size: int = 64,
    dequant_threshold: int | None = None,
    quantize_embedding: bool = True,
    int8: list[str] | tuple[str, ...] = EIGHT_BIT_SET,
    ignore: list[str] | None = None,
    decode_kernel: str = DEFAULT_DECODE_KERNEL,
    int8_group_size: int | None = None,
) -> dict[str, Any]:
    """The `quantization_config` dict for a layout on this host, as a plan would write it (tests, benchmarks);
    `int8=()` leaves the embedding and the head to 4 bits."""
    if layout not in LAYOUTS:
        raise InputError("layout", layout, f"one of {sorted(LAYOUTS)}")
    host = host_params()
    return {
        "quant_method": NAME,
        "bits": 4,
        "group_size": group_size,
        **LAYOUTS[layout],
        "dequant_threshold": host.dequant_threshold if dequant_threshold is None else dequant_threshold,
        "prefill_dtype": host.prefill_dtype,
        "tinygemm_block": host.block,
        "repack_chunk_rows": host.repack_chunk_rows,
        "quantize_embedding": quantize_embedding,
        "int8": list(int8),
        **int8_group_entry(int8_group_size),
        "ignore": list(ignore or []),
        **({"decode_kernel": decode_kernel} if decode_kernel != DEFAULT_DECODE_KERNEL else {}),
    }


def int8_group_entry(group: int | None) -> dict[str, int]:
    """quantization_config's int8_group_size, written only when the 8-bit set is per group (a per-channel
    checkpoint's config, and so its compile-cache key and quality records, stay as they were)."""
    return {"int8_group_size": group} if group else {}


def int8_rows(group: int | None, dequant_threshold: int, decode_rows: int = 0) -> int:
    """Batches of up to this many rows run the 8-bit set on the AVX2 int8 kernel: the decode kernel's rows, and
    with per-group scales every batch below dequant_threshold (PyTorch's int8 GEMM takes one scale per channel),
    where that kernel runs here; without it, such a layer dequantizes every batch (kernels.ops.int4_ops)."""
    if group and _avx2_available():
        return max(decode_rows, dequant_threshold - 1)
    return decode_rows


def weight_param(data: torch.Tensor, **attrs: Any) -> Parameter:
    param = Parameter(data, requires_grad=False)
    set_weight_attrs(param, attrs)
    return param


def empty_param(dtype: torch.dtype) -> Parameter:
    return Parameter(torch.empty(0, dtype=dtype), requires_grad=False)


# The model dtypes a cpu_int4 checkpoint serves in: bf16, and float16 for ARM cores without BF16, where vLLM's own bf16
# kernels would meet instructions the core lacks (edge.measure.kernel_params.float_dtype). The plugin's ops compute
# in bf16 either way (torch converts bf16 in software where the core has no BF16); a layer casts at its boundary.
INT4_ACT_DTYPES = (torch.bfloat16, torch.float16)


def out_dtype(layer: torch.nn.Module, y: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """An op's bf16 output in the model's dtype, plus the bias (added in that dtype: bf16 + float16 would promote)."""
    dtype = getattr(layer, "edge_dtype", torch.bfloat16)
    if y.dtype != dtype:
        y = y.to(dtype)
    return y if bias is None else y + bias


class PluginConfig(QuantizationConfig):
    """What the plugin's configs share: bf16 activations, the config in config.json, the layer rules of
    edge.catalog.quantized_layers for their path, and the method each weight's format gets. A subclass names its PATH
    and its methods per format (`_methods`: "linear" and "embedding", keyed by int4/int8; bf16 is vLLM's own)."""

    PATH = ""

    def _methods(self) -> dict[str, dict[str, type]]:
        raise NotImplementedError

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]  # tinygemm, int4_scaled_mm_cpu and the int8 kernels take bf16 activations

    @classmethod
    def get_min_capability(cls) -> int:
        return -1  # a GPU notion; vLLM's CPU platform reports no capability

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # the config lives in config.json's quantization_config

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        if hf_config is not None:
            self.tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))

    @property
    def rules(self) -> QuantRules:
        """edge.catalog.quantized_layers' rules for this config: the same answer the plan's ledger and the converter
        got."""
        return QuantRules.from_config(self.PATH, self.to_dict(), tied=self.tied_embeddings)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        methods = self._methods()
        if isinstance(layer, LinearBase):
            decision = self._linear_decision(layer, prefix)
            # an int4 layer whose decode copy keeps the file's own blocks has a method of its own (their type)
            method = methods["linear"].get(decision.blocks or decision.format)
            return method(self) if method else UnquantizedLinearMethod()
        if not isinstance(layer, VocabParallelEmbedding):
            return None
        name = prefix or ("lm_head" if isinstance(layer, ParallelLMHead) else "model.embed_tokens")
        decision = self.rules.weight(name, layer.org_vocab_size, layer.embedding_dim)
        method = methods["embedding"].get(decision.blocks or decision.format)
        assert method or decision.format == "bf16", f"{self.get_name()} has no {decision.format} {name}"
        return method(self) if method else None

    def _linear_decision(self, layer: LinearBase, prefix: str) -> Decision:
        """A fused vLLM layer (qkv_proj, gate_up_proj) is decided from the checkpoint weights it loads."""
        kind = prefix.rsplit(".", 1)[-1]
        sizes = getattr(layer, "output_sizes", None) or [layer.output_size]
        shards = list(self.packed_modules_mapping.get(kind) or SHARDS.get(kind) or [kind])
        if len(shards) != len(sizes):  # a layer fused in the checkpoint too (Phi-3's qkv_proj): one weight
            shards, sizes = [kind], [sum(sizes)]
        return self.rules.fused(prefix, list(zip(shards, sizes, strict=True)), layer.input_size)


@register_quantization_config(NAME)
class CpuInt4Config(PluginConfig):
    """W4A16 group-wise asymmetric int4 for CPUs (tinygemm), from a checkpoint's `quantization_config`."""

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return list(INT4_ACT_DTYPES)

    def __init__(
        self,
        group_size: int = 64,
        *,
        direct_dequant: bool = False,
        prefill_dequant: bool = True,
        dequant_threshold: int | None = None,
        prefill_dtype: str | None = None,
        tinygemm_block: int | None = None,
        repack_chunk_rows: int | None = None,
        quantize_embedding: bool = False,
        int8: list[str] | None = None,
        ignore: list[str] | None = None,
        decode_kernel: str = DEFAULT_DECODE_KERNEL,
        int8_group_size: int | None = None,
        own_blocks: dict[str, list[str]] | None = None,
    ) -> None:
        super().__init__()
        TINYGEMM.check_method_config(group_size=group_size, dequant_threshold=dequant_threshold,
                                     int8_group_size=int8_group_size)  # fmt: skip
        if prefill_dtype is not None and prefill_dtype not in kernel_params.PREFILL_DTYPES:
            raise InputError("prefill_dtype", prefill_dtype, f"one of {kernel_params.PREFILL_DTYPES}")
        if decode_kernel not in DECODE_KERNELS:
            raise InputError("decode_kernel", decode_kernel, f"one of {tuple(DECODE_KERNELS)}")
        host = host_params()
        if tinygemm_block is not None and tinygemm_block != host.block:
            raise InputError(
                "quantization_config.tinygemm_block", tinygemm_block,
                f"this host's block, {host.block} (torch {torch.__version__} dispatches "
                f"{torch.backends.cpu.get_cpu_capability()} kernels here; a checkpoint planned for another device "
                "must be planned and converted on this one, as edge-serve does)",
            )  # fmt: skip
        if repack_chunk_rows is not None and (repack_chunk_rows <= 0 or repack_chunk_rows % host.block):
            raise InputError("repack_chunk_rows", repack_chunk_rows, f"a positive multiple of {host.block}")
        self.group_size = group_size
        self.direct_dequant = direct_dequant
        self.prefill_dequant = prefill_dequant
        self.dequant_threshold = host.dequant_threshold if dequant_threshold is None else dequant_threshold
        self.prefill_dtype = prefill_dtype or host.prefill_dtype
        self.tinygemm_block = host.block
        self.repack_chunk_rows = repack_chunk_rows or host.repack_chunk_rows
        self.quantize_embedding = quantize_embedding
        self.int8 = list(int8 or [])
        self.ignore = list(ignore or [])
        self.decode_kernel = decode_kernel
        # Rows that take the AVX2 kernel; 0 (tinygemm) when it was not asked for or cannot run here (no compiler,
        # no AVX2/FMA: kernels/avx2_int4.available() logs why).
        avx2 = TINYGEMM.reads_row_major(decode_kernel) and _avx2_available()
        self.avx2_rows = decode_rows(decode_kernel) if avx2 else 0
        self.avx2_bits = DECODE_KERNELS[decode_kernel].activation_bits or 16  # its activations: int16 or int8
        self.int8_group_size = int8_group_size
        # the weights kept as a GGUF's own blocks, by quantization_config key (q4k, q6k, q8_0, q5_0)
        self.own_blocks = {key: list(names) for key, names in (own_blocks or {}).items() if names}
        for key, names in self.own_blocks.items():
            if key not in BLOCK_KEYS:
                raise InputError("quantization_config", key, f"one of {tuple(BLOCK_KEYS)}")
            if decode_kernel not in OWN_BLOCK_DECODE_KERNELS:
                raise InputError(f"quantization_config.{key}", names[:3],
                                 f"empty unless decode_kernel reads a GGUF's own blocks "
                                 f"({', '.join(OWN_BLOCK_DECODE_KERNELS)}), not {decode_kernel}")  # fmt: skip
        self.int8_rows = int8_rows(int8_group_size, self.dequant_threshold, self.avx2_rows)
        self.tied_embeddings = False  # set from the HF config in maybe_update_config

    def __repr__(self) -> str:
        return (
            f"CpuInt4Config(group_size={self.group_size}, layout={self.layout}, "
            f"dequant_threshold={self.dequant_threshold}, quantize_embedding={self.quantize_embedding}, "
            f"ignore={self.ignore})"
        )

    @property
    def layout(self) -> str:
        if not self.prefill_dequant:
            return "kernel-only"
        return "direct" if self.direct_dequant else "dual"

    @property
    def mode(self) -> int:
        """The int4_ops mode for a layer whose N tiles the host block."""
        return {"kernel-only": KERNEL_ONLY, "dual": DUAL, "direct": DIRECT}[self.layout]

    def decode_copy_only(self, mode: int) -> bool:
        """Whether a layer repacked in `mode` keeps only the decode kernel's copy (edge.formats.tinygemm's rule, where
        the AVX2 decode kernel runs here). EDGE_DECODE_COPY_ONLY=0 keeps the tinygemm buffer beside it, as before
        2026-12-06, for benchmarks that compare the two (bench_serve's +two-copies); the plan's ledger still books
        one copy."""
        if os.environ.get(DECODE_COPY_ONLY_ENV) == "0":
            return False
        return self.avx2_rows > 0 and TINYGEMM.decode_copy_only(MODES[mode], self.decode_kernel)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuInt4Config:
        method = config.get("quant_method", NAME)
        if method != NAME:
            raise InputError("quant_method", method, f"'{NAME}'")
        bits = config.get("bits", 4)
        if bits != 4:
            raise InputError("bits", bits, "4")
        return cls(
            group_size=int(config.get("group_size", 64)),
            direct_dequant=bool(config.get("direct_dequant", False)),
            prefill_dequant=bool(config.get("prefill_dequant", True)),
            dequant_threshold=config.get("dequant_threshold"),
            prefill_dtype=config.get("prefill_dtype"),
            tinygemm_block=config.get("tinygemm_block"),
            repack_chunk_rows=config.get("repack_chunk_rows"),
            quantize_embedding=bool(config.get("quantize_embedding", False)),
            int8=list(config.get("int8", [])),
            ignore=list(config.get("ignore", [])),
            decode_kernel=config.get("decode_kernel", DEFAULT_DECODE_KERNEL),
            int8_group_size=config.get("int8_group_size"),
            own_blocks=own_block_entries(config),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": NAME,
            "bits": 4,
            "group_size": self.group_size,
            "direct_dequant": self.direct_dequant,
            "prefill_dequant": self.prefill_dequant,
            "dequant_threshold": self.dequant_threshold,
            "prefill_dtype": self.prefill_dtype,
            "tinygemm_block": self.tinygemm_block,
            "repack_chunk_rows": self.repack_chunk_rows,
            "quantize_embedding": self.quantize_embedding,
            "int8": list(self.int8),
            **int8_group_entry(self.int8_group_size),
            **{key: list(names) for key, names in self.own_blocks.items()},
            "ignore": list(self.ignore),
            **({"decode_kernel": self.decode_kernel} if self.decode_kernel != DEFAULT_DECODE_KERNEL else {}),
        }

    def get_name(self) -> str:
        return NAME

    PATH = METHODS[NAME].path  # the path whose checkpoints name this method (edge.catalog.weight_paths)

    def _methods(self) -> dict[str, dict[str, type]]:
        blocks = eight_bit_block_methods()
        return {"linear": {"int4": CpuInt4LinearMethod, "int8": CpuInt8LinearMethod, "Q4_K": CpuQ4kLinearMethod,
                           **blocks["linear"]},
                "embedding": {"int4": CpuInt4EmbeddingMethod, "int8": CpuInt8EmbeddingMethod,
                              **blocks["embedding"]}}  # fmt: skip


def own_block_entries(config: dict[str, Any]) -> dict[str, list[str]]:
    """The weights a checkpoint's quantization_config keeps as a GGUF's own blocks, by key (every BLOCK_KEYS entry it
    names: a method refuses the keys it cannot run by name)."""
    return {key: list(config[key]) for key in BLOCK_KEYS if config.get(key)}


# the 8-bit set's own-block types (Q6_K, Q8_0, Q5_0) and their quantization_config keys (q6k, q8_0, q5_0)
EIGHT_BIT_BLOCKS = {t: own.key for t, own in OWN_BLOCK_TYPES.items() if own.format == "int8"}


def eight_bit_block_methods() -> dict[str, dict[str, Any]]:
    """The methods of the 8-bit set's weights kept as a file's own blocks, by type, for linears and heads: what every
    method running the 8-bit set (cpu_int4, cpu_w4a8) offers."""
    return {"linear": {t: functools.partial(CpuBlocksLinearMethod, blocks=t) for t in EIGHT_BIT_BLOCKS},
            "embedding": {t: functools.partial(CpuBlocksHeadMethod, blocks=t) for t in EIGHT_BIT_BLOCKS}}  # fmt: skip


def _avx2_available() -> bool:
    from kernels.ops import avx2_int4

    return avx2_int4.available()


def _check_shape(n: int, k: int, group: int) -> None:
    if k % group:
        raise InputError("input_size", k, f"a multiple of group_size {group}")
    if n % PACK_N_MULTIPLE:
        raise InputError("output_size", n, f"a multiple of {PACK_N_MULTIPLE}")


def _create_int4_params(layer: torch.nn.Module, n: int, k: int, group: int, extra: dict[str, Any],
                        empty: Callable[..., torch.Tensor] = torch.empty) -> None:  # fmt: skip
    """Register the checkpoint's row-major tensors for a [N, K] weight on `layer`, made by `empty` (huge_pages.empty
    for tensors the decode kernel keeps reading)."""
    _check_shape(n, k, group)
    attrs = {"input_dim": 1, "output_dim": 0, **extra}
    # qweight is packed along K (dim 1), never along the output dim vLLM shards and stacks by.
    layer.register_parameter(
        "qweight", weight_param(empty(n, k // 2, dtype=torch.uint8), packed_dim=1, packed_factor=2, **attrs)
    )  # [N, K/2]
    layer.register_parameter("scales", weight_param(empty(n, k // group, dtype=torch.bfloat16), **attrs))
    layer.register_parameter("zeros", weight_param(empty(n, k // group, dtype=torch.bfloat16), **attrs))


def _no_tinygemm_buffer(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tinygemm tensors of a layer that keeps only its decode copy: empty, shaped so that K ([0, K/2]) and N
    ([0, N, 2]) still read as from a buffer; int4_ops takes an empty `packed` to mean the decode copy alone."""
    return torch.empty(0, k // 2, dtype=torch.uint8), torch.empty(0, n, 2, dtype=torch.bfloat16)


def _repack(
    layer: torch.nn.Module, group: int, mode: int, chunk_rows: int, keep_row_major: bool = False, act_bits: int = 16,
    one_copy: bool = False,
) -> None:
    """Build the tinygemm buffer; drop the row-major copy unless this layer's mode reads it (or keep_row_major:
    the AVX2 decode kernel reads it; its op is loaded here, in the worker, which the config never ran in: vLLM
    builds the config in the engine process and ships it to the workers). A copy only that kernel reads (not DUAL's,
    which wide batches dequantize) goes into the layout it reads best (kernels.ops.avx2_int4.decode_layout_ for its
    act_bits activations: in place, chunk_rows channels at a time).

    one_copy (edge.formats.tinygemm decode_copy_only, with keep_row_major): no tinygemm buffer, only the decode copy,
    which wider batches dequantize.

    Sets layer.int4_mode: DIRECT falls back to DUAL when N does not tile the host block (the direct
    dequantizer cannot read a narrower last block, kernels/ops/layout.py).
    """
    n, k = layer.qweight.shape[0], layer.qweight.shape[1] * 2
    if keep_row_major:
        assert _avx2_available(), "the config checked the AVX2 kernel runs on this host"
    if one_copy:  # the decode copy alone: wider batches dequantize it (int4_ops.int4_linear_impl)
        packed, scales_and_zeros = _no_tinygemm_buffer(n, k)
    else:
        if mode == DIRECT and not tiles(n, host_layout()):
            mode = DUAL
        packed, scales_and_zeros = to_tinygemm(
            layer.qweight.data, layer.scales.data, layer.zeros.data, group, chunk_rows=chunk_rows
        )
    layer.register_parameter("tinygemm_packed", Parameter(packed, requires_grad=False))  # [N, K/2] host layout
    layer.register_parameter("tinygemm_sz", Parameter(scales_and_zeros, requires_grad=False))  # [K/g, N, 2]
    if mode != DUAL and not keep_row_major:
        layer.qweight = empty_param(torch.uint8)
        layer.scales = empty_param(torch.bfloat16)
        layer.zeros = empty_param(torch.bfloat16)
    elif mode != DUAL:
        from kernels.ops.avx2_int4 import decode_layout_

        tensors = decode_layout_(layer.qweight.data, layer.scales.data, layer.zeros.data, act_bits, chunk_rows)
        layer.qweight, layer.scales, layer.zeros = (Parameter(t, requires_grad=False) for t in tensors)
    layer.int4_mode = mode


class PluginWeights:
    """What every plugin method shares (cpu_int4's and cpu_w4a8's): its config and vLLM's create_weights, which
    registers the checkpoint's tensors for a [N, K] weight (fused shards stack along N; for the head, this rank's
    padded vocab)."""

    def __init__(self, config: PluginConfig) -> None:
        self.config = config

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        # what the layer hands back (out_dtype): the model's dtype where the plugin serves it (vLLM checked it against
        # get_supported_act_dtypes), else its ops' own bf16 (a layer built outside an engine, at torch's default)
        layer.edge_dtype = params_dtype if params_dtype in INT4_ACT_DTYPES else torch.bfloat16
        self.register(layer, sum(output_partition_sizes), input_size_per_partition, extra_weight_attrs)

    def register(self, layer: torch.nn.Module, n: int, k: int, extra: dict[str, Any]) -> None:
        raise NotImplementedError


class _Int4Weights(PluginWeights):
    """The int4 parameters the linear and the embedding/head methods load."""

    def keeps_row_major(self) -> bool:
        """Whether the row-major tensors stay after load (then they are loaded into huge-page slabs)."""
        return False

    def register(self, layer: torch.nn.Module, n: int, k: int, extra: dict[str, Any]) -> None:
        empty = huge_pages.empty if self.keeps_row_major() else torch.empty
        _create_int4_params(layer, n, k, self.config.group_size, extra, empty)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _apply(layer, self.config, x, bias)


class _InLayerTable:
    """A linear method whose loaded layers the layer table holds (kernels/vllm_plugin/layer_table.py): apply calls a
    layer by its index where it has one, else its weights' own op (the class after this one)."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        index = layer_table.index_of(layer)
        if index is None:
            return super().apply(layer, x, bias)
        return out_dtype(layer, layer_table.linear(x, index), bias)


class CpuInt4LinearMethod(_InLayerTable, _Int4Weights, LinearMethodBase):
    """A linear layer (also fused QKV / gate_up: shards stack along N, which is never the packed dim)."""

    def keeps_row_major(self) -> bool:
        return self.config.avx2_rows > 0 or self.config.mode == DUAL  # _repack's rule

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        _repack(layer, self.config.group_size, self.config.mode, self.config.repack_chunk_rows,
                keep_row_major=self.config.avx2_rows > 0, act_bits=self.config.avx2_bits,
                one_copy=self.config.decode_copy_only(self.config.mode))  # fmt: skip
        layer_table.add_int4(layer, self.config)


class CpuQ4kLinearMethod(CpuInt4LinearMethod):
    """An int4 layer whose weights are a GGUF's own Q4_K blocks (quantization_config.q4k; kernels/ops/q4k.py):
    qweight (cpu_int4's codes) and meta (the file's 16 scale bytes a block), 144 bytes per 256 weights. Decode rows
    read them in the decode layout (torch.ops.edge_avx2.q4k_linear: int8 activations, the scales applied in fp32
    from the file's fp16 and 6-bit values). Wider batches dequantize the blocks themselves in the direct layout
    (edge_avx2::q4k_dequantize, the file's float32 values rounded once), else read a tinygemm buffer built from the
    same codes and the bf16 grid of those scales, as a cpu_int4 checkpoint of the file holds (kernel-only, also
    where N does not tile the host block: no bf16 grid is kept for dual's dequantize)."""

    def register(self, layer: torch.nn.Module, n: int, k: int, extra: dict[str, Any]) -> None:
        _check_shape(n, k, self.config.group_size)
        empty = huge_pages.empty if self.keeps_row_major() else torch.empty
        attrs = {"input_dim": 1, "output_dim": 0, **extra}
        layer.register_parameter(
            "qweight", weight_param(empty(n, k // 2, dtype=torch.uint8), packed_dim=1, packed_factor=2, **attrs)
        )  # [N, K/2]
        layer.register_parameter("meta", weight_param(empty(n, k // 256 * 16, dtype=torch.uint8), **attrs))

    def keeps_row_major(self) -> bool:
        return self.config.avx2_rows > 0

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from kernels.ops import q4k

        n, k = layer.qweight.shape[0], layer.qweight.shape[1] * 2
        if self.config.decode_copy_only(self.config.mode):  # the blocks alone: wider batches dequantize them
            packed, scales_and_zeros = _no_tinygemm_buffer(n, k)
        else:
            scales, zeros = q4k.int4_grid(layer.meta.data)  # [N, K/32] bf16: for the tinygemm buffer only
            packed, scales_and_zeros = to_tinygemm(layer.qweight.data, scales, zeros, self.config.group_size,
                                                   chunk_rows=self.config.repack_chunk_rows)  # fmt: skip
            del scales, zeros
        layer.register_parameter("tinygemm_packed", Parameter(packed, requires_grad=False))  # [N, K/2] host layout
        layer.register_parameter("tinygemm_sz", Parameter(scales_and_zeros, requires_grad=False))  # [K/g, N, 2]
        layer.int4_mode = DIRECT if self.config.mode != KERNEL_ONLY and tiles(n, host_layout()) else KERNEL_ONLY
        layer.zeros = empty_param(torch.bfloat16)
        if self.config.avx2_rows > 0:
            qweight, meta = q4k.decode_layout_(layer.qweight.data, layer.meta.data, self.config.repack_chunk_rows)
            layer.qweight = Parameter(qweight, requires_grad=False)
            layer.scales = Parameter(meta, requires_grad=False)  # the op's `scales`: uint8 says Q4_K blocks
        else:
            layer.qweight = empty_param(torch.uint8)
            layer.scales = empty_param(torch.bfloat16)
        del layer.meta
        layer_table.add_int4(layer, self.config)


class CpuInt4EmbeddingMethod(_Int4Weights, QuantizeMethodBase):
    """Embedding (lookup dequantizes only the gathered rows of the row-major copy) and LM head (tinygemm).

    A tied head shares the embedding's row-major tensors and adds the tinygemm buffer; its prefill path reads
    the row-major copy that the lookup keeps anyway (dual), whatever the layout.
    """

    def __init__(self, config: CpuInt4Config) -> None:
        super().__init__(config)
        self.tied = False

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        assert isinstance(embed_tokens.quant_method, CpuInt4EmbeddingMethod), "tied head needs a cpu_int4 embedding"
        layer.qweight, layer.scales, layer.zeros = (
            embed_tokens.qweight,
            embed_tokens.scales,
            embed_tokens.zeros,
        )
        self.tied = True
        return layer

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if isinstance(layer, ParallelLMHead):
            mode = DUAL if self.tied else self.config.mode
            _repack(layer, self.config.group_size, mode, self.config.repack_chunk_rows,
                    keep_row_major=self.config.avx2_rows > 0, act_bits=self.config.avx2_bits,
                    one_copy=self.config.decode_copy_only(mode))  # fmt: skip

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        rows = int4_embedding(input_, layer.qweight, layer.scales, layer.zeros, self.config.group_size)
        return out_dtype(layer, rows)


def _apply(layer: torch.nn.Module, config: CpuInt4Config, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One int4 GEMM through the opaque op (a linear layer or the head): x [..., K] -> [..., N]."""
    y = int4_linear(
        x,
        layer.tinygemm_packed,
        layer.tinygemm_sz,
        layer.qweight,
        layer.scales,
        layer.zeros,
        config.group_size,
        layer.int4_mode,
        config.dequant_threshold,
        config.prefill_dtype == "float32",
        config.avx2_rows,
        config.avx2_bits,
    )
    return out_dtype(layer, y, bias)


class _Int8Weights(PluginWeights):
    """The 8-bit set's tensors (kernels/ops/int8.py): qweight int8 [N, K] and scales, bf16 [N] or, with the
    config's int8_group_size g, float32 [N, K/g]; loaded as stored."""

    def register(self, layer: torch.nn.Module, n: int, k: int, extra: dict[str, Any]) -> None:
        # the kernels read them as loaded, so they load straight into huge-page slabs
        layer.register_parameter(
            "qweight", weight_param(huge_pages.empty(n, k, dtype=torch.int8), input_dim=1, output_dim=0, **extra)
        )  # [N, K]
        group = self.config.int8_group_size
        if group:
            check_int8_group(group, k, name="int8_group_size")
            scales = weight_param(huge_pages.empty(n, k // group, dtype=torch.float32), input_dim=1, output_dim=0,
                                  **extra)  # fmt: skip
        else:
            scales = weight_param(huge_pages.empty(n, dtype=torch.bfloat16), output_dim=0, **extra)  # [N]
        layer.register_parameter("scales", scales)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass  # the int8 kernels read the checkpoint layout as is

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = int8_linear(x, layer.qweight, layer.scales, self.config.dequant_threshold, self.config.int8_rows)
        return out_dtype(layer, y, bias)


class _BlocksWeights(PluginWeights):
    """An 8-bit-set weight kept as a GGUF's own Q6_K, Q8_0 or Q5_0 blocks (quantization_config.q6k, q8_0, q5_0;
    kernels/ops/q6k.py, g32.py): `blocks` uint8 [N, K/block * block bytes] as the file holds them, rearranged in place
    at load into the type's decode layout (8 channels interleaved, the same bytes), which its kernel reads for batches
    the 8-bit set runs on its AVX2 kernel (int8 activations per 32, the scales applied in fp32 from the file's
    values); wider batches dequantize to bf16."""

    def __init__(self, config: PluginConfig, blocks: str) -> None:
        super().__init__(config)
        self.blocks = blocks

    def register(self, layer: torch.nn.Module, n: int, k: int, extra: dict[str, Any]) -> None:
        weights, nbytes = GGML_BLOCKS[self.blocks]
        if k % weights or n % 8:
            raise InputError("input_size/output_size", (k, n),
                             f"K a multiple of {weights} and N of 8 for {self.blocks} blocks")  # fmt: skip
        layer.register_parameter("blocks", weight_param(huge_pages.empty(n, k // weights * nbytes, dtype=torch.uint8),
                                                        input_dim=1, output_dim=0, **extra))  # fmt: skip

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # N a multiple of 8: register
        packed = blocks_decode_layout_(self.blocks, layer.blocks.data, self.config.repack_chunk_rows)
        layer.blocks = Parameter(packed, requires_grad=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = blocks_linear(x, layer.blocks, self.config.dequant_threshold, self.config.int8_rows)
        return out_dtype(layer, y, bias)


class CpuBlocksLinearMethod(_InLayerTable, _BlocksWeights, LinearMethodBase):
    """A linear layer of the 8-bit set kept as a file's own blocks (every shard of a fused one, of one type: the plan's
    rule)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer_table.add_blocks(layer, self.config)


class CpuBlocksHeadMethod(_BlocksWeights, QuantizeMethodBase):
    """An untied head kept as a file's own blocks (the plan never keeps a tied one so: the embedding looks rows up)."""

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"a {self.blocks} head is never an embedding: quantization_config names untied heads "
                                  "only")  # fmt: skip


class CpuInt8LinearMethod(_InLayerTable, _Int8Weights, LinearMethodBase):
    """A linear layer in the 8-bit set (fused shards stack along N, like the int4 method's)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer_table.add_int8(layer, self.config)


class CpuInt8EmbeddingMethod(_Int8Weights, QuantizeMethodBase):
    """The embedding (lookups gather int8 rows) and the head (int8 GEMM); a tied head shares the same tensors."""

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        assert isinstance(embed_tokens.quant_method, CpuInt8EmbeddingMethod), "tied head needs an int8 embedding"
        layer.qweight, layer.scales = embed_tokens.qweight, embed_tokens.scales
        return layer

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return out_dtype(layer, int8_embedding(input_, layer.qweight, layer.scales, cpp=self.config.int8_rows > 0))
