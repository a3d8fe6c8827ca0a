"""The weight paths and the checkpoint methods, as data: one spec per path and one per vLLM method, the one place a
path's name, layouts, methods, gate, weight format and reference numbers are written.

Everything that lists paths or branches on one asks these tables: the Plan's types and choices (edge.plan.schema), the
gates (edge.plan.gates, by `gate`), the ranking and the fidelity order (edge.measure.rank: `reference`,
`fidelity_rank`), which weights a method quantizes and how (edge.catalog.quantized_layers, by MethodSpec), the format
that stores its weights (`weight_format`: edge.formats, whose objects the ledger, the cost model and the converter
ask), the vLLM method a checkpoint names (edge.plan.engine_config) and, the other way, the path a checkpoint's
`quant_method` belongs to (kernels.evaluate.evaluate's quality records), and who measured a path where
(edge.plan.verified, by `measured`). The kernels each path runs are edge.catalog.kernel_registry's `serves`.

    w4a16-tinygemm  4-bit weights, bf16 activations: the plugin's `cpu_int4` method, in a layout
    w4a8-gptq       4-bit GPTQ weights, int8 activations: vLLM's own `gptq` where AMX tiles are (its W4A8 kernel
                    turns on only there, vllm/model_executor/kernels/linear/mixed_precision/cpu.py), the plugin's
                    `cpu_w4a8` elsewhere (kernels/vllm_plugin/cpu_w4a8.py calls the same op)
    bf16            the source's bf16 weights, served as they are
    export-only     a bundle for a phone runtime (kernels/export/export.py): nothing vLLM serves
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from edge.catalog import shape_rules as rules
from edge.model.gguf_metadata import FOUR_BIT_GRIDS, SYMMETRIC_FOUR_BIT_GRIDS

WeightPath = Literal["w4a8-gptq", "w4a16-tinygemm", "bf16", "export-only"]
Layout = Literal["direct", "dual", "kernel-only"]
# What a plan puts first (README: --priority): fidelity never quantizes activations.
Priority = Literal["fidelity", "speed"]
PRIORITIES: tuple[Priority, ...] = ("fidelity", "speed")
# How a path stores its weights, which decides the ledger's weight items and the converter's step.
WeightFormat = Literal["tinygemm", "gptq", "bf16", "export"]

# Who measured what (a path's `measured`, read by edge.plan.verified).
_REFERENCE = "measured by the reference study on a Xeon 8480C (AMX) with vLLM 0.28"
_HERE = "measured on this project's AVX2 host with vLLM 0.28"
_HERE_AVX512 = (
    "measured on this project's AVX-512 host (AMD EPYC Zen 5, AVX512-BF16, no AMX) with vLLM 0.28: the default "
    "model served through edge-serve, 1 thread (docs/FACTS.md, 2026-11-30)"
)
# Each layout's prefill against dual's on AMX (edge.facts keys; None: dual itself), for the reference ranking.
LAYOUT_PREFILL_SLOWDOWN: dict[Layout, str | None] = {
    "dual": None, "direct": "amx.direct.prefill_slowdown", "kernel-only": "amx.kernel_only.prefill_slowdown",
}  # fmt: skip
# Bytes read per weight per decode step ranks paths on an ISA class nothing measured (ARM); the layouts decode alike,
# so they go in the order every measured class supports: direct, whose prefill dequantizes (AVX2 engine: 133 tok/s
# against kernel-only's 71; AMX: kernel-only 7.3x slower) at less memory than dual, then the leanest, then dual.
DERIVED_LAYOUT_ORDER: tuple[Layout, ...] = ("direct", "kernel-only", "dual")
# The facts that order cites (edge.facts keys).
DERIVED_LAYOUT_FACTS = ("avx2.engine.direct.prefill_tok_s", "amx.kernel_only.prefill_slowdown")


@dataclass(frozen=True)
class Reference:
    """The reference study's numbers for a path on AMX (edge.facts keys), which rank it there without a record."""

    prefill: str  # tok/s (dual's, for a path with layouts: LAYOUT_PREFILL_SLOWDOWN scales it)
    decode: str  # tok/s
    why: str  # the reason the ranking cites with the decode figure
    perplexity: str | None = None  # the nearest quality figure, for a plan with no edge-eval record


@dataclass(frozen=True)
class PathSpec:
    name: WeightPath
    layouts: tuple[Layout, ...]  # equal cost ranks them in this order (the leanest first); () without layouts
    quantizes_weights: bool  # to 4 bits (the layer rules of edge.catalog.quantized_layers apply)
    quantizes_activations: bool  # to 8 bits: never chosen for fidelity (docs/FACTS.md: agents lost completion)
    # Fidelity: bf16 is the reference; W4A16 keeps bf16 activations (+12.5 % perplexity on the reference model);
    # W4A8 quantizes activations (+27.2 %) and comes last.
    fidelity_rank: int
    methods: dict[bool, str] | None  # the checkpoint's quant_method, by: the device has AMX tiles; None: no checkpoint
    weight_format: WeightFormat
    gate: str  # its gate in edge.plan.gates (GATES)
    reference: Reference | None = None  # None: the reference study did not rank it
    measured: dict[tuple[Layout | None, str], str] = field(default_factory=dict)  # (layout or any, ISA class) -> who
    served_by_vllm: bool = True


PATHS: dict[str, PathSpec] = {
    spec.name: spec
    for spec in (
        # AMX hosts too run the plugin's cpu_w4a8: the op vLLM's own GPTQ W4A8 calls there (int4_scaled_mm_cpu),
        # with the 8-bit embedding and head, so a cpu_w4a8 quality record measured elsewhere is the same weights
        # through the same int8 arithmetic (issue 22); vLLM's gptq (4-bit head, bf16 embedding) stays a method
        # for GPTQ checkpoints
        PathSpec("w4a8-gptq", (), True, True, 9, {True: "cpu_w4a8", False: "cpu_w4a8"}, "gptq", "gate_w4a8",
                 Reference("amx.w4a8.prefill_tok_s", "amx.w4a8.decode_tok_s", "W4A8 decodes fastest on AMX",
                           "amx.w4a8.perplexity_delta"),
                 measured={(None, "amx"): _REFERENCE + " (through vLLM's own gptq; the plugin's cpu_w4a8 has not run "
                           "on AMX)",
                           (None, "avx512"): _HERE_AVX512.replace("served through edge-serve", "served by vLLM "
                           "through the plugin's cpu_w4a8") + " (decode 131 tok/s vs direct 104)"}),
        PathSpec("w4a16-tinygemm", ("direct", "dual", "kernel-only"), True, False, 1,
                 {True: "cpu_int4", False: "cpu_int4"}, "tinygemm", "gate_w4a16",
                 Reference("amx.w4a16.dual.prefill_tok_s", "amx.w4a16.decode_tok_s", "W4A16 tinygemm decode on AMX",
                           "amx.w4a16.perplexity_delta"),
                 measured={(None, "amx"): _REFERENCE,
                           (None, "avx2"): _HERE + " (direct, dual and kernel-only served the default model; "
                           "docs/reports/2026-11-29-engine.md)",
                           ("direct", "avx512"): _HERE_AVX512 + " (direct: decode ~103 tok/s vs bf16 ~55-61)"}),
        PathSpec("bf16", (), False, False, 0, None, "bf16", "gate_bf16",
                 Reference("amx.bf16.prefill_tok_s", "amx.bf16.decode_tok_s", "bf16 decode on AMX"),
                 measured={(None, "amx"): _REFERENCE, (None, "avx2"): _HERE, (None, "avx512"): _HERE_AVX512}),
        PathSpec("export-only", (), False, False, 2, None, "export", "gate_export_only", served_by_vllm=False),
    )
}  # fmt: skip

WEIGHT_PATHS: tuple[WeightPath, ...] = tuple(PATHS)  # type: ignore[assignment]
LAYOUTS: tuple[Layout, ...] = tuple(dict.fromkeys(layout for spec in PATHS.values() for layout in spec.layouts))
QUANTIZED_PATHS: tuple[WeightPath, ...] = tuple(name for name, spec in PATHS.items() if spec.quantizes_weights)


@dataclass(frozen=True)
class MethodSpec:
    """A vLLM quantization method a checkpoint names (`quant_method`): what it stores and which weights it takes."""

    name: str
    path: WeightPath
    plugin: bool  # this project's (kernels/vllm_plugin) or vLLM's own
    eight_bit: bool  # runs the 8-bit set (int8 head and embedding, quantization_config.int8)
    n_multiple: int  # a quantized layer's N is a multiple of it
    k_multiple: int  # and its K (1: any K the group divides)
    head_by_default: bool  # the head is quantized when the config's `lm_head` says nothing
    int4_head: bool  # the head may take 4 bits (else int8 or bf16)
    int4_embedding: bool  # the embedding may take 4 bits (`quantize_embedding`)
    # the GGUF types whose 4-bit codes it copies from the source's own grid (`codes_from_source`); () none
    source_codes: tuple[str, ...]
    # its 4-bit layers quantize their activations to int8 (W4A8): the file's own 8-bit-set blocks, whose kernels
    # round activations to int8 per group of 32 (finer than per row), take nothing from it that it kept
    int8_activations: bool = False


METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("cpu_int4", "w4a16-tinygemm", True, True, rules.PACK_N_MULTIPLE, 1, False, True, True,
                   FOUR_BIT_GRIDS),
        # symmetric codes only: GPTQ's uint4b8 is Q4_0's grid
        MethodSpec("cpu_w4a8", "w4a8-gptq", True, True, rules.GPTQ_PARTITION_MULTIPLE,
                   rules.GPTQ_PARTITION_MULTIPLE, True, False, False, SYMMETRIC_FOUR_BIT_GRIDS, int8_activations=True),
        # vLLM's GPTQ keeps the embedding bf16 and quantizes the head (a tied one is untied)
        MethodSpec("gptq", "w4a8-gptq", False, False, rules.GPTQ_PARTITION_MULTIPLE,
                   rules.GPTQ_PARTITION_MULTIPLE, True, True, False, (), int8_activations=True),
    )
}  # fmt: skip
# The plugin's methods (kernels/vllm plugin) run the 8-bit set (int8 head and embedding); vLLM's own gptq does not.
EIGHT_BIT_METHODS = tuple(name for name, spec in METHODS.items() if spec.eight_bit)


def the_path(**props: object) -> WeightPath:
    """The one path with these spec values (a second one would have to say which it means)."""
    found = [name for name, spec in PATHS.items() if all(getattr(spec, k) == v for k, v in props.items())]
    assert len(found) == 1, f"one path has {props}, got {found}"
    return found[0]  # type: ignore[return-value]


def path_with_layout(layout: str) -> WeightPath:
    """The path a layout belongs to."""
    found = [name for name, spec in PATHS.items() if layout in spec.layouts]
    assert len(found) == 1, f"{layout} belongs to one path, got {found}"
    return found[0]  # type: ignore[return-value]


def own_method(path: str) -> MethodSpec | None:
    """The method a checkpoint of this path names when its config says none (the AMX host's)."""
    method = quant_method(path, amx=True)
    return METHODS[method] if method else None


def quant_method(path: str, *, amx: bool) -> str | None:
    """The vLLM quantization method a checkpoint of this path names on such a device; None: no checkpoint."""
    methods = PATHS[path].methods
    return methods[amx] if methods else None


def quant_methods(path: str) -> list[str]:
    """Every method a checkpoint of this path may name, whatever the device: the plans' and any other method of
    the same path (vLLM's own gptq, which no plan writes, for a GPTQ checkpoint)."""
    return sorted({spec.name for spec in METHODS.values() if spec.path == path})


def path_of_method(method: str) -> WeightPath:
    """The path whose checkpoints carry this quant_method ("bf16" for a checkpoint without one)."""
    spec = METHODS.get(method)
    return spec.path if spec else the_path(weight_format="bf16")


def fidelity_rank(path: str) -> int:
    return PATHS[path].fidelity_rank
