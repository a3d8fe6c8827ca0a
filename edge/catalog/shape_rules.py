"""Quantization and sizing rules shared by the selector and the memory ledger. Pure functions of shapes."""

from __future__ import annotations

from edge.model.gguf_metadata import FOUR_BIT_GRIDS, SYMMETRIC_FOUR_BIT_GRIDS, WIDE_SOURCE_TYPES
from edge.model.shapes import LinearShape, ModelShape

# The group sizes a plan chooses from, largest first: a bigger group stores fewer scales. SmolLM2's K=576 is
# not a multiple of 128, so it takes 64 (docs/FACTS.md; the reference study ran tinygemm at g64, GPTQ at g128).
GROUP_SIZES = (128, 64, 32)
# What PyTorch 2.13's _weight_int4pack_mm_for_cpu accepts (TORCH_CHECK "expect qGroupSize to be 32, 64, 128 or
# 256"); the converter and the vLLM method check a checkpoint's group against it.
TINYGEMM_GROUP_SIZES = (32, 64, 128, 256)
# vLLM 0.28 CPU GPTQ (docs/FACTS.md "GPTQ on CPU: ... group size in {-1, 32, 64, 128}"); -1 = one group per row.
GPTQ_GROUP_SIZES = (-1, 32, 64, 128)
# Measured here (PyTorch 2.13 CPU): _convert_weight_to_int4pack_for_cpu(int32 [N, K], 1) raises
# "expect N to be dividable by 16" for N = 8, 24, 40 and packs N = 16, 48.
PACK_N_MULTIPLE = 16
# docs/FACTS.md "GPTQ on CPU: ... partition sizes multiples of 32" (CPUWNA16LinearKernel.can_implement).
GPTQ_PARTITION_MULTIPLE = 32
# KleidiAI's groupwise int4 kernels (torch's _dyn_quant_matmul_4bit on aarch64) on every Arm core: group 32 (emulated
# Cortex-A76 and a 256-bit SVE core; channelwise needs BF16, docs/FACTS.md). The gate, the plan and the kernel ask it.
KLEIDIAI_GROUP = 32
SLIDING = "sliding_attention"
# vLLM 0.28's CPU KV block (platforms/cpu.py:149: block_size 128 when none is asked for).
CPU_KV_BLOCK_TOKENS = 128
# vLLM 0.28's CPU attention fails the first request of a model whose every layer attends through a sliding window
# (Mistral v0.1, Phi-3 mini 4k: a model-level sliding_window; a Gemma 3 with fewer layers than its pattern) at a
# KV block of 32 or more: "cpu_attn.cpp:244 Check failed: input.block_size % attn_impl::BlockSizeAlignment == 0
# (16 vs. 0)"; at 16 it serves (seen 2026-12-01 on the Zen 5 host, docs/FACTS.md). A model with at least one full
# attention layer (Gemma 2, a real Gemma 3) serves at the default block size.
ALL_SLIDING_BLOCK_TOKENS = 16


def pick_group_size(model: ModelShape) -> int | None:
    """The source's own 4-bit grid when it has one that fits (re-rounding it onto another grid throws away what
    the source had: a Q4_1 source re-quantized at group 64 kept 62 % of its top-1 tokens, docs/FACTS.md);
    else the largest group size that divides the K of every quantizable linear (the head included), or None."""
    candidates = ((model.source_grid,) if model.source_grid in GROUP_SIZES else ()) + GROUP_SIZES
    return next((g for g in candidates if all(lin.k % g == 0 for lin in model.linears)), None)


def copied_grid(model: ModelShape, types: tuple[str, ...]) -> int | None:
    """The source's 4-bit grid (its group) where a method that copies the codes of `types` finds it: most of the
    decoder linears a plan keeps at 4 bits (all but WIDE_SOURCE_TYPES) hold one of them. A source whose types per
    kind are unknown (the default model's edge-source.json: a 4-bit grid) counts for a method that copies every
    4-bit grid only. None: nothing to copy."""
    if model.source_grid is None or not types:
        return None
    if model.source_types is None:
        return model.source_grid if set(FOUR_BIT_GRIDS) <= set(types) else None
    narrow = [(t, n) for kind, held in model.source_types.items() if kind not in ("embed_tokens", "lm_head")
              for t, n in held.items() if t not in WIDE_SOURCE_TYPES]  # fmt: skip
    copied = sum(n for t, n in narrow if t in types)
    return model.source_grid if copied and 2 * copied >= sum(n for _, n in narrow) else None


def packable(lin: LinearShape, group: int) -> bool:
    """Can tinygemm pack this layer at this group size? Layers that cannot stay bf16."""
    return lin.n % PACK_N_MULTIPLE == 0 and lin.k % group == 0


def tiles_block(lin: LinearShape, block: int) -> bool:
    """Does N split into whole n-blocks of the host's tinygemm layout ([N/B][K][B/2 bytes], docs/FACTS.md)?

    The direct layout dequantizes prefill weights straight from the tinygemm buffer block by block; a layer
    whose N does not tile keeps a row-major copy, i.e. it runs dual. B comes from edge.measure.kernel_params.
    """
    return lin.n % block == 0


def pick_gptq_group_size(model: ModelShape) -> int | None:
    """The source's own symmetric 4-bit grid when it has one that fits (a Q4_0 file: w = d * (q - 8) is GPTQ's
    uint4b8 with scale d, so its codes carry over unchanged); else the largest planned group size at which every
    linear (the head included) is GPTQ-compatible."""
    grid = copied_grid(model, SYMMETRIC_FOUR_BIT_GRIDS)
    candidates = ((grid,) if grid in GPTQ_GROUP_SIZES else ()) + GROUP_SIZES
    return next((g for g in candidates if all(gptq_compatible(lin, g) for lin in model.linears)), None)


def gptq_compatible(lin: LinearShape, group: int) -> bool:
    """vLLM 0.28 CPU GPTQ: 4-bit symmetric, group in {-1, 32, 64, 128}, N and K multiples of 32."""
    if group not in GPTQ_GROUP_SIZES:
        return False
    whole_groups = group == -1 or lin.k % group == 0
    return lin.n % GPTQ_PARTITION_MULTIPLE == 0 and lin.k % GPTQ_PARTITION_MULTIPLE == 0 and whole_groups


def kv_block_tokens(model: ModelShape) -> int:
    """The tokens of one KV block the engine runs at: vLLM 0.28's CPU default, or the block a model whose every layer
    attends through a sliding window must be started with."""
    types = model.layer_types
    return ALL_SLIDING_BLOCK_TOKENS if types and all(t == SLIDING for t in types) else CPU_KV_BLOCK_TOKENS


def kv_tokens_per_layer(model: ModelShape, max_model_len: int, max_num_seqs: int = 1) -> list[int]:
    """Tokens of K and V each layer holds for max_num_seqs streams sharing one context of max_model_len.

    A full-attention layer holds max_model_len tokens for all the streams together, plus one block per stream (a
    stream's last block is partly empty): what llama.cpp's server holds for `-c max_model_len` shared by its slots,
    except that one stream may take the whole context, so a prompt of the full context still prefills. Streams that
    together outgrow it are not lost: vLLM's scheduler preempts the newest and recomputes it when blocks free up.
    Filling max_num_seqs x max_model_len instead held 180 MiB for the default model, 19 % of the engine's RssAnon
    on the Zen 4 (benchmarks/engine_memory.py, 2026-12-06).

    A sliding-window layer holds each stream's window, min(window, max_model_len), plus a block: vLLM 0.28's CPU
    platform supports the hybrid KV cache manager (platforms/cpu.py:450 support_hybrid_kv_cache -> True), which
    frees a sliding layer's blocks behind the window (v1/kv_cache_interface.py:546-572). The groups of a hybrid
    model share one pool of blocks, each block a page in one layer of every group (v1/core/kv_cache_utils.py
    get_kv_cache_config_from_groups), so the layers' tokens sum.
    """
    types = model.layer_types or ["full_attention"] * model.num_layers
    assert len(types) == model.num_layers, (len(types), model.num_layers)
    window, slack = model.sliding_window, max_num_seqs * kv_block_tokens(model)
    shared = max_model_len + slack
    per_stream = max_num_seqs * min(window, max_model_len) + slack if window else shared
    return [per_stream if t == SLIDING and window else shared for t in types]


def kv_cache_bytes(model: ModelShape, max_model_len: int, max_num_seqs: int, dtype_bytes: int = 2) -> int:
    """The KV pool for max_num_seqs streams sharing one context of max_model_len (kv_tokens_per_layer).

    2 (K and V) x kv_heads x head_dim x tokens x bytes, summed over layers. vLLM's CPU worker allocates exactly the
    KV space it is given (--kv-cache-memory-bytes), so the plan passes this number to it and the ledger counts it.
    """
    per_token = 2 * model.num_kv_heads * model.head_dim * dtype_bytes
    return per_token * sum(kv_tokens_per_layer(model, max_model_len, max_num_seqs))
