"""The memory ledger: every byte a plan costs, named, computed from shapes, with the arithmetic shown.

Peak model: peak_bytes = resident_bytes + the largest single transient. Transients are not summed: the loader
converts one tensor (or one chunk of one tensor) at a time, and a w4a16 batch dequantizes one layer at a time.
That run-time working set is filed under phase "run-transient". Memory means RssAnon summed over the vLLM
process tree (docs/FACTS.md), which is what engine_baseline_bytes was measured as; the allocator's retention is
inside that measurement, so it is not an item of its own (it was, as a 150 MiB reference figure, until
benchmarks/ledger_vs_rss.py showed the ledger 16-20 % above the two-process engine, 2026-12-01).
"""

from __future__ import annotations

from collections.abc import Iterable

from edge import rules
from edge.export_plan import WEIGHT_BLOCK
from edge.kernel_params import KernelParams
from edge.kernel_registry import DEFAULT_DECODE_KERNEL, reads_row_major
from edge.plan import ItemKind, Layout, MemoryItem, MemoryLedger, WeightPath
from edge.quantized_layers import EMBEDDING, LayerDecision, QuantRules, by_kind, format_counts, model_layers, rules_for
from edge.shapes import LinearShape, ModelShape
from edge.weight_paths import PATHS

FP32 = 4  # bytes of an exported graph's scale
BF16 = 2  # bytes; the engine runs every path with bf16 activations and bf16 non-quantized tensors
LM_HEAD = "lm_head"
Layers = dict[str, list[LayerDecision]]  # kind -> its parts (edge.quantized_layers.model_layers)


def estimate(
    model: ModelShape,
    path: WeightPath,
    layout: Layout | None,
    group_size: int | None,
    *,
    max_model_len: int,
    max_num_seqs: int,
    kernel: KernelParams,
    budget_bytes: int | None,
    engine_baseline_bytes: int,
    quant: QuantRules | None = None,
    bf16_repack_retention: float = 0.0,
) -> MemoryLedger:
    """Itemized resident footprint and load-time peak of running `model` on `path`.

    kernel: the w4a16 kernel's parameters for the device (edge.kernel_params), the same values the plan writes
    into the checkpoint's quantization_config: block, dequant threshold, prefill dtype, repack chunk.
    Which weights are quantized is asked of edge.quantized_layers, as the converter and the vLLM method do:
    `quant`, by default the rules a plan writes (rules_for).
    bf16_repack_retention: the share of the bf16 linears' bytes the engine's allocator keeps after vLLM repacks
    them for oneDNN and frees the originals, where the engine baseline was measured on a quantized plan (which
    repacks nothing); 0 where it was measured on bf16 and so holds it (edge.planner.engine_baseline).
    """
    quant = quant or rules_for(model, path, group_size)
    layers: Layers = by_kind(model_layers(model, quant))  # a kind split by format (a GGUF's mixed grid): parts
    weight_format = PATHS[path].weight_format  # which weight items, edge.weight_paths
    if weight_format == "export":
        items = _export_weights(model)
    else:
        if weight_format == "bf16":
            weights = _bf16_weights(model)
        elif weight_format == "tinygemm":
            assert layout is not None and group_size is not None, (layout, group_size)
            weights = _tinygemm_weights(model, layers, layout, group_size, kernel.block, kernel.decode_kernel)
        else:
            assert weight_format == "gptq", (path, weight_format)
            weights = _gptq_weights(model, layers, group_size)
        items = [
            *weights,
            _norms(model),
            *_biases(model),
            _rope(model, max_model_len),
            _kv_cache(model, max_model_len, max_num_seqs),
            _resident(
                "engine-baseline",
                "engine baseline",
                engine_baseline_bytes,
                "the vLLM process tree's RssAnon without weights and KV cache (measured, passed in)",
            ),
            *_transients(model, layers, path, kernel),
        ]
        if bf16_repack_retention > 0:
            items += _repack_retention(model, items, bf16_repack_retention)
        if weight_format == "tinygemm":
            assert layout is not None and group_size is not None
            items += _dequant_working_set(model, layers, layout, kernel, max_model_len, max_num_seqs)
    resident = sum(item.bytes for item in items if item.phase == "resident")
    transient = max((item.bytes for item in items if item.phase != "resident"), default=0)
    peak = resident + transient
    return MemoryLedger(
        resident_bytes=resident,
        peak_bytes=peak,
        budget_bytes=budget_bytes,
        fits=budget_bytes is None or peak <= budget_bytes,
        items=items,
    )


# --- bytes of one kind of linear, all `count` layers of it -------------------------------------------------


def bf16_bytes(lin: LinearShape) -> int:
    return lin.count * lin.n * lin.k * BF16


def tinygemm_bytes(lin: LinearShape, group: int) -> int:
    """Packed codes [N, K/2] uint8 + scales and zeros bf16 [K/group, N, 2].

    The row-major copy is the same size: qweight uint8 [N, K/2] + scales and zeros bf16 [N, K/g] each.
    """
    return lin.count * (lin.n * lin.k // 2 + 2 * BF16 * lin.n * (lin.k // group))


def gptq_bytes(lin: LinearShape, group: int) -> int:
    """qweight int32 [K/8, N] + scales bf16 [K/g, N] + qzeros int32 [K/g, N/8]; group -1: one group a row."""
    groups = 1 if group == -1 else lin.k // group
    return lin.count * (lin.n * lin.k // 2 + BF16 * lin.n * groups + 4 * (lin.n // 8) * groups)


def _resident(
    kind: ItemKind, name: str, size: int, detail: str, *, layer: str | None = None, avoidable_bytes: int | None = None
) -> MemoryItem:
    return MemoryItem(
        kind=kind, layer=layer, name=name, bytes=size, phase="resident", detail=detail, avoidable_bytes=avoidable_bytes
    )


def _transient(kind: ItemKind, name: str, size: int, detail: str) -> MemoryItem:
    return MemoryItem(kind=kind, name=name, bytes=size, phase="load-transient", detail=detail)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _times(lin: LinearShape) -> str:
    return f"{lin.count} x " if lin.count > 1 else ""


def _bf16_detail(lin: LinearShape) -> str:
    return f"{_times(lin)}{lin.n} x {lin.k} x 2 B = {_mib(bf16_bytes(lin))}"


def _tinygemm_detail(lin: LinearShape, group: int) -> str:
    return (
        f"{_times(lin)}({lin.n} x {lin.k} / 2 B codes + 2 x 2 B x {lin.n} x {lin.k}/{group} scales and zeros)"
        f" = {_mib(tinygemm_bytes(lin, group))}"
    )


def _embedding(model: ModelShape) -> LinearShape:
    return LinearShape(name=EMBEDDING, n=model.vocab_size, k=model.hidden_size, count=1)


def _layer_linears(model: ModelShape) -> list[LinearShape]:
    return [lin for lin in model.linears if lin.name != LM_HEAD]


def _head(model: ModelShape) -> LinearShape:
    heads = [lin for lin in model.linears if lin.name == LM_HEAD]
    return heads[0] if heads else _embedding(model).model_copy(update={"name": LM_HEAD})


def _one(layers: Layers, name: str) -> LayerDecision:
    """The decision of a weight that is one tensor (the embedding, the head): never split."""
    (decision,) = layers[name]
    return decision


def _parts(linears: Iterable[LinearShape], layers: Layers) -> list[tuple[LinearShape, LayerDecision]]:
    """Each of `linears` per format its layers take (a kind split by format counts each part in its own), as
    LinearShapes of that many layers, each with the first of its parts' decisions."""
    parts: list[tuple[LinearShape, LayerDecision]] = []
    for lin in linears:
        for fmt, count in format_counts(layers[lin.name]).items():
            first = next(d for d in layers[lin.name] if d.format == fmt)
            parts.append((lin.model_copy(update={"count": count}), first))
    return parts


# --- weights per path ----------------------------------------------------------------------------------


def _bf16_weights(model: ModelShape) -> list[MemoryItem]:
    emb = _embedding(model)
    tied = " (tied: the head reads this same tensor)" if model.tie_word_embeddings else ""
    items = [
        _resident("bf16-weights", "embedding (bf16)", bf16_bytes(emb), _bf16_detail(emb) + tied, layer=EMBEDDING)
    ]
    linears = _layer_linears(model) + ([] if model.tie_word_embeddings else [_head(model)])
    items += [
        _resident("bf16-weights", f"{lin.name} (bf16)", bf16_bytes(lin), _bf16_detail(lin), layer=lin.name)
        for lin in linears
    ]
    return items


# glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, malloc(3) M_MMAP_THRESHOLD): a block
# above it is always mmapped, so freeing it returns it to the system
MMAP_THRESHOLD_MAX = 32 << 20


def _repack_retention(model: ModelShape, items: list[MemoryItem], share: float) -> list[MemoryItem]:
    """vLLM's CPU linear repacks each bf16 weight for oneDNN and frees the original; glibc keeps most of those freed
    blocks in its heap (RssAnon), but not a tensor above MMAP_THRESHOLD_MAX (mmapped, unmapped when freed: a 7B
    model's linears). Not the embedding: a lookup table is not repacked."""
    shapes = {lin.name: lin for lin in [*_layer_linears(model), _head(model)]}
    kept = [i for i in items if i.kind == "bf16-weights" and i.layer in shapes
            and BF16 * shapes[i.layer].n * shapes[i.layer].k <= MMAP_THRESHOLD_MAX]  # fmt: skip
    linears = sum(i.bytes for i in kept)
    if not linears:
        return []
    detail = (f"{share:.2f} x {_mib(linears)} of bf16 linears of at most {_mib(MMAP_THRESHOLD_MAX)} a tensor "
              "(measured: benchmarks/ledger_vs_rss.py, bf16 against the speed plan)")  # fmt: skip
    return [_resident("repack-retention", "bf16 originals kept by the allocator after repacking",
                      round(share * linears), detail)]  # fmt: skip


def int8_bytes(lin: LinearShape, group: int | None = None) -> int:
    """int8 codes [N, K] + one bf16 scale per output channel [N], or per group a float32 scale each [N, K/group]
    (kernels/ops/int8.py)."""
    scales = BF16 * lin.n if group is None else FP32 * lin.n * (lin.k // group)
    return lin.count * (lin.n * lin.k + scales)


def _int8(lin: LinearShape, group: int | None, note: str = "") -> MemoryItem:
    scales = f"2 B x {lin.n}" if group is None else f"4 B x {lin.n} x {lin.k}/{group}"
    detail = f"{_times(lin)}({lin.n} x {lin.k} x 1 B + {scales} scales) = {_mib(int8_bytes(lin, group))}{note}"
    return _resident("int8-weights", f"{lin.name} int8 (8-bit set)", int8_bytes(lin, group), detail, layer=lin.name)


def _kept_bf16(lin: LinearShape, why: str) -> MemoryItem:
    return _resident(
        "bf16-weights", f"{lin.name} kept bf16", bf16_bytes(lin), f"{why}: {_bf16_detail(lin)}", layer=lin.name
    )


def _tinygemm_weights(
    model: ModelShape, layers: Layers, layout: Layout, group: int, block: int,
    decode_kernel: str = DEFAULT_DECODE_KERNEL,
) -> list[MemoryItem]:  # fmt: skip
    """int4 tinygemm buffers, bf16 for the layers kept bf16, and the row-major copies the layout keeps.

    A tied embedding is quantized once (quantize_embedding): the head runs through tinygemm and a row-major
    copy serves the embedding lookups (dequantizing the gathered rows), so it never needs a layout duplicate.
    """
    head = _head(model)
    tied = model.tie_word_embeddings
    items: list[MemoryItem] = []
    embedding = _one(layers, EMBEDDING)
    if embedding.format == "int8":
        shared = " (tied: the head multiplies the same rows)" if tied else ""
        items.append(_int8(_embedding(model), embedding.group, shared))
    elif tied and embedding.format == "int4":
        detail = _tinygemm_detail(head, group)
        items += [
            _resident("int4-weights", "lm_head (tied embedding) int4 tinygemm", tinygemm_bytes(head, group), detail,
                      layer=LM_HEAD),
            _resident("lookup-copy", "tied embedding row-major int4 copy (lookups)", tinygemm_bytes(head, group),
                      f"second copy of the quantized embedding, row-major qweight + scales + zeros: {detail}",
                      layer=EMBEDDING),
        ]  # fmt: skip
    else:
        items.append(_kept_bf16(_embedding(model), embedding.why))
    packed = []
    for lin, decision in _parts(_layer_linears(model) + ([] if tied else [head]), layers):
        if decision.format == "int4":
            packed.append(lin)
            items.append(_resident("int4-weights", f"{lin.name} int4 tinygemm", tinygemm_bytes(lin, group),
                                   _tinygemm_detail(lin, group), layer=lin.name))  # fmt: skip
        elif decision.format == "int8":
            items.append(_int8(lin, decision.group))
        else:
            items.append(_kept_bf16(lin, decision.why))
    return items + _row_major_copies(packed, layout, group, block, decode_kernel=decode_kernel)


def _row_major_copies(
    packed: Iterable[LinearShape], layout: Layout, group: int, block: int, *, decode_kernel: str = DEFAULT_DECODE_KERNEL
) -> list[MemoryItem]:
    """The row-major copies a layout keeps beside the tinygemm buffers.

    dual: every quantized layer, for prefill dequantize; direct: only layers whose N does not tile the host
    block (docs/FACTS.md: direct saved 615 MB of dual's 3542 MB resident on Spark); kernel-only: none.
    decode_kernel "avx2" or "avx2-w4a8": every quantized layer in any layout, the copy the AVX2 decode kernel reads.
    """
    avx2 = reads_row_major(decode_kernel)
    if layout == "kernel-only" and not avx2:
        return []
    items = []
    for lin in packed:
        if avx2:
            why = f"AVX2 decode kernel (decode_kernel: {decode_kernel}) reads the row-major copy"
        elif layout == "dual":
            why = "dual layout: row-major copy for prefill dequantize"
        elif not rules.tiles_block(lin, block):
            why = f"direct layout, but N={lin.n} does not tile the {block}-channel block: row-major copy kept"
        else:
            continue
        items.append(
            _resident(
                "row-major-copy",
                f"{lin.name} row-major copy",
                tinygemm_bytes(lin, group),
                f"{why}: {_tinygemm_detail(lin, group)}",
                layer=lin.name,
            )
        )
    return items


def _gptq_weights(model: ModelShape, layers: Layers, group: int | None) -> list[MemoryItem]:
    """GPTQ int4 linears; the embedding and the head as edge.quantized_layers decides. vLLM's own gptq path
    quantizes the head to 4 bits (docs/FACTS.md: a bf16 head costs more per step than the 4-bit saving), so a tied
    embedding is untied and stays bf16 beside it; the plugin's cpu_w4a8 keeps the 8-bit set (embedding and head
    int8, still tied) or, for fidelity, both bf16 and tied."""
    emb, head = _embedding(model), _head(model)
    tied = model.tie_word_embeddings
    head_format, embedding_format = _one(layers, LM_HEAD).format, _one(layers, EMBEDDING).format
    if embedding_format == "int8":
        shared = " (tied: the head multiplies the same rows)" if tied else ""
        embedding = _int8(emb, _one(layers, EMBEDDING).group, shared)
    elif tied and head_format != "bf16":
        embedding = _resident("untie-cost", "embedding kept bf16 (cost of untying the head)", bf16_bytes(emb),
                              f"the head is quantized apart: {_bf16_detail(emb)}", layer=EMBEDDING)  # fmt: skip
    else:
        shared = " (tied: the head reads this same tensor)" if tied else ""
        embedding = _resident("bf16-weights", "embedding (bf16)", bf16_bytes(emb), _bf16_detail(emb) + shared,
                              layer=EMBEDDING)  # fmt: skip
    items = [embedding]
    head_shares_embedding = tied and head_format == embedding_format
    for lin, decision in _parts([*_layer_linears(model), *([] if head_shares_embedding else [head])], layers):
        if decision.format == "int4":
            assert group is not None
            groups = "1" if group == -1 else f"{lin.k}/{group}"
            detail = (
                f"{_times(lin)}({lin.n} x {lin.k} / 2 B qweight + 2 B x {lin.n} x {groups} scales"
                f" + 4 B x {lin.n}/8 x {groups} qzeros) = {_mib(gptq_bytes(lin, group))}"
            )
            items.append(_resident("int4-weights", f"{lin.name} GPTQ int4", gptq_bytes(lin, group), detail,
                                   layer=lin.name))  # fmt: skip
        elif decision.format == "int8":
            items.append(_int8(lin, decision.group))
        else:
            items.append(_kept_bf16(lin, decision.why))
    return items


def _export_weights(model: ModelShape) -> list[MemoryItem]:
    """The exported graph's weights (kernels/export/export_graph.py, what edge-export writes); no engine and no KV
    cache.

    w8a16 (docs/FACTS.md: "calibrated w8a16 was the only scheme correct on device"): 1 byte per weight plus, per
    block of WEIGHT_BLOCK inputs of each output channel, a float32 scale and an int8 zero point. The graph stores
    the head even when it is tied to the embedding (the head is a MatMul, the embedding a Gather); norms as below.
    """
    linears = [_embedding(model), *_layer_linears(model), _head(model)]
    items = []
    for lin in linears:
        blocks = -(-lin.k // WEIGHT_BLOCK)
        size = lin.count * (lin.n * lin.k + lin.n * blocks * (FP32 + 1))
        items.append(
            _resident(
                "export-weights",
                f"{lin.name} w8a16 (exported graph)",
                size,
                f"{_times(lin)}({lin.n} x {lin.k} x 1 B + {lin.n} x {blocks} blocks x 5 B scale and zero point)"
                f" = {_mib(size)}",
                layer=lin.name,
            )
        )
    return [*items, _norms(model)]


# --- everything else the engine holds ------------------------------------------------------------------


def _norms(model: ModelShape) -> MemoryItem:
    """RMSNorm weights: two per layer and a final one; Gemma2 has four per layer; Qwen3 adds q_norm/k_norm."""
    per_layer = 4 if model.model_type == "gemma2" else 2
    params = (per_layer * model.num_layers + 1) * model.hidden_size
    detail = f"({per_layer} x {model.num_layers} + 1) x {model.hidden_size}"
    if model.model_type == "qwen3":
        params += 2 * model.num_layers * model.head_dim
        detail += f" + 2 x {model.num_layers} x {model.head_dim} (q_norm, k_norm)"
    return _resident("norms", "norms (bf16)", params * BF16, f"{detail} x 2 B = {_mib(params * BF16)}")


def _biases(model: ModelShape) -> list[MemoryItem]:
    """Qwen2 carries q/k/v biases (vLLM qwen2.py builds QKVParallelLinear with bias=True)."""
    if model.model_type != "qwen2":
        return []
    n = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    size = model.num_layers * n * BF16
    return [_resident("biases", "q/k/v biases (bf16)", size, f"{model.num_layers} x {n} x 2 B = {_mib(size)}")]


def _rope(model: ModelShape, max_model_len: int) -> MemoryItem:
    """The rotary cos/sin table, as vLLM 0.28 builds it (model_executor/layers/rotary_embedding/).

    One table per distinct rope (__init__.py:83 caches by key). Rows = max_position_embeddings (docs/FACTS.md:
    Llama passes max_position_embeddings, not max_model_len); columns = rotary_dim, the cos half and the sin
    half (base.py:94-103, computed in fp32); then cast to get_rope's dtype (base.py:59-61), which defaults
    to torch.get_default_dtype() (__init__.py:41-42), set to the model dtype while the model is built
    (model_loader/base_loader.py:53): bf16 resident.
    """
    rows, cols = model.max_position_embeddings, model.rotary_dim
    row_bytes = cols * BF16
    avoidable = max(0, rows - max_model_len) * row_bytes
    return _resident(
        "rope",
        "RoPE cos/sin table",
        rows * row_bytes,
        f"{rows} positions x {cols} (cos + sin halves) x 2 B bf16 = {_mib(rows * row_bytes)}; capping "
        f"the table at max_model_len={max_model_len} would save {_mib(avoidable)}. Built in fp32 at "
        f"model construction (~10 x {rows} x {cols} B of intermediates, before any weight loads)",
        avoidable_bytes=avoidable,
    )


def _kv_cache(model: ModelShape, max_model_len: int, max_num_seqs: int) -> MemoryItem:
    tokens = rules.kv_tokens_per_layer(model, max_model_len)
    counts: dict[int, int] = {}
    for t in tokens:
        counts[t] = counts.get(t, 0) + 1
    layers = " + ".join(f"{n} layers x {t} tokens" for t, n in sorted(counts.items(), reverse=True))
    size = rules.kv_cache_bytes(model, max_model_len, max_num_seqs)
    return _resident(
        "kv-cache",
        "KV cache",
        size,
        f"2 (K, V) x {model.num_kv_heads} kv heads x {model.head_dim} x 2 B x ({layers}) x "
        f"{max_num_seqs} seqs = {_mib(size)}; sliding layers hold min(window, max_model_len); "
        "given to vLLM as --kv-cache-memory-bytes",
    )


# --- load-time transients ------------------------------------------------------------------------------


def _weight_matrices(model: ModelShape) -> list[LinearShape]:
    return [_embedding(model), *model.linears]


def _transients(model: ModelShape, layers: Layers, path: WeightPath, kernel: KernelParams) -> list[MemoryItem]:
    if PATHS[path].weight_format != "tinygemm":
        largest = max(_weight_matrices(model), key=lambda lin: lin.n * lin.k)
        one = largest.model_copy(update={"count": 1})
        return [
            _transient(
                "load-copy",
                "largest tensor's load copy",
                bf16_bytes(one),
                f"{largest.name}: {_bf16_detail(one)} copied while it loads",
            )
        ]
    rows = kernel.repack_chunk_rows
    # a tied embedding is the head
    packed = [lin for lin in model.linears if any(d.format == "int4" for d in layers[lin.name])]
    # No bf16 copy here: edge-convert quantizes in its own process before the engine starts (server.cli.prepare),
    # and the engine loads the converted codes, so only the repack chunk stacks on the engine's resident bytes.
    items = []
    if packed:
        widest = max(packed, key=lambda lin: min(rows, lin.n) * lin.k)
        chunk = min(rows, widest.n)
        items.append(
            _transient(
                "repack-transient",
                "repack transient (int32 codes)",
                4 * chunk * widest.k,
                f"{widest.name}: 4 B x {chunk} rows x {widest.k} = {_mib(4 * chunk * widest.k)} (codes "
                f"expanded to int32 a chunk of {rows} output channels at a time, edge.kernel_params)",
            )
        )
    return items


def _dequant_working_set(
    model: ModelShape,
    layers: Layers,
    layout: Layout,
    kernel: KernelParams,
    max_model_len: int,
    max_num_seqs: int,
) -> list[MemoryItem]:
    """At run time, not load: a batch of >= threshold rows dequantizes the whole layer before its GEMM.

    kernels/ops/int4_ops.py dequantizes to [N, K]: uint8 codes (1 B) then fp32 arithmetic (4 B, kernels/ops/int4.py
    apply_scales), cast to the plan's prefill dtype (edge.kernel_params: bf16 adds 2 B, fp32 is computed in
    place). Decoder layers see prompt-length batches; the head one row per running sequence.
    kernels/vllm_plugin/cpu_int4.py runs a tied int4 head dual whatever the layout, so even kernel-only dequantizes it;
    an int8 layer (kernels/ops/int8.py) dequantizes wide batches to bf16 in every layout. Freed after each layer: a
    transient on top of the resident total, not resident itself.
    """
    threshold = kernel.dequant_threshold
    # int4: uint8 codes + fp32 values (+ the bf16 cast unless fp32 is the prefill dtype); int8: fp32 + bf16
    bytes_per = {"int4": 1 + 4 + (2 if kernel.prefill_dtype == "bfloat16" else 0), "int8": 4 + 2}
    def dequantizes(fmt: str, rows: int, int4_dequantizes: bool) -> bool:
        return rows >= threshold and (fmt == "int8" or (fmt == "int4" and int4_dequantizes))

    # int8 layers dequantize wide batches in every layout (kernels/ops/int4_ops.py cpu_int8_linear)
    candidates = [(lin, d.format) for lin in _layer_linears(model) for d in layers[lin.name]
                  if dequantizes(d.format, max_model_len, layout != "kernel-only")]  # fmt: skip
    head = _head(model)
    head_format = _one(layers, LM_HEAD).format
    if dequantizes(head_format, max_num_seqs, layout != "kernel-only" or model.tie_word_embeddings):
        candidates.append((head, head_format))
    if not candidates:
        return []
    widest, fmt = max(candidates, key=lambda pair: pair[0].n * pair[0].k * bytes_per[pair[1]])
    per_weight = bytes_per[fmt]
    size = per_weight * widest.n * widest.k
    what = {5: "uint8 codes + fp32 values", 7: "uint8 codes + fp32 values + bf16 cast", 6: "fp32 + bf16 values"}
    return [
        MemoryItem(
            kind="dequant-working-set",
            layer=widest.name,
            name="prefill dequantize working set",
            phase="run-transient",
            bytes=size,
            detail=f"{widest.name}: {widest.n} x {widest.k} x {per_weight} B ({what[per_weight]})"
            f" = {_mib(size)}, once a batch reaches {threshold} rows",
        )
    ]
