"""The memory ledger: every byte a plan costs, named, computed from shapes, with the arithmetic shown.

Peak model: peak_bytes is the larger of two moments. Loading: every resident item but the KV cache and the prefill
activations (they come after the load), plus the largest load transient. Serving: every resident item plus the
largest run transient. Transients are not summed: the loader converts one tensor (or one chunk of one tensor) at a
time, and a w4a16 batch dequantizes one layer at a time. That run-time working set is filed under phase
"run-transient". The peak counts file-backed items too (the weights the engine maps): they are anonymous while
they load, and page cache a budget must hold while serving. Memory means RssAnon summed over the vLLM
process tree (docs/FACTS.md), which is what engine_baseline_bytes was measured as; the allocator's retention is
inside that measurement, so it is not an item of its own (it was, as a 150 MiB reference figure, until
benchmarks/ledger_vs_rss.py showed the ledger 16-20 % above the two-process engine, 2026-12-01).
"""

from __future__ import annotations

from pydantic import BaseModel

from edge.catalog import shape_rules as rules
from edge.catalog.kernel_registry import reads_own_blocks
from edge.catalog.quantized_layers import LayerDecision, QuantRules, by_kind, model_layers, rules_for
from edge.catalog.weight_paths import Layout, WeightPath
from edge.formats import format_of
from edge.formats.base import (
    BF16,
    MemoryItem,
    WeightFormat,
    embedding,
    head,
    layer_linears,
    mib,
    resident,
)
from edge.measure.kernel_params import KernelParams
from edge.model.shapes import ModelShape


class MemoryLedger(BaseModel):
    resident_bytes: int  # sum of resident items
    file_backed_bytes: int = 0  # of which mapped from a file (RssFile, the page cache), the rest anonymous (RssAnon)
    peak_bytes: int  # the larger of loading's and serving's: see the module's docstring
    budget_bytes: int | None
    fits: bool  # peak within budget (True when no budget is known)
    items: list[MemoryItem]


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
    layers: list[LayerDecision] | None = None,
    bf16_repack_retention: float = 0.0,
    tokenizers: int = 1,
    tokenizer_bytes_per_token: int = 0,
    mapped_weights: bool = True,
    idle_trim: bool = False,
    drafting_bytes: int = 0,
) -> MemoryLedger:
    """Itemized resident footprint and load-time peak of running `model` on `path`.

    kernel: the w4a16 kernel's parameters for the device (edge.measure.kernel_params), the same values the plan writes
    into the checkpoint's quantization_config: block, dequant threshold, prefill dtype, repack chunk.
    Which weights are quantized is asked of edge.catalog.quantized_layers, as the converter and the vLLM method do:
    `quant`, by default the rules a plan writes (rules_for).
    bf16_repack_retention: the share of the bf16 linears' bytes the engine's allocator keeps after vLLM repacks
    them for oneDNN and frees the originals, where the engine baseline was measured on a quantized plan (which
    repacks nothing); 0 where it was measured on bf16 and so holds it (edge.plan.planner.engine_baseline).
    mapped_weights: the engine maps the tensors its modules hold from a file once loaded
    (kernels/vllm_plugin/mapped_weights.py; EDGE_MAPPED_WEIGHTS=0 turns it off): those items are file-backed once
    the engine has started. The load-time peak is unchanged: the weights are loaded into anonymous memory first.
    idle_trim: the engine gives its heap's free pages back once it idles after serving (the one-process engine,
    kernels/vllm_plugin/heap_trim.py IdleTrim), so a full prefill batch's activations are held while it serves, not
    while it idles: they count at the serving moment, added to its largest run transient, instead of as resident.
    drafting_bytes: what the engine's draft proposer holds where the plan drafts (edge.plan.speculative), else 0.
    """
    quant = quant or rules_for(model, path, group_size, own_blocks=reads_own_blocks(kernel.decode_kernel, path))
    # a kind split by format (a GGUF's mixed grid): parts; `layers`, when given, are model_layers(model, quant)
    parts = by_kind(layers if layers is not None else model_layers(model, quant))
    fmt = format_of(path)  # which weight items, edge.formats
    items = fmt.weight_items(model, parts, layout, group_size, block=kernel.block, decode_kernel=kernel.decode_kernel)
    if not fmt.runs_in_engine:
        items.append(_norms(model))
    else:
        items += [
            _norms(model),
            *_biases(model),
            _rope(model, max_model_len),
            _kv_cache(model, max_model_len, max_num_seqs),
            _tokenizer(model, tokenizers, tokenizer_bytes_per_token),
            _prefill_activations(model, idle_trim),
            resident(
                "engine-baseline",
                "engine baseline",
                engine_baseline_bytes,
                "the vLLM process tree's RssAnon without the items above (measured on the default model, passed in)",
            ),
            *fmt.load_transients(model, parts, repack_chunk_rows=kernel.repack_chunk_rows),
        ]
        if drafting_bytes:
            items.append(resident("drafting", "n-gram draft proposer", drafting_bytes,
                                  "vLLM's n-gram proposer: numba and llvmlite with its compiled function, measured "
                                  "(edge.plan.speculative DRAFTING_BYTES_FACT)"))  # fmt: skip
        if bf16_repack_retention > 0:
            items += _repack_retention(model, items, bf16_repack_retention)
        items += fmt.run_transients(model, parts, layout, dequant_threshold=kernel.dequant_threshold,
                                    prefill_dtype=kernel.prefill_dtype, max_model_len=max_model_len,
                                    max_num_seqs=max_num_seqs)  # fmt: skip
        if mapped_weights:
            items = [_mapped(item, fmt, embedding(model).name) for item in items]
    resident_bytes = sum(item.bytes for item in items if item.phase == "resident")
    peak = max(_load_peak(items), resident_bytes + _serving_extra(items))
    return MemoryLedger(
        resident_bytes=resident_bytes,
        file_backed_bytes=sum(item.bytes for item in items if item.phase == "resident" and item.backing == "file"),
        peak_bytes=peak,
        budget_bytes=budget_bytes,
        fits=budget_bytes is None or peak <= budget_bytes,
        items=items,
    )


# resident items that do not exist yet while the weights load: vLLM's CPU worker allocates the KV cache after
# load_model (Worker.initialize_from_config), and a full prefill batch's activations come with the first long prompt
AFTER_LOAD_KINDS = ("kv-cache", "prefill-activations")


def _largest(items: list[MemoryItem], phase: str) -> int:
    return max((item.bytes for item in items if item.phase == phase), default=0)


def _serving_extra(items: list[MemoryItem]) -> int:
    """What the serving moment holds beyond the resident items: the largest run transient, plus a full prefill
    batch's activations where they are not resident (idle_trim): a prefill holds them and its layers' working set at
    once."""
    activations = sum(i.bytes for i in items if i.phase == "run-transient" and i.kind == "prefill-activations")
    others = [i for i in items if i.kind != "prefill-activations"]
    return activations + _largest(others, "run-transient")


def _load_peak(items: list[MemoryItem]) -> int:
    """While loading: every resident item but those that come after the load, and the largest load transient."""
    held = sum(i.bytes for i in items if i.phase == "resident" and i.kind not in AFTER_LOAD_KINDS)
    return held + _largest(items, "load-transient")


WEIGHT_KINDS = ("bf16-weights", "int4-weights", "int8-weights", "row-major-copy", "lookup-copy", "untie-cost")
PLAIN_TENSOR_KINDS = ("norms", "biases", "rope")  # tensors a module holds as it loaded them, on every path


def _mapped(item: MemoryItem, fmt: WeightFormat, embedding_name: str) -> MemoryItem:
    """`item` as the engine holds it once it has mapped its modules' tensors (kernels/vllm_plugin/mapped_weights.py):
    the weights, norms, biases and RoPE table file-backed, except linears a format's kernel repacks into memory of
    its own (an embedding is a lookup table and is never repacked)."""
    linear = item.kind in WEIGHT_KINDS and item.layer != embedding_name
    if item.phase != "resident" or not (item.kind in PLAIN_TENSOR_KINDS or item.kind in WEIGHT_KINDS):
        return item
    if linear and not fmt.linears_mapped:
        return item
    return item.model_copy(update={"backing": "file"})


# glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, malloc(3) M_MMAP_THRESHOLD): a block
# above it is always mmapped, so freeing it returns it to the system
MMAP_THRESHOLD_MAX = 32 << 20


def _repack_retention(model: ModelShape, items: list[MemoryItem], share: float) -> list[MemoryItem]:
    """vLLM's CPU linear repacks each bf16 weight for oneDNN and frees the original; glibc keeps most of those freed
    blocks in its heap (RssAnon), but not a tensor above MMAP_THRESHOLD_MAX (mmapped, unmapped when freed: a 7B
    model's linears). Not the embedding: a lookup table is not repacked."""
    shapes = {lin.name: lin for lin in [*layer_linears(model), head(model)]}
    kept = [i for i in items if i.kind == "bf16-weights" and i.layer in shapes
            and BF16 * shapes[i.layer].n * shapes[i.layer].k <= MMAP_THRESHOLD_MAX]  # fmt: skip
    linears = sum(i.bytes for i in kept)
    if not linears:
        return []
    detail = (f"{share:.2f} x {mib(linears)} of bf16 linears of at most {mib(MMAP_THRESHOLD_MAX)} a tensor "
              "(measured: benchmarks/ledger_vs_rss.py, bf16 against the speed plan)")  # fmt: skip
    return [resident("repack-retention", "bf16 originals kept by the allocator after repacking",
                      round(share * linears), detail)]  # fmt: skip


# --- everything else the engine holds ------------------------------------------------------------------


def _norms(model: ModelShape) -> MemoryItem:
    """RMSNorm weights: two per layer and a final one; Gemma2 has four per layer; Qwen3 adds q_norm/k_norm."""
    per_layer = 4 if model.model_type == "gemma2" else 2
    params = (per_layer * model.num_layers + 1) * model.hidden_size
    detail = f"({per_layer} x {model.num_layers} + 1) x {model.hidden_size}"
    if model.model_type == "qwen3":
        params += 2 * model.num_layers * model.head_dim
        detail += f" + 2 x {model.num_layers} x {model.head_dim} (q_norm, k_norm)"
    return resident("norms", "norms (bf16)", params * BF16, f"{detail} x 2 B = {mib(params * BF16)}")


def _biases(model: ModelShape) -> list[MemoryItem]:
    """Qwen2 carries q/k/v biases (vLLM qwen2.py builds QKVParallelLinear with bias=True)."""
    if model.model_type != "qwen2":
        return []
    n = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    size = model.num_layers * n * BF16
    return [resident("biases", "q/k/v biases (bf16)", size, f"{model.num_layers} x {n} x 2 B = {mib(size)}")]


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
    return resident(
        "rope",
        "RoPE cos/sin table",
        rows * row_bytes,
        f"{rows} positions x {cols} (cos + sin halves) x 2 B bf16 = {mib(rows * row_bytes)}; capping "
        f"the table at max_model_len={max_model_len} would save {mib(avoidable)}. Built in fp32 at "
        f"model construction (~10 x {rows} x {cols} B of intermediates, before any weight loads)",
        avoidable_bytes=avoidable,
    )


# vLLM 0.28's OpenAI server on CPU batches up to 2048 tokens a step (max_num_batched_tokens; its warm-up's dummy
# forward runs at that size, kernels/vllm_plugin/warmup.py), so a prompt of the full context prefills in batches of it.
PREFILL_BATCH_TOKENS = 2048


def _prefill_activations(model: ModelShape, idle_trim: bool = False) -> MemoryItem:
    """What a full prefill batch's activations leave held: the allocator keeps the largest layer's working set
    (measured: the engine's RssAnon after serving a full context grew 21 MiB on the default model, 166 MiB on the ~1B,
    benchmarks/ledger_vs_rss.py breakdown, Zen 4, 2026-12-06). Counted from the widths, bf16: gate and up (2I), the
    activation (I), q, k and v, and four hidden-wide tensors (the residual, the norm, attention's output, down's).
    With idle_trim, held only while serving: an engine that trims its heap when it idles gave it back (the ~1B's
    engine settled at 603 MiB after 5 s idle, the ledger then booking these 108 MiB as resident put it 9.9 % over,
    benchmarks/ledger_vs_rss.py, Zen 5, 2026-12-07)."""
    tokens = PREFILL_BATCH_TOKENS
    heads = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    width = 3 * model.intermediate_size + 4 * model.hidden_size + heads
    size = tokens * width * BF16
    detail = (f"{tokens} tokens x (3 x {model.intermediate_size} + 4 x {model.hidden_size} + {heads}) x 2 B "
              f"= {mib(size)}")  # fmt: skip
    if idle_trim:
        return MemoryItem(kind="prefill-activations", name="activations of a full prefill batch, while serving",
                          bytes=size, phase="run-transient",
                          detail=f"{detail}; given back when the engine idles (its heap trim)")  # fmt: skip
    return resident("prefill-activations", "activations of a full prefill batch, held by the allocator", size, detail)


def _tokenizer(model: ModelShape, copies: int, bytes_per_token: int) -> MemoryItem:
    """The loaded tokenizer, once per process that loads it: a 262144-token vocabulary held 460 MiB more than the
    default model's 49152 in one process (facts any.tokenizer_bytes_per_vocab_token)."""
    size = copies * model.vocab_size * bytes_per_token
    return resident("tokenizer", "tokenizer (per process that loads it)", size,
                    f"{copies} x {model.vocab_size} tokens x {bytes_per_token} B (measured per vocabulary token) "
                    f"= {mib(size)}")  # fmt: skip


def _kv_cache(model: ModelShape, max_model_len: int, max_num_seqs: int) -> MemoryItem:
    tokens = rules.kv_tokens_per_layer(model, max_model_len, max_num_seqs)
    counts: dict[int, int] = {}
    for t in tokens:
        counts[t] = counts.get(t, 0) + 1
    layers = " + ".join(f"{n} layers x {t} tokens" for t, n in sorted(counts.items(), reverse=True))
    size = rules.kv_cache_bytes(model, max_model_len, max_num_seqs)
    return resident(
        "kv-cache",
        "KV cache",
        size,
        f"2 (K, V) x {model.num_kv_heads} kv heads x {model.head_dim} x 2 B x ({layers}) = {mib(size)}: "
        f"{max_num_seqs} streams share one context of {max_model_len} tokens, a block of "
        f"{rules.kv_block_tokens(model)} each to spare; a sliding layer holds each stream's min(window, "
        "max_model_len); given to vLLM as --kv-cache-memory-bytes",
    )
