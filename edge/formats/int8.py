"""The 8-bit set's format: int8 codes [N, K], one bf16 scale per output channel, or per group of K a float32 scale
each (a GGUF source's own 8-bit grids copied: Q8_0's group 32, kernels/ops/int8.py). The embedding and the head of
a w4a16 or cpu_w4a8 plan take it (edge.catalog.quantized_layers: EIGHT_BIT_SET), and a GGUF's wider tensors."""

from __future__ import annotations

from edge.errors import InputError
from edge.formats.base import BF16, FP32, MemoryItem, WeightFormat, mib, resident, times
from edge.model.gguf_metadata import GGML_BLOCKS
from edge.model.shapes import LinearShape

# Per-group int8's group sizes: a GGUF's Q8_0 / Q5_0 / Q4_0 blocks (32) and Q6_K's sub-blocks (16); the AVX2 int8
# kernel rounds activations in groups of 32, which either divides (kernels/ops/avx2_int4.cpp).
INT8_GROUP_SIZES = (16, 32)


class Int8(WeightFormat):
    name = "int8"
    kernel_layouts = ("int8-channel",)
    group_sizes = INT8_GROUP_SIZES

    def bytes(self, lin: LinearShape, group: int | None = None) -> int:
        """int8 codes [N, K] + one bf16 scale per output channel [N], or per group a float32 scale each
        [N, K/group] (kernels/ops/int8.py)."""
        scales = BF16 * lin.n if group is None else FP32 * lin.n * (lin.k // group)
        return lin.count * (lin.n * lin.k + scales)

    def item(self, lin: LinearShape, group: int | None, note: str = "") -> MemoryItem:
        scales = f"2 B x {lin.n}" if group is None else f"4 B x {lin.n} x {lin.k}/{group}"
        size = self.bytes(lin, group)
        detail = f"{times(lin)}({lin.n} x {lin.k} x 1 B + {scales} scales) = {mib(size)}{note}"
        return resident("int8-weights", f"{lin.name} int8 (8-bit set)", size, detail, layer=lin.name)

    def blocks_bytes(self, lin: LinearShape, blocks: str) -> int:
        """An 8-bit-set weight kept as the file's own Q6_K, Q8_0 or Q5_0 blocks: the file's bytes (kernels/ops/q6k.py,
        g32.py: the decode layout rearranges them in place)."""
        weights, nbytes = GGML_BLOCKS[blocks]
        return lin.count * lin.n * lin.k // weights * nbytes

    def blocks_item(self, lin: LinearShape, blocks: str) -> MemoryItem:
        """blocks_bytes as a ledger line."""
        weights, nbytes = GGML_BLOCKS[blocks]
        size = self.blocks_bytes(lin, blocks)
        return resident("int8-weights", f"{lin.name} {blocks} blocks (8-bit set)", size,
                        f"the file's own {blocks} blocks, {times(lin)}({lin.n} x {lin.k} / {weights} blocks x "
                        f"{nbytes} B) = {mib(size)}", layer=lin.name)  # fmt: skip

    def check_group(self, group: int | None, k: int | None = None, *, name: str = "int8_group_size") -> None:
        """None (per channel) or one of the group sizes, dividing K when K is given."""
        if group is None:
            return
        if group not in self.group_sizes:
            raise InputError(name, group, f"one of {self.group_sizes} (or absent: one scale per output channel)")
        if k is not None and k % group:
            raise InputError(name, group, f"a divisor of K={k}")


INT8 = Int8()
