"""W4A16's format: group-wise asymmetric int4 in PyTorch's tinygemm layout (the `cpu_int4` method), with the
row-major copies a layout or a decode kernel reads beside it, and the 8-bit set (edge.formats.int8) or bf16 for
the layers that take no 4 bits.

    tinygemm buffers   packed codes [N, K/2] uint8 + scales and zeros bf16 [K/group, N, 2], N in blocks of the
                       host's block (4 x the float vector width torch dispatched to: 32 under AVX2, 64 under AVX-512,
                       16 on ARM NEON, 32 with 256-bit SVE;
                       the measurement, kernels.ops.layout, is authoritative and this rule its fallback)
    row-major copy     qweight uint8 [N, K/2] + scales and zeros bf16 [N, K/g] each: the same size
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from edge.catalog import shape_rules as rules
from edge.catalog.kernel_registry import DECODE_KERNELS, KERNELS, KernelSpec
from edge.facts import fact
from edge.formats.base import (
    BF16,
    LM_HEAD,
    Layers,
    MemoryItem,
    WeightFormat,
    embedding,
    head,
    kept_bf16,
    layer_linears,
    mib,
    one,
    parts,
    resident,
    times,
    transient,
)
from edge.formats.int8 import INT8
from edge.model.gguf_metadata import GGML_BLOCKS
from edge.model.shapes import LinearShape, ModelShape

PACKED = "int4-tinygemm"  # the kernel layouts this format stores (edge.catalog.kernel_registry)
ROW_MAJOR = "int4-rowmajor"
# torch.backends.cpu.get_cpu_capability() -> the facts-table key of the block it packs with: 4 x the float vector
# torch dispatched to. x86: AVX-512 64, AVX2 and the scalar DEFAULT (8-float generic vectors) 32. aarch64: SVE256 32,
# every other capability (DEFAULT: NEON's 4-float vectors) 16 (measured under emulation, docs/FACTS.md).
_BLOCK_FACTS = {"AVX512": "avx512.tinygemm_block", "AVX2": "avx2.tinygemm_block", "DEFAULT": "avx2.tinygemm_block"}
_ARM_BLOCK_FACTS = {"SVE256": "arm.sve256.tinygemm_block"}
_ARM_BLOCK_FACT = "arm.tinygemm_block"


def block_fact_key(capability: str | None, arch: str | None = None) -> str | None:
    if capability is None:
        return None
    if arch == "aarch64":
        return _ARM_BLOCK_FACTS.get(capability, _ARM_BLOCK_FACT)
    return _BLOCK_FACTS.get(capability)


def derived_block(capability: str | None, arch: str | None = None) -> int | None:
    """The block torch packs with at this CPU capability on this architecture (docs/FACTS.md), or None when no rule
    is known.

    Authoritative is the measurement (kernels.ops.layout, cached by edge.device.layout_cache); this is its fallback.
    """
    key = block_fact_key(capability, arch)
    return int(fact(key).value) if key else None


class Tinygemm(WeightFormat):
    name = "tinygemm"
    kernel_layouts = (PACKED, ROW_MAJOR)
    eight_bit = INT8
    group_sizes = rules.TINYGEMM_GROUP_SIZES
    group_note = "tinygemm's group sizes"
    # 4.5 bits/weight with bf16 scale and zero per 64 weights; layouts differ only in prefill.
    derived_bytes = 0.5625
    decode_kernels = True
    # int4: uint8 codes + fp32 values (+ the bf16 cast unless fp32 is the prefill dtype); int8: fp32 + bf16
    _DEQUANT_WHAT: ClassVar[dict[int, str]] = {
        5: "uint8 codes + fp32 values", 7: "uint8 codes + fp32 values + bf16 cast", 6: "fp32 + bf16 values",
    }  # fmt: skip

    def bytes(self, lin: LinearShape, group: int) -> int:
        """Packed codes [N, K/2] uint8 + scales and zeros bf16 [K/group, N, 2] (a row-major copy: the same)."""
        return lin.count * (lin.n * lin.k // 2 + 2 * BF16 * lin.n * (lin.k // group))

    def detail(self, lin: LinearShape, group: int) -> str:
        return (f"{times(lin)}({lin.n} x {lin.k} / 2 B codes + 2 x 2 B x {lin.n} x {lin.k}/{group} scales and "
                f"zeros) = {mib(self.bytes(lin, group))}")  # fmt: skip

    def cannot_hold(self, layout: str, n: int, k: int, group: int) -> str | None:
        if layout == PACKED and (n % rules.PACK_N_MULTIPLE or k % group):
            return f"{n}x{k}: tinygemm packs N in multiples of {rules.PACK_N_MULTIPLE} and K in whole groups of {group}"
        if layout == ROW_MAJOR and k % group:
            return f"{n}x{k}: K in whole groups of {group}"
        return None

    def reads_row_major(self, decode_kernel: str) -> bool:
        """The decode kernel reads the row-major copy of the int4 weights (so every quantized layer keeps one)."""
        return DECODE_KERNELS[decode_kernel].weight_format == ROW_MAJOR

    def decode_copy_only(self, layout: str | None, decode_kernel: str) -> bool:
        """Whether an int4 layer keeps only its decode kernel's copy: the direct layout with a decode kernel that reads
        its own copy. The batches tinygemm took (below the dequant threshold) then run the decode kernel, and wider
        ones dequantize that copy (C++, kernels/ops/avx2_int4.py dequantize: 0.16 ms for 1536x576 against tinygemm's
        buffer's 0.54 ms, Zen 4, 2026-12-06), instead of the engine holding a tinygemm buffer beside it: the weights
        once, not twice. A layer of a GGUF's own Q4_K blocks keeps only the blocks (kernels/ops/q4k.py
        dequantize_any)."""
        return layout == "direct" and self.reads_row_major(decode_kernel)

    def row_major_kernels(self) -> list[KernelSpec]:
        """The kernels that read the row-major copy (this project's AVX2 kernels, kernels/ops/avx2_int4.cpp)."""
        return [spec for spec in KERNELS.values() if spec.weight_format == ROW_MAJOR]

    def weight_items(self, model: ModelShape, layers: Layers, layout: str | None, group: int | None, *,
                     block: int, decode_kernel: str) -> list[MemoryItem]:  # fmt: skip
        """int4 tinygemm buffers, bf16 for the layers kept bf16, and the row-major copies the layout keeps.

        A tied embedding is quantized once (quantize_embedding): the head runs through tinygemm and a row-major
        copy serves the embedding lookups (dequantizing the gathered rows), so it never needs a layout duplicate.
        """
        assert layout is not None and group is not None, (layout, group)
        lm_head = head(model)
        tied = model.tie_word_embeddings
        items: list[MemoryItem] = []
        emb = one(layers, embedding(model).name)
        if emb.format == "int8":
            shared = " (tied: the head multiplies the same rows)" if tied else ""
            items.append(INT8.item(embedding(model), emb.group, shared))
        elif tied and emb.format == "int4":
            detail = self.detail(lm_head, group)
            items += [
                resident("int4-weights", "lm_head (tied embedding) int4 tinygemm", self.bytes(lm_head, group), detail,
                         layer=LM_HEAD),
                resident("lookup-copy", "tied embedding row-major int4 copy (lookups)", self.bytes(lm_head, group),
                         f"second copy of the quantized embedding, row-major qweight + scales + zeros: {detail}",
                         layer=embedding(model).name),
            ]  # fmt: skip
        else:
            items.append(kept_bf16(embedding(model), emb.why))
        packed = []
        one_copy = self.decode_copy_only(layout, decode_kernel)
        for lin, decision in parts(layer_linears(model) + ([] if tied else [lm_head]), layers):
            if decision.format == "int4" and one_copy and decision.blocks:
                weights, nbytes = GGML_BLOCKS[decision.blocks]
                size = lin.count * lin.n * lin.k // weights * nbytes
                items.append(resident("int4-weights", f"{lin.name} {decision.blocks} blocks (decode copy)", size,
                                      f"the only copy (direct layout, decode_kernel {decode_kernel}): the file's own "
                                      f"{decision.blocks} blocks, which batches at the dequant threshold or wider "
                                      f"dequantize: {times(lin)}({lin.n} x {lin.k} / {weights} blocks x {nbytes} B) "
                                      f"= {mib(size)}", layer=lin.name))  # fmt: skip
            elif decision.format == "int4" and one_copy:
                items.append(resident("int4-weights", f"{lin.name} int4 decode copy", self.bytes(lin, group),
                                      f"the only copy (direct layout, decode_kernel {decode_kernel}): batches at the "
                                      f"dequant threshold or wider dequantize it; {self.detail(lin, group)}",
                                      layer=lin.name))  # fmt: skip
            elif decision.format == "int4":
                packed.append((lin, decision.blocks))
                items.append(resident("int4-weights", f"{lin.name} int4 tinygemm", self.bytes(lin, group),
                                      self.detail(lin, group), layer=lin.name))  # fmt: skip
            elif decision.format == "int8" and decision.blocks:
                items.append(INT8.blocks_item(lin, decision.blocks))
            elif decision.format == "int8":
                items.append(INT8.item(lin, decision.group))
            else:
                items.append(kept_bf16(lin, decision.why))
        return items + self._row_major_copies(packed, layout, group, block, decode_kernel)

    def _row_major_copies(self, packed: Iterable[tuple[LinearShape, str | None]], layout: str, group: int,
                          block: int, decode_kernel: str) -> list[MemoryItem]:  # fmt: skip
        """The row-major copies a layout keeps beside the tinygemm buffers.

        dual: every quantized layer, for prefill dequantize; direct: only layers whose N does not tile the host
        block (docs/FACTS.md: direct saved 615 MB of dual's 3542 MB resident on Spark); kernel-only: none.
        A decode kernel that reads the row-major copy ("avx2", "avx2-w4a8"): every quantized layer in any layout.
        A layer whose decode copy keeps the file's own blocks (its `blocks`: Q4_K) holds them at the file's size.
        """
        avx2 = self.reads_row_major(decode_kernel)
        if layout == "kernel-only" and not avx2:
            return []
        items = []
        for lin, blocks in packed:
            if avx2 and blocks:
                weights, nbytes = GGML_BLOCKS[blocks]
                size = lin.count * lin.n * lin.k // weights * nbytes
                items.append(resident("row-major-copy", f"{lin.name} {blocks} blocks (decode copy)", size,
                                      f"the file's own {blocks} blocks, which the AVX2 decode kernel (decode_kernel: "
                                      f"{decode_kernel}) reads: {times(lin)}({lin.n} x {lin.k} / {weights} blocks x "
                                      f"{nbytes} B) = {mib(size)}", layer=lin.name))  # fmt: skip
                continue
            if avx2:
                why = f"AVX2 decode kernel (decode_kernel: {decode_kernel}) reads the row-major copy"
            elif layout == "dual":
                why = "dual layout: row-major copy for prefill dequantize"
            elif not rules.tiles_block(lin, block):
                why = f"direct layout, but N={lin.n} does not tile the {block}-channel block: row-major copy kept"
            else:
                continue
            items.append(resident("row-major-copy", f"{lin.name} row-major copy", self.bytes(lin, group),
                                  f"{why}: {self.detail(lin, group)}", layer=lin.name))  # fmt: skip
        return items

    def load_transients(self, model: ModelShape, layers: Layers, *, repack_chunk_rows: int) -> list[MemoryItem]:
        """The repack chunk: the loader expands a chunk of output channels' codes to int32 at a time.

        No bf16 copy here: edge-convert quantizes in its own process before the engine starts (server.cli.prepare),
        and the engine loads the converted codes, so only the repack chunk stacks on the engine's resident bytes.
        """
        rows = repack_chunk_rows
        # a tied embedding is the head
        packed = [lin for lin in model.linears if any(d.format == "int4" for d in layers[lin.name])]
        if not packed:
            return []
        widest = max(packed, key=lambda lin: min(rows, lin.n) * lin.k)
        chunk = min(rows, widest.n)
        return [
            transient(
                "repack-transient",
                "repack transient (int32 codes)",
                4 * chunk * widest.k,
                f"{widest.name}: 4 B x {chunk} rows x {widest.k} = {mib(4 * chunk * widest.k)} (codes "
                f"expanded to int32 a chunk of {rows} output channels at a time: quantization_config's "
                "repack_chunk_rows)",
            )
        ]

    def run_transients(self, model: ModelShape, layers: Layers, layout: str | None, *, dequant_threshold: int,
                       prefill_dtype: str, max_model_len: int, max_num_seqs: int) -> list[MemoryItem]:  # fmt: skip
        """At run time, not load: a batch of >= threshold rows dequantizes the whole layer before its GEMM.

        kernels/ops/int4_ops.py dequantizes to [N, K]: uint8 codes (1 B) then fp32 arithmetic (4 B, kernels/ops/int4.py
        apply_scales), cast to the plan's prefill dtype (edge.measure.kernel_params: bf16 adds 2 B, fp32 is computed in
        place). Decoder layers see prompt-length batches; the head one row per running sequence.
        kernels/vllm_plugin/cpu_int4.py runs a tied int4 head dual whatever the layout, so even kernel-only
        dequantizes it; an int8 layer (kernels/ops/int8.py) dequantizes wide batches to bf16 in every layout. Freed
        after each layer: a transient on top of the resident total, not resident itself.
        """
        assert layout is not None
        threshold = dequant_threshold
        bytes_per = {"int4": 1 + 4 + (2 if prefill_dtype == "bfloat16" else 0), "int8": 4 + 2}

        def dequantizes(fmt: str, rows: int, int4_dequantizes: bool) -> bool:
            return rows >= threshold and (fmt == "int8" or (fmt == "int4" and int4_dequantizes))

        # int8 layers dequantize wide batches in every layout (kernels/ops/int4_ops.py cpu_int8_linear)
        candidates = [(lin, d.format) for lin in layer_linears(model) for d in layers[lin.name]
                      if dequantizes(d.format, max_model_len, layout != "kernel-only")]  # fmt: skip
        lm_head = head(model)
        head_format = one(layers, LM_HEAD).format
        if dequantizes(head_format, max_num_seqs, layout != "kernel-only" or model.tie_word_embeddings):
            candidates.append((lm_head, head_format))
        if not candidates:
            return []
        widest, fmt = max(candidates, key=lambda pair: pair[0].n * pair[0].k * bytes_per[pair[1]])
        per_weight = bytes_per[fmt]
        size = per_weight * widest.n * widest.k
        return [
            MemoryItem(
                kind="dequant-working-set",
                layer=widest.name,
                name="prefill dequantize working set",
                phase="run-transient",
                bytes=size,
                detail=f"{widest.name}: {widest.n} x {widest.k} x {per_weight} B "
                f"({self._DEQUANT_WHAT[per_weight]}) = {mib(size)}, once a batch reaches {threshold} rows",
            )
        ]


TINYGEMM = Tinygemm()
