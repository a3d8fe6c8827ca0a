"""W4A8's format: symmetric 4-bit GPTQ (uint4b8, Q4_0's grid) that vLLM's int4 x int8 kernel reads, through the
plugin's `cpu_w4a8` or vLLM's own `gptq`; the embedding and the head as edge.catalog.quantized_layers decides.

    qweight int32 [K/8, N] + scales bf16 [K/g, N] + qzeros int32 [K/g, N/8]; group -1: one group a row
"""

from __future__ import annotations

from edge.catalog import shape_rules as rules
from edge.formats.base import (
    BF16,
    LM_HEAD,
    Layers,
    MemoryItem,
    WeightFormat,
    bf16_bytes,
    bf16_detail,
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
from edge.model.shapes import LinearShape, ModelShape


class Gptq(WeightFormat):
    name = "gptq"
    kernel_layouts = ("int4-gptq",)
    eight_bit = INT8
    group_sizes = rules.GPTQ_GROUP_SIZES
    group_note = "vLLM 0.28 GPTQ on CPU"
    # Ranking where nothing measured (ARM): 4-bit codes and a bf16 scale per 32 weights (KleidiAI's group), what the
    # kernel reads per weight, as tinygemm's 0.5625 is its codes, scale and zero per 64.
    derived_bytes = 0.5625
    # The plugin's cpu_w4a8 converts a layer's GPTQ codes for vLLM's W4A8 kernel this many output channels at a time
    # (kernels/vllm_plugin/cpu_w4a8.py to_w4a8): each chunk's codes unpacked to int32 and reordered. 2048 (K 6912)
    # peaked ~200 MiB above the load on a Gemma 3-shaped plan (AMD EPYC Zen 5, 2026-12-07); a multiple of the
    # kernel's 32-channel blocks.
    convert_chunk_channels = 512

    def cannot_hold(self, layout: str, n: int, k: int, group: int) -> str | None:
        multiple = rules.GPTQ_PARTITION_MULTIPLE
        if n % multiple or k % multiple or k % group:
            return (f"{n}x{k}: vLLM's GPTQ kernels need N and K multiples of {multiple} and K in whole groups of "
                    f"{group}")  # fmt: skip
        return None

    def bytes(self, lin: LinearShape, group: int) -> int:
        groups = 1 if group == -1 else lin.k // group
        return lin.count * (lin.n * lin.k // 2 + BF16 * lin.n * groups + 4 * (lin.n // 8) * groups)

    def load_transients(self, model: ModelShape, layers: Layers, *, repack_chunk_rows: int) -> list[MemoryItem]:
        """The W4A8 conversion's chunk: a chunk of output channels' codes as int32, unpacked and reordered (two
        copies). No bf16 copy: edge-convert quantizes in its own process before the engine starts, and the engine
        loads the converted codes."""
        converted = [lin for lin in model.linears if any(d.format == "int4" for d in layers[lin.name])]
        if not converted:
            return []
        widest = max(converted, key=lambda lin: min(self.convert_chunk_channels, lin.n) * lin.k)
        chunk = min(self.convert_chunk_channels, widest.n)
        size = 2 * 4 * chunk * widest.k
        return [transient("repack-transient", "W4A8 conversion chunk (int32 codes)", size,
                          f"{widest.name}: 2 x 4 B x {chunk} channels x {widest.k} = {mib(size)} (codes unpacked "
                          "and reordered a chunk of output channels at a time)")]  # fmt: skip

    def weight_items(self, model: ModelShape, layers: Layers, layout: str | None, group: int | None, *,
                     block: int, decode_kernel: str) -> list[MemoryItem]:  # fmt: skip
        """GPTQ int4 linears; the embedding and the head as edge.catalog.quantized_layers decides. vLLM's own gptq
        path quantizes the head to 4 bits (docs/FACTS.md: a bf16 head costs more per step than the 4-bit saving),
        so a tied embedding is untied and stays bf16 beside it; the plugin's cpu_w4a8 keeps the 8-bit set
        (embedding and head int8, still tied) or, for fidelity, both bf16 and tied."""
        emb, lm_head = embedding(model), head(model)
        tied = model.tie_word_embeddings
        head_format, embedding_format = one(layers, LM_HEAD).format, one(layers, emb.name).format
        if embedding_format == "int8":
            shared = " (tied: the head multiplies the same rows)" if tied else ""
            first = INT8.item(emb, one(layers, emb.name).group, shared)
        elif tied and head_format != "bf16":
            first = resident("untie-cost", "embedding kept bf16 (cost of untying the head)", bf16_bytes(emb),
                             f"the head is quantized apart: {bf16_detail(emb)}", layer=emb.name)  # fmt: skip
        else:
            shared = " (tied: the head reads this same tensor)" if tied else ""
            first = resident("bf16-weights", "embedding (bf16)", bf16_bytes(emb), bf16_detail(emb) + shared,
                             layer=emb.name)  # fmt: skip
        items = [first]
        head_shares_embedding = tied and head_format == embedding_format
        for lin, decision in parts([*layer_linears(model), *([] if head_shares_embedding else [lm_head])], layers):
            if decision.format == "int4":
                assert group is not None
                groups = "1" if group == -1 else f"{lin.k}/{group}"
                detail = (f"{times(lin)}({lin.n} x {lin.k} / 2 B qweight + 2 B x {lin.n} x {groups} scales"
                          f" + 4 B x {lin.n}/8 x {groups} qzeros) = {mib(self.bytes(lin, group))}")  # fmt: skip
                items.append(resident("int4-weights", f"{lin.name} GPTQ int4", self.bytes(lin, group), detail,
                                      layer=lin.name))  # fmt: skip
            elif decision.format == "int8" and decision.blocks:
                items.append(INT8.blocks_item(lin, decision.blocks))
            elif decision.format == "int8":
                items.append(INT8.item(lin, decision.group))
            else:
                items.append(kept_bf16(lin, decision.why))
        return items


GPTQ = Gptq()
